"""The engines' embedding modes: what a built-in engine name loads for ``task: embed``
(``engines.EMBEDDING_ENGINES``; results record the built-in name).

Each is its generating engine with the model loaded for pooling and a
``generate`` that yields one vector per record (``Outcome.vector``) instead
of text; the worker checks and stores it (``embed.vectors.to_storage``).
The input is the record rendered by the prompt's template (columns as for
generation) after ``embedding.instruction``; there is no system turn.

* ``llama-cpp`` (``LlamaCppEmbedder``): ``llama_cpp.Llama(embedding=True)``
  with the spec's pooling (``embedding.pooling``: mean, cls, last), a whole
  record in one micro-batch (``n_batch`` = ``n_ubatch`` = ``n_ctx``), records
  embedded ``EMBED_BATCH`` at a time through ``Llama.embed`` (a batch that
  raises is embedded again one record at a time, so only the bad record
  fails). The default model is the SmolLM2 GGUF: 576 dimensions.
* ``vllm`` (``VllmEmbedder``): ``vllm.LLM(runner="pooling")`` (a causal model
  converted to an embedding model, ``convert="embed"``) and ``LLM.embed``
  over the whole request list at once, the spec's pooling in vLLM's
  ``PoolerConfig``; no streaming (``queue_depth`` 0: one shard at a time).
* ``openai`` (``OpenAIEmbedder``): an OpenAI-compatible ``POST /embeddings``
  (vLLM's and llama.cpp's servers, OpenAI's API) through the generating
  engine's client, with its retries, breaker, rate limit and clearance.
* ``openai-batch`` (``OpenAIBatchEmbedder``): the OpenAI Batch API's
  ``/v1/embeddings`` endpoint as a hosted transport (``hosted.openai_batch``):
  one ``/v1/embeddings`` request per record in the shard's batch file, each
  answer's ``data[0].embedding`` the record's vector.

Both OpenAI-shaped engines send the same body (``embedding_body``):
``model``, ``input``, ``encoding_format: float``, and ``dimensions`` for a
model known to shorten its vectors (``OPENAI_EMBEDDING_MODELS``).

``model_dimensions(spec)`` reads the pinned model's embedding size without
loading it (the GGUF's metadata, the model directory's config.json), so
submit refuses a spec whose ``embedding.dimensions`` does not match; for the
OpenAI-shaped engines ``check_openai_model`` does the same from the table of
OpenAI's embedding models.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from batch_inference.engines.base import Outcome, Request, one_line
from batch_inference.engines.llama_cpp import LlamaCppEngine, native_log_quiet, resolve_model_path
from batch_inference.engines.openai import OpenAIEngine, extra_body_option
from batch_inference.hosted.core import ERRORED, SUCCEEDED, HostedBatchEngine, Item
from batch_inference.hosted.openai_batch import OpenAIBatchEngine
from batch_inference.engines.vllm import VllmEngine, build_llm_kwargs, tolerate_proxies_in_kernel_scan, \
    vllm_for_a_start_up
from batch_inference.exceptions import InvalidValue
from batch_inference.prompting import render_record
from batch_inference.spec import JobSpec

EMBED_BATCH = 32   # llama.cpp: records per Llama.embed call

# OpenAI's embedding models: (native dimensions, takes ``dimensions`` to shorten its vectors).
OPENAI_EMBEDDING_MODELS: dict[str, tuple[int, bool]] = {
    "text-embedding-3-small": (1536, True),
    "text-embedding-3-large": (3072, True),
    "text-embedding-ada-002": (1536, False),
}
OPENAI_API_HOST = "api.openai.com"
# A /v1/embeddings batch holds at most this many inputs (one a record here): a shard is one batch.
OPENAI_BATCH_MAX_INPUTS = 50_000
# The fields of an embeddings request the spec sets; ``extra_body`` may add to them, never replace one.
EMBED_BODY_FIELDS = frozenset({"model", "input", "dimensions", "encoding_format"})


def embed_input(spec: JobSpec, text: str) -> str:
    """What an embedding engine embeds for one record: the instruction, then the rendered record."""
    return spec.embedding.instruction + render_record(spec, text)


def _check_model_size(name: str, spec: JobSpec, size: int | None) -> None:
    want = spec.embedding.dimensions
    if size is not None and size != want:
        raise InvalidValue(f"engine '{name}': model {spec.model.name} makes {size}-dimensional embeddings; the "
                           f"spec's embedding.dimensions is {want}")


def gguf_embedding_length(path: Path) -> int | None:
    """``<arch>.embedding_length`` from a GGUF's metadata (llama.cpp reads only the vocabulary)."""
    import llama_cpp

    with native_log_quiet():   # llama.cpp warns that a vocabulary-only model has no training context
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        meta = llm.metadata or {}
    finally:
        llm.close()
    arch = meta.get("general.architecture")
    value = meta.get(f"{arch}.embedding_length") if arch else None
    return int(value) if value is not None else None


def model_dimensions(spec: JobSpec) -> int | None:
    """The pinned model's embedding size, read without loading it; None where it cannot be known here
    (an endpoint's model, a dotted-path engine)."""
    name = spec.engine.name
    if name == "llama-cpp":
        return gguf_embedding_length(resolve_model_path(spec.model.path))
    if name == "vllm" and spec.model.path:
        config = Path(spec.model.path) / "config.json"
        if config.is_file():
            cfg = json.loads(config.read_text())
            size = cfg.get("hidden_size") or (cfg.get("text_config") or {}).get("hidden_size")
            return int(size) if size else None
    return None


def check_spec(spec: JobSpec) -> None:
    """At submit: a model whose embedding size is not ``embedding.dimensions`` is refused (one line), and
    an OpenAI-shaped engine's model as ``check_openai_model`` says."""
    if spec.task != "embed":
        return
    from batch_inference.engines import EMBEDDING_ENGINES, engine_class

    name = spec.engine.name   # a built-in without one the spec refused; a dotted path's class must say so
    if name not in EMBEDDING_ENGINES and not getattr(engine_class(name), "embeds", False):
        raise InvalidValue(f"engine {name!r} has no embedding mode: its class does not set embeds = True")
    if name in ("openai", "openai-batch"):
        check_openai_model(spec)
    try:
        size = model_dimensions(spec)
    except (OSError, ValueError, ImportError) as exc:
        raise InvalidValue(f"embedding: cannot read the size of model {spec.model.name}: {one_line(exc)}") from None
    _check_model_size(spec.engine.name, spec, size)


def embedding_body(spec: JobSpec, model: str, text: str, extra: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI-shaped embeddings request: ``dimensions`` only for a model known to take it."""
    body: dict[str, Any] = {"model": model, "input": embed_input(spec, text), "encoding_format": "float"}
    if OPENAI_EMBEDDING_MODELS.get(model, (0, False))[1]:
        body["dimensions"] = spec.embedding.dimensions
    return {**body, **extra}


def vector_of(data: Any) -> tuple[list[float] | None, str | None]:
    """``(vector, None)`` from an embeddings response holding one input, else ``(None, why)``."""
    try:
        vector = data["data"][0]["embedding"]
    except (KeyError, IndexError, TypeError):
        return None, "response has no data[0].embedding"
    if not isinstance(vector, list):
        return None, "data[0].embedding is not a list of floats"
    return vector, None


def check_openai_model(spec: JobSpec) -> None:
    """An OpenAI-shaped engine's model against what OpenAI documents of it (one line, at submit):
    a known model asked for a size it cannot make, or, on OpenAI's own API, a model that is not one
    of its embedding models (a model behind another server is that server's to know); for
    ``openai-batch``, a shard larger than one batch may be."""
    name, opts = spec.engine.name, spec.engine.options
    if name == "openai-batch" and spec.shard_size > OPENAI_BATCH_MAX_INPUTS:
        raise InvalidValue(f"engine 'openai-batch': shard_size {spec.shard_size} is more than the "
                           f"{OPENAI_BATCH_MAX_INPUTS:,} inputs a /v1/embeddings batch may hold (a shard is one batch)")
    model = str(opts.get("model") or spec.model.name)
    want = spec.embedding.dimensions
    known = OPENAI_EMBEDDING_MODELS.get(model)
    if known is not None:
        native, shortens = known
        if shortens and want > native:
            raise InvalidValue(f"engine '{name}': model {model} makes at most {native}-dimensional embeddings; "
                               f"the spec's embedding.dimensions is {want}")
        if not shortens and want != native:
            raise InvalidValue(f"engine '{name}': model {model} makes {native}-dimensional embeddings and takes no "
                               f"'dimensions'; the spec's embedding.dimensions is {want}")
        return
    from urllib.parse import urlsplit

    base_url = opts.get("base_url") or (None if opts.get("conn_id") else OpenAIBatchEngine.default_base_url)
    if base_url and urlsplit(str(base_url)).hostname == OPENAI_API_HOST:
        raise InvalidValue(f"engine '{name}': model {model!r} is not one of OpenAI's embedding models "
                           f"({', '.join(OPENAI_EMBEDDING_MODELS)}): name one as model.name or the option 'model'")


class LlamaCppEmbedder(LlamaCppEngine):
    embeds = True
    POOLING = {"mean": 1, "cls": 2, "last": 3}   # llama_cpp.LLAMA_POOLING_TYPE_*

    def llama_kwargs(self) -> dict[str, Any]:
        kwargs = super().llama_kwargs()
        kwargs.pop("chat_format", None)
        kwargs.pop("logits_all", None)
        n_ctx = kwargs["n_ctx"]
        kwargs.update(embedding=True, pooling_type=self.POOLING[self.spec.embedding.pooling], n_batch=n_ctx,
                      n_ubatch=n_ctx)
        return kwargs

    def load(self) -> None:
        super().load()
        _check_model_size(self.name, self.spec, int(self._llm.n_embd()))

    def embed_texts(self, texts: list[str]) -> list[list[float]]:
        """Vectors of ``texts`` as llama.cpp's own ``Llama.embed`` gives them (not normalized here)."""
        return self._llm.embed(texts, normalize=False, truncate=True)

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        if self._llm is None:
            raise RuntimeError("engine 'llama-cpp': generate() called before load()")
        for i in range(0, len(requests), EMBED_BATCH):
            if stop.is_set():
                return
            batch = requests[i:i + EMBED_BATCH]
            texts = [embed_input(self.spec, r.text) for r in batch]
            try:
                vectors = self.embed_texts(texts)
            except Exception:  # noqa: BLE001 - one bad record: embed the batch one by one to find it
                for req, text in zip(batch, texts):
                    try:
                        [vector] = self.embed_texts([text])
                    except Exception as exc:  # noqa: BLE001 - that record fails, not the shard
                        yield Outcome(req.record_id, None, error=one_line(exc))
                        continue
                    yield Outcome(req.record_id, None, vector=vector)
                continue
            for req, vector in zip(batch, vectors):
                yield Outcome(req.record_id, None, vector=vector)


class VllmEmbedder(VllmEngine):
    embeds = True
    POOLING = {"mean": "MEAN", "cls": "CLS", "last": "LAST"}

    def llm_kwargs(self) -> dict[str, Any]:
        from vllm.config import PoolerConfig

        kwargs = build_llm_kwargs(self.spec, self.options)
        kwargs["enable_prefix_caching"] = False   # a pooling model reads every prompt token once
        kwargs.update(runner="pooling", convert="embed",
                      pooler_config=PoolerConfig(seq_pooling_type=self.POOLING[self.spec.embedding.pooling]))
        return kwargs

    def load(self) -> None:
        import os

        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        with vllm_for_a_start_up() as vllm:
            tolerate_proxies_in_kernel_scan()
            self._llm = vllm.LLM(**self.llm_kwargs())
        _check_model_size(self.name, self.spec, int(self._llm.llm_engine.model_config.get_hidden_size()))

    def queue_depth(self) -> int:
        return 0

    def embed_texts(self, texts: list[str]) -> list[list[float]]:
        """Vectors of ``texts`` as vLLM's own ``LLM.embed`` gives them."""
        return [o.outputs.embedding for o in self._llm.embed(texts, use_tqdm=False)]

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        if self._llm is None:
            raise RuntimeError("engine 'vllm': generate() called before load()")
        if stop.is_set() or not requests:
            return
        texts = [embed_input(self.spec, r.text) for r in requests]
        try:
            vectors = self.embed_texts(texts)
        except (ValueError, TypeError):   # a prompt vLLM refuses (over max_model_len): find it alone
            for req, text in zip(requests, texts):
                if stop.is_set():
                    return
                try:
                    [vector] = self.embed_texts([text])
                except (ValueError, TypeError) as exc:
                    yield Outcome(req.record_id, None, error=one_line(exc))
                    continue
                yield Outcome(req.record_id, None, vector=vector)
            return
        for req, vector in zip(requests, vectors):
            yield Outcome(req.record_id, None, vector=vector)

    def end_shard(self, lease: Any) -> None:
        pass


class OpenAIEmbedder(OpenAIEngine):
    embeds = True
    path = "/embeddings"

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        self.extra_body = extra_body_option(self.name, self.option("extra_body", {}), EMBED_BODY_FIELDS)

    def body(self, req: Request) -> dict[str, Any]:
        return embedding_body(self.spec, self.model, req.text, self.extra_body)

    def parse(self, record_id: str, data: Any) -> Outcome:
        vector, error = vector_of(data)
        return Outcome(record_id, None, error=error, vector=vector)


class OpenAIBatchEmbedder(OpenAIBatchEngine):
    """``openai-batch`` for ``task: embed``: the Batch API's ``/v1/embeddings`` endpoint. The provider
    batch's life (intent, poll, cancel-and-collect, reconcile) is ``hosted.core``'s, unchanged."""

    embeds = True
    batch_endpoint = "/v1/embeddings"
    option_names = HostedBatchEngine.common_options | {"extra_body"}

    def __init__(self, spec, options=None):
        HostedBatchEngine.__init__(self, spec, options)   # no response format: an embedding has no schema
        self.extra_body = extra_body_option(self.name, self.option("extra_body", {}), EMBED_BODY_FIELDS)

    def request_body(self, req: Request) -> dict[str, Any]:
        return embedding_body(self.spec, self.model, req.text, self.extra_body)

    def read_answer(self, cid: str, body: Any) -> Item:
        vector, error = vector_of(body)
        usage = body.get("usage") if isinstance(body, dict) else None
        tokens_in = int((usage or {}).get("prompt_tokens") or 0)
        if error is not None:
            return Item(cid, ERRORED, error=error, tokens_in=tokens_in)
        return Item(cid, SUCCEEDED, vector=vector, tokens_in=tokens_in)
