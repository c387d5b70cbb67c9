"""``openai-batch``: OpenAI's Batch API (Files + Batches) through the official ``openai`` client.

Any server that speaks the Batch API works through ``base_url``. The input
is a JSONL file (purpose ``batch``) of requests to the engine's ``endpoint``,
one per record, ``custom_id`` the record id: chat-completions requests built
like the ``openai`` engine's (``engines.openai.chat_body``: the spec's params,
the output schema as ``response_format``); for ``task: embed`` the engine's
embedding mode (``embed.engines.OpenAIBatchEmbedder``) sends ``/v1/embeddings``
requests instead and reads a vector from each answer. The idempotency key travels in the batch's
``metadata`` (``bi_key``), so a batch created by a holder that died before
confirming it is found again by listing batches.

Results: the output file holds the requests answered 200, the error file the
rest: an HTTP 4xx body (the request's own fault, a failed attempt), a 5xx
body, or no response with ``error.code`` ``batch_expired`` /
``batch_cancelled`` (nothing spent: the record stays pending). After
reconciliation the input, output and error files are deleted (Files API);
the batch object itself cannot be deleted. Usage: the batch's ``usage``
(input and output tokens) where the API reports it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from batch_inference.engines import (STYLES, TRUNCATED, Request, chat_body, error_text, extra_body_option, one_line,
                                     parse_chat_completion, response_format)
from batch_inference.exceptions import InvalidValue
from batch_inference.hosted.core import (
    CANCELED, CLOCK_SKEW_S, ERRORED, EXPIRED, SUCCEEDED, TRANSPORT, BatchStatus, HostedBatchEngine, HostedBatchError,
    Item, Provider, jsonl_objects,
)
from batch_inference.spec import ENGINE_RESULT_OPTIONS

ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
KEY_FIELD = "bi_key"
LIST_PAGE = 100


class OpenAIBatches(Provider):
    name = "openai"

    def connect(self) -> None:
        import openai

        e = self.engine
        key, base_url = e.credentials()
        self.client = openai.OpenAI(api_key=key or "unused", base_url=base_url, timeout=e.timeout_s,
                                    max_retries=5)
        # batch id -> (input, output, error file ids) of a batch the last poll saw ended: final from
        # then on, so the collection and the clean-up need not read the batch again.
        self._ended_files: dict[str, tuple[str | None, str | None, str | None]] = {}

    def line(self, req: Request) -> dict[str, Any]:
        e = self.engine
        return {"custom_id": req.record_id, "method": "POST", "url": e.batch_endpoint, "body": e.request_body(req)}

    def submit(self, key: str, requests: Sequence[Request]) -> tuple[str, str | None]:
        data = "".join(json.dumps(self.line(r), ensure_ascii=False) + "\n" for r in requests).encode()
        f = self.client.files.create(file=(f"{key}.jsonl", data, "application/jsonl"), purpose="batch")
        b = self.client.with_options(max_retries=0).batches.create(
            input_file_id=f.id, endpoint=self.engine.batch_endpoint, completion_window="24h", metadata={KEY_FIELD: key})
        return b.id, f.id

    def transient(self, exc: BaseException) -> bool:
        import openai

        return isinstance(exc, (openai.APIConnectionError, openai.InternalServerError, openai.RateLimitError))

    def find(self, key: str, custom_ids: Sequence[str], since: float) -> str | None:
        for b in self.client.batches.list(limit=LIST_PAGE):      # newest first
            if (b.metadata or {}).get(KEY_FIELD) == key:
                return b.id
            if b.created_at < since - CLOCK_SKEW_S:
                return None       # older than the intent: the rest are older still
        return None

    def status(self, batch_id: str) -> BatchStatus:
        b = self.client.batches.retrieve(batch_id)
        c = b.request_counts
        total, done, failed = (c.total, c.completed, c.failed) if c else (0, 0, 0)
        ended = b.status in ENDED
        if ended:
            self._ended_files[batch_id] = (b.input_file_id, b.output_file_id, b.error_file_id)
        usage = getattr(b, "usage", None)
        return BatchStatus(
            status=b.status, ended=ended, total=total, processing=0 if ended else max(0, total - done - failed),
            succeeded=done, errored=failed,
            input_tokens=getattr(usage, "input_tokens", None) if usage else None,
            output_tokens=getattr(usage, "output_tokens", None) if usage else None,
            failed=b.status == "failed")

    def cancel(self, batch_id: str) -> None:
        self.client.batches.cancel(batch_id)

    def _files(self, batch_id: str) -> tuple[str | None, str | None, str | None]:
        files = self._ended_files.get(batch_id)
        if files is None:
            b = self.client.batches.retrieve(batch_id)
            files = (b.input_file_id, b.output_file_id, b.error_file_id)
        return files

    def results(self, batch_id: str) -> Iterator[Item]:
        _, output, error = self._files(batch_id)
        for file_id in (output, error):
            if file_id:
                for line in jsonl_objects(self.client.files.content(file_id).text):
                    yield parse_line(line, self.engine.read_answer)

    def cleanup(self, batch_id: str, input_ref: str | None) -> None:
        input_file, output, error = self._files(batch_id)
        for fid in (input_ref or input_file, output, error):
            if fid:
                self.client.files.delete(fid)
        self._ended_files.pop(batch_id, None)


class _Resp:
    """Just enough of an HTTP response for ``engines.openai.error_text``."""

    def __init__(self, body: Any):
        self.body = body
        self.text = body if isinstance(body, str) else json.dumps(body)

    def json(self) -> Any:
        return self.body


def read_chat_answer(cid: str, body: Any) -> Item:
    """A chat completion answered 200, read as the synchronous engines read one."""
    o = parse_chat_completion(cid, body)
    ok = o.error is None or o.error == TRUNCATED
    return Item(cid, SUCCEEDED if ok else ERRORED, text=o.text, error=o.error, tokens_out=o.tokens_out)


def parse_line(line: dict[str, Any], read: Callable[[str, Any], Item] = read_chat_answer) -> Item:
    """One line of a Batch API output or error file; ``read`` reads the body of a request answered 200."""
    cid = str(line.get("custom_id"))
    resp = line.get("response")
    err = line.get("error")
    if not resp:
        code = (err or {}).get("code") or ""
        kind = EXPIRED if code == "batch_expired" else CANCELED if code == "batch_cancelled" else TRANSPORT
        return Item(cid, kind, error=one_line(f"{code}: {(err or {}).get('message', '')}", 300))
    status = int(resp.get("status_code") or 0)
    body = resp.get("body") or {}
    if status == 200:
        return read(cid, body)
    reason = f"HTTP {status}: {one_line(error_text(_Resp(body)), 300)}"
    if status >= 500 or status in (408, 429):
        return Item(cid, TRANSPORT, error=reason)
    return Item(cid, ERRORED, error=reason)


class OpenAIBatchEngine(HostedBatchEngine):
    name = "openai-batch"
    provider_class = OpenAIBatches
    batch_endpoint = "/v1/chat/completions"   # the Batch API endpoint every request of a batch goes to
    default_base_url = "https://api.openai.com/v1"
    option_names = HostedBatchEngine.common_options | {"response_format_style", "extra_body"}
    result_options = frozenset(ENGINE_RESULT_OPTIONS["openai-batch"])

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        style = str(self.option("response_format_style", "json_schema"))
        if style not in STYLES:
            raise InvalidValue(f"engine 'openai-batch': response_format_style must be one of {', '.join(STYLES)}")
        self.response_format = response_format(style, spec.output_schema)
        self.extra_body = extra_body_option("openai-batch", self.option("extra_body", {}))

    def request_body(self, req: Request) -> dict[str, Any]:
        """One batch line's body."""
        return chat_body(self.spec, self.model, req.messages, self.response_format, self.extra_body)

    def read_answer(self, cid: str, body: Any) -> Item:
        """The body of a request the provider answered 200."""
        return read_chat_answer(cid, body)


__all__ = ["HostedBatchError", "OpenAIBatchEngine", "OpenAIBatches", "parse_line", "read_chat_answer"]
