"""The worker's exit codes: what ``python -m gpu_runner`` returns, and what each means for a task."""

from __future__ import annotations

import signal
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    DB = 2
    DIGEST = 3
    CONFIG = 4
    ENGINE = 5
    ENDPOINT = 6
    PREEMPTED = 143


FATAL = frozenset({ExitCode.DB, ExitCode.DIGEST, ExitCode.CONFIG, ExitCode.ENDPOINT})
HALTING = frozenset({ExitCode.DIGEST, ExitCode.CONFIG})

_MEANING = {
    ExitCode.OK: "nothing left to claim, the job entered fallback mode, or cost.budget pays for no more rows",
    ExitCode.DB: "the ledger database stayed unreachable",
    ExitCode.DIGEST: "the model weights do not match the digest the spec pins (or are missing)",
    ExitCode.CONFIG: "configuration error (unknown job version, engine, option, or a refused endpoint)",
    ExitCode.ENGINE: "the engine crashed; the shard was given back (counted as a lost lease)",
    ExitCode.ENDPOINT: "the engine endpoint is unavailable (most requests failed in transport); shards released, "
                       "records left pending with no attempts spent",
    ExitCode.PREEMPTED: "SIGTERM handled: in-flight records written, lease released",
}


def describe(code: int) -> str:
    """What a worker's exit status means, in words (a negative status: the signal that killed it)."""
    if code in _MEANING:
        return _MEANING[ExitCode(code)]
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"
