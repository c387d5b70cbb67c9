-- The chaos harness's audit and checks (batch_inference/chaos.py). Not a
-- migration: the harness installs it on a database it runs on, normally an
-- embedded server of its own. Same format as queries.sql.

-- name: install  a lease log: every claim, release and completion of a shard, with its time
CREATE SCHEMA IF NOT EXISTS chaos;
CREATE TABLE IF NOT EXISTS chaos.lease_log (
    id          bigserial PRIMARY KEY,
    job_version text NOT NULL,
    shard_no    integer NOT NULL,
    epoch       bigint NOT NULL,
    event       text NOT NULL CHECK (event IN ('claim', 'release', 'done')),
    owner       text,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS lease_log_shard ON chaos.lease_log (job_version, shard_no, epoch);
-- The trigger fires inside the ledger's own UPDATE, which holds the shard
-- row lock that every fenced write takes first (put_results_v1 and
-- fail_records_v2 lock the row FOR UPDATE). So an epoch's end is logged
-- strictly after every write that epoch got in, and strictly before any
-- write it refused: comparing results.created_at with these times is exact.
CREATE OR REPLACE FUNCTION chaos.log_lease() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO chaos.lease_log (job_version, shard_no, epoch, event, owner)
    VALUES (NEW.job_version, NEW.shard_no, NEW.epoch,
            CASE WHEN NEW.epoch <> OLD.epoch THEN 'claim'
                 WHEN NEW.state = 'done' THEN 'done'
                 ELSE 'release' END,
            CASE WHEN NEW.epoch <> OLD.epoch THEN NEW.lease_owner ELSE OLD.lease_owner END);
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS chaos_lease_log ON bi.shards;
CREATE TRIGGER chaos_lease_log AFTER UPDATE ON bi.shards FOR EACH ROW
    WHEN (OLD.epoch IS DISTINCT FROM NEW.epoch OR OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION chaos.log_lease();

-- name: progress  live counts, from the shard table
SELECT records, stored, dead_letters, outstanding, shards_pending, shards_leased, shards_done
  FROM bi.job_counts_v1(%(job)s);

-- name: lease_holders  who holds which shard now
SELECT lease_owner, shard_no, epoch FROM bi.shards WHERE job_version = %(job)s AND state = 'leased';

-- name: shard_epoch  one shard's current epoch and state
SELECT epoch, state FROM bi.shards WHERE job_version = %(job)s AND shard_no = %(shard)s;

-- name: coverage  every snapshot record is stored or dead-lettered, once
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

-- name: counter_drift  shards whose live counters disagree with the rows they count
SELECT count(*) AS shards
  FROM bi.shards s
 WHERE s.job_version = %(job)s
   AND (s.stored <> (SELECT count(*) FROM bi.results r
                       JOIN bi.snapshot_rows sr USING (job_version, record_id)
                      WHERE sr.job_version = s.job_version AND sr.shard_no = s.shard_no)
     OR s.dead <> (SELECT count(*) FROM bi.dead_letters d
                     JOIN bi.snapshot_rows sr USING (job_version, record_id)
                    WHERE sr.job_version = s.job_version AND sr.shard_no = s.shard_no));

-- name: stale_writes  result rows accepted from an epoch that was not, or no longer, the writer's lease
SELECT count(*) FILTER (WHERE NOT held) AS never_held,
       count(*) FILTER (WHERE ended) AS after_epoch_ended
  FROM (SELECT EXISTS (SELECT 1 FROM chaos.lease_log l
                        WHERE l.job_version = r.job_version AND l.shard_no = sr.shard_no
                          AND l.event = 'claim' AND l.epoch = r.epoch AND l.owner = r.worker_id) AS held,
               -- the epoch had ended (a later claim, a release or the shard's
               -- completion) when the row was written
               EXISTS (SELECT 1 FROM chaos.lease_log l
                        WHERE l.job_version = r.job_version AND l.shard_no = sr.shard_no
                          AND l.at <= r.created_at
                          AND ((l.event = 'claim' AND l.epoch > r.epoch)
                               OR (l.event IN ('release', 'done') AND l.epoch = r.epoch))) AS ended
          FROM bi.results r
          JOIN bi.snapshot_rows sr USING (job_version, record_id)
         WHERE r.job_version = %(job)s) t;

-- name: handoffs  claims after the first, by what ended the previous epoch
SELECT count(*) FILTER (WHERE prev_event = 'release') AS after_release,
       count(*) FILTER (WHERE prev_event = 'claim') AS after_expiry,
       count(*) FILTER (WHERE prev_event IS NOT NULL) AS handoffs,
       count(*) AS claims
  FROM (SELECT l.event, lag(l.event) OVER (PARTITION BY l.shard_no ORDER BY l.id) AS prev_event
          FROM chaos.lease_log l WHERE l.job_version = %(job)s) t
 WHERE event = 'claim';

-- name: fence_by_op  refused stale-epoch calls, by operation
SELECT op, count(*) AS n FROM bi.fence_events WHERE job_version = %(job)s GROUP BY op ORDER BY op;

-- name: fence_for  refusals of one worker's one epoch of one shard
SELECT count(*) AS n FROM bi.fence_events
 WHERE job_version = %(job)s AND worker_id = %(worker)s AND shard_no = %(shard)s AND presented = %(epoch)s;

-- name: dead_letters  the job's dead letters
SELECT record_id, stage, attempts, reason FROM bi.dead_letters WHERE job_version = %(job)s ORDER BY record_id;
