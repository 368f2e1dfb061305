-- Table and type changes from 0.2.0 to 0.3.0 (tools/upgrade_script.py puts
-- them before the functions and views of 0.3.0, which replace the old ones).

-- Durations are kept only with no negative field and at most 100 years
-- (src/spans.rs). 0.2.0 took a mixed-sign interval for what it compared as
-- ('4000000 mons -119999999 days' as one day): such a definition gets that
-- span, in seconds, and the tables' CHECKs hold every duration from now on.
-- (flow._span_ok is created before this part, with sql/schema.sql's functions.)
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

-- (REASSIGN OWNED gives journal entries their new owner: flow._journal_is_append_only,
-- sql/schema.sql, which the script replaces before this part.)
-- (set_queue keeps what it is not given: src/api.rs, _left_out)
DROP FUNCTION flow._set_queue(oid, text, integer, boolean);
-- (recovery reads the workers' attempt records: src/recovery.rs)
DROP FUNCTION flow._recover();
DROP FUNCTION flow._stopped_in(integer, timestamptz);
-- (a leased command's run is locked at its settlement, not before it runs)
DROP FUNCTION flow._begin_batch(uuid[], uuid[]);

-- Runs past their deadline end as a whole (flow._expire_runs).
CREATE INDEX _commands_deadline ON flow._commands (deadline) WHERE finished_at IS NULL AND deadline IS NOT NULL;

-- A re-drive (flow.retry) gives a command a fresh attempt budget from here.
ALTER TABLE flow._commands ADD COLUMN attempt_base integer NOT NULL DEFAULT 0;

-- Attempts the engine voided are counted, not charged (flow._release).
ALTER TABLE flow._attempts DROP CONSTRAINT _attempts_outcome_check,
    ADD CONSTRAINT _attempts_outcome_check CHECK (outcome IN ('succeeded', 'permanent', 'retry_after', 'timeout',
        'interrupted', 'lease_lost', 'crash', 'retryable', 'cancelled', 'expired', 'voided'));
DROP FUNCTION flow._release(uuid[], uuid[]);


-- Schedules (sql/schedules.sql): each of its owner's, by name. The
-- maintenance worker fires a schedule's ticks from next_tick on, each as a
-- run keyed schedule:<name>:<tick in UTC>, and moves next_tick past them in
-- the same transaction, so a tick runs once.
CREATE TABLE flow._schedules (
    owner        regrole NOT NULL,
    name         text NOT NULL CHECK (name <> ''),
    cron         text NOT NULL,
    timezone     text NOT NULL,
    definition   text NOT NULL,
    args         jsonb NOT NULL,
    queue        text,                   -- NULL: the definition's own
    overlap      boolean NOT NULL,       -- false: a tick is skipped while the last tick's run is unfinished
    catch_up     integer NOT NULL CHECK (catch_up >= 0),
    paused       boolean NOT NULL DEFAULT false,
    next_tick    timestamptz,            -- the first unfired tick (NULL: the expression names no more)
    last_tick    timestamptz,
    last_run_id  uuid,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (owner, name)
);
CREATE INDEX _schedules_due ON flow._schedules (next_tick) WHERE NOT paused;
SELECT pg_catalog.pg_extension_config_dump('flow._schedules', '');

-- Priorities (flow._claim): lower runs first within a queue.
ALTER TABLE flow._definitions ADD COLUMN priority smallint NOT NULL DEFAULT 0;
ALTER TABLE flow._commands ADD COLUMN priority smallint NOT NULL DEFAULT 0;
ALTER TYPE flow.claimed_command ADD ATTRIBUTE priority smallint;
-- Groups (flow._claim, flow._groups_of): round-robin and group_concurrency within a queue.
ALTER TABLE flow._commands ADD COLUMN group_key text CHECK (group_key <> '' AND octet_length(group_key) <= 1024),
    ADD COLUMN group_hash bigint NOT NULL DEFAULT 0;
ALTER TYPE flow.claimed_command ADD ATTRIBUTE group_hash bigint;
DROP INDEX flow._commands_due;
CREATE INDEX _commands_due ON flow._commands
    (flow._lane(queue, CASE WHEN external THEN name ELSE '' END), priority, group_hash, next_run_at, id)
    WHERE status IN ('pending', 'waiting');
CREATE INDEX _commands_due_grouped ON flow._commands
    (flow._lane(queue, CASE WHEN external THEN name ELSE '' END), priority, next_run_at)
    WHERE status IN ('pending', 'waiting') AND group_hash <> 0;
CREATE INDEX _commands_group_running ON flow._commands (queue, group_hash) WHERE status = 'running' AND group_hash <> 0;
-- A run's unfinished children (see sql/schema.sql).
CREATE INDEX _commands_open_children ON flow._commands (run_id) WITH (deduplicate_items = off)
    WHERE finished_at IS NULL AND parent_id IS NOT NULL;
DROP FUNCTION flow._claim(integer, text[], integer, oid[], uuid[], text[], timestamptz[], uuid[], boolean);
DROP FUNCTION flow._next_due_ms(text[], timestamptz[], uuid[]);
-- (enqueue, enqueue_many, spawn and define take a priority)
DROP FUNCTION flow._plan_enqueue(oid, text, integer, text, interval, timestamptz, interval);
DROP FUNCTION flow._insert_roots(oid, text, integer, boolean, text, timestamptz, timestamptz, uuid[], jsonb[]);
DROP FUNCTION flow._enqueue(oid, text, jsonb, text, integer, text, interval, timestamptz, interval);
DROP FUNCTION flow._enqueue_many(oid, text, jsonb[], integer, text, interval, timestamptz, interval);
DROP FUNCTION flow._spawn(oid, uuid, text, jsonb, text, interval, flow.wait_spec[], interval, integer, text);
-- (a try-lock of one run is flow._try_lock_run_of's own statement)
DROP FUNCTION flow._lock_runs(uuid[], boolean);
DROP FUNCTION flow._define(oid, text, regprocedure, integer, text, integer, interval, interval, interval, interval, regtype);
DROP FUNCTION flow.define(text, regprocedure, integer, text, integer, interval, interval, interval, interval, regtype, bigint);
DROP FUNCTION flow.enqueue(text, jsonb, text, integer, text, interval, timestamptz, interval, bigint);
DROP FUNCTION flow.enqueue_many(text, jsonb[], integer, text, interval, timestamptz, interval, bigint);
DROP FUNCTION flow.spawn(text, jsonb, text, interval, flow.wait_spec[], interval, integer, text, bigint);
-- (an external claim's cursor names its priority too)
DROP FUNCTION flow._external_claim_start(text);
DROP FUNCTION flow._external_claim_ended(text, integer, text[], timestamptz[], uuid[]);

-- Rate limits (src/rate_limits.rs): at most `rate` commands of a queue start per `per`.
ALTER TABLE flow._queues ADD COLUMN rate integer CHECK (rate >= 0),
    ADD COLUMN per interval NOT NULL DEFAULT '1 second' CHECK (flow._span_ok(per, false));
ALTER TABLE flow._queues ADD COLUMN group_concurrency integer CHECK (group_concurrency >= 1);
-- The priorities and grouped priorities a queue's commands were given (see sql/schema.sql).
ALTER TABLE flow._queues
    ADD COLUMN priorities smallint[] NOT NULL DEFAULT '{0}' CHECK (0 = ANY (priorities)),
    ADD COLUMN grouped_priorities smallint[] NOT NULL DEFAULT '{}';
-- Priorities noted and not yet in their queue's row (see sql/schema.sql).
CREATE TABLE flow._priority_notes (
    queue    text NOT NULL,
    priority smallint NOT NULL,
    grouped  boolean NOT NULL
);
CREATE INDEX _priority_notes_queue ON flow._priority_notes (queue, priority);
REVOKE ALL ON flow._priority_notes FROM PUBLIC;
SELECT pg_catalog.pg_extension_config_dump('flow._priority_notes', '');
DROP FUNCTION flow.set_queue(text, integer, boolean, bigint);
