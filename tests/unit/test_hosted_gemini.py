"""gemini-batch's reading of one result and of an output schema, through the official google-genai client's types;
no server (the transport end to end: tests/integration/test_hosted_gemini.py)."""

from __future__ import annotations

from batch_inference.engines import TRUNCATED
from batch_inference.hosted.core import ERRORED, SUCCEEDED, TRANSPORT
from batch_inference.hosted.gemini_batch import item, schema_refusal
from tests.fixtures.hosted_gemini import answer, status_error


def test_an_answer_is_its_text_and_usage():
    it = item("r1", answer('{"a": 1}', prompt_tokens=30, output_tokens=7), None)
    assert (it.kind, it.text, it.error, it.tokens_in, it.tokens_out) == (SUCCEEDED, '{"a": 1}', None, 30, 7)


def test_max_tokens_is_a_truncation():
    it = item("r1", answer('{"a": ', finish="MAX_TOKENS"), None)
    assert (it.kind, it.error) == (SUCCEEDED, TRUNCATED)


def test_a_blocked_prompt_with_no_candidate_is_a_failed_attempt():
    it = item("r1", {"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": {"promptTokenCount": 5}}, None)
    assert it.kind == ERRORED and "blockReason SAFETY" in it.error


def test_only_invalid_argument_is_the_requests_fault():
    assert item("r1", None, status_error(400, "INVALID_ARGUMENT", "bad")).kind == ERRORED
    assert item("r1", None, {"code": 3, "message": "bad"}).kind == ERRORED            # an inline JobError's code
    for code, status in ((429, "RESOURCE_EXHAUSTED"), (500, "INTERNAL"), (503, "UNAVAILABLE"),
                         (504, "DEADLINE_EXCEEDED")):
        it = item("r1", None, status_error(code, status, "try later"))
        assert it.kind == TRANSPORT and it.error.startswith(f"{status} ({code})")


def test_the_schema_keywords_gemini_takes_and_refuses():
    takes = {"type": "object", "properties": {"a": {"type": ["string", "null"], "enum": ["x", None], "maxLength": 3},
                                              "b": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "boolean"}]},
                                              "c": {"type": "array", "items": {"type": "integer", "minimum": 0},
                                                    "maxItems": 2}},
             "required": ["a"], "additionalProperties": False, "$defs": {"n": {"type": "number"}}}
    assert schema_refusal(takes) is None
    for keyword, schema in (("const", {"const": 1}), ("allOf", {"allOf": []}), ("not", {"not": {}}),
                            ("multipleOf", {"multipleOf": 2}), ("prefixItems", {"prefixItems": []}),
                            ("patternProperties", {"patternProperties": {}}), ("$schema", {"$schema": "x"})):
        assert schema_refusal({"type": "object", **schema}) == f"{keyword}: a keyword Gemini does not take"
