"""What the output checks protect the result table from, shown on the real PostgreSQL."""

from __future__ import annotations

import json

import psycopg
import pytest


def test_a_nul_output_would_have_failed_the_whole_flush(conn):
    """Why check_output refuses it: PostgreSQL rejects the batch it is in."""
    with pytest.raises(psycopg.errors.UntranslatableCharacter):
        conn.execute("SELECT %s::text::jsonb", (json.dumps({"summary": "a\x00b"}),))
