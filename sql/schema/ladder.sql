-- ladder: the model ladder's audit of every rung's answers and calibrate's measurements
-- (batch_inference.ladder). Workers write and read the answers through two functions (roles.sql).

-- Every answer a rung gave a record of a ladder job (a spec with models:),
-- one row per (job version, record, rung), written put-if-absent by the
-- worker under its shard lease (bi.ladder_put_answers_v1) before the final
-- answer goes to bi.results: the escalated ones (not valid, or not
-- confident enough) and the one handed on as the final answer (escalated
-- false, at most one per record: ladder_answers_final). A worker that takes
-- a shard over reads them back (bi.ladder_answers_v1) and resumes each record
-- at the rung where it stopped, re-using a stored final answer as it is, so
-- a record's final answer is made once and bi.results holds that answer.
-- Gone with the job version (the foreign key).
CREATE TABLE IF NOT EXISTS bi.ladder_answers (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    record_id   text NOT NULL,
    rung        smallint NOT NULL CHECK (rung >= 1),
    output      text,                          -- the raw answer (several samples: the one kept)
    valid       boolean NOT NULL,              -- it passed the output schema and the rules
    confidence  double precision CHECK (confidence IS NULL OR confidence BETWEEN 0 AND 1),
    escalated   boolean NOT NULL,              -- true: the record went on to the next rung
    error       text,                          -- why it was not valid
    worker_id   text,
    epoch       bigint,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_version, record_id, rung)
);
CREATE UNIQUE INDEX IF NOT EXISTS ladder_answers_final ON bi.ladder_answers (job_version, record_id)
    WHERE NOT escalated;

-- What calibrate measured for a ladder spec on its golden set (run in its own
-- process, not as a job version): every rung's
-- golden accuracy and bill, the accuracy/cost curve over thresholds, and the
-- thresholds it picked. Keyed by the calibrated spec's hash and dataset: the
-- job versions submitted from that spec (bi.jobs.spec_hash) read it.
CREATE TABLE IF NOT EXISTS bi.ladder_calibrations (
    id            bigserial PRIMARY KEY,
    dataset       text NOT NULL,
    spec_hash     text NOT NULL,               -- of the spec with the picked thresholds
    target        double precision NOT NULL,
    thresholds    jsonb NOT NULL,              -- one per rung below the top
    report        jsonb NOT NULL,              -- rungs, top-rung-alone and picked figures, the curve
    calibrated_by text NOT NULL DEFAULT session_user,
    calibrated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS ladder_calibrations_spec ON bi.ladder_calibrations (dataset, spec_hash, calibrated_at DESC);

-- Put-if-absent rung answers for records of one shard under the current
-- epoch: the shard row is locked as bi.put_results_v3 locks it, so a stale
-- epoch writes nothing (stale), and a record outside the shard is skipped.
-- n: rows new. Arrays are parallel.
CREATE OR REPLACE FUNCTION bi.ladder_put_answers_v1(p_job text, p_shard integer, p_epoch bigint, p_worker text,
                                                   p_ids text[], p_rungs integer[], p_outputs text[],
                                                   p_valid boolean[], p_confidence double precision[],
                                                   p_escalated boolean[], p_errors text[],
                                                   OUT stale boolean, OUT n integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    PERFORM 1 FROM bi.shards s
     WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)
       FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM bi.record_fence_v1(p_job, p_shard, 'ladder_put_answers', p_epoch, p_worker);
        stale := true;
        n := 0;
        RETURN;
    END IF;
    INSERT INTO bi.ladder_answers (job_version, record_id, rung, output, valid, confidence, escalated, error,
                                   worker_id, epoch)
    SELECT p_job, u.id, u.rung, u.output, u.valid, u.confidence, u.escalated, u.error, p_worker, p_epoch
      FROM unnest(p_ids, p_rungs, p_outputs, p_valid, p_confidence, p_escalated, p_errors)
           AS u(id, rung, output, valid, confidence, escalated, error)
     WHERE EXISTS (SELECT 1 FROM bi.snapshot_rows sr
                    WHERE sr.job_version = p_job AND sr.record_id = u.id AND sr.shard_no = p_shard)
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    stale := false;
END $$;

-- The stored rung answers of some records of a shard the caller holds (none
-- for a stale epoch), for a worker resuming them.
CREATE OR REPLACE FUNCTION bi.ladder_answers_v1(p_job text, p_shard integer, p_epoch bigint, p_ids text[])
RETURNS TABLE (record_id text, rung integer, output text, valid boolean, confidence double precision,
               escalated boolean)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    IF NOT EXISTS (SELECT 1 FROM bi.shards s
                    WHERE s.job_version = p_job AND s.shard_no = p_shard AND bi.holds_lease_v1(s, p_epoch)) THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT a.record_id, a.rung::integer, a.output, a.valid, a.confidence, a.escalated
      FROM bi.ladder_answers a
     WHERE a.job_version = p_job AND a.record_id = ANY (p_ids)
     ORDER BY a.record_id, a.rung;
END $$;
