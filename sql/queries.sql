-- Named statements used by the package. Format: "-- name: NAME  what it does",
-- then the statement. Loaded, with the other files of db.QUERY_FILES, by
-- batch_inference.db.queries(): no SQL is written anywhere else.
-- Statements with {placeholders} are composed with psycopg.sql parts (db.composed).

-- name: migration_lock  one migrator at a time (this transaction)
SELECT pg_advisory_xact_lock(%(key)s);

-- name: migrations_table  where applied migrations are recorded, created by the first migrate
CREATE SCHEMA IF NOT EXISTS bi;
CREATE TABLE IF NOT EXISTS bi.schema_migrations (
    name text PRIMARY KEY, checksum text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp());

-- name: migrations_applied  every migration applied to this database, with the checksum of its file then
SELECT name, checksum FROM bi.schema_migrations;

-- name: migration_record  one migration applied
INSERT INTO bi.schema_migrations (name, checksum) VALUES (%(name)s, %(checksum)s);

-- name: stage_create  a per-transaction staging table for rows read in Python (object store, another database)
CREATE TEMP TABLE _bi_stage (record_id text, text text, acl text[], reject text) ON COMMIT DROP;

-- name: stage_copy  COPY target for rows read in Python, in binary (snapshot.copy_rows)
COPY _bi_stage (record_id, text, acl, reject) FROM STDIN (FORMAT BINARY);

-- name: query_stage_create  a per-transaction table for a source.query's rows, filled read-only inside the submit's transaction
CREATE TEMP TABLE _bi_query (record_id text, text text, acl text[], reject text) ON COMMIT DROP;

-- name: query_stage_fill  the source.query's rows, in a read-only subtransaction and one statement
INSERT INTO pg_temp._bi_query (record_id, text, acl, reject) SELECT * FROM {relation} AS s;

-- name: source_longest_id  the longest record id of a source (named when one is too long to key a result)
SELECT left(record_id, 40) AS head, octet_length(record_id) AS bytes FROM {relation} AS s
 ORDER BY octet_length(record_id) DESC NULLS LAST LIMIT 1;

-- name: source_relation  a PostgreSQL table or query seen as (record_id, text, acl, reject)
(SELECT ({id})::text AS record_id, ({text})::text AS text, {acl} AS acl, NULL::text AS reject FROM {source} AS src)

-- name: source_columns_relation  a PostgreSQL table or query whose records are several columns, seen as (record_id, text, acl, reject)
-- The text is the JSON array of the columns as text, as prompting.columns_text
-- writes it; the record is judged whole: empty when every column is blank,
-- over the cap when its columns together are longer than max_input_chars
-- (sources.record judges a record read in Python the same way). No percent
-- sign: the relation is run both with parameters (snapshot_insert) and without.
(SELECT r.record_id, json_build_array(VARIADIC r.vals)::text AS text, r.acl,
        CASE WHEN r.chars > {cap} THEN 'input over the length cap (' || r.chars || ' characters > ' || {cap} || ')'
             WHEN NOT EXISTS (SELECT FROM unnest(r.vals) AS v WHERE v ~ E'[^ \t\n\r\f\x0b]') THEN 'empty text'
        END AS reject
   FROM (SELECT c.*, (SELECT coalesce(sum(length(v)), 0) FROM unnest(c.vals) AS v) AS chars
           FROM (SELECT ({id})::text AS record_id, ARRAY[{columns}]::text[] AS vals, {acl} AS acl
                   FROM {source} AS src) c) r)

-- name: snapshot_scan  one pass over the source: size, NULL ids and an order-independent content identity
-- sum(bigint) is exact (a numeric result, added up in 128-bit integers), so
-- each sum is the one a numeric sum of the same hashes gives, without a
-- numeric per row.
SELECT count(*) AS n,
       count(*) FILTER (WHERE s.record_id IS NULL) AS null_ids,
       coalesce(sum(hashtextextended(s.record_id, 17) # hashtextextended(coalesce(s.text, ''), 19)
                    # coalesce(hash_array_extended(s.acl, 23), 0)), 0)::text AS a,
       coalesce(sum(hashtextextended(s.record_id, 29) # hashtextextended(coalesce(s.text, ''), 31)
                    # coalesce(hash_array_extended(s.acl, 37), 0)), 0)::text AS b
  FROM {relation} AS s;

-- name: source_duplicates  a few duplicate record ids, worst first (only run after a unique violation)
SELECT s.record_id, count(*) AS n FROM {relation} AS s WHERE s.record_id IS NOT NULL
 GROUP BY s.record_id HAVING count(*) > 1 ORDER BY n DESC, s.record_id LIMIT 5;

-- name: halt_job  record that the job's workers cannot work (the cutoff watch ends the run); NULL if not running
SELECT bi.halt_job_v1(%(job)s, %(reason)s) AS halted_at;

-- name: listen_halts  a cutoff watch hears each halt at once (bi.halt_job_v1 notifies bi_halt with the job version)
LISTEN bi_halt;

-- name: listen_done  a cutoff watch hears at once that a job's last shard is done (bi.complete_shard_v2 notifies bi_done with the job version)
LISTEN bi_done;

-- name: job_halt  the job's latest halt, if any, the first work on the version seen after it (a shard claimed, renewed or finished, a DAG run's submit) and a later resubmit that changed its settings: either makes the halt a past one
SELECT j.halted_at, j.halt_reason, CASE WHEN j.resubmitted_at > j.halted_at THEN j.resubmitted_at END AS resubmitted_after,
       (SELECT min(t) FROM (SELECT v.t FROM bi.shards s
                              CROSS JOIN LATERAL (VALUES (s.first_claim_at), (s.lease_renewed_at), (s.done_at)) v (t)
                             WHERE s.job_version = j.job_version
                            UNION ALL
                            SELECT r.at FROM bi.job_runs r WHERE r.job_version = j.job_version) w
         WHERE w.t > j.halted_at) AS worked_after
  FROM bi.jobs j WHERE j.job_version = %(job)s;

-- name: job_manifest  the small manifest of an existing job version
SELECT job_version, dataset, records, shards, planned_dead AS dead_letters, reused, status, mode
  FROM bi.jobs WHERE job_version = %(job)s;

-- name: job_settings_update  a resubmit's settings outside the job version (guarded: same spec hash, not published or dropped)
UPDATE bi.jobs SET spec = %(spec_text)s::jsonb, spec_text = %(spec_text)s, resubmitted_at = clock_timestamp()
 WHERE job_version = %(job)s AND spec_hash = %(spec_hash)s AND status NOT IN ('published', 'dropped')
RETURNING job_version;

-- name: base_for_reuse  the newest validated version of the same dataset and spec (incremental runs)
SELECT job_version FROM bi.jobs
 WHERE dataset = %(dataset)s AND spec_hash = %(spec_hash)s AND status IN ('validated', 'published')
   AND job_version <> %(job)s
 ORDER BY (status = 'published') DESC, created_at DESC LIMIT 1;

-- name: repeatable_read  one snapshot of the database for the whole transaction (a submit reads its source twice: scan, then load)
-- MySQL / MariaDB take the same statement for the next transaction (sources.sql, source_mysql_snapshot starts it).
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ;

-- name: read_only_transaction  the rest of this (sub)transaction may not write (a source.query's fill)
SET TRANSACTION READ ONLY;

-- name: job_partitions_create  the job version's snapshot and result partitions; returns the snapshot partition's name
SELECT bi.create_job_partitions_v1(%(job)s) AS p;

-- name: snapshot_job_version  the snapshot partition's job_version column, added once it is written: a constant default, stored once in the catalog, not in every row (no rewrite, no scan)
ALTER TABLE bi.{partition} ADD COLUMN job_version text NOT NULL DEFAULT {job};

-- name: snapshot_attach  attach the filled snapshot partition (builds its key: a duplicate id fails here)
-- Columns are matched by name: the partition's job_version is its last column, the parent's first.
SELECT bi.attach_snapshot_v2(%(job)s);

-- name: shard_numbers_create  the sequence snapshot_insert numbers the eligible records from (0, 1, 2, ...), dropped by shard_numbers_drop in the same transaction
-- Cached in the backend: nextval touches the sequence's page once every 10,000 numbers.
CREATE SEQUENCE {numbers} MINVALUE 0 START 0 CACHE 10000;

-- name: shard_numbers_drop  the submit's shard-number sequence, once snapshot_insert has used it
DROP SEQUENCE {numbers};

-- name: job_insert  register a job version (counts are filled in by plan_finish)
INSERT INTO bi.jobs (job_version, dataset, spec_hash, snapshot_id, spec, spec_text, model_name, model_digest,
                     prompt_version, records, base_job_version)
VALUES (%(job)s, %(dataset)s, %(spec_hash)s, %(snapshot_id)s, %(spec_text)s::text::jsonb, %(spec_text)s::text, %(model_name)s,
        %(model_digest)s, %(prompt_version)s, %(records)s, %(base)s);

-- name: snapshot_insert  write the snapshot partition with CREATE TABLE AS (the bulk path) and plan it in the same pass
-- The job version is not a column here: snapshot_job_version adds it after.
-- Each record is rejected (why), reused (an unchanged record of the base
-- version, incremental runs: the reuse placeholder is snapshot_reuse, else
-- snapshot_no_reuse)
-- or given a shard: a running count over the eligible rows in the order they
-- are written, so no sort of the whole snapshot is needed, and shards are
-- numbered 0..n-1 with shard_size records each but the last (plan_finish
-- relies on it). The count is the submit's own sequence (shard_numbers_create),
-- called only for an eligible row: a window count would copy every row, text
-- included, through a tuple store first.
-- The reject tests are written to read as little of each text as they can
-- (a long text is stored compressed, and every function call decompresses it
-- again; the content hash is the one full read):
--   blank = no character outside btrim's set E' \t\n\r\f\x0b' (the regex stops
--     at the first other one), tested only when the first character, read from a
--     slice, is one of them or the text is empty (ascii('') = 0);
--   too long = over cap characters; a text of at most cap bytes has at most cap
--     characters, and octet_length reads only the header.
CREATE TABLE bi.{partition} AS
SELECT c.record_id,
       CASE WHEN c.reject IS NULL AND NOT c.reused THEN (nextval({numbers}) / %(shard_size)s)::integer END AS shard_no,
       c.text, c.acl, c.content_hash, c.reject
  FROM (SELECT r.*, coalesce(base.reused, false) AS reused
          FROM (SELECT s.record_id, coalesce(s.text, '') AS text, s.acl,
                       to_hex(hashtextextended(coalesce(s.text, ''), 0)
                              # coalesce(hash_array_extended(s.acl, 0), 0)) AS content_hash,
                       CASE WHEN s.reject IS NOT NULL THEN s.reject
                            WHEN s.text IS NULL
                                 OR (ascii(substr(s.text, 1, 1)) IN (0, 9, 10, 11, 12, 13, 32)
                                     AND s.text !~ E'[^ \t\n\r\f\x0b]') THEN 'empty text'
                            WHEN octet_length(s.text) > %(cap)s AND length(s.text) > %(cap)s
                            THEN format('input over the length cap (%%s characters > %%s)', length(s.text), %(cap)s)
                       END AS reject
                  FROM {relation} AS s
                OFFSET 0) r   -- not flattened: each CASE above is computed once per row, not once per use
          {reuse}) c;

-- name: snapshot_reuse  the reuse join of snapshot_insert in an incremental run: the base version's unchanged records that have a result
LEFT JOIN (SELECT b.record_id, b.content_hash, true AS reused
             FROM bi.snapshot_rows b
             JOIN bi.results br ON br.job_version = b.job_version AND br.record_id = b.record_id
            WHERE b.job_version = %(base)s) base
  ON base.record_id = r.record_id AND base.content_hash = r.content_hash AND r.reject IS NULL

-- name: snapshot_no_reuse  the reuse join of snapshot_insert otherwise: one constant row, folded away (no join per record)
CROSS JOIN (SELECT NULL::boolean AS reused) base

-- name: plan_work_mem  room for the index builds and joins of a submit, built by this backend alone (this transaction only)
-- Parallel index builds cost more CPU in all (the primary key at 1M records on
-- 2 cores: 0.6 CPU-s and 0.6 s serial, 1.1 CPU-s and 0.9 s with two workers) and
-- shorten the build only where idle cores wait; a submit is batch work beside
-- interactive users of the same database (I5), so it builds on one core.
SELECT set_config('maintenance_work_mem', '256MB', true), set_config('work_mem', '64MB', true),
       set_config('max_parallel_maintenance_workers', '0', true);

-- name: plan_unsharded  the records that never reach a worker, read through the shard index (shard_no IS NULL), and the last shard
-- The sizes of the shards follow from these counts (see snapshot_insert), so
-- the snapshot is not read again to count them; max(shard_no) is an index probe.
SELECT count(*) FILTER (WHERE p.reject IS NOT NULL) AS dead,
       count(*) FILTER (WHERE p.reject IS NULL) AS reused,
       (SELECT max(x.shard_no) FROM bi.snapshot_rows x WHERE x.job_version = %(job)s) AS last_shard
  FROM bi.snapshot_rows p
 WHERE p.job_version = %(job)s AND p.shard_no IS NULL;

-- name: plan_dead_letters  records that never reach a worker, with their reason (run only when there are some)
INSERT INTO bi.dead_letters (job_version, record_id, reason, error, raw_output, attempts, stage,
                             model_name, model_digest, prompt_version, transport, acl)
SELECT %(job)s, p.record_id, p.reject, p.reject, NULL, 0,
       CASE WHEN p.reject LIKE 'input over the length cap%%' THEN 'plan' ELSE 'snapshot' END,
       j.model_name, j.model_digest, j.prompt_version, NULL, p.acl
  FROM bi.snapshot_rows p JOIN bi.jobs j ON j.job_version = p.job_version
 WHERE p.job_version = %(job)s AND p.shard_no IS NULL AND p.reject IS NOT NULL;

-- name: plan_reuse  carry over results of unchanged records from the base version (incremental), counted per category in stripe 0
WITH reused AS (
    INSERT INTO bi.results (job_version, record_id, output, category, model_name, model_digest, prompt_version,
                            transport, engine, endpoint, worker_id, epoch, acl, content_hash, created_at, embedding)
    SELECT %(job)s, r.record_id, r.output, r.category, r.model_name, r.model_digest, r.prompt_version,
           'reused', r.engine, r.endpoint, r.worker_id, r.epoch, p.acl, p.content_hash, r.created_at, r.embedding
      FROM bi.snapshot_rows p
      JOIN bi.results r ON r.job_version = %(base)s AND r.record_id = p.record_id
     WHERE p.job_version = %(job)s AND p.shard_no IS NULL AND p.reject IS NULL
    RETURNING category
)
INSERT INTO bi.category_stripes AS t (job_version, stripe, category, n)
SELECT %(job)s, 0, c.category, count(*) FROM reused c GROUP BY c.category
ON CONFLICT ON CONSTRAINT category_stripes_key DO UPDATE SET n = t.n + excluded.n;

-- name: plan_finish  the shard rows and the job's fixed counts: shard i holds shard_size records, the last one the rest
WITH n AS (SELECT %(records)s::bigint - %(dead)s - %(reused)s AS eligible),
shards AS (
    INSERT INTO bi.shards (job_version, shard_no, records)
    SELECT %(job)s, i, least(%(shard_size)s, n.eligible - i::bigint * %(shard_size)s)
      FROM n, generate_series(0, ((n.eligible + %(shard_size)s - 1) / %(shard_size)s)::integer - 1) AS i
    RETURNING shard_no)
UPDATE bi.jobs j SET
    shards = (SELECT count(*) FROM shards), planned_dead = %(dead)s, reused = %(reused)s
 WHERE j.job_version = %(job)s
RETURNING j.job_version, j.dataset, j.records, j.shards, j.planned_dead AS dead_letters, j.reused;

-- name: job_counts  live counts from the shard table (cost independent of records)
SELECT * FROM bi.job_counts_v1(%(job)s);

-- name: shards_by_state  the shard table of one job
SELECT shard_no, state, epoch, lease_owner, lease_transport, lease_expires_at, claims, records, stored,
       stored_fallback, dead, first_claim_at, done_at
  FROM bi.shards WHERE job_version = %(job)s ORDER BY shard_no;

-- name: dead_letters  the dead letters of one job
SELECT record_id, reason, attempts, stage, error, raw_output, transport, created_at
  FROM bi.dead_letters WHERE job_version = %(job)s ORDER BY record_id;

-- name: dead_letter_causes  dead letters of one job grouped by cause, read from their reasons: endpoint (transport, HTTP 5xx), output (invalid or off-schema), input (rejected before a worker), other
SELECT cause, count(*) AS n, min(reason) AS example
  FROM (SELECT CASE WHEN reason ~* %(endpoint)s THEN 'endpoint'
                    WHEN reason ~* %(output)s THEN 'output'
                    WHEN stage <> 'worker' THEN 'input'
                    ELSE 'other' END AS cause, reason
          FROM bi.dead_letters WHERE job_version = %(job)s) d
 GROUP BY cause ORDER BY n DESC, cause;

-- name: job_run_record  the job version a DAG run's submit returned, created or resumed (0013); the run's latest submit wins
INSERT INTO bi.job_runs (dag_id, run_id, job_version, created)
VALUES (%(dag_id)s, %(run_id)s, %(job)s, %(created)s)
ON CONFLICT (dag_id, run_id) DO UPDATE
   SET job_version = excluded.job_version, created = excluded.created, at = excluded.at;

-- name: job_runs_earlier  the latest other DAG runs that submitted a version of the same dataset (this job version or another) before this run did
SELECT r.dag_id, r.run_id FROM bi.job_runs r JOIN bi.jobs j ON j.job_version = r.job_version
 WHERE j.dataset = (SELECT dataset FROM bi.jobs WHERE job_version = %(job)s)
   AND NOT (r.dag_id = %(dag_id)s AND r.run_id = %(run_id)s)
   AND r.at < (SELECT at FROM bi.job_runs WHERE dag_id = %(dag_id)s AND run_id = %(run_id)s)
 ORDER BY r.at DESC LIMIT 20;

-- name: job_run_version  the job version a DAG run submitted, if its submit got that far
SELECT job_version, created FROM bi.job_runs WHERE dag_id = %(dag_id)s AND run_id = %(run_id)s;

-- name: done_keys  record ids of one shard already stored or dead-lettered (resume)
SELECT sr.record_id
  FROM bi.snapshot_rows sr
 WHERE sr.job_version = %(job)s AND sr.shard_no = %(shard)s
   AND (EXISTS (SELECT 1 FROM bi.results r WHERE r.job_version = sr.job_version AND r.record_id = sr.record_id)
        OR EXISTS (SELECT 1 FROM bi.dead_letters d WHERE d.job_version = sr.job_version AND d.record_id = sr.record_id));

-- name: claim_shard  a pending or expired shard; lost_leases > 0 means run it carefully (0006)
SELECT * FROM bi.claim_shard_v2(%(job)s, %(owner)s, %(transport)s, %(lease_s)s);

-- name: renew_lease  extend the lease, read the job's mode (fenced calls answer one row; stale is true once our epoch ended)
SELECT * FROM bi.renew_lease_v2(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(lease_s)s);

-- name: release_shard
SELECT * FROM bi.release_shard_v2(%(job)s, %(shard)s, %(epoch)s, %(owner)s);

-- name: complete_shard
SELECT * FROM bi.complete_shard_v2(%(job)s, %(shard)s, %(epoch)s, %(owner)s);

-- name: shard_records  one page of the records still to do (the first %(limit)s after %(after)s, in record_id order), with failed attempts and crashes so far
SELECT * FROM bi.shard_records_v4(%(job)s, %(shard)s, %(epoch)s, %(after)s, %(limit)s);

-- name: mark_in_flight  careful mode: the engine batch about to be generated
SELECT * FROM bi.mark_in_flight_v2(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(ids)s::text[]);

-- name: abandon_shard  the engine broke: give the shard back, counted as a lost lease
SELECT * FROM bi.abandon_shard_v2(%(job)s, %(shard)s, %(epoch)s, %(owner)s);

-- name: put_results  put-if-absent under the lease; the engine and its endpoint class once per call
SELECT * FROM bi.put_results_v3(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(transport)s, %(engine)s, %(endpoint)s,
                                %(ids)b::text[], %(outputs)b::text[]::jsonb[], %(categories)b::text[]);

-- name: put_results_joined  put_results with each column one text split at U+001E, a NULL category as U+001F (Ledger.put_results: no array encoded element by element)
SELECT * FROM bi.put_results_v3(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(transport)s, %(engine)s, %(endpoint)s,
                                string_to_array(%(ids)s::text, E'\x1e'),
                                string_to_array(%(outputs)s::text, E'\x1e')::jsonb[],
                                string_to_array(%(categories)s::text, E'\x1e', E'\x1f'));

-- name: fail_records  one failed attempt per record, the attempt numbers make a retried call count once
SELECT * FROM bi.fail_records_v3(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(transport)s,
                                 %(ids)s::text[], %(errors)s::text[], %(outputs)s::text[],
                                 %(attempt_nos)s::integer[]);

-- name: sweep_expired
SELECT bi.sweep_expired_v1(%(job)s) AS n;

-- name: enter_fallback
SELECT bi.enter_fallback_v1(%(job)s) AS ok;

-- name: job_spec  the spec as submitted (json keeps the schema's property order; 0005)
SELECT * FROM bi.job_spec_v2(%(job)s);

-- name: drop_job_version
SELECT bi.drop_job_version_v1(%(job)s) AS dropped;

-- name: grant_job  let a worker role (a member of bi_worker) work on a job version (owner only)
SELECT bi.grant_job_v1(%(role)s, %(job)s) AS changed;

-- name: revoke_job  take a job version back from a worker role
SELECT coalesce(bi.revoke_job_v1(%(role)s, %(job)s), false) AS changed;

-- name: fence_counts  refused stale-epoch writes by operation
SELECT op, count(*) AS n FROM bi.fence_events WHERE job_version = %(job)s GROUP BY op ORDER BY op;

-- deadline and fallback

-- name: cutoff_job  what the cutoff and the fallback pool read of a job: spec, mode, when it fired, the DB clock
SELECT job_version, dataset, spec, mode, status, fallback_at, clock_timestamp() AS db_now
  FROM bi.jobs WHERE job_version = %(job)s;

-- name: fallback_history  a dataset's last n fallback runs and its last w complete ones, newest first
-- (complete: drain, re-drive and load measured, re-drive >= min_redrive_s)
SELECT job_version, dataset, records, rate, overhead_s, drain_s, busy_s, load_s, started_at, finished_at
  FROM bi.fallback_runs
 WHERE id IN ((SELECT id FROM bi.fallback_runs WHERE dataset = %(dataset)s
                ORDER BY finished_at DESC, id DESC LIMIT %(n)s)
              UNION
              (SELECT id FROM bi.fallback_runs WHERE dataset = %(dataset)s AND drain_s IS NOT NULL
                  AND busy_s >= %(min_redrive_s)s AND load_s IS NOT NULL
                ORDER BY finished_at DESC, id DESC LIMIT %(w)s))
 ORDER BY finished_at DESC, id DESC;

-- name: progress_insert  one progress sample (the burn-down chart, the moving cutoff's history)
INSERT INTO bi.progress (job_version, stored, dead_letters, outstanding, latest_safe_start, deadline)
VALUES (%(job)s, %(stored)s, %(dead_letters)s, %(outstanding)s, %(latest_safe_start)s, %(deadline)s);

-- name: fallback_run_insert  one measured fallback run: started_at is when the cutoff fired (jobs.fallback_at)
-- drain_s: to the latest batch lease end of the job's shards (0 if none after the firing); NULL while one is left
INSERT INTO bi.fallback_runs (job_version, dataset, started_at, finished_at, records, rate, overhead_s, busy_s, drain_s)
SELECT %(job)s, %(dataset)s, %(started_at)s, %(finished_at)s, %(records)s, %(rate)s, %(overhead_s)s, %(busy_s)s,
       CASE WHEN bool_or(s.state = 'leased' AND s.lease_transport IN ('batch', 'hosted_batch')) THEN NULL
            ELSE extract(epoch FROM greatest(%(started_at)s, max(s.batch_lease_ended_at)) - %(started_at)s)::float8 END
  FROM bi.shards s WHERE s.job_version = %(job)s
RETURNING id, drain_s;

-- name: fallback_run_add_load  the warehouse load of the job's latest fallback run, recorded once (publish calls it)
-- load_s given, else from the run's finished_at to the dataset's pointer switch to this version
WITH latest AS (
    SELECT r.id, coalesce(%(load_s)s::float8,
                          extract(epoch FROM p.switched_at - r.finished_at)::float8) AS load_s
      FROM bi.fallback_runs r
      LEFT JOIN bi.publish_pointer p ON p.dataset = r.dataset AND p.job_version = r.job_version
     WHERE r.job_version = %(job)s ORDER BY r.id DESC LIMIT 1
), upd AS (
    UPDATE bi.fallback_runs r SET load_s = greatest(0, latest.load_s)
      FROM latest WHERE r.id = latest.id AND r.load_s IS NULL AND latest.load_s IS NOT NULL
    RETURNING r.id, r.overhead_s, r.load_s, true AS recorded
)
SELECT id, overhead_s, load_s, recorded FROM upd
UNION ALL
SELECT r.id, r.overhead_s, r.load_s, false FROM bi.fallback_runs r JOIN latest USING (id)
 WHERE NOT EXISTS (SELECT 1 FROM upd);

-- name: leases_by_transport  shards still leased, by transport (batch leases are the drain still to come)
SELECT lease_transport AS transport, count(*) AS n
  FROM bi.shards WHERE job_version = %(job)s AND state = 'leased' GROUP BY lease_transport;

-- validate and publish

-- name: validate_job  the job fields the validator and publish need
SELECT job_version, dataset, status, records, reused, planned_dead, validation
  FROM bi.jobs WHERE job_version = %(job)s;

-- name: validate_work_mem  room for hash joins over a million record ids (this transaction only)
SELECT set_config('work_mem', '256MB', true);

-- name: validate_coverage  snapshot records against results and dead letters, by record id, in one pass
SELECT count(*) AS snapshot,
       count(*) FILTER (WHERE r.record_id IS NULL AND d.record_id IS NULL) AS missing,
       count(*) FILTER (WHERE r.record_id IS NOT NULL AND d.record_id IS NOT NULL) AS in_both,
       count(r.record_id) AS stored_in_snapshot,
       count(d.record_id) AS dead_in_snapshot
  FROM bi.snapshot_rows s
  LEFT JOIN bi.results r ON r.job_version = %(job)s AND r.record_id = s.record_id
  LEFT JOIN bi.dead_letters d ON d.job_version = %(job)s AND d.record_id = s.record_id
 WHERE s.job_version = %(job)s;

-- name: validate_dead_letter_count  all dead letters of a version, in the snapshot or not
SELECT count(*) AS n FROM bi.dead_letters WHERE job_version = %(job)s;

-- name: validate_missing_ids  the first snapshot records with neither a result nor a dead letter
SELECT s.record_id FROM bi.snapshot_rows s
 WHERE s.job_version = %(job)s
   AND NOT EXISTS (SELECT 1 FROM bi.results r WHERE r.job_version = s.job_version AND r.record_id = s.record_id)
   AND NOT EXISTS (SELECT 1 FROM bi.dead_letters d WHERE d.job_version = s.job_version AND d.record_id = s.record_id)
 ORDER BY s.record_id LIMIT %(n)s;

-- name: validate_in_both_ids  the first records with both a result and a dead letter
SELECT r.record_id FROM bi.results r
  JOIN bi.dead_letters d ON d.job_version = r.job_version AND d.record_id = r.record_id
 WHERE r.job_version = %(job)s ORDER BY r.record_id LIMIT %(n)s;

-- name: validate_orphan_ids  the first results or dead letters whose record is not in the snapshot
SELECT t.record_id FROM (SELECT record_id FROM bi.results WHERE job_version = %(job)s
                         UNION SELECT record_id FROM bi.dead_letters WHERE job_version = %(job)s) t
 WHERE NOT EXISTS (SELECT 1 FROM bi.snapshot_rows s WHERE s.job_version = %(job)s AND s.record_id = t.record_id)
 ORDER BY t.record_id LIMIT %(n)s;

-- name: validate_results  one scan: rows per category, engine, endpoint class and transport, and rows the SQL form of the schema cannot vouch for ({valid})
SELECT r.category, r.engine, r.endpoint, r.transport, count(*) AS n, count(*) FILTER (WHERE NOT {valid}) AS unvouched
  FROM bi.results r WHERE r.job_version = %(job)s GROUP BY r.category, r.engine, r.endpoint, r.transport;

-- name: validate_unvouched  the outputs {valid} does not vouch for, as JSON text, for the full check in Python
SELECT r.record_id, r.output::text AS output
  FROM bi.results r WHERE r.job_version = %(job)s AND NOT {valid};

-- name: category_counts  rows per category of one version (drift, when its report lacks them), from its category stripes
SELECT category, sum(n)::bigint AS n FROM bi.category_stripes WHERE job_version = %(job)s GROUP BY category HAVING sum(n) > 0;

-- name: validate_sample  the stored review sample (review_sample_store picks it) with its input text
SELECT record_id, text, output::text AS output FROM bi.review_sample WHERE job_version = %(job)s
 ORDER BY record_id LIMIT %(n)s;

-- name: record_validation  store the report; status validated or failed_validation (guarded: every shard done)
SELECT bi.record_validation_v1(%(job)s, %(report)s, %(passed)s) AS status;

-- name: published_version  the version a dataset's view shows now, with its last validation report
SELECT p.dataset, p.job_version, p.switched_at, p.switched_by, j.validation
  FROM bi.publish_pointer p JOIN bi.jobs j ON j.job_version = p.job_version
 WHERE p.dataset = %(dataset)s;

-- name: set_lock_timeout  for DDL (the first publish creates the view): fail fast and retry, never queue readers
SELECT set_config('lock_timeout', %(timeout)s, true);

-- name: ensure_published_view  the dataset's view shaped like the version it shows (DDL only when the shape changes)
SELECT bi.ensure_published_view_v2(%(dataset)s, %(id_type)s, %(columns)s::jsonb) AS view_name;

-- name: source_id_type  the view's record_id type from a source table's id column (catalog only): bigint, uuid or text
SELECT CASE format_type(a.atttypid, NULL) WHEN 'smallint' THEN 'bigint' WHEN 'integer' THEN 'bigint'
                                          WHEN 'bigint' THEN 'bigint' WHEN 'uuid' THEN 'uuid' ELSE 'text' END AS id_type
  FROM pg_attribute a
 WHERE a.attrelid = to_regclass(%(table)s) AND a.attname = %(column)s AND a.attnum > 0 AND NOT a.attisdropped;

-- name: publish  switch the dataset's pointer to a version and record it (guards in bi.publish_v1)
SELECT * FROM bi.publish_v1(%(dataset)s, %(job)s, %(actor)s, %(force)s, %(reason)s);

-- name: rollback  switch the dataset's pointer back to the version the current one replaced
SELECT * FROM bi.rollback_v1(%(dataset)s, %(actor)s, %(reason)s);

-- name: publish_expected  publish, refused (SQLSTATE BI409) unless the pointer is at the expected version (bi.publish_v2)
SELECT * FROM bi.publish_v2(%(dataset)s, %(job)s, %(expected)s, %(actor)s, %(force)s, %(reason)s);

-- name: rollback_expected  roll back, refused (SQLSTATE BI409) unless the pointer is at the expected version (bi.rollback_v2)
SELECT * FROM bi.rollback_v2(%(dataset)s, %(expected)s, %(actor)s, %(reason)s);

-- name: published_view  the dataset's view, if created
SELECT dataset, view_name, fields, created_at, created_by FROM bi.published_views WHERE dataset = %(dataset)s;

-- name: publish_history  the latest publishes and rollbacks of a dataset, newest first
SELECT id, dataset, from_version, to_version, action, forced, reason, actor, at
  FROM bi.publish_history WHERE dataset = %(dataset)s ORDER BY id DESC LIMIT %(n)s;

-- name: dataset_null_acl  what a record without an ACL means for the dataset's readers
SELECT coalesce((SELECT null_acl FROM bi.dataset_acl WHERE dataset = %(dataset)s), 'all_readers') AS null_acl;

-- name: set_null_acl  all_readers or nobody
SELECT bi.set_null_acl_v1(%(dataset)s, %(mode)s) AS null_acl;

-- name: server_version  the server's version (the connection test of the Airflow UI)
SHOW server_version;

-- name: demo_tickets_reset  the demo's source table, created if missing and emptied
CREATE TABLE IF NOT EXISTS {table} (id text PRIMARY KEY, text text, acl text[], channel text, created_at timestamptz);
TRUNCATE {table};

-- name: demo_tickets_copy  COPY target for the demo's sample tickets
COPY {table} (id, text, acl, channel, created_at) FROM STDIN;

-- name: latest_job_of_dataset  the newest job version of a dataset, with its status and validation report
SELECT job_version, status, validation FROM bi.jobs WHERE dataset = %(dataset)s ORDER BY created_at DESC LIMIT 1;

-- name: published_view_rows_count  the rows a dataset's published view shows ({view} as published() names it)
SELECT count(*) AS n FROM {view};

-- name: published_view_head  the first rows of a dataset's published view, by record id
SELECT {columns} FROM {view} ORDER BY record_id LIMIT %(n)s;

-- Publish destinations besides the view (batch_inference.destinations)

-- name: destination_rows  a job version's rows as a destination gets them, by record id (the output as JSON text)
SELECT record_id, output::text AS output, job_version, model_name, model_digest, prompt_version, transport, acl,
       created_at AS stored_at, embedding
  FROM bi.results WHERE job_version = %(job)s ORDER BY record_id;

-- name: destination_record  what a publish or rollback left a destination pointing at
INSERT INTO bi.publish_destinations (history_id, destination, job_version, snapshot_id, location)
VALUES (%(history_id)s, %(destination)s, %(job)s, %(snapshot_id)s, %(location)s);

-- name: destination_history  the destinations of a dataset's latest publishes and rollbacks
SELECT d.history_id, d.destination, d.job_version, d.snapshot_id, d.location
  FROM bi.publish_destinations d JOIN bi.publish_history h ON h.id = d.history_id
 WHERE h.dataset = %(dataset)s AND d.history_id = ANY (%(ids)s)
 ORDER BY d.history_id DESC, d.destination;

-- name: schema_exists  whether a schema exists in the connected database
SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %(schema)s) AS present;

-- name: redrive_dead_letters  put chosen dead letters of a version back to pending with a fresh attempt budget, recorded (guarded: not published or dropped, something matches, no matching shard leased)
SELECT * FROM bi.redrive_dead_letters_v1(%(job)s, %(actor)s, %(reason)s, %(stage)s, %(reason_like)s);

-- name: redrives  a version's re-drives of dead letters, newest first
SELECT id, job_version, actor, reason, stage, reason_like, records, shards, left_out, at
  FROM bi.redrives WHERE job_version = %(job)s ORDER BY id DESC LIMIT %(n)s;

-- name: dataset_names  every dataset that has a job version or a publish history (an unknown name's did-you-mean)
SELECT dataset FROM bi.jobs UNION SELECT dataset FROM bi.publish_history ORDER BY 1;

-- name: note_shared  count records of a shard stored with another record's result (the same rendered input) under the lease
SELECT * FROM bi.note_shared_v1(%(job)s, %(shard)s, %(epoch)s, %(owner)s, %(n)s);

-- name: shared_inputs  a job version's records stored with another record's result (identical rendered inputs computed once)
SELECT coalesce(sum(records), 0)::bigint AS n FROM bi.shared_inputs WHERE job_version = %(job)s;
