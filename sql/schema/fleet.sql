-- fleet: the batch fleet's size, as the autopilot decides it and as the
-- launchers run it (batch_inference.autopilot).
--
-- The autopilot (in the cutoff watch) writes the desired size as state, one
-- row per job version in bi.fleet_size, and every decision that led to it in
-- bi.fleet_decisions; a launcher (the local process fleet, the Kubernetes
-- pods) reads the state and reconciles to it, so the autopilot never holds a
-- handle on a launcher and a restarted launcher resumes from the row. Each
-- launcher records what it runs whenever that changes (bi.fleet_observed):
-- the batch workers' GPU-hours are the integral of those counts over time.

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
    options        jsonb NOT NULL DEFAULT '[]',
    cluster        text                         -- the cluster decided for (NULL: the one fleet of a job)
);
CREATE INDEX IF NOT EXISTS fleet_decisions_job ON bi.fleet_decisions (job_version, id);

-- A job version placed over several clusters (batch_inference.regions): each
-- cluster's desired batch fleet, the last per-cluster decision that changed it
-- (bi.fleet_decisions with its cluster), which that cluster's launcher
-- reconciles to.
CREATE TABLE IF NOT EXISTS bi.fleet_cluster_size (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    cluster     text NOT NULL,
    desired     integer NOT NULL CHECK (desired >= 0),
    reason      text NOT NULL,
    decided_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    decision_id bigint NOT NULL,
    PRIMARY KEY (job_version, cluster)
);

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
REVOKE ALL ON bi.fleet_size, bi.fleet_cluster_size, bi.fleet_decisions, bi.fleet_observed FROM PUBLIC;
REVOKE ALL ON SEQUENCE bi.fleet_decisions_id_seq, bi.fleet_observed_id_seq FROM PUBLIC;

-- A launcher saw worker p_owner die by a signal (a fault in the engine, an OOM kill): every shard
-- it still holds is given back now, as an engine failure it reported itself would be
-- (bi.abandon_shard_v2: pending again, counted as a lost lease, deaths recorded for the records it
-- had marked in flight), each fenced by the epoch it held, with p_error on the shard.
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
