-- 0006_crash_poison: records that kill the worker are dead-lettered too (I4),
-- and a retried failed-attempt count is counted once.
--
-- Until now attempts were counted only by fail_records_v1, for failures the
-- worker lives through. A record that kills the process (OOM, a segfault or
-- an abort in the engine) left no trace: the lease expired, the next holder
-- ran the same batch, died the same way, forever.
--
-- The fix costs nothing on the normal path:
--
-- * bi.shards.lost_leases counts the epochs of a shard that ended without a
--   release or a completion: a lease taken over after it expired (claim), a
--   lease swept (sweep_expired_v1), or a shard given up because the engine
--   broke (abandon_shard_v1). A shard that never lost a lease runs exactly as
--   before: no extra statement, no extra column written per record.
-- * A shard that lost a lease is run carefully by its next holders (the claim
--   returns lost_leases): the worker sends the ids of each engine batch to
--   mark_in_flight_v1 before generating it, one statement per batch, fenced by
--   the epoch. The ids are kept on the shard row (in_flight), replaced by the
--   next batch, cleared by every claim; fail_records_v2 takes out the records
--   that did get an outcome. Batches are small there (the worker's
--   --careful-batch), so one death implicates few records.
-- * When such an epoch ends without a release (the lease is taken over after
--   expiring, swept, or abandoned), every record of its last marked batch
--   that has neither a result nor a dead letter gets one more crash in
--   bi.attempts.crashes (record_deaths_v1). At the job's max_attempts crashes
--   it is dead-lettered by that same statement, with a NULL raw output and an
--   error that says how many times the worker died with it in flight.
-- * Records with crashes are suspects: the worker runs each one alone (a batch
--   of one, marked), so the next death names the culprit and no innocent
--   record that shared its first batch reaches the limit.
--
-- Crashes and failed attempts are separate budgets: a record is dead-lettered
-- when either reaches max_attempts, so an engine error poison still gets its
-- max_attempts engine calls even if a kill caught it in flight once.
--
-- fail_records_v2 takes the attempt number the worker is recording for each
-- record (what shard_records returned plus one, then what fail returned). A
-- call repeated after a lost reply finds the count already there and adds
-- nothing. v1 functions stay (a worker still running the old code keeps
-- working). claim_shard_v1 and fail_records_v1 are now thin calls of their
-- v2 bodies (a v1 claim counts lost leases and crashes too), and
-- shard_records_v2 adds one column to v1's: one live body per transition.

ALTER TABLE bi.shards
    ADD COLUMN IF NOT EXISTS lost_leases integer NOT NULL DEFAULT 0,   -- epochs that ended without release or completion
    ADD COLUMN IF NOT EXISTS in_flight text[];                         -- the current epoch's last marked engine batch

-- Deaths with the record in flight; separate from failed attempts (above).
ALTER TABLE bi.attempts ADD COLUMN IF NOT EXISTS crashes integer NOT NULL DEFAULT 0;

-- Worker-stage dead letters for records of one shard, and the shard's dead
-- counter with them: the one place both the failure count and the crash
-- count end in. Arrays are parallel; a record already dead-lettered is
-- skipped. Owner only. Returns how many were written.
CREATE OR REPLACE FUNCTION bi.dead_letter_records_v1(p_job text, p_shard integer, p_transport text, p_ids text[],
                                                    p_attempts integer[], p_reasons text[], p_errors text[],
                                                    p_outputs text[])
RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
BEGIN
    INSERT INTO bi.dead_letters (job_version, record_id, reason, error, raw_output, attempts, stage,
                                 model_name, model_digest, prompt_version, transport, acl)
    SELECT p_job, u.id, left(u.reason, 300), u.err, u.out, u.n, 'worker',
           j.model_name, j.model_digest, j.prompt_version, p_transport, sr.acl
      FROM unnest(p_ids, p_attempts, p_reasons, p_errors, p_outputs) AS u(id, n, reason, err, out)
      JOIN bi.snapshot_rows sr ON sr.job_version = p_job AND sr.record_id = u.id
      JOIN bi.jobs j ON j.job_version = p_job
     WHERE u.id IS NOT NULL
    ON CONFLICT (job_version, record_id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        UPDATE bi.shards s SET dead = s.dead + n WHERE s.job_version = p_job AND s.shard_no = p_shard;
    END IF;
    RETURN n;
END $$;

-- One more crash for each record of p_ids in the shard that is neither stored
-- nor dead-lettered; dead letters at max_attempts. Called with the shard row
-- locked (by the claim, the sweep or the abandon that ended epoch p_epoch).
-- Owner only: it is reached through those functions. Returns the number
-- dead-lettered.
CREATE OR REPLACE FUNCTION bi.record_deaths_v1(p_job text, p_shard integer, p_epoch bigint, p_transport text,
                                              p_ids text[])
RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_max integer;
    v_ids text[];
    v_crashes integer[];
BEGIN
    SELECT (j.spec ->> 'max_attempts')::integer INTO v_max FROM bi.jobs j WHERE j.job_version = p_job;
    WITH died AS (
        INSERT INTO bi.attempts AS a (job_version, record_id, attempts, crashes, last_error)
        SELECT p_job, u.id, 0, 1,
               format('the worker died while this record was in flight (shard %s, epoch %s)', p_shard, p_epoch)
          FROM (SELECT DISTINCT x.id FROM unnest(p_ids) AS x(id)) u
         CROSS JOIN LATERAL (SELECT x.shard_no FROM bi.snapshot_rows x
                              WHERE x.job_version = p_job AND x.record_id = u.id OFFSET 0) sr
         WHERE sr.shard_no = p_shard
           AND NOT EXISTS (SELECT 1 FROM bi.results r WHERE r.job_version = p_job AND r.record_id = u.id)
           AND NOT EXISTS (SELECT 1 FROM bi.dead_letters d WHERE d.job_version = p_job AND d.record_id = u.id)
        ON CONFLICT (job_version, record_id) DO UPDATE
           SET crashes = a.crashes + 1, last_error = excluded.last_error, updated_at = clock_timestamp()
        RETURNING a.record_id, a.crashes
    )
    SELECT array_agg(d.record_id), array_agg(d.crashes) INTO v_ids, v_crashes FROM died d WHERE d.crashes >= v_max;
    -- raw output NULL: the process died before the engine returned anything
    RETURN bi.dead_letter_records_v1(
        p_job, p_shard, p_transport, v_ids, v_crashes,
        ARRAY(SELECT format('worker died %s times with this record in flight', n) FROM unnest(v_crashes) n),
        ARRAY(SELECT format('the worker died %s times while this record was in flight (the last time: shard %s, '
                            'epoch %s; an OOM kill, a segfault or an abort in the engine, or a lost device)',
                            n, p_shard, p_epoch) FROM unnest(v_crashes) n),
        NULL);
END $$;

-- The claim of 0002, and: taking over an expired lease counts a lost lease
-- and the deaths of the last batch the expired epoch marked in flight. The
-- caller learns lost_leases (> 0: run this shard carefully).
CREATE OR REPLACE FUNCTION bi.claim_shard_v2_unguarded(p_job text, p_owner text, p_transport text DEFAULT 'batch',
                                                      p_lease_seconds integer DEFAULT NULL)
RETURNS TABLE (shard_no integer, epoch bigint, lease_expires_at timestamptz, records integer, lost_leases integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    c record;
BEGIN
    WITH job AS (
        SELECT j.job_version,
               coalesce(p_lease_seconds, (j.spec ->> 'lease_seconds')::integer) AS lease_s
        FROM bi.jobs j
        WHERE j.job_version = p_job
          AND j.status = 'running'
          AND (p_transport = 'fallback' OR j.mode = 'batch')
    ), pick AS (
        SELECT s.shard_no, s.state = 'leased' AS expired, s.epoch AS old_epoch,
               s.lease_transport AS old_transport, s.in_flight AS old_in_flight
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
           first_claim_at = coalesce(s.first_claim_at, clock_timestamp()),
           lost_leases = s.lost_leases + CASE WHEN pick.expired THEN 1 ELSE 0 END,
           in_flight = NULL
      FROM pick, job
     WHERE s.job_version = p_job AND s.shard_no = pick.shard_no
    RETURNING s.shard_no AS shard_no, s.epoch AS epoch, s.lease_expires_at AS lease_expires_at,
              s.records AS records, s.lost_leases AS lost_leases, pick.expired, pick.old_epoch,
              pick.old_transport, pick.old_in_flight
    INTO c;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- A release or a completion leaves no lease to expire, so only a holder
    -- that vanished (or stalled) lands here; its marks were its own epoch's.
    IF c.expired AND c.old_in_flight IS NOT NULL THEN
        PERFORM bi.record_deaths_v1(p_job, c.shard_no, c.old_epoch, c.old_transport, c.old_in_flight);
    END IF;
    RETURN QUERY SELECT c.shard_no, c.epoch, c.lease_expires_at, c.records, c.lost_leases;
END $$;

-- v1 keeps its signature and shares v2's body (a v1 claim counts lost leases too).
CREATE OR REPLACE FUNCTION bi.claim_shard_v1_unguarded(p_job text, p_owner text, p_transport text DEFAULT 'batch',
                                                      p_lease_seconds integer DEFAULT NULL)
RETURNS TABLE (shard_no integer, epoch bigint, lease_expires_at timestamptz, records integer)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT c.shard_no, c.epoch, c.lease_expires_at, c.records
      FROM bi.claim_shard_v2_unguarded(p_job, p_owner, p_transport, p_lease_seconds) c;
$$;

-- The sweep of 0002, and: a swept lease is a lost lease, with the same death count.
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
          FROM (SELECT o.shard_no, o.epoch, o.lease_transport, o.in_flight FROM bi.shards o
                 WHERE o.job_version = p_job AND o.state = 'leased' AND o.lease_expires_at < clock_timestamp()
                   FOR UPDATE) prev
         WHERE s.job_version = p_job AND s.shard_no = prev.shard_no
        RETURNING prev.shard_no, prev.epoch, prev.lease_transport, prev.in_flight
    LOOP
        n := n + 1;
        IF c.in_flight IS NOT NULL THEN
            PERFORM bi.record_deaths_v1(p_job, c.shard_no, c.epoch, c.lease_transport, c.in_flight);
        END IF;
    END LOOP;
    RETURN n;
END $$;

-- Careful mode: the ids of the engine batch about to be generated. One
-- statement per batch; the current epoch only. false (and a fence event)
-- when the epoch is stale.
CREATE OR REPLACE FUNCTION bi.mark_in_flight_v1_unguarded(p_job text, p_shard integer, p_epoch bigint,
                                                         p_worker text, p_ids text[])
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE bi.shards s
       SET in_flight = p_ids
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND s.epoch = p_epoch AND s.state = 'leased';
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'mark_in_flight', p_epoch, p_worker);
        RETURN false;
    END IF;
    RETURN true;
END $$;

-- The engine broke mid-shard (an exception, not a death): give the shard back
-- at once like a release, but count it as a lost lease with the deaths of its
-- in-flight batch, so an engine that fails on one record cannot loop either.
CREATE OR REPLACE FUNCTION bi.abandon_shard_v1_unguarded(p_job text, p_shard integer, p_epoch bigint,
                                                        p_worker text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_ids text[];
    v_transport text;
BEGIN
    SELECT s.in_flight, s.lease_transport INTO v_ids, v_transport
      FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND s.epoch = p_epoch AND s.state = 'leased'
       FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'abandon', p_epoch, p_worker);
        RETURN false;
    END IF;
    UPDATE bi.shards s
       SET state = 'pending', lease_owner = NULL, lease_transport = NULL, lease_expires_at = NULL,
           lost_leases = s.lost_leases + 1, in_flight = NULL
     WHERE s.job_version = p_job AND s.shard_no = p_shard;
    IF v_ids IS NOT NULL THEN
        PERFORM bi.record_deaths_v1(p_job, p_shard, p_epoch, v_transport, v_ids);
    END IF;
    RETURN true;
END $$;

-- shard_records_v1 plus each record's crashes (> 0: a suspect, run it alone).
-- (v1's body and guard, plus one primary-key probe per record: read once per claim.)
CREATE OR REPLACE FUNCTION bi.shard_records_v2_unguarded(p_job text, p_shard integer, p_epoch bigint)
RETURNS TABLE (record_id text, text text, attempts integer, crashes integer)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT v.record_id, v.text, v.attempts, coalesce(a.crashes, 0)
      FROM bi.shard_records_v1_unguarded(p_job, p_shard, p_epoch) v
      LEFT JOIN bi.attempts a ON a.job_version = p_job AND a.record_id = v.record_id
     ORDER BY v.record_id;
$$;

-- fail_records_v1, made safe to repeat: p_attempt_nos[i] is the attempt
-- number the caller is recording for p_ids[i]. A record whose count already
-- reached it (the same call, retried after its reply was lost) is not
-- counted again; NULL counts unconditionally, as v1 did. Returns, for every
-- given record of the shard without a result, its count and whether it is
-- dead-lettered; a stale epoch returns the single row (NULL, -1, false).
-- Records that got an outcome leave the shard's in-flight batch.
CREATE OR REPLACE FUNCTION bi.fail_records_v2_unguarded(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                                       p_transport text, p_ids text[], p_errors text[],
                                                       p_outputs text[], p_attempt_nos integer[])
RETURNS TABLE (record_id text, attempts integer, dead boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_max integer;
    v_counted record;
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

    RETURN QUERY
    SELECT a.record_id, a.attempts,
           EXISTS (SELECT 1 FROM bi.dead_letters d WHERE d.job_version = p_job AND d.record_id = a.record_id)
      FROM bi.attempts a
      JOIN bi.snapshot_rows sr ON sr.job_version = a.job_version AND sr.record_id = a.record_id
     WHERE a.job_version = p_job AND a.record_id = ANY (p_ids) AND sr.shard_no = p_shard
       AND NOT EXISTS (SELECT 1 FROM bi.results r WHERE r.job_version = p_job AND r.record_id = a.record_id);
END $$;

-- v1 keeps its signature and runs v2's body without attempt numbers (each
-- call counts, as before), so one body of the failure count is live.
CREATE OR REPLACE FUNCTION bi.fail_records_v1_unguarded(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                                       p_transport text, p_ids text[], p_errors text[],
                                                       p_outputs text[])
RETURNS TABLE (record_id text, attempts integer, dead boolean)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT * FROM bi.fail_records_v2_unguarded(p_job, p_shard, p_epoch, p_worker, p_transport,
                                                p_ids, p_errors, p_outputs, NULL);
$$;

-- The worker-facing names, behind the per-job guard of 0004 (same pattern:
-- the body is <name>_unguarded, the wrapper checks the grant and calls it).
CREATE OR REPLACE FUNCTION bi.claim_shard_v2(p_job text, p_owner text, p_transport text DEFAULT 'batch',
                                            p_lease_seconds integer DEFAULT NULL)
RETURNS TABLE (shard_no integer, epoch bigint, lease_expires_at timestamptz, records integer, lost_leases integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY SELECT * FROM bi.claim_shard_v2_unguarded(p_job, p_owner, p_transport, p_lease_seconds);
END $$;

CREATE OR REPLACE FUNCTION bi.mark_in_flight_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                               p_ids text[])
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN bi.mark_in_flight_v1_unguarded(p_job, p_shard, p_epoch, p_worker, p_ids);
END $$;

CREATE OR REPLACE FUNCTION bi.abandon_shard_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN bi.abandon_shard_v1_unguarded(p_job, p_shard, p_epoch, p_worker);
END $$;

CREATE OR REPLACE FUNCTION bi.shard_records_v2(p_job text, p_shard integer, p_epoch bigint)
RETURNS TABLE (record_id text, text text, attempts integer, crashes integer)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY SELECT * FROM bi.shard_records_v2_unguarded(p_job, p_shard, p_epoch);
END $$;

CREATE OR REPLACE FUNCTION bi.fail_records_v2(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                             p_transport text, p_ids text[], p_errors text[], p_outputs text[],
                                             p_attempt_nos integer[])
RETURNS TABLE (record_id text, attempts integer, dead boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY SELECT * FROM bi.fail_records_v2_unguarded(p_job, p_shard, p_epoch, p_worker, p_transport,
                                                             p_ids, p_errors, p_outputs, p_attempt_nos);
END $$;

-- Closed to PUBLIC (0004's default privileges do it too; this does not rely on them).
REVOKE EXECUTE ON FUNCTION
    bi.dead_letter_records_v1(text, integer, text, text[], integer[], text[], text[], text[]),
    bi.record_deaths_v1(text, integer, bigint, text, text[]),
    bi.claim_shard_v2_unguarded(text, text, text, integer),
    bi.mark_in_flight_v1_unguarded(text, integer, bigint, text, text[]),
    bi.abandon_shard_v1_unguarded(text, integer, bigint, text),
    bi.shard_records_v2_unguarded(text, integer, bigint),
    bi.fail_records_v2_unguarded(text, integer, bigint, text, text, text[], text[], text[], integer[]),
    bi.claim_shard_v2(text, text, text, integer),
    bi.mark_in_flight_v1(text, integer, bigint, text, text[]),
    bi.abandon_shard_v1(text, integer, bigint, text),
    bi.shard_records_v2(text, integer, bigint),
    bi.fail_records_v2(text, integer, bigint, text, text, text[], text[], text[], integer[])
FROM PUBLIC;

GRANT EXECUTE ON FUNCTION
    bi.claim_shard_v2(text, text, text, integer),
    bi.mark_in_flight_v1(text, integer, bigint, text, text[]),
    bi.abandon_shard_v1(text, integer, bigint, text),
    bi.shard_records_v2(text, integer, bigint),
    bi.fail_records_v2(text, integer, bigint, text, text, text[], text[], text[], integer[])
TO bi_worker;
