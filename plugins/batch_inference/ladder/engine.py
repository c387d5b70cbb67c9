"""The ladder engine: the spec's ``models:`` run as one engine behind the worker.

The worker loads it as it loads any engine (the spec's engine is ``ladder``)
and gets one outcome per record, the record's final answer; everything around
it is the worker's as for a one-model job: the lease and its renewal, the
epoch fence, careful mode, failed attempts and dead letters, the results'
put-if-absent, the preemption notice and the cutoff's drain.

Inside one ``generate`` call the batch goes up the ladder: every record to
rung 1; each answer is checked (``rungs.check``), given its confidence, and
kept or escalated (``rungs.keeps``); the escalated records go to rung 2, and
so on. Before a rung's answers reach the worker they are written to
bi.ladder_answers under the lease (``audit.put``): the escalated ones for
audit, the kept one as the answer the worker then stores. A record a worker
meets again (its shard was taken over, or its top-rung answer failed and is
retried) starts from what is stored: a stored final answer is handed on as it
is, without generating, and escalated rungs are not asked again. So the
answer in bi.results is the one bi.ladder_answers names as final, and a
record's final answer is made once whichever worker stores it.

Failed attempts count only at the top rung: an invalid answer lower down is
an escalation. Every rung engine is constructed, verified against its own
pinned digest (``parts``, ``pinning.verify_weights``) and loaded in this
process; a rung engine that is down (``EndpointUnavailable``) stops the shard
as it stops a one-model worker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from batch_inference.engines import load_engine
from batch_inference.engines.base import Engine, Outcome, Request
from batch_inference.exceptions import InvalidValue
from batch_inference.ladder import audit, rungs
from batch_inference.ladder.audit import WRITE_EVERY, WRITE_SECONDS
from batch_inference.ladder.rungs import Answer
from batch_inference.spec import JobSpec


class _Rung:
    def __init__(self, no: int, spec: JobSpec, rung_spec: JobSpec, engine: Engine, samples: int):
        self.no, self.spec, self.engine, self.samples = no, rung_spec, engine, samples
        # The agreement rule's samples: the rung's spec with the seed moved, one per sample.
        self.sample_specs = [rung_spec] + [rungs.rung_spec(spec, spec.models[no - 1], i) for i in range(1, samples)]


class LadderEngine(Engine):
    name = "ladder"
    option_names = frozenset()

    def __init__(self, spec: JobSpec, options: dict[str, Any] | None = None):
        super().__init__(spec, options)
        ladder = rungs.rungs_of(spec)
        if not ladder:
            raise InvalidValue("engine 'ladder' needs a spec with models: (the rungs, cheapest first)")
        self.rungs: list[_Rung] = []
        for no, rung in enumerate(ladder, 1):
            rspec = rungs.rung_spec(spec, rung)
            engine = load_engine(rung.engine.name, rspec, rung.engine.options)
            below_top = no < len(ladder)
            if below_top and spec.ladder.confidence == "logprobs":
                if not engine.gives_logprobs:
                    raise InvalidValue(f"models[{no}] ({rung.model.name}): engine {rung.engine.name!r} gives no "
                                       "token log-probabilities, which ladder.confidence 'logprobs' needs")
                engine.want_logprobs = True
            self.rungs.append(_Rung(no, spec, rspec, engine, rungs.samples(spec, no)))
        self._ledger: Any = None
        self._lease: Any = None
        self.asked = [0] * len(self.rungs)   # answers asked of each rung (samples count one each)

    def parts(self) -> list[Engine]:
        """The rung engines, cheapest first: each is verified against its own pinned digest."""
        return [r.engine for r in self.rungs]

    def load(self) -> None:
        for r in self.rungs:
            r.engine.load()

    def begin_shard(self, ledger: Any, lease: Any, drain: threading.Event) -> None:
        self._ledger, self._lease = ledger, lease
        for r in self.rungs:
            r.engine.begin_shard(ledger, lease, drain)

    def end_shard(self, lease: Any) -> None:
        for r in self.rungs:
            r.engine.end_shard(lease)

    def close(self) -> None:
        for r in self.rungs:
            r.engine.close()

    # -- one batch up the ladder ------------------------------------------
    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        by_id = {r.record_id: r for r in requests}
        held = self._ledger is not None and self._lease is not None
        stored = audit.stored(self._ledger, self._lease, list(by_id)) if held else {}
        pending = list(by_id)
        for rung in self.rungs:
            if not pending or stop.is_set():
                return
            going_on: list[str] = []
            fresh: list[str] = []
            for rid in pending:
                before = stored.get(rid, {}).get(rung.no)
                if before is None:
                    fresh.append(rid)
                elif before.escalated:
                    going_on.append(rid)
                else:
                    yield Outcome(rid, before.output)   # the final answer an earlier holder made
            buffered: list[tuple[Answer, bool]] = []
            last = time.monotonic()
            for answer in self.answers(rung.no, [by_id[rid] for rid in fresh], stop):
                buffered.append((answer, not rungs.keeps(self.spec, rung.no, answer)))
                if len(buffered) >= WRITE_EVERY or time.monotonic() - last >= WRITE_SECONDS:
                    yield from self._hand_on(rung, buffered, going_on)
                    buffered, last = [], time.monotonic()
            yield from self._hand_on(rung, buffered, going_on)
            pending = going_on

    def _hand_on(self, rung: _Rung, answers: list[tuple[Answer, bool]], going_on: list[str]) -> Iterator[Outcome]:
        """Write a rung's answers (not the top rung's invalid ones: those are failed attempts, kept
        by the worker with their raw output), then yield the kept ones and note the escalated ones."""
        top = rung.no == len(self.rungs)
        rows = [(rung.no, a, up) for a, up in answers if not (top and not a.valid)]
        if self._ledger is not None and self._lease is not None:
            audit.put(self._ledger, self._lease, rows)
        for a, up in answers:
            if up and not top:
                going_on.append(a.record_id)
            elif a.valid:
                yield Outcome(a.record_id, a.text, tokens_out=a.tokens_out)
            else:
                yield Outcome(a.record_id, a.text, error=a.error or "not valid", tokens_out=a.tokens_out)

    def answers(self, rung_no: int, requests: Sequence[Request], stop: threading.Event) -> Iterator[Answer]:
        """Rung ``rung_no``'s (1-based) answer to each request it got to before ``stop``: one
        generation, or ``samples`` of them compared (the agreement rule). Writes nothing."""
        rung = self.rungs[rung_no - 1]
        if not requests:
            return
        engine = rung.engine
        if rung.samples == 1:
            for o in engine.generate(requests, stop):
                self.asked[rung.no - 1] += 1
                yield rungs.check(self.spec, o.record_id, o.text, o.error,
                                  rungs.from_logprobs(self.spec, o.text, o.logprobs), o.tokens_out)
            return
        got: dict[str, list[Answer]] = {}
        try:
            for sample_spec in rung.sample_specs:
                engine.spec = sample_spec     # the engine reads its params from its spec at each request
                for o in engine.generate(requests, stop):
                    self.asked[rung.no - 1] += 1
                    got.setdefault(o.record_id, []).append(
                        rungs.check(self.spec, o.record_id, o.text, o.error, None, o.tokens_out))
                if stop.is_set():
                    break
        finally:
            engine.spec = rung.spec
        for req in requests:
            answers = got.get(req.record_id, [])
            if len(answers) == rung.samples:   # a record stopped short of its samples gets no answer now
                yield rungs.agree(self.spec, req.record_id, answers)
