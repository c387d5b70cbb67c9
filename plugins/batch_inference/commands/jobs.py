"""``submit``, ``status``, ``dead-letters``, ``redrive`` and ``drop``: a job version in the ledger."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from batch_inference.commands.common import connect, print_json, printable


def register(sub: Any) -> None:
    s = sub.add_parser("submit", help="validate a spec, snapshot its source and plan shards")
    s.add_argument("spec")
    s.add_argument("--shard-size", type=int)
    s.add_argument("--s3-endpoint", default=None, help="S3-compatible endpoint URL (object-store sources)")
    s.add_argument("--deployment", metavar="YAML", help="clusters in several regions (docs/regions.md): every store "
                                                        "and connection checked first, then the snapshot replicated "
                                                        "near each cluster")
    s.set_defaults(func=run_submit)

    st = sub.add_parser("status", help="live counts of a job version")
    st.add_argument("job_version")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=run_status)

    dl = sub.add_parser("dead-letters", help="records that never produced a result, with reasons")
    dl.add_argument("job_version")
    dl.add_argument("--json", action="store_true")
    dl.set_defaults(func=run_dead_letters)

    rd = sub.add_parser("redrive", help="put chosen dead letters back to pending, attempts reset, after their "
                                        "cause was fixed (recorded with who, when and why)")
    rd.add_argument("job_version")
    rd.add_argument("--dead-letters", action="store_true", required=True,
                    help="what is re-driven: the version's dead letters (the only kind)")
    rd.add_argument("--stage", choices=("snapshot", "plan", "worker"), help="only dead letters of this stage")
    rd.add_argument("--reason-like", metavar="TEXT", help="only dead letters whose reason contains TEXT (any case)")
    rd.add_argument("--reason", required=True, metavar="WHY", help="why (recorded with the re-drive)")
    rd.add_argument("--actor", help="who (default: cli:<login name>)")
    rd.add_argument("--json", action="store_true")
    rd.set_defaults(func=run_redrive)

    dr = sub.add_parser("drop", help="drop a whole job version (its partitions, and its golden and judge runs "
                                     "unless shared)")
    dr.add_argument("job_version")
    dr.set_defaults(func=run_drop)


def run_submit(args: argparse.Namespace) -> int:
    from batch_inference.plan import submit
    from batch_inference.spec import load_spec

    spec = load_spec(args.spec)
    deployment = None
    if args.deployment:
        from batch_inference.regions import load_deployment

        deployment = load_deployment(args.deployment)   # a bad file: one line before any connection
    overrides = {k: v for k, v in (("shard_size", args.shard_size),) if v is not None}
    if overrides:
        spec = spec.with_overrides(**overrides)
    from batch_inference.sources import for_spec

    reader = for_spec(spec, s3_endpoint_url=args.s3_endpoint)
    from batch_inference.pinning import check_at_submit
    from batch_inference.status import job_counts

    weights = check_at_submit(spec)   # weights here that do not match the pin: refused before anything is written
    with connect(args) as conn:
        # with a deployment: a store or connection that does not answer is one line, nothing written
        m = submit(conn, spec, reader=reader, deployment=deployment)
        total = job_counts(conn, m.job_version)["dead_letters"]
    # dead_letters_at_planning counts the records refused at planning; dead_letters_total, the version's
    # dead letters now (a resubmit of a version the workers already ran counts theirs too).
    print_json({**m.as_dict(), "dead_letters_total": total, "weights": weights})
    if weights.startswith("not checked here"):
        print(f"note: model weights {printable(weights)}", file=sys.stderr)
    if m.applied:
        print(f"job version {m.job_version} already exists; applied: {printable('; '.join(m.applied))}",
              file=sys.stderr)
    return 0


def run_status(args: argparse.Namespace) -> int:
    from batch_inference.fleet import worker_death
    from batch_inference.status import job_counts, job_halt, region_bill, shared_inputs

    with connect(args) as conn:
        c = job_counts(conn, args.job_version)
        halt = job_halt(conn, args.job_version)
        shared = shared_inputs(conn, args.job_version)
        death = worker_death(conn, args.job_version)
        regions = region_bill(conn, args.job_version)
    if args.json:
        print_json({**c, **halt, "worker_death": death, "computed_once": shared,
                    **({"regions": regions} if regions["placed"] else {})})
    else:
        s = c["shards"]
        # The workers' halt (weights that do not match, an engine that cannot start): why nothing moves;
        # a halt followed by a resubmit that changed the settings (its cause fixed) or by work on the
        # version is shown as past, with when it was cleared.
        halted = ""
        if halt["halted_at"] and halt["halt_cleared_at"]:
            how = ("cleared by a resubmit that changed its settings at" if halt["halt_cleared_by"] == "resubmit"
                   else "workers worked on it again from")
            halted = (f"; an earlier halt at {halt['halted_at']:%Y-%m-%d %H:%M:%S %Z} is past ({how} "
                      f"{halt['halt_cleared_at']:%Y-%m-%d %H:%M:%S %Z}): {printable(halt['halt_reason'])}")
        elif halt["halted_at"]:
            halted = (f"; HALTED by its workers at {halt['halted_at']:%Y-%m-%d %H:%M:%S %Z}: "
                      f"{printable(halt['halt_reason'])}")
        print(f"{c['job_version']}: {c['stored']}/{c['records']} stored ({c['stored_fallback']} by fallback, "
              f"{c['reused']} reused{f', {shared} computed once for an identical input' if shared else ''}), "
              f"{c['dead_letters']} dead letters, {c['outstanding']} outstanding; "
              f"shards pending {s['pending']}, leased {s['leased']}, done {s['done']}; "
              f"mode {c['mode']}, status {c['status']}{halted}")
        if regions["placed"]:
            print(f"regions: replication {regions['replication_bytes']:,} bytes in "
                  f"{regions['replication_seconds']:.2f} s ${regions['replication_usd']:,.4f}; egress: "
                  f"{regions['steals']:,} steals {regions['steal_bytes']:,} bytes ${regions['steal_usd']:,.4f}, "
                  f"{regions['merged_files']:,} far result files merged {regions['merge_bytes']:,} bytes "
                  f"${regions['merge_usd']:,.4f}")
        if death:
            print(f"last worker death at {death['last_error_at']:%Y-%m-%d %H:%M:%S %Z}: "
                  f"{printable(death['last_error'])} (shard {death['shard_no']}, {death['state']} now)")
    return 0


def run_dead_letters(args: argparse.Namespace) -> int:
    from batch_inference.status import dead_letters, job_counts

    with connect(args) as conn:
        job_counts(conn, args.job_version)  # a clear error for an unknown version
        rows = dead_letters(conn, args.job_version)
    if args.json:
        for r in rows:
            print_json({k: r[k] for k in ("record_id", "reason", "attempts", "stage", "error", "raw_output")})
    else:
        # Ids, reasons and raw outputs come from records and the model: escaped, never sent raw to a terminal.
        for r in rows:
            raw = printable((r["raw_output"] or "")[:80])
            print(f"{printable(r['record_id'])}\t{r['attempts']}\t{printable(r['reason'])}\t{raw}")
        print(f"{len(rows)} dead letter(s)", file=sys.stderr)
    return 0


def run_redrive(args: argparse.Namespace) -> int:
    import getpass

    from batch_inference.plan import redrive_dead_letters

    with connect(args) as conn:
        out = redrive_dead_letters(conn, args.job_version, actor=args.actor or f"cli:{getpass.getuser()}",
                                   reason=args.reason, stage=args.stage, reason_like=args.reason_like)
    if args.json:
        print_json(out)
    else:
        left = f"; {out['left_out']} matching left dead (refused before any worker)" if out["left_out"] else ""
        print(f"{out['job_version']}: {out['records']} dead letter(s) back to pending in {out['shards']} shard(s), "
              f"attempts reset{left}; start workers on it (`batch-inference worker {out['job_version']}`), "
              "then validate")
    return 0


def run_drop(args: argparse.Namespace) -> int:
    from batch_inference.exceptions import UnknownJob
    from batch_inference.plan import drop_job_version

    with connect(args) as conn:
        if not drop_job_version(conn, args.job_version):
            raise UnknownJob(f"no job version {args.job_version!r}")
    print("dropped", file=sys.stderr)
    return 0
