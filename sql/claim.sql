-- Claim: handing due commands to in-database and external workers (rules 1-3).

-- Retry delay: exponential from `backoff`, jittered by ±25 %, kept within
-- [backoff, backoff_max]; at the cap it is jittered too, within [75 %, 100 %]
-- of backoff_max (clamped after the jitter, every retry at the cap landed on
-- backoff_max itself, all at once). Computed in seconds so huge attempt
-- numbers cannot overflow an interval.
CREATE FUNCTION flow._backoff(backoff interval, backoff_max interval, attempt integer) RETURNS interval
LANGUAGE sql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
    SELECT make_interval(secs => greatest(extract(epoch FROM backoff),
        least(extract(epoch FROM backoff_max) * (0.75 + random() * 0.25),
              extract(epoch FROM backoff) * power(2, least(greatest(attempt - 1, 0), 60))
                  * (0.75 + random() * 0.5)))::double precision)
$$;

-- A group key's hash, as _commands.group_hash keeps it: 0 for none, else
-- positive (flow._groups_of reads a lane's groups after 0).
CREATE FUNCTION flow._group_hash(group_key text) RETURNS bigint
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
CREATE FUNCTION flow._groups_of(queue text, lane bigint, priority smallint, from_hash bigint, max_groups integer)
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
CREATE FUNCTION flow._claim_ranges(queue text, lane bigint, priorities smallint[], grouped_priorities smallint[],
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
CREATE FUNCTION flow._claim(max_count integer, names text[], turn integer,
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
CREATE FUNCTION flow._lease(owner_name text, owner_pid integer, owner_started timestamptz, lease interval,
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
CREATE FUNCTION flow._next_due_ms(after_queues text[], after_priorities smallint[], after_at timestamptz[],
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
