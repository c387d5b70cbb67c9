-- 0029_fleet_autopilot: the batch fleet's desired size (bi.fleet_size), the
-- autopilot's decisions (bi.fleet_decisions) and what each launcher runs
-- (bi.fleet_observed, the GPU-hours' source). Never edited.

-- A job version's desired batch fleet: the last decision that changed it, and when.
CREATE TABLE IF NOT EXISTS bi.fleet_size (
    job_version text PRIMARY KEY REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    desired     integer NOT NULL CHECK (desired >= 0),
    reason      text NOT NULL,
    decided_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    decision_id bigint NOT NULL
);

-- Every decision of the autopilot, one per poll: the size it found and the
-- size it wants, why, the projected finish and bill with and without the
-- change, the page it raised (the budget, the deadline) and every option it
-- weighed (workers, projected finish, fallback rows, bill, within budget).
CREATE TABLE IF NOT EXISTS bi.fleet_decisions (
    id             bigserial PRIMARY KEY,
    job_version    text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    at             timestamptz NOT NULL DEFAULT clock_timestamp(),
    current        integer NOT NULL CHECK (current >= 0),
    desired        integer NOT NULL CHECK (desired >= 0),
    action         text NOT NULL CHECK (action IN ('add', 'remove', 'hold')),
    reason         text NOT NULL,
    per_worker     double precision,            -- measured rows/s of one worker (NULL: none measured yet)
    finish_without timestamptz,                 -- projected finish at the current size
    finish_with    timestamptz,                 -- projected finish at the desired size
    bill_without   numeric,
    bill_with      numeric,
    page           text,
    options        jsonb NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS fleet_decisions_job ON bi.fleet_decisions (job_version, id);

-- What a launcher runs: a row whenever its count of running workers changes
-- (0 when it stops).
CREATE TABLE IF NOT EXISTS bi.fleet_observed (
    id          bigserial PRIMARY KEY,
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    launcher    text NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    running     integer NOT NULL CHECK (running >= 0)
);
CREATE INDEX IF NOT EXISTS fleet_observed_job ON bi.fleet_observed (job_version, launcher, id);

-- Owner only, like the ledger's other tables (the launchers and the watch use the owner's connection).
REVOKE ALL ON bi.fleet_size, bi.fleet_decisions, bi.fleet_observed FROM PUBLIC;
REVOKE ALL ON SEQUENCE bi.fleet_decisions_id_seq, bi.fleet_observed_id_seq FROM PUBLIC;
