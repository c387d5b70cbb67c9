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
from batch_inference.cost import Prices, rows_within
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


def test_a_watch_re_armed_without_a_measurement_does_not_undo_an_add():
    """Found by the nights (on_budget spend): after the budget page the watch starts again with no
    throughput, and the shards left (4) cut the 6 workers just added down to 4, 6 s after the add.
    Without a measurement only the spec's bounds apply: a worker beyond the shards exits by itself."""
    budget = Policy(**{**POLICY.__dict__, "budget": Decimal("1"), "on_budget": "spend"})
    d = decide(T0, DEADLINE, 1000, None, 6, 85.0, 1800.0, budget, PRICES, shards_left=4)
    assert (d.desired, d.action) == (6, HOLD)
    assert decide(T0, DEADLINE, 1000, None, 20, 85.0, 1800.0, budget, PRICES, shards_left=4).desired == 16


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
    decides and the fleet follows at once. When the cutoff fires the fleet drains for
    ``policy.drain_s`` and the pool re-drives the rest; with ``on_budget: page`` only the rows the
    budget affords after that drain (``fallback.BudgetCheck``'s allowance), the others left pending.
    Returns what happened."""
    rng = random.Random(seed)
    t, dt = 0.0, 5.0
    left = float(records)
    fleet = [-policy.start_s] * workers                 # start times: the first ones are up at 0
    desired, last_change, last_action = workers, None, None
    tp = Throughput(start_s=policy.start_s, window_s=policy.window_s)
    gpu_s = 0.0
    actions, pages, fired, fb_rows, done, decisions = [], [], None, 0, 0.0, []
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
                           last_change, last_action=last_action)
                decisions.append((t, d))
                if d.page:
                    pages.append((t, d.page))
                if d.desired != desired:
                    actions.append((t, d.action, desired, d.desired))
                    last_change, last_action = now, d.action
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
    pending = 0
    if fired is not None:
        gpu_s += len(fleet) * policy.drain_s
        if policy.keeps_budget:
            afford = rows_within(policy.budget, prices.gpu_cost(Decimal(str(gpu_s / 3600))), prices.fallback_per_row)
            pending = max(0, fb_rows - afford) if afford is not None else 0
            fb_rows -= pending
    bill = prices.gpu_cost(Decimal(str(gpu_s / 3600))) + fb_rows * prices.fallback_per_row
    return {"fired": fired, "fallback_rows": fb_rows, "finish": t, "bill": bill, "actions": actions,
            "pages": pages, "gpu_h": gpu_s / 3600, "decisions": decisions, "pending": pending}


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


# -- the budget, hard: issue 39 ----------------------------------------------------------------
# On-demand-like prices where meeting the slowed night costs far more than the budget: no size can
# meet it within $40, and every row the cutoff leaves costs $0.00725 at the fallback.
TIGHT = Decimal("40")
DRAIN = {**POLICY.__dict__, "drain_s": 630.0, "budget": TIGHT}


def test_page_prices_what_the_pool_would_do_and_spend_every_row():
    now = T0 + timedelta(hours=6)
    page = Policy(**{**DRAIN, "on_budget": "page"})
    spend = Policy(**{**DRAIN, "on_budget": "spend"})
    a = project(2, 2, 18.7 / 8, 300_000, now, DEADLINE, 85.0, 1800.0, page, PRICES, Decimal("20"))
    b = project(2, 2, 18.7 / 8, 300_000, now, DEADLINE, 85.0, 1800.0, spend, PRICES, Decimal("20"))
    assert a.fire == b.fire and a.gpu_hours == b.gpu_hours
    # spend: every row left at the cutoff at the fallback's price; page: what the rest of the budget affords.
    assert b.fallback_rows > 0 and b.pending_rows == 0 and b.bill > TIGHT
    assert a.fallback_rows + a.pending_rows == b.fallback_rows and a.pending_rows > 0
    assert a.bill <= TIGHT and a.within_budget and TIGHT - a.bill < PRICES.fallback_per_row
    # The drain after the cutoff is GPU time too.
    no_drain = project(2, 2, 18.7 / 8, 300_000, now, DEADLINE, 85.0, 1800.0,
                       Policy(**{**DRAIN, "drain_s": 0.0}), PRICES, Decimal("20"))
    assert a.gpu_hours == pytest.approx(no_drain.gpu_hours + 2 * 630 / 3600)


def test_with_page_no_option_over_the_budget_is_ever_taken_on_a_night_no_size_can_meet():
    """The issue's night: once no size met the deadline within the budget, the controller took the
    cheapest option over it (every row left priced at the fallback's) and kept adding workers; the
    draining fleet came on top. Now every size it takes is within the budget and so is the night."""
    policy = Policy(**{**DRAIN, "on_budget": "page"})
    res = night(policy, PRICES, slow_at=0.0, poll_s=60.0)
    assert res["pages"], "the budget is binding: it pages"
    assert res["bill"] <= TIGHT, res["bill"]
    for t, d in res["decisions"]:
        if d.options:
            chosen = d.option(d.desired)
            assert chosen is not None and chosen.within_budget, (t, d.reason)
    # Without a budget the same controller spends more than the budget to meet the deadline.
    free = night(POLICY, PRICES, slow_at=0.0, poll_s=60.0)
    assert free["fired"] is None and free["bill"] > TIGHT


def test_with_spend_the_deadline_is_met_past_the_budget_and_paged():
    res = night(Policy(**{**DRAIN, "on_budget": "spend"}), PRICES, slow_at=0.0, poll_s=60.0)
    assert res["fired"] is None and res["bill"] > TIGHT
    assert res["pages"] and all(p.startswith("spending past the budget") for _, p in res["pages"])


def test_an_added_worker_is_paid_for_before_it_starts():
    # Behind: four workers would meet the deadline for $26.18 of a $28 budget at the measured
    # throughput, but were the batch slower they would run on to the cutoff's last moment and drain
    # after it ($33.45): the add stops at the largest size the budget pays for whatever the
    # throughput does, so the budget never has to undo it.
    now = T0 + timedelta(hours=6)
    policy = Policy(**{**DRAIN, "on_budget": "page", "budget": Decimal("28")})
    d = decide(now, DEADLINE, 300_000, 18.7, 2, 85.0, 1800.0, policy, PRICES, Decimal("10"))
    assert d.option(4).meets and d.option(4).within_budget
    assert (d.desired, d.action) == (3, ADD) and "the budget pays for 3" in d.reason

    def worst(n: int) -> Decimal:
        return autopilot.longest_bill(n, 300_000, now, DEADLINE, 1800.0, policy, PRICES, Decimal("10"))

    assert worst(3) == Decimal("27.5875") <= policy.budget < worst(4) == Decimal("33.45")
    # However slow the batch, three workers stay within the budget.
    assert project(3, 3, 0.1, 300_000, now, DEADLINE, 85.0, 1800.0, policy, PRICES, Decimal("10")).within_budget
    # With room in the budget the add goes as far as the deadline asks.
    roomy = decide(now, DEADLINE, 300_000, 18.7, 2, 85.0, 1800.0, Policy(**{**DRAIN, "on_budget": "page"}), PRICES,
                   Decimal("10"))
    assert (roomy.desired, roomy.action, roomy.page) == (4, ADD, None)


def test_under_a_budget_a_removal_is_not_followed_by_an_add_within_the_cooldown():
    now = T0 + timedelta(hours=6)
    policy = Policy(**{**DRAIN, "on_budget": "page", "budget": Decimal("1000")})
    behind = dict(now=now, deadline=DEADLINE, outstanding=300_000, per_worker=18.7, current=2, fb_rate=85.0,
                  overhead_s=1800.0, policy=policy, prices=PRICES, spent=Decimal("10"))
    assert decide(**behind).action == ADD
    within = decide(**behind, last_change=now - timedelta(seconds=60), last_action=REMOVE)
    assert within.action == HOLD and "cooldown" in within.reason
    past = decide(**behind, last_change=now - timedelta(seconds=policy.cooldown_s), last_action=REMOVE)
    assert past.action == ADD


@pytest.mark.parametrize("budget,kw", [(40, {"slow_at": 0.0}),
                                       *[(30, {"noise": 0.2, "seed": s, "slow_at": 1800.0, "slow": 3.0})
                                         for s in range(3)]])
def test_a_night_under_a_binding_budget_does_not_flap(budget, kw):
    """Seen before: every night over the budget, and on the slowed one sizes 3, 4, 5, 4, 5, 4, 5, 4, 3."""
    policy = Policy(**{**DRAIN, "on_budget": "page", "budget": Decimal(budget)})
    res = night(policy, PRICES, poll_s=60.0, **kw)
    assert res["bill"] <= policy.budget and res["pending"] > 0        # binding: rows left at the budget
    acts = res["actions"]
    # Neither an add within the cooldown of a removal nor a removal within the cooldown of an add.
    for (t1, a1, _, _), (t2, a2, _, _), in zip(acts, acts[1:]):
        if a1 != a2:
            assert t2 - t1 >= policy.cooldown_s, acts
    reversals = sum(1 for a, b in zip(acts, acts[1:]) if a[1] != b[1])
    assert reversals <= 1, acts


def test_the_page_gives_the_arithmetic_of_the_option_it_names():
    now = T0 + timedelta(hours=6)
    policy = Policy(**{**DRAIN, "on_budget": "page"})
    d = decide(now, DEADLINE, 300_000, 18.7 / 8, 2, 85.0, 1800.0, policy, PRICES, Decimal("20"))
    assert d.page is not None
    named = d.option(d.desired)
    assert f"keeping within it with {d.desired} worker(s)" in d.page
    assert autopilot.arithmetic(named, policy, PRICES, Decimal("20")) in d.page
    # The sum it gives is the bill it names: spent + GPU-hours at the price + fallback rows at theirs.
    total = Decimal("20") + PRICES.gpu_cost(Decimal(str(named.gpu_hours))) + named.fallback_rows * PRICES.fallback_per_row
    assert abs(total - named.bill) < Decimal("0.01")
    assert f"bill ${named.bill.quantize(Decimal('0.01')):,}" in d.page and f"{named.gpu_hours:.4f} GPU-h" in d.page
    assert f"{named.fallback_rows:,} fallback rows" in d.page and f"{named.pending_rows:,} rows left pending" in d.page


def test_a_fleet_the_budget_cannot_keep_stops_and_stays_stopped():
    now = T0 + timedelta(hours=6)
    policy = Policy(**{**DRAIN, "on_budget": "page"})
    d = decide(now, DEADLINE, 300_000, 18.7, 4, 85.0, 1800.0, policy, PRICES, Decimal("39.5"))
    assert (d.desired, d.action) == (0, REMOVE) and d.page and "the fleet stops" in d.page
    again = decide(now, DEADLINE, 300_000, 18.7, 0, 85.0, 1800.0, policy, PRICES, Decimal("39.5"),
                   last_change=now, last_action=REMOVE)
    assert again.desired == 0 and again.action == HOLD
    # Stopped, behind, and the budget would pay for workers again: not within the cooldown of the stop
    # (found by the nights: a stopped fleet's hold had no size to name), then only what is paid for.
    roomy = Policy(**{**DRAIN, "on_budget": "page", "budget": Decimal("1000")})
    held = decide(now, DEADLINE, 300_000, 18.7, 0, 85.0, 1800.0, roomy, PRICES, Decimal("39.5"),
                  last_change=now - timedelta(seconds=60), last_action=REMOVE)
    assert (held.desired, held.action) == (0, HOLD) and "holding 0" in held.reason
    back = decide(now, DEADLINE, 300_000, 18.7, 0, 85.0, 1800.0, roomy, PRICES, Decimal("39.5"),
                  last_change=now - timedelta(seconds=roomy.cooldown_s), last_action=REMOVE)
    assert back.action == ADD and back.option(back.desired).within_budget
    # The launchers take 0 from the budget, below the bounds.
    ran: list[int] = []

    class Conn:
        def execute(self, *a, **k):
            return self

        def fetchone(self):
            return {"desired": 0}

    import batch_inference.autopilot as ap
    orig = ap.observe
    try:
        ap.observe = lambda *a, **k: None
        assert ap.reconcile(Conn(), "jv_x", "test", lambda: 2, ran.append, 2, (1, 8)) == 0 and ran == [0]
    finally:
        ap.observe = orig


def test_the_budget_counts_rows_a_retried_request_spends_nothing_twice():
    from batch_inference.ratelimit import RequestAllowance

    spent: list[bool] = []
    a = RequestAllowance(2, on_spent=lambda: spent.append(True))
    assert a.take("r1") and a.take("r1") and a.take("r1")     # one row, retried: one of the allowance
    assert a.take("r2") and a.take("r2")
    assert not a.take("r3") and spent == [True] and a.taken == 2


def test_hosted_batch_jobs_are_not_steered_and_bill_no_gpu_hours():
    from batch_inference.spec import parse_spec
    from tests.conftest import make_spec

    base = make_spec(autopilot={"enabled": True}, cost={"gpu_hour_spot": 3.5})
    gpu = parse_spec(base.model_dump() if hasattr(base, "model_dump") else base)
    hosted = parse_spec({**(base.model_dump() if hasattr(base, "model_dump") else base),
                         "cleared_for_hosted": True,
                         "engine": {"name": "openai-batch", "options": {"base_url": "https://api.openai.com/v1"}}})
    assert autopilot.steers(gpu) and not autopilot.hosted(gpu)
    assert autopilot.hosted(hosted) and not autopilot.steers(hosted)
    assert autopilot.gpu_hours(None, "jv_x", hosted) == 0.0        # not even read: no GPU worker ran
