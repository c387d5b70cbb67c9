-- 0045_region_lost: a region lost mid-night ends the leases its workers hold at once
-- (bi.end_region_leases_v1), recorded as a region decision of its own kind. Never edited.

ALTER TABLE bi.region_decisions DROP CONSTRAINT region_decisions_kind_check;
ALTER TABLE bi.region_decisions ADD CONSTRAINT region_decisions_kind_check
    CHECK (kind IN ('claim', 'steal', 'rebuild', 'replicate', 'region_lost'));

-- A region is lost (its store or its Kubernetes API unreachable, its workers
-- gone at once): every lease its workers hold (the shard's current epoch was
-- claimed or stolen in p_region) ends now instead of when it runs out. Like a
-- release, not like a death: a lost region is no record's fault, so no crash
-- and no lost lease is counted, and a result file the region handed in and
-- that was not merged is refused unread from now on (its epoch does not hold
-- the shard). Recorded once with the shards it freed. Owner only. Returns how
-- many leases ended.
CREATE OR REPLACE FUNCTION bi.end_region_leases_v1(p_job text, p_region text, p_reason text) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_shards integer[];
BEGIN
    WITH ended AS (
        UPDATE bi.shards s
           SET state = 'pending', lease_owner = NULL, lease_transport = NULL, lease_expires_at = NULL,
               in_flight = NULL
         WHERE s.job_version = p_job AND s.state = 'leased'
           AND EXISTS (SELECT 1 FROM bi.region_decisions d
                        WHERE d.job_version = s.job_version AND d.kind IN ('claim', 'steal')
                          AND d.shard_no = s.shard_no AND d.epoch = s.epoch AND d.region = p_region)
        RETURNING s.shard_no
    )
    SELECT array_agg(e.shard_no ORDER BY e.shard_no) INTO v_shards FROM ended e;
    INSERT INTO bi.region_decisions (job_version, kind, region, reason)
    VALUES (p_job, 'region_lost', p_region,
            left(format('%s; %s lease(s) ended: shards %s', p_reason, coalesce(cardinality(v_shards), 0),
                        coalesce(array_to_string(v_shards, ', '), 'none')), 2000));
    RETURN coalesce(cardinality(v_shards), 0);
END $$;
