"""``anthropic-batch``: Anthropic's Message Batches through the official ``anthropic`` client.

Each record is one request: ``custom_id`` (the record id when it fits the
API's ``[A-Za-z0-9_-]{1,64}``, else ``r`` and 40 hex digits of its sha256),
``params`` with the job's system turn as ``system``, the record's user turn,
``max_tokens`` from the spec and the output schema as
``output_config.format`` (``json_schema``). The API keeps no metadata on a
batch, so the idempotency key of an unconfirmed intent is matched on a
listing: batches created since the intent with as many requests, and, where
the batch has ended, exactly the intent's set of custom_ids (the shards
partition the records, so that set names one shard's batch). Two in-flight
candidates that cannot be told apart yet are an error, never a second create.

The API reports ``succeeded`` only once the whole batch has ended (until then
every request counts as ``processing``), so the cutoff's hosted term for an
Anthropic batch is zero while it runs: the cutoff is the conservative one.
Results: ``succeeded`` (text; ``stop_reason`` ``max_tokens`` is a truncation),
``errored`` (an ``invalid_request_error`` is the request's fault, a failed
attempt; any other error type spends nothing), ``canceled`` and ``expired``
(nothing spent). After reconciliation the batch is deleted (its results go
with it). Usage comes from each result's message.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

from batch_inference.engines import TRUNCATED, Request
from batch_inference.hosted.core import (
    CANCELED, CLOCK_SKEW_S, ERRORED, EXPIRED, SUCCEEDED, TRANSPORT, BatchStatus, HostedBatchEngine, HostedBatchError,
    Item, Provider,
)
from batch_inference.spec import ENGINE_RESULT_OPTIONS

_CUSTOM_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
RECORD_FAULTS = frozenset({"invalid_request_error"})
LIST_PAGE = 100


def custom_id(record_id: str) -> str:
    return record_id if _CUSTOM_ID.match(record_id) else "r" + hashlib.sha256(record_id.encode()).hexdigest()[:40]


def message_params(spec: Any, messages: list[dict[str, str]], structured: bool = True) -> dict[str, Any]:
    """One record's Messages API fields (here and Anthropic models on Bedrock): ``max_tokens`` from
    the spec, the system turns as ``system``, the other turns, the output schema as
    ``output_config.format`` when ``structured``."""
    body: dict[str, Any] = {"max_tokens": spec.params.max_tokens,
                            "system": "\n\n".join(m["content"] for m in messages if m["role"] == "system"),
                            "messages": [m for m in messages if m["role"] != "system"]}
    if structured:
        body["output_config"] = {"format": {"type": "json_schema", "schema": spec.output_schema}}
    return body


class AnthropicBatches(Provider):
    name = "anthropic"

    def connect(self) -> None:
        import anthropic

        e = self.engine
        key, base_url = e.credentials()
        self.client = anthropic.Anthropic(api_key=key or "unused", base_url=base_url, timeout=e.timeout_s,
                                          max_retries=5)

    def custom_id(self, record_id: str) -> str:
        return custom_id(record_id)

    def request(self, req: Request) -> dict:
        e = self.engine
        return {"custom_id": custom_id(req.record_id),
                "params": {"model": e.model, **message_params(e.spec, req.messages)}}

    def submit(self, key: str, requests: Sequence[Request]) -> tuple[str, str | None]:
        b = self.client.with_options(max_retries=0).messages.batches.create(
            requests=[self.request(r) for r in requests])
        return b.id, None

    def transient(self, exc: BaseException) -> bool:
        import anthropic

        return isinstance(exc, (anthropic.APIConnectionError, anthropic.InternalServerError,
                                anthropic.RateLimitError))

    def find(self, key: str, custom_ids: Sequence[str], since: float) -> str | None:
        want = set(custom_ids)
        after = datetime.fromtimestamp(since - CLOCK_SKEW_S, timezone.utc)
        live: list[str] = []
        for b in self.client.messages.batches.list(limit=LIST_PAGE):
            if b.created_at < after:
                break          # newest first: the rest are older still
            c = b.request_counts
            if c.processing + c.succeeded + c.errored + c.canceled + c.expired != len(want):
                continue
            if b.processing_status == "ended":
                if {r.custom_id for r in self.client.messages.batches.results(b.id)} == want:
                    return b.id
            else:
                live.append(b.id)
        if len(live) > 1:
            raise HostedBatchError(f"{len(live)} in-flight Anthropic batches could be intent {key}; re-attaching "
                                   "once they have ended and their custom_ids can be compared")
        return live[0] if live else None

    def status(self, batch_id: str) -> BatchStatus:
        b = self.client.messages.batches.retrieve(batch_id)
        c = b.request_counts
        total = c.processing + c.succeeded + c.errored + c.canceled + c.expired
        return BatchStatus(status=b.processing_status, ended=b.processing_status == "ended", total=total,
                           processing=c.processing, succeeded=c.succeeded, errored=c.errored,
                           canceled=c.canceled, expired=c.expired)

    def cancel(self, batch_id: str) -> None:
        self.client.messages.batches.cancel(batch_id)

    def results(self, batch_id: str) -> Iterator[Item]:
        for r in self.client.messages.batches.results(batch_id):
            yield parse_result(r)

    def cleanup(self, batch_id: str, input_ref: str | None) -> None:
        self.client.messages.batches.delete(batch_id)


def parse_result(r) -> Item:
    """One line of a Message Batch's results."""
    res = r.result
    if res.type == "succeeded":
        msg = res.message
        text = "".join(getattr(block, "text", "") for block in msg.content if block.type == "text")
        usage = msg.usage
        out = int(getattr(usage, "output_tokens", 0) or 0)
        inp = int(getattr(usage, "input_tokens", 0) or 0)
        return Item(r.custom_id, SUCCEEDED, text=text, error=TRUNCATED if msg.stop_reason == "max_tokens" else None,
                    tokens_out=out, tokens_in=inp)
    if res.type == "errored":
        err = res.error.error
        kind = ERRORED if err.type in RECORD_FAULTS else TRANSPORT
        return Item(r.custom_id, kind, error=f"{err.type}: {err.message}"[:300])
    return Item(r.custom_id, CANCELED if res.type == "canceled" else EXPIRED)


class AnthropicBatchEngine(HostedBatchEngine):
    name = "anthropic-batch"
    provider_class = AnthropicBatches
    default_base_url = "https://api.anthropic.com"
    option_names = HostedBatchEngine.common_options
    result_options = frozenset(ENGINE_RESULT_OPTIONS["anthropic-batch"])
