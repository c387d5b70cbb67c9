-- 0013_job_runs: which job version each Airflow DAG run worked on.
--
-- SubmitJobOperator writes one row per DAG run after its submit, whether the
-- submit created the job version or found it already there (the same spec
-- over the same rows is the same version, created days before). The on-call
-- callbacks read it: the DAG-level Deadline Alert runs in the triggerer with
-- only the DAG run's ids, and cannot read the submit task's XCom.
CREATE TABLE IF NOT EXISTS bi.job_runs (
    dag_id      text NOT NULL,
    run_id      text NOT NULL,
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    created     boolean NOT NULL,   -- this run's submit created the version (false: it resumed an existing one)
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (dag_id, run_id)
);
CREATE INDEX IF NOT EXISTS job_runs_job ON bi.job_runs (job_version);
