"""Output checking: is an engine's text a result, or a failed attempt?

``check_output(spec, raw)`` runs on every record, so it is built for speed:
the compiled Draft 2020-12 validator is cached per schema, and the schema is
hashed only the first time a given schema object is seen. The order of checks
is JSON syntax, then the JSON schema (with format assertions), then the
spec's rules (checks a JSON schema cannot say, such as "this label set for
this job" kept apart from the schema). The reason for a failure is one line,
suitable for the dead-letter table.

Every engine's text passes ``check_for_storage`` in the worker, which also
refuses what PostgreSQL or UTF-8 cannot hold (NUL, lone surrogates, numbers
jsonb refuses, text that is not a string): a failed attempt, never a failed
write. ``storable_text`` is how a failed attempt keeps its raw output and
error: NUL and lone surrogates backslash-escaped. An embedding job's vectors
pass ``to_storage`` (their stored form is ``embed.vectors``'s).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import jsonschema_rs

from batch_inference.exceptions import BatchInferenceError
from batch_inference.spec import JobSpec, Rule

if TYPE_CHECKING:
    from jsonschema import Draft202012Validator

# numpy (an embedding's vectors) and jsonschema (the reason an output is
# invalid) are imported where they are used: every CLI command and worker
# imports this module, and most never need either (about 0.2 s of start-up).

MAX_REASON = 300

@dataclass
class _Compiled:
    """Both validators of one output schema, each built once: jsonschema's when first asked for (a
    job whose outputs are all valid never needs it)."""

    schema: dict[str, Any]
    fast: Any                       # jsonschema-rs: "is it valid?" in about 1 us instead of about 40
    _full: Draft202012Validator | None = None

    @property
    def full(self) -> Draft202012Validator:
        """jsonschema's validator: the reason for an invalid output."""
        if self._full is None:
            from jsonschema import Draft202012Validator

            # Formats are asserted: an LLM writing "yesterday" into a "date" field
            # is exactly the failure worth catching.
            self._full = Draft202012Validator(self.schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
        return self._full


_by_hash: dict[str, _Compiled] = {}
# id(schema) -> (schema, compiled). Keeping the schema object alive pins its
# id, so an id hit is always the same object; the spec is frozen.
_by_id: dict[int, tuple[dict[str, Any], _Compiled]] = {}


def schema_hash(schema: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(schema, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _compiled(schema: dict[str, Any]) -> _Compiled:
    hit = _by_id.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    key = schema_hash(schema)
    compiled = _by_hash.get(key)
    if compiled is None:
        compiled = _Compiled(schema, jsonschema_rs.Draft202012Validator(schema, validate_formats=True))
        _by_hash[key] = compiled
    if len(_by_id) > 256:  # a long-lived process checking many specs
        _by_id.clear()
    _by_id[id(schema)] = (schema, compiled)
    return compiled


def validator_for(schema: dict[str, Any]) -> Draft202012Validator:
    return _compiled(schema).full


def fast_validator_for(schema: dict[str, Any]) -> Any:
    return _compiled(schema).fast


class _Unstorable(BatchInferenceError, ValueError):
    """Valid to Python's json module, refused by PostgreSQL's jsonb."""


def _no_constant(name: str) -> Any:
    raise _Unstorable(f"{name} is not JSON (jsonb refuses it)")


# jsonb numbers are PostgreSQL numerics: at most 16383 digits after the
# decimal point ("1e-20000" parses as 0.0 in Python and overflows there).
_NUMERIC_DSCALE_MAX = 16383
# Python's int() refuses longer digit strings (sys.get_int_max_str_digits()).
_INT_DIGITS_MAX = 4300


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Unstorable(f"the number {text[:40]} is out of range")
    if len(text) > 24 or "e" in text or "E" in text:   # only these can need that many digits
        exponent = Decimal(text).as_tuple().exponent
        if isinstance(exponent, int) and -exponent > _NUMERIC_DSCALE_MAX:
            raise _Unstorable(f"the number {text[:40]} is out of range for PostgreSQL "
                              f"(more than {_NUMERIC_DSCALE_MAX} digits after the point)")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _INT_DIGITS_MAX:
        raise _Unstorable(f"an integer has {len(text.lstrip('-'))} digits (at most {_INT_DIGITS_MAX})")
    return int(text)


# What PostgreSQL cannot hold in a string: NUL, and lone UTF-16 surrogates
# (not encodable as UTF-8; an engine that decoded invalid UTF-8 bytes with
# surrogateescape hands them over as U+DC80..U+DCFF).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def _escaped(m: re.Match[str]) -> str:
    return "\\x00" if m.group() == "\x00" else f"\\u{ord(m.group()):04x}"


def storable_text(value: Any) -> str | None:
    """``value`` as text PostgreSQL's ``text`` and UTF-8 hold: NUL and lone
    surrogates backslash-escaped (``\\x00``, ``\\ud800``), anything not a
    string as its ``repr``. For raw outputs and error messages kept with a
    failed attempt."""
    if value is None:
        return None
    if not isinstance(value, str):
        value = repr(value)
    return _UNSTORABLE.sub(_escaped, value) if _UNSTORABLE.search(value) else value


def _unstorable_char(value: Any) -> str | None:
    """What in ``value``'s strings PostgreSQL cannot store, or None: NUL
    (jsonb refuses \\u0000) or a lone UTF-16 surrogate (not encodable as
    UTF-8; a valid pair has already been joined by json.loads)."""
    if isinstance(value, str):
        m = _UNSTORABLE.search(value)
        if m is None:
            return None
        return "a NUL character (\\u0000), which jsonb refuses" if m.group() == "\x00" else \
            f"a lone surrogate (\\u{ord(m.group()):04x}), which is not valid UTF-8 (an invalid byte or a broken pair)"
    if isinstance(value, dict):
        for k, v in value.items():
            bad = _unstorable_char(k) or _unstorable_char(v)
            if bad:
                return bad
    if isinstance(value, list):
        for v in value:
            bad = _unstorable_char(v)
            if bad:
                return bad
    return None


# Built once: json.loads(raw, **options) builds a decoder per call, which
# costs as much as the parse of a short output.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float, parse_int=_bounded_int)
_DECODE = _DECODER.decode
_SCAN = _DECODER.scan_once
_DECODE_LAX = json.JSONDecoder(strict=False, parse_constant=_no_constant, parse_float=_finite_float,
                               parse_int=_bounded_int).decode


def _decode(raw: str) -> Any:
    """``_DECODE(raw)``. Text that is one JSON value with nothing around it
    (nearly every output) is scanned alone, without decode's two whitespace
    matches; anything else, an error included, goes through ``_DECODE``, which
    raises as it always does."""
    try:
        obj, end = _SCAN(raw, 0)
        if end == len(raw):
            return obj
    except (StopIteration, ValueError, RecursionError):
        pass
    return _DECODE(raw)


def _best_match(errors: Any) -> Any:
    from jsonschema.exceptions import best_match

    return best_match(errors)


def _message(error: Any) -> str:
    """A schema error's message with a long instance shortened in the middle, so
    the reason still says what is wrong ("'xxx...xxx' is too long")."""
    message = error.message
    if len(message) > MAX_REASON:
        shown = repr(error.instance)
        if len(shown) > 80 and shown in message:
            message = message.replace(shown, f"{shown[:30]}...{shown[-10:]} ({len(shown)} characters)")
    return message


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def check_output(spec: JobSpec, raw: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """``(obj, None)`` for a valid output, else ``(None, one-line reason)``."""
    obj, _text, err = check_for_storage(spec, raw)
    return obj, err


def check_for_storage(spec: JobSpec, raw: str | None) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """``(obj, text, None)`` for a valid output, where ``text`` is JSON that
    PostgreSQL's jsonb accepts as it is (the engine's own text when it
    already is, which spares the worker a re-serialisation per record);
    else ``(None, None, one-line reason)``."""
    if raw is None:
        return None, None, "engine returned no output"
    if not isinstance(raw, str):
        return None, None, f"engine returned {type(raw).__name__}, not text"
    text: str | None = raw
    try:
        try:
            obj = _decode(raw)
        except json.JSONDecodeError as exc:
            if not exc.msg.startswith("Invalid control character"):
                raise
            # llama.cpp's grammars can let a raw newline or tab into a
            # string. The meaning is intact, but jsonb wants it escaped:
            # accept it and store the object re-serialised.
            obj = _DECODE_LAX(raw)
            text = None
    except (json.JSONDecodeError, RecursionError) as exc:
        detail = f"{exc.msg} at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        return None, None, _short(f"output is not valid JSON: {detail}")
    except _Unstorable as exc:
        return None, None, _short(f"output cannot be stored: {exc}")
    if "\\u" in raw or ("\x00" in raw if raw.isascii() else _UNSTORABLE.search(raw) is not None):
        # A \\u escape or a raw NUL or surrogate: json.loads accepts them,
        # PostgreSQL's jsonb (or UTF-8) may refuse what they decode to, and
        # one such output would fail the whole batch it is written with.
        bad = _unstorable_char(obj)
        if bad:
            return None, None, f"output cannot be stored: a string holds {bad}"
    compiled = _compiled(spec.output_schema)
    # Valid outputs (nearly all) are vouched for by jsonschema-rs; the reason
    # for an invalid one comes from jsonschema (its messages and best_match).
    error = None if compiled.fast.is_valid(obj) else _best_match(compiled.full.iter_errors(obj))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        return None, None, _short(f"output does not match the schema at {where}: {_message(error)}")
    if not isinstance(obj, dict):  # the spec forces type: object; belt and braces
        return None, None, "output is not a JSON object"
    for rule in spec.rules:
        reason = check_rule(rule, obj)
        if reason:
            return None, None, _short(reason)
    return obj, text if text is not None else json.dumps(obj, ensure_ascii=False), None


def _same(a: Any, b: Any) -> bool:
    # JSON equality: Python has True == 1, JSON does not.
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip()) or (isinstance(value, (list, dict)) and not value)


def check_rule(rule: Rule, obj: dict[str, Any]) -> str | None:
    """The reason ``obj`` breaks ``rule``, or None.

    A missing field breaks only ``not_empty``; the other checks apply to a
    field that is present (the schema's ``required`` decides presence).
    """
    name = rule.field
    if name not in obj:
        return f"rule on '{name}': field is missing" if rule.not_empty else None
    value = obj[name]
    if rule.not_empty and _empty(value):
        return f"rule on '{name}': must not be empty"
    if rule.one_of is not None and not any(_same(value, c) for c in rule.one_of):
        allowed = ", ".join(json.dumps(c) for c in rule.one_of)
        return f"rule on '{name}': {json.dumps(value)[:80]} is not one of {allowed}"
    if rule.min_length is not None or rule.max_length is not None:
        if not isinstance(value, (str, list)):
            return f"rule on '{name}': length rules need a string or array, got {type(value).__name__}"
        if rule.min_length is not None and len(value) < rule.min_length:
            return f"rule on '{name}': length {len(value)} is below min_length {rule.min_length}"
        if rule.max_length is not None and len(value) > rule.max_length:
            return f"rule on '{name}': length {len(value)} is above max_length {rule.max_length}"
    return None


# -- an embedding job's vectors ------------------------------------------------

# A vector whose norm is below this cannot be normalized: it points nowhere.
MIN_NORM = 1e-12


def _vector_dtype() -> Any:
    """The stored form of a vector's values, little-endian float32 (``DTYPE``), made when first needed."""
    dtype = globals().get("DTYPE")
    if dtype is None:
        import numpy as np

        globals()["DTYPE"] = dtype = np.dtype("<f4")
    return dtype


def __getattr__(name: str) -> Any:
    """``DTYPE`` for the modules that import it (``embed.vectors``): numpy only once one does."""
    if name == "DTYPE":
        return _vector_dtype()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def to_storage(spec: JobSpec, vector: Any) -> tuple[bytes | None, str | None, str | None]:
    """``(bytes, output JSON text, None)`` for a vector fit to store under ``spec``, else ``(None, None, error)``."""
    import numpy as np

    dims = spec.embedding.dimensions
    try:
        v = np.asarray(vector, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        return None, None, f"embedding is not a list of numbers: {type(exc).__name__}"
    if v.ndim != 1:
        return None, None, f"embedding has shape {tuple(v.shape)}, not one vector"
    if v.shape[0] != dims:
        return None, None, f"embedding has {v.shape[0]} dimensions; the spec's embedding.dimensions is {dims}"
    if not np.isfinite(v).all():
        return None, None, f"embedding holds {int((~np.isfinite(v)).sum())} value(s) that are not finite"
    norm = float(np.linalg.norm(v))
    if spec.embedding.normalize:
        if norm < MIN_NORM:
            return None, None, "embedding is the zero vector: it cannot be normalized"
        v = v / norm
    stored = v.astype(_vector_dtype())
    if not np.isfinite(stored).all():     # a float64 value past float32's range
        return None, None, "embedding holds a value outside float32's range"
    return stored.tobytes(), json.dumps({"dimensions": dims, "norm": round(norm, 6)}), None
