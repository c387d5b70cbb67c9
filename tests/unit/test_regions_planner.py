"""The deployment's validation and the placement arithmetic across clusters (batch_inference.regions):
pure functions, no database."""

from __future__ import annotations

import pytest

from batch_inference.regions import DeploymentError, parse_deployment
from batch_inference.regions.planner import Workload, choose, plan, replan, single_regions


def cluster(name: str, region: str, spot: float, on_demand: float, interruptions: float, capacity: int) -> dict:
    return {"name": name, "region": region, "workers": {"kind": "local"},
            "gpu": {"kind": "H100", "spot_per_hour": spot, "on_demand_per_hour": on_demand,
                    "interruption_rate": interruptions},
            "capacity": capacity, "store": {"kind": "path", "path": f"/srv/{region}"}}


EGRESS = [{"from": "us", "to": "eu", "usd_per_gb": 0.02}, {"from": "us", "to": "ap", "usd_per_gb": 0.09},
          {"from": "eu", "to": "ap", "usd_per_gb": 0.08}]


def three(**over) -> object:
    d = {"clusters": [cluster("us-1", "us", 3.5, 7.0, 0.05, 40), cluster("eu-1", "eu", 3.0, 6.5, 0.05, 40),
                      cluster("ap-1", "ap", 2.0, 5.0, 0.5, 40)],
         "egress": EGRESS}
    d.update(over)
    return parse_deployment(d)


# 40M records at 10 records/s a worker, 20 h: 57 workers flat out, start and margin counted.
NIGHT = Workload(records=40_000_000, per_worker=10.0, deadline_s=20 * 3600, ledger_region="us",
                 replica_bytes=5000, result_bytes=1000, start_s=300, shard_s=600, margin_s=600)


def test_an_egress_price_given_one_way_holds_both_ways_and_a_missing_pair_is_one_line():
    d = three()
    assert d.egress_price("eu", "us") == d.egress_price("us", "eu") == 0.02
    with pytest.raises(DeploymentError, match=r"^deployment: region 'eu' has no egress price to 'ap' "):
        three(egress=EGRESS[:2])
    with pytest.raises(DeploymentError, match="egress names region 'mars', which no cluster is in"):
        three(egress=[*EGRESS, {"from": "us", "to": "mars", "usd_per_gb": 1}])
    with pytest.raises(DeploymentError, match="kubernetes workers need conn_id"):
        parse_deployment({"clusters": [{**cluster("k", "us", 1, 2, 0, 1), "workers": {"kind": "kubernetes"}}]})
    with pytest.raises(DeploymentError, match="region 'us' names two stores"):
        parse_deployment({"clusters": [cluster("a", "us", 1, 2, 0, 1),
                                       {**cluster("b", "us", 1, 2, 0, 1), "store": {"kind": "path", "path": "/x"}}]})


def test_spot_where_its_interruption_rate_allows_on_demand_where_it_does_not():
    d = three()
    us, eu, ap = (choose(c, d, NIGHT) for c in d.clusters)
    assert (us.capacity, eu.capacity) == ("spot", "spot")
    assert us.per_worker < NIGHT.per_worker            # interruptions cost restarts and half a shard
    assert us.transfer_usd == 0 and eu.transfer_usd == pytest.approx((5000 + 1000) * 0.02 / 1e9)
    assert ap.capacity == "on_demand" and "interruption rate 0.5/GPU-hour over 0.2" in ap.reason


def test_the_cheapest_record_first_up_to_capacity_until_the_deadline_is_met():
    p = plan(three(), NIGHT)
    assert p.meets, p.arithmetic
    by = {c.cluster: c for c in p.clusters}
    assert by["eu-1"].workers == 40                  # the cheapest record, filled to its capacity
    assert 0 < by["us-1"].workers < 40               # then the next, only as far as the deadline needs
    assert "ap-1" not in by                          # on demand there: the dearest record, not needed
    assert sum(c.records for c in p.clusters) == NIGHT.records
    assert p.makespan_s <= NIGHT.deadline_s - NIGHT.margin_s


def test_across_regions_the_bill_is_at_most_one_regions_and_its_deadline_is_met_where_one_region_misses():
    d = three()
    p = plan(d, NIGHT)
    alone = single_regions(d, NIGHT)
    assert not alone["us"].meets and not alone["eu"].meets          # 40 workers cannot do it in 20 h
    assert "page now" in alone["us"].arithmetic
    # with room enough in one region, the regions' bill is still at most that region's
    roomy = three(clusters=[cluster("us-1", "us", 3.5, 7.0, 0.05, 400), cluster("eu-1", "eu", 3.0, 6.5, 0.05, 40),
                            cluster("ap-1", "ap", 2.0, 5.0, 0.5, 40)])
    one = single_regions(roomy, NIGHT)["us"]
    many = plan(roomy, NIGHT)
    assert one.meets and many.meets and many.bill_usd <= one.bill_usd
    assert p.bill_usd == pytest.approx(sum(c.gpu_usd + c.transfer_usd for c in p.clusters))


def test_egress_counts_a_region_whose_gpu_is_cheaper_but_whose_records_are_dearer_to_move():
    far = three(egress=[{"from": "us", "to": "eu", "usd_per_gb": 1000.0}, *EGRESS[1:]])
    eu = choose(far.clusters[1], far, NIGHT)
    us = choose(far.clusters[0], far, NIGHT)
    assert eu.hour_usd < us.hour_usd and eu.record_usd > us.record_usd
    assert plan(far, NIGHT).clusters[0].cluster == "us-1"


def test_a_region_lost_mid_night_is_re_placed_in_the_others_or_paged_with_its_arithmetic():
    d = three()
    # half done after 8 h, eu lost: the rest goes to us, and to ap on demand as far as the deadline needs
    p = replan(d, NIGHT, "eu", remaining=20_000_000, elapsed_s=8 * 3600)
    assert p.meets and {c.region for c in p.clusters} == {"us", "ap"}
    assert sum(c.records for c in p.clusters) == 20_000_000 and p.region("ap")[0].capacity == "on_demand"
    # too little left: paged now, with the arithmetic
    late = replan(d, NIGHT, "eu", remaining=36_000_000, elapsed_s=15 * 3600)
    assert not late.meets and "page now" in late.arithmetic
    assert not replan(d, NIGHT, "us", remaining=1, elapsed_s=0).meets    # the ledger's region: the night stops


def test_the_ten_times_plan_in_the_docs_is_what_the_planner_says(capsys):
    """docs/regions.md's figures come from ``batch-inference regions plan`` on docs/regions_ten_times.yaml."""
    import json
    from pathlib import Path

    from batch_inference import cli

    yaml_path = Path(__file__).resolve().parents[2] / "docs" / "regions_ten_times.yaml"
    assert cli.main(["regions", "plan", str(yaml_path), "--records", "500000000", "--per-worker", "18.7",
                     "--deadline-hours", "20"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["regions"]["meets"] and out["regions"]["bill_usd"] == 24153.39
    assert [c["cluster"] for c in out["regions"]["clusters"]] == ["eu-west-h100", "us-east-h100"]
    assert not any(p["meets"] for p in out["alone"].values())
    assert out["alone"]["us-east"]["makespan_h"] == 37.85


def test_shards_are_homed_where_a_plans_workers_are_or_by_capacity():
    from batch_inference.regions.replicas import assign

    d = three()
    assert list(assign(d, range(6)).values()) == ["us", "us", "eu", "eu", "ap", "ap"]
    homes = assign(d, range(10), {"eu": 3_000, "ap": 1_000})       # the plan left us-1 without workers
    assert list(homes.values()) == ["eu"] * 8 + ["ap"] * 2
