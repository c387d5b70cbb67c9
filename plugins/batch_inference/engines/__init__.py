"""Engines: the model side of the worker.

``load_engine(name, spec, options)`` returns an :class:`Engine`. Built-in
names are ``llama-cpp`` (embedded CPU default), ``vllm`` (offline GPU),
``openai`` (any OpenAI-compatible HTTP endpoint), ``noop`` (benchmark and
chaos engine, never a default) and the hosted batch transports
``openai-batch``, ``anthropic-batch``, ``bedrock-batch`` and ``gemini-batch``
(``batch_inference.hosted``). Anything else is a dotted path to an Engine
subclass, ``package.module:ClassName`` or ``package.module.ClassName``,
imported only from a module the deployment allows (``allowed_engine_modules``):
the check comes before the import, so a refused module never runs.

Built-in modules are imported only when named, so a worker running ``noop``
needs neither llama.cpp nor httpx, and the GPU image needs no llama.cpp.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any

from batch_inference.engines.base import (BUILTIN_ENGINES, EMBEDDING_ENGINES, TRUNCATED, Engine, Outcome, Request,
                                          one_line, parse_chat_completion)
# OpenAI's chat-completions wire shape, which the hosted batch transports and the fallback speak too
# (the module imports httpx only when an engine starts).
from batch_inference.engines.openai import STYLES, chat_body, error_text, extra_body_option, response_format
from batch_inference.exceptions import InvalidValue
from batch_inference.spec import JobSpec, pinned_options  # noqa: F401 - re-exported: the spec owns it

__all__ = ["BUILTIN_ENGINES", "EMBEDDING_ENGINES", "STYLES", "TRUNCATED", "Engine", "Outcome", "Request",
           "allowed_engine_modules", "chat_body", "engine_class", "engine_for", "error_text", "extra_body_option",
           "load_engine", "one_line", "parse_chat_completion", "pinned_options", "response_format"]

# The deployment's setting: comma-separated modules or packages whose engines may
# be loaded by dotted path. The Airflow option [batch_inference]
# allowed_engine_modules is read from its environment form when Airflow is not
# loaded (the worker process never loads it).
ENGINE_MODULES_ENV = "BATCH_INFERENCE_ENGINE_MODULES"
AIRFLOW_ENGINE_MODULES_ENV = "AIRFLOW__BATCH_INFERENCE__ALLOWED_ENGINE_MODULES"
# The provider's own package is code the deployment already runs.
ALWAYS_ALLOWED_MODULES = ("batch_inference",)
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_ATTR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def allowed_engine_modules() -> tuple[str, ...]:
    """The modules and packages dotted-path engines may come from (``ALWAYS_ALLOWED_MODULES`` first)."""
    raw = [os.environ.get(ENGINE_MODULES_ENV, "")]
    if "airflow.configuration" in sys.modules:
        try:
            raw.append(sys.modules["airflow.configuration"].conf.get("batch_inference", "allowed_engine_modules",
                                                                     fallback="") or "")
        except Exception:  # noqa: BLE001 - an unreadable option allows nothing
            pass
    else:
        raw.append(os.environ.get(AIRFLOW_ENGINE_MODULES_ENV, ""))
    entries = [e.strip() for text in raw for e in text.split(",")]
    return ALWAYS_ALLOWED_MODULES + tuple(dict.fromkeys(e for e in entries if _MODULE.match(e)))


def _module_allowed(module_name: str) -> bool:
    return any(module_name == a or module_name.startswith(a + ".") for a in allowed_engine_modules())


def engine_class(name: str) -> type[Engine]:
    """The Engine subclass a name or dotted path refers to; ValueError (one line) if none.

    A dotted path's module must match ``allowed_engine_modules()`` (itself, or
    a package above it) and is refused before anything is imported.
    """
    target = BUILTIN_ENGINES.get(name, name)
    shown = one_line(repr(name), 200)
    if ":" in target:
        module_name, _, attr = target.partition(":")
    elif "." in target:
        module_name, _, attr = target.rpartition(".")
    else:
        # A ladder is spelt models:; openai-tiers is the fallback pool's engine for fallback.tiers.
        known = ", ".join(n for n in BUILTIN_ENGINES if n not in ("ladder", "openai-tiers"))
        raise InvalidValue(f"unknown engine {shown}: use one of {known}, or a dotted path package.module:ClassName")
    if not _MODULE.match(module_name) or not _ATTR.match(attr):
        raise InvalidValue(f"unknown engine {shown}: a dotted path must look like package.module:ClassName")
    if not _module_allowed(module_name):
        raise InvalidValue(
            f"engine {shown}: module '{module_name}' is not in the allowed engine modules; the deployment allows "
            f"it with {ENGINE_MODULES_ENV} or [batch_inference] allowed_engine_modules (comma-separated modules "
            "or packages)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidValue(f"engine '{name}': cannot import module '{module_name}': {one_line(exc)}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise InvalidValue(f"engine '{name}': module '{module_name}' has no attribute '{attr}'")
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise InvalidValue(f"engine '{name}': '{attr}' is not a subclass of batch_inference.engines.Engine")
    return cls


def load_engine(name: str, spec: JobSpec, options: dict[str, Any] | None = None) -> Engine:
    """Construct (not load) the engine ``name`` for ``spec``.

    ``options=None`` takes ``spec.engine.options``. The caller verifies the
    weights (``pinning.verify_weights``) and then calls ``engine.load()``.
    An embedding job (``spec.task == "embed"``) gets the engine's embedding
    mode (``EMBEDDING_ENGINES``); an engine without one is refused.
    """
    if spec.task == "embed":
        cls = engine_class(EMBEDDING_ENGINES.get(name, name))
        if not getattr(cls, "embeds", False):
            raise InvalidValue(f"engine {one_line(repr(name), 200)} has no embedding mode: task: embed runs on "
                               f"{', '.join(EMBEDDING_ENGINES)} (or an engine class with embeds = True)")
        return cls(spec, options)
    return engine_class(name)(spec, options)


def engine_for(spec: JobSpec) -> Engine:
    """The engine the spec names, with the spec's options."""
    return load_engine(spec.engine.name, spec, spec.engine.options)


def unenforced_line(spec: JobSpec) -> str | None:
    """One line naming the output schema's limits the spec's engine cannot enforce while generating
    (``Engine.unenforced``), or None: every limit is enforced, the engine does not constrain decoding,
    or it does not resolve (that is refused elsewhere). What ``submit`` reports."""
    if getattr(spec, "task", "generate") != "generate":
        return None
    try:
        cls = engine_class(spec.engine.name)
    except ValueError:
        return None
    gaps = cls.unenforced(spec.output_schema)
    if not gaps:
        return None
    return (f"engine {spec.engine.name!r} cannot enforce while generating: {'; '.join(gaps)}; an answer outside "
            "them fails validation and is retried (then dead-lettered)")
