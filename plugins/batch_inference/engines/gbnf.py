"""The llama-cpp engine's JSON-schema-to-GBNF converter: llama-cpp-python's, with the bounds it drops.

llama-cpp-python's converter (``llama_cpp.llama_grammar.SchemaConverter``)
compiles string ``minLength``/``maxLength``, anchored ``pattern`` and array
``minItems``/``maxItems``, but turns ``{"type": "integer", "minimum": 1,
"maximum": 5}`` into any integer, drops number bounds, drops lengths beside
a pattern, ignores item counts on an array without ``items``, and fails on an
unanchored pattern (llama-cpp-python then falls back to plain JSON: no schema
at all). :class:`BoundedConverter` adds to it:

* integers: ``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum``
  as one range rule (``int_range``, the digit-by-digit construction of
  llama.cpp's C++ ``build_min_max_int``);
* numbers whose bounds are whole numbers (0, 1, 5, 100): a range rule over
  the integral part and the fraction (``number_range``); a fractional bound is
  left out of the grammar and reported;
* a pattern not anchored at both ends is matched anywhere (``.*`` added), and
  ``.`` in a pattern is one JSON string character, so the pattern cannot end
  the string early; a pattern the converter cannot compile is reported and the
  string left free;
* ``minItems``/``maxItems`` on an array without ``items``.

What it still cannot enforce (``multipleOf``, ``uniqueItems``, lengths beside
a pattern, fractional number bounds, an uncompilable pattern) is listed in
``BoundedConverter.gaps``, each ``path: keyword``; the engine reports them at
submit (``LlamaCppEngine.unenforced``). The output is always validated
against the whole schema after generation, whatever the grammar holds.

Needs llama-cpp-python (imported by the engine only when it loads or checks a spec).
"""

from __future__ import annotations

import json
import math
from typing import Any

from llama_cpp.llama_grammar import JSON_GBNF, PRIMITIVE_RULES, RESERVED_NAMES, SchemaConverter

# The fraction of a number: any (integral part anywhere in a range), or none but zeros (at an inclusive bound).
ANY_FRACTION = '("." [0-9]{1,15})?'
ZERO_FRACTION = '("." "0"{1,15})?'
NONZERO_FRACTION = '"." [0-9]{0,14} [1-9]'
ANY_VALUE = ("object", "array", "string", "number", "boolean", "null")
NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Keywords beside which the converter's own rule for the type is taken as it is.
_OWN_RULE_KEYS = ("$ref", "oneOf", "anyOf", "allOf", "const", "enum")


def int_range(lo: int | None, hi: int | None) -> str:
    """A GBNF expression for the integers from ``lo`` to ``hi`` (None: unbounded), both included,
    written as JSON writes them (no leading zero, no ``-0``), at most 16 digits when unbounded."""
    if lo is not None and hi is not None:
        return _between(lo, hi)
    if lo is not None:
        return f'"-" ({_between(1, -lo)}) | {_at_least(0)}' if lo < 0 else _at_least(lo)
    if hi is None:
        raise ValueError("int_range needs a bound")
    return f'"-" ({_at_least(1)}) | {_between(0, hi)}' if hi >= 0 else f'"-" ({_at_least(-hi)})'


def _at_least(lo: int) -> str:
    """The integers from ``lo`` >= 0 up: as many digits as ``lo`` and not below it, or more digits."""
    if lo == 0:
        return "[0] | [1-9] [0-9]{0,15}"
    width = len(str(lo))
    return f"{_same_width(str(lo), '9' * width)} | [1-9] [0-9]{{{width},15}}"


def _between(lo: int, hi: int) -> str:
    """The integers from ``lo`` to ``hi`` (lo <= hi): llama.cpp's ``build_min_max_int`` with both bounds."""
    if lo < 0 and hi < 0:
        return f'"-" ({_between(-hi, -lo)})'
    parts = []
    if lo < 0:
        parts.append(f'"-" ({_between(1, -lo)})')
        lo = 0
    min_s, max_s = str(lo), str(hi)
    for digits in range(len(min_s), len(max_s)):
        parts.append(_same_width(min_s, "9" * digits))
        min_s = "1" + "0" * digits
    parts.append(_same_width(min_s, max_s))
    return " | ".join(parts)


def _same_width(frm: str, to: str) -> str:
    """The digit strings of ``len(frm)`` characters from ``frm`` to ``to`` (as wide as ``frm``): the
    ``uniform_range`` of llama.cpp's ``build_min_max_int`` (common/json-schema-to-grammar.cpp)."""
    out: list[str] = []

    def digit_range(a: str, b: str) -> None:
        out.append(f"[{a}]" if a == b else f"[{a}-{b}]")

    def digits(n: int) -> None:
        out.append("[0-9]" if n == 1 else f"[0-9]{{{n}}}")

    def uniform(frm: str, to: str) -> None:
        i = 0
        while i < len(frm) and i < len(to) and frm[i] == to[i]:
            i += 1
        if i > 0:
            out.append(f'"{frm[:i]}"')
        if i >= len(frm) or i >= len(to):
            return
        if i > 0:
            out.append(" ")
        sub_len = len(frm) - i - 1
        if sub_len == 0:
            out.append(f"[{frm[i]}-{to[i]}]")
            return
        from_sub, to_sub = frm[i + 1:], to[i + 1:]
        zeros, nines = "0" * sub_len, "9" * sub_len
        to_reached = False
        out.append("(")
        if from_sub == zeros:
            digit_range(frm[i], chr(ord(to[i]) - 1))
            out.append(" ")
            digits(sub_len)
        else:
            out.append(f"[{frm[i]}] (")
            uniform(from_sub, nines)
            out.append(")")
            if ord(frm[i]) < ord(to[i]) - 1:
                out.append(" | ")
                if to_sub == nines:
                    digit_range(chr(ord(frm[i]) + 1), to[i])
                    to_reached = True
                else:
                    digit_range(chr(ord(frm[i]) + 1), chr(ord(to[i]) - 1))
                out.append(" ")
                digits(sub_len)
        if not to_reached:
            out.append(" | ")
            digit_range(to[i], to[i])
            out.append(" ")
            uniform(zeros, to_sub)
        out.append(")")

    uniform(frm, to)
    return "".join(out)


def integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The least and greatest integer an integer schema's bounds allow (None: unbounded)."""
    lows, highs = [], []
    if isinstance(schema.get("minimum"), (int, float)):
        lows.append(math.ceil(schema["minimum"]))
    if isinstance(schema.get("exclusiveMinimum"), (int, float)):
        lows.append(math.floor(schema["exclusiveMinimum"]) + 1)
    if isinstance(schema.get("maximum"), (int, float)):
        highs.append(math.floor(schema["maximum"]))
    if isinstance(schema.get("exclusiveMaximum"), (int, float)):
        highs.append(math.ceil(schema["exclusiveMaximum"]) - 1)
    return (max(lows) if lows else None), (min(highs) if highs else None)


def _nonnegative(a: int, a_open: bool, b: int | None, b_open: bool) -> list[str]:
    """Alternatives for the numbers from ``a`` to ``b`` (None: unbounded), 0 <= a, each end open or not."""
    alts = []
    first = a + 1 if a_open else a
    last = None if b is None else b - 1
    if last is None or first <= last:
        alts.append(f"({int_range(first, last)}) {ANY_FRACTION}")
    if a_open and (b is None or a < b):
        alts.append(f'"{a}" {NONZERO_FRACTION}')
    if b is not None and not b_open and (b > a or not a_open):
        alts.append(f'"{b}" {ZERO_FRACTION}')
    return alts


def number_range(lo: int | None, lo_open: bool, hi: int | None, hi_open: bool) -> str:
    """A GBNF expression for the numbers from ``lo`` to ``hi`` (whole-number bounds; None: unbounded;
    ``*_open``: that end excluded), written without an exponent. ValueError when none is allowed."""
    alts: list[str] = []
    if hi is None or hi >= 0:                       # the part at 0 and above
        a, a_open = (0, False) if lo is None or lo < 0 else (lo, lo_open)
        alts += _nonnegative(a, a_open, hi, hi_open)
    if lo is None or lo < 0:                        # below 0: "-" and the magnitude
        if hi is None or hi >= 0:
            mags = _nonnegative(0, True, None if lo is None else -lo, lo_open)
        else:
            mags = _nonnegative(-hi, hi_open, None if lo is None else -lo, lo_open)
        if mags:
            alts.append('"-" (' + " | ".join(mags) + ")")
    if not alts:
        raise ValueError("no number lies within these bounds")
    return " | ".join(f"({alt})" for alt in alts)


# Escapes the converter would copy into a literal as they are: the characters they stand for.
_CLASS_ESCAPES = {"d": "0-9", "w": "A-Za-z0-9_", "s": " "}


def grammar_pattern(pattern: str) -> str:
    """``pattern`` as the converter reads it: anchored at both ends (JSON Schema matches it anywhere,
    so an open end gets ``.*``), each escape a character class. ValueError for what the grammar
    cannot hold as JSON text (a quote or a backslash in the string) or an escape it does not know."""
    out = []
    in_class = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == '"':
            raise ValueError("a quote in a pattern")
        if c == "\\":
            nxt = pattern[i + 1:i + 2]
            if nxt in _CLASS_ESCAPES:
                chars = _CLASS_ESCAPES[nxt]
            elif nxt and not nxt.isalnum() and nxt not in '"\\':
                chars = "\\" + nxt if nxt in "[]^-" else nxt
            else:
                raise ValueError(f"the escape \\{nxt} in a pattern")
            out.append(chars if in_class else f"[{chars}]")
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    body = "".join(out)
    return ("" if body.startswith("^") else "^.*") + body + ("" if body.endswith("$") else ".*$")


def _whole(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()


class BoundedConverter(SchemaConverter):
    """llama-cpp-python's converter with integer and number ranges, patterns matched as JSON
    Schema does, and item counts on untyped items; ``gaps`` lists what the grammar leaves out."""

    def __init__(self) -> None:
        super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        self.gaps: list[str] = []

    def _gap(self, name: str, keyword: str, why: str = "") -> None:
        path = (name or "(root)").replace("-", ".")
        self.gaps.append(f"{path}: {keyword}{f' ({why})' if why else ''}")

    def _add_rule(self, name: str, rule: str) -> str:
        # ``.`` in a pattern: one JSON string character, never a bare quote that would end the string.
        if name == "dot":
            if "char" not in self._rules:
                self._add_primitive("char", PRIMITIVE_RULES["char"])
            rule = "char"
        return super()._add_rule(name, rule)

    def visit(self, schema: dict[str, Any], name: str) -> str:
        if not isinstance(schema, dict) or any(k in schema for k in _OWN_RULE_KEYS):
            return super().visit(schema, name)
        kind = schema.get("type")
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        for keyword in ("multipleOf", "uniqueItems"):
            if keyword in schema:
                self._gap(name, keyword)
        if kind == "integer" and any(k in schema for k in NUMBER_BOUNDS):
            lo, hi = integer_bounds(schema)
            if lo is not None and hi is not None and lo > hi:
                self._gap(name, "minimum/maximum", "no integer lies within them")
                return super().visit(schema, name)
            return self._add_rule(rule_name, f"({int_range(lo, hi)}) space")
        if kind == "number" and any(k in schema for k in NUMBER_BOUNDS):
            return self._number(schema, name, rule_name)
        if kind == "string" and "pattern" in schema:
            return self._pattern(schema, name, rule_name)
        if kind == "array" and "items" not in schema and "prefixItems" not in schema and (
                "minItems" in schema or "maxItems" in schema):
            return super().visit({**schema, "items": {"type": list(ANY_VALUE)}}, name)
        return super().visit(schema, name)

    def _number(self, schema: dict[str, Any], name: str, rule_name: str) -> str:
        lo = hi = None
        lo_open = hi_open = False
        for keyword in NUMBER_BOUNDS:
            if keyword not in schema:
                continue
            value = schema[keyword]
            if not _whole(value):
                self._gap(name, keyword, "a fractional bound on a number")
                continue
            v, is_open = int(value), keyword.startswith("exclusive")
            if keyword.endswith("inimum") and (lo is None or v > lo or (v == lo and is_open)):
                lo, lo_open = v, is_open
            elif keyword.endswith("aximum") and (hi is None or v < hi or (v == hi and is_open)):
                hi, hi_open = v, is_open
        if lo is None and hi is None:
            return super().visit({k: v for k, v in schema.items() if k not in NUMBER_BOUNDS}, name)
        try:
            body = number_range(lo, lo_open, hi, hi_open)
        except ValueError as exc:
            self._gap(name, "minimum/maximum", str(exc))
            return super().visit({k: v for k, v in schema.items() if k not in NUMBER_BOUNDS}, name)
        return self._add_rule(rule_name, f"({body}) space")

    def _pattern(self, schema: dict[str, Any], name: str, rule_name: str) -> str:
        pattern = schema["pattern"]
        for keyword in ("minLength", "maxLength"):
            if keyword in schema:
                self._gap(name, keyword, "beside a pattern")
        rules = dict(self._rules)
        try:
            return self._visit_pattern(grammar_pattern(pattern), rule_name)
        except Exception:  # noqa: BLE001 - a pattern this converter cannot read: the string stays free
            self._rules = rules
            self._gap(name, "pattern", "the grammar cannot express it")
            rest = {k: v for k, v in schema.items() if k not in ("pattern", "minLength", "maxLength")}
            return super().visit(rest, name)


def schema_to_gbnf(schema: dict[str, Any]) -> tuple[str, list[str]]:
    """The GBNF grammar of ``schema`` and the keywords it leaves out (``path: keyword``). A schema the
    converter cannot read at all gets llama.cpp's grammar of any JSON value, and says so."""
    converter = BoundedConverter()
    try:
        resolved = converter.resolve_refs(json.loads(json.dumps(schema)), "output_schema")
        converter.visit(resolved, "")
    except Exception as exc:  # noqa: BLE001 - the converter asserts on what it does not know
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        return JSON_GBNF, [f"(root): the whole schema (only JSON is enforced: {why})"]
    return converter.format_grammar(), converter.gaps
