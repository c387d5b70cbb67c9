-- 0001_initial: the squash of sql/schema/ (core.sql, ledger.sql, publish.sql,
-- roles.sql, concatenated in that order) as the schema stood when the
-- migrations were first squashed. Never edited: a change to the ledger is a
-- new numbered migration here plus the matching edit in sql/schema/, and
-- tests/test_schema.py checks that the two build the same database.

-- ==== sql/schema/core.sql ====

-- core: the schemas, the two group roles and the bookkeeping tables.
--
-- sql/schema/ is the current definition of the ledger, one file per area,
-- applied in name order: core, ledger (the state transitions), publish (the
-- published views, publish and rollback, readers' row-level security), roles
-- (who may call what). sql/migrations/ holds the numbered steps that build
-- the same database from an empty one; tests/test_schema.py compares the two.
--
-- Everything lives in schema bi. Per-record tables (snapshot rows, results,
-- dead letters, attempts) are LIST-partitioned by job_version, so a whole job
-- version is dropped with DROP TABLE on its partitions, never a row-by-row DELETE.

CREATE SCHEMA IF NOT EXISTS bi;

-- Downstream reads published.<dataset> (publish.sql). Only bi_reader may look
-- inside; PUBLIC gets nothing.
CREATE SCHEMA IF NOT EXISTS published;
REVOKE ALL ON SCHEMA published FROM PUBLIC;

-- The group roles (NOLOGIN; grant them to login roles): bi_reader reads
-- published results (publish.sql), bi_worker runs shards (roles.sql). Roles
-- are cluster-wide, so several databases migrating at once may race here.
DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['bi_reader', 'bi_worker'] LOOP
        BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            END IF;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;  -- another database's migration created it first
        END;
    END LOOP;
END $$;

CREATE TABLE IF NOT EXISTS bi.jobs (
    job_version      text PRIMARY KEY,
    dataset          text NOT NULL,
    spec_hash        text NOT NULL,
    snapshot_id      text NOT NULL,
    spec             jsonb NOT NULL,           -- for queries (spec->>'dataset', containment)
    model_name       text NOT NULL,
    model_digest     text NOT NULL,
    prompt_version   text NOT NULL,
    -- batch: workers claim; fallback: the cutoff fired, only the fallback pool claims
    mode             text NOT NULL DEFAULT 'batch' CHECK (mode IN ('batch', 'fallback')),
    status           text NOT NULL DEFAULT 'running'
                     CHECK (status IN ('running', 'validated', 'failed_validation', 'published', 'dropped')),
    records          bigint NOT NULL,           -- snapshot size, fixed at submit
    planned_dead     bigint NOT NULL DEFAULT 0, -- dead-lettered at planning (never leased)
    reused           bigint NOT NULL DEFAULT 0, -- results carried over from an earlier version of the same spec
    base_job_version text,                      -- the version results were reused from (incremental runs)
    shards           integer NOT NULL DEFAULT 0,
    validation       jsonb,
    submitted_by     text NOT NULL DEFAULT current_user,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    fallback_at      timestamptz,
    -- The spec as the submitter wrote it, key order included: jsonb reorders
    -- object keys, and structured decoding writes properties in the output
    -- schema's order. The worker reads this (bi.job_spec_v2); NULL falls back
    -- to spec.
    spec_text        text,
    -- A worker that cannot work at all (weights that do not match the pinned
    -- digest, an engine that cannot be configured), or the operator for every
    -- fatal worker exit, records why (bi.halt_job_v1). The cutoff watch reads
    -- it at each poll and fails the run. Never cleared: a watch ignores halts
    -- from before its DAG run was (re)queued.
    halted_at        timestamptz,
    halt_reason      text,
    CONSTRAINT jobs_spec_text_matches CHECK (spec_text IS NULL OR spec_text::jsonb = spec)
);
CREATE INDEX IF NOT EXISTS jobs_dataset_spec ON bi.jobs (dataset, spec_hash, created_at DESC);

-- The immutable input: copied from the source at submit, never updated.
CREATE TABLE IF NOT EXISTS bi.snapshot_rows (
    job_version  text NOT NULL,
    record_id    text NOT NULL,
    shard_no     integer,        -- NULL: never leased (dead-lettered at planning or reused)
    text         text NOT NULL,
    acl          text[],
    content_hash text NOT NULL,
    reject       text,           -- why the record never reaches a worker (it is dead-lettered), else NULL
    PRIMARY KEY (job_version, record_id)
) PARTITION BY LIST (job_version);
CREATE INDEX IF NOT EXISTS snapshot_rows_shard ON bi.snapshot_rows (job_version, shard_no);

-- The shard table: leases, fencing epochs and live counts (the cutoff reads
-- these, never COUNT(*) over results).
CREATE TABLE IF NOT EXISTS bi.shards (
    job_version      text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    shard_no         integer NOT NULL,
    state            text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'leased', 'done')),
    epoch            bigint NOT NULL DEFAULT 0,  -- +1 on every claim; never reset
    lease_owner      text,
    lease_transport  text,
    lease_expires_at timestamptz,
    claims           integer NOT NULL DEFAULT 0,
    records          integer NOT NULL,
    stored           integer NOT NULL DEFAULT 0,  -- results written under this shard (any transport)
    stored_fallback  integer NOT NULL DEFAULT 0,  -- of which by the synchronous fallback pool
    dead             integer NOT NULL DEFAULT 0,
    first_claim_at   timestamptz,
    done_at          timestamptz,
    lost_leases      integer NOT NULL DEFAULT 0,  -- epochs that ended without release or completion
    in_flight        text[],                      -- the current epoch's last marked engine batch
    batch_lease_ended_at timestamptz,             -- when a batch worker last stopped holding it
    PRIMARY KEY (job_version, shard_no)
);
CREATE INDEX IF NOT EXISTS shards_claimable ON bi.shards (job_version, shard_no) WHERE state <> 'done';

-- Stamp the end of a batch lease: the row was leased by a batch worker and is
-- now not (released, completed, abandoned, swept, taken over after expiry, or
-- claimed by the fallback pool). A fallback run's drain time is measured from
-- these stamps.
CREATE OR REPLACE FUNCTION bi.stamp_batch_lease_end_v1() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.batch_lease_ended_at := clock_timestamp();
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS shards_batch_lease_end ON bi.shards;
CREATE TRIGGER shards_batch_lease_end BEFORE UPDATE OF state, lease_transport ON bi.shards
    FOR EACH ROW
    WHEN (OLD.state = 'leased' AND OLD.lease_transport = 'batch'
          AND (NEW.state <> 'leased' OR NEW.lease_transport IS DISTINCT FROM 'batch'))
    EXECUTE FUNCTION bi.stamp_batch_lease_end_v1();

CREATE TABLE IF NOT EXISTS bi.results (
    job_version    text NOT NULL,
    record_id      text NOT NULL,
    output         jsonb NOT NULL,
    category       text,
    model_name     text NOT NULL,
    model_digest   text NOT NULL,
    prompt_version text NOT NULL,
    transport      text NOT NULL CHECK (transport IN ('batch', 'fallback', 'reused')),
    worker_id      text,
    epoch          bigint,
    acl            text[],
    content_hash   text,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_version, record_id)
) PARTITION BY LIST (job_version);

CREATE TABLE IF NOT EXISTS bi.dead_letters (
    job_version    text NOT NULL,
    record_id      text NOT NULL,
    reason         text NOT NULL,   -- short, readable: why the record never produced a result
    error          text,            -- the last error in full
    raw_output     text,            -- the last raw model output, if any
    attempts       integer NOT NULL,
    stage          text NOT NULL CHECK (stage IN ('snapshot', 'plan', 'worker')),
    model_name     text NOT NULL,
    model_digest   text NOT NULL,
    prompt_version text NOT NULL,
    transport      text CHECK (transport IN ('batch', 'fallback')),
    acl            text[],
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_version, record_id)
) PARTITION BY LIST (job_version);

-- Failed attempts and crashes per record; survives leases so a poison record
-- ends in dead letters after max_attempts whichever worker sees it. The two
-- are separate budgets (ledger.sql, bi.record_deaths_v1).
CREATE TABLE IF NOT EXISTS bi.attempts (
    job_version text NOT NULL,
    record_id   text NOT NULL,
    attempts    integer NOT NULL,
    last_error  text,
    last_output text,
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    crashes     integer NOT NULL DEFAULT 0,   -- deaths of the worker with the record in flight
    PRIMARY KEY (job_version, record_id)
) PARTITION BY LIST (job_version);

-- Every refused write from a stale epoch, for the chaos figures and on-call.
CREATE TABLE IF NOT EXISTS bi.fence_events (
    id          bigserial PRIMARY KEY,
    job_version text NOT NULL,
    shard_no    integer NOT NULL,
    op          text NOT NULL,
    presented   bigint NOT NULL,
    current     bigint,
    worker_id   text,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS fence_events_job ON bi.fence_events (job_version);

-- Progress samples for the burn-down chart and the moving cutoff history.
CREATE TABLE IF NOT EXISTS bi.progress (
    job_version       text NOT NULL,
    at                timestamptz NOT NULL DEFAULT clock_timestamp(),
    stored            bigint NOT NULL,
    dead_letters      bigint NOT NULL,
    outstanding       bigint NOT NULL,
    latest_safe_start timestamptz,
    deadline          timestamptz,
    PRIMARY KEY (job_version, at)
);

-- Measured fallback runs: the cutoff derives its rate and overhead from these,
-- and relaxes its constants only on runs that measured every part of the
-- overhead (docs/deadlines.md, "Constants that go stale"). NULL: not measured.
-- A run's whole overhead is overhead_s + load_s.
CREATE TABLE IF NOT EXISTS bi.fallback_runs (
    id          bigserial PRIMARY KEY,
    job_version text NOT NULL,
    dataset     text NOT NULL,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    records     bigint NOT NULL,
    rate        double precision NOT NULL,   -- sustained records/s
    overhead_s  double precision NOT NULL,   -- wall time of the pool minus busy_s
    -- from the cutoff firing (jobs.fallback_at) to the last batch lease's end
    -- (shards.batch_lease_ended_at), 0 when every batch lease had ended before
    drain_s     double precision,
    busy_s      double precision,            -- the re-drive: time at least one pool worker held a shard
    load_s      double precision             -- nothing outstanding -> the published pointer switch
);

-- The publish pointer: one row per dataset naming the version downstream reads
-- (the published view joins to it). Switching is one UPDATE of this row.
CREATE TABLE IF NOT EXISTS bi.publish_pointer (
    dataset     text PRIMARY KEY,
    job_version text NOT NULL REFERENCES bi.jobs (job_version),
    switched_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    switched_by text NOT NULL DEFAULT current_user
);

CREATE TABLE IF NOT EXISTS bi.publish_history (
    id           bigserial PRIMARY KEY,
    dataset      text NOT NULL,
    from_version text,
    to_version   text,
    action       text NOT NULL CHECK (action IN ('publish', 'rollback')),
    forced       boolean NOT NULL DEFAULT false,
    reason       text,
    actor        text NOT NULL,
    at           timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS publish_history_dataset ON bi.publish_history (dataset, id DESC);

-- Which job version each Airflow DAG run worked on. SubmitJobOperator writes
-- one row per DAG run after its submit, whether the submit created the
-- version or found it already there. The on-call callbacks read it: the
-- DAG-level Deadline Alert runs in the triggerer with only the DAG run's ids.
CREATE TABLE IF NOT EXISTS bi.job_runs (
    dag_id      text NOT NULL,
    run_id      text NOT NULL,
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    created     boolean NOT NULL,   -- this run's submit created the version (false: it resumed an existing one)
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (dag_id, run_id)
);
CREATE INDEX IF NOT EXISTS job_runs_job ON bi.job_runs (job_version);

-- ==== sql/schema/ledger.sql ====

-- ledger: every state transition of the shard ledger as one SQL function.
--
-- The guard of each transition (state, lease epoch) sits in the statement that
-- changes state, never in a read-then-write in Python. The lease guard is
-- written once, bi.holds_lease_v1, which the planner inlines into each of those
-- statements. A write from a stale epoch is refused and recorded in
-- bi.fence_events. Worker-facing functions are SECURITY DEFINER with a pinned
-- search_path so the worker role needs EXECUTE only, and each checks first
-- that the authenticated role may work on the job version
-- (bi.assert_may_work_on_v1, roles.sql). Names carry a version suffix: a
-- change of signature adds _v2 beside _v1, so a worker that is still running
-- keeps working.

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

-- Records that kill the worker (an OOM kill, a segfault or an abort in the
-- engine) are dead-lettered too (I4). A shard whose lease ended without a
-- release or a completion (taken over after it expired, swept, or abandoned)
-- counts a lost lease; its next holders run it carefully: the worker marks
-- each engine batch in flight before generating it (bi.mark_in_flight_v1),
-- and when such an epoch ends without a release, every record of its last
-- marked batch left without an outcome gets one more crash. At the job's
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

-- Claim one shard: a pending one, or one whose lease expired (no sweeper
-- needed for progress). The epoch goes up by one on every claim and never
-- resets. Batch workers are refused once the job is in fallback mode. Taking
-- over an expired lease counts a lost lease and the deaths of the last batch
-- the expired epoch marked in flight; the caller learns lost_leases (> 0: run
-- this shard carefully).
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
    PERFORM bi.assert_may_work_on_v1(p_job);
    SELECT j.mode INTO v_mode FROM bi.jobs j WHERE j.job_version = p_job;
    UPDATE bi.shards s
       SET lease_expires_at = clock_timestamp() + make_interval(secs =>
               coalesce(p_lease_seconds, (SELECT (j.spec ->> 'lease_seconds')::integer
                                          FROM bi.jobs j WHERE j.job_version = p_job)))
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
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
    PERFORM bi.assert_may_work_on_v1(p_job);
    UPDATE bi.shards s
       SET state = 'pending', lease_owner = NULL, lease_transport = NULL, lease_expires_at = NULL
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch);
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
    PERFORM bi.assert_may_work_on_v1(p_job);
    UPDATE bi.shards s
       SET state = 'done', lease_owner = NULL, lease_expires_at = NULL, done_at = clock_timestamp()
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
       AND s.stored + s.dead >= s.records;
    IF FOUND THEN
        RETURN 'done';
    END IF;
    -- Not a guard, only the reason for the refusal.
    IF EXISTS (SELECT 1 FROM bi.shards s WHERE s.job_version = p_job AND s.shard_no = p_shard
                                          AND bi.holds_lease_v1(s, p_epoch)) THEN
        RETURN 'incomplete';
    END IF;
    PERFORM bi.record_fence_v1(p_job, p_shard, 'complete', p_epoch, p_worker);
    RETURN 'stale';
END $$;

-- The records of a leased shard still to do, with each one's failed attempts
-- and crashes (> 0: a suspect, run it alone), readable only by the current
-- epoch's holder: a worker never reads rows of a shard it does not hold.
-- Every result and dead letter of a shard's record is written with the shard
-- row locked and counted in shards.stored / shards.dead, so a shard with
-- nothing stored (or nothing dead) skips that anti-join; the OR
-- short-circuits per row.
CREATE OR REPLACE FUNCTION bi.shard_records_v2(p_job text, p_shard integer, p_epoch bigint)
RETURNS TABLE (record_id text, text text, attempts integer, crashes integer)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY
    SELECT sr.record_id, sr.text, coalesce(a.attempts, 0), coalesce(a.crashes, 0)
      FROM bi.shards s
      JOIN bi.snapshot_rows sr ON sr.job_version = s.job_version AND sr.shard_no = s.shard_no
      LEFT JOIN bi.attempts a ON a.job_version = sr.job_version AND a.record_id = sr.record_id
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
       AND (s.stored = 0 OR NOT EXISTS (SELECT 1 FROM bi.results r
                                         WHERE r.job_version = sr.job_version AND r.record_id = sr.record_id))
       AND (s.dead = 0 OR NOT EXISTS (SELECT 1 FROM bi.dead_letters d
                                       WHERE d.job_version = sr.job_version AND d.record_id = sr.record_id))
     ORDER BY sr.record_id;
END $$;

-- Careful mode: the ids of the engine batch about to be generated. One
-- statement per batch; the current epoch only. false (and a fence event)
-- when the epoch is stale.
CREATE OR REPLACE FUNCTION bi.mark_in_flight_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                               p_ids text[])
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    UPDATE bi.shards s
       SET in_flight = p_ids
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch);
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'mark_in_flight', p_epoch, p_worker);
        RETURN false;
    END IF;
    RETURN true;
END $$;

-- The engine broke mid-shard (an exception, not a death): give the shard back
-- at once like a release, but count it as a lost lease with the deaths of its
-- in-flight batch, so an engine that fails on one record cannot loop either.
CREATE OR REPLACE FUNCTION bi.abandon_shard_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text)
RETURNS boolean
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

-- Put-if-absent results for one shard under the current epoch. The shard row
-- is locked first, so a concurrent claim (which bumps the epoch) waits for
-- this batch to commit, and a batch from a stale epoch writes nothing. While
-- the lock is held no record of the shard can be dead-lettered, so with the
-- shard's dead counter at 0 the per-record dead-letter probe is skipped.
-- Returns the number of new rows, or -1 when the epoch is stale.
CREATE OR REPLACE FUNCTION bi.put_results_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                            p_transport text, p_ids text[], p_outputs jsonb[], p_categories text[])
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
    v_dead bigint;
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    SELECT s.dead INTO v_dead FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
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
       AND (v_dead = 0 OR NOT EXISTS (SELECT 1 FROM bi.dead_letters d
                                       WHERE d.job_version = p_job AND d.record_id = u.id))
    ON CONFLICT (job_version, record_id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    UPDATE bi.shards s
       SET stored = s.stored + n,
           stored_fallback = s.stored_fallback + CASE WHEN p_transport = 'fallback' THEN n ELSE 0 END
     WHERE s.job_version = p_job AND s.shard_no = p_shard;
    RETURN n;
END $$;

-- Count one failed attempt per record; at the job's max_attempts the record
-- goes to dead letters with its last error and raw output (I4).
-- p_attempt_nos[i] is the attempt number the caller is recording for
-- p_ids[i]: a record whose count already reached it (the same call, retried
-- after its reply was lost) is not counted again; NULL counts
-- unconditionally. Returns, for every given record of the shard without a
-- result, its count and whether it is dead-lettered; a stale epoch returns
-- the single row (NULL, -1, false). Records that got an outcome leave the
-- shard's in-flight batch.
CREATE OR REPLACE FUNCTION bi.fail_records_v2(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                             p_transport text, p_ids text[], p_errors text[], p_outputs text[],
                                             p_attempt_nos integer[])
RETURNS TABLE (record_id text, attempts integer, dead boolean)
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

-- The cutoff fired: batch workers stop claiming and drain; the fallback pool claims.
CREATE OR REPLACE FUNCTION bi.enter_fallback_v1(p_job text) RETURNS boolean
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    UPDATE bi.jobs SET mode = 'fallback', fallback_at = coalesce(fallback_at, clock_timestamp())
     WHERE job_version = p_job AND status = 'running'
    RETURNING true;
$$;

-- A job's workers stop the whole run: record why on the job (bi.jobs.halted_at).
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

-- Live counts from the shard table alone: cost independent of the number of records.
CREATE OR REPLACE FUNCTION bi.job_counts_v1(p_job text)
RETURNS TABLE (records bigint, stored bigint, stored_batch bigint, stored_fallback bigint, reused bigint,
               dead_letters bigint, outstanding bigint, shards_pending bigint, shards_leased bigint,
               shards_done bigint, mode text, status text, first_claim_at timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY
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
END $$;

-- ==== sql/schema/publish.sql ====

-- publish: validation results, the published views, publish and rollback,
-- and row-level access control for readers.
--
-- Downstream reads one stable view per dataset, published.<dataset>, which
-- joins bi.results to the dataset's row in bi.publish_pointer. Publishing or
-- rolling back is one UPDATE of that row: readers never wait on a lock and a
-- statement sees exactly one version (one snapshot reads both the pointer and
-- the rows). The view itself is created once, at the first publish; no DDL
-- runs on the switch.
--
-- State changes are SQL functions with the guard in the statement. Unlike the
-- ledger functions they are SECURITY INVOKER: the caller must own the tables
-- (the admin or migrating role), so a reader or a worker that can EXECUTE
-- them still cannot publish. That also keeps current_user as the default
-- actor. Nobody but the owner may execute them (roles.sql closes schema bi to
-- PUBLIC).

-- One row per published view (created at the dataset's first publish).
CREATE TABLE IF NOT EXISTS bi.published_views (
    dataset     text PRIMARY KEY,
    view_name   text NOT NULL,          -- qualified and quoted, e.g. published.tickets_triage
    fields      jsonb NOT NULL,         -- output fields exposed as columns: {"name": "text" | "jsonb"}
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    created_by  text NOT NULL DEFAULT current_user
);

-- Principal mapping. A reader's principals are its own role name, the names of
-- the roles whose privileges it has (pg_has_role USAGE: inherited membership),
-- and every principal mapped here to any of those roles. A source's ACL
-- entries rarely are PostgreSQL role names ('team:billing', an LDAP group), so
-- this table says which database role stands for which ACL entry.
CREATE TABLE IF NOT EXISTS bi.reader_principals (
    role      text NOT NULL,   -- a database role: a reader or a group readers belong to
    principal text NOT NULL,   -- an ACL entry as the source writes it
    PRIMARY KEY (role, principal)
);

-- What a record without an ACL (acl IS NULL) means, per dataset. Absent row:
-- 'all_readers', i.e. every member of bi_reader sees it. An empty ACL ('{}')
-- overlaps nothing and is visible to no reader, whatever this says.
CREATE TABLE IF NOT EXISTS bi.dataset_acl (
    dataset  text PRIMARY KEY,
    null_acl text NOT NULL DEFAULT 'all_readers' CHECK (null_acl IN ('all_readers', 'nobody'))
);

-- SECURITY INVOKER on purpose: current_user must be the reader, not the owner.
-- Called once per statement from the policy (as an uncorrelated sub-select,
-- so it is an InitPlan, not a per-row call).
CREATE OR REPLACE FUNCTION bi.current_principals() RETURNS text[]
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    WITH held AS (
        SELECT r.rolname::text AS name FROM pg_roles r
         WHERE pg_has_role(current_user, r.oid, 'USAGE')
    )
    SELECT coalesce(array_agg(DISTINCT p), '{}') FROM (
        SELECT name AS p FROM held
        UNION ALL
        SELECT m.principal FROM bi.reader_principals m JOIN held ON held.name = m.role
    ) t;
$$;

-- Row-level security on results. The owner (the migrating role) and
-- superusers bypass it, and so do the ledger's SECURITY DEFINER functions,
-- which run as their owner: workers keep writing. Any other role sees no row
-- unless a policy admits it, and only bi_reader has a policy: a reader sees a
-- row only if its version is published somewhere (never a half-finished or
-- superseded version, even reading bi.results directly) and its ACL overlaps
-- the reader's principals, or it has no ACL and the dataset's null_acl says so.
ALTER TABLE bi.results ENABLE ROW LEVEL SECURITY;

DROP POLICY IF EXISTS results_published_acl ON bi.results;
CREATE POLICY results_published_acl ON bi.results FOR SELECT TO bi_reader
USING (
    CASE WHEN acl IS NULL
         THEN job_version IN (SELECT p.job_version FROM bi.publish_pointer p
                                LEFT JOIN bi.dataset_acl a ON a.dataset = p.dataset
                               WHERE coalesce(a.null_acl, 'all_readers') = 'all_readers')
         ELSE job_version IN (SELECT p.job_version FROM bi.publish_pointer p)
              AND acl && (SELECT bi.current_principals())
    END
);

-- The mapping is readable by readers (the policy runs as them), but each sees
-- only the rows of roles it holds.
ALTER TABLE bi.reader_principals ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS reader_principals_own ON bi.reader_principals;
CREATE POLICY reader_principals_own ON bi.reader_principals FOR SELECT TO bi_reader
USING (role IN (SELECT r.rolname FROM pg_roles r WHERE pg_has_role(current_user, r.oid, 'USAGE')));

-- Dead letters follow the results' ACL rule, except that a dead letter is
-- visible whether or not its version is published: it is what on-call reads
-- while the night runs. The dashboard reads them as the signed-in user's
-- reader role (bi.dashboard_readers, roles.sql).
ALTER TABLE bi.dead_letters ENABLE ROW LEVEL SECURITY;

-- The job versions whose records without an ACL every reader may see. SECURITY
-- DEFINER: the policy runs as the reader, who has no privilege on bi.jobs.
-- Called once per statement (an uncorrelated sub-select in the policy).
CREATE OR REPLACE FUNCTION bi.null_acl_readable_jobs_v1() RETURNS text[]
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(array_agg(j.job_version), '{}')
      FROM bi.jobs j
      LEFT JOIN bi.dataset_acl a ON a.dataset = j.dataset
     WHERE coalesce(a.null_acl, 'all_readers') = 'all_readers';
$$;

DROP POLICY IF EXISTS dead_letters_acl ON bi.dead_letters;
CREATE POLICY dead_letters_acl ON bi.dead_letters FOR SELECT TO bi_reader
USING (
    CASE WHEN acl IS NULL
         THEN job_version = ANY ((SELECT bi.null_acl_readable_jobs_v1())::text[])
         ELSE acl && (SELECT bi.current_principals())
    END
);

-- The views are security_invoker, so the reader needs the base privileges;
-- RLS above narrows them to the rows it may see.
GRANT USAGE ON SCHEMA bi TO bi_reader;
GRANT USAGE ON SCHEMA published TO bi_reader;
GRANT SELECT ON bi.results, bi.dead_letters, bi.publish_pointer, bi.dataset_acl, bi.reader_principals,
    bi.published_views TO bi_reader;
GRANT EXECUTE ON FUNCTION bi.current_principals(), bi.null_acl_readable_jobs_v1() TO bi_reader;


-- Store a validation report. Guard: every shard done and the version not
-- dropped. A published version keeps its status (the pointer names it);
-- otherwise the status becomes validated or failed_validation. Returns the
-- status, or nothing when the guard refused.
CREATE OR REPLACE FUNCTION bi.record_validation_v1(p_job text, p_report jsonb, p_passed boolean)
RETURNS text
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    UPDATE bi.jobs j
       SET validation = p_report,
           status = CASE WHEN j.status = 'published' THEN j.status
                         WHEN p_passed THEN 'validated' ELSE 'failed_validation' END
     WHERE j.job_version = p_job
       AND j.status <> 'dropped'
       AND NOT EXISTS (SELECT 1 FROM bi.shards s WHERE s.job_version = p_job AND s.state <> 'done')
    RETURNING j.status;
$$;


-- The view of one dataset, created if absent. The column list is fixed here:
-- the output's top-level fields are taken from the first published version's
-- schema (strings as text, anything else as jsonb, so a later schema can
-- never make a cast fail at read time); every field stays in `output`.
CREATE OR REPLACE FUNCTION bi.ensure_published_view_v1(p_dataset text, p_text_fields text[] DEFAULT '{}',
                                                      p_json_fields text[] DEFAULT '{}')
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_name text := format('published.%I', p_dataset);
    fixed text[] := ARRAY['record_id', 'output', 'category', 'model_name', 'model_digest', 'prompt_version',
                          'transport', 'job_version', 'created_at', 'acl'];
    cols text := '';
    fields jsonb := '{}';
    f text;
BEGIN
    IF to_regclass(v_name) IS NOT NULL THEN
        RETURN v_name;
    END IF;
    FOREACH f IN ARRAY coalesce(p_text_fields, '{}') LOOP
        CONTINUE WHEN f = ANY (fixed) OR fields ? f OR length(f) > 63;
        cols := cols || format(', r.output ->> %L AS %I', f, f);
        fields := fields || jsonb_build_object(f, 'text');
    END LOOP;
    FOREACH f IN ARRAY coalesce(p_json_fields, '{}') LOOP
        CONTINUE WHEN f = ANY (fixed) OR fields ? f OR length(f) > 63;
        cols := cols || format(', r.output -> %L AS %I', f, f);
        fields := fields || jsonb_build_object(f, 'jsonb');
    END LOOP;
    BEGIN
        -- security_invoker: the policy on bi.results is checked against the
        -- reader, not the view's owner (who bypasses RLS).
        EXECUTE format(
            'CREATE VIEW published.%I WITH (security_invoker = true) AS '
            'SELECT r.record_id, r.output, r.category%s, r.model_name, r.model_digest, r.prompt_version, '
            'r.transport, r.job_version, r.created_at, r.acl '
            'FROM bi.results r '
            'WHERE r.job_version = (SELECT p.job_version FROM bi.publish_pointer p WHERE p.dataset = %L)',
            p_dataset, cols, p_dataset);
    EXCEPTION WHEN duplicate_table THEN
        RETURN v_name;  -- a concurrent first publish created it
    END;
    EXECUTE format('REVOKE ALL ON %s FROM PUBLIC', v_name);
    EXECUTE format('GRANT SELECT ON %s TO bi_reader', v_name);
    EXECUTE format('COMMENT ON VIEW %s IS %L', v_name,
                   format('Published results of dataset %s: the version named in bi.publish_pointer. '
                          'Rows are filtered by ACL for bi_reader members.', p_dataset));
    INSERT INTO bi.published_views (dataset, view_name, fields) VALUES (p_dataset, v_name, fields)
    ON CONFLICT (dataset) DO NOTHING;
    RETURN v_name;
END $$;


-- The status a version returns to when it stops being the published one: what
-- its last validation said (a forced publish of a failed or never-validated
-- version must not come back as 'validated').
CREATE OR REPLACE FUNCTION bi.unpublished_status_v1(p_validation jsonb) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN (p_validation ->> 'passed')::boolean IS TRUE THEN 'validated' ELSE 'failed_validation' END;
$$;


-- Publish: switch the dataset's pointer to p_job and record it, in one
-- transaction. Refused (SQLSTATE 55000, one line) when the version belongs to
-- another dataset, is dropped, still has shards to do, or is not validated and
-- not forced with a reason. Publishing the version already published is a
-- no-op (an Airflow retry must not write history twice).
CREATE OR REPLACE FUNCTION bi.publish_v1(p_dataset text, p_job text, p_actor text DEFAULT NULL,
                                        p_force boolean DEFAULT false, p_reason text DEFAULT NULL)
RETURNS TABLE (dataset text, from_version text, to_version text, action text, forced boolean,
               changed boolean, history_id bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    j record;
    v_from text;
    v_open bigint;
    v_id bigint;
    v_actor text := coalesce(nullif(btrim(p_actor), ''), current_user);
    v_reason text := nullif(btrim(p_reason), '');
BEGIN
    -- One publisher per dataset at a time, including the very first publish
    -- (no pointer row to lock yet).
    PERFORM pg_advisory_xact_lock(hashtextextended('bi.publish:' || p_dataset, 0));
    SELECT jb.job_version, jb.dataset, jb.status, jb.validation INTO j
      FROM bi.jobs jb WHERE jb.job_version = p_job FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no job version %', p_job USING ERRCODE = 'no_data_found';
    END IF;
    IF j.dataset <> p_dataset THEN
        RAISE EXCEPTION 'job version % belongs to dataset %, not %', p_job, j.dataset, p_dataset
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    SELECT p.job_version INTO v_from FROM bi.publish_pointer p WHERE p.dataset = p_dataset FOR UPDATE;
    IF v_from = p_job THEN
        RETURN QUERY SELECT p_dataset, v_from, p_job, 'publish'::text, false, false, NULL::bigint;
        RETURN;
    END IF;
    IF j.status = 'dropped' THEN
        RAISE EXCEPTION 'job version % was dropped and cannot be published', p_job
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    SELECT count(*) INTO v_open FROM bi.shards s WHERE s.job_version = p_job AND s.state <> 'done';
    IF v_open > 0 THEN
        -- Never forcible: it would publish half a job (I3).
        RAISE EXCEPTION 'job version % is not finished (% shard(s) not done); it cannot be published, even forced',
            p_job, v_open USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF j.status <> 'validated' AND NOT p_force THEN
        RAISE EXCEPTION 'job version % %: refused (publish --force --reason TEXT to override)',
            p_job, CASE j.status WHEN 'failed_validation' THEN 'failed validation'
                                 WHEN 'running' THEN 'has not been validated'
                                 ELSE 'is ' || j.status || ', not validated' END
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF p_force AND v_reason IS NULL THEN
        RAISE EXCEPTION 'a forced publish needs a reason' USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;

    INSERT INTO bi.publish_pointer AS pp (dataset, job_version, switched_at, switched_by)
    VALUES (p_dataset, p_job, clock_timestamp(), v_actor)
    ON CONFLICT ON CONSTRAINT publish_pointer_pkey DO UPDATE
       SET job_version = excluded.job_version, switched_at = excluded.switched_at,
           switched_by = excluded.switched_by;
    UPDATE bi.jobs jb SET status = 'published' WHERE jb.job_version = p_job;
    UPDATE bi.jobs jb SET status = bi.unpublished_status_v1(jb.validation)
     WHERE jb.job_version = v_from AND jb.status = 'published';
    INSERT INTO bi.publish_history (dataset, from_version, to_version, action, forced, reason, actor)
    VALUES (p_dataset, v_from, p_job, 'publish', p_force AND j.status <> 'validated', v_reason, v_actor)
    RETURNING id INTO v_id;
    RETURN QUERY SELECT p_dataset, v_from, p_job, 'publish'::text, p_force AND j.status <> 'validated', true, v_id;
END $$;


-- Rollback: switch the pointer back to the version the current one replaced
-- (from_version of the latest publish that made the current version live).
-- Repeated rollbacks walk back through the publishes, like an undo stack.
CREATE OR REPLACE FUNCTION bi.rollback_v1(p_dataset text, p_actor text DEFAULT NULL, p_reason text DEFAULT NULL)
RETURNS TABLE (dataset text, from_version text, to_version text, action text, forced boolean,
               changed boolean, history_id bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_cur text;
    v_to text;
    v_id bigint;
    v_actor text := coalesce(nullif(btrim(p_actor), ''), current_user);
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('bi.publish:' || p_dataset, 0));
    SELECT p.job_version INTO v_cur FROM bi.publish_pointer p WHERE p.dataset = p_dataset FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'dataset % has never been published; nothing to roll back', p_dataset
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    SELECT h.from_version INTO v_to FROM bi.publish_history h
     WHERE h.dataset = p_dataset AND h.action = 'publish' AND h.to_version = v_cur
     ORDER BY h.id DESC LIMIT 1;
    IF v_to IS NULL THEN
        RAISE EXCEPTION 'nothing to roll back to: % was the first version published for dataset %', v_cur, p_dataset
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM bi.jobs jb WHERE jb.job_version = v_to AND jb.status <> 'dropped') THEN
        RAISE EXCEPTION 'cannot roll back dataset % to %: that version was dropped', p_dataset, v_to
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    UPDATE bi.publish_pointer p SET job_version = v_to, switched_at = clock_timestamp(), switched_by = v_actor
     WHERE p.dataset = p_dataset;
    UPDATE bi.jobs jb SET status = 'published' WHERE jb.job_version = v_to;
    UPDATE bi.jobs jb SET status = bi.unpublished_status_v1(jb.validation)
     WHERE jb.job_version = v_cur AND jb.status = 'published';
    INSERT INTO bi.publish_history (dataset, from_version, to_version, action, forced, reason, actor)
    VALUES (p_dataset, v_cur, v_to, 'rollback', false, nullif(btrim(p_reason), ''), v_actor)
    RETURNING id INTO v_id;
    RETURN QUERY SELECT p_dataset, v_cur, v_to, 'rollback'::text, false, true, v_id;
END $$;


-- What a record without an ACL means for one dataset's readers.
CREATE OR REPLACE FUNCTION bi.set_null_acl_v1(p_dataset text, p_mode text) RETURNS text
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    INSERT INTO bi.dataset_acl (dataset, null_acl) VALUES (p_dataset, p_mode)
    ON CONFLICT (dataset) DO UPDATE SET null_acl = excluded.null_acl
    RETURNING null_acl;
$$;


-- Publish and roll back only from the version the caller saw. A person
-- deciding to roll back (the dashboard's button, `rollback --expect`) looked
-- at the dataset's pointer first; if another publish lands between that look
-- and the switch, an unguarded rollback would undo the newer publish instead
-- of the one they meant. The _v2 functions check under the dataset's publish
-- lock, then call the _v1 switch in the same transaction (advisory locks and
-- row locks are re-entrant for their holder), so the switch and its other
-- guards exist once. _v1 serves callers with no expectation (`rollback`
-- without --expect, Airflow). Refusal: SQLSTATE BI409 ("the pointer moved"),
-- one line naming the dataset, the version expected and the version actually
-- published; the DETAIL is the actual version alone, for programs.

-- Raise unless the dataset's pointer is at p_expected (NULL: nothing published
-- yet) or at p_or_at. Takes the publish lock and locks the pointer row until
-- the caller's transaction ends, so what it checked is what the caller then
-- switches.
CREATE OR REPLACE FUNCTION bi.assert_pointer_at_v1(p_dataset text, p_expected text, p_action text,
                                                   p_or_at text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_cur text;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('bi.publish:' || p_dataset, 0));
    SELECT p.job_version INTO v_cur FROM bi.publish_pointer p WHERE p.dataset = p_dataset FOR UPDATE;
    IF v_cur IS DISTINCT FROM p_expected AND v_cur IS DISTINCT FROM coalesce(p_or_at, p_expected) THEN
        RAISE EXCEPTION '% of dataset % refused: expected % to be published, but % is; nothing was changed',
            p_action, p_dataset, coalesce(p_expected, 'nothing'), coalesce(v_cur, 'nothing')
            USING ERRCODE = 'BI409', DETAIL = coalesce(v_cur, ''),
                  HINT = 'someone published or rolled back in between: look again and decide again';
    END IF;
END $$;


-- Rollback from p_expected_current: bi.rollback_v1's switch (to the version
-- the current one replaced, with its guards and history row), refused with
-- BI409 when the pointer is not at p_expected_current.
CREATE OR REPLACE FUNCTION bi.rollback_v2(p_dataset text, p_expected_current text, p_actor text DEFAULT NULL,
                                         p_reason text DEFAULT NULL)
RETURNS TABLE (dataset text, from_version text, to_version text, action text, forced boolean,
               changed boolean, history_id bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_pointer_at_v1(p_dataset, p_expected_current, 'rollback');
    RETURN QUERY SELECT * FROM bi.rollback_v1(p_dataset, p_actor, p_reason);
END $$;


-- Publish p_job in place of p_expected_current (NULL: the dataset's first
-- publish). bi.publish_v1's switch and guards; refused with BI409 when the
-- pointer is elsewhere. Already at p_job is the same no-op as in _v1 (a retry
-- of a publish that committed finds its own version, not the one it expected).
CREATE OR REPLACE FUNCTION bi.publish_v2(p_dataset text, p_job text, p_expected_current text,
                                        p_actor text DEFAULT NULL, p_force boolean DEFAULT false,
                                        p_reason text DEFAULT NULL)
RETURNS TABLE (dataset text, from_version text, to_version text, action text, forced boolean,
               changed boolean, history_id bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_pointer_at_v1(p_dataset, p_expected_current, 'publish of ' || p_job, p_job);
    RETURN QUERY SELECT * FROM bi.publish_v1(p_dataset, p_job, p_actor, p_force, p_reason);
END $$;

-- ==== sql/schema/roles.sql ====

-- roles: least privilege. Who may call what.
--
-- Three kinds of credentials touch this schema:
--
-- * the owner (the role that ran the migrations: Airflow, the CLI, on-call)
--   submits, validates, publishes and reads everything;
-- * a worker logs in as a role that is a member of the NOLOGIN group role
--   bi_worker. It may EXECUTE the ledger functions the worker process calls and
--   nothing else: no table, view or sequence in schema bi, no publish, no
--   drop. Those functions are SECURITY DEFINER (ledger.sql), so they read and
--   write the tables as the owner, behind their state and epoch guards;
-- * a reader is a member of bi_reader: it reads published views and dead
--   letters under row-level security (publish.sql); the dashboard reads as
--   the reader role mapped to the signed-in Airflow user (bi.dashboard_readers).
--
-- On top of that a worker may only work on the job versions it is given: a
-- row in bi.worker_grants names a role (the worker's login role, or any group
-- role it belongs to, bi_worker included) and a job version. Every
-- worker-facing function calls bi.assert_may_work_on_v1 first, so a worker
-- that holds a lease on nothing it was granted cannot read a single snapshot
-- row. tests/test_privileges.py checks that each one does.
--
-- Who is asking: session_user, the role that authenticated. Inside a
-- SECURITY DEFINER function current_user is the owner, and SET ROLE can only
-- move to roles the login role already belongs to, so session_user is the
-- identity that cannot be borrowed. The owner (and a superuser) passes always.

-- Which roles may work on which job version. Written by the owner when it
-- launches workers for a job (bi.grant_job_v1); gone with the job version.
CREATE TABLE IF NOT EXISTS bi.worker_grants (
    role_name   text NOT NULL,
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    granted_by  text NOT NULL DEFAULT session_user,
    granted_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (role_name, job_version)
);
CREATE INDEX IF NOT EXISTS worker_grants_job ON bi.worker_grants (job_version);

-- True when the authenticated role may work on p_job: it belongs to the
-- schema owner's role (admin, superuser), or to a role granted this job.
CREATE OR REPLACE FUNCTION bi.may_work_on_v1(p_job text) RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT pg_has_role(session_user, (SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = 'bi'), 'MEMBER')
        OR EXISTS (SELECT 1
                     FROM bi.worker_grants g
                     JOIN pg_roles r ON r.rolname = g.role_name
                    WHERE g.job_version = p_job
                      AND pg_has_role(session_user, r.oid, 'MEMBER'));
$$;

CREATE OR REPLACE FUNCTION bi.assert_may_work_on_v1(p_job text) RETURNS void
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT bi.may_work_on_v1(p_job) THEN
        RAISE EXCEPTION 'role % may not work on job version %', session_user, p_job
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'the owner grants it with SELECT bi.grant_job_v1(role, job_version)';
    END IF;
END $$;

-- Owner-only: give a worker role one job.
CREATE OR REPLACE FUNCTION bi.grant_job_v1(p_role text, p_job text) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = p_role) THEN
        RAISE EXCEPTION 'no role %', p_role USING ERRCODE = 'undefined_object';
    END IF;
    -- A grant to a role outside bi_worker would be useless (it cannot EXECUTE
    -- the ledger) or, for an admin, meaningless; refusing it catches typos.
    IF NOT pg_has_role(p_role, 'bi_worker', 'MEMBER') THEN
        RAISE EXCEPTION 'role % is not a member of bi_worker', p_role USING ERRCODE = 'invalid_grant_operation';
    END IF;
    INSERT INTO bi.worker_grants (role_name, job_version) VALUES (p_role, p_job)
    ON CONFLICT (role_name, job_version) DO NOTHING;
    RETURN FOUND;
END $$;

CREATE OR REPLACE FUNCTION bi.revoke_job_v1(p_role text, p_job text) RETURNS boolean
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM bi.worker_grants WHERE role_name = p_role AND job_version = p_job RETURNING true;
$$;

-- Airflow user -> the database role the dashboard reads customer text as:
-- inside a transaction that runs SET LOCAL ROLE to that role, so row-level
-- security decides what it sees. A user with no row reads no customer text
-- at all (counts only). Several Airflow users may share one role. A role
-- that would see past row-level security (a superuser, BYPASSRLS, or a
-- member of the bi schema's owner, which owns the tables) is refused when
-- mapped and again at every read (bi.dashboard_role_problem_v1).
CREATE TABLE IF NOT EXISTS bi.dashboard_readers (
    airflow_user text PRIMARY KEY,   -- BaseUser.get_name(): the name the user signs in with
    role_name    text NOT NULL,      -- a bi_reader member
    mapped_by    text NOT NULL DEFAULT session_user,
    mapped_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Why a role cannot stand for a dashboard user, or NULL when it can.
CREATE OR REPLACE FUNCTION bi.dashboard_role_problem_v1(p_role text) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN r.oid IS NULL THEN format('no role %s', p_role)
        WHEN r.rolsuper OR r.rolbypassrls
            THEN format('role %s bypasses row-level security (superuser or BYPASSRLS)', r.rolname)
        WHEN pg_has_role(r.oid, (SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = 'bi'), 'MEMBER')
            THEN format('role %s is a member of the owner of schema bi, which row-level security does not restrict',
                        r.rolname)
        WHEN NOT pg_has_role(r.oid, 'bi_reader', 'MEMBER')
            THEN format('role %s is not a member of bi_reader', r.rolname)
    END
      FROM (SELECT 1) one
      LEFT JOIN pg_roles r ON r.rolname = p_role;
$$;

-- Owner-only: map an Airflow user to a reader role, replacing an earlier mapping.
CREATE OR REPLACE FUNCTION bi.map_dashboard_reader_v1(p_user text, p_role text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_problem text := bi.dashboard_role_problem_v1(p_role);
BEGIN
    IF nullif(btrim(p_user), '') IS NULL THEN
        RAISE EXCEPTION 'name the Airflow user to map' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'cannot map Airflow user % to role %: %', p_user, p_role, v_problem
            USING ERRCODE = 'invalid_grant_operation';
    END IF;
    INSERT INTO bi.dashboard_readers AS m (airflow_user, role_name) VALUES (p_user, p_role)
    ON CONFLICT (airflow_user) DO UPDATE
       SET role_name = excluded.role_name, mapped_by = session_user, mapped_at = clock_timestamp();
    RETURN p_role;
END $$;

CREATE OR REPLACE FUNCTION bi.unmap_dashboard_reader_v1(p_user text) RETURNS boolean
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM bi.dashboard_readers WHERE airflow_user = p_user RETURNING true;
$$;

-- Nothing in schema bi for PUBLIC: functions are executable by PUBLIC by
-- default, and a SECURITY DEFINER function callable by anyone with USAGE on
-- bi would be a way around every grant below. Publishing, dropping, granting
-- and mapping are owner's acts: nobody else may even call those functions.
REVOKE ALL ON SCHEMA bi FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA bi FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA bi FROM PUBLIC;
REVOKE EXECUTE ON ALL ROUTINES IN SCHEMA bi FROM PUBLIC;
-- Functions the owner creates in later migrations start closed too. (A
-- per-schema default can only add privileges, so this one is database-wide
-- for the migrating role; grant what a reader or worker needs explicitly.)
ALTER DEFAULT PRIVILEGES REVOKE EXECUTE ON ROUTINES FROM PUBLIC;

-- The worker set: exactly what gpu_runner/worker.py and ledger.py call, and
-- the read-only "may I?" check.
GRANT USAGE ON SCHEMA bi TO bi_worker;
GRANT EXECUTE ON FUNCTION
    bi.claim_shard_v2(text, text, text, integer),
    bi.renew_lease_v1(text, integer, bigint, text, integer),
    bi.release_shard_v1(text, integer, bigint, text),
    bi.complete_shard_v1(text, integer, bigint, text),
    bi.shard_records_v2(text, integer, bigint),
    bi.mark_in_flight_v1(text, integer, bigint, text, text[]),
    bi.abandon_shard_v1(text, integer, bigint, text),
    bi.put_results_v1(text, integer, bigint, text, text, text[], jsonb[], text[]),
    bi.fail_records_v2(text, integer, bigint, text, text, text[], text[], text[], integer[]),
    bi.halt_job_v1(text, text),
    bi.job_spec_v2(text),
    bi.job_counts_v1(text),
    bi.may_work_on_v1(text)
TO bi_worker;

