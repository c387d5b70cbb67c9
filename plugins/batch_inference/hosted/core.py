"""The hosted batch transport: one provider batch per leased shard.

A hosted batch engine is an :class:`~batch_inference.engines.base.Engine`
run by the ordinary worker, so the worker leases the shard, renders its
records (``prompting.build_messages``), renews the lease on its thread while
the provider works, checks every output (``outputs.check_for_storage``) and
writes it put-if-absent under the transport ``hosted_batch``. What the engine
adds, in :meth:`HostedBatchEngine.generate`:

1. **Intent.** Before the provider's create call it writes an intent row
   (``bi.hosted_open_v1``: job version, shard, epoch, idempotency key). A
   worker that re-leases the shard finds the open row: it re-attaches to the
   batch the row names, or, when the earlier holder died between the create
   call and the confirmation, asks the provider for the batch by the key
   (:meth:`Provider.find`) before it would create one. A record is never in
   two provider batches by our doing.
2. **Poll.** Every ``poll_seconds`` it reads the batch and mirrors the
   provider's request counts into the row (the cutoff's hosted term,
   ``bi.hosted_counts_v1``).
3. **Cancel and collect.** When the cutoff fires (the worker's ``drain``) it
   asks the provider to cancel, keeps polling until the batch has settled, and
   then collects every result the provider completed, of a cancelled or
   expired batch too: they were paid for. A preemption notice or a stale lease
   only stops watching: the batch goes on and the next holder re-attaches.
4. **Reconcile.** Results become outcomes: a success is text for the worker's
   checks; a request the provider refused as invalid is a failed attempt; a
   provider-side server error, an expiry or a cancellation spends nothing and
   leaves the record pending (for the next batch or the fallback). The row is
   marked collected; once the worker has stored the outcomes (``end_shard``, or
   the shard's next ``generate``) it is reconciled and the provider's input
   and output files are deleted. A holder that dies before storing collects
   the ended batch again: results are read again, never bought again.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from batch_inference.breaker import EndpointUnavailable
from batch_inference.clearance import check_clearance
from batch_inference.db import q
from batch_inference.engines import TRUNCATED, Engine, Outcome, Request, one_line
from batch_inference.exceptions import BatchInferenceError, BudgetSpent, InvalidValue
from batch_inference.ledger import Lease, Ledger, StaleLease

log = logging.getLogger("batch_inference.hosted")

# Normalised kinds of one result line.
SUCCEEDED, ERRORED, TRANSPORT, CANCELED, EXPIRED = "succeeded", "errored", "transport", "canceled", "expired"
MAX_POLL_FAILURES = 10
# How far before an intent a provider batch may be dated and still be the one it created (clock skew).
CLOCK_SKEW_S = 300.0


_DECODE = json.JSONDecoder().decode


def jsonl_objects(text: str) -> Iterator[Any]:
    """The values of a JSONL result file, one per non-blank line, as they are read."""
    for raw in text.splitlines():
        if raw and not raw.isspace():
            yield _DECODE(raw)


class HostedBatchError(BatchInferenceError, RuntimeError):
    """The provider refused a whole batch (not one request)."""


@dataclass(frozen=True)
class BatchStatus:
    """A provider batch as the transport sees it: the provider's own status word and its counts."""

    status: str
    ended: bool
    total: int = 0
    processing: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    failed: bool = False          # the whole batch failed (validation): nothing ran

    def counts(self) -> list[int]:
        return [self.total, self.processing, self.succeeded, self.errored, self.canceled, self.expired]


@dataclass(frozen=True)
class Item:
    """One result line: ``custom_id`` and what became of the request."""

    custom_id: str
    kind: str
    text: str | None = None
    error: str | None = None
    tokens_out: int = 0
    tokens_in: int = 0
    vector: Any = None            # an embedding request's answer (task: embed), instead of text


@dataclass(frozen=True)
class Intent:
    intent_no: int
    idem_key: str
    batch_id: str | None
    state: str
    record_ids: list[str]
    reattached: bool
    collected_epoch: int | None
    input_ref: str | None = None
    created_at: float = 0.0       # when the intent was written (database clock, epoch seconds)


class Provider(abc.ABC):
    """One hosted batch API, through its official client."""

    name: ClassVar[str]

    def __init__(self, engine: "HostedBatchEngine"):
        self.engine = engine

    @abc.abstractmethod
    def connect(self) -> None:
        """Build the client (credentials read here)."""

    def custom_id(self, record_id: str) -> str:
        """The id a request carries at the provider (the record id, unless the API restricts it)."""
        return record_id

    @abc.abstractmethod
    def submit(self, key: str, requests: Sequence[Request]) -> tuple[str, str | None]:
        """Create the batch; returns (provider batch id, input reference)."""

    @abc.abstractmethod
    def find(self, key: str, custom_ids: Sequence[str], since: float) -> str | None:
        """The batch an unconfirmed intent created, if the provider has it (created after ``since``)."""

    @abc.abstractmethod
    def status(self, batch_id: str) -> BatchStatus: ...

    @abc.abstractmethod
    def cancel(self, batch_id: str) -> None: ...

    @abc.abstractmethod
    def results(self, batch_id: str) -> Iterator[Item]:
        """Every result line of an ended batch (output and error files alike)."""

    def cleanup(self, batch_id: str, input_ref: str | None) -> None:
        """Delete the provider's input and output files where the API allows it."""

    def transient(self, exc: BaseException) -> bool:
        """A failure of the call, not of the batch: refused, reset, timed out, a 5xx."""
        return False


class HostedLedger:
    """The fenced provider-batch calls (sql/hosted.sql), on the worker's own ledger connection."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def _call(self, name: str, lease: Lease, **params: Any) -> dict[str, Any]:
        """One fenced call: the ledger's own fence check (``Ledger.transition``: StaleLease when stale)."""
        return self.ledger.transition(name, name, lease, **params)

    def open(self, lease: Lease, provider: str, ids: Sequence[str]) -> Intent:
        r = self._call("hosted_open", lease, provider=provider, ids=list(ids))
        return Intent(r["intent_no"], r["idem_key"], r["provider_batch_id"], r["state"], list(r["record_ids"]),
                      bool(r["reattached"]), r["collected_epoch"], created_at=r["created_at"].timestamp())

    def spend(self, lease: Lease) -> dict[str, Any]:
        """The hosted part of the bill and the requests the job's provider batches hold; takes the job's
        budget lock for the open transaction (``bi.hosted_spend_v1``)."""
        return self.ledger.conn.execute(q("hosted_spend"), {"job": lease.job_version, "lock": True}).fetchone()

    def intents(self, lease: Lease) -> list[Intent]:
        rows = self.ledger.conn.execute(q("hosted_intents"), {
            "job": lease.job_version, "shard": lease.shard_no, "epoch": lease.epoch}).fetchall()
        return [Intent(r["intent_no"], r["idem_key"], r["provider_batch_id"], r["state"], list(r["record_ids"]),
                       True, r["collected_epoch"], r["input_ref"]) for r in rows]

    def update(self, lease: Lease, intent_no: int, op: str, *, batch_id: str | None = None,
               input_ref: str | None = None, ids: Sequence[str] | None = None, st: BatchStatus | None = None,
               cancel: bool = False) -> str:
        r = self._call("hosted_update", lease, intent=intent_no, op=op, batch_id=batch_id, input_ref=input_ref,
                       ids=None if ids is None else list(ids), status=st.status if st else None,
                       counts=st.counts() if st else None, ended=bool(st and st.ended), cancel=cancel,
                       input_tokens=st.input_tokens if st and op == "collected" else None,
                       output_tokens=st.output_tokens if st and op == "collected" else None)
        return r["state"]


class HostedBatchEngine(Engine):
    """Base of the hosted batch engines; a subclass names its :class:`Provider`."""

    transport = "hosted_batch"
    whole_shard = True
    provider_class: ClassVar[type[Provider]]
    common_options = frozenset({"model", "api_key_env", "conn_id", "base_url", "poll_seconds", "cancel_poll_seconds",
                                "cancel_timeout_s", "delete_files", "hosted", "timeout_s"})
    default_base_url: ClassVar[str | None] = None

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        self.model = str(self.option("model", spec.model.name))
        self.base_url = self.option("base_url", self.default_base_url)
        self.poll_seconds = float(self.option("poll_seconds", 60.0))
        self.cancel_poll_seconds = float(self.option("cancel_poll_seconds", min(self.poll_seconds, 30.0)))
        self.cancel_timeout_s = float(self.option("cancel_timeout_s", 3600.0))
        self.timeout_s = float(self.option("timeout_s", 120.0))
        self.delete_files = bool(self.option("delete_files", True))
        if not (self.poll_seconds > 0 and self.cancel_poll_seconds > 0 and self.cancel_timeout_s > 0):
            raise InvalidValue(f"engine '{self.name}': poll_seconds, cancel_poll_seconds and cancel_timeout_s "
                               "must be positive")
        # A hosted batch API is hosted unless the spec's endpoints say its host is internal
        # (option hosted: false declares nothing, as for the fallback).
        check_clearance(spec, self.clearance_url(), hosted=bool(self.option("hosted", True)), role=self.name)
        self.provider = self.provider_class(self)
        self._ledger: HostedLedger | None = None
        self._lease: Lease | None = None
        self._drain: threading.Event | None = None
        self._connected = False

    def result_default(self, key: str) -> Any:
        return self.spec.model.name if key == "model" else None

    def clearance_url(self) -> str | None:
        return self.base_url

    # -- credentials --------------------------------------------------------
    def credentials(self) -> tuple[str | None, str | None]:
        """(API key, base URL). The key: from ``api_key_env`` (an environment variable's name), else
        the Airflow connection ``conn_id``'s password (read only when named, once; the worker need not
        have Airflow), whose host, if any, is the endpoint unless ``base_url`` is set."""
        env = self.option("api_key_env")
        if env:
            value = os.environ.get(str(env))
            if not value:
                raise InvalidValue(f"engine '{self.name}': environment variable '{env}' (option api_key_env) "
                                   "is not set")
            return value, self.base_url
        conn = self.airflow_connection()
        if conn is None:
            return None, self.base_url
        return conn.password, conn.host if conn.host and not self.option("base_url") else self.base_url

    def airflow_connection(self) -> Any:
        conn_id = self.option("conn_id")
        if not conn_id:
            return None
        from airflow.sdk import BaseHook   # lazily: only a deployment that names a connection needs Airflow

        return BaseHook.get_connection(str(conn_id))

    # -- the worker's hooks -------------------------------------------------
    def load(self) -> None:
        self.provider.connect()
        self._connected = True

    def begin_shard(self, ledger: Any, lease: Any, drain: threading.Event) -> None:
        self._ledger, self._lease, self._drain = HostedLedger(ledger), lease, drain

    def end_shard(self, lease: Any) -> None:
        self._close_collected()

    def _close_collected(self) -> None:
        """Provider batches whose results this epoch handed to the worker, which has stored them since:
        reconciled, and their files deleted."""
        hl, lease = self._require()
        for it in hl.intents(lease):
            if it.state == "ended" and it.collected_epoch == lease.epoch:
                hl.update(lease, it.intent_no, "reconciled")
                if self.delete_files and it.batch_id:
                    try:
                        self.provider.cleanup(it.batch_id, it.input_ref)
                    except Exception as exc:  # noqa: BLE001 - the results are stored; the provider's retention applies
                        log.warning("%s: could not delete the files of batch %s: %s", self.name, it.batch_id,
                                    one_line(exc))

    def _require(self) -> tuple[HostedLedger, Lease]:
        if self._ledger is None or self._lease is None:
            raise RuntimeError(f"engine '{self.name}': generate() called outside a leased shard")
        return self._ledger, self._lease

    # -- one shard's batch --------------------------------------------------
    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        if not self._connected:
            raise RuntimeError(f"engine '{self.name}': generate() called before load()")
        hl, lease = self._require()
        self._close_collected()
        draining = self._drain if self._drain is not None else stop
        by_id = {r.record_id: r for r in requests}
        it = self._open(hl, lease, list(by_id))
        if it.reattached:
            log.info("%s: shard %d: re-attaching to intent %d (%s, batch %s)", self.name, lease.shard_no,
                     it.intent_no, it.state, it.batch_id or "not confirmed")
        batch_id = it.batch_id
        if batch_id is None and it.reattached:
            batch_id = self.provider.find(it.idem_key, [self.provider.custom_id(r) for r in it.record_ids],
                                          it.created_at)
            if batch_id is not None:
                log.warning("%s: shard %d: the earlier holder created batch %s but died before confirming it; "
                            "re-attached by key %s", self.name, lease.shard_no, batch_id, it.idem_key)
                hl.update(lease, it.intent_no, "confirm", batch_id=batch_id)
        if batch_id is None:
            if stop.is_set():
                return
            # What the shard still needs, of what the intent names: never a stored record again. The
            # worker's requests are this epoch's unstored records (read under the lease just now).
            ids = [rid for rid in it.record_ids if rid in by_id]
            if not ids:
                hl.update(lease, it.intent_no, "abandoned")
                return
            batch_id, input_ref = self._create(it, [by_id[rid] for rid in ids])
            hl.update(lease, it.intent_no, "confirm", batch_id=batch_id, input_ref=input_ref, ids=ids)
            it = Intent(it.intent_no, it.idem_key, batch_id, "submitted", ids, False, None)
            log.info("%s: shard %d: submitted %d requests as batch %s", self.name, lease.shard_no, len(ids),
                     batch_id)
        st = self._watch(hl, lease, it.intent_no, batch_id, stop, draining)
        if st is None:
            return     # preempted or stale: the batch goes on; the next holder re-attaches
        yield from self._collect(hl, lease, it, batch_id, st)

    def _open(self, hl: HostedLedger, lease: Lease, ids: list[str]) -> Intent:
        """The shard's provider batch: the one it re-attaches to, or a new intent. Under ``cost.budget``
        with ``on_budget: page`` a new one names only the rows the rest of the budget affords at the
        batch price (``hosted.budget``), checked and reserved in one transaction under the job's budget
        lock; none affordable: ``BudgetSpent`` (the worker releases the shard, its rows stay pending)."""
        cost = self.spec.cost
        if cost.budget is None or cost.on_budget != "page":
            return hl.open(lease, self.provider.name, ids)
        from batch_inference.hosted.budget import affordable, hosted_budget
        from batch_inference.status import job_counts

        stale: StaleLease | None = None
        with hl.ledger.conn.transaction():
            if not hl.intents(lease):
                check = hosted_budget(self.spec, job_counts(hl.ledger.conn, lease.job_version), hl.spend(lease))
                n = affordable(check, len(ids))
                if n == 0:
                    raise BudgetSpent(check.page(lease.job_version))
                if n < len(ids):
                    log.warning("%s: shard %d: %d of %d rows go to the provider within the budget: %s", self.name,
                                lease.shard_no, n, len(ids), check.page(lease.job_version))
                    ids = ids[:n]
            try:
                it = hl.open(lease, self.provider.name, ids)
            except StaleLease as exc:    # kept, with its fence record: the transaction commits
                stale = exc
        if stale is not None:
            raise stale
        return it

    def _create(self, it: Intent, requests: list[Request]) -> tuple[str, str | None]:
        """The provider's create call, made once: the client does not retry it (a retry after a lost
        reply would create a second batch); a failed call is followed by a look-up by key."""
        try:
            return self.provider.submit(it.idem_key, requests)
        except Exception as exc:
            if not self.provider.transient(exc):
                raise
            found = self.provider.find(it.idem_key, [self.provider.custom_id(r.record_id) for r in requests],
                                       it.created_at)
            if found is None:
                raise EndpointUnavailable(str(self.base_url or self.name), f"batch create failed: {one_line(exc)}") \
                    from None
            log.warning("%s: the create call failed (%s) but the provider has batch %s: attached", self.name,
                        one_line(exc), found)
            return found, None

    def _status(self, batch_id: str, stop: threading.Event) -> BatchStatus:
        """The batch's status; a transient failure is retried, backing off, up to ``MAX_POLL_FAILURES``
        in a row. ``stop`` (the cutoff or a preemption notice) cuts a back-off short, and from then
        on retries come at the cancel poll's pace, so a flaky endpoint cannot hold up the cancel."""
        for n in range(MAX_POLL_FAILURES):
            try:
                return self.provider.status(batch_id)
            except Exception as exc:
                if not self.provider.transient(exc):
                    raise
                log.warning("%s: polling batch %s failed (%s); retrying", self.name, batch_id, one_line(exc))
                delay = min(self.poll_seconds, 30.0) * (n + 1)
                if stop.is_set():
                    time.sleep(min(delay, self.cancel_poll_seconds))
                else:
                    stop.wait(delay)
        raise EndpointUnavailable(str(self.base_url or self.name), f"{MAX_POLL_FAILURES} polls of {batch_id} failed")

    def _watch(self, hl: HostedLedger, lease: Lease, intent_no: int, batch_id: str, stop: threading.Event,
               draining: threading.Event) -> BatchStatus | None:
        """Poll until the batch ends; cancel it (and keep polling) once the cutoff fires."""
        pause = threading.Event()      # never set: a plain wait that the halt does not cut short
        cancel_at: float | None = None
        while True:
            st = self._status(batch_id, stop)
            hl.update(lease, intent_no, "poll", st=st)
            if st.ended:
                if cancel_at is not None:
                    log.info("%s: shard %d: batch %s settled %.1fs after the cancel (%s)", self.name,
                             lease.shard_no, batch_id, time.monotonic() - cancel_at, st.status)
                return st
            if stop.is_set() and not draining.is_set():
                return None
            if draining.is_set() and cancel_at is None:
                log.warning("%s: shard %d: cutoff fired: cancelling batch %s (%d of %d succeeded so far)",
                            self.name, lease.shard_no, batch_id, st.succeeded, st.total)
                self.provider.cancel(batch_id)
                cancel_at = time.monotonic()
                hl.update(lease, intent_no, "poll", cancel=True)
            if cancel_at is not None:
                if time.monotonic() - cancel_at > self.cancel_timeout_s:
                    log.error("%s: shard %d: batch %s still not settled %.0fs after the cancel; leaving it",
                              self.name, lease.shard_no, batch_id, self.cancel_timeout_s)
                    return None
                pause.wait(self.cancel_poll_seconds)
            else:
                stop.wait(self.poll_seconds)

    def _collect(self, hl: HostedLedger, lease: Lease, it: Intent, batch_id: str,
                 st: BatchStatus) -> Iterator[Outcome]:
        ids = {self.provider.custom_id(rid): rid for rid in it.record_ids}
        kinds: dict[str, int] = {}
        tokens_in = tokens_out = 0
        if not st.failed:
            for item in self.provider.results(batch_id):
                rid = ids.get(item.custom_id)
                if rid is None:
                    log.warning("%s: batch %s answered an unknown custom_id %r; ignored", self.name, batch_id,
                                item.custom_id[:80])
                    continue
                kinds[item.kind] = kinds.get(item.kind, 0) + 1
                tokens_in += item.tokens_in
                tokens_out += item.tokens_out
                if item.kind == SUCCEEDED:
                    yield Outcome(rid, item.text, error=TRUNCATED if item.error == TRUNCATED else None,
                                  tokens_out=item.tokens_out, vector=item.vector)
                elif item.kind == ERRORED:
                    yield Outcome(rid, item.text, error=item.error or "the provider refused the request")
                # transport errors, cancellations and expiries: no attempt spent, the record stays pending
        if st.input_tokens is None and (tokens_in or tokens_out):   # usage per result, not per batch
            st = dataclasses.replace(st, input_tokens=tokens_in, output_tokens=tokens_out)
        hl.update(lease, it.intent_no, "collected", st=st)
        log.info("%s: shard %d: batch %s %s: %s", self.name, lease.shard_no, batch_id, st.status,
                 ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "no results")
