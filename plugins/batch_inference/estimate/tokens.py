"""Token counters: a record's chat messages as the pinned model's engine tokenizes them.

One interface (:class:`Counter`: ``count(messages) -> list[int]`` token ids,
``exact``, ``name``), one class per kind of engine:

* ``llama-cpp``: the GGUF's own vocabulary (``llama_cpp.Llama(vocab_only=True)``,
  no weights loaded) and its own chat handler: the messages go through
  ``Llama.create_chat_completion`` exactly as the engine sends them, and the
  token ids are taken at the handler's call of ``Llama.tokenize`` (the prompt
  the handler's chat template rendered, with its BOS and special-token rule),
  before anything is generated. So the chat format the engine would pick (the
  GGUF's template, a guessed format, the ``chat_format`` option) is the one
  counted, without a copy of llama-cpp-python's choice here.
* ``vllm``: the model directory's tokenizer (``transformers.AutoTokenizer``) and
  its chat template, as ``vllm.LLM.chat`` renders a conversation
  (``apply_chat_template(..., add_generation_prompt=True)``).
* a model ladder (``models:``): each rung with its own counter (``LadderCounter``);
* anything else (an OpenAI-compatible endpoint, a hosted batch API, noop):
  the provider's tokenizer is not here, so the count is an estimate (four
  characters a token, the usual rule for English), and says so (``exact`` False).

The model file is the spec's (``spec.model.path``, or the llama-cpp engine's
default GGUF): the file whose digest the job version pins.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from batch_inference.exceptions import BatchInferenceError, InvalidValue
from batch_inference.spec import JobSpec

CHARS_PER_TOKEN = 4   # the estimate where no tokenizer of the model is here


class Counter:
    """Counts the tokens of one record's chat messages (system turn, then user turn)."""

    name: str = "estimate"
    exact: bool = False

    def count(self, messages: Sequence[dict[str, str]]) -> list[int]:
        raise NotImplementedError

    def count_text(self, text: str) -> int:
        """Tokens of a plain text (an answer), without a chat template."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the tokenizer."""


class CharEstimate(Counter):
    """No tokenizer of the model here: ``CHARS_PER_TOKEN`` characters a token, stated as an estimate.

    The ids are not real: the rendered text's characters in groups, so the shared-prefix
    arithmetic still works (the system turn is the same text for every record)."""

    name = "estimate (4 characters a token)"
    exact = False

    def count(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        return [hash(text[i:i + CHARS_PER_TOKEN]) for i in range(0, len(text), CHARS_PER_TOKEN)]

    def count_text(self, text: str) -> int:
        return math.ceil(len(text) / CHARS_PER_TOKEN)


class _Tokenized(BatchInferenceError):
    """Raised from inside the chat handler's tokenize call, carrying the prompt's token ids
    (control flow, caught by ``LlamaCppCounter.count``; never leaves it)."""

    def __init__(self, ids: list[int]):
        super().__init__("tokenized")
        self.ids = ids


class LlamaCppCounter(Counter):
    """The GGUF's vocabulary and chat handler, as the llama-cpp engine uses them (no weights loaded)."""

    exact = True

    def __init__(self, spec: JobSpec):
        from batch_inference.engines.llama_cpp import LlamaCppEngine, native_log_quiet

        try:
            import llama_cpp
        except ImportError:
            raise InvalidValue("estimate: counting llama-cpp tokens needs llama-cpp-python "
                               "(pip install 'airflow-provider-batch-inference[cpu]')") from None
        engine = LlamaCppEngine(spec)            # the engine's own options and model file
        kwargs = {**engine.llama_kwargs(), "vocab_only": True}
        if not engine.model_path.is_file():
            raise InvalidValue(f"estimate: model file {engine.model_path} not found")
        self.name = f"llama.cpp vocabulary of {engine.model_path.name}"
        with native_log_quiet():   # llama.cpp warns that a vocabulary-only model has no training context
            self._llm = llama_cpp.Llama(**kwargs)
        # The C tokenizer the engine's ``Llama.tokenize`` calls, with the same arguments, into one buffer
        # kept here: llama-cpp-python sizes its buffer by the training context, which a vocabulary-only
        # model reports as 0, so every call of its own would tokenize twice.
        vocab = llama_cpp.llama_model_get_vocab(self._llm.model)
        buf = [(llama_cpp.llama_token * 8192)()]

        def tokenize(text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
            n = llama_cpp.llama_tokenize(vocab, text, len(text), buf[0], len(buf[0]), add_bos, special)
            if n < 0:
                buf[0] = (llama_cpp.llama_token * -n)()
                n = llama_cpp.llama_tokenize(vocab, text, len(text), buf[0], len(buf[0]), add_bos, special)
            return buf[0][:n]

        def capture(text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
            raise _Tokenized(tokenize(text, add_bos, special))

        self._tokenize = tokenize

        # Only the chat handler calls tokenize on this object; it raises with the ids, so nothing is generated.
        self._llm.tokenize = capture   # type: ignore[method-assign]

    def count(self, messages: Sequence[dict[str, str]]) -> list[int]:
        try:
            self._llm.create_chat_completion(messages=list(messages), max_tokens=1)
        except _Tokenized as done:
            return done.ids
        raise RuntimeError("estimate: the llama.cpp chat handler did not tokenize the prompt")

    def count_text(self, text: str) -> int:
        return len(self._tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None and hasattr(llm, "close"):
            llm.close()


class HuggingFaceCounter(Counter):
    """The model directory's tokenizer and chat template, as vLLM's ``LLM.chat`` renders a conversation."""

    exact = True

    def __init__(self, spec: JobSpec):
        from batch_inference.engines.vllm import model_dir

        os.environ.setdefault("HF_HUB_OFFLINE", "1")   # only the pinned directory, nothing fetched
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise InvalidValue("estimate: counting vllm tokens needs transformers "
                               "(pip install 'airflow-provider-batch-inference[vllm]')") from None
        path = model_dir(spec)
        if not path.is_dir():
            raise InvalidValue(f"estimate: model directory {path} not found")
        self.name = f"tokenizer of {path.name}"
        self._tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    def count(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text = self._tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        # vLLM tokenizes the rendered conversation without adding special tokens again.
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def count_text(self, text: str) -> int:
        return len(self._tok(text, add_special_tokens=False)["input_ids"])


class LadderCounter(Counter):
    """A model ladder's rungs, each counted with its own rung's counter (``counter_for`` of the rung's
    one-model spec: its tokenizer and chat template). ``count`` gives rung 1's ids (every record is
    asked there first) and leaves every rung's count of the same record in ``last``."""

    def __init__(self, spec: JobSpec):
        from batch_inference.ladder import rung_spec, rungs_of

        self.counters: list[Counter] = []
        try:
            for rung in rungs_of(spec):
                self.counters.append(counter_for(rung_spec(spec, rung)))
        except BaseException:
            self.close()
            raise
        self.exact = all(c.exact for c in self.counters)
        self.name = "; ".join(f"rung {no}: {c.name}" for no, c in enumerate(self.counters, 1))
        self.last: list[int] = []

    def count(self, messages: Sequence[dict[str, str]]) -> list[int]:
        every = [c.count(messages) for c in self.counters]
        self.last = [len(ids) for ids in every]
        return every[0]

    def count_text(self, text: str) -> int:
        return self.counters[-1].count_text(text)   # an answer stored: the top rung's tokenizer

    def close(self) -> None:
        for c in self.counters:
            c.close()


def counter_for(spec: JobSpec) -> Counter:
    """The token counter of the spec's pinned model and engine (a model ladder's: each rung's)."""
    if spec.models:
        return LadderCounter(spec)
    name = spec.engine.name
    if name == "llama-cpp":
        return LlamaCppCounter(spec)
    if name == "vllm":
        return HuggingFaceCounter(spec)
    return CharEstimate()
