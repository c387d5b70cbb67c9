"""An Apache Iceberg table as a publish destination (pyiceberg).

A version is published as one commit to the table's catalog: the version's
rows, written as Parquet data files under ``data/<job_version>/<attempt>/``,
replace the table's contents in one snapshot, which the same commit tags
with the job version; the commit moves ``main`` to it. A reader of ``main``
(Spark, Trino, DuckDB, pyiceberg) sees the whole previous version or the
whole new one. Publishing a version whose tag exists only moves ``main`` to
the tag; rolling back moves ``main`` to the earlier version's tag. Nothing
here locks: the catalog's compare-and-swap of the metadata pointer decides,
and the table is created with pyiceberg's commit retries off
(``commit.retry.num-retries`` 0), so a publisher that lost a race is told so
instead of having its commit replayed over the winner's.

Columns come from the output schema (``table_schema``): record id, each
top-level output field typed (string, long, double, boolean, struct, list;
anything else as its JSON text) or, for an embedding job, ``embedding``
(Iceberg has no fixed-size list: a list of exactly ``dimensions`` required
floats, the size in the table property ``batch_inference.embedding.dimensions``),
then job version, model name and digest,
prompt version, transport, the record's ACL and the time it was stored. A
version whose schema adds a field evolves the table; one that removes a field
or changes its type is refused, naming the field, unless forced with a reason.

The catalog (``sql``, ``rest``, ``glue``), the warehouse (a local path or
``s3://``) and their credentials are ``lakehouse.CatalogAccess``'s, which the
Iceberg source opens too.
"""

from __future__ import annotations

import json
import logging
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from batch_inference.destinations.base import Destination, Pointed, Version, json_type
from batch_inference.exceptions import DestinationRefused, DestinationUnavailable, NotCleared
from batch_inference.lakehouse import CatalogAccess
from batch_inference.spec import Destination as DestinationSpec
from batch_inference.spec import JobSpec

log = logging.getLogger(__name__)

# The table property that turns pyiceberg's commit retries off (see the module docstring).
NO_RETRIES = {"commit.retry.num-retries": "0"}
FIXED_AFTER = ("job_version", "model_name", "model_digest", "prompt_version", "transport", "acl", "stored_at")
FIXED = ("record_id", *FIXED_AFTER)
TAG_PREFIX = "jv_"


# -- the table's schema from the output schema --------------------------------

Convert = Callable[[Any], Any]


class _Ids:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def _field_type(sub: Any, ids: _Ids) -> tuple[Any, Convert]:
    """(Iceberg type, value converter) of one JSON schema node."""
    from pyiceberg.types import (BooleanType, DoubleType, ListType, LongType, NestedField, StringType,
                                 StructType)

    t = json_type(sub)
    if t == "string":
        return StringType(), lambda v: v if v is None or isinstance(v, str) else json.dumps(v)
    if t == "integer":
        return LongType(), lambda v: None if v is None else int(v)
    if t == "number":
        return DoubleType(), lambda v: None if v is None else float(v)
    if t == "boolean":
        return BooleanType(), lambda v: v
    if t == "object" and isinstance(sub.get("properties"), dict) and sub["properties"]:
        fields, convs = [], []
        for name, child in sub["properties"].items():
            fid = ids()
            ft, conv = _field_type(child, ids)
            fields.append(NestedField(fid, name, ft, required=False))
            convs.append((name, conv))
        return StructType(*fields), lambda v: None if not isinstance(v, dict) else {
            n: c(v.get(n)) for n, c in convs}
    if t == "array" and isinstance(sub.get("items"), dict):
        eid = ids()
        et, conv = _field_type(sub["items"], ids)
        return ListType(eid, et, element_required=False), lambda v: None if not isinstance(v, list) else [
            conv(x) for x in v]
    return StringType(), lambda v: None if v is None else json.dumps(v, sort_keys=True)


def output_fields(spec: JobSpec) -> list[str]:
    """The top-level output fields that become columns (a field named like a fixed column is left out,
    as the view leaves it out)."""
    props = (spec.output_schema or {}).get("properties") or {}
    return [n for n in props if n not in FIXED]


def table_schema(spec: JobSpec) -> tuple[Any, dict[str, Convert]]:
    """The Iceberg schema of ``spec``'s rows, and a converter for each output field."""
    from pyiceberg.schema import Schema
    from pyiceberg.types import FloatType, ListType, NestedField, StringType, TimestamptzType

    ids = _Ids()
    props = (spec.output_schema or {}).get("properties") or {}
    fields = [NestedField(ids(), "record_id", StringType(), required=True)]
    if spec.task == "embed":   # the vector, from bi.results.embedding (embedding_column)
        fid = ids()
        fields.append(NestedField(fid, "embedding", ListType(ids(), FloatType(), element_required=True),
                                  required=False))
    convs: dict[str, Convert] = {}
    for name in output_fields(spec):
        fid = ids()
        ft, conv = _field_type(props[name], ids)
        fields.append(NestedField(fid, name, ft, required=False))
        convs[name] = conv
    for name in FIXED_AFTER[:5]:
        fields.append(NestedField(ids(), name, StringType(), required=False))
    aid = ids()
    fields.append(NestedField(aid, "acl", ListType(ids(), StringType(), element_required=False), required=False))
    fields.append(NestedField(ids(), "stored_at", TimestamptzType(), required=False))
    return Schema(*fields), convs


_PROMOTIONS = {("IntegerType", "LongType"), ("FloatType", "DoubleType")}


def schema_problems(old: Any, new: Any, path: str = "") -> list[str]:
    """The removed and changed fields of ``old`` (a table's struct) in ``new``: what breaks readers."""
    from pyiceberg.types import ListType, StructType

    out: list[str] = []
    new_by = {f.name: f for f in new.fields}
    for f in old.fields:
        if not path and f.name in FIXED:
            continue
        where = f"{path}{f.name}"
        n = new_by.get(f.name)
        if n is None:
            out.append(f"field {where!r} is removed")
            continue
        a, b = f.field_type, n.field_type
        if isinstance(a, StructType) and isinstance(b, StructType):
            out.extend(schema_problems(a, b, where + "."))
        elif isinstance(a, ListType) and isinstance(b, ListType):
            ea, eb = a.element_type, b.element_type
            if isinstance(ea, StructType) and isinstance(eb, StructType):
                out.extend(schema_problems(ea, eb, where + "[]."))
            elif ea != eb and (type(ea).__name__, type(eb).__name__) not in _PROMOTIONS:
                out.append(f"field {where!r} changes its elements from {ea} to {eb}")
        elif a != b and (type(a).__name__, type(b).__name__) not in _PROMOTIONS:
            out.append(f"field {where!r} changes from {a} to {b}")
    return out


def arrow_batches(version: Version, arrow_schema: Any, convs: dict[str, Convert]) -> Iterator[Any]:
    """The version's rows as Arrow tables of ``arrow_schema``, one per batch the ledger reads.

    The outputs arrive as JSON text and are parsed by pyarrow's JSON reader
    against the output columns' types; a batch it cannot read that way (a
    value of another type than its column's, a field kept as JSON text) is
    converted value by value in Python instead."""
    import pyarrow as pa

    names = arrow_schema.names
    out_schema = pa.schema([arrow_schema.field(n) for n in names if n in convs])
    for rows in version.rows():
        outputs = _parsed(rows, out_schema) if len(out_schema) else None
        if outputs is None:
            parsed = [json.loads(r["output"]) if isinstance(r["output"], str) else r["output"] for r in rows]
            parsed = [o if isinstance(o, dict) else {} for o in parsed]
        cols = []
        for field in arrow_schema:
            n = field.name
            if n in convs:
                cols.append(outputs.column(n) if outputs is not None
                            else pa.array([convs[n](o.get(n)) for o in parsed], type=field.type))
            elif n == "embedding" and version.spec.task == "embed":
                cols.append(embedding_column(rows, version.spec.embedding.dimensions, field.type))
            elif rows and n in rows[0]:
                cols.append(pa.array([r[n] for r in rows], type=field.type))
            else:
                cols.append(pa.nulls(len(rows), type=field.type))   # a column kept for earlier versions' readers
        yield pa.Table.from_arrays(cols, schema=arrow_schema)


def embedding_column(rows: list[dict[str, Any]], dims: int, arrow_type: Any) -> Any:
    """The rows' stored float32 vectors (``embed.vectors``) as one Arrow list column of ``dims`` floats each."""
    import numpy as np
    import pyarrow as pa

    from batch_inference.embed import from_storage

    values = np.concatenate([from_storage(r["embedding"]) for r in rows]) if rows else np.empty(0, np.float32)
    if values.shape[0] != dims * len(rows):
        raise ValueError(f"a vector of this version does not have {dims} dimensions")
    offsets = pa.array(np.arange(0, dims * len(rows) + 1, dims, dtype=np.int64))
    return pa.LargeListArray.from_arrays(offsets, pa.array(values), type=arrow_type)


def _parsed(rows: list[dict[str, Any]], out_schema: Any) -> Any:
    """The outputs of ``rows`` parsed by pyarrow's JSON reader into ``out_schema``; None if it cannot."""
    import io

    import pyarrow as pa
    from pyarrow import json as pj

    texts = [r["output"] for r in rows]
    if not all(isinstance(t, str) for t in texts):
        return None
    data = "\n".join(texts).encode()   # jsonb's text form is one line: strings escape their newlines
    readable = pa.schema([pa.field(f.name, _readable(f.type)) for f in out_schema])
    try:
        table = pj.read_json(io.BytesIO(data), read_options=pj.ReadOptions(block_size=max(len(data) + 1, 1 << 20)),
                             parse_options=pj.ParseOptions(explicit_schema=readable,
                                                           unexpected_field_behavior="ignore"))
        if table.num_rows != len(rows):
            return None
        return pa.Table.from_arrays([table.column(f.name).cast(f.type) for f in out_schema], schema=out_schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, KeyError):
        return None


def _readable(t: Any) -> Any:
    """``t`` with its large lists as lists: the JSON reader builds no large lists (a cast makes them)."""
    import pyarrow as pa

    if pa.types.is_large_list(t) or pa.types.is_list(t):
        return pa.list_(_readable(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _readable(f.type)) for f in t])
    return t


# -- the adapter ---------------------------------------------------------------

class IcebergTable(CatalogAccess, Destination):
    """One Iceberg table named by catalog and identifier (``spec.Destination``); its catalog, warehouse and
    credentials are ``lakehouse.CatalogAccess``'s."""

    kind = "iceberg"

    def __init__(self, dest: DestinationSpec, spec: JobSpec, *, ledger: psycopg.Connection | None = None):
        super().__init__(dest, ledger=ledger)
        self.spec = spec

    def _table(self, create: bool) -> Any:
        from pyiceberg.exceptions import NoSuchTableError

        cat = self.catalog()
        try:
            try:
                tbl = cat.load_table(self.dest.identifier)
            except NoSuchTableError:
                if not create:
                    return None
                namespace = self.dest.identifier.rsplit(".", 1)[0]
                cat.create_namespace_if_not_exists(namespace)
                schema, _ = table_schema(self.spec)
                tbl = cat.create_table_if_not_exists(self.dest.identifier, schema, properties={
                    **NO_RETRIES, "batch_inference.dataset": self.spec.dataset,
                    **({"batch_inference.embedding.dimensions": str(self.spec.embedding.dimensions)}
                       if self.spec.task == "embed" else {})})
            if tbl.metadata.properties.get("commit.retry.num-retries") != "0":
                tbl.transaction().set_properties(**NO_RETRIES).commit_transaction()
                tbl = tbl.refresh()
            return tbl
        except (DestinationUnavailable, DestinationRefused):
            raise
        except Exception as exc:  # noqa: BLE001
            raise DestinationUnavailable(f"{self.name}: catalog unreachable: {self.error_line(exc)}"
                                         ) from None

    # -- the interface
    def check(self) -> None:
        if self.spec.record_class not in self.dest.cleared_record_classes:
            raise NotCleared(f"refused: record class '{self.spec.record_class}' is not cleared for destination "
                             f"{self.name} (its cleared_record_classes: "
                             f"{', '.join(self.dest.cleared_record_classes) or 'none'}); nothing was written")
        try:
            self.catalog().list_namespaces()
        except DestinationUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001
            raise DestinationUnavailable(f"{self.name}: catalog unreachable: {self.error_line(exc)}"
                                         ) from None
        where = self.fs_path(self.warehouse)
        if self.warehouse.startswith("s3://"):
            where = where.split("/", 1)[0]     # the bucket: a prefix exists only once something is in it
        try:
            info = self.filesystem().get_file_info(where)
        except Exception as exc:  # noqa: BLE001
            raise DestinationUnavailable(f"{self.name}: warehouse {self.dest.warehouse} unreachable: "
                                         f"{self.error_line(exc)}") from None
        if self.warehouse.startswith("s3://") and info.type.name == "NotFound":
            raise DestinationUnavailable(f"{self.name}: warehouse {self.dest.warehouse}: no such bucket")

    @staticmethod
    def main_snapshot(tbl: Any) -> int | None:
        snap = tbl.current_snapshot()
        return snap.snapshot_id if snap else None

    @staticmethod
    def tag_of(tbl: Any, snapshot_id: int | None) -> str | None:
        """The job version whose tag names ``snapshot_id``."""
        for name, ref in tbl.metadata.refs.items():
            if name.startswith(TAG_PREFIX) and ref.snapshot_id == snapshot_id:
                return name
        return None

    def current(self) -> str | None:
        """The job version ``main`` shows (None: no table, or no tagged snapshot)."""
        tbl = self._table(create=False)
        return None if tbl is None else self.tag_of(tbl, self.main_snapshot(tbl))

    def _pointed(self, tbl: Any, changed: bool, previous: int | None) -> Pointed:
        sid = self.main_snapshot(tbl)
        return Pointed(self.name, self.tag_of(tbl, sid), sid, tbl.metadata_location, changed, previous)

    def _move_main(self, tbl: Any, snapshot_id: int) -> Any:
        from pyiceberg.table.update.snapshot import ManageSnapshots

        tx = tbl.transaction()
        ManageSnapshots(tx).set_current_snapshot(snapshot_id=snapshot_id).commit()
        return self._commit(tx)

    def _commit(self, tx: Any) -> Any:
        """The one catalog commit of a publish or a move: the metadata swap."""
        return tx.commit_transaction()

    def publish(self, version: Version, *, force: bool = False, reason: str | None = None) -> Pointed:
        from pyiceberg.exceptions import CommitFailedException

        try:
            self.check()
        except NotCleared as exc:
            raise DestinationRefused(str(exc)) from None
        jv = version.job_version
        tbl = self._table(create=True)
        previous = self.main_snapshot(tbl)
        tag = tbl.metadata.refs.get(jv)
        try:
            if tag is not None:
                if previous == tag.snapshot_id:
                    return self._pointed(tbl, False, previous)
                tbl = self._move_main(tbl, tag.snapshot_id)
                log.info("%s: %s was written before; main moved to its snapshot %d", self.name, jv, tag.snapshot_id)
                return self._pointed(tbl, True, previous)
            return self._write(tbl, version, force=force, reason=reason, previous=previous)
        except CommitFailedException as exc:
            return self._lost_race(jv, previous, exc)
        except (DestinationRefused, DestinationUnavailable, NotCleared):
            raise
        except Exception as exc:  # noqa: BLE001 - a catalog or store down: nothing committed, retryable
            raise DestinationUnavailable(f"{self.name}: publish of {jv} failed before its commit: "
                                         f"{self.error_line(exc)}; nothing was committed") from None

    def _lost_race(self, jv: str, previous: int | None, exc: Exception) -> Pointed:
        """Another publisher's commit came first: this version is live already, or the caller is told."""
        tbl = self._table(create=False)
        tag = tbl.metadata.refs.get(jv) if tbl is not None else None
        if tag is not None and self.main_snapshot(tbl) == tag.snapshot_id:
            log.info("%s: another publisher committed %s first; it is live", self.name, jv)
            return self._pointed(tbl, False, previous)
        raise DestinationRefused(f"{self.name}: another publisher committed first "
                                 f"(main is at {self.tag_of(tbl, self.main_snapshot(tbl)) if tbl else None}); "
                                 f"nothing of {jv} was committed ({self.error_line(exc)})") from None

    def _write(self, tbl: Any, version: Version, *, force: bool, reason: str | None, previous: int | None) -> Pointed:
        import pyarrow.parquet as pq
        from pyiceberg.expressions import AlwaysTrue
        from pyiceberg.table.update.snapshot import ManageSnapshots

        jv = version.job_version
        new_schema, convs = table_schema(version.spec)
        problems = schema_problems(tbl.schema().as_struct(), new_schema.as_struct())
        if problems and not force:
            raise DestinationRefused(f"{self.name}: {jv} {problems[0]}"
                                     f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; "
                                     "readers' queries would break; refused (publish --force --reason TEXT to "
                                     "override)")
        if problems and (not reason or not reason.strip()):
            raise DestinationRefused(f"{self.name}: a forced change of the table's schema needs a reason")
        tx = tbl.transaction()
        self._evolve(tx, tbl, new_schema, problems)
        arrow_schema = tx.table_metadata.schema().as_arrow()
        fs = self.filesystem()
        attempt = uuid.uuid4().hex[:12]
        base = f"{tbl.location().rstrip('/')}/data/{jv}"
        paths: list[str] = []
        writer = None
        rows_in_file = 0
        try:
            for batch in arrow_batches(version, arrow_schema, convs):
                if writer is None or rows_in_file >= self.dest.target_file_rows:
                    if writer is not None:
                        writer.close()
                    paths.append(f"{base}/{attempt}/part-{len(paths):05d}.parquet")
                    fs.create_dir(self.fs_path(f"{base}/{attempt}"), recursive=True)
                    writer = pq.ParquetWriter(self.fs_path(paths[-1]), arrow_schema, filesystem=fs,
                                              compression="zstd")
                    rows_in_file = 0
                writer.write_table(batch)
                rows_in_file += batch.num_rows
            if writer is not None:
                writer.close()
                writer = None
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Delete operation did not match any records")
                tx.delete(AlwaysTrue())
            if paths:
                tx.add_files(paths, snapshot_properties={"batch_inference.job_version": jv},
                             check_duplicate_files=False)
            snap = tx.table_metadata.current_snapshot()
            assert snap is not None
            ManageSnapshots(tx).create_tag(snap.snapshot_id, jv).commit()
            tbl = self._commit(tx)
        except BaseException:
            if writer is not None:
                writer.close()
            self._remove(fs, [f"{base}/{attempt}"])
            raise
        # The commit is in: files that earlier attempts of this version left (killed before their
        # commit) are orphans, since only a commit that also made the tag could reference them.
        self._remove_orphans(fs, base, keep=attempt)
        log.info("%s: %s committed as snapshot %s (%d file(s)); main moved", self.name, jv,
                 self.main_snapshot(tbl), len(paths))
        return self._pointed(tbl, True, previous)

    def _evolve(self, tx: Any, tbl: Any, new_schema: Any, problems: list[str]) -> None:
        """Stage the schema change in ``tx``: added fields always; with a forced change, removed fields
        dropped and changed ones dropped and added again."""
        from pyiceberg.types import StructType

        current = tbl.schema().as_struct()
        if problems:
            by_name = {n.name: n for n in new_schema.fields}
            gone = [f.name for f in current.fields if f.name not in FIXED and (
                f.name not in by_name or schema_problems(StructType(f), StructType(by_name[f.name])))]
            if gone:
                with tx.update_schema(allow_incompatible_changes=True) as us:
                    for name in gone:
                        us.delete_column(name)
        if new_schema.as_struct() != current:
            with tx.update_schema() as us:
                us.union_by_name(new_schema)

    def _remove(self, fs: Any, dirs: list[str]) -> None:
        from pyarrow.fs import FileType

        for d in dirs:
            try:
                if fs.get_file_info(self.fs_path(d)).type != FileType.NotFound:
                    fs.delete_dir(self.fs_path(d))
            except Exception as exc:  # noqa: BLE001 - best effort: the next publish of the version retries
                log.warning("%s: could not remove %s: %s", self.name, d, self.error_line(exc))

    def _remove_orphans(self, fs: Any, base: str, *, keep: str) -> None:
        from pyarrow.fs import FileSelector, FileType

        try:
            found = fs.get_file_info(FileSelector(self.fs_path(base), allow_not_found=True))
        except Exception as exc:  # noqa: BLE001
            log.warning("%s: could not list %s for orphans: %s", self.name, base, self.error_line(exc))
            return
        stale = [i.path for i in found if i.type == FileType.Directory and i.base_name != keep]
        for path in stale:
            try:
                fs.delete_dir(path)
                log.info("%s: removed orphaned files of an uncommitted attempt: %s", self.name, path)
            except Exception as exc:  # noqa: BLE001
                log.warning("%s: could not remove orphans %s: %s", self.name, path, self.error_line(exc))

    def point_back(self, job_version: str) -> Pointed:
        from pyiceberg.exceptions import CommitFailedException

        tbl = self._table(create=False)
        tag = tbl.metadata.refs.get(job_version) if tbl is not None else None
        if tag is None:
            raise DestinationRefused(f"{self.name}: no snapshot tagged {job_version} (it was never published "
                                     "there); rollback refused, nothing was changed")
        previous = self.main_snapshot(tbl)
        if previous == tag.snapshot_id:
            return self._pointed(tbl, False, previous)
        try:
            tbl = self._move_main(tbl, tag.snapshot_id)
        except CommitFailedException as exc:
            raise DestinationRefused(f"{self.name}: another publisher moved main first; rollback to {job_version} "
                                     f"not made ({self.error_line(exc)})") from None
        except Exception as exc:  # noqa: BLE001
            raise DestinationUnavailable(f"{self.name}: rollback to {job_version} failed: "
                                         f"{self.error_line(exc)}; nothing was changed") from None
        return self._pointed(tbl, True, previous)

    def restore(self, pointed: Pointed) -> None:
        if not pointed.changed:
            return
        if pointed.previous_snapshot_id is None:
            log.warning("%s: the view did not switch, but %s stays in the new table (it had no earlier snapshot "
                        "to restore)", self.name, pointed.job_version)
            return
        tbl = self._table(create=False)
        self._move_main(tbl, pointed.previous_snapshot_id)
        log.warning("%s: the view did not switch; main restored to snapshot %d", self.name,
                    pointed.previous_snapshot_id)
