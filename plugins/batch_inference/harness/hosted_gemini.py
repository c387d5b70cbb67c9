"""A loopback emulator of Gemini's Batch API (Gemini Developer API, ``v1beta``), for the hosted batch tests and the
nights.

A hosted provider is the one boundary that cannot run here; this speaks the
API's wire shapes on ``127.0.0.1`` and is driven by the official
``google-genai`` client (``HttpOptions.base_url``). Every request the
emulator takes is read through the client's own types (``types.Content``,
``types.GenerateContentConfig`` for ``generationConfig`` with
``systemInstruction``), and every answer it gives is a
``types.GenerateContentResponse`` checked by ``model_validate`` before it is
stored; the batch itself is read by the client's ``BatchJob`` converter on
every ``batches.get``. What it covers:

* Files API, resumable upload: ``POST /upload/v1beta/files`` with
  ``X-Goog-Upload-Command: start`` answers an ``x-goog-upload-url``; ``upload,
  finalize`` to that URL stores the bytes and answers ``{"file": File}``;
  ``GET /v1beta/files/{id}:download?alt=media``, ``DELETE /v1beta/files/{id}``.
* ``POST /v1beta/models/{model}:batchGenerateContent`` with
  ``batch.inputConfig.fileName`` (a JSONL file of ``{"key", "request"}`` lines)
  or ``batch.inputConfig.requests.requests`` (``{"request", "metadata"}``),
  keys unique; ``GET /v1beta/batches/{id}``, ``GET /v1beta/batches`` (newest
  first, ``pageSize``/``pageToken``), ``POST /v1beta/batches/{id}:cancel``,
  ``DELETE /v1beta/batches/{id}``. A batch is a long-running operation: its
  ``metadata`` holds ``state`` (``BATCH_STATE_PENDING`` while the clock
  validates, ``_RUNNING``, then ``_SUCCEEDED``, ``_CANCELLED`` or ``_EXPIRED``),
  ``batchStats`` and, once ended, ``output``: a ``responsesFile`` for a file
  batch, ``inlinedResponses`` for an inline one, holding what the batch finished
  (of a cancelled or expired batch too).
* Per-request answers from ``respond(request) -> (code, body)``: 200 and a
  ``GenerateContentResponse``, or an error ``{"code", "message", "status"}``.
* A job left PENDING: ``pending_forever`` (or a batch's ``_validate_s`` set to
  infinity in ``on_create``) keeps it ``BATCH_STATE_PENDING`` past any window,
  as jobs have sat at the provider (googleapis/python-genai #1482, #2221); a
  cancel then settles it ``BATCH_STATE_CANCELLED`` with nothing done.
* ``fail_next`` 5xx answers to the next calls (``UNAVAILABLE``), whichever route.

Not covered: authentication beyond recording the ``x-goog-api-key`` header,
quotas and the enqueued-token limit, the 2 GB file and 20 MB inline limits,
Vertex AI's ``batchPredictionJobs`` (GCS/BigQuery sources), embedding batches,
webhooks, and real model output.

The clock, ``billed``, ``hold_after`` and ``on_create`` are ``harness.hosted_sim``'s.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from batch_inference.harness.hosted_sim import BatchProvider

OP_TYPE = "type.googleapis.com/google.ai.generativelanguage.v1main.GenerateContentBatch"
OUT_TYPE = "type.googleapis.com/google.ai.generativelanguage.v1main.GenerateContentBatchOutput"
END_STATE = {"completed": "BATCH_STATE_SUCCEEDED", "cancelled": "BATCH_STATE_CANCELLED",
             "expired": "BATCH_STATE_EXPIRED"}


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def answer(text: str, finish: str = "STOP", prompt_tokens: int = 20, output_tokens: int = 9) -> dict[str, Any]:
    """A ``GenerateContentResponse`` of one candidate, as the REST API writes it."""
    return {"candidates": [{"content": {"role": "model", "parts": [{"text": text}]}, "finishReason": finish,
                            "index": 0}],
            "usageMetadata": {"promptTokenCount": prompt_tokens, "candidatesTokenCount": output_tokens,
                              "totalTokenCount": prompt_tokens + output_tokens},
            "modelVersion": "gemini-test", "responseId": uuid.uuid4().hex[:20]}


def status_error(code: int, status: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message, "status": status}


def _error(code: int, status: str, message: str) -> dict[str, Any]:
    return {"error": status_error(code, status, message)}


class GeminiBatchEmulator(BatchProvider):
    def __init__(self, respond: Callable[[dict[str, Any]], tuple[int, dict[str, Any]]] | None = None, *,
                 pending_forever: bool = False, **clock: Any):
        self.respond = respond or (lambda request: (200, answer('{"category": "bug", "summary": "x"}')))
        self.files: dict[str, dict[str, Any]] = {}
        self.uploads: dict[str, dict[str, Any]] = {}
        self.pending_forever = pending_forever
        self.fail_next = 0
        self.requests: list[dict[str, Any]] = []      # every request line a batch was created with
        super().__init__(**clock)

    @property
    def base_url(self) -> str:
        return self.url + "/"

    def line_id(self, line: dict[str, Any]) -> str:
        return str(line["key"])

    # -- the provider's side -------------------------------------------------
    def add(self, bid: str, b: dict[str, Any], lines: list[dict[str, Any]]) -> None:
        super().add(bid, b, lines)
        if self.pending_forever:
            b["_validate_s"] = float("inf")

    def started(self, b: dict[str, Any], now: float) -> None:
        self._state(b, "BATCH_STATE_RUNNING", now)

    def _state(self, b: dict[str, Any], state: str, now: float) -> None:
        b["metadata"]["state"] = state
        b["metadata"]["updateTime"] = rfc3339(now)

    def complete(self, b: dict[str, Any], w: dict[str, Any], line: dict[str, Any]) -> None:
        from google.genai import types

        code, body = self.respond(line["request"])
        stats = b["metadata"]["batchStats"]
        if code == 200:
            types.GenerateContentResponse.model_validate(body)     # the client's own type reads it
            w["out"].append({"key": line["key"], "response": body})
            stats["successfulRequestCount"] = str(int(stats["successfulRequestCount"]) + 1)
        else:
            w["out"].append({"key": line["key"], "error": body})
            stats["failedRequestCount"] = str(int(stats["failedRequestCount"]) + 1)
        stats["pendingRequestCount"] = str(int(stats["pendingRequestCount"]) - 1)

    def ended(self, b: dict[str, Any], w: dict[str, Any], how: str, now: float) -> None:
        w["next"] = len(w["lines"])
        md = b["metadata"]
        self._state(b, END_STATE[how], now)
        md["endTime"] = rfc3339(now)
        if b["_inline"]:
            out = [{"response": x["response"], "metadata": {"key": x["key"]}} if "response" in x else
                   {"error": x["error"], "metadata": {"key": x["key"]}} for x in w["out"]]
            md["output"] = {"inlinedResponses": {"inlinedResponses": out}}
        else:
            data = "".join(json.dumps(x) + "\n" for x in w["out"]).encode()
            md["output"] = {"responsesFile": self._file(data, "batch-output.jsonl", "application/jsonl",
                                                        generated=True)}
        b["done"] = True
        b["response"] = {"@type": OUT_TYPE, **md["output"]}

    def _file(self, data: bytes, display: str, mime: str, generated: bool = False) -> str:
        fid = uuid.uuid4().hex[:12]
        now = rfc3339(time.time())
        name = f"files/{fid}"
        self.files[name] = {"name": name, "displayName": display, "mimeType": mime, "sizeBytes": str(len(data)),
                            "createTime": now, "updateTime": now, "expirationTime": rfc3339(time.time() + 172800),
                            "sha256Hash": "", "uri": f"{self.url}/v1beta/{name}", "state": "ACTIVE",
                            "source": "GENERATED" if generated else "UPLOADED", "_data": data}
        if generated:
            self.files[name]["downloadUri"] = f"{self.url}/v1beta/{name}:download?alt=media"
        return name

    @staticmethod
    def _public_file(f: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in f.items() if not k.startswith("_")}

    # -- the API ---------------------------------------------------------------
    def _failing(self) -> tuple[int, Any] | None:
        if self.fail_next > 0:
            self.fail_next -= 1
            return 503, _error(503, "UNAVAILABLE", "The service is currently unavailable.")
        return None

    def upload(self, *, body: bytes, headers: Any, params: dict[str, str], **_: Any) -> tuple[int, Any]:
        command = (headers.get("X-Goog-Upload-Command") or "").lower()
        if command == "start":
            meta = (json.loads(body or b"{}") or {}).get("file") or {}
            uid = uuid.uuid4().hex
            self.uploads[uid] = {"display": meta.get("displayName") or "input.jsonl",
                                 "mime": meta.get("mimeType") or headers.get("X-Goog-Upload-Header-Content-Type")
                                 or "application/octet-stream", "data": b""}
            url = f"{self.url}/upload/v1beta/files?upload_id={uid}&upload_protocol=resumable"
            return 200, (b"", "text/plain", {"x-goog-upload-url": url, "x-goog-upload-status": "active"})
        up = self.uploads.get(params.get("upload_id", ""))
        if up is None or "upload" not in command:
            return 400, _error(400, "INVALID_ARGUMENT", "unknown upload session or command")
        up["data"] += body
        if "finalize" not in command:
            return 200, (b"", "text/plain", {"x-goog-upload-status": "active"})
        del self.uploads[params["upload_id"]]
        name = self._file(up["data"], up["display"], up["mime"])
        return 200, (json.dumps({"file": self._public_file(self.files[name])}).encode(), "application/json",
                     {"x-goog-upload-status": "final"})

    def download(self, fid: str, **_: Any) -> tuple[int, Any]:
        f = self.files.get(f"files/{fid}")
        if f is None:
            return 404, _error(404, "NOT_FOUND", f"File files/{fid} not found.")
        return 200, (f["_data"], "application/octet-stream")

    def delete_file(self, fid: str, **_: Any) -> tuple[int, Any]:
        if self.files.pop(f"files/{fid}", None) is None:
            return 404, _error(404, "NOT_FOUND", f"File files/{fid} not found.")
        return 200, {}

    def create_batch(self, model: str, *, body: bytes, **_: Any) -> tuple[int, Any]:
        from google.genai import types
        import pydantic

        failing = self._failing()
        if failing:
            return failing
        batch = (json.loads(body) or {}).get("batch") or {}
        src = batch.get("inputConfig") or {}
        if "fileName" in src:
            f = self.files.get(src["fileName"])
            if f is None:
                return 400, _error(400, "INVALID_ARGUMENT", f"File {src['fileName']} not found.")
            lines, inline = [json.loads(x) for x in f["_data"].decode().splitlines() if x.strip()], False
        elif "requests" in src:
            lines = [{"key": (r.get("metadata") or {}).get("key"), "request": r.get("request") or {}}
                     for r in src["requests"].get("requests") or []]
            inline = True
        else:
            return 400, _error(400, "INVALID_ARGUMENT", "batch.input_config: a file name or requests is required")
        keys = [x.get("key") for x in lines]
        if not lines or len(set(keys)) != len(keys) or any(not isinstance(k, str) for k in keys):
            return 400, _error(400, "INVALID_ARGUMENT", "every request needs a unique key")
        for x in lines:
            req = x["request"]
            try:
                for c in req.get("contents") or []:
                    types.Content.model_validate(c)
                types.GenerateContentConfig.model_validate({**(req.get("generationConfig") or {}),
                                                            "systemInstruction": req.get("systemInstruction")})
            except pydantic.ValidationError as exc:
                e = exc.errors()[0]
                return 400, _error(400, "INVALID_ARGUMENT", f"Invalid JSON payload received. Unknown name "
                                   f"{'.'.join(map(str, e['loc']))!r}: {e['msg']}")
            if not req.get("contents"):
                return 400, _error(400, "INVALID_ARGUMENT", "contents is not specified")
        now = time.time()
        bid = f"batches/{uuid.uuid4().hex[:16]}"
        b = {"name": bid, "metadata": {
            "@type": OP_TYPE, "model": f"models/{model}", "displayName": batch.get("displayName") or "",
            "createTime": rfc3339(now), "updateTime": rfc3339(now), "state": "BATCH_STATE_PENDING", "name": bid,
            "batchStats": {"requestCount": str(len(lines)), "pendingRequestCount": str(len(lines)),
                           "successfulRequestCount": "0", "failedRequestCount": "0"}}}
        b["_inline"] = inline          # where its results go: inline responses, or a responses file
        self.requests.extend(lines)
        self.add(bid, b, lines)
        return 200, self.public(b)

    def get_batch(self, bid: str, **_: Any) -> tuple[int, Any]:
        failing = self._failing()
        if failing:
            return failing
        b = self.batches.get(f"batches/{bid}")
        return (200, self.public(b)) if b else (404, _error(404, "NOT_FOUND", f"Batch batches/{bid} not found."))

    def cancel_batch(self, bid: str, **_: Any) -> tuple[int, Any]:
        b = self.batches.get(f"batches/{bid}")
        if b is None:
            return 404, _error(404, "NOT_FOUND", f"Batch batches/{bid} not found.")
        if not self.cancel(b["name"]):
            return 400, _error(400, "FAILED_PRECONDITION", f"Batch {b['name']} has already ended.")
        return 200, {}

    def delete_batch(self, bid: str, **_: Any) -> tuple[int, Any]:
        b = self.batches.get(f"batches/{bid}")
        if b is None:
            return 404, _error(404, "NOT_FOUND", f"Batch batches/{bid} not found.")
        if not b.get("done"):
            return 400, _error(400, "FAILED_PRECONDITION", "A batch can be deleted once it has ended.")
        del self.batches[b["name"]]
        del self.work[b["name"]]
        return 200, {}

    def list_batches(self, *, params: dict[str, str], **_: Any) -> tuple[int, Any]:
        rows = sorted(self.batches.values(), key=lambda b: b["_t0"], reverse=True)
        start = int(params.get("pageToken") or 0)
        size = int(params.get("pageSize") or 50)
        page = rows[start:start + size]
        out: dict[str, Any] = {"operations": [self.public(b) for b in page]}
        if start + size < len(rows):
            out["nextPageToken"] = str(start + size)
        return 200, out

    routes = [
        ("POST", re.compile(r"^/upload/v1(?:beta)?/files$"), upload),
        ("GET", re.compile(r"^/v1(?:beta)?/files/([^/:]+):download$"), download),
        ("DELETE", re.compile(r"^/v1(?:beta)?/files/([^/:]+)$"), delete_file),
        ("POST", re.compile(r"^/v1(?:beta)?/models/([^/:]+):batchGenerateContent$"), create_batch),
        ("GET", re.compile(r"^/v1(?:beta)?/batches$"), list_batches),
        ("GET", re.compile(r"^/v1(?:beta)?/batches/([^/:]+)$"), get_batch),
        ("POST", re.compile(r"^/v1(?:beta)?/batches/([^/:]+):cancel$"), cancel_batch),
        ("DELETE", re.compile(r"^/v1(?:beta)?/batches/([^/:]+)$"), delete_batch),
    ]


__all__ = ["GeminiBatchEmulator", "answer", "status_error"]
