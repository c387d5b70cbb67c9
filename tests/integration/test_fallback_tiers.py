"""The fallback pool with price tiers (batch_inference.tiers): the real pool and ledger against a loopback
chat-completions endpoint that answers each ``service_tier`` as a provider's tier does (flex slower, and refusing
a share of its requests with 429 "Resource Unavailable" or dropping them). A hosted provider cannot be reached
from here: the endpoint is the boundary's stand-in."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

from batch_inference.cli import main as cli_main
from batch_inference.exceptions import SpecError
from batch_inference.fallback import run_fallback
from batch_inference.plan import submit
from batch_inference.status import job_counts
from tests.conftest import make_source, make_spec, tickets
from tests.fixtures.chat_server import ChatServer, completion
from tests.integration.test_bad_input import _cli, _yaml

OK = completion('{"category": "billing", "summary": "charged twice"}')
UNAVAILABLE = {"error": {"message": "Resource Unavailable", "type": "resource_unavailable", "code": None}}
TIERS = [{"name": "flex", "per_row": 0.003625, "latency_s": 0.05}, {"name": "default", "per_row": 0.00725}]


def tiered_spec(**fallback):
    return make_spec(fallback={"provider": "openai", "tiers": TIERS, **fallback}, shard_size=100, lease_seconds=30,
                     renew_seconds=0.2)


class TieredEndpoint:
    """Flex answers after ``flex_s`` and refuses (or drops) a share of its requests at random; default at once."""

    def __init__(self, flex_s: float = 0.0, refuse: float = 0.0, drop: float = 0.0, seed: int = 0):
        from batch_inference.harness.loopback import DROP

        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.answered: Counter[str] = Counter()
        self.refused = 0

        def respond(body):
            tier = body.get("service_tier")
            with self.lock:
                r = self.rng.random()
                if tier == "flex" and r < refuse:
                    self.refused += 1
                    return 429, {}, UNAVAILABLE
                if tier == "flex" and r < refuse + drop:
                    self.refused += 1
                    return 200, {}, DROP, 0.0
                self.answered[tier] += 1
            return 200, {}, OK, flex_s if tier == "flex" else 0.0

        self.server = ChatServer(respond)

    def close(self) -> None:
        self.server.close()


def tier_rows(conn, job: str) -> dict[str, int]:
    return {r["tier"]: r["n"] for r in conn.execute(
        "SELECT tier, count(*) AS n FROM bi.fallback_tiers WHERE job_version = %s GROUP BY tier", (job,))}


def no_attempts(conn, job: str) -> bool:
    return conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s AND attempts > 0",
                        (job,)).fetchone()["n"] == 0


def test_without_a_deadline_every_row_goes_flex_and_refusals_move_up_spending_nothing(conn, db_url, capsys):
    """Flex refuses or drops 30% of its requests: a refused row tries flex once more, then moves up to default;
    no attempt is spent and every row is billed at the tier that answered it."""
    ep = TieredEndpoint(refuse=0.2, drop=0.1)
    make_source(conn, tickets(400))
    job = submit(conn, tiered_spec()).job_version
    try:
        result = run_fallback(db_url, job, ep.server.base_url, rate=2000.0, concurrency=8)
    finally:
        ep.close()
    assert result.stored == 400 and job_counts(conn, job)["stored"] == 400 and no_attempts(conn, job)
    flex, default = result.tiers
    n_flex, n_default = ep.answered["flex"], ep.answered["default"]
    assert flex["refused"] == ep.refused > 0 and (flex["answered"], default["answered"]) == (n_flex, n_default)
    # a row moves up only after two refusals at flex: about 0.3 x 0.3 of them, far fewer than the refusals
    assert n_flex + n_default == 400 and 0 < n_default < ep.refused / 2
    # every stored row billed at the tier that answered it
    assert tier_rows(conn, job) == {"flex": n_flex, "default": n_default}
    assert cli_main(["cost", job, "--db", db_url, "--json"]) == 0
    bill = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["so_far"]
    split = {t["tier"]: t for t in bill["fallback_tiers"]}
    assert split["flex"]["rows"] == n_flex and split["default"]["rows"] == n_default
    want = n_flex * Decimal("0.003625") + n_default * Decimal("0.00725")
    assert abs(Decimal(str(bill["fallback_cost"])) - want) < Decimal("0.01")
    assert bill["fallback_cost"] < bill["fallback_rows"] * 0.00725


def test_a_deadline_flex_cannot_meet_sends_the_head_to_default_and_the_tail_flex_can_finish_to_flex(conn, db_url):
    """Flex answers in 0.5 s: 6 in flight make 12 rows/s, 300 rows need 31 s with the margin and 10 s are left,
    so default takes the rows until what is left fits flex's rate in the time left; flex takes that tail."""
    ep = TieredEndpoint(flex_s=0.5)
    make_source(conn, tickets(300))
    job = submit(conn, tiered_spec(tiers=[{**TIERS[0], "latency_s": 0.5}, TIERS[1]], overhead_s=3.0)).job_version
    try:
        result = run_fallback(db_url, job, ep.server.base_url, rate=2000.0, concurrency=8,
                              deadline=datetime.now(timezone.utc) + timedelta(seconds=11))
    finally:
        ep.close()
    assert result.stored == 300 and no_attempts(conn, job) and tier_rows(conn, job) == dict(ep.answered)
    first = [b["service_tier"] for b in ep.server.bodies[:6]]
    assert first == ["default"] * 6 and ep.answered["default"] >= 150
    # what went flex fitted flex's rate in the time left (10 s at 12 rows/s, with the margin)
    assert 0 < ep.answered["flex"] <= 10 * 12 / 1.25


def test_rows_move_up_a_tier_as_the_measured_flex_rate_shrinks_the_margin(conn, db_url):
    """The spec hopes flex answers in 10 ms; it takes 300 ms. Flex takes the first rows until its measured
    latency says the rest cannot finish by the deadline on it; default takes them from then on."""
    ep = TieredEndpoint(flex_s=0.3)
    make_source(conn, tickets(400))
    job = submit(conn, tiered_spec(tiers=[{**TIERS[0], "latency_s": 0.01}, TIERS[1]], overhead_s=3.0)).job_version
    try:
        result = run_fallback(db_url, job, ep.server.base_url, rate=2000.0, concurrency=8,
                              deadline=datetime.now(timezone.utc) + timedelta(seconds=16))
    finally:
        ep.close()
    assert result.stored == 400 and no_attempts(conn, job)
    assert 0 < ep.answered["flex"] < 400 and ep.answered["default"] == 400 - ep.answered["flex"]
    assert tier_rows(conn, job) == dict(ep.answered)
    flex, _ = result.tiers
    assert flex["latency_s"] > 0.1     # measured, not the spec's hope


# The refusals of each test below: the first goes through the real CLI process (a fresh interpreter, so
# nothing its start-up prints can come before the one line); the others call the same main() in-process,
# which another process start (submit imports Airflow: 2-3 CPU-s) would only repeat.
THROUGH_THE_PROCESS = frozenset({"unknown-tier", "not-cleared"})


def submit_refused(db_url: str, spec_path, request, capsys) -> tuple[int, str, str]:
    """``batch-inference submit SPEC`` of a spec it refuses: (exit status, stdout, stderr)."""
    if request.node.callspec.id in THROUGH_THE_PROCESS:
        p = _cli(db_url, "submit", str(spec_path))
        return p.returncode, p.stdout, p.stderr
    capsys.readouterr()
    rc = cli_main(["--db", db_url, "submit", str(spec_path)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("fallback,words", [
    ({"provider": "openai", "tiers": [{"name": "standard", "per_row": 0.001}]},
     "unknown tier 'standard' for provider openai"),
    ({"provider": "gemini", "tiers": [{"name": "flex"}]}, "tier 'flex' has no price"),
    ({"tiers": [{"name": "flex", "per_row": 0.001}]}, "tiers need fallback.provider"),
    ({"provider": "gemini", "tiers": [{"name": "standard", "per_row": 0.002}, {"name": "flex", "per_row": 0.001}]},
     "cheapest first"),
], ids=["unknown-tier", "no-price", "no-provider", "order"])
def test_a_bad_tier_is_one_line_exit_2_nothing_written(conn, db_url, tmp_path, fallback, words, request, capsys):
    with pytest.raises(SpecError, match=words.replace("(", r"\(")):
        make_spec(fallback=fallback)
    make_source(conn, tickets(3))
    bad = tmp_path / "bad.yaml"
    bad.write_text(_yaml(fallback=fallback))
    rc, out, err = submit_refused(db_url, bad, request, capsys)
    assert rc == 2 and out == ""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0], err
    assert conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == 0


@pytest.mark.parametrize("over,words", [
    ({"engine": {"name": "gemini-batch", "options": {"base_url": "https://generativelanguage.googleapis.com/"}}},
     "not cleared for hosted APIs"),
    ({"engine": {"name": "gemini-batch", "options": {}}, "cleared_for_hosted": True,
      "output_schema": {"type": "object", "properties": {"n": {"type": "number", "exclusiveMinimum": 0}}}},
     "Gemini's response schema cannot take: properties.n.exclusiveMinimum"),
], ids=["not-cleared", "schema"])
def test_a_gemini_batch_spec_it_cannot_run_is_one_line_exit_2_nothing_written(conn, db_url, tmp_path, over, words,
                                                                             request, capsys):
    make_source(conn, tickets(3))
    bad = tmp_path / "bad.yaml"
    bad.write_text(_yaml(**over))
    rc, out, err = submit_refused(db_url, bad, request, capsys)
    assert rc == 2 and out == "", out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0], err
    assert conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == 0
