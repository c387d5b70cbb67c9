"""Where a published version goes: one adapter per kind, behind one interface.

Every destination can do three things: write a version and point its readers
at it (``publish``), point them back at an earlier version (``point_back``),
and undo its last move when the view's switch did not follow
(``restore``). The PostgreSQL view (``view.py``) is the first and is always
there; an Apache Iceberg table (``iceberg.py``) is the second, named in the
spec's ``publish.destinations``. Each pointer's atomicity is its own commit
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

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg

from batch_inference.db import q
from batch_inference.spec import JobSpec

ROWS_PER_BATCH = 50_000


@dataclass(frozen=True)
class Version:
    """A job version as a destination receives it: its spec and its rows, in batches by record id."""

    job_version: str
    spec: JobSpec
    rows: Callable[[], Iterator[list[dict[str, Any]]]]


@dataclass(frozen=True)
class Pointed:
    """Where a destination points after a move, and where it pointed before (for ``restore``)."""

    destination: str
    job_version: str | None
    snapshot_id: int | None
    location: str | None
    changed: bool
    previous_snapshot_id: int | None = None


class Destination(ABC):
    """A place readers find the published version."""

    name: str

    @abstractmethod
    def check(self) -> None:
        """Refuse now (one line) what ``publish`` would refuse for every version: an unreachable
        catalog or store (``DestinationUnavailable``), a record class not cleared for it (``NotCleared``)."""

    @abstractmethod
    def publish(self, version: Version, *, force: bool = False, reason: str | None = None) -> Pointed:
        """Write ``version`` (unless it is there already) and point readers at it."""

    @abstractmethod
    def point_back(self, job_version: str) -> Pointed:
        """Point readers at ``job_version``, written by an earlier publish."""

    @abstractmethod
    def restore(self, pointed: Pointed) -> None:
        """Undo the move that answered ``pointed`` (the view's switch did not follow it)."""

    def close(self) -> None:
        """Release what the destination holds open (a catalog's connection pool)."""


def version_rows(conn: psycopg.Connection, job_version: str,
                 batch: int = ROWS_PER_BATCH) -> Callable[[], Iterator[list[dict[str, Any]]]]:
    """The version's rows (``destination_rows``) in batches, read through a server-side cursor in
    one read-only snapshot, so a destination sees exactly the rows the view shows."""

    def read() -> Iterator[list[dict[str, Any]]]:
        with conn.transaction(), conn.cursor(name="bi_destination_rows") as cur:
            cur.itersize = batch
            cur.execute(q("destination_rows"), {"job": job_version})
            while rows := cur.fetchmany(batch):
                yield rows

    return read


def for_spec(conn: psycopg.Connection, spec: JobSpec) -> list[Destination]:
    """The spec's destinations besides the view, as adapters (nothing is contacted yet)."""
    out: list[Destination] = []
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
