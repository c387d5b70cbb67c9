"""The capacity arithmetic against the design's figures, to the design's rounding."""

from __future__ import annotations

import argparse
import json

import pytest

from batch_inference.capacity import Hardware, Model, Workload, estimate, kv_bytes_per_token, plan_gpus, rate_from_timing
from batch_inference.commands import capacity as command


def test_defaults_reproduce_the_design():
    e = estimate()
    assert e.source == "estimate"
    assert e.tokens_in_total == 60e9 and e.tokens_out_total == 7.5e9
    assert round(e.prefill_tokens_per_s) == 30_906
    assert e.kv_bytes_per_token == 128 * 1024 == kv_bytes_per_token(Model())
    assert e.decode_context == 1_275
    assert round(e.bytes_per_step / 1e9, 1) == 58.8
    assert round(e.step_s * 1e3) == 25
    assert round(e.decode_tokens_per_s) == 10_213
    assert round(e.prefill_ms, 1) == 38.8 and round(e.decode_ms, 1) == 14.7
    assert round(e.ms_per_record, 1) == 53.5
    assert round(e.records_per_s_per_gpu, 1) == 18.7
    assert round(e.gpu_hours) == 743
    assert round(e.cost) == 2_601


def test_gpus_for_the_window_round_up():
    # The design says 37 GPUs: 743.3 / 20 = 37.2, rounded to nearest. On 37 the
    # job takes 20.1 h and misses the window, so the plan rounds up.
    e = estimate()
    assert round(e.gpus_flat_out) == 37
    assert e.gpus_for_window == e.workers_for_window == 38
    assert e.gpu_hours / 37 > 20 >= e.gpu_hours / 38


def test_cached_prefix():
    e = estimate(Workload(cached_prefix=500))
    assert round(e.ms_per_record, 1) == 37.3
    assert round(e.records_per_s_per_gpu, 1) == 26.8
    gain = e.records_per_s_per_gpu / estimate().records_per_s_per_gpu - 1
    assert round(gain * 100) == 43
    # The cache saves prefill compute only; decode still reads the prefix's KV.
    assert e.decode_ms == estimate().decode_ms


def test_measured_rate_replaces_the_estimate():
    rps = rate_from_timing(1_000, 50)  # 1,000 real records timed at 50 s
    assert rps == 20
    e = estimate(Workload(records=1_000_000), measured_rps=rps)
    assert e.source == "measured"
    assert e.ms_per_record == 50 and e.records_per_s_per_gpu == 20
    assert round(e.one_worker_hours, 1) == 13.9
    assert round(e.gpu_hours, 1) == 13.9
    assert round(e.estimated_ms_per_record, 1) == 53.5  # kept for comparison


def test_tensor_parallel_worker():
    one, two = estimate(), estimate(hardware=Hardware(gpus_per_worker=2))
    assert two.ms_per_record == one.ms_per_record  # GPU-ms per record
    assert two.records_per_s_per_worker == pytest.approx(2 * one.records_per_s_per_worker)
    assert two.gpu_hours == one.gpu_hours and two.cost == one.cost
    assert two.workers_for_window == 19 and two.gpus_for_window == 38
    # A measured rate is per worker, shared by its GPUs.
    m = estimate(hardware=Hardware(gpus_per_worker=2), measured_rps=40)
    assert m.records_per_s_per_gpu == 20 and m.ms_per_record == 50


def test_plan_with_interruption_overhead():
    # The design: interruptions add about 20%, so plan about 45 GPUs.
    assert plan_gpus(estimate(), 0.2) == 45
    assert plan_gpus(estimate(), 0.2, gpus_per_worker=2) == 46


@pytest.mark.parametrize("kwargs", [
    {"workload": Workload(cached_prefix=1_200)},
    {"workload": Workload(records=0)},
    {"hardware": Hardware(decode_efficiency=1.5)},
    {"hardware": Hardware(gpus_per_worker=0)},
    {"measured_rps": 0},
])
def test_impossible_inputs(kwargs):
    with pytest.raises(ValueError):
        estimate(**kwargs)


def _parser():
    parser = argparse.ArgumentParser(prog="batch-inference")
    command.register(parser.add_subparsers())
    return parser


def test_cli_json_is_one_line(capsys):
    args = _parser().parse_args(["capacity", "--json", "--cached-prefix", "500"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    e = json.loads(out)["estimate"]
    assert round(e["ms_per_record"], 1) == 37.3


def test_cli_json_with_simulation(capsys):
    args = _parser().parse_args(["capacity", "--json", "--simulate", "--sim-records", "200000",
                                 "--workers", "4", "--seeds", "2", "--shard-sizes", "1000,5000"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    s = json.loads(out)["simulation"]
    assert s["best"] in (1000, 5000) and len(s["rows"]) == 2
    assert all(r["duplicate_rows"] == 0 for r in s["rows"])


def test_cli_human_and_errors(capsys):
    args = _parser().parse_args(["capacity", "--records", "1e6", "--measured-rps", "20"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "53.5 ms of GPU (estimate)" in out and "one worker alone: 13.9 h" in out
    args = _parser().parse_args(["capacity", "--cached-prefix", "5000"])
    assert args.func(args) == 2
    assert "cached prefix" in capsys.readouterr().err
