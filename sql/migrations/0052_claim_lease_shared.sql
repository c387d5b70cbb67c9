-- 0052_claim_lease_shared: one update for every claim. bi.lease_shard_v1 leases the shard a claim picked
-- (the epoch, the lease, the lost lease and the deaths of an expired epoch's in-flight batch) and
-- bi.claimable_v1 says whether the job may be claimed by a transport; bi.claim_shard_v2 and
-- bi.claim_shard_region_v2 pick their shard and call both. Never edited.

-- Lease one shard the caller picked and locked (FOR UPDATE in the caller's
-- statement) to p_owner: the epoch +1, the lease for p_lease_seconds (the
-- job's lease_seconds when NULL), a claim counted; taking over an expired
-- lease counts a lost lease and the deaths of the last batch the expired
-- epoch marked in flight (none when the server restarted since that lease
-- was last renewed). The one update of every claim (bi.claim_shard_v2,
-- bi.claim_shard_region_v2). untouched: nothing stored or dead-lettered in
-- the shard and no failed attempt or crash in the job. Owner only: the
-- claims call it as their definer.
CREATE OR REPLACE FUNCTION bi.lease_shard_v1(p_job text, p_shard integer, p_owner text, p_transport text,
                                            p_lease_seconds integer)
RETURNS TABLE (shard_no integer, epoch bigint, lease_expires_at timestamptz, records integer, lost_leases integer,
               untouched boolean)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    o record;
    c record;
BEGIN
    SELECT s.state = 'leased' AS expired, s.epoch, s.lease_transport, s.in_flight, s.lease_renewed_at INTO o
      FROM bi.shards s WHERE s.job_version = p_job AND s.shard_no = p_shard;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE bi.shards s
       SET state = 'leased',
           epoch = s.epoch + 1,
           lease_owner = p_owner,
           lease_transport = p_transport,
           lease_expires_at = clock_timestamp() + make_interval(secs => coalesce(p_lease_seconds,
               (SELECT (j.spec ->> 'lease_seconds')::integer FROM bi.jobs j WHERE j.job_version = p_job))),
           lease_renewed_at = clock_timestamp(),
           claims = s.claims + 1,
           first_claim_at = coalesce(s.first_claim_at, clock_timestamp()),
           lost_leases = s.lost_leases + CASE WHEN o.expired THEN 1 ELSE 0 END,
           in_flight = NULL
     WHERE s.job_version = p_job AND s.shard_no = p_shard
    RETURNING s.shard_no AS shard_no, s.epoch AS epoch, s.lease_expires_at AS lease_expires_at,
              s.records AS records, s.lost_leases AS lost_leases,
              s.stored = 0 AND s.dead = 0
                  AND NOT EXISTS (SELECT 1 FROM bi.attempts a WHERE a.job_version = p_job) AS untouched
    INTO c;
    -- A release or a completion leaves no lease to expire, so only a holder
    -- that vanished (or stalled) lands here; its marks were its own epoch's.
    IF o.expired AND o.in_flight IS NOT NULL AND NOT bi.lapsed_over_restart_v1(o.lease_renewed_at) THEN
        PERFORM bi.record_deaths_v1(p_job, c.shard_no, o.epoch, o.lease_transport, o.in_flight);
    END IF;
    RETURN QUERY SELECT c.shard_no, c.epoch, c.lease_expires_at, c.records, c.lost_leases, c.untouched;
END $$;

-- Whether a job version's shards may be claimed now by p_transport: running,
-- and batch workers only while the job is in batch mode (a fallback claims in
-- fallback mode too).
CREATE OR REPLACE FUNCTION bi.claimable_v1(p_job text, p_transport text) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM bi.jobs j
                    WHERE j.job_version = p_job AND j.status = 'running'
                      AND (p_transport = 'fallback' OR j.mode = 'batch'))
$$;

-- Claim one shard: a pending one, or one whose lease expired (no sweeper
-- needed for progress). The epoch goes up by one on every claim and never
-- resets. Batch workers are refused once the job is in fallback mode. Taking
-- over an expired lease counts a lost lease and the deaths of the last batch
-- the expired epoch marked in flight (bi.lease_shard_v1, the one update of
-- every claim); the caller learns lost_leases (> 0: run this shard carefully).
CREATE OR REPLACE FUNCTION bi.claim_shard_v2(p_job text, p_owner text, p_transport text DEFAULT 'batch',
                                            p_lease_seconds integer DEFAULT NULL)
RETURNS TABLE (shard_no integer, epoch bigint, lease_expires_at timestamptz, records integer, lost_leases integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_shard integer;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    IF NOT bi.claimable_v1(p_job, p_transport) THEN
        RETURN;
    END IF;
    SELECT s.shard_no INTO v_shard
      FROM bi.shards s
     WHERE s.job_version = p_job
       AND (s.state = 'pending' OR (s.state = 'leased' AND s.lease_expires_at < clock_timestamp()))
     ORDER BY s.shard_no
     LIMIT 1
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT l.shard_no, l.epoch, l.lease_expires_at, l.records, l.lost_leases
                   FROM bi.lease_shard_v1(p_job, v_shard, p_owner, p_transport, p_lease_seconds) l;
END $$;

-- Claim one shard from a worker in p_region: a pending or expired shard whose
-- replica is in p_region first; with p_steal, a shard of another region when
-- p_region has none left, that region's steal gate is open (the deadline's
-- arithmetic: its remaining records cannot finish by the deadline with its own
-- workers, bi.region_steal_gates) and it is behind (more of its shards
-- pending than its own workers hold: they will not reach them all this round,
-- or none of them is left). Everything else is every claim's: the job's mode
-- (bi.claimable_v1) and the one update (bi.lease_shard_v1: the epoch +1, the
-- lost lease and the deaths of an expired epoch's in-flight batch). The claim is recorded in
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
    p record;
    c record;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    IF NOT bi.claimable_v1(p_job, p_transport) THEN
        RETURN;
    END IF;
    WITH behind AS (
        SELECT r.region,
               count(*) FILTER (WHERE s.state = 'pending' OR s.lease_expires_at < clock_timestamp()) AS pending,
               count(*) FILTER (WHERE s.state = 'leased' AND s.lease_expires_at >= clock_timestamp()
                                  AND EXISTS (SELECT 1 FROM bi.region_decisions d
                                               WHERE d.job_version = s.job_version AND d.kind = 'claim'
                                                 AND d.shard_no = s.shard_no AND d.epoch = s.epoch)) AS leased
          FROM bi.replicas r JOIN bi.shards s ON s.job_version = r.job_version AND s.shard_no = r.shard_no
         WHERE p_steal AND r.job_version = p_job AND r.region <> p_region AND s.state <> 'done'
         GROUP BY r.region
    )
    SELECT s.shard_no, r.region AS home, r.object_key AS key, r.digest AS dig, r.bytes AS nbytes,
           b.pending AS home_pending, b.leased AS home_leased, g.reason AS gate_reason
      INTO p
      FROM bi.shards s
      JOIN bi.replicas r ON r.job_version = s.job_version AND r.shard_no = s.shard_no
      LEFT JOIN behind b ON b.region = r.region
      LEFT JOIN bi.region_steal_gates g ON g.job_version = p_job AND g.home_region = r.region AND g.open
     WHERE s.job_version = p_job
       AND (s.state = 'pending' OR (s.state = 'leased' AND s.lease_expires_at < clock_timestamp()))
       AND (r.region = p_region OR (p_steal AND g.open AND b.pending > b.leased))
     ORDER BY (r.region = p_region) DESC,   -- a steal takes the far end of the other region's range
              CASE WHEN r.region = p_region THEN s.shard_no ELSE -s.shard_no END
     LIMIT 1
       FOR UPDATE OF s SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT * INTO c FROM bi.lease_shard_v1(p_job, p.shard_no, p_owner, p_transport, p_lease_seconds);
    INSERT INTO bi.region_decisions (job_version, kind, shard_no, epoch, region, home_region, worker_id, bytes,
                                     usd, reason)
    SELECT p_job, CASE WHEN p.home = p_region THEN 'claim' ELSE 'steal' END, c.shard_no, c.epoch, p_region, p.home,
           p_owner, CASE WHEN p.home = p_region THEN 0 ELSE p.nbytes END,
           CASE WHEN p.home = p_region THEN 0 ELSE p.nbytes / 1e9 * e.usd_per_gb END,
           CASE WHEN p.home <> p_region
                THEN left(format('%s had no shard left; %s had %s pending against %s held by its own workers; %s',
                                 p_region, p.home, p.home_pending, p.home_leased, p.gate_reason), 2000) END
      FROM (SELECT 1) one
      LEFT JOIN bi.region_egress e ON e.job_version = p_job AND e.from_region = p.home AND e.to_region = p_region;
    RETURN QUERY SELECT c.shard_no, c.epoch, c.lease_expires_at, c.records, c.lost_leases, p.home, p.key, p.dig,
                        p.nbytes, c.untouched;
END $$;
