"""A region lost mid-night: found (by asking each region's store, by its workers' leases all running
out at once, or by a launcher that cannot reach its cluster), and its leases ended at once.

``watch`` is the scheduled check, run at every poll of the regions' autopilot (``fleet.ClusterPilot``):
a region is lost when its store does not answer, when two or more leases its workers hold have all run
out unrenewed a whole lease ago with none claimed there since (every worker gone at once; a single
worker's death is the lease's own business: its expiry counts the lost lease and the deaths, I4; two
workers killed alone within a lease of each other are restarted and claim again within it, where on
loaded nights a check at the first lapse found their region lost), or when a launcher says it cannot
reach the region's cluster (a Kubernetes API gone). ``check`` asks the stores when it is run (``regions check``), and
``end_region`` is what both do for a region found lost, or what ``regions lost`` does by hand.

A lost region has its leases ended at once: every shard its workers hold is pending again now, not
when its lease runs out, and its steal gate opens (none of its own workers is left to finish its
records, bi.set_steal_gate_v1), so the other regions take its shards (a steal each, priced as egress,
its replica rebuilt from the ledger where the home store is the one lost, bi.claim_shard_region_v2),
and a result file it handed in and that was not merged is refused unread. A lost region is no
record's fault: no attempt, crash or lost lease is counted (bi.end_region_leases_v1). Where the rest
of the night goes, and whether the deadline still holds, is the regions' autopilot's arithmetic
(``fleet.decide_clusters``: its clusters sized 0, workers added in the others, or a page now), as it is
``planner.replan``'s on paper.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import psycopg

from batch_inference.db import q
from batch_inference.regions.store import StoreUnavailable, store_for

log = logging.getLogger(__name__)


def end_region(conn: psycopg.Connection, job_version: str, region: str, reason: str) -> int:
    """End every lease the region's workers hold, recorded with ``reason``, and open its steal gate; how
    many leases ended."""
    ended = conn.execute(q("end_region_leases"), {"job": job_version, "region": region, "reason": reason}
                         ).fetchone()["ended"]
    conn.execute(q("set_steal_gate"), {"job": job_version, "region": region, "open": True,
                                       "reason": f"{region} lost ({reason}): none of its own workers left"})
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


def watch(conn: psycopg.Connection, job_version: str, *, unreachable: Mapping[str, str] | None = None,
          known: set[str] | frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """The scheduled check (module docstring): every region not ``known`` lost that is lost now has its
    leases ended; each one found: region, reason, leases ended."""
    found: dict[str, str] = {}
    for region, why in (unreachable or {}).items():
        if region not in known:
            found[region] = f"its cluster cannot be reached: {why}"
    for r in conn.execute(q("region_stores"), {"job": job_version}).fetchall():
        if r["region"] in known or r["region"] in found:
            continue
        try:
            store_for(r["store"]).check()
        except StoreUnavailable as exc:
            found[r["region"]] = f"its store does not answer: {exc}"
    for r in conn.execute(q("region_lapsed"), {"job": job_version}).fetchall():
        if r["region"] in known or r["region"] in found:
            continue
        if r["held"] >= 2 and r["lapsed"] == r["held"] and r["quiet"]:
            found[r["region"]] = (f"every worker gone at once: all {r['held']} leases its workers held ran out "
                                  f"unrenewed a whole lease ago, none claimed since (last renewed "
                                  f"{r['last_renewed']:%H:%M:%S})")
    return [{"region": region, "reason": why, "ended": end_region(conn, job_version, region, why)}
            for region, why in sorted(found.items())]
