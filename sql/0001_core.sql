-- 0001_core: the bookkeeping tables.
--
-- Everything lives in schema bi. Per-record tables (snapshot rows, results,
-- dead letters, attempts) are LIST-partitioned by job_version, so a whole job
-- version is dropped with DROP TABLE on its partitions, never a row-by-row DELETE.

CREATE SCHEMA IF NOT EXISTS bi;

CREATE TABLE IF NOT EXISTS bi.jobs (
    job_version      text PRIMARY KEY,
    dataset          text NOT NULL,
    spec_hash        text NOT NULL,
    snapshot_id      text NOT NULL,
    spec             jsonb NOT NULL,
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
    fallback_at      timestamptz
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
    PRIMARY KEY (job_version, shard_no)
);
CREATE INDEX IF NOT EXISTS shards_claimable ON bi.shards (job_version, shard_no) WHERE state <> 'done';

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

-- Failed attempts per record; survives leases so a poison record ends in
-- dead letters after max_attempts whichever worker sees it.
CREATE TABLE IF NOT EXISTS bi.attempts (
    job_version text NOT NULL,
    record_id   text NOT NULL,
    attempts    integer NOT NULL,
    last_error  text,
    last_output text,
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
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

-- Measured fallback runs: the cutoff derives its rate and overhead from these.
CREATE TABLE IF NOT EXISTS bi.fallback_runs (
    id          bigserial PRIMARY KEY,
    job_version text NOT NULL,
    dataset     text NOT NULL,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    records     bigint NOT NULL,
    rate        double precision NOT NULL,   -- sustained records/s
    overhead_s  double precision NOT NULL    -- drain + reconcile measured around the re-drive
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
