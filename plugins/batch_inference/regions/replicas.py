"""Replicas of the snapshot near each cluster, and placement of a job version over regions.

A shard's replica is one Parquet object of its records (record_id, text), in
record id byte order, written once to its home region's store under a key
that is the sha256 of its bytes; the digest is recorded in the ledger
(bi.replicas). A worker reads its shard from the replica and checks the
digest (``read_replica``); one that is missing or does not match is rebuilt
from the ledger's rows of the shard, never read.

``plan.submit`` with a deployment asks every store and Kubernetes connection
first (``check_reachable``: a refusal writes nothing, not even the job
version), then makes the job version (regions are not part of it, I2) and
``place`` replicates it. ``place`` gives each region a range of shards in
proportion to its clusters' capacity, writes their replicas, and records
clusters, egress prices, replicas and what replication cost (bytes, seconds,
and dollars: the bytes at the egress price from the ledger's region) in one
transaction.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from batch_inference.db import q
from batch_inference.exceptions import UnknownJob
from batch_inference.regions.deployment import Deployment, DeploymentError, check_connections
from batch_inference.regions.store import ObjectStore, StoreUnavailable, key_for, store_for

log = logging.getLogger(__name__)


def pyarrow_modules() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DeploymentError("replicas are Parquet: install pyarrow (pip install "
                              "'airflow-provider-batch-inference[lakehouse]')") from None
    return pa, pq


def encode(ids: Sequence[str], texts: Sequence[str]) -> bytes:
    """Records as the replica's Parquet bytes: the same records give the same bytes (one row group,
    no statistics, no dictionary, zstd), so a replica rebuilt from the ledger has the recorded digest."""
    pa, pq = pyarrow_modules()
    table = pa.table({"record_id": pa.array(list(ids), pa.string()), "text": pa.array(list(texts), pa.string())})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", use_dictionary=False, write_statistics=False,
                   row_group_size=max(1, len(ids)))
    return buf.getvalue()


def decode(data: bytes, columns: Sequence[str] = ("record_id", "text")) -> list[list[Any]]:
    """A Parquet object's columns as lists."""
    _, pq = pyarrow_modules()
    table = pq.read_table(io.BytesIO(data), columns=list(columns))
    return [table.column(c).to_pylist() for c in columns]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Replica:
    """What a worker is told of the shard it claimed: its home region and its replica there."""

    region: str
    key: str
    digest: str
    bytes: int


def read_replica(store: Any, replica: Replica) -> tuple[list[str], list[str]] | str:
    """The replica's (ids, texts), or why it cannot be trusted (missing, not matching its digest)."""
    data = store.get(replica.key)
    if data is None:
        return f"replica {replica.key} is missing from {store.where}"
    got = digest(data)
    if got != replica.digest:
        return f"replica {replica.key} in {store.where} does not match its digest (sha256 {got[:12]}, recorded " \
               f"{replica.digest[:12]})"
    ids, texts = decode(data)
    return ids, texts


def assign(deployment: Deployment, shard_nos: Sequence[int], weights: dict[str, float] | None = None
           ) -> dict[int, str]:
    """Each shard's home region: contiguous ranges in region order, in proportion to ``weights`` (a plan's
    records per region: shards go where its workers are), else to the regions' capacity."""
    regions = [r for r in deployment.regions() if weights is None or weights.get(r, 0) > 0]
    caps = [weights[r] if weights is not None else deployment.capacity(r) for r in regions]
    total, n = sum(caps), len(shard_nos)
    out: dict[int, str] = {}
    start, acc = 0, 0
    for region, cap in zip(regions, caps):
        acc += cap
        end = round(n * acc / total)
        for s in shard_nos[start:end]:
            out[s] = region
        start = end
    return out


def check_reachable(deployment: Deployment) -> dict[str, ObjectStore]:
    """Every Kubernetes connection exists and every region's store answers (DeploymentError, one line,
    otherwise); the stores by region."""
    check_connections(deployment)
    stores = {r: store_for(deployment.store(r)) for r in deployment.regions()}
    for region, store in stores.items():
        try:
            store.check()
        except StoreUnavailable as exc:
            raise DeploymentError(f"region {region!r}: {exc}") from None
    return stores


def place(conn: psycopg.Connection, job_version: str, deployment: Deployment,
          weights: dict[str, float] | None = None, *, stores: dict[str, ObjectStore] | None = None
          ) -> dict[str, Any]:
    """Place the job version on the deployment's clusters and write each region's replicas (module
    docstring; ``weights``: each region's share, as a plan's records per region). Returns per region: shards,
    bytes, seconds, usd. A version placed before on the same clusters, or with nothing left to run, is
    left as it is; on other clusters it is refused. Nothing is written to the ledger when a store or
    connection cannot be reached (DeploymentError, one line; ``stores``: already checked by
    ``check_reachable``)."""
    placed = conn.execute(q("regions_placed"), {"job": job_version}).fetchall()
    shards = conn.execute(q("region_shards"), {"job": job_version}).fetchall()
    if not shards:
        raise UnknownJob(f"no job version {job_version!r}")
    if placed:
        names = sorted(r["cluster"] for r in placed)
        if names == sorted(c.name for c in deployment.clusters):
            log.info("job version %s is placed on these clusters already; nothing written", job_version)
            return {"placed": False, "regions": {}}
        raise DeploymentError(f"job version {job_version} is placed on clusters {', '.join(names)} already")
    if shards[0]["status"] != "running":
        log.info("job version %s is %s: nothing left to place", job_version, shards[0]["status"])
        return {"placed": False, "regions": {}}
    stores = check_reachable(deployment) if stores is None else stores
    numbers = [r["shard_no"] for r in shards if r["shard_no"] is not None]
    if weights is not None and not any(weights.get(r, 0) > 0 for r in deployment.regions()):
        raise DeploymentError("the placement's weights give no region of the deployment any shard")
    homes = assign(deployment, numbers, weights)
    rows: list[dict[str, Any]] = []
    cost: dict[str, dict[str, float]] = {r: {"shards": 0, "bytes": 0, "seconds": 0.0, "usd": 0.0}
                                         for r in set(homes.values())}
    for shard_no in numbers:
        region = homes[shard_no]
        t0 = time.perf_counter()
        with conn.cursor(row_factory=tuple_row) as cur:
            got = cur.execute(q("replica_shard_rows"), {"job": job_version, "shard": shard_no}).fetchall()
        ids, texts = (list(c) for c in zip(*got)) if got else ([], [])
        data = encode(ids, texts)
        d = digest(data)
        settings = deployment.store(region)
        key = key_for(settings, job_version, "replicas", d)
        try:
            stores[region].put(key, data)
        except StoreUnavailable as exc:
            raise DeploymentError(f"region {region!r}: {exc}") from None
        seconds = time.perf_counter() - t0
        rows.append({"job": job_version, "shard": shard_no, "region": region, "key": key, "digest": d,
                     "bytes": len(data), "records": len(ids), "seconds": seconds})
        c = cost[region]
        c["shards"] += 1
        c["bytes"] += len(data)
        c["seconds"] += seconds
    ledger = deployment.ledger()
    for region, c in cost.items():   # written from the ledger's region: egress to every other
        c["usd"] = c["bytes"] / 1e9 * (deployment.egress_price(ledger, region) or 0.0) if region != ledger else 0.0
    with conn.transaction():
        for c in deployment.clusters:
            conn.execute(q("region_cluster_insert"), {"job": job_version, "cluster": c.name, "region": c.region,
                                                      "settings": json.dumps(c.model_dump(mode="json"))})
        for a in deployment.regions():
            for b in deployment.regions():
                if a != b:
                    conn.execute(q("region_egress_insert"), {"job": job_version, "from_region": a, "to_region": b,
                                                             "usd_per_gb": deployment.egress_price(a, b)})
        with conn.cursor() as cur:
            cur.executemany(q("replica_insert"), rows)
        for region, c in cost.items():
            conn.execute(q("region_replication_record"), {
                "job": job_version, "region": region, "ledger_region": ledger, "bytes": int(c["bytes"]),
                "seconds": c["seconds"], "usd": c["usd"],
                "reason": f"{int(c['shards'])} shard replicas written to {stores[region].where} from {ledger}"})
    for region, c in cost.items():
        log.info("%s: region %s: %d shard replicas, %d bytes in %.2fs", job_version, region, c["shards"],
                 c["bytes"], c["seconds"])
    return {"placed": True, "regions": cost}


def local_slots(conn: psycopg.Connection, job_version: str, workers: int) -> list[dict[str, Any]]:
    """The worker processes to start for a placed version's clusters whose workers are local: per cluster,
    its region, ``workers`` (at most its capacity) and ``result_files`` (a region other than the ledger's
    hands its results in as files). A version never placed: one slot of plain workers (region None)."""
    clusters = conn.execute(q("regions_placed_settings"), {"job": job_version}).fetchall()
    if not clusters:
        return [{"cluster": None, "region": None, "workers": workers, "result_files": False}]
    ledger = conn.execute(q("region_bill"), {"job": job_version}).fetchone()["ledger_region"]
    out = []
    for c in clusters:
        settings = c["settings"]
        if settings["workers"]["kind"] != "local":
            log.info("%s: cluster %s runs Kubernetes pods (%s), not local workers", job_version, c["cluster"],
                     settings["workers"].get("conn_id"))
            continue
        out.append({"cluster": c["cluster"], "region": c["region"], "workers": min(workers, settings["capacity"]),
                    "result_files": ledger is not None and c["region"] != ledger})
    return out


def report(conn: psycopg.Connection, job_version: str) -> list[dict[str, Any]]:
    """Per region: shards homed, replica bytes and seconds, claims, steals in with their egress, rebuilds."""
    return [dict(r) for r in conn.execute(q("region_report"), {"job": job_version})]
