"""Compressed nights over three regions in the nights harness (``NightsConfig(regions=True)``,
batch_inference.regions.RegionNight), each beside the same night in one region under its own autopilot.

On the real parts: one embedded PostgreSQL, a path store and worker processes per region (``--region``,
the far ones handing in result files), the merger near the ledger, the cutoff watch, the fallback pool
against its loopback endpoint, validate and publish; the autopilot over every cluster sizes each
cluster, opens steal gates by the deadline's arithmetic, and finds a region lost by itself. Seed 38
draws a region lost a quarter into the night (its workers killed at once, its cluster unreachable) and
another region's store gone soon after, beside the harness's own "history longer"; the single region
meets the same losses (the same share of its workers at the same moments, the same share of its GPUs).
The bill against one region is a figure (benchmarks/region_nights.py, docs/regions.md), not asserted
here."""

from __future__ import annotations

from batch_inference.autopilot import Policy
from batch_inference.nights import NightsConfig, run_nights
from batch_inference.regions import RegionNight

# Three workers' worth of work over a 40 s night: the planner spreads it over two regions (two workers each at
# most), the single region gets the three regions' six.
CFG = dict(records=600, shard_size=20, batch_delay_s=0.1, deadline_s=40.0, hosted_nights=0)


def test_a_region_night_is_drawn_from_its_seed_alone_and_planned_over_the_cheapest_regions(tmp_path):
    policy = Policy(margin_s=5, start_s=2, cooldown_s=8, window_s=4)
    a, b = (RegionNight(38, tmp_path / x, 600, 20, 0.1, 40.0, 8.0, policy, capacity=2) for x in ("a", "b"))
    assert a.deployment.model_dump()["clusters"][0]["gpu"] == b.deployment.model_dump()["clusters"][0]["gpu"]
    assert a.faults == b.faults and a.faults.lost == "ap" and a.faults.store == "eu"
    assert [(c.region, c.workers) for c in a.plan.clusters] == [("eu", 2), ("ap", 1)] and a.plan.meets
    only, price, capacity = a.one_region()
    assert capacity == 6 and [c.region for c in only.clusters] == ["us"] and price > 0


def test_nights_over_three_regions_with_a_region_lost_are_met_or_paged_once_each_record():
    report = run_nights(NightsConfig(nights=1, seed=38, regions=True, **CFG))
    assert report.passed, report.table()
    one, reg = report.nights
    assert (one.regions["role"], reg.regions["role"]) == ("one", "regions")
    for n in report.nights:
        # met, or paged before the deadline; every record once (no duplicate, none lost)
        assert n.verdict in ("met", "paged") and n.coverage["duplicates"] == 0 and n.lost == 0, n.line()
    r = reg.regions
    # the region killed and the store gone were found by the regions' autopilot's poll, not by hand
    assert sorted(r["lost"]) == ["ap", "eu"], r
    assert any("cluster cannot be reached" in x for x in r["lost_reasons"])
    assert any("store does not answer" in x for x in r["lost_reasons"])
    # their gates were open at their loss (opened for it, or already open for a region behind: at load 7 a gate
    # opened for a region 159 records behind 2 s before that region was lost and stayed open), their shards went
    # to the region left, each steal read across and priced with the arithmetic of the gate it went through: the
    # egress is in the bill. A gate may also open for a region behind and close again before any is lost, as the
    # measured rate swings on a loaded machine, so what counts is the gate's state at the loss and after it
    def open_at_loss(region: str) -> bool:
        state, lost = False, False
        for kind, where, why in r["gates_and_losses"]:
            if where != region:
                continue
            if kind == "region_lost":
                lost = True
                if state:
                    return True
            elif why.startswith("open:"):
                state = True
                if lost:
                    return True
            else:
                state = False
        return False

    assert all(open_at_loss(x) for x in ("ap", "eu")), r["gates_and_losses"]
    assert r["steals"] > 0 and all(usd > 0 and any(k in why for k in ("lost:", "it needs help", "no worker of its own"))
                                   for usd, why in r["steal_reasons"]), r["steal_reasons"]
    assert set(r["steals_from"]) & {"ap", "eu"}, r["steals_from"]
    assert r["egress_usd"] > 0 and r["bill_usd"] > r["gpu_usd"]
    # each cluster's decision with its reason: us had no worker in the plan and was added; the lost ones removed
    assert r["worker_seconds"]["us-gpu"] > 0
    assert any(c == "us-gpu" and a == "add" and "behind" in why for c, a, why in r["decisions"])
    assert any(a == "remove" and "lost" in why for c, a, why in r["decisions"])
    # the single region met the same losses at the same moments: a share of its running workers ended each time,
    # its six GPUs cut by the lost regions' two each
    assert [x["region"] for x in r["losses"]] == ["ap", "eu"] and [x["of_capacity"] for x in r["losses"]] == [6, 6]
    faced = one.regions["faced"]
    assert len(faced) == 2 and faced[0].endswith("capacity 4") and faced[1].endswith("capacity 2"), faced
    assert any("the same loss at" in e for e in one.fallback["supervisor"])
    cmp = report.summary()["regions"]
    assert cmp["one_region"]["nights"] == cmp["regions"]["nights"] == 1 and cmp["region_lost_nights"] == 1
    assert "one region (its autopilot) -> three regions" in report.table()


def test_leases_lapsed_over_a_database_restart_are_no_region_lost_until_a_lease_after_it(tmp_path):
    """The ledger's server restarted (a server of the test's own, restarted for real): every holder's renewals
    were cut, so two leases of one region last renewed before the restart and run out more than a lease ago
    are no region lost until a whole lease after the server's start (region night 14 found the ledger's region
    lost with no region fault drawn, its database restarted right after two kills); a lease after it they are."""
    import shutil
    import tempfile
    import time
    from pathlib import Path

    from batch_inference import db
    from batch_inference.harness import EmbeddedServer
    from batch_inference.plan import submit
    from batch_inference.regions import parse_deployment, place, watch_regions
    from tests.conftest import make_source, make_spec, tickets
    from tests.integration.test_regions import deployment_dict, region_ledger

    for r in ("us-east", "eu-west", "ap-south"):
        (tmp_path / r).mkdir()
    short = Path(tempfile.mkdtemp(prefix="bi-rl-", dir="/tmp"))     # a Unix socket lives in it
    server = EmbeddedServer(short / "pg")
    try:
        with db.connect(server.url) as conn:
            db.migrate(conn)
            make_source(conn, tickets(60))
            job = submit(conn, make_spec(lease_seconds=6, renew_seconds=1)).job_version
            place(conn, job, parse_deployment(deployment_dict(tmp_path)))
        held = [region_ledger(server.url, job, f"ap-{i}", "ap-south").claim() for i in (1, 2)]
        assert all(h is not None for h in held)
        server.restart()
        with db.connect(server.url, retries=5) as conn:
            # both run out 7 s before now (more than the 6 s lease), last renewed before the restart
            conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '7 seconds' "
                         "WHERE job_version = %s AND shard_no = ANY(%s)", (job, [h.shard_no for h in held]))
            up = float(conn.execute("SELECT extract(epoch FROM clock_timestamp() - pg_postmaster_start_time()) AS s"
                                    ).fetchone()["s"])
            assert up < 6 and watch_regions(conn, job) == [], up
            time.sleep(6.2 - up)
            found = watch_regions(conn, job)
            assert [(f["region"], f["ended"]) for f in found] == [("ap-south", 2)], found
            assert "every worker gone at once" in found[0]["reason"]
    finally:
        server.stop()
        shutil.rmtree(short, ignore_errors=True)
