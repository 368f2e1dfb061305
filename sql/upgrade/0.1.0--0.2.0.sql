-- Table and type changes from 0.1.0 to 0.2.0 (tools/upgrade_script.py puts
-- them before the functions and views of 0.2.0, which replace the old ones).

-- Owners are regrole, so pg_dump writes role names; the views that read them
-- are recreated below.
DROP VIEW flow.runs, flow.commands, flow.attempts, flow.definitions, flow.events, flow.waits,
    flow.recent_attempts, flow.queues, flow.workers;
ALTER TABLE flow._definitions ALTER COLUMN owner TYPE regrole;
ALTER TABLE flow._runs ALTER COLUMN owner TYPE regrole;
ALTER TABLE flow._events ALTER COLUMN owner TYPE regrole;

-- pg_dump keeps the rows of these tables (see sql/schema.sql, "backups").
SELECT pg_catalog.pg_extension_config_dump('flow._queues', '');
SELECT pg_catalog.pg_extension_config_dump('flow._definitions', '');
SELECT pg_catalog.pg_extension_config_dump('flow._runs', '');
SELECT pg_catalog.pg_extension_config_dump('flow._commands', '');
SELECT pg_catalog.pg_extension_config_dump('flow._attempts', '');
SELECT pg_catalog.pg_extension_config_dump('flow._events', '');
SELECT pg_catalog.pg_extension_config_dump('flow._events_position_seq', '');
SELECT pg_catalog.pg_extension_config_dump('flow._waits', '');

-- Owned queues and definition names (see sql/schema.sql). Queues of 0.1.0
-- were shared lanes: they stay shared, owned by no role (superusers manage
-- them) and open to everyone; new queues are owned by their creator.
ALTER TABLE flow._queues ADD COLUMN owner regrole, ADD COLUMN users regrole[] NOT NULL DEFAULT '{}';
UPDATE flow._queues q SET users = '{-}';
CREATE TABLE flow._definition_names (
    name      text PRIMARY KEY CHECK (name <> ''),
    owner     regrole NOT NULL,
    starters  regrole[] NOT NULL DEFAULT '{}'
);
INSERT INTO flow._definition_names (name, owner)
SELECT DISTINCT ON (d.name) d.name, d.owner FROM flow._definitions d ORDER BY d.name, d.version;
ALTER TABLE flow._definitions ADD CONSTRAINT _definitions_name_fkey
    FOREIGN KEY (name) REFERENCES flow._definition_names (name);
SELECT pg_catalog.pg_extension_config_dump('flow._definition_names', '');
-- Event keys are locked by a C function now (0.1.0 had an SQL one).
DROP FUNCTION flow._lock_event_key(text, text);
-- Events satisfy waits of their own run too (sql/workflows.sql, _may_satisfy).
DROP FUNCTION flow._may_satisfy(oid, uuid);
-- flow.claim calls flow._claim itself, after these checks (sql/api.sql).
DROP FUNCTION flow._claim_external(oid, text[], text, integer, interval);
-- Functions whose signature or result changed.
DROP FUNCTION flow._lock_runs_of(uuid[]);
DROP FUNCTION flow.fail(text);
DROP FUNCTION flow._decide(text, text, text, bigint);
DROP FUNCTION flow._begin_batch(uuid[], uuid[]);
DROP FUNCTION flow._prune(interval, integer);
DROP FUNCTION flow._next_due_ms();
-- Enqueue resolves and checks in one function (flow._plan_enqueue, which
-- returns scalars), and its helpers take scalars, not a flow._definitions row.
DROP FUNCTION flow._plan_enqueue(oid, text, integer, text, interval, timestamptz, interval);
DROP FUNCTION flow._definition(text, integer);
DROP FUNCTION flow._require_use(oid, flow._definitions);
DROP FUNCTION flow._first_due(interval, timestamptz);
DROP FUNCTION flow._deadline(interval);
DROP FUNCTION flow._insert_roots(flow._definitions, text, timestamptz, timestamptz, uuid[], jsonb[]);
-- External leases remember their length.
ALTER TABLE flow._commands ADD COLUMN lease_interval interval;
UPDATE flow._commands SET lease_interval = lease_expires_at - attempt_started_at
WHERE status = 'running' AND lease_pid IS NULL;
-- The handler context says when the command was created, when its budget
-- started and when this attempt started.
ALTER TYPE flow.context ADD ATTRIBUTE created_at timestamptz, ADD ATTRIBUTE budget_started_at timestamptz,
    ADD ATTRIBUTE attempt_started_at timestamptz;
-- Settlements take when the handler started (attempts are timed from there).
DROP FUNCTION flow._settle_batch(uuid[], uuid[], jsonb[]);
DROP FUNCTION flow._settle_failure(uuid, uuid, text, text, text, interval);
-- Old journal entries no wait refers to can be retired (flow.event_retention).
CREATE OR REPLACE FUNCTION flow._journal_is_append_only() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('flow_internal.retiring_events', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'flow: the event journal is append-only' USING ERRCODE = '55000';
END $$;
-- Typed arguments.
DROP FUNCTION flow.define(text, regprocedure, integer, text, integer, interval, interval, interval, interval, bigint);
DROP FUNCTION flow._define(oid, text, regprocedure, integer, text, integer, interval, interval, interval, interval);
ALTER TABLE flow._definitions ADD COLUMN args_type regtype;
-- Runs, commands, attempts and waits lose their foreign keys (see
-- sql/schema.sql): flow._prune deletes what they cascaded.
ALTER TABLE flow._runs DROP CONSTRAINT _runs_name_version_fkey;
ALTER TABLE flow._commands DROP CONSTRAINT _commands_run_id_fkey, DROP CONSTRAINT _commands_parent_id_fkey,
    DROP CONSTRAINT _commands_queue_fkey, DROP CONSTRAINT _commands_name_version_fkey;
ALTER TABLE flow._attempts DROP CONSTRAINT _attempts_command_id_fkey;
ALTER TABLE flow._waits DROP CONSTRAINT _waits_command_id_fkey;
-- Commands say whether external workers run them; the claim index keeps the
-- two kinds apart (see sql/schema.sql).
-- A command row's invariants are one CHECK calling a C function (see
-- sql/schema.sql and src/invariants.rs), not nine SQL ones; with them, a
-- succeeded command may keep its successful attempt on its row (see
-- sql/schema.sql, _attempts).
CREATE FUNCTION flow._command_row_is_consistent(status text, attempts integer, stop_reason text,
    finished boolean, lease_token boolean, lease_expires boolean, attempt_started boolean, lease_pid boolean,
    result boolean)
RETURNS boolean LANGUAGE c IMMUTABLE PARALLEL SAFE AS 'MODULE_PATHNAME', '_command_row_is_consistent_wrapper';
ALTER TABLE flow._commands DROP CONSTRAINT _commands_attempts_check, DROP CONSTRAINT _commands_stop_reason_check,
    DROP CONSTRAINT _commands_check, DROP CONSTRAINT _commands_check1, DROP CONSTRAINT _commands_check2,
    DROP CONSTRAINT _commands_check3, DROP CONSTRAINT _commands_check4, DROP CONSTRAINT _commands_check5,
    DROP CONSTRAINT _commands_check6,
    ADD CONSTRAINT _commands_state CHECK (flow._command_row_is_consistent(status::text, attempts, stop_reason,
        finished_at IS NOT NULL, lease_token IS NOT NULL, lease_expires_at IS NOT NULL,
        attempt_started_at IS NOT NULL, lease_pid IS NOT NULL, result IS NOT NULL));
ALTER TABLE flow._commands ADD COLUMN external boolean NOT NULL DEFAULT false;
UPDATE flow._commands c SET external = true
FROM flow._definitions d WHERE d.name = c.name AND d.version = c.version AND d.handler IS NULL;
DROP INDEX flow._commands_due;
CREATE FUNCTION flow._lane(queue text, claimant text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pg_catalog.hashtextextended(claimant, pg_catalog.hashtextextended(queue, 0))
$$;
CREATE INDEX _commands_due ON flow._commands
    (flow._lane(queue, CASE WHEN external THEN name ELSE '' END), next_run_at, id)
    WHERE status IN ('pending', 'waiting');
-- The busy tables are vacuumed sooner and unthrottled (see sql/schema.sql).
ALTER TABLE flow._runs SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0);
ALTER TABLE flow._commands SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0);
ALTER TABLE flow._attempts SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0);
-- Claims hold the commands of handlers known to be fast (see flow._claim).
DROP FUNCTION flow._claim(text, integer, timestamptz, integer, interval, text[], integer);
-- What a claim hands its claimant (see sql/schema.sql): it only locks now, so
-- no lease, and it says how each command is run, where it ended, which row it
-- locked and how its queues are interleaved. Made anew: the two functions
-- that returned it (flow._claim, flow._claim_external) are gone by here.
DROP TYPE flow.claimed_command;
CREATE TYPE flow.claimed_command AS (
    command_id uuid, run_id uuid, name text, version integer, queue text, args jsonb, attempt integer,
    deadline timestamptz, handler oid, handler_owner oid, context flow.context, attempt_timeout interval,
    hard_deadline timestamptz, claim_order integer, args_type regtype, due_at timestamptz, row_at tid,
    held boolean, lane_order integer, lane_room integer
);
-- The handler context is built in flow._claim itself.
DROP FUNCTION flow._context(flow._commands);
-- Running commands are indexed by their lease's expiry too (external claims
-- conclude the expired ones first).
DROP INDEX flow._commands_running;
CREATE INDEX _commands_running ON flow._commands (queue, lease_expires_at) WHERE status = 'running';
-- Room in the primary key's leaves for a settlement's second entry (see
-- sql/schema.sql; pages split from now on leave it, existing ones get it at
-- the next REINDEX).
ALTER INDEX flow._commands_pkey SET (fillfactor = 50);
-- flow.queues counts what is live by the claim's indexes; flow.queue_history
-- counts what is finished (both created below).
ALTER TABLE flow._queues SET (autovacuum_analyze_threshold = 0, autovacuum_analyze_scale_factor = 0);
-- Only keyed runs are indexed by (owner, key) (see sql/schema.sql).
ALTER TABLE flow._runs DROP CONSTRAINT _runs_owner_key_key;
CREATE UNIQUE INDEX _runs_owner_key ON flow._runs (owner, key) WHERE key IS NOT NULL;
-- A run's root command has the run's id from 0.2.0 on, found by the primary
-- key; (run_id, key) is unique among the other commands (see sql/schema.sql).
-- The roots of 0.1.0's runs keep their ids, and their entries.
ALTER TABLE flow._commands DROP CONSTRAINT _commands_run_id_key_key;
CREATE UNIQUE INDEX _commands_run_key ON flow._commands (run_id, key) WHERE id <> run_id;
-- Every command carries its run's owner, and a run without a key is its root
-- until it needs a row of its own (see sql/schema.sql, flow._runs). The runs
-- of 0.1.0 keep their rows.
ALTER TABLE flow._commands ADD COLUMN owner regrole;
UPDATE flow._commands c SET owner = r.owner FROM flow._runs r WHERE r.id = c.run_id;
ALTER TABLE flow._commands ALTER COLUMN owner SET NOT NULL;
-- The waits an event satisfied are indexed by it (see sql/schema.sql, _waits_event).
CREATE INDEX _waits_event ON flow._waits (event_position) WHERE event_position IS NOT NULL;
-- A claim may hold its commands for the caller's transaction (flow.claim's hold).
DROP FUNCTION flow.claim(text[], text, integer, interval, bigint);
