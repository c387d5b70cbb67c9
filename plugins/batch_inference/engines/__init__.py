"""Engines: the model side of the worker.

``load_engine(name, spec, options)`` returns an :class:`Engine`. Built-in
names are ``llama-cpp`` (embedded CPU default), ``vllm`` (offline GPU),
``openai`` (any OpenAI-compatible HTTP endpoint) and ``noop`` (benchmark and
chaos engine, never a default). Anything else is a dotted path to an Engine
subclass, ``package.module:ClassName`` or ``package.module.ClassName``.

Built-in modules are imported only when named, so a worker running ``noop``
needs neither llama.cpp nor httpx, and the GPU image needs no llama.cpp.
"""

from __future__ import annotations

import importlib
from typing import Any

from batch_inference.engines.base import TRUNCATED, Engine, Outcome, Request, one_line
from batch_inference.spec import JobSpec

__all__ = ["BUILTIN_ENGINES", "TRUNCATED", "Engine", "Outcome", "Request", "engine_class", "engine_for", "load_engine", "one_line"]

BUILTIN_ENGINES: dict[str, str] = {
    "llama-cpp": "batch_inference.engines.llama_cpp:LlamaCppEngine",
    "vllm": "batch_inference.engines.vllm:VllmEngine",
    "openai": "batch_inference.engines.openai:OpenAIEngine",
    "noop": "batch_inference.engines.noop:NoopEngine",
}


def engine_class(name: str) -> type[Engine]:
    """The Engine subclass a name or dotted path refers to; ValueError if none."""
    target = BUILTIN_ENGINES.get(name, name)
    if ":" in target:
        module_name, _, attr = target.partition(":")
    elif "." in target:
        module_name, _, attr = target.rpartition(".")
    else:
        known = ", ".join(BUILTIN_ENGINES)
        raise ValueError(f"unknown engine '{name}': use one of {known}, or a dotted path package.module:ClassName")
    if not module_name or not attr:
        raise ValueError(f"unknown engine '{name}': a dotted path must look like package.module:ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"engine '{name}': cannot import module '{module_name}': {one_line(exc)}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"engine '{name}': module '{module_name}' has no attribute '{attr}'")
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise ValueError(f"engine '{name}': '{attr}' is not a subclass of batch_inference.engines.Engine")
    return cls


def load_engine(name: str, spec: JobSpec, options: dict[str, Any] | None = None) -> Engine:
    """Construct (not load) the engine ``name`` for ``spec``.

    ``options=None`` takes ``spec.engine.options``. The caller verifies the
    weights (``pinning.verify_weights``) and then calls ``engine.load()``.
    """
    return engine_class(name)(spec, options)


def engine_for(spec: JobSpec) -> Engine:
    """The engine the spec names, with the spec's options."""
    return load_engine(spec.engine.name, spec, spec.engine.options)
