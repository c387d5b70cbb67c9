"""The ledger as a worker in one region sees it (``RegionLedger``): what the worker is given in place
of ``batch_inference.ledger.Ledger`` when it runs with ``--region``.

* **claim**: a shard whose replica is in this region first
  (bi.claim_shard_region_v2, one call); only when none is left, and when
  ``steal`` is on, one of a region that is behind, recorded as a steal priced
  as egress. The
  guard, the epoch, the lease and the deaths of an expired epoch are the
  claim statement's, as for every claim.
* **records**: read from the shard's replica in its home region's store, the
  digest checked; a replica missing, unreachable or not matching is rebuilt from
  the ledger's rows of the shard (bi.replica_rows_v1), written back when the
  rebuilt bytes have the recorded digest, and recorded (bi.replica_rebuilt_v1),
  never read. Only which records are done and their attempt counts come from
  the ledger (bi.region_shard_state_v1), and only for a shard the claim did
  not find untouched.
* **results** (``result_files``: a worker far from the ledger): held per shard
  and written at completion as one Parquet file of keyed rows in this region's
  store, handed in with one small call (bi.hand_in_results_v1) and merged near
  the ledger (``regions.merge``) with the one put-if-absent and fence. What a
  shard has held for ``hold_seconds`` is written straight to the ledger (a death
  loses at most that much work); a shard given back (release, abandon) writes
  what it holds straight to the ledger first. Without ``result_files`` results go straight to the ledger as today.

* **renew**: a far worker's renewal reports how many results it holds for the
  shard (bi.renew_lease_held_v1): done, not yet in the ledger, counted done by
  the cutoff and the regions' autopilot (bi.region_held_v1).

Every other transition (fail, mark in flight) is the plain ledger's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from batch_inference.db import q
from batch_inference.ledger import SHARD_READ_PAGE, FailedAttempt, Failure, Lease, Ledger, StaleLease
from batch_inference.regions import merge
from batch_inference.regions.replicas import Replica, digest, encode, read_replica
from batch_inference.regions.store import ObjectStore, StoreUnavailable, key_for, store_for

log = logging.getLogger("batch_inference.worker")

# A far worker writes what it holds for a shard straight to the ledger once the oldest of it is this old
# (one round trip per HOLD_SECONDS of work), so a worker that dies mid-shard loses at most that much work,
# not a whole shard's (7-16 s at a slowed night's pace). A shard of less work goes in one file, as before.
HOLD_SECONDS = 6.0


class RegionLedger(Ledger):
    def __init__(self, conn: psycopg.Connection, job_version: str, owner: str, transport: str = "batch",
                 lease_seconds: int | None = None, engine: str | None = None, endpoint: str | None = None, *,
                 region: str, result_files: bool = False, steal: bool = True, hold_seconds: float = HOLD_SECONDS):
        super().__init__(conn, job_version, owner, transport, lease_seconds, engine, endpoint)
        self.region = region
        self.result_files = result_files
        self.steal = steal
        self.hold_seconds = hold_seconds
        # Shared with every copy bound to another connection (``with_conn``): one worker's state.
        self._replicas: dict[tuple[int, int], Replica] = {}
        self._results: dict[tuple[int, int], tuple[list[str], list[str], list[str | None]]] = {}
        self._stores: dict[str, tuple[dict[str, Any], ObjectStore]] = {}
        self._untouched: set[tuple[int, int]] = set()   # claimed with every record to do: no state to read
        # Per shard and epoch: the records it had to do when read, and those dead-lettered since.
        self._todo: dict[tuple[int, int], set[str]] = {}
        self._dead: dict[tuple[int, int], set[str]] = {}
        # Per shard and epoch: when the oldest result it holds was made, and those written straight already.
        self._held_since: dict[tuple[int, int], float] = {}
        self._written: dict[tuple[int, int], set[str]] = {}
        self.stats = {"claims": 0, "steals": 0, "rebuilds": 0, "files": 0, "replica_bytes": 0}

    @classmethod
    def wrap(cls, ledger: Ledger, region: str, *, result_files: bool = False, steal: bool = True) -> "RegionLedger":
        """The region's view of an existing worker ledger (same connection, owner, transport, lease, provenance)."""
        out = cls(ledger.conn, ledger.job_version, ledger.owner, ledger.transport, ledger.lease_seconds,
                  ledger.engine, ledger.endpoint, region=region, result_files=result_files, steal=steal)
        out.call = ledger.call
        out.store(region)        # the version has a cluster in the region (StoreUnavailable otherwise)
        return out

    # -- stores -----------------------------------------------------------
    def store(self, region: str) -> tuple[dict[str, Any], ObjectStore]:
        """A region's store settings (from the ledger: no secret there) and the store."""
        if region not in self._stores:
            settings = self.conn.execute(q("region_store"), {"job": self.job_version, "region": region}
                                         ).fetchone()["store"]
            if settings is None:
                raise StoreUnavailable(f"job version {self.job_version} has no cluster in region {region!r} (regions "
                                       "place puts it on a deployment's clusters)")
            self._stores[region] = (settings, store_for(settings))
        return self._stores[region]

    # -- claim ------------------------------------------------------------
    def claim(self) -> Lease | None:
        r = self.conn.execute(q("claim_shard_region"), {
            "job": self.job_version, "owner": self.owner, "transport": self.transport,
            "lease_s": self.lease_seconds, "region": self.region, "steal": self.steal}).fetchone()
        if r is None:
            return None
        lease = Lease(self.job_version, r["shard_no"], r["epoch"], r["lease_expires_at"], r["records"], self.owner,
                      self.transport, r["lost_leases"])
        self._replicas[(lease.shard_no, lease.epoch)] = Replica(r["home_region"], r["object_key"], r["digest"],
                                                               r["replica_bytes"])
        if r["untouched"]:
            self._untouched.add((lease.shard_no, lease.epoch))
        self.stats["claims"] += 1
        if r["home_region"] != self.region:
            self.stats["steals"] += 1
            log.info("%s: region %s took shard %d of region %s (it had none left; %d bytes read across)",
                     self.owner, self.region, lease.shard_no, r["home_region"], r["replica_bytes"])
        return lease

    # -- records ------------------------------------------------------------
    def record_columns(self, lease: Lease, page: int = SHARD_READ_PAGE
                       ) -> tuple[list[str], list[str], list[int], list[int]]:
        out = self._record_columns(lease, page)
        self._todo[(lease.shard_no, lease.epoch)] = set(out[0])
        return out

    def _record_columns(self, lease: Lease, page: int) -> tuple[list[str], list[str], list[int], list[int]]:
        replica = self._replicas.get((lease.shard_no, lease.epoch))
        if replica is None:       # not claimed through this ledger: the ledger's rows, as a plain worker reads
            return super().record_columns(lease, page)
        t0 = time.perf_counter()
        try:
            settings, store = self.store(replica.region)
            got: tuple[list[str], list[str]] | str = read_replica(store, replica)
        except StoreUnavailable as exc:
            store, got = None, str(exc)
        if isinstance(got, str):
            ids, texts = self._rebuild(lease, replica, store, got, t0)
        else:
            ids, texts = got
            self.stats["replica_bytes"] += replica.bytes
        if (lease.shard_no, lease.epoch) in self._untouched:
            return ids, texts, [0] * len(ids), [0] * len(ids)
        state = {r["record_id"]: r for r in self.conn.execute(
            q("region_shard_state"), {"job": lease.job_version, "shard": lease.shard_no, "epoch": lease.epoch})}
        out: tuple[list[str], list[str], list[int], list[int]] = ([], [], [], [])
        for rid, text in zip(ids, texts):
            s = state.get(rid)
            if s is not None and s["done"]:
                continue
            out[0].append(rid)
            out[1].append(text)
            out[2].append(s["attempts"] if s else 0)
            out[3].append(s["crashes"] if s else 0)
        return out

    def _rebuild(self, lease: Lease, replica: Replica, store: ObjectStore | None, why: str,
                 t0: float) -> tuple[list[str], list[str]]:
        """The shard's records from the ledger; the replica written again when the bytes match its digest."""
        rows = self.conn.execute(q("replica_rows"), {"job": lease.job_version, "shard": lease.shard_no,
                                                     "epoch": lease.epoch}).fetchall()
        ids, texts = [r["record_id"] for r in rows], [r["text"] for r in rows]
        data = encode(ids, texts)
        written = "not written back"
        if digest(data) != replica.digest:
            written = "not written back: the rebuilt bytes differ from the recorded digest (another Parquet writer)"
        elif store is not None:
            try:
                store.put(replica.key, data)
                written = f"written back to {store.where}"
            except StoreUnavailable as exc:
                written = f"not written back: {exc}"
        reason = f"{why}; rebuilt from the ledger's {len(ids)} rows, {written}"
        log.warning("%s: shard %d: %s", self.owner, lease.shard_no, reason)
        self.transition("replica rebuild", "replica_rebuilt", lease, region=self.region, reason=reason,
                        bytes=len(data), seconds=time.perf_counter() - t0)
        self.stats["rebuilds"] += 1
        return ids, texts

    # -- results ------------------------------------------------------------
    def put_results(self, lease: Lease, ids: Sequence[str], outputs: Sequence[dict[str, Any] | str],
                    categories: Sequence[str | None], vectors: Sequence[bytes] | None = None) -> int:
        if not self.result_files or vectors is not None or not ids:
            return super().put_results(lease, ids, outputs, categories, vectors)
        key = (lease.shard_no, lease.epoch)
        held = self._results.setdefault(key, ([], [], []))
        now = time.monotonic()
        if not held[0]:
            self._held_since[key] = now
        held[0].extend(ids)
        held[1].extend(merge.output_text(o) for o in outputs)
        held[2].extend(categories)
        if now - self._held_since.get(key, now) >= self.hold_seconds:
            # Held long enough: straight to the ledger, the rest of the shard in its file.
            out = self._results.pop(key)
            super().put_results(lease, *out)
            self._written.setdefault(key, set()).update(out[0])
        return len(ids)

    def renew(self, lease: Lease) -> str:
        """Extend the lease; a far worker reports with it how many results it holds for the shard
        (bi.renew_lease_held_v1), so the cutoff and the regions' autopilot count them done before the
        shard's file is merged."""
        held = self._results.get((lease.shard_no, lease.epoch))
        if not self.result_files or not held or not held[0]:
            return super().renew(lease)
        return self.transition("renew", "renew_lease_held", lease, lease_s=self.lease_seconds,
                               held=len(held[0]))["mode"]

    def fail(self, lease: Lease, failures: Sequence[Failure]) -> list[FailedAttempt]:
        counted = super().fail(lease, failures)
        self._dead.setdefault((lease.shard_no, lease.epoch), set()).update(f.record_id for f in counted if f.dead)
        return counted

    def complete(self, lease: Lease) -> str:
        """Hand the shard's held results in as one file when they, its dead letters and what it wrote straight
        cover every record it had to do; kept until the hand-in answers, so a call the worker retries after a lost reply writes the
        same object and hands the same epoch's file in again (one file per epoch: nothing changes). A shard
        that stopped short (a preemption notice, a drain) writes what it holds straight to the ledger, and
        the ledger's completion says it is incomplete: the worker releases it at once."""
        key = (lease.shard_no, lease.epoch)
        held = self._results.get(key)
        if not held or not held[0]:
            self._held_since.pop(key, None)
            self._written.pop(key, None)
            return super().complete(lease)
        todo = self._todo.get(key)
        covered = set(held[0]) | self._dead.get(key, set()) | self._written.get(key, set())
        if todo is not None and not todo <= covered:
            if not self._put_held(lease):
                raise StaleLease(f"results refused: shard {lease.shard_no} epoch {lease.epoch} is stale")
            return super().complete(lease)
        settings, store = self.store(self.region)
        data = merge.encode_results(*held)
        d = digest(data)
        obj_key = key_for(settings, lease.job_version, "results", d)
        store.put(obj_key, data)
        try:
            self.transition("hand-in", "hand_in_results", lease, region=self.region, key=obj_key, digest=d,
                            records=len(held[0]), bytes=len(data), engine=self.engine, endpoint=self.endpoint)
        except StaleLease:
            self._results.pop(key, None)
            raise
        for kept in (self._results, self._todo, self._dead, self._held_since, self._written):
            kept.pop(key, None)
        self.stats["files"] += 1
        log.info("%s: shard %d: %d results handed in as %s in %s", self.owner, lease.shard_no, len(held[0]),
                 obj_key, store.where)
        return "done"

    def _put_held(self, lease: Lease) -> bool:
        """A shard given back: what it holds goes straight to the ledger. False when our epoch ended."""
        held = self._results.pop((lease.shard_no, lease.epoch), None)
        if held and held[0]:
            try:
                super().put_results(lease, *held)
            except StaleLease:
                return False
        return True

    def release(self, lease: Lease) -> bool:
        return self._put_held(lease) and super().release(lease)

    def abandon(self, lease: Lease) -> bool:
        return self._put_held(lease) and super().abandon(lease)

