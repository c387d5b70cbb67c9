-- 0037_worker_deaths: a launcher that saw its worker die by a signal gives back every shard
-- that worker held at once, as an engine failure the worker reported itself would have
-- (bi.abandon_shard_v2: pending again, a lost lease, deaths of the records it had marked in
-- flight), and records why on each shard (bi.shards.last_error). A halt (bi.halt_job_v1)
-- notifies channel bi_halt, so a cutoff watch between polls ends at once. Never edited.

ALTER TABLE bi.shards ADD COLUMN IF NOT EXISTS last_error text;
ALTER TABLE bi.shards ADD COLUMN IF NOT EXISTS last_error_at timestamptz;

CREATE OR REPLACE FUNCTION bi.abandon_dead_owner_v1(p_job text, p_owner text, p_error text)
RETURNS TABLE (shard_no integer, epoch bigint, stale boolean)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT s.shard_no AS no, s.epoch AS ep FROM bi.shards s
              WHERE s.job_version = p_job AND s.lease_owner = p_owner AND s.state = 'leased'
              ORDER BY s.shard_no
    LOOP
        shard_no := r.no;
        epoch := r.ep;
        stale := bi.abandon_shard_v2(p_job, r.no, r.ep, p_owner);
        IF NOT stale THEN
            UPDATE bi.shards s SET last_error = left(p_error, 2000), last_error_at = clock_timestamp()
             WHERE s.job_version = p_job AND s.shard_no = r.no;
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION bi.halt_job_v1(p_job text, p_reason text)
RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_at timestamptz;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    UPDATE bi.jobs SET halted_at = clock_timestamp(), halt_reason = left(p_reason, 2000)
     WHERE job_version = p_job AND status = 'running'
    RETURNING halted_at INTO v_at;
    IF v_at IS NOT NULL THEN
        PERFORM pg_notify('bi_halt', p_job);
    END IF;
    RETURN v_at;
END $$;
