"""The autopilot over every cluster and the steal gates (batch_inference.regions.fleet): pure arithmetic, no
database. A job on one cluster keeps the single-cluster autopilot (tests/unit/test_autopilot.py)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from batch_inference.autopilot import ADD, HOLD, REMOVE, Policy
from batch_inference.regions import decide_clusters, parse_deployment, steal_gates

T0 = datetime(2026, 12, 7, 22, 0, tzinfo=timezone.utc)
DEADLINE = T0 + timedelta(hours=1)
POLICY = Policy(min_workers=1, max_workers=8, margin_s=60, start_s=30, cooldown_s=100, window_s=60)
EGRESS = [{"from": "us", "to": "eu", "usd_per_gb": 0.02}, {"from": "us", "to": "ap", "usd_per_gb": 0.09},
          {"from": "eu", "to": "ap", "usd_per_gb": 0.08}]


def deployment(us: int = 40, eu: int = 40, ap: int = 40):
    def c(name, region, spot, od, rate, cap):
        return {"name": name, "region": region, "workers": {"kind": "local"},
                "gpu": {"kind": "H100", "spot_per_hour": spot, "on_demand_per_hour": od, "interruption_rate": rate},
                "capacity": cap, "store": {"kind": "path", "path": f"/srv/{region}"}}
    # eu's spot record is the cheapest, then us's spot; ap's 0.5 interruptions an hour rule its spot out
    return parse_deployment({"clusters": [c("us-1", "us", 3.5, 7.0, 0.05, us), c("eu-1", "eu", 3.0, 6.0, 0.05, eu),
                                          c("ap-1", "ap", 1.0, 5.0, 0.5, ap)], "egress": EGRESS})


def decide(outstanding, current, d=None, **kw):
    kw.setdefault("shard_s", 60.0)
    return decide_clusters(kw.pop("now", T0), DEADLINE, outstanding, kw.pop("per_worker", 10.0), current,
                           d or deployment(), "us", 0.0, POLICY, **kw)


def by(decision):
    return {c.cluster: c for c in decision.clusters}


def test_behind_it_adds_where_a_record_is_cheapest_first_spot_where_the_interruptions_allow():
    d = by(decide(200_000, {"us-1": 1}))
    # 200,000 records less us-1's 35,000 by the target need 46.9 records/s more from 30 s on: eu's spot, 5 workers
    assert (d["eu-1"].desired, d["eu-1"].action, d["eu-1"].capacity) == (5, ADD, "spot")
    assert "behind" in d["eu-1"].reason and "spot" in d["eu-1"].reason
    assert (d["us-1"].desired, d["us-1"].action) == (1, HOLD) and d["ap-1"].desired == 0
    # eu full at 2: the rest goes to the next cheapest record (us's spot), not to ap's on demand
    d = by(decide(200_000, {"us-1": 1}, deployment(eu=2)))
    assert (d["eu-1"].desired, d["us-1"].desired, d["ap-1"].desired) == (2, 4, 0)
    assert by(decide(200_000, {"us-1": 1}))["ap-1"].capacity == "on_demand"


def test_the_whole_capacity_short_of_the_deadline_fills_every_cluster_and_pages_now_with_the_arithmetic():
    dec = decide(1_000_000, {"us-1": 1}, deployment(2, 2, 2))
    assert dec.sizes() == {"us-1": 2, "eu-1": 2, "ap-1": 2}
    assert dec.page and "cannot be met" in dec.page and "6 workers" in dec.page and "page now" in dec.page
    # on a throughput not yet measured over a whole window no page yet, and only the clusters whose record is no
    # dearer than the dearest running (us's spot) are filled: ap's on demand waits for the whole window's measure
    early = decide(1_000_000, {"us-1": 1}, deployment(2, 2, 2), steady=False)
    assert early.sizes() == {"us-1": 2, "eu-1": 2, "ap-1": 0} and early.page is None
    ap = by(early)["ap-1"]
    assert ap.action == HOLD and "dearer than any running" in ap.reason and "whole window of rows" in ap.reason
    # a whole window measured, but not yet a whole window of rows (ClusterPilot's settled): ap's still waits
    assert decide(1_000_000, {"us-1": 1}, deployment(2, 2, 2), settled=False).sizes()["ap-1"] == 0
    # nothing running yet: no price to hold to, every cluster filled as on a steady measure
    assert decide(1_000_000, {}, deployment(2, 2, 2), steady=False).sizes() == dec.sizes()


def test_ahead_it_removes_where_a_record_is_dearest_first_past_the_cooldown_on_a_steady_measure():
    current = {"us-1": 3, "eu-1": 3, "ap-1": 2}
    dec = decide(60_000, current, last_change=T0 - timedelta(seconds=500))
    d = by(dec)
    # 60,000 records keep two margins at 80% with 3 workers: ap's on-demand records go first, then us's
    assert (d["ap-1"].desired, d["ap-1"].action) == (0, REMOVE) and "dearest" in d["ap-1"].reason
    assert (d["us-1"].desired, d["eu-1"].desired) == (0, 3)
    assert dec.bill_with < dec.bill_without
    held = by(decide(60_000, current, last_change=T0 - timedelta(seconds=50)))
    assert all(c.action == HOLD and c.desired == current[c.cluster] for c in held.values())
    assert "within the cooldown" in held["us-1"].reason
    assert all(c.action == HOLD for c in decide(60_000, current, steady=False).clusters)


def test_a_lost_regions_clusters_go_to_zero_and_its_records_go_where_they_are_cheapest_with_egress():
    dec = decide(100_000, {"us-1": 1, "eu-1": 2}, lost={"eu"})
    d = by(dec)
    assert (d["eu-1"].desired, d["eu-1"].action) == (0, REMOVE) and "lost" in d["eu-1"].reason
    assert d["us-1"].desired > 1 and d["ap-1"].desired == 0 and not dec.page


def test_no_throughput_measured_keeps_the_sizes_in_force():
    dec = decide(100_000, {"us-1": 2}, per_worker=None)
    assert dec.sizes() == {"us-1": 2, "eu-1": 0, "ap-1": 0} and not dec.changed


def test_a_steal_gate_opens_only_when_the_regions_own_workers_cannot_finish_its_records_by_the_deadline():
    d = deployment()
    gates = {g.region: g for g in steal_gates(
        T0, DEADLINE, 0.0, 60.0, {"us": 20_000, "eu": 50_000, "ap": 10}, {"us-1": 1, "eu-1": 1}, d, 10.0,
        ledger_region="us", policy=POLICY, shard_s=60.0)}
    assert not gates["us"].open and "20,000 records left at 1 worker(s)" in gates["us"].reason   # 35,000 fit
    assert gates["eu"].open and "needs help" in gates["eu"].reason
    assert gates["ap"].open and "no worker of its own" in gates["ap"].reason
    lost = {g.region: g for g in steal_gates(T0, DEADLINE, 0.0, 60.0, {"us": 100, "eu": 0}, {"us-1": 1}, d, 10.0,
                                             {"us"}, ledger_region="us", policy=POLICY, shard_s=60.0)}
    assert lost["us"].open and "lost" in lost["us"].reason and not lost["eu"].open


def test_an_open_steal_gate_closes_only_when_the_regions_own_workers_finish_at_the_removal_derate():
    d = deployment()

    def gate(left, was_open):
        return {g.region: g for g in steal_gates(T0, DEADLINE, 0.0, 60.0, {"us": left}, {"us-1": 1}, d, 10.0,
                                                 ledger_region="us", policy=POLICY, shard_s=60.0,
                                                 was_open=was_open)}["us"]
    # us's one worker makes 35,370 in the time left: 30,000 do not open a closed gate ...
    assert not gate(30_000, frozenset()).open
    # ... and keep an open one open (35,370 at 80% is 28,296), which closes at 28,296 and below
    still = gate(30_000, {"us"})
    assert still.open and "28,296 at 80% (its gate open): it needs help" in still.reason
    assert not gate(28_000, {"us"}).open and gate(36_000, frozenset()).open


def test_a_cluster_whose_region_has_nothing_left_while_no_other_gate_is_open_is_idle_and_sized_zero():
    current = {"us-1": 1, "eu-1": 2, "ap-1": 1}
    d = by(decide(100_000, current, remaining={"us": 50_000, "eu": 0, "ap": 50_000}))
    assert (d["eu-1"].desired, d["eu-1"].action) == (0, REMOVE) and d["eu-1"].reason.startswith("idle: eu")
    # behind, the adds go elsewhere: eu's workers would find nothing to claim
    assert d["us-1"].desired + d["ap-1"].desired > 2
    # another region's gate open: eu's workers may take its shards, eu is not idle
    d = by(decide(100_000, current, remaining={"us": 50_000, "eu": 0, "ap": 50_000}, open_gates={"ap"}))
    assert d["eu-1"].desired >= 2 and not d["eu-1"].reason.startswith("idle")
