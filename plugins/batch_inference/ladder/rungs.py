"""The rungs of a ladder spec, their confidence, and the escalation rule.

A rung is the spec with the rung's model, engine and params in place of the
ladder's (``rung_spec``): the prompt, the output schema and the rules are the
ladder's own, so every rung answers the same question the same way and is
checked by the same ``outputs.check_for_storage``.

Confidence is a share in [0, 1]:

* ``logprobs``: the probability the rung's model gave the answer's compared
  fields (``ladder.fields``, default the category field): exp of the summed
  log-probabilities of the tokens that spell their values, as the engine
  reports them (``Outcome.logprobs``); with no field to compare, the geometric
  mean probability of every token of the answer;
* ``agreement``: of ``samples`` answers (seeds seed, seed+1, ...), the share
  that agree with the most common one on ``ladder.fields`` (default the
  category field, else the whole answer); an invalid sample agrees with none.

The rule (``keeps``): a rung below the top keeps its answer when it is valid
and its confidence is at least the rung's threshold; anything else goes on to
the next rung. The top rung keeps every valid answer; an invalid one there is a
failed attempt of the record, as for a one-model job.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from batch_inference.exceptions import SpecError
from batch_inference.outputs import check_for_storage
from batch_inference.spec import JobSpec, Rung


@dataclass(frozen=True)
class Answer:
    """One rung's answer to one record: the raw text it would store, whether it is valid, and how sure it is."""

    record_id: str
    text: str | None
    valid: bool
    confidence: float | None
    error: str | None = None
    tokens_out: int = 0


def rungs_of(spec: JobSpec) -> list[Rung]:
    """The ladder's rungs, cheapest first; [] for a one-model spec."""
    return list(spec.models or ())


def check_engines(spec: JobSpec) -> None:
    """Each rung's engine resolves (a dotted path: allowed, importable, an Engine subclass) and, below
    the top under ``confidence: logprobs``, gives token log-probabilities; else SpecError, one line.
    Submit and calibrate call it before anything is written."""
    from batch_inference.engines import engine_class

    ladder = rungs_of(spec)
    for no, rung in enumerate(ladder, 1):
        where = f"spec field 'models[{no}]' ({rung.model.name})"
        try:
            cls = engine_class(rung.engine.name)
        except ValueError as exc:
            raise SpecError(f"{where}: {exc}") from None
        if no < len(ladder) and spec.ladder.confidence == "logprobs" and not cls.gives_logprobs:
            raise SpecError(f"{where}: engine {rung.engine.name!r} gives no token log-probabilities, which "
                            "ladder.confidence 'logprobs' needs")


def rung_spec(spec: JobSpec, rung: Rung, seed_offset: int = 0) -> JobSpec:
    """``spec`` as the one-model spec of ``rung`` (its model, engine and params); ``seed_offset``
    moves the seed (the agreement rule's samples)."""
    params = rung.params.model_dump(mode="json")
    if seed_offset:
        params["seed"] = (params.get("seed") or 0) + seed_offset
    return spec.with_overrides(model=rung.model.model_dump(mode="json"),
                               engine=rung.engine.model_dump(mode="json"), params=params, models=None)


def samples(spec: JobSpec, rung_no: int) -> int:
    """Answers per record at rung ``rung_no`` (1-based): ``ladder.samples`` under the agreement
    rule below the top, else 1 (``JobSpec.rung_samples``)."""
    return spec.rung_samples(rung_no)


def keeps(spec: JobSpec, rung_no: int, answer: Answer) -> bool:
    """Whether rung ``rung_no`` (1-based) keeps ``answer`` as the record's final answer."""
    ladder = rungs_of(spec)
    if not answer.valid:
        return False
    if rung_no >= len(ladder):
        return True
    threshold = ladder[rung_no - 1].threshold
    return threshold is not None and answer.confidence is not None and answer.confidence >= threshold


def compared_fields(spec: JobSpec) -> list[str]:
    """The answer's fields confidence is about: ``ladder.fields``, else the category field; [] for all of it."""
    if spec.ladder.fields:
        return list(spec.ladder.fields)
    cat = spec.category_field
    return [cat] if cat and cat in (spec.output_schema.get("properties") or {}) else []


def _value_spans(text: str, fields: list[str]) -> list[tuple[int, int]] | None:
    """Character spans of the top-level values of ``fields`` in the JSON ``text`` (a string's
    without its quotes); None when one cannot be found."""
    decoder = json.JSONDecoder()
    spans = []
    for name in fields:
        m = re.search(r'"' + re.escape(name) + r'"\s*:\s*', text)
        if m is None:
            return None
        try:
            value, end = decoder.raw_decode(text, m.end())
        except json.JSONDecodeError:
            return None
        start = m.end()
        if isinstance(value, str) and end - start >= 2:
            start, end = start + 1, end - 1
        spans.append((start, end))
    return spans


def from_logprobs(spec: JobSpec, text: str | None,
                  logprobs: tuple[tuple[str, float], ...] | None) -> float | None:
    """The ``logprobs`` confidence of an answer: the probability of the values of the compared fields
    (exp of the summed log-probabilities of the tokens that spell them), or, with no field to
    compare or tokens that do not spell the text, the geometric mean probability of every token."""
    if not logprobs:
        return None
    values = [lp for _, lp in logprobs]
    spans = _value_spans(text or "", compared_fields(spec)) if compared_fields(spec) else None
    # The tokens spell the text, maybe with an end-of-turn token after it (vLLM counts it).
    if spans and "".join(t for t, _ in logprobs).startswith(text or "\x00"):
        picked, at = [], 0
        for token, lp in logprobs:
            end = at + len(token)
            if any(at < e and end > s for s, e in spans):
                picked.append(lp)
            at = end
        if picked:
            total = sum(picked)
            return min(1.0, max(0.0, math.exp(total))) if math.isfinite(total) else 0.0
    mean = sum(values) / len(values)
    return min(1.0, max(0.0, math.exp(mean))) if math.isfinite(mean) else 0.0


def check(spec: JobSpec, record_id: str, text: str | None, error: str | None = None,
          confidence: float | None = None, tokens_out: int = 0) -> Answer:
    """An Answer from one engine outcome, checked as the worker checks what it stores."""
    if error is not None:
        return Answer(record_id, text, False, confidence, error, tokens_out)
    obj, stored, err = check_for_storage(spec, text)
    if obj is None:
        return Answer(record_id, text, False, confidence, err or "not valid", tokens_out)
    return Answer(record_id, stored, True, confidence, None, tokens_out)


def agreement_key(spec: JobSpec, text: str) -> str:
    """What the agreement rule compares of a valid answer: ``ladder.fields``, else the category field, else all."""
    obj = json.loads(text)
    fields = compared_fields(spec)
    picked = {f: obj.get(f) for f in fields} if fields else obj
    return json.dumps(picked, sort_keys=True, ensure_ascii=False)


def agree(spec: JobSpec, record_id: str, answers: list[Answer]) -> Answer:
    """One Answer from a record's sampled answers: the first of the most common valid one, with the
    share of samples that agree with it as its confidence (no valid sample: invalid, confidence 0)."""
    valid = [a for a in answers if a.valid]
    tokens = sum(a.tokens_out for a in answers)
    if not valid:
        last = answers[-1]
        return Answer(record_id, last.text, False, 0.0, last.error, tokens)
    keys = [agreement_key(spec, a.text or "") for a in valid]
    top_key, count = Counter(keys).most_common(1)[0]
    chosen = valid[keys.index(top_key)]
    return Answer(record_id, chosen.text, True, count / len(answers), None, tokens)
