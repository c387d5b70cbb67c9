"""The autopilot's arithmetic (batch_inference.autopilot), without a database.

Known answers first (the fewest workers that finish a margin before the cutoff's last
moment, the start-up of added workers, the bill of each option); then whole nights on a
simulated clock with the controller in the loop: a slowed batch is caught by adding workers
before the cutoff fires, a noisy one does not flap, and the budget is never exceeded on a
night where meeting the deadline would need more. The same controller runs against the real
PostgreSQL and real worker processes in tests/integration/test_autopilot.py and in the nights.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

from batch_inference import autopilot
from batch_inference.autopilot import ADD, HOLD, REMOVE, Policy, Throughput, decide, project
from batch_inference.cost import Prices
from batch_inference.cutoff import decide as cutoff_decide

UTC = timezone.utc
T0 = datetime(2026, 12, 5, 22, 0, tzinfo=UTC)
DEADLINE = T0 + timedelta(hours=8)
# The seed's prices: $3.50 a GPU-hour (spot), $0.00725 a synchronous row; own rows billed by GPU time.
PRICES = Prices(gpu_hour=Decimal("3.50"))
POLICY = Policy(min_workers=1, max_workers=16, margin_s=600, start_s=300, cooldown_s=900, window_s=900)


def test_behind_it_adds_the_fewest_workers_that_finish_a_margin_before_the_cutoff():
    # 300,000 rows at 18.7 rows/s a worker; 1,800 s fallback overhead: the last moment is 05:30,
    # the target 05:20. Two workers would take 2.2 h from 01:00 (fine); from 04:00 they cannot.
    now = T0 + timedelta(hours=6)          # 04:00: 80 minutes to the target
    d = decide(now, DEADLINE, 300_000, 18.7, 2, 85.0, 1800.0, POLICY, PRICES)
    assert d.action == ADD
    # n workers, the added ones after 300 s: 2*18.7*300 + n*18.7*(4800-300) >= 300,000  ->  n >= 3.48...
    assert d.desired == 4
    opt = d.option(4)
    assert opt.meets and opt.fallback_rows == 0 and opt.finish <= DEADLINE - timedelta(seconds=1800 + 600)
    assert not d.option(3).meets
    # Without the change the cutoff fires and re-drives rows at the synchronous price.
    two = d.option(2)
    assert two.finish is None and two.fire is not None and two.fallback_rows > 0
    assert two.bill > opt.bill
    # The bill: GPU-hours at $3.50, own rows free, no fallback rows.
    assert opt.bill == Decimal(str(opt.gpu_hours)) * Decimal("3.50")
    assert "fewest workers" in d.reason


def test_start_up_counts_in_the_projection():
    now = T0 + timedelta(hours=6)
    slow_start = Policy(**{**POLICY.__dict__, "start_s": 1800})
    fast = project(6, 2, 18.7, 300_000, now, DEADLINE, 85.0, 1800.0, POLICY, PRICES, Decimal(0))
    slow = project(6, 2, 18.7, 300_000, now, DEADLINE, 85.0, 1800.0, slow_start, PRICES, Decimal(0))
    assert fast.finish < slow.finish
    # A size at or below the current one starts no worker: no start-up.
    same = project(2, 2, 18.7, 1000, now, DEADLINE, 85.0, 1800.0, slow_start, PRICES, Decimal(0))
    assert same.finish == now + timedelta(seconds=1000 / (2 * 18.7))


def test_ahead_it_removes_only_with_a_second_margin_and_past_the_cooldown():
    now = T0 + timedelta(hours=1)
    # 10 workers on 50,000 rows: 1 worker would take 44 min, far inside the target.
    d = decide(now, DEADLINE, 50_000, 18.7, 10, 85.0, 1800.0, POLICY, PRICES, last_change=now - timedelta(hours=1))
    assert d.action == REMOVE and d.desired == 1
    within = decide(now, DEADLINE, 50_000, 18.7, 10, 85.0, 1800.0, POLICY, PRICES,
                    last_change=now - timedelta(seconds=60))
    assert within.action == HOLD and within.desired == 10 and "cooldown" in within.reason


def test_no_throughput_yet_holds_within_the_bounds():
    d = decide(T0, DEADLINE, 1000, None, 0, 85.0, 1800.0, POLICY, PRICES)
    assert (d.desired, d.action) == (1, ADD) and d.options == ()
    d = decide(T0, DEADLINE, 1000, None, 40, 85.0, 1800.0, POLICY, PRICES)
    assert (d.desired, d.action) == (16, REMOVE)


def test_throughput_is_measured_per_worker_past_the_start_up():
    tp = Throughput(start_s=10, window_s=20)
    assert tp.add(0, 0, 2) is None                # two workers appear: starting up
    assert tp.add(10, 0, 2) is None               # producing from now
    assert tp.add(20, 200, 2) == pytest.approx(10.0)
    # Two workers added: their start-up is not read as slowness.
    assert tp.add(25, 300, 4) == pytest.approx(10.0)
    assert tp.add(35, 500, 4) == pytest.approx(10.0)
    assert tp.add(45, 900, 4) == pytest.approx(10.0)
    # Slowed to half: the window follows it.
    for t in range(55, 200, 10):
        tp.add(t, 900 + (t - 45) * 20, 4)
    assert tp.estimate == pytest.approx(5.0)
    # Removing workers stops counting them at once.
    assert tp.add(205, 900 + 160 * 20 + 5 * 5, 1) == pytest.approx(5.0, rel=0.1)


def test_the_decision_records_its_options_and_the_finish_with_and_without():
    now = T0 + timedelta(hours=6)
    d = decide(now, DEADLINE, 300_000, 18.7, 2, 85.0, 1800.0, POLICY, PRICES)
    p = d.params("jv_x")
    assert p["current"] == 2 and p["desired"] == 4 and p["action"] == ADD
    assert p["finish_with"] == d.option(4).finish and p["finish_without"] == d.option(2).fire
    assert p["bill_without"] > p["bill_with"]
    import json

    opts = json.loads(p["options"])
    assert len(opts) <= autopilot.MAX_OPTIONS and {2, 4, 1, 16} <= {o["workers"] for o in opts}


# -- whole nights on a simulated clock ------------------------------------------------------


def night(policy: Policy, prices: Prices, *, records=300_000, per_worker=18.7, workers=2, slow_at=3600.0,
          slow=8.0, noise=0.0, pilot=True, poll_s=300.0, seed=0, fb_rate=85.0, overhead_s=1800.0):
    """One night: workers settle rows (an added one after policy.start_s), the moving cutoff is
    checked at each poll (cutoff.decide, as the watch does) and, with the pilot, the controller
    decides and the fleet follows at once. Returns what happened."""
    rng = random.Random(seed)
    t, dt = 0.0, 5.0
    left = float(records)
    fleet = [-policy.start_s] * workers                 # start times: the first ones are up at 0
    desired, last_change = workers, None
    tp = Throughput(start_s=policy.start_s, window_s=policy.window_s)
    gpu_s = 0.0
    actions, pages, fired, fb_rows, done = [], [], None, 0, 0.0
    next_poll = 0.0
    factor = 1.0
    while left > 0 and t < 10 * 3600:
        now = T0 + timedelta(seconds=t)
        if t >= next_poll:
            next_poll = t + poll_s
            factor = (slow if t >= slow_at else 1.0) * (1 + rng.uniform(-noise, noise))
            if cutoff_decide(now, DEADLINE, int(left), fb_rate, overhead_s, step_s=60).fire:
                fired, fb_rows = t, int(round(left))
                break
            if pilot:
                per = tp.add(t, int(done), len(fleet))
                gpu_h = gpu_s / 3600
                spent = prices.gpu_cost(Decimal(str(gpu_h)))
                d = decide(now, DEADLINE, int(left), per, desired, fb_rate, overhead_s, policy, prices, spent,
                           last_change)
                if d.page:
                    pages.append((t, d.page))
                if d.desired != desired:
                    actions.append((t, d.action, desired, d.desired))
                    last_change = now
                    if d.desired > len(fleet):
                        fleet += [t] * (d.desired - len(fleet))
                    else:
                        fleet = fleet[:d.desired]
                    desired = d.desired
        up = sum(1 for s in fleet if t - s >= policy.start_s)
        rate = up * per_worker / factor
        step = min(left, rate * dt)
        left -= step
        done += step
        gpu_s += len(fleet) * dt
        t += dt
    bill = prices.gpu_cost(Decimal(str(gpu_s / 3600))) + fb_rows * prices.fallback_per_row
    return {"fired": fired, "fallback_rows": fb_rows, "finish": t, "bill": bill, "actions": actions,
            "pages": pages, "gpu_h": gpu_s / 3600}


def test_a_slowed_night_is_met_by_adding_workers_and_costs_less_than_the_fixed_fleet():
    fixed = night(POLICY, PRICES, pilot=False)
    auto = night(POLICY, PRICES)
    assert fixed["fired"] is not None and fixed["fallback_rows"] > 0
    assert auto["fired"] is None and auto["fallback_rows"] == 0
    assert auto["finish"] <= 8 * 3600 - 1800
    first_add = next(a for a in auto["actions"] if a[1] == ADD)
    assert first_add[0] < fixed["fired"]                       # it acted before the cutoff would have fired
    assert auto["bill"] < Decimal("0.7") * fixed["bill"]       # the goal: 30 % lower at least


@pytest.mark.parametrize("seed", range(5))
def test_a_noisy_night_does_not_flap(seed):
    res = night(POLICY, PRICES, noise=0.15, seed=seed, slow_at=2 * 3600, slow=2.0, poll_s=60.0)
    assert res["fired"] is None
    kinds = [a[1] for a in res["actions"]]
    # No reversal: adds, then (once well ahead) removes, never back and forth.
    reversals = sum(1 for a, b in zip(kinds, kinds[1:]) if a != b)
    assert reversals <= 1, res["actions"]
    # And no two changes closer than the start-up of the workers they added.
    times = [a[0] for a in res["actions"]]
    assert all(b - a >= POLICY.start_s for a, b in zip(times, times[1:])), res["actions"]


def test_the_budget_is_never_exceeded_on_a_night_where_meeting_the_deadline_would_need_more():
    # On-demand GPUs at $40/h and a cheap synchronous fallback ($0.0001 a row): on this night,
    # slowed from the start, a GPU row costs more than a fallback row, and meeting the deadline
    # would cost more than the $50 budget. The fleet may go down to no worker at all.
    prices = Prices(gpu_hour=Decimal("40"), fallback_per_row=Decimal("0.0001"))
    budget = Decimal("50")
    base = {**POLICY.__dict__, "min_workers": 0, "budget": budget}
    spend = night(Policy(**{**base, "on_budget": "spend"}), prices, slow_at=0.0)
    keep = night(Policy(**{**base, "on_budget": "page"}), prices, slow_at=0.0)
    # Meeting the deadline needs more than the budget: "spend" meets it, over the budget, and pages.
    assert spend["fired"] is None and spend["bill"] > budget and spend["pages"]
    # "page" keeps within the budget every poll and pages early, with the arithmetic in one message.
    assert keep["bill"] <= budget, keep
    assert keep["pages"]
    t_page, page = keep["pages"][0]
    assert keep["fired"] is None or t_page < keep["fired"]
    assert "budget $50.00" in page and "GPU-h" in page and "fallback rows" in page
