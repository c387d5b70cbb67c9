"""Shard overlap: one engine stream over every shard the worker holds.

An engine that streams (``Engine.queue_depth() > 0``) keeps that many
requests unfinished and asks this feed for more whenever it has room. The
feed hands over the held shards' records, oldest shard first; when all of
them are queued and the engine still has room, it claims the next shard and
reads it, so the next shard's records join the batch while the current
shard's last ones still generate. It claims only while:

* the worker may take more shards (``max_shards`` counts completed and held);
* no shard has drained (the job is in fallback) and no preemption notice came;
* the last claim found a shard (a worker that found none goes back to the
  worker's loop, which waits for leases that may expire);
* the records held would still finish within a lease at the rate this stream
  has reached so far (before it has a rate: only to fill the engine's batch).

A claimed shard whose last holder died (careful mode) is not mixed into the
stream: it is parked, renewed with the others, and run alone once the held
shards are done (``Worker._process``).

Each shard has its own lease, renewal (one renewer thread, one fenced call
per shard), outcome buffer and epoch fence. A shard that halts (its lease
went stale, or it drains) has its queued records aborted in the engine
(``Feed.cancelled``); a stale one drops what it had not written, a drained
one writes what it had and is released; the others go on. A shard whose
records are all answered is written, and its failures retried after the
backoff, or it is completed. When the engine raises, every held shard is
given back (``ShardHost.give_back``). The feed runs in the worker's thread
(the engine calls it between steps), on the worker's connection; between
steps it also writes each shard's finished outcomes once they are
``flush_seconds`` old, so results reach the ledger as records finish, not
when a shard ends. The stream talks to the worker only through
``gpu_runner.shard.ShardHost``.

Identical inputs are computed once (``gpu_runner.shard.input_key``, as the
worker's one-shard path does): a record whose request is the same as one in
the engine now, of any held shard, is not queued but waits for that outcome,
which is then held under its own id in its own shard (under that shard's
lease; ``Shard.shared`` counts it). A shard's records with the same text are
queued one after another, so within a shard they always meet. A shard that
stops aborts its requests in the engine; the records of other shards waiting
for one of them are queued again in their own shard; its own waiting records
are dropped with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg

from batch_inference.engines.base import Outcome, Request
from batch_inference.exceptions import DatabaseUnavailable
from batch_inference.ledger import Lease, StaleLease
from gpu_runner.shard import Shard, ShardHost, computes_once, input_key

log = logging.getLogger("batch_inference.worker")

# Outcomes the stream needs before its rate decides how many records it may hold.
RATE_AFTER = 32


@dataclass(eq=False)
class _Queue:
    """A streamed shard's records: to queue, queued, and failed ones waiting for their retry."""

    texts: dict[str, str]
    todo: deque[str]
    in_engine: set[str] = field(default_factory=set)
    retry: list[str] = field(default_factory=list)
    round_no: int = 0
    retry_at: float = 0.0

    @property
    def open(self) -> int:
        return len(self.todo) + len(self.in_engine) + len(self.retry)


def _same_texts_together(texts: dict[str, str]) -> deque[str]:
    """The ids in order, each record with the same text as an earlier one moved up behind it."""
    by_text: dict[str, list[str]] = {}
    for rid, text in texts.items():
        by_text.setdefault(text, []).append(rid)
    if len(by_text) == len(texts):
        return deque(texts)
    return deque(rid for ids in by_text.values() for rid in ids)


class ShardStream:
    """The feed (``engines.base.Feed``) and the consumer of one ``Engine.stream`` call."""

    def __init__(self, host: ShardHost, first: Lease):
        assert host.engine is not None and host.spec is not None
        self.w = host
        self.engine, self.spec = host.engine, host.spec
        self.depth = self.engine.queue_depth()
        self.lease_s, self.flush_every, self.flush_seconds = host.settings()
        self.active: dict[int, tuple[Shard, _Queue]] = {}   # by shard number, in claim order
        self.owner: dict[str, tuple[Shard, _Queue]] = {}    # record id -> its shard
        self.cancel: list[str] = []
        self.claiming = True
        self.parked: Shard | None = None
        self.answered = 0
        self.first_answer_at: float | None = None
        self.view: tuple[Shard, ...] = ()                   # what the renewer renews (replaced, never mutated)
        # Identical inputs computed once (module docstring): the record whose request is in the engine for
        # each input key, each such record's key, and the records (with their shard) waiting for one.
        self.once = computes_once(self.engine)
        self.leading: dict[tuple[Any, ...], str] = {}
        self.group: dict[str, tuple[Any, ...]] = {}
        self.waiting: dict[str, list[tuple[str, Shard, _Queue]]] = {}
        self.done = threading.Event()
        self._add(first)

    # -- the shards held --------------------------------------------------
    def _set_view(self) -> None:
        self.view = tuple(s for s, _ in self.active.values()) + ((self.parked,) if self.parked else ())

    def _add(self, lease: Lease) -> None:
        shard, texts = self.w.open_shard(lease)
        if lease.careful:
            log.info("%s: shard %d lost its lease before: parked until the held shards are done", self.w.owner,
                     lease.shard_no)
            self.parked, self.claiming = shard, False
            self._set_view()
            return
        queue = _Queue(texts, _same_texts_together(texts) if self.once else deque(texts))
        self.active[lease.shard_no] = (shard, queue)
        for rid in texts:
            self.owner[rid] = (shard, queue)
        self._set_view()
        if not texts:
            self._round_end(shard, queue)

    def _close(self, shard: Shard, queue: _Queue) -> None:
        """Forget the shard here (the worker has let it go): its queued records are aborted."""
        self.active.pop(shard.lease.shard_no, None)
        self._abort(queue)
        queue.todo.clear()
        for rid in queue.texts:
            self.owner.pop(rid, None)
        self._set_view()

    def _abort(self, queue: _Queue) -> None:
        """Abort the queue's records in the engine. Computing once: a request of its own is cancelled
        and the records of other shards waiting for it are queued again in theirs; a record waiting
        for another's outcome just stops waiting (``_share`` skips it)."""
        if not self.once:
            self.cancel.extend(queue.in_engine)
        else:
            for rid in queue.in_engine:
                key = self.group.pop(rid, None)
                if key is None:
                    continue
                del self.leading[key]
                self.cancel.append(rid)
                for other, shard, q in self.waiting.pop(rid, ()):
                    if q is not queue and not shard.closed and other in q.in_engine:
                        q.in_engine.discard(other)
                        q.todo.appendleft(other)
        queue.in_engine.clear()

    def _claim_more(self) -> bool:
        """Claim one more shard if the rules allow (module docstring); True if one was taken."""
        w = self.w
        if not self.claiming or w.stop.is_set():
            return False
        if any(s.drain.is_set() for s, _ in self.active.values()):
            self.claiming = False
            return False
        if self.answered >= RATE_AFTER and self.first_answer_at is not None:
            rate = self.answered / max(time.monotonic() - self.first_answer_at, 1e-9)
            held = sum(q.open for _, q in self.active.values())
            if held + self.spec.shard_size > rate * self.lease_s:
                w.stats["claims_held_back"] += 1     # a refill that found the lease budget spent
                return False
        lease = w.claim_next()
        if lease is None:
            self.claiming = False
            return False
        self._add(lease)
        return True

    # -- the feed (called by the engine, in this thread) --------------------
    def cancelled(self) -> list[str]:
        for shard, queue in list(self.active.values()):
            if shard.halt.is_set() and not self.w.stop.is_set():
                self._stop_shard(shard, queue)
            elif shard.buffered and shard.due(self.flush_every, self.flush_seconds):
                self._flush(shard, queue)    # finished records reach the ledger while the shard runs
        out, self.cancel = self.cancel, []
        return out

    def refill(self, room: int, idle: bool) -> list[Request]:
        spec = self.spec
        out: list[Request] = []
        while True:
            now = time.monotonic()
            for shard, queue in list(self.active.values()):
                if shard.halt.is_set() or queue.retry_at > now:
                    continue
                if self.once:
                    self._queue_once(shard, queue, out, room)
                else:
                    while queue.todo and len(out) < room:
                        rid = queue.todo.popleft()
                        queue.in_engine.add(rid)
                        out.append(shard.request(spec, rid, queue.texts[rid]))
                if len(out) >= room:
                    return out
            if self._claim_more():
                continue
            if out or not idle or self.w.stop.is_set():
                return out
            # Idle with nothing to queue: a retry round waiting for its backoff, or the end.
            due = [q.retry_at for s, q in self.active.values() if q.todo and not s.halt.is_set()]
            if not due:
                return out
            self.w.stop.wait(min(max(min(due) - now, 0.0), 0.25))
            self.cancel.extend(self.cancelled())

    def _queue_once(self, shard: Shard, queue: _Queue, out: list[Request], room: int) -> None:
        """``refill``'s queueing of the shard's records when computing once: a record asked the same
        as a request in the engine waits for it (it takes no room: the records right after a full
        ``room`` that wait are taken too); any other is queued while there is room."""
        spec, leading, group = self.spec, self.leading, self.group
        while queue.todo:
            rid = queue.todo[0]
            req = shard.request(spec, rid, queue.texts[rid])
            key = input_key(req)
            first = leading.get(key)
            if first is not None:
                self.waiting.setdefault(first, []).append((rid, shard, queue))
            elif len(out) < room:
                leading[key] = rid
                group[rid] = key
                out.append(req)
            else:
                return
            queue.todo.popleft()
            queue.in_engine.add(rid)

    # -- the consumer -------------------------------------------------------
    def run(self) -> Lease | None:
        """Stream until no held shard has work; returns a parked (careful) lease to run alone."""
        w = self.w
        renewer = w.renewer(lambda: self.view, self.done, "renew-stream")
        owner, leading, group, waiting = self.owner, self.leading, self.group, self.waiting
        try:
            for outcome in self.engine.stream(self, w.stop):
                rid = outcome.record_id
                key = group.pop(rid, None) if group else None
                held = owner.get(rid)
                # Not when its shard was dropped or released: not ours to write.
                if held is not None and not held[0].closed:
                    if held[0].shared:     # computed itself this time (it may have waited for another before)
                        held[0].shared.discard(rid)
                    self._answer(held[0], held[1], outcome)
                if key is not None:
                    del leading[key]
                    if waiting and rid in waiting:
                        self._share(outcome, waiting.pop(rid))
        except (psycopg.OperationalError, DatabaseUnavailable):
            raise
        except Exception as exc:  # noqa: BLE001 - the endpoint is down, or the engine broke
            self.done.set()
            renewer.join(timeout=5)
            held = [s for s, _ in self.active.values()] + ([self.parked] if self.parked else [])
            w.give_back(held, exc)
        finally:
            self.done.set()
            renewer.join(timeout=5)
        # The stream ended: a preemption notice, a drain, or nothing more to do.
        for shard, queue in list(self.active.values()):
            self._stop_shard(shard, queue)
        parked, self.parked = self.parked, None
        if parked is not None and (w.stop.is_set() or parked.drain.is_set()):
            w.hand_back(parked)
            return None
        if parked is not None:
            w.let_go(parked)
        return parked.lease if parked is not None else None

    def _answer(self, shard: Shard, queue: _Queue, outcome: Outcome) -> None:
        """Hold the outcome of one of the shard's records; write and end the round when due."""
        queue.in_engine.discard(outcome.record_id)
        self.answered += 1
        if self.first_answer_at is None:
            self.first_answer_at = time.monotonic()
        if shard.stale.is_set():
            self._drop(shard, queue, StaleLease(f"lease on shard {shard.lease.shard_no} epoch "
                                                f"{shard.lease.epoch} went stale"))
            return
        self.w.take(shard, outcome)
        if shard.due(self.flush_every, self.flush_seconds):
            self._flush(shard, queue)
        if not queue.todo and not queue.in_engine and not shard.closed:
            self._round_end(shard, queue)

    def _share(self, outcome: Outcome, waiting: list[tuple[str, Shard, _Queue]]) -> None:
        """The outcome of a request that records of the same input waited for: held under each of
        their ids, in their own shard (one still held and still waiting)."""
        for rid, shard, queue in waiting:
            if shard.closed or rid not in queue.in_engine:
                continue
            shard.shared.add(rid)
            self._answer(shard, queue, replace(outcome, record_id=rid))

    def _flush(self, shard: Shard, queue: _Queue) -> None:
        try:
            queue.retry += self.w.write(shard)
        except StaleLease as exc:
            self._drop(shard, queue, exc)

    def _drop(self, shard: Shard, queue: _Queue, exc: StaleLease) -> None:
        self.w.drop(shard, exc)
        self._close(shard, queue)

    def _stop_shard(self, shard: Shard, queue: _Queue) -> None:
        """The shard halted (stale, drain, preemption notice) or the stream ended: abort what is
        queued, write what it has (unless stale), then complete or release it."""
        if shard.stale.is_set():
            self._drop(shard, queue, StaleLease(f"lease on shard {shard.lease.shard_no} epoch "
                                                f"{shard.lease.epoch} went stale"))
            return
        if shard.drain.is_set():
            self.claiming = False
        self._abort(queue)
        self._flush(shard, queue)
        if shard.closed:
            return
        self._close(shard, queue)
        if not queue.todo and not queue.retry and not shard.halt.is_set():
            self.w.finish(shard)
        else:
            self.w.hand_back(shard)

    def _round_end(self, shard: Shard, queue: _Queue) -> None:
        """Every queued record of the shard is answered: write, then retry its failures or complete it."""
        self._flush(shard, queue)
        if shard.closed:
            return
        retry = [rid for rid in queue.retry if rid in queue.texts]
        queue.retry = []
        if retry:
            queue.round_no += 1
            queue.retry_at = time.monotonic() + self.w.retry_wait(shard, queue.round_no, len(retry))
            queue.todo.extend(retry)
            return
        self._close(shard, queue)
        self.w.finish(shard)
