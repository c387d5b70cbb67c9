"""The model ladder without a database: the spec (rungs, bad input in one line, the job version pins
the ladder), confidence from token log-probabilities and from agreement, the keep-or-escalate rule,
LadderEngine up the rungs, and calibrate's threshold search."""

from __future__ import annotations

import copy
import math
import threading

import pytest

from batch_inference.engines.base import build_request, token_logprobs
from batch_inference.exceptions import InvalidValue, SpecError
from batch_inference.ladder import rungs
from batch_inference.ladder.calibrate import search
from batch_inference.ladder.engine import LadderEngine
from batch_inference.spec import parse_spec
from benchmarks.ladder import known_ladder, ticket_rows


@pytest.fixture(autouse=True)
def known_engines(monkeypatch):
    monkeypatch.setenv("BATCH_INFERENCE_ENGINE_MODULES", "tests,benchmarks.ladder")


def ladder(**over) -> dict:
    return known_ladder("public.tickets", None, **over)


def refused(d: dict) -> str:
    with pytest.raises(SpecError) as exc:
        parse_spec(d)
    return str(exc.value)


def test_a_ladder_spec_takes_its_top_rung_as_model_and_pins_every_rung_in_the_job_version():
    spec = parse_spec(ladder(thresholds=(0.6,)))
    assert spec.engine.name == "ladder" and spec.model.name == "known-dear"
    assert spec.params == spec.models[-1].params
    moved = ladder(thresholds=(0.7,))
    assert parse_spec(moved).spec_hash != spec.spec_hash            # a threshold is a new job version (I2)
    cheaper = ladder(thresholds=(0.6,))
    cheaper["models"][0]["cost_per_row"] = 0.0001
    assert parse_spec(cheaper).spec_hash == spec.spec_hash           # a price is not
    again = spec.with_overrides(dataset="other")                     # a dumped ladder spec parses again
    assert again.models == spec.models and again.engine.name == "ladder"


@pytest.mark.parametrize("change, words", [
    (lambda d: d["models"][0].__setitem__("output_schema", {"type": "object", "properties": {
        "label": {"type": "string"}}}), "models[1] (known-cheap): its output_schema differs from the spec's"),
    (lambda d: d["models"][0].__setitem__("engine", {"name": "noop"}),
     "models[1] (known-cheap): engine 'noop' gives no token log-probabilities, which ladder.confidence 'logprobs'"),
    (lambda d: d.__setitem__("ladder", {"confidence": "agreement"}),
     "models[1] (known-cheap): ladder.confidence 'agreement' compares 3 sampled answers, which at temperature 0"),
    (lambda d: (d.__setitem__("ladder", {"confidence": "agreement"}),
                d["models"][0].__setitem__("engine", {"name": "vllm"}),
                d["models"][0]["params"].__setitem__("temperature", 0.7)),
     "models[1] (known-cheap): engine 'vllm' builds its sampling parameters (the seed) once"),
    (lambda d: d.__setitem__("engine", {"name": "llama-cpp"}), "a spec with models: runs them as a ladder"),
    (lambda d: d.__setitem__("models", d["models"][:1]), "models"),
    (lambda d: d.__setitem__("ladder", {"fields": ["nope"]}), "ladder.fields: 'nope' is not a top-level property"),
])
def test_bad_ladders_are_refused_in_one_line(change, words):
    d = copy.deepcopy(ladder())
    change(d)
    message = refused(d)
    assert words in message and len(message.splitlines()) == 1


def test_engine_ladder_without_models_is_refused():
    d = known_ladder("public.tickets", None)
    del d["models"]
    d.update(model={"name": "x", "digest": "0" * 64}, engine={"name": "ladder"})
    assert "engine 'ladder' needs models:" in refused(d)


def test_confidence_is_the_probability_of_the_compared_fields_values():
    spec = parse_spec(ladder())
    text = '{"category": "billing"}'
    lp = ((('{"category": "', -0.5), ("bill", -0.1), ("ing", -0.2), ('"}', -3.0)))
    assert rungs.from_logprobs(spec, text, lp) == pytest.approx(math.exp(-0.3))
    assert rungs.from_logprobs(spec, text, (*lp, ("<|im_end|>", -0.7))) == pytest.approx(math.exp(-0.3))
    # Tokens that do not spell the text: the geometric mean of every token.
    assert rungs.from_logprobs(spec, "{}", lp) == pytest.approx(math.exp(-3.8 / 4))
    assert rungs.from_logprobs(spec, text, None) is None
    # An engine's logprobs as llama.cpp and OpenAI-compatible servers give them.
    got = token_logprobs({"content": [{"token": "a", "logprob": "-0.5"}, {"token": "b", "logprob": -1}]})
    assert got == (("a", -0.5), ("b", -1.0))


def test_agreement_is_the_share_of_samples_agreeing_with_the_most_common_answer():
    spec = parse_spec(ladder())
    a = [rungs.check(spec, "r", '{"category": "bug"}'), rungs.check(spec, "r", '{"category": "billing"}'),
         rungs.check(spec, "r", '{"category": "bug"}'), rungs.check(spec, "r", "not json")]
    got = rungs.agree(spec, "r", a)
    assert got.valid and got.text == '{"category": "bug"}' and got.confidence == 0.5
    assert not rungs.agree(spec, "r", [a[3]]).valid


def test_the_rule_keeps_a_confident_valid_answer_and_escalates_the_rest():
    spec = parse_spec(ladder(thresholds=(0.5,)))
    ok = rungs.check(spec, "r", '{"category": "bug"}', confidence=0.6)
    assert rungs.keeps(spec, 1, ok)
    assert not rungs.keeps(spec, 1, rungs.check(spec, "r", '{"category": "bug"}', confidence=0.4))
    assert not rungs.keeps(spec, 1, rungs.check(spec, "r", '{"category": "nope"}', confidence=0.99))
    assert rungs.keeps(spec, 2, rungs.check(spec, "r", '{"category": "bug"}', confidence=None))   # the top rung
    uncalibrated = parse_spec(ladder())
    assert not rungs.keeps(uncalibrated, 1, ok)                   # no threshold: every record goes on


def test_the_ladder_engine_sends_only_the_unsure_records_up():
    spec = parse_spec(ladder(thresholds=(0.5,)))
    rows = ticket_rows(20, hard_share=0.4)
    engine = LadderEngine(spec)
    engine.load()
    out = {o.record_id: o for o in engine.generate([build_request(spec, r, t) for r, t, _ in rows],
                                                   threading.Event())}
    hard = sum(1 for _, t, _ in rows if "[hard]" in t)
    assert engine.asked == [20, hard]
    assert {r: o.text for r, o in out.items()} == {r: f'{{"category": "{label}"}}' for r, _, label in rows}
    stop = threading.Event()
    stop.set()
    assert list(LadderEngine(spec).generate([build_request(spec, "r", "x")], stop)) == []


def test_a_dotted_engine_without_logprobs_is_refused_when_the_ladder_loads(monkeypatch):
    from benchmarks.ladder import KnownEngine
    monkeypatch.setattr(KnownEngine, "gives_logprobs", False)
    with pytest.raises(InvalidValue, match="gives no token log-probabilities"):
        LadderEngine(parse_spec(ladder()))


def test_search_picks_the_cheapest_thresholds_within_target_and_names_the_best_when_none_does():
    ids = [f"r{i}" for i in range(10)]
    # Rung 1 right on r0-r6 with confidence 0.9, wrong on r7-r9 with 0.3 (one wrong one at 0.95).
    low = {rid: (True, 0.9 if i < 7 else 0.3, i < 7) for i, rid in enumerate(ids)}
    top = {rid: (True, None, True) for rid in ids}
    found = search([low, top], [1.0, 10.0], ids, 0.98)
    assert found["picked"]["thresholds"] == [0.9] and found["picked"]["accuracy"] == 1.0
    assert found["picked"]["bill_per_record"] == pytest.approx(1.0 + 0.3 * 10.0)
    assert found["top_alone"] == {"accuracy": 1.0, "bill_per_record": 10.0}
    low["r9"] = (True, 0.95, False)
    found = search([low, top], [1.0, 10.0], ids, 1.0)
    assert found["picked"] is None and found["best"]["accuracy"] == 0.9
    assert [c["accuracy"] for c in found["curve"]] == sorted(c["accuracy"] for c in found["curve"])


def test_under_agreement_a_rung_answers_each_record_with_several_seeds_and_keeps_what_agrees():
    d = ladder(thresholds=(1.0,))
    d["ladder"] = {"confidence": "agreement", "samples": 3}
    d["models"][0]["params"]["temperature"] = 0.7
    spec = parse_spec(d)
    rows = ticket_rows(30, hard_share=0.5)
    engine = LadderEngine(spec)
    engine.load()
    out = {o.record_id: o.text for o in engine.generate([build_request(spec, r, t) for r, t, _ in rows],
                                                        threading.Event())}
    easy = [r for r, t, _ in rows if "[hard]" not in t]
    assert engine.asked[0] == 3 * len(rows)                       # three samples a record at rung 1
    assert 0 < engine.asked[1] <= len(rows) - len(easy)           # only hard records disagree with themselves
    assert all(out[r] == f'{{"category": "{label}"}}' for r, _, label in rows if r in easy)
    assert engine.rungs[0].engine.spec.params.seed == spec.models[0].params.seed   # the rung's own spec is back


def test_calibrate_out_sets_each_threshold_where_the_spec_wrote_its_rung():
    """``with_thresholds``: a threshold replaced where it is, added after a block rung's last line (first
    when that is a block), inside a flow rung; comments, quoting and the top rung untouched."""
    from batch_inference.ladder.calibrate import with_thresholds

    text = ("# my ladder\n"
            "models:   # rungs\n"
            "  - model: {name: a, digest: x}   # small\n"
            "    cost_per_row: 0.0004  # price\n"
            "  - {model: {name: b}, cost_per_row: 0.004}\n"
            "  - model: {name: c}\n"
            "    params:\n"
            "      temperature: 0\n"
            "  - model: {name: d}\n"
            "    threshold: 0.5   # old\n"
            "  - model: {name: e}\n"
            "    cost_per_row: 1\n")
    assert with_thresholds(text, [0.25, 0.5, 0.125, None]) == (
        "# my ladder\n"
        "models:   # rungs\n"
        "  - model: {name: a, digest: x}   # small\n"
        "    cost_per_row: 0.0004  # price\n"
        "    threshold: 0.25\n"
        "  - {model: {name: b}, cost_per_row: 0.004, threshold: 0.5}\n"
        "  - threshold: 0.125\n"
        "    model: {name: c}\n"
        "    params:\n"
        "      temperature: 0\n"
        "  - model: {name: d}\n"
        "    threshold: null   # old\n"
        "  - model: {name: e}\n"
        "    cost_per_row: 1\n")
    with pytest.raises(SpecError, match="is not the list of rungs it calibrated"):
        with_thresholds(text, [0.25])
