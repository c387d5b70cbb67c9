-- core: the schemas, the two group roles and the bookkeeping tables.
--
-- sql/schema/ is the current definition of the ledger, one file per area,
-- applied in name order: core, evaluation (the review sample and the
-- reviews), ledger (the state transitions), publish (the published views,
-- publish and rollback, readers' row-level security), roles (who may call
-- what). sql/migrations/ holds the numbered steps that build
-- the same database from an empty one; tests/test_schema.py compares the two.
--
-- Everything lives in schema bi. Per-record tables (snapshot rows, results,
-- dead letters, attempts) are LIST-partitioned by job_version, so a whole job
-- version is dropped with DROP TABLE on its partitions, never a row-by-row DELETE.
-- A job's results partition is HASH-partitioned by record_id under that
-- (bi.create_job_partitions_v1, ledger.sql).

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
    -- When a submit last applied changed settings to the version (plan._resubmitted): a halt
    -- before it is past (its cause fixed), whether or not a worker has run since.
    resubmitted_at   timestamptz,
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
    reject       text            -- why the record never reaches a worker (it is dead-lettered), else NULL
) PARTITION BY LIST (job_version);
-- Keyed per partition, not on this parent: each partition holds one job
-- version, so its unique index on record_id is the key (job_version,
-- record_id) without a constant first column, and its shard index
-- (shard_no, record_id) reads a shard in pages in record_id order; both
-- compare record ids as bytes (bi.attach_snapshot_v2 and
-- bi.shard_records_v4, ledger.sql; partitions from before 0023 keep their
-- primary key).

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
    lease_renewed_at timestamptz,                 -- the current lease's claim or last renewal
    claims           integer NOT NULL DEFAULT 0,
    records          integer NOT NULL,
    stored           integer NOT NULL DEFAULT 0,  -- results written under this shard (any transport)
    stored_fallback  integer NOT NULL DEFAULT 0,  -- of which by the synchronous fallback pool
    stored_hosted    integer NOT NULL DEFAULT 0,  -- of which through a hosted batch API
    dead             integer NOT NULL DEFAULT 0,
    first_claim_at   timestamptz,
    done_at          timestamptz,
    lost_leases      integer NOT NULL DEFAULT 0,  -- epochs that ended without release or completion
    in_flight        text[],                      -- the current epoch's last marked engine batch
    batch_lease_ended_at timestamptz,             -- when a batch worker last stopped holding it
    last_error       text,                        -- why a launcher last gave it back: its worker died by a signal
    last_error_at    timestamptz,                 -- (bi.abandon_dead_owner_v1)
    PRIMARY KEY (job_version, shard_no)
);
CREATE INDEX IF NOT EXISTS shards_claimable ON bi.shards (job_version, shard_no) WHERE state <> 'done';
-- The done shards in completion order (the progress panel's burn-down without
-- samples, and the job's finish time): done_at and shard_no change at most once
-- per shard, so the row's other updates stay HOT.
CREATE INDEX IF NOT EXISTS shards_done_at ON bi.shards (job_version, done_at, shard_no) WHERE done_at IS NOT NULL;

-- Stamp the end of a batch lease: the row was leased by a batch or hosted
-- batch worker and is now not (released, completed, abandoned, swept, taken
-- over after expiry, or claimed by the fallback pool). A fallback run's drain
-- time is measured from these stamps.
CREATE OR REPLACE FUNCTION bi.stamp_batch_lease_end_v1() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.batch_lease_ended_at := clock_timestamp();
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS shards_batch_lease_end ON bi.shards;
CREATE TRIGGER shards_batch_lease_end BEFORE UPDATE OF state, lease_transport ON bi.shards
    FOR EACH ROW
    WHEN (OLD.state = 'leased' AND OLD.lease_transport IN ('batch', 'hosted_batch')
          AND (NEW.state <> 'leased' OR NEW.lease_transport IS DISTINCT FROM OLD.lease_transport))
    EXECUTE FUNCTION bi.stamp_batch_lease_end_v1();

CREATE TABLE IF NOT EXISTS bi.results (
    job_version    text NOT NULL,
    record_id      text NOT NULL,
    output         jsonb NOT NULL,
    category       text,
    model_name     text NOT NULL,
    model_digest   text NOT NULL,
    prompt_version text NOT NULL,
    transport      text NOT NULL CHECK (transport IN ('batch', 'hosted_batch', 'fallback', 'reused')),
    -- The engine that made the output (a built-in name, or module:Class) and
    -- its endpoint's class: local (in the worker's process), internal (an
    -- endpoint inside the company), hosted (outside it). A reused row keeps
    -- its base row's. NULL: written before migration 0006.
    engine         text,
    endpoint       text CHECK (endpoint IN ('local', 'internal', 'hosted')),
    worker_id      text,
    epoch          bigint,
    acl            text[],
    content_hash   text,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_version, record_id),
    CONSTRAINT results_engine_endpoint CHECK ((engine IS NULL) = (endpoint IS NULL))
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
    transport      text CHECK (transport IN ('batch', 'hosted_batch', 'fallback')),
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
