"""The vllm engine: offline batched generation (the GPU runner image; vllm-cpu in the tests).

One ``vllm.LLM`` per worker process, prefix caching on (every request of a
job shares its system turn). A shard's records are queued together
(``LLM.enqueue_chat``, the same rendering as ``LLM.chat``) and the engine is
stepped here (``LLMEngine.step``), so vLLM's scheduler batches them freely,
each outcome is yielded as its record finishes (the worker writes while the
rest generate), and a set ``stop`` aborts every unfinished request at once:
a preempted or drained shard gives its GPU back within one step, and the
aborted records get no outcome (they stay pending in the ledger, no attempt
spent). JSON output is enforced with
``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))``
(``ENFORCED_LIMITS``: what it enforces; ``REFUSED_LIMITS`` are left out of
the constraint and reported at submit). A retried record gets its own seed.

A prompt vLLM refuses when it is queued (longer than ``max_model_len``)
is that record's failed attempt; the rest of the shard goes on. An
exception from a step is the engine's, not a record's: it propagates and
the worker gives the shard back (``Worker._process``).

Weights: ``spec.model.path`` is a model directory (config, tokenizer, chat
template, generation config and ``*.safetensors``) mounted into the pod; the
digest is taken over every file in it, recursively (``pinning.sha256_tree``),
a code file in it is refused unless ``spec.model.code_files`` declares it,
vLLM is told to load safetensors only, and the Hugging Face hub is switched
off (``HF_HUB_OFFLINE``) so nothing is fetched that was not hashed.

Options passed to ``vllm.LLM``: ``tensor_parallel_size``,
``gpu_memory_utilization``, ``kv_cache_memory_bytes``, ``max_num_seqs``,
``enforce_eager`` (speed and memory only), and ``RESULT_OPTIONS``
(``dtype``, ``quantization``, ``max_model_len``, ``trust_remote_code``,
``tokenizer_mode``, ``kv_cache_dtype``, ``hf_overrides``,
``generation_config``, ``override_generation_config``, ``seed``), which
change results and so join the job version. ``model``, ``tokenizer``,
``chat_template``, the revisions, ``load_format``, ``download_dir`` and
``hf_token`` are refused: the model is ``spec.model.path``, pinned by
digest. ``llm_kwargs`` (dict) passes any other ``vllm.LLM`` argument, none
of those; a name vLLM does not know is refused at construction, where
vLLM is installed.

Shards overlap (``stream``): the engine keeps up to vLLM's maximum number of
sequences (``max_num_seqs``) unfinished, and asks the worker's feed for more
records whenever fewer are, so the next shard's records join the batch while
the current shard's last ones still decode; a shard the worker stops (a
stale lease, a drain) has its unfinished requests aborted, and the others
go on.

At each completed shard the engine logs vLLM's prefix-cache hit rate: the
prompt tokens vLLM served from its cache (``RequestOutput.num_cached_tokens``)
over all prompt tokens of the requests finished since the last such line.
``meter`` (:class:`StepMeter`) counts engine steps, their time, the time
between steps (the engine waiting on the worker) and the batch slots left
empty: what the benchmark reports as idle time at shard boundaries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from batch_inference.engines.base import (SCHEMA_LIMITS, TRUNCATED, Engine, Feed, Outcome, Request, one_line,
                                          without_limits)
from batch_inference.exceptions import InvalidValue
from batch_inference.pinning import WeightsMissing
from batch_inference.spec import ENGINES_WITH_LOGPROBS, JobSpec

log = logging.getLogger("batch_inference.engines.vllm")

RESULT_OPTIONS = ("dtype", "quantization", "max_model_len", "trust_remote_code", "tokenizer_mode", "kv_cache_dtype",
                  "hf_overrides", "generation_config", "override_generation_config", "seed")
LLM_OPTIONS = ("tensor_parallel_size", "gpu_memory_utilization", "kv_cache_memory_bytes", "max_num_seqs",
               "enforce_eager", *RESULT_OPTIONS)
_PINNED_BY_DIGEST = "the model is spec.model.path, pinned by spec.model.digest"
REFUSED_OPTIONS = {
    "model": _PINNED_BY_DIGEST,
    "tokenizer": "the tokenizer is the model directory's, pinned by spec.model.digest",
    "chat_template": "the chat template is the model directory's, pinned by spec.model.digest",
    "revision": _PINNED_BY_DIGEST, "tokenizer_revision": _PINNED_BY_DIGEST, "code_revision": _PINNED_BY_DIGEST,
    "download_dir": _PINNED_BY_DIGEST, "hf_token": _PINNED_BY_DIGEST,
    "load_format": "the engine loads safetensors only: the files whose digest was verified",
}
INSTALL_HINT = ("pip install 'airflow-provider-batch-inference[vllm]' (the GPU runner image has it; on x86 CPUs "
                "'[vllm-cpu]', see docs/engines.md)")


def model_dir(spec: JobSpec) -> Path:
    if not spec.model.path:
        raise InvalidValue("engine 'vllm': spec.model.path must name the mounted model directory")
    return Path(spec.model.path)


def safetensors_files(path: Path) -> list[Path]:
    """The weights to hash, sorted by name; a directory without any is an error, never 'nothing to verify'."""
    files = sorted(path.glob("*.safetensors"), key=lambda p: p.name)
    if not files:
        raise WeightsMissing(f"engine 'vllm': no *.safetensors files in {path}")
    return files


def build_llm_kwargs(spec: JobSpec, options: dict[str, Any]) -> dict[str, Any]:
    """Arguments for ``vllm.LLM``."""
    kwargs: dict[str, Any] = {"enable_prefix_caching": True}
    kwargs.update(options.get("llm_kwargs") or {})
    for key in LLM_OPTIONS:
        if options.get(key) is not None:
            kwargs[key] = options[key]
    # Load exactly the files whose digest was verified (set last: nothing overrides them).
    kwargs.update(model=str(model_dir(spec)), load_format="safetensors")
    return kwargs


def check_llm_kwargs(llm_kwargs: Any) -> None:
    """``llm_kwargs`` may hold no refused option and no option that changes results."""
    if llm_kwargs is None:
        return
    if not isinstance(llm_kwargs, dict):
        raise InvalidValue("engine 'vllm': option 'llm_kwargs' must be a mapping")
    for key in sorted(llm_kwargs):
        if key in REFUSED_OPTIONS:
            raise InvalidValue(f"engine 'vllm': option 'llm_kwargs.{key}' is refused: {REFUSED_OPTIONS[key]}")
        if key in LLM_OPTIONS or key == "enable_prefix_caching":
            what = "changes results" if key in RESULT_OPTIONS else "is an engine option"
            raise InvalidValue(f"engine 'vllm': option 'llm_kwargs.{key}' {what}: give it as the option '{key}' "
                             "(in the spec's engine.options when it changes results)")


def vllm_argument_names() -> frozenset[str] | None:
    """Every argument ``vllm.LLM`` accepts (its own and ``EngineArgs``'), or None when vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    own = {n for n, p in inspect.signature(LLM.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY}
    return frozenset(own | {f.name for f in dataclasses.fields(EngineArgs)})


def check_vllm_accepts(kwargs: dict[str, Any]) -> None:
    """Refuse (one line) an argument this vLLM does not know, before anything loads (none given: vLLM is
    not imported, so building the engine to check its weights at submit stays cheap)."""
    if not kwargs:
        return
    known = vllm_argument_names()
    if known is None:
        return
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise InvalidValue(f"engine 'vllm': vLLM does not accept the argument '{unknown[0]}' (from llm_kwargs)")


def build_sampling_kwargs(spec: JobSpec) -> dict[str, Any]:
    """Arguments for ``SamplingParams`` except the structured-output constraint."""
    p = spec.params
    return {"temperature": p.temperature, "max_tokens": p.max_tokens, "top_p": p.top_p, "seed": p.seed}


# Limits vLLM's structured outputs refuse (a request whose schema holds one fails: "Unimplemented keys"
# from its guidance fallback, vllm-cpu 0.32): left out of the constraint, reported at submit.
REFUSED_LIMITS = frozenset({"uniqueItems"})
# What vLLM 0.32 enforces while generating, tried on the CPU build (docs/engines.md): xgrammar takes
# bounds, lengths, patterns and item counts; a schema with multipleOf (or a pattern beside a length)
# goes to its guidance backend, which enforces those too.
ENFORCED_LIMITS = frozenset(SCHEMA_LIMITS) - REFUSED_LIMITS


def build_structured_kwargs(spec: JobSpec) -> dict[str, Any]:
    """Arguments for ``StructuredOutputsParams``: the output schema as a JSON constraint, without
    the limits vLLM refuses (``REFUSED_LIMITS``; the answer is still validated against them)."""
    return {"json": without_limits(spec.output_schema, REFUSED_LIMITS)}


def make_sampling_params(sampling_module: Any, spec: JobSpec, logprobs: bool = False) -> Any:
    """``SamplingParams`` from ``vllm.sampling_params``, with the output schema as its JSON constraint;
    ``logprobs``: each generated token's log-probability too (``logprobs=1``)."""
    structured = sampling_module.StructuredOutputsParams(**build_structured_kwargs(spec))
    extra = {"logprobs": 1} if logprobs else {}
    return sampling_module.SamplingParams(**build_sampling_kwargs(spec), **extra, structured_outputs=structured)


def build_conversations(requests: Sequence[Request]) -> list[list[dict[str, str]]]:
    """One conversation per request, in request order."""
    return [[dict(m) for m in r.messages] for r in requests]


def parse_request_output(record_id: str, output: Any) -> Outcome:
    """An Outcome from a ``vllm.RequestOutput``: ``.outputs[0]`` with ``.text``, ``.finish_reason``, ``.token_ids``."""
    completions = getattr(output, "outputs", None) or []
    if not completions:
        return Outcome(record_id, None, error="vLLM returned no completion")
    c = completions[0]
    text = getattr(c, "text", None)
    tokens = len(getattr(c, "token_ids", None) or ())
    reason = getattr(c, "finish_reason", None)
    if reason == "length":
        return Outcome(record_id, text, error=TRUNCATED, tokens_out=tokens)
    if reason == "abort":
        return Outcome(record_id, text, error="generation aborted by vLLM", tokens_out=tokens)
    if text is None:
        return Outcome(record_id, None, error="vLLM completion has no text", tokens_out=tokens)
    return Outcome(record_id, text, tokens_out=tokens, logprobs=sampled_logprobs(c))


def sampled_logprobs(completion: Any) -> tuple[tuple[str, float], ...] | None:
    """(token text, log-probability) of each token a ``CompletionOutput`` generated, from its
    ``logprobs`` (one dict per position: token id -> ``Logprob(logprob, rank, decoded_token)``);
    None when it was not asked for them."""
    positions, ids = getattr(completion, "logprobs", None), getattr(completion, "token_ids", None) or ()
    if not positions or len(positions) != len(ids):
        return None
    out = []
    for tid, at in zip(ids, positions):
        lp = at.get(tid) if isinstance(at, dict) else None
        if lp is None:
            return None
        out.append((str(getattr(lp, "decoded_token", "") or ""), float(lp.logprob)))
    return tuple(out)


def external_id(request_id: str) -> str:
    """The id a ``RequestOutput`` carries for a request ``enqueue_chat`` named ``request_id``
    (vLLM adds a random suffix to the ids it hands back: ``"12-8a3a82a1"``)."""
    return request_id.rsplit("-", 1)[0]


@dataclasses.dataclass
class PrefixCacheStats:
    """Prompt tokens of finished requests, and how many of them vLLM served from its prefix cache."""

    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, output: Any) -> None:
        self.prompt_tokens += len(getattr(output, "prompt_token_ids", None) or ())
        self.cached_tokens += int(getattr(output, "num_cached_tokens", None) or 0)

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


class StepMeter:
    """Engine steps and the engine's idle time: ``gap_s``, the time between two steps (the
    engine waits on its caller), and ``idle_slot_s``, each step's time times the share of the
    batch (``max_num_seqs``) it left empty."""

    def __init__(self) -> None:
        self.figures = {"steps": 0, "step_s": 0.0, "gap_s": 0.0, "idle_slot_s": 0.0}
        self._last_end: float | None = None

    def step(self, step: Any, unfinished: int, depth: int) -> Any:
        t0 = time.perf_counter()
        if self._last_end is not None:
            self.figures["gap_s"] += t0 - self._last_end
        outputs = step()
        t1 = self._last_end = time.perf_counter()
        self.figures["steps"] += 1
        self.figures["step_s"] += t1 - t0
        self.figures["idle_slot_s"] += (t1 - t0) * (1 - min(unfinished, depth) / depth)
        return outputs


def _hasattr_or_false(obj: Any, name: str) -> bool:
    try:
        return hasattr(obj, name)
    except Exception:  # noqa: BLE001 - an object whose attribute lookup raises has none to offer
        return False


def cpu_build() -> bool:
    """vLLM here is its x86 CPU build (the ``vllm-cpu`` distribution)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def tolerate_proxies_in_kernel_scan() -> None:
    """Let vLLM start in a process that imported Flask.

    vLLM's CPU build (no triton) registers its kernel overrides by scanning every module's globals with
    ``hasattr(value, "__dict__")`` (``vllm.triton_utils.dispatcher._rebind_kernels``, 0.32). A werkzeug
    ``LocalProxy`` (``flask.current_app``, ``flask.request``: imported by moto's server or an Airflow web
    component) raises ``RuntimeError`` there outside an application context, and ``vllm.LLM()`` fails.
    The dispatcher module's own ``hasattr`` becomes one that answers False for such an object; nothing
    else in the process changes."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    dispatcher.hasattr = _hasattr_or_false


@contextlib.contextmanager
def vllm_for_a_start_up() -> Iterator[Any]:
    """The ``vllm`` module, for a ``vllm.LLM`` started inside the block (the engines' loads, the benchmark's
    bare arm): imported, and the block run, with Python's cyclic collector held off, and what the process
    holds once ``vllm.LLM`` is imported (vLLM's modules with the rest) frozen out of it before the block.
    vLLM's import (about 5,000 modules) and start-up make objects that live as long as the model: the
    collector's passes over them as they were made were about 2 of a load's 12-13 CPU-s, and vLLM's own
    full collections while it starts (it freezes the heap itself once started) walked the whole heap, 0.7
    CPU-s more (2 AMD EPYC cores, load 9-10). The collector is restored on the way out (only if it was on).
    No vLLM installed: one line (``InvalidValue``)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        try:
            import vllm

            vllm.LLM   # noqa: B018 - its lazy import (vllm.entrypoints.llm), done before the freeze
        except ImportError as exc:
            raise InvalidValue(f"engine 'vllm' needs the vllm package ({one_line(exc)}): {INSTALL_HINT}") from None
        gc.freeze()
        yield vllm
    finally:
        if was_on:
            gc.enable()


class VllmEngine(Engine):
    name = "vllm"
    option_names = frozenset({*LLM_OPTIONS, "llm_kwargs"})
    result_options = frozenset(RESULT_OPTIONS)
    refused_options = REFUSED_OPTIONS
    enforces = ENFORCED_LIMITS
    gives_logprobs = "vllm" in ENGINES_WITH_LOGPROBS

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        check_llm_kwargs(self.options.get("llm_kwargs"))
        check_vllm_accepts(self.options.get("llm_kwargs") or {})
        self._llm: Any = None
        self._sampling: Any = None
        self._request_errors: tuple[type[BaseException], ...] = (ValueError, TypeError)
        self.prefix_cache = PrefixCacheStats()     # since the last end_shard
        self.meter = StepMeter()

    def weights_files(self) -> list[Path]:
        """The model directory, hashed whole (it must hold safetensors: the only format loaded)."""
        path = model_dir(self.spec)
        safetensors_files(path)
        return [path]

    def load(self) -> None:
        # Nothing may come from the hub: a model, tokenizer or remote code
        # fetched at load time would not be the files whose digest was verified.
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        if cpu_build():   # what this CPU means for its bfloat16 and oneDNN paths, said once (engines.cpu_probe)
            from batch_inference.engines.cpu_probe import vllm_cpu_notes

            for note in vllm_cpu_notes(str(self.options.get("dtype") or "auto")):
                log.info("%s", note)
        with vllm_for_a_start_up() as vllm:
            import vllm.exceptions
            import vllm.sampling_params as sampling_module

            # What vLLM raises for one request it will not take (a prompt over max_model_len, say).
            self._request_errors = (ValueError, TypeError, vllm.exceptions.VLLMClientError)
            tolerate_proxies_in_kernel_scan()
            self._llm = vllm.LLM(**build_llm_kwargs(self.spec, self.options))
        self._sampling = make_sampling_params(sampling_module, self.spec, self.want_logprobs)

    def with_spec(self, spec: JobSpec, options: dict[str, Any] | None = None) -> "VllmEngine":
        """This loaded model for another job version of it (same ``vllm.LLM`` arguments; the sampling
        parameters and the schema are the new spec's), so the model loads once for several job versions."""
        other = type(self)(spec, options)
        if build_llm_kwargs(spec, other.options) != build_llm_kwargs(self.spec, self.options):
            raise InvalidValue("engine 'vllm': with_spec needs the same model and vLLM arguments")
        if self._llm is None:
            raise RuntimeError("engine 'vllm': with_spec() called before load()")
        import vllm.sampling_params as sampling_module

        other._llm, other._sampling = self._llm, make_sampling_params(sampling_module, spec, self.want_logprobs)
        other.want_logprobs = self.want_logprobs
        other._request_errors = self._request_errors
        return other

    def end_shard(self, lease: Any) -> None:
        rate = self.prefix_cache.hit_rate
        if rate is not None:
            log.info("shard %d: vLLM prefix cache hit rate %.1f%% (%d of %d prompt tokens cached)", lease.shard_no,
                     100 * rate, self.prefix_cache.cached_tokens, self.prefix_cache.prompt_tokens)
        self.prefix_cache = PrefixCacheStats()

    def queue_depth(self) -> int:
        """vLLM's maximum number of sequences in a batch (the ``max_num_seqs`` it runs with)."""
        if self._llm is None:
            raise RuntimeError("engine 'vllm': queue_depth() called before load()")
        return int(self._llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)

    def _params(self, req: Request) -> Any:
        """The job's sampling parameters; a retry's with its own seed (``Request.seed``)."""
        if req.retry is None:
            return self._sampling
        params = self._sampling.clone()
        params.seed = req.seed(self.spec.params.seed)
        return params

    def _enqueue(self, req: Request, conversation: list[dict[str, str]]) -> str | Outcome:
        """Queue one request: vLLM's request id, or the record's failed attempt when vLLM refuses it."""
        try:
            [rid] = self._llm.enqueue_chat([conversation], self._params(req), use_tqdm=False)
        except self._request_errors as exc:   # this prompt (too long, say), not the engine
            return Outcome(req.record_id, None, error=f"vLLM: {one_line(exc)}")
        return rid

    def _finished(self, output: Any, waiting: dict[str, str]) -> Outcome | None:
        record_id = waiting.pop(output.request_id, None) if output.finished else None
        if record_id is None:
            return None
        self.prefix_cache.add(output)
        return parse_request_output(record_id, output)

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        if self._llm is None:
            raise RuntimeError("engine 'vllm': generate() called before load()")
        engine = self._llm.llm_engine
        depth = self.queue_depth()
        waiting: dict[str, str] = {}     # the id on vLLM's outputs -> record id
        queued: list[str] = []           # the ids vLLM handed back (abort takes these)
        refused: list[Outcome] = []
        try:
            for req, conversation in zip(requests, build_conversations(requests)):
                if stop.is_set():
                    break
                rid = self._enqueue(req, conversation)
                if isinstance(rid, Outcome):
                    refused.append(rid)
                    continue
                queued.append(rid)
                waiting[external_id(rid)] = req.record_id
            yield from refused
            while waiting and engine.has_unfinished_requests():
                if stop.is_set():
                    break
                for output in self.meter.step(engine.step, len(waiting), depth):
                    outcome = self._finished(output, waiting)
                    if outcome is not None:
                        yield outcome
        finally:
            # Stopped, or the consumer went away: nothing left of this call may keep generating.
            if waiting:
                engine.abort_request([rid for rid in queued if external_id(rid) in waiting], internal=True)

    def stream(self, feed: Feed, stop: threading.Event) -> Iterator[Outcome]:
        if self._llm is None:
            raise RuntimeError("engine 'vllm': stream() called before load()")
        engine = self._llm.llm_engine
        depth = self.queue_depth()
        waiting: dict[str, str] = {}     # the id on vLLM's outputs -> record id
        queued: dict[str, str] = {}      # record id -> the id vLLM handed back (abort takes these)
        try:
            while not stop.is_set():
                cancelled = [queued.pop(r) for r in feed.cancelled() if r in queued]
                if cancelled:
                    engine.abort_request(cancelled, internal=True)
                    for rid in cancelled:
                        waiting.pop(external_id(rid), None)
                if len(waiting) < depth:
                    requests = feed.refill(depth - len(waiting), not waiting)
                    if not requests and not waiting:
                        return
                    for req, conversation in zip(requests, build_conversations(requests)):
                        rid = self._enqueue(req, conversation)
                        if isinstance(rid, Outcome):
                            yield rid
                            continue
                        queued[req.record_id] = rid
                        waiting[external_id(rid)] = req.record_id
                if not waiting:
                    continue
                for output in self.meter.step(engine.step, len(waiting), depth):
                    outcome = self._finished(output, waiting)
                    if outcome is not None:
                        queued.pop(outcome.record_id, None)
                        yield outcome
        finally:
            # Stopped, or the consumer went away: nothing left of this call may keep generating.
            if queued:
                engine.abort_request(list(queued.values()), internal=True)

    def close(self) -> None:
        """Shut vLLM's engine down and drop the model: its memory (weights, KV cache) is freed here."""
        llm, self._llm, self._sampling = self._llm, None, None
        if llm is None:
            return
        # One line a benchmark (or a person) reads: this process's engine steps and their time (StepMeter).
        log.info("vLLM engine steps: %s", json.dumps({k: round(v, 4) for k, v in self.meter.figures.items()}))
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        try:
            if core is not None:
                core.shutdown()
        finally:
            del llm, core
            gc.collect()
