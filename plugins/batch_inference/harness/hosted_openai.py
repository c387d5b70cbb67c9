"""A loopback emulator of OpenAI's Batch API (Files + Batches), for the hosted batch tests and the nights.

A hosted provider is the one boundary that cannot run here; this speaks its
published wire shapes on ``127.0.0.1`` and is driven by the official
``openai`` client (``base_url``). What it covers:

* ``POST /v1/files`` (multipart, purpose ``batch``), ``GET /v1/files/{id}/content``,
  ``DELETE /v1/files/{id}``; the JSONL input is parsed and each line's
  ``custom_id``, ``url`` and ``body`` checked (duplicate custom_ids refused, as the API does).
* ``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``),
  ``GET /v1/batches/{id}``, ``GET /v1/batches`` (newest first, ``limit``/``after`` pages),
  ``POST /v1/batches/{id}/cancel``.
* States ``validating`` -> ``in_progress`` -> ``finalizing`` -> ``completed``; ``cancelling``
  -> ``cancelled`` after ``cancel_delay_s``, during which requests still complete (and bill);
  ``expired`` after ``expire_s`` with the completed part in the output file and
  ``batch_expired`` lines for the rest; ``batch_cancelled`` lines for a cancelled batch's rest.
* ``request_counts`` (total, completed, failed) that move while the batch runs, and
  ``usage`` (input/output tokens) on the batch.
* Per-request answers from ``respond(body) -> (status, body)`` for ``/v1/chat/completions``
  lines and ``embed(body) -> (status, body)`` for ``/v1/embeddings`` lines: 200 lines go
  to the output file, other statuses to the error file with the same line shape.
* ``/v1/embeddings`` (``embedding_answer``, the default ``embed``): the request body
  ``{model, input, dimensions?, encoding_format?}`` as the Embeddings API takes it, for
  OpenAI's three embedding models (``EMBEDDING_MODELS``): an unknown model is a 404
  ``model_not_found``, ``dimensions`` on ``text-embedding-ada-002`` or past a model's size
  a 400, an empty input a 400; the answer ``{object: list, data: [{object: embedding,
  index, embedding}], model, usage: {prompt_tokens, total_tokens}}``, ``embedding`` a
  list of floats or, with ``encoding_format: base64``, float32 bytes in base64. A batch
  of more than 50,000 embedding inputs is refused at create, as the API documents.
  The vectors are not a model's: each is a unit vector of the text's hashed character
  trigrams (texts that share words are near each other), shortened as ``dimensions``
  shortens OpenAI's (the first values, normalized again).

Not covered: authentication and organisation scoping, rate limits and the
enqueued-token limit, file size and line-count limits (but the embedding inputs'),
the per-input token limit of the embedding models, the ``/v1/responses`` and
other endpoints, ``output_expires_after``, a batch ``failed`` at validation for
a malformed file beyond what is checked above, and real model output.

The clock, ``billed``, ``hold_after`` and ``on_create`` are ``harness.hosted_sim``'s.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
import uuid
from collections.abc import Callable
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

import numpy as np

from batch_inference.harness.hosted_sim import BatchProvider
from batch_inference.harness.loopback import completion

ENDPOINTS = ("/v1/chat/completions", "/v1/embeddings")
# The provider's embedding models as its documentation gives them: native size, and whether
# the request's ``dimensions`` may shorten the vectors (the text-embedding-3 models only).
EMBEDDING_MODELS = {"text-embedding-3-small": 1536, "text-embedding-3-large": 3072, "text-embedding-ada-002": 1536}
SHORTENS = frozenset({"text-embedding-3-small", "text-embedding-3-large"})
MAX_BATCH_EMBEDDING_INPUTS = 50_000
END_FIELD = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}
END_CODE = {"expired": ("batch_expired", "This request could not be executed before the completion window expired."),
            "cancelled": ("batch_cancelled", "This request was not executed because the batch was cancelled.")}


def tokens(text: str) -> int:
    """A stand-in token count: four characters a token."""
    return max(1, len(text) // 4)


def _error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _inputs(body: dict[str, Any]) -> list[Any]:
    x = body.get("input")
    return [x] if isinstance(x, str) else list(x) if isinstance(x, list) else [x]


def trigram_vector(text: str, size: int) -> np.ndarray:
    """A unit vector of ``text``'s character trigrams, each hashed to a place and a sign."""
    v = np.zeros(size, dtype=np.float64)
    t = f"  {text.lower()} "
    for i in range(len(t) - 2):
        h = int.from_bytes(hashlib.blake2b(t[i:i + 3].encode(), digest_size=8).digest(), "little")
        v[h % size] += 1.0 if (h >> 40) & 1 else -1.0
    n = np.linalg.norm(v)
    return v / n if n else v


def embedding_answer(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One ``/v1/embeddings`` request answered as the Embeddings API answers it."""
    model = body.get("model")
    if model not in EMBEDDING_MODELS:
        err = _error(f"The model `{model}` does not exist or you do not have access to it.")
        err["error"]["code"] = "model_not_found"
        return 404, err
    texts = _inputs(body)
    if not texts or any(not isinstance(t, str) or not t for t in texts):
        return 400, _error("'$.input' is invalid. Please check the API reference: "
                           "https://platform.openai.com/docs/api-reference.")
    size = EMBEDDING_MODELS[model]
    dims = body.get("dimensions")
    if dims is not None and model not in SHORTENS:
        return 400, _error("This model does not support specifying dimensions.")
    if dims is not None and (not isinstance(dims, int) or not 1 <= dims <= size):
        return 400, _error(f"Invalid value for 'dimensions' = {dims}. Must be between 1 and {size}.")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        return 400, _error(f"Invalid value for 'encoding_format' = {fmt}. Must be 'float' or 'base64'.")
    data = []
    for i, t in enumerate(texts):
        v = trigram_vector(t, size)[:dims or size]
        v = (v / np.linalg.norm(v)).astype("<f4")
        emb: Any = base64.b64encode(v.tobytes()).decode() if fmt == "base64" else [float(x) for x in v]
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(tokens(t) for t in texts)
    return 200, {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": n, "total_tokens": n}}


def _multipart(ctype: str, raw: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body: field name -> (file name, bytes)."""
    msg = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + raw)
    return {part.get_param("name", header="content-disposition"): (part.get_filename(),
                                                                  part.get_payload(decode=True) or b"")
            for part in msg.iter_parts()}


class OpenAIBatchEmulator(BatchProvider):
    def __init__(self, respond: Callable[[dict[str, Any]], tuple[int, dict[str, Any]]] | None = None,
                 embed: Callable[[dict[str, Any]], tuple[int, dict[str, Any]]] | None = None, **clock: Any):
        self.respond = respond or (lambda body: (200, completion('{"category": "bug", "summary": "x"}')))
        self.embed = embed or embedding_answer
        self.files: dict[str, dict[str, Any]] = {}
        super().__init__(**clock)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    # -- the provider's side -------------------------------------------------
    def started(self, b: dict[str, Any], now: float) -> None:
        b["status"], b["in_progress_at"] = "in_progress", int(now)

    def complete(self, b: dict[str, Any], w: dict[str, Any], line: dict[str, Any]) -> None:
        embeds = line["url"] == "/v1/embeddings"
        status, body = (self.embed if embeds else self.respond)(line["body"])
        out = {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": line["custom_id"],
               "response": {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}, "error": None}
        (w["out"] if status == 200 else w["err"]).append(out)
        b["request_counts"]["completed" if status == 200 else "failed"] += 1
        u = b["usage"]
        if embeds:   # the model's own count where it answered, else the input's
            u["input_tokens"] += int(((body or {}).get("usage") or {}).get("prompt_tokens")
                                     or sum(tokens(str(t)) for t in _inputs(line["body"])))
        else:
            u["input_tokens"] += tokens(json.dumps(line["body"].get("messages", "")))
        u["output_tokens"] += int(((body or {}).get("usage") or {}).get("completion_tokens") or 0)
        u["total_tokens"] = u["input_tokens"] + u["output_tokens"]

    def ended(self, b: dict[str, Any], w: dict[str, Any], how: str, now: float) -> None:
        if how in END_CODE:
            code, msg = END_CODE[how]
            for line in w["lines"][w["next"]:]:
                w["err"].append({"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": line["custom_id"],
                                 "response": None, "error": {"code": code, "message": msg}})
            w["next"] = len(w["lines"])
        if how == "completed":
            b["finalizing_at"] = int(now)
        if w["out"]:
            b["output_file_id"] = self._file(w["out"], "batch_output")
        if w["err"]:
            b["error_file_id"] = self._file(w["err"], "batch_output")
        b["status"] = how
        b[END_FIELD[how]] = int(now)

    def _file(self, lines: list[dict[str, Any]], purpose: str, name: str = "output.jsonl",
              data: bytes | None = None) -> str:
        fid = f"file-{uuid.uuid4().hex[:24]}"
        data = data if data is not None else "".join(json.dumps(x) + "\n" for x in lines).encode()
        self.files[fid] = {"id": fid, "object": "file", "bytes": len(data), "created_at": int(time.time()),
                           "filename": name, "purpose": purpose, "status": "processed", "data": data}
        return fid

    # -- the API ---------------------------------------------------------------
    def upload(self, *, body: bytes, headers: Any, **_: Any) -> tuple[int, Any]:
        form = _multipart(headers["Content-Type"], body)
        if form.get("purpose", (None, b""))[1] != b"batch" or "file" not in form:
            return 400, _error("purpose must be 'batch', with a file")
        filename, data = form["file"]
        fid = self._file([], "batch", filename or "input.jsonl", data)
        return 200, {k: v for k, v in self.files[fid].items() if k != "data"}

    def create_batch(self, *, body: bytes, **_: Any) -> tuple[int, Any]:
        req = json.loads(body)
        f = self.files.get(req.get("input_file_id", ""))
        if f is None:
            return 400, _error(f"No such File object: {req.get('input_file_id')}")
        if req.get("endpoint") not in ENDPOINTS or req.get("completion_window") != "24h":
            return 400, _error("unsupported endpoint or completion_window")
        lines = [json.loads(x) for x in f["data"].decode().splitlines() if x.strip()]
        ids = [x.get("custom_id") for x in lines]
        if len(set(ids)) != len(ids) or any(not isinstance(i, str) for i in ids):
            return 400, _error("custom_id must be a unique string per request")
        if any(x.get("url") != req["endpoint"] or x.get("method") != "POST" for x in lines):
            return 400, _error("every request's url must match the batch endpoint")
        if req["endpoint"] == "/v1/embeddings" and \
                sum(len(_inputs(x.get("body") or {})) for x in lines) > MAX_BATCH_EMBEDDING_INPUTS:
            return 400, _error(f"/v1/embeddings batches may hold at most {MAX_BATCH_EMBEDDING_INPUTS} "
                               "embedding inputs across all requests")
        now = time.time()
        bid = f"batch_{uuid.uuid4().hex[:24]}"
        b = {"id": bid, "object": "batch", "endpoint": req["endpoint"], "errors": None,
             "input_file_id": f["id"], "completion_window": "24h", "status": "validating",
             "output_file_id": None, "error_file_id": None, "created_at": int(now),
             "in_progress_at": None, "expires_at": int(now + 86400), "finalizing_at": None, "completed_at": None,
             "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
             "request_counts": {"total": len(lines), "completed": 0, "failed": 0},
             "usage": {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
                       "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0},
             "metadata": req.get("metadata")}
        self.add(bid, b, lines)
        return 200, self.public(b)

    def get_batch(self, bid: str, **_: Any) -> tuple[int, Any]:
        b = self.batches.get(bid)
        return (200, self.public(b)) if b else (404, _error(f"No batch found with id '{bid}'."))

    def cancel_batch(self, bid: str, **_: Any) -> tuple[int, Any]:
        b = self.batches.get(bid)
        if b is None:
            return 404, _error(f"No batch found with id '{bid}'.")
        if not self.cancel(bid):
            return 409, _error(f"Cannot cancel a batch with status '{b['status']}'.")
        if b["status"] != "cancelling":
            b["status"], b["cancelling_at"] = "cancelling", int(time.time())
        return 200, self.public(b)

    def list_batches(self, *, params: dict[str, str], **_: Any) -> tuple[int, Any]:
        rows = sorted(self.batches.values(), key=lambda b: b["_t0"], reverse=True)
        if "after" in params:
            ids = [b["id"] for b in rows]
            rows = rows[ids.index(params["after"]) + 1:] if params["after"] in ids else []
        limit = int(params.get("limit", 20))
        page = rows[:limit]
        return 200, {"object": "list", "data": [self.public(b) for b in page],
                     "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
                     "has_more": len(rows) > limit}

    def content(self, fid: str, **_: Any) -> tuple[int, Any]:
        f = self.files.get(fid)
        return (200, (f["data"], "application/octet-stream")) if f else (404, _error("No such File object"))

    def delete_file(self, fid: str, **_: Any) -> tuple[int, Any]:
        if self.files.pop(fid, None) is None:
            return 404, _error("No such File object")
        return 200, {"id": fid, "object": "file", "deleted": True}

    routes = [
        ("POST", re.compile(r"^/v1/files$"), upload),
        ("GET", re.compile(r"^/v1/files/([^/]+)/content$"), content),
        ("DELETE", re.compile(r"^/v1/files/([^/]+)$"), delete_file),
        ("POST", re.compile(r"^/v1/batches$"), create_batch),
        ("GET", re.compile(r"^/v1/batches$"), list_batches),
        ("GET", re.compile(r"^/v1/batches/([^/]+)$"), get_batch),
        ("POST", re.compile(r"^/v1/batches/([^/]+)/cancel$"), cancel_batch),
    ]
