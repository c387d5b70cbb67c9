-- 0008_restart_is_no_death: a lease that lapsed while the server restarted
-- counts no deaths for its in-flight batch: each claim and renewal stamps
-- bi.shards.lease_renewed_at, and bi.claim_shard_v2's takeover and
-- bi.sweep_expired_v1 skip the deaths when the server started after it
-- (bi.lapsed_over_restart_v1). The restart cut the holder's connections,
-- renewals included, so nothing says it died; one restart could charge a
-- crash to every careful shard's in-flight records, healthy ones included.
-- Never edited.

ALTER TABLE bi.shards ADD COLUMN IF NOT EXISTS lease_renewed_at timestamptz;

-- Whether the server (re)started after a lease was last claimed or renewed
-- (bi.shards.lease_renewed_at): the restart cut the holder's connections, its
-- renewals included, so the lapse is no sign that the holder died. An expired
-- lease counts no deaths then. False when the stamp is unknown.
CREATE OR REPLACE FUNCTION bi.lapsed_over_restart_v1(p_renewed_at timestamptz)
RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(pg_postmaster_start_time() > p_renewed_at, false)
$$;

-- Claim one shard: a pending one, or one whose lease expired (no sweeper
-- needed for progress). The epoch goes up by one on every claim and never
-- resets. Batch workers are refused once the job is in fallback mode. Taking
-- over an expired lease counts a lost lease and the deaths of the last batch
-- the expired epoch marked in flight (none when the server restarted since
-- that lease was last renewed); the caller learns lost_leases (> 0: run this
-- shard carefully).
CREATE OR REPLACE FUNCTION bi.claim_shard_v2(p_job text, p_owner text, p_transport text DEFAULT 'batch',
                                            p_lease_seconds integer DEFAULT NULL)
RETURNS TABLE (shard_no integer, epoch bigint, lease_expires_at timestamptz, records integer, lost_leases integer)
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
    ), pick AS (
        SELECT s.shard_no, s.state = 'leased' AS expired, s.epoch AS old_epoch,
               s.lease_transport AS old_transport, s.in_flight AS old_in_flight, s.lease_renewed_at AS old_renewed_at
        FROM bi.shards s
        WHERE s.job_version = p_job
          AND EXISTS (SELECT 1 FROM job)
          AND (s.state = 'pending' OR (s.state = 'leased' AND s.lease_expires_at < clock_timestamp()))
        ORDER BY s.shard_no
        LIMIT 1
        FOR UPDATE SKIP LOCKED
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
              pick.old_transport, pick.old_in_flight, pick.old_renewed_at
    INTO c;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- A release or a completion leaves no lease to expire, so only a holder
    -- that vanished (or stalled) lands here; its marks were its own epoch's.
    IF c.expired AND c.old_in_flight IS NOT NULL AND NOT bi.lapsed_over_restart_v1(c.old_renewed_at) THEN
        PERFORM bi.record_deaths_v1(p_job, c.shard_no, c.old_epoch, c.old_transport, c.old_in_flight);
    END IF;
    RETURN QUERY SELECT c.shard_no, c.epoch, c.lease_expires_at, c.records, c.lost_leases;
END $$;

-- Renew: only the holder of the current epoch. Returns the job's mode so a
-- batch worker learns within one renewal interval that the cutoff fired.
CREATE OR REPLACE FUNCTION bi.renew_lease_v2(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                            p_lease_seconds integer DEFAULT NULL,
                                            OUT stale boolean, OUT mode text, OUT lease_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    SELECT j.mode INTO mode FROM bi.jobs j WHERE j.job_version = p_job;
    UPDATE bi.shards s
       SET lease_expires_at = clock_timestamp() + make_interval(secs =>
               coalesce(p_lease_seconds, (SELECT (j.spec ->> 'lease_seconds')::integer
                                          FROM bi.jobs j WHERE j.job_version = p_job))),
           lease_renewed_at = clock_timestamp()
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
    RETURNING s.lease_expires_at INTO lease_expires_at;
    stale := NOT FOUND;
    IF stale THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'renew', p_epoch, p_worker);
        mode := NULL;
    END IF;
END $$;

-- Return every expired lease to pending (claims also take expired shards, so
-- this is for a tidy status page, not for progress). A swept lease is a lost
-- lease, with the same death count as a claim's takeover.
CREATE OR REPLACE FUNCTION bi.sweep_expired_v1(p_job text) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    c record;
    n integer := 0;
BEGIN
    FOR c IN
        UPDATE bi.shards s
           SET state = 'pending', lease_owner = NULL, lease_transport = NULL, lease_expires_at = NULL,
               lost_leases = s.lost_leases + 1, in_flight = NULL
          FROM (SELECT o.shard_no, o.epoch, o.lease_transport, o.in_flight, o.lease_renewed_at FROM bi.shards o
                 WHERE o.job_version = p_job AND o.state = 'leased' AND o.lease_expires_at < clock_timestamp()
                   FOR UPDATE) prev
         WHERE s.job_version = p_job AND s.shard_no = prev.shard_no
        RETURNING prev.shard_no, prev.epoch, prev.lease_transport, prev.in_flight, prev.lease_renewed_at
    LOOP
        n := n + 1;
        IF c.in_flight IS NOT NULL AND NOT bi.lapsed_over_restart_v1(c.lease_renewed_at) THEN
            PERFORM bi.record_deaths_v1(p_job, c.shard_no, c.epoch, c.lease_transport, c.in_flight);
        END IF;
    END LOOP;
    RETURN n;
END $$;
