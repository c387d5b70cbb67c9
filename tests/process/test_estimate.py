"""``batch-inference estimate``: the preview before any spend, and the pilot, on the real ledger and llama.cpp.

The demo's 320 tickets, its spec (SmolLM2 on llama.cpp), the real embedded
PostgreSQL. Token counts are checked against the GGUF's tokenizer called
directly (its own chat template rendered by llama-cpp-python's Jinja2
formatter, then ``Llama.tokenize``); "writes nothing" is every ``bi`` table's
row count before and after. The pilot runs the real worker on the real model.
"""

from __future__ import annotations

import json

import pytest

from batch_inference import db
from batch_inference.cli import main
from batch_inference.commands.demo import load_tickets
from batch_inference.data import DEMO_SPEC, read_tickets
from batch_inference.prompting import build_messages
from batch_inference.spec import load_spec

pytest.importorskip("llama_cpp")


def bi_rows(conn) -> dict[str, int]:
    """Every table of the bi schema (partitions included) and its rows."""
    names = [r["relname"] for r in conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = 'bi' AND c.relkind IN ('r', 'p') ORDER BY 1")]
    return {n: conn.execute(f'SELECT count(*) AS n FROM bi."{n}"').fetchone()["n"] for n in names}


@pytest.fixture(scope="module")
def direct_counts() -> dict[str, int]:
    """Each demo ticket's prompt tokens, by the GGUF's tokenizer and chat template called directly."""
    import llama_cpp
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from batch_inference.engines.llama_cpp import default_gguf_path

    spec = load_spec(DEMO_SPEC)
    llm = llama_cpp.Llama(model_path=str(default_gguf_path()), vocab_only=True, verbose=False)
    bos = llm.token_get_text(llm.token_bos()) if hasattr(llm, "token_get_text") else llm.detokenize(
        [llm.token_bos()]).decode()
    eos = llm.detokenize([llm.token_eos()], special=True).decode()
    fmt = Jinja2ChatFormatter(template=llm.metadata["tokenizer.chat_template"], eos_token=eos, bos_token=bos)
    out = {}
    for t in read_tickets(None):
        text = t["text"] or ""
        if not text.strip() or len(text) > spec.max_input_chars:
            continue
        r = fmt(messages=build_messages(spec, text))
        out[t["id"]] = len(llm.tokenize(r.prompt.encode("utf-8"), add_bos=not r.added_special, special=True))
    llm.close()
    return out


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_preview_of_the_demo_counts_exactly_and_writes_nothing(conn, db_url, capsys, direct_counts):
    load_tickets(conn, 320)
    before = bi_rows(conn)
    code, out, err = run_cli(capsys, "--db", db_url, "estimate", str(DEMO_SPEC), "--deadline", "+20h")
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1
    p = json.loads(out)
    assert bi_rows(conn) == before                       # nothing written, in any bi table

    counts = sorted(direct_counts.values())
    assert p["exact"] is True and "SmolLM2" in p["tokenizer"]
    assert p["records"] == 320
    assert p["eligible"] == len(counts)
    assert p["rejected"] == 320 - len(counts) >= 1       # the blank ticket and the pasted log
    assert p["input_tokens"]["total"] == sum(counts)
    assert p["input_tokens"]["max"] == counts[-1]
    n = len(counts)
    assert p["input_tokens"]["p50"] == counts[-(-n * 50 // 100) - 1]
    assert p["input_tokens"]["p99"] == counts[-(-n * 99 // 100) - 1]
    # The system turn is shared: far more than 100 tokens of every prompt are the same.
    assert p["shared_prefix_tokens"] > 100
    assert p["prefix_cache_saves_tokens"] == p["shared_prefix_tokens"] * (n - 1)
    assert p["rate"] is None and p["gpu_hours"] is None   # nothing measured yet: said, not invented
    assert p["output_tokens"]["per_record"] == 120        # max_tokens, an upper bound, so stated
    assert p["verdict"] == "go"
    assert "input tokens" in err and "exact" in err


def test_an_unreadable_source_is_one_line_and_writes_nothing(conn, db_url, capsys, tmp_path):
    spec = load_spec(DEMO_SPEC).model_dump(mode="json")
    spec["source"]["table"] = "public.no_such_table"
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    before = bi_rows(conn)
    code, out, err = run_cli(capsys, "--db", db_url, "estimate", str(path))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no_such_table" in lines[0], err
    assert bi_rows(conn) == before


def test_a_pilot_measures_and_feeds_the_preview_and_capacity(conn, db_url, capsys, direct_counts, tmp_path):
    load_tickets(conn, 60)
    jobs_before = bi_rows(conn)["jobs"]
    # The demo's spec with one llama.cpp thread: on the suite's shared cores two spin (docs/engines.md). Engine
    # options are outside the job version and the spec's hash, so capacity below reads this pilot for DEMO_SPEC.
    spec = load_spec(DEMO_SPEC).model_dump(mode="json")
    spec["engine"]["options"] = {**spec["engine"]["options"], "n_threads": 1}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    code, out, err = run_cli(capsys, "--db", db_url, "estimate", str(path), "--pilot", "4", "--workers", "2")
    assert code == 0, err
    p = json.loads(out)
    pilots = conn.execute(db.q("estimate_pilots_of_dataset"), {"dataset": "ticket_triage", "n": 5}).fetchall()
    assert len(pilots) == 1
    pilot = pilots[0]
    assert pilot["records"] == 4 and pilot["stored"] + pilot["dead_letters"] == 4
    assert pilot["records_per_s"] > 0 and 0 <= pilot["valid_rate"] <= 1
    assert pilot["input_tokens"] > 4 * 100
    # The scratch version is gone: no job row, no partition of it left.
    assert bi_rows(conn)["jobs"] == jobs_before
    assert not conn.execute("SELECT 1 FROM bi.jobs WHERE dataset LIKE 'pilot_%'").fetchall()
    assert not conn.execute("SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                            "WHERE n.nspname = 'bi' AND c.relname ~ '^(results|snapshot_rows)_[0-9a-f]{16}$'"
                            ).fetchall()

    # The preview uses what the pilot measured.
    assert p["rate"]["source"] == "pilot"
    assert p["rate"]["records_per_s"] == pytest.approx(pilot["records_per_s"])
    assert p["rate"]["fleet_records_per_s"] == pytest.approx(2 * pilot["records_per_s"])
    # The pilot's rate is after its worker's start-up (the model load); each of the two workers pays one.
    startup = pilot["seconds"] - 4 / pilot["records_per_s"]
    assert startup > 0 and p["rate"]["startup_s"] == pytest.approx(startup, abs=1e-3)
    assert p["gpu_hours"] == pytest.approx((p["eligible"] / pilot["records_per_s"] + 2 * startup) / 3600,
                                           rel=1e-3, abs=1e-5)
    if pilot["stored"]:
        assert p["output_tokens"]["source"] == "measured (pilot)"
        assert p["output_tokens"]["per_record"] == pytest.approx(pilot["output_tokens"] / pilot["stored"], abs=0.1)

    # So does capacity: the measured shapes and rate replace its assumed 1,200 tokens in.
    code, out, err = run_cli(capsys, "--db", db_url, "capacity", "--spec", str(DEMO_SPEC), "--records", "1000",
                             "--json")
    assert code == 0, err
    c = json.loads(out)
    assert c["pilot"]["id"] == pilot["id"]
    est = c["estimate"]
    assert est["source"] == "measured"
    assert est["inputs"]["workload"]["tokens_in"] == round(pilot["input_tokens"] / 4)
    assert est["records_per_s_per_worker"] == pytest.approx(pilot["records_per_s"])
