"""The vllm engine: offline batched generation on a GPU (the GPU runner image).

One ``vllm.LLM`` per worker process, prefix caching on (every request of a
job shares its system turn), and a shard's records submitted in one
``LLM.chat`` call so vLLM's scheduler can batch them freely. JSON output is
enforced with ``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))``
(vLLM >= 0.12; the older ``guided_decoding`` fields are gone).

vLLM is imported only inside ``load()``: it is not installed, and cannot
run, on CPU machines. Everything that does not need vLLM itself (engine
arguments, sampling arguments, conversations, reading ``RequestOutput``s) is
a pure function here, tested with stand-in objects.

Weights: ``spec.model.path`` is a model directory (config, tokenizer, chat
template, generation config and ``*.safetensors``) mounted into the pod; the
digest is taken over every file in it, recursively (``pinning.sha256_tree``),
a code file in it is refused unless ``spec.model.code_files`` declares it,
vLLM is told to load safetensors only, and the Hugging Face hub is switched
off (``HF_HUB_OFFLINE``) so nothing is fetched that was not hashed.

Options passed to ``vllm.LLM``: ``tensor_parallel_size``,
``gpu_memory_utilization``, ``max_num_seqs``, ``enforce_eager`` (speed and
memory only), and ``RESULT_OPTIONS`` (``dtype``, ``quantization``,
``max_model_len``, ``trust_remote_code``, ``tokenizer_mode``,
``kv_cache_dtype``, ``hf_overrides``, ``generation_config``,
``override_generation_config``, ``seed``), which change results and so
join the job version. ``model``, ``tokenizer``, the revisions,
``load_format``, ``download_dir`` and ``hf_token`` are refused: the model is
``spec.model.path``, pinned by digest. ``llm_kwargs`` (dict) passes any
other ``vllm.LLM`` argument, none of those. ``chunk_size`` (0: the whole
shard in one call; N: N records per call, so ``stop`` is honoured between
chunks at some cost in batching).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from batch_inference.engines.base import TRUNCATED, Engine, Outcome, Request, one_line
from batch_inference.exceptions import InvalidValue
from batch_inference.pinning import WeightsMissing
from batch_inference.spec import ENGINE_RESULT_OPTIONS, JobSpec

RESULT_OPTIONS = ENGINE_RESULT_OPTIONS["vllm"]
LLM_OPTIONS = ("tensor_parallel_size", "gpu_memory_utilization", "max_num_seqs", "enforce_eager", *RESULT_OPTIONS)
_PINNED_BY_DIGEST = "the model is spec.model.path, pinned by spec.model.digest"
REFUSED_OPTIONS = {
    "model": _PINNED_BY_DIGEST,
    "tokenizer": "the tokenizer is the model directory's, pinned by spec.model.digest",
    "revision": _PINNED_BY_DIGEST, "tokenizer_revision": _PINNED_BY_DIGEST, "code_revision": _PINNED_BY_DIGEST,
    "download_dir": _PINNED_BY_DIGEST, "hf_token": _PINNED_BY_DIGEST,
    "load_format": "the engine loads safetensors only: the files whose digest was verified",
}


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


def build_sampling_kwargs(spec: JobSpec) -> dict[str, Any]:
    """Arguments for ``SamplingParams`` except the structured-output constraint."""
    p = spec.params
    return {"temperature": p.temperature, "max_tokens": p.max_tokens, "top_p": p.top_p, "seed": p.seed}


def build_structured_kwargs(spec: JobSpec) -> dict[str, Any]:
    """Arguments for ``StructuredOutputsParams``: the output schema as a JSON constraint."""
    return {"json": spec.output_schema}


def make_sampling_params(sampling_module: Any, spec: JobSpec) -> Any:
    """``SamplingParams`` from ``vllm.sampling_params`` (or a stand-in module with the same two classes)."""
    structured = sampling_module.StructuredOutputsParams(**build_structured_kwargs(spec))
    return sampling_module.SamplingParams(**build_sampling_kwargs(spec), structured_outputs=structured)


def build_conversations(requests: Sequence[Request]) -> list[list[dict[str, str]]]:
    """One conversation per request, in request order (``LLM.chat`` keeps the order)."""
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
    return Outcome(record_id, text, tokens_out=tokens)


def parse_outputs(requests: Sequence[Request], outputs: Sequence[Any]) -> list[Outcome]:
    """Outcomes for a chat call's results, matched to requests by position."""
    found = [parse_request_output(r.record_id, o) for r, o in zip(requests, outputs)]
    missing = [Outcome(r.record_id, None, error="vLLM returned no output for this request") for r in requests[len(outputs):]]
    return found + missing


def chat_batch(chat: Any, requests: Sequence[Request], sampling: Any, stop: threading.Event) -> list[Outcome]:
    """Run ``requests`` through ``chat`` (``LLM.chat``) in one call.

    If the batch call raises (one prompt longer than ``max_model_len`` makes
    vLLM reject the whole call), each record is retried alone so that only
    the bad record fails. If every record then fails too, the engine itself
    is broken (lost GPU, out of memory): raise, so the worker gives the
    shard back instead of spending every record's attempts.
    """
    try:
        return parse_outputs(requests, chat(build_conversations(requests), sampling, use_tqdm=False))
    except Exception as exc:
        batch_error = exc
    outcomes: list[Outcome] = []
    failures = 0
    for req in requests:
        if stop.is_set():
            break
        try:
            outcomes += parse_outputs([req], chat(build_conversations([req]), sampling, use_tqdm=False))
        except Exception as exc:
            failures += 1
            outcomes.append(Outcome(req.record_id, None, error=f"vLLM: {one_line(exc)}"))
    if len(requests) > 1 and failures == len(requests):
        raise RuntimeError(f"engine 'vllm': chat failed for every record: {one_line(batch_error)}") from batch_error
    return outcomes


class VllmEngine(Engine):
    name = "vllm"
    option_names = frozenset({*LLM_OPTIONS, "llm_kwargs", "chunk_size"})
    result_options = frozenset(RESULT_OPTIONS)
    refused_options = REFUSED_OPTIONS

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        check_llm_kwargs(self.options.get("llm_kwargs"))
        self._llm: Any = None
        self._sampling: Any = None
        self.chunk_size = int(self.option("chunk_size", 0))

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
        try:
            import vllm
            import vllm.sampling_params as sampling_module
        except ImportError:
            raise InvalidValue("engine 'vllm' needs the vllm package (the GPU runner image has it)") from None
        self._llm = vllm.LLM(**build_llm_kwargs(self.spec, self.options))
        self._sampling = make_sampling_params(sampling_module, self.spec)

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        if self._llm is None:
            raise RuntimeError("engine 'vllm': generate() called before load()")
        size = self.chunk_size or len(requests) or 1
        for start in range(0, len(requests), size):
            if stop.is_set():
                return
            yield from chat_batch(self._llm.chat, requests[start : start + size], self._sampling, stop)

    def close(self) -> None:
        # vLLM frees GPU memory when the LLM is garbage-collected; the worker
        # process exits after its shards anyway.
        self._llm = None
