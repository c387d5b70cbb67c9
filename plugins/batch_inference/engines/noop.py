"""The noop engine: instant, schema-valid answers with no model.

For benchmarks (how fast can the ledger, worker and result writes go when the
model costs nothing?) and for the chaos harness (inject delays, engine errors
and invalid outputs at chosen rates). Never a default and never a source of
real labels: every record gets the same smallest valid instance of
``spec.output_schema``.

Options:

* ``delay_s`` (float, 0): sleep per record, to make shards slow enough to preempt.
* ``fail_rate`` (0..1, 0): share of records answered with an engine error.
* ``invalid_rate`` (0..1, 0): share answered with output that fails the schema.
* ``max_num_seqs`` (int, 0): above 0, the engine streams across shards
  (``Engine.stream``) with this many requests queued, as vLLM does with its
  batch: the worker then overlaps shards. 0: one shard at a time.
* ``step_s`` (float, 0): when streaming, answer in engine steps as vLLM does:
  each step takes ``step_s`` whatever happens meanwhile (a model forward is
  not cut short by a stop or a signal) and answers the ``per_step`` oldest
  queued requests (int, 0: all of them).
* ``seed`` (int, 0): seeds the draws. One generator per engine instance, drawn
  once per record in order, so a retried record fails independently (a
  fixed per-record draw would make ``fail_rate`` a dead-letter rate).

Poison markers in a record's text force an outcome whatever the rates:
``[[engine-error]]`` always yields an engine error, ``[[invalid-output]]``
always yields output that fails schema validation.

Three derived engines, loaded by dotted path (the chaos harness runs a model
ladder and an embedding job on the first two, the nights harness its batch on
the third):

* ``ScoredNoopEngine`` (``batch_inference.engines.noop:ScoredNoopEngine``):
  gives token log-probabilities when asked (``want_logprobs``, the model
  ladder's ``logprobs`` confidence). Its answer is one token, sure
  (probability ``SURE``) or, for the share ``unsure_rate`` of records drawn
  from the record id (``is_unsure``: the same records in every run and on
  every retry), unsure (``UNSURE``).
* ``NoopEmbedder`` (``batch_inference.engines.noop:NoopEmbedder``): an
  embedding mode (``embeds``): a vector of ``embedding.dimensions`` values
  drawn from the sha256 of the rendered input, so equal inputs get equal
  vectors. ``[[engine-error]]`` yields an engine error, ``[[invalid-output]]``
  a vector one dimension short (the worker's vector check fails it).
* ``PacedEngine`` (``PACED_ENGINE``): another engine (``inner``, default
  noop) at a set throughput that a file can slow while it runs: here,
  beside the engine it paces, so that a worker process loading it imports
  no harness.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from batch_inference.engines.base import Engine, Feed, Outcome, Request
from batch_inference.exceptions import InvalidValue

ENGINE_ERROR_MARKER = "[[engine-error]]"
INVALID_OUTPUT_MARKER = "[[invalid-output]]"
# A JSON array: parses, but can never satisfy an output schema, which the
# spec requires to be an object.
INVALID_OUTPUT = '["noop: deliberately invalid output"]'


class NoopEngine(Engine):
    name = "noop"
    option_names = frozenset({"delay_s", "fail_rate", "invalid_rate", "seed", "max_num_seqs", "step_s", "per_step"})

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        self.delay_s = float(self.option("delay_s", 0.0))
        self.fail_rate = float(self.option("fail_rate", 0.0))
        self.invalid_rate = float(self.option("invalid_rate", 0.0))
        for key in ("fail_rate", "invalid_rate"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise InvalidValue(f"engine 'noop': option '{key}' must be between 0 and 1")
        if self.delay_s < 0:
            raise InvalidValue("engine 'noop': option 'delay_s' must not be negative")
        self.step_s = float(self.option("step_s", 0.0))
        self.per_step = int(self.option("per_step", 0))
        if self.step_s < 0 or self.per_step < 0:
            raise InvalidValue("engine 'noop': options 'step_s' and 'per_step' must not be negative")
        self.max_num_seqs = int(self.option("max_num_seqs", 0))
        if self.max_num_seqs < 0:
            raise InvalidValue("engine 'noop': option 'max_num_seqs' must not be negative")
        self._rng = random.Random(int(self.option("seed", 0)))
        self._answer = json.dumps(minimal_instance(spec.output_schema), separators=(",", ":"))
        # Rendering cuts the record, breaks up delimiters with spaces and puts
        # it into the template; a marker (no spaces) in the user turn is then
        # in the record itself, unless the template holds part of one: with no
        # bracket in the template, a record without a marker needs no
        # rendering to tell.
        self._markers_only_in_record = "[" not in spec.prompt.template and "]" not in spec.prompt.template
        # Draws decide nothing at rate 0, so none are made.
        self._draws = self.fail_rate > 0 or self.invalid_rate > 0

    def load(self) -> None:
        pass

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        for req in requests:
            if stop.is_set():
                return
            if self.delay_s:
                # wait() rather than sleep(): a stop cuts the delay short, and
                # the record in hand is still answered (it was in flight).
                stop.wait(self.delay_s)
            yield self._answer_for(req)

    def queue_depth(self) -> int:
        return self.max_num_seqs

    def stream(self, feed: Feed, stop: threading.Event) -> Iterator[Outcome]:
        queue: deque[Request] = deque()
        while not stop.is_set():
            cancelled = set(feed.cancelled())
            if cancelled:
                queue = deque(r for r in queue if r.record_id not in cancelled)
            if len(queue) < self.max_num_seqs:
                queue.extend(feed.refill(self.max_num_seqs - len(queue), not queue))
            if not queue:
                return
            if self.step_s:
                time.sleep(self.step_s)   # a signal runs its handler, then the step goes on
                for _ in range(min(self.per_step or len(queue), len(queue))):
                    yield self._answer_for(queue.popleft())
                continue
            req = queue.popleft()
            if self.delay_s:
                stop.wait(self.delay_s)
            yield self._answer_for(req)

    def _answer_for(self, req: Request) -> Outcome:
        # Markers count in the record (user turn) only, not in the system prompt.
        raw = req.text
        if raw is not None and self._markers_only_in_record and ENGINE_ERROR_MARKER not in raw \
                and INVALID_OUTPUT_MARKER not in raw:
            text = ""
        else:
            text = "\n".join(m.get("content", "") for m in req.messages if m.get("role") == "user")
        # Draw both numbers for every record so that the sequence of draws,
        # and so the faults, do not depend on which markers appear.
        fail_draw, invalid_draw = (self._rng.random(), self._rng.random()) if self._draws else (1.0, 1.0)
        if ENGINE_ERROR_MARKER in text or fail_draw < self.fail_rate:
            return Outcome(req.record_id, None, error="noop: injected engine error")
        if INVALID_OUTPUT_MARKER in text or invalid_draw < self.invalid_rate:
            return Outcome(req.record_id, INVALID_OUTPUT)
        return Outcome(req.record_id, self._answer)


# Token probabilities of ScoredNoopEngine's answers.
SURE = 0.99
UNSURE = 0.1


def is_unsure(record_id: str, rate: float) -> bool:
    """Whether ``ScoredNoopEngine`` with ``unsure_rate`` ``rate`` is unsure of record ``record_id``."""
    draw = int(hashlib.sha256(f"unsure\x1f{record_id}".encode()).hexdigest()[:8], 16) / 2**32
    return draw < rate


class ScoredNoopEngine(NoopEngine):
    """The noop engine with token log-probabilities (see the module docstring). Option
    ``unsure_rate`` (0..1, 0): the share of records it is unsure of."""

    gives_logprobs = True
    option_names = NoopEngine.option_names | {"unsure_rate"}

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        self.unsure_rate = float(self.option("unsure_rate", 0.0))
        if not 0.0 <= self.unsure_rate <= 1.0:
            raise InvalidValue("engine 'noop': option 'unsure_rate' must be between 0 and 1")

    def _answer_for(self, req: Request) -> Outcome:
        out = super()._answer_for(req)
        if not self.want_logprobs or out.error is not None or out.text is None:
            return out
        p = UNSURE if is_unsure(req.record_id, self.unsure_rate) else SURE
        return Outcome(out.record_id, out.text, tokens_out=1, logprobs=((out.text, math.log(p)),))


class NoopEmbedder(NoopEngine):
    """The noop engine's embedding mode (see the module docstring)."""

    embeds = True

    def _answer_for(self, req: Request) -> Outcome:
        out = super()._answer_for(req)
        if out.error is not None:
            return out
        from batch_inference.prompting import render_record

        dims = self.spec.embedding.dimensions
        text = self.spec.embedding.instruction + render_record(self.spec, req.text or "")
        seed = hashlib.sha256(text.encode()).digest()
        vector = [b / 255.0 - 0.5 for b in (seed * (dims // len(seed) + 1))[:dims]]
        if out.text == INVALID_OUTPUT:
            vector = vector[:-1]
        return Outcome(req.record_id, None, vector=vector)


PACED_ENGINE = "batch_inference.engines.noop:PacedEngine"   # its --engine path


class PacedEngine(Engine):
    """The noop engine at a night's batch throughput (the nights harness's workers): each answer takes
    ``delay_s`` times the factor in ``pace_file`` (1 when absent), so the harness can slow the batch from
    any second on without restarting a worker. Options: ``inner`` (default noop), ``delay_s``, ``pace_file``."""

    name = "paced"
    option_names = None

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        opts = dict(self.options)
        inner = str(opts.pop("inner", "noop"))
        self.delay_s = float(opts.pop("delay_s", 0.0))
        self.pace_file = opts.pop("pace_file", None)
        from batch_inference.engines import load_engine

        self.inner = load_engine(inner, spec, opts)

    def weights_files(self) -> list[Path]:
        return self.inner.weights_files()

    def load(self) -> None:
        self.inner.load()

    def _factor(self) -> float:
        if not self.pace_file:
            return 1.0
        try:
            return float(Path(self.pace_file).read_text() or 1.0)
        except (OSError, ValueError):
            return 1.0

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        for outcome in self.inner.generate(requests, stop):
            if self.delay_s:
                stop.wait(self.delay_s * self._factor())
            yield outcome

    def close(self) -> None:
        self.inner.close()


# -- the smallest valid instance of a JSON schema ---------------------------

_FORMAT_EXAMPLES = {
    "date": "1970-01-01",
    "date-time": "1970-01-01T00:00:00Z",
    "time": "00:00:00Z",
    "email": "a@example.com",
    "uri": "urn:a",
    "uuid": "00000000-0000-0000-0000-000000000000",
    "ipv4": "0.0.0.0",
    "ipv6": "::",
    "hostname": "a",
}


def minimal_instance(schema: Any, root: Any = None) -> Any:
    """The smallest JSON value valid for ``schema`` (Draft 2020-12 subset).

    Enums give their first value, objects their required properties only,
    strings ``minLength`` characters, numbers their minimum (or 0), arrays
    ``minItems`` items; ``$ref`` to local ``$defs``, ``allOf``, ``anyOf`` and
    ``oneOf`` (first branch) are followed. ``pattern`` is met only when a short
    run of one character matches it; ``not``, ``if``/``then`` and
    ``dependentSchemas`` are not solved.
    """
    root = schema if root is None else root
    if schema is True or not isinstance(schema, dict):
        return None
    schema = _flatten(schema, root)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = "null" if "null" in kind else kind[0]
    if kind is None:
        kind = _infer_type(schema)
    if kind == "object":
        return _minimal_object(schema, root)
    if kind == "array":
        return _minimal_array(schema, root)
    if kind == "string":
        return _minimal_string(schema)
    if kind in ("integer", "number"):
        return _minimal_number(schema, integer=kind == "integer")
    if kind == "boolean":
        return False
    return None


def _resolve(ref: str, root: Any) -> Any:
    if not ref.startswith("#"):
        raise InvalidValue(f"noop engine: only local $ref is supported, got '{ref}'")
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def _flatten(schema: dict[str, Any], root: Any, depth: int = 0) -> dict[str, Any]:
    """Fold $ref, allOf and the first anyOf/oneOf branch into one schema."""
    if depth > 32:
        raise InvalidValue("noop engine: schema references nest too deeply")
    schema = dict(schema)
    if "$ref" in schema:
        target = _resolve(schema.pop("$ref"), root)
        schema = _merge(_flatten(target, root, depth + 1) if isinstance(target, dict) else {}, schema)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            branches = schema.pop(key)
            schema = _merge(schema, _flatten(branches[0], root, depth + 1) if isinstance(branches[0], dict) else {})
    for sub in schema.pop("allOf", []):
        if isinstance(sub, dict):
            schema = _merge(schema, _flatten(sub, root, depth + 1))
    return schema


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {**a, **b}
    if "properties" in a and "properties" in b:
        out["properties"] = {**a["properties"], **b["properties"]}
    if "required" in a and "required" in b:
        out["required"] = list(dict.fromkeys([*a["required"], *b["required"]]))
    for key in ("minLength", "minItems", "minProperties", "minimum"):
        if key in a and key in b:
            out[key] = max(a[key], b[key])
    return out


def _infer_type(schema: dict[str, Any]) -> str:
    if {"properties", "required", "additionalProperties", "minProperties"} & schema.keys():
        return "object"
    if {"items", "prefixItems", "minItems"} & schema.keys():
        return "array"
    if {"minLength", "maxLength", "pattern", "format"} & schema.keys():
        return "string"
    if {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"} & schema.keys():
        return "number"
    return "null"


def _minimal_object(schema: dict[str, Any], root: Any) -> dict[str, Any]:
    props = schema.get("properties", {})
    names = list(schema.get("required", []))
    # minProperties beyond the required ones: take declared properties in order.
    for extra in props:
        if len(names) >= schema.get("minProperties", 0):
            break
        if extra not in names:
            names.append(extra)
    fallback = schema.get("additionalProperties", {})
    return {n: minimal_instance(props.get(n, fallback), root) for n in names}


def _minimal_array(schema: dict[str, Any], root: Any) -> list[Any]:
    n = schema.get("minItems", 0)
    prefix = schema.get("prefixItems", [])
    items = schema.get("items", {})
    out = [minimal_instance(s, root) for s in prefix[:n]]
    if len(out) < n:
        rest = n - len(out)
        flat = _flatten(items, root) if isinstance(items, dict) else {}
        if schema.get("uniqueItems") and "enum" in flat:
            out.extend(flat["enum"][:rest])
        elif schema.get("uniqueItems") and flat.get("type") in ("integer", "number"):
            start = minimal_instance(flat, root)
            out.extend(start + i for i in range(rest))
        else:
            out.extend(minimal_instance(items, root) for _ in range(rest))
    return out


def _minimal_string(schema: dict[str, Any]) -> str:
    n = schema.get("minLength", 0)
    fmt = schema.get("format")
    if fmt in _FORMAT_EXAMPLES and len(_FORMAT_EXAMPLES[fmt]) >= n:
        return _FORMAT_EXAMPLES[fmt]
    pattern = schema.get("pattern")
    if pattern:
        for ch in "a0A -_.":
            for k in range(n, n + 8):
                if re.search(pattern, ch * k):
                    return ch * k
    return "x" * n


def _minimal_number(schema: dict[str, Any], integer: bool) -> int | float:
    lo, xlo = schema.get("minimum"), schema.get("exclusiveMinimum")
    hi, xhi = schema.get("maximum"), schema.get("exclusiveMaximum")
    if xlo is not None and (lo is None or xlo >= lo):
        # Strictly above: the next integer, or halfway to the ceiling for numbers.
        ceiling = xhi if xhi is not None else hi
        if integer:
            value: float = math.floor(xlo) + 1
        elif ceiling is not None:
            value = (xlo + ceiling) / 2
        else:
            value = xlo + 1
    elif lo is not None:
        value = lo
    else:
        value = 0
        if hi is not None and hi < value:
            value = hi
        if xhi is not None and xhi <= value:
            value = xhi - 1
    step = schema.get("multipleOf")
    if step:
        value = math.ceil(value / step) * step
    if integer or float(value).is_integer():
        return int(math.ceil(value))
    return value
