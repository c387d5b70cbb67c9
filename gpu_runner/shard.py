"""A shard a worker holds (``gpu_runner.worker`` one at a time, ``gpu_runner.overlap`` several)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from batch_inference.ledger import Failure, Lease


@dataclass(eq=False)
class Shard:
    """A shard the worker holds: its lease, its stop signals and the outcomes not yet written."""

    lease: Lease
    halt: threading.Event = field(default_factory=threading.Event)   # stop generating for this shard
    stale: threading.Event = field(default_factory=threading.Event)
    drain: threading.Event = field(default_factory=threading.Event)
    attempts: dict[str, int] = field(default_factory=dict)   # failed attempts counted so far, by record
    progress: Any = None    # the worker's progress line for it (gpu_runner.worker)
    # Outcomes not yet written (Worker._take, Worker._flush).
    ok_ids: list[str] = field(default_factory=list)
    ok_out: list[str] = field(default_factory=list)
    ok_cat: list[str | None] = field(default_factory=list)
    failures: dict[str, Failure] = field(default_factory=dict)
    last_flush: float = field(default_factory=time.monotonic)
    closed: bool = False        # completed, released or dropped: its renewals and outcomes are over

    def due(self, every: int, seconds: float) -> bool:
        return len(self.ok_ids) + len(self.failures) >= every or time.monotonic() - self.last_flush >= seconds
