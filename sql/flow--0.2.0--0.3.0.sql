-- flow 0.2.0 -> 0.3.0. Written by tools/upgrade_script.py: edit
-- sql/upgrade/0.2.0--0.3.0.sql and the sql/*.sql it takes the code from.
\echo Use "ALTER EXTENSION flow UPDATE" to load this file. \quit

CREATE OR REPLACE FUNCTION flow._span_ok(span interval, zero_ok boolean)
RETURNS boolean LANGUAGE c IMMUTABLE STRICT PARALLEL SAFE AS 'MODULE_PATHNAME', '_span_ok_wrapper';

CREATE OR REPLACE FUNCTION flow._command_row_is_consistent(status text, attempts integer, stop_reason text,
    finished boolean, lease_token boolean, lease_expires boolean, attempt_started boolean, lease_pid boolean,
    result boolean)
RETURNS boolean LANGUAGE c IMMUTABLE PARALLEL SAFE AS 'MODULE_PATHNAME', '_command_row_is_consistent_wrapper';

CREATE OR REPLACE FUNCTION flow._lane(queue text, claimant text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pg_catalog.hashtextextended(claimant, pg_catalog.hashtextextended(queue, 0))
$$;

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

-- src/lib.rs:59
-- requires:
--   schema

-- flow's engine SQL, one file per service (sql/common.sql first, then
-- definitions, enqueue, claim, settle, recover, retention, workflows,
-- external; src/lib.rs loads them in that order). This one: what they share.
--
-- The conventions every engine statement follows (function security,
-- search_path pinning, the hot path's planner settings, status-as-text
-- lookups, `= ANY (ARRAY[...])` joins, tid joins) are in docs/DESIGN.md,
-- section 5, each with the measurement that made it one.

CREATE OR REPLACE FUNCTION flow._require_name(what text, value text) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF value IS NULL OR btrim(value) = '' THEN
        RAISE EXCEPTION 'flow: % must not be NULL or empty', what USING ERRCODE = 'FL002';
    END IF;
    RETURN flow._require_short(what, value);
END $$;

-- Names and keys are indexed: at most 1 KiB of UTF-8 each (two fit in one index entry).
-- (inlined where it is called from SQL)
CREATE OR REPLACE FUNCTION flow._short_enough(value text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT value IS NULL OR octet_length(value) <= 1024
$$;

CREATE OR REPLACE FUNCTION flow._require_short(what text, value text) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF NOT flow._short_enough(value) THEN
        RAISE EXCEPTION 'flow: % is % bytes, over 1024', what, octet_length(value) USING ERRCODE = 'FL002';
    END IF;
    RETURN value;
END $$;

-- args and payloads: a JSON object within flow.max_result_bytes.
CREATE OR REPLACE FUNCTION flow._require_payload(what text, value jsonb, must_be_object boolean DEFAULT true)
RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    size integer;
BEGIN
    IF value IS NULL OR (must_be_object AND jsonb_typeof(value) <> 'object') THEN
        RAISE EXCEPTION 'flow: % must be a JSON object, got %', what, coalesce(jsonb_typeof(value), 'NULL')
            USING ERRCODE = 'FL003';
    END IF;
    size := octet_length(value::text);
    IF size > flow._max_payload_bytes() THEN
        RAISE EXCEPTION 'flow: % is % bytes, over flow.max_result_bytes (% bytes)',
            what, size, flow._max_payload_bytes() USING ERRCODE = 'FL004';
    END IF;
    RETURN value;
END $$;

CREATE OR REPLACE FUNCTION flow._require_member(caller oid, owner oid, what text, id uuid) RETURNS void
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- Another role's run is reported exactly like a missing one: no existence leak.
    IF owner IS NULL OR NOT pg_has_role(caller, owner, 'MEMBER') THEN
        RAISE EXCEPTION 'flow: no % with id %', what, id USING ERRCODE = 'FL014';
    END IF;
END $$;

-- What every claim of a command records when it comes from `waiting` (its
-- waits timed out: `within` passed): max_elapsed counts from when a command
-- first became due, so the budget of its first attempt starts then, and its
-- handler is told the wait timed out. (LANGUAGE sql with no SET clause, so
-- the planner inlines them into the statements of the claim and settlement
-- paths; those pin search_path, and only the extension owner may call these.)
CREATE OR REPLACE FUNCTION flow._budget_start(status flow.command_status, attempts integer, next_run_at timestamptz,
    budget_started_at timestamptz) RETURNS timestamptz
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN status = 'waiting' AND attempts = 0 THEN next_run_at ELSE budget_started_at END
$$;

CREATE OR REPLACE FUNCTION flow._wait_timed_out(status flow.command_status, wait_timed_out boolean) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT wait_timed_out OR status = 'waiting'
$$;

-- All commands, in two parts the planner can find by run: roots made by
-- 0.2.0 on (id = run_id: a filter on run_id is one on the primary key too)
-- and the others (index _commands_run_key, whose predicate the second part
-- repeats as written). What reads commands by run reads them through this
-- (the views, and flow._commands_of), so "WHERE run_id = ..." never scans.
CREATE OR REPLACE VIEW flow._command_rows AS
SELECT * FROM flow._commands c WHERE c.id = c.run_id
UNION ALL
SELECT * FROM flow._commands c WHERE c.id <> c.run_id;

-- The commands of a run, for the engine's own statements. (LANGUAGE sql,
-- STABLE, no SET clause: inlined into the statements that use it, as two
-- index scans.) Give it a parameter or a correlated outer value, never a
-- lateral join's column (FROM x, flow._commands_of(x.id)): there its filter
-- is a join clause, which the planner does not push into the view's two
-- parts, and all of _commands is read (see flow._prune).
CREATE OR REPLACE FUNCTION flow._commands_of(run_id uuid) RETURNS SETOF flow._commands
LANGUAGE sql STABLE AS $$
    SELECT * FROM flow._command_rows c WHERE c.run_id = _commands_of.run_id
$$;

-- All runs as they stand, with _runs' columns in its order: those with a row
-- and those without (see flow._runs). A run whose root
-- succeeded with no child ended with it, and its end is on the root's row
-- alone: the settlement of such a root (the common run: one command) writes
-- the command and not the run, whose row stays as enqueue wrote it, status
-- 'running' (sql/settle.sql; one row version less per command). So what
-- reads a run's status, result or end reads it here; _runs is for writers,
-- and for what does not look at those three columns. (Roots made before
-- 0.2.0 have ids of their own; their runs are still written when they end.)
-- "A root with no child" (alone) is one clause, written out in each place
-- that makes the test and marked there (docs/DESIGN.md, "alone", says where
-- and why it is not a function); pg_test/test_sources.py holds the copies
-- to it.
CREATE OR REPLACE VIEW flow._run_rows AS
SELECT r.id, r.key, r.owner, r.name, r.version, r.queue, r.args,
       coalesce(alone.status, r.status) AS status, coalesce(alone.result, r.result) AS result, r.error,
       r.deadline, r.created_at, coalesce(alone.finished_at, r.finished_at) AS finished_at
FROM flow._runs r LEFT JOIN LATERAL (
    SELECT 'succeeded'::flow.run_status AS status, c.result, c.finished_at
    FROM flow._commands c
    WHERE r.status = 'running' AND c.id = r.id AND c.status::text = 'succeeded'   -- by id (above)
      AND NOT EXISTS (SELECT 1 FROM flow._commands k WHERE k.parent_id = c.id)  -- alone: docs/DESIGN.md
) alone ON true
UNION ALL
-- A run without a row (see flow._runs) is its root, which has no child: a
-- failure or a cancel gives the run its row, so such a root is unfinished or
-- succeeded (the other two are mapped, should one ever be seen).
SELECT c.id, NULL::text, c.owner, c.name, c.version, c.queue, c.args,
       CASE c.status::text WHEN 'succeeded' THEN 'succeeded' WHEN 'failed' THEN 'failed'
                           WHEN 'cancelled' THEN 'cancelled' ELSE 'running' END::flow.run_status,
       c.result, NULL::jsonb, c.deadline, c.created_at, c.finished_at
FROM flow._commands c
WHERE c.id = c.run_id AND NOT EXISTS (SELECT 1 FROM flow._runs r WHERE r.id = c.id);

-- The lanes of each queue (see _commands_due in sql/schema.sql): in-database
-- workers' ('') and each external definition's (a command is external as
-- its definition is, kept so by flow._define). What counts or looks for a
-- queue's due commands (flow.queues, flow._drop_queue) reads them lane by lane.
CREATE OR REPLACE VIEW flow._queue_lanes AS
SELECT q.name AS queue, flow._lane(q.name, n.claimant) AS lane
FROM flow._queues q
CROSS JOIN (SELECT '' UNION SELECT d.name FROM flow._definitions d WHERE d.handler IS NULL) n(claimant);

-- Give a run without a row its row (see flow._runs), as enqueue would have
-- written it, from its root; a run that has one keeps it. The caller holds
-- the root's row lock (the chunk or client running the root, a cancel or a
-- settlement that locked it), so two callers never insert it at once.
-- (flow._lease writes the same row for the roots it leases, in its statement.)
CREATE OR REPLACE FUNCTION flow._run_row_needed(run_id uuid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO flow._runs (id, owner, name, version, queue, args, deadline, created_at)
    SELECT c.id, c.owner, c.name, c.version, c.queue, c.args, c.deadline, c.created_at
    FROM flow._commands c WHERE c.id = _run_row_needed.run_id
    ON CONFLICT (id) DO NOTHING;
END $$;

-- src/lib.rs:60
-- requires:
--   common

-- Definitions and queues: define, grants, queue settings and ownership.

-- Durations flow keeps or adds to timestamps: no field negative (a month, a
-- day and a microsecond are not comparable, so mixed signs have no meaning:
-- '4000000 mons -119999999 days' compares as one day and overflows any
-- timestamp it is added to), some field positive (or all zero where
-- zero_ok), and at most 100 years as PostgreSQL compares intervals (a month
-- as 30 days), so every field is bounded too (flow._span_ok,
-- src/spans.rs). No timestamp arithmetic in the claim, the settlement or
-- recovery can then overflow on one command's account; the tables' CHECKs
-- hold it for every row (sql/schema.sql).
CREATE OR REPLACE FUNCTION flow._require_span(what text, value interval, zero_ok boolean DEFAULT false,
    code text DEFAULT 'FL005')
RETURNS interval
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF NOT flow._span_ok(value, zero_ok) THEN
        RAISE EXCEPTION 'flow: % must be %positive, with no negative field, and at most 100 years, got %',
            what, CASE WHEN zero_ok THEN 'zero or ' ELSE '' END, value USING ERRCODE = code;
    END IF;
    RETURN value;
END $$;

-- The search_path a role's own session would start with in this database:
-- its setting for this database (ALTER ROLE ... IN DATABASE ... SET), its
-- own (ALTER ROLE ... SET), the database's (ALTER DATABASE ... SET), in that
-- order; NULL when none sets one. The gateway gives it to the role's
-- handlers and args checks ("$user" alone for NULL: src/gateway.rs).
CREATE OR REPLACE FUNCTION flow._search_path_of(role oid) RETURNS text
-- (plpgsql, not sql: its plan is kept per session; an sql function with a
-- SET clause is parsed and planned again at every call, 0.25 ms a chunk)
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (SELECT substr(c.setting, length('search_path=') + 1)
            FROM pg_db_role_setting s CROSS JOIN LATERAL unnest(s.setconfig) AS c(setting)
            WHERE s.setrole IN (0, _search_path_of.role)
              AND s.setdatabase IN (0, (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()))
              AND (s.setrole <> 0 OR s.setdatabase <> 0)
              AND c.setting LIKE 'search\_path=%'
            ORDER BY s.setrole <> 0 DESC, s.setdatabase <> 0 DESC
            LIMIT 1);
END $$;

-- A role named in a grant: 'PUBLIC' (any case) or an existing role.
CREATE OR REPLACE FUNCTION flow._grantee(role text) RETURNS regrole
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    found regrole;
BEGIN
    PERFORM flow._require_name('role', role);
    IF lower(role) = 'public' THEN
        RETURN '-'::regrole;                 -- OID 0: everyone
    END IF;
    SELECT r.oid::regrole INTO found FROM pg_roles r WHERE r.rolname = role;   -- exact name, no quoting
    IF found IS NULL THEN
        RAISE EXCEPTION 'flow: no role named %', role USING ERRCODE = '42704';
    END IF;
    RETURN found;
END $$;

-- Whether `caller` is one of `roles` or a member of one ('-' is PUBLIC).
-- (Executable by everyone: the flow.queues view calls it as its reader.)
CREATE OR REPLACE FUNCTION flow._among(caller oid, roles regrole[]) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM unnest(roles) g WHERE g::oid = 0::oid OR pg_has_role(caller, g, 'MEMBER'))
$$;

-- A grant list with `grantee` added (allow) or removed.
CREATE OR REPLACE FUNCTION flow._granted(roles regrole[], grantee regrole, allow boolean) RETURNS regrole[]
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN allow THEN (SELECT array_agg(DISTINCT g) FROM unnest(roles || grantee) g)
                ELSE array_remove(roles, grantee) END
$$;

-- A queue row, created on first use: owned by its creator, except 'default',
-- which belongs to no role (superusers manage it) and is open to everyone.
CREATE OR REPLACE FUNCTION flow._queue(caller oid, name text, for_update boolean DEFAULT false) RETURNS flow._queues
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q flow._queues;
BEGIN
    PERFORM flow._require_name('queue', name);
    SELECT * INTO q FROM flow._queues x WHERE x.name = _queue.name;
    IF NOT FOUND AND name LIKE 'role:%' AND name <> flow._own_queue(caller)
       AND NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = caller) THEN
        RAISE EXCEPTION 'flow: queue % is another role''s own queue (names starting with "role:" are reserved)', name
            USING ERRCODE = 'FL011', HINT = 'Name no queue to use your own, or choose another name.';
    END IF;
    IF NOT FOUND AND name <> 'default' AND NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = caller)
       AND (SELECT count(*) FROM flow._queues x WHERE x.owner = caller)
           >= current_setting('flow.max_queues_per_role')::integer THEN
        -- every queue costs each claim a probe: one role cannot slow everyone's
        RAISE EXCEPTION 'flow: role % owns flow.max_queues_per_role (%) queues already', caller::regrole,
            current_setting('flow.max_queues_per_role') USING ERRCODE = 'FL018';
    END IF;
    IF NOT FOUND OR for_update THEN
        INSERT INTO flow._queues (name, owner, users)
        VALUES (name, CASE WHEN name = 'default' THEN NULL ELSE caller END,
                CASE WHEN name = 'default' THEN '{-}' ELSE '{}' END::regrole[])
        ON CONFLICT DO NOTHING;
        IF FOUND AND name <> 'default' THEN
            PERFORM flow._mark_owner(caller);
        END IF;
        IF for_update THEN
            SELECT * INTO q FROM flow._queues x WHERE x.name = _queue.name FOR NO KEY UPDATE;
        ELSE
            SELECT * INTO q FROM flow._queues x WHERE x.name = _queue.name;
        END IF;
    END IF;
    RETURN q;
END $$;

-- Where a role's definitions go when they name no queue: its own queue,
-- 'role:<name>' (superusers: 'default'). Roles never share a lane unless
-- they choose to, so one role's backlog cannot hold up another's: queues are
-- served round-robin, while one queue runs in due order whoever enqueued.
CREATE OR REPLACE FUNCTION flow._own_queue(caller oid) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN r.rolsuper THEN 'default' ELSE 'role:' || r.rolname END FROM pg_roles r WHERE r.oid = caller
$$;

-- Hold a queue a definition or a command is being put in until the
-- transaction ends: flow.drop_queue waits for the transactions that hold it
-- to commit before it looks for what uses the queue, and one that comes
-- after a drop sees the queue gone (a command or definition put in a
-- dropped queue would never run: claims read the queues there are). Raises
-- 40001 (try again) when the queue was dropped meanwhile: a definition
-- moved to another queue, whose old one was dropped while this enqueue had
-- read it, runs in its new queue at the next try. Returns the queue's name.
-- (No SET clause, as flow._plan_enqueue, which calls it for every enqueue and
-- spawn: its callers pin search_path; a SET costs each call a walk of every
-- setting when it ends.)
CREATE OR REPLACE FUNCTION flow._hold_queue(name text) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM flow._lock_queue_name(_hold_queue.name, false);
    -- (after the lock: a statement of its own, whose snapshot sees a drop
    -- that committed before; a transaction that keeps its snapshot reads the
    -- row as it now is by locking it, and gets 40001 if it was deleted since)
    IF current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM 1 FROM flow._queues x WHERE x.name = _hold_queue.name;
    ELSE
        PERFORM 1 FROM flow._queues x WHERE x.name = _hold_queue.name FOR KEY SHARE;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'flow: queue % was dropped meanwhile', _hold_queue.name USING ERRCODE = '40001',
            HINT = 'Try again.';
    END IF;
    RETURN _hold_queue.name;
END $$;

-- Who may put commands in a queue: its owner's members and the roles it was
-- granted to (flow._use_queue; a re-drive, flow._retry).
CREATE OR REPLACE FUNCTION flow._may_use_queue(caller oid, q flow._queues) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(pg_has_role(caller, q.owner, 'MEMBER'), false) OR flow._among(caller, q.users)
$$;

-- Put commands in a queue: its owner's members and the roles it was granted to.
CREATE OR REPLACE FUNCTION flow._use_queue(caller oid, name text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q flow._queues := flow._queue(caller, name);
BEGIN
    IF NOT flow._may_use_queue(caller, q) THEN
        RAISE EXCEPTION 'flow: queue % belongs to another role', name USING ERRCODE = 'FL011',
            HINT = 'Use a queue of your own, or ask its owner for flow.grant_queue().';
    END IF;
    RETURN flow._hold_queue(q.name);
END $$;

-- Manage a queue (limit, pause, grants): its owner's members; 'default': superusers.
CREATE OR REPLACE FUNCTION flow._manage_queue(caller oid, name text) RETURNS flow._queues
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q flow._queues := flow._queue(caller, name, for_update => true);
    allowed boolean := CASE WHEN q.owner IS NULL THEN (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = caller)
                            ELSE pg_has_role(caller, q.owner, 'MEMBER') END;
BEGIN
    IF NOT allowed THEN
        RAISE EXCEPTION 'flow: queue % belongs to another role', name USING ERRCODE = 'FL011';
    END IF;
    RETURN q;
END $$;

-- Why args do not fit an args_type (NULL: they fit). A composite type takes
-- a JSON object whose keys are its attributes and whose values convert
-- (jsonb_populate_record); a domain over jsonb takes what its checks allow.
-- Called only through the gateway (src/gateway.rs, check_args), as the
-- definition's owner: its own statements run under the pinned path, the
-- owner's code (the domain's checks, the columns' types) under `path`, the
-- owner's own search_path. (Executable by PUBLIC: it runs as its caller.)
CREATE OR REPLACE FUNCTION flow._args_misfit(args_type regtype, args jsonb, path text) RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    t pg_type;
    unknown text;
    -- (the type's name as the pinned path prints it: qualified wherever it
    -- is not in pg_catalog, so the owner's path cannot change what it names)
    cast_sql text;
BEGIN
    SELECT * INTO t FROM pg_type WHERE oid = args_type;
    IF t.typtype = 'c' THEN
        SELECT k INTO unknown FROM jsonb_object_keys(args) k
        WHERE NOT EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = t.typrelid AND a.attname = k
                          AND a.attnum > 0 AND NOT a.attisdropped)
        LIMIT 1;
        IF FOUND THEN
            RETURN format('%s has no attribute %s', args_type, unknown);
        END IF;
        cast_sql := format('SELECT pg_catalog.jsonb_populate_record(NULL::%s, $1)', args_type);
    ELSE
        cast_sql := format('SELECT $1::%s', args_type);
    END IF;
    PERFORM set_config('search_path', coalesce(path, '"$user"'), true);
    EXECUTE cast_sql USING args;
    RETURN NULL;
EXCEPTION WHEN data_exception OR integrity_constraint_violation OR check_violation THEN
    RETURN SQLERRM;
END $$;

CREATE OR REPLACE FUNCTION flow._require_args_fit(name text, owner oid, args_type regtype, args jsonb) RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    misfit text := CASE WHEN args_type IS NOT NULL THEN flow._args_misfit_as(owner, args_type, args::text) END;
BEGIN
    IF misfit IS NOT NULL THEN
        RAISE EXCEPTION 'flow: args do not fit % of definition %: %', args_type, name, misfit
            USING ERRCODE = 'FL019';
    END IF;
END $$;

CREATE OR REPLACE FUNCTION flow._define(caller oid, name text, handler regprocedure, version integer, queue text,
    max_attempts integer, backoff interval, backoff_max interval, max_elapsed interval, timeout interval,
    args_type regtype, priority integer)
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    fn record;
    takes_context boolean := false;
    named flow._definition_names;
BEGIN
    PERFORM flow._require_name('name', name);
    queue := flow._require_name('queue', coalesce(queue, flow._own_queue(caller)));
    IF version IS NULL OR version < 1 THEN
        RAISE EXCEPTION 'flow: version must be 1 or more, got %', version USING ERRCODE = 'FL015';
    END IF;
    IF max_attempts IS NULL OR max_attempts < 1 THEN
        RAISE EXCEPTION 'flow: max_attempts must be 1 or more, got %', max_attempts USING ERRCODE = 'FL015';
    END IF;
    IF backoff IS NULL OR backoff_max IS NULL OR backoff_max < backoff THEN
        RAISE EXCEPTION 'flow: backoff must be positive and at most backoff_max (got % and %)', backoff, backoff_max
            USING ERRCODE = 'FL015';
    END IF;
    PERFORM flow._require_span('backoff', backoff, code => 'FL015');
    PERFORM flow._require_span('backoff_max', backoff_max, code => 'FL015');
    PERFORM flow._require_span('max_elapsed', max_elapsed, code => 'FL015');
    PERFORM flow._require_span('timeout', timeout, code => 'FL015');
    IF args_type IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM pg_type t WHERE t.oid = args_type
          AND (t.typtype = 'c' OR (t.typtype = 'd' AND t.typbasetype = 'pg_catalog.jsonb'::regtype))) THEN
        RAISE EXCEPTION 'flow: args_type % must be a composite type or a domain over jsonb', args_type
            USING ERRCODE = 'FL015';
    END IF;
    IF args_type IS NOT NULL AND NOT has_type_privilege(caller, args_type, 'USAGE') THEN
        RAISE EXCEPTION 'flow: role % may not use type %', caller::regrole, args_type USING ERRCODE = '42501';
    END IF;
    IF handler IS NOT NULL THEN
        SELECT p.pronargs, p.proargtypes, p.prorettype, p.prokind, p.proretset,
               n.nspname ~ '^pg_(toast_)?temp_' AS temporary INTO fn
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE p.oid = handler;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'flow: handler % does not exist', handler USING ERRCODE = '42883';
        END IF;
        IF fn.prokind <> 'f' OR fn.proretset
           OR fn.prorettype NOT IN ('pg_catalog.jsonb'::regtype, 'pg_catalog.void'::regtype)
           OR fn.pronargs NOT IN (1, 2)
           OR fn.proargtypes[0] <> 'pg_catalog.jsonb'::regtype
           OR (fn.pronargs = 2 AND fn.proargtypes[1] <> 'flow.context'::regtype) THEN
            RAISE EXCEPTION 'flow: handler % has the wrong signature', handler::text
                USING ERRCODE = 'FL008',
                      HINT = 'A handler is a function (args jsonb) or (args jsonb, ctx flow.context) returning jsonb or void.';
        END IF;
        IF fn.temporary THEN
            RAISE EXCEPTION 'flow: handler % is a temporary function; it ends with its session', handler::text
                USING ERRCODE = 'FL008';
        END IF;
        takes_context := fn.pronargs = 2;
        IF NOT has_function_privilege(caller, handler, 'EXECUTE') THEN
            RAISE EXCEPTION 'flow: role % may not execute handler %', caller::regrole, handler::text
                USING ERRCODE = '42501';
        END IF;
    END IF;

    -- The name belongs to its first definer. Its row is locked before anything
    -- else is checked, so a concurrent define of the same name waits here and
    -- then sees who owns it: no role can slip its handler under another's name.
    INSERT INTO flow._definition_names AS n (name, owner) VALUES (name, caller) ON CONFLICT DO NOTHING;
    SELECT * INTO named FROM flow._definition_names n WHERE n.name = _define.name FOR UPDATE;
    IF NOT pg_has_role(caller, named.owner, 'MEMBER') THEN
        RAISE EXCEPTION 'flow: the definition name % is taken by another role', name USING ERRCODE = 'FL011';
    END IF;
    PERFORM flow._mark_owner(named.owner);
    IF cardinality(named.starters) > 0 AND handler = 'flow.run_sql(pg_catalog.jsonb)'::regprocedure THEN
        RAISE EXCEPTION 'flow: definition % is open to other roles; it cannot run flow.run_sql', name
            USING ERRCODE = '42501';
    END IF;
    PERFORM flow._use_queue(caller, queue);
    IF priority IS NULL THEN
        RAISE EXCEPTION 'flow: priority must not be NULL (0 is the default)' USING ERRCODE = '22004';
    END IF;
    PERFORM flow._priority(priority, 0::smallint);
    INSERT INTO flow._definitions AS d (name, version, handler, takes_context, owner, queue,
        max_attempts, backoff, backoff_max, max_elapsed, timeout, args_type, priority)
    VALUES (name, version, handler, takes_context, named.owner, queue,
        max_attempts, backoff, backoff_max, max_elapsed, timeout, args_type, priority)
    ON CONFLICT ON CONSTRAINT _definitions_pkey DO UPDATE SET
        handler = excluded.handler, takes_context = excluded.takes_context, queue = excluded.queue,
        max_attempts = excluded.max_attempts, backoff = excluded.backoff,
        backoff_max = excluded.backoff_max, max_elapsed = excluded.max_elapsed,
        timeout = excluded.timeout, args_type = excluded.args_type, priority = excluded.priority,
        updated_at = now();
    -- A version redefined with or without a handler changes who runs its
    -- commands still to come (rare: a scan of the unfinished commands is fine).
    UPDATE flow._commands c SET external = (handler IS NULL)
    WHERE c.name = _define.name AND c.version = _define.version
      AND c.status IN ('pending', 'waiting') AND c.external <> (handler IS NULL);
END $$;

-- Open a definition (every version) to another role, or close it again.
-- flow.run_sql definitions stay their owner's: they run any SQL as the owner.
CREATE OR REPLACE FUNCTION flow._grant_definition(caller oid, name text, role text, allow boolean) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    named flow._definition_names;
    grantee regrole := flow._grantee(role);
BEGIN
    PERFORM flow._require_name('name', name);
    SELECT * INTO named FROM flow._definition_names n WHERE n.name = _grant_definition.name FOR UPDATE;
    IF NOT FOUND OR NOT pg_has_role(caller, named.owner, 'MEMBER') THEN
        RAISE EXCEPTION 'flow: no definition named %', name USING ERRCODE = 'FL001';
    END IF;
    IF allow AND EXISTS (SELECT 1 FROM flow._definitions d WHERE d.name = named.name
                         AND d.handler = 'flow.run_sql(pg_catalog.jsonb)'::regprocedure) THEN
        RAISE EXCEPTION 'flow: definition % runs flow.run_sql; it cannot be opened to other roles', name
            USING ERRCODE = '42501', HINT = 'Its SQL runs as its owner: let the other role define its own.';
    END IF;
    UPDATE flow._definition_names n SET starters = flow._granted(n.starters, grantee, allow)
    WHERE n.name = named.name;
END $$;

CREATE OR REPLACE FUNCTION flow._grant_queue(caller oid, name text, role text, allow boolean) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    grantee regrole := flow._grantee(role);
    q flow._queues := flow._manage_queue(caller, name);
BEGIN
    UPDATE flow._queues x SET users = flow._granted(x.users, grantee, allow), updated_at = now()
    WHERE x.name = q.name;
END $$;

-- Set a queue's options; those the caller left out (`left_out`: see
-- flow._left_out) keep their values, and so does a NULL paused.
CREATE OR REPLACE FUNCTION flow._set_queue(caller oid, name text, concurrency integer, paused boolean, rate integer,
    per interval, group_concurrency integer, left_out text[])
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q flow._queues;
BEGIN
    IF concurrency IS NOT NULL AND concurrency < 1 THEN
        RAISE EXCEPTION 'flow: queue concurrency must be 1 or more (NULL for no limit), got %', concurrency
            USING ERRCODE = 'FL009';
    END IF;
    IF group_concurrency IS NOT NULL AND group_concurrency < 1 THEN
        RAISE EXCEPTION 'flow: queue group_concurrency must be 1 or more (NULL for no limit), got %', group_concurrency
            USING ERRCODE = 'FL009';
    END IF;
    IF rate IS NOT NULL AND rate < 0 THEN
        RAISE EXCEPTION 'flow: queue rate must be 0 or more (NULL for no limit, 0 to start none), got %', rate
            USING ERRCODE = 'FL009';
    END IF;
    IF NOT ('per' = ANY (left_out)) AND (per IS NULL OR NOT flow._span_ok(per, false)
                                         OR extract(epoch FROM per) * 1000000 < coalesce(rate, 1)) THEN
        RAISE EXCEPTION 'flow: queue rate''s per must be a positive interval of at most 100 years, and at least a microsecond per command, got %',
            coalesce(per::text, 'NULL') USING ERRCODE = 'FL009';
    END IF;
    q := flow._manage_queue(caller, name);
    UPDATE flow._queues x SET
        concurrency = CASE WHEN 'concurrency' = ANY (left_out) THEN x.concurrency ELSE _set_queue.concurrency END,
        rate = CASE WHEN 'rate' = ANY (left_out) THEN x.rate ELSE _set_queue.rate END,
        per = CASE WHEN 'per' = ANY (left_out) THEN x.per ELSE _set_queue.per END,
        group_concurrency = CASE WHEN 'group_concurrency' = ANY (left_out) THEN x.group_concurrency
                                 ELSE _set_queue.group_concurrency END,
        paused = coalesce(_set_queue.paused, x.paused),
        updated_at = now()
    WHERE x.name = q.name;
    PERFORM flow._wake();
END $$;

-- Drop a queue no definition and no unfinished command uses (its managers
-- only; false: there is no such queue). Its finished commands keep its name.
CREATE OR REPLACE FUNCTION flow._drop_queue(caller oid, name text) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q flow._queues;
BEGIN
    -- It must see what the enqueues and defines it waits for wrote (below):
    -- a transaction's own older snapshot (REPEATABLE READ, SERIALIZABLE) would
    -- not, and drop a queue a command was just put in.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'flow: drop_queue needs a READ COMMITTED transaction, not %',
            current_setting('transaction_isolation')
            USING ERRCODE = '0A000', HINT = 'It must see what concurrent enqueues into the queue committed.';
    END IF;
    PERFORM flow._require_name('queue', name);
    IF NOT EXISTS (SELECT 1 FROM flow._queues x WHERE x.name = _drop_queue.name) THEN
        RETURN false;
    END IF;
    q := flow._manage_queue(caller, name);   -- checks the caller
    -- waits for the enqueues and defines that put something in the queue to
    -- commit (flow._hold_queue), so the checks below see what they wrote, and
    -- holds off those that come after until the queue is gone
    PERFORM flow._lock_queue_name(q.name, true);
    IF EXISTS (SELECT 1 FROM flow._definitions d WHERE d.queue = q.name)
       OR EXISTS (SELECT 1 FROM flow._commands c                      -- index _commands_due
                  WHERE flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END)
                            = ANY (ARRAY(SELECT l.lane FROM flow._queue_lanes l WHERE l.queue = q.name))
                    AND c.queue = q.name AND c.status IN ('pending', 'waiting'))
       OR EXISTS (SELECT 1 FROM flow._commands c                      -- index _commands_running
                  WHERE c.queue = q.name AND c.status = 'running') THEN
        RAISE EXCEPTION 'flow: queue % is still used by definitions or unfinished commands', name
            USING ERRCODE = '2BP01';
    END IF;
    DELETE FROM flow._queues x WHERE x.name = q.name;
    -- (its priorities not yet added: a queue made again by that name starts with none)
    DELETE FROM flow._priority_notes n WHERE n.queue = q.name;
    IF q.owner IS NOT NULL AND NOT flow._owns_anything(q.owner) THEN
        PERFORM flow._unmark_owner(q.owner);
    END IF;
    RETURN true;
END $$;

-- REASSIGN OWNED BY ... TO ... moves flow's ownership too (src/roles.rs calls
-- this after PostgreSQL checked the caller may act for both roles).
CREATE OR REPLACE FUNCTION flow._reassign_owned(old_roles oid[], new_role oid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE flow._definition_names n SET owner = new_role WHERE n.owner = ANY (old_roles);
    UPDATE flow._definitions d SET owner = new_role WHERE d.owner = ANY (old_roles);
    UPDATE flow._queues q SET owner = new_role WHERE q.owner = ANY (old_roles);
    -- (a schedule's name is its owner's: the new role may not have one of the same name)
    IF EXISTS (SELECT 1 FROM flow._schedules s JOIN flow._schedules t ON t.name = s.name
               WHERE s.owner = ANY (old_roles) AND t.owner = new_role AND NOT (t.owner = ANY (old_roles))) THEN
        RAISE EXCEPTION 'flow: role % has a schedule of the same name as one of the roles reassigned', new_role::regrole
            USING ERRCODE = '2BP01', HINT = 'Rename or unschedule one of them first.';
    END IF;
    UPDATE flow._schedules s SET owner = new_role WHERE s.owner = ANY (old_roles);
    UPDATE flow._runs r SET owner = new_role WHERE r.owner = ANY (old_roles);
    UPDATE flow._commands c SET owner = new_role WHERE c.owner = ANY (old_roles);
    -- (the journal lets an entry change its owner only so: sql/schema.sql)
    PERFORM set_config('flow_internal.reassigning', 'on', true);
    UPDATE flow._events e SET owner = new_role WHERE e.owner = ANY (old_roles);
    PERFORM set_config('flow_internal.reassigning', 'off', true);
    PERFORM flow._mark_owner(new_role);
    -- the old roles own nothing of flow here any more (see _mark_owner)
    PERFORM flow._unmark_owner(old) FROM unnest(old_roles) old;
END $$;

-- Make PostgreSQL's own dependency tracking see that `role` owns flow
-- objects in this database, so DROP ROLE run from another database (where
-- flow's hook cannot look into these tables) fails as it does for a role
-- that owns tables here: an explicit USAGE grant on schema flow (PUBLIC has
-- it anyway, so it gives nothing) is recorded in pg_shdepend. Superusers,
-- and the schema's owner, are not marked.
CREATE OR REPLACE FUNCTION flow._mark_owner(role oid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF role IS NULL OR (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = role)
       OR EXISTS (SELECT 1 FROM pg_namespace n WHERE n.nspname = 'flow'
                  AND (n.nspowner = role OR EXISTS (SELECT 1 FROM aclexplode(n.nspacl) a WHERE a.grantee = role))) THEN
        RETURN;
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA flow TO %s', role::regrole);
END $$;

CREATE OR REPLACE FUNCTION flow._unmark_owner(role oid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_namespace n, aclexplode(n.nspacl) a WHERE n.nspname = 'flow' AND a.grantee = role) THEN
        EXECUTE format('REVOKE USAGE ON SCHEMA flow FROM %s', role::regrole);
    END IF;
END $$;

-- What keeps DROP ROLE from leaving flow objects with a dangling owner: the
-- role still owns definitions, queues, schedules or unfinished runs here.
-- (Runs are not indexed by owner, see sql/schema.sql: this reads the runs
-- table, kept small by flow.retention; DROP ROLE and flow.drop_queue are rare.)
CREATE OR REPLACE FUNCTION flow._owns_anything(role oid) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM flow._definition_names n WHERE n.owner = role)
        OR EXISTS (SELECT 1 FROM flow._queues q WHERE q.owner = role)
        OR EXISTS (SELECT 1 FROM flow._schedules s WHERE s.owner = role)
        OR EXISTS (SELECT 1 FROM flow._run_rows r WHERE r.owner = role AND r.status = 'running')
$$;

-- src/lib.rs:61
-- requires:
--   definitions

-- Enqueue: starting runs (one, or many in one statement).

-- What enqueue, enqueue_many and spawn share: resolve the definition (its
-- newest version unless one is named), check that the caller may start it,
-- the schedule and the queue. The checks are inline, and the definition
-- comes back as scalars: each nested PL/pgSQL call, and a composite passed
-- or returned above all, costs microseconds, and a single flow.enqueue was
-- half such calls.
CREATE OR REPLACE FUNCTION flow._plan_enqueue(caller oid, name text, version integer, queue text, start_after interval,
    run_at timestamptz, deadline interval,
    OUT def_version integer, OUT def_owner oid, OUT def_external boolean, OUT def_args_type regtype,
    OUT lane text, OUT due timestamptz, OUT ends timestamptz, OUT def_priority smallint)
LANGUAGE plpgsql AS $$
DECLARE
    home text;   -- the definition's own queue
BEGIN
    PERFORM flow._require_name('name', name);
    SELECT x.version, x.owner, x.handler IS NULL, x.args_type, x.queue, x.priority
    INTO def_version, def_owner, def_external, def_args_type, home, def_priority
    FROM flow._definitions x
    WHERE x.name = _plan_enqueue.name AND (_plan_enqueue.version IS NULL OR x.version = _plan_enqueue.version)
    ORDER BY x.version DESC LIMIT 1;
    IF NOT FOUND THEN
        IF version IS NULL THEN
            RAISE EXCEPTION 'flow: no definition named %', name USING ERRCODE = 'FL001';
        END IF;
        RAISE EXCEPTION 'flow: definition % has no version %', name, version USING ERRCODE = 'FL001';
    END IF;
    -- Who may start commands of a definition: its owner's members, and the
    -- roles its owner opened it to (flow.grant_definition). To anyone else it
    -- does not exist: the same FL001 as an unknown name, so names cannot be probed.
    IF NOT (pg_has_role(caller, def_owner, 'MEMBER')
            OR EXISTS (SELECT 1 FROM flow._definition_names n
                       WHERE n.name = _plan_enqueue.name AND flow._among(caller, n.starters))) THEN
        RAISE EXCEPTION 'flow: no definition named %', name USING ERRCODE = 'FL001';
    END IF;
    -- When the new command is first due: from start_after or run_at, not both.
    IF start_after IS NOT NULL THEN
        IF run_at IS NOT NULL THEN
            RAISE EXCEPTION 'flow: give start_after or run_at, not both' USING ERRCODE = 'FL006';
        END IF;
        PERFORM flow._require_span('start_after', start_after, zero_ok => true);
    END IF;
    IF NOT isfinite(run_at) OR run_at > now() + interval '100 years' THEN
        RAISE EXCEPTION 'flow: run_at must be a finite time within 100 years, got %', run_at USING ERRCODE = 'FL005';
    END IF;
    due := greatest(now(), coalesce(run_at, now() + coalesce(start_after, interval '0')));
    IF deadline IS NOT NULL THEN
        IF deadline <= interval '0' THEN
            RAISE EXCEPTION 'flow: deadline % is already past', deadline USING ERRCODE = 'FL007';
        END IF;
        PERFORM flow._require_span('deadline', deadline);
        ends := now() + deadline;
    END IF;
    -- the definition's own queue was its owner's choice; another one must be the caller's to use
    lane := CASE WHEN queue IS NULL THEN flow._hold_queue(home) ELSE flow._use_queue(caller, queue) END;
    IF ends <= due THEN
        RAISE EXCEPTION 'flow: deadline % passes before the run is due at %', ends, due USING ERRCODE = 'FL007';
    END IF;
END $$;

-- The priority a new command gets: the one given, else its definition's.
CREATE OR REPLACE FUNCTION flow._priority(given integer, otherwise smallint) RETURNS smallint
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF given NOT BETWEEN -32768 AND 32767 THEN
        RAISE EXCEPTION 'flow: priority must be from -32768 to 32767 (lower runs first), got %', given
            USING ERRCODE = '22003';
    END IF;
    RETURN coalesce(given, otherwise);
END $$;

-- A group key as a command keeps it: NULL (none), or a name of at most 1 KiB.
-- (inlined: flow._enqueue_many tests every key of its array with it in one
-- statement, and calls flow._require_group, which says what is wrong, for
-- the first it refuses only)
CREATE OR REPLACE FUNCTION flow._group_key_ok(group_key text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT group_key IS NULL OR (btrim(group_key) <> '' AND flow._short_enough(group_key))
$$;

CREATE OR REPLACE FUNCTION flow._require_group(what text, group_key text) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF flow._group_key_ok(group_key) THEN
        RETURN group_key;
    END IF;
    IF btrim(group_key) = '' THEN
        RAISE EXCEPTION 'flow: % must not be empty (NULL for none)', what USING ERRCODE = 'FL002';
    END IF;
    RETURN flow._require_short(what, group_key);
END $$;

-- One group for all (group_key) or one each (group_keys, as many as the
-- `count` elements of the array named `counted`), not both; each key NULL
-- (no group) or a valid group key. For enqueue_many and spawn_many.
CREATE OR REPLACE FUNCTION flow._require_group_keys(group_key text, group_keys text[], count integer, counted text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    bad record;
BEGIN
    IF group_keys IS NULL THEN
        PERFORM flow._require_group('group_key', group_key);
        RETURN;
    END IF;
    IF group_key IS NOT NULL THEN
        RAISE EXCEPTION 'flow: give group_key or group_keys, not both' USING ERRCODE = 'FL006';
    END IF;
    IF cardinality(group_keys) <> count THEN
        RAISE EXCEPTION 'flow: group_keys has % elements, % %', cardinality(group_keys), counted, count
            USING ERRCODE = 'FL003';
    END IF;
    -- (a call of flow._require_group per key: 1.3-1.7 ms of an enqueue of 999 runs with a group each)
    SELECT i, k INTO bad FROM unnest(group_keys) WITH ORDINALITY AS u(k, i) WHERE NOT flow._group_key_ok(k) LIMIT 1;
    IF bad.i IS NOT NULL THEN
        PERFORM flow._require_group(format('group_keys[%s]', bad.i), bad.k);
    END IF;
END $$;

-- Note that `queue` has commands of `priority`, with groups if `grouped`,
-- for its claims (_queues.priorities and grouped_priorities; priority 0
-- without groups is always read). Called for each enqueue and spawn of a
-- priority other than 0 or with a group: a probe of the queue's row once
-- they are known. The first time, the note goes to _priority_notes, and the
-- maintenance worker, woken by this transaction's commit, adds it to the
-- queue's row in a transaction of its own (flow._fold_priority_notes): so
-- the first commands of a new priority are claimed a moment after their
-- commit, and no transaction ever holds a queue's row for a note (another
-- role's first enqueue of a new priority in a shared queue, `default`,
-- waited for it to end). Where that worker does not run (another database
-- than flow.database_name), the queue's row is written here, as before.
CREATE OR REPLACE FUNCTION flow._note_priority(queue text, priority smallint, grouped boolean) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    here boolean := current_database() = current_setting('flow.database_name');
    in_use integer;
    -- (what a note in progress holds: see the cap below)
    lock_key integer := pg_catalog.hashtext('flow priority note ' || queue);
    -- A transaction that keeps its snapshot may read the queue's row, and
    -- others' notes, as they were before the maintenance worker forgot the
    -- priority (flow._retire_priorities: it cannot do so while this one
    -- holds the queue, but may have just before): only its own notes count.
    -- (Where no maintenance worker runs, nothing is forgotten.)
    snapshot_kept boolean := here AND current_setting('transaction_isolation') <> 'read committed';
BEGIN
    IF (NOT snapshot_kept AND EXISTS (SELECT 1 FROM flow._queues q
                                      WHERE q.name = _note_priority.queue AND _note_priority.priority = ANY (q.priorities)
                                        AND (NOT grouped OR _note_priority.priority = ANY (q.grouped_priorities))))
       -- (noted by this transaction, or not yet added: the maintenance worker adds it)
       OR (here AND EXISTS (SELECT 1 FROM flow._priority_notes n
                            WHERE n.queue = _note_priority.queue AND n.priority = _note_priority.priority
                              AND (n.grouped OR NOT _note_priority.grouped)
                              AND (NOT snapshot_kept OR flow._written_here(n.xmin::text::bigint)))) THEN
        RETURN;
    END IF;
    -- The cap (each priority costs every claim of the queue a probe) counts
    -- the notes other transactions are making and have not committed: each
    -- note holds a shared advisory lock on (its queue's hash, its priority)
    -- until its transaction ends, taken before it counts, so of two notes
    -- made at the same moment the second to count sees the first. (Shared:
    -- notes never wait for each other; one whose key a role holds
    -- exclusively goes on without it.)
    PERFORM pg_catalog.pg_try_advisory_xact_lock_shared(lock_key, priority);
    SELECT count(*) INTO in_use
    FROM (SELECT p FROM flow._queues q CROSS JOIN unnest(q.priorities || _note_priority.priority) AS p
          WHERE q.name = _note_priority.queue
          UNION
          SELECT n.priority FROM flow._priority_notes n WHERE n.queue = _note_priority.queue
          UNION
          SELECT l.priority::smallint
          FROM (-- (an advisory lock's second key as pg_locks shows it: unsigned)
                SELECT l.objid::bigint - CASE WHEN l.objid::bigint >= 2147483648 THEN 4294967296 ELSE 0 END AS priority
                FROM pg_catalog.pg_locks l
                WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
                  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database())
                  AND l.classid = (lock_key::bigint & 4294967295)::text::oid) l
          WHERE l.priority BETWEEN -32768 AND 32767) u;
    IF in_use > 65 THEN
        RAISE EXCEPTION 'flow: queue % has 64 priorities besides 0 in use already', queue
            USING ERRCODE = '54000', HINT = 'Use fewer distinct priorities, or another queue.';
    END IF;
    INSERT INTO flow._priority_notes VALUES (queue, priority, grouped);
    IF here THEN
        PERFORM flow._wake_maintenance();
    ELSE
        -- (no maintenance worker here: added now, with any notes left, the
        -- queue's row held to the end)
        PERFORM 1 FROM flow._queues q WHERE q.name = _note_priority.queue FOR NO KEY UPDATE;
        PERFORM flow._fold_priority_notes(queue);
    END IF;
END $$;

-- Add the priorities noted in _priority_notes to their queues' rows (all
-- queues', or only `only_queue`'s), and forget the notes: the maintenance
-- worker's, in a transaction of its own, at each of its rounds (a note's
-- commit wakes it). A queue locked elsewhere (flow.set_queue in an open
-- transaction) is left for the next round, never waited for. Returns how
-- many queues it changed; their new priorities' commands are due from now.
CREATE OR REPLACE FUNCTION flow._fold_priority_notes(only_queue text DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    changed integer;
BEGIN
    -- (most rounds: nothing noted)
    IF NOT EXISTS (SELECT 1 FROM flow._priority_notes n WHERE only_queue IS NULL OR n.queue = only_queue) THEN
        RETURN 0;
    END IF;
    -- (of queues dropped since)
    DELETE FROM flow._priority_notes n
    WHERE (only_queue IS NULL OR n.queue = only_queue)
      AND NOT EXISTS (SELECT 1 FROM flow._queues q WHERE q.name = n.queue);
    WITH locked AS (
        SELECT q.name FROM flow._queues q
        WHERE q.name IN (SELECT n.queue FROM flow._priority_notes n WHERE only_queue IS NULL OR n.queue = only_queue)
        FOR NO KEY UPDATE SKIP LOCKED
    ), taken AS (
        DELETE FROM flow._priority_notes n USING locked l WHERE n.queue = l.name
        RETURNING n.queue, n.priority, n.grouped
    ), noted AS (
        SELECT t.queue, array_agg(t.priority) AS priorities,
               coalesce(array_agg(t.priority) FILTER (WHERE t.grouped), '{}') AS grouped_priorities
        FROM taken t GROUP BY t.queue
    )
    UPDATE flow._queues q
    SET priorities = ARRAY(SELECT DISTINCT p FROM unnest(q.priorities || n.priorities) AS p ORDER BY p),
        grouped_priorities = ARRAY(SELECT DISTINCT p FROM unnest(q.grouped_priorities || n.grouped_priorities) AS p ORDER BY p)
    FROM noted n WHERE q.name = n.queue;
    GET DIAGNOSTICS changed = ROW_COUNT;
    IF changed > 0 THEN
        PERFORM flow._wake_due_from('-infinity');
    END IF;
    RETURN changed;
END $$;

-- Forget the priorities (and the grouped priorities) of a queue that none
-- of its unfinished commands has any more: the maintenance worker's, every
-- PRIORITY_RETIREMENT_INTERVAL (src/maintenance.rs). So a queue whose
-- commands once used 64 priorities (the cap, see flow._note_priority) can
-- take new ones once those are done, and the shared `default` queue is not
-- closed to new priorities for good by one role that used many once; and
-- its claims no longer probe for them. A priority used again is noted again.
-- Safe against commands being put in the queue meanwhile: the queue is
-- looked at only under its name's lock, taken exclusively without waiting
-- (skipped while an enqueue, spawn, define or re-drive holds it: those hold
-- it to their commit, see flow._hold_queue; a transaction that keeps an
-- older snapshot notes a priority again, see flow._note_priority), and
-- under its row's lock. Commands finished are made unfinished again only
-- under that hold (flow._retry).
-- It looks at the first queue with priorities after `after` in name order
-- and returns its name (NULL: none is left) and whether it changed: the
-- maintenance worker calls it in a transaction per queue, so one queue's
-- name is held at a time, for a fraction of a millisecond (an enqueue into
-- it waits for that), and a queue locked elsewhere is left for the next pass.
CREATE OR REPLACE FUNCTION flow._retire_priorities(after text, OUT queue text, OUT changed boolean)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q flow._queues;
    kept smallint[];
    kept_grouped smallint[];
BEGIN
    changed := false;
    -- A queue's look probes each of its lanes, one per external definition
    -- of any role, under the queue's name lock: past 1,000 of them (a role
    -- defining 100,000 would hold every enqueue into `default` for seconds)
    -- no pass is made, and priorities are kept, as before 0.3.0.
    IF after = '' AND (SELECT count(DISTINCT d.name) FROM flow._definitions d WHERE d.handler IS NULL) > 1000 THEN
        RETURN;
    END IF;
    SELECT x.name INTO queue FROM flow._queues x
    WHERE x.name > after AND (x.priorities <> '{0}' OR x.grouped_priorities <> '{}')
    ORDER BY x.name LIMIT 1;
    IF queue IS NULL OR NOT flow._try_lock_queue_name(queue) THEN
        RETURN;
    END IF;
    SELECT * INTO q FROM flow._queues x WHERE x.name = _retire_priorities.queue FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;   -- (flow.set_queue in an open transaction, or dropped: next time)
    END IF;
    -- (a statement after the locks: its snapshot sees every command put in
    -- the queue by a transaction that held it and committed)
    SELECT ARRAY(SELECT p FROM unnest(q.priorities) AS p
                 WHERE p = 0 OR flow._priority_in_use(q.name, p, false) ORDER BY p),
           ARRAY(SELECT p FROM unnest(q.grouped_priorities) AS p
                 WHERE flow._priority_in_use(q.name, p, true) ORDER BY p)
    INTO kept, kept_grouped;
    IF kept <> q.priorities OR kept_grouped <> q.grouped_priorities THEN
        UPDATE flow._queues x SET priorities = kept, grouped_priorities = kept_grouped WHERE x.name = q.name;
        changed := true;
    END IF;
END $$;

-- Note again each priority (or grouped priority) that a due or waiting
-- command has and its queue's row does not list: a net under
-- flow._retire_priorities, run by the maintenance worker at the start of
-- each of its passes, for a command that pass could not see: one that
-- became visible after it looked (a `pg_restore -j` loads _commands and
-- _queues at once), or in a lane of a definition external once more. Such a
-- command is claimed a pass later (a minute) instead of never. It reads the
-- due index once per (lane, priority) with due work (a loose index scan),
-- whatever the number of commands; it writes notes only (folded as any
-- other, flow._fold_priority_notes). Returns how many it noted.
CREATE OR REPLACE FUNCTION flow._renote_stranded_priorities() RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    noted integer;
BEGIN
    WITH RECURSIVE pairs AS (
        (SELECT flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END) AS lane, c.priority
         FROM flow._commands c                                         -- index _commands_due
         WHERE c.status IN ('pending', 'waiting')
         ORDER BY 1, 2 LIMIT 1)
        UNION ALL
        SELECT n.lane, n.priority
        FROM pairs x CROSS JOIN LATERAL (
            SELECT flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END) AS lane, c.priority
            FROM flow._commands c                                      -- index _commands_due
            WHERE (flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END), c.priority) > (x.lane, x.priority)
              AND c.status IN ('pending', 'waiting')
            ORDER BY 1, 2 LIMIT 1) n
    ), used AS (
        SELECT DISTINCT h.queue, x.priority,
               EXISTS (SELECT 1 FROM flow._commands g                  -- index _commands_due_grouped
                       WHERE flow._lane(g.queue, CASE WHEN g.external THEN g.name ELSE '' END) = x.lane
                         AND g.priority = x.priority AND g.group_hash <> 0 AND g.queue = h.queue
                         AND g.status IN ('pending', 'waiting')) AS grouped
        FROM pairs x CROSS JOIN LATERAL (
            SELECT c.queue FROM flow._commands c                       -- index _commands_due
            WHERE flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END) = x.lane
              AND c.priority = x.priority AND c.status IN ('pending', 'waiting')
            LIMIT 1) h
    )
    INSERT INTO flow._priority_notes (queue, priority, grouped)
    SELECT u.queue, u.priority, u.grouped
    FROM used u JOIN flow._queues q ON q.name = u.queue
    WHERE NOT (u.priority = ANY (q.priorities) AND (NOT u.grouped OR u.priority = ANY (q.grouped_priorities)))
      AND NOT EXISTS (SELECT 1 FROM flow._priority_notes n
                      WHERE n.queue = u.queue AND n.priority = u.priority AND (n.grouped OR NOT u.grouped));
    GET DIAGNOSTICS noted = ROW_COUNT;
    RETURN noted;
END $$;

-- Whether an unfinished command of `queue` has `priority` (and a group, if
-- `grouped`): a due or waiting one, lane by lane, or a running one (which
-- may be due again: a retry, a hand-back).
CREATE OR REPLACE FUNCTION flow._priority_in_use(queue text, priority smallint, grouped boolean) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM flow._commands c                      -- index _commands_due
                   WHERE flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END)
                             = ANY (ARRAY(SELECT l.lane FROM flow._queue_lanes l WHERE l.queue = _priority_in_use.queue))
                     AND c.queue = _priority_in_use.queue AND c.status IN ('pending', 'waiting')
                     AND c.priority = _priority_in_use.priority AND (NOT grouped OR c.group_hash <> 0))
        OR EXISTS (SELECT 1 FROM flow._commands c                      -- index _commands_running
                   WHERE c.queue = _priority_in_use.queue AND c.status = 'running'
                     AND c.priority = _priority_in_use.priority AND (NOT grouped OR c.group_hash <> 0))
$$;

-- The root commands of new runs (run_ids[i] gets args[i]), and the wake-up.
-- A run is its root until it needs a row of its own (see flow._runs).
CREATE OR REPLACE FUNCTION flow._insert_roots(owner oid, name text, version integer, external boolean, lane text,
    due timestamptz, ends timestamptz, run_ids uuid[], args jsonb[], priority smallint, group_keys text[])
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    -- (a key given: flow.enqueue passes ARRAY[NULL] without one, which noted
    -- nothing at 58 µs an enqueue; a simple expression, planned once)
    grouped boolean := coalesce(cardinality(array_remove(group_keys, NULL)) > 0, false);
BEGIN
    IF priority <> 0 OR grouped THEN
        PERFORM flow._note_priority(lane, priority, grouped);
    END IF;
    INSERT INTO flow._commands (id, run_id, key, name, version, queue, args, declaration, status,
        next_run_at, not_before, budget_started_at, deadline, external, owner, priority, group_key, group_hash)
    -- (a root is never spawned again, so it has no declaration to match:
    -- its args are not stored twice; its id is its run's, see _commands_run_key)
    SELECT t.run_id, t.run_id, 'root', _insert_roots.name, _insert_roots.version, lane, t.args, '{}',
        'pending', due, due, due, ends, _insert_roots.external, _insert_roots.owner, _insert_roots.priority,
        t.group_key, flow._group_hash(t.group_key)
    FROM unnest(run_ids, args, group_keys) AS t(run_id, args, group_key);
    PERFORM flow._wake_due_from(due);
END $$;

CREATE OR REPLACE FUNCTION flow._enqueue(caller oid, name text, args jsonb, key text, version integer, queue text,
    start_after interval, run_at timestamptz, deadline interval, priority integer, group_key text,
    check_args boolean DEFAULT true)
RETURNS uuid
LANGUAGE plpgsql AS $$
#variable_conflict use_column
-- (the ON CONFLICT below names columns key and owner, which cannot be qualified)
DECLARE
    p record := flow._plan_enqueue(caller, name, version, queue, start_after, run_at, deadline);
    run_id uuid := flow._new_id();
    existing flow._runs;
BEGIN
    PERFORM flow._require_payload('args', args);
    IF check_args THEN
        PERFORM flow._require_args_fit(name, p.def_owner, p.def_args_type, args);
    END IF;
    PERFORM flow._require_short('key', key);
    PERFORM flow._require_group('group_key', group_key);
    IF key IS NOT NULL AND btrim(key) = '' THEN
        RAISE EXCEPTION 'flow: key must not be empty (NULL for none)' USING ERRCODE = 'FL002';
    END IF;
    -- The run key makes enqueue idempotent: a concurrent insert of the same key
    -- waits for the first to commit, then finds its row. (A run without a key
    -- has no row of its own: see flow._runs.)
    -- (a loop: the run found in the way may be deleted by retention before it
    -- is read, and the key is then free again)
    WHILE key IS NOT NULL LOOP
        INSERT INTO flow._runs (id, key, owner, name, version, queue, args, deadline)
        VALUES (run_id, key, caller, _enqueue.name, p.def_version, p.lane, args, p.ends)
        ON CONFLICT (owner, key) WHERE key IS NOT NULL DO NOTHING;      -- index _runs_owner_key
        EXIT WHEN FOUND;
        SELECT * INTO existing FROM flow._runs r WHERE r.owner = caller AND r.key = _enqueue.key;
        IF FOUND THEN
            IF existing.name IS DISTINCT FROM _enqueue.name OR existing.version IS DISTINCT FROM p.def_version
               OR existing.args IS DISTINCT FROM args OR existing.queue IS DISTINCT FROM p.lane THEN
                RAISE EXCEPTION 'flow: run key % was already used for another declaration', key
                    USING ERRCODE = 'FL010',
                          DETAIL = format('existing run %s is %s v%s on queue %s', existing.id, existing.name,
                                          existing.version, existing.queue);
            END IF;
            RETURN existing.id;
        END IF;
    END LOOP;
    PERFORM flow._insert_roots(caller, name, p.def_version, p.def_external, p.lane, p.due, p.ends,
                               ARRAY[run_id], ARRAY[args], flow._priority(priority, p.def_priority), ARRAY[group_key]);
    RETURN run_id;
END $$;

-- Many runs in one statement: set-based, no run keys.
CREATE OR REPLACE FUNCTION flow._enqueue_many(caller oid, name text, args_array jsonb[], version integer, queue text,
    start_after interval, run_at timestamptz, deadline interval, priority integer, group_key text,
    group_keys text[])
RETURNS uuid[]
LANGUAGE plpgsql AS $$
DECLARE
    p record := flow._plan_enqueue(caller, name, version, queue, start_after, run_at, deadline);
    limit_bytes integer := flow._max_payload_bytes();
    bad record;
    ids uuid[];
BEGIN
    IF args_array IS NULL THEN
        RAISE EXCEPTION 'flow: args_array must not be NULL' USING ERRCODE = 'FL003';
    END IF;
    PERFORM flow._require_group_keys(group_key, group_keys, cardinality(args_array), 'args_array');
    SELECT i, a INTO bad FROM unnest(args_array) WITH ORDINALITY AS t(a, i)
    WHERE a IS NULL OR jsonb_typeof(a) <> 'object' OR octet_length(a::text) > limit_bytes
    LIMIT 1;
    IF FOUND THEN
        IF bad.a IS NULL OR jsonb_typeof(bad.a) <> 'object' THEN
            RAISE EXCEPTION 'flow: args_array[%] must be a JSON object', bad.i USING ERRCODE = 'FL003';
        END IF;
        RAISE EXCEPTION 'flow: args_array[%] is over flow.max_result_bytes (% bytes)', bad.i, limit_bytes
            USING ERRCODE = 'FL004';
    END IF;
    IF p.def_args_type IS NOT NULL THEN
        SELECT t.i, t.why INTO bad FROM (
            SELECT i, flow._args_misfit_as(p.def_owner, p.def_args_type, a::text) AS why
            FROM unnest(args_array) WITH ORDINALITY AS u(a, i)) t
        WHERE t.why IS NOT NULL
        LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'flow: args_array[%] does not fit %: %', bad.i, p.def_args_type, bad.why
                USING ERRCODE = 'FL019';
        END IF;
    END IF;
    SELECT coalesce(array_agg(flow._new_id()), '{}') INTO ids FROM unnest(args_array);
    PERFORM flow._insert_roots(caller, name, p.def_version, p.def_external, p.lane, p.due, p.ends,
                               ids, args_array, flow._priority(priority, p.def_priority),
                               coalesce(group_keys, CASE WHEN group_key IS NOT NULL
                                                         THEN array_fill(group_key, ARRAY[cardinality(args_array)]) END));
    RETURN ids;
END $$;

-- src/lib.rs:62
-- requires:
--   enqueue

-- Claim: handing due commands to in-database and external workers (rules 1-3).

-- Retry delay: exponential from `backoff`, jittered by ±25 %, kept within
-- [backoff, backoff_max]; at the cap it is jittered too, within [75 %, 100 %]
-- of backoff_max (clamped after the jitter, every retry at the cap landed on
-- backoff_max itself, all at once). Computed in seconds so huge attempt
-- numbers cannot overflow an interval.
CREATE OR REPLACE FUNCTION flow._backoff(backoff interval, backoff_max interval, attempt integer) RETURNS interval
LANGUAGE sql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
    SELECT make_interval(secs => greatest(extract(epoch FROM backoff),
        least(extract(epoch FROM backoff_max) * (0.75 + random() * 0.25),
              extract(epoch FROM backoff) * power(2, least(greatest(attempt - 1, 0), 60))
                  * (0.75 + random() * 0.5)))::double precision)
$$;

-- A group key's hash, as _commands.group_hash keeps it: 0 for none, else
-- positive (flow._groups_of reads a lane's groups after 0).
CREATE OR REPLACE FUNCTION flow._group_hash(group_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN group_key IS NULL THEN 0
                ELSE (pg_catalog.hashtextextended(group_key, 0) & 9223372036854775807) | 1 END
$$;

-- The groups of a lane's pending and waiting commands of one priority (not
-- 0, what has no group), at most max_groups of them, in hash order from
-- after from_hash round to it: a loose scan of _commands_due, one probe per
-- group. (Called only for a priority whose commands had groups,
-- _queues.grouped_priorities; PL/pgSQL, not inlined: the plans that call it
-- need not carry its nodes, set up by every call of them, groups or none.)
-- A claim reads at most as many groups as it takes
-- commands, from a point that moves every claim, so a queue's number of
-- groups never makes a claim longer.
CREATE OR REPLACE FUNCTION flow._groups_of(queue text, lane bigint, priority smallint, from_hash bigint, max_groups integer)
RETURNS TABLE (group_hash bigint)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN QUERY
    WITH RECURSIVE g(h, lap, found) AS (
        SELECT _groups_of.from_hash, 0, false
        UNION ALL
        SELECT n.h, n.lap, true FROM g CROSS JOIN LATERAL (
            (SELECT c.group_hash AS h, g.lap FROM flow._commands c            -- index _commands_due
             WHERE flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END) = _groups_of.lane
               AND c.priority = _groups_of.priority AND c.group_hash > g.h
               AND (g.lap = 0 OR c.group_hash <= _groups_of.from_hash)
               AND c.status IN ('pending', 'waiting')
             ORDER BY c.group_hash LIMIT 1)
            UNION ALL
            -- (past the last group: round to the first, once. `> g.lap`, 0
            -- here, not `> 0`: a constant lets the planner prove the partial
            -- index _commands_due_grouped usable, and it read a group's
            -- whole backlog there, then sorted it: 20 ms a claim with
            -- 90,000 of one group's commands waiting)
            (SELECT c.group_hash, 1 FROM flow._commands c                     -- index _commands_due
             WHERE g.lap = 0 AND flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END) = _groups_of.lane
               AND c.priority = _groups_of.priority AND c.group_hash > g.lap AND c.group_hash <= _groups_of.from_hash
               AND c.status IN ('pending', 'waiting')
             ORDER BY c.group_hash LIMIT 1)
            LIMIT 1) n)
    SELECT g.h FROM g WHERE g.found LIMIT max_groups;
END $$;

-- The index ranges of _commands_due a claim of a lane reads, in order, each
-- with how many it may take of the lane's share (`take`): each of the
-- queue's priorities, lowest first; in a priority whose commands had groups,
-- what has no group (0) and then one group after another (flow._groups_of,
-- from a point that moves every claim), each an equal part of the share,
-- within group_concurrency. Called only for a lane with priorities or
-- groups (flow._claim reads the one range of any other without a call: 19 %
-- of the claim of one command was setting up these parts' nodes).
CREATE OR REPLACE FUNCTION flow._claim_ranges(queue text, lane bigint, priorities smallint[], grouped_priorities smallint[],
    group_start bigint, take integer, group_concurrency integer)
RETURNS TABLE (priority smallint, group_hash bigint, room integer)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    p smallint;
BEGIN
    FOREACH p IN ARRAY priorities LOOP
        IF p <> ALL (grouped_priorities) THEN
            priority := p;
            group_hash := 0;
            room := take;
            RETURN NEXT;
        ELSE
            RETURN QUERY
            SELECT p, g.h, CASE WHEN g.h = 0 OR _claim_ranges.group_concurrency IS NULL THEN greatest(1, take / g.groups)
                                ELSE least(greatest(1, take / g.groups), flow._group_room(_claim_ranges.group_concurrency - (
                                    SELECT count(*) FROM flow._commands r            -- index _commands_group_running
                                    WHERE r.queue = _claim_ranges.queue AND r.group_hash = g.h AND r.status = 'running')::integer))
                           END::integer
            FROM (SELECT u.h, count(*) OVER () AS groups
                  FROM (SELECT 0::bigint AS h
                        UNION ALL
                        SELECT x.group_hash FROM flow._groups_of(_claim_ranges.queue, lane, p, group_start, take) x) u) g;
        END IF;
    END LOOP;
END $$;

-- Claim up to max_count due commands (rule 3): lock them, and say how each
-- is to be run. A command is claimed in one of two ways:
-- * leased: its row will say `running`, with the attempt counted and the
--   lease recorded (flow._lease, called by the claimant in the same
--   transaction for the rows returned with held = false), and the claim
--   commits before any handler runs. External workers, commands of limited
--   queues (their running count must be seen by every worker) and handlers
--   not known to be fast are claimed so.
-- * held (in-database workers, for the handlers in `fast_handlers`, in
--   queues without a limit): the row is only locked, and the worker runs
--   and settles it in this same transaction, writing the command once. The
--   attempt is counted at its settlement; what keeps rule 3 is the worker's
--   record of the held attempt it is in, outside the transaction (see
--   src/attempt_record.rs). An external claim with `hold` holds its commands
--   the same way, for its client's transaction (flow.claim's hold; rule 3:
--   src/external.rs).
-- Either way this writes nothing: it returns each command locked, with the
-- number of the attempt it makes and that attempt's deadline, its row
-- (row_at: where its lease or its settlement writes) and no token (a lease's
-- comes from flow._lease; a held attempt's is made by its claimant). So the
-- rows go from the locking scan straight to the caller: a statement that
-- also wrote the leases had to keep the locked rows in a store first (a CTE
-- that locks is never inlined) and read them again for each of its parts,
-- which cost more than the scan itself (the statement of an in-database
-- claim of 1,000 held commands: 3.9 ms, 2.5 ms now).
-- `excluded`: commands other workers' records name, or whose abandoned held
-- attempts wait for the maintenance worker, or that the caller's transaction holds already,
-- left alone. `busy_runs`: runs whose locks other workers' chunks hold; their
-- commands are left alone too (src/shmem.rs, publish_busy_runs).
-- In-database workers pass no names (they claim commands with an SQL
-- handler); external workers pass definition names.
-- Fairness (rule 2): every unpaused queue with due work offers its head, in
-- (next_run_at, id) order, up to its free concurrency, each queue (and each
-- claimant in it) an equal share of max_count; lane_order is each queue's
-- place in this claim's round-robin turn (from queue number `turn`), and a
-- claim from several (claim_order 0) is put in that order by its caller.
-- Priorities: within a queue, due commands are claimed by (priority, due
-- time): each of the queue's priorities (_queues.priorities) is read in
-- turn, lowest first, each an index range of its own, so a queue whose
-- commands all have priority 0 reads what it read before priorities.
-- A worker draining a backlog passes where its last claim ended in each
-- queue and priority (after_queues[i], after_priorities[i]: after
-- (after_at[i], after_ids[i]) in due order):
-- the claim starts there, not at the queue's head, so it does not walk again
-- the index entries of the commands claimed and settled before it, which
-- cannot be cleaned while any snapshot older than their settlement lives
-- (a session's long transaction would make every claim walk the whole
-- backlog drained since it began). An in-database worker claims from the
-- heads again once a commit says it made commands due before that point (a
-- command handed back, an enqueue whose transaction began earlier:
-- shmem::DueFloors), and at least every second (src/worker.rs,
-- CURSOR_SPAN); an external claim every 250 ms, and for the rest of a claim
-- that came back short (flow.claim, src/external.rs).
CREATE OR REPLACE FUNCTION flow._claim(max_count integer, names text[], turn integer,
    fast_handlers oid[] DEFAULT NULL, excluded uuid[] DEFAULT NULL,
    after_queues text[] DEFAULT NULL, after_priorities smallint[] DEFAULT NULL,
    after_at timestamptz[] DEFAULT NULL, after_ids uuid[] DEFAULT NULL,
    hold boolean DEFAULT false, busy_runs uuid[] DEFAULT NULL)
RETURNS SETOF flow.claimed_command
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    lanes text[];
    locked text[];
    -- the claim's slots: each lane with due work, for each claimant whose
    -- commands are due in it (slot_queues[i], slot_claimants[i]); and those
    -- of the limited queues, kept once the queue is locked
    slot_queues text[];
    slot_claimants text[];
    limited_queues text[];
    limited_claimants text[];
    -- whose commands the due index is read for: the definitions an external
    -- claim names (each once), or '' for an in-database worker's claim
    claimants text[] := CASE WHEN names IS NULL THEN '{""}' ELSE ARRAY(SELECT DISTINCT n FROM unnest(names) AS n) END;
    -- other owners' queues have due work too: the claim is one turn of several
    other_owners_due boolean;
    -- where this claim's round of a queue's groups begins (see the scan below)
    group_start bigint := (random() * 9.2e18)::bigint;
    -- every slot's queue has no priority and no group
    all_plain boolean;
    claim_order integer;
    -- the slots that take a share, in this claim's turn: each one's queue,
    -- claimant, place in the turn, room, share, limits and whether it is plain
    s_queues text[];
    s_claimants text[];
    s_lane_orders integer[];
    s_rooms integer[];
    s_takes integer[];
    s_unlimited boolean[];
    s_rates integer[];
    s_per_us bigint[];
    s_plain boolean[];
    -- the slot being claimed from, and the index ranges it reads
    s_queue text;
    s_claimant text;
    s_take integer;
    r_priorities smallint[];
    r_groups bigint[];
    r_rooms integer[];
BEGIN
    -- Which queues offer due work, and to which claimants: each unpaused
    -- queue's head in the due index for each (an ORDER BY ... LIMIT 1
    -- probe of _commands_due per slot: an index probe whatever the
    -- table's size or statistics, never a scan of the pending commands;
    -- see pg_test/test_scale.py).
    -- An external claim only takes part in the limited queues of the
    -- definitions it names, and looks at the heads of those definitions'
    -- commands only (per definition: the due index is keyed by lane, a queue
    -- and its claimant, before the due time, see sql/schema.sql), so another
    -- definition's backlog is never read. (Not the excluded commands: a
    -- queue whose due ones are all excluded would take a share and give
    -- nothing.)
    -- Fairness over owners (rule 2): an in-database worker's claim serves the
    -- queues of one owner, the one whose turn it is (`turn`) among the
    -- owners of queues with due work, and round-robin over that owner's
    -- queues; its next claim serves the next owner. (A queue's owner is the
    -- role that made it; the `default` queue, which no role owns, takes a
    -- turn of its own.) So a role with 200 queues gets one turn among the
    -- roles with due work, not 200, and a claim holds one owner's commands
    -- (a chunk never runs two owners' handlers: src/worker.rs). An external
    -- claim names definitions its caller may claim, and is not split so.
    WITH due AS (
        SELECT q.name AS queue, coalesce(q.owner::oid, 0::oid) AS queue_owner,
               q.concurrency IS NULL AND q.group_concurrency IS NULL AND q.rate IS NULL AS unlimited,
               -- (its commands never had a priority or a group: one range)
               q.priorities = '{0}' AND q.grouped_priorities = '{}' AS plain,
               w.claimant
        FROM flow._queues q
        CROSS JOIN unnest(claimants) AS w(claimant) CROSS JOIN LATERAL (
            SELECT min(x.next_run_at) AS next_run_at
            FROM unnest(q.priorities) AS p(priority)
            LEFT JOIN LATERAL (
                SELECT a.at, a.id FROM unnest(after_queues, after_priorities, after_at, after_ids) AS a(queue, priority, at, id)
                WHERE a.queue = q.name AND a.priority = p.priority LIMIT 1) a ON true
            CROSS JOIN LATERAL (
                -- the head of what has no group, from where the last claim ended
                (SELECT c.next_run_at FROM flow._commands c          -- index _commands_due
                 WHERE flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END) = flow._lane(q.name, w.claimant)
                   AND c.priority = p.priority AND c.group_hash = 0
                   AND c.queue = q.name AND c.external = (names IS NOT NULL)
                   AND (CASE WHEN c.external THEN c.name ELSE '' END) = w.claimant
                   AND c.status IN ('pending', 'waiting')
                   AND (c.next_run_at, c.id) > (coalesce(a.at, '-infinity'), coalesce(a.id, '00000000-0000-0000-0000-000000000000'::uuid))
                   AND (excluded IS NULL OR c.id <> ALL (excluded))
                 ORDER BY c.next_run_at LIMIT 1)
                UNION ALL
                -- the head of all its groups (one probe, whatever their number)
                (SELECT c.next_run_at FROM flow._commands c          -- index _commands_due_grouped
                 WHERE flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END) = flow._lane(q.name, w.claimant)
                   AND c.priority = p.priority AND c.group_hash <> 0
                   AND c.queue = q.name AND c.external = (names IS NOT NULL)
                   AND (CASE WHEN c.external THEN c.name ELSE '' END) = w.claimant
                   AND c.status IN ('pending', 'waiting')
                   AND p.priority = ANY (q.grouped_priorities)
                   AND (excluded IS NULL OR c.id <> ALL (excluded))
                 ORDER BY c.next_run_at LIMIT 1)) x) x
        WHERE NOT q.paused AND x.next_run_at <= now()
          AND ((q.concurrency IS NULL AND q.group_concurrency IS NULL AND q.rate IS NULL) OR names IS NULL
               OR EXISTS (SELECT 1 FROM flow._definitions d WHERE d.queue = q.name AND d.name = ANY (names)))
    ), turns AS (
        SELECT o.owners[1 + ((turn % cardinality(o.owners)) + cardinality(o.owners)) % cardinality(o.owners)] AS owner,
               cardinality(o.owners) AS owners
        FROM (SELECT array_agg(DISTINCT d.queue_owner ORDER BY d.queue_owner) AS owners FROM due d) o
    )
    SELECT array_agg(DISTINCT s.queue) FILTER (WHERE s.unlimited),
           array_agg(s.queue) FILTER (WHERE s.unlimited), array_agg(s.claimant) FILTER (WHERE s.unlimited),
           array_agg(s.queue) FILTER (WHERE NOT s.unlimited), array_agg(s.claimant) FILTER (WHERE NOT s.unlimited),
           coalesce(bool_or(t.owners > 1), false), coalesce(bool_and(s.plain), true)
    INTO lanes, slot_queues, slot_claimants, limited_queues, limited_claimants, other_owners_due, all_plain
    FROM due s CROSS JOIN turns t
    WHERE names IS NOT NULL OR s.queue_owner = t.owner;
    -- Limited queues are locked before their running commands are counted
    -- (by the next statement, with a fresh snapshot), so the counts are exact
    -- across all workers. A queue locked elsewhere (another worker claiming
    -- from it, or a flow.set_queue in an open transaction) is skipped this
    -- turn, never waited for: one open transaction can hold up one queue,
    -- not the engine.
    IF limited_queues IS NOT NULL THEN
        SELECT array_agg(l.name) INTO locked FROM (
            SELECT q.name FROM flow._queues q WHERE q.name = ANY (limited_queues)
            ORDER BY q.name FOR NO KEY UPDATE SKIP LOCKED) l;
        lanes := coalesce(lanes, '{}') || locked;
        SELECT coalesce(slot_queues, '{}') || array_agg(s.queue), coalesce(slot_claimants, '{}') || array_agg(s.claimant)
        INTO slot_queues, slot_claimants
        FROM unnest(limited_queues, limited_claimants) AS s(queue, claimant)
        WHERE s.queue = ANY (locked);
    END IF;
    -- (a claim of no command runs the statements below anyway, and takes
    -- nothing: an idle worker plans them so, see worker.rs, warm_plans)
    IF coalesce(cardinality(lanes), 0) = 0 AND max_count > 0 THEN
        RETURN;
    END IF;
    -- (a claim from several queues, or one owner's turn of several: claim
    -- order 0, so the worker claims again at once)
    claim_order := CASE WHEN cardinality(slot_queues) <> 1 OR (other_owners_due AND names IS NULL) THEN 0 END;
    -- The slots' shares. What each slot (a lane and a claimant with commands
    -- due in it: an in-database worker, or a definition an external claim
    -- names) gives the claim: an equal share of max_count (the remainder one
    -- each to the slots first in this claim's turn), within the lane's room.
    -- A claim of one slot of a queue without limits (most claims) takes
    -- max_count, and needs no statement here: each statement's nodes are set
    -- up at every call, and these were a third of the claim of one command.
    IF cardinality(slot_queues) = 1 AND limited_queues IS NULL THEN
        s_queues := slot_queues;
        s_claimants := slot_claimants;
        s_lane_orders := '{0}';
        s_rooms := ARRAY[max_count];
        s_takes := ARRAY[max_count];
        s_unlimited := '{true}';
        s_rates := '{NULL}';
        s_per_us := '{NULL}';
        s_plain := ARRAY[all_plain];
    ELSE
        -- Every row the scan below locks is returned: a row locked and left
        -- out would stay locked for the claim's transaction (a held chunk's
        -- whole run, an external client's transaction), and the other claims,
        -- skipping it, would take up after it and leave it behind until their
        -- cursors ran out (a second for a worker) while its queue's later
        -- commands ran. (Only a limited lane of several claimants may lock
        -- more than its room: flow.claim keeps the earliest of them; the claim
        -- holds the lane's queue meanwhile, so no other claim reads it.) A slot
        -- with less than its share leaves the claim short: an external claim
        -- then claims the rest (flow.claim), a worker claims again at once
        -- (Worker::claim). (A full limited lane takes no share.) An
        -- in-database worker may leave out rows of handlers that may be slow
        -- (it keeps one: see src/claim.rs, keep_what_starts_now); its commit
        -- then says they are due from where they are, so no claim skips them for long.
        SELECT array_agg(l.name ORDER BY l.slot), array_agg(l.claimant ORDER BY l.slot),
               array_agg(l.lane_order ORDER BY l.slot), array_agg(l.room ORDER BY l.slot),
               array_agg(l.take ORDER BY l.slot), array_agg(l.unlimited ORDER BY l.slot),
               array_agg(l.rate ORDER BY l.slot), array_agg(l.per_us ORDER BY l.slot), array_agg(l.plain ORDER BY l.slot)
        INTO s_queues, s_claimants, s_lane_orders, s_rooms, s_takes, s_unlimited, s_rates, s_per_us, s_plain
        FROM (
            SELECT l.*, least(l.room, max_count / l.slots + (l.slot < max_count % l.slots)::integer) AS take
            FROM (SELECT l.*, s.claimant,
                         (row_number() OVER (ORDER BY l.lane_order, s.claimant) - 1)::integer AS slot,
                         (count(*) OVER ())::integer AS slots
                  FROM (
                      SELECT q.name,
                             -- (its place in this claim's round-robin turn: from queue number `turn`, in name order)
                             (((row_number() OVER (ORDER BY q.name) - 1 - turn) % cardinality(lanes) + cardinality(lanes))
                                 % cardinality(lanes))::integer AS lane_order,
                             q.concurrency IS NULL AND q.group_concurrency IS NULL AND q.rate IS NULL AS unlimited,
                             -- (within its concurrency limit, and as many as its rate
                             -- limit has cells for now: each row it locks takes one,
                             -- below, and one it cannot is left for a later claim)
                             least(CASE WHEN q.concurrency IS NULL THEN max_count
                                        ELSE greatest(0, q.concurrency - (
                                            SELECT count(*) FROM flow._commands r       -- index _commands_running
                                            WHERE r.queue = q.name AND r.status = 'running'))::integer
                                   END,
                                   CASE WHEN q.rate IS NOT NULL THEN flow._rate_room(q.name, q.rate, x.per_us) END) AS room,
                             q.rate, x.per_us,
                             q.priorities = '{0}' AND q.grouped_priorities = '{}' AS plain
                      FROM flow._queues q CROSS JOIN LATERAL (SELECT (extract(epoch FROM q.per) * 1000000)::bigint AS per_us) x
                      WHERE q.name = ANY (lanes)) l
                  JOIN unnest(slot_queues, slot_claimants) AS s(queue, claimant) ON s.queue = l.name
                  WHERE l.room > 0) l) l
        WHERE l.take > 0;
    END IF;

    -- Each slot's commands, in its lane's claim order. (A claim of no
    -- command: one pass with nothing to take, to plan it.)
    FOR i IN 1..greatest(coalesce(cardinality(s_queues), 0), (max_count = 0)::integer) LOOP
        s_queue := s_queues[i];
        s_claimant := s_claimants[i];
        s_take := coalesce(s_takes[i], 0);
        -- The index ranges of _commands_due the slot reads, in order, each up
        -- to its room: one for a lane whose commands never had a priority or
        -- a group, else flow._claim_ranges's.
        IF coalesce(s_plain[i], max_count > 0) THEN
            r_priorities := '{0}';
            r_groups := '{0}';
            r_rooms := ARRAY[s_take];
        ELSE
            SELECT array_agg(r.priority), array_agg(r.group_hash), array_agg(r.room)
            INTO r_priorities, r_groups, r_rooms
            FROM flow._queues q
            CROSS JOIN LATERAL flow._claim_ranges(q.name, flow._lane(q.name, s_claimant), q.priorities,
                                                  q.grouped_priorities, group_start, s_take, q.group_concurrency) r
            WHERE q.name = s_queue;
        END IF;
        RETURN QUERY
        SELECT h.id, h.run_id, h.name, h.version, h.queue, h.args,
               h.attempts + 1, h.attempt_deadline,
               h.handler, h.owner,
               -- the context a handler or external worker sees: only for handlers
               -- that take it, and external workers (built here, in one
               -- expression: a function per command would cost several times more;
               -- in a branch of the CASE, so no-context handlers pay nothing for it)
               CASE WHEN h.takes_context OR names IS NOT NULL THEN
                   ROW(h.run_id, (SELECT r.key FROM flow._runs r WHERE r.id = h.run_id), h.id,
                       h.key, h.name, h.version, h.queue, h.attempts + 1, h.attempt_deadline,
                       -- the command's waits, met (with their events) and not: by
                       -- its own entries of _waits_pkey (a filter on event_position
                       -- alone would walk every open wait), in that index's order,
                       -- so the aggregates sort nothing (an ORDER BY in them sets up
                       -- a sort per command, waits or not). A run's root (id =
                       -- run_id) waits for nothing: the CASEs spare it both reads
                       -- (one subquery for both lists ran for it too, to aggregate
                       -- no row: 4 % of a writing drain, 2 % of an external one).
                       coalesce(CASE WHEN h.id <> h.run_id THEN (
                           SELECT jsonb_agg(jsonb_build_object('name', w.name, 'key', w.key, 'payload', w.payload,
                                                               'position', w.position))
                           FROM (SELECT w.name, w.key, e.payload, e.position
                                 FROM flow._waits w LEFT JOIN flow._events e ON e.position = w.event_position
                                 WHERE w.command_id = h.id AND w.event_position IS NOT NULL
                                 ORDER BY w.name, w.key) w) END, '[]'),
                       flow._wait_timed_out(h.status, h.wait_timed_out),
                       coalesce(CASE WHEN h.id <> h.run_id THEN (
                           SELECT jsonb_agg(jsonb_build_object('name', w.name, 'key', w.key))
                           FROM (SELECT w.name, w.key FROM flow._waits w
                                 WHERE w.command_id = h.id AND w.event_position IS NULL
                                 ORDER BY w.name, w.key) w) END, '[]'),
                       h.created_at, h.budget_start, now())::flow.context
               END,
               h.timeout, least(flow._deadline(h.budget_start, h.max_elapsed), h.deadline),
               claim_order, h.args_type, h.next_run_at, h.row_at,
               h.held, s_lane_orders[i], s_rooms[i], h.priority, h.group_hash
        FROM (
            -- (an attempt's deadlines: flow._deadline never raises, whatever one
            -- row holds, so no row can fail the claim for every role: src/spans.rs)
            SELECT h.*, least(flow._deadline(now(), h.timeout), flow._deadline(h.budget_start, h.max_elapsed),
                              h.deadline) AS attempt_deadline,
                   -- (a command of a rate-limited queue is leased: the claim
                   -- that admitted it commits at once, with what it left)
                   coalesce(s_unlimited[i] AND (h.handler = ANY (fast_handlers) OR hold), false) AS held
            FROM (
              -- (its ranges in order, each up to its room: the ungrouped read
              -- from where the last claim ended; until the slot has its share:
              -- the LIMIT stops the scans, so every row locked is returned)
              SELECT k.* FROM unnest(r_priorities, r_groups, r_rooms) AS p(priority, group_hash, room)
              LEFT JOIN LATERAL (
                  SELECT a.at, a.id FROM unnest(after_queues, after_priorities, after_at, after_ids) AS a(queue, priority, at, id)
                  WHERE p.group_hash = 0 AND a.queue = s_queue AND a.priority = p.priority LIMIT 1) a ON true
              CROSS JOIN LATERAL (
                -- (the columns a caller needs, not the whole row: a row carried
                -- as one composite value is built, copied and taken apart again
                -- for every command)
                SELECT c.id, c.priority, c.group_hash, c.run_id, c.key, c.name, c.version, c.queue, c.args, c.status, c.attempts, c.next_run_at,
                       c.deadline, c.wait_timed_out, c.created_at, c.ctid AS row_at,
                       d.handler::oid AS handler, d.owner::oid AS owner, d.takes_context,
                       d.timeout, d.max_elapsed, d.args_type,
                       flow._budget_start(c.status, c.attempts, c.next_run_at, c.budget_started_at) AS budget_start
                FROM flow._commands c                                   -- index _commands_due
                JOIN flow._definitions d ON d.name = c.name AND d.version = c.version
                WHERE flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END) = flow._lane(s_queue, s_claimant)
                  AND c.priority = p.priority AND c.group_hash = p.group_hash
                  AND c.queue = s_queue AND c.external = (names IS NOT NULL)
                  AND (CASE WHEN c.external THEN c.name ELSE '' END) = s_claimant
                  AND c.status IN ('pending', 'waiting') AND c.next_run_at <= now()
                  AND (c.next_run_at, c.id) > (coalesce(a.at, '-infinity'), coalesce(a.id, '00000000-0000-0000-0000-000000000000'::uuid))
                  AND (excluded IS NULL OR c.id <> ALL (excluded))
                  -- (runs other workers' chunks hold: a command of one would be
                  -- locked here and left out below, see shmem::publish_busy_runs)
                  AND (busy_runs IS NULL OR c.run_id <> ALL (busy_runs))
                ORDER BY c.next_run_at, c.id
                LIMIT p.room
                FOR UPDATE OF c SKIP LOCKED
              ) k
              LIMIT s_take
            ) h
        ) h
        -- A held command is held with its run locked too (a run locked elsewhere,
        -- by a cancel or another chunk, leaves its command for a later claim: see
        -- flow._left_behind; busy_runs spares most of them the lock). A
        -- run's root with no child yet is held without its run's lock: only its
        -- own handler can add to the run (spawn), and its chunk never waits for
        -- the run's lock (a success of such a root writes no run; a failure takes
        -- the lock only if it is free, see _settle_failure's wait_for_run), so a
        -- cancel that holds the run and waits for the root (flow._cancel) cannot
        -- deadlock with it. That lock would be the only write to the run's row:
        -- its WAL, and a page dirtied, per command.
        -- (a CASE: the lock is taken only when the first test fails; a root with
        -- no child: see flow._run_rows. A root no attempt was counted for has
        -- none, without a probe: only its own attempt can spawn, and an attempt
        -- that kept its spawns is counted, see flow._settle_batch's `alone`)
        -- (A command of a rate-limited queue takes its cell here, in claim
        -- order. The claim holds the queue (as a limited one), so no other claim
        -- took its cells meanwhile: it locked no more than there are.)
        WHERE (s_rates[i] IS NULL OR flow._rate_admit(h.queue, s_rates[i], s_per_us[i]))
          AND (NOT h.held
           OR CASE WHEN h.id = h.run_id
                        AND (h.attempts = 0
                             OR NOT EXISTS (SELECT 1 FROM flow._commands k WHERE k.parent_id = h.id))  -- alone: docs/DESIGN.md
                   THEN true
                   ELSE EXISTS (SELECT 1 FROM flow._runs r WHERE r.id = h.run_id FOR UPDATE SKIP LOCKED)
                        -- (or it is left out, and due again at the claim's end)
                        OR flow._left_behind(h.next_run_at) END);
    END LOOP;
END $$;

-- Lease commands this transaction's claim locked (flow._claim, held = false):
-- each row says `running`, its attempt counted, with a lease that expires at
-- the attempt's deadline for an in-database worker (owner_pid, which it
-- watches), or after `lease` for an external one, until a heartbeat. Returns
-- each command's lease.
CREATE OR REPLACE FUNCTION flow._lease(owner_name text, owner_pid integer, owner_started timestamptz, lease interval,
    command_ids uuid[], row_ats tid[], attempt_deadlines timestamptz[])
RETURNS TABLE (command_id uuid, lease_token uuid, lease_expires_at timestamptz)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN QUERY
    WITH leased AS (
        UPDATE flow._commands c SET
            status = 'running',
            attempts = c.attempts + 1,
            attempt_started_at = now(),
            lease_token = flow._lease_token(),   -- (unguessable: src/api.rs)
            lease_owner = owner_name,
            lease_pid = owner_pid,
            lease_backend_start = owner_started,
            budget_started_at = flow._budget_start(c.status, c.attempts, c.next_run_at, c.budget_started_at),
            attempt_deadline = a.attempt_deadline,
            -- (an external lease ends at the attempt's deadline at the latest:
            -- its timeout, max_elapsed and the run's deadline hold for
            -- external workers too, see flow._heartbeat)
            lease_expires_at = CASE WHEN owner_pid IS NULL THEN least(now() + lease, coalesce(a.attempt_deadline, 'infinity'))
                                    ELSE coalesce(a.attempt_deadline, 'infinity') END,
            lease_interval = CASE WHEN owner_pid IS NULL THEN lease END,
            wait_timed_out = flow._wait_timed_out(c.status, c.wait_timed_out)
        FROM unnest(command_ids, row_ats, attempt_deadlines) AS a(id, row_at, attempt_deadline)
        -- (by the tid the claim locked, as LockRows left it: the row's latest
        -- version; a TID scan per command, not a second descent of the
        -- primary key: sql/common.sql)
        WHERE c.ctid = a.row_at AND NOT (c.id IS DISTINCT FROM a.id) AND c.status::text IN ('pending', 'waiting')
        RETURNING c.id, c.run_id, c.lease_token, c.lease_expires_at
    )
    SELECT k.id, k.lease_token, k.lease_expires_at FROM leased k;
END $$;

-- Milliseconds until the next command becomes due (NULL: none scheduled), so
-- an idle worker sleeps exactly that long (rule 1). Queues that are paused or
-- full are left out: what frees them (flow.set_queue, a settlement) wakes the
-- workers. So "due now" means a claim may take it: it came due after the
-- worker's last claim.
-- (plpgsql, not sql: its plan is kept for the worker's session; an sql
-- function with SET clauses is planned again at every call, a quarter of a
-- millisecond each time a worker goes idle. A generic plan from the first
-- call: the custom plans of the first five calls after each change of the
-- tables took 1.5 ms each, in every worker.)
CREATE OR REPLACE FUNCTION flow._next_due_ms(after_queues text[], after_priorities smallint[], after_at timestamptz[],
    after_ids uuid[]) RETURNS bigint
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    -- (after where the worker's claims take up, in the queues it names, as
    -- flow._claim's head probe reads it: not through the entries claimed
    -- since the last VACUUM at the queue's head)
    -- (a rate-limited queue's next command is due when its next cell is free)
    RETURN (SELECT (extract(epoch FROM min(greatest(h.next_run_at,
                CASE WHEN q.rate IS NOT NULL
                     THEN flow._rate_next(q.name, q.rate, (extract(epoch FROM q.per) * 1000000)::bigint) END))
            - clock_timestamp()) * 1000)::bigint
    FROM flow._queues q CROSS JOIN LATERAL unnest(q.priorities) AS p(priority)
    LEFT JOIN LATERAL (
        SELECT a.at, a.id FROM unnest(after_queues, after_priorities, after_at, after_ids) AS a(queue, priority, at, id)
        WHERE a.queue = q.name AND a.priority = p.priority LIMIT 1) a ON true
    CROSS JOIN LATERAL (
        -- the head of what has no group, after the cursor
        (SELECT c.next_run_at FROM flow._commands c                 -- index _commands_due
         WHERE flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END) = flow._lane(q.name, '')
           AND c.priority = p.priority AND c.group_hash = 0
           AND c.queue = q.name AND NOT c.external
           AND c.status IN ('pending', 'waiting') AND c.next_run_at < 'infinity'
           AND (c.next_run_at, c.id) > (coalesce(a.at, '-infinity'), coalesce(a.id, '00000000-0000-0000-0000-000000000000'::uuid))
         ORDER BY c.next_run_at LIMIT 1)
        UNION ALL
        -- the head of all its groups, in a queue without group_concurrency
        (SELECT c.next_run_at FROM flow._commands c                 -- index _commands_due_grouped
         WHERE q.group_concurrency IS NULL
           AND flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END) = flow._lane(q.name, '')
           AND c.priority = p.priority AND c.group_hash <> 0
           AND c.queue = q.name AND NOT c.external
           AND c.status IN ('pending', 'waiting') AND c.next_run_at < 'infinity'
           AND p.priority = ANY (q.grouped_priorities)
         ORDER BY c.next_run_at LIMIT 1)
        UNION ALL
        -- with group_concurrency, the earliest head of a group with room (of
        -- its first 1,000 groups: a queue with more may wait for its next
        -- wake-up, a settlement or the poll interval; what frees a full group,
        -- a settlement, wakes the workers)
        (SELECT min(h.next_run_at) FROM flow._groups_of(q.name, flow._lane(q.name, ''), p.priority, 0, 1000) g
         CROSS JOIN LATERAL (
             SELECT c.next_run_at FROM flow._commands c              -- index _commands_due
             WHERE flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END) = flow._lane(q.name, '')
               AND c.priority = p.priority AND c.group_hash = g.group_hash
               AND c.queue = q.name AND NOT c.external
               AND c.status IN ('pending', 'waiting') AND c.next_run_at < 'infinity'
             ORDER BY c.next_run_at LIMIT 1) h
         WHERE q.group_concurrency IS NOT NULL
           AND p.priority = ANY (q.grouped_priorities)
           AND q.group_concurrency > (SELECT count(*) FROM flow._commands r    -- index _commands_group_running
                                      WHERE r.queue = q.name AND r.group_hash = g.group_hash AND r.status = 'running'))) h
    WHERE NOT q.paused AND q.rate IS DISTINCT FROM 0
      AND (q.concurrency IS NULL
           OR q.concurrency > (SELECT count(*) FROM flow._commands r      -- index _commands_running
                               WHERE r.queue = q.name AND r.status = 'running')));
END $$;

-- src/lib.rs:63
-- requires:
--   claim

-- Settle: concluding attempts, successes in batches and failures one by one,
-- with the retry policy (rules 5-7).

-- Cut a message to at most 1 KiB of UTF-8 without splitting a character.
CREATE OR REPLACE FUNCTION flow._cut_message(message text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cut text := left(message, 1024);
BEGIN
    WHILE octet_length(cut) > 1024 LOOP
        cut := left(cut, length(cut) - greatest(1, (octet_length(cut) - 1024) / 4));
    END LOOP;
    RETURN cut;
END $$;

-- Lock runs, in id order (so two lockers never deadlock): their rows, and
-- for a run without a row (see flow._runs) its root's row, which stands for
-- it, waiting for runs locked elsewhere. (Without waiting, one run:
-- flow._try_lock_run_of.)
-- (generic plans: custom ones, which PostgreSQL keeps choosing for
-- `= ANY (run_ids)`, planned both queries at every call, 0.2 ms a settlement)
CREATE OR REPLACE FUNCTION flow._lock_runs(run_ids uuid[]) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    IF coalesce(cardinality(run_ids), 0) = 0 THEN
        RETURN;
    END IF;
    PERFORM 1 FROM flow._runs r WHERE r.id = ANY (run_ids) ORDER BY r.id FOR UPDATE;
    PERFORM 1 FROM flow._commands c
    WHERE c.id = ANY (run_ids) AND NOT EXISTS (SELECT 1 FROM flow._runs r WHERE r.id = c.id)
    ORDER BY c.id FOR UPDATE;
END $$;

-- Lock the runs of these commands (flow._lock_runs). Every settlement of a
-- run takes this lock first, so exactly one of them sees the run's last
-- command finish (rule 7). (An external completion of successes leaves the
-- run of a root with no child unlocked, and locks the others' itself:
-- flow._complete_many.)
-- (plpgsql, not sql: its plan is cached per session; an sql function called
-- from plpgsql is planned again on every call, ~70 µs.)
CREATE OR REPLACE FUNCTION flow._lock_runs_of(command_ids uuid[]) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM flow._lock_runs(ARRAY(SELECT DISTINCT c.run_id FROM flow._commands c WHERE c.id = ANY (command_ids)));
END $$;

-- Lock the run of a command unless another transaction holds it (then
-- false): for work that can wait for a later round, such as concluding an
-- attempt whose owner is gone; a leased settlement tries it for a while
-- (src/settle.rs, lock_run_briefly).
-- (one statement: through flow._lock_runs, a try took 210 µs, and the 200
-- children of a fan-out settling at 8 workers tried 1.8 times each)
CREATE OR REPLACE FUNCTION flow._try_lock_run_of(command_id uuid) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    locked boolean;
BEGIN
    WITH run AS (SELECT c.run_id AS id FROM flow._commands c WHERE c.id = _try_lock_run_of.command_id),
    run_row AS (SELECT r.id FROM flow._runs r WHERE r.id = (SELECT run.id FROM run) FOR UPDATE SKIP LOCKED),
    -- (a run without a row: its root's row; a run whose row is locked
    -- elsewhere has a row, and its root is not taken)
    root_row AS (SELECT c.id FROM flow._commands c
                 WHERE c.id = (SELECT run.id FROM run) AND NOT EXISTS (SELECT 1 FROM flow._runs r WHERE r.id = c.id)
                 FOR UPDATE SKIP LOCKED)
    SELECT EXISTS (SELECT 1 FROM run_row) OR EXISTS (SELECT 1 FROM root_row) INTO locked;
    RETURN locked;
END $$;

-- Close every unfinished command of a run (cancel, run failure, or the
-- run's deadline: reason 'deadline', the commands expire). An
-- attempt in progress gets an attempt row and is counted, leased or held
-- (a held one is known from its worker's shared memory, as the views know it:
-- say, a handler that cancels its own run); its worker's later settlement
-- finds no lease, or a command that moved on.
CREATE OR REPLACE FUNCTION flow._close_open_commands(run_id uuid, reason text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    interrupted integer;
BEGIN
    WITH in_progress AS (
        SELECT c.id, c.attempts AS attempt, c.lease_token, c.lease_owner AS owner, c.attempt_started_at AS started_at
        FROM flow._commands_of(_close_open_commands.run_id) c WHERE c.status::text = 'running'   -- (sql/common.sql)
        UNION ALL
        -- held: by a live worker (its shared memory), or named by the record
        -- of a worker that stopped in it and is not concluded yet
        (SELECT DISTINCT ON (h.command_id) h.command_id, h.attempt, gen_random_uuid(), h.owner, h.started_at
         FROM (SELECT h.command_id, h.attempt, h.owner, h.started_at, 0 AS pick FROM flow._held_attempts h
               UNION ALL
               SELECT r.command_id, r.attempt, 'a stopped worker', clock_timestamp(), 1
               FROM flow._recorded_attempts() r) h
         JOIN flow._commands_of(_close_open_commands.run_id) c ON c.id = h.command_id
         WHERE c.status::text IN ('pending', 'waiting') AND c.attempts = h.attempt - 1
         ORDER BY h.command_id, h.pick)   -- (a live worker's entry first)
    ), counted AS (
        INSERT INTO flow._attempts (command_id, attempt, lease_token, owner, started_at, finished_at,
            outcome, error_code, error_message)
        SELECT i.id, i.attempt, i.lease_token, i.owner, i.started_at, clock_timestamp(),
               CASE WHEN reason = 'deadline' THEN 'expired' ELSE 'cancelled' END,
               reason, 'the run ended while this attempt ran'
        FROM in_progress i
        RETURNING command_id, attempt
    ), closed AS (
        UPDATE flow._commands c SET
            status = CASE WHEN reason = 'deadline' THEN 'expired' ELSE 'cancelled' END::flow.command_status,
            stop_reason = reason, finished_at = clock_timestamp(),
            attempts = coalesce((SELECT k.attempt FROM counted k WHERE k.command_id = c.id), c.attempts),
            lease_token = NULL, lease_owner = NULL, lease_pid = NULL, lease_backend_start = NULL,
            lease_expires_at = NULL, lease_interval = NULL, attempt_started_at = NULL, attempt_deadline = NULL
        WHERE c.id = ANY (ARRAY(SELECT k.id FROM flow._commands_of(_close_open_commands.run_id) k)) AND c.finished_at IS NULL
    )
    SELECT count(*) INTO interrupted FROM counted;
    PERFORM flow._observe(CASE WHEN reason = 'deadline' THEN 'attempts_expired' ELSE 'attempts_cancelled' END,
                          interrupted);
END $$;

-- Hand claimed commands back to their queue. One whose attempt never
-- started (a claim its worker did not reach in time, a chunk that failed
-- before it, a dead worker's lease its record does not name) gives back the
-- attempt the claim counted. One whose attempt started and that the engine
-- voided (`voided[i]`, the reason: 'demoted', a fast attempt cut at its
-- budget; 'engine_error', its chunk failed outside its handler; 'late_cancel',
-- a cancel signal meant for an attempt before it) keeps it, recorded as
-- 'voided': every attempt that started is counted (rule 3), and a voided one
-- is not charged against max_attempts (flow._settle_failure). Takes no run
-- lock and skips a command row locked elsewhere; returns those still held,
-- so the worker tries again later.
CREATE OR REPLACE FUNCTION flow._release(command_ids uuid[], lease_tokens uuid[], voided text[] DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    released uuid[];
BEGIN
    WITH mine AS (
        SELECT c.id, t.void FROM flow._commands c
        JOIN unnest(command_ids, lease_tokens, voided) AS t(id, token, void) ON c.id = ANY (ARRAY[t.id])
        WHERE c.status::text = 'running' AND c.lease_token = t.token   -- by id (sql/common.sql)
        FOR UPDATE OF c SKIP LOCKED
    ), counted AS (
        INSERT INTO flow._attempts (command_id, attempt, lease_token, owner, started_at, finished_at,
            outcome, error_code, error_message)
        SELECT c.id, c.attempts, c.lease_token, c.lease_owner, c.attempt_started_at, clock_timestamp(),
               'voided', m.void, flow._voided_message(m.void)
        FROM mine m JOIN flow._commands c ON c.id = ANY (ARRAY[m.id])
        WHERE m.void IS NOT NULL
    ), done AS (
        UPDATE flow._commands c SET status = 'pending',
            attempts = CASE WHEN mine.void IS NULL THEN c.attempts - 1 ELSE c.attempts END,
            lease_token = NULL, lease_owner = NULL, lease_pid = NULL, lease_backend_start = NULL,
            lease_expires_at = NULL, lease_interval = NULL, attempt_started_at = NULL, attempt_deadline = NULL
        FROM mine WHERE c.id = ANY (ARRAY[mine.id])
        RETURNING c.id
    )
    SELECT coalesce(array_agg(done.id), '{}') INTO released FROM done;
    PERFORM flow._observe('handed_back', cardinality(released)),
            flow._observe('attempts_voided', (SELECT count(*) FROM unnest(command_ids, voided) AS x(id, void)
                                               WHERE x.void IS NOT NULL AND x.id = ANY (released)));
    PERFORM flow._wake();
    RETURN QUERY
        SELECT c.id FROM flow._commands c JOIN unnest(command_ids, lease_tokens) AS t(id, token) ON c.id = ANY (ARRAY[t.id])
        WHERE c.status::text = 'running' AND c.lease_token = t.token AND c.id <> ALL (released);
END $$;

-- Why the engine voided an attempt (flow._release, flow._void_held).
CREATE OR REPLACE FUNCTION flow._voided_message(code text) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE code
        WHEN 'demoted' THEN 'the attempt ran past the 100 ms budget of a fast handler: run again alone, not charged'
        WHEN 'engine_error' THEN 'the engine failed outside this attempt''s handler: run again, not charged'
        WHEN 'late_cancel' THEN 'a cancel meant for an earlier attempt stopped it: run again, not charged'
        WHEN 'crash' THEN 'its worker stopped later in the same transaction, which rolled it back: run again, not charged'
        WHEN 'cancelled' THEN 'its run was cancelled while it ran: counted, not charged'
        WHEN 'run_locked' THEN 'its run stayed locked elsewhere at its settlement: run again, not charged'
        ELSE code END
$$;

-- Void a held attempt that started (its command only locked, nothing
-- written): the attempt `attempt` is counted, recorded as 'voided' with the
-- reason `code` (see flow._release), and not charged. Changes nothing if the
-- command has moved on. Returns whether it voided it.
CREATE OR REPLACE FUNCTION flow._void_held(command_id uuid, attempt integer, lease_token uuid, owner_name text,
    started timestamptz, code text)
RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE flow._commands c SET attempts = attempt,
        budget_started_at = flow._budget_start(c.status, c.attempts, c.next_run_at, c.budget_started_at),
        wait_timed_out = flow._wait_timed_out(c.status, c.wait_timed_out)
    WHERE c.id = _void_held.command_id AND c.status::text IN ('pending', 'waiting') AND c.attempts = attempt - 1;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO flow._attempts (command_id, attempt, lease_token, owner, started_at, finished_at,
        outcome, error_code, error_message)
    VALUES (command_id, attempt, lease_token, owner_name, least(started, clock_timestamp()), clock_timestamp(),
            'voided', code, flow._voided_message(code));
    PERFORM flow._observe('attempts_voided', 1);
    RETURN true;
END $$;

-- Settle successful attempts in three set-based statements: a worker chunk's,
-- or one external completion. A succeeded command is the record of its
-- successful attempt (see sql/schema.sql, _attempts). The caller holds their
-- runs' locks (_lock_runs_of, the claim, _complete_many), but a root's with
-- no child, whose success writes no run (below). Returns the ids of the
-- commands it settled: a command the caller read as its own may have moved
-- on before this statement locked it (a cancel, a lease concluded as lost,
-- a second completion), and is then left as it is and not among them.
-- handler_started: when each handler started (in-database workers; NULL:
-- the attempt started at its claim), so an attempt's duration is its own.
-- held_attempts: for commands an in-database worker holds (see _claim), the
-- number of the attempt it made (NULL for leased ones), and owner_name the
-- worker: the claim's writes are made here, with the settlement's.
-- held_rows: where each held command's row is (its tid, from the claim that
-- locked it): the settlement writes it there, not through a probe of the
-- primary key for each (the lock kept the row where it was; a row this
-- transaction moved since, as a handler's cancel of its own run does, is not
-- there for it any more, and stays unsettled, as one whose status moved on).
-- chunk_spawned: whether any handler in the caller's transaction may have
-- spawned a command (an in-database worker knows, flow._note_spawn; true
-- when unknown): see `alone` below.
-- (Generic plans: every statement here is driven by the ids it is given,
-- whatever they are; a custom plan per call re-planned the statement that
-- completes runs of several commands, with its inlined _commands_of, for
-- half a millisecond per settlement, runs of one command or not.)
CREATE OR REPLACE FUNCTION flow._settle_batch(command_ids uuid[], lease_tokens uuid[], results jsonb[],
    handler_started timestamptz[] DEFAULT NULL, held_attempts integer[] DEFAULT NULL, owner_name text DEFAULT NULL,
    held_rows tid[] DEFAULT NULL, chunk_spawned boolean DEFAULT true)
RETURNS uuid[]
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    settled uuid[];
    other_runs uuid[];
    old_root_runs uuid[];
    old_root_results jsonb[];
    finished integer;
    more integer;
BEGIN
    -- (the commands are looked up by id: their status is compared as text,
    -- see sql/common.sql)
    WITH item AS NOT MATERIALIZED (   -- (read by each branch below that runs, one for a chunk all held or all leased: not copied first)
        SELECT * FROM unnest(command_ids, lease_tokens, results, handler_started, held_attempts, held_rows)
                      AS t(id, token, result, started, held, row_at)
    ), leased_done AS (
        -- leased: the lease token must still be the command's. The command
        -- keeps the token, owner and start of its successful attempt: that is
        -- the attempt's record (no _attempts row; see sql/schema.sql).
        UPDATE flow._commands c SET status = 'succeeded', result = t.result, finished_at = clock_timestamp(),
            attempt_started_at = coalesce(t.started, c.attempt_started_at),
            lease_pid = NULL, lease_backend_start = NULL, lease_expires_at = NULL, lease_interval = NULL,
            attempt_deadline = NULL
        FROM item t
        WHERE c.id = ANY (ARRAY[t.id]) AND t.held IS NULL AND c.status::text = 'running' AND c.lease_token = t.token
          -- (one-time filters: a worker's chunk is all held or all leased,
          -- and the branch with none of its commands reads no item)
          AND (held_attempts IS NULL OR array_position(held_attempts, NULL) IS NOT NULL)
        RETURNING c.id, c.run_id, c.result, c.parent_id, NULL::integer AS held
    ), held_done AS (
        -- held (locked by this transaction's claim): the command must not have
        -- moved on (a cancel in the handler's own transaction); the writes the
        -- claim of a leased attempt makes are made here, with the attempt's record
        UPDATE flow._commands c SET status = 'succeeded', result = t.result, finished_at = clock_timestamp(),
            attempts = t.held, lease_token = t.token, lease_owner = owner_name, attempt_started_at = t.started,
            budget_started_at = flow._budget_start(c.status, c.attempts, c.next_run_at, c.budget_started_at),
            wait_timed_out = flow._wait_timed_out(c.status, c.wait_timed_out)
        FROM item t
        -- (by its tid: a probe of the row per command, whatever the table's
        -- statistics; the id is compared as a filter the planner cannot join by)
        WHERE c.ctid = t.row_at AND NOT (c.id IS DISTINCT FROM t.id)
          AND t.held IS NOT NULL AND c.status::text IN ('pending', 'waiting')
          AND c.attempts = t.held - 1
          AND cardinality(array_remove(held_attempts, NULL)) > 0
        RETURNING c.id, c.run_id, c.result, c.parent_id, t.held
    ), done AS (
        SELECT d.*,
               -- a root without children: the run's only command (spawned ones descend
               -- from it). flow._run_rows recognizes such a run by the same test; the two
               -- must agree, or a run whose row is not written here is never seen ended
               -- (the places that make this test are listed there).
               -- A held root in its first attempt (none counted before) has no
               -- child unless a handler of this transaction spawned one, so
               -- it needs no probe: a child is spawned only by its parent's
               -- attempt (flow._spawn_many), and an attempt whose spawns were kept
               -- is counted (one given back by flow._release kept nothing of
               -- its transaction). The claim's held test takes the same step.
               d.parent_id IS NULL
               AND CASE WHEN d.held = 1 AND NOT chunk_spawned THEN true
                        ELSE NOT EXISTS (SELECT 1 FROM flow._commands k WHERE k.parent_id = d.id)  -- alone: docs/DESIGN.md
                   END AS alone
        FROM (SELECT * FROM leased_done UNION ALL SELECT * FROM held_done) d
        OFFSET 0   -- (kept a subquery: pulled up, its probe ran once per aggregate below, three times a command)
    )
    SELECT coalesce(array_agg(done.id), '{}'), array_agg(done.run_id) FILTER (WHERE NOT done.alone),
           count(*) FILTER (WHERE done.alone AND done.id = done.run_id),
           array_agg(done.run_id) FILTER (WHERE done.alone AND done.id <> done.run_id),
           array_agg(done.result) FILTER (WHERE done.alone AND done.id <> done.run_id)
    INTO settled, other_runs, finished, old_root_runs, old_root_results FROM done;
    -- The runs whose last command this was. A run of one command ended with
    -- its root, and its row is left alone: its end is the root's row (see
    -- flow._run_rows). What keeps a cancel from ending it meanwhile is the
    -- root's row lock (the claim's, or this settlement's): a cancel takes the
    -- run's unfinished commands before it reads whether the run ended
    -- (flow._lock_run_and_commands).
    -- A root made before 0.2.0 (its id is not its run's) still ends its run
    -- here, and other runs end once none of their commands is unfinished.
    IF old_root_runs IS NOT NULL THEN
        UPDATE flow._runs r SET status = 'succeeded', finished_at = clock_timestamp(), result = t.result
        FROM unnest(old_root_runs, old_root_results) AS t(id, result)
        WHERE r.id = ANY (ARRAY[t.id]) AND r.status = 'running';
        GET DIAGNOSTICS more = ROW_COUNT;
        finished := finished + more;
    END IF;
    IF other_runs IS NOT NULL THEN
        UPDATE flow._runs r SET status = 'succeeded', finished_at = clock_timestamp(),
            result = (SELECT c.result FROM flow._commands_of(r.id) c WHERE c.parent_id IS NULL)
        WHERE r.id = ANY (other_runs) AND r.status = 'running'
          -- (none of its commands unfinished: its root, by id; its children,
          -- by their own index, whatever the number finished; a root made
          -- before 0.2.0, by its key. Through flow._commands_of, the children
          -- were read in key order up to the first unfinished one: under the
          -- run's lock, 2.3 ms a settlement when 4,000 were half done.)
          AND NOT EXISTS (SELECT 1 FROM flow._commands c WHERE c.id = r.id AND c.finished_at IS NULL)
          AND NOT EXISTS (SELECT 1 FROM flow._commands c                  -- index _commands_open_children
                          WHERE c.run_id = r.id AND c.parent_id IS NOT NULL AND c.finished_at IS NULL)
          AND NOT EXISTS (SELECT 1 FROM flow._commands c                  -- index _commands_run_key
                          WHERE c.run_id = r.id AND c.key = 'root' AND c.id <> c.run_id AND c.finished_at IS NULL);
        GET DIAGNOSTICS more = ROW_COUNT;
        finished := finished + more;
    END IF;
    PERFORM flow._observe('attempts_succeeded', cardinality(settled)), flow._observe('runs_succeeded', finished);
    -- a limited queue may have room now (otherwise nobody is waiting for this)
    IF EXISTS (SELECT 1 FROM flow._queues q WHERE q.concurrency IS NOT NULL) THEN
        PERFORM flow._wake_due_from('infinity');   -- (room, nothing made due)
    END IF;
    RETURN settled;
END $$;

-- Settle a failed attempt and apply the retry policy (rules 5-6). outcome is
-- the class: permanent, retry_after, timeout, interrupted, lease_lost, crash,
-- retryable. Returns 'retry', 'failed', or 'expired' (lease not held: no change).
-- held_attempt: the command is not leased but held (see _claim), or was held
-- by a worker that stopped in its attempt (src/attempt_record.rs): the
-- attempt with this number is counted here, by `owner_name`, unless the
-- command has moved on since.
-- wait_for_run false: the caller's transaction holds the command (a worker's
-- chunk) and must not wait for its run's lock, which a cancel may hold while
-- it waits for the command (a root held without its run's lock, see _claim):
-- with the run locked elsewhere nothing is written and 'locked' returned,
-- the attempt left to that cancel.
CREATE OR REPLACE FUNCTION flow._settle_failure(command_id uuid, lease_token uuid, outcome text, code text,
    message text, retry_delay interval DEFAULT NULL, handler_started timestamptz DEFAULT NULL,
    held_attempt integer DEFAULT NULL, owner_name text DEFAULT NULL, wait_for_run boolean DEFAULT true)
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    c flow._commands;
    d flow._definitions;
    next_at timestamptz;
    stop text;
    charged integer;
    cut text := flow._cut_message(coalesce(message, code));
BEGIN
    IF wait_for_run THEN
        PERFORM flow._lock_runs_of(ARRAY[command_id]);
    ELSIF NOT flow._try_lock_run_of(command_id) THEN
        RETURN 'locked';
    END IF;
    IF held_attempt IS NULL THEN
        -- (a lease concluded as lost was read as expired before this lock:
        -- a heartbeat committed meanwhile extended it, and it stands)
        SELECT * INTO c FROM flow._commands x
        WHERE x.id = _settle_failure.command_id AND x.status::text = 'running'   -- by id (sql/common.sql)
          AND x.lease_token = _settle_failure.lease_token
          AND (outcome <> 'lease_lost' OR x.lease_expires_at < now())
        FOR UPDATE;
    ELSIF wait_for_run THEN
        SELECT * INTO c FROM flow._commands x
        WHERE x.id = _settle_failure.command_id AND x.status::text IN ('pending', 'waiting')
          AND x.attempts = held_attempt - 1
        FOR UPDATE;
        IF NOT FOUND THEN
            RETURN 'expired';
        END IF;
    ELSE
        -- (a row locked by another transaction is not waited for either:
        -- 'locked'; one this transaction holds, a worker's chunk's, is read)
        SELECT * INTO c FROM flow._commands x
        WHERE x.id = _settle_failure.command_id AND x.status::text IN ('pending', 'waiting')
          AND x.attempts = held_attempt - 1
        FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN CASE WHEN EXISTS (SELECT 1 FROM flow._commands x
                                     WHERE x.id = _settle_failure.command_id
                                       AND x.status::text IN ('pending', 'waiting') AND x.attempts = held_attempt - 1)
                        THEN 'locked' ELSE 'expired' END;
        END IF;
    END IF;
    IF held_attempt IS NOT NULL THEN
        -- what the claim of a leased attempt would have written
        c.budget_started_at := flow._budget_start(c.status, c.attempts, c.next_run_at, c.budget_started_at);
        c.wait_timed_out := flow._wait_timed_out(c.status, c.wait_timed_out);
        c.attempts := held_attempt;
        c.lease_token := _settle_failure.lease_token;
        c.lease_owner := owner_name;
        c.attempt_started_at := coalesce(handler_started, clock_timestamp());
    END IF;
    IF NOT FOUND THEN
        RETURN 'expired';
    END IF;
    SELECT * INTO d FROM flow._definitions x WHERE x.name = c.name AND x.version = c.version;

    -- The attempts charged: not those the engine voided (flow._release),
    -- nor those before the command's last re-drive (flow._retry). The limit
    -- and the backoff count these alone.
    charged := c.attempts - c.attempt_base
               - (SELECT count(*) FROM flow._attempts a                    -- index _attempts_pkey
                  WHERE a.command_id = c.id AND a.attempt > c.attempt_base AND a.outcome = 'voided');
    IF outcome = 'permanent' THEN
        stop := 'permanent';
    ELSIF charged >= d.max_attempts THEN
        stop := 'attempt_limit';
    ELSE
        next_at := clock_timestamp() + CASE WHEN outcome = 'retry_after' AND retry_delay > interval '0' THEN retry_delay
                                ELSE flow._backoff(d.backoff, d.backoff_max, greatest(charged, 1)) END;
        IF next_at > flow._deadline(c.budget_started_at, d.max_elapsed) THEN
            stop := 'elapsed_limit';
        ELSIF c.deadline IS NOT NULL AND next_at >= c.deadline THEN
            stop := 'deadline_before_next_attempt';
        END IF;
    END IF;

    INSERT INTO flow._attempts (command_id, attempt, lease_token, owner, started_at, finished_at,
        outcome, error_code, error_message)
    VALUES (c.id, c.attempts, c.lease_token, c.lease_owner, coalesce(handler_started, c.attempt_started_at),
            clock_timestamp(), outcome, code, cut);
    PERFORM flow._observe('attempts_' || outcome, 1), flow._observe('stops_' || stop, 1);
    UPDATE flow._commands x SET
        status = CASE WHEN stop IS NULL THEN 'pending' ELSE 'failed' END::flow.command_status,
        attempts = c.attempts, budget_started_at = c.budget_started_at, wait_timed_out = c.wait_timed_out,
        next_run_at = coalesce(next_at, x.next_run_at),
        finished_at = CASE WHEN stop IS NULL THEN NULL ELSE clock_timestamp() END,
        stop_reason = stop, last_error_code = code, last_error_message = cut,
        lease_token = NULL, lease_owner = NULL, lease_pid = NULL, lease_backend_start = NULL,
        lease_expires_at = NULL, lease_interval = NULL, attempt_started_at = NULL, attempt_deadline = NULL
    WHERE x.id = c.id;

    IF stop IS NOT NULL THEN
        -- A terminal failure fails the run and cancels its other commands (rule 7).
        PERFORM flow._run_row_needed(c.run_id);   -- (its root is locked above)
        UPDATE flow._runs r SET status = 'failed', finished_at = clock_timestamp(),
            error = jsonb_build_object('command_id', c.id, 'command_key', c.key, 'name', c.name,
                                       'code', code, 'message', cut, 'stop_reason', stop)
        WHERE r.id = c.run_id AND r.status = 'running';
        IF FOUND THEN
            PERFORM flow._observe('runs_failed', 1);
        END IF;
        PERFORM flow._close_open_commands(c.run_id, 'run_failed');
    END IF;
    PERFORM flow._wake();
    RETURN CASE WHEN stop IS NULL THEN 'retry' ELSE 'failed' END;
END $$;

-- src/lib.rs:64
-- requires:
--   settle

-- Recover: concluding attempts whose owner is gone (rule 8), run by the
-- maintenance worker (src/recovery.rs). Nothing here waits for a lock: a
-- run or row locked elsewhere (a client idle in its transaction, a chunk
-- that holds a root) is tried without waiting (SKIP LOCKED, NOWAIT) and left,
-- in a subtransaction rolled back, for the next round. A wait without limit
-- here would stop every recovery, expiry and pruning behind one idle client.
-- (Not lock_timeout: the engine's statements run with query cancels held off,
-- src/spi.rs, and a lock timeout is one.)

-- Which of these worker processes (pid, backend start) are gone.
CREATE OR REPLACE FUNCTION flow._gone_workers(pids integer[], started timestamptz[]) RETURNS boolean[]
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(array_agg(NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                                          WHERE a.pid = w.pid AND a.backend_start = w.started) ORDER BY w.i), '{}')
    FROM unnest(pids, started) WITH ORDINALITY AS w(pid, started, i)
$$;

-- Conclude, as interrupted, the attempt a gone worker's record names (see
-- src/attempt_record.rs): the attempt `attempt` of `command_id`, which the
-- worker (pid, started) had leased, or held (its row only locked, its
-- attempt not counted yet). Changes nothing if the command has moved on
-- (settled, or concluded already). Returns 'retry' or 'failed' (concluded),
-- 'expired' (moved on) or 'locked' (its run or row is locked elsewhere: try
-- again later).
CREATE OR REPLACE FUNCTION flow._conclude_record(command_id uuid, attempt integer, pid integer, started timestamptz)
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    c flow._commands;
    message constant text := 'the worker running this attempt exited before settling it';
BEGIN
    SELECT * INTO c FROM flow._commands x WHERE x.id = _conclude_record.command_id;
    IF c.status::text = 'running' AND c.lease_pid = pid AND c.lease_backend_start = started
       AND c.attempts = attempt THEN
        RETURN flow._settle_failure(c.id, c.lease_token, 'interrupted', 'owner_died', message,
                                    wait_for_run => false);
    ELSIF c.status::text IN ('pending', 'waiting') AND c.attempts = attempt - 1 THEN
        RETURN flow._settle_failure(c.id, flow._new_id(), 'interrupted', 'owner_died', message,
                                    held_attempt => attempt, owner_name => current_database() || ':' || pid,
                                    wait_for_run => false);
    END IF;
    RETURN 'expired';
EXCEPTION WHEN lock_not_available THEN
    RETURN 'locked';
END $$;

-- One round of recovery. The writers of attempt records (pids[i], started[i]),
-- whether each was found gone (gone[i]), and for those gone what their record
-- names (recorded_commands[i], recorded_attempts[i]; NULL: no attempt):
-- * the attempt each gone worker's record names is charged, interrupted
--   (flow._conclude_record);
-- * the earlier attempts of a gone worker's open transaction (earlier_*:
--   writer index, command, attempt) ended, but their settlements rolled
--   back with that transaction: each is voided, code 'crash' (counted, not
--   charged; a leased one released, a held one by flow._void_held);
-- * the other commands a gone worker had leased never started their
--   attempt: they go back to their queues uncharged (flow._release). A lease of a worker that is gone
--   and wrote no record (after an OS crash lost the files) is charged, the
--   conservative side of rule 3; one of a worker that went after the
--   records were read waits for the next round;
-- * an external lease past its expiry is concluded as lease_lost.
-- Returns how many attempts it concluded, and for each writer whether its
-- record is done with (gone, and what it names concluded or moved on).
CREATE OR REPLACE FUNCTION flow._recover(pids integer[], started timestamptz[], gone boolean[],
    recorded_commands uuid[], recorded_attempts integer[], earlier_writers integer[], earlier_commands uuid[],
    earlier_attempts integer[], OUT concluded integer, OUT records_done boolean[])
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    w record;
    e record;
    lost record;
    outcome text;
    entered flow._commands;
BEGIN
    concluded := 0;
    records_done := '{}';
    FOR w IN SELECT * FROM unnest(pids, started, gone, recorded_commands, recorded_attempts)
                          WITH ORDINALITY AS x(writer_pid, writer_started, writer_gone, command_id, attempt, i)
             ORDER BY x.i LOOP
        outcome := CASE WHEN NOT w.writer_gone THEN 'alive'
                        WHEN w.command_id IS NULL THEN 'expired'
                        ELSE flow._conclude_record(w.command_id, w.attempt, w.writer_pid, w.writer_started) END;
        records_done := records_done || (outcome NOT IN ('alive', 'locked'));
        concluded := concluded + (outcome IN ('retry', 'failed'))::integer;
    END LOOP;

    FOR e IN SELECT * FROM unnest(earlier_writers, earlier_commands, earlier_attempts) AS x(writer, command_id, attempt)
    LOOP
        CONTINUE WHEN NOT coalesce(gone[e.writer], false);
        BEGIN
            SELECT * INTO entered FROM flow._commands x WHERE x.id = e.command_id FOR UPDATE NOWAIT;
            IF entered.status::text = 'running' AND entered.lease_pid = pids[e.writer]
               AND entered.lease_backend_start = started[e.writer] AND entered.attempts = e.attempt THEN
                IF EXISTS (SELECT FROM flow._release(ARRAY[entered.id], ARRAY[entered.lease_token], ARRAY['crash'])) THEN
                    records_done[e.writer] := false;
                END IF;
            ELSIF entered.status::text IN ('pending', 'waiting') AND entered.attempts = e.attempt - 1 THEN
                PERFORM flow._void_held(entered.id, e.attempt, flow._new_id(),
                                        current_database() || ':' || pids[e.writer], clock_timestamp(), 'crash');
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            records_done[e.writer] := false;   -- (next round)
        END;
    END LOOP;

    FOR lost IN
        SELECT c.id, c.lease_token, c.lease_pid IS NULL AS external,
               coalesce(c.attempt_deadline <= c.lease_expires_at, false) AS timed_out,
               (SELECT bool_or(g.writer_gone) FROM unnest(pids, started, gone) AS g(writer_pid, writer_started, writer_gone)
                WHERE g.writer_pid = c.lease_pid AND g.writer_started = c.lease_backend_start) AS writer_gone,
               (SELECT min(g.i) FROM unnest(pids, started) WITH ORDINALITY AS g(writer_pid, writer_started, i)
                WHERE g.writer_pid = c.lease_pid AND g.writer_started = c.lease_backend_start) AS writer
        FROM flow._commands c                                       -- index _commands_running
        WHERE c.status = 'running'
          AND CASE WHEN c.lease_pid IS NULL THEN c.lease_expires_at < now()
                   ELSE NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                                    WHERE a.pid = c.lease_pid AND a.backend_start = c.lease_backend_start) END
    LOOP
        IF NOT lost.external THEN
            -- (named by its worker's record: concluded above, or on a later round)
            CONTINUE WHEN lost.id = ANY (recorded_commands) OR lost.writer_gone IS false;
            IF lost.writer_gone THEN
                -- A row locked elsewhere is released on a later round, and
                -- its writer's record kept until then: without it, that lease
                -- would be taken for one an OS crash left, and charged.
                IF EXISTS (SELECT FROM flow._release(ARRAY[lost.id], ARRAY[lost.lease_token])) THEN
                    records_done[lost.writer] := false;
                END IF;
                CONTINUE;
            END IF;
        END IF;
        BEGIN
            -- a run locked elsewhere (an external client idle in its transaction, a
            -- long chunk) is concluded on a later round, never waited for
            CONTINUE WHEN NOT flow._try_lock_run_of(lost.id);
            IF lost.external THEN
                outcome := flow._conclude_expired_lease(lost.id, lost.lease_token, lost.timed_out);
            ELSE
                outcome := flow._settle_failure(lost.id, lost.lease_token, 'interrupted', 'owner_died',
                                                'the worker running this attempt exited before settling it');
            END IF;
            concluded := concluded + (outcome <> 'expired')::integer;
        EXCEPTION WHEN lock_not_available THEN
            NULL;   -- (its row, or a run the lock found taken meanwhile: next round)
        END;
    END LOOP;
END $$;

-- End the runs whose deadline has passed (rule 6): each one fails with
-- stop_reason 'deadline', and its unfinished commands expire (an attempt in
-- progress is counted, outcome 'expired'; an in-database handler still in
-- it is cut off by its own deadline, which is never later than the run's).
-- Without this a run whose child is due after the deadline, or whose
-- external command nobody claims, would stay running. A run locked
-- elsewhere, or one of its commands (a held root's chunk, a client's held
-- claim), is left for the next round: their locks are tried without waiting,
-- in a subtransaction rolled back if one is taken (a held root that
-- succeeds meanwhile then ends its run as it should).
-- Earliest deadlines first. Returns how many runs ended.
CREATE OR REPLACE FUNCTION flow._expire_runs() RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    late uuid;
    ended integer := 0;
BEGIN
    FOR late IN
        SELECT c.run_id FROM flow._commands c                       -- index _commands_deadline
        WHERE c.finished_at IS NULL AND c.deadline IS NOT NULL AND c.deadline <= now()
        ORDER BY c.deadline
        LIMIT 1000
    LOOP
        BEGIN
            CONTINUE WHEN NOT flow._try_lock_run_of(late);
            -- (its commands first, as a cancel takes them, then the check under the
            -- locks: still past its deadline with something unfinished)
            PERFORM 1 FROM flow._commands c
            WHERE c.id = ANY (ARRAY(SELECT k.id FROM flow._commands_of(late) k WHERE k.finished_at IS NULL))
            ORDER BY c.id FOR UPDATE OF c NOWAIT;
            CONTINUE WHEN NOT EXISTS (SELECT 1 FROM flow._commands_of(late) c
                                      WHERE c.finished_at IS NULL AND c.deadline <= now());
            PERFORM flow._run_row_needed(late);
            UPDATE flow._runs r SET status = 'failed', finished_at = clock_timestamp(),
                error = jsonb_build_object('code', 'deadline', 'message', 'the run''s deadline passed',
                                           'stop_reason', 'deadline', 'deadline', r.deadline)
            WHERE r.id = late AND r.status = 'running';
            IF FOUND THEN
                ended := ended + 1;
            END IF;
            PERFORM flow._close_open_commands(late, 'deadline');
            PERFORM flow._interrupt_run(late);
        EXCEPTION WHEN lock_not_available THEN
            NULL;   -- (next round)
        END;
    END LOOP;
    PERFORM flow._observe('runs_failed', ended), flow._observe('stops_deadline', ended);
    RETURN ended;
END $$;

-- src/lib.rs:65
-- requires:
--   recover

-- Retention: pruning finished runs and retiring old journal entries.

-- Let the current transaction commit without waiting for its WAL to be
-- flushed (synchronous_commit off until it ends), for work that is done
-- again if a crash loses it. A later flushed commit flushes it too.
CREATE OR REPLACE FUNCTION flow._commit_without_flush() RETURNS void
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    SELECT set_config('synchronous_commit', 'off', true)
$$;

-- Compress the full-page images the current transaction writes to WAL (lz4,
-- when the server compresses none and was built with it). Pruning deletes
-- rows from pages last written a retention ago, so nearly every page it
-- touches was checkpointed since and is logged whole: in a churn at 58,000
-- runs/s with a retention of a minute, its deletions wrote two thirds of all
-- full-page image bytes, a sixth of the WAL, and each checkpoint (every 7-8 s
-- there, max_wal_size = 1GB) brought the next round of them.
CREATE OR REPLACE FUNCTION flow._compress_page_images() RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF current_setting('wal_compression') = 'off' THEN
        PERFORM set_config('wal_compression', 'lz4', true);
    END IF;
EXCEPTION WHEN invalid_parameter_value THEN
    NULL;   -- (a server built without lz4 keeps its setting)
END $$;

-- Delete the runs that finished more than `older_than` ago among the next
-- `max_runs` runs after `after` (in id order; NULL: from the oldest), with
-- their commands, attempts and waits. Returns how many were deleted and the
-- last run looked at (NULL: none left before the cut, start again from the
-- oldest next time). Run ids are UUIDv7, so "created before the cut" is a
-- range of the primary key: no index on finished_at is needed (one would
-- make every run's final update non-HOT), and the moving window never walks
-- the same unfinished runs twice in a round, however large a backlog is.
CREATE OR REPLACE FUNCTION flow._prune(older_than interval, max_runs integer, after uuid,
    OUT pruned integer, OUT last uuid)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cut timestamptz := now() - older_than;
    hex text := lpad(to_hex((extract(epoch FROM cut) * 1000)::bigint), 12, '0');
    bound uuid := (substr(hex, 1, 8) || '-' || substr(hex, 9, 4) || '-7000-8000-000000000000')::uuid;
    start uuid := coalesce(after, '00000000-0000-0000-0000-000000000000');
    seen uuid[];
    with_row uuid[];
    alone_at tid[];
    ended_ids uuid[];
BEGIN
    -- (committed without waiting for its WAL to reach disk: a deletion lost
    -- to a crash is simply done again, and the maintenance worker, which prunes between
    -- its batches, waited for that flush after each of them: under a churn
    -- of 84,000 runs/s the drain fell behind once runs expired)
    PERFORM flow._commit_without_flush();
    PERFORM flow._compress_page_images();
    -- The window: the next max_runs runs, those with a row of their own and
    -- the runs' roots (see flow._runs), each part read in id order from its
    -- primary key and cut at max_runs, merged by id (as one union ordered by
    -- id, the planner sorted every run after `after`). A run with a row has
    -- its root in both parts: grouped as one run that has a row (rather than
    -- a probe of _runs for every root: a third of the window's time under
    -- EXPLAIN ANALYZE, 5,000 runs). A run
    -- without a row is its root alone, and ended when the root did: that is
    -- read here, with where the root's row is, and such a run is that row to
    -- delete (the common run; no lookup of its run or of its commands). A
    -- run with a row is read through flow._run_rows below.
    SELECT array_agg(x.id ORDER BY x.id),   -- (in the order read: nothing to sort)
           array_agg(x.id) FILTER (WHERE x.has_row),
           array_agg(x.row_at) FILTER (WHERE NOT x.has_row AND x.finished_at < cut)
    INTO seen, with_row, alone_at
    FROM (
        SELECT w.id, bool_or(w.has_row) AS has_row, max(w.finished_at) AS finished_at, max(w.row_at) AS row_at
        FROM (
            (SELECT r.id, true AS has_row, NULL::timestamptz AS finished_at, NULL::tid AS row_at FROM flow._runs r
             WHERE r.id > start AND r.id < bound ORDER BY r.id LIMIT max_runs)
            UNION ALL
            (SELECT c.id, false, c.finished_at, c.ctid FROM flow._commands c
             WHERE c.id > start AND c.id < bound AND c.id = c.run_id
             ORDER BY c.id LIMIT max_runs)) w
        GROUP BY w.id ORDER BY w.id LIMIT max_runs) x;
    last := seen[cardinality(seen)];
    -- which of the runs with a row ended (finished runs never change again,
    -- so what ended here is still ended below)
    SELECT array_agg(v.id) INTO ended_ids FROM flow._run_rows v
    WHERE v.id = ANY (with_row) AND v.status <> 'running' AND v.finished_at < cut;
    WITH run_rows AS (
        DELETE FROM flow._runs r WHERE r.id = ANY (ended_ids)
    ), alone AS (
        -- (by where the window read each root, a TID scan: 1.9 ms for 5,000
        -- under EXPLAIN ANALYZE, where finding them by id in the primary key
        -- took 4.6 of the statement's 9.3 ms. Only prune deletes a
        -- command and a finished one never changes, so that row is still the
        -- root read: a row put in its place would have finished after the cut)
        DELETE FROM flow._commands c
        WHERE c.ctid = ANY (alone_at) AND c.id = c.run_id AND c.finished_at < cut
        RETURNING c.id, c.status, c.attempts, c.lease_token, c.parent_id, c.run_id
    ), of_rows AS (
        -- (each run's commands by a subquery on its id, not a lateral join:
        -- see flow._commands_of)
        DELETE FROM flow._commands c
        WHERE c.id = ANY (ARRAY(SELECT unnest(ARRAY(SELECT k.id FROM flow._commands_of(gone.id) k))
                                FROM unnest(ended_ids) AS gone(id)))
        RETURNING c.id, c.status, c.attempts, c.lease_token, c.parent_id, c.run_id
    ), commands AS (
        SELECT c.id, c.parent_id IS NULL AS root,
               -- (a success at its first attempt, settled by 0.2.0 on, has no
               -- row in _attempts: see sql/schema.sql; 0.1.0 left the command
               -- no lease token)
               NOT (c.status = 'succeeded' AND c.attempts = 1 AND c.lease_token IS NOT NULL) AS attempted_before,
               c.id <> c.run_id AS may_wait   -- (a run's root waits for nothing)
        FROM (SELECT * FROM alone UNION ALL SELECT * FROM of_rows) c
    ), attempts AS (
        -- (the common run, one command that succeeded at once, probes neither)
        DELETE FROM flow._attempts a USING commands WHERE commands.attempted_before AND a.command_id = ANY (ARRAY[commands.id])
    ), waits AS (
        DELETE FROM flow._waits w USING commands WHERE commands.may_wait AND w.command_id = ANY (ARRAY[commands.id])
    )
    -- (every run has one root: its runs pruned here, not by a concurrent prune)
    SELECT count(*) FILTER (WHERE commands.root) INTO pruned FROM commands;
    PERFORM flow._observe('pruned_runs', pruned);
END $$;

-- Retire up to max_events journal entries emitted more than `older_than` ago
-- that no wait refers to. Open waits are satisfied when an event is emitted,
-- so only waits spawned later could still read an old entry: that is what
-- flow.event_retention bounds. (index _events_name_key is not needed: the
-- scan is by position, which grows with emitted_at.)
CREATE OR REPLACE FUNCTION flow._retire_events(older_than interval, max_events integer) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    retired integer;
    old_events bigint[];
BEGIN
    PERFORM flow._commit_without_flush();   -- (as flow._prune's)
    PERFORM flow._compress_page_images();
    PERFORM set_config('flow_internal.retiring_events', 'on', true);
    -- An event goes only under its key's bucket lock (flow._lock_event_bucket):
    -- a wait being created on a key of the bucket keeps it this pass (it may
    -- refer to it); one created after waits for this pass to commit, and does
    -- not find it.
    -- (A statement of its own, then the deletion in the next: its snapshot
    -- sees the waits that were committed before the locks were taken.)
    SELECT array_agg(x.position) INTO old_events
    FROM (SELECT x.position, x.name, x.key FROM flow._events x
          WHERE x.emitted_at < now() - older_than
            AND NOT EXISTS (SELECT 1 FROM flow._waits w WHERE w.event_position = x.position)   -- index _waits_event
          ORDER BY x.position LIMIT max_events) x
    WHERE flow._lock_event_bucket(x.name, x.key, true, false);
    DELETE FROM flow._events e
    WHERE e.position = ANY (old_events)
      AND NOT EXISTS (SELECT 1 FROM flow._waits w WHERE w.event_position = e.position);
    GET DIAGNOSTICS retired = ROW_COUNT;
    PERFORM set_config('flow_internal.retiring_events', 'off', true);
    RETURN retired;
END $$;

-- src/lib.rs:66
-- requires:
--   retention

-- Workflows: run control (cancel, await), events, waits, children and the run graph.

-- Lock a run, then its unfinished commands: a chunk holding a root that has
-- no child yet holds the root and not the run (flow._claim); once the root
-- is had too, whatever that chunk settled is seen by the next statement.
-- (The run first: everyone else who locks a run's commands and then the run
-- holds the run already, or takes it only if it is free.)
CREATE OR REPLACE FUNCTION flow._lock_run_and_commands(run_id uuid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM 1 FROM flow._runs x WHERE x.id = run_id FOR UPDATE;
    PERFORM 1 FROM flow._commands c
    WHERE c.id = ANY (ARRAY(SELECT k.id FROM flow._commands_of(_lock_run_and_commands.run_id) k WHERE k.finished_at IS NULL))
    ORDER BY c.id FOR UPDATE OF c;
END $$;

CREATE OR REPLACE FUNCTION flow._cancel(caller oid, run_id uuid) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r flow._runs;
    started timestamptz := clock_timestamp();
    stopped boolean := false;
BEGIN
    SELECT * INTO r FROM flow._run_rows x WHERE x.id = run_id;
    PERFORM flow._require_member(caller, r.owner, 'run', run_id);
    -- A worker chunk running this run's commands holds its lock, or (a root
    -- with no child yet, see flow._claim) its root's: interrupt the handler
    -- so the lock comes free and nothing is settled as success (the worker
    -- hands the command back, whatever attempt it was on).
    PERFORM flow._interrupt_run(run_id);
    LOOP
        BEGIN
            PERFORM set_config('lock_timeout', CASE WHEN stopped THEN '0' ELSE '3s' END, true);
            PERFORM flow._lock_run_and_commands(run_id);
            -- Whoever held the run's commands may have given the run its row
            -- meanwhile (a root's chunk that spawned, or failed): it is locked
            -- too, without waiting while the commands are held (a settlement
            -- takes the run, then the command: that wait could deadlock), or
            -- the commands' locks are given back and all taken again.
            PERFORM 1 FROM flow._runs x WHERE x.id = run_id FOR UPDATE NOWAIT;
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            -- (rolled back: the commands' locks are given back) A handler of the
            -- run that ignores the cancel for 3 s has its worker stopped
            -- (recovery concludes that attempt); then whoever else holds the
            -- run is waited for.
            IF NOT stopped AND clock_timestamp() - started >= interval '3 s' THEN
                PERFORM flow._stop_workers_of(run_id);
                stopped := true;
            END IF;
        END;
    END LOOP;
    PERFORM set_config('lock_timeout', '0', true);
    -- (as it stands now that it is locked: it may have ended with its root,
    -- or, ended long ago, been deleted by retention while the lock was awaited)
    SELECT * INTO r FROM flow._run_rows x WHERE x.id = run_id;
    IF NOT FOUND OR r.status <> 'running' THEN
        RETURN false;
    END IF;
    PERFORM flow._run_row_needed(run_id);   -- (its root is locked above)
    UPDATE flow._runs x SET status = 'cancelled', finished_at = now() WHERE x.id = run_id AND x.status = 'running';
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM flow._close_open_commands(run_id, 'cancelled');
    PERFORM flow._observe('runs_cancelled', 1);
    PERFORM flow._wake();   -- a limited queue may have room now
    RETURN true;
END $$;

-- Re-drive (flow.retry): the failed and cancelled commands of a failed or
-- cancelled run become due again, each with a fresh attempt budget (its
-- attempts so far become its attempt_base: max_attempts, the backoff and
-- max_elapsed count from now; attempt numbers and their history go on), and
-- the run is running again. A command that never ran and still waits for an
-- event waits again, for its `within` from now. Expired commands are not
-- re-driven: a run past its deadline cannot run again (FL007). The caller
-- needs the rights flow.cancel needs. No handler of an ended run runs, so
-- its locks are taken in cancel's order without waiting on a handler.
CREATE OR REPLACE FUNCTION flow._retry(caller oid, run_id uuid) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r flow._runs;
    redriven integer;
    used record;
    q flow._queues;
BEGIN
    SELECT * INTO r FROM flow._run_rows x WHERE x.id = run_id;
    PERFORM flow._require_member(caller, r.owner, 'run', run_id);
    PERFORM flow._lock_run_and_commands(run_id);
    PERFORM 1 FROM flow._runs x WHERE x.id = run_id FOR UPDATE;
    -- (as it stands now that it is locked: a concurrent re-drive, or retention)
    SELECT * INTO r FROM flow._run_rows x WHERE x.id = run_id;
    IF NOT FOUND OR r.status NOT IN ('failed', 'cancelled') THEN
        RETURN false;
    END IF;
    IF r.deadline IS NOT NULL AND r.deadline <= now() THEN
        RAISE EXCEPTION 'flow: run % passed its deadline at %; it cannot run again', run_id, r.deadline
            USING ERRCODE = 'FL007';
    END IF;
    -- The queues of the commands made unfinished again are held, as an
    -- enqueue holds its queue (flow._hold_queue): one dropped since they
    -- ended is refused (a command in it would never run), and their
    -- priorities are noted again (flow._retire_priorities forgets those no
    -- unfinished command has, as it may have since these ended).
    FOR used IN SELECT DISTINCT k.queue, k.priority, k.group_hash <> 0 AS grouped
                FROM flow._commands_of(_retry.run_id) k WHERE k.status IN ('failed', 'cancelled') LOOP
        IF NOT EXISTS (SELECT 1 FROM flow._queues x WHERE x.name = used.queue) THEN
            RAISE EXCEPTION 'flow: run % has commands in queue %, which was dropped', run_id, used.queue
                USING ERRCODE = '42704', HINT = 'Make the queue again with flow.set_queue, then re-drive the run.';
        END IF;
        PERFORM flow._hold_queue(used.queue);   -- (40001 if dropped meanwhile)
        -- (read once held, as it now is: a queue dropped and made again by
        -- another role is that role's)
        SELECT * INTO q FROM flow._queues x WHERE x.name = used.queue;
        IF NOT flow._may_use_queue(r.owner, q) THEN
            RAISE EXCEPTION 'flow: run % has commands in queue %, which its owner may no longer use', run_id, used.queue
                USING ERRCODE = 'FL011', HINT = 'Ask the queue''s owner for flow.grant_queue(), then re-drive the run.';
        END IF;
        IF used.priority <> 0 OR used.grouped THEN
            PERFORM flow._note_priority(used.queue, used.priority, used.grouped);
        END IF;
    END LOOP;
    UPDATE flow._commands c SET
        status = CASE WHEN redo.waits THEN 'waiting' ELSE 'pending' END::flow.command_status,
        next_run_at = CASE WHEN redo.waits THEN least(coalesce(now() + (c.declaration->>'within')::interval, 'infinity'),
                                                   coalesce(c.deadline, 'infinity'))
                           ELSE greatest(c.not_before, now()) END,
        budget_started_at = greatest(c.not_before, now()),
        attempt_base = c.attempts,
        stop_reason = NULL, finished_at = NULL
    FROM (SELECT k.id, k.attempts = 0 AND EXISTS (SELECT 1 FROM flow._waits w
                                                  WHERE w.command_id = k.id AND w.event_position IS NULL) AS waits
          FROM flow._commands_of(_retry.run_id) k WHERE k.status IN ('failed', 'cancelled')) redo
    WHERE c.id = redo.id;
    GET DIAGNOSTICS redriven = ROW_COUNT;
    UPDATE flow._runs x SET status = 'running', finished_at = NULL, error = NULL, result = NULL
    WHERE x.id = run_id;
    PERFORM flow._observe('runs_retried', 1);
    PERFORM flow._observe('commands_retried', redriven);
    PERFORM flow._wake_due_from(now());
    RETURN true;
END $$;

-- Block until the run is terminal or the timeout passes (then status is
-- 'running'). Polls with a growing pause (1 ms → 50 ms); each poll is a new
-- snapshot, so call it outside a REPEATABLE READ transaction.
CREATE OR REPLACE FUNCTION flow._await(caller oid, run_id uuid, timeout interval) RETURNS flow.run_outcome
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r flow._runs;
    give_up timestamptz;
    pause double precision := 0.001;
    first boolean := true;
BEGIN
    PERFORM flow._require_span('await timeout', timeout, zero_ok => true);
    give_up := clock_timestamp() + coalesce(timeout, interval '0');
    LOOP
        SELECT * INTO r FROM flow._run_rows x WHERE x.id = run_id;
        PERFORM flow._require_member(caller, r.owner, 'run', run_id);
        EXIT WHEN r.status <> 'running' OR clock_timestamp() >= give_up;
        -- A run this transaction enqueued (or made running again) cannot
        -- end before it commits, and one whose end this transaction's
        -- snapshot cannot see would not be seen to end: refused, not
        -- waited for until the timeout.
        IF first THEN
            first := false;
            IF EXISTS (SELECT 1 FROM flow._commands c WHERE c.id = _await.run_id AND flow._written_here(c.xmin::text::bigint)) THEN
                RAISE EXCEPTION 'flow: run % was enqueued or changed by this transaction, and cannot end before it commits', run_id
                    USING ERRCODE = '55000', HINT = 'Commit first, then call flow.await.';
            END IF;
            IF current_setting('transaction_isolation') <> 'read committed' THEN
                RAISE EXCEPTION 'flow: flow.await cannot see run % end in a % transaction', run_id,
                    current_setting('transaction_isolation')
                    USING ERRCODE = '55000', HINT = 'Call flow.await in a READ COMMITTED transaction, or outside one.';
            END IF;
        END IF;
        -- (woken by a commit that ends runs: src/shmem.rs, _await_pause)
        PERFORM flow._await_pause(least(pause, extract(epoch FROM give_up - clock_timestamp())));
        pause := least(pause * 2, 0.05);
    END LOOP;
    PERFORM flow._await_done();
    RETURN ROW(r.status, r.result, r.error)::flow.run_outcome;
END $$;

-- An emit and the creation of a wait on the same (name, key) serialize on
-- flow._lock_event_key (src/locks.rs: a lock tag of flow's own), so a
-- wait created while the event is being emitted is never missed by both
-- sides. The lock is per owner of the waiting runs (the "domain"), and an
-- emitter locks only the domains its event may satisfy (flow._may_satisfy):
-- a transaction left open after an emit holds up waits on that key in its
-- own role's runs, never in another role's. Emits share their locks, so they
-- never wait for each other. A superuser's event may satisfy every role's
-- waits: it takes the key's lock for all domains, which every wait creation
-- takes in a mode that does not conflict with other wait creations.
CREATE OR REPLACE FUNCTION flow._lock_event_emit(name text, key text, emitter oid, emitter_run uuid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    domain oid;
BEGIN
    IF (SELECT a.rolsuper FROM pg_roles a WHERE a.oid = emitter) THEN
        PERFORM flow._lock_event_key(name, key, 0, 'share');
        RETURN;
    END IF;
    -- the owners whose waits _may_satisfy lets this event satisfy
    FOR domain IN
        SELECT a.oid FROM pg_roles a WHERE pg_has_role(emitter, a.oid, 'MEMBER')
        UNION
        SELECT r.owner::oid FROM flow._run_rows r WHERE r.id = emitter_run
        ORDER BY 1
    LOOP
        PERFORM flow._lock_event_key(name, key, domain, 'share');
    END LOOP;
END $$;

-- Before a wait on (name, key) is created in a run of run_owner (see above;
-- and its bucket's lock, against event retention: src/locks.rs).
CREATE OR REPLACE FUNCTION flow._lock_event_waits(name text, key text, run_owner oid) RETURNS void
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    SELECT flow._lock_event_key(name, key, 0, 'row exclusive'),
           flow._lock_event_key(name, key, run_owner, 'exclusive'),
           flow._lock_event_bucket(name, key, false, true)
$$;

-- Mark the open waits of one command satisfied by the newest journal entries
-- and make it due when none is left open.
CREATE OR REPLACE FUNCTION flow._promote_if_satisfied(command_id uuid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- Lock first, check in the next statement: its fresh snapshot sees every
    -- wait satisfied by emitters that committed while we waited for the lock.
    -- (A single UPDATE would re-check its NOT EXISTS with the old snapshot, and
    -- two concurrent emitters could each leave the command waiting forever.)
    PERFORM 1 FROM flow._commands c WHERE c.id = command_id AND c.status = 'waiting' FOR UPDATE;
    IF FOUND THEN
        UPDATE flow._commands c SET status = 'pending', next_run_at = greatest(c.not_before, now()),
            -- max_elapsed counts from when it first became due, not from its spawn
            budget_started_at = CASE WHEN c.attempts = 0 THEN greatest(c.not_before, now())
                                     ELSE c.budget_started_at END
        WHERE c.id = command_id AND c.status = 'waiting'
          AND NOT EXISTS (SELECT 1 FROM flow._waits w WHERE w.command_id = c.id AND w.event_position IS NULL);
    END IF;
END $$;

-- Whose events may satisfy a command's waits: those emitted inside its own
-- run (by any of its handlers or external workers), and those its run's owner
-- (or a member of it; a superuser) emitted. Another role can neither feed
-- inputs into a workflow it does not own, nor read its own events back
-- through one it spawned a definition of.
CREATE OR REPLACE FUNCTION flow._may_satisfy(emitter_role oid, emitter_run uuid, command_id uuid) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (
        SELECT 1 FROM flow._commands c
        WHERE c.id = command_id
          AND (c.run_id = emitter_run OR pg_has_role(emitter_role, c.owner, 'MEMBER')))
$$;

-- emitter: the command whose handler (or external worker) emits, NULL from outside.
CREATE OR REPLACE FUNCTION flow._emit(caller oid, emitter uuid, name text, key text, payload jsonb) RETURNS bigint
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    pos bigint;
    waiting uuid;
    promoted uuid[];
    emitter_run uuid := (SELECT c.run_id FROM flow._commands c WHERE c.id = emitter);
BEGIN
    -- (the checks in a block of their own, which writes nothing: see _spawn_many)
    BEGIN
        PERFORM flow._require_name('event name', name);
        IF key IS NULL THEN
            RAISE EXCEPTION 'flow: event key must not be NULL' USING ERRCODE = 'FL002';
        END IF;
        PERFORM flow._require_short('event key', key);
        PERFORM flow._require_payload('event payload', payload, false);
    EXCEPTION WHEN SQLSTATE 'FL002' OR SQLSTATE 'FL003' OR SQLSTATE 'FL004' THEN
        -- inside a handler an invalid emit is an invalid decision (see _spawn_many)
        IF emitter IS NOT NULL THEN
            PERFORM flow._decide('invalid_decision', 'invalid_decision', SQLERRM, NULL);
        END IF;
        RAISE;
    END;
    PERFORM flow._lock_event_emit(name, key, caller, emitter_run);
    -- Inside a handler the event rides in the handler's transaction: it is
    -- journaled only if the attempt settles successfully.
    INSERT INTO flow._events (id, name, key, payload, owner, run_id, command_id)
    VALUES (flow._new_id(), name, key, payload, caller, emitter_run, emitter)
    RETURNING position INTO pos;
    PERFORM flow._observe('events', 1);
    -- The waiting commands are promoted (each locked) in id order: two emits
    -- of different events that satisfy waits of the same commands lock them
    -- in the same order, never in the order each one's waits were found in,
    -- which may be opposite and deadlock.
    WITH satisfied AS (
        UPDATE flow._waits w SET event_position = pos, satisfied_at = now()
        WHERE w.name = _emit.name AND w.key = _emit.key AND w.event_position IS NULL   -- index _waits_open
          AND flow._may_satisfy(caller, emitter_run, w.command_id)
        RETURNING w.command_id
    )
    SELECT array_agg(s.command_id ORDER BY s.command_id) INTO promoted FROM satisfied s;
    FOREACH waiting IN ARRAY coalesce(promoted, '{}') LOOP
        PERFORM flow._promote_if_satisfied(waiting);
    END LOOP;
    PERFORM flow._wake_due_from(now());   -- (a command promoted is due at now() or later)
    RETURN pos;
END $$;

-- An array of one dimension whose first index is 1, or empty, or NULL: what
-- a loop by index and unnest read alike. (SQL, inlined.)
CREATE OR REPLACE FUNCTION flow._plain_array(a anyarray) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT a IS NULL OR cardinality(a) = 0 OR (array_ndims(a) = 1 AND array_lower(a, 1) = 1)
$$;

-- What a spawn declares, kept in _commands.declaration: a spawn of the same
-- key must declare the same (flow._spawn_many). `waits` is the waits as a
-- JSON array; `more` the priority when given. (SQL, inlined into the
-- statements that call it.)
CREATE OR REPLACE FUNCTION flow._declaration(name text, version integer, args jsonb, queue text, start_after interval,
    within interval, waits jsonb, more jsonb, group_key text) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object('name', name, 'version', version, 'args', args, 'queue', queue,
                              'start_after', start_after, 'within', within, 'waits', waits) || more
           || CASE WHEN group_key IS NOT NULL THEN jsonb_build_object('group_key', group_key) ELSE '{}' END
$$;

-- parent_id: the command whose handler (or external worker) spawns; NULL is an
-- error. Spawns one child of `name` per element of args_list, under the key
-- at the same place in `keys` (and in the group at the same place in
-- group_keys, if given), with the same options; returns their ids in
-- that order (flow.spawn is a spawn of one). A fan-out of 200 children in
-- one call inserts them in one statement: 200 calls of a spawn of one took
-- 27-49 ms of its root's attempt, and its children could not start before.
CREATE OR REPLACE FUNCTION flow._spawn_many(caller oid, parent_id uuid, name text, args_list jsonb[], keys text[],
    start_after interval, waits flow.wait_spec[], within interval, version integer, queue text,
    given_priority integer, group_key text, group_keys text[])
RETURNS uuid[]
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
-- (the ON CONFLICT below names columns run_id and key, which cannot be
-- qualified; every other use of a parameter or column here is qualified, or
-- has no column of that name in scope)
DECLARE
    parent flow._commands;
    p record;   -- flow._plan_enqueue's
    spec flow.wait_spec;
    declared_waits jsonb;
    declared_more jsonb;
    grouped boolean;
    children uuid[];
    inserted uuid[];   -- the children that are new, when some are not (NULL: all are)
    added integer;
    conflict text;
    journaled bigint;
    priority smallint;
    child uuid;
BEGIN
    SELECT * INTO parent FROM flow._commands c WHERE c.id = _spawn_many.parent_id AND c.finished_at IS NULL;  -- leased (running) or held by this worker
    IF NOT FOUND THEN
        RAISE EXCEPTION 'flow: spawn is only possible inside a running handler' USING ERRCODE = 'FL012',
            HINT = 'Use flow.enqueue to start a new run.';
    END IF;
    waits := coalesce(waits, '{}');
    -- The checks, in a block of their own: an invalid spawn is the handler's
    -- decision, and fails its command even if the handler catches the error
    -- (the first one counts, as the reference). The block writes nothing but
    -- a queue made on first use, so its subtransaction takes no transaction
    -- id: around the inserts too, a fan-out of 200 spawns took 200, and the
    -- subtransactions of more than 64 overflow every snapshot in the server.
    BEGIN
        IF args_list IS NULL OR keys IS NULL THEN
            RAISE EXCEPTION 'flow: spawn_many needs args_array and keys' USING ERRCODE = 'FL003';
        END IF;
        IF cardinality(args_list) <> cardinality(keys) THEN
            RAISE EXCEPTION 'flow: spawn_many needs as many keys (%) as args (%)', cardinality(keys),
                cardinality(args_list) USING ERRCODE = 'FL003';
        END IF;
        -- (read by index below, and by unnest in the insert: the two agree
        -- only on arrays of one dimension that start at 1)
        IF NOT flow._plain_array(keys) OR NOT flow._plain_array(args_list) OR NOT flow._plain_array(group_keys) THEN
            RAISE EXCEPTION 'flow: spawn_many takes arrays of one dimension, from index 1' USING ERRCODE = 'FL003';
        END IF;
        p := flow._plan_enqueue(caller, name, version, queue, start_after, NULL, NULL);
        priority := flow._priority(given_priority, p.def_priority);
        -- (one loop for both, by index: two FOREACH loops cost a spawn of
        -- one child 5-8 µs, 5 %)
        FOR i IN 1..cardinality(keys) LOOP
            PERFORM flow._require_name(CASE WHEN cardinality(keys) = 1 THEN 'key' ELSE format('keys[%s]', i) END, keys[i]);
            IF keys[i] = 'root' THEN
                -- (the root's key, though not in _commands_run_key: spawning it is
                -- spawning a declaration other than the root's)
                RAISE EXCEPTION 'flow: child key root is the run''s root command' USING ERRCODE = 'FL016';
            END IF;
            PERFORM flow._require_payload(CASE WHEN cardinality(keys) = 1 THEN 'args' ELSE format('args_array[%s]', i) END,
                                          args_list[i]);
            -- (each check called only when it has something to check: a call is
            -- a statement of its own, a few microseconds each, per spawn)
            IF p.def_args_type IS NOT NULL THEN
                PERFORM flow._require_args_fit(_spawn_many.name, p.def_owner, p.def_args_type, args_list[i]);
            END IF;
        END LOOP;
        IF group_key IS NOT NULL OR group_keys IS NOT NULL THEN
            PERFORM flow._require_group_keys(group_key, group_keys, cardinality(keys), 'keys');
        END IF;
        IF within IS NOT NULL THEN
            PERFORM flow._require_span('within', within);
        END IF;
        FOREACH spec IN ARRAY waits LOOP
            PERFORM flow._require_name('wait name', spec.name);
            IF spec.key IS NULL THEN
                RAISE EXCEPTION 'flow: wait key must not be NULL' USING ERRCODE = 'FL002';
            END IF;
            PERFORM flow._require_short('wait key', spec.key);
        END LOOP;
    EXCEPTION WHEN SQLSTATE 'FL001' OR SQLSTATE 'FL002' OR SQLSTATE 'FL003' OR SQLSTATE 'FL004'
                  OR SQLSTATE 'FL005' OR SQLSTATE 'FL006' OR SQLSTATE 'FL011' OR SQLSTATE 'FL016'
                  OR SQLSTATE 'FL018' OR SQLSTATE 'FL019' THEN
        PERFORM flow._decide('invalid_decision', 'invalid_decision', SQLERRM, NULL);
        RAISE;
    END;
    IF cardinality(keys) = 0 THEN
        RETURN '{}';
    END IF;
    -- (what each child declares besides its args: see flow._declaration)
    SELECT CASE WHEN cardinality(waits) = 0 THEN '[]'::jsonb ELSE
               (SELECT coalesce(jsonb_agg(DISTINCT jsonb_build_object('name', w.name, 'key', w.key)), '[]')
                FROM unnest(waits) w) END,
           -- (a priority is declared when it is not 0: children spawned before
           -- there were priorities declared none, and a re-spawn still matches)
           CASE WHEN priority <> 0 THEN jsonb_build_object('priority', priority) ELSE '{}' END,
           group_key IS NOT NULL OR coalesce(cardinality(array_remove(group_keys, NULL)) > 0, false)
    INTO declared_waits, declared_more, grouped;
    IF priority <> 0 OR grouped THEN
        PERFORM flow._note_priority(p.lane, priority, grouped);
    END IF;
    IF NOT EXISTS (SELECT 1 FROM flow._runs r WHERE r.id = parent.run_id) THEN
        -- The run's first child: the run gets its row (see flow._runs), under
        -- its root's lock, which the root's own chunk holds already (an
        -- external worker's spawn takes it: a cancel holds it before it
        -- gives a run its row, so neither waits for the other's insert).
        PERFORM 1 FROM flow._commands c WHERE c.id = parent.run_id FOR UPDATE;
        PERFORM flow._run_row_needed(parent.run_id);
    END IF;
    -- (tells an in-database worker's settlement that this transaction has
    -- children: see flow._settle_batch's `alone`)
    PERFORM flow._note_spawn();
    -- (most spawns are of one child: its id is made without a query, 15 µs)
    IF cardinality(keys) = 1 THEN
        children := ARRAY[flow._new_id()];
    ELSE
        children := ARRAY(SELECT flow._new_id() FROM generate_series(1, cardinality(keys)));
    END IF;
    INSERT INTO flow._commands (id, run_id, parent_id, key, name, version, queue, args, declaration, status,
        next_run_at, not_before, budget_started_at, deadline, external, owner, priority, group_key, group_hash)
    SELECT t.id, parent.run_id, parent.id, t.key, _spawn_many.name, p.def_version, p.lane, t.args,
        flow._declaration(_spawn_many.name, p.def_version, t.args, p.lane, start_after, within, declared_waits,
                          declared_more, coalesce(t.group_key, _spawn_many.group_key)),
        CASE WHEN cardinality(waits) > 0 THEN 'waiting' ELSE 'pending' END::flow.command_status,
        -- a wait ends at `within`, and at the run's deadline at the latest
        CASE WHEN cardinality(waits) = 0 THEN p.due
             ELSE least(CASE WHEN within IS NULL THEN 'infinity' ELSE greatest(now() + within, p.due) END,
                        coalesce(parent.deadline, 'infinity')) END,
        p.due, p.due, parent.deadline, p.def_external, parent.owner, priority,
        coalesce(t.group_key, _spawn_many.group_key), flow._group_hash(coalesce(t.group_key, _spawn_many.group_key))
    -- (in the order given: of a key given twice, the first is inserted; a
    -- NULL group_keys gives each child NULL there, and group_key its group)
    FROM unnest(children, keys, args_list, group_keys) AS t(id, key, args, group_key)
    ON CONFLICT (run_id, key) WHERE id <> run_id DO NOTHING;          -- index _commands_run_key
    GET DIAGNOSTICS added = ROW_COUNT;
    IF added < cardinality(keys) THEN
        -- Keys are unique within a run: the same declaration again is a no-op
        -- (a retried attempt re-spawns safely), another one is an invalid
        -- decision. A key not inserted has a command of another id.
        SELECT format('flow: child key %s was already spawned with another declaration', t.key)
        INTO conflict
        FROM unnest(children, keys, args_list, group_keys) WITH ORDINALITY AS t(id, key, args, group_key, n)
        JOIN flow._commands_of(parent.run_id) c ON c.key = t.key
        WHERE c.id <> t.id
          AND c.declaration IS DISTINCT FROM flow._declaration(_spawn_many.name, p.def_version, t.args, p.lane,
                                                               start_after, within, declared_waits, declared_more,
                                                               coalesce(t.group_key, _spawn_many.group_key))
        ORDER BY t.n LIMIT 1;
        IF conflict IS NOT NULL THEN
            PERFORM flow._decide('invalid_decision', 'invalid_decision', conflict, NULL);
            RAISE EXCEPTION USING MESSAGE = conflict, ERRCODE = 'FL016';
        END IF;
        -- each key's command, and of those the new ones
        SELECT array_agg(c.id ORDER BY t.n), coalesce(array_agg(c.id) FILTER (WHERE c.id = t.id), '{}')
        INTO children, inserted
        FROM unnest(children, keys) WITH ORDINALITY AS t(id, key, n)
        JOIN flow._commands_of(parent.run_id) c ON c.key = t.key;
    END IF;

    -- (a child without waits is pending already: a fan-out's spawns skip
    -- the three statements below, a sixth of a spawn's time)
    IF cardinality(waits) > 0 THEN
        FOREACH child IN ARRAY coalesce(inserted, children) LOOP
            FOR spec IN SELECT DISTINCT w.name, w.key FROM unnest(waits) w ORDER BY 1, 2 LOOP
                PERFORM flow._lock_event_waits(spec.name, spec.key, parent.owner::oid);
                -- An event emitted before the wait existed satisfies it from the journal.
                SELECT max(e.position) INTO journaled FROM flow._events e      -- index _events_name_key
                WHERE e.name = spec.name AND e.key = spec.key AND flow._may_satisfy(e.owner, e.run_id, child);
                INSERT INTO flow._waits (command_id, name, key, event_position, satisfied_at)
                VALUES (child, spec.name, spec.key, journaled, CASE WHEN journaled IS NOT NULL THEN now() END);
            END LOOP;
            PERFORM flow._promote_if_satisfied(child);
        END LOOP;
    END IF;
    PERFORM flow._wake_due_from(now());   -- (due at p.due, or when promoted: both now() or later)
    RETURN children;
END $$;

-- A run's commands, parent links, waits and events as Graphviz DOT or Mermaid.
CREATE OR REPLACE FUNCTION flow._run_graph(caller oid, run_id uuid, format text) RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r flow._runs;
    dot boolean := lower(coalesce(format, 'dot')) = 'dot';
    lines text[] := '{}';
    item record;
BEGIN
    IF lower(coalesce(format, 'dot')) NOT IN ('dot', 'mermaid') THEN
        RAISE EXCEPTION 'flow: run_graph format must be dot or mermaid, got %', format USING ERRCODE = 'FL003';
    END IF;
    SELECT * INTO r FROM flow._run_rows x WHERE x.id = run_id;
    PERFORM flow._require_member(caller, r.owner, 'run', run_id);
    -- commands
    FOR item IN
        SELECT 'c' || replace(c.id::text, '-', '') AS node, c.parent_id,
               translate(format('%s: %s v%s\n%s%s', c.key, c.name, c.version, c.status,
                   CASE WHEN c.attempts > 1 THEN format(' after %s attempts', c.attempts) ELSE '' END),
                   '"[]{}<>|', '''()()()/') AS label,
               CASE c.status WHEN 'succeeded' THEN 'palegreen' WHEN 'failed' THEN 'salmon'
                             WHEN 'running' THEN 'lightblue' WHEN 'waiting' THEN 'khaki'
                             WHEN 'cancelled' THEN 'lightgrey' ELSE 'white' END AS colour
        FROM flow._commands_of(_run_graph.run_id) c ORDER BY c.created_at, c.id
    LOOP
        lines := lines || CASE WHEN dot
            THEN format('  %s [label="%s", fillcolor=%s];', item.node, item.label, item.colour)
            ELSE format('  %s["%s"]', item.node, replace(item.label, '\n', '<br/>')) END;
        IF item.parent_id IS NOT NULL THEN
            lines := lines || format(CASE WHEN dot THEN '  %s -> %s;' ELSE '  %s --> %s' END,
                                     'c' || replace(item.parent_id::text, '-', ''), item.node);
        END IF;
    END LOOP;
    -- events emitted by this run's commands or satisfying its waits, and open waits
    FOR item IN
        SELECT DISTINCT 'e' || e.position AS node, e.command_id,
               translate(format('event %s/%s', e.name, e.key), '"[]{}<>|', '''()()()/') AS label
        FROM flow._events e
        WHERE e.run_id = _run_graph.run_id
           OR e.position IN (SELECT w.event_position
                             FROM flow._waits w JOIN flow._commands_of(_run_graph.run_id) c ON c.id = w.command_id)
    LOOP
        lines := lines || CASE WHEN dot THEN format('  %s [shape=ellipse, label="%s"];', item.node, item.label)
                               ELSE format('  %s(["%s"])', item.node, item.label) END;
        IF item.command_id IS NOT NULL AND EXISTS (SELECT 1 FROM flow._commands c WHERE c.id = item.command_id
                                                   AND c.run_id = _run_graph.run_id) THEN
            lines := lines || format(CASE WHEN dot THEN '  %s -> %s [label="emits"];' ELSE '  %s -- emits --> %s' END,
                                     'c' || replace(item.command_id::text, '-', ''), item.node);
        END IF;
    END LOOP;
    FOR item IN
        SELECT w.event_position, 'c' || replace(w.command_id::text, '-', '') AS waiter,
               'w' || md5(w.command_id::text || w.name || w.key) AS open_node,
               translate(format('waiting for %s/%s', w.name, w.key), '"[]{}<>|', '''()()()/') AS label
        FROM flow._waits w JOIN flow._commands_of(_run_graph.run_id) c ON c.id = w.command_id
        ORDER BY w.name, w.key
    LOOP
        IF item.event_position IS NOT NULL THEN
            lines := lines || format(CASE WHEN dot THEN '  %s -> %s [style=dashed, label="satisfies"];'
                                          ELSE '  %s -. satisfies .-> %s' END, 'e' || item.event_position, item.waiter);
        ELSE
            lines := lines || CASE WHEN dot
                THEN format('  %s [shape=ellipse, style=dashed, label="%s"];', item.open_node, item.label)
                ELSE format('  %s(["%s"])', item.open_node, item.label) END;
            lines := lines || format(CASE WHEN dot THEN '  %s -> %s [style=dashed];' ELSE '  %s -.-> %s' END,
                                     item.open_node, item.waiter);
        END IF;
    END LOOP;
    IF dot THEN
        RETURN format(E'digraph "run %s" {\n  rankdir=LR;\n  label="run %s: %s";\n  node [shape=box, style="rounded,filled", fontname="Helvetica"];\n%s\n}\n',
                      r.id, r.id, r.status, array_to_string(lines, E'\n'));
    END IF;
    RETURN format(E'flowchart LR\n%s\n', array_to_string(lines, E'\n'));
END $$;

-- src/lib.rs:67
-- requires:
--   workflows

-- External workers: claims with leases, heartbeats and settlements from outside the server.

-- Whether a succeeded command succeeded under lease_token: it keeps the
-- token of its successful attempt (kept_token); one settled by 0.1.0 has
-- an attempt row instead.
CREATE OR REPLACE FUNCTION flow._succeeded_under(command_id uuid, kept_token uuid, lease_token uuid) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(kept_token = lease_token, false)
        OR EXISTS (SELECT 1 FROM flow._attempts a WHERE a.command_id = _succeeded_under.command_id
                   AND a.lease_token = _succeeded_under.lease_token AND a.outcome = 'succeeded')
$$;

-- The attempt this transaction holds command_id in for caller under
-- lease_token (flow.claim's hold) and has not settled; NULL: none.
-- (plpgsql: the function it calls is written by pgrx, after this file)
CREATE OR REPLACE FUNCTION flow._holding_attempt(caller oid, command_id uuid, lease_token uuid) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (flow._holding_attempts(caller, ARRAY[command_id], ARRAY[lease_token]))[1];
END $$;

-- The running command behind an external lease, locked, after checking the
-- caller may resolve it. A wrong or stale token is FL013; a command already
-- settled under this very token is FL017 (double completion).
CREATE OR REPLACE FUNCTION flow._leased(caller oid, command_id uuid, lease_token uuid) RETURNS flow._commands
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    c flow._commands;
    owner_ oid;
BEGIN
    IF command_id IS NULL OR lease_token IS NULL THEN
        RAISE EXCEPTION 'flow: command_id and lease_token must not be NULL' USING ERRCODE = 'FL002';
    END IF;
    -- Ownership first, without a lock: another role's command is reported
    -- missing at once, never after waiting for its run's lock.
    SELECT d.owner INTO owner_ FROM flow._commands x
    JOIN flow._definitions d ON d.name = x.name AND d.version = x.version WHERE x.id = command_id;
    IF NOT FOUND OR NOT pg_has_role(caller, owner_, 'MEMBER') THEN
        RAISE EXCEPTION 'flow: no command with id %', command_id USING ERRCODE = 'FL014';
    END IF;
    PERFORM flow._lock_runs_of(ARRAY[command_id]);
    SELECT x.* INTO c FROM flow._commands x WHERE x.id = command_id FOR UPDATE;
    IF c.status = 'running' AND c.lease_token = _leased.lease_token AND c.lease_pid IS NULL THEN
        IF c.lease_expires_at < now() THEN
            RAISE EXCEPTION 'flow: the lease on command % expired at %', command_id, c.lease_expires_at
                USING ERRCODE = 'FL013';
        END IF;
        RETURN c;
    END IF;
    IF c.status = 'succeeded' AND flow._succeeded_under(c.id, c.lease_token, _leased.lease_token) THEN
        RAISE EXCEPTION 'flow: command % was already completed under this lease', command_id
            USING ERRCODE = 'FL017';
    END IF;
    RAISE EXCEPTION 'flow: lease token % does not hold command % (it is %)', lease_token, command_id, c.status
        USING ERRCODE = 'FL013', HINT = 'The lease expired or was never yours; claim the command again.';
END $$;

-- What became of an external attempt (the reference's ResolveCommandAttempt),
-- for a worker that lost the reply to a claim, heartbeat or settlement:
-- 'held' (the lease is yours, until lease_expires_at), 'expired' (its lease ran
-- out and nobody concluded it yet; it can no longer be settled, see
-- flow._leased: a claim or recovery concludes it as lease_lost), or
-- 'concluded' with the attempt's outcome ('succeeded', 'lease_lost', 'cancelled', ...).
CREATE OR REPLACE FUNCTION flow._resolve(caller oid, command_id uuid, lease_token uuid)
RETURNS TABLE (state text, outcome text, lease_expires_at timestamptz)
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    c flow._commands;
    owner_ oid;
    concluded text;
BEGIN
    SELECT * INTO c FROM flow._commands x WHERE x.id = command_id;
    SELECT d.owner INTO owner_ FROM flow._definitions d WHERE d.name = c.name AND d.version = c.version;
    IF NOT FOUND OR NOT pg_has_role(caller, owner_, 'MEMBER') THEN
        RAISE EXCEPTION 'flow: no command with id %', command_id USING ERRCODE = 'FL014';
    END IF;
    IF flow._holding_attempt(caller, command_id, lease_token) IS NOT NULL THEN   -- (by this transaction: flow.claim's hold)
        RETURN QUERY SELECT 'held', NULL::text, NULL::timestamptz;
        RETURN;
    END IF;
    IF c.status = 'running' AND c.lease_token = _resolve.lease_token AND c.lease_pid IS NULL THEN
        RETURN QUERY SELECT CASE WHEN c.lease_expires_at >= now() THEN 'held' ELSE 'expired' END, NULL::text,
                            c.lease_expires_at;
        RETURN;
    END IF;
    IF c.status = 'succeeded' AND flow._succeeded_under(c.id, c.lease_token, _resolve.lease_token) THEN
        RETURN QUERY SELECT 'concluded', 'succeeded', NULL::timestamptz;
        RETURN;
    END IF;
    SELECT a.outcome INTO concluded FROM flow._attempts a
    WHERE a.command_id = _resolve.command_id AND a.lease_token = _resolve.lease_token;
    IF FOUND THEN
        RETURN QUERY SELECT 'concluded', concluded, NULL::timestamptz;
        RETURN;
    END IF;
    RAISE EXCEPTION 'flow: lease token % never held command %', lease_token, command_id USING ERRCODE = 'FL013';
END $$;

-- What an external claim does before flow._claim takes its commands (see
-- flow.claim): checks its arguments and the caller's right to the
-- definitions, and concludes their expired leases.
CREATE OR REPLACE FUNCTION flow._prepare_external_claim(caller oid, names text[], worker text, max_count integer, lease interval,
    conclude_expired boolean DEFAULT true)
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    wanted text;
    expired record;
BEGIN
    PERFORM flow._require_name('worker', worker);
    IF names IS NULL OR cardinality(names) = 0 THEN
        RAISE EXCEPTION 'flow: names must list at least one definition' USING ERRCODE = 'FL002';
    END IF;
    IF max_count IS NULL OR max_count < 1 OR max_count > 10000 THEN
        RAISE EXCEPTION 'flow: max must be between 1 and 10000, got %', max_count USING ERRCODE = 'FL015';
    END IF;
    IF lease IS NULL THEN
        RAISE EXCEPTION 'flow: lease must be positive, got NULL' USING ERRCODE = 'FL005';
    END IF;
    PERFORM flow._require_span('lease', lease);
    FOREACH wanted IN ARRAY names LOOP
        IF NOT EXISTS (SELECT 1 FROM flow._definitions d WHERE d.name = wanted AND d.handler IS NULL) THEN
            RAISE EXCEPTION 'flow: no external definition named %', wanted USING ERRCODE = 'FL001';
        END IF;
        IF EXISTS (SELECT 1 FROM flow._definitions d WHERE d.name = wanted AND d.handler IS NULL
                   AND NOT pg_has_role(caller, d.owner, 'MEMBER')) THEN
            RAISE EXCEPTION 'flow: no external definition named %', wanted USING ERRCODE = 'FL001';
        END IF;
    END LOOP;
    -- Expired external leases of these definitions are concluded first, so a
    -- server without in-database workers still retries them. (Not by a held
    -- claim: it needs the workers, whose recovery concludes them, and the
    -- locks it would take here would last for its client's transaction.)
    IF NOT conclude_expired THEN
        RETURN;
    END IF;
    FOR expired IN
        SELECT c.id, c.lease_token, c.attempt_deadline <= c.lease_expires_at AS timed_out
        FROM flow._commands c                                            -- index _commands_running, per queue
        WHERE c.status = 'running' AND c.queue = ANY (ARRAY(SELECT q.name FROM flow._queues q))
          AND c.lease_expires_at < now() AND c.lease_pid IS NULL AND c.name = ANY (names)
    LOOP
        CONTINUE WHEN NOT flow._try_lock_run_of(expired.id);
        PERFORM flow._conclude_expired_lease(expired.id, expired.lease_token, coalesce(expired.timed_out, false));
    END LOOP;
END $$;

-- Conclude an external lease that expired: lease_lost, or, when it ended at
-- the attempt's deadline (`timed_out`), timeout. The caller holds its run's lock.
CREATE OR REPLACE FUNCTION flow._conclude_expired_lease(command_id uuid, lease_token uuid, timed_out boolean) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF timed_out THEN
        RETURN flow._settle_failure(command_id, lease_token, 'timeout', 'attempt_timeout',
                                    'the attempt''s deadline passed before the command was settled');
    END IF;
    RETURN flow._settle_failure(command_id, lease_token, 'lease_lost', 'lease_lost',
                                'the lease expired before the command was settled');
END $$;

-- Whether the attempt under lease_token was concluded by a cancel of its run.
CREATE OR REPLACE FUNCTION flow._cancelled_under(caller oid, command_id uuid, lease_token uuid) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM flow._attempts a JOIN flow._commands x ON x.id = a.command_id
                   WHERE a.command_id = _cancelled_under.command_id AND a.lease_token = _cancelled_under.lease_token
                     AND a.outcome = 'cancelled' AND pg_has_role(caller, x.owner, 'MEMBER'))
$$;

CREATE OR REPLACE FUNCTION flow._heartbeat(caller oid, command_id uuid, lease_token uuid, extend interval)
RETURNS TABLE (lease_expires_at timestamptz, cancelled boolean)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    c flow._commands;
BEGIN
    PERFORM flow._require_span('extend', extend);
    -- Held by this transaction (flow.claim's hold): no lease to extend, and
    -- no cancel before the transaction ends (a cancel waits for its locks).
    IF flow._holding_attempt(caller, command_id, lease_token) IS NOT NULL THEN
        RETURN QUERY SELECT NULL::timestamptz, false;
        RETURN;
    END IF;
    -- A run cancelled (or failed) under a live lease: tell the worker to stop.
    IF flow._cancelled_under(caller, command_id, lease_token) THEN
        RETURN QUERY SELECT NULL::timestamptz, true;
        RETURN;
    END IF;
    BEGIN
        c := flow._leased(caller, command_id, lease_token);
    EXCEPTION WHEN SQLSTATE 'FL013' THEN
        -- (a cancel that committed while _leased waited for the run's lock)
        IF flow._cancelled_under(caller, command_id, lease_token) THEN
            RETURN QUERY SELECT NULL::timestamptz, true;
            RETURN;
        END IF;
        RAISE;
    END;
    -- (never past the attempt's deadline: its timeout, max_elapsed, the run's deadline)
    UPDATE flow._commands x SET
        lease_expires_at = least(now() + coalesce(extend, x.lease_interval), coalesce(x.attempt_deadline, 'infinity'))
    WHERE x.id = c.id
    RETURNING x.lease_expires_at INTO c.lease_expires_at;
    RETURN QUERY SELECT c.lease_expires_at, false;
END $$;

-- Settle an external success with its events and children, all in the caller's transaction.
CREATE OR REPLACE FUNCTION flow._complete(caller oid, command_id uuid, lease_token uuid, result jsonb, events jsonb,
    children jsonb)
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    held integer := flow._holding_attempt(caller, command_id, lease_token);
    c flow._commands;
    row_at tid;
    item jsonb;
BEGIN
    IF held IS NULL THEN
        c := flow._leased(caller, command_id, lease_token);
    ELSE
        -- held by this transaction's claim, which checked the caller's right
        -- and locked it (and its run, for a command not its run's root)
        SELECT * INTO c FROM flow._commands x WHERE x.id = command_id;
        SELECT x.ctid INTO row_at FROM flow._commands x WHERE x.id = command_id;
        IF c.status::text NOT IN ('pending', 'waiting') OR c.attempts <> held - 1 THEN
            -- (moved on in this very transaction: its run failed or was cancelled)
            RAISE EXCEPTION 'flow: lease token % does not hold command % (it is %)', lease_token, command_id, c.status
                USING ERRCODE = 'FL013';
        END IF;
    END IF;
    IF result IS NOT NULL THEN
        PERFORM flow._require_payload('result', result, false);
    END IF;
    IF events IS NOT NULL AND jsonb_typeof(events) <> 'array' OR children IS NOT NULL AND jsonb_typeof(children) <> 'array' THEN
        RAISE EXCEPTION 'flow: events and children must be JSON arrays' USING ERRCODE = 'FL003';
    END IF;
    FOR item IN SELECT * FROM jsonb_array_elements(coalesce(events, '[]')) LOOP
        PERFORM flow._emit(caller, c.id, item->>'name', item->>'key', coalesce(item->'payload', '{}'));
    END LOOP;
    FOR item IN SELECT * FROM jsonb_array_elements(coalesce(children, '[]')) LOOP
        PERFORM flow._spawn_many(caller, c.id, item->>'name', ARRAY[coalesce(item->'args', '{}')], ARRAY[item->>'key'],
            (item->>'start_after')::interval,
            (SELECT coalesce(array_agg(ROW(w->>'name', w->>'key')::flow.wait_spec), '{}')
             FROM jsonb_array_elements(coalesce(item->'waits', '[]')) w),
            (item->>'within')::interval, (item->>'version')::integer, item->>'queue', (item->>'priority')::integer,
            item->>'group_key', NULL);
    END LOOP;
    -- _leased holds the run's lock, as _settle_batch requires.
    IF held IS NULL THEN
        PERFORM flow._settle_batch(ARRAY[c.id], ARRAY[c.lease_token], ARRAY[result]);
    ELSE
        PERFORM flow._settle_batch(ARRAY[c.id], ARRAY[lease_token], ARRAY[result], ARRAY[now()], ARRAY[held],
                                   flow._holding_worker(), ARRAY[row_at]),
                flow._holding_settled(ARRAY[c.id]);
    END IF;
    RETURN 'succeeded';
END $$;

-- Settle many external successes in one call (results only: no events or
-- children). Returns each command's outcome: 'succeeded', or 'lease_lost'
-- when its token no longer holds it (nothing changed for that command), or
-- 'already_completed' for a second completion under the same token.
-- 'succeeded' means settled by this call: the commands are read without a
-- lock, and one that moves on before the settlement locks it (a cancel
-- committed meanwhile, its lease concluded as lost by a claim, the same
-- completion made by another call) is not settled. Every command not
-- settled is read again, after the settlement, and reported as it then is.
-- (Generic plans, as flow._settle_batch's: every statement is driven by the
-- ids given; a custom plan per call planned them all again, 150 us of a
-- call's 270 with nothing to settle, 0.5 us per command of a client's 100.)
CREATE OR REPLACE FUNCTION flow._complete_many(caller oid, command_ids uuid[], lease_tokens uuid[], results jsonb[])
RETURNS TABLE (command_id uuid, status text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    bad record;
    not_yours uuid;
    runs uuid[];
    ids uuid[];
    tokens uuid[];
    outcomes text[];
    -- the attempts of the commands this transaction holds (flow.claim's hold), aligned; NULL: none
    held_attempts integer[] := flow._holding_attempts(caller, command_ids, lease_tokens);
    settled uuid[];
BEGIN
    IF command_ids IS NULL OR lease_tokens IS NULL
       OR cardinality(command_ids) <> cardinality(lease_tokens)
       OR (results IS NOT NULL AND cardinality(results) <> cardinality(command_ids)) THEN
        RAISE EXCEPTION 'flow: command_ids, lease_tokens and results must be arrays of the same length'
            USING ERRCODE = 'FL003';
    END IF;
    SELECT t.i, t.result INTO bad FROM unnest(results) WITH ORDINALITY AS t(result, i)
    WHERE octet_length(t.result::text) > flow._max_payload_bytes() LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'flow: results[%] is over flow.max_result_bytes', bad.i USING ERRCODE = 'FL004';
    END IF;
    -- (a result for each command from here on: NULL for none)
    results := coalesce(results, array_fill(NULL::jsonb, ARRAY[cardinality(command_ids)]));
    -- Every command held by this transaction's claims for the caller (the
    -- call of a client that claims with hold): the claims checked the
    -- caller's right, took the runs' locks and keep the rows where they
    -- were, so the settlement writes them with no read first.
    IF held_attempts IS NOT NULL AND array_position(held_attempts, NULL) IS NULL THEN
        settled := flow._settle_batch(command_ids, lease_tokens, results,
                                      array_fill(now(), ARRAY[cardinality(command_ids)]), held_attempts,
                                      flow._holding_worker(), flow._holding_rows(command_ids)::tid[], false);
        IF cardinality(settled) < cardinality(command_ids) THEN
            -- A command this transaction moved since its claim (an emit that
            -- made a held waiting command pending) is no longer at the row the
            -- claim noted: settled again where it is now (its lock is this
            -- transaction's, so nothing else moved it; one it ended, cancelled
            -- or failed with its run, stays unsettled)
            settled := settled || (
                SELECT flow._settle_batch(array_agg(t.id), array_agg(t.token), array_agg(t.result),
                                          array_agg(now()), array_agg(t.attempt), flow._holding_worker(),
                                          array_agg(c.ctid), false)
                FROM unnest(command_ids, lease_tokens, results, held_attempts) AS t(id, token, result, attempt)
                JOIN flow._commands c ON c.id = ANY (ARRAY[t.id])   -- (a probe per command: sql/common.sql)
                WHERE t.id <> ALL (settled));
        END IF;
        ids := command_ids;
        tokens := lease_tokens;
        outcomes := CASE WHEN cardinality(settled) = cardinality(command_ids)
                         THEN array_fill('succeeded'::text, ARRAY[cardinality(command_ids)])
                         ELSE ARRAY(SELECT CASE WHEN t.id = ANY (settled) THEN 'succeeded' END
                                    FROM unnest(command_ids) AS t(id)) END;
    ELSE
        -- One read of each command: whether the caller may settle it, and the
        -- runs to lock first (_lock_runs_of's lock; a root with no child leaves
        -- its run unlocked: its success is the run's end and writes no run, and a
        -- cancel waits for the root's own row instead, see flow._run_rows).
        SELECT (array_agg(t.id) FILTER (WHERE d.owner IS NULL OR NOT pg_has_role(caller, d.owner, 'MEMBER')))[1],
               array_agg(DISTINCT c.run_id) FILTER (WHERE NOT (c.id = c.run_id
                   AND NOT EXISTS (SELECT 1 FROM flow._commands k WHERE k.parent_id = c.id)))  -- alone: docs/DESIGN.md
        INTO not_yours, runs
        FROM unnest(command_ids) AS t(id)
        LEFT JOIN flow._commands c ON c.id = t.id
        LEFT JOIN flow._definitions d ON d.name = c.name AND d.version = c.version;
        IF not_yours IS NOT NULL THEN
            RAISE EXCEPTION 'flow: no command with id %', not_yours USING ERRCODE = 'FL014';
        END IF;
        IF runs IS NOT NULL THEN
            PERFORM flow._lock_runs(runs);
        END IF;
        WITH item AS (
            -- held: this transaction's claim locked it (its settlement writes the
            -- claim's attempt too, at the row the lock kept in place); leased: the
            -- lease is still the token's
            SELECT t.id, t.token, t.result, t.attempt, c.ctid AS row_at,
                   CASE WHEN t.attempt IS NOT NULL THEN now() END AS started,
                   (t.attempt IS NOT NULL
                    OR c.status = 'running' AND c.lease_token = t.token AND c.lease_pid IS NULL
                       AND c.lease_expires_at >= now()) AS settleable
            FROM unnest(command_ids, lease_tokens, results, held_attempts) AS t(id, token, result, attempt)
            JOIN flow._commands c ON c.id = ANY (ARRAY[t.id])   -- (a probe per command: sql/common.sql)
        ), settled AS (
            -- (a held root's first attempt spawned nothing: only flow.complete
            -- spawns for an external command, and it settles the command too)
            SELECT coalesce(flow._settle_batch(array_agg(i.id), array_agg(i.token), array_agg(i.result),
                                               array_agg(i.started), array_agg(i.attempt), flow._holding_worker(),
                                               array_agg(i.row_at), false), '{}') AS ids
            FROM item i WHERE i.settleable
        )
        -- (the aggregates of one statement take its rows in the same order: the
        -- arrays stay aligned)
        SELECT array_agg(i.id), array_agg(i.token),
               array_agg(CASE WHEN i.settleable AND i.id = ANY (s.ids) THEN 'succeeded' END)   -- (NULL: read again below)
        INTO ids, tokens, outcomes
        FROM item i, settled s;
    END IF;
    -- (noted for the transaction's end: settled, not abandoned)
    IF held_attempts IS NOT NULL THEN
        PERFORM flow._holding_settled(ARRAY(SELECT t.id FROM unnest(ids, outcomes) AS t(id, outcome)
                                         WHERE t.outcome = 'succeeded'));
    END IF;
    -- (a statement of its own: its snapshot sees what the settlement waited for)
    IF array_position(outcomes, NULL) IS NOT NULL THEN
        SELECT array_agg(coalesce(t.outcome,
                   CASE WHEN EXISTS (SELECT 1 FROM flow._commands c
                                     WHERE c.id = t.id AND c.status = 'succeeded'
                                       AND flow._succeeded_under(c.id, c.lease_token, t.token))
                        THEN 'already_completed' ELSE 'lease_lost' END))
        INTO outcomes
        FROM unnest(ids, tokens, outcomes) AS t(id, token, outcome);
    END IF;
    RETURN QUERY SELECT * FROM unnest(ids, outcomes);
END $$;

CREATE OR REPLACE FUNCTION flow._fail_external(caller oid, command_id uuid, lease_token uuid, message text,
    retry_after interval, permanent boolean, code text)
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    held integer := flow._holding_attempt(caller, command_id, lease_token);
    outcome text;
BEGIN
    PERFORM flow._require_span('retry_after', retry_after);
    IF held IS NULL THEN
        PERFORM flow._leased(caller, command_id, lease_token);
    END IF;
    -- (held: by this transaction's claim, which checked the caller's right)
    outcome := flow._settle_failure(command_id, lease_token,
        CASE WHEN permanent THEN 'permanent' WHEN retry_after IS NOT NULL THEN 'retry_after' ELSE 'retryable' END,
        coalesce(code, CASE WHEN permanent THEN 'permanent' ELSE 'worker_error' END),
        coalesce(message, 'failed by its external worker'), retry_after,
        CASE WHEN held IS NOT NULL THEN now() END, held, flow._holding_worker());
    IF held IS NOT NULL THEN
        IF outcome NOT IN ('retry', 'failed') THEN
            -- (moved on in this very transaction: its run failed or was cancelled)
            RAISE EXCEPTION 'flow: lease token % does not hold command %', lease_token, command_id
                USING ERRCODE = 'FL013';
        END IF;
        PERFORM flow._holding_settled(ARRAY[command_id]);
    END IF;
    RETURN outcome;
END $$;

-- src/lib.rs:68
-- requires:
--   external

-- Schedules: runs started by the clock. A schedule belongs to the role that
-- made it, names a cron expression in a time zone (src/schedules.rs) and a
-- definition with its args; the maintenance worker fires each tick as an
-- enqueue by the schedule's owner (src/maintenance.rs, flow._fire_schedules).

-- Create or replace the caller's schedule `name`; returns its next tick.
-- Everything an enqueue would check is checked now (the definition, the
-- queue, the args), and again at each tick, as the owner then is.
CREATE OR REPLACE FUNCTION flow._schedule(caller oid, name text, cron text, definition text, args jsonb, timezone text,
    queue text, overlap boolean, catch_up integer)
RETURNS timestamptz
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
-- (the ON CONFLICT below names columns owner and name, which cannot be qualified)
DECLARE
    problem text := flow._schedule_problem(cron, timezone);
    plan record;
    next_at timestamptz;
BEGIN
    PERFORM flow._require_name('name', name);
    -- (its runs' keys, schedule:<name>:<tick>, are at most 1 KiB too)
    IF octet_length(name) > 990 THEN
        RAISE EXCEPTION 'flow: a schedule name is at most 990 bytes, got %', octet_length(name) USING ERRCODE = 'FL002';
    END IF;
    IF timezone IS NULL OR overlap IS NULL THEN
        RAISE EXCEPTION 'flow: % must not be NULL', CASE WHEN timezone IS NULL THEN 'timezone' ELSE 'overlap' END
            USING ERRCODE = '22004';
    END IF;
    PERFORM flow._require_name('definition', definition);
    IF problem LIKE 'cron:%' THEN
        RAISE EXCEPTION 'flow: invalid cron expression %: %', coalesce(quote_literal(cron), 'NULL'), substr(problem, 7)
            USING ERRCODE = 'FL022',
                  HINT = 'Give 5 fields (minute hour day-of-month month day-of-week), 6 with a leading seconds field, or @yearly, @monthly, @weekly, @daily, @hourly.';
    ELSIF problem IS NOT NULL THEN
        RAISE EXCEPTION 'flow: %', substr(problem, 11) USING ERRCODE = 'FL023';
    END IF;
    IF catch_up IS NULL OR catch_up < 0 OR catch_up > 1000 THEN
        RAISE EXCEPTION 'flow: catch_up must be from 0 to 1000, got %', coalesce(catch_up::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
    -- (a role's schedules are bounded: each costs the maintenance worker, which serves every role)
    IF NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = caller)
       AND NOT EXISTS (SELECT 1 FROM flow._schedules x WHERE x.owner = caller AND x.name = _schedule.name)
       AND (SELECT count(*) FROM flow._schedules x WHERE x.owner = caller)
           >= current_setting('flow.max_schedules_per_role')::integer THEN
        RAISE EXCEPTION 'flow: role % has flow.max_schedules_per_role (%) schedules already',
            caller::regrole, current_setting('flow.max_schedules_per_role') USING ERRCODE = 'FL018';
    END IF;
    plan := flow._plan_enqueue(caller, definition, NULL, queue, NULL, NULL, NULL);
    PERFORM flow._require_payload('args', args);
    PERFORM flow._require_args_fit(definition, plan.def_owner, plan.def_args_type, args);
    -- (after the clock, not the transaction's start, and after the last tick
    -- enqueued, up to a second ahead: no tick is fired twice, and the one
    -- enqueued already runs as it was enqueued)
    next_at := flow._cron_next(cron, timezone, greatest(clock_timestamp(),
        (SELECT x.last_tick FROM flow._schedules x WHERE x.owner = caller AND x.name = _schedule.name)));
    INSERT INTO flow._schedules AS s (owner, name, cron, timezone, definition, args, queue, overlap, catch_up, next_tick)
    VALUES (caller, name, cron, timezone, definition, args, queue, overlap, catch_up, next_at)
    ON CONFLICT (owner, name) DO UPDATE SET
        cron = excluded.cron, timezone = excluded.timezone, definition = excluded.definition, args = excluded.args,
        queue = excluded.queue, overlap = excluded.overlap, catch_up = excluded.catch_up,
        next_tick = excluded.next_tick, updated_at = now();   -- (a paused schedule stays paused)
    PERFORM flow._mark_owner(caller);
    PERFORM flow._wake_maintenance();
    RETURN next_at;
END $$;

-- Delete the caller's schedule `name`; false if it has none of that name.
-- (Runs it started go on.)
CREATE OR REPLACE FUNCTION flow._unschedule(caller oid, name text) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM flow._schedules s WHERE s.owner = caller AND s.name = _unschedule.name;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF NOT flow._owns_anything(caller) THEN
        PERFORM flow._unmark_owner(caller);
    END IF;
    RETURN true;
END $$;

-- Pause (or resume) the caller's schedule `name`; false if it has none of
-- that name. A paused schedule fires nothing more (a tick enqueued ahead of
-- its time already, at most a second, still runs); resumed, it fires from
-- its next tick after now (the ticks it was paused for are not caught up).
CREATE OR REPLACE FUNCTION flow._pause_schedule(caller oid, name text, paused boolean) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF paused IS NULL THEN
        RAISE EXCEPTION 'flow: paused must not be NULL' USING ERRCODE = '22004';
    END IF;
    UPDATE flow._schedules s SET
        next_tick = CASE WHEN s.paused AND NOT _pause_schedule.paused
                         THEN flow._cron_next(s.cron, s.timezone, greatest(clock_timestamp(), s.last_tick))
                         ELSE s.next_tick END,
        paused = _pause_schedule.paused, updated_at = now()
    WHERE s.owner = caller AND s.name = _pause_schedule.name;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM flow._wake_maintenance();
    RETURN true;
END $$;

-- Fire the due ticks of up to max_count schedules (the maintenance worker,
-- src/maintenance.rs, one short transaction at a time; a schedule another
-- transaction holds waits for the next round). Each tick is enqueued as the
-- schedule's owner, up to `lead` before its time and due at it (run_at), so
-- the time firing takes is not the tick's lateness: its run starts when a
-- worker's sleep until the next due command ends. (A schedule with overlap
-- => false fires at the tick, when it can tell whether the last run is
-- over.) A run is keyed schedule:<name>:<tick in UTC>: that key is the
-- owner's, so a tick fired again (a restore, a failover, a round whose
-- commit was lost) finds its run instead of starting another. A tick whose
-- enqueue fails (the definition's owner revoked the schedule owner's right
-- to start it, args that no longer fit) is skipped with a WARNING.
-- The firing never waits long and runs no user code, whatever a role does:
-- it waits at most lock_timeout for a lock (a run key or a queue held by the
-- owner's open transaction), and does not check args against the
-- definition's args_type (their check was made when the schedule was, and
-- the worker checks them again before each attempt): one role's schedule
-- cannot hold up the maintenance worker, which serves every role.
-- `started`: when the maintenance worker started; ticks that passed before
-- are missed (see src/schedules.rs, _schedule_due). At most max_ticks ticks
-- per call, each a subtransaction (more than 64 in one transaction slow
-- every backend's snapshots); returns true when it stopped there, more may be due.
CREATE OR REPLACE FUNCTION flow._fire_schedules(started timestamptz, max_ticks integer, lead interval) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET lock_timeout = '100ms' AS $$
DECLARE
    -- how late a tick may be fired: later than this, it was missed (a dump
    -- restored long after it was made; the worker's own lag never nears it)
    grace_s constant bigint := 60;
    now_at timestamptz := clock_timestamp();
    s flow._schedules;
    fire timestamptz[];
    next_at timestamptz;
    tick timestamptz;
    skipped bigint;
    run uuid;
    budget integer := max_ticks;
    fired integer := 0;
    skipped_all bigint := 0;
BEGIN
    FOR s IN SELECT * FROM flow._schedules x                            -- index _schedules_due
             WHERE NOT x.paused AND x.next_tick <= now_at + lead AND (x.overlap OR x.next_tick <= now_at)
             ORDER BY x.next_tick LIMIT max_ticks FOR UPDATE SKIP LOCKED LOOP
        EXIT WHEN budget <= 0;
        SELECT d.fire, d.skipped, d.next_tick INTO fire, skipped, next_at
        FROM flow._schedule_due(s.cron, s.timezone, s.next_tick, started, now_at,
                                now_at + CASE WHEN s.overlap THEN lead ELSE interval '0' END, grace_s, s.catch_up,
                                budget) d;
        IF NOT s.overlap AND cardinality(fire) > 0 THEN
            -- one run at a time: the latest due tick, and none while the last one's run is unfinished
            skipped := skipped + cardinality(fire) - 1;
            fire := fire[cardinality(fire):];
            IF EXISTS (SELECT 1 FROM flow._run_rows r WHERE r.id = s.last_run_id AND r.status = 'running') THEN
                skipped := skipped + 1;
                fire := '{}';
            END IF;
        END IF;
        FOREACH tick IN ARRAY fire LOOP
            budget := budget - 1;
            BEGIN
                run := flow._enqueue(s.owner, s.definition, s.args,
                    'schedule:' || s.name || ':' || to_char(tick AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
                    NULL, s.queue, NULL, tick, NULL, NULL, NULL, check_args => false);
                fired := fired + 1;
                s.last_tick := tick;
                s.last_run_id := run;
            EXCEPTION WHEN OTHERS THEN
                skipped := skipped + 1;
                RAISE WARNING 'flow: schedule % of role % skipped its tick at %: %', s.name, s.owner, tick, SQLERRM;
            END;
        END LOOP;
        IF next_at IS NULL THEN
            RAISE WARNING 'flow: schedule % of role % has no tick after %: it fires no more', s.name, s.owner,
                coalesce(s.last_tick, now_at);
        END IF;
        skipped_all := skipped_all + skipped;
        UPDATE flow._schedules x SET next_tick = next_at, last_tick = s.last_tick, last_run_id = s.last_run_id
        WHERE x.owner = s.owner AND x.name = s.name;
    END LOOP;
    PERFORM flow._observe('ticks_fired', fired);
    PERFORM flow._observe('ticks_skipped', skipped_all);
    RETURN budget <= 0;
END $$;

-- Milliseconds until the next tick of any schedule is to be fired (`lead`
-- before it, see _fire_schedules; NULL: none), for the maintenance worker's sleep.
CREATE OR REPLACE FUNCTION flow._next_tick_ms(lead interval) RETURNS bigint
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (SELECT ceil(extract(epoch FROM least(
                       (SELECT min(x.next_tick) - lead FROM flow._schedules x           -- index _schedules_due
                        WHERE NOT x.paused AND x.overlap),
                       (SELECT min(x.next_tick) FROM flow._schedules x                  -- index _schedules_due
                        WHERE NOT x.paused AND NOT x.overlap))
                   - clock_timestamp()) * 1000)::bigint);
END $$;

-- src/gateway.rs:362
-- flow::gateway::_args_misfit_as
CREATE OR REPLACE FUNCTION "_args_misfit_as"(
	"owner" oid, /* pg_sys :: Oid */
	"args_type" oid, /* pg_sys :: Oid */
	"args" TEXT /* & str */
) RETURNS TEXT /* Option < String > */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_args_misfit_as_wrapper';

-- src/shmem.rs:289
-- flow::shmem::_await_done
CREATE OR REPLACE FUNCTION "_await_done"() RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_await_done_wrapper';

-- src/shmem.rs:270
-- flow::shmem::_await_pause
CREATE OR REPLACE FUNCTION "_await_pause"(
	"seconds" double precision /* f64 */
) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_await_pause_wrapper';

-- src/external.rs:284
-- flow::external::_claim_excluded
CREATE OR REPLACE FUNCTION "_claim_excluded"() RETURNS uuid[] /* :: std :: option :: Option < Vec < pgrx :: Uuid > > */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_claim_excluded_wrapper';

-- src/invariants.rs:31
-- flow::invariants::_command_row_is_consistent
-- Skipped due to `#[pgrx(sql = false)]`

-- src/api.rs:236
-- flow::api::_counters
CREATE OR REPLACE FUNCTION "_counters"() RETURNS TABLE (
	"name" TEXT,  /* String */
	"value" bigint  /* i64 */
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_counters_wrapper';

-- src/schedules.rs:76
-- flow::schedules::_cron_next
CREATE OR REPLACE FUNCTION "_cron_next"(
	"cron" TEXT, /* & str */
	"timezone" TEXT, /* & str */
	"after" timestamp with time zone /* TimestampWithTimeZone */
) RETURNS timestamp with time zone /* Option < TimestampWithTimeZone > */
IMMUTABLE STRICT PARALLEL SAFE 
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'next_tick_wrapper';

-- src/api.rs:180
-- flow::api::_current_command
CREATE OR REPLACE FUNCTION "_current_command"() RETURNS uuid /* Option < pgrx :: Uuid > */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_current_command_wrapper';

-- src/spans.rs:51
-- flow::spans::_deadline
CREATE OR REPLACE FUNCTION "_deadline"(
	"start" timestamp with time zone, /* TimestampWithTimeZone */
	"span" interval /* Interval */
) RETURNS timestamp with time zone /* Option < TimestampWithTimeZone > */
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_deadline_wrapper';

-- src/execute.rs:136
-- flow::execute::_decide
CREATE OR REPLACE FUNCTION "_decide"(
	"class" TEXT, /* & str */
	"code" TEXT, /* & str */
	"message" TEXT, /* & str */
	"delay_us" bigint /* Option < i64 > */
) RETURNS bool /* bool */
VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_decide_wrapper';

-- src/external.rs:78
-- flow::external::_external_claim_ended
-- Skipped due to `#[pgrx(sql = false)]`

-- src/external.rs:70
-- flow::external::_external_claim_start
-- Skipped due to `#[pgrx(sql = false)]`

-- src/external.rs:40
-- flow::external::_external_cursor_end
CREATE OR REPLACE FUNCTION "_external_cursor_end"(
	"definition" TEXT, /* Option < & str > */
	"asked" INT, /* i32 */
	"queues" TEXT[], /* :: std :: option :: Option < Vec < String > > */
	"priorities" smallint[], /* :: std :: option :: Option < Vec < i16 > > */
	"due_ats" timestamp with time zone[], /* :: std :: option :: Option < Vec < TimestampWithTimeZone > > */
	"ids" uuid[] /* :: std :: option :: Option < Vec < pgrx :: Uuid > > */
) RETURNS bool /* bool */
VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_external_cursor_end_wrapper';

-- src/external.rs:22
-- flow::external::_external_cursor_start
CREATE OR REPLACE FUNCTION "_external_cursor_start"(
	"definition" TEXT /* Option < & str > */
) RETURNS TABLE (
	"queue" TEXT,  /* String */
	"priority" smallint,  /* i16 */
	"due_at" timestamp with time zone,  /* TimestampWithTimeZone */
	"id" uuid  /* pgrx :: Uuid */
)
VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_external_cursor_start_wrapper';

-- src/api.rs:138
-- flow::api::_group_room
CREATE OR REPLACE FUNCTION "_group_room"(
	"free" INT /* i32 */
) RETURNS INT /* i32 */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_group_room_wrapper';

-- src/api.rs:221
-- flow::api::_held_states
CREATE OR REPLACE FUNCTION "_held_states"() RETURNS TABLE (
	"command_id" uuid,  /* pgrx :: Uuid */
	"pid" INT,  /* i32 */
	"since" timestamp with time zone  /* Option < TimestampWithTimeZone > */
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_held_states_wrapper';

-- src/external.rs:234
-- flow::external::_holding_attempts
CREATE OR REPLACE FUNCTION "_holding_attempts"(
	"caller" oid, /* pg_sys :: Oid */
	"command_ids" uuid[], /* Vec < Option < pgrx :: Uuid > > */
	"lease_tokens" uuid[] /* Vec < Option < pgrx :: Uuid > > */
) RETURNS INT[] /* :: std :: option :: Option < Vec < Option < i32 > > > */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_holding_attempts_wrapper';

-- src/external.rs:256
-- flow::external::_holding_rows
CREATE OR REPLACE FUNCTION "_holding_rows"(
	"command_ids" uuid[] /* Vec < Option < pgrx :: Uuid > > */
) RETURNS TEXT[] /* Vec < Option < String > > */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_holding_rows_wrapper';

-- src/external.rs:266
-- flow::external::_holding_settled
CREATE OR REPLACE FUNCTION "_holding_settled"(
	"command_ids" uuid[] /* Vec < Option < pgrx :: Uuid > > */
) RETURNS bool /* bool */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_holding_settled_wrapper';

-- src/external.rs:163
-- flow::external::_holding_worker
CREATE OR REPLACE FUNCTION "_holding_worker"() RETURNS TEXT /* Option < String > */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_holding_worker_wrapper';

-- src/external.rs:157
-- flow::external::_in_transaction_block
CREATE OR REPLACE FUNCTION "_in_transaction_block"() RETURNS bool /* bool */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_in_transaction_block_wrapper';

-- src/api.rs:155
-- flow::api::_interrupt_run
CREATE OR REPLACE FUNCTION "_interrupt_run"(
	"run" uuid /* pgrx :: Uuid */
) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_interrupt_run_wrapper';

-- src/api.rs:174
-- flow::api::_lease_duration_s
CREATE OR REPLACE FUNCTION "_lease_duration_s"() RETURNS INT /* i32 */
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_lease_duration_s_wrapper';

-- src/ids.rs:55
-- flow::ids::_lease_token
CREATE OR REPLACE FUNCTION "_lease_token"() RETURNS uuid /* pgrx :: Uuid */
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_lease_token_wrapper';

-- src/api.rs:129
-- flow::api::_left_behind
CREATE OR REPLACE FUNCTION "_left_behind"(
	"due" timestamp with time zone /* TimestampWithTimeZone */
) RETURNS bool /* bool */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_left_behind_wrapper';

-- src/api.rs:44
-- flow::api::_left_out
CREATE OR REPLACE FUNCTION "_left_out"(
	"what" TEXT /* & str */
) RETURNS TEXT /* Option < String > */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_left_out_wrapper';

-- src/api.rs:81
-- flow::api::_left_out_of
CREATE OR REPLACE FUNCTION "_left_out_of"(
	"ticket" bigint /* Option < i64 > */
) RETURNS TEXT[] /* Vec < String > */
VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_left_out_of_wrapper';

-- src/locks.rs:79
-- flow::locks::_lock_event_bucket
CREATE OR REPLACE FUNCTION "_lock_event_bucket"(
	"name" TEXT, /* & str */
	"key" TEXT, /* & str */
	"share" bool, /* bool */
	"wait" bool /* bool */
) RETURNS bool /* bool */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_lock_event_bucket_wrapper';

-- src/locks.rs:54
-- flow::locks::_lock_event_key
CREATE OR REPLACE FUNCTION "_lock_event_key"(
	"name" TEXT, /* & str */
	"key" TEXT, /* & str */
	"domain" oid, /* pg_sys :: Oid */
	"mode" TEXT /* & str */
) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_lock_event_key_wrapper';

-- src/locks.rs:91
-- flow::locks::_lock_queue_name
CREATE OR REPLACE FUNCTION "_lock_queue_name"(
	"name" TEXT, /* & str */
	"exclusive" bool /* bool */
) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_lock_queue_name_wrapper';

-- src/api.rs:168
-- flow::api::_max_payload_bytes
CREATE OR REPLACE FUNCTION "_max_payload_bytes"() RETURNS INT /* i32 */
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_max_payload_bytes_wrapper';

-- src/ids.rs:19
-- flow::ids::_new_id
CREATE OR REPLACE FUNCTION "_new_id"() RETURNS uuid /* pgrx :: Uuid */
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_new_id_wrapper';

-- src/external.rs:170
-- flow::external::_note_holding
CREATE OR REPLACE FUNCTION "_note_holding"(
	"caller" oid, /* pg_sys :: Oid */
	"command_id" uuid, /* pgrx :: Uuid */
	"lease_token" uuid, /* pgrx :: Uuid */
	"attempt" INT, /* i32 */
	"held" bool, /* bool */
	"row_at" TEXT, /* Option < String > */
	"worker" TEXT /* & str */
) RETURNS bool /* bool */
VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_note_holding_wrapper';

-- src/execute.rs:128
-- flow::execute::_note_spawn
CREATE OR REPLACE FUNCTION "_note_spawn"() RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_note_spawn_wrapper';

-- src/api.rs:242
-- flow::api::_observe
CREATE OR REPLACE FUNCTION "_observe"(
	"metric" TEXT, /* & str */
	"n" bigint /* i64 */
) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_observe_wrapper';

-- src/rate_limits.rs:150
-- flow::rate_limits::_rate_admit
CREATE OR REPLACE FUNCTION "_rate_admit"(
	"queue" TEXT, /* & str */
	"rate" INT, /* i32 */
	"per_us" bigint /* i64 */
) RETURNS bool /* bool */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_rate_admit_wrapper';

-- src/rate_limits.rs:170
-- flow::rate_limits::_rate_next
CREATE OR REPLACE FUNCTION "_rate_next"(
	"queue" TEXT, /* & str */
	"rate" INT, /* i32 */
	"per_us" bigint /* i64 */
) RETURNS timestamp with time zone /* TimestampWithTimeZone */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_rate_next_wrapper';

-- src/rate_limits.rs:126
-- flow::rate_limits::_rate_room
CREATE OR REPLACE FUNCTION "_rate_room"(
	"queue" TEXT, /* & str */
	"rate" INT, /* i32 */
	"per_us" bigint /* i64 */
) RETURNS INT /* i32 */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_rate_room_wrapper';

-- src/attempt_record.rs:316
-- flow::attempt_record::_recorded_attempts
CREATE OR REPLACE FUNCTION "_recorded_attempts"() RETURNS TABLE (
	"command_id" uuid,  /* pgrx :: Uuid */
	"attempt" INT  /* i32 */
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_recorded_attempts_wrapper';

-- src/api.rs:87
-- flow::api::_redeem
CREATE OR REPLACE FUNCTION "_redeem"(
	"ticket" bigint /* Option < i64 > */
) RETURNS oid /* pg_sys :: Oid */
VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_redeem_wrapper';

-- src/schedules.rs:90
-- flow::schedules::_schedule_due
CREATE OR REPLACE FUNCTION "_schedule_due"(
	"cron" TEXT, /* & str */
	"timezone" TEXT, /* & str */
	"next_tick" timestamp with time zone, /* TimestampWithTimeZone */
	"started" timestamp with time zone, /* TimestampWithTimeZone */
	"now" timestamp with time zone, /* TimestampWithTimeZone */
	"until" timestamp with time zone, /* TimestampWithTimeZone */
	"grace_s" bigint, /* i64 */
	"catch_up" INT, /* i32 */
	"max_fire" INT /* i32 */
) RETURNS TABLE (
	"fire" timestamp with time zone[],  /* Vec < TimestampWithTimeZone > */
	"skipped" bigint,  /* i64 */
	"next_tick" timestamp with time zone  /* Option < TimestampWithTimeZone > */
)
IMMUTABLE STRICT PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_schedule_due_wrapper';

-- src/schedules.rs:56
-- flow::schedules::_schedule_problem
CREATE OR REPLACE FUNCTION "_schedule_problem"(
	"cron" TEXT, /* Option < & str > */
	"timezone" TEXT /* Option < & str > */
) RETURNS TEXT /* Option < String > */
STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_schedule_problem_wrapper';

-- src/spans.rs:29
-- flow::spans::_span_ok
-- Skipped due to `#[pgrx(sql = false)]`

-- src/api.rs:162
-- flow::api::_stop_workers_of
CREATE OR REPLACE FUNCTION "_stop_workers_of"(
	"run" uuid /* pgrx :: Uuid */
) RETURNS INT /* i32 */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_stop_workers_of_wrapper';

-- src/handlers.rs:43
-- flow::handlers::_test_panic
CREATE OR REPLACE FUNCTION "_test_panic"(
	"_args" jsonb /* JsonB */
) RETURNS jsonb /* Option < JsonB > */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_test_panic_wrapper';

-- src/api.rs:23
-- flow::api::_ticket
CREATE OR REPLACE FUNCTION "_ticket"() RETURNS bigint /* i64 */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_ticket_wrapper';

-- src/locks.rs:101
-- flow::locks::_try_lock_queue_name
CREATE OR REPLACE FUNCTION "_try_lock_queue_name"(
	"name" TEXT /* & str */
) RETURNS bool /* bool */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_try_lock_queue_name_wrapper';

-- src/api.rs:103
-- flow::api::_wake
CREATE OR REPLACE FUNCTION "_wake"() RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_wake_wrapper';

-- src/api.rs:111
-- flow::api::_wake_due_from
CREATE OR REPLACE FUNCTION "_wake_due_from"(
	"due" timestamp with time zone /* TimestampWithTimeZone */
) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_wake_due_from_wrapper';

-- src/api.rs:148
-- flow::api::_wake_maintenance
CREATE OR REPLACE FUNCTION "_wake_maintenance"() RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_wake_maintenance_wrapper';

-- src/api.rs:188
-- flow::api::_worker_states
CREATE OR REPLACE FUNCTION "_worker_states"() RETURNS TABLE (
	"worker" INT,  /* i32 */
	"pid" INT,  /* Option < i32 > */
	"state" TEXT,  /* String */
	"command_id" uuid,  /* Option < pgrx :: Uuid > */
	"since" timestamp with time zone,  /* Option < TimestampWithTimeZone > */
	"handled" bigint  /* i64 */
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_worker_states_wrapper';

-- src/api.rs:119
-- flow::api::_written_here
CREATE OR REPLACE FUNCTION "_written_here"(
	"xmin" bigint /* i64 */
) RETURNS bool /* bool */
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_written_here_wrapper';

-- src/handlers.rs:13
-- flow::handlers::noop

CREATE OR REPLACE FUNCTION "noop"(
	"_args" jsonb /* JsonB */
) RETURNS jsonb /* Option < JsonB > */
IMMUTABLE STRICT PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'noop_wrapper';

-- src/handlers.rs:28
-- flow::handlers::run_sql
CREATE OR REPLACE FUNCTION "run_sql"(
	"args" jsonb /* JsonB */
) RETURNS jsonb /* JsonB */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'run_sql_wrapper';

-- src/lib.rs:69
-- finalize
-- flow's public SQL surface (names and named parameters are the API, see
-- DESIGN.md) and the views a person reads.
--
-- Every function that changes flow's tables is SECURITY DEFINER with a pinned
-- search_path and ends in `caller_ticket bigint DEFAULT flow._ticket()`: the
-- default is evaluated in the caller's security context, before the switch to
-- the definer, so flow._redeem() learns the real calling role. Never pass it.
-- They are PL/pgSQL, however short: PostgreSQL parses and plans the body of an
-- SQL function at every call from a client (and, inside a handler, in every
-- subtransaction), where PL/pgSQL plans each statement once per session.

-- ---------------------------------------------------------------- definitions and queues

-- Register or update a kind of command; its handler runs as the calling role.
-- queue NULL: the role's own queue, 'role:<name>' ('default' for superusers).
-- args_type: a composite type (or a domain over jsonb) the args must fit.
CREATE OR REPLACE FUNCTION flow.define(name text, handler regprocedure, version integer DEFAULT 1,
    queue text DEFAULT NULL, max_attempts integer DEFAULT 5, backoff interval DEFAULT '1 second',
    backoff_max interval DEFAULT '1 hour', max_elapsed interval DEFAULT NULL, timeout interval DEFAULT NULL,
    args_type regtype DEFAULT NULL, priority integer DEFAULT 0, caller_ticket bigint DEFAULT flow._ticket())
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM flow._define(flow._redeem(caller_ticket), name, handler, version, queue, max_attempts, backoff,
                         backoff_max, max_elapsed, timeout, args_type, priority);
END $$;

-- Set a queue's concurrency limit (NULL: none) and paused flag. An option
-- left out keeps the value it has (flow._left_out: its default is NULL, and
-- says it was left out); paused NULL keeps it too.
CREATE OR REPLACE FUNCTION flow.set_queue(name text, concurrency integer DEFAULT flow._left_out('concurrency')::integer,
    paused boolean DEFAULT NULL, rate integer DEFAULT flow._left_out('rate')::integer,
    per interval DEFAULT flow._left_out('per')::interval,
    group_concurrency integer DEFAULT flow._left_out('group_concurrency')::integer,
    caller_ticket bigint DEFAULT flow._ticket())
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    left_out text[] := flow._left_out_of(caller_ticket);
BEGIN
    PERFORM flow._set_queue(flow._redeem(caller_ticket), name, concurrency, paused, rate, per, group_concurrency, left_out);
END $$;

-- Drop a queue you manage that no definition and no unfinished command uses
-- (2BP01 otherwise); false if there is no such queue.
CREATE OR REPLACE FUNCTION flow.drop_queue(name text, caller_ticket bigint DEFAULT flow._ticket())
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._drop_queue(flow._redeem(caller_ticket), name);
END $$;

-- Let `role` ('PUBLIC' for everyone) start commands of a definition you own,
-- every version of it; by default only the owner's role and its members can.
CREATE OR REPLACE FUNCTION flow.grant_definition(name text, role text, caller_ticket bigint DEFAULT flow._ticket())
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM flow._grant_definition(flow._redeem(caller_ticket), name, role, true);
END $$;

CREATE OR REPLACE FUNCTION flow.revoke_definition(name text, role text, caller_ticket bigint DEFAULT flow._ticket())
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM flow._grant_definition(flow._redeem(caller_ticket), name, role, false);
END $$;

-- Let `role` ('PUBLIC' for everyone) define on, and enqueue into, a queue you own.
CREATE OR REPLACE FUNCTION flow.grant_queue(name text, role text, caller_ticket bigint DEFAULT flow._ticket())
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM flow._grant_queue(flow._redeem(caller_ticket), name, role, true);
END $$;

CREATE OR REPLACE FUNCTION flow.revoke_queue(name text, role text, caller_ticket bigint DEFAULT flow._ticket())
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM flow._grant_queue(flow._redeem(caller_ticket), name, role, false);
END $$;

-- ---------------------------------------------------------------- starting runs

-- Start a run of a definition; returns the run id (the same one again for the same key).
CREATE OR REPLACE FUNCTION flow.enqueue(name text, args jsonb DEFAULT '{}', key text DEFAULT NULL,
    version integer DEFAULT NULL, queue text DEFAULT NULL, start_after interval DEFAULT NULL,
    run_at timestamptz DEFAULT NULL, deadline interval DEFAULT NULL, priority integer DEFAULT NULL,
    group_key text DEFAULT NULL, caller_ticket bigint DEFAULT flow._ticket())
RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._enqueue(flow._redeem(caller_ticket), name, args, key, version, queue, start_after,
                         run_at, deadline, priority, group_key);
END $$;

-- Start one run per element of args_array in one statement; returns their ids in order.
CREATE OR REPLACE FUNCTION flow.enqueue_many(name text, args_array jsonb[], version integer DEFAULT NULL,
    queue text DEFAULT NULL, start_after interval DEFAULT NULL, run_at timestamptz DEFAULT NULL,
    deadline interval DEFAULT NULL, priority integer DEFAULT NULL, group_key text DEFAULT NULL,
    group_keys text[] DEFAULT NULL, caller_ticket bigint DEFAULT flow._ticket())
RETURNS uuid[]
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._enqueue_many(flow._redeem(caller_ticket), name, args_array, version, queue, start_after,
                              run_at, deadline, priority, group_key, group_keys);
END $$;

-- ---------------------------------------------------------------- schedules

-- Create or replace your schedule `name`: each tick of `cron` (5 fields, 6
-- with seconds first, or @hourly...) in `timezone` starts a run of
-- `definition` with `args`, keyed schedule:<name>:<tick in UTC>. Returns the
-- next tick. overlap => false skips a tick while the last one's run is
-- unfinished; catch_up is how many ticks missed while the server was down
-- run when it is back (0: none).
CREATE OR REPLACE FUNCTION flow.schedule(name text, cron text, definition text, args jsonb DEFAULT '{}',
    timezone text DEFAULT 'UTC', queue text DEFAULT NULL, overlap boolean DEFAULT true, catch_up integer DEFAULT 0,
    caller_ticket bigint DEFAULT flow._ticket())
RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._schedule(flow._redeem(caller_ticket), name, cron, definition, args, timezone, queue, overlap, catch_up);
END $$;

-- Delete your schedule `name` (its runs go on); false if you have none of that name.
CREATE OR REPLACE FUNCTION flow.unschedule(name text, caller_ticket bigint DEFAULT flow._ticket())
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._unschedule(flow._redeem(caller_ticket), name);
END $$;

-- Pause (or, with false, resume) your schedule `name`; false if you have none of that name.
CREATE OR REPLACE FUNCTION flow.pause_schedule(name text, paused boolean DEFAULT true, caller_ticket bigint DEFAULT flow._ticket())
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._pause_schedule(flow._redeem(caller_ticket), name, paused);
END $$;

-- ---------------------------------------------------------------- run control

-- Cancel every unfinished command of a run; true if the run was still running.
CREATE OR REPLACE FUNCTION flow.cancel(run_id uuid, caller_ticket bigint DEFAULT flow._ticket())
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._cancel(flow._redeem(caller_ticket), run_id);
END $$;

-- Re-drive a failed or cancelled run: its failed and cancelled commands run
-- again with a fresh attempt budget; false if the run is not failed or cancelled.
CREATE OR REPLACE FUNCTION flow.retry(run_id uuid, caller_ticket bigint DEFAULT flow._ticket())
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._retry(flow._redeem(caller_ticket), run_id);
END $$;

-- Wait until a run is terminal (or the timeout passes) and return its outcome.
CREATE OR REPLACE FUNCTION flow.await(run_id uuid, timeout interval DEFAULT '30 seconds',
    caller_ticket bigint DEFAULT flow._ticket())
RETURNS flow.run_outcome
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._await(flow._redeem(caller_ticket), run_id, timeout);
END $$;

-- ---------------------------------------------------------------- events and children

-- Append an event to the journal (inside a handler: only if its attempt succeeds).
CREATE OR REPLACE FUNCTION flow.emit(name text, key text, payload jsonb DEFAULT '{}',
    caller_ticket bigint DEFAULT flow._ticket())
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._emit(flow._redeem(caller_ticket), flow._current_command(), name, key, payload);
END $$;

-- A wait on the event (name, key), for flow.spawn(waits => ...).
CREATE OR REPLACE FUNCTION flow.wait(name text, key text) RETURNS flow.wait_spec
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT ROW(name, key)::flow.wait_spec
$$;

-- Inside a handler: add a child command to the current run.
CREATE OR REPLACE FUNCTION flow.spawn(name text, args jsonb DEFAULT '{}', key text DEFAULT NULL,
    start_after interval DEFAULT NULL, waits flow.wait_spec[] DEFAULT '{}', within interval DEFAULT NULL,
    version integer DEFAULT NULL, queue text DEFAULT NULL, priority integer DEFAULT NULL,
    group_key text DEFAULT NULL, caller_ticket bigint DEFAULT flow._ticket())
RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (flow._spawn_many(flow._redeem(caller_ticket), flow._current_command(), name, ARRAY[args], ARRAY[key],
                             start_after, waits, within, version, queue, priority, group_key, NULL))[1];
END $$;

-- Inside a handler: add a child of `name` to the current run for each
-- element of args_array, under the key at the same place in keys (and in the
-- group at the same place in group_keys, or all in group_key), all with the
-- same options. Returns their ids in that order.
CREATE OR REPLACE FUNCTION flow.spawn_many(name text, args_array jsonb[], keys text[],
    start_after interval DEFAULT NULL, waits flow.wait_spec[] DEFAULT '{}', within interval DEFAULT NULL,
    version integer DEFAULT NULL, queue text DEFAULT NULL, priority integer DEFAULT NULL,
    group_key text DEFAULT NULL, group_keys text[] DEFAULT NULL, caller_ticket bigint DEFAULT flow._ticket())
RETURNS uuid[]
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._spawn_many(flow._redeem(caller_ticket), flow._current_command(), name, args_array, keys,
                            start_after, waits, within, version, queue, priority, group_key, group_keys);
END $$;

-- The run's commands, parent links, waits and events as text to render: 'dot' or 'mermaid'.
CREATE OR REPLACE FUNCTION flow.run_graph(run_id uuid, format text DEFAULT 'dot', caller_ticket bigint DEFAULT flow._ticket())
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._run_graph(flow._redeem(caller_ticket), run_id, format);
END $$;

-- ---------------------------------------------------------------- decisions inside a handler

-- Fail the current command permanently: no retry. It raises, rolling back
-- the handler's writes; with keep_writes => true it returns instead, and the
-- handler's writes, events and children commit with the failed settlement
-- (a saga's compensation: refund, then fail).
CREATE OR REPLACE FUNCTION flow.fail(message text, keep_writes boolean DEFAULT false) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    text_ text := coalesce(message, 'failed by its handler');
BEGIN
    IF keep_writes THEN
        IF NOT flow._decide('kept_failure', 'permanent', text_, NULL) THEN
            RAISE EXCEPTION 'flow: fail(keep_writes => true) needs a running handler' USING ERRCODE = 'FL012';
        END IF;
        RETURN;
    END IF;
    PERFORM flow._decide('permanent', 'permanent', text_, NULL);
    RAISE EXCEPTION USING ERRCODE = 'FL020', MESSAGE = text_;
END $$;

-- Retry the current command after `delay` (positive), counting an attempt.
CREATE OR REPLACE FUNCTION flow.retry_after(delay interval, message text DEFAULT 'retry requested by its handler')
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF delay IS NULL OR NOT flow._span_ok(delay, false) THEN
        PERFORM flow._decide('permanent', 'invalid_retry_after',
            format('flow: retry_after delay must be positive, with no negative field, and at most 100 years, got %s', delay), NULL);
        RAISE EXCEPTION 'flow: retry_after delay must be positive, with no negative field, and at most 100 years, got %', delay
            USING ERRCODE = 'FL005';
    END IF;
    PERFORM flow._decide('retry_after', 'retry_after', coalesce(message, 'retry requested by its handler'),
                         (extract(epoch FROM delay) * 1000000)::bigint);
    RAISE EXCEPTION USING ERRCODE = 'FL021', MESSAGE = coalesce(message, 'retry requested by its handler');
END $$;

-- ---------------------------------------------------------------- external workers
-- A definition with handler => NULL is resolved by programs outside the
-- server. Its owner's role (and members of it) may claim and settle it.

-- Take up to `max` due commands of these definitions under a lease.
-- With hold => true, inside a transaction block, they are held by the
-- caller's transaction instead: the claim locks their rows and writes
-- nothing, and their settlement in the same transaction (complete_many,
-- complete, fail) writes each once; the transaction's end releases what it
-- did not settle, each such attempt counted as interrupted (by the maintenance worker,
-- src/external.rs). No heartbeat: the lease is the transaction. (A limited
-- queue's commands are still leased, so that they count as running: their
-- lease runs out if the transaction commits them unsettled.)
-- (Not a thin SQL wrapper like the others: every layer of set-returning
-- function copies each claimed row, with its context, once more, and an SQL
-- function's statement is planned at every call. This is an external
-- worker's hot path, so flow._claim's rows are leased (those it does not
-- hold, by flow._lease), interleaved and handed on here directly, in one
-- statement whose plan is kept for the session.)
-- A claim of one definition takes up where the last full claim of it ended,
-- whichever worker made it, as an in-database worker's claim takes up where
-- its last one ended (see flow._claim): the index entries of the commands
-- claimed before stay in the due index until VACUUM, and every claim from
-- the head walked them all (src/external.rs keeps the ends). Short from
-- there, it takes the rest from the head.
CREATE OR REPLACE FUNCTION flow.claim(names text[], worker text, max integer DEFAULT 1, lease interval DEFAULT NULL,
    hold boolean DEFAULT false, caller_ticket bigint DEFAULT flow._ticket())
RETURNS TABLE (command_id uuid, run_id uuid, name text, version integer, queue text, args jsonb,
               attempt integer, lease_token uuid, lease_expires_at timestamptz, deadline timestamptz,
               context flow.context)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    lease_for interval := coalesce(lease, make_interval(secs => flow._lease_duration_s()));
    alone text := CASE WHEN cardinality(names) = 1 THEN names[1] END;
    holding boolean := coalesce(hold, false);
    caller oid := flow._redeem(caller_ticket);
    after_queue text;
    after_priority smallint;
    after_at timestamptz;
    after_id uuid;
    wanted integer := max;
    taken integer;
BEGIN
    PERFORM flow._prepare_external_claim(caller, names, worker, max, lease_for, NOT holding);
    IF holding THEN
        IF NOT flow._in_transaction_block() THEN
            RAISE EXCEPTION 'flow: a claim with hold => true must run inside a transaction block (BEGIN ... COMMIT)'
                USING ERRCODE = '25P01', HINT = 'Its commands are held until the transaction ends.';
        END IF;
        IF flow._holding_worker() <> worker THEN
            RAISE EXCEPTION 'flow: this transaction holds commands for worker %, not %', flow._holding_worker(), worker
                USING ERRCODE = '22023';
        END IF;
        IF current_database() <> current_setting('flow.database_name') THEN
            RAISE EXCEPTION 'flow: a claim with hold => true needs flow''s maintenance worker in this database (flow.database_name)'
                USING ERRCODE = '55000',
                      DETAIL = 'The maintenance worker counts the attempts of transactions that end unsettled.';
        END IF;
    END IF;
    SELECT s.queue, s.priority, s.due_at, s.id INTO after_queue, after_priority, after_at, after_id
    FROM flow._external_cursor_start(alone) s;
    LOOP
        RETURN QUERY
            WITH locked AS (
                SELECT k.*,
                       -- (a held attempt's token: it names the attempt for the
                       -- client's transaction, see src/external.rs)
                       CASE WHEN k.held THEN flow._new_id() END AS held_token
                FROM flow._claim(wanted, names, (random() * 1000)::integer, NULL, flow._claim_excluded(),
                                 CASE WHEN after_queue IS NOT NULL THEN ARRAY[after_queue] END,
                                 ARRAY[after_priority], ARRAY[after_at], ARRAY[after_id], holding) k
            ), picked AS (
                -- From one queue and for one definition (the common claim),
                -- what the claim locked, in due order (nothing sorted).
                SELECT k.command_id, k.run_id, k.name, k.version, k.queue, k.args, k.attempt, k.deadline, k.context,
                       k.due_at, k.row_at, k.held, k.held_token, k.priority, k.group_hash
                FROM locked k WHERE k.claim_order IS NULL
                UNION ALL
                -- From several (claim_order 0), the queues interleaved
                -- round-robin, each lane's commands ranked in due order; a
                -- limited lane keeps its earliest up to its room (a claim
                -- naming several definitions locked up to the room for each).
                (SELECT k.command_id, k.run_id, k.name, k.version, k.queue, k.args, k.attempt, k.deadline, k.context,
                        k.due_at, k.row_at, k.held, k.held_token, k.priority, k.group_hash
                 FROM (SELECT k.*, row_number() OVER (PARTITION BY k.lane_order ORDER BY k.priority, k.due_at, k.command_id) AS rank
                       FROM locked k WHERE k.claim_order IS NOT NULL) k
                 WHERE k.rank <= k.lane_room
                 ORDER BY k.rank, k.lane_order
                 LIMIT wanted)
            ), leased AS (
                SELECT l.*
                FROM (SELECT array_agg(p.command_id) AS ids, array_agg(p.row_at) AS row_ats,
                             array_agg(p.deadline) AS deadlines
                      FROM picked p WHERE NOT p.held) a
                CROSS JOIN LATERAL flow._lease(worker, NULL, NULL, lease_for, a.ids, a.row_ats, a.deadlines) l
                WHERE a.ids IS NOT NULL
            )
            SELECT c.command_id, c.run_id, c.name, c.version, c.queue, c.args, c.attempt, c.lease_token,
                   c.lease_expires_at, c.deadline, c.context
            FROM (-- the leased ones, then the held ones, each in claim order
                  SELECT p.*, l.lease_token, l.lease_expires_at
                  FROM leased l JOIN picked p ON p.command_id = l.command_id
                  UNION ALL
                  SELECT p.*, p.held_token, NULL FROM picked p WHERE p.held) c
            -- The claim notes where it ended, for the next claims of its
            -- definition (src/external.rs): a one-time filter, run once, before
            -- any row is handed on. (From what it locked: a held claim's
            -- commands stay in the due index, locked, until its client's
            -- transaction ends, and the next claims would skip each of them again.)
            -- (a claim that took grouped commands notes nothing: cursors are of the ungrouped)
            WHERE (SELECT flow._external_cursor_end(CASE WHEN bool_or(k.group_hash <> 0) THEN NULL ELSE alone END, wanted, array_agg(k.queue), array_agg(k.priority),
                                                     array_agg(k.due_at), array_agg(k.command_id))
                   FROM picked k)
              -- (each held claim noted for the transaction's end: src/external.rs)
              AND (NOT holding OR flow._note_holding(caller, c.command_id, c.lease_token, c.attempt, c.held,
                                                     CASE WHEN c.held THEN c.row_at::text END, worker));
        GET DIAGNOSTICS taken = ROW_COUNT;
        -- Short, it claims the rest: from the head, if it began where the
        -- last claim ended; and from the queues that had more, if it took
        -- several queues' shares (what it claimed is leased now, or held and
        -- left alone: flow._claim_excluded). A claim from one queue that came
        -- back short asks once more, and finds nothing or what came due meanwhile.
        EXIT WHEN taken >= wanted OR (taken = 0 AND after_queue IS NULL);
        after_queue := NULL;
        wanted := wanted - taken;
    END LOOP;
END $$;

-- Extend a lease (by `extend`, default: its original length); cancelled = true means stop.
CREATE OR REPLACE FUNCTION flow.heartbeat(command_id uuid, lease_token uuid, extend interval DEFAULT NULL,
    caller_ticket bigint DEFAULT flow._ticket())
RETURNS TABLE (lease_expires_at timestamptz, cancelled boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN QUERY SELECT * FROM flow._heartbeat(flow._redeem(caller_ticket), command_id, lease_token, extend);
END $$;

-- What became of an attempt: 'held', 'expired', or 'concluded' with its
-- outcome (for a worker that lost a reply and must know whether it still owns it).
CREATE OR REPLACE FUNCTION flow.resolve(command_id uuid, lease_token uuid, caller_ticket bigint DEFAULT flow._ticket())
RETURNS TABLE (state text, outcome text, lease_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN QUERY SELECT * FROM flow._resolve(flow._redeem(caller_ticket), command_id, lease_token);
END $$;

-- Settle success, with events [{name, key, payload}] and children
-- [{name, args, key, start_after, waits: [{name, key}], within, version, queue}].
CREATE OR REPLACE FUNCTION flow.complete(command_id uuid, lease_token uuid, result jsonb DEFAULT NULL,
    events jsonb DEFAULT NULL, children jsonb DEFAULT NULL, caller_ticket bigint DEFAULT flow._ticket())
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._complete(flow._redeem(caller_ticket), command_id, lease_token, result, events, children);
END $$;

-- Settle many successes (results only) in one call: one status per command,
-- 'succeeded', 'lease_lost' (nothing changed for it) or 'already_completed'.
CREATE OR REPLACE FUNCTION flow.complete_many(command_ids uuid[], lease_tokens uuid[], results jsonb[] DEFAULT NULL,
    caller_ticket bigint DEFAULT flow._ticket())
RETURNS TABLE (command_id uuid, status text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN QUERY SELECT * FROM flow._complete_many(flow._redeem(caller_ticket), command_ids, lease_tokens, results);
END $$;

-- Settle failure: retried per the definition's policy, after retry_after when
-- given, or never when permanent. Returns 'retry' or 'failed'.
CREATE OR REPLACE FUNCTION flow.fail(command_id uuid, lease_token uuid, message text, retry_after interval DEFAULT NULL,
    permanent boolean DEFAULT false, code text DEFAULT NULL, caller_ticket bigint DEFAULT flow._ticket())
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._fail_external(flow._redeem(caller_ticket), command_id, lease_token, message, retry_after,
                               permanent, code);
END $$;

-- ---------------------------------------------------------------- views

-- Runs the current role may see: its own, or those of roles it is a member of.
CREATE OR REPLACE VIEW flow.runs WITH (security_barrier) AS
SELECT r.id, r.key, r.name, r.version, r.queue, r.status, r.args, r.result, r.error,
       r.error ->> 'message' AS last_error, r.deadline, r.created_at, r.finished_at,
       r.owner::regrole AS owner,
       -- (_command_rows, not flow._commands_of: a view's function calls are
       -- checked against the caller, who may not execute the engine's own)
       (SELECT sum(c.attempts) FROM flow._command_rows c WHERE c.run_id = r.id)::integer AS attempts
FROM flow._run_rows r
WHERE pg_has_role(current_user, r.owner, 'MEMBER');

-- What each in-database worker is doing now (shared memory), as the caller
-- may see it: the command it runs is named only if the caller is a member of
-- the command's owner (the engine, as superuser, sees every one). The views
-- read the workers through this (flow._worker_states is the engine's own):
-- the ticket says who called, from the view's own call.
CREATE OR REPLACE FUNCTION flow._worker_rows(caller_ticket bigint DEFAULT flow._ticket())
RETURNS TABLE (worker integer, pid integer, state text, command_id uuid, since timestamptz, handled bigint)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH me AS MATERIALIZED (SELECT flow._redeem(caller_ticket) AS caller)
    SELECT w.worker, w.pid, w.state,
           (SELECT c.id FROM flow._commands c
            WHERE c.id = w.command_id AND pg_has_role(me.caller, c.owner, 'MEMBER')),
           w.since, w.handled
    FROM flow._worker_states() w CROSS JOIN me
$$;

-- The commands in-database workers hold now, as flow._worker_rows names
-- them: only the caller's.
CREATE OR REPLACE FUNCTION flow._held_rows(caller_ticket bigint DEFAULT flow._ticket())
RETURNS TABLE (command_id uuid, pid integer, since timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH me AS MATERIALIZED (SELECT flow._redeem(caller_ticket) AS caller)
    SELECT h.command_id, h.pid, h.since
    FROM flow._held_states() h CROSS JOIN me
    WHERE EXISTS (SELECT 1 FROM flow._commands c
                  WHERE c.id = h.command_id AND pg_has_role(me.caller, c.owner, 'MEMBER'))
$$;

-- The attempts in-database workers are in now, of commands they hold (see
-- flow._claim): nothing in the table says so until the attempt is settled,
-- so the views take it from the workers' shared memory. Held only: a leased
-- command's row says it runs, as of the reader's snapshot, and a worker's
-- word on it, read later, could show it running beside the command that
-- ran before it in a limited queue.
CREATE OR REPLACE VIEW flow._held_attempts AS
SELECT c.id AS command_id, c.attempts + 1 AS attempt, format('%s:%s', current_database(), w.pid) AS owner,
       w.since AS started_at
FROM flow._held_rows() w JOIN flow._commands c ON c.id = w.command_id
WHERE c.status IN ('pending', 'waiting');

CREATE OR REPLACE VIEW flow.commands WITH (security_barrier) AS
SELECT c.id, c.run_id, c.parent_id, c.key, c.name, c.version, c.queue,
       CASE WHEN h.command_id IS NULL THEN c.status ELSE 'running' END AS status,
       coalesce(h.attempt, c.attempts) AS attempts,
       c.next_run_at, c.args, c.result, c.last_error_code, c.last_error_message, c.stop_reason,
       c.wait_timed_out, coalesce(h.owner, c.lease_owner) AS lease_owner, c.lease_expires_at,
       coalesce(h.started_at, c.attempt_started_at) AS attempt_started_at, c.attempt_deadline,
       c.created_at, c.finished_at, c.priority, c.group_key
FROM flow._command_rows c
LEFT JOIN flow._held_attempts h ON h.command_id = c.id
WHERE pg_has_role(current_user, c.owner, 'MEMBER');

-- Finished attempts of visible commands (a success is its command row: see
-- sql/schema.sql, _attempts), plus the live one of a running command.
CREATE OR REPLACE VIEW flow.attempts WITH (security_barrier) AS
SELECT a.command_id, c.run_id, c.name, a.attempt, a.owner, a.started_at, a.finished_at,
       a.finished_at - a.started_at AS duration, a.outcome, a.error_code, a.error_message
FROM flow._attempts a JOIN flow._command_rows c ON c.id = a.command_id
WHERE pg_has_role(current_user, c.owner, 'MEMBER')
UNION ALL
SELECT c.id, c.run_id, c.name, c.attempts, c.lease_owner, c.attempt_started_at, c.finished_at,
       c.finished_at - c.attempt_started_at, 'succeeded', NULL, NULL
FROM flow._command_rows c
WHERE c.status = 'succeeded' AND c.lease_token IS NOT NULL AND pg_has_role(current_user, c.owner, 'MEMBER')
UNION ALL
SELECT c.id, c.run_id, c.name, c.attempts, c.lease_owner, c.attempt_started_at, NULL, now() - c.attempt_started_at,
       'running', NULL, NULL
FROM flow._command_rows c
WHERE c.status = 'running' AND pg_has_role(current_user, c.owner, 'MEMBER')
UNION ALL
SELECT c.id, c.run_id, c.name, h.attempt, h.owner, h.started_at, NULL, now() - h.started_at, 'running', NULL, NULL
FROM flow._held_attempts h JOIN flow._command_rows c ON c.id = h.command_id
WHERE pg_has_role(current_user, c.owner, 'MEMBER');

CREATE OR REPLACE VIEW flow.definitions WITH (security_barrier) AS
SELECT d.name, d.version, d.handler, d.handler IS NULL AS external, d.takes_context, d.owner,
       d.queue, d.max_attempts, d.backoff, d.backoff_max, d.max_elapsed, d.timeout, d.created_at, d.updated_at,
       n.starters, d.priority
FROM flow._definitions d JOIN flow._definition_names n ON n.name = d.name
WHERE pg_has_role(current_user, d.owner, 'MEMBER');

-- The queues a role owns or may use, with what is live in them: counts of
-- its own unfinished commands (other roles' work in a shared queue is theirs
-- to see). Counted by the claim's own indexes (pending and waiting commands
-- in _commands_due, running ones in _commands_running; a held attempt is
-- running, from the workers' shared memory), so polling it costs the
-- backlog, never the retained history: that is flow.queue_history.
CREATE OR REPLACE VIEW flow.queues WITH (security_barrier) AS
SELECT q.name, q.owner, q.users, q.concurrency, q.paused,
       coalesce(u.pending, 0) AS pending, coalesce(u.due, 0) AS due, coalesce(u.waiting, 0) AS waiting,
       coalesce(u.held, 0) + coalesce(k.running, 0) AS running, q.rate, q.per, q.group_concurrency
FROM flow._queues q
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE c.status = 'pending' AND h.command_id IS NULL) AS pending,
           count(*) FILTER (WHERE c.status = 'pending' AND h.command_id IS NULL AND c.next_run_at <= now()) AS due,
           count(*) FILTER (WHERE c.status = 'waiting' AND h.command_id IS NULL) AS waiting,
           count(h.command_id) AS held
    FROM flow._commands c                                           -- index _commands_due
    LEFT JOIN flow._held_attempts h ON h.command_id = c.id
    WHERE flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END)
              = ANY (ARRAY(SELECT l.lane FROM flow._queue_lanes l WHERE l.queue = q.name))
      AND c.queue = q.name AND c.status IN ('pending', 'waiting')
      AND pg_has_role(current_user, c.owner, 'MEMBER')) u
CROSS JOIN LATERAL (
    SELECT count(*) AS running
    FROM flow._commands c                                           -- index _commands_running
    WHERE c.queue = q.name AND c.status = 'running'
      AND pg_has_role(current_user, c.owner, 'MEMBER')) k
WHERE coalesce(pg_has_role(current_user, q.owner, 'MEMBER'), false) OR flow._among(current_user::regrole, q.users);

-- What the retained history holds per queue: counts of a role's own finished
-- commands (until flow.retention prunes them). It reads every retained
-- command of the queue: for reports, not for polling.
CREATE OR REPLACE VIEW flow.queue_history WITH (security_barrier) AS
SELECT q.name,
       count(c.id) FILTER (WHERE c.status = 'succeeded') AS succeeded,
       count(c.id) FILTER (WHERE c.status = 'failed') AS failed,
       count(c.id) FILTER (WHERE c.status = 'cancelled') AS cancelled,
       min(c.finished_at) AS since
FROM flow._queues q
LEFT JOIN (SELECT x.id, x.queue, x.status, x.finished_at
           FROM flow._commands x
           WHERE x.finished_at IS NOT NULL AND pg_has_role(current_user, x.owner, 'MEMBER')) c
       ON c.queue = q.name
WHERE coalesce(pg_has_role(current_user, q.owner, 'MEMBER'), false) OR flow._among(current_user::regrole, q.users)
GROUP BY q.name;

-- The journal, with the waits each event satisfied.
CREATE OR REPLACE VIEW flow.events WITH (security_barrier) AS
SELECT e.position, e.id, e.name, e.key, e.payload, e.emitted_at, e.run_id, e.command_id,
       e.owner::regrole AS owner,
       coalesce((SELECT array_agg(w.command_id ORDER BY w.command_id) FROM flow._waits w
                 WHERE w.event_position = e.position), '{}') AS satisfied_waits
FROM flow._events e
WHERE pg_has_role(current_user, e.owner, 'MEMBER');

CREATE OR REPLACE VIEW flow.waits WITH (security_barrier) AS
SELECT w.command_id, c.run_id, w.name, w.key, w.event_position, w.satisfied_at
FROM flow._waits w JOIN flow._command_rows c ON c.id = w.command_id
WHERE pg_has_role(current_user, c.owner, 'MEMBER');

-- What each in-database worker is doing now (shared memory); another role's
-- command is not named (flow._worker_rows).
CREATE OR REPLACE VIEW flow.workers AS
SELECT w.worker, w.pid, w.state, w.command_id, w.since, w.handled
FROM flow._worker_rows() w;

-- Your schedules (those of roles you are a member of).
CREATE OR REPLACE VIEW flow.schedules WITH (security_barrier) AS
SELECT s.name, s.cron, s.timezone, s.definition, s.args, s.queue, s.paused, s.next_tick, s.last_tick,
       s.last_run_id, s.owner::regrole AS owner, s.overlap, s.catch_up
FROM flow._schedules s
WHERE pg_has_role(current_user, s.owner, 'MEMBER');

-- Engine counters since the server started (shared memory), plus recent attempts.
CREATE OR REPLACE VIEW flow.stats AS
SELECT s.name, s.value FROM flow._counters() s;

-- The counters in Prometheus' text format, one line a row: an exporter (or
-- `psql -At -c 'SELECT line FROM flow.prometheus'`) serves it as it is.
CREATE OR REPLACE VIEW flow.prometheus AS
WITH c AS (SELECT s.name, s.value FROM flow._counters() s),
series (family, kind, help, name_like, label, strip) AS (VALUES
    ('flow_attempts_total', 'counter', 'Attempts concluded, by outcome class.', 'attempts\_%', 'outcome', 10),
    ('flow_stops_total', 'counter', 'Commands that stopped for good, by reason (exhausted or permanent).', 'stops\_%', 'reason', 7),
    ('flow_runs_ended_total', 'counter', 'Runs that ended, by status.', 'runs\_%', 'status', 6)),
lines (family, ord, line) AS (
    SELECT s.family, 0, format('# HELP %s %s', s.family, s.help) FROM series s
    UNION ALL SELECT s.family, 1, format('# TYPE %s %s', s.family, s.kind) FROM series s
    UNION ALL SELECT s.family, 2, format('%s{%s="%s"} %s', s.family, s.label, substr(c.name, s.strip), c.value)
              FROM series s JOIN c ON c.name LIKE s.name_like
    UNION ALL SELECT 'flow_' || m.metric, 1, format('# TYPE flow_%s counter', m.metric)
              FROM (VALUES ('events_total'), ('claims_total'), ('claims_empty_total'), ('claimed_total'),
                           ('claim_seconds_total'), ('handler_seconds_total'), ('handed_back_total'),
                           ('recovered_total'), ('group_reruns_total'), ('pruned_runs_total'),
                           ('ticks_fired_total'), ('ticks_skipped_total'), ('rate_limited_total'), ('group_limited_total')) m(metric)
    UNION ALL SELECT 'flow_' || c.name || CASE WHEN c.name LIKE '%\_us' THEN '' ELSE '_total' END, 2,
              CASE WHEN c.name LIKE '%\_us'
                   THEN format('flow_%s_seconds_total %s', left(c.name, -3), round(c.value / 1e6, 6))
                   ELSE format('flow_%s_total %s', c.name, c.value) END
              FROM c WHERE c.name NOT LIKE 'attempts\_%' AND c.name NOT LIKE 'stops\_%' AND c.name NOT LIKE 'runs\_%'
    UNION ALL SELECT 'flow_workers', 1, '# TYPE flow_workers gauge'
    UNION ALL SELECT 'flow_workers', 2, format('flow_workers{state="%s"} %s', w.state, count(*))
              FROM flow._worker_rows() w GROUP BY w.state)
SELECT l.line FROM lines l ORDER BY replace(l.family, '_us', '_seconds_total'), l.ord, l.line;

-- Throughput and latency of attempts finished in the last minute, per definition.
CREATE OR REPLACE VIEW flow.recent_attempts WITH (security_barrier) AS
SELECT c.queue, c.name, count(*) AS attempts,
       round(count(*) / 60.0, 2) AS per_second,
       count(*) FILTER (WHERE a.outcome = 'succeeded') AS succeeded,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY a.finished_at - a.started_at) AS p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY a.finished_at - a.started_at) AS p99,
       max(a.finished_at - a.started_at) AS max
FROM (SELECT a.command_id, a.outcome, a.started_at, a.finished_at FROM flow._attempts a
      WHERE a.finished_at > now() - interval '1 minute'
      UNION ALL
      -- successes: their command rows (see sql/schema.sql, _attempts)
      SELECT s.id, 'succeeded', s.attempt_started_at, s.finished_at FROM flow._commands s
      WHERE s.status = 'succeeded' AND s.lease_token IS NOT NULL AND s.finished_at > now() - interval '1 minute') a
JOIN flow._commands c ON c.id = a.command_id
WHERE pg_has_role(current_user, c.owner, 'MEMBER')
GROUP BY c.queue, c.name;

-- ---------------------------------------------------------------- privileges

-- Internal functions are the extension owner's alone; flow._ticket must stay
-- callable by everyone because it runs in the caller's context.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = 'flow'::regnamespace AND p.proname LIKE '\_%'
               AND p.proname NOT IN ('_ticket', '_left_out', '_decide', '_worker_rows', '_held_rows', '_counters', '_args_misfit', '_among', '_lane', '_span_ok') LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END $$;
-- flow.run_sql runs any SQL as a definition's owner: a superuser grants it to
-- the roles that may schedule SQL of their own (pg_cron style).
REVOKE ALL ON FUNCTION flow.run_sql(jsonb) FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA flow FROM PUBLIC;
GRANT SELECT ON flow.runs, flow.commands, flow.attempts, flow.definitions, flow.queues, flow.queue_history, flow.events,
    flow.waits, flow.workers, flow.stats, flow.prometheus, flow.recent_attempts, flow.schedules TO PUBLIC;

-- ---------------------------------------------------------------- the hot path
-- The functions of the claim, settlement, recovery and retention paths (the
-- workers' and external claims' own) run with the planner settings that
-- sql/common.sql's header explains: plans pinned to index scans, from 0 to
-- 10M rows. One list, here; pg_test/test_sources.py fails when a function
-- the engine calls from Rust is not on it.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = 'flow'::regnamespace
               AND p.proname = ANY (ARRAY['_claim', '_lease', '_next_due_ms', '_run_row_needed', '_leased',
                   '_prepare_external_claim', '_complete_many', '_recover', '_prune', '_retire_events',
                   '_lock_runs', '_lock_runs_of', '_try_lock_run_of', '_close_open_commands', '_conclude_record',
                   '_expire_runs', '_conclude_expired_lease', '_gone_workers',
                   '_release', '_void_held', '_settle_batch', '_settle_failure', '_lock_run_and_commands',
                   '_promote_if_satisfied', '_fire_schedules', '_next_tick_ms', '_fold_priority_notes',
                   '_retire_priorities', '_renote_stranded_priorities']) LOOP
        EXECUTE format('ALTER FUNCTION %s SET enable_seqscan = off SET enable_bitmapscan = off'
                       ' SET enable_hashjoin = off SET enable_mergejoin = off SET jit = off', f);
    END LOOP;
END $$;
