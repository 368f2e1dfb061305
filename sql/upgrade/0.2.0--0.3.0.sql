-- Table and type changes from 0.2.0 to 0.3.0 (tools/upgrade_script.py puts
-- them before the functions and views of 0.3.0, which replace the old ones).

-- Durations are kept only with no negative field and at most 100 years
-- (src/spans.rs). 0.2.0 took a mixed-sign interval for what it compared as
-- ('4000000 mons -119999999 days' as one day): such a definition gets that
-- span, in seconds, and the tables' CHECKs hold every duration from now on.
CREATE FUNCTION flow._span_ok(span interval, zero_ok boolean)
RETURNS boolean LANGUAGE c IMMUTABLE STRICT PARALLEL SAFE AS 'MODULE_PATHNAME', '_span_ok_wrapper';
CREATE FUNCTION pg_temp.kept_span(span interval) RETURNS interval LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN span IS NULL OR flow._span_ok(span, false) THEN span
                ELSE make_interval(secs => least(greatest(extract(epoch FROM span), 1), 3110400000)) END
$$;
UPDATE flow._definitions d SET
    backoff = pg_temp.kept_span(d.backoff), backoff_max = pg_temp.kept_span(d.backoff_max),
    max_elapsed = pg_temp.kept_span(d.max_elapsed), timeout = pg_temp.kept_span(d.timeout)
WHERE NOT (flow._span_ok(d.backoff, false) AND flow._span_ok(d.backoff_max, false)
           AND coalesce(flow._span_ok(d.max_elapsed, false), true) AND coalesce(flow._span_ok(d.timeout, false), true));
ALTER TABLE flow._definitions
    DROP CONSTRAINT _definitions_backoff_check,
    DROP CONSTRAINT _definitions_max_elapsed_check,
    DROP CONSTRAINT _definitions_timeout_check,
    ADD CONSTRAINT _definitions_backoff_check CHECK (flow._span_ok(backoff, false)),
    ADD CONSTRAINT _definitions_backoff_max_check CHECK (flow._span_ok(backoff_max, false)),
    ADD CONSTRAINT _definitions_max_elapsed_check CHECK (flow._span_ok(max_elapsed, false)),
    ADD CONSTRAINT _definitions_timeout_check CHECK (flow._span_ok(timeout, false));

-- Functions whose signature changed.
-- (an args check takes its owner's search_path: src/gateway.rs)
DROP FUNCTION flow._args_misfit(regtype, jsonb);

-- REASSIGN OWNED gives journal entries their new owner (sql/schema.sql).
CREATE OR REPLACE FUNCTION flow._journal_is_append_only() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('flow_internal.retiring_events', true) = 'on' THEN
        RETURN OLD;
    END IF;
    IF TG_OP = 'UPDATE' AND current_setting('flow_internal.reassigning', true) = 'on'
       AND (NEW.position, NEW.id, NEW.name, NEW.key, NEW.payload, NEW.run_id, NEW.command_id, NEW.emitted_at)
           IS NOT DISTINCT FROM
           (OLD.position, OLD.id, OLD.name, OLD.key, OLD.payload, OLD.run_id, OLD.command_id, OLD.emitted_at) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'flow: the event journal is append-only' USING ERRCODE = '55000';
END $$;
