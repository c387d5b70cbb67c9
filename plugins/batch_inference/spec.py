"""The job spec: what a job is, pinned.

A spec names the input source, the dataset it publishes to, the model by
weights digest, the prompt by version, decoding parameters and the output
schema. Everything that changes results goes into ``spec_hash``; the job
version is that hash combined with the identity of the input snapshot
(invariant I2: a change of any of them is a new version, never an update).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_DIGEST = re.compile(r"^(sha256:)?[0-9a-f]{64}$")


class SpecError(ValueError):
    """A spec that cannot be used; the message is one line naming the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Source(_Strict):
    """Where the records come from. Exactly one of ``table``, ``query``, ``s3_manifest``."""

    kind: Literal["postgres", "s3_manifest"] = "postgres"
    table: str | None = None
    query: str | None = None
    s3_manifest: str | None = Field(default=None, description="s3://bucket/key of a manifest listing JSONL object keys")
    id_column: str = "id"
    text_column: str = "text"
    acl_column: str | None = None
    conn_id: str | None = Field(default=None, description="Airflow connection for the source (postgres or aws)")

    @field_validator("table")
    @classmethod
    def _table_ident(cls, v: str | None) -> str | None:
        if v is not None and not _IDENT.match(v):
            raise ValueError("must be a plain identifier such as schema.table")
        return v

    @field_validator("id_column", "text_column", "acl_column")
    @classmethod
    def _col_ident(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", v):
            raise ValueError("must be a plain column name")
        return v

    @model_validator(mode="after")
    def _one_of(self) -> "Source":
        given = [n for n in ("table", "query", "s3_manifest") if getattr(self, n)]
        if self.kind == "postgres" and len([g for g in given if g != "s3_manifest"]) != 1:
            raise ValueError("a postgres source needs exactly one of 'table' or 'query'")
        if self.kind == "s3_manifest" and given != ["s3_manifest"]:
            raise ValueError("an s3_manifest source needs 's3_manifest' and no table or query")
        return self


class Model(_Strict):
    name: str = Field(min_length=1)
    digest: str = Field(description="sha256 of the weights file, or of every file of a model "
                        "directory (batch_inference.pinning), hex, optionally prefixed 'sha256:'")
    path: str | None = Field(default=None, description="weights file or directory; engines have defaults")
    code_files: list[str] = Field(default_factory=list, description="code files (*.py, *.so, ...) the model "
                                  "directory may hold, as paths relative to it; any other code file is refused")

    @field_validator("digest")
    @classmethod
    def _digest(cls, v: str) -> str:
        v = v.strip().lower()
        if not _DIGEST.match(v):
            raise ValueError("must be a sha256 hex digest (64 hex characters, optionally 'sha256:')")
        return v.removeprefix("sha256:")


class Engine(_Strict):
    name: str = Field(default="llama-cpp", description="llama-cpp, vllm, openai, noop, or a dotted path module:Class")
    options: dict[str, Any] = Field(default_factory=dict, description="engine options; those that change results "
                                    "join the job version (batch_inference.engines.pinned_options)")


_HOST = re.compile(r"^(\*\.)?[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?$|^[0-9a-f:.]*:[0-9a-f:.]*$")


class Endpoint(_Strict):
    """A declaration that an endpoint host is hosted (outside the company) or internal.

    ``host`` is a host name, an IP address, or ``*.domain`` (any name below
    ``domain``). Undeclared hosts follow ``batch_inference.clearance``:
    loopback and private addresses are internal, everything else is hosted.
    """

    host: str = Field(min_length=1, max_length=253)
    hosted: bool

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        v = v.strip().lower().removeprefix("[").removesuffix("]")
        if not _HOST.match(v):
            raise ValueError("must be a host name, an IP address or *.domain (no scheme, port or path)")
        if v.startswith("*.") and "." not in v[2:].rstrip("."):
            raise ValueError("a wildcard needs at least two labels after '*.' (e.g. *.corp.example)")
        return v.rstrip(".")



class Prompt(_Strict):
    version: str = Field(min_length=1)
    system: str = Field(min_length=1)
    template: str = Field(default="Record:\n<<<\n{text}\n>>>", description="user turn; must contain {text}")

    @field_validator("template")
    @classmethod
    def _has_text(cls, v: str) -> str:
        if "{text}" not in v:
            raise ValueError("must contain the placeholder {text}")
        return v


class Params(_Strict):
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    max_tokens: int = Field(default=256, ge=1, le=32768)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = 0


class Rule(_Strict):
    """A business rule a JSON schema cannot express, checked on every output."""

    field: str
    one_of: list[Any] | None = None
    max_length: int | None = None
    min_length: int | None = None
    not_empty: bool = False


class Validation(_Strict):
    max_dead_letter_rate: float = Field(default=0.01, ge=0.0, le=1.0)
    max_drift: float = Field(default=0.2, ge=0.0, le=1.0, description="total variation distance gate")
    sample_size: int = Field(default=200, ge=0)
    sample_seed: int = 0


class Cost(_Strict):
    batch_per_row: float = Field(default=0.003625, ge=0)
    fallback_per_row: float = Field(default=0.00725, ge=0)


class Fallback(_Strict):
    rate: float = Field(default=85.0, gt=0, description="sustained requests/s of the synchronous pool")
    overhead_s: float = Field(default=1800.0, ge=0, description="batch drain + reconcile + warehouse load")
    concurrency: int = Field(default=16, ge=1)
    base_url: str | None = None
    hosted: bool = Field(default=False, description="true: the fallback endpoint is hosted whatever its address; "
                         "false declares nothing (batch_inference.clearance decides)")
    response_format_style: Literal["json_object", "json_schema"] = Field(
        default="json_object", description="the openai engine's response_format_style for the fallback endpoint: "
        "json_object (llama.cpp's server) or json_schema (vLLM, OpenAI)")
    history_runs: int = Field(default=5, ge=0, description="derive rate/overhead from this many past runs")
    min_history_runs: int = Field(default=5, ge=1, description="complete fallback runs needed before history may "
                                                               "relax rate/overhead (fewer only tighten them)")


class JobSpec(_Strict):
    dataset: str
    source: Source
    model: Model
    engine: Engine = Field(default_factory=Engine)
    prompt: Prompt
    params: Params = Field(default_factory=Params)
    output_schema: dict[str, Any]
    rules: list[Rule] = Field(default_factory=list)
    category_field: str | None = Field(default="category", description="output field whose distribution is checked for drift")
    record_class: str = "internal"
    cleared_for_hosted: bool = False
    endpoints: list[Endpoint] = Field(default_factory=list, max_length=1000, description="hosts declared hosted or "
                                      "internal (batch_inference.clearance); not part of the job version")
    shard_size: int = Field(default=5000, ge=1, le=1_000_000)
    max_attempts: int = Field(default=3, ge=1, le=100)
    max_input_chars: int = Field(default=20_000, ge=1)
    lease_seconds: int = Field(default=600, ge=1)
    renew_seconds: float = Field(default=30.0, gt=0)
    incremental: bool = Field(default=False, description="reuse stored results of the same spec for unchanged records")
    validation: Validation = Field(default_factory=Validation)
    cost: Cost = Field(default_factory=Cost)
    fallback: Fallback = Field(default_factory=Fallback)

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, v: str) -> str:
        if not re.match(r"^[a-z_][a-z0-9_]{0,47}$", v):
            raise ValueError("must be lower-case letters, digits and underscores (at most 48), starting with a letter")
        return v

    @field_validator("output_schema")
    @classmethod
    def _schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        try:
            Draft202012Validator.check_schema(v)
        except SchemaError as exc:
            raise ValueError(f"not a valid JSON schema: {exc.message}") from None
        if v.get("type") != "object":
            raise ValueError("must describe a JSON object (type: object)")
        return v

    @model_validator(mode="after")
    def _renew_below_lease(self) -> "JobSpec":
        if self.renew_seconds >= self.lease_seconds:
            raise ValueError("renew_seconds must be shorter than lease_seconds")
        return self

    # -- identity ---------------------------------------------------------
    def result_defining(self) -> dict[str, Any]:
        """The fields that change results. Sharding and leases do not; of the
        engine, only the options that change results do, and only when the
        spec sets any, so a spec without them keeps its version."""
        from batch_inference.engines import pinned_options

        out = {
            "model": {"name": self.model.name, "digest": self.model.digest},
            "prompt": self.prompt.model_dump(),
            "params": self.params.model_dump(),
            "output_schema": self.output_schema,
            "rules": [r.model_dump() for r in self.rules],
            "max_input_chars": self.max_input_chars,
        }
        pinned = pinned_options(self.engine.name, self.engine.options)
        if pinned:
            out["engine"] = {"name": self.engine.name, "options": pinned}
        return out

    @property
    def spec_hash(self) -> str:
        return _sha(_canonical(self.result_defining()))

    def job_version(self, snapshot_identity: str) -> str:
        """``jv_`` + 16 hex characters: the spec hash bound to one input snapshot."""
        return "jv_" + _sha(self.spec_hash + ":" + snapshot_identity)[:16]

    def to_json(self) -> str:
        return self.model_dump_json()


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    more = len(exc.errors()) - 1
    return f"spec field '{where}': {msg}" + (f" (and {more} more)" if more else "")


def parse_spec(data: Any) -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(f"spec must be a mapping, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_first_error(exc)) from None


def load_spec(path: str | Path) -> JobSpec:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read spec {p}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"spec {p} is not UTF-8 text") from None
    return loads_spec(text, name=str(p))


def loads_spec(text: str, name: str = "<spec>") -> JobSpec:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise SpecError(f"{name}: malformed YAML{where}: {problem}") from None
    return parse_spec(data)
