"""The shard ledger: claim, renew, release and complete leases; write results
and failed attempts under a lease.

Every method is one call of a SQL function (sql/schema/ledger.sql), whose
guard (state, epoch) sits inside the statement that changes state. A method that is
refused because the epoch is stale raises ``StaleLease``: the caller stops
working on that shard, and nothing it sent was written.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from batch_inference.db import q
from batch_inference.exceptions import BatchInferenceError
from batch_inference.outputs import storable_text


# A fleet started at once (the pod operator's worker slots) spreads its first
# claims over this many seconds: each worker waits a random part of it before
# its first claim (gpu_runner.worker, --start-jitter-seconds), so the claims and
# first shard reads do not all queue for the ledger's connections together.
FLEET_START_JITTER_SECONDS = 10.0

# A shard is read this many records per call (bi.shard_records_v3): one call
# never carries a whole shard's text, so it holds a pooled server connection
# for a page's time whatever the shard size.
SHARD_READ_PAGE = 1000

# A put sends its ids, outputs and categories each as one text that the server
# splits (string_to_array, put_results_joined): one join here instead of three
# arrays encoded element by element (psycopg's binary list dumper runs Python
# per element, about 1 us of the worker's CPU a result). Valid JSON never holds
# a raw U+001E; a batch where an element holds one (or a category holds the
# NULL mark) goes as arrays (put_results).
PUT_SEPARATOR = "\x1e"
PUT_NULL = "\x1f"


def _joined(items: list[str]) -> str | None:
    """``items`` as one text that splits back into exactly them at ``PUT_SEPARATOR``, else None."""
    text = PUT_SEPARATOR.join(items)
    # '' splits into no element at all: a lone empty item goes as an array.
    return text if text and text.count(PUT_SEPARATOR) == len(items) - 1 else None


class StaleLease(BatchInferenceError, RuntimeError):
    """The shard was re-leased (our epoch is stale): our write was refused."""


@dataclass(frozen=True)
class Lease:
    job_version: str
    shard_no: int
    epoch: int
    expires_at: datetime
    records: int
    owner: str
    transport: str = "batch"
    lost_leases: int = 0        # earlier epochs of this shard that ended without a release or completion

    @property
    def careful(self) -> bool:
        """A holder of this shard died (or stalled) before: mark engine batches in flight."""
        return self.lost_leases > 0


@dataclass(frozen=True)
class Failure:
    record_id: str
    error: str
    raw_output: str | None = None
    # The attempt number this failure is (attempts so far + 1). The ledger
    # ignores a number it has already counted, so a call retried after its
    # reply was lost counts once. None: count unconditionally.
    attempt: int | None = None


@dataclass(frozen=True)
class FailedAttempt:
    record_id: str
    attempts: int
    dead: bool


def new_owner_id(prefix: str = "worker") -> str:
    """Unique per process start, readable in the shard table."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _call_once(fn: Any) -> Any:
    return fn()


class Ledger:
    """The worker's view of the ledger, over one autocommit connection.

    ``engine`` and ``endpoint`` (``provenance.made_by``) go on every result
    row this ledger puts; None records neither. ``call(fn)`` runs ``fn()``, a
    call on ``conn``: the worker sets it to its own reconnect-and-retry, so an
    engine that writes through the worker's ledger (the model ladder's rung
    answers) outlives a database restart as the worker's own writes do."""

    def __init__(self, conn: psycopg.Connection, job_version: str, owner: str,
                 transport: str = "batch", lease_seconds: int | None = None,
                 engine: str | None = None, endpoint: str | None = None):
        self.conn = conn
        self.job_version = job_version
        self.owner = owner
        self.transport = transport
        self.lease_seconds = lease_seconds
        self.engine = engine
        self.endpoint = endpoint
        self.call: Any = _call_once

    def with_conn(self, conn: psycopg.Connection) -> "Ledger":
        """This ledger over another connection (a preemption notice writes and releases on its own), sharing
        whatever this one holds; its calls made once (``call`` is not the worker's reconnect)."""
        out = copy.copy(self)
        out.conn, out.call = conn, _call_once
        return out

    def _args(self, lease: Lease, **extra: Any) -> dict[str, Any]:
        return {"job": lease.job_version, "shard": lease.shard_no, "epoch": lease.epoch,
                "owner": self.owner, "transport": self.transport, **extra}

    def claim(self) -> Lease | None:
        r = self.conn.execute(q("claim_shard"), {"job": self.job_version, "owner": self.owner,
                                                 "transport": self.transport,
                                                 "lease_s": self.lease_seconds}).fetchone()
        if r is None:
            return None
        return Lease(self.job_version, r["shard_no"], r["epoch"], r["lease_expires_at"], r["records"],
                     self.owner, self.transport, r["lost_leases"])

    def _fenced(self, statement: str, lease: Lease, **extra: Any) -> dict[str, Any] | None:
        """Run one fenced transition. Each answers one row; ``stale`` is true
        (and the call changed nothing) when our epoch has ended: None then."""
        r = self.conn.execute(q(statement), self._args(lease, **extra)).fetchone()
        return None if r["stale"] else r

    def _held(self, what: str, statement: str, lease: Lease, **extra: Any) -> dict[str, Any]:
        r = self._fenced(statement, lease, **extra)
        if r is None:
            raise StaleLease(f"{what} refused: shard {lease.shard_no} epoch {lease.epoch} is stale")
        return r

    # One fenced transition that must find our epoch current (StaleLease otherwise), by statement name:
    # the public name other modules call (hosted.core's provider-batch calls).
    transition = _held

    def renew(self, lease: Lease) -> str:
        """Extend the lease; returns the job's mode ('batch' or 'fallback')."""
        return self._held("renew", "renew_lease", lease, lease_s=self.lease_seconds)["mode"]

    def release(self, lease: Lease) -> bool:
        """Give the shard back at once; False when our epoch had already ended."""
        return self._fenced("release_shard", lease) is not None

    def complete(self, lease: Lease) -> str:
        """'done', or 'incomplete' (records left: release instead). Stale raises."""
        return "done" if self._held("complete", "complete_shard", lease)["done"] else "incomplete"

    def records(self, lease: Lease) -> list[dict[str, Any]]:
        """The shard's records not yet stored or dead-lettered, with failed
        attempts and crashes (deaths with the record in flight) so far, in
        record id order. Empty for a stale epoch: a stale holder reads nothing."""
        return [{"record_id": i, "text": t, "attempts": a, "crashes": c}
                for i, t, a, c in zip(*self.record_columns(lease))]

    def record_columns(self, lease: Lease, page: int = SHARD_READ_PAGE
                       ) -> tuple[list[str], list[str], list[int], list[int]]:
        """``records`` as four parallel lists (ids, texts, attempts, crashes),
        without a dict per record: what the worker reads at every claim. Read
        ``page`` records a call, each page after the last id of the one before."""
        ids: list[str] = []
        texts: list[str] = []
        attempts: list[int] = []
        crashes: list[int] = []
        with self.conn.cursor(row_factory=tuple_row) as cur:
            after = None
            while True:
                rows = cur.execute(q("shard_records"), self._args(lease, after=after, limit=page)).fetchall()
                if rows:
                    i, t, a, c = zip(*rows)
                    ids += i
                    texts += t
                    attempts += a
                    crashes += c
                if len(rows) < page:
                    return ids, texts, attempts, crashes
                after = ids[-1]

    def mark_in_flight(self, lease: Lease, ids: Sequence[str]) -> None:
        """Careful mode: ``ids`` are the engine batch about to be generated. If
        this epoch ends without a release, each of them left without a result
        gets a crash (sql/schema/ledger.sql, bi.record_deaths_v1)."""
        self._held("in-flight mark", "mark_in_flight", lease, ids=list(ids))

    def note_shared(self, lease: Lease, n: int) -> None:
        """Count ``n`` records of the shard stored with another record's result (the same rendered
        input, computed once); stale raises."""
        self._held("shared count", "note_shared", lease, n=n)

    def abandon(self, lease: Lease) -> bool:
        """Give the shard back at once because the engine broke: a release that
        counts as a lost lease, with crashes for the in-flight batch."""
        return self._fenced("abandon_shard", lease) is not None

    def put_results(self, lease: Lease, ids: Sequence[str], outputs: Sequence[dict[str, Any] | str],
                    categories: Sequence[str | None], vectors: Sequence[bytes] | None = None) -> int:
        """Put-if-absent; returns how many rows were new. An output is an
        object, or JSON text jsonb accepts (``outputs.check_for_storage``).
        ``vectors``: an embedding job's float32 vectors, one per id, stored
        with their rows in the same call (``embed.vectors``)."""
        if not ids:
            return 0
        if vectors is not None:
            return self._held("results", "embed_put_results", lease, engine=self.engine, endpoint=self.endpoint,
                              ids=list(ids), outputs=list(outputs), vectors=list(vectors))["n"]
        texts = [o if isinstance(o, str) else json.dumps(o, ensure_ascii=False) for o in outputs]
        cats = list(categories)
        id_text, output_text = _joined(list(ids)), _joined(texts)
        cat_text = _joined([PUT_NULL if c is None else c for c in cats])
        # Every NULL mark in the categories' text is a None (a category holding one goes as arrays).
        if id_text and output_text and cat_text and cat_text.count(PUT_NULL) == cats.count(None):
            return self._held("results", "put_results_joined", lease, engine=self.engine, endpoint=self.endpoint,
                              ids=id_text, outputs=output_text, categories=cat_text)["n"]
        return self._held("results", "put_results", lease, engine=self.engine, endpoint=self.endpoint,
                          ids=list(ids), outputs=texts, categories=cats)["n"]

    def fail(self, lease: Lease, failures: Sequence[Failure]) -> list[FailedAttempt]:
        """Count one failed attempt per record; returns the counts (dead at the
        max). Safe to repeat when every failure carries its ``attempt``."""
        if not failures:
            return []
        r = self._held("failures", "fail_records", lease, ids=[f.record_id for f in failures],
                       errors=[storable_text(f.error) for f in failures],
                       outputs=[storable_text(f.raw_output) for f in failures],
                       attempt_nos=[f.attempt for f in failures])
        return [FailedAttempt(*row) for row in zip(r["record_ids"], r["attempts"], r["dead"])]

    def done_keys(self, job_version: str, shard_no: int) -> set[str]:
        return {r["record_id"] for r in self.conn.execute(q("done_keys"), {"job": job_version, "shard": shard_no})}
