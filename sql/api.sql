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
CREATE FUNCTION flow.define(name text, handler regprocedure, version integer DEFAULT 1,
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
CREATE FUNCTION flow.set_queue(name text, concurrency integer DEFAULT flow._left_out('concurrency')::integer,
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
CREATE FUNCTION flow.drop_queue(name text, caller_ticket bigint DEFAULT flow._ticket())
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._drop_queue(flow._redeem(caller_ticket), name);
END $$;

-- Let `role` ('PUBLIC' for everyone) start commands of a definition you own,
-- every version of it; by default only the owner's role and its members can.
CREATE FUNCTION flow.grant_definition(name text, role text, caller_ticket bigint DEFAULT flow._ticket())
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM flow._grant_definition(flow._redeem(caller_ticket), name, role, true);
END $$;

CREATE FUNCTION flow.revoke_definition(name text, role text, caller_ticket bigint DEFAULT flow._ticket())
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM flow._grant_definition(flow._redeem(caller_ticket), name, role, false);
END $$;

-- Let `role` ('PUBLIC' for everyone) define on, and enqueue into, a queue you own.
CREATE FUNCTION flow.grant_queue(name text, role text, caller_ticket bigint DEFAULT flow._ticket())
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM flow._grant_queue(flow._redeem(caller_ticket), name, role, true);
END $$;

CREATE FUNCTION flow.revoke_queue(name text, role text, caller_ticket bigint DEFAULT flow._ticket())
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM flow._grant_queue(flow._redeem(caller_ticket), name, role, false);
END $$;

-- ---------------------------------------------------------------- starting runs

-- Start a run of a definition; returns the run id (the same one again for the same key).
CREATE FUNCTION flow.enqueue(name text, args jsonb DEFAULT '{}', key text DEFAULT NULL,
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
CREATE FUNCTION flow.enqueue_many(name text, args_array jsonb[], version integer DEFAULT NULL,
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
CREATE FUNCTION flow.schedule(name text, cron text, definition text, args jsonb DEFAULT '{}',
    timezone text DEFAULT 'UTC', queue text DEFAULT NULL, overlap boolean DEFAULT true, catch_up integer DEFAULT 0,
    caller_ticket bigint DEFAULT flow._ticket())
RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._schedule(flow._redeem(caller_ticket), name, cron, definition, args, timezone, queue, overlap, catch_up);
END $$;

-- Delete your schedule `name` (its runs go on); false if you have none of that name.
CREATE FUNCTION flow.unschedule(name text, caller_ticket bigint DEFAULT flow._ticket())
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._unschedule(flow._redeem(caller_ticket), name);
END $$;

-- Pause (or, with false, resume) your schedule `name`; false if you have none of that name.
CREATE FUNCTION flow.pause_schedule(name text, paused boolean DEFAULT true, caller_ticket bigint DEFAULT flow._ticket())
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._pause_schedule(flow._redeem(caller_ticket), name, paused);
END $$;

-- ---------------------------------------------------------------- run control

-- Cancel every unfinished command of a run; true if the run was still running.
CREATE FUNCTION flow.cancel(run_id uuid, caller_ticket bigint DEFAULT flow._ticket())
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._cancel(flow._redeem(caller_ticket), run_id);
END $$;

-- Re-drive a failed or cancelled run: its failed and cancelled commands run
-- again with a fresh attempt budget; false if the run is not failed or cancelled.
CREATE FUNCTION flow.retry(run_id uuid, caller_ticket bigint DEFAULT flow._ticket())
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._retry(flow._redeem(caller_ticket), run_id);
END $$;

-- Wait until a run is terminal (or the timeout passes) and return its outcome.
CREATE FUNCTION flow.await(run_id uuid, timeout interval DEFAULT '30 seconds',
    caller_ticket bigint DEFAULT flow._ticket())
RETURNS flow.run_outcome
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._await(flow._redeem(caller_ticket), run_id, timeout);
END $$;

-- ---------------------------------------------------------------- events and children

-- Append an event to the journal (inside a handler: only if its attempt succeeds).
CREATE FUNCTION flow.emit(name text, key text, payload jsonb DEFAULT '{}',
    caller_ticket bigint DEFAULT flow._ticket())
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._emit(flow._redeem(caller_ticket), flow._current_command(), name, key, payload);
END $$;

-- A wait on the event (name, key), for flow.spawn(waits => ...).
CREATE FUNCTION flow.wait(name text, key text) RETURNS flow.wait_spec
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT ROW(name, key)::flow.wait_spec
$$;

-- Inside a handler: add a child command to the current run.
CREATE FUNCTION flow.spawn(name text, args jsonb DEFAULT '{}', key text DEFAULT NULL,
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
CREATE FUNCTION flow.spawn_many(name text, args_array jsonb[], keys text[],
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
CREATE FUNCTION flow.run_graph(run_id uuid, format text DEFAULT 'dot', caller_ticket bigint DEFAULT flow._ticket())
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
CREATE FUNCTION flow.fail(message text, keep_writes boolean DEFAULT false) RETURNS void
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
CREATE FUNCTION flow.retry_after(delay interval, message text DEFAULT 'retry requested by its handler')
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
CREATE FUNCTION flow.claim(names text[], worker text, max integer DEFAULT 1, lease interval DEFAULT NULL,
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
CREATE FUNCTION flow.heartbeat(command_id uuid, lease_token uuid, extend interval DEFAULT NULL,
    caller_ticket bigint DEFAULT flow._ticket())
RETURNS TABLE (lease_expires_at timestamptz, cancelled boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN QUERY SELECT * FROM flow._heartbeat(flow._redeem(caller_ticket), command_id, lease_token, extend);
END $$;

-- What became of an attempt: 'held', 'expired', or 'concluded' with its
-- outcome (for a worker that lost a reply and must know whether it still owns it).
CREATE FUNCTION flow.resolve(command_id uuid, lease_token uuid, caller_ticket bigint DEFAULT flow._ticket())
RETURNS TABLE (state text, outcome text, lease_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN QUERY SELECT * FROM flow._resolve(flow._redeem(caller_ticket), command_id, lease_token);
END $$;

-- Settle success, with events [{name, key, payload}] and children
-- [{name, args, key, start_after, waits: [{name, key}], within, version, queue}].
CREATE FUNCTION flow.complete(command_id uuid, lease_token uuid, result jsonb DEFAULT NULL,
    events jsonb DEFAULT NULL, children jsonb DEFAULT NULL, caller_ticket bigint DEFAULT flow._ticket())
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._complete(flow._redeem(caller_ticket), command_id, lease_token, result, events, children);
END $$;

-- Settle many successes (results only) in one call: one status per command,
-- 'succeeded', 'lease_lost' (nothing changed for it) or 'already_completed'.
CREATE FUNCTION flow.complete_many(command_ids uuid[], lease_tokens uuid[], results jsonb[] DEFAULT NULL,
    caller_ticket bigint DEFAULT flow._ticket())
RETURNS TABLE (command_id uuid, status text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN QUERY SELECT * FROM flow._complete_many(flow._redeem(caller_ticket), command_ids, lease_tokens, results);
END $$;

-- Settle failure: retried per the definition's policy, after retry_after when
-- given, or never when permanent. Returns 'retry' or 'failed'.
CREATE FUNCTION flow.fail(command_id uuid, lease_token uuid, message text, retry_after interval DEFAULT NULL,
    permanent boolean DEFAULT false, code text DEFAULT NULL, caller_ticket bigint DEFAULT flow._ticket())
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN flow._fail_external(flow._redeem(caller_ticket), command_id, lease_token, message, retry_after,
                               permanent, code);
END $$;

-- ---------------------------------------------------------------- views

-- Runs the current role may see: its own, or those of roles it is a member of.
CREATE VIEW flow.runs WITH (security_barrier) AS
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
CREATE FUNCTION flow._worker_rows(caller_ticket bigint DEFAULT flow._ticket())
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
CREATE FUNCTION flow._held_rows(caller_ticket bigint DEFAULT flow._ticket())
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
CREATE VIEW flow._held_attempts AS
SELECT c.id AS command_id, c.attempts + 1 AS attempt, format('%s:%s', current_database(), w.pid) AS owner,
       w.since AS started_at
FROM flow._held_rows() w JOIN flow._commands c ON c.id = w.command_id
WHERE c.status IN ('pending', 'waiting');

CREATE VIEW flow.commands WITH (security_barrier) AS
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
CREATE VIEW flow.attempts WITH (security_barrier) AS
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

CREATE VIEW flow.definitions WITH (security_barrier) AS
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
CREATE VIEW flow.queues WITH (security_barrier) AS
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
CREATE VIEW flow.queue_history WITH (security_barrier) AS
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
CREATE VIEW flow.events WITH (security_barrier) AS
SELECT e.position, e.id, e.name, e.key, e.payload, e.emitted_at, e.run_id, e.command_id,
       e.owner::regrole AS owner,
       coalesce((SELECT array_agg(w.command_id ORDER BY w.command_id) FROM flow._waits w
                 WHERE w.event_position = e.position), '{}') AS satisfied_waits
FROM flow._events e
WHERE pg_has_role(current_user, e.owner, 'MEMBER');

CREATE VIEW flow.waits WITH (security_barrier) AS
SELECT w.command_id, c.run_id, w.name, w.key, w.event_position, w.satisfied_at
FROM flow._waits w JOIN flow._command_rows c ON c.id = w.command_id
WHERE pg_has_role(current_user, c.owner, 'MEMBER');

-- What each in-database worker is doing now (shared memory); another role's
-- command is not named (flow._worker_rows).
CREATE VIEW flow.workers AS
SELECT w.worker, w.pid, w.state, w.command_id, w.since, w.handled
FROM flow._worker_rows() w;

-- Your schedules (those of roles you are a member of).
CREATE VIEW flow.schedules WITH (security_barrier) AS
SELECT s.name, s.cron, s.timezone, s.definition, s.args, s.queue, s.paused, s.next_tick, s.last_tick,
       s.last_run_id, s.owner::regrole AS owner, s.overlap, s.catch_up
FROM flow._schedules s
WHERE pg_has_role(current_user, s.owner, 'MEMBER');

-- Engine counters since the server started (shared memory), plus recent attempts.
CREATE VIEW flow.stats AS
SELECT s.name, s.value FROM flow._counters() s;

-- The counters in Prometheus' text format, one line a row: an exporter (or
-- `psql -At -c 'SELECT line FROM flow.prometheus'`) serves it as it is.
CREATE VIEW flow.prometheus AS
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
CREATE VIEW flow.recent_attempts WITH (security_barrier) AS
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
