-- 0002_one_fence_outcome: the fenced transitions report a stale epoch in one
-- shape, a row whose first column, stale, is true (the rest NULL). The new
-- versions replace renew_lease_v1, release_shard_v1, complete_shard_v1,
-- mark_in_flight_v1, abandon_shard_v1, put_results_v1 and fail_records_v2,
-- which are dropped. Never edited.

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
                                          FROM bi.jobs j WHERE j.job_version = p_job)))
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
    RETURNING s.lease_expires_at INTO lease_expires_at;
    stale := NOT FOUND;
    IF stale THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'renew', p_epoch, p_worker);
        mode := NULL;
    END IF;
END $$;

-- Release (the preemption notice): the shard is pending again at once.
CREATE OR REPLACE FUNCTION bi.release_shard_v2(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                             OUT stale boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    UPDATE bi.shards s
       SET state = 'pending', lease_owner = NULL, lease_transport = NULL, lease_expires_at = NULL
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch);
    stale := NOT FOUND;
    IF stale THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'release', p_epoch, p_worker);
    END IF;
END $$;

-- Complete: only the current epoch, and only when every record of the shard
-- is stored or dead-lettered. done is false while records are left.
CREATE OR REPLACE FUNCTION bi.complete_shard_v2(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                              OUT stale boolean, OUT done boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    UPDATE bi.shards s
       SET state = 'done', lease_owner = NULL, lease_expires_at = NULL, done_at = clock_timestamp()
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
       AND s.stored + s.dead >= s.records;
    done := FOUND;
    stale := false;
    IF done THEN
        RETURN;
    END IF;
    -- Not a guard, only the reason for the refusal.
    IF EXISTS (SELECT 1 FROM bi.shards s WHERE s.job_version = p_job AND s.shard_no = p_shard
                                          AND bi.holds_lease_v1(s, p_epoch)) THEN
        RETURN;
    END IF;
    PERFORM bi.record_fence_v1(p_job, p_shard, 'complete', p_epoch, p_worker);
    stale := true;
    done := NULL;
END $$;

-- Careful mode: the ids of the engine batch about to be generated. One
-- statement per batch; the current epoch only.
CREATE OR REPLACE FUNCTION bi.mark_in_flight_v2(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                               p_ids text[], OUT stale boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    UPDATE bi.shards s
       SET in_flight = p_ids
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch);
    stale := NOT FOUND;
    IF stale THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'mark_in_flight', p_epoch, p_worker);
    END IF;
END $$;

-- The engine broke mid-shard (an exception, not a death): give the shard back
-- at once like a release, but count it as a lost lease with the deaths of its
-- in-flight batch, so an engine that fails on one record cannot loop either.
CREATE OR REPLACE FUNCTION bi.abandon_shard_v2(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                             OUT stale boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_ids text[];
    v_transport text;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    SELECT s.in_flight, s.lease_transport INTO v_ids, v_transport
      FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
       FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'abandon', p_epoch, p_worker);
        stale := true;
        RETURN;
    END IF;
    UPDATE bi.shards s
       SET state = 'pending', lease_owner = NULL, lease_transport = NULL, lease_expires_at = NULL,
           lost_leases = s.lost_leases + 1, in_flight = NULL
     WHERE s.job_version = p_job AND s.shard_no = p_shard;
    IF v_ids IS NOT NULL THEN
        PERFORM bi.record_deaths_v1(p_job, p_shard, p_epoch, v_transport, v_ids);
    END IF;
    stale := false;
END $$;

-- Put-if-absent results for one shard under the current epoch. The shard row
-- is locked first, so a concurrent claim (which bumps the epoch) waits for
-- this batch to commit, and a batch from a stale epoch writes nothing. While
-- the lock is held no record of the shard can be dead-lettered, so with the
-- shard's dead counter at 0 the per-record dead-letter probe is skipped.
-- n is the number of new rows.
CREATE OR REPLACE FUNCTION bi.put_results_v2(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                            p_transport text, p_ids text[], p_outputs jsonb[], p_categories text[],
                                            OUT stale boolean, OUT n integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_dead bigint;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    SELECT s.dead INTO v_dead FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
       FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'put_results', p_epoch, p_worker);
        stale := true;
        RETURN;
    END IF;
    INSERT INTO bi.results (job_version, record_id, output, category, model_name, model_digest,
                            prompt_version, transport, worker_id, epoch, acl, content_hash)
    SELECT p_job, u.id, u.output, u.category, j.model_name, j.model_digest, j.prompt_version,
           p_transport, p_worker, p_epoch, sr.acl, sr.content_hash
      FROM unnest(p_ids, p_outputs, p_categories) AS u(id, output, category)
     CROSS JOIN LATERAL (SELECT x.acl, x.content_hash, x.shard_no FROM bi.snapshot_rows x
                          WHERE x.job_version = p_job AND x.record_id = u.id OFFSET 0) sr
      JOIN bi.jobs j ON j.job_version = p_job
     WHERE sr.shard_no = p_shard
       AND (v_dead = 0 OR NOT EXISTS (SELECT 1 FROM bi.dead_letters d
                                       WHERE d.job_version = p_job AND d.record_id = u.id))
    ON CONFLICT (job_version, record_id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    UPDATE bi.shards s
       SET stored = s.stored + n,
           stored_fallback = s.stored_fallback + CASE WHEN p_transport = 'fallback' THEN n ELSE 0 END
     WHERE s.job_version = p_job AND s.shard_no = p_shard;
    stale := false;
END $$;

-- Count one failed attempt per record; at the job's max_attempts the record
-- goes to dead letters with its last error and raw output (I4).
-- p_attempt_nos[i] is the attempt number the caller is recording for
-- p_ids[i]: a record whose count already reached it (the same call, retried
-- after its reply was lost) is not counted again; NULL counts
-- unconditionally. Returns, for every given record of the shard without a
-- result (parallel arrays in record id order), its count and whether it is
-- dead-lettered. Records that got an outcome leave the shard's in-flight
-- batch.
CREATE OR REPLACE FUNCTION bi.fail_records_v3(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                             p_transport text, p_ids text[], p_errors text[], p_outputs text[],
                                             p_attempt_nos integer[],
                                             OUT stale boolean, OUT record_ids text[], OUT attempts integer[],
                                             OUT dead boolean[])
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_max integer;
    v_counted record;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    PERFORM 1 FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
       FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'fail_records', p_epoch, p_worker);
        stale := true;
        RETURN;
    END IF;
    SELECT (j.spec ->> 'max_attempts')::integer INTO v_max FROM bi.jobs j WHERE j.job_version = p_job;

    -- bumped and fresh see the same snapshot: one touches rows that exist,
    -- the other inserts the missing ones, never both for a record.
    WITH given AS (
        SELECT u.id, u.err, u.out, u.n
          FROM unnest(p_ids, p_errors, p_outputs, p_attempt_nos) AS u(id, err, out, n)
         CROSS JOIN LATERAL (SELECT x.shard_no FROM bi.snapshot_rows x
                              WHERE x.job_version = p_job AND x.record_id = u.id OFFSET 0) sr
         WHERE sr.shard_no = p_shard
           AND NOT EXISTS (SELECT 1 FROM bi.results r WHERE r.job_version = p_job AND r.record_id = u.id)
           AND NOT EXISTS (SELECT 1 FROM bi.dead_letters d WHERE d.job_version = p_job AND d.record_id = u.id)
    ), bumped AS (
        UPDATE bi.attempts a
           SET attempts = a.attempts + 1, last_error = g.err, last_output = g.out, updated_at = clock_timestamp()
          FROM given g
         WHERE a.job_version = p_job AND a.record_id = g.id AND a.attempts < coalesce(g.n, a.attempts + 1)
        RETURNING a.record_id, a.attempts, a.last_error, a.last_output
    ), fresh AS (
        INSERT INTO bi.attempts AS t (job_version, record_id, attempts, last_error, last_output)
        SELECT p_job, g.id, 1, g.err, g.out
          FROM given g
         WHERE NOT EXISTS (SELECT 1 FROM bi.attempts a WHERE a.job_version = p_job AND a.record_id = g.id)
        ON CONFLICT (job_version, record_id) DO NOTHING
        RETURNING t.record_id, t.attempts, t.last_error, t.last_output
    )
    SELECT array_agg(f.record_id) AS ids, array_agg(f.attempts) AS attempts,
           array_agg(format('failed %s attempts: %s', f.attempts,
                            split_part(coalesce(f.last_error, 'unknown error'), E'\n', 1))) AS reasons,
           array_agg(f.last_error) AS errors, array_agg(f.last_output) AS outputs
      INTO v_counted
      FROM (SELECT * FROM bumped UNION ALL SELECT * FROM fresh) f
     WHERE f.attempts >= v_max;
    PERFORM bi.dead_letter_records_v1(p_job, p_shard, p_transport, v_counted.ids, v_counted.attempts,
                                      v_counted.reasons, v_counted.errors, v_counted.outputs);

    -- They had an outcome, so they did not kill anyone (careful shards only).
    UPDATE bi.shards s
       SET in_flight = ARRAY(SELECT x FROM unnest(s.in_flight) AS x WHERE x <> ALL (p_ids))
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND s.in_flight IS NOT NULL;

    stale := false;
    SELECT coalesce(array_agg(a.record_id ORDER BY a.record_id), '{}'),
           coalesce(array_agg(a.attempts ORDER BY a.record_id), '{}'),
           coalesce(array_agg(EXISTS (SELECT 1 FROM bi.dead_letters d
                                       WHERE d.job_version = p_job AND d.record_id = a.record_id)
                              ORDER BY a.record_id), '{}')
      INTO record_ids, attempts, dead
      FROM bi.attempts a
      JOIN bi.snapshot_rows sr ON sr.job_version = a.job_version AND sr.record_id = a.record_id
     WHERE a.job_version = p_job AND a.record_id = ANY (p_ids) AND sr.shard_no = p_shard
       AND NOT EXISTS (SELECT 1 FROM bi.results r WHERE r.job_version = p_job AND r.record_id = a.record_id);
END $$;


DROP FUNCTION bi.renew_lease_v1(text, integer, bigint, text, integer);
DROP FUNCTION bi.release_shard_v1(text, integer, bigint, text);
DROP FUNCTION bi.complete_shard_v1(text, integer, bigint, text);
DROP FUNCTION bi.mark_in_flight_v1(text, integer, bigint, text, text[]);
DROP FUNCTION bi.abandon_shard_v1(text, integer, bigint, text);
DROP FUNCTION bi.put_results_v1(text, integer, bigint, text, text, text[], jsonb[], text[]);
DROP FUNCTION bi.fail_records_v2(text, integer, bigint, text, text, text[], text[], text[], integer[]);

GRANT EXECUTE ON FUNCTION
    bi.renew_lease_v2(text, integer, bigint, text, integer),
    bi.release_shard_v2(text, integer, bigint, text),
    bi.complete_shard_v2(text, integer, bigint, text),
    bi.mark_in_flight_v2(text, integer, bigint, text, text[]),
    bi.abandon_shard_v2(text, integer, bigint, text),
    bi.put_results_v2(text, integer, bigint, text, text, text[], jsonb[], text[]),
    bi.fail_records_v3(text, integer, bigint, text, text, text[], text[], text[], integer[])
TO bi_worker;
