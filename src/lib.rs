//! flow: a durable job and workflow engine inside PostgreSQL.
//!
//! One module per stage of a command's path, as `sql/` has one file per
//! service (docs/DESIGN.md has the rules each one keeps):
//! - `worker`: the background worker loop, top to bottom: claim, execute,
//!   settle, hand back, sleep until the next due time;
//! - `maintenance`: the maintenance worker (schedules' ticks, recovery, run
//!   deadlines, retention); `schedules`: cron expressions and time zones;
//! - `claim`: claimed rows (`Claimed`), what a claim keeps, the claim cursor,
//!   round-robin order, leases, which handlers are fast;
//! - `execute`: the chunk, the attempt, its deadline; `handler_call`: how a
//!   handler is called; `outcome`: failure classes and classification;
//! - `settle`: settlements, failures, conclusions, releases;
//! - `recovery`, `retention`: the maintenance worker's upkeep;
//! - `external`: external workers' claims, held claims and their shared tables;
//! - `gateway`: every call of user code (as its owner, with its owner's
//!   search_path, leaving nothing behind); `hooks`: the utility hook; `roles`:
//!   ownership and the role commands;
//! - `spi`: the engine's statements, plans and transactions; `shmem`: the
//!   worker table, counters, wake-ups, cancels; `attempt_record`: the
//!   attempt a worker is in (rule 3);
//! - `api`: internal SQL functions the public SQL API stands on; `ids`: ids
//!   and lease tokens; `rate_limits`: queues' rate limits; `spans`: durations and times; `payload`: args and
//!   results as datums; `locks`: flow's own lock tags; `invariants`: a
//!   command row's CHECK; `handlers`: built-in Rust handlers; `gucs`: settings.

use pgrx::prelude::*;

mod api;
mod attempt_record;
mod claim;
mod execute;
mod external;
mod gateway;
mod gucs;
mod handler_call;
mod handlers;
mod hooks;
mod ids;
mod invariants;
mod locks;
mod maintenance;
mod outcome;
mod payload;
mod rate_limits;
mod recovery;
mod retention;
mod roles;
mod schedules;
mod settle;
mod shmem;
mod spans;
mod spi;
mod worker;

::pgrx::pg_module_magic!(name, version);

extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
extension_sql_file!("../sql/common.sql", name = "common", requires = ["schema"]);
extension_sql_file!("../sql/definitions.sql", name = "definitions", requires = ["common"]);
extension_sql_file!("../sql/enqueue.sql", name = "enqueue", requires = ["definitions"]);
extension_sql_file!("../sql/claim.sql", name = "claim", requires = ["enqueue"]);
extension_sql_file!("../sql/settle.sql", name = "settle", requires = ["claim"]);
extension_sql_file!("../sql/recover.sql", name = "recover", requires = ["settle"]);
extension_sql_file!("../sql/retention.sql", name = "retention", requires = ["recover"]);
extension_sql_file!("../sql/workflows.sql", name = "workflows", requires = ["retention"]);
extension_sql_file!("../sql/external.sql", name = "external", requires = ["workflows"]);
extension_sql_file!("../sql/schedules.sql", name = "schedules", requires = ["external"]);
extension_sql_file!("../sql/api.sql", name = "api", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // Shared memory and background workers exist only for preloaded libraries.
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        pgrx::error!(
            "flow must be loaded via shared_preload_libraries: add shared_preload_libraries = 'flow' to postgresql.conf and restart"
        );
    }
    gucs::init();
    hooks::init();
    gateway::init();
    api::init();
    shmem::init();
    rate_limits::init();
    external::init();
    worker::register();
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use pgrx::prelude::*;

    #[pg_test]
    fn ticket_names_the_calling_role() {
        let me = Spi::get_one::<bool>(
            "SELECT flow._redeem(flow._ticket()) = (SELECT oid FROM pg_roles WHERE rolname = current_user)",
        );
        assert_eq!(me, Ok(Some(true)));
    }

    #[pg_test]
    fn a_ticket_works_once() {
        let again = Spi::get_one::<pg_sys::Oid>("WITH t AS (SELECT flow._ticket() AS t) SELECT flow._redeem(t) FROM t");
        assert!(again.is_ok());
        let forged = std::panic::catch_unwind(|| Spi::get_one::<pg_sys::Oid>("SELECT flow._redeem(42)"));
        assert!(forged.is_err());
    }

    #[pg_test]
    fn sqlstates_unpack_to_their_five_characters() {
        assert_eq!(crate::spi::sqlstate(PgSqlErrorCode::ERRCODE_DIVISION_BY_ZERO), "22012");
        assert_eq!(crate::spi::sqlstate(PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE), "42501");
        assert_eq!(crate::spi::sqlstate(PgSqlErrorCode::ERRCODE_QUERY_CANCELED), "57014");
    }

    #[pg_test]
    fn backoff_stays_within_its_bounds() {
        let within = Spi::get_one::<bool>(
            "SELECT bool_and(b BETWEEN interval '1 s' AND interval '1 min')
             FROM (SELECT flow._backoff('1 s', '1 min', a) b FROM generate_series(1, 100) a) x",
        );
        assert_eq!(within, Ok(Some(true)));
        let grows = Spi::get_one::<bool>("SELECT flow._backoff('1 s', '1 hour', 5) > interval '10 s'");
        assert_eq!(grows, Ok(Some(true)));
    }

    /// A due-again note expires the cursors published past it, and a worker
    /// whose floor moved since its claim took it publishes none: a cursor
    /// made before the note, taken up by a worker that had already taken
    /// the note, went on past what it made due (fan-out children waited a
    /// second). (Slot 0 is the test server's one worker's: it publishes
    /// nothing of its own in this empty database.)
    #[pg_test]
    fn a_due_again_note_expires_the_cursors_published_past_it() {
        use crate::shmem::{note_due_again, publish_cursor, take_due_floor, WORKERS};
        let end = |due: i64| vec![("q".to_string(), 0i16, due, [7u8; 16])];
        let published = || WORKERS.share().slots[0].cursor_len > 0;
        take_due_floor(0);
        publish_cursor(0, &end(1_000), i64::MAX - 1);
        assert!(published());
        note_due_again(1_000); // (at the end's own time: after it)
        assert!(published());
        note_due_again(999);
        assert!(!published());
        // published after a note its worker's claim did not take: not at all
        take_due_floor(0);
        note_due_again(500);
        publish_cursor(0, &end(1_000), i64::MAX - 1);
        assert!(!published());
        take_due_floor(0);
        publish_cursor(0, &end(1_000), i64::MAX - 1);
        assert!(published());
        publish_cursor(0, &[], 0);
    }

    #[pg_test]
    fn ids_are_time_ordered_v7() {
        let ordered = Spi::get_one::<bool>(
            "SELECT bool_and(a < b) FROM (SELECT flow._new_id() a, flow._new_id() b FROM generate_series(1, 100)) x",
        );
        assert_eq!(ordered, Ok(Some(true)));
        let version = Spi::get_one::<String>("SELECT substr(flow._new_id()::text, 15, 1)");
        assert_eq!(version, Ok(Some("7".to_string())));
        // the variant (10xx), and the time: the first 48 bits are now's milliseconds
        let variant = Spi::get_one::<bool>("SELECT substr(flow._new_id()::text, 20, 1) IN ('8', '9', 'a', 'b')");
        assert_eq!(variant, Ok(Some(true)));
        let now = Spi::get_one::<bool>(
            "SELECT abs(('x' || lpad(replace(left(flow._new_id()::text, 13), '-', ''), 16, '0'))::bit(64)::bigint
                        - (extract(epoch FROM clock_timestamp()) * 1000)::bigint) < 1000",
        );
        assert_eq!(now, Ok(Some(true)));
        // 100,000 in one statement (many per millisecond) are distinct and increasing
        let increasing = Spi::get_one::<bool>(
            "SELECT bool_and(a < b) FROM (SELECT lag(i) OVER (ORDER BY n) a, i b
                                         FROM (SELECT n, flow._new_id() i FROM generate_series(1, 100000) n) x) y
             WHERE a IS NOT NULL",
        );
        assert_eq!(increasing, Ok(Some(true)));
    }
}

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec!["shared_preload_libraries = 'flow'", "flow.database_name = 'pgrx_tests'", "flow.workers = 1"]
    }
}
