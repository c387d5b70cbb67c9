"""The preemptible-worker simulation: bookkeeping, fencing, and the design's shard-size result."""

from __future__ import annotations

import pytest

from batch_inference.simulate import DEFAULT_CANDIDATES, Scenario, recommend_shard_size, simulate

SEED_SCENARIO = Scenario()  # 2,000,000 records, 20 workers, 18.7/s, 1/h, 180 s, 600 s, 3 s, 20% stalls


def test_defaults_are_the_design_scenario():
    sc = SEED_SCENARIO
    assert (sc.records, sc.workers, sc.rate, sc.interruptions_per_hour) == (2_000_000, 20, 18.7, 1.0)
    assert (sc.load_s, sc.lease_s, sc.shard_overhead_s, sc.stall_fraction, sc.notice_fraction) == (180, 600, 3, 0.2, 0)
    assert round(sc.ideal_hours, 2) == 1.54  # 1.49 h of work plus 3 minutes of loading


def test_without_interruptions_the_makespan_is_arithmetic():
    r = simulate(Scenario(interruptions_per_hour=0), 5_000)
    # 400 shards over 20 workers: 20 each, each 3 s + 5,000 / 18.7 s, after the load.
    assert r.makespan_h * 3600 == pytest.approx(180 + 20 * (3 + 5_000 / 18.7))
    assert (r.interruptions, r.lost_gpu_h, r.refused_writes, r.claims) == (0, 0, 0, 400)


@pytest.mark.parametrize("size", [500, 5_000, 25_000])
def test_every_record_stored_once(size):
    r = simulate(SEED_SCENARIO, size, seed=1)
    assert r.rows == SEED_SCENARIO.records
    assert r.duplicate_rows == 0
    assert r.interruptions > 0


def test_stalls_are_fenced_and_counted_as_refused():
    r = simulate(SEED_SCENARIO, 5_000, seed=0)
    assert r.stalls > 0 and r.fenced > 0
    assert r.refused_writes > 0
    assert r.rows == SEED_SCENARIO.records  # refused writes are not rows
    calm = simulate(Scenario(stall_fraction=0), 5_000, seed=0)
    assert (calm.stalls, calm.fenced, calm.refused_writes) == (0, 0, 0)


def test_a_stall_nobody_overtook_carries_on():
    # One worker: while it stalls nobody can claim its shard, so the epoch is
    # still its own when it returns. The ledger guards on the epoch only, so
    # its writes are accepted and nothing is refused.
    sc = Scenario(records=50_000, workers=1, stall_fraction=1.0, interruptions_per_hour=4)
    r = simulate(sc, 5_000, seed=2)
    assert r.stalls > 0 and r.fenced == 0 and r.refused_writes == 0
    assert r.rows == sc.records and r.duplicate_rows == 0


def test_deterministic_by_seed():
    a, b = simulate(SEED_SCENARIO, 2_000, seed=3), simulate(SEED_SCENARIO, 2_000, seed=3)
    assert a == b
    assert simulate(SEED_SCENARIO, 2_000, seed=4) != a


def test_notice_shortens_the_job():
    # Same interruptions either way (per-worker streams), so the comparison is paired.
    base = [simulate(SEED_SCENARIO, 5_000, s).makespan_h for s in range(3)]
    sc = Scenario(notice_fraction=1.0)
    noticed = [simulate(sc, 5_000, s) for s in range(3)]
    assert all(r.notices > 0 for r in noticed)
    assert sum(r.makespan_h for r in noticed) < sum(base)


def test_fifo_claim_order_also_completes():
    r = simulate(Scenario(claim_order="fifo"), 5_000, seed=0)
    assert r.rows == SEED_SCENARIO.records and r.duplicate_rows == 0


def test_recommendation_for_the_design_scenario():
    rec = recommend_shard_size(SEED_SCENARIO, DEFAULT_CANDIDATES, seeds=5)
    by = {r.shard_size: r for r in rec.rows}
    # The design's item-keyed row: 1.81 h at 5,000 (500 -> 2.01, 25,000 -> 1.88).
    assert by[5_000].makespan_h == pytest.approx(1.81, rel=0.10)
    assert rec.best not in (500, 25_000)
    assert by[rec.best].makespan_h < by[500].makespan_h
    assert by[rec.best].makespan_h < by[25_000].makespan_h
    assert all(r.duplicate_rows == 0 for r in rec.rows)
    assert 0.1 < rec.overhead < 0.3  # the design: about 20% over ideal
    assert rec.best in rec.near_best and 500 not in rec.near_best and 25_000 not in rec.near_best


@pytest.mark.parametrize("bad", [
    {"stall_fraction": 1.5}, {"notice_fraction": -0.1}, {"stall_extra_s": 0},
    {"workers": 0}, {"claim_order": "random"},
])
def test_scenario_rejects_impossible_values(bad):
    with pytest.raises(ValueError):
        Scenario(**bad)
