"""Pure tests: no database, no processes (cutoff, cost, the schema compiler, simulate, outputs)."""
