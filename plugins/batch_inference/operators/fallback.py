"""``FallbackPoolOperator``: re-drive what the batch left, through the synchronous pool.

A thin shell over :func:`batch_inference.fallback.run_fallback`. It runs after
``CutoffSensor`` in both of the sensor's outcomes. If the cutoff fired, it
claims the remaining shards through the ledger (transport ``fallback``) and
drives their records through an OpenAI-compatible endpoint at a sustained,
rate-limited pace. If the batch completed, nothing is outstanding and it
returns at once. Its return value (an XCom) is the run's measurements: rows
re-driven, sustained rate, overhead, and the ``bi.fallback_runs`` id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from batch_inference.hooks.connection import DEFAULT_CONN_ID, ledger_conninfo


class FallbackPoolOperator(BaseOperator):
    """Drive a job's outstanding records through the synchronous fallback pool.

    :param job_version: the job version (templated).
    :param base_url: OpenAI-compatible API root including ``/v1`` (templated); default
        ``spec.fallback.base_url``.
    :param postgres_conn_id: Airflow connection of the ledger database.
    :param rate: sustained requests/s for the whole pool, retries included (token bucket); default
        ``spec.fallback.rate``.
    :param concurrency: requests in flight across the pool; default ``spec.fallback.concurrency``.
    :param parallel_shards: shards the pool holds at once (each pool thread holds one).
    :param model: model name sent to the endpoint (templated); default ``spec.model.name``. It changes
        results, so anything but the job's pinned name is refused.
    :param style: ``json_schema`` (vLLM, OpenAI) or ``json_object`` (llama.cpp's server); default
        ``spec.fallback.response_format_style``.
    :param hosted: True marks the endpoint hosted (as ``spec.fallback.hosted`` does); otherwise the
        spec's ``endpoints`` and the address decide (``batch_inference.clearance``), never this flag.
        A record class not cleared for hosted APIs is refused before any request.
    :param api_key_env: name of the environment variable holding the API key (never the key).
    :param record_run: write the run's measured rate and overhead to ``bi.fallback_runs``.
    :param engine_options: extra options for the ``openai`` engine (``max_retries``, ``timeout_s``, ...).
    """

    template_fields: Sequence[str] = ("job_version", "base_url", "model")
    ui_color = "#f6b3a6"

    def __init__(self, *, job_version: str, base_url: str | None = None, postgres_conn_id: str = DEFAULT_CONN_ID,
                 rate: float | None = None, concurrency: int | None = None, parallel_shards: int = 4,
                 model: str | None = None, style: str | None = None, hosted: bool | None = None,
                 api_key_env: str | None = None, record_run: bool = True,
                 engine_options: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.job_version = job_version
        self.base_url = base_url
        self.postgres_conn_id = postgres_conn_id
        self.rate = rate
        self.concurrency = concurrency
        self.parallel_shards = parallel_shards
        self.model = model
        self.style = style
        self.hosted = hosted
        self.api_key_env = api_key_env
        self.record_run = record_run
        self.engine_options = engine_options
        self._pool: Any = None
        self._killed = False

    def execute(self, context: Any) -> dict[str, Any]:
        from batch_inference.fallback import FallbackIncomplete, FallbackRefused, run_fallback
        from batch_inference.status import UnknownJob

        def keep(pool: Any) -> None:
            self._pool = pool

        try:
            result = run_fallback(
                ledger_conninfo(self.postgres_conn_id), self.job_version, self.base_url or None, rate=self.rate,
                concurrency=self.concurrency, model=self.model or None, style=self.style or None, hosted=self.hosted,
                api_key_env=self.api_key_env, parallel_shards=self.parallel_shards, record_run=self.record_run,
                extra_engine_options=self.engine_options, pool_ready=keep)
        except (FallbackRefused, UnknownJob) as exc:
            raise AirflowFailException(str(exc)) from None  # configuration: retrying cannot help
        except FallbackIncomplete as exc:
            # Also FallbackEndpointUnavailable: the endpoint may be back by the
            # retry, and no record spent an attempt on the outage.
            raise AirflowException(str(exc)) from None  # a retry claims what is left
        if self._killed:
            raise AirflowException(f"fallback pool stopped from outside (the task was marked failed, cleared or "
                                   f"timed out) with {result.outstanding} record(s) outstanding; its shards "
                                   "were released")
        if result.stopped and result.outstanding:
            raise AirflowException(f"fallback pool stopped with {result.outstanding} record(s) outstanding")
        return result.to_dict()

    def on_kill(self) -> None:
        # Stop taking records, write what is in flight, release the leases,
        # so a retry (or the next try) claims the shards at once. Airflow then
        # returns into execute(), which fails the try.
        self._killed = True
        if self._pool is not None:
            self._pool.stop()
