"""The spec's output schema and rules compiled into one SQL predicate that vouches for a row.

``output_predicate(spec, conn)`` is true for a stored output only if
``outputs.check_output`` would accept it: the validator evaluates it in the
scan that counts categories, so only the rows it does not vouch for are read
into Python and checked there. A keyword the SQL form cannot decide exactly
(pattern, format, $ref, ...) raises ``Unsupported`` inside the compiler;
``output_predicate`` then vouches for nothing, and every row is checked in
Python: slower, never wrong.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
from psycopg import sql

from batch_inference.exceptions import BatchInferenceError
from batch_inference.spec import JobSpec, Rule


class Unsupported(BatchInferenceError):
    """A keyword the SQL form cannot check exactly; the caller falls back to Python."""


# Keywords with no effect on validity.
_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated",
                          "readOnly", "writeOnly", "$schema", "$id", "contentMediaType", "contentEncoding"})
_SUPPORTED = frozenset({"type", "enum", "const", "minLength", "maxLength", "minimum", "maximum",
                        "exclusiveMinimum", "exclusiveMaximum", "required", "properties",
                        "additionalProperties", "minProperties", "maxProperties", "items", "minItems",
                        "maxItems", "allOf", "anyOf"})
# Bounds beyond this are not exactly representable as doubles; the comparison
# Python makes could then differ from the decimal one.
_MAX_EXACT = 2 ** 53

TRUE = sql.SQL("true")
FALSE = sql.SQL("false")


def _and(parts: list[sql.Composable]) -> sql.Composable:
    parts = [p for p in parts if p is not TRUE]
    if not parts:
        return TRUE
    return sql.SQL("(") + sql.SQL(" AND ").join(parts) + sql.SQL(")")


def _or(parts: list[sql.Composable]) -> sql.Composable:
    if not parts:
        return FALSE
    return sql.SQL("(") + sql.SQL(" OR ").join(parts) + sql.SQL(")")


def _when(x: sql.Composable, kind: str, pred: sql.Composable) -> sql.Composable:
    """``pred`` applies only to values of JSON type ``kind`` (JSON Schema keywords
    constrain one type and let the others through). CASE fixes the evaluation
    order, so a cast inside ``pred`` never meets the wrong type."""
    return sql.SQL("(CASE WHEN jsonb_typeof({x}) = {k} THEN {p} ELSE true END)").format(
        x=x, k=sql.Literal(kind), p=pred)


def _lit(value: Any) -> sql.Composable:
    return sql.SQL("{}::jsonb").format(sql.Literal(json.dumps(value, ensure_ascii=False)))


def _num(x: sql.Composable) -> sql.Composable:
    return sql.SQL("({}::numeric)").format(x)


def _bound(x: sql.Composable, op: str, bound: Any) -> sql.Composable:
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or abs(bound) > _MAX_EXACT:
        raise Unsupported(f"numeric bound {bound!r}")
    # Both the exact decimal comparison and the double one: Python compares the
    # parsed float, and only when both hold is its verdict sure to agree.
    return sql.SQL("({n} {op} {b}::numeric AND {n}::float8 {op} {b}::float8)").format(
        n=_num(x), op=sql.SQL(op), b=sql.Literal(str(bound)))


def _within(n: sql.Composable, lo: int, hi: int) -> sql.Composable:
    """``n BETWEEN lo AND hi`` with ``n`` evaluated once (BETWEEN evaluates its
    operand twice, and a character count is a loop over the string)."""
    return sql.SQL("(abs(2 * {n} - {mid2}) <= {span})").format(
        n=n, mid2=sql.Literal(int(lo) + int(hi)), span=sql.Literal(int(hi) - int(lo)))


def schema_predicate(schema: Any, x: sql.Composable, text: sql.Composable | None = None) -> sql.Composable:
    """A boolean SQL expression over the jsonb value ``x``: true only if ``x`` is
    valid against ``schema``. Raises Unsupported for keywords it cannot decide.
    ``text`` is the cheapest SQL for ``x`` as text (``parent ->> 'key'``).

    Only monotone combinators (allOf, anyOf) are compiled, so each piece need
    only be sound (true implies valid), never its negation."""
    if schema is True or schema == {}:
        return TRUE
    if schema is False:
        return FALSE
    if not isinstance(schema, dict):
        raise Unsupported(f"schema {schema!r}")
    unknown = set(schema) - _SUPPORTED - _ANNOTATIONS
    if unknown:
        raise Unsupported(", ".join(sorted(unknown)))
    if text is None:
        text = sql.SQL("({} #>> '{{}}')").format(x)
    parts: list[sql.Composable] = []
    t = sql.SQL("jsonb_typeof({})").format(x)
    kinds: list[str] = []

    values = list(schema.get("enum", []))
    string_enum = bool(values) and all(isinstance(v, str) for v in values)
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        alts: list[sql.Composable] = []
        for kind in kinds:
            if kind == "integer":
                # 1.0 is an integer to JSON Schema; 1e400 would be a float('inf') to Python.
                alts.append(sql.SQL("({t} = 'number' AND (CASE WHEN {t} = 'number' THEN "
                                    "{n} = trunc({n}) AND abs({n}) < 1e300 ELSE false END))").format(t=t, n=_num(x)))
            elif kind in ("number", "string", "boolean", "null", "object", "array"):
                alts.append(sql.SQL("{} = {}").format(t, sql.Literal(kind)))
            else:
                raise Unsupported(f"type {kind!r}")
        if not (string_enum and "string" in kinds):   # else the enum's own type test below implies it
            parts.append(_or(alts))
    if "enum" in schema:
        if string_enum:
            # One text comparison per row instead of one jsonb equality per value.
            parts.append(sql.SQL("({t} = 'string' AND {s} = ANY ({vals}::text[]))").format(
                t=t, s=text, vals=sql.Literal(values)))
        else:
            parts.append(_or([sql.SQL("{} = {}").format(x, _lit(v)) for v in values]))
    if "const" in schema:
        parts.append(sql.SQL("{} = {}").format(x, _lit(schema["const"])))

    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if lo is not None or hi is not None:
        if lo is not None and hi is not None:
            cond = _within(sql.SQL("length({})").format(text), lo, hi)
        elif hi is not None:
            # Characters never outnumber bytes: the byte count (free) settles
            # most rows, the character count (a loop over the string) the rest.
            cond = sql.SQL("(octet_length({s}) <= {n} OR length({s}) <= {n})").format(s=text, n=sql.Literal(int(hi)))
        else:
            cond = sql.SQL("length({}) >= {}").format(text, sql.Literal(int(lo)))
        # With type string asserted alongside, a non-string fails anyway and
        # measuring its text form is harmless: no CASE needed.
        parts.append(cond if kinds == ["string"] else _when(x, "string", cond))

    for key, op in (("minimum", ">="), ("maximum", "<="), ("exclusiveMinimum", ">"), ("exclusiveMaximum", "<")):
        if key in schema:
            parts.append(_when(x, "number", _bound(x, op, schema[key])))

    obj: list[sql.Composable] = []
    required = list(schema.get("required") or [])
    if required:
        obj.append(sql.SQL("{} ?& {}").format(x, sql.Literal(required)))
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise Unsupported("properties")
    for name, sub in props.items():
        key = sql.Literal(name)
        p = schema_predicate(sub, sql.SQL("({} -> {})").format(x, key), sql.SQL("({} ->> {})").format(x, key))
        if p is TRUE:
            continue
        if name in required:
            obj.append(p)      # absent: ?& above is false, and so is the whole AND
        else:
            obj.append(sql.SQL("(NOT ({x} ? {k}) OR {p})").format(x=x, k=key, p=p))
    if "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        if extra is False:
            obj.append(sql.SQL("({} - {}::text[]) = '{{}}'::jsonb").format(x, sql.Literal(list(props))))
        elif extra is not True and extra != {}:
            p = schema_predicate(extra, sql.SQL("e.value"))
            obj.append(sql.SQL("NOT EXISTS (SELECT 1 FROM jsonb_each({x}) e WHERE NOT (e.key = ANY ({k}::text[])) "
                               "AND NOT coalesce({p}, false))").format(x=x, k=sql.Literal(list(props)), p=p))
    for key_, op in (("minProperties", ">="), ("maxProperties", "<=")):
        if key_ in schema:
            obj.append(sql.SQL("(SELECT count(*) FROM jsonb_object_keys({})) {} {}").format(
                x, sql.SQL(op), sql.Literal(int(schema[key_]))))
    if obj:
        parts.append(_when(x, "object", _and(obj)))

    arr: list[sql.Composable] = []
    if "items" in schema:
        if not isinstance(schema["items"], (dict, bool)):
            raise Unsupported("items as a list")
        p = schema_predicate(schema["items"], sql.SQL("e.value"))
        if p is not TRUE:
            arr.append(sql.SQL("NOT EXISTS (SELECT 1 FROM jsonb_array_elements({x}) e WHERE NOT coalesce({p}, false))")
                       .format(x=x, p=p))
    if "minItems" in schema:
        arr.append(sql.SQL("jsonb_array_length({}) >= {}").format(x, sql.Literal(int(schema["minItems"]))))
    if "maxItems" in schema:
        arr.append(sql.SQL("jsonb_array_length({}) <= {}").format(x, sql.Literal(int(schema["maxItems"]))))
    if arr:
        parts.append(_when(x, "array", _and(arr)))

    for sub in schema.get("allOf", []):
        parts.append(schema_predicate(sub, x, text))
    if "anyOf" in schema:
        parts.append(_or([schema_predicate(sub, x, text) for sub in schema["anyOf"]]))
    return _and(parts)


# Python's str.strip() removes exactly the characters for which isspace() is
# true; a string with any other character is not blank to check_rule.
_NOT_BLANK = "[^" + "".join(chr(c) for c in range(0x3001) if chr(c).isspace()) + "]"


def rule_predicate(rule: Rule, x: sql.Composable) -> sql.Composable:
    """SQL that vouches for ``outputs.check_rule(rule, obj)`` finding nothing."""
    v = sql.SQL("({} -> {})").format(x, sql.Literal(rule.field))
    present = sql.SQL("({} ? {})").format(x, sql.Literal(rule.field))
    checks: list[sql.Composable] = []
    if rule.not_empty:
        checks.append(sql.SQL("(CASE jsonb_typeof({v}) WHEN 'null' THEN false "
                              "WHEN 'string' THEN ({v} #>> '{{}}') ~ {nb} "
                              "WHEN 'array' THEN jsonb_array_length({v}) > 0 "
                              "WHEN 'object' THEN {v} <> '{{}}'::jsonb ELSE true END)").format(v=v, nb=sql.Literal(_NOT_BLANK)))
    if rule.one_of is not None:
        checks.append(_or([sql.SQL("{} = {}").format(v, _lit(c)) for c in rule.one_of]))
    if rule.min_length is not None or rule.max_length is not None:
        def within(n: sql.Composable) -> sql.Composable:
            if rule.max_length is None:
                return sql.SQL("{} >= {}").format(n, sql.Literal(rule.min_length))
            return _within(n, rule.min_length or 0, rule.max_length)
        checks.append(sql.SQL("(CASE jsonb_typeof({v}) WHEN 'string' THEN {s} WHEN 'array' THEN {a} ELSE false END)").format(
            v=v, s=within(sql.SQL("length({} #>> '{{}}')").format(v)), a=within(sql.SQL("jsonb_array_length({})").format(v))))
    if not checks:
        return TRUE
    if rule.not_empty:
        return _and([present, *checks])          # a missing field breaks not_empty
    return sql.SQL("(NOT {} OR {})").format(present, _and(checks))


def output_predicate(spec: JobSpec, conn: psycopg.Connection, column: str = "output") -> tuple[sql.SQL, str | None]:
    """The vouching predicate for a job's outputs (over ``r.<column>``), never
    NULL, rendered for a statement that also takes %(name)s parameters.
    Second item: why the schema could not be compiled (then the predicate is
    ``false`` and every row is checked in Python)."""
    x = sql.SQL("r.{}").format(sql.Identifier(column))
    try:
        parts = [schema_predicate(spec.output_schema, x)]
        if spec.output_schema.get("type") != "object":   # the spec forces it; belt and braces
            parts.insert(0, sql.SQL("jsonb_typeof({}) = 'object'").format(x))
        parts += [rule_predicate(rule, x) for rule in spec.rules]
    except Unsupported as exc:
        return sql.SQL("false"), f"schema keywords checked in Python only: {exc}"
    text = sql.SQL("coalesce({}, false)").format(_and(parts)).as_string(conn)
    # A '%' inside a literal (an enum value "100%") would read as a parameter.
    return sql.SQL(text.replace("%", "%%")), None
