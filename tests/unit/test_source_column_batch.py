"""The column path of record building (``sources.column_batch``) gives what ``sources.record`` gives row
by row, value for value: the text, the JSON array of several columns, the reject reason, the ACL."""

from __future__ import annotations

import datetime as dt
import decimal
import uuid

import pyarrow as pa
import pytest

from batch_inference.exceptions import SnapshotError
from batch_inference.snapshot import staged_columns
from batch_inference.sources import Reader, column_batch
from batch_inference.sources.base import _column_batch, _records
from batch_inference.spec import parse_spec

AWKWARD = ['plain', '', ' \t\n', 'quote " and \\ back', 'line\nbreak\r\ttab\b\x0c', 'ünïcödé ✓ 𝄞',
           'ctrl \x01 \x1f', 'nul \x00 here', 'vt\x0b', '{"json": [1, 2]}', '>>> delim', 'a' * 30, None]


class _Reader(Reader):
    def rows(self):   # not read: the tests hand batches to column_batch
        return None


def reader(columns: bool, cap: int = 40, acl: bool = True) -> _Reader:
    source = {"kind": "parquet", "paths": ["."], "id_column": "id",
              **({"columns": ["a", "b"]} if columns else {"text_column": "a"}),
              **({"acl_column": "acl"} if acl else {})}
    return _Reader(parse_spec({
        "dataset": "d", "source": source, "model": {"name": "m", "digest": "sha256:" + "0" * 64},
        "engine": {"name": "noop"}, "max_input_chars": cap,
        "prompt": {"version": "v1", "system": "s", "template": "{a} {b}" if columns else "{text}"},
        "output_schema": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}))


def both(r: Reader, cols: dict) -> tuple[list, list]:
    fast = column_batch(r, cols).to_pylist()
    slow = staged_columns(list(_records(r, cols, ""))).to_pylist()
    return fast, slow


@pytest.mark.parametrize("columns", [True, False])
@pytest.mark.parametrize("arrow", [True, False])
def test_text_values_as_the_row_path_makes_them(columns, arrow):
    a = AWKWARD
    b = list(reversed(AWKWARD))
    cols = {"id": [f"t{i}" for i in range(len(a))], "a": a, "b": b,
            "acl": [["x", "y"], [], None, ["ü"], *([["z"]] * (len(a) - 4))]}
    if arrow:
        cols = {k: pa.array(v) for k, v in cols.items()}
    fast, slow = both(reader(columns), cols)
    assert fast == slow
    # without the NUL and the control characters the column path itself runs (not the row path)
    keep = [i for i, v in enumerate(a) if not any(ch in (v or "") + (b[i] or "") for ch in "\x00\x01\x1f\x0b")]
    clean = {k: [v[i] for i in keep] + extra for k, v, extra in
             [("id", [f"t{i}" for i in range(len(a))], ["blank", "long"]), ("a", a, [" \t", "a" * 30]),
              ("b", b, [None, "b" * 30]), ("acl", [["x"]] * len(a), [None, ["y"]])]}
    if arrow:
        clean = {k: pa.array(v) for k, v in clean.items()}
    r = reader(columns)
    fast = _column_batch(r.spec, clean).to_pylist()   # the column path itself, not the row path
    assert fast == staged_columns(list(_records(r, clean, ""))).to_pylist()
    if columns:
        assert [x["reject"] for x in fast[-2:]] == ["empty text", "input over the length cap (60 characters > 40)"]


@pytest.mark.parametrize("arrow", [True, False])
def test_other_types_and_acls_as_the_row_path_makes_them(arrow):
    ids = [1, 2, 3, 4, 5, 6]
    a = [1, -7, 2**40, None, 0, 42]
    b = [True, False, None, True, False, True]
    acl = ['["a", "b"]', "team1", None, "[not json", '[1, 2.5, null]', "team1"]
    cols = {"id": ids, "a": a, "b": b, "acl": acl}
    if arrow:
        cols = {k: pa.array(v) for k, v in cols.items()}
    fast, slow = both(reader(True), cols)
    assert fast == slow and fast[0]["text"] == '["1", "true"]' and fast[0]["acl"] == ["a", "b"]
    mixed = {"id": ["x1", "x2", "x3", "x4"], "a": [1.5, decimal.Decimal("1.50"), dt.date(2026, 1, 2), uuid.UUID(int=5)],
             "b": [dt.datetime(2026, 1, 2, 3, 4, 5, 500000), {"k": [1]}, 0.1, None], "acl": [("a",), ["b", 1], "c", None]}
    fast, slow = both(reader(True), mixed)
    assert fast == slow and fast[0]["text"] == '["1.5", "2026-01-02 03:04:05.5"]'


def test_a_value_that_cannot_become_text_is_the_same_one_line():
    r = reader(True)
    with pytest.raises(SnapshotError, match=r"record 't2': a value of type bytes cannot become text"):
        column_batch(r, {"id": ["t1", "t2"], "a": ["x", b"raw"], "b": ["y", "z"], "acl": [None, None]})
    with pytest.raises(SnapshotError, match="text contains NUL bytes"):
        column_batch(r, {"id": ["t\x00"], "a": ["x"], "b": ["y"], "acl": [None]})


@pytest.mark.parametrize("cap", [5, 40])
def test_sliced_arrays_tuples_and_non_ascii_as_the_row_path_makes_them(cap):
    """The lengths and blank tests read from a string array's buffers: a slice of an array (an offset
    into its buffers), a NULL, text that is not ASCII (characters are not bytes), and columns given as
    tuples (a fetched batch turned into columns by zip)."""
    a = ["x" * 50, "ünï", " ü", "", None, "\tz", "𝄞𝄞𝄞𝄞", "plain", "  ", "ok"]
    b = ["head", None, "", " ", None, "\n", "ééé", "q\"b", None, "ü" * 4]
    ids = [f"t{i}" for i in range(len(a))]
    r = reader(True, cap=cap)
    sliced = {"id": pa.array(ids)[3:], "a": pa.array(a)[3:], "b": pa.array(b)[3:],
              "acl": pa.array([["x"]] * len(a))[3:]}
    assert column_batch(r, sliced) is not None and _column_batch(r.spec, sliced) is not None   # the column path ran
    fast, slow = both(r, sliced)
    assert fast == slow
    tuples = {"id": tuple(ids), "a": tuple(a), "b": tuple(b), "acl": tuple([["x"]] * len(a))}
    assert _column_batch(r.spec, tuples) is not None
    fast, slow = both(r, tuples)
    assert fast == slow
    rejects = [x["reject"] or "" for x in fast]
    assert "empty text" in rejects
    assert rejects[0].startswith("input over the length cap (54 characters")


def test_the_collector_is_paused_for_a_batch_and_restored_as_it_was():
    import gc

    from batch_inference.sources.base import collection_paused

    assert gc.isenabled()
    with pytest.raises(ValueError), collection_paused():
        assert not gc.isenabled()
        raise ValueError("a refusal inside the batch")
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()   # it was off: left off
    finally:
        gc.enable()
