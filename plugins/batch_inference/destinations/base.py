"""The destination interface: what a published version is to a destination
(``Version``), where a move left it (``Pointed``), the four things every
destination does (``Destination``), and the version's rows in batches.
An adapter (``iceberg.py``) imports this module, never the package, which
picks the adapters a spec names: no import circle."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg

from batch_inference.db import q
from batch_inference.spec import JobSpec

ROWS_PER_BATCH = 50_000


def json_type(sub: Any) -> str | None:
    """The one JSON type of an output schema node (``["integer", "null"]`` is integer; a string enum is
    string), or None when it has several or none: the view's and the Iceberg table's columns are typed
    from it."""
    t = sub.get("type") if isinstance(sub, dict) else None
    if isinstance(t, list):
        t = [x for x in t if x != "null"]
        t = t[0] if len(t) == 1 else None
    if t is None and isinstance(sub, dict) and "enum" in sub and all(isinstance(v, str) for v in sub["enum"]):
        t = "string"
    return t


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
