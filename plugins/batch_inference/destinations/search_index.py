"""Publishing an embedding job: the version's search table, built before the pointer moves.

``SearchIndex`` is the publish destination (``destinations.base.Destination``)
that ``destinations.for_spec`` adds for every ``task: embed`` spec. Its
``publish`` copies the version's stored float32 vectors into
``bi.embed_<job_version>`` (``record_id``, ``embedding vector(n)``, one
binary COPY) and builds its HNSW index (cosine distance, the ``<=>``
operator), each step its own commit and done once, so the index exists
before the view's switch and the first query after publish uses it.
``point_back`` makes sure the version a rollback returns to still has its
table; ``restore`` has nothing to undo (a version's table is only read once
the view names it). The view itself (``ensure_view``,
``bi.ensure_embedding_view_v1``) is created again in the switch's
transaction, naming the table of the version the pointer now names: the
search moves with the pointer, both ways.

Without pgvector in the ledger's database (the embedded PostgreSQL ships it;
another server needs it installed, then ``batch-inference db migrate``)
``check`` refuses, at submit and at publish, with one line: the vectors of a
version are kept and validated all the same, and can be published once the
extension is there.
"""

from __future__ import annotations

import logging
import struct

import numpy as np
import psycopg
from psycopg import sql

from batch_inference.db import composed, q
from batch_inference.destinations.base import Destination, Pointed, Version
from batch_inference.embed import DTYPE
from batch_inference.exceptions import PublishRefused
from batch_inference.spec import JobSpec
from batch_inference.status import job_spec

log = logging.getLogger(__name__)

COPY_ROWS = 5_000      # vectors read and written per round of the copy
_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)
_COPY_TRAILER = struct.pack("!h", -1)


def table_name(job_version: str) -> str:
    return f"bi.embed_{job_version}"


def copy_rows(ids: list[str], vectors: list[bytes], dims: int) -> bytes:
    """``(record_id, vector)`` rows in PostgreSQL's binary COPY format; a vector is pgvector's binary
    form (int16 dimensions, int16 0, big-endian float4s), made from the stored little-endian bytes."""
    head = struct.pack("!hh", dims, 0)
    size = struct.pack("!i", 4 + 4 * dims)
    parts = []
    for rid, data in zip(ids, vectors):
        key = rid.encode("utf-8")
        parts += [struct.pack("!hi", 2, len(key)), key, size, head,
                  np.frombuffer(data, dtype=DTYPE).astype(">f4").tobytes()]
    return b"".join(parts)


def pgvector_schema(conn: psycopg.Connection) -> str | None:
    return conn.execute(q("embed_pgvector")).fetchone()["schema"]


def ensure_view(conn: psycopg.Connection, dataset: str, spec: JobSpec, job_version: str, id_type: str) -> str:
    """The dataset's view reading ``job_version``'s search table (in the caller's transaction)."""
    return conn.execute(q("embed_ensure_view"), {"dataset": dataset, "job": job_version, "id_type": id_type,
                                                 "dims": spec.embedding.dimensions}).fetchone()["view_name"]


class SearchIndex(Destination):
    """The search table and its HNSW index of each published version of an embedding dataset."""

    def __init__(self, spec: JobSpec, *, ledger: psycopg.Connection):
        self.spec = spec
        self.conn = ledger
        self.name = f"search:{spec.dataset}"

    def check(self) -> None:
        if pgvector_schema(self.conn) is None:
            raise PublishRefused(
                f"dataset {self.spec.dataset}: an embedding job is published as a pgvector column, and the ledger's "
                "database has no pgvector extension (install pgvector on the server, then run `batch-inference db "
                "migrate`, which creates it)")

    def _build(self, job_version: str, spec: JobSpec) -> Pointed:
        """The version's search table, filled and indexed (each once, each its own commit)."""
        self.check()
        changed = self.fill(job_version, spec) > 0
        index = self.index(job_version)
        return Pointed(self.name, job_version, None, f"{table_name(job_version)} ({index})", changed)

    def fill(self, job_version: str, spec: JobSpec) -> int:
        """Create the version's search table and copy its vectors in, unless it holds them; returns how many
        were copied now."""
        with self.conn.transaction():
            self.conn.execute(q("embed_index_create"), {"job": job_version, "dims": spec.embedding.dimensions})
        have = self.conn.execute(composed("embed_index_rows", table=sql.Identifier("bi", f"embed_{job_version}"))
                                 ).fetchone()["n"]
        if have:
            return 0
        n = self._fill(job_version, spec.embedding.dimensions)
        log.info("%s: %d vectors copied into %s", job_version, n, table_name(job_version))
        return n

    def index(self, job_version: str) -> str:
        """Build the version's HNSW index unless it exists; returns its name."""
        with self.conn.transaction():
            return self.conn.execute(q("embed_index_build"), {"job": job_version}).fetchone()["index"]

    def _fill(self, job_version: str, dims: int) -> int:
        """Copy the version's vectors into its (empty) search table, in one transaction: pages of
        ``COPY_ROWS`` read in record id order, each staged by one binary COPY, then one INSERT."""
        after = None
        with self.conn.transaction():
            self.conn.execute(q("embed_index_stage"), {"dims": dims})
            while True:
                rows = self.conn.execute(q("embed_index_source"), {"job": job_version, "after": after,
                                                                   "n": COPY_ROWS}).fetchall()
                if not rows:
                    break
                with self.conn.cursor().copy(q("embed_index_copy")) as copy:
                    copy.write(_COPY_HEADER + copy_rows([r["record_id"] for r in rows],
                                                        [r["embedding"] for r in rows], dims) + _COPY_TRAILER)
                after = rows[-1]["record_id"]
            return self.conn.execute(q("embed_index_fill"), {"job": job_version}).fetchone()["n"]

    def publish(self, version: Version, *, force: bool = False, reason: str | None = None) -> Pointed:
        return self._build(version.job_version, version.spec)

    def point_back(self, job_version: str) -> Pointed:
        spec = job_spec(self.conn, job_version)
        if spec.task != "embed":
            return Pointed(self.name, job_version, None, None, False)
        return self._build(job_version, spec)

    def restore(self, pointed: Pointed) -> None:
        """Nothing to undo: the table of a version the view does not name is never read."""

