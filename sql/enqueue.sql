-- Enqueue: starting runs (one, or many in one statement).

-- What enqueue, enqueue_many and spawn share: resolve the definition (its
-- newest version unless one is named), check that the caller may start it,
-- the schedule and the queue. The checks are inline, and the definition
-- comes back as scalars: each nested PL/pgSQL call, and a composite passed
-- or returned above all, costs microseconds, and a single flow.enqueue was
-- half such calls.
CREATE FUNCTION flow._plan_enqueue(caller oid, name text, version integer, queue text, start_after interval,
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
CREATE FUNCTION flow._priority(given integer, otherwise smallint) RETURNS smallint
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
CREATE FUNCTION flow._group_key_ok(group_key text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT group_key IS NULL OR (btrim(group_key) <> '' AND flow._short_enough(group_key))
$$;

CREATE FUNCTION flow._require_group(what text, group_key text) RETURNS text
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
CREATE FUNCTION flow._require_group_keys(group_key text, group_keys text[], count integer, counted text)
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
CREATE FUNCTION flow._note_priority(queue text, priority smallint, grouped boolean) RETURNS void
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
CREATE FUNCTION flow._fold_priority_notes(only_queue text DEFAULT NULL) RETURNS integer
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
CREATE FUNCTION flow._retire_priorities(after text, OUT queue text, OUT changed boolean)
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
CREATE FUNCTION flow._renote_stranded_priorities() RETURNS integer
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
CREATE FUNCTION flow._priority_in_use(queue text, priority smallint, grouped boolean) RETURNS boolean
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
CREATE FUNCTION flow._insert_roots(owner oid, name text, version integer, external boolean, lane text,
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

CREATE FUNCTION flow._enqueue(caller oid, name text, args jsonb, key text, version integer, queue text,
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
CREATE FUNCTION flow._enqueue_many(caller oid, name text, args_array jsonb[], version integer, queue text,
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
