-- 0002_ledger: every state transition of the shard ledger as one SQL function.
--
-- The guard of each transition (state, lease epoch) sits in the statement that
-- changes state, never in a read-then-write in Python. A write from a stale
-- epoch is refused and recorded in bi.fence_events. Functions are SECURITY
-- DEFINER with a pinned search_path so the worker role needs EXECUTE only.
-- Names carry a version suffix: a migration adds _v2 beside _v1 so a worker
-- that is still running keeps working.

-- Partitions of one job version, created at submit. Each is created on its
-- own and then attached: CREATE TABLE ... PARTITION OF would take an ACCESS
-- EXCLUSIVE lock on the parent and queue behind readers of a published view,
-- ATTACH PARTITION takes only SHARE UPDATE EXCLUSIVE. The snapshot partition
-- is written by submit itself with CREATE TABLE AS (the bulk path, no index
-- maintenance per row); bi.attach_snapshot_v1 then adds its constraints in one
-- scan and attaches it, which builds its indexes in one sort each.
CREATE OR REPLACE FUNCTION bi.create_job_partitions_v1(p_job text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    t text;
    part text;
    suffix text := substr(md5(p_job), 1, 16);
BEGIN
    FOREACH t IN ARRAY ARRAY['results', 'dead_letters', 'attempts'] LOOP
        part := t || '_' || suffix;
        IF to_regclass(format('bi.%I', part)) IS NULL THEN
            EXECUTE format('CREATE TABLE bi.%I (LIKE bi.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', part, t);
            EXECUTE format('ALTER TABLE bi.%I ATTACH PARTITION bi.%I FOR VALUES IN (%L)', t, part, p_job);
        END IF;
    END LOOP;
    RETURN 'snapshot_rows_' || suffix;   -- the name submit creates the snapshot under
END $$;

CREATE OR REPLACE FUNCTION bi.attach_snapshot_v1(p_job text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    part text := 'snapshot_rows_' || substr(md5(p_job), 1, 16);
BEGIN
    -- One ALTER, one scan; the CHECK lets ATTACH skip its own validation scan.
    EXECUTE format('ALTER TABLE bi.%I ALTER COLUMN job_version SET NOT NULL, ALTER COLUMN record_id SET NOT NULL, '
                   'ALTER COLUMN text SET NOT NULL, ALTER COLUMN content_hash SET NOT NULL, '
                   'ADD CONSTRAINT %I CHECK (job_version = %L)', part, part || '_jv', p_job);
    EXECUTE format('ALTER TABLE bi.snapshot_rows ATTACH PARTITION bi.%I FOR VALUES IN (%L)', part, p_job);
END $$;

-- Drop a whole job version: its partitions go with DROP TABLE, no row-by-row DELETE.
-- Refused while the version is published (rollback first).
CREATE OR REPLACE FUNCTION bi.drop_job_version_v1(p_job text) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    t text;
    suffix text := substr(md5(p_job), 1, 16);
BEGIN
    IF EXISTS (SELECT 1 FROM bi.publish_pointer WHERE job_version = p_job) THEN
        RAISE EXCEPTION 'job version % is published; roll back its dataset before dropping it', p_job
            USING ERRCODE = 'object_in_use';
    END IF;
    FOREACH t IN ARRAY ARRAY['snapshot_rows', 'results', 'dead_letters', 'attempts'] LOOP
        EXECUTE format('DROP TABLE IF EXISTS bi.%I', t || '_' || suffix);
    END LOOP;
    DELETE FROM bi.jobs WHERE job_version = p_job;   -- cascades to its shards
    RETURN FOUND;
END $$;

CREATE OR REPLACE FUNCTION bi.record_fence_v1(p_job text, p_shard integer, p_op text, p_epoch bigint, p_worker text)
RETURNS void LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    INSERT INTO bi.fence_events (job_version, shard_no, op, presented, current, worker_id)
    SELECT p_job, p_shard, p_op, p_epoch,
           (SELECT s.epoch FROM bi.shards s WHERE s.job_version = p_job AND s.shard_no = p_shard), p_worker;
$$;

-- Claim one shard: a pending one, or one whose lease expired (no sweeper
-- needed for progress). The epoch goes up by one on every claim and never
-- resets. Batch workers are refused once the job is in fallback mode.
CREATE OR REPLACE FUNCTION bi.claim_shard_v1(p_job text, p_owner text, p_transport text DEFAULT 'batch',
                                            p_lease_seconds integer DEFAULT NULL)
RETURNS TABLE (shard_no integer, epoch bigint, lease_expires_at timestamptz, records integer)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH job AS (
        SELECT j.job_version,
               coalesce(p_lease_seconds, (j.spec ->> 'lease_seconds')::integer) AS lease_s
        FROM bi.jobs j
        WHERE j.job_version = p_job
          AND j.status = 'running'
          AND (p_transport = 'fallback' OR j.mode = 'batch')
    ), pick AS (
        SELECT s.shard_no
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
           claims = s.claims + 1,
           first_claim_at = coalesce(s.first_claim_at, clock_timestamp())
      FROM pick, job
     WHERE s.job_version = p_job AND s.shard_no = pick.shard_no
    RETURNING s.shard_no, s.epoch, s.lease_expires_at, s.records;
$$;

-- Renew: only the holder of the current epoch. Returns the job's mode so a
-- batch worker learns within one renewal interval that the cutoff fired.
CREATE OR REPLACE FUNCTION bi.renew_lease_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                            p_lease_seconds integer DEFAULT NULL)
RETURNS TABLE (ok boolean, mode text, lease_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_expires timestamptz;
    v_mode text;
BEGIN
    SELECT j.mode INTO v_mode FROM bi.jobs j WHERE j.job_version = p_job;
    UPDATE bi.shards s
       SET lease_expires_at = clock_timestamp() + make_interval(secs =>
               coalesce(p_lease_seconds, (SELECT (j.spec ->> 'lease_seconds')::integer
                                          FROM bi.jobs j WHERE j.job_version = p_job)))
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND s.epoch = p_epoch AND s.state = 'leased'
    RETURNING s.lease_expires_at INTO v_expires;
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'renew', p_epoch, p_worker);
        RETURN QUERY SELECT false, v_mode, NULL::timestamptz;
        RETURN;
    END IF;
    RETURN QUERY SELECT true, v_mode, v_expires;
END $$;

-- Release (the preemption notice): the shard is pending again at once.
CREATE OR REPLACE FUNCTION bi.release_shard_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE bi.shards s
       SET state = 'pending', lease_owner = NULL, lease_transport = NULL, lease_expires_at = NULL
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND s.epoch = p_epoch AND s.state = 'leased';
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'release', p_epoch, p_worker);
        RETURN false;
    END IF;
    RETURN true;
END $$;

-- Complete: only the current epoch, and only when every record of the shard
-- is stored or dead-lettered. Returns 'done', 'stale' or 'incomplete'.
CREATE OR REPLACE FUNCTION bi.complete_shard_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE bi.shards s
       SET state = 'done', lease_owner = NULL, lease_expires_at = NULL, done_at = clock_timestamp()
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND s.epoch = p_epoch AND s.state = 'leased'
       AND s.stored + s.dead >= s.records;
    IF FOUND THEN
        RETURN 'done';
    END IF;
    -- Not a guard, only the reason for the refusal.
    IF EXISTS (SELECT 1 FROM bi.shards s WHERE s.job_version = p_job AND s.shard_no = p_shard
                                          AND s.epoch = p_epoch AND s.state = 'leased') THEN
        RETURN 'incomplete';
    END IF;
    PERFORM bi.record_fence_v1(p_job, p_shard, 'complete', p_epoch, p_worker);
    RETURN 'stale';
END $$;

-- The records of a leased shard still to do, readable only by the current
-- epoch's holder: a worker never reads rows of a shard it does not hold.
CREATE OR REPLACE FUNCTION bi.shard_records_v1(p_job text, p_shard integer, p_epoch bigint)
RETURNS TABLE (record_id text, text text, attempts integer)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT sr.record_id, sr.text, coalesce(a.attempts, 0)
      FROM bi.shards s
      JOIN bi.snapshot_rows sr ON sr.job_version = s.job_version AND sr.shard_no = s.shard_no
      LEFT JOIN bi.attempts a ON a.job_version = sr.job_version AND a.record_id = sr.record_id
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND s.epoch = p_epoch AND s.state = 'leased'
       AND NOT EXISTS (SELECT 1 FROM bi.results r WHERE r.job_version = sr.job_version AND r.record_id = sr.record_id)
       AND NOT EXISTS (SELECT 1 FROM bi.dead_letters d WHERE d.job_version = sr.job_version AND d.record_id = sr.record_id)
     ORDER BY sr.record_id;
$$;

-- Put-if-absent results for one shard under the current epoch. The shard row
-- is locked first, so a concurrent claim (which bumps the epoch) waits for
-- this batch to commit, and a batch from a stale epoch writes nothing.
-- Returns the number of new rows, or -1 when the epoch is stale.
CREATE OR REPLACE FUNCTION bi.put_results_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                            p_transport text, p_ids text[], p_outputs jsonb[], p_categories text[])
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
BEGIN
    PERFORM 1 FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND s.epoch = p_epoch AND s.state = 'leased'
       FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'put_results', p_epoch, p_worker);
        RETURN -1;
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
       AND NOT EXISTS (SELECT 1 FROM bi.dead_letters d WHERE d.job_version = p_job AND d.record_id = u.id)
    ON CONFLICT (job_version, record_id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    UPDATE bi.shards s
       SET stored = s.stored + n,
           stored_fallback = s.stored_fallback + CASE WHEN p_transport = 'fallback' THEN n ELSE 0 END
     WHERE s.job_version = p_job AND s.shard_no = p_shard;
    RETURN n;
END $$;

-- Count one failed attempt per record; at the job's max_attempts the record
-- goes to dead letters with its last error and raw output (I4). Returns one
-- row per counted record; a stale epoch returns the single row (NULL, -1, false).
CREATE OR REPLACE FUNCTION bi.fail_records_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                             p_transport text, p_ids text[], p_errors text[], p_outputs text[])
RETURNS TABLE (record_id text, attempts integer, dead boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_max integer;
    n integer;
BEGIN
    PERFORM 1 FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND s.epoch = p_epoch AND s.state = 'leased'
       FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'fail_records', p_epoch, p_worker);
        RETURN QUERY SELECT NULL::text, -1, false;
        RETURN;
    END IF;
    SELECT (j.spec ->> 'max_attempts')::integer INTO v_max FROM bi.jobs j WHERE j.job_version = p_job;

    CREATE TEMP TABLE IF NOT EXISTS _bi_failed (record_id text, attempts integer, err text, out text)
        ON COMMIT DROP;
    TRUNCATE _bi_failed;
    WITH up AS (
        INSERT INTO bi.attempts AS a (job_version, record_id, attempts, last_error, last_output)
        SELECT p_job, u.id, 1, u.err, u.out
          FROM unnest(p_ids, p_errors, p_outputs) AS u(id, err, out)
         CROSS JOIN LATERAL (SELECT x.shard_no FROM bi.snapshot_rows x
                              WHERE x.job_version = p_job AND x.record_id = u.id OFFSET 0) sr
         WHERE sr.shard_no = p_shard
           AND NOT EXISTS (SELECT 1 FROM bi.results r WHERE r.job_version = p_job AND r.record_id = u.id)
           AND NOT EXISTS (SELECT 1 FROM bi.dead_letters d WHERE d.job_version = p_job AND d.record_id = u.id)
        ON CONFLICT (job_version, record_id) DO UPDATE
           SET attempts = a.attempts + 1, last_error = excluded.last_error,
               last_output = excluded.last_output, updated_at = clock_timestamp()
        RETURNING a.record_id, a.attempts, a.last_error, a.last_output
    )
    INSERT INTO _bi_failed SELECT * FROM up;

    INSERT INTO bi.dead_letters (job_version, record_id, reason, error, raw_output, attempts, stage,
                                 model_name, model_digest, prompt_version, transport, acl)
    SELECT p_job, f.record_id,
           left(format('failed %s attempts: %s', f.attempts, split_part(coalesce(f.err, 'unknown error'), E'\n', 1)), 300),
           f.err, f.out, f.attempts, 'worker', j.model_name, j.model_digest, j.prompt_version, p_transport, sr.acl
      FROM _bi_failed f
      JOIN bi.snapshot_rows sr ON sr.job_version = p_job AND sr.record_id = f.record_id
      JOIN bi.jobs j ON j.job_version = p_job
     WHERE f.attempts >= v_max
    ON CONFLICT (job_version, record_id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    UPDATE bi.shards s SET dead = s.dead + n WHERE s.job_version = p_job AND s.shard_no = p_shard;

    RETURN QUERY SELECT f.record_id, f.attempts, f.attempts >= v_max FROM _bi_failed f;
END $$;

-- Return every expired lease to pending (claims also take expired shards, so
-- this is for a tidy status page, not for progress).
CREATE OR REPLACE FUNCTION bi.sweep_expired_v1(p_job text) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE n integer;
BEGIN
    UPDATE bi.shards s SET state = 'pending', lease_owner = NULL, lease_transport = NULL, lease_expires_at = NULL
     WHERE s.job_version = p_job AND s.state = 'leased' AND s.lease_expires_at < clock_timestamp();
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- The cutoff fired: batch workers stop claiming and drain; the fallback pool claims.
CREATE OR REPLACE FUNCTION bi.enter_fallback_v1(p_job text) RETURNS boolean
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    UPDATE bi.jobs SET mode = 'fallback', fallback_at = coalesce(fallback_at, clock_timestamp())
     WHERE job_version = p_job AND status = 'running'
    RETURNING true;
$$;

-- What a worker needs to run a job: its pinned spec. Nothing else of the job.
CREATE OR REPLACE FUNCTION bi.job_spec_v1(p_job text)
RETURNS TABLE (spec jsonb, mode text, status text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT j.spec, j.mode, j.status FROM bi.jobs j WHERE j.job_version = p_job;
$$;

-- Live counts from the shard table alone: cost independent of the number of records.
CREATE OR REPLACE FUNCTION bi.job_counts_v1(p_job text)
RETURNS TABLE (records bigint, stored bigint, stored_batch bigint, stored_fallback bigint, reused bigint,
               dead_letters bigint, outstanding bigint, shards_pending bigint, shards_leased bigint,
               shards_done bigint, mode text, status text, first_claim_at timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT j.records,
           j.reused + coalesce(sum(s.stored), 0),
           coalesce(sum(s.stored - s.stored_fallback), 0),
           coalesce(sum(s.stored_fallback), 0),
           j.reused,
           j.planned_dead + coalesce(sum(s.dead), 0),
           j.records - j.reused - j.planned_dead - coalesce(sum(s.stored + s.dead), 0),
           count(*) FILTER (WHERE s.state = 'pending'),
           count(*) FILTER (WHERE s.state = 'leased'),
           count(*) FILTER (WHERE s.state = 'done'),
           j.mode, j.status, min(s.first_claim_at)
      FROM bi.jobs j
      LEFT JOIN bi.shards s ON s.job_version = j.job_version
     WHERE j.job_version = p_job
     GROUP BY j.job_version;
$$;
