"""Tests against the real embedded PostgreSQL, in this process (ledger, plan, validate, publish, operators, security)."""
