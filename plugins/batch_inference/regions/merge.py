"""Results merged by key: the far workers' result files, merged near the ledger.

A far worker writes a shard's results as one Parquet file of keyed rows
(record_id, output as JSON text, category) in its region's store and hands it
in with one small call (``RegionLedger.complete``). ``merge_pending`` (the
owner's side, near the ledger: ``batch-inference regions merge``) reads each
handed-in file, checks its digest, and merges it with bi.merge_result_file_v1:
the rows go through bi.put_results_v3 under the file's epoch, the one
put-if-absent per (job version, record id) and the one fence, then the shard
is completed. So a file merged twice, a late worker's file and a stale epoch's
file change nothing (I1). A file whose epoch has ended is refused without being
read (its region's store may be gone with the region). A file missing or not
matching its digest is marked unreadable and merges nothing: the shard's lease
runs out and it is done again. ``merge_until_settled`` runs the merge beside
the workers until the version has nothing outstanding (the CLI's ``regions
merge`` and the DAG's ``merge`` task, ``RegionMergeOperator``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import psycopg

from batch_inference.db import q
from batch_inference.regions.replicas import pyarrow_modules, decode, digest
from batch_inference.regions.store import StoreUnavailable, store_for

log = logging.getLogger(__name__)


def output_text(output: dict[str, Any] | str) -> str:
    """An output as the JSON text a result row stores (``Ledger.put_results`` takes both forms)."""
    return output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)


def encode_results(ids: Sequence[str], outputs: Sequence[str], categories: Sequence[str | None]) -> bytes:
    """A shard's results as a Parquet file of keyed rows."""
    import io

    pa, pq = pyarrow_modules()
    table = pa.table({"record_id": pa.array(list(ids), pa.string()), "output": pa.array(list(outputs), pa.string()),
                      "category": pa.array(list(categories), pa.string())})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=max(1, len(ids)))
    return buf.getvalue()


def decode_results(data: bytes) -> tuple[list[str], list[str], list[str | None]]:
    ids, outputs, categories = decode(data, ("record_id", "output", "category"))
    return ids, outputs, categories


def merge_file(conn: psycopg.Connection, file_id: int, data: bytes) -> dict[str, Any]:
    """Merge one handed-in file's bytes (already checked against its digest): outcome, n new rows, done."""
    ids, outputs, categories = decode_results(data)
    with conn.transaction():
        return dict(conn.execute(q("merge_result_file"), {"file": file_id, "ids": ids, "outputs": outputs,
                                                          "categories": categories}).fetchone())


def merge_pending(conn: psycopg.Connection, job_version: str, limit: int = 100) -> Counter[str]:
    """Merge the version's handed-in files not yet merged, oldest first. Returns how many ended each way
    (merged, already, stale, unreadable, and unreachable: a store that did not answer, tried again later)
    and ``rows``, the new result rows."""
    out: Counter[str] = Counter()
    for f in conn.execute(q("result_files_unmerged"), {"job": job_version, "limit": limit}).fetchall():
        if not f["current"]:      # its epoch ended (a lost region's file, a late one): refused unread
            with conn.transaction():
                r = conn.execute(q("merge_result_file"), {"file": f["id"], "ids": [], "outputs": [],
                                                          "categories": []}).fetchone()
            out[r["outcome"]] += 1
            continue
        try:
            data = store_for(f["store"]).get(f["object_key"])
        except StoreUnavailable as exc:
            log.warning("%s: result file of shard %d: %s; trying again later", job_version, f["shard_no"], exc)
            out["unreachable"] += 1
            continue
        problem = None
        if data is None:
            problem = f"result file {f['object_key']} is missing from region {f['region']}'s store"
        elif digest(data) != f["digest"]:
            problem = f"result file {f['object_key']} does not match its digest (sha256 {digest(data)[:12]})"
        if problem is not None:
            conn.execute(q("result_file_unreadable"), {"file": f["id"], "detail": problem})
            log.warning("%s: shard %d epoch %d: %s; nothing merged (the shard is done again)", job_version,
                        f["shard_no"], f["epoch"], problem)
            out["unreadable"] += 1
            continue
        r = merge_file(conn, f["id"], data)
        out[r["outcome"]] += 1
        if r["n"]:
            out["rows"] += r["n"]
        if r["outcome"] == "stale":
            log.warning("%s: result file of shard %d epoch %d refused: the epoch ended before the merge",
                        job_version, f["shard_no"], f["epoch"])
    return out


def merge_until_settled(conn: psycopg.Connection, job_version: str, *, poll_s: float = 1.0,
                        idle_s: float | None = None, stop: threading.Event | None = None) -> Counter[str]:
    """Merge handed-in files until the version has nothing outstanding (every record stored or dead-lettered)
    or is no longer running; with ``idle_s``, also once no shard has been leased and no file handed in for
    that long (its workers are gone: what is left is the fallback's or a next run's); with ``stop``, when it
    is set (then once more). The totals. What ``batch-inference regions merge`` and the DAG's merge task run."""
    from batch_inference.status import job_counts

    total: Counter[str] = Counter()
    idle_since: float | None = None
    while True:
        got = merge_pending(conn, job_version)
        total.update(got)
        c = job_counts(conn, job_version)
        if c["outstanding"] == 0 or c["status"] != "running":
            return total
        if got or c["shards"]["leased"]:
            idle_since = None
        elif idle_s is not None:
            idle_since = time.monotonic() if idle_since is None else idle_since
            if time.monotonic() - idle_since >= idle_s:
                log.warning("%s: no shard leased and no file handed in for %.0f s: %d record(s) outstanding are "
                            "left to the fallback or a next run", job_version, idle_s, c["outstanding"])
                return total
        if got:
            continue
        if stop is None:
            time.sleep(poll_s)
        elif stop.wait(poll_s):
            total.update(merge_pending(conn, job_version))
            return total


def merge_until(conn: psycopg.Connection, job_version: str, stop: threading.Event, poll_s: float = 0.5
                ) -> Counter[str]:
    """Merge handed-in files until ``stop`` is set, then once more; the totals."""
    total: Counter[str] = Counter()
    while True:
        stopping = stop.is_set()
        got = merge_pending(conn, job_version)
        total.update(got)
        if stopping:
            return total
        if not got:
            stop.wait(poll_s)
