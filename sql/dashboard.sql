-- The dashboard's read statements (batch_inference/ui/data.py). Same format
-- as queries.sql ("-- name: NAME  what it does", then the statement), loaded
-- with it by batch_inference.db.queries(). Every statement here only reads:
-- the one write the dashboard makes (rollback) goes through
-- batch_inference.publish.

-- name: jobs  the newest job versions with live counts (per-shard counters, never COUNT(*) over results)
SELECT j.job_version, j.dataset, j.status, j.mode, j.created_at, j.fallback_at, j.model_name,
       j.prompt_version, c.records, c.stored, c.dead_letters, c.outstanding, c.reused,
       c.shards_done, c.shards_pending + c.shards_leased + c.shards_done AS shards,
       (p.job_version IS NOT NULL) AS published, lp.deadline, lp.latest_safe_start
  FROM bi.jobs j
 CROSS JOIN LATERAL bi.job_counts_v1(j.job_version) c
  LEFT JOIN bi.publish_pointer p ON p.dataset = j.dataset AND p.job_version = j.job_version
  LEFT JOIN LATERAL (SELECT pr.deadline, pr.latest_safe_start FROM bi.progress pr
                      WHERE pr.job_version = j.job_version ORDER BY pr.at DESC LIMIT 1) lp ON true
 WHERE (%(dataset)s::text IS NULL OR j.dataset = %(dataset)s)
   -- only versions the user may read: one of its DAGs is in %(dags)s, or it has
   -- no DAG run and %(undagged)s (the user may read every DAG)
   AND (EXISTS (SELECT 1 FROM bi.job_runs r WHERE r.job_version = j.job_version AND r.dag_id = ANY(%(dags)s))
        OR (%(undagged)s AND NOT EXISTS (SELECT 1 FROM bi.job_runs r WHERE r.job_version = j.job_version)))
   -- companion versions (a golden run, a judge) only when %(companions)s: each is shown under the version it serves
   AND (%(companions)s OR NOT EXISTS (SELECT 1 FROM bi.companion_versions cv WHERE cv.companion = j.job_version))
 ORDER BY j.created_at DESC, j.job_version
 LIMIT %(limit)s;

-- name: companions_of  the companion job versions serving a version, with live counts
SELECT cv.kind, cv.companion AS job_version, j.dataset, j.status, c.records, c.stored, c.dead_letters,
       c.outstanding, j.created_at
  FROM bi.companion_versions cv
  JOIN bi.jobs j ON j.job_version = cv.companion
 CROSS JOIN LATERAL bi.job_counts_v1(cv.companion) c
 WHERE cv.job_version = %(job)s
 ORDER BY cv.kind, j.created_at, cv.companion;

-- name: companion_serves  the versions a companion job version serves, and as what
SELECT job_version, kind FROM bi.companion_versions WHERE companion = %(job)s ORDER BY job_version;

-- name: job_row  one job version's fixed facts (the spec included)
SELECT job_version, dataset, spec_hash, snapshot_id, spec, model_name, model_digest, prompt_version, mode,
       status, records, planned_dead, reused, base_job_version, shards, validation, submitted_by,
       created_at, fallback_at
  FROM bi.jobs WHERE job_version = %(job)s;

-- name: pointer  the version a dataset's readers see now
SELECT dataset, job_version, switched_at, switched_by FROM bi.publish_pointer WHERE dataset = %(dataset)s;

-- name: progress_samples  the burn-down and moving-cutoff samples of one job, oldest first
SELECT at, stored, dead_letters, outstanding, latest_safe_start, deadline
  FROM bi.progress WHERE job_version = %(job)s ORDER BY at;

-- name: shard_times  the first %(n)s shards to finish, in completion order (burn-down without samples; index shards_done_at)
SELECT shard_no, done_at, stored, dead
  FROM bi.shards WHERE job_version = %(job)s AND done_at IS NOT NULL ORDER BY done_at, shard_no LIMIT %(n)s;

-- name: shards_finished_at  when the job's last shard finished (one probe of shards_done_at)
SELECT max(done_at) AS done_at FROM bi.shards WHERE job_version = %(job)s AND done_at IS NOT NULL;

-- name: shard_states  shard and record counts by shard state, from the job's stripes
SELECT s.state, s.shards, s.records
  FROM (SELECT coalesce(sum(pending), 0) AS pending, coalesce(sum(leased), 0) AS leased,
               coalesce(sum(done), 0) AS done, coalesce(sum(pending_records), 0) AS pending_records,
               coalesce(sum(leased_records), 0) AS leased_records, coalesce(sum(done_records), 0) AS done_records
          FROM bi.shard_stripes WHERE job_version = %(job)s) t
 CROSS JOIN LATERAL (VALUES ('pending', t.pending, t.pending_records), ('leased', t.leased, t.leased_records),
                            ('done', t.done, t.done_records)) AS s(state, shards, records);

-- name: shard_page  the shard table of one job, a page at a time
SELECT shard_no, state, epoch, lease_owner, lease_transport, lease_expires_at, claims, records, stored,
       stored_fallback, dead, first_claim_at, done_at
  FROM bi.shards WHERE job_version = %(job)s ORDER BY shard_no LIMIT %(limit)s OFFSET %(offset)s;

-- name: dead_letter_reasons  dead letters grouped by reason, most frequent first, from their counts (run as the reader: RLS counts)
SELECT reason, stage, sum(n)::bigint AS n
  FROM bi.dead_letter_counts WHERE job_version = %(job)s
 GROUP BY reason, stage HAVING sum(n) > 0 ORDER BY n DESC, reason LIMIT 50;

-- name: dead_letter_page  one page of dead letters; error and raw output cut to what a table can show
SELECT record_id, reason, attempts, stage, transport, left(error, 500) AS error,
       left(raw_output, 500) AS raw_output, created_at
  FROM bi.dead_letters WHERE job_version = %(job)s
 ORDER BY record_id LIMIT %(limit)s OFFSET %(offset)s;

-- name: previous_published  the version that was published before this one (drift baseline for the published job)
SELECT from_version AS job_version FROM bi.publish_history
 WHERE dataset = %(dataset)s AND to_version = %(job)s AND from_version IS NOT NULL
 ORDER BY id DESC LIMIT 1;

-- name: run_dags  every DAG that has run a job version (the jobs list is filtered by the user's read permission on them)
SELECT DISTINCT dag_id FROM bi.job_runs ORDER BY dag_id;

-- name: job_dags  the DAGs whose runs worked on one job version
SELECT DISTINCT dag_id FROM bi.job_runs WHERE job_version = %(job)s ORDER BY dag_id;

-- name: dataset_dags  the DAGs whose runs worked on any version of a dataset
SELECT DISTINCT r.dag_id FROM bi.job_runs r JOIN bi.jobs j ON j.job_version = r.job_version
 WHERE j.dataset = %(dataset)s ORDER BY r.dag_id;

-- name: dashboard_reader  the database role an Airflow user reads customer text as, and why it may not (NULL: it may)
SELECT role_name, bi.dashboard_role_problem_v1(role_name) AS problem
  FROM bi.dashboard_readers WHERE airflow_user = %(user)s;

-- name: dead_letter_visible  how many of a job's dead letters the current role sees, from their counts (run as the reader: RLS counts)
SELECT coalesce(sum(n), 0)::bigint AS n FROM bi.dead_letter_counts WHERE job_version = %(job)s;

-- name: visible_records  which of these records of a job the current role sees, as a result or a dead letter (run as the reader)
SELECT record_id FROM bi.results WHERE job_version = %(job)s AND record_id = ANY(%(ids)s)
 UNION
SELECT record_id FROM bi.dead_letters WHERE job_version = %(job)s AND record_id = ANY(%(ids)s);

-- name: statement_timeout  a dashboard read must never hold the ledger for long (this transaction only)
SELECT set_config('statement_timeout', %(timeout)s, true);

-- name: reader_role_set  run the rest of this transaction as the user's reader role
SET LOCAL ROLE {role};
