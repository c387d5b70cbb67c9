"""The openai engine: any OpenAI-compatible chat completions endpoint.

Talks HTTP to a vLLM server, llama.cpp's server, or a hosted API. Requests
run concurrently on an asyncio loop (httpx), bounded by ``concurrency`` and
optionally by a request rate; transient failures are retried with
exponential backoff and jitter.

Options:

* ``base_url``: the API root including ``/v1`` (``http://host:8000/v1``);
  defaults to ``spec.fallback.base_url``. Checked by
  ``clearance.check_clearance`` when the engine is built: records of a class
  not cleared for hosted APIs never go to a hosted endpoint.
* ``model``: the model name sent in each request (default ``spec.model.name``).
  It changes results: it joins the job version, and at run time it must equal
  the spec's (serve the model under that name).
* ``api_key_env``: name of the environment variable holding the API key
  (never the key itself: specs are stored and hashed).
* ``response_format_style``: ``json_schema`` (default; vLLM and OpenAI:
  ``{"type": "json_schema", "json_schema": {"name": "output", "schema": S, "strict": true}}``)
  or ``json_object`` (llama.cpp server: ``{"type": "json_object", "schema": S}``;
  it answers HTTP 500 to the other form).
* ``concurrency`` (8): requests in flight at once.
* ``max_retries`` (5): retries after the first try, on transport failures:
  connect errors, timeouts, dropped connections, HTTP 5xx, 408, 409, 429,
  and 401/403/404 (a wrong key, URL or model name refuses every request).
  Other 4xx (400, 413, 422: about the request) fail the record at once.
* ``breaker_failures`` (5), ``breaker_window`` (20): the endpoint breaker
  (``batch_inference.breaker``). Once the last ``breaker_failures`` requests,
  or 80% of the last ``breaker_window``, were transport failures,
  ``generate()`` raises ``EndpointUnavailable`` and sends nothing more; no
  outcome is yielded for the records it did not finish. A record whose
  retries ran out spends an attempt only while the endpoint answers other
  requests; otherwise it keeps retrying until the breaker decides.
* ``backoff_base_s`` (0.5), ``backoff_max_s`` (30): retry ``k`` (0-based)
  waits a random time in ``[d/2, d]`` with ``d = min(max, base * 2**k)``;
  a ``Retry-After`` header (seconds or HTTP date) replaces that, capped at
  ``retry_after_max_s`` (120).
* ``rate_limit`` (requests/s, none) and ``rate_burst`` (1): a token bucket
  every HTTP request, retries included, must pass.
* ``timeout_s`` (120): per HTTP request.
* ``extra_body`` (dict): merged into every request body (server-specific knobs).
  It changes results: it joins the job version, and it may not replace the
  request's own fields (``model``, ``messages``, the sampling parameters,
  ``response_format``).

``generate()`` is synchronous: it drives the event loop in a background
thread and yields outcomes as they complete. ``agenerate()`` is the same as
an async iterator, for callers that have a loop (the fallback pool).
After ``stop`` is set no new request is sent: requests on the wire finish
and are yielded; records not started, and those waiting to retry, get no
outcome. The same holds for a record whose request, first or retry, finds
the engine's ``allowance`` (a ``ratelimit.RequestAllowance``) spent.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import json
import logging
import os
import queue
import random
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

from batch_inference.breaker import Breaker, EndpointUnavailable, public_url
from batch_inference.clearance import check_clearance
from batch_inference.engines.base import Engine, Outcome, Request, one_line, parse_chat_completion
from batch_inference.exceptions import BatchInferenceError, InvalidValue
from batch_inference.ratelimit import TokenBucket
from batch_inference.spec import ENGINE_RESULT_OPTIONS, ENGINES_WITH_LOGPROBS


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS context every client of this process verifies with (httpx's default: certifi's CA bundle, or
    $SSL_CERT_FILE / $SSL_CERT_DIR). A client is made per ``agenerate`` (a shard, a careful batch), and
    building a context loads the whole CA bundle, about 40 ms of CPU here; one context serves every client."""
    import httpx

    return httpx.create_ssl_context()


STYLES = ("json_schema", "json_object")


class _RedactURLs(logging.Filter):
    """httpx logs every request with its full URL at INFO: those lines show
    the URL as ``public_url`` does (no userinfo, no ``?key=`` value)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(type(a).__name__ == "URL" for a in record.args):
            record.args = tuple(public_url(str(a)) if type(a).__name__ == "URL" else a for a in record.args)
        return True


if not any(isinstance(f, _RedactURLs) for f in logging.getLogger("httpx").filters):
    logging.getLogger("httpx").addFilter(_RedactURLs())
# Transport failures besides 5xx: retried, counted by the breaker, never a record's fault.
RETRY_STATUS = frozenset({401, 403, 404, 408, 409, 429})
# The request's own fields (OpenAIEngine.body): extra_body may not replace them.
BODY_FIELDS = frozenset({"model", "messages", "temperature", "top_p", "max_tokens", "response_format", "seed"})
_DONE = object()



def extra_body_option(engine: str, extra: Any, fields: frozenset[str] = BODY_FIELDS) -> dict[str, Any]:
    """The ``extra_body`` option of an OpenAI-shaped engine: a mapping that adds to the request and
    never replaces one of its own ``fields`` (set by the spec; a chat completion's by default)."""
    if not isinstance(extra, dict):
        raise InvalidValue(f"engine '{engine}': option 'extra_body' must be a mapping")
    for key in sorted(fields & set(extra)):
        raise InvalidValue(f"engine '{engine}': option 'extra_body.{key}' is refused: it would replace the "
                           f"request's own '{key}' (set by the spec)")
    return dict(extra)

def response_format(style: str, schema: dict[str, Any]) -> dict[str, Any]:
    if style == "json_object":
        return {"type": "json_object", "schema": schema}
    if style == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": True}}
    raise InvalidValue(f"engine 'openai': response_format_style must be one of {', '.join(STYLES)}, got '{style}'")


def chat_body(spec: Any, model: str, messages: list[dict[str, str]], fmt: dict[str, Any],
              extra: dict[str, Any] | None = None, seed: int | None = None) -> dict[str, Any]:
    """One chat-completions request body: the spec's params (``seed``: a retry's, ``Request.seed``),
    the output schema's response_format."""
    p = spec.params
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "max_tokens": p.max_tokens,
        "response_format": fmt,
    }
    seed = p.seed if seed is None else seed
    if seed is not None:
        body["seed"] = seed
    body.update(extra or {})
    return body


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Retry ``attempt`` (0-based) waits in [d/2, d], d = min(cap, base * 2**attempt).

    "Equal jitter": never less than half the exponential step, so retries
    still back off, and never in lock-step with other clients.
    """
    d = min(cap, base * (2**attempt))
    return d / 2 + rng.uniform(0, d / 2)


def error_text(resp: Any) -> str:
    """An error response's text: ``error.message`` of the OpenAI error shape
    (``{"error": {"message": ...}}``, which llama.cpp and vLLM also send), else the body."""
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return resp.text
    return message if isinstance(message, str) and message.strip() else resp.text


class _Retryable(BatchInferenceError):
    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


# Public: what ``attempt`` raises for a transport failure (a tier-aware subclass, batch_inference.tiers.engine,
# tells a refused request from an answered one by it).
Retryable = _Retryable


class OpenAIEngine(Engine):
    name = "openai"
    option_names = frozenset(
        {
            "base_url", "model", "api_key_env", "response_format_style", "concurrency", "max_retries",
            "backoff_base_s", "backoff_max_s", "retry_after_max_s", "rate_limit", "rate_burst", "timeout_s",
            "extra_body", "breaker_failures", "breaker_window",
        }
    )
    result_options = frozenset(ENGINE_RESULT_OPTIONS["openai"])
    path = "/chat/completions"   # the API path each record is posted to, under base_url
    gives_logprobs = "openai" in ENGINES_WITH_LOGPROBS

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        base_url = self.option("base_url", spec.fallback.base_url)
        if not base_url:
            raise InvalidValue("engine 'openai': option 'base_url' is required (e.g. http://host:8000/v1)")
        self.base_url = str(base_url).rstrip("/")
        check_clearance(spec, self.base_url)    # before any request: NotCleared (a ValueError) refuses the start
        self.extra_body = extra_body_option(self.name, self.option("extra_body", {}))
        self.model = str(self.option("model", spec.model.name))
        self.style = str(self.option("response_format_style", "json_schema"))
        self.response_format = response_format(self.style, spec.output_schema)
        self.concurrency = int(self.option("concurrency", 8))
        self.max_retries = int(self.option("max_retries", 5))
        self.backoff_base_s = float(self.option("backoff_base_s", 0.5))
        self.backoff_max_s = float(self.option("backoff_max_s", 30.0))
        self.retry_after_max_s = float(self.option("retry_after_max_s", 120.0))
        self.timeout_s = float(self.option("timeout_s", 120.0))
        self.rate_limit = self.option("rate_limit")
        self.rate_burst = float(self.option("rate_burst", 1))
        if self.concurrency < 1 or self.max_retries < 0:
            raise InvalidValue("engine 'openai': 'concurrency' must be at least 1 and 'max_retries' at least 0")
        self._rng = random.Random()
        self._headers: dict[str, str] | None = None
        # One bucket per engine, shared by every generate() call: the limit is
        # the endpoint's, not a call's.
        self.bucket = TokenBucket(float(self.rate_limit), self.rate_burst) if self.rate_limit else None
        # One breaker per endpoint; the fallback pool swaps in one for all its threads.
        self.breaker = Breaker.from_options(self.base_url, self.options)
        # How many requests may go at all (ratelimit.RequestAllowance); None: no cap. The fallback
        # pool swaps in one for all its threads when the budget affords fewer rows than are left.
        self.allowance: Any = None

    def result_default(self, key: str) -> Any:
        return self.spec.model.name if key == "model" else None

    # -- set-up -----------------------------------------------------------
    def load(self) -> None:
        headers = {"Content-Type": "application/json"}
        env = self.option("api_key_env")
        if env:
            key = os.environ.get(env)
            if not key:
                raise InvalidValue(f"engine 'openai': environment variable '{env}' (option api_key_env) is not set")
            headers["Authorization"] = f"Bearer {key}"
        self._headers = headers

    def body(self, req: Request) -> dict[str, Any]:
        body = chat_body(self.spec, self.model, req.messages, self.response_format, self.extra_body,
                         req.seed(self.spec.params.seed))
        if self.want_logprobs:
            body.update(logprobs=True, top_logprobs=1)
        return body

    def _client(self):
        import httpx

        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        return httpx.AsyncClient(headers=self._headers, timeout=self.timeout_s, limits=limits, verify=tls_context())

    # -- one record -------------------------------------------------------
    async def attempt(self, client: Any, req: Request) -> Outcome:
        """One HTTP request for one record: its outcome, or ``Retryable`` for a transport failure."""
        import httpx

        try:
            resp = await client.post(f"{self.base_url}{self.path}", json=self.body(req))
        except httpx.TransportError as exc:
            raise _Retryable(one_line(exc)) from None
        if resp.status_code in RETRY_STATUS or resp.status_code >= 500:
            raise _Retryable(
                f"HTTP {resp.status_code}: {one_line(error_text(resp), 200)}",
                parse_retry_after(resp.headers.get("retry-after")),
            )
        if resp.status_code >= 400:
            return Outcome(req.record_id, None, error=f"HTTP {resp.status_code}: {one_line(error_text(resp), 300)}")
        try:
            try:
                data = resp.json()
            except UnicodeDecodeError:
                # Not UTF-8: each invalid byte becomes a lone surrogate, which
                # the worker's output check refuses, keeping the text escaped.
                data = json.loads(resp.content.decode("utf-8", "surrogateescape"))
        except ValueError:
            return Outcome(req.record_id, None, error=f"response is not JSON: {one_line(resp.text, 200)}")
        return self.parse(req.record_id, data)

    def parse(self, record_id: str, data: Any) -> Outcome:
        """The outcome of one answered request (``path``'s JSON)."""
        return parse_chat_completion(record_id, data)

    async def record_outcome(self, client: Any, req: Request, stop: threading.Event | None) -> Outcome | None:
        """The outcome of one record, or None when ``stop`` came before it was sent: its requests with the
        retries, the bucket, the breaker and the allowance (the seam a tier-aware subclass overrides).

        Raises :class:`EndpointUnavailable` once the breaker has tripped.
        """
        attempt = 0
        while True:
            if self.bucket is not None:
                await self.bucket.acquire()
            if attempt == 0 and stop is not None and stop.is_set():
                return None
            self.breaker.check()
            if self.allowance is not None and not self.allowance.take(req.record_id):
                return None   # the allowance is spent: not sent, no attempt counted (as after stop)
            try:
                outcome = await self.attempt(client, req)
            except _Retryable as exc:
                self.breaker.failure(exc.reason)
                # Out of retries, the record is at fault only if the endpoint answers others.
                if attempt >= self.max_retries and self.breaker.answering:
                    return Outcome(req.record_id, None, error=f"{exc.reason} (gave up after {attempt + 1} attempts)")
                if exc.retry_after is not None:
                    delay = min(exc.retry_after, self.retry_after_max_s)
                else:
                    delay = backoff_delay(min(attempt, self.max_retries), self.backoff_base_s, self.backoff_max_s,
                                          self._rng)
                if not await _sleep_unless(delay, stop):
                    return None
                attempt += 1
                continue
            except Exception as exc:  # anything else fails this record, not the batch
                return Outcome(req.record_id, None, error=one_line(exc))
            self.breaker.success()
            return outcome

    # -- many records -------------------------------------------------------
    async def agenerate(
        self, requests: Iterable[Request], stop: threading.Event | None = None, client: Any = None
    ) -> AsyncIterator[Outcome]:
        """Outcomes as they complete, at most ``concurrency`` requests in flight."""
        if self._headers is None:
            self.load()
        own = client is None
        client = self._client() if own else client
        pending: set[asyncio.Task] = set()
        source = iter(requests)
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) < self.concurrency and not (stop is not None and stop.is_set()):
                    req = next(source, None)
                    if req is None:
                        exhausted = True
                    else:
                        pending.add(asyncio.ensure_future(self.record_outcome(client, req, stop)))
                if not pending:
                    return
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                down: EndpointUnavailable | None = None
                for task in done:
                    try:
                        outcome = task.result()
                    except EndpointUnavailable as exc:
                        down = exc
                        continue
                    if outcome is not None:
                        yield outcome
                if down is not None:
                    raise down
        finally:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            if own:
                await client.aclose()

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        if self._headers is None:
            raise RuntimeError("engine 'openai': generate() called before load()")
        out: queue.Queue = queue.Queue()
        loop_box: dict[str, Any] = {}

        async def drive() -> None:
            loop_box["loop"] = asyncio.get_running_loop()
            loop_box["task"] = asyncio.current_task()
            async for outcome in self.agenerate(requests, stop):
                out.put(outcome)

        def run() -> None:
            try:
                asyncio.run(drive())
            except asyncio.CancelledError:
                pass
            except BaseException as exc:  # surfaced in the caller's thread
                out.put(exc)
            finally:
                out.put(_DONE)

        thread = threading.Thread(target=run, name="openai-engine", daemon=True)
        thread.start()
        finished = False
        try:
            while True:
                item = out.get()
                if item is _DONE:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not finished:
                # The caller stopped iterating: nobody will read further
                # outcomes, so cancel what is in flight instead of waiting.
                while thread.is_alive() and "task" not in loop_box:
                    time.sleep(0.01)  # the loop is still starting
                loop, task = loop_box.get("loop"), loop_box.get("task")
                if loop is not None and task is not None:
                    try:
                        loop.call_soon_threadsafe(task.cancel)
                    except RuntimeError:  # the loop closed meanwhile: nothing left to cancel
                        pass
            thread.join()


async def _sleep_unless(delay: float, stop: threading.Event | None) -> bool:
    """Sleep ``delay`` seconds; False (early) if ``stop`` gets set meanwhile."""
    deadline = time.monotonic() + delay
    while True:
        if stop is not None and stop.is_set():
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        await asyncio.sleep(min(left, 0.05))
