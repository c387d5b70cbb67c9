"""The worker's exit codes: what ``python -m gpu_runner`` returns, and what each means for a task."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0              # nothing left to claim, or the job entered fallback mode
    DB = 2              # the ledger database stayed unreachable
    DIGEST = 3          # the model weights do not match the digest the spec pins (or are missing)
    CONFIG = 4          # configuration error (unknown job version, engine, option, or a refused endpoint)
    ENGINE = 5          # the engine crashed; the shard was given back
    ENDPOINT = 6        # the engine's endpoint failed most requests in transport; records left pending
    PREEMPTED = 143     # SIGTERM handled: in-flight records written, lease released


FATAL = frozenset({ExitCode.DB, ExitCode.DIGEST, ExitCode.CONFIG, ExitCode.ENDPOINT})
HALTING = frozenset({ExitCode.DIGEST, ExitCode.CONFIG})
