-- flow's schema: tables, types, indexes and the engine's SQL.
--
-- Everything here runs as the extension owner (a superuser). Ordinary roles get
-- no privileges on the tables; they act through the functions below, which are
-- SECURITY DEFINER with a pinned search_path, and read through views that show
-- each role only its own rows.
--
-- Error codes (SQLSTATE class FL, see README "Errors"):
--   FL001 unknown definition or version       FL010 run key reused with another declaration
--   FL002 NULL or empty name                  FL011 not the owner
--   FL003 args/payload not a JSON object      FL012 needs a running handler
--   FL004 payload over flow.max_result_bytes  FL013 lease lost or token wrong
--   FL005 negative or zero delay              FL014 unknown run or command
--   FL006 run_at together with start_after    FL015 invalid retry policy
--   FL007 deadline already passed             FL016 invalid decision (conflicting spawn)
--   FL008 handler has the wrong signature     FL020 flow.fail(): permanent failure
--   FL009 queue concurrency below 1           FL021 flow.retry_after(): retry later
--   FL017 settled already under this lease (double completion)
--   FL018 the role owns flow.max_queues_per_role queues already
--   FL019 args do not fit the definition's args_type
--   FL022 invalid cron expression             FL023 unknown time zone

-- ---------------------------------------------------------------- types

CREATE TYPE flow.run_status AS ENUM ('running', 'succeeded', 'failed', 'cancelled');

CREATE TYPE flow.command_status AS ENUM
    ('pending', 'waiting', 'running', 'succeeded', 'failed', 'cancelled', 'expired');

-- What a handler receives as its optional second argument.
CREATE TYPE flow.context AS (
    run_id          uuid,
    run_key         text,
    command_id      uuid,
    command_key     text,
    name            text,
    version         integer,
    queue           text,
    attempt         integer,
    deadline        timestamptz,    -- when this attempt is cut off (the deadline actually enforced)
    inputs          jsonb,          -- {"event_name/key": payload, ...} of satisfied waits
    wait_timed_out  boolean,        -- true when `within` passed before every wait was met
    missing         jsonb,          -- [{"name":..,"key":..}] waits that never arrived
    created_at      timestamptz,    -- when the command was enqueued or spawned
    budget_started_at timestamptz,  -- max_elapsed counts from here (when it first became due)
    attempt_started_at timestamptz  -- when this attempt's handler started
);

-- An event a spawned command waits for; built by flow.wait(name, key).
CREATE TYPE flow.wait_spec AS (name text, key text);

-- One due command claimed by flow._claim, locked, for a worker (in-database
-- or external). Its lease, if it is leased, is written by flow._lease.
CREATE TYPE flow.claimed_command AS (
    command_id        uuid,
    run_id            uuid,
    name              text,
    version           integer,
    queue             text,
    args              jsonb,
    attempt           integer,        -- the attempt it makes (no lease: see flow._lease)
    deadline          timestamptz,    -- the attempt's deadline, if it started now
    handler           oid,
    handler_owner     oid,
    context           flow.context,
    -- for in-database workers, which may start a claimed command a while after
    -- the claim: the attempt deadline is min(start + attempt_timeout, hard_deadline)
    attempt_timeout   interval,
    hard_deadline     timestamptz,    -- min(retry budget end, run deadline)
    claim_order       integer,        -- NULL from a claim of one queue: the rows come in due order;
                                      -- 0 from a claim of several: its caller interleaves them (lane_order)
    args_type         regtype,        -- the definition's args_type: checked before the handler runs
    due_at            timestamptz,    -- its next_run_at when claimed: where the next claim may start
    row_at            tid,            -- its row, locked by the claim: where its lease or its settlement writes
    held              boolean,        -- held (run and settled in the claim's transaction), not leased
    lane_order        integer,        -- its queue's place in the claim's round-robin turn
    lane_room         integer,        -- how many its queue may start (a limited queue's free concurrency)
    priority          smallint,       -- its priority (lower runs first): where the next claim may start, with due_at
    group_hash        bigint          -- its group's hash, 0 for none: a grouped command moves no claim cursor
                                      -- (those are of the ungrouped, see flow._claim)
);

-- What flow.await returns.
CREATE TYPE flow.run_outcome AS (status flow.run_status, result jsonb, error jsonb);

-- ---------------------------------------------------------------- tables

-- Whether an interval is a duration flow may keep: no field negative, some
-- positive unless zero_ok, at most 100 years (src/spans.rs; sql/definitions.sql,
-- _require_span). Declared here, before the functions pgrx writes: the
-- tables' CHECKs below hold every stored duration to it, so no timestamp
-- arithmetic on a row can overflow.
CREATE FUNCTION flow._span_ok(span interval, zero_ok boolean)
RETURNS boolean LANGUAGE c IMMUTABLE STRICT PARALLEL SAFE AS 'MODULE_PATHNAME', '_span_ok_wrapper';

-- Queues are owned like tables: the role that first uses a name owns it and
-- may pause, limit and share it; others put commands in it only when granted.
-- The 'default' queue has no owner (only superusers manage it) and is open to all.
CREATE TABLE flow._queues (
    name         text PRIMARY KEY CHECK (name <> ''),
    concurrency  integer CHECK (concurrency >= 1),   -- NULL: no limit of its own
    paused       boolean NOT NULL DEFAULT false,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    owner        regrole,                            -- NULL: the extension's (superusers)
    users        regrole[] NOT NULL DEFAULT '{}',    -- granted to put commands in it ('-': PUBLIC)
    -- at most `rate` of its commands start per `per` (NULL: no limit; 0: none
    -- start), counted in shared memory (src/rate_limits.rs)
    rate         integer CHECK (rate >= 0),
    per          interval NOT NULL DEFAULT '1 second' CHECK (flow._span_ok(per, false)),
    group_concurrency integer CHECK (group_concurrency >= 1),  -- at most this many of one group run at once
    -- The priorities its commands were given, in claim order, 0 always
    -- among them, and those whose commands had groups (flow._note_priority):
    -- what a claim of the queue reads (flow._claim), from the queue's row
    -- its claim reads anyway: a queue that never had either costs a claim
    -- no probe for them. Forgotten once no unfinished command has them
    -- (flow._retire_priorities); until then a priority no longer used costs
    -- each claim of its queue one empty index probe.
    priorities   smallint[] NOT NULL DEFAULT '{0}' CHECK (0 = ANY (priorities)),
    grouped_priorities smallint[] NOT NULL DEFAULT '{}'
);

-- Priorities (and groups) enqueues and spawns noted for a queue that its
-- row does not have yet (flow._note_priority), until the maintenance worker
-- adds them to it (flow._fold_priority_notes). Noted here, not in the
-- queue's row: a transaction that wrote that row would hold it until its
-- end, and every other role's first command of another new priority in the
-- same shared queue would wait for it. (No unique key either, for the same
-- reason: an insert of a key another open transaction inserted waits for it.)
CREATE TABLE flow._priority_notes (
    queue    text NOT NULL,
    priority smallint NOT NULL,
    grouped  boolean NOT NULL
);
CREATE INDEX _priority_notes_queue ON flow._priority_notes (queue, priority);

-- Definition names are owned: the first role to define a name owns every
-- version of it, and only its members (and roles it grants) start its commands.
-- Defining locks the name's row first, so two roles can never race for it.
CREATE TABLE flow._definition_names (
    name      text PRIMARY KEY CHECK (name <> ''),
    owner     regrole NOT NULL,
    starters  regrole[] NOT NULL DEFAULT '{}'        -- granted to start its commands ('-': PUBLIC)
);

CREATE TABLE flow._definitions (
    name           text NOT NULL CHECK (name <> ''),
    version        integer NOT NULL CHECK (version >= 1),
    handler        regprocedure,                      -- NULL: external workers resolve it
    takes_context  boolean NOT NULL DEFAULT false,
    owner          regrole NOT NULL,     -- regrole: pg_dump writes the role's name, not its OID
    queue          text NOT NULL REFERENCES flow._queues (name),
    max_attempts   integer NOT NULL CHECK (max_attempts >= 1),
    backoff        interval NOT NULL CHECK (flow._span_ok(backoff, false)),
    backoff_max    interval NOT NULL CHECK (flow._span_ok(backoff_max, false)),
    max_elapsed    interval CHECK (flow._span_ok(max_elapsed, false)),
    timeout        interval CHECK (flow._span_ok(timeout, false)),
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    args_type      regtype,                           -- what args must fit (NULL: any JSON object)
    priority       smallint NOT NULL DEFAULT 0,       -- its commands' priority, unless an enqueue or spawn gives one
    PRIMARY KEY (name, version),
    FOREIGN KEY (name) REFERENCES flow._definition_names (name),   -- owner equals the name's owner
    CHECK (backoff_max >= backoff),
    CHECK (handler IS NOT NULL OR NOT takes_context)
);

-- Runs, commands, attempts and waits carry no foreign keys: each would cost
-- every enqueue and settlement a row lock on the referenced row (a
-- definition row locked by every concurrent enqueuer turns into multixacts).
-- Their references hold by construction: rows are written only by flow's
-- functions, which resolve definitions and queues first; definitions are
-- never deleted, and flow.drop_queue drops only a queue no definition and no
-- unfinished command uses (enqueue and define hold a queue they name
-- explicitly FOR KEY SHARE meanwhile); flow._prune deletes a
-- run with its commands, attempts and waits in one statement.
-- Not every run has a row here: a run is its root command (same id) until
-- it needs more than the root can say. A run gets its row when it is
-- enqueued with a key (the key is unique here), when its root spawns its
-- first child, when it ends otherwise than by its root's success (a
-- failure, a cancel: flow._run_row_needed), and when an in-database worker
-- leases its root (flow._lease), always under its root's row lock. A run of one command that
-- succeeds (the common run) is one row, inserted once, written once more by
-- its settlement, deleted once. Runs started before 0.2.0 all have a row
-- (their roots have ids of their own). Read runs through flow._run_rows;
-- "the run's lock" of a run without a row is its root's row lock
-- (flow._lock_runs).
CREATE TABLE flow._runs (
    id           uuid PRIMARY KEY,
    key          text CHECK (key <> ''),
    owner        regrole NOT NULL,
    name         text NOT NULL,
    version      integer NOT NULL,
    queue        text NOT NULL,
    args         jsonb NOT NULL,
    status       flow.run_status NOT NULL DEFAULT 'running',   -- as written: read runs through flow._run_rows
    result       jsonb,
    error        jsonb,                  -- {"command":..,"code":..,"message":..} when failed
    deadline     timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz,
    CHECK ((status = 'running') = (finished_at IS NULL)),
    CHECK (status = 'succeeded' OR result IS NULL)
) WITH (fillfactor = 70);   -- room for the one HOT update of a run that ends apart from its root (no indexed column changes)
-- Run keys are unique per owner (flow.enqueue's idempotency). Only keyed runs
-- have an entry: most runs have no key, and an entry per run was a fifth of
-- the index work of an enqueue_many.
CREATE UNIQUE INDEX _runs_owner_key ON flow._runs (owner, key) WHERE key IS NOT NULL;

-- The invariants of a command row, for its CHECK below: one call of a C
-- function, not nine SQL expressions, which PostgreSQL prepared anew for every
-- statement writing the table, about 25 us each single-row insert or update
-- (src/invariants.rs). Declared here, before the functions pgrx writes.
CREATE FUNCTION flow._command_row_is_consistent(status text, attempts integer, stop_reason text,
    finished boolean, lease_token boolean, lease_expires boolean, attempt_started boolean, lease_pid boolean,
    result boolean)
RETURNS boolean LANGUAGE c IMMUTABLE PARALLEL SAFE AS 'MODULE_PATHNAME', '_command_row_is_consistent_wrapper';

CREATE TABLE flow._commands (
    -- (half-filled leaves: a settlement cannot be HOT, so it adds a second
    -- entry for its command's id beside the first, and finds room for it
    -- there instead of splitting the page or first trying to delete older
    -- entries that are still visible: 4-5 % of a no-op drain's CPU)
    id                uuid PRIMARY KEY WITH (fillfactor = 50),
    run_id            uuid NOT NULL,
    parent_id         uuid,
    key               text NOT NULL CHECK (key <> ''),
    name              text NOT NULL,
    version           integer NOT NULL,
    queue             text NOT NULL,
    args              jsonb NOT NULL,
    declaration       jsonb NOT NULL,     -- what a re-spawn of the same key must match ('{}' for roots)
    status            flow.command_status NOT NULL,
    next_run_at       timestamptz NOT NULL,  -- pending: due time; waiting: end of `within`
    not_before        timestamptz NOT NULL,  -- start_after, kept while waiting
    budget_started_at timestamptz NOT NULL,  -- max_elapsed counts from here
    deadline          timestamptz,           -- the run's deadline, copied for the claim path
    attempts          integer NOT NULL DEFAULT 0,
    -- the live lease (status = 'running'); a succeeded command keeps the
    -- token, owner and start of its successful attempt (see _attempts)
    attempt_started_at timestamptz,
    lease_token       uuid,
    lease_owner       text,
    lease_pid         integer,              -- set for in-database workers
    lease_backend_start timestamptz,        -- with lease_pid, proves the owner is alive
    lease_expires_at  timestamptz,
    attempt_deadline  timestamptz,
    -- outcome
    result            jsonb,
    last_error_code   text,
    last_error_message text,
    stop_reason       text,    -- permanent, attempt_limit, elapsed_limit, deadline_before_next_attempt, cancelled, run_failed, deadline
    wait_timed_out    boolean NOT NULL DEFAULT false,
    created_at        timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz,
    lease_interval    interval,              -- an external lease's length: what a heartbeat extends by
    external          boolean NOT NULL DEFAULT false,  -- its definition has no handler: external workers run it
    owner             regrole NOT NULL,      -- its run's owner (who started the run), for who may see it
    -- attempts before its last re-drive (flow.retry): max_attempts and the
    -- backoff count the attempts after it; attempt numbers go on
    attempt_base      integer NOT NULL DEFAULT 0,
    priority          smallint NOT NULL DEFAULT 0,   -- lower runs first within its queue (see flow._claim)
    -- its group in its queue (NULL: none): claims go round-robin over a
    -- queue's groups, and group_concurrency holds per group; group_hash
    -- (flow._group_hash: 0 for none) is what the indexes and claims use
    group_key         text CHECK (group_key <> '' AND octet_length(group_key) <= 1024),
    group_hash        bigint NOT NULL DEFAULT 0,
    -- state, lease, attempt and outcome agree (the rules: src/invariants.rs)
    CONSTRAINT _commands_state CHECK (flow._command_row_is_consistent(status::text, attempts, stop_reason,
        finished_at IS NOT NULL, lease_token IS NOT NULL, lease_expires_at IS NOT NULL,
        attempt_started_at IS NOT NULL, lease_pid IS NOT NULL, result IS NOT NULL))
);
-- A run's root command has the run's id (key 'root'): it is found by the
-- primary key. Keys are unique within a run among the others, the commands
-- spawned in it (and the roots of runs 0.1.0 started, which have ids of their
-- own). So a run of one command has two index entries here, not three, and
-- its settlement (an update that cannot be HOT: status is in the partial
-- indexes) inserts one, not two. flow._commands_of finds a run's commands.
CREATE UNIQUE INDEX _commands_run_key ON flow._commands (run_id, key) WHERE id <> run_id;
-- The claim path: due commands of one lane in (next_run_at, id) order. A
-- lane is a queue and who claims from it: in-database workers ('') or the
-- external workers of one definition (its name: external workers claim by
-- definition name; a name is never empty), so no kind's or definition's
-- backlog is in another's way. The index keys a lane by a 64-bit hash of the
-- two (flow._lane), not by the texts: every key column is then of fixed
-- width, which makes each comparison of an insert's or a scan's descent
-- cheap (with a text first, every column after it is found by walking the
-- tuple: an enqueue of 1,000 spent 1.8 us per run in this index, 0.9 now).
-- Statements that read it compare the lane's hash and then its queue and
-- claimant themselves (a hash is no proof), written out the same in each
-- (flow._claim, flow._next_due_ms; flow.queues and flow._drop_queue read a
-- queue's lanes from flow._queue_lanes).
-- (Executable by everyone: the flow.queues view calls it as its reader; it
-- reads nothing.)
CREATE FUNCTION flow._lane(queue text, claimant text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pg_catalog.hashtextextended(claimant, pg_catalog.hashtextextended(queue, 0))
$$;
-- Within a lane, by priority, then group (0: none), then due time: a claim
-- reads each priority's due range in turn, and in it each group's
-- (flow._claim, flow._groups_of). Every key column is of fixed width.
CREATE INDEX _commands_due ON flow._commands
    (flow._lane(queue, CASE WHEN external THEN name ELSE '' END), priority, group_hash, next_run_at, id)
    WHERE status IN ('pending', 'waiting');
-- Concurrency accounting and recovery of dead owners.
-- (lease_expires_at: an external claim finds the expired leases it must
-- conclude first without walking every running command)
CREATE INDEX _commands_running ON flow._commands (queue, lease_expires_at) WHERE status = 'running';
-- The heads of a lane's grouped commands, whatever the group: a claim
-- learns whether a queue's groups have due work with one probe.
CREATE INDEX _commands_due_grouped ON flow._commands
    (flow._lane(queue, CASE WHEN external THEN name ELSE '' END), priority, next_run_at)
    WHERE status IN ('pending', 'waiting') AND group_hash <> 0;
-- (a group's running commands, for group_concurrency)
CREATE INDEX _commands_group_running ON flow._commands (queue, group_hash) WHERE status = 'running' AND group_hash <> 0;
CREATE INDEX _commands_parent ON flow._commands (parent_id) WHERE parent_id IS NOT NULL;
-- A run's unfinished children: a settlement learns whether its run has
-- any left with one probe (flow._settle_batch). Not deduplicated: a run's
-- entries in one posting list could not be marked dead until all its children
-- had finished, and each probe read the finished ones again. (The
-- predicate names parent_id, not id <> run_id, so that _commands_run_key,
-- whose cost ties with it, cannot serve the probe: the planner keeps the
-- first index of a tie.)
CREATE INDEX _commands_open_children ON flow._commands (run_id) WITH (deduplicate_items = off)
    WHERE finished_at IS NULL AND parent_id IS NOT NULL;
-- (the maintenance worker's look for runs past their deadline: flow._expire_runs)
CREATE INDEX _commands_deadline ON flow._commands (deadline) WHERE finished_at IS NULL AND deadline IS NOT NULL;

-- One row per finished attempt, but for a success: a succeeded command keeps
-- its successful attempt on its own row (lease_token, lease_owner,
-- attempt_started_at, finished_at; the views show it as an attempt), which
-- spares every success a row and an index entry here. (Successes settled by
-- 0.1.0 have their row here, and no lease_token on the command.) The live
-- attempt is on the command row too.
CREATE TABLE flow._attempts (
    command_id   uuid NOT NULL,
    attempt      integer NOT NULL CHECK (attempt >= 1),
    lease_token  uuid NOT NULL,
    owner        text NOT NULL,
    started_at   timestamptz NOT NULL,
    finished_at  timestamptz NOT NULL,
    outcome      text NOT NULL CHECK (outcome IN ('succeeded', 'permanent', 'retry_after', 'timeout',
                     'interrupted', 'lease_lost', 'crash', 'retryable', 'cancelled', 'expired', 'voided')),
    error_code   text,
    error_message text CHECK (octet_length(error_message) <= 1024),
    PRIMARY KEY (command_id, attempt),
    CHECK (finished_at >= started_at)
);

-- The append-only event journal.
CREATE TABLE flow._events (
    position    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id          uuid NOT NULL UNIQUE,
    name        text NOT NULL CHECK (name <> ''),
    key         text NOT NULL,
    payload     jsonb NOT NULL,
    owner       regrole NOT NULL,
    run_id      uuid,           -- set when a handler emitted it
    command_id  uuid,
    emitted_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX _events_name_key ON flow._events (name, key, position);

CREATE TABLE flow._waits (
    command_id      uuid NOT NULL,
    name            text NOT NULL,
    key             text NOT NULL,
    event_position  bigint REFERENCES flow._events (position),
    satisfied_at    timestamptz,
    PRIMARY KEY (command_id, name, key),
    CHECK ((event_position IS NULL) = (satisfied_at IS NULL))
);
CREATE INDEX _waits_open ON flow._waits (name, key) WHERE event_position IS NULL;
-- The waits an event satisfied: event retention keeps the events a wait
-- refers to, and the foreign key's check on each deletion looks for them
-- (without it, a pass of flow._retire_events read all of _waits per event:
-- 153 s for 5,000 events beside 300,000 waits).
CREATE INDEX _waits_event ON flow._waits (event_position) WHERE event_position IS NOT NULL;

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

-- Every command leaves dead row versions behind (claim, settlement, pruning):
-- autovacuum visits the busy tables after 2 % of their rows changed, not 20 %,
-- and unthrottled, so their sizes level off under a steady flow of work.
ALTER TABLE flow._runs SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0);
ALTER TABLE flow._commands SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0);
ALTER TABLE flow._attempts SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0);
-- A handful of rows, read by every view of queues: analyzed after any change,
-- so the planner does not take it for hundreds of rows (and compile flow.queues
-- with JIT).
ALTER TABLE flow._queues SET (autovacuum_analyze_threshold = 0, autovacuum_analyze_scale_factor = 0);

-- The journal is append-only, even for the extension owner's own code paths.
-- (flow._retire_events alone may delete old entries no wait refers to, under
-- flow.event_retention; REASSIGN OWNED, flow._reassign_owned, alone may give
-- an entry another owner, and change nothing else of it.)
CREATE FUNCTION flow._journal_is_append_only() RETURNS trigger
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
CREATE TRIGGER _events_append_only BEFORE UPDATE OR DELETE ON flow._events
    FOR EACH ROW EXECUTE FUNCTION flow._journal_is_append_only();

REVOKE ALL ON ALL TABLES IN SCHEMA flow FROM PUBLIC;
GRANT USAGE ON SCHEMA flow TO PUBLIC;

-- ---------------------------------------------------------------- backups
-- pg_dump skips the rows of an extension's tables unless they are marked as
-- configuration: these hold the users' definitions, queues, runs and journal,
-- so all of them are dumped, with the journal's position sequence. Owners are
-- regrole and handlers regprocedure, so a dump names roles and functions and a
-- restore into another cluster resolves them again.
SELECT pg_catalog.pg_extension_config_dump('flow._queues', '');
SELECT pg_catalog.pg_extension_config_dump('flow._definition_names', '');
SELECT pg_catalog.pg_extension_config_dump('flow._definitions', '');
SELECT pg_catalog.pg_extension_config_dump('flow._runs', '');
SELECT pg_catalog.pg_extension_config_dump('flow._commands', '');
SELECT pg_catalog.pg_extension_config_dump('flow._attempts', '');
SELECT pg_catalog.pg_extension_config_dump('flow._events', '');
SELECT pg_catalog.pg_extension_config_dump('flow._events_position_seq', '');
SELECT pg_catalog.pg_extension_config_dump('flow._waits', '');
SELECT pg_catalog.pg_extension_config_dump('flow._schedules', '');
SELECT pg_catalog.pg_extension_config_dump('flow._priority_notes', '');
