-- 0010_companion_versions: a version's companion job versions (the golden
-- run and the judge) are recorded in bi.companion_versions, so job lists can
-- leave them out, a version's page shows them, and bi.drop_job_version_v1
-- drops them with the last version they serve. Companions already made are
-- found in the validation reports that name them. Never edited.

-- A version's companion job versions, the golden run and the judge
-- (evaluation.run_companion): each has a version of its own, and one golden
-- run may serve several versions of a spec. A companion is left out of job
-- lists unless asked for, shown on the page of each version it serves, and
-- dropped with the last of them (bi.drop_job_version_v1). A row goes with
-- either of its versions.
CREATE TABLE IF NOT EXISTS bi.companion_versions (
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    companion   text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    kind        text NOT NULL CHECK (kind IN ('golden', 'judge')),
    PRIMARY KEY (job_version, companion),
    CHECK (companion <> job_version)
);
CREATE INDEX IF NOT EXISTS companion_versions_companion ON bi.companion_versions (companion);
REVOKE ALL ON bi.companion_versions FROM PUBLIC;

INSERT INTO bi.companion_versions (job_version, companion, kind)
SELECT j.job_version, e.companion, e.kind
  FROM bi.jobs j
 CROSS JOIN LATERAL (VALUES (j.validation #>> '{evaluation,golden,job_version}', 'golden'),
                            (j.validation #>> '{evaluation,judge,job_version}', 'judge')) AS e(companion, kind)
 WHERE e.companion IS NOT NULL AND e.companion <> j.job_version
   AND EXISTS (SELECT 1 FROM bi.jobs c WHERE c.job_version = e.companion)
ON CONFLICT DO NOTHING;

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
