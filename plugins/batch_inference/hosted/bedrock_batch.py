"""``bedrock-batch``: Amazon Bedrock batch inference (``CreateModelInvocationJob``) through boto3.

The shard's requests go to S3 as one JSONL object (``input_s3_uri`` prefix,
``{key}.jsonl``), one line per record: ``recordId`` (the record id, hashed
when it does not fit ``[A-Za-z0-9_-]{1,64}``, as for Anthropic) and
``modelInput``, the InvokeModel body of an Anthropic model on Bedrock
(``anthropic_version``, the system turn as ``system``, the user turn,
``max_tokens``, the output schema as ``output_config.format`` unless
``structured_output`` is false). The job is created with the idempotency key
as ``clientRequestToken`` and ``jobName``: a create repeated with the same
token does not start a second job, and an unconfirmed intent is found by
listing jobs submitted since it and matching the token.

Progress comes from the job's ``totalRecordCount`` / ``processedRecordCount``
/ ``successRecordCount`` / ``errorRecordCount``. Ended states: Completed,
PartiallyCompleted (the timeout ran out: what finished is in the output),
Stopped (our cancel: ``StopModelInvocationJob``), Expired (never started),
Failed. Results are the ``.jsonl.out`` objects under the output prefix
(``modelOutput``, or ``error.errorCode`` / ``errorMessage``: a 4xx is the
record's fault, anything else spends nothing; usage from each
``modelOutput``; ``manifest.json.out`` is not read). After reconciliation the input object and
the job's output objects are deleted.

Clients: the amazon provider's ``AwsBaseHook`` when ``aws_conn_id`` names an
Airflow connection, else boto3's own credential chain; ``region``,
``endpoint_url`` (the Bedrock control plane) and ``s3_endpoint_url`` for
S3-compatible stores and emulators.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from batch_inference.engines import TRUNCATED, Request
from batch_inference.exceptions import InvalidValue
from batch_inference.hosted.anthropic_batch import custom_id, message_params
from batch_inference.hosted.core import (
    CLOCK_SKEW_S, ERRORED, SUCCEEDED, TRANSPORT, BatchStatus, HostedBatchEngine, Item, Provider, jsonl_objects,
)
from batch_inference.sources import parse_s3_url, s3_client
from batch_inference.spec import ENGINE_RESULT_OPTIONS

ENDED = frozenset({"Completed", "PartiallyCompleted", "Stopped", "Expired", "Failed"})
ANTHROPIC_VERSION = "bedrock-2023-05-31"


class BedrockJobs(Provider):
    name = "bedrock"

    def connect(self) -> None:
        e = self.engine
        conn_id = e.option("aws_conn_id")
        if conn_id:
            from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

            hook = AwsBaseHook(aws_conn_id=str(conn_id), client_type="bedrock", region_name=e.region)
            self.bedrock = hook.get_session(region_name=e.region).client(
                "bedrock", region_name=e.region, endpoint_url=e.option("endpoint_url"), config=hook.config)
        else:
            import boto3

            self.bedrock = boto3.session.Session().client("bedrock", region_name=e.region,
                                                          endpoint_url=e.option("endpoint_url"))
        self.s3 = s3_client(str(conn_id) if conn_id else None, e.option("s3_endpoint_url"))

    def custom_id(self, record_id: str) -> str:
        return custom_id(record_id)

    def line(self, req: Request) -> dict[str, Any]:
        e = self.engine
        return {"recordId": custom_id(req.record_id),
                "modelInput": {"anthropic_version": ANTHROPIC_VERSION,
                               **message_params(e.spec, req.messages, e.structured_output)}}

    def _input_uri(self, key: str) -> str:
        return f"{self.engine.input_prefix.rstrip('/')}/{key}.jsonl"

    def submit(self, key: str, requests: Sequence[Request]) -> tuple[str, str | None]:
        e = self.engine
        uri = self._input_uri(key)
        bucket, obj = parse_s3_url(uri)
        data = "".join(json.dumps(self.line(r), ensure_ascii=False) + "\n" for r in requests).encode()
        self.s3.put_object(Bucket=bucket, Key=obj, Body=data)
        r = self.bedrock.create_model_invocation_job(
            jobName=key, roleArn=e.role_arn, clientRequestToken=key, modelId=e.model,
            inputDataConfig={"s3InputDataConfig": {"s3InputFormat": "JSONL", "s3Uri": uri}},
            outputDataConfig={"s3OutputDataConfig": {"s3Uri": e.output_prefix}},
            timeoutDurationInHours=e.timeout_hours)
        return r["jobArn"], uri

    def transient(self, exc: BaseException) -> bool:
        from botocore.exceptions import ClientError, ConnectionError, ReadTimeoutError

        if isinstance(exc, (ConnectionError, ReadTimeoutError)):
            return True
        return isinstance(exc, ClientError) and (
            exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500
            or exc.response.get("Error", {}).get("Code") == "ThrottlingException")

    def find(self, key: str, custom_ids: Sequence[str], since: float) -> str | None:
        after = datetime.fromtimestamp(since, timezone.utc) - timedelta(seconds=CLOCK_SKEW_S)
        kwargs: dict[str, Any] = {"submitTimeAfter": after, "nameContains": key, "maxResults": 100}
        while True:
            page = self.bedrock.list_model_invocation_jobs(**kwargs)
            for job in page.get("invocationJobSummaries", []):
                if job.get("clientRequestToken") == key:
                    return job["jobArn"]
            if not page.get("nextToken"):
                return None
            kwargs["nextToken"] = page["nextToken"]

    def status(self, batch_id: str) -> BatchStatus:
        j = self.bedrock.get_model_invocation_job(jobIdentifier=batch_id)
        total = int(j.get("totalRecordCount") or 0)
        done = int(j.get("successRecordCount") or 0)
        failed = int(j.get("errorRecordCount") or 0)
        ended = j["status"] in ENDED
        return BatchStatus(status=j["status"], ended=ended, total=total,
                           processing=0 if ended else max(0, total - done - failed), succeeded=done, errored=failed,
                           failed=j["status"] in ("Failed", "Expired"))

    def cancel(self, batch_id: str) -> None:
        self.bedrock.stop_model_invocation_job(jobIdentifier=batch_id)

    def _outputs(self, batch_id: str) -> tuple[str, list[str]]:
        bucket, prefix = parse_s3_url(self.engine.output_prefix.rstrip("/") + "/" + batch_id.rsplit("/", 1)[-1])
        keys: list[str] = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            keys += [o["Key"] for o in page.get("Contents", [])]
        return bucket, keys

    def results(self, batch_id: str) -> Iterator[Item]:
        bucket, keys = self._outputs(batch_id)
        for k in keys:
            if k.endswith(".jsonl.out"):
                data = self.s3.get_object(Bucket=bucket, Key=k)["Body"].read().decode()
                for rec in jsonl_objects(data):
                    yield parse_record(rec)

    def cleanup(self, batch_id: str, input_ref: str | None) -> None:
        bucket, keys = self._outputs(batch_id)
        for k in keys:
            self.s3.delete_object(Bucket=bucket, Key=k)
        if input_ref:
            ib, ik = parse_s3_url(input_ref)
            self.s3.delete_object(Bucket=ib, Key=ik)


def parse_record(rec: dict[str, Any]) -> Item:
    """One line of a ``.jsonl.out`` output object."""
    rid = str(rec.get("recordId"))
    err = rec.get("error")
    if err:
        code = int(err.get("errorCode") or 0)
        reason = f"{code}: {err.get('errorMessage', '')}"[:300]
        return Item(rid, ERRORED if 400 <= code < 500 and code != 429 else TRANSPORT, error=reason)
    out = rec.get("modelOutput") or {}
    text = "".join(b.get("text", "") for b in out.get("content", []) if b.get("type") == "text")
    usage = out.get("usage") or {}
    return Item(rid, SUCCEEDED, text=text, error=TRUNCATED if out.get("stop_reason") == "max_tokens" else None,
                tokens_out=int(usage.get("output_tokens") or 0), tokens_in=int(usage.get("input_tokens") or 0))


class BedrockBatchEngine(HostedBatchEngine):
    name = "bedrock-batch"
    provider_class = BedrockJobs
    option_names = HostedBatchEngine.common_options | {
        "region", "endpoint_url", "s3_endpoint_url", "aws_conn_id", "role_arn", "input_s3_uri", "output_s3_uri",
        "timeout_hours", "structured_output"}
    result_options = frozenset(ENGINE_RESULT_OPTIONS["bedrock-batch"])

    def __init__(self, spec, options=None):
        super().__init__(spec, options)
        for required in ("role_arn", "input_s3_uri", "output_s3_uri"):
            if not self.option(required):
                raise InvalidValue(f"engine 'bedrock-batch': option '{required}' is required")
        self.role_arn = str(self.option("role_arn"))
        self.input_prefix = str(self.option("input_s3_uri"))
        self.output_prefix = str(self.option("output_s3_uri"))
        parse_s3_url(self.input_prefix.rstrip("/") + "/x")
        parse_s3_url(self.output_prefix.rstrip("/") + "/x")
        self.timeout_hours = int(self.option("timeout_hours", 24))
        self.structured_output = bool(self.option("structured_output", True))

    @property
    def region(self) -> str:
        return str(self.option("region", "us-east-1"))

    def clearance_url(self) -> str | None:
        return self.option("endpoint_url") or f"https://bedrock.{self.region}.amazonaws.com"
