-- The chaos harness's source, audit and checks (batch_inference/chaos.py).
-- Not a migration: the harness installs it on a database it runs on, normally
-- an embedded server of its own. Same format as queries.sql, loaded with it by
-- batch_inference.db.queries(); every name starts with chaos_.

-- name: chaos_install  a lease log: every claim, release and completion of a shard, with its time
CREATE SCHEMA IF NOT EXISTS chaos;
CREATE TABLE IF NOT EXISTS chaos.lease_log (
    id          bigserial PRIMARY KEY,
    job_version text NOT NULL,
    shard_no    integer NOT NULL,
    epoch       bigint NOT NULL,
    event       text NOT NULL CHECK (event IN ('claim', 'release', 'done')),
    owner       text,
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- A lost lease (taken over after it expired, swept or abandoned): the holder that lost it and the
    -- batch it had marked in flight, which the ledger charged a death (bi.record_deaths_v1).
    lost_owner  text,
    lost_in_flight text[]
);
ALTER TABLE chaos.lease_log ADD COLUMN IF NOT EXISTS lost_owner text, ADD COLUMN IF NOT EXISTS lost_in_flight text[];
CREATE INDEX IF NOT EXISTS lease_log_shard ON chaos.lease_log (job_version, shard_no, epoch);
-- The trigger fires inside the ledger's own UPDATE, which holds the shard
-- row lock that every fenced write takes first (put_results_v2 and
-- fail_records_v3 lock the row FOR UPDATE). So an epoch's end is logged
-- strictly after every write that epoch got in, and strictly before any
-- write it refused: comparing results.created_at with these times is exact.
CREATE OR REPLACE FUNCTION chaos.log_lease() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO chaos.lease_log (job_version, shard_no, epoch, event, owner, lost_owner, lost_in_flight)
    VALUES (NEW.job_version, NEW.shard_no, NEW.epoch,
            CASE WHEN NEW.epoch <> OLD.epoch THEN 'claim'
                 WHEN NEW.state = 'done' THEN 'done'
                 ELSE 'release' END,
            CASE WHEN NEW.epoch <> OLD.epoch THEN NEW.lease_owner ELSE OLD.lease_owner END,
            CASE WHEN NEW.lost_leases > OLD.lost_leases THEN OLD.lease_owner END,
            CASE WHEN NEW.lost_leases > OLD.lost_leases AND NOT bi.lapsed_over_restart_v1(OLD.lease_renewed_at)
                 THEN OLD.in_flight END);
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS chaos_lease_log ON bi.shards;
CREATE TRIGGER chaos_lease_log AFTER UPDATE ON bi.shards FOR EACH ROW
    WHEN (OLD.epoch IS DISTINCT FROM NEW.epoch OR OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION chaos.log_lease();

-- name: chaos_lease_holders  who holds which shard now
SELECT lease_owner, shard_no, epoch FROM bi.shards WHERE job_version = %(job)s AND state = 'leased';

-- name: chaos_shard_epoch  one shard's current epoch and state
SELECT epoch, state FROM bi.shards WHERE job_version = %(job)s AND shard_no = %(shard)s;

-- name: chaos_coverage  every snapshot record is stored or dead-lettered, once
SELECT (SELECT count(*) FROM bi.snapshot_rows WHERE job_version = %(job)s) AS snapshot,
       (SELECT count(*) FROM bi.results WHERE job_version = %(job)s) AS stored,
       (SELECT count(*) - count(DISTINCT record_id) FROM bi.results WHERE job_version = %(job)s) AS duplicates,
       (SELECT count(*) FROM bi.dead_letters WHERE job_version = %(job)s) AS dead,
       (SELECT count(*) FROM bi.results r JOIN bi.dead_letters d USING (job_version, record_id)
         WHERE r.job_version = %(job)s) AS stored_and_dead,
       (SELECT count(*) FROM bi.snapshot_rows s
         WHERE s.job_version = %(job)s
           AND NOT EXISTS (SELECT 1 FROM bi.results r WHERE r.job_version = s.job_version AND r.record_id = s.record_id)
           AND NOT EXISTS (SELECT 1 FROM bi.dead_letters d
                            WHERE d.job_version = s.job_version AND d.record_id = s.record_id)) AS missing;

-- name: chaos_counter_drift  shards whose live counters disagree with the rows they count
SELECT count(*) AS shards
  FROM bi.shards s
 WHERE s.job_version = %(job)s
   AND (s.stored <> (SELECT count(*) FROM bi.results r
                       JOIN bi.snapshot_rows sr USING (job_version, record_id)
                      WHERE sr.job_version = s.job_version AND sr.shard_no = s.shard_no)
     OR s.dead <> (SELECT count(*) FROM bi.dead_letters d
                     JOIN bi.snapshot_rows sr USING (job_version, record_id)
                    WHERE sr.job_version = s.job_version AND sr.shard_no = s.shard_no));

-- name: chaos_stale_writes  result rows and a ladder's rung answers accepted from an epoch that was not, or no longer, the writer's lease
SELECT count(*) FILTER (WHERE NOT held) AS never_held,
       count(*) FILTER (WHERE ended) AS after_epoch_ended
  FROM (SELECT EXISTS (SELECT 1 FROM chaos.lease_log l
                        WHERE l.job_version = w.job_version AND l.shard_no = sr.shard_no
                          AND l.event = 'claim' AND l.epoch = w.epoch AND l.owner = w.worker_id) AS held,
               -- the epoch had ended (a later claim, a release or the shard's
               -- completion) when the row was written
               EXISTS (SELECT 1 FROM chaos.lease_log l
                        WHERE l.job_version = w.job_version AND l.shard_no = sr.shard_no
                          AND l.at <= w.created_at
                          AND ((l.event = 'claim' AND l.epoch > w.epoch)
                               OR (l.event IN ('release', 'done') AND l.epoch = w.epoch))) AS ended
          FROM (SELECT r.job_version, r.record_id, r.epoch, r.worker_id, r.created_at
                  FROM bi.results r WHERE r.job_version = %(job)s
                UNION ALL
                SELECT a.job_version, a.record_id, a.epoch, a.worker_id, a.created_at
                  FROM bi.ladder_answers a WHERE a.job_version = %(job)s) w
          JOIN bi.snapshot_rows sr USING (job_version, record_id)) t;

-- name: chaos_ladder_finals  a ladder job's final rung answers against its results: each result is its record's one final answer
SELECT (SELECT count(*) FROM bi.results r
         WHERE r.job_version = %(job)s
           AND NOT EXISTS (SELECT 1 FROM bi.ladder_answers a
                            WHERE a.job_version = r.job_version AND a.record_id = r.record_id
                              AND NOT a.escalated)) AS results_without_final,
       (SELECT count(*) FROM bi.results r
          JOIN bi.ladder_answers a ON a.job_version = r.job_version AND a.record_id = r.record_id AND NOT a.escalated
         WHERE r.job_version = %(job)s AND a.output::jsonb IS DISTINCT FROM r.output::jsonb) AS results_not_final,
       (SELECT count(*) FROM bi.ladder_answers a
         WHERE a.job_version = %(job)s AND NOT a.escalated
           AND NOT EXISTS (SELECT 1 FROM bi.results r
                            WHERE r.job_version = a.job_version AND r.record_id = a.record_id)) AS finals_not_stored,
       (SELECT count(*) - count(DISTINCT record_id) FROM bi.ladder_answers
         WHERE job_version = %(job)s AND NOT escalated) AS several_finals;

-- name: chaos_ladder_final_rungs  the rung of each record's final answer
SELECT record_id, rung FROM bi.ladder_answers WHERE job_version = %(job)s AND NOT escalated;

-- name: chaos_embed_vectors  stored vectors of an embedding job, and those not 4 bytes a dimension
SELECT count(*) AS vectors,
       count(*) FILTER (WHERE embedding IS NULL OR length(embedding) <> 4 * %(dims)s) AS malformed
  FROM bi.results WHERE job_version = %(job)s;

-- name: chaos_handoffs  claims after the first, by what ended the previous epoch
SELECT count(*) FILTER (WHERE prev_event = 'release') AS after_release,
       count(*) FILTER (WHERE prev_event = 'claim') AS after_expiry,
       count(*) FILTER (WHERE prev_event IS NOT NULL) AS handoffs,
       count(*) AS claims
  FROM (SELECT l.event, lag(l.event) OVER (PARTITION BY l.shard_no ORDER BY l.id) AS prev_event
          FROM chaos.lease_log l WHERE l.job_version = %(job)s) t
 WHERE event = 'claim';

-- name: chaos_death_dead_letters  records dead-lettered for deaths with them in flight (crashes at max_attempts), not for failed attempts
SELECT d.record_id
  FROM bi.dead_letters d
  JOIN bi.attempts a ON a.job_version = d.job_version AND a.record_id = d.record_id
  JOIN bi.jobs j ON j.job_version = d.job_version
 WHERE d.job_version = %(job)s AND d.stage = 'worker' AND a.crashes >= (j.spec ->> 'max_attempts')::integer;

-- name: chaos_death_charges  for each record dead-lettered for deaths, the holders whose lost lease charged it a death
SELECT x.id AS record_id, l.lost_owner
  FROM chaos.lease_log l
 CROSS JOIN LATERAL unnest(l.lost_in_flight) AS x(id)
 WHERE l.job_version = %(job)s AND x.id = ANY(%(ids)s);

-- name: chaos_fence_for  refusals of one worker's one epoch of one shard
SELECT count(*) AS n FROM bi.fence_events
 WHERE job_version = %(job)s AND worker_id = %(worker)s AND shard_no = %(shard)s AND presented = %(epoch)s;

-- name: chaos_source_create  the harness's source table, empty
DROP TABLE IF EXISTS public.chaos_records;
CREATE TABLE public.chaos_records (id text, body text, acl text[]);

-- name: chaos_source_copy  COPY target for the harness's records
COPY public.chaos_records (id, body, acl) FROM STDIN;

-- name: chaos_worker_role  the workers' LOGIN role, a member of bi_worker, created once ({name} its name as a literal)
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {name}) THEN
        CREATE ROLE {role} LOGIN IN ROLE bi_worker;
    END IF;
END $$;
