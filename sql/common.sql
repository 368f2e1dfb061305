-- flow's engine SQL, one file per service (sql/common.sql first, then
-- definitions, enqueue, claim, settle, recover, retention, workflows,
-- external; src/lib.rs loads them in that order). This one: what they share.
--
-- The conventions every engine statement follows (function security,
-- search_path pinning, the hot path's planner settings, status-as-text
-- lookups, `= ANY (ARRAY[...])` joins, tid joins) are in docs/DESIGN.md,
-- section 5, each with the measurement that made it one.

CREATE FUNCTION flow._require_name(what text, value text) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF value IS NULL OR btrim(value) = '' THEN
        RAISE EXCEPTION 'flow: % must not be NULL or empty', what USING ERRCODE = 'FL002';
    END IF;
    RETURN flow._require_short(what, value);
END $$;

-- Names and keys are indexed: at most 1 KiB of UTF-8 each (two fit in one index entry).
-- (inlined where it is called from SQL)
CREATE FUNCTION flow._short_enough(value text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT value IS NULL OR octet_length(value) <= 1024
$$;

CREATE FUNCTION flow._require_short(what text, value text) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF NOT flow._short_enough(value) THEN
        RAISE EXCEPTION 'flow: % is % bytes, over 1024', what, octet_length(value) USING ERRCODE = 'FL002';
    END IF;
    RETURN value;
END $$;

-- args and payloads: a JSON object within flow.max_result_bytes.
CREATE FUNCTION flow._require_payload(what text, value jsonb, must_be_object boolean DEFAULT true)
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

CREATE FUNCTION flow._require_member(caller oid, owner oid, what text, id uuid) RETURNS void
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
CREATE FUNCTION flow._budget_start(status flow.command_status, attempts integer, next_run_at timestamptz,
    budget_started_at timestamptz) RETURNS timestamptz
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN status = 'waiting' AND attempts = 0 THEN next_run_at ELSE budget_started_at END
$$;

CREATE FUNCTION flow._wait_timed_out(status flow.command_status, wait_timed_out boolean) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT wait_timed_out OR status = 'waiting'
$$;

-- All commands, in two parts the planner can find by run: roots made by
-- 0.2.0 on (id = run_id: a filter on run_id is one on the primary key too)
-- and the others (index _commands_run_key, whose predicate the second part
-- repeats as written). What reads commands by run reads them through this
-- (the views, and flow._commands_of), so "WHERE run_id = ..." never scans.
CREATE VIEW flow._command_rows AS
SELECT * FROM flow._commands c WHERE c.id = c.run_id
UNION ALL
SELECT * FROM flow._commands c WHERE c.id <> c.run_id;

-- The commands of a run, for the engine's own statements. (LANGUAGE sql,
-- STABLE, no SET clause: inlined into the statements that use it, as two
-- index scans.) Give it a parameter or a correlated outer value, never a
-- lateral join's column (FROM x, flow._commands_of(x.id)): there its filter
-- is a join clause, which the planner does not push into the view's two
-- parts, and all of _commands is read (see flow._prune).
CREATE FUNCTION flow._commands_of(run_id uuid) RETURNS SETOF flow._commands
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
CREATE VIEW flow._run_rows AS
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
CREATE VIEW flow._queue_lanes AS
SELECT q.name AS queue, flow._lane(q.name, n.claimant) AS lane
FROM flow._queues q
CROSS JOIN (SELECT '' UNION SELECT d.name FROM flow._definitions d WHERE d.handler IS NULL) n(claimant);

-- Give a run without a row its row (see flow._runs), as enqueue would have
-- written it, from its root; a run that has one keeps it. The caller holds
-- the root's row lock (the chunk or client running the root, a cancel or a
-- settlement that locked it), so two callers never insert it at once.
-- (flow._lease writes the same row for the roots it leases, in its statement.)
CREATE FUNCTION flow._run_row_needed(run_id uuid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO flow._runs (id, owner, name, version, queue, args, deadline, created_at)
    SELECT c.id, c.owner, c.name, c.version, c.queue, c.args, c.deadline, c.created_at
    FROM flow._commands c WHERE c.id = _run_row_needed.run_id
    ON CONFLICT (id) DO NOTHING;
END $$;
