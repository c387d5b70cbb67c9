"""The nights harness: compressed nights end to end under drawn faults (batch_inference.nights).

The default run (three nights: a slowed batch with kills and a 5xx burst, a night of drifted
"faster" history with a database restart and 429s, a slow cancel with "slower" history; and three
nights whose records go to a hosted batch API: a batch that expires with partial results, one
stuck validating, a cancel that settles slowly at the provider) must meet every deadline with no
duplicate, no loss, no healthy dead letter, no request billed twice and every bill under its
ceiling; and a replay of one night by its seed must reproduce its cutoff and verdict. The hosted
nights and a night whose fallback endpoint is down for the whole tail are in test_nights_hosted.py,
the autopilot's nights in test_nights_autopilot.py, the budgets' in test_nights_budget.py and the
price tiers' in test_nights_tiers.py: files of their own, so that scripts/test.sh's workers (a file
to a worker) run them side by side."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta

import pytest

from batch_inference import nights
from batch_inference.cutoff import FallbackRun, derive_rate_and_overhead
from batch_inference.nights import Endpoint, Faults, NightsConfig, draw_faults, history_rows, predict, run_nights


def _post(url: str) -> tuple[int, dict[str, str], dict]:
    req = urllib.request.Request(url + "/chat/completions", data=b'{"model": "noop", "messages": []}',
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_faults_and_history_are_drawn_from_the_seed_alone():
    cfg = NightsConfig()
    assert draw_faults(7, cfg) == draw_faults(7, cfg)
    assert history_rows(7, cfg, "faster") == history_rows(7, cfg, "faster")
    assert len({draw_faults(s, cfg) for s in range(30)}) == 30
    # Over a month of seeds every kind of fault comes up, the unabsorbable one included.
    names = " ".join(n for s in range(30) for n in draw_faults(s, cfg).names())
    for kind in ("slower from", "kill", "stall", "5xx burst", "429", "cancel settles", "db restart",
                 "history slower", "history longer", "history faster", "endpoint down",
                 "hosted batch 1 expires with partial results", "hosted cancel settles"):
        assert kind in names, kind
    # The default run adds a night for each hosted fault the first three lack, found by its seed.
    extra = NightsConfig().seeds()[3:]
    assert {draw_faults(s, cfg).hosted for s in extra} == set(nights.HOSTED_FAULTS)
    assert [draw_faults(s, cfg).hosted for s in range(3)] == [None] * 3


def test_the_endpoint_answers_the_chat_completions_shape_and_its_faults():
    cases = ((Faults(), 200, None),
             (Faults(burst_at_pool=0.0, burst_s=60.0), 500, None),
             (Faults(throttle_at_pool=0.0, throttle_s=60.0, throttle_share=1.0, retry_after_s=2), 429, "2"),
             (Faults(down_at_pool=0.0), 503, None))
    for faults, want, retry_after in cases:
        ep = Endpoint(faults, 1, time.monotonic() + 60)
        try:
            status, headers, body = _post(ep.base_url)
            assert status == want and headers.get("Retry-After") == retry_after
            assert ep.answers == {want: 1}
            if want == 200:
                content = json.loads(body["choices"][0]["message"]["content"])
                assert set(content) == {"category", "summary"} and body["choices"][0]["finish_reason"] == "stop"
        finally:
            ep.close()


def test_drifted_history_keeps_the_cutoffs_step():
    """Found by the nights run (seed 1, "history faster"): history rounded every measured overhead
    up to a whole minute whatever the cutoff's step, so five complete runs measuring 4-5 s turned a
    compressed night's 8 s overhead into 60 s and fired its cutoff at submit. The rounding now
    follows the watch's step_s (a minute in production, unchanged there)."""
    cfg = NightsConfig()
    now = datetime.now(UTC)
    runs = [FallbackRun(records=h["records"], rate=h["rate"], overhead_s=h["overhead_s"], drain_s=h["drain_s"],
                        busy_s=h["busy_s"], load_s=h["load_s"], finished_at=now - timedelta(days=h["days_ago"]))
            for h in history_rows(1, cfg, draw_faults(1, cfg).drift)]
    assert draw_faults(1, cfg).drift == "faster"
    fine = derive_rate_and_overhead(runs, cfg.rate, cfg.overhead_s, n=5, step_s=1)
    minute = derive_rate_and_overhead(runs, cfg.rate, cfg.overhead_s, n=5)
    assert minute.overhead_s == 60.0                       # what a compressed night got before
    assert fine.overhead_s < cfg.overhead_s and fine.rate > cfg.rate
    assert "rounded up to 1 s" in fine.source and "rounded up to the minute" in minute.source


def test_prediction_follows_the_drawn_conditions():
    cfg = NightsConfig()
    clean = predict(cfg, Faults(), cfg.rate, cfg.overhead_s)
    assert not clean["fires"] and clean["finish_s"] < cfg.deadline_s / 2
    slow = predict(cfg, Faults(slow_at=2.0, slow_factor=8.0), cfg.rate, cfg.overhead_s)
    assert slow["fires"] and slow["finish_s"] <= cfg.deadline_s - cfg.overhead_s / 2


@pytest.mark.chaos
def test_default_nights_run_meets_every_deadline(tmp_path, monkeypatch, caplog):
    """The default run's drawn nights (its first ``nights`` seeds, none of them hosted); the nights it
    adds for the hosted faults are tests/process/test_nights_hosted.py's. The first night's validate
    meets the database gone (as a drawn restart can land there) and is retried, as the DAG's task is."""
    import psycopg

    from batch_inference import validate as validate_module

    real, calls = validate_module.validate, []

    def validate_once_gone(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise psycopg.OperationalError("terminating connection due to administrator command")
        return real(*args, **kwargs)

    monkeypatch.setattr(validate_module, "validate", validate_once_gone)
    caplog.set_level("WARNING", logger="batch_inference.nights")
    cfg = NightsConfig()
    # The replay of night 1 by its seed, through the command, runs beside the run (its own process and
    # database): its cutoff at submit comes from its seed's history, its verdict from a night of a few
    # workers that mostly wait, so the two nights need not take turns.
    # (Its output goes to files: a pipe nobody reads during the run could fill and stop it.)
    with (tmp_path / "replay.out").open("w") as out, (tmp_path / "replay.err").open("w") as err:
        replay = subprocess.Popen([sys.executable, "-m", "batch_inference.cli", "nights", "--night", "1", "--json"],
                                  stdout=out, stderr=err, text=True)
    try:
        report = run_nights(NightsConfig(hosted_nights=0))
        replay.wait(timeout=300)
    finally:
        replay.kill()
        replay.wait()
    print(report.table())
    s = report.summary()
    assert report.passed, report.table()
    assert len(calls) == 4 and "validate/publish try 1: terminating connection" in caplog.text
    assert [n.seed for n in report.nights] == cfg.seeds()[:cfg.nights] == [0, 1, 2]
    assert s["nights"] == 3 and s["met"] == 3 and s["false_pages"] == []
    assert (s["duplicates"], s["lost"], s["healthy_dead"]) == (0, 0, 0)
    # The ceiling bounds the rows' bill; the workers' GPU-hours are billed beside it.
    assert all(n.bill["rows_total"] <= n.bill["all_synchronous_ceiling"] for n in report.nights)
    # Our own workers' GPU time is billed.
    assert all(not n.hosted and n.gpu_hours > 0 for n in report.nights) and s["hosted_nights"] == 0
    by_seed = {n.seed: n for n in report.nights}
    assert by_seed[0].fired_s is not None and by_seed[0].rows.get("fallback", 0) > 0
    assert "history" in by_seed[1].constants["source"] and by_seed[1].constants["overhead_s"] < 8.0
    assert by_seed[2].constants["rate"] < NightsConfig().rate          # "slower" history tightened it
    # The replay of a night by its seed, through the command: the same cutoff at submit and verdict.
    assert replay.returncode == 0, (tmp_path / "replay.err").read_text()[-3000:]
    again = json.loads((tmp_path / "replay.out").read_text())["nights"][0]
    assert again["cutoff_before_deadline_s"] == by_seed[1].cutoff_before_deadline_s
    assert again["constants"] == by_seed[1].constants
    assert again["verdict"] == by_seed[1].verdict


def test_the_page_comes_when_the_arithmetic_knows_the_deadline_is_lost():
    """Seed 14's page: 435 rows left at 56.581/s with 2 s to publish and 9.5 s to the deadline is
    lost (7.7 + 2 > 9.5); a second earlier it was not yet (the pool could still have made it)."""
    from batch_inference.cutoff import deadline_lost

    deadline = datetime(2026, 1, 1, 6, 0, tzinfo=UTC)
    # Seed 16, found by the 30-night run: "slower" history (26.474/s) made the night lost from
    # submit, so a 1.5 s 5xx burst paged it, and it met its deadline. The harness pages at the
    # pool's own limit (80/s), the fastest it could go, at which 1,050 rows with 36.4 s left are not lost.
    cfg = NightsConfig()
    assert draw_faults(16, cfg).drift == "slower" and draw_faults(16, cfg).down_at_pool is None
    at = deadline - timedelta(seconds=36.4)
    assert deadline_lost(at, deadline, 1050, 26.474, cfg.page_reserve_s, "burst", step_s=1) is not None
    assert deadline_lost(at, deadline, 1050, cfg.pool_rate, cfg.page_reserve_s, "burst", step_s=1) is None
    lost = deadline_lost(deadline - timedelta(seconds=9.5), deadline, 435, 56.581, 2.0, "endpoint down", step_s=1)
    assert lost is not None and lost.startswith("deadline 06:00:00 will be missed: 435 rows outstanding")
    assert lost.endswith("9.5s left; endpoint down")
    assert deadline_lost(deadline - timedelta(seconds=11), deadline, 435, 56.581, 2.0, "down", step_s=1) is None
    assert deadline_lost(deadline, deadline, 0, 56.581, 2.0, "down") is None
    # Production figures: 40,000 rows at 85/s with 10 minutes of load left is lost 5 minutes out.
    assert deadline_lost(deadline - timedelta(minutes=5), deadline, 40_000, 85, 600, "down") is not None
    assert deadline_lost(deadline - timedelta(minutes=30), deadline, 40_000, 85, 600, "down") is None
