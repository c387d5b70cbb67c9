"""``gemini-batch``: Gemini's Batch API (the Gemini Developer API) through the official ``google-genai`` client.

Each record is one ``GenerateContentRequest``: the job's system turn as
``systemInstruction``, the other turns as ``contents`` (an assistant turn of a
retry's repair is role ``model``), the spec's params in ``generationConfig``
(``temperature``, ``topP``, ``maxOutputTokens``, ``seed``) with the output
schema as ``responseJsonSchema`` and ``responseMimeType`` ``application/json``.
The requests go either as a JSONL file through the Files API (``input: file``,
the default: one line ``{"key": record id, "request": ...}`` each,
``client.files.upload``) or inline in the create call (``input: inline``:
``InlinedRequest`` with ``metadata.key``; the API takes at most 20 MB so).
Any server that speaks the API works through ``base_url``
(``HttpOptions.base_url``).

The batch's ``displayName`` carries the idempotency key, so a batch created
by a holder that died before confirming it is found again by listing
batches. The client makes one try per call (no ``retry_options``): the
create call is never repeated blindly, and a failed poll is retried by
``core``.

States as the client reports them: ``JOB_STATE_PENDING`` and
``JOB_STATE_RUNNING`` run on; ``JOB_STATE_SUCCEEDED``, ``_FAILED``,
``_CANCELLED`` and ``_EXPIRED`` have ended. The client's ``BatchJob`` carries
no request counts for the Gemini Developer API, so while a batch runs the
cutoff's hosted term for it is zero (the conservative side, as for Anthropic).
A job can sit ``PENDING`` past its 24-hour target: the transport says so
once in the log and goes on polling; the cutoff cancels it like any other,
and its rows, never started, go to the fallback.

Results are matched by key: the responses file's lines (``dest.file_name``,
``client.files.download``) or the inline responses' ``metadata.key``. An
ended job of any state gives what it finished (a cancelled or expired job's
finished part was paid for); a request answered with an error whose status is
``INVALID_ARGUMENT`` (code 3, or HTTP 400) is the request's fault, a failed
attempt; any other error (``RESOURCE_EXHAUSTED``, ``INTERNAL``,
``UNAVAILABLE``, ...) spends nothing and leaves the record pending, as a
request the job never reached does. ``finishReason`` ``MAX_TOKENS`` is a
truncation. Usage: each response's ``usageMetadata``. After reconciliation
the input and responses files are deleted and the batch with them.

``schema_refusal`` says what of an output schema Gemini cannot take: the
client's own ``types.JSONSchema`` (what ``responseJsonSchema`` accepts:
``type``, ``properties``, ``required``, ``enum``, ``items``, ``anyOf``,
``oneOf``, ``$ref``/``$defs``, ``additionalProperties``, lengths, ranges,
``pattern``, ``format``, ``title``, ``description``, ``default``) refuses
every other keyword (``const``, ``allOf``, ``not``, ``exclusiveMinimum``,
``multipleOf``, ``prefixItems``, ``patternProperties``, ``if``, ``$schema``,
...); the engine refuses such a spec when it is built, before any request.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

from batch_inference.engines import TRUNCATED, Request, one_line
from batch_inference.exceptions import InvalidValue
from batch_inference.hosted.core import (
    CANCELED, CLOCK_SKEW_S, ERRORED, EXPIRED, SUCCEEDED, TRANSPORT, BatchStatus, HostedBatchEngine, Item, Provider,
    jsonl_objects,
)
from batch_inference.spec import ENGINE_RESULT_OPTIONS

log = logging.getLogger("batch_inference.hosted")

RUNNING = frozenset({"JOB_STATE_PENDING", "JOB_STATE_RUNNING", "JOB_STATE_QUEUED"})
ENDED = frozenset({"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED"})
# A request's own fault (google.rpc codes and their HTTP forms): a failed attempt. Every other error spends nothing.
RECORD_FAULTS = frozenset({"INVALID_ARGUMENT", 3, 400})
INPUTS = ("file", "inline")
WINDOW_S = 86400.0       # the Batch API's target turnaround
LIST_PAGE = 100
ROLES = {"user": "user", "assistant": "model"}


def schema_refusal(schema: dict[str, Any]) -> str | None:
    """What of ``schema`` Gemini's ``responseJsonSchema`` cannot take (the client's ``types.JSONSchema``
    refuses it), as ``path: reason``; None when it can take all of it."""
    import pydantic
    from google.genai import types

    try:
        types.JSONSchema.model_validate(schema)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top)"
        why = "a keyword Gemini does not take" if err["type"] == "extra_forbidden" else err["msg"]
        return f"{where}: {why}"
    return None


def state_name(state: Any) -> str:
    return str(getattr(state, "value", state) or "JOB_STATE_UNSPECIFIED")


def item(key: str, response: dict[str, Any] | None, error: dict[str, Any] | None) -> Item:
    """One result: a ``GenerateContentResponse`` (REST JSON, read through the client's type) or an error status."""
    from google.genai import types

    if response is None:
        err = error or {}
        status, code = err.get("status"), err.get("code")
        kind = ERRORED if status in RECORD_FAULTS or code in RECORD_FAULTS else TRANSPORT
        name = status or STATUS_NAMES.get(code) or "error"
        return Item(key, kind, error=one_line(f"{name} ({code}): {err.get('message', '')}", 300))
    r = types.GenerateContentResponse.model_validate(response)
    cand = (r.candidates or [None])[0]
    parts = (cand.content.parts or []) if cand is not None and cand.content is not None else []
    text = "".join(p.text or "" for p in parts if not p.thought)
    usage = r.usage_metadata
    out = int(usage.candidates_token_count or 0) if usage else 0
    inp = int(usage.prompt_token_count or 0) if usage else 0
    finish = state_name(cand.finish_reason) if cand is not None and cand.finish_reason is not None else ""
    if cand is None or not parts:
        why = one_line(f"no answer (finishReason {finish or 'none'}, blockReason "
                       f"{state_name(r.prompt_feedback.block_reason) if r.prompt_feedback else 'none'})", 300)
        return Item(key, ERRORED, error=why, tokens_in=inp)
    return Item(key, SUCCEEDED, text=text, error=TRUNCATED if finish == "MAX_TOKENS" else None, tokens_out=out,
                tokens_in=inp)


class GeminiBatches(Provider):
    name = "gemini"

    def connect(self) -> None:
        from google import genai
        from google.genai import types

        e = self.engine
        key, base_url = e.credentials()
        self.types = types
        self.client = genai.Client(api_key=key or "unused", http_options=types.HttpOptions(
            base_url=base_url, api_version="v1beta", timeout=int(e.timeout_s * 1000)))
        # batch name -> (its ``dest``, its results) once a poll saw it ended: final from then on
        self._ended: dict[str, tuple[Any, list[Item]]] = {}
        self._late: set[str] = set()      # batches already reported PENDING past the API's target

    # -- requests -------------------------------------------------------------
    def request(self, req: Request) -> dict[str, Any]:
        """One ``GenerateContentRequest`` as REST JSON (a line of the input file)."""
        e, p = self.engine, self.engine.spec.params
        gen: dict[str, Any] = {"temperature": p.temperature, "topP": p.top_p, "maxOutputTokens": p.max_tokens,
                               "responseMimeType": "application/json", "responseJsonSchema": e.spec.output_schema}
        seed = req.seed(p.seed)
        if seed is not None:
            gen["seed"] = seed
        body: dict[str, Any] = {
            "contents": [{"role": ROLES.get(m["role"], "user"), "parts": [{"text": m["content"]}]}
                         for m in req.messages if m["role"] != "system"],
            "generationConfig": gen}
        system = "\n\n".join(m["content"] for m in req.messages if m["role"] == "system")
        if system:
            body["systemInstruction"] = {"parts": [{"text": system}]}
        return body

    def inlined(self, req: Request) -> Any:
        """The same request as the client's ``InlinedRequest`` (``input: inline``)."""
        t = self.types
        body = self.request(req)
        g = body["generationConfig"]
        config = t.GenerateContentConfig(
            system_instruction=body.get("systemInstruction"), temperature=g["temperature"], top_p=g["topP"],
            max_output_tokens=g["maxOutputTokens"], seed=g.get("seed"), response_mime_type=g["responseMimeType"],
            response_json_schema=g["responseJsonSchema"])
        return t.InlinedRequest(contents=body["contents"], metadata={"key": req.record_id}, config=config)

    def submit(self, key: str, requests: Sequence[Request]) -> tuple[str, str | None]:
        e = self.engine
        config = {"display_name": key}
        if e.input == "inline":
            job = self.client.batches.create(model=e.model, src=[self.inlined(r) for r in requests], config=config)
            return str(job.name), None
        data = "".join(json.dumps({"key": r.record_id, "request": self.request(r)}, ensure_ascii=False) + "\n"
                       for r in requests).encode()
        f = self.client.files.upload(file=io.BytesIO(data), config={"display_name": key,
                                                                    "mime_type": "application/jsonl"})
        job = self.client.batches.create(model=e.model, src=str(f.name), config=config)
        return str(job.name), str(f.name)

    def transient(self, exc: BaseException) -> bool:
        from google.genai import errors

        if isinstance(exc, errors.ServerError):
            return True
        if isinstance(exc, errors.ClientError):
            return exc.code in (408, 429)
        return type(exc).__name__ in ("ConnectError", "TimeoutException", "ReadTimeout", "ConnectTimeout",
                                      "RemoteProtocolError", "ReadError", "WriteTimeout", "PoolTimeout")

    def find(self, key: str, custom_ids: Sequence[str], since: float) -> str | None:
        after = datetime.fromtimestamp(since - CLOCK_SKEW_S, timezone.utc)
        for job in self.client.batches.list(config={"page_size": LIST_PAGE}):    # newest first
            if job.display_name == key:
                return str(job.name)
            if job.create_time is not None and job.create_time < after:
                return None
        return None

    # -- the batch --------------------------------------------------------------
    def status(self, batch_id: str) -> BatchStatus:
        job = self.client.batches.get(name=batch_id)
        state = state_name(job.state)
        total = len(self.engine.current_ids)
        if state not in ENDED:
            if state == "JOB_STATE_PENDING" and job.create_time is not None:
                self._pending(batch_id, time.time() - job.create_time.timestamp())
            return BatchStatus(status=state, ended=False, total=total, processing=total)
        items = self._items(batch_id, job.dest)
        kinds = [i.kind for i in items]
        return BatchStatus(
            status=state, ended=True, total=max(total, len(items)), succeeded=kinds.count(SUCCEEDED),
            errored=kinds.count(ERRORED), canceled=max(0, total - len(items)) if state == "JOB_STATE_CANCELLED" else 0,
            expired=max(0, total - len(items)) if state == "JOB_STATE_EXPIRED" else 0,
            input_tokens=sum(i.tokens_in for i in items), output_tokens=sum(i.tokens_out for i in items),
            failed=state == "JOB_STATE_FAILED" and not items)

    def _pending(self, batch_id: str, waited: float) -> None:
        if waited > self.engine.window_s and batch_id not in self._late:
            self._late.add(batch_id)
            log.warning("%s: batch %s still PENDING %.0f s after its creation, past the API's %.0f s target; the "
                        "cutoff cancels it if it has not started by then", self.engine.name, batch_id, waited,
                        self.engine.window_s)

    def cancel(self, batch_id: str) -> None:
        self.client.batches.cancel(name=batch_id)

    def _items(self, batch_id: str, dest: Any) -> list[Item]:
        """The ended batch's results, read once (its ``dest``: final once ended)."""
        if batch_id not in self._ended:
            self._ended[batch_id] = (dest, list(self._read(dest)))
        return self._ended[batch_id][1]

    def _read(self, dest: Any) -> Iterator[Item]:
        if dest is None:
            return
        if dest.file_name:
            data = self.client.files.download(file=dest.file_name)
            for line in jsonl_objects(data.decode("utf-8", "surrogateescape")):
                yield item(str(line.get("key")), line.get("response"), line.get("error"))
        for r in dest.inlined_responses or []:
            key = str((r.metadata or {}).get("key"))
            if r.response is not None:
                yield item(key, r.response.model_dump(mode="json", by_alias=True, exclude_none=True), None)
            else:
                err = r.error
                yield item(key, None, {"code": getattr(err, "code", None), "message": getattr(err, "message", ""),
                                       "status": _status_of(err)})

    def _dest(self, batch_id: str) -> Any:
        if batch_id not in self._ended:
            self._items(batch_id, self.client.batches.get(name=batch_id).dest)
        return self._ended[batch_id][0]

    def results(self, batch_id: str) -> Iterator[Item]:
        self._dest(batch_id)
        yield from self._ended[batch_id][1]

    def cleanup(self, batch_id: str, input_ref: str | None) -> None:
        dest = self._dest(batch_id)
        for name in (input_ref, getattr(dest, "file_name", None)):
            if name:
                self.client.files.delete(name=name)
        self.client.batches.delete(name=batch_id)
        self._ended.pop(batch_id, None)


# google.rpc status names by their code and by the HTTP status the API maps them to: an inline error
# (the client's ``JobError``) keeps only the code.
STATUS_NAMES = {3: "INVALID_ARGUMENT", 400: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 504: "DEADLINE_EXCEEDED",
                8: "RESOURCE_EXHAUSTED", 429: "RESOURCE_EXHAUSTED", 13: "INTERNAL", 500: "INTERNAL",
                14: "UNAVAILABLE", 503: "UNAVAILABLE"}


def _status_of(err: Any) -> str | None:
    """An inline error's status name, from its code."""
    return STATUS_NAMES.get(getattr(err, "code", None))


class GeminiBatchEngine(HostedBatchEngine):
    name = "gemini-batch"
    provider_class = GeminiBatches
    default_base_url = "https://generativelanguage.googleapis.com/"
    option_names = HostedBatchEngine.common_options | {"input", "window_s"}
    result_options = frozenset(ENGINE_RESULT_OPTIONS["gemini-batch"])

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        self.input = str(self.option("input", "file"))
        if self.input not in INPUTS:
            raise InvalidValue(f"engine 'gemini-batch': option input must be one of {', '.join(INPUTS)}, "
                               f"got {self.input!r}")
        self.window_s = float(self.option("window_s", WINDOW_S))
        refused = schema_refusal(spec.output_schema)
        if refused is not None:
            raise InvalidValue(f"engine 'gemini-batch': the output schema has what Gemini's response schema "
                               f"cannot take: {refused}")
        self.current_ids: list[str] = []

    def generate(self, requests, stop):
        self.current_ids = [r.record_id for r in requests]
        yield from super().generate(requests, stop)


__all__ = ["GeminiBatchEngine", "GeminiBatches", "schema_refusal"]
