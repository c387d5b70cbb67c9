"""The job spec: what a job is, pinned.

A spec names the input source, the dataset it publishes to, the model by
weights digest, the prompt by version, decoding parameters and the output
schema. Everything that changes results goes into ``spec_hash``; the job
version is that hash combined with the dataset and the identity of the input
snapshot (invariant I2: a change of any of them is a new version, never an
update).

Every limit is checked here, once, for a spec from a file, a dict or a
spec with overrides (``with_overrides``): YAML aliases are refused, nesting
and sizes are bounded, no string may hold a NUL or a lone surrogate (the
database cannot store either), and numbers stay inside what the ledger's
columns hold.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from batch_inference.exceptions import SpecError

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$")
_DIGEST = re.compile(r"^(sha256:)?[0-9a-f]{64}$")
_ENGINE_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*[:.][A-Za-z_][A-Za-z0-9_]*$")
_TABLE_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}(\.[a-z_][a-z0-9_]{0,62})+$")

INT4_MAX = 2**31 - 1            # integer columns and function arguments in the ledger
MAX_SPEC_CHARS = 1_000_000      # a spec file; the system prompt is most of a large one
MAX_DEPTH = 32                  # nesting of mappings and lists, output_schema included
MAX_NODES = 100_000             # values in the whole spec
MAX_NAME = 256                  # names and versions (model, prompt, engine, connection)
MAX_TEXT = 200_000              # prompt.system, prompt.template, source.query
MAX_LEASE_SECONDS = 7 * 86_400  # a lease is renewed every renew_seconds; a week is past any use
PG_IDENT_BYTES = 63             # a PostgreSQL identifier: output properties become view columns
STORED_KEY = "stored"           # validation context of a spec read back from the ledger (stored_spec)

# The options of each built-in engine (batch_inference.engines.BUILTIN_ENGINES)
# that change results: set in a spec they join the job version
# (pinned_options). Each engine class's ``result_options`` is its entry here,
# so the spec reads them without importing an engine.
ENGINE_RESULT_OPTIONS: dict[str, tuple[str, ...]] = {
    "llama-cpp": ("n_ctx", "chat_format"),
    "vllm": ("dtype", "quantization", "max_model_len", "trust_remote_code", "tokenizer_mode", "kv_cache_dtype",
             "hf_overrides", "generation_config", "override_generation_config", "seed"),
    "openai": ("model", "extra_body"),
    "noop": (),
    "ladder": (),   # a model ladder (``models:``): each rung's engine pins its own options
    "openai-batch": ("model", "extra_body"),
    "anthropic-batch": ("model",),
    "bedrock-batch": ("model",),
    "gemini-batch": ("model",),
    "openai-tiers": ("model", "extra_body"),
}


# The built-in engines that return the token log-probabilities of their answer
# (``Outcome.logprobs``): a ladder's ``confidence: logprobs`` needs one on every
# rung below the top (batch_inference.ladder). A dotted-path engine says so with
# its class attribute ``gives_logprobs``.
ENGINES_WITH_LOGPROBS: frozenset[str] = frozenset({"llama-cpp", "openai", "vllm"})


def pinned_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options of engine ``name`` that change results: they join the job version.

    A built-in engine's are in ``ENGINE_RESULT_OPTIONS``; a dotted-path
    engine is not imported to find out, so all its options count.
    """
    keys = ENGINE_RESULT_OPTIONS.get(name, options)
    return {k: options[k] for k in sorted(keys) if options.get(k) is not None}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


MAX_COLUMNS = 64               # source.columns: the columns a prompt may name
_COLUMN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_IDENT3 = re.compile(r"^[A-Za-z_][A-Za-z0-9_$-]{0,127}(\.[A-Za-z_][A-Za-z0-9_$]{0,127}){0,2}$")
PLACEHOLDER_NAME = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]{0,62})\}")   # {text}, {subject}: what a template fills
# What each kind reads: the fields it needs (one of) and the fields it may not have
# (batch_inference.sources has one module per kind).
SOURCE_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "postgres": (("table", "query"), ("s3_manifest", "paths", "identifier")),
    "s3_manifest": (("s3_manifest",), ("table", "query", "paths", "identifier")),
    "sql": (("table", "query"), ("s3_manifest", "paths", "identifier")),
    "parquet": (("paths",), ("table", "query", "s3_manifest", "identifier")),
    "iceberg": (("identifier",), ("table", "query", "s3_manifest", "paths")),
}


class Source(_Strict):
    """Where the records come from (``batch_inference.sources``, one module per kind).

    ``postgres``: a table or one SELECT in the ledger's database. ``s3_manifest``:
    JSON Lines objects listed in a manifest. ``sql``: a table or one SELECT
    through any Airflow connection whose hook is a common-sql ``DbApiHook``.
    ``parquet``: files or prefixes, local or on S3. ``iceberg``: a table at a
    snapshot. A record is ``text_column``, or the several ``columns`` the
    template names. Nothing here is part of the job version: the rows are
    (their content hash is the snapshot identity)."""

    kind: Literal["postgres", "s3_manifest", "sql", "parquet", "iceberg"] = "postgres"
    table: str | None = None
    query: str | None = Field(default=None, max_length=MAX_TEXT,
                              description="one SELECT, run read-only (postgres: inside the submit's transaction, "
                              "snapshot.materialize_query; sql: in a read-only transaction of the connection)")
    s3_manifest: str | None = Field(default=None, max_length=2048,
                                    description="s3://bucket/key of a manifest listing JSONL object keys")
    paths: list[Any] | None = Field(default=None, max_length=100_000, description="parquet: files or prefixes "
                                    "(local paths or s3://bucket/key); an entry {path, etag, version_id, size} "
                                    "pins one file, as submit records every file it read")
    identifier: str | None = Field(default=None, max_length=200, description="iceberg: namespace.table")
    catalog: "IcebergCatalog | None" = Field(default=None, description="iceberg: the catalog, as the Iceberg "
                                             "destination names it (default: the SQL catalog in the ledger)")
    warehouse: str | None = Field(default=None, max_length=2048, description="iceberg: the catalog's warehouse")
    snapshot_id: int | None = Field(default=None, description="iceberg: the snapshot to read (default: the "
                                    "current one, recorded with the job at submit)")
    row_filter: str | None = Field(default=None, max_length=MAX_TEXT, description="iceberg: a pyiceberg row "
                                   "filter expression")
    as_of: str | None = Field(default=None, max_length=64, description="sql: a time-travel timestamp (ISO 8601) "
                              "for Snowflake (AT) and BigQuery (FOR SYSTEM_TIME AS OF)")
    s3_endpoint: str | None = Field(default=None, max_length=2048, description="parquet/iceberg: an "
                                    "S3-compatible endpoint URL (else the connection's endpoint_url)")
    id_column: str = "id"
    text_column: str = "text"
    columns: list[str] | None = Field(default=None, min_length=1, max_length=MAX_COLUMNS, description="the "
                                      "columns a record is made of; the template names each ({subject}, {body}); "
                                      "instead of text_column")
    acl_column: str | None = None
    conn_id: str | None = Field(default=None, max_length=250,
                                description="Airflow connection for the source (postgres, aws, or any "
                                "common-sql DbApiHook for kind sql); a name, never a credential")

    @field_validator("table")
    @classmethod
    def _table_ident(cls, v: str | None, info: ValidationInfo | None = None) -> str | None:
        if v is None:
            return v
        if info is not None and info.data.get("kind") == "sql":   # database.schema.table, project.dataset.table
            if not _IDENT3.match(v):
                raise ValueError("must be a plain identifier such as schema.table or database.schema.table")
        elif not _IDENT.match(v):
            raise ValueError("must be a plain identifier such as schema.table")
        return v

    @field_validator("query")
    @classmethod
    def _one_trailing_semicolon(cls, v: str | None) -> str | None:
        """One rule for every kind: a query may end with one ``;``, which is not sent (the servers'
        single-statement paths take no terminator); anything after a ``;`` is a second statement."""
        if v is None:
            return v
        text = v.rstrip()
        return text[:-1].rstrip() if text.endswith(";") else text

    @field_validator("id_column", "text_column", "acl_column")
    @classmethod
    def _col_ident(cls, v: str | None) -> str | None:
        if v is not None and not _COLUMN.match(v):
            raise ValueError("must be a plain column name (at most 63 characters)")
        return v

    @field_validator("columns")
    @classmethod
    def _columns(cls, v: list[str] | None) -> list[str] | None:
        for c in v or ():
            if not _COLUMN.match(c):
                raise ValueError(f"{c[:40]!r} must be a plain column name (at most 63 characters)")
        if v is not None and len(set(v)) != len(v):
            raise ValueError("each column may be named once")
        return v

    @field_validator("identifier")
    @classmethod
    def _identifier(cls, v: str | None) -> str | None:
        if v is not None and not _TABLE_IDENT.match(v):
            raise ValueError("must be namespace.table in lower-case letters, digits and underscores")
        return v

    @field_validator("paths")
    @classmethod
    def _paths(cls, v: list[Any] | None) -> list[Any] | None:
        for i, p in enumerate(v or ()):
            path = p.get("path") if isinstance(p, dict) else p
            if not isinstance(path, str) or not path or (isinstance(p, dict) and set(p) - {
                    "path", "etag", "version_id", "size", "mtime_ns"}):
                raise ValueError(f"entry {i}: a path, or {{path, etag, version_id, size, mtime_ns}}")
            if "://" in path and "@" in path.split("://", 1)[1].split("/", 1)[0]:
                raise ValueError(f"entry {i}: must not hold credentials")
        if v is not None and not v:
            raise ValueError("must name at least one file or prefix")
        return v

    @model_validator(mode="after")
    def _one_of(self) -> "Source":
        if self.kind == "postgres":   # the messages of the first two kinds, as they always were
            if len([n for n in ("table", "query") if getattr(self, n)]) != 1:
                raise ValueError("a postgres source needs exactly one of 'table' or 'query'")
        if self.kind == "s3_manifest":
            if [n for n in ("table", "query", "s3_manifest") if getattr(self, n)] != ["s3_manifest"]:
                raise ValueError("an s3_manifest source needs 's3_manifest' and no table or query")
        need, refused = SOURCE_KINDS[self.kind]
        given = [n for n in need if getattr(self, n)]
        if len(given) != 1:
            raise ValueError(f"a {self.kind} source needs exactly one of " + " or ".join(map(repr, need)))
        extra = [n for n in refused if getattr(self, n)]
        if extra:
            raise ValueError(f"a {self.kind} source does not read {', '.join(map(repr, extra))}")
        if self.kind == "sql" and not self.conn_id:
            raise ValueError("a sql source needs conn_id: the Airflow connection it reads through")
        kind_only = {"as_of": "sql", "snapshot_id": "iceberg", "row_filter": "iceberg", "catalog": "iceberg",
                     "warehouse": "iceberg"}
        for name, kind in kind_only.items():
            if getattr(self, name) is not None and self.kind != kind:
                raise ValueError(f"{name!r} is for a {kind} source")
        return self

    @property
    def label(self) -> str:
        """The source as one line's errors name it."""
        if self.kind in ("postgres", "s3_manifest"):
            return self.table or self.s3_manifest or "query"
        if self.kind == "sql":
            return f"{self.table or 'query'} (connection {self.conn_id})"
        if self.kind == "parquet":
            first = self.paths[0] if self.paths else ""
            first = first.get("path", "") if isinstance(first, dict) else first
            return f"parquet {first}" + (f" (+{len(self.paths) - 1} more)" if self.paths and len(self.paths) > 1
                                         else "")
        return f"iceberg {self.identifier}" + (f"@{self.snapshot_id}" if self.snapshot_id is not None else "")

    @property
    def record_columns(self) -> list[str]:
        """The columns a record is made of: ``columns``, else ``[text_column]``."""
        return list(self.columns) if self.columns else [self.text_column]


class Model(_Strict):
    name: str = Field(min_length=1, max_length=MAX_NAME)
    digest: str = Field(max_length=80, description="sha256 of the weights file, or of every file of a model "
                        "directory (batch_inference.pinning), hex, optionally prefixed 'sha256:'")
    path: str | None = Field(default=None, max_length=4096, description="weights file or directory; engines have defaults")
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
    name: str = Field(default="llama-cpp", min_length=1, max_length=MAX_NAME,
                      description="llama-cpp, vllm, openai, noop, openai-batch, anthropic-batch, bedrock-batch, "
                                  "gemini-batch, "
                                  "or a dotted path module:Class")
    options: dict[str, Any] = Field(default_factory=dict, description="engine options; those that change results "
                                    "join the job version (batch_inference.spec.pinned_options)")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        # Checked at submit, not first in a worker: a built-in name, or the form of a dotted path (its
        # module is imported only where the engine runs: batch_inference.engines.engine_class).
        # A built-in's name spelt with a dot or an underscore (``llama.cpp``, as prose writes it) has a dotted
        # path's form but means the built-in: refused with its name, not imported as module ``llama``.
        spelt = re.sub(r"[._\s]+", "-", v.strip().lower())
        if v in ENGINE_RESULT_OPTIONS or (_ENGINE_PATH.match(v) and spelt not in ENGINE_RESULT_OPTIONS):
            return v
        # A ladder is spelt models:, not named; openai-tiers is the fallback pool's engine for fallback.tiers.
        named = [n for n in ENGINE_RESULT_OPTIONS if n not in ("ladder", "openai-tiers")]
        near = [spelt] if spelt in ENGINE_RESULT_OPTIONS else \
            difflib.get_close_matches(spelt, named, n=1, cutoff=0.6)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ValueError(f"unknown engine '{v}': {hint}use one of {', '.join(named)}, or a dotted "
                         "path package.module:ClassName")


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
    version: str = Field(min_length=1, max_length=MAX_NAME)
    # Required; an embedding job (task: embed) has no system turn, and may leave it out (JobSpec._task_fields).
    system: str | None = Field(min_length=1, max_length=MAX_TEXT)
    template: str = Field(default="Record:\n<<<\n{text}\n>>>", max_length=MAX_TEXT,
                          description="user turn; must contain {text}, or name each of source.columns "
                          "({subject}, {body})")

    @field_validator("template")
    @classmethod
    def _has_text(cls, v: str) -> str:
        if "{text}" not in v and not PLACEHOLDER_NAME.search(v):
            raise ValueError("must contain the placeholder {text}")
        return v


class Params(_Strict):
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    max_tokens: int = Field(default=256, ge=1, le=32768)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=0, ge=0, le=INT4_MAX)


class Rule(_Strict):
    """A business rule a JSON schema cannot express, checked on every output."""

    field: str = Field(min_length=1, max_length=MAX_NAME)
    one_of: list[Any] | None = None
    max_length: int | None = Field(default=None, ge=0, le=INT4_MAX)
    min_length: int | None = Field(default=None, ge=0, le=INT4_MAX)
    not_empty: bool = False


class Validation(_Strict):
    max_dead_letter_rate: float = Field(default=0.01, ge=0.0, le=1.0)
    max_drift: float = Field(default=0.2, ge=0.0, le=1.0, description="total variation distance gate (task "
                             "embed: the share of nearest neighbours that changed, batch_inference.embed)")
    max_norm_error: float = Field(default=1e-3, gt=0.0, le=1.0, description="task embed with normalize: how far "
                                  "a stored vector's norm may be from 1")
    sample_size: int = Field(default=200, ge=0, le=100_000)
    sample_seed: int = Field(default=0, ge=-INT4_MAX, le=INT4_MAX)


class Cost(_Strict):
    batch_per_row: float = Field(default=0.003625, ge=0, le=1_000)
    fallback_per_row: float = Field(default=0.00725, ge=0, le=1_000)
    hosted_batch_per_row: float | None = Field(default=None, ge=0, le=1_000,
                                               description="a hosted batch API's row; default half of fallback_per_row")
    hosted_batch_per_m_input_tokens: float | None = Field(default=None, ge=0, le=1_000_000, description=(
        "with the output price: hosted batch rows priced from the provider's reported usage"))
    hosted_batch_per_m_output_tokens: float | None = Field(default=None, ge=0, le=1_000_000)
    # Our own batch workers cost GPU time, not rows: with a GPU-hour price set, their rows are
    # billed by the GPU-hours the launchers record (bi.fleet_observed) instead of batch_per_row.
    gpu_hour_spot: float | None = Field(default=None, ge=0, le=100_000, description="a batch worker's GPU-hour "
                                        "on spot capacity (the seed's $3.50); set: own rows are billed by GPU-hours")
    gpu_hour_on_demand: float | None = Field(default=None, ge=0, le=100_000,
                                             description="a batch worker's GPU-hour on on-demand capacity")
    capacity: Literal["spot", "on_demand"] = Field(default="spot", description="which GPU-hour price the batch "
                                                   "workers pay (the other is used when only it is set)")
    min_workers: int = Field(default=1, ge=0, le=10_000, description="the autopilot never runs fewer batch workers")
    max_workers: int = Field(default=8, ge=1, le=10_000, description="the autopilot never runs more batch workers")
    budget: float | None = Field(default=None, gt=0, le=1_000_000_000, description="dollars: no option whose "
                                 "projected bill is over it is chosen (batch_inference.autopilot), and the "
                                 "fallback pool checks it before it spends (batch_inference.fallback)")
    on_budget: Literal["page", "spend"] = Field(default="page", description="when meeting the deadline would "
                                                "exceed the budget: page and keep within it (the fallback pool "
                                                "stops at it), or spend and page")

    @model_validator(mode="after")
    def _worker_bounds(self) -> "Cost":
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) is more than max_workers ({self.max_workers})")
        return self


class Autopilot(_Strict):
    """The batch fleet's size, decided at every poll of the cutoff watch (batch_inference.autopilot).

    Not part of the job version: it changes when rows are produced and what they cost, never
    what they are."""

    enabled: bool = False
    margin_s: float = Field(default=600.0, ge=0, le=MAX_LEASE_SECONDS, description="the batch must be projected "
                            "to finish this long before the cutoff (deadline less the fallback overhead)")
    start_s: float = Field(default=300.0, ge=0, le=MAX_LEASE_SECONDS, description="an added worker's start-up "
                           "before its first row (a GPU node and the model's load)")
    cooldown_s: float = Field(default=900.0, ge=0, le=MAX_LEASE_SECONDS, description="no worker is removed this "
                              "soon after the last change of size")
    window_s: float = Field(default=900.0, gt=0, le=MAX_LEASE_SECONDS, description="per-worker throughput is "
                            "measured over the polls of this last window")


class GoldenSet(_Strict):
    """Records with expected outputs: a table of (id, text, expected) rows (batch_inference.evaluation)."""

    table: str = Field(description="schema.table holding the golden records")
    id_column: str = "id"
    text_column: str = "text"
    expected_column: str = Field(default="expected", description="the expected output: a JSON object (jsonb or "
                                 "JSON text) with some or all of the output's top-level fields")
    run: Literal["auto", "join", "engine"] = Field(
        default="auto", description="join: grade the job's own results (every golden record is in its snapshot "
        "with the same text); engine: run the job's engine over the golden records under a companion job "
        "version; auto: join when it can, else engine")

    _table = field_validator("table")(Source._table_ident.__func__)
    _cols = field_validator("id_column", "text_column", "expected_column")(Source._col_ident.__func__)


class FieldGrader(_Strict):
    grader: Literal["exact", "normalized", "similarity"] = Field(
        description="exact: equal values; normalized: equal after case folding and collapsing punctuation and "
        "white space; similarity: normalized texts at least min_similarity alike (difflib ratio)")
    min_similarity: float = Field(default=0.8, ge=0.0, le=1.0)


class Judge(_Strict):
    """A second engine that grades a sample of the outputs with a rubric; its verdicts are a companion job."""

    model: Model
    engine: Engine
    rubric: str = Field(min_length=1, max_length=MAX_TEXT, description="the judge's system prompt: what a right "
                        "answer is; it answers {verdict: right|wrong, reason}")
    params: Params = Field(default_factory=lambda: Params(max_tokens=96))
    cost: Cost = Field(default_factory=Cost, description="the judge engine's price per row (batch_inference.cost)")
    sample_size: int = Field(default=20, ge=1, le=100_000, description="rows of the review sample it grades")
    min_agreement: float | None = Field(default=None, ge=0.0, le=1.0,
                                        description="gate: the share of graded rows the judge calls right")


class Review(_Strict):
    """The human sign-off on the review sample, checked at publish (bi.review_gate_problem_v1)."""

    min_reviewed: int = Field(default=0, ge=0, le=100_000, description="sample rows a person must have reviewed")
    min_right: float = Field(default=0.0, ge=0.0, le=1.0, description="share of reviewed rows marked right")


class Evaluation(_Strict):
    """Correctness gates (batch_inference.evaluation). None of it changes results, so none of it joins the
    job version: the golden run and the judge are companion job versions with versions of their own."""

    golden: GoldenSet | None = None
    graders: dict[str, FieldGrader] = Field(default_factory=dict, description="per output field; default: exact "
                                            "for enums, numbers and booleans, normalized for other strings")
    min_accuracy: dict[str, float] = Field(default_factory=dict, description="gate: per output field, the least "
                                           "share of golden records graded right")
    judge: Judge | None = None
    review: Review = Field(default_factory=Review)
    pairs: "GoldenPairs | None" = Field(default=None, description="task embed: record pairs that must be near "
                                        "each other (recall@k, batch_inference.embed)")

    @field_validator("min_accuracy")
    @classmethod
    def _shares(cls, v: dict[str, float]) -> dict[str, float]:
        for name, share in v.items():
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{name}: an accuracy is a share between 0 and 1, not {share}")
        return v

    @model_validator(mode="after")
    def _needs_golden(self) -> "Evaluation":
        if self.min_accuracy and self.golden is None:
            raise ValueError("min_accuracy needs a golden set (evaluation.golden)")
        return self


class Rung(_Strict):
    """One rung of a model ladder (``JobSpec.models``, cheapest first; batch_inference.ladder)."""

    model: Model
    engine: Engine = Field(default_factory=Engine)
    params: Params = Field(default_factory=Params)
    threshold: float | None = Field(default=None, ge=0.0, le=1.0, description="an answer of this rung is kept "
                                    "when it is valid and its confidence is at least this; None (not calibrated): "
                                    "every record goes on to the next rung. The top rung keeps every valid answer")
    cost_per_row: float = Field(ge=0, le=1_000, description="dollars per record answered at this rung (one sample)")
    output_schema: dict[str, Any] | None = Field(default=None, description="the rung's output schema when "
                                                 "written out: it must equal the spec's output_schema")


class Ladder(_Strict):
    """How a model ladder judges its answers and what calibrate aims for (batch_inference.ladder)."""

    confidence: Literal["logprobs", "agreement"] = Field(
        default="logprobs", description="logprobs: the engine's token log-probabilities of the constrained answer "
        "(exp of their mean); agreement: the share of `samples` answers (seeds seed..seed+k-1) that agree")
    samples: int = Field(default=3, ge=2, le=32, description="agreement: answers per record at a rung")
    fields: list[str] = Field(default_factory=list, max_length=64, description="agreement: the output fields "
                              "compared (default: category_field, else the whole answer)")
    target: float = Field(default=0.98, gt=0.0, le=1.0, description="calibrate: the least share of the top "
                          "rung's golden accuracy the cascade keeps")


# The built-in engines with an embedding mode (task: embed; batch_inference.embed.engines).
EMBEDDING_ENGINES = ("llama-cpp", "vllm", "openai", "openai-batch")
MAX_DIMENSIONS = 16_000   # pgvector's vector type holds at most 16,000 dimensions


class Embedding(_Strict):
    """What an embedding job (``task: embed``) stores for each record: one vector (batch_inference.embed).

    All of it joins the job version."""

    dimensions: int = Field(ge=1, le=MAX_DIMENSIONS, description="the model's embedding size: every vector has "
                            "exactly this many values (a model of another size is refused at submit)")
    normalize: bool = Field(default=True, description="store unit vectors (cosine distance = 1 - dot product)")
    instruction: str = Field(default="", max_length=MAX_TEXT, description="text put before every rendered "
                             "record, such as 'passage: ' (the model's instruction prefix)")
    pooling: Literal["mean", "cls", "last"] = Field(default="mean", description="how the model's token states "
                                                    "become one vector (llama.cpp's and vLLM's pooling type)")


class GoldenPairs(_Strict):
    """Record pairs that must be near each other in an embedding job: a table of (left, right) record ids."""

    table: str = Field(description="schema.table holding the pairs")
    left_column: str = "left_id"
    right_column: str = "right_id"
    k: int = Field(default=10, ge=1, le=1000, description="right must be among left's k nearest neighbours")
    min_recall: float | None = Field(default=None, ge=0.0, le=1.0, description="gate: the share of pairs found")

    _table = field_validator("table")(Source._table_ident.__func__)
    _cols = field_validator("left_column", "right_column")(Source._col_ident.__func__)


# The price tiers a synchronous endpoint of each provider sells, as its API names them (OpenAI's
# ``service_tier``; Gemini's ``ServiceTier``, checked against google-genai's enum by
# tests/unit/test_tiers.py), cheapest first. ``fallback.tiers`` names some of them (batch_inference.tiers).
FALLBACK_TIERS: dict[str, tuple[str, ...]] = {"openai": ("flex", "default", "priority"),
                                              "gemini": ("flex", "standard", "priority")}


class FallbackTier(_Strict):
    """One price tier of the fallback endpoint (batch_inference.tiers): the name its API takes as
    ``service_tier``, its price and what the pool expects of it until it has measured it."""

    name: str = Field(min_length=1, max_length=32)
    per_row: float | None = Field(default=None, ge=0, le=1000, description="what a row answered at this tier costs")
    rate: float | None = Field(default=None, gt=0, le=1_000_000, description="requests/s this tier takes "
                               "(its own rate limit; default fallback.rate)")
    latency_s: float = Field(default=1.0, gt=0, le=86_400, description="a request's latency at this tier before "
                             "the pool has measured it (flex: slower)")


class Fallback(_Strict):
    rate: float = Field(default=85.0, gt=0, le=1_000_000, description="sustained requests/s of the synchronous pool")
    overhead_s: float = Field(default=1800.0, ge=0, le=MAX_LEASE_SECONDS,
                              description="batch drain + reconcile + warehouse load")
    concurrency: int = Field(default=16, ge=1, le=1024, description="threads of the synchronous pool")
    base_url: str | None = Field(default=None, max_length=2048)
    hosted: bool = Field(default=False, description="true: the fallback endpoint is hosted whatever its address; "
                         "false declares nothing (batch_inference.clearance decides)")
    response_format_style: Literal["json_object", "json_schema"] = Field(
        default="json_object", description="the openai engine's response_format_style for the fallback endpoint: "
        "json_object (llama.cpp's server) or json_schema (vLLM, OpenAI)")
    history_runs: int = Field(default=5, ge=0, le=1000, description="derive rate/overhead from this many past runs")
    min_history_runs: int = Field(default=5, ge=1, le=1000, description="complete fallback runs needed before history may "
                                                               "relax rate/overhead (fewer only tighten them)")
    provider: Literal["openai", "gemini"] | None = Field(default=None, description="whose tiers fallback.tiers "
                                                         "names (FALLBACK_TIERS)")
    tiers: list[FallbackTier] = Field(default_factory=list, max_length=3, description="price tiers of the endpoint, "
                                      "cheapest first: the pool sends each row at the cheapest that still finishes "
                                      "by the deadline (batch_inference.tiers)")

    @model_validator(mode="after")
    def _tiers_known_and_priced(self) -> "Fallback":
        if not self.tiers:
            return self
        if self.provider is None:
            raise ValueError("tiers need fallback.provider (openai or gemini): the tier names are the provider's")
        known = FALLBACK_TIERS[self.provider]
        names = [t.name for t in self.tiers]
        for t in self.tiers:
            if t.name not in known:
                raise ValueError(f"unknown tier {t.name!r} for provider {self.provider} (its tiers: "
                                 f"{', '.join(known)})")
            if t.per_row is None:
                raise ValueError(f"tier {t.name!r} has no price: set per_row")
        if len(set(names)) != len(names) or names != sorted(names, key=known.index):
            raise ValueError(f"tiers must be distinct and cheapest first ({', '.join(known)}), got {', '.join(names)}")
        return self


class IcebergCatalog(_Strict):
    """Where an Iceberg table's metadata pointer lives (batch_inference.destinations.iceberg).

    ``sql``: pyiceberg's SqlCatalog on a PostgreSQL (``uri`` a SQLAlchemy URL,
    else the ledger's own database), its tables in ``db_schema``. ``rest``: a
    REST catalog at ``uri``. ``glue``: AWS Glue. Credentials never go here:
    they come from the environment (libpq's, pyiceberg's and AWS's variables)
    or, for Glue and S3, from the Airflow connection ``Destination.aws_conn_id``."""

    type: Literal["sql", "rest", "glue"] = "sql"
    name: str = Field(default="ledger", min_length=1, max_length=64, pattern=r"^[a-z_][a-z0-9_]*$")
    uri: str | None = Field(default=None, max_length=2048, description="sql: a SQLAlchemy URL without a "
                            "password (default: the ledger's database); rest: the catalog's URI; glue: an "
                            "endpoint other than AWS's")
    db_schema: str = Field(default="iceberg_catalog", pattern=r"^[a-z_][a-z0-9_]{0,62}$",
                           description="sql: the PostgreSQL schema holding the catalog's tables")

    @field_validator("uri")
    @classmethod
    def _no_password(cls, v: str | None) -> str | None:
        if v is not None and re.search(r"//[^/@]*:[^/@]*@|password=", v, re.I):
            raise ValueError("must not hold a password: credentials come from the environment")
        return v


class Destination(_Strict):
    """A place the published version goes besides the PostgreSQL view, which always gets it.

    Not part of the job version: where the rows go does not change them."""

    kind: Literal["iceberg"] = "iceberg"
    identifier: str = Field(max_length=200, description="namespace.table")
    catalog: IcebergCatalog = Field(default_factory=IcebergCatalog)
    warehouse: str = Field(min_length=1, max_length=2048, description="a local path or s3://bucket/prefix")
    s3_endpoint: str | None = Field(default=None, max_length=2048, description="an S3-compatible endpoint URL")
    s3_region: str | None = Field(default=None, max_length=64)
    aws_conn_id: str | None = Field(default=None, max_length=250, pattern=r"^[A-Za-z0-9_.-]+$",
                                    description="an Airflow AWS connection (the amazon provider's) whose "
                                    "credentials, region and endpoint_url Glue and S3 use; a name, not a "
                                    "credential (without it: the environment's)")
    cleared_record_classes: list[str] = Field(default_factory=list, max_length=100, description="record classes "
                                              "that may be written here (as cleared_for_hosted does for endpoints)")
    target_file_rows: int = Field(default=1_000_000, ge=1_000, le=100_000_000,
                                  description="rows per Parquet data file")

    @field_validator("identifier")
    @classmethod
    def _ident(cls, v: str) -> str:
        if not _TABLE_IDENT.match(v):
            raise ValueError("must be namespace.table in lower-case letters, digits and underscores")
        return v

    @field_validator("warehouse", "s3_endpoint")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        if v is not None and "@" in v.split("?")[0]:
            raise ValueError("must not hold credentials: they come from the environment")
        return v

    @property
    def name(self) -> str:
        """The destination's name in the publish history: kind, catalog and table."""
        return f"{self.kind}:{self.catalog.name}.{self.identifier}"


Source.model_rebuild()   # source.catalog names IcebergCatalog, defined after Source
Evaluation.model_rebuild()   # evaluation.pairs names GoldenPairs, defined after Evaluation


class Publish(_Strict):
    destinations: list[Destination] = Field(default_factory=list, max_length=16)

    @model_validator(mode="after")
    def _unique(self) -> "Publish":
        names = [d.name for d in self.destinations]
        if len(names) != len(set(names)):
            raise ValueError("each destination may be named once")
        return self


class JobSpec(_Strict):
    dataset: str
    task: Literal["generate", "embed"] = Field(default="generate", description="generate: a JSON answer per "
                                               "record; embed: a vector per record (batch_inference.embed)")
    source: Source
    model: Model
    engine: Engine = Field(default_factory=Engine)
    prompt: Prompt
    params: Params = Field(default_factory=Params)
    output_schema: dict[str, Any] | None   # required; task embed takes none (_task_fields)
    embedding: Embedding | None = Field(default=None, description="task embed: the vectors' size and form")
    rules: list[Rule] = Field(default_factory=list)
    category_field: str | None = Field(default="category", max_length=MAX_NAME,
                                       description="output field whose distribution is checked for drift")
    record_class: str = Field(default="internal", min_length=1, max_length=64)
    cleared_for_hosted: bool = False
    endpoints: list[Endpoint] = Field(default_factory=list, max_length=1000, description="hosts declared hosted or "
                                      "internal (batch_inference.clearance); not part of the job version")
    shard_size: int = Field(default=5000, ge=1, le=1_000_000)
    max_attempts: int = Field(default=3, ge=1, le=100)
    max_input_chars: int = Field(default=20_000, ge=1, le=10_000_000)
    lease_seconds: int = Field(default=600, ge=1, le=MAX_LEASE_SECONDS)
    renew_seconds: float = Field(default=30.0, gt=0)
    incremental: bool = Field(default=False, description="reuse stored results of the same spec for unchanged records")
    validation: Validation = Field(default_factory=Validation)
    cost: Cost = Field(default_factory=Cost)
    fallback: Fallback = Field(default_factory=Fallback)
    autopilot: Autopilot = Field(default_factory=Autopilot, description="the batch fleet's size against the "
                                 "deadline and the budget; not part of the job version")
    evaluation: Evaluation = Field(default_factory=Evaluation)
    models: list[Rung] | None = Field(default=None, min_length=2, max_length=8, description="a model ladder, "
                                      "cheapest first (batch_inference.ladder); model, engine and params are then "
                                      "the top rung's")
    ladder: Ladder = Field(default_factory=Ladder, description="the ladder's confidence rule and calibrate target")
    publish: Publish = Field(default_factory=Publish, description="destinations besides the view; not part of "
                             "the job version")

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, v: str) -> str:
        if not re.match(r"^[a-z_][a-z0-9_]{0,47}$", v):
            raise ValueError("must be lower-case letters, digits and underscores (at most 48), starting with a letter")
        return v

    @field_validator("output_schema")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        if info.data.get("task") == "embed":
            if v is not None:
                raise ValueError("task: embed stores a vector per record and takes no output schema: remove "
                                 "output_schema (or use task: generate)")
            return v
        if v is None:
            raise ValueError("must be a JSON schema object (task generate)")
        if not (info.context or {}).get(STORED_KEY):
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError

            try:
                Draft202012Validator.check_schema(v)
            except SchemaError as exc:
                raise ValueError(f"not a valid JSON schema: {exc.message}") from None
        if v.get("type") != "object":
            raise ValueError("must describe a JSON object (type: object)")
        props = v.get("properties") or {}
        for name in props if isinstance(props, dict) else ():
            # Top-level properties become columns of the published view.
            if not name or len(name.encode("utf-8")) > PG_IDENT_BYTES or not name.isprintable():
                raise ValueError(f"property {name[:40]!r}: a top-level output property needs a name of 1 to "
                                 f"{PG_IDENT_BYTES} bytes without control characters (it is a column of the "
                                 "published view)")
        return v

    @model_validator(mode="after")
    def _template_names_the_record(self) -> "JobSpec":
        """Without ``source.columns`` the template holds ``{text}``; with them it names each column
        (a ``{name}`` that no column fills is refused)."""
        template, columns = self.prompt.template, self.source.columns
        if not columns:
            if "{text}" not in template:
                raise ValueError("'prompt.template' must contain the placeholder {text} (or name each of "
                                 "source.columns)")
        else:
            missing = [c for c in columns if "{" + c + "}" not in template]
            if missing:
                raise ValueError(f"'prompt.template' must name each of source.columns: "
                                 f"{', '.join('{' + c + '}' for c in missing)} missing")
        # A placeholder nothing fills would reach the model as the literal text "{body}".
        filled = columns or ["text"]
        stray = list(dict.fromkeys(n for n in PLACEHOLDER_NAME.findall(template) if n not in filled))
        if stray:
            names = ", ".join("{" + n + "}" for n in stray)
            what = (f"source.columns are {', '.join(columns)}" if columns else
                    f"the record is one column, source.text_column '{self.source.text_column}', filled in as {{text}}")
            raise ValueError(f"'prompt.template' names {names}, which no column fills ({what}): add "
                             f"{'it' if len(stray) == 1 else 'them'} to source.columns or take "
                             f"{'it' if len(stray) == 1 else 'them'} out of the template")
        return self

    @model_validator(mode="before")
    @classmethod
    def _ladder_top(cls, data: Any) -> Any:
        """A ladder (``models:``) gives model, engine and params: the top rung's model and params, engine ``ladder``."""
        rungs = data.get("models") if isinstance(data, dict) else None
        if isinstance(rungs, list) and rungs and isinstance(rungs[-1], dict):
            top = rungs[-1]
            data = {**data}
            data.setdefault("model", top.get("model"))
            data.setdefault("engine", {"name": "ladder"})
            if "params" in top:
                data.setdefault("params", top["params"])
        return data

    @model_validator(mode="after")
    def _ladder_rungs(self) -> "JobSpec":
        """One schema for every rung, a confidence every rung below the top can give, the top rung as the spec's model."""
        rungs = self.models
        if not rungs:
            if self.engine.name == "ladder":
                raise ValueError("engine 'ladder' needs models: the rungs of the ladder, cheapest first")
            return self
        top = rungs[-1]
        if self.engine.name != "ladder":
            raise ValueError(f"a spec with models: runs them as a ladder: leave engine out (or name 'ladder'), "
                             f"not {self.engine.name!r}")
        if self.model != top.model or self.params != top.params:
            raise ValueError("a spec with models: takes model and params from its top rung: leave them out")
        props = self.output_schema.get("properties") or {}
        for name in self.ladder.fields:
            if name not in props:
                raise ValueError(f"ladder.fields: {name!r} is not a top-level property of output_schema")
        for i, rung in enumerate(rungs, 1):
            where = f"models[{i}] ({rung.model.name})"
            if rung.engine.name == "ladder":
                raise ValueError(f"{where}: a rung's engine cannot be a ladder")
            if rung.output_schema is not None and rung.output_schema != self.output_schema:
                first = next((j for j, r in enumerate(rungs, 1) if r.output_schema is not None), i)
                raise ValueError(f"{where}: its output_schema differs from the spec's output_schema"
                                 f"{'' if first == i else f' (and from models[{first}])'}: every rung of a ladder "
                                 "answers one schema")
            if rung is top:
                continue
            if self.ladder.confidence == "logprobs" and rung.engine.name in ENGINE_RESULT_OPTIONS \
                    and rung.engine.name not in ENGINES_WITH_LOGPROBS:
                raise ValueError(f"{where}: engine {rung.engine.name!r} gives no token log-probabilities, which "
                                 f"ladder.confidence 'logprobs' needs: use confidence 'agreement', or an engine "
                                 f"that gives them ({', '.join(sorted(ENGINES_WITH_LOGPROBS))})")
            if self.ladder.confidence == "agreement" and rung.engine.name == "vllm":
                raise ValueError(f"{where}: engine 'vllm' builds its sampling parameters (the seed) once, so "
                                 "ladder.confidence 'agreement' would compare one answer with itself: use "
                                 "confidence 'logprobs'")
            if self.ladder.confidence == "agreement" and rung.params.temperature == 0:
                raise ValueError(f"{where}: ladder.confidence 'agreement' compares {self.ladder.samples} sampled "
                                 "answers, which at temperature 0 are one answer: give the rung a temperature above 0")
        return self

    @model_validator(mode="after")
    def _renew_below_lease(self) -> "JobSpec":
        if self.renew_seconds >= self.lease_seconds:
            raise ValueError("renew_seconds must be shorter than lease_seconds")
        return self

    @model_validator(mode="after")
    def _evaluation_fields(self) -> "JobSpec":
        props = (self.output_schema or {}).get("properties") or {}
        ev = self.evaluation
        for name in [*ev.min_accuracy, *ev.graders]:
            if name not in props:
                raise ValueError(f"evaluation: {name!r} is not a top-level property of output_schema")
        if ev.judge is not None and self.validation.sample_size == 0:
            raise ValueError("evaluation.judge grades rows of the review sample: validation.sample_size must be "
                             "at least 1")
        if ev.review.min_reviewed > self.validation.sample_size:
            raise ValueError(f"evaluation.review.min_reviewed ({ev.review.min_reviewed}) is more than the review "
                             f"sample holds (validation.sample_size {self.validation.sample_size})")
        return self

    @model_validator(mode="before")
    @classmethod
    def _embed_leaves_out(cls, data: Any) -> Any:
        """An embedding job may leave out what only generation uses: the output schema and the system turn."""
        if isinstance(data, dict) and data.get("task") == "embed":
            data = {"output_schema": None, **data}
            if isinstance(data.get("prompt"), dict):
                data["prompt"] = {"system": None, **data["prompt"]}
        return data

    @model_validator(mode="after")
    def _task_fields(self) -> "JobSpec":
        if self.task == "generate":
            if self.prompt.system is None:
                raise ValueError("'prompt.system' is required for task generate")
            if self.embedding is not None or self.evaluation.pairs is not None:
                raise ValueError("'embedding' and 'evaluation.pairs' are for task: embed")
            return self
        if self.embedding is None:
            raise ValueError("task: embed needs 'embedding' with the model's 'dimensions'")
        if self.engine.name in ENGINE_RESULT_OPTIONS and self.engine.name not in EMBEDDING_ENGINES:
            raise ValueError(f"engine '{self.engine.name}' has no embedding mode: task: embed runs on "
                             f"{', '.join(EMBEDDING_ENGINES)}")
        if self.rules or self.evaluation.golden is not None or self.evaluation.judge is not None:
            raise ValueError("task: embed takes no rules, evaluation.golden or evaluation.judge (they grade JSON "
                             "answers): use evaluation.pairs")
        return self

    # -- identity ---------------------------------------------------------
    def result_defining(self) -> dict[str, Any]:
        """The fields that change results. Sharding and leases do not; of the
        engine, only the options that change results do, and only when the
        spec sets any, so a spec without them keeps its version."""
        out = {
            "model": {"name": self.model.name, "digest": self.model.digest},
            "prompt": self.prompt.model_dump(),
            "params": self.params.model_dump(),
            "output_schema": self.output_schema,
            "rules": [r.model_dump() for r in self.rules],
            "max_input_chars": self.max_input_chars,
        }
        if self.task == "embed":   # a generate spec's version stays as it always was
            out["task"] = self.task
            out["embedding"] = self.embedding.model_dump() if self.embedding else None
        pinned = pinned_options(self.engine.name, self.engine.options)
        if self.models:
            out["models"] = [{"model": {"name": r.model.name, "digest": r.model.digest},
                              "engine": {"name": r.engine.name, "options": pinned_options(r.engine.name,
                                                                                          r.engine.options)},
                              "params": r.params.model_dump(), "threshold": r.threshold} for r in self.models]
            out["ladder"] = self.ladder.model_dump(exclude={"target"})
        if pinned:
            out["engine"] = {"name": self.engine.name, "options": pinned}
        return out

    @property
    def spec_hash(self) -> str:
        return _sha(_canonical(self.result_defining()))

    def rung_samples(self, rung_no: int) -> int:
        """Answers a model ladder asks of rung ``rung_no`` (1-based) a record: ``ladder.samples`` under the
        agreement rule below the top, else 1 (what a rung's answers are priced by)."""
        top = len(self.models or ())
        return self.ladder.samples if self.ladder.confidence == "agreement" and rung_no < top else 1

    def job_version(self, snapshot_identity: str) -> str:
        """``jv_`` + 16 hex characters: the spec hash bound to the dataset and one input snapshot.

        Two datasets over the same rows, model and prompt are two job versions:
        each keeps its own spec (engine, gates) and publishes to its own view."""
        return "jv_" + _sha(self.spec_hash + ":" + self.dataset + ":" + snapshot_identity)[:16]

    def with_overrides(self, **fields: Any) -> "JobSpec":
        """This spec with top-level ``fields`` replaced, validated like a spec from a file."""
        return parse_spec({**self.model_dump(mode="json"), **fields})


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# Settings outside the job version that a resubmit may change under it: workers, the validator, the
# review gate and publish read them from the ledger's copy of the spec each time they start. Any other
# difference (shard size, attempts, source, clearance, ...) was planned or checked at the first submit.
SETTINGS_UNDER_A_VERSION = ("engine", "validation", "evaluation", "category_field", "cost", "fallback",
                            "lease_seconds", "renew_seconds", "publish")


def settings_diff(old: JobSpec, new: JobSpec) -> list[tuple[str, Any, Any]]:
    """Every setting of ``new`` that differs from ``old``: (dotted path, old value, new value), in the
    spec's field order (a list is one value)."""
    out: list[tuple[str, Any, Any]] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in list(a) + [k for k in b if k not in a]:
                walk(a.get(key), b.get(key), f"{path}.{key}" if path else key)
        elif a != b:
            out.append((path, a, b))

    walk(old.model_dump(mode="json"), new.model_dump(mode="json"), "")
    return out


def _problems(exc: ValidationError) -> list[str]:
    """Every problem pydantic found, one line each, in the spec's field order. An unknown field
    beside a missing required one names it as the likely misspelling."""
    errs = exc.errors()
    missing = {tuple(e["loc"][:-1]): [str(m["loc"][-1]) for m in errs if m["type"] == "missing"
                                      and tuple(m["loc"][:-1]) == tuple(e["loc"][:-1])] for e in errs}
    out = []
    for err in errs:
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
            near = difflib.get_close_matches(str(err["loc"][-1]), missing[tuple(err["loc"][:-1])], n=1, cutoff=0.6)
            if near:
                msg += f" (did you mean '{near[0]}'?)"
        line = f"spec field '{where}': {msg}"
        if line not in out:
            out.append(line)
    return out


def _check_values(data: Any) -> None:
    """Refuse what no field validator can see: nesting past ``MAX_DEPTH``, more
    than ``MAX_NODES`` values, and strings (keys included) the database cannot
    store: a NUL, or a lone surrogate."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    nodes = 0
    while stack:
        value, path = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise SpecError(f"spec has more than {MAX_NODES:,} values")
        if len(path) > MAX_DEPTH:
            raise SpecError(f"spec field '{'.'.join(path[:4])}...': nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for k, v in value.items():
                key = str(k)
                _check_string(key, path + (key[:40],))
                stack.append((v, path + (key[:40],)))
        elif isinstance(value, (list, tuple)):
            stack.extend((v, path + (str(i),)) for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_string(value, path)


def _check_string(text: str, path: tuple[str, ...]) -> None:
    where = ".".join(path) or "(top level)"
    if "\x00" in text:
        raise SpecError(f"spec field '{where}': contains a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SpecError(f"spec field '{where}': not valid Unicode (lone surrogate)") from None


def stored_spec(data: Any) -> JobSpec:
    """A spec read back from the ledger: submit checked its output schema against JSON Schema's meta-schema,
    so this skips that check and the jsonschema import it takes (about 0.1 CPU-s of every worker's start);
    every other rule runs as at submit."""
    return JobSpec.model_validate(data, context={STORED_KEY: True})


def parse_spec(data: Any) -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(f"spec must be a mapping, got {type(data).__name__}")
    _check_values(data)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError("\n".join(_problems(exc))) from None


def load_spec(path: str | Path) -> JobSpec:
    return loads_spec(read_text(path), name=str(path))


def read_text(path: str | Path, what: str = "spec") -> str:
    """A spec's (or another file's of the same kind: a deployment) text; SpecError, one line, if unreadable."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read {what} {p}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{what} {p} is not UTF-8 text") from None


class _SpecLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without aliases and with bounded nesting: an alias
    can make a few hundred bytes expand to gigabytes once the spec is walked
    (a "billion laughs"), and deep nesting exhausts the parser's recursion."""

    def __init__(self, stream: str, name: str):
        super().__init__(stream)
        self._name = name
        self._depth = 0

    def _refuse(self, what: str) -> SpecError:
        mark = self.peek_event().start_mark
        return SpecError(f"{self._name}: line {mark.line + 1}, column {mark.column + 1}: {what}")

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise self._refuse("YAML aliases (*name) are not allowed in a spec")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise self._refuse(f"nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def loads_spec(text: str, name: str = "<spec>") -> JobSpec:
    return parse_spec(loads_yaml(text, name))


def loads_yaml(text: str, name: str = "<spec>") -> Any:
    """YAML text as data, read as a spec is: bounded in size, no aliases, bounded nesting (a
    deployment file is read the same way: ``batch_inference.regions``)."""
    if len(text) > MAX_SPEC_CHARS:
        raise SpecError(f"{name}: {len(text):,} characters; a spec is at most {MAX_SPEC_CHARS:,}")
    try:
        loader = _SpecLoader(text, name)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise SpecError(f"{name}: malformed YAML{where}: {problem}") from None
    return data
