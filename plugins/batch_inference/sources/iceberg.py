"""``kind: iceberg``: an Apache Iceberg table at one snapshot, read with pyiceberg as Arrow.

The catalog settings are the Iceberg destination's (``spec.IcebergCatalog``:
the SQL catalog in the ledger's database by default, a REST catalog, AWS
Glue), and so is the catalog itself: both open it through
``lakehouse.CatalogAccess``, credentials from the environment or the Airflow
AWS connection. ``source.snapshot_id`` picks the
snapshot, the table's current one by default; the snapshot read is recorded
with the job (its stored spec's ``source.snapshot_id``), so resubmitting
that spec after the table has moved on reads the same rows and gives the same
job version. ``row_filter`` is a pyiceberg filter expression
(``"status = 'open'"``). The snapshot's data files are read one at a time
(``ArrowScan.to_record_batches`` per file scan task), so memory holds one
file's batches.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from batch_inference.exceptions import SnapshotError
from batch_inference.sources.base import Ident, Reader, Records, column_batch, read_columns

log = logging.getLogger(__name__)


class IcebergSnapshot(Reader):
    """One Iceberg table at one snapshot."""

    kind = "iceberg"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._adapter: Any = None
        self._table: Any = None
        self._snapshot_id: int | None = None

    def adapter(self) -> Any:
        """The catalog access over the source's catalog settings (it makes the catalog)."""
        if self._adapter is None:
            from batch_inference.lakehouse import CatalogAccess
            from batch_inference.spec import Destination, IcebergCatalog

            src = self.source
            dest = Destination(kind="iceberg", identifier=src.identifier or "", catalog=src.catalog or IcebergCatalog(),
                               warehouse=src.warehouse or ".", s3_endpoint=src.s3_endpoint or self.s3_endpoint_url,
                               aws_conn_id=self.aws_conn_id or src.conn_id)
            self._adapter = CatalogAccess(dest, ledger=self.ledger)
        return self._adapter

    def table(self) -> Any:
        if self._table is None:
            from pyiceberg.exceptions import NoSuchTableError

            adapter = self.adapter()
            try:
                self._table = adapter.catalog().load_table(self.source.identifier)
            except NoSuchTableError:
                raise self.refuse(f"no such table {self.source.identifier}") from None
            except SnapshotError:
                raise
            except Exception as exc:  # noqa: BLE001 - the catalog's own errors, DestinationUnavailable: one line
                raise self.refuse(f"catalog unreachable: {adapter.error_line(exc)}") from None
        return self._table

    def snapshot_id(self) -> int:
        """The snapshot read: the one the spec names, else the table's current one (resolved once)."""
        if self._snapshot_id is None:
            tbl = self.table()
            wanted = self.source.snapshot_id
            if wanted is not None:
                if tbl.snapshot_by_id(wanted) is None:
                    raise self.refuse(f"snapshot id {wanted} does not exist (the table has "
                                      f"{', '.join(str(s.snapshot_id) for s in tbl.snapshots()[-5:]) or 'none'})")
                self._snapshot_id = wanted
            else:
                current = tbl.current_snapshot()
                if current is None:
                    raise self.refuse("the table has no snapshot: nothing to read")
                self._snapshot_id = current.snapshot_id
        return self._snapshot_id

    def check(self) -> None:
        sid = self.snapshot_id()
        tbl = self.table()
        schema = tbl.schemas().get(tbl.snapshot_by_id(sid).schema_id) or tbl.schema()
        names = [f.name for f in schema.fields]
        for col in self._columns():
            if col not in names:
                raise self.refuse(f"no column {col!r} at snapshot {sid} (it has {', '.join(names[:20])})")

    def pin(self) -> dict[str, Any]:
        return {"snapshot_id": self.snapshot_id()}

    def _columns(self) -> list[str]:
        return read_columns(self.source)

    def rows(self) -> Records:
        return Records(self._batches())

    def _batches(self) -> Iterator[Any]:
        src = self.source
        kw: dict[str, Any] = {"snapshot_id": self.snapshot_id(), "selected_fields": tuple(self._columns())}
        if src.row_filter:
            kw["row_filter"] = src.row_filter
        try:
            from pyiceberg.io.pyarrow import ArrowScan

            scan = self.table().scan(**kw)
            arrow = ArrowScan(scan.table_metadata, scan.io, scan.projection(), scan.row_filter, scan.case_sensitive)
            tasks = scan.plan_files()
        except Exception as exc:  # noqa: BLE001 - a bad row filter, an unreadable manifest
            raise self.refuse(f"cannot scan snapshot {kw['snapshot_id']}: {str(exc).splitlines()[0]}") from None
        n = 0
        # One data file at a time: the scan's own batch reader reads every file of the snapshot ahead on
        # its thread pool, so its memory grows with the table (docs/sources.md, Measured).
        for task in tasks:
            try:
                batches = list(arrow.to_record_batches([task]))
            except Exception as exc:  # noqa: BLE001 - an unreadable data file
                raise self.refuse(f"cannot read {task.file.file_path}: {str(exc).splitlines()[0]}") from None
            for batch in batches:
                yield column_batch(self, {c: batch.column(c) for c in self._columns()})
                n += batch.num_rows
        log.info("source %s: %d row(s) read at snapshot %d", self.name, n, kw["snapshot_id"])

    def lineage(self) -> list[Ident]:
        """The table as OpenLineage names an Iceberg table: by its storage location."""
        from batch_inference.lineage import iceberg_ident

        try:
            return [iceberg_ident(self.table().metadata_location)]
        except SnapshotError:
            return []

    def close(self) -> None:
        if self._adapter is not None:
            self._adapter.close()
