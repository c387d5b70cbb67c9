"""The nights harness with the autopilot off and on (batch_inference.nights): the same seed's night
paired, the controller's comparison, and what it shows on a slowed night. A file of its own beside
tests/process/test_nights.py so that scripts/test.sh's workers (a file to a worker) run the nights
files side by side."""

from __future__ import annotations

import pytest

from batch_inference import nights
from batch_inference.nights import NightsConfig, draw_faults, run_nights


def test_the_comparison_pairs_each_seed_off_and_on():
    def night(seed, pilot, verdict, bill, fallback, gpu, fired=None, first_add=None, slowed=True):
        return nights.Night(seed=seed, autopilot=pilot, verdict=verdict, bill={"total": bill}, slowed=slowed,
                            rows={"batch": 1199 - fallback, "fallback": fallback}, gpu_hours=gpu, fired_s=fired,
                            pilot={"first_add_s": first_add} if pilot else {})
    from dataclasses import asdict

    report = nights.NightsReport(asdict(NightsConfig(autopilot="both")), [night(0, False, "met", 6.32, 861, 0.008, fired=14.5),
                                      night(0, True, "met", 0.40, 0, 0.043, first_add=6.2),
                                      night(1, False, "met", 0.10, 0, 0.011, slowed=False),
                                      night(1, True, "met", 0.12, 0, 0.012, slowed=False)], 0.0)
    c = report.summary()["autopilot"]
    assert c["all"]["off"]["bill"] == pytest.approx(6.42) and c["all"]["on"]["bill"] == pytest.approx(0.52)
    assert c["slowed"]["off"]["nights"] == 1 and c["slowed"]["bill_saved"] == pytest.approx(1 - 0.40 / 6.32, abs=1e-4)
    assert c["slowed"]["off"]["fallback_rows"] == 861 and c["slowed"]["on"]["fallback_rows"] == 0
    assert c["acted_before_fixed_fleet_fired_s"] == {"nights": 1, "mean": 8.3, "least": 8.3}
    assert "autopilot off -> on" in report.table() and "+93.7% saved" in report.table()
    assert nights.NightsReport({}, [night(0, False, "met", 1.0, 0, 0.01)], 0.0).summary()["autopilot"] is None


@pytest.mark.chaos
def test_the_autopilot_meets_a_slowed_night_for_less_than_the_fixed_fleet():
    """Seed 15 (batch x4.6 slower from 7 s, 3 kills, a stall; no hosted transport), off then on: with
    the autopilot the controller adds workers seconds after the slow-down and the fallback re-drives
    far fewer rows (2026-12-05: 261 -> 0, the cutoff never fired, bill $2.03 -> $0.22)."""
    report = run_nights(NightsConfig(night=15, autopilot="both"))
    print(report.table())
    assert report.passed, report.table()
    off, on = report.nights
    assert (off.autopilot, on.autopilot) == (False, True) and off.faults == on.faults
    assert draw_faults(15, NightsConfig()).hosted is None
    assert off.fired_s is not None and on.pilot["first_add_s"] < off.fired_s
    assert on.rows.get("fallback", 0) < off.rows.get("fallback", 0)
    assert on.bill["total"] <= 0.7 * off.bill["total"]
    assert on.pilot["largest"] > 2 and on.gpu_hours > off.gpu_hours
    for n in (off, on):
        assert (n.coverage["duplicates"], n.coverage["missing"], n.healthy_dead) == (0, 0, 0)
