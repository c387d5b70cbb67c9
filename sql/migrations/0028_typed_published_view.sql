-- 0028_typed_published_view: the published view's columns are typed from the
-- output schema of the version it shows, record_id as the source's id type,
-- and the view follows the pointer's version when a publish or a rollback
-- moves it to another shape (bi.ensure_published_view_v2, which replaces
-- bi.ensure_published_view_v1). Never edited.

DROP FUNCTION IF EXISTS bi.ensure_published_view_v1(text, text[], text[]);

-- The view of one dataset, shaped like the version it shows: the output's
-- top-level fields typed from that version's output schema (p_columns, an
-- array of [name, type] in the schema's order; types: text, bigint, double
-- precision, boolean, jsonb), and record_id as the source's id type (text,
-- bigint or uuid), each cast from outputs the worker validated against that
-- schema. Created at the first publish; when the pointer moves to a version
-- of another shape (a field added, a type changed, by a publish or a
-- rollback) it is dropped and created again in the same transaction as the
-- switch, so a reader sees the old version in the old shape or the new one
-- in the new shape. Same shape: no DDL, no lock. Every field stays in
-- `output`. bi.published_views.fields records the shape.
CREATE OR REPLACE FUNCTION bi.ensure_published_view_v2(p_dataset text, p_id_type text, p_columns jsonb)
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_name text := format('published.%I', p_dataset);
    fixed text[] := ARRAY['record_id', 'output', 'category', 'model_name', 'model_digest', 'prompt_version',
                          'transport', 'job_version', 'created_at', 'acl'];
    cols text := '';
    fields jsonb := jsonb_build_object('record_id', p_id_type);
    c jsonb;
    f text;
    t text;
BEGIN
    IF p_id_type NOT IN ('text', 'bigint', 'uuid') THEN
        RAISE EXCEPTION 'record_id type % is not one of text, bigint, uuid', p_id_type
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR c IN SELECT * FROM jsonb_array_elements(coalesce(p_columns, '[]')) LOOP
        f := c ->> 0;
        t := c ->> 1;
        CONTINUE WHEN f = ANY (fixed) OR fields ? f OR length(f) > 63;
        cols := cols || CASE t
            WHEN 'text' THEN format(', r.output ->> %L AS %I', f, f)
            WHEN 'bigint' THEN format(', (r.output ->> %L)::numeric::bigint AS %I', f, f)
            WHEN 'double precision' THEN format(', (r.output ->> %L)::double precision AS %I', f, f)
            WHEN 'boolean' THEN format(', (r.output ->> %L)::boolean AS %I', f, f)
            WHEN 'jsonb' THEN format(', r.output -> %L AS %I', f, f)
        END;
        IF cols IS NULL THEN
            RAISE EXCEPTION 'output field %: type % is not one of text, bigint, double precision, boolean, jsonb',
                f, t USING ERRCODE = 'invalid_parameter_value';
        END IF;
        fields := fields || jsonb_build_object(f, t);
    END LOOP;
    IF to_regclass(v_name) IS NOT NULL
       AND (SELECT pv.fields FROM bi.published_views pv WHERE pv.dataset = p_dataset) = fields THEN
        RETURN v_name;
    END IF;
    EXECUTE format('DROP VIEW IF EXISTS %s', v_name);
    -- security_invoker: the policy on bi.results is checked against the
    -- reader, not the view's owner (who bypasses RLS).
    EXECUTE format(
        'CREATE VIEW published.%I WITH (security_invoker = true) AS '
        'SELECT r.record_id%s AS record_id, r.output, r.category%s, r.model_name, r.model_digest, '
        'r.prompt_version, r.transport, r.job_version, r.created_at, r.acl '
        'FROM bi.results r '
        'WHERE r.job_version = (SELECT p.job_version FROM bi.publish_pointer p WHERE p.dataset = %L)',
        p_dataset, CASE p_id_type WHEN 'text' THEN '' ELSE '::' || p_id_type END, cols, p_dataset);
    EXECUTE format('REVOKE ALL ON %s FROM PUBLIC', v_name);
    EXECUTE format('GRANT SELECT ON %s TO bi_reader', v_name);
    EXECUTE format('COMMENT ON VIEW %s IS %L', v_name,
                   format('Published results of dataset %s: the version named in bi.publish_pointer. '
                          'Rows are filtered by ACL for bi_reader members.', p_dataset));
    INSERT INTO bi.published_views AS pv (dataset, view_name, fields) VALUES (p_dataset, v_name, fields)
    ON CONFLICT (dataset) DO UPDATE SET fields = excluded.fields;
    RETURN v_name;
END $$;
