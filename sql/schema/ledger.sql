-- ledger: every state transition of the shard ledger as one SQL function.
--
-- The guard of each transition (state, lease epoch) sits in the statement that
-- changes state, never in a read-then-write in Python. The lease guard is
-- written once, bi.holds_lease_v1, which the planner inlines into each of those
-- statements. A call from a stale epoch is refused and recorded in
-- bi.fence_events, and every fenced transition reports it the same way: one
-- row whose first column, stale, is true (the rest NULL). Worker-facing functions are SECURITY DEFINER with a pinned
-- search_path so the worker role needs EXECUTE only, and each checks first
-- that the authenticated role may work on the job version
-- (bi.assert_may_work_on_v1, roles.sql). Names carry a version suffix: a
-- change of signature adds _v2 beside _v1, so a worker that is still running
-- keeps working.

-- Partitions of one job version, created at submit. Each is created on its
-- own and then attached: CREATE TABLE ... PARTITION OF would take an ACCESS
-- EXCLUSIVE lock on the parent and queue behind readers of a published view,
-- ATTACH PARTITION takes only SHARE UPDATE EXCLUSIVE. The results partition
-- is itself HASH-partitioned by record_id into 8 tables (results_<suffix>_0
-- .. _7), created under it before it is attached: a whole fleet puts into one
-- job at once, and each of the 8 heaps and primary-key indexes has its own
-- relation extension lock, so the writers queue to extend eight relations
-- instead of one. (job_version, record_id) stays the key: it holds the hash
-- key. The snapshot partition
-- is written by submit itself with CREATE TABLE AS (the bulk path, no index
-- maintenance per row); bi.attach_snapshot_v2 then adds its constraints in one
-- scan, builds its two indexes in one sort each and attaches it.
CREATE OR REPLACE FUNCTION bi.create_job_partitions_v1(p_job text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    t text;
    part text;
    suffix text := substr(md5(p_job), 1, 16);
    hash_parts constant integer := 8;
BEGIN
    FOREACH t IN ARRAY ARRAY['results', 'dead_letters', 'attempts'] LOOP
        part := t || '_' || suffix;
        IF to_regclass(format('bi.%I', part)) IS NULL THEN
            EXECUTE format('CREATE TABLE bi.%I (LIKE bi.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)%s', part, t,
                           CASE WHEN t = 'results' THEN ' PARTITION BY HASH (record_id)' ELSE '' END);
            IF t = 'results' THEN
                FOR i IN 0 .. hash_parts - 1 LOOP
                    EXECUTE format('CREATE TABLE bi.%I PARTITION OF bi.%I FOR VALUES WITH (MODULUS %s, REMAINDER %s)',
                                   part || '_' || i, part, hash_parts, i);
                END LOOP;
            END IF;
            EXECUTE format('ALTER TABLE bi.%I ATTACH PARTITION bi.%I FOR VALUES IN (%L)', t, part, p_job);
        END IF;
    END LOOP;
    RETURN 'snapshot_rows_' || suffix;   -- the name submit creates the snapshot under
END $$;

CREATE OR REPLACE FUNCTION bi.attach_snapshot_v2(p_job text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    part text := 'snapshot_rows_' || substr(md5(p_job), 1, 16);
BEGIN
    -- One ALTER, one scan; the CHECK lets ATTACH skip its own validation scan.
    EXECUTE format('ALTER TABLE bi.%I ALTER COLUMN job_version SET NOT NULL, ALTER COLUMN record_id SET NOT NULL, '
                   'ALTER COLUMN text SET NOT NULL, ALTER COLUMN content_hash SET NOT NULL, '
                   'ADD CONSTRAINT %I CHECK (job_version = %L)', part, part || '_jv', p_job);
    -- The key and the shard index compare record ids as bytes (text_pattern_ops:
    -- memcmp with abbreviated keys, where the database's collation would call
    -- strcoll for every comparison): 3x less CPU for the key over ids in random
    -- order (UUIDs), the same in id order. Equality is the same under both, so
    -- the unique index is the key (a duplicate id fails it) and serves every
    -- record_id = x lookup; the shard index is read in byte order
    -- (bi.shard_records_v4).
    EXECUTE format('CREATE UNIQUE INDEX %I ON bi.%I (record_id text_pattern_ops)', part || '_key', part);
    EXECUTE format('CREATE INDEX %I ON bi.%I (shard_no, record_id text_pattern_ops)', part || '_shard', part);
    EXECUTE format('ALTER TABLE bi.snapshot_rows ATTACH PARTITION bi.%I FOR VALUES IN (%L)', part, p_job);
END $$;

-- Drop a whole job version: its partitions go with DROP TABLE, no row-by-row DELETE.
-- Refused while the version is published (rollback first). Its companion
-- versions (bi.companion_versions) go with it, each unless it serves another
-- version too or is published itself; the companion's row is locked first,
-- so two drops of versions sharing one do not both leave it behind.
CREATE OR REPLACE FUNCTION bi.drop_job_version_v1(p_job text) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    t text;
    suffix text := substr(md5(p_job), 1, 16);
    v_companion text;
BEGIN
    IF EXISTS (SELECT 1 FROM bi.publish_pointer WHERE job_version = p_job) THEN
        RAISE EXCEPTION 'job version % is published; roll back its dataset before dropping it', p_job
            USING ERRCODE = 'object_in_use';
    END IF;
    FOR v_companion IN
        SELECT jc.job_version FROM bi.jobs jc
         WHERE jc.job_version IN (SELECT c.companion FROM bi.companion_versions c WHERE c.job_version = p_job)
         ORDER BY jc.job_version
           FOR UPDATE
    LOOP
        IF NOT EXISTS (SELECT 1 FROM bi.companion_versions o WHERE o.companion = v_companion AND o.job_version <> p_job)
           AND NOT EXISTS (SELECT 1 FROM bi.publish_pointer pp WHERE pp.job_version = v_companion) THEN
            PERFORM bi.drop_job_version_v1(v_companion);
        END IF;
    END LOOP;
    FOREACH t IN ARRAY ARRAY['snapshot_rows', 'results', 'dead_letters', 'attempts'] LOOP
        EXECUTE format('DROP TABLE IF EXISTS bi.%I', t || '_' || suffix);
    END LOOP;
    DELETE FROM bi.jobs WHERE job_version = p_job;   -- cascades to its shards
    RETURN FOUND;
END $$;

-- The fence: shard row s is leased under epoch p_epoch. Every transition made
-- under a lease puts this in the WHERE clause of the statement that changes
-- (or locks) the shard row, so the check and the change are one statement.
-- A plain SQL expression (no SECURITY DEFINER, no SET): the planner inlines
-- it, so it costs what the two comparisons cost and the row's lock re-check
-- (READ COMMITTED) covers it. Its callers pin search_path.
CREATE OR REPLACE FUNCTION bi.holds_lease_v1(s bi.shards, p_epoch bigint) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT s.state = 'leased' AND s.epoch = p_epoch
$$;

-- A refused call from a stale epoch, recorded with the epoch the shard is at.
CREATE OR REPLACE FUNCTION bi.record_fence_v1(p_job text, p_shard integer, p_op text, p_epoch bigint, p_worker text)
RETURNS void LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    INSERT INTO bi.fence_events (job_version, shard_no, op, presented, current, worker_id)
    SELECT p_job, p_shard, p_op, p_epoch,
           (SELECT s.epoch FROM bi.shards s WHERE s.job_version = p_job AND s.shard_no = p_shard), p_worker;
$$;

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

-- Whether the server (re)started after a lease was last claimed or renewed
-- (bi.shards.lease_renewed_at): the restart cut the holder's connections, its
-- renewals included, so the lapse is no sign that the holder died. An expired
-- lease counts no deaths then. False when the stamp is unknown.
CREATE OR REPLACE FUNCTION bi.lapsed_over_restart_v1(p_renewed_at timestamptz)
RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(pg_postmaster_start_time() > p_renewed_at, false)
$$;

-- Records that kill the worker (an OOM kill, a segfault or an abort in the
-- engine) are dead-lettered too (I4). A shard whose lease ended without a
-- release or a completion (taken over after it expired, swept, or abandoned)
-- counts a lost lease; its next holders run it carefully: the worker marks
-- each engine batch in flight before generating it (bi.mark_in_flight_v2),
-- and when such an epoch ends without a release, every record of its last
-- marked batch left without an outcome gets one more crash, unless the server
-- restarted since the lease was last claimed or renewed
-- (bi.lapsed_over_restart_v1: the holder may be alive and reconnecting;
-- nothing says it died). At the job's
-- max_attempts crashes it is dead-lettered. Crashes and failed attempts are
-- separate budgets: a record is dead-lettered when either reaches
-- max_attempts. Records with crashes are suspects, run alone.
--
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
-- is stored or dead-lettered. done is false while records are left. The
-- completion that leaves no shard of the job undone notifies channel bi_done
-- with the job version: a cutoff watch between polls reads the counts at once.
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
        IF NOT EXISTS (SELECT 1 FROM bi.shards s WHERE s.job_version = p_job AND s.state <> 'done') THEN
            PERFORM pg_notify('bi_done', p_job);
        END IF;
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

-- The records of a leased shard still to do, with each one's failed attempts
-- and crashes (> 0: a suspect, run it alone), readable only by the current
-- epoch's holder: a worker never reads rows of a shard it does not hold.
-- One page at a time, in record_id order: the first p_limit records after
-- p_after (NULL: from the start; a NULL p_limit: all the rest). A worker
-- reads its shard page by page (Ledger.record_columns), so no call carries
-- the whole shard's text and holds a pooled server connection that long; a
-- page is one range of the snapshot's shard index (shard_no, record_id
-- text_pattern_ops: record ids in byte order, bi.attach_snapshot_v2), read in
-- its order (~>=~, USING ~<~) and stopped at the limit: neither sorted nor
-- read again by the pages after it ('' is the least text, so the range starts
-- at the shard's first record when p_after is NULL, and p_after itself is
-- left out).
-- Every result and dead letter of a shard's record is written with the shard
-- row locked and counted in shards.stored / shards.dead, so a shard with
-- nothing stored (or nothing dead) skips that anti-join; the OR
-- short-circuits per row. A job with no attempts row at all (no failure, no
-- crash yet: nearly every read) skips the probe of bi.attempts per record:
-- the probe's gate (v_tried, a one-time filter in the generic plan as well)
-- sits inside the LATERAL subquery, which OFFSET 0 keeps from being pulled up
-- into a join filter tested after the probe. A shard with nothing stored or
-- dead in a job with no attempts row (a shard's first read, nearly every
-- read) is read by the range alone: no anti-join, no probe, attempts and
-- crashes 0 (about a quarter less of the read's server CPU a record than the
-- general query with its gates off). The queries read one snapshot (STABLE),
-- so neither the lease nor an attempt can change between them.
CREATE OR REPLACE FUNCTION bi.shard_records_v4(p_job text, p_shard integer, p_epoch bigint, p_after text,
                                              p_limit integer)
RETURNS TABLE (record_id text, text text, attempts integer, crashes integer)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_tried boolean;
    v_stored integer;
    v_dead integer;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    SELECT s.stored, s.dead INTO v_stored, v_dead
      FROM bi.shards s WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch);
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_tried := EXISTS (SELECT 1 FROM bi.attempts a WHERE a.job_version = p_job);
    IF NOT v_tried AND v_stored = 0 AND v_dead = 0 THEN
        RETURN QUERY
        SELECT sr.record_id, sr.text, 0, 0
          FROM bi.snapshot_rows sr
         WHERE sr.job_version = p_job AND sr.shard_no = p_shard
           AND sr.record_id ~>=~ coalesce(p_after, '') AND (p_after IS NULL OR sr.record_id <> p_after)
         ORDER BY sr.record_id USING ~<~
         LIMIT p_limit;
        RETURN;
    END IF;
    RETURN QUERY
    SELECT sr.record_id, sr.text, coalesce(a.attempts, 0), coalesce(a.crashes, 0)
      FROM bi.snapshot_rows sr
      LEFT JOIN LATERAL (SELECT x.attempts, x.crashes FROM bi.attempts x
                          WHERE v_tried AND x.job_version = sr.job_version AND x.record_id = sr.record_id
                         OFFSET 0) a ON true
     WHERE sr.job_version = p_job AND sr.shard_no = p_shard
       AND sr.record_id ~>=~ coalesce(p_after, '') AND (p_after IS NULL OR sr.record_id <> p_after)
       AND (v_stored = 0 OR NOT EXISTS (SELECT 1 FROM bi.results r
                                         WHERE r.job_version = sr.job_version AND r.record_id = sr.record_id))
       AND (v_dead = 0 OR NOT EXISTS (SELECT 1 FROM bi.dead_letters d
                                       WHERE d.job_version = sr.job_version AND d.record_id = sr.record_id))
     ORDER BY sr.record_id USING ~<~
     LIMIT p_limit;
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
-- p_engine and p_endpoint (the engine that made every output of the call,
-- and its endpoint class) go on each row. n is the number of new rows.
--
-- The snapshot side (the shard check, and the ACL and content hash every
-- result carries) is one scan of the primary key with all of the call's ids
-- (record_id = ANY: one descent, then the leaf pages in key order), hash-joined
-- to the call's arrays; the shard test is a filter (IS NOT DISTINCT FROM, which
-- no index serves), so the shard index, which holds the whole shard, is never
-- the scan. enable_nestloop and enable_seqscan are off for this function: a
-- nested loop would scan the snapshot again per result, a sequential scan
-- would read the whole job, whatever the estimates say. The plan is the
-- generic one (plan_cache_mode), made once per connection rather than at
-- every call.
CREATE OR REPLACE FUNCTION bi.put_results_v3(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                            p_transport text, p_engine text, p_endpoint text, p_ids text[],
                                            p_outputs jsonb[], p_categories text[],
                                            OUT stale boolean, OUT n integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET enable_nestloop = off
    SET enable_seqscan = off SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_dead bigint;
    v_model text;
    v_digest text;
    v_prompt text;
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
    SELECT j.model_name, j.model_digest, j.prompt_version INTO v_model, v_digest, v_prompt
      FROM bi.jobs j WHERE j.job_version = p_job;
    -- The stored rows, and their categories counted into the shard's category stripe.
    WITH stored AS (
        INSERT INTO bi.results (job_version, record_id, output, category, model_name, model_digest,
                                prompt_version, transport, engine, endpoint, worker_id, epoch, acl, content_hash)
        SELECT p_job, u.id, u.output, u.category, v_model, v_digest, v_prompt,
               p_transport, p_engine, p_endpoint, p_worker, p_epoch, sr.acl, sr.content_hash
          FROM unnest(p_ids, p_outputs, p_categories) AS u(id, output, category)
          JOIN bi.snapshot_rows sr ON sr.record_id = u.id
         WHERE sr.job_version = p_job AND sr.record_id = ANY (p_ids) AND sr.shard_no IS NOT DISTINCT FROM p_shard
           AND (v_dead = 0 OR NOT EXISTS (SELECT 1 FROM bi.dead_letters d
                                           WHERE d.job_version = p_job AND d.record_id = u.id))
        ON CONFLICT (job_version, record_id) DO NOTHING
        RETURNING category
    ), counted AS (
        INSERT INTO bi.category_stripes AS t (job_version, stripe, category, n)
        SELECT p_job, p_shard % bi.category_stripe_count_v1(), c.category, count(*)
          FROM stored c GROUP BY c.category ORDER BY c.category
        ON CONFLICT ON CONSTRAINT category_stripes_key DO UPDATE SET n = t.n + excluded.n
    )
    SELECT count(*) INTO n FROM stored;
    UPDATE bi.shards s
       SET stored = s.stored + n,
           stored_fallback = s.stored_fallback + CASE WHEN p_transport = 'fallback' THEN n ELSE 0 END,
           stored_hosted = s.stored_hosted + CASE WHEN p_transport = 'hosted_batch' THEN n ELSE 0 END
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

-- The cutoff fired: batch workers stop claiming and drain; the fallback pool claims.
CREATE OR REPLACE FUNCTION bi.enter_fallback_v1(p_job text) RETURNS boolean
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    UPDATE bi.jobs SET mode = 'fallback', fallback_at = coalesce(fallback_at, clock_timestamp())
     WHERE job_version = p_job AND status = 'running'
    RETURNING true;
$$;

-- A job's workers stop the whole run: record why on the job (bi.jobs.halted_at) and say so on
-- channel bi_halt.
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

-- What a worker needs to run a job: its pinned spec, as the JSON text the
-- submitter wrote (psycopg decodes json in document order). Nothing else of
-- the job.
CREATE OR REPLACE FUNCTION bi.job_spec_v2(p_job text)
RETURNS TABLE (spec json, mode text, status text)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY
    SELECT coalesce(j.spec_text, j.spec::text)::json, j.mode, j.status
      FROM bi.jobs j WHERE j.job_version = p_job;
END $$;

-- Re-drives: an operator put chosen dead letters of a version back to pending
-- after fixing their cause (bi.redrive_dead_letters_v1), with who, when, why,
-- the filters and how many. Never automatic (I4): only the command writes one.
CREATE TABLE IF NOT EXISTS bi.redrives (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    actor       text NOT NULL,
    reason      text NOT NULL,
    stage       text,               -- the stage filter; NULL: every stage
    reason_like text,               -- the dead letters' reason contained this (any case); NULL: any reason
    records     bigint NOT NULL,    -- dead letters put back to pending
    shards      integer NOT NULL,   -- shards put back to pending
    left_out    bigint NOT NULL,    -- matched but never leased (refused at snapshot or planning): left dead
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS redrives_job ON bi.redrives (job_version, id);

-- Re-drive chosen dead letters of a version: each matching dead letter of a
-- leased record (a shard of the snapshot) is deleted with its attempts and
-- crashes (a fresh budget of max_attempts), its shard goes back to pending
-- (its dead counter down, done_at cleared) and the version back to running
-- (its validation report cleared: validate again), all in this statement's
-- transaction, recorded in bi.redrives. Dead letters refused at the snapshot
-- or at planning never reach a worker (their input is refused): they stay and
-- are counted as left out. Guards, each one line: who and why given; the
-- version exists, is not published (its readers see it: submit a new version)
-- nor dropped; something matches; no matching shard is leased now (re-drive
-- once its workers have stopped). The version's row is locked FOR UPDATE
-- first, as bi.publish_v1 locks it: a re-drive and a publish never interleave.
-- Owner only.
CREATE OR REPLACE FUNCTION bi.redrive_dead_letters_v1(p_job text, p_actor text, p_reason text,
                                                     p_stage text DEFAULT NULL, p_reason_like text DEFAULT NULL)
RETURNS TABLE (id bigint, job_version text, records bigint, shards integer, left_out bigint, at timestamptz)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_status text;
    v_ids text[];
    v_shard_nos integer[];
    v_left bigint;
    v_shards integer;
    v_leased integer;
BEGIN
    IF nullif(btrim(p_actor), '') IS NULL OR nullif(btrim(p_reason), '') IS NULL THEN
        RAISE EXCEPTION 'a re-drive needs who and why (--reason)' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT j.status INTO v_status FROM bi.jobs j WHERE j.job_version = p_job FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no job version %', p_job USING ERRCODE = 'no_data_found';
    END IF;
    IF v_status IN ('published', 'dropped') THEN
        RAISE EXCEPTION 'job version % is %: its dead letters are not re-driven (submit a new version)', p_job,
            v_status USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    SELECT coalesce(array_agg(d.record_id) FILTER (WHERE sr.shard_no IS NOT NULL), '{}'),
           coalesce(array_agg(sr.shard_no) FILTER (WHERE sr.shard_no IS NOT NULL), '{}'),
           count(*) FILTER (WHERE sr.shard_no IS NULL)
      INTO v_ids, v_shard_nos, v_left
      FROM bi.dead_letters d
      LEFT JOIN bi.snapshot_rows sr ON sr.job_version = d.job_version AND sr.record_id = d.record_id
     WHERE d.job_version = p_job AND (p_stage IS NULL OR d.stage = p_stage)
       AND (p_reason_like IS NULL OR strpos(lower(d.reason), lower(p_reason_like)) > 0);
    IF cardinality(v_ids) = 0 THEN
        RAISE EXCEPTION '%', format('job version %s: no dead letter to re-drive matches%s', p_job,
            CASE WHEN v_left > 0 THEN format(' (%s matching were refused before any worker: their input is refused)',
                                             v_left) ELSE '' END)
            USING ERRCODE = 'no_data_found';
    END IF;
    SELECT min(s.shard_no) INTO v_leased FROM bi.shards s
     WHERE s.job_version = p_job AND s.state = 'leased' AND s.shard_no = ANY (v_shard_nos);
    IF v_leased IS NOT NULL THEN
        RAISE EXCEPTION 'job version %: shard % is leased; re-drive once its workers have stopped', p_job, v_leased
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    DELETE FROM bi.dead_letters d WHERE d.job_version = p_job AND d.record_id = ANY (v_ids);
    DELETE FROM bi.attempts a WHERE a.job_version = p_job AND a.record_id = ANY (v_ids);
    UPDATE bi.shards s
       SET dead = s.dead - c.n, state = 'pending', done_at = NULL
      FROM (SELECT u.shard_no, count(*) AS n FROM unnest(v_shard_nos) AS u (shard_no) GROUP BY 1) c
     WHERE s.job_version = p_job AND s.shard_no = c.shard_no;
    GET DIAGNOSTICS v_shards = ROW_COUNT;
    UPDATE bi.jobs j SET status = 'running', validation = NULL WHERE j.job_version = p_job;
    RETURN QUERY
    INSERT INTO bi.redrives AS r (job_version, actor, reason, stage, reason_like, records, shards, left_out)
    VALUES (p_job, p_actor, btrim(p_reason), p_stage, p_reason_like, cardinality(v_ids), v_shards, v_left)
    RETURNING r.id, r.job_version, r.records, r.shards, r.left_out, r.at;
END $$;
