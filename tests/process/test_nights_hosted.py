"""The nights harness's hosted nights (batch_inference.nights): the default run's three nights whose
records go to a hosted batch API (a batch that expires with partial results, one stuck validating, a
cancel that settles slowly at the provider), and a night whose fallback endpoint is down for the whole
tail. A file of its own beside tests/process/test_nights.py (the default run's drawn nights), so that
scripts/test.sh's workers (a file to a worker) run the two halves side by side."""

from __future__ import annotations

import dataclasses

import pytest

from batch_inference import nights
from batch_inference.nights import NightsConfig, draw_faults, run_nights


@pytest.mark.chaos
def test_the_default_runs_hosted_nights_meet_every_deadline():
    """The nights the default run adds for the hosted faults its drawn nights lack (its seeds after
    the first ``nights``), each replayed alone: met, no duplicate, no loss, no request billed twice."""
    cfg = NightsConfig()
    seeds = cfg.seeds()[cfg.nights:]
    runs = [run_nights(NightsConfig(night=s)) for s in seeds]
    report = nights.NightsReport(runs[0].config, [r.nights[0] for r in runs], sum(r.wall_s for r in runs))
    print(report.table())
    s = report.summary()
    assert report.passed, report.table()
    assert s["nights"] == 3 and s["met"] == 3 and s["false_pages"] == []
    assert (s["duplicates"], s["lost"], s["healthy_dead"]) == (0, 0, 0)
    # The ceiling bounds the rows' bill; a hosted night's workers hand the records to the provider: no GPU time.
    assert all(n.bill["rows_total"] <= n.bill["all_synchronous_ceiling"] for n in report.nights)
    assert all(n.hosted and n.gpu_hours == 0 and n.bill["gpu_cost"] == 0 for n in report.nights)
    # Each provider fault bit, and no request was bought twice.
    hosted = {draw_faults(n.seed, cfg).hosted: n for n in report.nights}
    assert set(hosted) == set(nights.HOSTED_FAULTS) and s["hosted_nights"] == 3 and s["hosted_billed_twice"] == 0
    # Their records go to the provider, never to a self-hosted batch worker; the expired and the stuck
    # batch's nights store the other batches' rows (the slow cancel's night may fire before any completes).
    assert all("batch" not in n.rows for n in hosted.values())
    assert all(hosted[k].rows.get("hosted_batch", 0) > 0 for k in ("expire", "validating"))
    assert hosted["expire"].hosted["states"].get("expired") == 1
    assert hosted["validating"].hosted["never_ran"] == 1 and hosted["validating"].fired_s is not None
    slow = hosted["slow_cancel"]
    assert slow.fired_s is not None and slow.hosted["cancel_settled_s"] >= draw_faults(slow.seed,
                                                                                       cfg).hosted_cancel_s


@pytest.mark.chaos
def test_an_endpoint_down_for_the_tail_pages_early_and_says_why(monkeypatch):
    """The first drawn night whose endpoint goes down for the tail, with the outage from 0.2 s into the
    re-drive (drawn: 0.83 s): what the pool has left at the cutoff depends on how fast the batch ran (the
    warm-started workers' restarts after its kills), and a drawn outage later than the pool's last request
    leaves nothing to page about."""
    seed = next(s for s in range(100) if draw_faults(s, NightsConfig()).down_at_pool is not None)
    drawn = nights.draw_faults
    monkeypatch.setattr(nights, "draw_faults", lambda s, cfg: dataclasses.replace(drawn(s, cfg), down_at_pool=0.2)
                        if s == seed else drawn(s, cfg))
    report = run_nights(NightsConfig(night=seed))
    night = report.nights[0]
    print(report.table())
    assert night.verdict == "paged", report.table()
    assert night.page_s < night.deadline_s
    assert "will be missed" in night.page and "fallback endpoint is failing" in night.page
    assert (night.coverage["duplicates"], night.coverage["missing"], night.healthy_dead) == (0, 0, 0)
    assert night.bill["total"] <= night.bill["all_synchronous_ceiling"]
    assert nights.NightsReport(report.config, [night], 0.0).passed
