-- 0035_estimate: a pilot's measured figures (bi.estimate_pilots) and a DAG run's
-- preview before its submit (bi.estimate_previews). Never edited.

CREATE TABLE IF NOT EXISTS bi.estimate_pilots (
    id             bigserial PRIMARY KEY,
    dataset        text NOT NULL,
    spec_hash      text NOT NULL,
    model_name     text NOT NULL,
    model_digest   text NOT NULL,
    engine         text NOT NULL,
    records        integer NOT NULL CHECK (records > 0),   -- records drawn and run
    stored         integer NOT NULL CHECK (stored >= 0),    -- valid answers written
    failed         integer NOT NULL CHECK (failed >= 0),    -- failed attempts (invalid, truncated, errors)
    dead_letters   integer NOT NULL CHECK (dead_letters >= 0),
    seconds        double precision NOT NULL CHECK (seconds > 0),   -- the worker's wall time, model load included
    records_per_s  double precision NOT NULL CHECK (records_per_s >= 0),
    input_tokens   bigint NOT NULL CHECK (input_tokens >= 0),       -- of the records run, by the pinned tokenizer
    output_tokens  bigint NOT NULL CHECK (output_tokens >= 0),      -- of the stored answers, re-tokenized
    valid_rate     double precision NOT NULL CHECK (valid_rate BETWEEN 0 AND 1),
    measured_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS estimate_pilots_model ON bi.estimate_pilots (model_name, model_digest, measured_at DESC);

CREATE TABLE IF NOT EXISTS bi.estimate_previews (
    id          bigserial PRIMARY KEY,
    dag_id      text NOT NULL,
    run_id      text NOT NULL,
    dataset     text NOT NULL,
    spec_hash   text NOT NULL,
    verdict     text NOT NULL CHECK (verdict IN ('go', 'over_budget', 'misses_deadline')),
    figures     jsonb NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS estimate_previews_dataset ON bi.estimate_previews (dataset, at DESC);
CREATE INDEX IF NOT EXISTS estimate_previews_run ON bi.estimate_previews (dag_id, run_id);

-- As sql/schema/roles.sql leaves every bi table: the owner's alone.
REVOKE ALL ON bi.estimate_pilots, bi.estimate_previews FROM PUBLIC;
REVOKE ALL ON SEQUENCE bi.estimate_pilots_id_seq, bi.estimate_previews_id_seq FROM PUBLIC;
