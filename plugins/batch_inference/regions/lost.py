"""A region lost mid-night: found by asking each region's store, and its leases ended at once.

``check`` asks every region of a placed version whether its store answers (the clusters' Kubernetes
APIs are asked by the launchers, which call ``end_region`` the same way). A region that does not
answer has its leases ended at once with ``end``: every shard its workers hold is pending again now,
not when its lease runs out, so the other regions take it (a steal each, its replica rebuilt from
the ledger where the home store is the one lost, bi.claim_shard_region_v2), and a result file it
handed in and that was not merged is refused unread. A lost region is no record's fault: no attempt,
crash or lost lease is counted (bi.end_region_leases_v1). Where the rest of the night goes, and
whether the deadline still holds, is ``planner.replan``'s arithmetic.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from batch_inference.db import q
from batch_inference.regions.store import StoreUnavailable, store_for

log = logging.getLogger(__name__)


def end_region(conn: psycopg.Connection, job_version: str, region: str, reason: str) -> int:
    """End every lease the region's workers hold, recorded with ``reason``; how many ended."""
    ended = conn.execute(q("end_region_leases"), {"job": job_version, "region": region, "reason": reason}
                         ).fetchone()["ended"]
    log.warning("%s: region %s lost (%s): %d lease(s) ended; its shards go to the other regions", job_version,
                region, reason, ended)
    return ended


def check(conn: psycopg.Connection, job_version: str, *, end: bool = False) -> list[dict[str, Any]]:
    """Each region's store asked once: region, reachable, the problem, and (with ``end``) the leases
    ended for a region that did not answer."""
    out = []
    for r in conn.execute(q("region_stores"), {"job": job_version}).fetchall():
        problem = None
        try:
            store_for(r["store"]).check()
        except StoreUnavailable as exc:
            problem = str(exc)
        row: dict[str, Any] = {"region": r["region"], "reachable": problem is None, "problem": problem}
        if problem is not None and end:
            row["ended"] = end_region(conn, job_version, r["region"], problem)
        out.append(row)
    return out
