"""Where a published version goes: one adapter per kind, behind one interface.

Every destination can do three things: write a version and point its readers
at it (``publish``), point them back at an earlier version (``point_back``),
and undo its last move when the view's switch did not follow
(``restore``). The PostgreSQL view (``view.py``) is the first and is always
there; an Apache Iceberg table (``iceberg.py``) is the second, named in the
spec's ``publish.destinations``; an embedding job's pgvector search table
(``search_index.py``) is built for every ``task: embed`` spec. Each pointer's atomicity is its own commit
(the view: one UPDATE in a transaction; Iceberg: one metadata swap in the
catalog), never a lock of ours held across two systems.

``batch_inference.publish`` orders them: the view's guards are checked first
(in a transaction that is rolled back), then every other destination commits,
then the view switches, expecting the pointer it saw; if a destination fails
the view does not switch, and if the view's switch fails the destinations
that moved are restored. The history row of the switch records where each
destination points (``bi.publish_destinations``).

Destination settings do not change results, so they are not part of the job
version; ``check_spec`` runs at submit, before anything is written.
"""

from __future__ import annotations

import psycopg

from batch_inference.destinations.base import ROWS_PER_BATCH, Destination, Pointed, Version, version_rows
from batch_inference.spec import JobSpec

__all__ = ["ROWS_PER_BATCH", "Destination", "Pointed", "Version", "check_spec", "for_spec", "version_rows"]


def for_spec(conn: psycopg.Connection, spec: JobSpec) -> list[Destination]:
    """The spec's destinations besides the view, as adapters (nothing is contacted yet)."""
    out: list[Destination] = []
    if spec.task == "embed":   # the version's pgvector search table, built before the view switches
        from batch_inference.destinations.search_index import SearchIndex

        out.append(SearchIndex(spec, ledger=conn))
    for dest in spec.publish.destinations:
        if dest.kind == "iceberg":
            from batch_inference.destinations.iceberg import IcebergTable

            out.append(IcebergTable(dest, spec, ledger=conn))
    return out


def check_spec(conn: psycopg.Connection, spec: JobSpec) -> None:
    """At submit: every destination of ``spec`` is reachable and cleared, or one line says which is not."""
    for dest in for_spec(conn, spec):
        try:
            dest.check()
        finally:
            dest.close()
