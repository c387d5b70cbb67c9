"""A shard a worker holds, and the seam between the worker and its shard stream.

``gpu_runner.worker`` runs shards one at a time; ``gpu_runner.overlap`` runs
several in one engine stream. The stream talks to the worker only through
``ShardHost`` (the worker implements it): it never reaches into the worker.
"""

from __future__ import annotations

import threading
import time
import typing
from dataclasses import dataclass, field
from typing import Any, Protocol

from batch_inference.engines.base import Engine, Outcome, Request, Retry, build_request
from batch_inference.ledger import Failure, Lease, StaleLease
from batch_inference.spec import JobSpec


@dataclass(eq=False)
class Shard:
    """A shard the worker holds: its lease, its stop signals and the outcomes not yet written."""

    lease: Lease
    halt: threading.Event = field(default_factory=threading.Event)   # stop generating for this shard
    stale: threading.Event = field(default_factory=threading.Event)
    drain: threading.Event = field(default_factory=threading.Event)
    attempts: dict[str, int] = field(default_factory=dict)   # failed attempts counted so far, by record
    progress: Any = None    # the worker's progress line for it (gpu_runner.worker)
    # Outcomes not yet written (ShardHost.take, ShardHost.write).
    ok_ids: list[str] = field(default_factory=list)
    ok_out: list[str] = field(default_factory=list)
    ok_cat: list[str | None] = field(default_factory=list)
    ok_vec: list[bytes] = field(default_factory=list)   # task embed: each result's float32 vector
    failures: dict[str, Failure] = field(default_factory=dict)
    # A put written behind (the worker's ``flush``): (its future, the batch it writes), answered at the next write.
    behind: tuple[Any, tuple[list[str], list[str], list[str | None], list[bytes] | None]] | None = None
    last_flush: float = field(default_factory=time.monotonic)
    # Results held past the flush size while a put is in flight (the worker's ``flush``): the next look is due then.
    held_over: int = 0
    closed: bool = False        # completed, released or dropped: its renewals and outcomes are over
    # Retries (``request``, ``failed``): how each record's attempt in flight was asked, and the last
    # failed answer this worker saw of each record.
    retries: dict[str, Retry] = field(default_factory=dict)
    last_failed: dict[str, Failure] = field(default_factory=dict)
    # Records held with another record's outcome: the same input, computed once (``same_inputs``; the
    # worker's _generate, the stream's refill); ``ShardHost.write`` counts those it stores.
    shared: set[str] = field(default_factory=set)

    def request(self, spec: JobSpec, record_id: str, text: str) -> Request:
        """The record's next request: its first, or a retry (``Retry``: the next attempt number, so
        another seed, and the last failed answer with its error, for a repair turn, when this worker
        saw it), never the request that failed again."""
        done = self.attempts.get(record_id, 0)
        if not done:
            self.retries.pop(record_id, None)
            return build_request(spec, record_id, text)
        last = self.last_failed.get(record_id)
        retry = Retry(done + 1, last.error if last else None, last.raw_output if last else None)
        self.retries[record_id] = retry
        return build_request(spec, record_id, text, retry)

    def failed(self, record_id: str, error: str, output: str | None) -> Failure:
        """Hold a failed attempt of the record for the next write. A retry's error gains a second
        line saying how it was asked (``Retry.describe``): the attempt's record in the ledger
        (``bi.attempts.last_error``, the dead letter's ``error``; its ``reason`` is the first line)."""
        retry = self.retries.get(record_id)
        failure = Failure(record_id, error if retry is None else f"{error}\n{retry.describe()}", output,
                          self.attempts.get(record_id, 0) + 1)
        self.failures[record_id] = self.last_failed[record_id] = failure
        return failure

    @property
    def buffered(self) -> int:
        return len(self.ok_ids) + len(self.failures)

    def due(self, every: int, seconds: float) -> bool:
        return self.buffered >= every + self.held_over or time.monotonic() - self.last_flush >= seconds


def computes_once(engine: Engine) -> bool:
    """Whether records asked the same thing are computed once on ``engine`` (``same_inputs``): not
    on an engine that keeps records of its own by id (a model ladder's rung answers, a hosted
    provider's batch)."""
    return engine.transport == "batch" and not callable(getattr(engine, "parts", None))


def input_key(request: Request) -> tuple[Any, ...]:
    """What makes two records' requests the same: the same record text (so the same rendered input)
    asked as the same attempt."""
    return (request.text, request.retry)


def same_inputs(engine: Engine, requests: list[Request]) -> tuple[list[Request], dict[str, list[str]]]:
    """The requests to generate, one for each distinct input (``input_key``), and for each of them
    the other records asked the very same thing: computed once, their outcome is held under each
    record id (``Shard.shared``). All of ``requests`` where ``engine`` does not compute once."""
    if not computes_once(engine):
        return requests, {}
    first: dict[tuple[Any, ...], str] = {}
    same: dict[str, list[str]] = {}
    todo = []
    for r in requests:
        rid = first.setdefault(input_key(r), r.record_id)
        if rid == r.record_id:
            todo.append(r)
        else:
            same.setdefault(rid, []).append(r.record_id)
    return todo, same


class ShardHost(Protocol):
    """What a shard stream (``gpu_runner.overlap``) may ask of the worker that runs it."""

    owner: str
    stop: threading.Event                 # the preemption notice
    engine: Engine | None
    spec: JobSpec | None
    stats: dict[str, int]

    def claim_next(self) -> Lease | None:
        """One more shard, or None (nothing claimable, a preemption notice, or ``max_shards`` reached)."""

    def open_shard(self, lease: Lease) -> tuple[Shard, dict[str, str]]:
        """Hold the claimed shard; unless it is careful, begin it in the engine and read its records
        still to do (id -> text, in id order)."""

    def take(self, shard: Shard, outcome: Outcome) -> None:
        """Check one outcome and hold it for the shard's next write."""

    def write(self, shard: Shard) -> list[str]:
        """Write what the shard holds; the ids that failed and may be retried. Stale: StaleLease."""

    def drop(self, shard: Shard, exc: StaleLease) -> None:
        """Our epoch ended: forget what the shard has not written."""

    def finish(self, shard: Shard) -> None:
        """Every record is answered and written: end it in the engine and complete it."""

    def hand_back(self, shard: Shard) -> None:
        """Release the shard (halted, drained or preempted) so it is pending again at once."""

    def let_go(self, shard: Shard) -> None:
        """The shard is over for this worker (its lease was not given back here)."""

    def give_back(self, shards: list[Shard], exc: Exception) -> typing.NoReturn:
        """The engine raised: give every shard back and stop the worker."""

    def retry_wait(self, shard: Shard, round_no: int, n: int) -> float:
        """Seconds to wait before retry round ``round_no`` of ``n`` failed records."""

    def renewer(self, held: typing.Callable[[], typing.Iterable[Shard]], done: threading.Event,
                name: str) -> threading.Thread:
        """A started thread renewing each lease ``held()`` names until ``done``."""

    def settings(self) -> tuple[float, int, float]:
        """(lease seconds, flush every N outcomes, flush every S seconds)."""
