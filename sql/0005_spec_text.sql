-- 0005_spec_text: keep the spec exactly as submitted.
--
-- bi.jobs.spec is jsonb, which stores object keys in its own order (shortest
-- first). An output schema that lists "category" before "summary" came back
-- to the worker as "summary" then "category", and structured decoding
-- (llama.cpp grammars, vLLM guided decoding, OpenAI structured outputs)
-- writes properties in the schema's order: the model summarised before it
-- chose the category, which is not the task the prompt's author tested.
--
-- spec_text holds the JSON text the submitter wrote (key order included);
-- spec stays for queries (spec->>'dataset', containment). The CHECK keeps
-- the two the same document. job_spec_v2 returns the text as json, which
-- psycopg decodes in document order. Job versions submitted before this
-- migration have no text and keep jsonb's order (they were decoded that way
-- from the start, so their results stay consistent).

ALTER TABLE bi.jobs ADD COLUMN IF NOT EXISTS spec_text text;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'jobs_spec_text_matches'
                   AND conrelid = 'bi.jobs'::regclass) THEN
        ALTER TABLE bi.jobs ADD CONSTRAINT jobs_spec_text_matches
            CHECK (spec_text IS NULL OR spec_text::jsonb = spec);
    END IF;
END $$;

CREATE OR REPLACE FUNCTION bi.job_spec_v2_unguarded(p_job text)
RETURNS TABLE (spec json, mode text, status text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(j.spec_text, j.spec::text)::json, j.mode, j.status
      FROM bi.jobs j WHERE j.job_version = p_job;
$$;

-- The worker-facing name, behind the per-job guard of 0004.
CREATE OR REPLACE FUNCTION bi.job_spec_v2(p_job text)
RETURNS TABLE (spec json, mode text, status text)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_may_work_on_v1(p_job);
    RETURN QUERY SELECT * FROM bi.job_spec_v2_unguarded(p_job);
END $$;

REVOKE EXECUTE ON FUNCTION bi.job_spec_v2_unguarded(text), bi.job_spec_v2(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION bi.job_spec_v2(text) TO bi_worker;
