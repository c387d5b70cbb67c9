"""Capacity arithmetic: how many GPUs a batch job needs, and what it costs.

A roofline estimate for a dense decoder model: prefill is compute-bound
(two FLOPs per parameter per input token), decode is bandwidth-bound (each
step reads the weights once plus the KV cache of every sequence in the
batch). The defaults reproduce the design's backfill: an 8B Llama-3.1-class
model in BF16 on one H100, 50 million records of 1,200 tokens in and 150 out,
a 20-hour window.

A roofline is an upper bound that real engines approach but do not reach, so
a measured rate (time 1,000 real records through the whole pipeline) replaces
the estimate whenever one is given. Standard library only: the CLI, the
planner and a DAG can all call this without a GPU or Airflow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from batch_inference.exceptions import InvalidValue


@dataclass(frozen=True)
class Model:
    """The shapes that set compute per token and KV bytes per token."""

    params: float = 8.0e9
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    bytes_per_weight: float = 2.0  # BF16; the KV cache is kept at the same width


@dataclass(frozen=True)
class Hardware:
    """One GPU, how well an offline engine uses it, and what an hour costs.

    ``gpus_per_worker`` > 1 means a tensor-parallel worker. We assume it
    scales linearly: the worker has ``g`` times the FLOP/s and bandwidth of
    one GPU, so a record takes 1/g of the wall time on it but the same
    GPU-seconds. Real tensor parallelism loses some of that to all-reduce
    traffic; a measured rate captures the loss, the estimate does not.
    """

    flops: float = 989e12  # dense BF16 FLOP/s (H100 SXM)
    bandwidth: float = 3.35e12  # HBM bytes/s
    prefill_efficiency: float = 0.5  # fraction of peak FLOP/s prefill reaches
    decode_efficiency: float = 0.7  # fraction of peak bandwidth decode reaches
    gpus_per_worker: int = 1
    price_per_gpu_hour: float = 3.50


@dataclass(frozen=True)
class Workload:
    """The job: how many records, how long each is, and when it must finish."""

    records: int = 50_000_000
    tokens_in: int = 1_200
    tokens_out: int = 150
    batch: int = 256  # sequences decoded together; offline jobs can run it large
    cached_prefix: int = 0  # shared instruction tokens served from the prefix cache
    window_hours: float = 20.0


@dataclass(frozen=True)
class Estimate:
    """Every intermediate figure, so a reader can check each step."""

    source: str  # "estimate" (roofline) or "measured"
    tokens_in_total: float
    tokens_out_total: float
    prefill_tokens_per_s: float  # per GPU
    kv_bytes_per_token: float
    decode_context: float  # mean tokens per sequence during decode
    bytes_per_step: float  # weights + KV read once per decode step
    step_s: float
    decode_tokens_per_s: float  # per GPU, across the whole batch
    prefill_ms: float  # GPU-ms per record
    decode_ms: float
    estimated_ms_per_record: float  # the roofline figure, kept when a measurement overrides it
    ms_per_record: float  # GPU-ms per record actually used below
    records_per_s_per_gpu: float
    records_per_s_per_worker: float
    gpu_hours: float
    gpus_flat_out: float  # GPU-hours / window, unrounded
    workers_for_window: int
    gpus_for_window: int
    one_worker_hours: float  # the whole job on a single worker
    cost: float
    inputs: dict = field(default_factory=dict, compare=False)

    def as_dict(self) -> dict:
        return asdict(self)


def kv_bytes_per_token(model: Model) -> float:
    # K and V, for every layer and KV head (grouped-query attention keeps this small).
    return 2 * model.layers * model.kv_heads * model.head_dim * model.bytes_per_weight


def rate_from_timing(records: int, seconds: float) -> float:
    """Records/s from a timed sample run, first claim to last write."""
    if records <= 0 or seconds <= 0:
        raise InvalidValue("a timing needs a positive record count and duration")
    return records / seconds


def estimate(
    workload: Workload | None = None,
    hardware: Hardware | None = None,
    model: Model | None = None,
    measured_rps: float | None = None,
) -> Estimate:
    """Size the job. ``measured_rps`` is records/s for one whole worker.

    When given it replaces the roofline rate for every figure that follows
    (GPU-hours, GPUs, cost); the roofline figures stay in the result so the
    two can be compared.
    """
    w = workload or Workload()
    h = hardware or Hardware()
    m = model or Model()
    _check(w, h, m, measured_rps)
    g = h.gpus_per_worker

    # Prefill: 2 FLOPs per parameter per token (attention FLOPs are small at
    # these lengths and left out). A cached shared prefix is not recomputed.
    prefill_tps = h.flops * h.prefill_efficiency / (2 * m.params)
    prefill_tokens = w.tokens_in - w.cached_prefix

    # Decode: a sequence is on average halfway through its output, so its
    # context is the whole input plus half the output. The prefix cache saves
    # compute, not KV reads: every sequence still attends over the prefix.
    kv_token = kv_bytes_per_token(m)
    context = w.tokens_in + w.tokens_out / 2
    step_bytes = m.params * m.bytes_per_weight + w.batch * context * kv_token
    step_s = step_bytes / (h.bandwidth * h.decode_efficiency)
    decode_tps = w.batch / step_s

    prefill_s = prefill_tokens / prefill_tps
    decode_s = w.tokens_out / decode_tps
    est_s = prefill_s + decode_s

    if measured_rps is not None:
        # A worker's measured rate is shared by its g GPUs.
        gpu_s = g / measured_rps
        source = "measured"
    else:
        gpu_s = est_s
        source = "estimate"
    worker_rps = g / gpu_s

    gpu_hours = w.records * gpu_s / 3600
    flat_out = gpu_hours / w.window_hours
    # Round up: 37.2 GPUs running flat out miss the window on 37.
    workers = math.ceil(flat_out / g - 1e-9)
    return Estimate(
        source=source,
        tokens_in_total=w.records * w.tokens_in,
        tokens_out_total=w.records * w.tokens_out,
        prefill_tokens_per_s=prefill_tps,
        kv_bytes_per_token=kv_token,
        decode_context=context,
        bytes_per_step=step_bytes,
        step_s=step_s,
        decode_tokens_per_s=decode_tps,
        prefill_ms=prefill_s * 1e3,
        decode_ms=decode_s * 1e3,
        estimated_ms_per_record=est_s * 1e3,
        ms_per_record=gpu_s * 1e3,
        records_per_s_per_gpu=1 / gpu_s,
        records_per_s_per_worker=worker_rps,
        gpu_hours=gpu_hours,
        gpus_flat_out=flat_out,
        workers_for_window=workers,
        gpus_for_window=workers * g,
        one_worker_hours=w.records / worker_rps / 3600,
        cost=gpu_hours * h.price_per_gpu_hour,
        inputs={"model": asdict(m), "hardware": asdict(h), "workload": asdict(w), "measured_rps": measured_rps},
    )


def measured_shapes(pilot: Mapping[str, Any], workload: Workload) -> tuple[Workload, float]:
    """``workload`` with the shapes a pilot measured (``bi.estimate_pilots``: input tokens a
    record by the pinned tokenizer, output tokens a stored answer) and one worker's measured
    records/s, which replaces the roofline rate."""
    records, stored = int(pilot["records"]), int(pilot["stored"])
    if records <= 0 or not pilot["records_per_s"] or pilot["records_per_s"] <= 0:
        raise InvalidValue("the pilot measured no rate")
    tokens_in = max(1, round(int(pilot["input_tokens"]) / records))
    tokens_out = round(int(pilot["output_tokens"]) / stored) if stored else workload.tokens_out
    cached = min(workload.cached_prefix, tokens_in - 1)
    return replace(workload, tokens_in=tokens_in, tokens_out=tokens_out, cached_prefix=cached), \
        float(pilot["records_per_s"])


def plan_gpus(est: Estimate, overhead: float, gpus_per_worker: int = 1) -> int:
    """GPUs to provision when interruptions stretch the makespan by ``overhead``.

    ``overhead`` is a fraction (0.2 for 20%), e.g. from the simulation's
    makespan over its ideal; the design adds about 20% and plans 45 GPUs.
    """
    if overhead < 0:
        raise InvalidValue("overhead must be >= 0")
    workers = math.ceil(est.gpus_flat_out * (1 + overhead) / gpus_per_worker - 1e-9)
    return workers * gpus_per_worker


def _check(w: Workload, h: Hardware, m: Model, measured_rps: float | None) -> None:
    positive = {
        "params": m.params, "layers": m.layers, "kv heads": m.kv_heads, "head dim": m.head_dim,
        "bytes per weight": m.bytes_per_weight, "FLOP/s": h.flops, "bandwidth": h.bandwidth,
        "prefill efficiency": h.prefill_efficiency, "decode efficiency": h.decode_efficiency,
        "GPUs per worker": h.gpus_per_worker, "batch": w.batch, "tokens in": w.tokens_in,
        "records": w.records, "window hours": w.window_hours,
    }
    for name, value in positive.items():
        if value <= 0:
            raise InvalidValue(f"{name} must be > 0, got {value}")
    if h.prefill_efficiency > 1 or h.decode_efficiency > 1:
        raise InvalidValue("efficiencies are fractions of peak: at most 1")
    if w.tokens_out < 0 or h.price_per_gpu_hour < 0:
        raise InvalidValue("tokens out and price must be >= 0")
    if not 0 <= w.cached_prefix < w.tokens_in:
        raise InvalidValue("cached prefix must be >= 0 and shorter than tokens in")
    if measured_rps is not None and measured_rps <= 0:
        raise InvalidValue("measured records/s must be > 0")
