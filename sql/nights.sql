-- The nights harness's reads and its history (batch_inference/nights.py).
-- Not a migration: named statements over the ledger's own tables, loaded by
-- batch_inference.db.queries(); every name starts with nights_.

-- name: nights_last_rows  when the last row of each transport was stored, and how many rows each stored
SELECT transport, count(*) AS n, max(created_at) AS last_at
  FROM bi.results WHERE job_version = %(job)s GROUP BY transport ORDER BY transport;

-- name: nights_history_insert  one past fallback run of a dataset, drawn by the harness (the night's drifted history)
INSERT INTO bi.fallback_runs (job_version, dataset, started_at, finished_at, records, rate, overhead_s,
                              drain_s, busy_s, load_s)
VALUES (%(job)s, %(dataset)s, %(finished_at)s - make_interval(secs => %(overhead_s)s + %(busy_s)s), %(finished_at)s,
        %(records)s, %(rate)s, %(overhead_s)s, %(drain_s)s, %(busy_s)s, %(load_s)s);

-- name: nights_fallback_runs  the fallback runs a night recorded (its own job version)
SELECT records, rate, overhead_s, drain_s, busy_s, load_s, started_at, finished_at
  FROM bi.fallback_runs WHERE job_version = %(job)s ORDER BY id;

-- name: nights_db_now  the database clock
SELECT clock_timestamp() AS now;
