"""A deployment: the clusters a job version runs on, in which regions, at what prices.

Read from YAML (``load_deployment``), validated by pydantic, every problem one
line naming the cluster or region it is about. Not part of the job version
(I2): the same spec over the same rows is one version wherever it runs.

    clusters:
      - name: us-spot
        region: us-east-1
        workers: {kind: kubernetes, conn_id: k8s_us}     # or {kind: local}: worker processes here
        gpu: {kind: H100, spot_per_hour: 2.1, on_demand_per_hour: 4.0, interruption_rate: 0.05}
        capacity: 16                                     # workers at most
        store: {kind: s3, bucket: replicas-us, endpoint: https://s3.us-east-1.amazonaws.com}
                                                         # or {kind: path, path: /mnt/replicas}
    egress:                                              # every pair of regions, one way or both
      - {from: us-east-1, to: eu-west-1, usd_per_gb: 0.02}
    ledger_region: us-east-1                             # where the ledger is (default: the first cluster's)

An egress price given one way holds both ways unless the other way is given
too. The ledger's region is where the snapshot is read to write replicas and
where far workers' result files are merged: its workers write straight to the
ledger, the others hand in result files, and replication and merge reads are
priced at the egress price from or to it. ``replicas.check_reachable`` (at
submit and placement, before anything is written) asks every store and every
Kubernetes connection.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from batch_inference.exceptions import BatchInferenceError
from batch_inference.spec import loads_yaml, read_text

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
MAX_CLUSTERS = 64


class DeploymentError(BatchInferenceError, ValueError):
    """A deployment that cannot be used, or whose stores or connections cannot be reached; one line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Workers(_Strict):
    """How a cluster's workers start: GPU pods through a Kubernetes connection, or local processes."""

    kind: Literal["kubernetes", "local"]
    conn_id: str | None = Field(default=None, max_length=250, description="the Airflow Kubernetes connection")
    namespace: str | None = Field(default=None, max_length=63)

    @model_validator(mode="after")
    def _conn(self) -> "Workers":
        if self.kind == "kubernetes" and not self.conn_id:
            raise ValueError("kubernetes workers need conn_id (the Airflow connection their pods use)")
        if self.kind == "local" and self.conn_id:
            raise ValueError("local workers take no conn_id")
        return self


class Gpu(_Strict):
    kind: str = Field(min_length=1, max_length=64)
    spot_per_hour: float = Field(ge=0, le=100_000, description="dollars per GPU-hour on spot capacity")
    on_demand_per_hour: float = Field(ge=0, le=100_000, description="dollars per GPU-hour on demand")
    interruption_rate: float = Field(default=0.0, ge=0, le=1, description="spot interruptions per GPU-hour "
                                     "(measured or stated)")


class Store(_Strict):
    """Where a region's replicas and result files live: an S3 bucket at an endpoint, or a path."""

    kind: Literal["s3", "path"]
    bucket: str | None = Field(default=None, max_length=63)
    endpoint: str | None = Field(default=None, max_length=500, description="S3 endpoint URL (default: AWS's)")
    conn_id: str | None = Field(default=None, max_length=250, description="an Airflow AWS connection "
                                "(default: boto3's own chain)")
    prefix: str = Field(default="batch-inference", max_length=200)
    path: str | None = Field(default=None, max_length=1000)

    @model_validator(mode="after")
    def _where(self) -> "Store":
        if self.kind == "s3" and not self.bucket:
            raise ValueError("an s3 store needs a bucket")
        if self.kind == "path" and not self.path:
            raise ValueError("a path store needs a path")
        if self.kind == "s3" and self.path or self.kind == "path" and (self.bucket or self.endpoint):
            raise ValueError(f"a {self.kind} store takes {'bucket and endpoint' if self.kind == 's3' else 'a path'}"
                             " only")
        return self

    def where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" + (f" at {self.endpoint}" if self.endpoint else "") \
            if self.kind == "s3" else self.path or ""


class Cluster(_Strict):
    name: str
    region: str
    workers: Workers
    gpu: Gpu
    capacity: int = Field(ge=1, le=100_000, description="workers at most")
    store: Store | None = None    # required: checked with the cluster's name (Deployment._whole)

    @field_validator("name", "region")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("must be letters, digits, '_', '.', '-' (at most 63), starting with a letter or digit")
        return v


class Egress(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)

    from_region: str = Field(alias="from")
    to_region: str = Field(alias="to")
    usd_per_gb: float = Field(ge=0, le=1_000)


class Deployment(_Strict):
    clusters: list[Cluster] = Field(min_length=1, max_length=MAX_CLUSTERS)
    egress: list[Egress] = Field(default_factory=list, max_length=MAX_CLUSTERS * MAX_CLUSTERS)
    ledger_region: str | None = Field(default=None, description="where the ledger is (default: the first "
                                      "cluster's region)")

    @model_validator(mode="after")
    def _whole(self) -> "Deployment":
        names = [c.name for c in self.clusters]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"cluster {dup[0]!r} is named twice")
        for c in self.clusters:
            if c.store is None:
                raise ValueError(f"cluster {c.name!r} has no store (its region's replicas and result files go "
                                 "there: store: {kind: s3, bucket: ..., endpoint: ...} or {kind: path, path: ...})")
        stores: dict[str, Store] = {}
        for c in self.clusters:
            if stores.setdefault(c.region, c.store) != c.store:
                raise ValueError(f"region {c.region!r} names two stores (clusters of one region share its replicas)")
        regions = self.regions()
        if self.ledger_region is not None and self.ledger_region not in regions:
            raise ValueError(f"ledger_region {self.ledger_region!r} is not the region of any cluster "
                             f"({', '.join(regions)})")
        for e in self.egress:
            for r in (e.from_region, e.to_region):
                if r not in regions:
                    raise ValueError(f"egress names region {r!r}, which no cluster is in")
            if e.from_region == e.to_region:
                raise ValueError(f"egress from {e.from_region!r} to itself (reads within a region are free)")
        for a in regions:
            for b in regions:
                if a != b and self.egress_price(a, b) is None:
                    raise ValueError(f"region {a!r} has no egress price to {b!r} (egress: - {{from: {a}, to: {b}, "
                                     "usd_per_gb: ...}})")
        return self

    def regions(self) -> list[str]:
        """The regions, in the order their first cluster is named."""
        return list(dict.fromkeys(c.region for c in self.clusters))

    def ledger(self) -> str:
        """The ledger's region: ``ledger_region``, else the first cluster's."""
        return self.ledger_region or self.regions()[0]

    def store(self, region: str) -> Store:
        return next(c.store for c in self.clusters if c.region == region and c.store is not None)

    def capacity(self, region: str) -> int:
        return sum(c.capacity for c in self.clusters if c.region == region)

    def egress_price(self, from_region: str, to_region: str) -> float | None:
        """Dollars per GB read in ``from_region`` by a worker in ``to_region``; one way given holds both ways."""
        given = {(e.from_region, e.to_region): e.usd_per_gb for e in self.egress}
        price = given.get((from_region, to_region))
        return given.get((to_region, from_region)) if price is None else price


def _problems(exc: ValidationError, data: Any) -> list[str]:
    out = []
    for err in exc.errors():
        loc = list(err["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        if len(loc) >= 2 and loc[0] == "clusters" and isinstance(loc[1], int):
            try:
                where = f"cluster {data['clusters'][loc[1]]['name']!r}" + (
                    f" field '{'.'.join(str(p) for p in loc[2:])}'" if loc[2:] else "")
            except (KeyError, IndexError, TypeError):
                pass
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        line = f"deployment: {msg}" if where == "(top level)" else f"deployment {where}: {msg}"
        if line not in out:
            out.append(line)
    return out


def parse_deployment(data: Any) -> Deployment:
    """A deployment from data; DeploymentError, the first problem in one line."""
    if not isinstance(data, dict):
        raise DeploymentError(f"a deployment must be a mapping, got {type(data).__name__}")
    try:
        return Deployment.model_validate(data)
    except ValidationError as exc:
        raise DeploymentError(_problems(exc, data)[0]) from None


def load_deployment(path: str | Path) -> Deployment:
    try:
        data = loads_yaml(read_text(path, "deployment"), name=str(path))
    except BatchInferenceError as exc:
        raise DeploymentError(str(exc)) from None
    return parse_deployment(data)


def check_connections(deployment: Deployment) -> None:
    """Every Kubernetes connection a cluster names exists in Airflow (DeploymentError otherwise)."""
    for c in deployment.clusters:
        if c.workers.kind != "kubernetes":
            continue
        try:
            from airflow.sdk import BaseHook
        except ImportError:
            raise DeploymentError(f"cluster {c.name!r}: kubernetes workers need Airflow and its cncf-kubernetes "
                                  "provider") from None
        try:
            BaseHook.get_connection(c.workers.conn_id or "")
        except Exception as exc:  # noqa: BLE001 - AirflowNotFoundException and friends: one line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise DeploymentError(f"cluster {c.name!r}: Kubernetes connection {c.workers.conn_id!r} does not "
                                  f"exist ({first})") from None
