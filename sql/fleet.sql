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

-- name: fleet_cluster_decide  record one cluster's decision; a change of its size becomes the cluster's desired size
WITH d AS (
    INSERT INTO bi.fleet_decisions (job_version, cluster, current, desired, action, reason, per_worker, finish_without,
                                    finish_with, bill_without, bill_with, page, options)
    VALUES (%(job)s, %(cluster)s, %(current)s, %(desired)s, %(action)s, %(reason)s, %(per_worker)s, %(finish_without)s,
            %(finish_with)s, %(bill_without)s, %(bill_with)s, %(page)s, %(options)s)
    RETURNING id, job_version, cluster, desired, reason, at)
INSERT INTO bi.fleet_cluster_size AS s (job_version, cluster, desired, reason, decided_at, decision_id)
SELECT job_version, cluster, desired, reason, at, id FROM d
    ON CONFLICT (job_version, cluster) DO UPDATE
   SET desired = excluded.desired, reason = excluded.reason, decided_at = excluded.decided_at,
       decision_id = excluded.decision_id
 WHERE s.desired IS DISTINCT FROM excluded.desired;

-- name: fleet_cluster_sizes  each cluster's desired batch fleet and the action that last set it
SELECT s.cluster, s.desired, s.decided_at, d.action
  FROM bi.fleet_cluster_size s JOIN bi.fleet_decisions d ON d.id = s.decision_id
 WHERE s.job_version = %(job)s ORDER BY s.cluster;

-- name: fleet_cluster_decisions  a job version's per-cluster autopilot decisions, oldest first
SELECT id, at, cluster, current, desired, action, reason, per_worker, bill_without, bill_with, page, options
  FROM bi.fleet_decisions WHERE job_version = %(job)s AND cluster IS NOT NULL ORDER BY id;

-- name: fleet_launcher_seconds  worker-seconds of a job version per launcher (each count times how long it held, the last until now)
SELECT launcher, coalesce(sum(running * extract(epoch FROM (until - at))), 0)::double precision AS worker_seconds FROM (
    SELECT launcher, running, at,
           coalesce(lead(at) OVER (PARTITION BY launcher ORDER BY id), clock_timestamp()) AS until
      FROM bi.fleet_observed WHERE job_version = %(job)s) spans
 GROUP BY launcher ORDER BY launcher;

-- the regions' autopilot (batch_inference.regions.fleet, .lost): steal gates and lost regions

-- name: set_steal_gate  a region's steal gate opened or closed by the deadline's arithmetic, a change recorded (owner only)
SELECT bi.set_steal_gate_v1(%(job)s, %(region)s, %(open)s, %(reason)s) AS changed;

-- name: region_remaining  per home region: its shards and records not done yet, the regions found lost, and whose steal gate is open now
SELECT r.region,
       count(*) FILTER (WHERE s.state <> 'done')::integer AS shards_left,
       coalesce(sum(greatest(s.records - s.stored - s.dead, 0)) FILTER (WHERE s.state <> 'done'), 0)::bigint
           AS records_left,
       EXISTS (SELECT 1 FROM bi.region_decisions d
                WHERE d.job_version = %(job)s AND d.kind = 'region_lost' AND d.region = r.region) AS lost,
       EXISTS (SELECT 1 FROM bi.region_steal_gates g
                WHERE g.job_version = %(job)s AND g.home_region = r.region AND g.open) AS gate_open
  FROM bi.replicas r JOIN bi.shards s ON s.job_version = r.job_version AND s.shard_no = r.shard_no
 WHERE r.job_version = %(job)s
 GROUP BY r.region ORDER BY r.region;

-- name: region_lapsed  per region not found lost: the leases held by its workers now (the shard's epoch claimed or stolen there), how many have run out unrenewed, and whether every one ran out a whole lease (the job's lease_seconds) ago: time for a worker killed alone and restarted to claim again; a lease last renewed before the server (re)started (bi.lapsed_over_restart_v1: the restart cut its holder's renewals) counts from the server's start
SELECT d.region, count(*)::integer AS held,
       count(*) FILTER (WHERE s.lease_expires_at < clock_timestamp())::integer AS lapsed,
       bool_and(CASE WHEN bi.lapsed_over_restart_v1(s.lease_renewed_at)
                     THEN greatest(s.lease_expires_at, pg_postmaster_start_time()) ELSE s.lease_expires_at END
                < clock_timestamp() - make_interval(secs => (j.spec ->> 'lease_seconds')::integer)) AS quiet,
       max(s.lease_renewed_at) AS last_renewed
  FROM bi.shards s
  JOIN bi.jobs j ON j.job_version = s.job_version
  JOIN bi.region_decisions d ON d.job_version = s.job_version AND d.shard_no = s.shard_no AND d.epoch = s.epoch
                            AND d.kind IN ('claim', 'steal')
 WHERE s.job_version = %(job)s AND s.state = 'leased'
   AND NOT EXISTS (SELECT 1 FROM bi.region_decisions l
                    WHERE l.job_version = %(job)s AND l.kind = 'region_lost' AND l.region = d.region)
 GROUP BY d.region ORDER BY d.region;

-- name: region_autopilot_decisions  the regions found lost, the steal gates opened or closed and the steals (egress priced), oldest first
SELECT kind, region, home_region, at, usd, reason FROM bi.region_decisions
 WHERE job_version = %(job)s AND kind IN ('region_lost', 'steal_gate', 'steal') ORDER BY id;

-- name: region_egress_of_job  the egress prices a placed version was given, every ordered pair of its regions
SELECT from_region, to_region, usd_per_gb FROM bi.region_egress WHERE job_version = %(job)s
 ORDER BY from_region, to_region;

-- name: fleet_running_by_launcher  what each launcher of a job version last said it runs
SELECT DISTINCT ON (launcher) launcher, running FROM bi.fleet_observed
 WHERE job_version = %(job)s ORDER BY launcher, id DESC;

-- name: fleet_cluster_size  one cluster's desired batch fleet (no row: the regions' autopilot has not sized it)
SELECT desired, decided_at FROM bi.fleet_cluster_size WHERE job_version = %(job)s AND cluster = %(cluster)s;
