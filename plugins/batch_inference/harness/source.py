"""The harnesses' source table: support tickets with poison records at seeded random places."""

from __future__ import annotations

import random

import psycopg

from batch_inference import db
from batch_inference.engines.noop import ENGINE_ERROR_MARKER, INVALID_OUTPUT_MARKER

SOURCE = {"table": "public.chaos_records", "id_column": "id", "text_column": "body", "acl_column": "acl"}
TICKETS = (
    "I was charged twice for my subscription this month.",
    "The export button does nothing on Firefox.",
    "Please merge my two accounts, same e-mail.",
    "L'application plante quand j'ouvre une facture.",
    "Refund still not received after 10 days 😞",
    "Login loops back to the sign-in page.",
)


def make_source(conn: psycopg.Connection, records: int, rng: random.Random, poison_each: int = 0,
                max_input_chars: int = 4000) -> dict[str, str]:
    """(Re)create ``SOURCE``'s table with ``records`` tickets: one oversized (a dead letter at
    planning), ``poison_each`` that always break the noop engine and ``poison_each`` that always
    get an invalid answer, at places drawn from ``rng``. Returns {id: poison kind}."""
    poison: dict[str, str] = {}
    ids = [f"r{i:07d}" for i in range(records)]
    picks = rng.sample(range(records), 2 * poison_each + 1)
    for k, i in enumerate(picks):
        kind = "oversized" if k == 0 else "engine_error" if k <= poison_each else "invalid_output"
        poison[ids[i]] = kind
    conn.execute(db.q("chaos_source_create"))
    with conn.cursor() as cur, cur.copy(db.q("chaos_source_copy")) as cp:
        for i, rid in enumerate(ids):
            kind = poison.get(rid)
            if kind == "oversized":
                body = "x" * (max_input_chars + 1)
            elif kind == "engine_error":
                body = f"Ticket {i}: {ENGINE_ERROR_MARKER} this one always breaks the engine."
            elif kind == "invalid_output":
                body = f"Ticket {i}: {INVALID_OUTPUT_MARKER} this one always gets an invalid answer."
            else:
                body = f"Ticket {i}: {TICKETS[i % len(TICKETS)]}"
            cp.write_row((rid, body, [f"team{i % 4}"]))
    return poison
