-- 0058_region_held: a far worker reports with each renewal how many results it holds for its shard
-- (bi.renew_lease_held_v1, into bi.held_results), and bi.region_held_v1 sums them with the handed-in
-- files not yet merged: done, not yet in the ledger, so the cutoff and the regions' autopilot count
-- them done. Never edited.

CREATE TABLE IF NOT EXISTS bi.held_results (
    job_version text NOT NULL,
    shard_no    integer NOT NULL,
    epoch       bigint NOT NULL,
    records     integer NOT NULL CHECK (records > 0),
    reported_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_version, shard_no),
    FOREIGN KEY (job_version, shard_no) REFERENCES bi.shards (job_version, shard_no) ON DELETE CASCADE
);
REVOKE ALL ON bi.held_results FROM PUBLIC;

-- Renew a far worker's lease (bi.renew_lease_v2, the one renewal) and record how many results it holds
-- for the shard: a count above 0 replaces the shard's row, 0 removes it. A stale epoch records nothing.
CREATE OR REPLACE FUNCTION bi.renew_lease_held_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                                 p_lease_seconds integer, p_held integer,
                                                 OUT stale boolean, OUT mode text, OUT lease_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    SELECT r.stale, r.mode, r.lease_expires_at INTO stale, mode, lease_expires_at
      FROM bi.renew_lease_v2(p_job, p_shard, p_epoch, p_worker, p_lease_seconds) r;
    IF stale THEN
        RETURN;
    END IF;
    IF coalesce(p_held, 0) > 0 THEN
        INSERT INTO bi.held_results AS h (job_version, shard_no, epoch, records)
        VALUES (p_job, p_shard, p_epoch, p_held)
        ON CONFLICT (job_version, shard_no) DO UPDATE
           SET epoch = excluded.epoch, records = excluded.records, reported_at = excluded.reported_at;
    ELSE
        DELETE FROM bi.held_results h WHERE h.job_version = p_job AND h.shard_no = p_shard;
    END IF;
END $$;

-- The results far workers have done and the ledger has not stored yet: held under a current lease (as
-- the last renewal reported them) or handed in as a file not yet merged (the larger per shard).
CREATE OR REPLACE FUNCTION bi.region_held_v1(p_job text, OUT held bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    SELECT coalesce(sum(x.records), 0)::bigint INTO held
      FROM (SELECT k.shard_no, max(k.records) AS records
              FROM (SELECT h.shard_no, h.epoch, h.records FROM bi.held_results h WHERE h.job_version = p_job
                    UNION ALL
                    SELECT f.shard_no, f.epoch, f.records FROM bi.result_files f
                     WHERE f.job_version = p_job AND f.merged_at IS NULL) k
              JOIN bi.shards s ON s.job_version = p_job AND s.shard_no = k.shard_no AND s.epoch = k.epoch
                              AND s.state = 'leased' AND s.lease_expires_at > clock_timestamp()
             GROUP BY k.shard_no) x;
END $$;

GRANT EXECUTE ON FUNCTION bi.renew_lease_held_v1(text, integer, bigint, text, integer, integer) TO bi_worker;
