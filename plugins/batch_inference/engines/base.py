"""The engine interface: the one seam between the worker and a model.

An engine turns a batch of chat requests into outcomes, one per record. The
worker owns everything around it (leases, attempts, dead letters, results);
an engine only generates. The contract:

* ``weights_files()`` names the files whose sha256 must equal
  ``spec.model.digest``, or one model directory, hashed whole; the worker
  verifies them (``pinning.verify_weights``) BEFORE ``load()``, so an engine
  never loads weights that are not pinned. Remote endpoints return ``[]``.
* ``result_options`` names the options that change results (a built-in
  engine's is its entry of ``spec.ENGINE_RESULT_OPTIONS``): set in the spec
  they join the job version (``spec.pinned_options``); given at run
  time (``--engine-option``, ``LocalWorkersOperator.engine_options``, the
  fallback pool's options) they must equal the spec's value or the engine
  refuses to start, and left out they keep it. ``refused_options`` are never
  accepted, from the spec or at run time.
* ``load()`` builds the model or client; it may be slow and may raise.
* ``generate(requests, stop)`` yields an :class:`Outcome` per record as soon
  as it completes, in any order. It never raises for a single record's
  failure: that is ``Outcome(error=...)``, and the worker counts it as a failed
  attempt. Once ``stop`` is set it starts no new record; records already in
  flight may still finish and be yielded. Records never started get no
  outcome (they stay pending in the ledger).
* ``close()`` frees the model; it is safe to call twice.

Shard overlap (optional): an engine whose ``queue_depth()`` is above 0 also
implements ``stream(feed, stop)``, one call for as many shards as the worker
holds. It keeps up to ``queue_depth()`` requests unfinished, asking the
:class:`Feed` for more whenever it has room, so the worker can claim and read
the next shard while the current one's last records still generate; it
aborts the requests ``feed.cancelled()`` names (a shard whose lease went
stale, or that drains) and yields no outcome for them; it returns when it is
idle and the feed has nothing more. ``queue_depth() == 0`` (the default):
the worker runs one shard at a time through ``generate``.
"""

from __future__ import annotations

import abc
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from batch_inference.exceptions import InvalidValue
from batch_inference.prompting import build_messages
from batch_inference.spec import JobSpec, pinned_options

TRUNCATED = "output truncated at max_tokens"

# Each built-in engine's name in a spec and the class it loads (``engines.engine_class``).
BUILTIN_ENGINES: dict[str, str] = {
    "llama-cpp": "batch_inference.engines.llama_cpp:LlamaCppEngine",
    "vllm": "batch_inference.engines.vllm:VllmEngine",
    "openai": "batch_inference.engines.openai:OpenAIEngine",
    "noop": "batch_inference.engines.noop:NoopEngine",
    "ladder": "batch_inference.ladder.engine:LadderEngine",
    "openai-batch": "batch_inference.hosted.openai_batch:OpenAIBatchEngine",
    "anthropic-batch": "batch_inference.hosted.anthropic_batch:AnthropicBatchEngine",
    "bedrock-batch": "batch_inference.hosted.bedrock_batch:BedrockBatchEngine",
    "gemini-batch": "batch_inference.hosted.gemini_batch:GeminiBatchEngine",
    # The fallback pool's engine for an endpoint with price tiers (spec.fallback.tiers; batch_inference.tiers).
    "openai-tiers": "batch_inference.tiers.engine:TieredOpenAIEngine",
}
# The class a built-in name loads for an embedding job (``spec.task == "embed"``; its names are
# ``spec.EMBEDDING_ENGINES``): the same engine in its embedding mode (batch_inference.embed.engines).
EMBEDDING_ENGINES: dict[str, str] = {
    "llama-cpp": "batch_inference.embed.engines:LlamaCppEmbedder",
    "vllm": "batch_inference.embed.engines:VllmEmbedder",
    "openai": "batch_inference.embed.engines:OpenAIEmbedder",
    "openai-batch": "batch_inference.embed.engines:OpenAIBatchEmbedder",
}


def builtin_target(name: str, task: str = "generate") -> str:
    """The ``module:Class`` a spec's engine name loads for ``task``; a dotted path is itself."""
    if task == "embed" and name in EMBEDDING_ENGINES:
        return EMBEDDING_ENGINES[name]
    return BUILTIN_ENGINES.get(name, name)


# The longest part of a failed answer a repair turn repeats back to the model.
REPAIR_OUTPUT_CHARS = 2000


@dataclass(frozen=True, slots=True)
class Retry:
    """What a retried request carries: which attempt it is and what was wrong with the last answer.

    ``attempt`` is this request's attempt number (2, 3, ...): the request is sampled with
    seed ``params.seed + attempt - 1`` (``Request.seed``). ``error`` and ``output`` are the last
    failed answer's, when this worker saw it: the request then ends with a repair turn (that
    answer, and a user turn naming its error), so a deterministic engine is not asked the same
    question again. A record whose earlier attempts another worker made, or whose last attempt
    gave no answer (an engine error), has only the new seed."""

    attempt: int
    error: str | None = None
    output: str | None = None

    @property
    def repairs(self) -> bool:
        """The request ends with a repair turn: there was an answer, and what was wrong with it."""
        return bool(self.error and self.output)

    def describe(self) -> str:
        """One line for the attempt's record: how this retry was asked."""
        how = ("a repair turn naming the last error" if self.repairs else
               "no repair turn (the last attempt gave no answer)" if self.error else
               "no repair turn (last error not seen here)")
        return f"retry: attempt {self.attempt}, {how}, seed offset {self.attempt - 1}"


def repair_turns(retry: Retry) -> list[dict[str, str]]:
    """The assistant's last answer and a user turn naming what was wrong with it."""
    error = (retry.error or "").split("\n", 1)[0]
    answer = (retry.output or "")[:REPAIR_OUTPUT_CHARS]
    return [{"role": "assistant", "content": answer},
            {"role": "user", "content": f"That answer is not valid: {error}. Answer again with only the JSON "
                                        "object, every field within the schema's limits."}]


class Request:
    """One record as chat messages (system turn, then user turn).

    Made with its ``messages``, or with the job's ``spec`` and the record's
    ``text`` (``build_request``): the messages are then rendered on
    first read, once, so an engine that never reads them (the noop engine,
    unless a record holds one of its markers) does not render them. A
    retried request (``retry``) ends with the repair turns of its last
    failed answer (``repair_turns``) and samples with another seed (``seed``)."""

    __slots__ = ("record_id", "text", "spec", "retry", "_messages")

    def __init__(self, record_id: str, messages: list[dict[str, str]] | None = None, *,
                 spec: JobSpec | None = None, text: str | None = None, retry: Retry | None = None):
        if messages is None and (spec is None or text is None):
            raise TypeError("a Request needs its messages, or the spec and the record's text")
        self.record_id = record_id
        self.text = text
        self.spec = spec
        self.retry = retry
        self._messages = messages

    @property
    def messages(self) -> list[dict[str, str]]:
        if self._messages is None:
            self._messages = build_messages(self.spec, self.text)
            if self.retry is not None and self.retry.repairs:
                self._messages = [*self._messages, *repair_turns(self.retry)]
        return self._messages

    def seed(self, base: int | None) -> int | None:
        """The sampling seed of this request: ``base``, moved on by one per earlier attempt."""
        if base is None or self.retry is None:
            return base
        return base + self.retry.attempt - 1

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return NotImplemented
        return self.record_id == other.record_id and self.messages == other.messages

    __hash__ = None  # type: ignore[assignment]  # messages are a list

    def __repr__(self) -> str:
        return f"Request(record_id={self.record_id!r}, messages={self.messages!r})"


def build_request(spec: JobSpec, record_id: str, text: str, retry: Retry | None = None) -> Request:
    """The request for one record (``retry``: a later attempt); its messages are rendered when an
    engine first reads them."""
    return Request(record_id, spec=spec, text=text, retry=retry)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an engine made of one record.

    ``error`` set means a failed attempt; ``text`` may then still hold the raw
    output (a truncated generation, say) for the dead-letter record. An
    embedding engine sets ``vector`` (a sequence of floats) instead of ``text``.
    """

    record_id: str
    text: str | None
    error: str | None = None
    tokens_out: int = 0
    vector: Any = None
    # The answer's tokens with their log-probabilities, ((token text, logprob), ...), from an
    # engine asked for them (``Engine.want_logprobs``); None when not asked or not given.
    logprobs: tuple[tuple[str, float], ...] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Feed(Protocol):
    """What the worker hands ``Engine.stream``: records to queue, and records to drop."""

    def refill(self, room: int, idle: bool) -> list[Request]:
        """At most ``room`` requests to queue now. ``idle``: the engine has nothing
        unfinished; the feed may then wait for work (a retry's backoff), and an
        empty answer ends the stream."""

    def cancelled(self) -> list[str]:
        """Record ids to abort now (their shard stopped); each is named once."""


class Engine(abc.ABC):
    """Base class of every engine; see the module docstring for the contract.

    Subclasses set ``name`` and may set ``option_names`` so that a misspelt
    option fails at construction instead of being silently ignored, and
    ``result_options`` / ``refused_options`` (see the module docstring).
    """

    name: ClassVar[str]
    option_names: ClassVar[frozenset[str] | None] = None
    result_options: ClassVar[frozenset[str]] = frozenset()
    refused_options: ClassVar[dict[str, str]] = {}   # option -> why it is refused
    result_defaults: ClassVar[dict[str, Any]] = {}   # a result option's value when the spec does not set it
    # The ledger transport of a batch worker running this engine.
    transport: ClassVar[str] = "batch"
    # True: a careful (re-leased) shard is still sent as one request set, not in batches of careful_batch.
    whole_shard: ClassVar[bool] = False
    # True: set ``want_logprobs`` before ``load()`` and each Outcome carries ``logprobs``
    # (a built-in engine's is its membership of ``spec.ENGINES_WITH_LOGPROBS``).
    gives_logprobs: ClassVar[bool] = False
    want_logprobs: bool = False
    # The output-schema limits (``SCHEMA_LIMITS``) this engine's constrained decoding enforces;
    # None: it does not constrain decoding itself (its answers are only validated afterwards).
    enforces: ClassVar[frozenset[str] | None] = None

    def __init__(self, spec: JobSpec, options: dict[str, Any] | None = None):
        self.spec = spec
        # None means "what the spec says"; callers such as the fallback pool
        # pass their own options for the same spec.
        given = dict(spec.engine.options if options is None else options)
        for key in sorted(set(given) & set(self.refused_options)):
            raise InvalidValue(f"engine '{self.name}': option '{key}' is refused: {self.refused_options[key]}")
        if self.option_names is not None:
            unknown = sorted(set(given) - self.option_names)
            if unknown:
                known = ", ".join(sorted(self.option_names)) or "none"
                raise InvalidValue(f"engine '{self.name}': unknown option '{unknown[0]}' (known: {known})")
        self.options: dict[str, Any] = self._pin(given)

    def _pin(self, given: dict[str, Any]) -> dict[str, Any]:
        """``given`` with every result option equal to the spec's: a left-out one
        takes the spec's value, a different one is refused."""
        spec_name = self.spec.engine.name
        target = builtin_target(spec_name, self.spec.task).replace(":", ".")
        mine = f"{type(self).__module__}.{type(self).__qualname__}"
        pinned = pinned_options(spec_name, self.spec.engine.options) if target == mine else {}
        out = dict(given)
        for key in sorted(self.result_options):
            want = pinned.get(key, self.result_default(key))
            if given.get(key) is None:
                if key in pinned:
                    out[key] = pinned[key]
            elif given[key] != want:
                raise InvalidValue(
                    f"engine '{self.name}': option '{key}' changes results, so it is pinned by the job version: "
                    f"set it in the spec's engine.options (a new job version), not at run time")
        return out

    @classmethod
    def unenforced(cls, schema: dict[str, Any]) -> list[str]:
        """``path: keyword`` for each limit of ``schema`` this engine's decoding does not enforce
        (what ``submit`` reports); [] for an engine that does not constrain decoding. Every
        answer is validated against the whole schema after generation either way."""
        if cls.enforces is None:
            return []
        return [f"{path}: {keyword}" for path, keyword in schema_limits(schema) if keyword not in cls.enforces]

    def result_default(self, key: str) -> Any:
        """The value a result option has when the spec does not set it (None: unset)."""
        return self.result_defaults.get(key)

    def option(self, key: str, default: Any = None) -> Any:
        value = self.options.get(key)
        return default if value is None else value

    def weights_files(self) -> list[Path]:
        """Files whose sha256 must equal ``spec.model.digest``; ``[]`` for remote endpoints."""
        return []

    @abc.abstractmethod
    def load(self) -> None:
        """Load the model or open the client. Called after digest verification."""

    @abc.abstractmethod
    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        """Yield one outcome per started record as it completes; see the module docstring."""

    def queue_depth(self) -> int:
        """How many requests ``stream`` keeps unfinished (vLLM: its maximum number of
        sequences); 0: no ``stream``, the worker runs one shard at a time."""
        return 0

    def stream(self, feed: Feed, stop: threading.Event) -> Iterator[Outcome]:
        """Yield one outcome per started record of every request ``feed`` hands over;
        see the module docstring. Only for an engine whose ``queue_depth()`` is above 0."""
        raise NotImplementedError(f"engine '{self.name}' does not stream")

    def begin_shard(self, ledger: Any, lease: Any, drain: threading.Event) -> None:
        """The worker leased a shard (``ledger.Ledger``, ``ledger.Lease``); ``drain`` is set
        when the cutoff fires. Engines that keep per-shard state at a provider use it."""

    def end_shard(self, lease: Any) -> None:
        """The worker stored every outcome of the shard's last ``generate``."""

    def close(self) -> None:
        """Release the model. Idempotent."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The JSON Schema keywords that limit a value: what constrained decoding may or may not enforce.
SCHEMA_LIMITS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
                 "maxLength", "pattern", "minItems", "maxItems", "uniqueItems")


def schema_limits(schema: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, keyword) for each ``SCHEMA_LIMITS`` keyword in ``schema`` and its subschemas
    (properties ``a.b``, items ``a[]``, tuple items ``a[0]``, definitions ``#name``)."""
    if not isinstance(schema, dict):
        return
    for keyword in SCHEMA_LIMITS:
        if keyword in schema:
            yield path or "(root)", keyword
    for name, sub in (schema.get("properties") or {}).items():
        yield from schema_limits(sub, f"{path}.{name}" if path else name)
    yield from schema_limits(schema.get("items"), f"{path}[]")
    for i, sub in enumerate(schema.get("prefixItems") or ()):
        yield from schema_limits(sub, f"{path}[{i}]")
    yield from schema_limits(schema.get("additionalProperties"), f"{path}.*" if path else "*")
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            yield from schema_limits(sub, path)
    for key in ("$defs", "definitions"):
        for name, sub in (schema.get(key) or {}).items():
            yield from schema_limits(sub, f"#{name}")


def without_limits(schema: Any, drop: frozenset[str]) -> Any:
    """A copy of ``schema`` without the ``drop`` keywords in it or any subschema (what an engine
    leaves out of its constraint because its decoder refuses them); the rest is unchanged."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if k not in drop}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: without_limits(sub, drop) for name, sub in out[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = without_limits(out[key], drop)
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [without_limits(sub, drop) for sub in out[key]]
    return out


def one_line(exc: BaseException | str, limit: int = 400) -> str:
    """An exception as one bounded line, fit for an Outcome error or a log."""
    text = exc if isinstance(exc, str) else (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_chat_completion(record_id: str, result: dict[str, Any]) -> Outcome:
    """An Outcome from an OpenAI-style chat completion dict (llama.cpp returns the same shape)."""
    try:
        choice = result["choices"][0]
        text = choice["message"].get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        return Outcome(record_id, None, error="response has no choices[0].message")
    tokens = int((result.get("usage") or {}).get("completion_tokens") or 0)
    if choice.get("finish_reason") == "length":
        return Outcome(record_id, text, error=TRUNCATED, tokens_out=tokens)
    if text is None:
        return Outcome(record_id, None, error="response message has no content", tokens_out=tokens)
    return Outcome(record_id, text, tokens_out=tokens, logprobs=token_logprobs(choice.get("logprobs")))


def token_logprobs(logprobs: Any) -> tuple[tuple[str, float], ...] | None:
    """The (token, logprob) pairs of a chat completion's ``choices[0].logprobs``
    (``{"content": [{"token", "logprob"}, ...]}``), or None when it has none."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    out = []
    for t in content or ():
        try:   # llama.cpp gives numpy floats; a server, JSON numbers
            v = float(t["logprob"])
        except (TypeError, ValueError, KeyError):
            return None
        out.append((str(t.get("token") or ""), v if math.isfinite(v) else -math.inf))
    return tuple(out) or None
