"""Which engine made a result, and whether that engine may serve the spec's model.

The engine is not part of the job version (the fallback pool serves the same
pinned model through another engine), so every result row records it
instead, next to its transport (``bi.results.engine`` and ``endpoint``):
the engine's name (a built-in name, or ``module:Class``) and the class of
its endpoint:

* ``local``: the model runs in the worker's process (llama-cpp, vllm, noop);
* ``internal``: an endpoint inside the company, ``hosted``: one outside it,
  as ``batch_inference.clearance`` classifies the engine's URL under the spec
  (the ``openai`` engine's ``base_url``; a hosted batch engine is hosted
  unless the spec's endpoints declare its host internal).

An engine from a dotted path may say so itself with a class attribute
``endpoint`` (one of those three words); otherwise it is classified as a
built-in one is (a ``base_url`` attribute, the ``hosted_batch`` transport),
else ``local``.

Who may serve a spec's pinned model (:func:`refusal`), checked by the worker
before it loads the engine and by ``validate`` on the engines its rows name:

* the ``noop`` engine, and any engine derived from it, writes placeholder
  outputs: only for a spec whose own engine is ``noop`` (or derived from it);
* every other built-in engine serves whatever the spec pins (the worker
  verifies local weights against the digest; an endpoint is asked for the
  spec's model);
* an engine from a dotted path only if it declares the model it serves: a
  class attribute ``serves_models``, a collection of ``spec.model.name``
  values. An engine that wraps another (an ``inner`` attribute that is an
  Engine, as ``chaos.CountingEngine``) and declares nothing stands for the
  wrapped one: that one is judged, and named on the rows.
"""

from __future__ import annotations

from typing import Any

from batch_inference.clearance import endpoint_is_hosted
from batch_inference.engines import BUILTIN_ENGINES, EMBEDDING_ENGINES, Engine, engine_class
from batch_inference.engines.noop import NoopEngine
from batch_inference.exceptions import InvalidValue
from batch_inference.spec import JobSpec

ENDPOINT_CLASSES = ("local", "internal", "hosted")
# An embedding engine records its built-in name too (the same engine, in its embedding mode).
_BUILTIN_BY_TARGET = {target: name for name, target in [*BUILTIN_ENGINES.items(), *EMBEDDING_ENGINES.items()]}


def engine_name(cls: type[Engine]) -> str:
    """The name a result row records: the built-in name, else ``module:Class``."""
    target = f"{cls.__module__}:{cls.__qualname__}"
    return _BUILTIN_BY_TARGET.get(target, target)


def _is_noop(cls: type[Engine]) -> bool:
    return issubclass(cls, NoopEngine)


def _spec_engine_is_noop(spec: JobSpec) -> bool:
    name = spec.engine.name
    if name in BUILTIN_ENGINES:
        return name == "noop"
    try:
        return _is_noop(engine_class(name))
    except (ValueError, ImportError):
        return False


def refusal(spec: JobSpec, cls: type[Engine]) -> str | None:
    """Why engine ``cls`` may not serve ``spec``'s pinned model (one line), or None when it may."""
    name = engine_name(cls)
    if _is_noop(cls):
        if _spec_engine_is_noop(spec):
            return None
        return (f"engine {name!r} writes placeholder outputs: it runs only a spec whose engine is noop, and this "
                f"spec's engine is {spec.engine.name!r}")
    if name in BUILTIN_ENGINES:
        return None
    declared = getattr(cls, "serves_models", None)
    if declared is not None and not isinstance(declared, str) and spec.model.name in set(declared):
        return None
    return (f"engine {name!r} does not declare that it serves model {spec.model.name!r} (a dotted-path engine "
            f"names the models it serves in its class attribute serves_models)")


def maker(engine: Engine) -> Engine:
    """The engine whose outputs ``engine`` returns: a wrapper that declares no
    ``serves_models`` of its own stands for the engine it wraps."""
    inner = getattr(engine, "inner", None)
    if isinstance(inner, Engine) and getattr(type(engine), "serves_models", None) is None:
        return maker(inner)
    return engine


def endpoint_class(engine: Engine) -> str:
    """'local', 'internal' or 'hosted' for a constructed engine (see the module docstring)."""
    declared = getattr(type(engine), "endpoint", None)
    if declared is not None:
        if declared not in ENDPOINT_CLASSES:
            raise InvalidValue(f"engine {engine_name(type(engine))!r}: endpoint must be one of "
                               f"{', '.join(ENDPOINT_CLASSES)}, got {declared!r}")
        return declared
    if engine.transport == "hosted_batch":
        url: Any = engine.clearance_url()  # type: ignore[attr-defined]
        hosted = bool(engine.option("hosted", True))
        return "hosted" if endpoint_is_hosted(engine.spec, url, hosted) else "internal"
    url = getattr(engine, "base_url", None)
    if url:
        return "hosted" if endpoint_is_hosted(engine.spec, str(url)) else "internal"
    return "local"


def made_by(spec: JobSpec, engine: Engine) -> tuple[str, str]:
    """(engine name, endpoint class) for the rows ``engine`` writes under ``spec`` (of ``maker(engine)``).

    Raises InvalidValue (one line) when the engine may not serve the spec's
    pinned model: the worker calls this before it loads the engine or claims."""
    made = maker(engine)
    why = refusal(spec, type(made))
    if why is not None:
        raise InvalidValue(f"refused: {why}")
    return engine_name(type(made)), endpoint_class(made)


def row_refusal(spec: JobSpec, name: str) -> str | None:
    """Why rows recorded as made by engine ``name`` are not allowed for ``spec`` (validate), or None.

    A built-in name is judged without importing anything; a ``module:Class``
    is imported through ``engines.engine_class`` (the deployment's allowed
    engine modules), and one that cannot be is not allowed."""
    if name in BUILTIN_ENGINES:
        return refusal(spec, NoopEngine) if name == "noop" else None
    try:
        cls = engine_class(name)
    except (ValueError, ImportError) as exc:
        return f"engine {name!r} cannot be checked here: {exc}"
    return refusal(spec, cls)
