"""What the commands share: the ledger connection and terminal-safe output."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

# C0 and C1 control characters, DEL, and the bidirectional overrides: a terminal
# acts on them (colours, cursor moves, title changes, reordered text).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# json.dumps escapes C0 itself; these it leaves as they are.
_JSON_CONTROL = re.compile("[\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: Any) -> str:
    """``text`` safe to print on a terminal: control characters as escapes (``\\x1b``, ``\\u202e``)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


def print_json(obj: Any) -> None:
    """``obj`` as one JSON line, with the control characters json.dumps leaves raw escaped."""
    print(_JSON_CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(obj, default=str, ensure_ascii=False)))


def print_report(report: Any, as_json: bool) -> int:
    """A harness's report (``as_dict``, ``table``, ``passed``): one JSON line or its table; the exit code."""
    if as_json:
        print_json(report.as_dict())
    else:
        print(report.table())
    return 0 if report.passed else 1


def doc_summary(doc: str | None) -> str:
    """A module docstring's first paragraph as one line: a command's ``--help`` description, whole."""
    return " ".join((doc or "").strip().split("\n\n")[0].split()).replace("``", "")


def one_line(message: Any, limit: int = 400) -> str:
    """An error message as one printable line of at most ``limit`` characters."""
    text = printable(" ".join(str(message).split()))
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def db_arg(p: argparse.ArgumentParser) -> None:
    """``--db`` on a subcommand; SUPPRESS keeps a --db given before the command from being reset."""
    p.add_argument("--db", default=argparse.SUPPRESS, help="database URL (default: $BATCH_INFERENCE_DB)")


def connect(args: argparse.Namespace):
    """The ledger connection of ``--db`` (else $BATCH_INFERENCE_DB, else embedded), migrated."""
    from batch_inference import db

    conn = db.connect(getattr(args, "db", None))
    db.migrate(conn)
    return conn
