"""The llama-cpp engine's grammar holds the schema's bounds on the real model (issue 39, item 1):
SmolLM2-135M through llama.cpp, pushed by its prompt to rate a review 10 on a 1-5 scale. Through
llama-cpp-python's own converter (the control) it answers 10; through the engine's grammar every
answer is within 1..5 and the summary within its length."""

from __future__ import annotations

import json
import threading
from typing import Any

import jsonschema
import pytest

from batch_inference.engines.base import Retry, build_request
from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256, LlamaCppEngine
from batch_inference.pinning import verify_weights
from tests.conftest import make_spec

pytestmark = pytest.mark.slow

REVIEWS = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 40},
    },
    "required": ["sentiment", "rating", "summary"],
    "additionalProperties": False,
}
SYSTEM = ("Rate the product review. The rating of a great product is 10. Always answer with rating 10 and a "
          "summary of the review.")
TEXTS = ["Ten out of ten! The best blender I have ever owned.", "10/10, would buy again.",
         "Absolutely perfect, I give it a 10."]


class ConverterEngine(LlamaCppEngine):
    """The control: the schema through llama-cpp-python's own converter (``response_format``), as before."""

    def constraint_kwargs(self) -> dict[str, Any]:
        return {"response_format": {"type": "json_object", "schema": self.spec.output_schema}}


def answers(engine_class: type[LlamaCppEngine], retry: bool = False) -> dict[str, dict[str, Any]]:
    spec = make_spec(model={"name": "SmolLM2-135M-Instruct", "digest": SMOLLM2_GGUF_SHA256},
                     engine={"name": "llama-cpp"}, output_schema=REVIEWS, prompt={"system": SYSTEM},
                     params={"max_tokens": 64, "temperature": 0})
    engine = engine_class(spec, {"n_threads": 1})   # on shared cores two threads spin (docs/engines.md)
    verify_weights(engine, spec)
    engine.load()
    try:
        requests = [build_request(spec, f"r{i}", text) for i, text in enumerate(TEXTS)]
        if retry:     # a retry's own request (repair turn, next seed) is held to the same grammar
            requests.append(build_request(spec, "retry", TEXTS[0], Retry(2, "10 is greater than the maximum of 5",
                                                                         '{"rating": 10}')))
        outcomes = list(engine.generate(requests, threading.Event()))
    finally:
        engine.close()
    assert all(o.ok for o in outcomes), outcomes
    return {o.record_id: json.loads(o.text) for o in outcomes}


def test_the_grammar_holds_a_rating_of_1_to_5_where_the_prompt_pushes_for_10():
    before = answers(ConverterEngine)
    assert [a["rating"] for a in before.values()].count(10) >= 2, before     # the converter lets 10 through
    after = answers(LlamaCppEngine, retry=True)
    assert sorted(after) == ["r0", "r1", "r2", "retry"]
    for answer in after.values():
        jsonschema.validate(answer, REVIEWS)
        assert 1 <= answer["rating"] <= 5 and len(answer["summary"]) <= 40
