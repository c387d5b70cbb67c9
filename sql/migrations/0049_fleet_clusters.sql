-- 0049_fleet_clusters: one autopilot over every cluster of a job version placed over regions:
-- each decision names its cluster (bi.fleet_decisions.cluster), each cluster has its desired size
-- (bi.fleet_cluster_size), and a region's shards are stolen only through its steal gate, opened by
-- the deadline's arithmetic (bi.region_steal_gates, bi.set_steal_gate_v1). Never edited.

ALTER TABLE bi.fleet_decisions ADD COLUMN IF NOT EXISTS cluster text;

-- A job version placed over several clusters (batch_inference.regions): each
-- cluster's desired batch fleet, the last per-cluster decision that changed it
-- (bi.fleet_decisions with its cluster), which that cluster's launcher
-- reconciles to.
CREATE TABLE IF NOT EXISTS bi.fleet_cluster_size (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    cluster     text NOT NULL,
    desired     integer NOT NULL CHECK (desired >= 0),
    reason      text NOT NULL,
    decided_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    decision_id bigint NOT NULL,
    PRIMARY KEY (job_version, cluster)
);
REVOKE ALL ON bi.fleet_cluster_size FROM PUBLIC;

ALTER TABLE bi.region_decisions DROP CONSTRAINT region_decisions_kind_check;
ALTER TABLE bi.region_decisions ADD CONSTRAINT region_decisions_kind_check
    CHECK (kind IN ('claim', 'steal', 'rebuild', 'replicate', 'region_lost', 'steal_gate'));

-- Whether workers of other regions may take a region's shards (its steal
-- gate): open when the deadline's arithmetic says its remaining records cannot
-- finish by the deadline with its own workers (the regions' autopilot,
-- regions.fleet.steal_gates; a region lost has none), closed otherwise. No row:
-- closed. bi.claim_shard_region_v2 steals only through an open gate.
CREATE TABLE IF NOT EXISTS bi.region_steal_gates (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    home_region text NOT NULL,
    open        boolean NOT NULL,
    reason      text NOT NULL,
    decided_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_version, home_region)
);
REVOKE ALL ON bi.region_steal_gates FROM PUBLIC;

-- Claim one shard from a worker in p_region: a pending or expired shard whose
-- replica is in p_region first; with p_steal, a shard of another region when
-- p_region has none left, that region's steal gate is open (the deadline's
-- arithmetic: its remaining records cannot finish by the deadline with its own
-- workers, bi.region_steal_gates) and it is behind (more of its shards
-- pending than its own workers hold: they will not reach them all this round,
-- or none of them is left). Everything else is bi.claim_shard_v2's, in the same statement
-- that changes the row: the epoch +1, the job's mode, the lost lease and the
-- deaths of an expired epoch's in-flight batch. The claim is recorded in
-- bi.region_decisions (a steal priced as egress: the replica's bytes at the
-- price from its home region to p_region). Answers also the replica to read:
-- its home region, key, digest and bytes, and whether the shard is untouched
-- (nothing stored or dead-lettered in it, no failed attempt or crash in the
-- job: every record of the replica is to do, nothing to ask the ledger). Shards of a version never placed
-- have no replica and are not claimed here.
CREATE OR REPLACE FUNCTION bi.claim_shard_region_v2(p_job text, p_owner text, p_transport text,
                                                   p_lease_seconds integer, p_region text, p_steal boolean)
RETURNS TABLE (shard_no integer, epoch bigint, lease_expires_at timestamptz, records integer, lost_leases integer,
               home_region text, object_key text, digest text, replica_bytes bigint, untouched boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    c record;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    WITH job AS (
        SELECT j.job_version,
               coalesce(p_lease_seconds, (j.spec ->> 'lease_seconds')::integer) AS lease_s
        FROM bi.jobs j
        WHERE j.job_version = p_job
          AND j.status = 'running'
          AND (p_transport = 'fallback' OR j.mode = 'batch')
    ), behind AS (
        SELECT r.region,
               count(*) FILTER (WHERE s.state = 'pending' OR s.lease_expires_at < clock_timestamp()) AS pending,
               count(*) FILTER (WHERE s.state = 'leased' AND s.lease_expires_at >= clock_timestamp()
                                  AND EXISTS (SELECT 1 FROM bi.region_decisions d
                                               WHERE d.job_version = s.job_version AND d.kind = 'claim'
                                                 AND d.shard_no = s.shard_no AND d.epoch = s.epoch)) AS leased
          FROM bi.replicas r JOIN bi.shards s ON s.job_version = r.job_version AND s.shard_no = r.shard_no
         WHERE p_steal AND r.job_version = p_job AND r.region <> p_region AND s.state <> 'done'
         GROUP BY r.region
    ), pick AS (
        SELECT s.shard_no, s.state = 'leased' AS expired, s.epoch AS old_epoch,
               s.lease_transport AS old_transport, s.in_flight AS old_in_flight, s.lease_renewed_at AS old_renewed_at,
               r.region AS home, r.object_key AS key, r.digest AS dig, r.bytes AS nbytes,
               b.pending AS home_pending, b.leased AS home_leased, g.reason AS gate_reason
        FROM bi.shards s
        JOIN bi.replicas r ON r.job_version = s.job_version AND r.shard_no = s.shard_no
        LEFT JOIN behind b ON b.region = r.region
        LEFT JOIN bi.region_steal_gates g ON g.job_version = p_job AND g.home_region = r.region AND g.open
        WHERE s.job_version = p_job
          AND EXISTS (SELECT 1 FROM job)
          AND (s.state = 'pending' OR (s.state = 'leased' AND s.lease_expires_at < clock_timestamp()))
          AND (r.region = p_region OR (p_steal AND g.open AND b.pending > b.leased))
        ORDER BY (r.region = p_region) DESC,   -- a steal takes the far end of the other region's range
                 CASE WHEN r.region = p_region THEN s.shard_no ELSE -s.shard_no END
        LIMIT 1
        FOR UPDATE OF s SKIP LOCKED
    )
    UPDATE bi.shards s
       SET state = 'leased',
           epoch = s.epoch + 1,
           lease_owner = p_owner,
           lease_transport = p_transport,
           lease_expires_at = clock_timestamp() + make_interval(secs => job.lease_s),
           lease_renewed_at = clock_timestamp(),
           claims = s.claims + 1,
           first_claim_at = coalesce(s.first_claim_at, clock_timestamp()),
           lost_leases = s.lost_leases + CASE WHEN pick.expired THEN 1 ELSE 0 END,
           in_flight = NULL
      FROM pick, job
     WHERE s.job_version = p_job AND s.shard_no = pick.shard_no
    RETURNING s.shard_no AS shard_no, s.epoch AS epoch, s.lease_expires_at AS lease_expires_at,
              s.records AS records, s.lost_leases AS lost_leases, pick.expired, pick.old_epoch,
              pick.old_transport, pick.old_in_flight, pick.old_renewed_at, pick.home, pick.key, pick.dig,
              pick.nbytes, pick.home_pending, pick.home_leased, pick.gate_reason,
              s.stored = 0 AND s.dead = 0
                  AND NOT EXISTS (SELECT 1 FROM bi.attempts a WHERE a.job_version = p_job) AS untouched
    INTO c;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF c.expired AND c.old_in_flight IS NOT NULL AND NOT bi.lapsed_over_restart_v1(c.old_renewed_at) THEN
        PERFORM bi.record_deaths_v1(p_job, c.shard_no, c.old_epoch, c.old_transport, c.old_in_flight);
    END IF;
    INSERT INTO bi.region_decisions (job_version, kind, shard_no, epoch, region, home_region, worker_id, bytes,
                                     usd, reason)
    SELECT p_job, CASE WHEN c.home = p_region THEN 'claim' ELSE 'steal' END, c.shard_no, c.epoch, p_region, c.home,
           p_owner, CASE WHEN c.home = p_region THEN 0 ELSE c.nbytes END,
           CASE WHEN c.home = p_region THEN 0 ELSE c.nbytes / 1e9 * e.usd_per_gb END,
           CASE WHEN c.home <> p_region
                THEN left(format('%s had no shard left; %s had %s pending against %s held by its own workers; %s',
                                 p_region, c.home, c.home_pending, c.home_leased, c.gate_reason), 2000) END
      FROM (SELECT 1) one
      LEFT JOIN bi.region_egress e ON e.job_version = p_job AND e.from_region = c.home AND e.to_region = p_region;
    RETURN QUERY SELECT c.shard_no, c.epoch, c.lease_expires_at, c.records, c.lost_leases, c.home, c.key, c.dig,
                        c.nbytes, c.untouched;
END $$;

-- A region's steal gate set by the deadline's arithmetic (owner only): open or
-- closed with the sum that says so; a change of state is recorded as a
-- steal_gate decision. Returns whether the state changed.
CREATE OR REPLACE FUNCTION bi.set_steal_gate_v1(p_job text, p_region text, p_open boolean, p_reason text)
RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_was boolean;
BEGIN
    SELECT g.open INTO v_was FROM bi.region_steal_gates g
     WHERE g.job_version = p_job AND g.home_region = p_region FOR UPDATE;
    INSERT INTO bi.region_steal_gates AS g (job_version, home_region, open, reason)
    VALUES (p_job, p_region, p_open, left(p_reason, 2000))
    ON CONFLICT (job_version, home_region) DO UPDATE
       SET open = excluded.open, reason = excluded.reason, decided_at = clock_timestamp();
    IF v_was IS NOT DISTINCT FROM p_open OR (v_was IS NULL AND NOT p_open) THEN
        RETURN false;
    END IF;
    INSERT INTO bi.region_decisions (job_version, kind, region, home_region, reason)
    VALUES (p_job, 'steal_gate', p_region, p_region,
            left(format('%s: %s', CASE WHEN p_open THEN 'open' ELSE 'closed' END, p_reason), 2000));
    RETURN true;
END $$;
