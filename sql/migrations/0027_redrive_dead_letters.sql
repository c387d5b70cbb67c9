-- 0027_redrive_dead_letters: an operator re-drives chosen dead letters of a
-- version on purpose (batch-inference redrive JOB_VERSION --dead-letters):
-- bi.redrive_dead_letters_v1 puts them back to pending with a fresh attempt
-- budget, recorded in bi.redrives (who, when, why, filters, counts); a delete
-- of dead letters now takes them off bi.dead_letter_counts. Never edited.

-- A statement that deletes dead letters (a re-drive, bi.redrive_dead_letters_v1):
-- their counts, from their groups.
CREATE OR REPLACE FUNCTION bi.dead_letter_counts_remove_v1() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE bi.dead_letter_counts t
       SET n = t.n - r.n
      FROM (SELECT o.job_version, o.acl, o.reason, o.stage, count(*) AS n FROM old_rows o GROUP BY 1, 2, 3, 4) r
     WHERE t.job_version = r.job_version AND t.acl IS NOT DISTINCT FROM r.acl AND t.reason = r.reason
       AND t.stage = r.stage;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS dead_letters_counts_delete ON bi.dead_letters;
CREATE TRIGGER dead_letters_counts_delete AFTER DELETE ON bi.dead_letters
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION bi.dead_letter_counts_remove_v1();

-- Re-drives: an operator put chosen dead letters of a version back to pending
-- after fixing their cause (bi.redrive_dead_letters_v1), with who, when, why,
-- the filters and how many. Never automatic (I4): only the command writes one.
CREATE TABLE IF NOT EXISTS bi.redrives (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_version text NOT NULL REFERENCES bi.jobs (job_version) ON DELETE CASCADE,
    actor       text NOT NULL,
    reason      text NOT NULL,
    stage       text,               -- the stage filter; NULL: every stage
    reason_like text,               -- the dead letters' reason contained this (any case); NULL: any reason
    records     bigint NOT NULL,    -- dead letters put back to pending
    shards      integer NOT NULL,   -- shards put back to pending
    left_out    bigint NOT NULL,    -- matched but never leased (refused at snapshot or planning): left dead
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS redrives_job ON bi.redrives (job_version, id);
REVOKE ALL ON bi.redrives FROM PUBLIC;
REVOKE ALL ON SEQUENCE bi.redrives_id_seq FROM PUBLIC;

-- Re-drive chosen dead letters of a version: each matching dead letter of a
-- leased record (a shard of the snapshot) is deleted with its attempts and
-- crashes (a fresh budget of max_attempts), its shard goes back to pending
-- (its dead counter down, done_at cleared) and the version back to running
-- (its validation report cleared: validate again), all in this statement's
-- transaction, recorded in bi.redrives. Dead letters refused at the snapshot
-- or at planning never reach a worker (their input is refused): they stay and
-- are counted as left out. Guards, each one line: who and why given; the
-- version exists, is not published (its readers see it: submit a new version)
-- nor dropped; something matches; no matching shard is leased now (re-drive
-- once its workers have stopped). The version's row is locked FOR UPDATE
-- first, as bi.publish_v1 locks it: a re-drive and a publish never interleave.
-- Owner only.
CREATE OR REPLACE FUNCTION bi.redrive_dead_letters_v1(p_job text, p_actor text, p_reason text,
                                                     p_stage text DEFAULT NULL, p_reason_like text DEFAULT NULL)
RETURNS TABLE (id bigint, job_version text, records bigint, shards integer, left_out bigint, at timestamptz)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_status text;
    v_ids text[];
    v_shard_nos integer[];
    v_left bigint;
    v_shards integer;
    v_leased integer;
BEGIN
    IF nullif(btrim(p_actor), '') IS NULL OR nullif(btrim(p_reason), '') IS NULL THEN
        RAISE EXCEPTION 'a re-drive needs who and why (--reason)' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT j.status INTO v_status FROM bi.jobs j WHERE j.job_version = p_job FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no job version %', p_job USING ERRCODE = 'no_data_found';
    END IF;
    IF v_status IN ('published', 'dropped') THEN
        RAISE EXCEPTION 'job version % is %: its dead letters are not re-driven (submit a new version)', p_job,
            v_status USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    SELECT coalesce(array_agg(d.record_id) FILTER (WHERE sr.shard_no IS NOT NULL), '{}'),
           coalesce(array_agg(sr.shard_no) FILTER (WHERE sr.shard_no IS NOT NULL), '{}'),
           count(*) FILTER (WHERE sr.shard_no IS NULL)
      INTO v_ids, v_shard_nos, v_left
      FROM bi.dead_letters d
      LEFT JOIN bi.snapshot_rows sr ON sr.job_version = d.job_version AND sr.record_id = d.record_id
     WHERE d.job_version = p_job AND (p_stage IS NULL OR d.stage = p_stage)
       AND (p_reason_like IS NULL OR strpos(lower(d.reason), lower(p_reason_like)) > 0);
    IF cardinality(v_ids) = 0 THEN
        RAISE EXCEPTION '%', format('job version %s: no dead letter to re-drive matches%s', p_job,
            CASE WHEN v_left > 0 THEN format(' (%s matching were refused before any worker: their input is refused)',
                                             v_left) ELSE '' END)
            USING ERRCODE = 'no_data_found';
    END IF;
    SELECT min(s.shard_no) INTO v_leased FROM bi.shards s
     WHERE s.job_version = p_job AND s.state = 'leased' AND s.shard_no = ANY (v_shard_nos);
    IF v_leased IS NOT NULL THEN
        RAISE EXCEPTION 'job version %: shard % is leased; re-drive once its workers have stopped', p_job, v_leased
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    DELETE FROM bi.dead_letters d WHERE d.job_version = p_job AND d.record_id = ANY (v_ids);
    DELETE FROM bi.attempts a WHERE a.job_version = p_job AND a.record_id = ANY (v_ids);
    UPDATE bi.shards s
       SET dead = s.dead - c.n, state = 'pending', done_at = NULL
      FROM (SELECT u.shard_no, count(*) AS n FROM unnest(v_shard_nos) AS u (shard_no) GROUP BY 1) c
     WHERE s.job_version = p_job AND s.shard_no = c.shard_no;
    GET DIAGNOSTICS v_shards = ROW_COUNT;
    UPDATE bi.jobs j SET status = 'running', validation = NULL WHERE j.job_version = p_job;
    RETURN QUERY
    INSERT INTO bi.redrives AS r (job_version, actor, reason, stage, reason_like, records, shards, left_out)
    VALUES (p_job, p_actor, btrim(p_reason), p_stage, p_reason_like, cardinality(v_ids), v_shards, v_left)
    RETURNING r.id, r.job_version, r.records, r.shards, r.left_out, r.at;
END $$;
