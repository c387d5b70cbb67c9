"""The readers' interface (``Reader``) and the rule by which a source's values become a
record's text and ACL (docs/sources.md). Each kind's module imports this one, never the package."""


from __future__ import annotations

import datetime as dt
import decimal
import gc
import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from batch_inference.exceptions import SnapshotError
from batch_inference.lineage import Ident
from batch_inference.prompting import columns_text, record_chars
from batch_inference.snapshot import clean_text
from batch_inference.spec import JobSpec

_DECODER = json.JSONDecoder()
ROWS_PER_FETCH = 10_000   # rows a reader holds at once (a fetchmany, an Arrow batch)


class Reader(ABC):
    """One source of records (``spec.source``); nothing is contacted until ``check`` or ``rows``."""

    kind: str

    def __init__(self, spec: JobSpec, *, s3_endpoint_url: str | None = None, aws_conn_id: str | None = None):
        self.spec = spec
        self.source = spec.source
        self.name = spec.source.label
        self.s3_endpoint_url = s3_endpoint_url
        self.aws_conn_id = aws_conn_id
        self.ledger: Any = None   # the ledger's connection, set by plan.submit (an Iceberg SQL catalog lives there)

    def check(self) -> None:
        """Refuse now (one line, ``SnapshotError``) what ``rows`` would refuse for every record."""

    @abstractmethod
    def rows(self) -> Iterator[dict[str, Any]] | None:
        """The records, lazily, in bounded memory; None when the ledger reads the source itself (SQL)."""

    def pin(self) -> dict[str, Any]:
        """What pins the input, as ``source`` fields: recorded with the job, and read back by a resubmit."""
        return {}

    def pinned(self) -> JobSpec:
        """The spec with ``pin()`` written into its source (not part of the job version: the rows are)."""
        pin = self.pin()
        if not pin:
            return self.spec
        return self.spec.with_overrides(source={**self.spec.source.model_dump(mode="json"), **pin})

    def lineage(self) -> list[Ident]:
        """The OpenLineage input datasets, named as the OpenLineage naming spec names this source."""
        return []

    def close(self) -> None:
        """Release what the reader holds open (a connection, a catalog)."""

    def refuse(self, problem: str) -> SnapshotError:
        """The one line naming this source and the problem."""
        return SnapshotError(f"source {self.name}: {problem}")


# -- a value becomes text -------------------------------------------------------

def _float_text(x: float) -> str:
    """A float8 as PostgreSQL 12+ writes it: the shortest digits that read back as the same number,
    positional from 1e-4 up to 1e15, else ``d.ddde+XX``; ``NaN``, ``Infinity``, ``-Infinity``."""
    if x != x:
        return "NaN"
    if x in (float("inf"), float("-inf")):
        return "Infinity" if x > 0 else "-Infinity"
    if x == 0:
        return "-0" if str(x).startswith("-") else "0"
    d = decimal.Decimal(repr(x))
    sign, digits, _ = d.as_tuple()
    exp10 = d.adjusted()
    text = "".join(map(str, digits)).rstrip("0") or "0"
    if exp10 < -4 or exp10 >= 15:
        mant = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{'-' if sign else ''}{mant}e{'-' if exp10 < 0 else '+'}{abs(exp10):02d}"
    out = format(d, "f")
    if "." in out:
        out = out.rstrip("0").rstrip(".")
    return out


def _time_text(text: str) -> str:
    """ISO time text without the trailing zeros of its fraction (``12:00:00.5``), as PostgreSQL writes it."""
    head, dot, frac = text.partition(".")
    if not dot:
        return text
    digits = frac.rstrip("0")
    return head + ("." + digits if digits else "")


def _jsonb_order(value: Any) -> Any:
    """A JSON value with its object keys in jsonb's order (shorter first, then by bytes)."""
    if isinstance(value, Mapping):
        return {k: _jsonb_order(value[k]) for k in sorted(value, key=lambda k: (len(str(k).encode()),
                                                                                  str(k).encode()))}
    if isinstance(value, (list, tuple)):
        return [_jsonb_order(v) for v in value]
    return value


def to_text(value: Any) -> str | None:
    """A column value as the text a prompt sees, the same for every source (docs/sources.md).

    Text as is; integers in digits; decimals with their scale (``1.50``);
    floats as PostgreSQL writes a float8; booleans ``true``/``false``; dates,
    times and timestamps in ISO 8601 with a space (``2026-01-02 03:04:05.5``,
    an aware one in UTC with ``+00``); UUIDs in their usual form; JSON objects
    and arrays as jsonb writes them. Bytes and anything else cannot become
    text: ``TypeError`` (a reader turns it into one line)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float_text(value)
    if isinstance(value, decimal.Decimal):
        return "NaN" if value.is_nan() else format(value, "f")
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(dt.timezone.utc).replace(tzinfo=None)
            return _time_text(value.isoformat(sep=" ")) + "+00"
        return _time_text(value.isoformat(sep=" "))
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, dt.time):
        return _time_text(value.isoformat())
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (Mapping, list, tuple)):
        try:
            return json.dumps(_jsonb_order(value), ensure_ascii=False, allow_nan=False, default=_json_default)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"a JSON value that cannot become text ({exc})") from None
    raise TypeError(f"a value of type {type(value).__name__} cannot become text")


def _json_default(value: Any) -> Any:
    text = to_text(value)   # a date or a decimal inside a JSON value (a Parquet struct, a Snowflake VARIANT)
    return text


def to_acl(value: Any) -> list[str] | None:
    """An ACL value as the snapshot's text[]: a list, a JSON array written as text, or one value."""
    if value is None:
        return None
    if type(value) is str and value[:1] == "[" or isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = _DECODER.decode(value)
        except ValueError:
            return [value]
    if isinstance(value, (list, tuple)):
        return [v if type(v) is str else str(to_text(v)) for v in value]
    return [str(to_text(value))]


def record(spec: JobSpec, record_id: Any, values: Sequence[Any], acl: Any) -> dict[str, Any]:
    """One row for ``snapshot.stage_from_rows`` from the values of ``spec.source.record_columns``.

    One ``text_column``: its value as text (the snapshot judges it). Several
    ``columns``: the JSON array of their texts (``prompting.columns_text``),
    judged whole here as ``source_columns_relation`` judges one read in SQL:
    a NUL or a lone surrogate in any column, then over ``max_input_chars``
    characters in all, then every column blank."""
    rid = None if record_id is None else to_text(record_id)
    if not spec.source.columns:
        return {"record_id": rid, "text": to_text(values[0]), "acl": to_acl(acl)}
    texts: list[str | None] = []
    reject = None
    for v in values:
        if type(v) is str and v.isascii() and "\x00" not in v:   # the common case, without the checks' calls
            texts.append(v)
            continue
        text, bad = clean_text(to_text(v))
        texts.append(text)
        reject = reject or bad
    chars = record_chars(texts)
    if reject is None and chars > spec.max_input_chars:
        reject = f"input over the length cap ({chars} characters > {spec.max_input_chars})"
    if reject is None and not any(t and t.strip(" \t\n\r\f\x0b") for t in texts):
        reject = "empty text"
    return {"record_id": rid, "text": columns_text(texts), "acl": to_acl(acl), "reject": reject}


@contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while a fetched batch of rows is turned into columns.

    A fetch makes ``ROWS_PER_FETCH`` row tuples at once, which the collector
    would otherwise scan again and again while they are alive (a collection
    every 700 new objects, and full ones over every object the process holds:
    Airflow's, the providers'); the rows hold no cycles and are freed by
    reference counting when the batch is done. Restored on the way out (only
    if it was on), so nothing outside the batch runs without it."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def read_columns(source: Any) -> list[str]:
    """The columns a reader reads: the id, the record's columns, the ACL."""
    return [source.id_column, *source.record_columns, *([source.acl_column] if source.acl_column else [])]


def batch_records(reader: Reader, batch: Any, where: str = "") -> Iterator[dict[str, Any]]:
    """The records of one Arrow record batch (a Parquet file's, an Iceberg scan's), as ``record`` makes them."""
    src = reader.source
    yield from _records(reader, {c: batch.column(c) for c in read_columns(src)}, where)


def _records(reader: Reader, columns: Mapping[str, Any], where: str) -> Iterator[dict[str, Any]]:
    """``record`` row by row over columns (Arrow arrays or Python lists): the rule's reference path."""
    src = reader.source
    data = {c: (v.to_pylist() if hasattr(v, "to_pylist") else v) for c, v in columns.items()}
    for i, rid in enumerate(data[src.id_column]):
        try:
            yield record(reader.spec, rid, [data[c][i] for c in src.record_columns],
                         data[src.acl_column][i] if src.acl_column else None)
        except TypeError as exc:
            raise reader.refuse(f"{where}record {rid!r}: {exc}") from None


class Records:
    """A reader's records: column batches of ``snapshot.stage_schema`` (``batches``, what
    ``snapshot.stage_from_rows`` copies in binary); iterated, one dict per record."""

    def __init__(self, batches: Iterator[Any]):
        self._batches = batches

    def batches(self) -> Iterator[Any]:
        return self._batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self._batches:
            yield from batch.to_pylist()


def column_batch(reader: Reader, columns: Mapping[str, Any], where: str = "") -> Any:
    """The staged records (``snapshot.stage_schema``) of one batch of source columns, each an Arrow
    array or a Python list or tuple, by column name (``read_columns``).

    Column-wise where the rule is plain: text, integers, booleans and NULLs
    become text with pyarrow compute, a record of several columns is its JSON
    array built from them, and its checks (the length cap, blank) are column
    tests; an ACL is a list of text as is, or each distinct value read once by
    ``to_acl``. A column of any other type goes value by value through
    ``to_text``; a batch with what the column path does not write the way
    ``record`` does (a NUL, a control character that JSON writes as ``\\u00XX``,
    a value that cannot become text) is made row by row by ``record`` itself,
    which gives the same text, reject reason or one-line refusal."""
    from batch_inference.snapshot import staged_columns

    try:
        batch = _column_batch(reader.spec, columns)
    except Exception:  # noqa: BLE001 - anything the column path does not handle: the row path decides
        batch = None
    return batch if batch is not None else staged_columns(list(_records(reader, columns, where)))


# JSON's escapes that ``json.dumps`` writes as two characters; the other control characters take the row path.
_JSON_ESCAPES = (("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t"),
                 ("\b", "\\b"), ("\f", "\\f"))
_ESCAPED_CONTROL_BYTES = [8, 9, 10, 12, 13]   # with '"' and the backslash: what JSON escapes in two characters
_OTHER_CONTROL_BYTES = [*range(0, 8), 11, *range(14, 32)]
_BLANK = " \t\n\r\f\x0b"   # what str.strip takes off in ``record``'s blank test
_NOT_BLANK = r"[^ \t\n\r\f\x0b]"


def _any(mask: Any) -> bool:
    import pyarrow.compute as pc

    return bool(pc.any(mask).as_py())


def _scan(values: Any) -> tuple[bool, bool, bool]:
    """(a NUL, another control character that JSON writes as ``\\u00XX``, a character JSON escapes in two)
    anywhere in a string array's values: a few passes over its bytes."""
    return _text_stats(values)[:3]


_BLANK_BYTES = [ord(c) for c in _BLANK]


def _text_stats(values: Any) -> tuple[bool, bool, bool, Any, Any]:
    """``_scan``'s three tests, each value's length in characters (a NULL's 0) and whether it may be blank
    (NULL, empty, or its first character one of ``_BLANK``), read from a string array's buffers with numpy:
    a pass over its bytes for each test, none per value."""
    import numpy as np
    import pyarrow.compute as pc

    n = len(values)
    if n == values.null_count:
        return False, False, False, np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool)
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int32)[values.offset:values.offset + n + 1]
    data = np.frombuffer(values.buffers()[2], dtype=np.uint8)[offsets[0]:offsets[-1]]
    control = np.bincount(data[data < 32], minlength=32)
    lengths = np.diff(offsets).astype(np.int64)
    if values.null_count:   # a NULL's slot may hold bytes: Arrow does not promise it is empty
        lengths[~values.is_valid().to_numpy(zero_copy_only=False)] = 0
    if data.size and int(data.max()) >= 128:   # not ASCII: characters are not bytes
        chars = pc.fill_null(pc.utf8_length(values), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    else:
        chars = lengths
    filled = lengths > 0
    first = np.zeros(n, dtype=np.uint8)
    first[filled] = data[(offsets[:-1] - offsets[0])[filled]]
    maybe_blank = ~filled | np.isin(first, _BLANK_BYTES)
    return (bool(control[0]), bool(control[_OTHER_CONTROL_BYTES].any()),
            bool(control[_ESCAPED_CONTROL_BYTES].any() or (data == 34).any() or (data == 92).any()),
            chars, maybe_blank)


def _text_column(values: Any) -> Any:
    """A column as ``to_text`` makes each value, a string array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(values, (list, tuple)):
        kinds = set(map(type, values)) - {type(None)}
        if kinds <= {str}:
            return pa.array(values, pa.string())
        if kinds != {int}:
            return pa.array([to_text(v) for v in values], pa.string())
        values = pa.array(values, pa.int64())
    t = values.type
    if pa.types.is_dictionary(t):
        values = values.dictionary_decode()
        t = values.type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return values.cast(pa.string())
    if pa.types.is_integer(t):
        return values.cast(pa.string())
    if pa.types.is_boolean(t):
        return pc.if_else(values, "true", "false")
    if pa.types.is_null(t):
        return pa.nulls(len(values), pa.string())
    return pa.array([to_text(v) for v in values.to_pylist()], pa.string())


def _acl_column(values: Any) -> Any:
    """A column as ``to_acl`` makes each value, a list<string> array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    acl_type = pa.list_(pa.string())
    if isinstance(values, (list, tuple)):
        kinds = set(map(type, values)) - {type(None)}
        if kinds <= {str}:
            values = pa.array(values, pa.string())
        elif kinds <= {list, tuple} and all(type(a) is str for v in values if v is not None for a in v):
            return pa.array(values, acl_type)
        else:
            return pa.array([to_acl(v) for v in values], acl_type)
    t = values.type
    if pa.types.is_dictionary(t):
        values = values.dictionary_decode()
        t = values.type
    if ((pa.types.is_list(t) or pa.types.is_large_list(t)) and
            (pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)) and
            pc.list_flatten(values).null_count == 0):
        return values.cast(acl_type)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        encoded = pc.dictionary_encode(values)
        distinct = pa.array([to_acl(v) for v in encoded.dictionary.to_pylist()], acl_type)
        return distinct.take(encoded.indices)
    return pa.array([to_acl(v) for v in values.to_pylist()], acl_type)


def _column_batch(spec: JobSpec, columns: Mapping[str, Any]) -> Any:
    """The batch made column-wise, or None where the row path must make it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from batch_inference.snapshot import stage_schema

    src = spec.source
    ids = _text_column(columns[src.id_column])
    if _scan(ids)[0]:
        return None   # the row path
    n = len(ids)
    acl = _acl_column(columns[src.acl_column]) if src.acl_column else pa.nulls(n, pa.list_(pa.string()))
    null_text = pa.nulls(n, pa.string())
    if not src.columns:   # one text column: as the snapshot cleans it (``clean_text``)
        text = _text_column(columns[src.text_column])
        reject = null_text
        if _scan(text)[0]:
            nul = pc.fill_null(pc.match_substring(text, "\x00"), False)
            text = pc.replace_substring(text, "\x00", "\ufffd")
            reject = pc.if_else(nul, "text contains NUL bytes", null_text)
        return pa.RecordBatch.from_arrays([ids, text, acl, reject], schema=stage_schema())
    texts = [_text_column(columns[c]) for c in src.columns]
    chars = np.zeros(n, dtype=np.int64)
    maybe_blank = np.ones(n, dtype=bool)   # every column NULL or starting with a blank character
    escaped: list[Any] = []
    for t in texts:
        nul, other_control, needs_escape, t_chars, t_maybe_blank = _text_stats(t)
        if nul or other_control:
            return None   # the row path
        chars += t_chars
        maybe_blank &= t_maybe_blank
        if needs_escape:
            for raw, esc in _JSON_ESCAPES:
                t = pc.replace_substring(t, raw, esc)
        escaped.append(t)
    if sum(t.null_count for t in escaped) == 0:   # one join: '["' a '", "' b '"]'
        parts: list[Any] = []
        for t in escaped:
            parts += [t, '", "']
        text = pc.binary_join_element_wise('["', *parts[:-1], '"]', "")
    else:
        parts = []
        for t in escaped:
            parts += [pc.fill_null(pc.binary_join_element_wise('"', t, '"', ""), "null"), ", "]
        text = pc.binary_join_element_wise("[", *parts[:-1], "]", "")
    blank = pa.array(maybe_blank)
    if maybe_blank.any():
        for t in texts:
            blank = pc.and_(blank, pc.invert(pc.fill_null(pc.match_substring_regex(t, _NOT_BLANK), False)))
    over = chars > spec.max_input_chars
    reject = null_text
    if over.any():
        reject = pc.if_else(pa.array(over), pc.binary_join_element_wise(
            "input over the length cap (", pa.array(chars).cast(pa.string()),
            f" characters > {spec.max_input_chars})", ""), null_text)
    if _any(blank):
        reject = pc.if_else(pc.and_(blank, pc.is_null(reject)), "empty text", reject)
    return pa.RecordBatch.from_arrays([ids, text, acl, reject], schema=stage_schema())
