"""Constrained decoding and the output schema's limits (issue 39, item 1), without a model: the
integer and number ranges of the llama-cpp grammar against every value around their bounds, what
each engine class says it cannot enforce, and a retried request that is never the same request."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

from batch_inference.engines.base import Engine, Retry, build_request, schema_limits, without_limits
from batch_inference.engines.gbnf import grammar_pattern, int_range, number_range, schema_to_gbnf
from batch_inference.engines.llama_cpp import LlamaCppEngine
from batch_inference.engines.noop import NoopEngine
from batch_inference.engines.vllm import VllmEngine, build_structured_kwargs
from batch_inference.ledger import Lease
from gpu_runner.shard import Shard
from tests.conftest import make_spec

REVIEWS = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 60},
    },
    "required": ["sentiment", "rating", "summary"],
    "additionalProperties": False,
}


def gbnf_regex(expr: str) -> re.Pattern[str]:
    """A GBNF expression of literals, classes, groups, alternatives and repetitions as a Python regex."""
    out, i = [], 0
    while i < len(expr):
        c = expr[i]
        if c == '"':
            j, lit = i + 1, ""
            while expr[j] != '"':
                lit, j = (lit + expr[j + 1], j + 2) if expr[j] == "\\" else (lit + expr[j], j + 1)
            out.append(re.escape(lit))
            i = j + 1
        elif c == "[":
            j = expr.index("]", i + 1)
            out.append(expr[i:j + 1])
            i = j + 1
        elif c == "{":
            j = expr.index("}", i)
            out.append(expr[i:j + 1])
            i = j + 1
        elif c in "()|?*+":
            out.append("(?:" if c == "(" else c)
            i += 1
        elif c == " ":
            i += 1
        else:
            raise ValueError(f"not a plain GBNF expression at {expr[i:i + 20]!r}")
    return re.compile("".join(out))


BOUNDS = [None, -120, -106, -13, -10, -1, 0, 1, 5, 9, 10, 99, 100, 113, 106]


@pytest.mark.parametrize("lo", BOUNDS)
def test_int_range_takes_exactly_the_integers_within_its_bounds(lo):
    for hi in BOUNDS:
        if (lo is None and hi is None) or (lo is not None and hi is not None and lo > hi):
            continue
        pattern = gbnf_regex(int_range(lo, hi))
        for n in range(-1300, 1300):
            inside = (lo is None or n >= lo) and (hi is None or n <= hi)
            assert bool(pattern.fullmatch(str(n))) == inside, (lo, hi, n, int_range(lo, hi))
        for odd in ("01", "-0", "00", "+1", ""):
            assert not pattern.fullmatch(odd), (lo, hi, odd)


def test_number_range_takes_the_numbers_within_whole_number_bounds():
    samples = [f"{n}{f}" for n in range(-14, 15) for f in ("", ".0", ".5", ".05", ".001", ".9")] + ["-0.5"]
    values = [None, -12, -3, -1, 0, 1, 2, 5, 10]
    tried = 0
    for lo in values:
        for hi in values:
            for lo_open in (False, True):
                for hi_open in (False, True):
                    if (lo is None and hi is None) or (lo is None and lo_open) or (hi is None and hi_open) \
                            or (lo is not None and hi is not None and lo > hi):
                        continue
                    try:
                        pattern = gbnf_regex(number_range(lo, lo_open, hi, hi_open))
                    except ValueError:      # an empty interval: (1, 1)
                        assert lo == hi and (lo_open or hi_open)
                        continue
                    tried += 1
                    for s in samples:
                        v = Fraction(s)
                        inside = (lo is None or (v > lo if lo_open else v >= lo)) and \
                                 (hi is None or (v < hi if hi_open else v <= hi))
                        assert bool(pattern.fullmatch(s)) == inside, (lo, lo_open, hi, hi_open, s)
    assert tried > 150


def test_the_reviews_grammar_bounds_the_rating_and_reports_nothing_missing():
    grammar, gaps = schema_to_gbnf(REVIEWS)
    assert gaps == []
    rule = dict(line.split(" ::= ", 1) for line in grammar.splitlines())["rating"]
    assert rule == "([1-5]) space"


def test_what_the_grammar_cannot_hold_is_listed_path_and_keyword():
    schema = {"type": "object", "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "weight": {"type": "number", "maximum": 0.5},
        "even": {"type": "integer", "multipleOf": 2},
        "code": {"type": "string", "pattern": r"^[A-Z]{2}-\d+$", "maxLength": 9},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 3},
        "odd": {"type": "string", "pattern": r"\p{L}+"}}}
    grammar, gaps = schema_to_gbnf(schema)
    assert sorted(gaps) == sorted([
        "weight: maximum (a fractional bound on a number)", "even: multipleOf", "code: maxLength (beside a pattern)",
        "tags: uniqueItems", "odd: pattern (the grammar cannot express it)"])
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    assert rules["code"] == '"\\"" code-1 code-1 "-" [0-9]+ "\\"" space'
    assert LlamaCppEngine.unenforced(schema) == gaps


def test_a_pattern_is_matched_anywhere_and_its_escapes_become_classes():
    assert grammar_pattern(r"[A-Z]{2}-\d+") == "^.*[A-Z]{2}-[0-9]+.*$"
    assert grammar_pattern(r"^\w+@\w+\.com$") == "^[A-Za-z0-9_]+@[A-Za-z0-9_]+[.]com$"
    assert grammar_pattern(r"^[\d.]+$") == "^[0-9.]+$"
    for bad in ('a"b', r"\p{L}", "a\\\\b"):
        with pytest.raises(ValueError):
            grammar_pattern(bad)


def test_each_engine_class_says_what_it_cannot_enforce():
    schema = {"type": "object", "properties": {
        "rating": {"type": "integer", "minimum": 1, "maximum": 5, "multipleOf": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "uniqueItems": True}}}
    assert list(schema_limits(schema)) == [("rating", "minimum"), ("rating", "maximum"), ("rating", "multipleOf"),
                                           ("tags", "uniqueItems"), ("tags[]", "maxLength")]
    assert VllmEngine.unenforced(schema) == ["tags: uniqueItems"]
    assert LlamaCppEngine.unenforced(schema) == ["rating: multipleOf", "tags: uniqueItems"]
    assert NoopEngine.unenforced(schema) == [] and Engine.enforces is None    # no constrained decoding to speak of


def test_vllm_leaves_out_of_its_constraint_only_what_it_refuses():
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "integer", "maximum": 3}, "uniqueItems": True, "maxItems": 2},
        "uniqueItems": {"type": "boolean"}}}
    spec = make_spec(output_schema=schema)
    assert build_structured_kwargs(spec)["json"]["properties"] == {
        "tags": {"type": "array", "items": {"type": "integer", "maximum": 3}, "maxItems": 2},
        "uniqueItems": {"type": "boolean"}}
    assert without_limits(schema, frozenset()) == schema


def test_a_retried_request_carries_the_error_and_another_seed():
    spec = make_spec(output_schema=REVIEWS)
    first = build_request(spec, "r1", "Great, 10/10!")
    again = build_request(spec, "r1", "Great, 10/10!",
                          Retry(2, "output fails the schema: 10 is greater than the maximum of 5\nretry: ...",
                                '{"sentiment": "positive", "rating": 10, "summary": ""}'))
    assert first.seed(7) == 7 and again.seed(7) == 8 and again.seed(None) is None
    assert again.messages[:len(first.messages)] == first.messages
    assistant, user = again.messages[len(first.messages):]
    assert assistant == {"role": "assistant", "content": '{"sentiment": "positive", "rating": 10, "summary": ""}'}
    assert user["role"] == "user" and "10 is greater than the maximum of 5" in user["content"]
    assert "retry:" not in user["content"]
    assert again != first


def test_a_shard_asks_a_failed_record_again_with_what_was_wrong_and_records_how():
    spec = make_spec(output_schema=REVIEWS)
    shard = Shard(Lease("jv_x", 0, 1, None, 2, "w"))
    shard.attempts = {"r1": 0, "r2": 1}           # r2 failed once under an earlier worker
    assert shard.request(spec, "r1", "text").retry is None
    failure = shard.failed("r1", "output fails the schema: 10 is greater than the maximum of 5", '{"rating": 10}')
    assert failure.error == "output fails the schema: 10 is greater than the maximum of 5" and failure.attempt == 1
    shard.attempts["r1"] = 1
    retry = shard.request(spec, "r1", "text").retry
    assert retry == Retry(2, failure.error, '{"rating": 10}')
    again = shard.failed("r1", "output fails the schema: 0 is less than the minimum of 1", '{"rating": 0}')
    assert again.attempt == 2 and again.error.splitlines() == [
        "output fails the schema: 0 is less than the minimum of 1",
        "retry: attempt 2, a repair turn naming the last error, seed offset 1"]
    # Another worker's failure: its text is not here, so only the seed moves on.
    assert shard.request(spec, "r2", "text").retry == Retry(2)
    assert shard.failed("r2", "output truncated at max_tokens", None).error.splitlines()[1] == (
        "retry: attempt 2, no repair turn (last error not seen here), seed offset 1")


def test_the_openai_engine_sends_a_retrys_seed():
    from batch_inference.engines.openai import chat_body

    spec = make_spec(params={"seed": 7})
    retry = build_request(spec, "r1", "text", Retry(3, "bad", "{}"))
    assert chat_body(spec, "m", retry.messages, {}, None, retry.seed(spec.params.seed))["seed"] == 9
    assert chat_body(spec, "m", [], {})["seed"] == 7


def test_a_retry_after_an_engine_error_has_no_repair_turn_only_the_next_seed():
    spec = make_spec(output_schema=REVIEWS)
    retry = Retry(2, "llama_decode returned -3", None)
    request = build_request(spec, "r1", "text", retry)
    assert request.messages == build_request(spec, "r1", "text").messages and request.seed(0) == 1
    assert retry.describe() == "retry: attempt 2, no repair turn (the last attempt gave no answer), seed offset 1"


def test_a_schema_the_converter_cannot_read_is_plain_json_and_said_so():
    grammar, gaps = schema_to_gbnf({"type": "object", "properties": {"x": {"type": "weird"}}})
    assert grammar.lstrip().startswith("root   ::= object") and gaps == [
        "(root): the whole schema (only JSON is enforced: Unrecognized schema: {'type': 'weird'})"]
