"""``batch-inference capacity``: GPUs, hours and cost for a job, and a shard size.

Without ``--simulate`` it is the roofline arithmetic of
:mod:`batch_inference.capacity` (or a measured rate in its place). With
``--simulate`` it also runs the preemptible-worker simulation over candidate
shard sizes at the per-worker rate just computed, and turns the best
makespan's overhead into a GPU count with headroom. No database, no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from batch_inference import capacity as cap
from batch_inference import simulate as sim
from batch_inference.commands.common import db_arg


def _count(text: str) -> int:
    """An integer that may be written 5e7 or 50_000_000."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(_count(part) for part in text.split(",") if part.strip())


def register(sub: Any) -> None:
    m, h, w, sc = cap.Model(), cap.Hardware(), cap.Workload(), sim.Scenario()
    p = sub.add_parser(
        "capacity",
        help="GPUs, hours and cost for a batch job; --simulate also picks a shard size",
        description=(
            "Roofline estimate for a dense model: prefill compute-bound, decode bandwidth-bound. "
            "--measured-rps (records/s one worker sustained over a timed sample) replaces it. "
            "Defaults: an 8B model in BF16 on one H100, 50 M records of 1,200 tokens in and 150 out, 20 hours."
        ),
    )
    g = p.add_argument_group("model")
    g.add_argument("--params", type=float, default=m.params, help="parameters (default 8e9)")
    g.add_argument("--layers", type=int, default=m.layers)
    g.add_argument("--kv-heads", type=int, default=m.kv_heads)
    g.add_argument("--head-dim", type=int, default=m.head_dim)
    g.add_argument("--bytes-per-weight", type=float, default=m.bytes_per_weight,
                   help="2 for BF16; the KV cache is taken at the same width")
    g = p.add_argument_group("hardware")
    g.add_argument("--gpus-per-worker", type=int, default=h.gpus_per_worker,
                   help="tensor-parallel GPUs per worker, assumed to scale linearly")
    g.add_argument("--flops", type=float, default=h.flops, help="peak dense FLOP/s per GPU (default 989e12)")
    g.add_argument("--bandwidth", type=float, default=h.bandwidth, help="memory bytes/s per GPU (default 3.35e12)")
    g.add_argument("--prefill-efficiency", type=float, default=h.prefill_efficiency)
    g.add_argument("--decode-efficiency", type=float, default=h.decode_efficiency)
    g.add_argument("--price-per-gpu-hour", type=float, default=h.price_per_gpu_hour)
    g = p.add_argument_group("job")
    g.add_argument("--batch", type=int, default=w.batch, help="sequences decoded together")
    g.add_argument("--tokens-in", type=int, default=w.tokens_in)
    g.add_argument("--tokens-out", type=int, default=w.tokens_out)
    g.add_argument("--cached-prefix", type=int, default=w.cached_prefix,
                   help="shared instruction tokens served from the prefix cache")
    g.add_argument("--records", type=_count, default=w.records)
    g.add_argument("--window-hours", type=float, default=w.window_hours)
    g.add_argument("--measured-rps", type=float, default=None,
                   help="records/s one worker sustained on real records; replaces the estimate")
    g.add_argument("--spec", default=None, metavar="SPEC",
                   help="use the newest pilot of this spec's model (batch-inference estimate SPEC --pilot N): "
                        "its input and output tokens a record and its records/s replace the assumed shapes")
    g = p.add_argument_group("simulation (--simulate)")
    g.add_argument("--simulate", action="store_true", help="also recommend a shard size")
    g.add_argument("--workers", type=int, default=sc.workers)
    g.add_argument("--interruptions-per-hour", type=float, default=sc.interruptions_per_hour,
                   help="per worker, exponential")
    g.add_argument("--load-s", type=float, default=sc.load_s, help="model load time of a replacement")
    g.add_argument("--lease-s", type=float, default=sc.lease_s)
    g.add_argument("--shard-overhead-s", type=float, default=sc.shard_overhead_s)
    g.add_argument("--stall-fraction", type=float, default=sc.stall_fraction,
                   help="interruptions that are stalls outliving the lease")
    g.add_argument("--stall-extra-s", type=float, default=sc.stall_extra_s,
                   help="how long after its lease expired a stalled worker comes back")
    g.add_argument("--notice-fraction", type=float, default=sc.notice_fraction,
                   help="deaths announced by a preemption notice (lease released at once)")
    g.add_argument("--fence-detect-s", type=float, default=sc.fence_detect_s,
                   help="how long a fenced worker computes before its first refused flush (worker: 2 s)")
    g.add_argument("--claim-order", choices=("lowest", "fifo"), default=sc.claim_order)
    g.add_argument("--seeds", type=int, default=20, help="runs averaged per shard size")
    g.add_argument("--sim-records", type=_count, default=sc.records, help="records in the simulated job")
    g.add_argument("--shard-sizes", type=_sizes, default=sim.DEFAULT_CANDIDATES,
                   help="comma-separated candidates (default 500,1000,2000,5000,10000,25000)")
    p.add_argument("--json", action="store_true", help="print one JSON object on one line")
    db_arg(p)
    p.set_defaults(func=run)


def compute(args: argparse.Namespace) -> dict[str, Any]:
    """The figures behind both outputs; raises ValueError on impossible inputs."""
    model = cap.Model(params=args.params, layers=args.layers, kv_heads=args.kv_heads,
                      head_dim=args.head_dim, bytes_per_weight=args.bytes_per_weight)
    hardware = cap.Hardware(flops=args.flops, bandwidth=args.bandwidth,
                            prefill_efficiency=args.prefill_efficiency,
                            decode_efficiency=args.decode_efficiency,
                            gpus_per_worker=args.gpus_per_worker,
                            price_per_gpu_hour=args.price_per_gpu_hour)
    workload = cap.Workload(records=args.records, tokens_in=args.tokens_in, tokens_out=args.tokens_out,
                            batch=args.batch, cached_prefix=args.cached_prefix,
                            window_hours=args.window_hours)
    measured_rps = args.measured_rps
    pilot = getattr(args, "pilot", None)
    if pilot is not None:
        workload, rps = cap.measured_shapes(pilot, workload)
        measured_rps = measured_rps or rps
    est = cap.estimate(workload, hardware, model, measured_rps=measured_rps)
    out: dict[str, Any] = {"estimate": est.as_dict()}
    if pilot is not None:
        out["pilot"] = {k: pilot[k] for k in ("id", "dataset", "model_name", "engine", "records", "records_per_s",
                                              "valid_rate", "measured_at")}
    if args.simulate:
        scenario = sim.Scenario(
            records=args.sim_records, workers=args.workers, rate=est.records_per_s_per_worker,
            interruptions_per_hour=args.interruptions_per_hour, load_s=args.load_s,
            lease_s=args.lease_s, shard_overhead_s=args.shard_overhead_s,
            stall_fraction=args.stall_fraction, stall_extra_s=args.stall_extra_s,
            notice_fraction=args.notice_fraction, fence_detect_s=args.fence_detect_s,
            claim_order=args.claim_order,
        )
        rec = sim.recommend_shard_size(scenario, tuple(args.shard_sizes), seeds=args.seeds)
        out["simulation"] = {
            "scenario": {k: getattr(scenario, k) for k in scenario.__dataclass_fields__},
            **rec.as_dict(),
            "planned_gpus": cap.plan_gpus(est, max(0.0, rec.overhead), args.gpus_per_worker),
        }
    return out


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _billions(n: float) -> str:
    return f"{n / 1e9:,.2f}".rstrip("0").rstrip(".")


def render(out: dict[str, Any]) -> str:
    e = out["estimate"]
    inp = e["inputs"]
    m, h, w = inp["model"], inp["hardware"], inp["workload"]
    g = h["gpus_per_worker"]
    lines = [
        f"capacity: {w['records']:,} records, {w['tokens_in']:,} tokens in"
        f" ({w['cached_prefix']:,} cached), {w['tokens_out']:,} out;"
        f" {m['params'] / 1e9:g}B parameters, {g} GPU{'s' if g > 1 else ''} per worker",
        f"  tokens       {_billions(e['tokens_in_total'])} B in, {_billions(e['tokens_out_total'])} B out",
        f"  prefill      {e['prefill_tokens_per_s']:,.0f} tokens/s per GPU",
        f"  decode       batch {w['batch']}, {e['bytes_per_step'] / 1e9:.1f} GB per step"
        f" (KV {e['kv_bytes_per_token'] / 1024:,.0f} KiB per token), {e['decode_tokens_per_s']:,.0f} tokens/s per GPU",
        f"  per record   {e['prefill_ms']:.1f} ms prefill + {e['decode_ms']:.1f} ms decode"
        f" = {e['estimated_ms_per_record']:.1f} ms of GPU (estimate)",
    ]
    if out.get("pilot"):
        p = out["pilot"]
        lines.append(f"  pilot        {p['id']} of {p['dataset']} ({p['records']} records, {p['engine']},"
                     f" {p['measured_at'][:16]}): tokens in and out and the rate as measured")
    if e["source"] == "measured":
        lines.append(f"  measured     {inp['measured_rps']:,.1f} records/s per worker"
                     f" = {e['ms_per_record']:.1f} ms of GPU per record (used below)")
    lines += [
        f"  rate         {e['records_per_s_per_gpu']:.1f} records/s per GPU,"
        f" {e['records_per_s_per_worker']:.1f} per worker; one worker alone: {e['one_worker_hours']:,.1f} h",
        f"  job          {e['gpu_hours']:,.0f} GPU-hours; {e['gpus_flat_out']:,.1f} GPUs flat out"
        f" -> {_n(e['gpus_for_window'], 'GPU')} ({_n(e['workers_for_window'], 'worker')}) for {w['window_hours']:g} h;"
        f" ${e['cost']:,.0f} at ${h['price_per_gpu_hour']:.2f}/GPU-hour",
    ]
    s = out.get("simulation")
    if s:
        sc = s["scenario"]
        lines += [
            "",
            f"shard size: {sc['records']:,} records on {sc['workers']} preemptible workers at {sc['rate']:.1f}"
            f" records/s, interruptions per worker-hour {sc['interruptions_per_hour']:g};"
            f" mean of {s['seeds']} seeds",
            f"  {'shard':>8}{'shards':>8}{'makespan h':>12}{'vs best h':>16}{'lost GPU-h':>12}"
            f"{'duplicate rows':>16}{'refused writes':>16}",
        ]
        for r in s["rows"]:
            mark = "  <- best" if r["shard_size"] == s["best"] else ("  ~ best" if r["near_best"] else "")
            vs = f"{r['vs_best_h']:+.2f} ±{r['vs_best_se']:.2f}"
            lines.append(f"  {r['shard_size']:>8,}{r['shards']:>8,}{r['makespan_h']:>12.2f}{vs:>16}"
                         f"{r['lost_gpu_h']:>12.1f}{r['duplicate_rows']:>16,.0f}{r['refused_writes']:>16,.0f}{mark}")
        best = next(r for r in s["rows"] if r["shard_size"] == s["best"])
        lines.append(
            f"  best {s['best']:,}: {best['makespan_h']:.2f} h, {s['overhead']:.0%} over the ideal"
            f" {s['ideal_h']:.2f} h -> plan {_n(s['planned_gpus'], 'GPU')} for the {w['window_hours']:g} h window"
        )
        lines.append("  as good within two standard errors: " + ", ".join(f"{n:,}" for n in s["near_best"]))
    return "\n".join(lines)


def _pilot(args: argparse.Namespace) -> dict[str, Any] | None:
    """The newest pilot of ``--spec``'s model from the ledger; None without ``--spec``."""
    if not args.spec:
        return None
    from batch_inference.commands.common import connect
    from batch_inference.estimate import pilot_figures
    from batch_inference.exceptions import InvalidValue
    from batch_inference.spec import load_spec

    spec = load_spec(args.spec)
    with connect(args) as conn:
        pilot = pilot_figures(conn, spec)
    if pilot is None:
        raise InvalidValue(f"no pilot of model {spec.model.name} on {spec.engine.name} in the ledger: run "
                           f"`batch-inference estimate {args.spec} --pilot 100` first")
    pilot["measured_at"] = pilot["measured_at"].isoformat()
    return pilot


def run(args: argparse.Namespace) -> int:
    args.pilot = _pilot(args)
    try:
        out = compute(args)
    except ValueError as exc:
        print(f"capacity: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, separators=(",", ":")))
    else:
        print(render(out))
    return 0
