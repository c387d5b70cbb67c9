-- The batch fleet's size (batch_inference.autopilot, sql/schema/fleet.sql).
-- Not a migration: named statements loaded by batch_inference.db.queries();
-- every name starts with fleet_.

-- name: fleet_size  a job version's desired batch fleet and the action that set it (no row: the autopilot has not decided)
SELECT s.desired, s.reason, s.decided_at, s.decision_id, d.action
  FROM bi.fleet_size s LEFT JOIN bi.fleet_decisions d ON d.id = s.decision_id
 WHERE s.job_version = %(job)s;

-- name: fleet_decide  record one decision; a change of size becomes the desired size (decided_at: when it changed)
WITH d AS (
    INSERT INTO bi.fleet_decisions (job_version, current, desired, action, reason, per_worker, finish_without,
                                    finish_with, bill_without, bill_with, page, options)
    VALUES (%(job)s, %(current)s, %(desired)s, %(action)s, %(reason)s, %(per_worker)s, %(finish_without)s,
            %(finish_with)s, %(bill_without)s, %(bill_with)s, %(page)s, %(options)s)
    RETURNING id, job_version, desired, reason, at)
INSERT INTO bi.fleet_size AS s (job_version, desired, reason, decided_at, decision_id)
SELECT job_version, desired, reason, at, id FROM d
    ON CONFLICT (job_version) DO UPDATE
   SET desired = excluded.desired, reason = excluded.reason, decided_at = excluded.decided_at,
       decision_id = excluded.decision_id
 WHERE s.desired IS DISTINCT FROM excluded.desired;

-- name: fleet_observe  what one launcher runs now; a row only when its count changed
INSERT INTO bi.fleet_observed (job_version, launcher, running)
SELECT %(job)s, %(launcher)s, %(running)s::integer
 WHERE %(running)s::integer IS DISTINCT FROM (
       SELECT o.running FROM bi.fleet_observed o
        WHERE o.job_version = %(job)s AND o.launcher = %(launcher)s ORDER BY o.id DESC LIMIT 1);

-- name: fleet_running  the batch workers every launcher of a job version last said it runs
SELECT coalesce(sum(running), 0)::integer AS running, count(*)::integer AS launchers FROM (
    SELECT DISTINCT ON (launcher) running FROM bi.fleet_observed
     WHERE job_version = %(job)s ORDER BY launcher, id DESC) last;

-- name: fleet_gpu_seconds  worker-seconds of a job version: each launcher's count times how long it held (the last until now)
SELECT coalesce(sum(running * extract(epoch FROM (until - at))), 0)::double precision AS worker_seconds FROM (
    SELECT running, at, coalesce(lead(at) OVER (PARTITION BY launcher ORDER BY id), clock_timestamp()) AS until
      FROM bi.fleet_observed WHERE job_version = %(job)s) spans;

-- name: fleet_decisions  a job version's autopilot decisions, oldest first
SELECT id, at, current, desired, action, reason, per_worker, finish_without, finish_with, bill_without,
       bill_with, page, options
  FROM bi.fleet_decisions WHERE job_version = %(job)s ORDER BY id;

-- name: fleet_changes  the decisions that changed the size or paged, oldest first (the dashboard's time axis)
SELECT at, current, desired, action, reason, page
  FROM bi.fleet_decisions WHERE job_version = %(job)s AND (action <> 'hold' OR page IS NOT NULL) ORDER BY id;

-- name: fleet_release_owner  every lease one ended worker still holds, released (the launcher ended it by force); each release fenced by the epoch it held (bi.release_shard_v2)
WITH held AS MATERIALIZED (
    SELECT job_version, shard_no, epoch FROM bi.shards
     WHERE job_version = %(job)s AND lease_owner = %(owner)s AND state = 'leased')
SELECT shard_no, epoch, bi.release_shard_v2(job_version, shard_no, epoch, %(owner)s) AS stale
  FROM held ORDER BY shard_no;

-- name: fleet_abandon_dead_owner  every lease a worker that died by a signal still holds, given back at once (counted as a lost lease, as its expiry would be) with why on each shard (bi.abandon_dead_owner_v1)
SELECT shard_no, epoch, stale FROM bi.abandon_dead_owner_v1(%(job)s, %(owner)s, %(error)s);

-- name: shard_last_error  the job's latest worker death a launcher recorded on a shard, if any (bi.shards.last_error)
SELECT shard_no, state, last_error, last_error_at
  FROM bi.shards WHERE job_version = %(job)s AND last_error IS NOT NULL
 ORDER BY last_error_at DESC LIMIT 1;
