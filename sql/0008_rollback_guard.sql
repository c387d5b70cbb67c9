-- 0008_rollback_guard: publish and roll back only from the version the caller saw.
--
-- A person deciding to roll back (the dashboard's button, `rollback --expect`)
-- looked at the dataset's pointer first. If another publish lands between that
-- look and the switch, an unguarded rollback would undo the newer publish
-- instead of the one they meant. The guard is here, in the statement that
-- switches the pointer, under the dataset's publish lock: no publisher can
-- move the pointer between the check and the switch, and a refused call
-- changes nothing (the exception aborts the statement).
--
-- The _v2 functions check, then call the _v1 switch of 0003_publish.sql in
-- the same transaction (advisory locks and row locks are re-entrant for
-- their holder), so the switch and its other guards exist once. _v1 stays
-- for callers with no expectation (`rollback` without --expect, Airflow).
--
-- Refusal: SQLSTATE BI409 (custom: "the pointer moved"), one line naming the
-- dataset, the version expected and the version actually published; the
-- DETAIL is the actual version alone, for programs.

-- Raise unless the dataset's pointer is at p_expected (NULL: nothing published
-- yet) or at p_or_at. Takes the publish lock and locks the pointer row until
-- the caller's transaction ends, so what it checked is what the caller then
-- switches.
CREATE OR REPLACE FUNCTION bi.assert_pointer_at_v1(p_dataset text, p_expected text, p_action text,
                                                   p_or_at text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_cur text;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('bi.publish:' || p_dataset, 0));
    SELECT p.job_version INTO v_cur FROM bi.publish_pointer p WHERE p.dataset = p_dataset FOR UPDATE;
    IF v_cur IS DISTINCT FROM p_expected AND v_cur IS DISTINCT FROM coalesce(p_or_at, p_expected) THEN
        RAISE EXCEPTION '% of dataset % refused: expected % to be published, but % is; nothing was changed',
            p_action, p_dataset, coalesce(p_expected, 'nothing'), coalesce(v_cur, 'nothing')
            USING ERRCODE = 'BI409', DETAIL = coalesce(v_cur, ''),
                  HINT = 'someone published or rolled back in between: look again and decide again';
    END IF;
END $$;


-- Rollback from p_expected_current: bi.rollback_v1's switch (to the version
-- the current one replaced, with its guards and history row), refused with
-- BI409 when the pointer is not at p_expected_current.
CREATE OR REPLACE FUNCTION bi.rollback_v2(p_dataset text, p_expected_current text, p_actor text DEFAULT NULL,
                                         p_reason text DEFAULT NULL)
RETURNS TABLE (dataset text, from_version text, to_version text, action text, forced boolean,
               changed boolean, history_id bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_pointer_at_v1(p_dataset, p_expected_current, 'rollback');
    RETURN QUERY SELECT * FROM bi.rollback_v1(p_dataset, p_actor, p_reason);
END $$;


-- Publish p_job in place of p_expected_current (NULL: the dataset's first
-- publish). bi.publish_v1's switch and guards; refused with BI409 when the
-- pointer is elsewhere. Already at p_job is the same no-op as in _v1 (a retry
-- of a publish that committed finds its own version, not the one it expected).
CREATE OR REPLACE FUNCTION bi.publish_v2(p_dataset text, p_job text, p_expected_current text,
                                        p_actor text DEFAULT NULL, p_force boolean DEFAULT false,
                                        p_reason text DEFAULT NULL)
RETURNS TABLE (dataset text, from_version text, to_version text, action text, forced boolean,
               changed boolean, history_id bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM bi.assert_pointer_at_v1(p_dataset, p_expected_current, 'publish of ' || p_job, p_job);
    RETURN QUERY SELECT * FROM bi.publish_v1(p_dataset, p_job, p_actor, p_force, p_reason);
END $$;


-- Owner only, as the _v1 functions (0003_publish.sql).
REVOKE EXECUTE ON FUNCTION bi.assert_pointer_at_v1(text, text, text, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION bi.rollback_v2(text, text, text, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION bi.publish_v2(text, text, text, text, boolean, text) FROM PUBLIC;
