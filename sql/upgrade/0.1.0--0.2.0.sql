-- Table and type changes from 0.1.0 to 0.2.0 (tools/upgrade_script.py puts
-- them before the functions and views of 0.2.0, which replace the old ones).

-- Owners are regrole, so pg_dump writes role names; the views that read them
-- are recreated below.
DROP VIEW flow.runs, flow.commands, flow.attempts, flow.definitions, flow.events, flow.waits,
    flow.recent_attempts;
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
