"""The chaos harness: a real job on real worker processes, under injected faults.

``run_chaos(ChaosConfig())`` starts an embedded PostgreSQL of its own (so it
may restart it), snapshots a source table with seeded poison records, and
runs ``workers`` processes of ``python -m gpu_runner`` on the job while it
injects seeded random faults, the ones the design names:

* ``kill``: SIGKILL, a worker dies mid-shard (its lease must expire);
* ``stall``: SIGSTOP held past the lease until another worker has claimed the
  shard, then SIGCONT: the stalled worker comes back with a stale epoch and
  its next ledger call must be refused (a row in ``bi.fence_events``);
* ``term``: SIGTERM, the preemption notice (finish in-flight, release);
* ``db_restart``: ``pg_ctl restart -m fast`` under every worker's feet.

Like a supervisor (Kubernetes, systemd) it restarts any worker that exits
before the job is done. At the end it measures what the design promises:
no duplicate rows, no write accepted from a stale epoch, refusals for every
stalled worker whose shard moved on, full coverage (stored + dead letters =
snapshot), each poison record dead-lettered after exactly ``max_attempts``
(the oversized one at planning), and recomputation within the in-flight
bound (at most one flush buffer lost per change of lease holder).

``job`` picks the job: ``generate`` (the default: one engine answers
each record against the output schema), ``ladder`` (a two-rung model ladder
of noop engines that give token log-probabilities,
``engines.noop.ScoredNoopEngine``: rung 1 is unsure of the share
``unsure_rate`` of records, which go on to rung 2) or ``embed`` (an embedding
job on the noop engine's embedding mode, ``engines.noop.NoopEmbedder``).
A ladder run also checks that each stored result is the one final rung answer
its record has (bi.ladder_answers), that exactly the records rung 1 is unsure
of (and the poison ones) were escalated, and counts a rung answer from a
stale epoch as a stale write; an embed run checks that every stored vector is
whole.

Workers log in with worker credentials (a LOGIN member of ``bi_worker``
granted this job only, sql/schema/roles.sql), so the run also shows the
least-privilege guard holding through restarts.

To count computations the workers run the chosen engine wrapped in
``CountingEngine``, which appends one line per outcome to a per-process file
with unbuffered ``os.write`` (so a SIGKILL loses no line). That is the
only difference from a production worker.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batch_inference import db
from batch_inference.data import NOOP_MODEL, TRIAGE_SCHEMA
from batch_inference.engines.base import Engine, Outcome, Request
from batch_inference.exceptions import InvalidValue
from batch_inference.fleet import Exit, Fleet, Worker
from batch_inference.outputs import check_output, to_storage

# Every worker imports this module for CountingEngine (by dotted path), at each of the run's hundred
# worker starts: the harness (its loopback servers, hosted emulators and numpy) is the run's alone, so
# _spec and run_chaos import it where they run.
if TYPE_CHECKING:
    from batch_inference.harness import Admin, EmbeddedServer

log = logging.getLogger("batch_inference.chaos")

FAULT_KINDS = ("kill", "stall", "term", "db_restart")
JOBS = ("generate", "ladder", "embed")
# The engines a ladder's rungs and an embedding job run (dotted paths into the package: always allowed).
SCORED_NOOP = "batch_inference.engines.noop:ScoredNoopEngine"
NOOP_EMBEDDER = "batch_inference.engines.noop:NoopEmbedder"
LADDER_THRESHOLD = 0.5      # rung 1 keeps an answer of probability SURE, escalates one of UNSURE
EMBED_DIMENSIONS = 16
# The run's loop: it reaps and restarts workers and injects faults every LOOP_S, and reads the job's
# counts (bi.job_counts_v1, a query the server answers) every PROGRESS_S.
LOOP_S = 0.05
PROGRESS_S = 0.25


@dataclass
class ChaosConfig:
    """One chaos run. Defaults: 16 workers and at least 100 faults, sized to
    finish in a few minutes on two cores."""

    workers: int = 16
    records: int | None = None        # default: 200 per requested fault (20,000 for 100)
    shard_size: int = 200
    lease_seconds: int = 3
    renew_seconds: float = 1.0
    seed: int = 0
    duration: float = 480.0           # the job must be done within this many seconds of the first worker
    faults: int = 100                 # at least this many faults are injected (each db restart counts one)
    job: str = "generate"             # generate, ladder (two noop rungs) or embed (see the module docstring)
    unsure_rate: float = 0.3          # ladder: the share of records rung 1 is unsure of (escalated)
    engine: str = "noop"
    engine_options: dict[str, Any] = field(default_factory=lambda: {"delay_s": 0.03})
    db_restart: bool = True
    db_restarts: int = 2              # spread over the run; 0 with db_restart=False
    weights: dict[str, float] = field(default_factory=lambda: {"kill": 0.4, "stall": 0.3, "term": 0.3})
    poison_each: int = 3              # records of each poison kind: engine error, invalid output
    max_attempts: int = 3
    max_input_chars: int = 4000
    flush_every: int = 20
    grace_seconds: float = 2.0
    db_url: str | None = None         # run on this database instead of an embedded server of our own
    restart: Callable[[], None] | None = None   # how to restart db_url's server (None: no db restarts)
    worker_role: bool = True          # workers log in as a LOGIN member of bi_worker
    keep: bool = False                # keep the work directory (worker logs, computation logs)

    def __post_init__(self) -> None:
        """Refuse a run that cannot finish (no workers, no records) or a job the spec would refuse."""
        for name, low in (("workers", 1), ("faults", 0), ("flush_every", 1), ("db_restarts", 0),
                          ("poison_each", 0)):
            if getattr(self, name) < low:
                raise InvalidValue(f"chaos: {name.replace('_', ' ')} must be at least {low}, got {getattr(self, name)}")
        if self.workers > 512:
            raise InvalidValue(f"chaos: at most 512 workers, got {self.workers}")
        if self.records is not None and self.records < 2 * self.poison_each + 2:
            raise InvalidValue(f"chaos: records must be at least {2 * self.poison_each + 2} (the poison records and "
                             f"healthy ones), got {self.records}")
        if not self.duration > 0:
            raise InvalidValue(f"chaos: duration must be positive, got {self.duration}")
        if self.job not in JOBS:
            raise InvalidValue(f"chaos: job must be one of {', '.join(JOBS)}, got {self.job!r}")
        if not 0.0 <= self.unsure_rate <= 1.0:
            raise InvalidValue(f"chaos: unsure rate must be between 0 and 1, got {self.unsure_rate}")
        if self.job != "generate" and self.engine != "noop":
            raise InvalidValue(f"chaos: job {self.job!r} runs on the noop engine's "
                               f"{'scored rungs' if self.job == 'ladder' else 'embedding mode'}, not engine "
                               f"{self.engine!r}")
        # The job's own limits (shard size, lease, renewal), checked the one way every spec is.
        _spec(self)

    def n_records(self) -> int:
        return self.records if self.records is not None else max(2000, 200 * self.faults)


@dataclass
class Check:
    name: str
    value: Any
    expect: str
    ok: bool


@dataclass
class ChaosReport:
    config: dict[str, Any]
    job_version: str
    figures: dict[str, Any]
    checks: list[Check]
    work_dir: str | None = None

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "job_version": self.job_version, "config": self.config,
                "figures": self.figures, "checks": [asdict(c) for c in self.checks], "work_dir": self.work_dir}

    def table(self) -> str:
        f, c = self.figures, self.config
        faults = f["faults"]
        kinds = ", ".join(f"{k.replace('_', ' ')} {faults['by_kind'].get(k, 0)}" for k in FAULT_KINDS)
        lines = [
            f"chaos run {self.job_version}: {c['workers']} workers, {f['records']:,} records "
            f"({f['poison']} poison), shards of {c['shard_size']}, lease {c['lease_seconds']} s, "
            f"renew {c['renew_seconds']:g} s, seed {c['seed']}",
            f"  wall time {f['wall_s']:.1f} s (job {f['job_s']:.1f} s); {f['workers_started']} worker processes "
            f"started; exits {_fmt_counter(f['worker_exits'])}",
            f"  faults injected {faults['total']}: {kinds}",
            f"  handoffs {f['handoffs']['handoffs']} ({f['handoffs']['after_expiry']} after an expired lease, "
            f"{f['handoffs']['after_release']} after a release); refused stale calls "
            f"{f['fenced_total']} ({_fmt_counter(f['fenced_by_op'])})",
            f"  stalls {f['stalls']['injected']}: {f['stalls']['shard_moved_on']} shards moved on while stopped, "
            f"{f['stalls']['refused_after']} of those workers refused on waking",
            f"  computations {f['computations']['valid']:,} valid outcomes for {f['computations']['records']:,} "
            f"healthy records: {f['computations']['extra']} extra, {f['computations']['recomputed_records']} records "
            f"computed more than once (bound: {f['handoffs']['handoffs']} handoffs x "
            f"{f['computations']['per_handoff']} = {f['computations']['bound']})",
            *([f"  {len(f['healthy_dead_for_injected_deaths'])} healthy record(s) dead-lettered by the ledger's "
               f"rule, in flight at {c['max_attempts']} deaths the harness caused: "
               + ", ".join(f["healthy_dead_for_injected_deaths"][:5])]
              if f.get("healthy_dead_for_injected_deaths") else []),
            *([f"  ladder: final answers at rung 1 {f['ladder']['final_by_rung'].get('1', 0):,}, rung 2 "
               f"{f['ladder']['final_by_rung'].get('2', 0):,}; escalated {f['ladder']['escalated']:,} "
               f"(rung 1 unsure of {f['ladder']['unsure_healthy']:,} healthy records)"] if "ladder" in f else []),
            *([f"  embed: {f['embed']['vectors']:,} vectors of {EMBED_DIMENSIONS} dimensions, "
               f"{f['embed']['malformed']} malformed"] if "embed" in f else []),
            *([f"  unexpected worker exits ({f['unexpected_exits_total']}), the first ones:"] +
              [f"    {u['worker']} exited {u['exit']}" + (f" after {u['fault']}" if u["fault"] else "")
               + (f": {u['log_tail'][-1][:120]}" if u["log_tail"] else "") for u in f["unexpected_exits"]]
              if f["unexpected_exits"] else []),
            "",
            f"  {'check':<44}{'value':>14}  {'expect':<22}",
        ]
        for ch in self.checks:
            lines.append(f"  {ch.name:<44}{str(ch.value):>14}  {ch.expect:<22}{'ok' if ch.ok else 'FAIL'}")
        lines.append("")
        lines.append("PASSED" if self.passed else "FAILED" + (f" (logs kept in {self.work_dir})" if self.work_dir else ""))
        return "\n".join(lines)


def _fmt_counter(d: dict[Any, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(d.items(), key=lambda kv: str(kv[0]))) or "none"


# -- the engine wrapper that counts computations ------------------------------

class CountingEngine(Engine):
    """Any engine, plus one line per outcome in ``count_dir/<pid>.log``.

    Options: ``inner`` (engine name, default noop), ``count_dir`` (required);
    every other option goes to the inner engine. An embedding job passes on to
    the inner engine's embedding mode (``load_engine`` refuses one without);
    a ladder's rungs are verified and get their shards through it.
    """

    name = "counting"
    option_names = None
    embeds = True

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        opts = dict(self.options)
        inner = str(opts.pop("inner", "noop"))
        count_dir = opts.pop("count_dir", None)
        if not count_dir:
            raise InvalidValue("engine 'counting': option 'count_dir' is required")
        from batch_inference.engines import load_engine

        self.inner = load_engine(inner, spec, opts)
        self._path = Path(count_dir) / f"{os.getpid()}.log"
        self._fd: int | None = None

    def weights_files(self) -> list[Path]:
        return self.inner.weights_files()

    def parts(self) -> list[Engine]:
        """The engine it wraps, verified as itself (a ladder: each rung against its own digest)."""
        return [self.inner]

    def begin_shard(self, ledger: Any, lease: Any, drain: threading.Event) -> None:
        self.inner.begin_shard(ledger, lease, drain)

    def end_shard(self, lease: Any) -> None:
        self.inner.end_shard(lease)

    def load(self) -> None:
        self.inner.load()
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        return self._count(self.inner.generate(requests, stop))

    def queue_depth(self) -> int:
        return self.inner.queue_depth()

    def stream(self, feed: Any, stop: threading.Event) -> Iterator[Outcome]:
        return self._count(self.inner.stream(feed, stop))

    def _count(self, outcomes: Iterator[Outcome]) -> Iterator[Outcome]:
        embed = self.spec.task == "embed"
        for outcome in outcomes:
            if self._fd is not None:
                # The worker's own check, so "valid" means "would be stored".
                ok = (to_storage(self.spec, outcome.vector)[0] is not None if embed else
                      check_output(self.spec, outcome.text or "")[0] is not None)
                kind = "error" if outcome.error else "valid" if ok else "invalid"
                os.write(self._fd, f"{outcome.record_id}\t{kind}\n".encode())
            yield outcome

    def close(self) -> None:
        self.inner.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# -- worker processes -----------------------------------------------------------

@dataclass
class _Stall:
    proc: Worker
    stopped_at: float
    shard: int | None
    epoch: int | None
    resumed_at: float | None = None
    moved_on: bool = False            # another worker claimed the shard while this one was stopped


class _Workers:
    """The run's workers on a ``Fleet``: each with the counting engine and a worker id of its
    own (``chaos-wSS-gG``), its output in ``logs/<id>.log``, restarted like a supervisor would
    whenever it exits before the job is done, backing off a worker that keeps crashing (a
    broken image must not spin)."""

    def __init__(self, cfg: ChaosConfig, job: str, url: str, work: Path):
        self.cfg, self.job = cfg, job
        self.counts = work / "computations"
        self.counts.mkdir(parents=True, exist_ok=True)
        # A session of its own: a Ctrl-C on the harness is not a preemption notice to every worker.
        self.fleet = Fleet(self._argv, {**os.environ, "BATCH_INFERENCE_DB": url}, cfg.workers,
                           name=lambda slot, gen: f"chaos-w{slot:02d}-g{gen}", log=log, echo=False,
                           log_dir=work / "logs", tail_lines=25, done=frozenset(), backoff_s=0.5,
                           backoff_max_s=10.0, new_session=True)
        self.exits: Counter[str] = Counter()
        self.unexpected: list[dict[str, Any]] = []     # the first few, with the end of their logs
        self.unexpected_total = 0
        self.fault: dict[str, str] = {}                 # worker id -> the fault that hit it
        self.protect_until: dict[str, float] = {}       # no new fault before this (a resumed stall
                                                         # must get to its refusal)

    def _argv(self, owner: str) -> list[str]:
        # A ladder's rung options and an embedder's are the spec's (_spec); generate's are run-time ones.
        inner = {"generate": self.cfg.engine, "ladder": "ladder", "embed": NOOP_EMBEDDER}[self.cfg.job]
        opts = {"inner": inner, "count_dir": str(self.counts),
                **(self.cfg.engine_options if self.cfg.job != "ladder" else {})}
        # An idle worker looks for an expired lease once a renewal interval: the production default (5 s)
        # is longer than the run's lease, and a killed holder's shard would lie expired while they slept.
        argv = [self.job, "--engine", "batch_inference.chaos:CountingEngine", "--worker-id", owner,
                "--flush-every", str(self.cfg.flush_every), "--grace-seconds", str(self.cfg.grace_seconds),
                "--poll-seconds", str(self.cfg.renew_seconds)]
        for k, v in opts.items():
            argv += ["--engine-option", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
        return argv

    @property
    def started(self) -> int:
        return self.fleet.started

    def start_all(self) -> None:
        self.fleet.start_all()

    def _count(self, e: Exit) -> None:
        """An exit is expected when it is 0 or what the fleet's last signal to it makes a worker
        return; anything else (a traceback's 1, 2 after exhausting its database retries) is a
        worker bug the faults uncovered."""
        self.exits[e.label] += 1
        if not e.expected:
            self.unexpected_total += 1
            if len(self.unexpected) < 5:
                self.unexpected.append({"worker": e.worker.name, "exit": e.label,
                                        "fault": self.fault.get(e.worker.name), "log_tail": list(e.worker.tail)})

    def reap(self, restart: bool) -> None:
        """Count the exits since the last call; restart the workers that are due."""
        self.fleet.poll(restart=restart, on_exit=self._count)

    def alive(self) -> list[Worker]:
        return self.fleet.alive()

    def targets(self, now: float) -> list[Worker]:
        """Workers a new fault may hit: running, not stopped, not already hit."""
        return [w for w in self.alive() if not w.stopped and w.name not in self.fault
                and now >= self.protect_until.get(w.name, 0.0)]

    def signal(self, w: Worker, sig: int) -> bool:
        return self.fleet.signal(w, sig)

    def shutdown(self, grace: float) -> None:
        """The end of the run: SIGTERM to every worker, SIGKILL after the grace (neither counts
        as a worker failure)."""
        for e in self.fleet.stop(grace + 5):
            self._count(e)

    def computations(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for path in self.counts.glob("*.log"):
            for line in path.read_text().splitlines():
                rid, _, kind = line.partition("\t")
                if kind:
                    out.append((rid, kind))
        return out


# -- the run ------------------------------------------------------------------------

def _spec(cfg: ChaosConfig):
    from batch_inference.harness import SOURCE
    from batch_inference.spec import parse_spec

    d: dict[str, Any] = {
        "dataset": "chaos",
        "source": dict(SOURCE),
        "model": dict(NOOP_MODEL),
        "engine": {"name": "noop"},
        "prompt": {"version": "chaos-v1", "system": "Classify the support ticket and summarize it in one sentence."},
        "params": {"temperature": 0, "max_tokens": 64},
        "output_schema": TRIAGE_SCHEMA,
        "shard_size": cfg.shard_size,
        "max_attempts": cfg.max_attempts,
        "max_input_chars": cfg.max_input_chars,
        "lease_seconds": cfg.lease_seconds,
        "renew_seconds": cfg.renew_seconds,
    }
    if cfg.job == "ladder":
        params = d["params"]

        def rung(options: dict[str, Any], price: float, threshold: float | None) -> dict[str, Any]:
            return {"model": dict(NOOP_MODEL), "engine": {"name": SCORED_NOOP, "options": options},
                    "params": params, "cost_per_row": price, "threshold": threshold}

        for key in ("model", "engine", "params"):
            del d[key]
        d["models"] = [rung({**cfg.engine_options, "unsure_rate": cfg.unsure_rate}, 0.0004, LADDER_THRESHOLD),
                       rung(dict(cfg.engine_options), 0.004, None)]
        d["ladder"] = {"confidence": "logprobs"}
    elif cfg.job == "embed":
        del d["output_schema"], d["params"]
        d.update(task="embed", engine={"name": NOOP_EMBEDDER, "options": dict(cfg.engine_options)},
                 prompt={"version": "chaos-v1", "template": "{text}"},
                 embedding={"dimensions": EMBED_DIMENSIONS})
    return parse_spec(d)


class _Run:
    def __init__(self, cfg: ChaosConfig, rng: random.Random, admin: Admin, fleet: _Workers,
                 restart: Callable[[], None] | None, job: str):
        self.cfg, self.rng, self.admin, self.fleet, self.restart, self.job = cfg, rng, admin, fleet, restart, job
        self.faults: Counter[str] = Counter()
        self.stalls: list[_Stall] = []
        self.deaths: set[str] = set()       # workers it killed or stopped: to their ledger, deaths
        self.injected = 0
        n_restarts = cfg.db_restarts if (cfg.db_restart and restart is not None) else 0
        # db restarts at evenly spaced places in the fault sequence
        self.restart_at = {round((k + 1) * cfg.faults / (n_restarts + 1)) for k in range(n_restarts)}
        self.timed_out = False
        self.t_first_result: float | None = None
        self.stored_at_first = 0

    # -- pacing --------------------------------------------------------------
    def _interval(self, now: float, progress: dict[str, Any]) -> float:
        """Spread the faults still due over about half of the job's remaining
        time, so all are injected while there is still work to hit."""
        left = self.cfg.faults - self.injected
        if left <= 0:
            return float("inf")
        done = progress["stored"] + progress["dead_letters"]
        if self.t_first_result is None or now - self.t_first_result < 1 or done <= self.stored_at_first:
            delay = float(self.cfg.engine_options.get("delay_s", 0.01) or 0.01)
            remaining = progress["outstanding"] * delay / max(self.cfg.workers, 1)
        else:
            rate = (done - self.stored_at_first) / (now - self.t_first_result)
            remaining = progress["outstanding"] / rate
        base = min(max(0.5 * remaining / left, 0.05), 3.0)
        return base * self.rng.uniform(0.5, 1.5)

    # -- faults --------------------------------------------------------------
    def _holders(self) -> dict[str, tuple[int, int]]:
        return {r["lease_owner"]: (r["shard_no"], r["epoch"])
                for r in self.admin.rows("chaos_lease_holders", {"job": self.job}) if r["lease_owner"]}

    def _inject(self, now: float) -> None:
        if self.injected in self.restart_at:
            self._db_restart()
            return
        targets = self.fleet.targets(now)
        if not targets:
            return
        holders = self._holders()
        holding = [p for p in targets if p.name in holders]
        weights = dict(self.cfg.weights)
        # A stall needs a lease holder to be interesting, and a quarter of
        # the fleet stopped at once is enough.
        if not holding or sum(1 for s in self.stalls if s.resumed_at is None) >= max(1, self.cfg.workers // 4):
            weights.pop("stall", None)
        if not any(weights.values()):
            return
        kinds = list(weights)
        kind = self.rng.choices(kinds, weights=[weights[k] for k in kinds])[0]
        # Faults hit lease holders when there are any: a fault on an idle
        # worker tests nothing the others do not.
        p = self.rng.choice(holding or targets)
        if kind == "kill":
            ok = self.fleet.signal(p, signal.SIGKILL)
        elif kind == "term":
            ok = self.fleet.signal(p, signal.SIGTERM)
        else:
            ok = self.fleet.signal(p, signal.SIGSTOP)
            if ok:
                # What it holds now: a stopped process can no longer change it.
                held = self._holders().get(p.name)
                self.stalls.append(_Stall(p, now, held[0] if held else None, held[1] if held else None))
        if ok:
            if kind != "term":
                self.deaths.add(p.name)
            self.fleet.fault[p.name] = kind
            self.faults[kind] += 1
            self.injected += 1
            log.debug("fault %d: %s %s", self.injected, kind, p.name)

    def _db_restart(self) -> None:
        assert self.restart is not None
        t0 = time.monotonic()
        self.restart()
        self.faults["db_restart"] += 1
        self.injected += 1
        log.info("chaos: database restarted in %.1fs", time.monotonic() - t0)

    def _service_stalls(self, now: float, finishing: bool = False) -> None:
        """Resume a stalled worker once its shard has moved on (or it waited long enough)."""
        lease = self.cfg.lease_seconds
        for st in self.stalls:
            if st.resumed_at is not None:
                continue
            held_for = now - st.stopped_at
            if held_for < lease + 0.5 and not finishing:
                continue
            if st.shard is not None:
                row = self.admin.one("chaos_shard_epoch", {"job": self.job, "shard": st.shard})
                st.moved_on = bool(row and row["epoch"] > st.epoch)
            # The lease has expired; wait for a claim by another worker (one
            # finishing its shard, or an idle one polling) before resuming.
            if st.moved_on or st.shard is None or held_for > lease + 12 or finishing:
                self.fleet.signal(st.proc, signal.SIGCONT)
                self.fleet.fault.pop(st.proc.name, None)      # it may be hit again later...
                self.fleet.protect_until[st.proc.name] = now + 2 * self.cfg.renew_seconds + 2   # ...once refused
                st.resumed_at = now

    # -- the loop ------------------------------------------------------------
    def loop(self) -> float:
        cfg = self.cfg
        t0 = time.monotonic()
        self.fleet.start_all()
        deadline = t0 + cfg.duration
        next_fault = float("inf")
        next_progress = t0
        while True:
            now = time.monotonic()
            if now >= next_progress:
                progress = self.admin.one("job_counts", {"job": self.job})
                assert progress is not None
                next_progress = now + PROGRESS_S
                if progress["outstanding"] == 0 and progress["shards_pending"] == 0 \
                        and progress["shards_leased"] == 0:
                    break
                if self.t_first_result is None and progress["stored"] > 0:
                    self.t_first_result = now
                    self.stored_at_first = progress["stored"] + progress["dead_letters"]
                    next_fault = now + 0.5
            if now > deadline:
                self.timed_out = True
                break
            self.fleet.reap(restart=True)
            self._service_stalls(now)
            if self.injected < cfg.faults and now >= next_fault:
                self._inject(now)
                next_fault = time.monotonic() + self._interval(time.monotonic(), progress)
            time.sleep(LOOP_S)
        job_s = time.monotonic() - t0
        # Resume anyone still stopped, and wait until each resumed worker whose shard moved on has been
        # refused (its next ledger call), for at most two renewals and a second.
        self._service_stalls(time.monotonic(), finishing=True)
        waiting = [st for st in self.stalls if st.moved_on]
        end = time.monotonic() + 2 * cfg.renew_seconds + 1
        while waiting and time.monotonic() < end:
            waiting = [st for st in waiting if not self._refused(st)]
            if waiting:
                time.sleep(0.1)
        self.fleet.reap(restart=False)
        return job_s

    def _refused(self, st: _Stall) -> bool:
        row = self.admin.one("chaos_fence_for", {"job": self.job, "worker": st.proc.name, "shard": st.shard,
                                                 "epoch": st.epoch})
        return bool(row and row["n"] > 0)


def run_chaos(cfg: ChaosConfig) -> ChaosReport:
    """Run one chaos job end to end; see the module docstring."""
    from batch_inference.harness import Admin, EmbeddedServer, make_source, worker_credentials
    from batch_inference.plan import submit

    t_start = time.monotonic()
    rng = random.Random(cfg.seed)
    work = Path(tempfile.mkdtemp(prefix="bi-chaos-", dir="/tmp"))   # short: a Unix socket lives in it
    server: EmbeddedServer | None = None
    fleet: _Workers | None = None
    admin: Admin | None = None
    keep = cfg.keep
    try:
        if cfg.db_url:
            url, restart = db.usable_url(cfg.db_url), cfg.restart
        else:
            server = EmbeddedServer(work / "pg")
            url, restart = server.url, server.restart
        with db.connect(url) as conn:
            db.migrate(conn)
            conn.execute(db.q("chaos_install"))
            poison = make_source(conn, cfg.n_records(), rng, cfg.poison_each, cfg.max_input_chars)
            manifest = submit(conn, _spec(cfg))
            job = manifest.job_version
            worker_url, role = worker_credentials(conn, url, job) if cfg.worker_role else (url, None)
        admin = Admin(url)
        fleet = _Workers(cfg, job, worker_url, work)
        run = _Run(cfg, rng, admin, fleet, restart, job)
        try:
            job_s = run.loop()
        finally:
            fleet.shutdown(cfg.grace_seconds)
        report = _report(cfg, run, fleet, admin, job, manifest, poison, role, job_s,
                         time.monotonic() - t_start)
        if not report.passed:
            keep = True
        if keep:
            report.work_dir = str(work)
        return report
    except BaseException:
        keep = True
        raise
    finally:
        if fleet is not None:
            fleet.fleet.kill()
        if admin is not None:
            admin.close()
        if server is not None:
            server.stop()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log.warning("chaos: work directory kept: %s", work)


# -- the figures and checks ----------------------------------------------------------

def injected_deaths(q: Callable[..., list[dict[str, Any]]], died: set[str], deaths: set[str],
                    max_attempts: int) -> set[str]:
    """The records of ``died`` (dead-lettered for deaths with them in flight) that the ledger's
    rule dead-lettered for deaths the harness itself caused: every lost lease that charged one a
    death (``chaos.lease_log``) was of a worker it killed or stopped (``deaths``), at least
    ``max_attempts`` of them. A healthy record in flight at three sudden deaths is, to the
    ledger, a record that kills its worker (bi.record_deaths_v1); one charged by a loss the
    harness did not cause is a false death and fails the run."""
    if not died:
        return set()
    owners: dict[str, list[str | None]] = {}
    for r in q("chaos_death_charges", ids=sorted(died)):
        owners.setdefault(r["record_id"], []).append(r["lost_owner"])
    return {rid for rid, who in owners.items() if len(who) >= max_attempts and all(w in deaths for w in who)}


def healthy_dead_check(dead: int, for_deaths: int, noisy_engine: bool) -> Check:
    """Healthy records in dead letters fail the run. An engine told to fail at random
    (``fail_rate``, ``invalid_rate``) may use up a healthy record's failed attempts, so
    those are allowed then; a healthy record dead-lettered for deaths with it in flight
    (``for_deaths`` of ``dead``) fails the run whatever the engine. Neither counts a record
    the ledger's rule dead-lettered for deaths the harness caused (``injected_deaths``)."""
    if noisy_engine:
        return Check("healthy records dead-lettered for deaths", for_deaths, "0", for_deaths == 0)
    return Check("healthy records dead-lettered", dead, "0", dead == 0)


def _report(cfg: ChaosConfig, run: _Run, fleet: _Workers, admin: Admin, job: str, manifest: Any,
            poison: dict[str, str], role: str | None, job_s: float, wall_s: float) -> ChaosReport:
    q = lambda name, **p: admin.rows(name, {"job": job, **p})  # noqa: E731
    cov = q("chaos_coverage")[0]
    stale = q("chaos_stale_writes")[0]
    hand = q("chaos_handoffs")[0]
    drift = q("chaos_counter_drift")[0]["shards"]
    fenced = {r["op"]: int(r["n"]) for r in q("fence_counts")}
    dead = {r["record_id"]: r for r in q("dead_letters")}
    died = {r["record_id"] for r in q("chaos_death_dead_letters")}

    # Stalled workers whose shard moved on must have been refused afterwards.
    moved = [s for s in run.stalls if s.moved_on]
    refused = sum(1 for s in moved
                  if q("chaos_fence_for", worker=s.proc.name, shard=s.shard, epoch=s.epoch)[0]["n"] > 0)

    # Computations: valid answers per healthy record, and engine calls per poison record.
    comp = fleet.computations()
    valid = Counter(rid for rid, kind in comp if kind == "valid" and rid not in poison)
    calls = Counter(rid for rid, _ in comp if rid in poison)
    extra = sum(n - 1 for n in valid.values())
    recomputed = sum(1 for n in valid.values() if n > 1)
    # Each change of holder loses at most what the old holder had computed
    # and not yet flushed: one flush buffer (flush_every outcomes). A ladder
    # hands on again the final answers it had written to bi.ladder_answers
    # and not yet to bi.results: at most one more batch of rung answers.
    from batch_inference.ladder import WRITE_EVERY

    per_handoff = cfg.flush_every + (WRITE_EVERY if cfg.job == "ladder" else 0)
    bound = int(hand["handoffs"]) * per_handoff

    noisy_engine = any(float(cfg.engine_options.get(k, 0) or 0) > 0 for k in ("fail_rate", "invalid_rate"))
    poison_ok = []
    for rid, kind in sorted(poison.items()):
        d = dead.get(rid)
        if kind == "oversized":
            ok = bool(d and d["stage"] == "plan" and d["attempts"] == 0) and calls[rid] == 0
        else:
            ok = bool(d and d["stage"] == "worker" and d["attempts"] == cfg.max_attempts) \
                and calls[rid] >= cfg.max_attempts
        poison_ok.append(ok)
    by_rule = injected_deaths(q, died - set(poison), run.deaths, cfg.max_attempts)
    healthy_dead = sorted(set(dead) - set(poison) - by_rule)
    healthy_died = sorted(died - set(poison) - by_rule)

    faults = {"total": run.injected, "by_kind": dict(run.faults)}
    figures = {
        "records": manifest.records, "poison": len(poison), "shards": manifest.shards,
        "wall_s": round(wall_s, 1), "job_s": round(job_s, 1),
        "faults": faults,
        "stalls": {"injected": len(run.stalls), "shard_moved_on": len(moved), "refused_after": refused},
        "workers_started": fleet.started, "worker_exits": dict(fleet.exits),
        "unexpected_exits": fleet.unexpected, "unexpected_exits_total": fleet.unexpected_total,
        "worker_role": role,
        "duplicates": int(cov["duplicates"]),
        "stale_writes_accepted": {"never_held": int(stale["never_held"]),
                                  "after_epoch_ended": int(stale["after_epoch_ended"])},
        "fenced_by_op": fenced, "fenced_total": sum(fenced.values()),
        "coverage": {k: int(v) for k, v in cov.items()},
        "counter_drift_shards": int(drift),
        "handoffs": {k: int(v) for k, v in hand.items()},
        "computations": {"valid": sum(valid.values()), "records": len(valid), "extra": extra,
                         "recomputed_records": recomputed, "bound": bound, "per_handoff": per_handoff,
                         "poison_engine_calls": {rid: calls[rid] for rid in sorted(poison)}},
        "poison_dead_letters": {rid: {"kind": poison[rid], "stage": dead[rid]["stage"] if rid in dead else None,
                                      "attempts": dead[rid]["attempts"] if rid in dead else None}
                                for rid in sorted(poison)},
        "healthy_dead_letters": len(healthy_dead),
        "healthy_dead_letters_for_deaths": len(healthy_died),
        "healthy_dead_letter_ids": healthy_dead[:20],
        "healthy_dead_for_injected_deaths": sorted(by_rule),
    }
    covered = cov["stored"] + cov["dead"] - cov["stored_and_dead"]
    pct = 100.0 * covered / cov["snapshot"] if cov["snapshot"] else 0.0
    stale_total = int(stale["never_held"]) + int(stale["after_epoch_ended"])
    checks = [
        Check("job finished (all shards done)", "yes" if not run.timed_out else "no",
              f"within {cfg.duration:g} s", not run.timed_out),
        Check("faults injected", run.injected, f">= {cfg.faults}", run.injected >= cfg.faults),
        Check("duplicate result rows", int(cov["duplicates"]), "0", cov["duplicates"] == 0),
        Check("stale-epoch writes accepted", stale_total, "0", stale_total == 0),
        Check("stale-epoch calls refused (fence events)", sum(fenced.values()),
              "> 0" if moved else ">= 0", sum(fenced.values()) > 0 or not moved),
        Check("stalled workers refused after resuming", f"{refused}/{len(moved)}", "all", refused == len(moved)),
        Check("coverage: stored + dead letters = snapshot", f"{pct:.2f}%", "100%",
              cov["missing"] == 0 and cov["stored_and_dead"] == 0 and covered == cov["snapshot"]),
        Check("ledger counters match the rows", f"{drift} shards off", "0 shards off", drift == 0),
        Check("poison dead-lettered as designed", f"{sum(poison_ok)}/{len(poison)}", "all", all(poison_ok)),
        healthy_dead_check(len(healthy_dead), len(healthy_died), noisy_engine),
        Check("extra computations (in-flight loss)", extra, f"<= {bound}", extra <= bound),
        # A worker ends with 0, 143 (notice) or a signal the harness sent;
        # anything else (a traceback's 1, 2 after exhausting its database
        # retries) is a worker bug the faults uncovered.
        Check("workers that crashed on their own", fleet.unexpected_total, "0", fleet.unexpected_total == 0),
    ]
    if cfg.job == "ladder":
        figures["ladder"], more = _ladder_checks(cfg, q, poison, set(dead))
        checks += more
    elif cfg.job == "embed":
        vec = q("chaos_embed_vectors", dims=EMBED_DIMENSIONS)[0]
        figures["embed"] = {"vectors": int(vec["vectors"]), "malformed": int(vec["malformed"])}
        checks.append(Check("stored vectors whole (4 bytes a dimension)", int(vec["malformed"]), "0",
                            vec["malformed"] == 0 and vec["vectors"] == cov["stored"]))
    # Not asdict: it deep-copies every field, the restart callable too (a
    # bound method of a server object, which does not copy).
    config = {f.name: copy.deepcopy(getattr(cfg, f.name)) for f in fields(cfg) if f.name != "restart"}
    if cfg.db_url:
        config["db_url"] = db.redact(cfg.db_url)
    config["records"] = cfg.n_records()
    return ChaosReport(config, job, figures, checks)


def _ladder_checks(cfg: ChaosConfig, q: Callable[..., list[dict[str, Any]]], poison: dict[str, str],
                   dead: set[str]) -> tuple[dict[str, Any], list[Check]]:
    """A ladder run's own figures and checks: one final answer per stored record, the very one
    stored; escalated exactly the records rung 1 is unsure of (and the poison ones, which fail
    there). A rung answer from a stale epoch counts in the run's stale writes (chaos_stale_writes)."""
    from batch_inference.engines.noop import is_unsure

    fin = q("chaos_ladder_finals")[0]
    finals = {r["record_id"]: int(r["rung"]) for r in q("chaos_ladder_final_rungs")}
    rungs = {int(r["rung"]): r for r in q("ladder_rung_counts")}
    healthy = [rid for rid in finals if rid not in poison]
    unsure = {rid for rid in healthy if is_unsure(rid, cfg.unsure_rate)}
    wrong_rung = sum(1 for rid in healthy if finals[rid] != (2 if rid in unsure else 1))
    # Poison records fail at rung 1 too (an error or an invalid answer): each is escalated once.
    tried = {rid for rid, kind in poison.items() if kind != "oversized"}
    escalated = int(rungs[1]["answered"] - rungs[1]["kept"]) if 1 in rungs else 0
    want_escalated = len(unsure) + len(tried)
    figures = {"final_by_rung": {str(k): int(r["kept"]) for k, r in rungs.items()},
               "answered_by_rung": {str(k): int(r["answered"]) for k, r in rungs.items()},
               "escalated": escalated, "unsure_healthy": len(unsure),
               "results_without_final": int(fin["results_without_final"]),
               "results_not_final": int(fin["results_not_final"]),
               "finals_not_stored": int(fin["finals_not_stored"]),
               "records_at_wrong_rung": wrong_rung}
    stored_once = fin["results_without_final"] == 0 and fin["results_not_final"] == 0 \
        and fin["finals_not_stored"] == 0 and fin["several_finals"] == 0
    checks = [
        Check("each result is its one final rung answer",
              f"{int(fin['results_without_final']) + int(fin['results_not_final']) + int(fin['finals_not_stored'])}"
              " off", "0 off", bool(stored_once)),
        Check("escalated: rung 1's unsure + poison", escalated, f"{want_escalated}",
              escalated == want_escalated and wrong_rung == 0),
    ]
    return figures, checks
