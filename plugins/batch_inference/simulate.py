"""Discrete-event simulation of a job on preemptible workers, to size shards.

It models this project's commit strategy, not a generic one:

* every result is committed as it is produced, keyed by (job version,
  record ID) and written put-if-absent, so an interruption loses only the
  records in flight;
* a shard is held under a lease with a fencing epoch; a lease that is not
  renewed expires ``lease_s`` after the worker went silent and the shard is
  claimable again, and a re-leased shard skips the records already stored;
* some interruptions come with a preemption notice, and the worker releases
  its lease at once instead of leaving it to expire;
* a dead worker is replaced, and the replacement loads the model first;
* some interruptions are stalls, not deaths: the worker freezes, comes back
  after its lease expired, and keeps writing until it learns it is fenced.
  If another worker claimed the shard meanwhile, those writes carry a stale
  epoch and are refused: counted as refused, never as rows. If nobody did,
  the epoch is still its own (the ledger guards on the epoch alone) and it
  carries on.

Why a count, not a set, per shard: only the current lease holder's writes
are accepted, and a holder works through the shard's remaining records in
order, so a shard's stored records are always a prefix of it. One integer per
shard is the whole done set, and each event is arithmetic over record counts.
A run over two million records takes milliseconds.

Simplifications, stated so nobody reads more into the figures: interruptions
are independent and exponential (real spot reclaims come in waves), they
strike only while a worker holds a shard, and a lease counts from the moment
the worker went silent (renewals are frequent next to ``lease_s``).
Standard library only.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import partial

from batch_inference.exceptions import InvalidValue

DEFAULT_CANDIDATES = (500, 1_000, 2_000, 5_000, 10_000, 25_000)


@dataclass(frozen=True)
class Scenario:
    """A job and the weather it runs in. Defaults are the design's scaled-down run."""

    records: int = 2_000_000
    workers: int = 20
    rate: float = 18.7  # records/s per worker (capacity.estimate or a measurement)
    interruptions_per_hour: float = 1.0  # per worker, while it holds a shard
    load_s: float = 180.0  # a replacement loads the model before its first claim
    lease_s: float = 600.0
    shard_overhead_s: float = 3.0  # claim, list stored keys, read input, per claim
    stall_fraction: float = 0.2  # of interruptions; the rest are deaths
    stall_extra_s: float = 300.0  # a stalled worker returns this long after its lease expired
    notice_fraction: float = 0.0  # of deaths that release the lease at once (0: the design's run)
    # A fenced worker learns at its first refused flush: gpu_runner flushes
    # every 1,000 results or 2 s, whichever comes first.
    fence_detect_s: float = 2.0
    claim_order: str = "lowest"  # "lowest": lowest claimable shard number (the ledger's order); "fifo"

    def __post_init__(self) -> None:
        if self.records <= 0 or self.workers <= 0 or self.rate <= 0:
            raise InvalidValue("records, workers and rate must be > 0")
        if min(self.interruptions_per_hour, self.load_s, self.lease_s, self.shard_overhead_s,
               self.fence_detect_s) < 0:
            raise InvalidValue("rates and durations must be >= 0")
        for name in ("stall_fraction", "notice_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise InvalidValue(f"{name} must be between 0 and 1")
        if self.stall_extra_s <= 0:
            # By definition a stall outlives its lease; a shorter pause is just a slow worker.
            raise InvalidValue("stall_extra_s must be > 0")
        if self.claim_order not in ("lowest", "fifo"):
            raise InvalidValue("claim_order must be 'lowest' or 'fifo'")

    @property
    def ideal_hours(self) -> float:
        """No interruptions, no overhead: the first model load, then every worker busy."""
        return (self.load_s + self.records / (self.workers * self.rate)) / 3600


@dataclass(frozen=True)
class SimResult:
    shard_size: int
    seed: int
    makespan_h: float  # first model load to the last stored record
    lost_gpu_h: float  # GPU time that stored nothing because of interruptions
    rows: int  # rows written; equals records when every record is stored once
    duplicate_rows: int  # rows written for a key already present: must stay 0
    refused_writes: int  # stale-epoch writes the fence turned away
    claims: int
    interruptions: int
    stalls: int
    fenced: int  # stalls whose shard was claimed by another worker before they came back
    notices: int


@dataclass(frozen=True)
class SizeRow:
    """One candidate shard size, averaged over seeds."""

    shard_size: int
    shards: int
    makespan_h: float
    lost_gpu_h: float
    duplicate_rows: float
    refused_writes: float
    vs_best_h: float = 0.0  # mean per-seed makespan minus the best size's, same seed
    vs_best_se: float = 0.0  # its standard error
    near_best: bool = True  # within two standard errors of the best: as good, as far as we can tell


@dataclass(frozen=True)
class Recommendation:
    best: int
    ideal_h: float
    seeds: int
    rows: list[SizeRow] = field(default_factory=list)

    @property
    def near_best(self) -> tuple[int, ...]:
        """Sizes the runs cannot tell from the best; often a wide, flat valley."""
        return tuple(r.shard_size for r in self.rows if r.near_best)

    @property
    def best_row(self) -> SizeRow:
        return next(r for r in self.rows if r.shard_size == self.best)

    @property
    def overhead(self) -> float:
        """Fraction the best makespan adds over the ideal; capacity.plan_gpus takes it."""
        return self.best_row.makespan_h / self.ideal_h - 1

    def as_dict(self) -> dict:
        return {"best": self.best, "ideal_h": self.ideal_h, "overhead": self.overhead,
                "seeds": self.seeds, "near_best": list(self.near_best),
                "rows": [asdict(r) for r in self.rows]}


# Event kinds. Ties at the same instant resolve by insertion order (seq).
_FREE, _EXPIRE, _RETURN = 0, 1, 2


def simulate(scenario: Scenario, shard_size: int, seed: int = 0) -> SimResult:
    """Run one job to completion; deterministic for a given (scenario, shard_size, seed)."""
    return _Run(scenario, shard_size, seed).result()


class _Run:
    """One simulated job: the shards, the claim queue, the event heap and the tallies."""

    def __init__(self, scenario: Scenario, shard_size: int, seed: int):
        if shard_size <= 0:
            raise InvalidValue("shard_size must be > 0")
        sc = self.sc = scenario
        self.shard_size, self.seed = shard_size, seed
        self.n_shards = -(-sc.records // shard_size)
        self.last_size = sc.records - (self.n_shards - 1) * shard_size
        self.done = [0] * self.n_shards  # stored records: always a prefix of the shard (see module doc)
        self.epoch = [0] * self.n_shards  # +1 per claim, as in the shard table
        self.claimable = [True] * self.n_shards
        self.n_claimable = self.n_shards
        # The queue may hold stale entries (a stalled worker took its own shard
        # back); take() skips any shard that is no longer claimable.
        if sc.claim_order == "lowest":
            queue: list[int] | deque[int] = list(range(self.n_shards))  # sorted, so already a heap
            self.pop, self.add = partial(heapq.heappop, queue), partial(heapq.heappush, queue)
        else:
            queue = deque(range(self.n_shards))
            self.pop, self.add = queue.popleft, queue.append
        self.events: list[tuple[float, int, int, tuple]] = []
        self.seq = 0
        self.stats = dict.fromkeys(("rows", "refused", "claims", "int", "stalls", "fenced", "notices"), 0)
        self.lost_s = 0.0
        self.makespan = 0.0
        self.mean_between = 3600 / sc.interruptions_per_hour if sc.interruptions_per_hour > 0 else math.inf
        # One random stream per worker slot, and interruptions on a clock of busy
        # seconds rather than drawn per claim: a worker meets the same
        # interruptions whatever the shard size, so sizes are compared under the
        # same weather and a few seeds separate them (common random numbers). The
        # exponential is memoryless, so it is the same process as a draw per claim.
        self.rngs = [random.Random(seed * 1_000_003 + w) for w in range(sc.workers)]
        self.clock = [self.next_interruption(w) for w in range(sc.workers)]  # busy seconds to the next one
        self.parked: list[int] = []  # workers waiting for a claimable shard

    def size(self, s: int) -> int:
        return self.last_size if s == self.n_shards - 1 else self.shard_size

    def next_interruption(self, w: int) -> float:
        return self.rngs[w].expovariate(1 / self.mean_between) if self.mean_between < math.inf else math.inf

    def take(self) -> int:
        while True:
            s = self.pop()
            if self.claimable[s]:
                self.claimable[s] = False
                self.n_claimable -= 1
                return s

    def release(self, s: int) -> None:
        self.claimable[s] = True
        self.n_claimable += 1
        self.add(s)

    def push(self, at: float, kind: int, payload: tuple) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def commit(self, s: int, ep: int, first: int, n: int, at: float) -> None:
        """Records [first, first+n) of shard s, written under epoch ep, the last at ``at``.

        The guard is the ledger's: the writer's epoch must be the shard's
        current one, else every write is refused. Then put-if-absent.
        """
        if n <= 0:
            return
        if ep != self.epoch[s]:
            self.stats["refused"] += n
            return
        done = self.done
        present = max(0, min(first + n, done[s]) - first)  # keys already stored are skipped
        if first + present != done[s]:
            raise AssertionError("stored records stopped being a prefix of the shard")
        self.stats["rows"] += n - present
        done[s] += n - present
        self.makespan = max(self.makespan, at)

    def work(self, w: int, s: int, ep: int, t: float, overhead: float) -> None:
        """Worker w holds shard s under epoch ep from time t until done or interrupted."""
        sc, clock = self.sc, self.clock
        first = self.done[s]
        todo = self.size(s) - first
        busy = overhead + todo / sc.rate
        if clock[w] >= busy:
            clock[w] -= busy
            self.commit(s, ep, first, todo, t + busy)
            self.push(t + busy, _FREE, (w,))
            return
        stop = clock[w]
        # Draw both numbers on every interruption, used or not, so changing the
        # stall or notice fraction leaves every interruption time where it was.
        u_stall, u_notice = self.rngs[w].random(), self.rngs[w].random()
        clock[w] = self.next_interruption(w)
        self.stats["int"] += 1
        computing = max(0.0, stop - overhead)
        finished = min(todo, int(computing * sc.rate))
        # Per-record commits: everything finished before the interruption is stored.
        self.commit(s, ep, first, finished, t + overhead + finished / sc.rate)
        self.lost_s += computing - finished / sc.rate  # the records in flight
        gone = t + stop
        if u_stall < sc.stall_fraction:
            self.stats["stalls"] += 1
            expiry = gone + sc.lease_s
            self.push(expiry, _EXPIRE, (s,))
            back = expiry + sc.stall_extra_s
            self.lost_s += back - gone
            self.push(back, _RETURN, (w, s, ep, first + finished, todo - finished))
            return
        if u_notice < sc.notice_fraction:
            self.stats["notices"] += 1
            self.release(s)  # the notice releases the lease now
            if self.parked:
                self.claim(self.parked.pop(), gone)
        else:
            self.push(gone + sc.lease_s, _EXPIRE, (s,))
        self.lost_s += sc.load_s  # the replacement loads the model before it claims
        self.push(gone + sc.load_s, _FREE, (w,))

    def claim(self, w: int, t: float) -> None:
        s = self.take()
        self.epoch[s] += 1
        self.stats["claims"] += 1
        self.work(w, s, self.epoch[s], t, self.sc.shard_overhead_s)

    def come_back(self, t: float, w: int, s: int, ep: int, first: int, remaining: int) -> None:
        """A stalled worker returns to the shard it held."""
        if ep == self.epoch[s]:
            # Nobody claimed it meanwhile: the epoch is still ours, so the
            # ledger accepts the renewal and the worker simply carries on.
            if self.claimable[s]:
                self.claimable[s] = False
                self.n_claimable -= 1
            self.work(w, s, ep, t, 0.0)
            return
        # Fenced. It keeps producing until its next write or renewal comes
        # back refused; what it wrote meanwhile is refused, not stored.
        sc = self.sc
        self.stats["fenced"] += 1
        n = min(remaining, max(1, math.ceil(sc.fence_detect_s * sc.rate)))
        until = t + n / sc.rate
        self.commit(s, ep, first, n, until)
        self.lost_s += n / sc.rate
        self.push(until, _FREE, (w,))

    def result(self) -> SimResult:
        for w in range(self.sc.workers):
            self.push(self.sc.load_s, _FREE, (w,))
        events = self.events
        while events:
            t, _, kind, payload = heapq.heappop(events)
            if kind == _FREE:
                (w,) = payload
                if self.n_claimable:
                    self.claim(w, t)
                else:
                    self.parked.append(w)
            elif kind == _EXPIRE:
                # Claims take expired leases directly, so expiry is a release.
                (s,) = payload
                self.release(s)
                if self.parked:
                    self.claim(self.parked.pop(), t)
            else:  # _RETURN
                self.come_back(t, *payload)

        if any(d != self.size(i) for i, d in enumerate(self.done)):
            raise AssertionError("simulation ended with records unstored")
        stats = self.stats
        return SimResult(
            shard_size=self.shard_size,
            seed=self.seed,
            makespan_h=self.makespan / 3600,
            lost_gpu_h=self.lost_s / 3600,
            rows=stats["rows"],
            duplicate_rows=stats["rows"] - sum(self.done),
            refused_writes=stats["refused"],
            claims=stats["claims"],
            interruptions=stats["int"],
            stalls=stats["stalls"],
            fenced=stats["fenced"],
            notices=stats["notices"],
        )


def recommend_shard_size(
    scenario: Scenario,
    candidates: tuple[int, ...] = DEFAULT_CANDIDATES,
    seeds: int = 5,
) -> Recommendation:
    """The candidate with the lowest mean makespan over ``seeds`` runs, and the table.

    Ties go to the larger shard: fewer rows in the shard table, fewer claims.
    Every size runs on the same seeds, so each is also compared with the best
    seed by seed (paired differences); sizes within two standard errors of it
    are marked ``near_best``.
    """
    if seeds <= 0 or not candidates:
        raise InvalidValue("need at least one seed and one candidate")
    runs = {size: [simulate(scenario, size, seed) for seed in range(seeds)] for size in candidates}

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    makespans = {size: [r.makespan_h for r in rs] for size, rs in runs.items()}
    best = min(candidates, key=lambda size: (round(mean(makespans[size]), 9), -size))
    rows = []
    for size, rs in runs.items():
        diffs = [a - b for a, b in zip(makespans[size], makespans[best])]
        d = mean(diffs)
        se = (sum((x - d) ** 2 for x in diffs) / (seeds - 1) / seeds) ** 0.5 if seeds > 1 else 0.0
        rows.append(SizeRow(
            shard_size=size,
            shards=-(-scenario.records // size),
            makespan_h=mean(makespans[size]),
            lost_gpu_h=mean([r.lost_gpu_h for r in rs]),
            duplicate_rows=mean([r.duplicate_rows for r in rs]),
            refused_writes=mean([r.refused_writes for r in rs]),
            vs_best_h=d,
            vs_best_se=se,
            near_best=d <= 2 * se,
        ))
    return Recommendation(best=best, ideal_h=scenario.ideal_hours, seeds=seeds, rows=rows)
