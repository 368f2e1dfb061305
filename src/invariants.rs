//! The invariants of a command row, which one CHECK constraint of
//! `flow._commands` calls (`_commands_state` in sql/schema.sql).
//!
//! They were nine CHECK constraints written in SQL. PostgreSQL prepares a
//! table's CHECK expressions anew for every statement that writes to it (each
//! read back from the catalog, planned and compiled, its operators looked up):
//! nine cost every single-row INSERT or UPDATE of `_commands` about 25 µs, the
//! most of a single `flow.enqueue`'s insert and of the settlement of one
//! command. A call of one function with plain arguments is prepared in about
//! 3 µs, and checks a row in well under one.

use pgrx::prelude::*;

/// Whether a `_commands` row's state, lease, attempt and outcome columns agree.
/// Its arguments are the row's `status::text`, `attempts`, `stop_reason`, and
/// whether `finished_at`, `lease_token`, `lease_expires_at`,
/// `attempt_started_at`, `lease_pid` and `result` are set:
/// - `attempts >= 0`, and at least 1 while running;
/// - finished (succeeded, failed, cancelled, expired) exactly when `finished_at` is set;
/// - `stop_reason`, when set, is one of the reasons settlement writes;
/// - a running command has a lease token, a lease expiry and an attempt start;
///   a succeeded one may keep the token and start of its successful attempt
///   (see sql/schema.sql, `_attempts`); no other command has either;
/// - only a running command has a lease expiry, or a lease pid (an
///   in-database worker's lease);
/// - only a succeeded command has a result.
///
/// Declared in sql/schema.sql (the table's CHECK needs it before the
/// functions pgrx writes), hence `sql = false`.
#[allow(clippy::too_many_arguments)]
#[pg_extern(immutable, parallel_safe, sql = false)]
fn _command_row_is_consistent(
    status: &str,
    attempts: i32,
    stop_reason: Option<&str>,
    finished: bool,
    lease_token: bool,
    lease_expires: bool,
    attempt_started: bool,
    lease_pid: bool,
    result: bool,
) -> bool {
    let running = status == "running";
    let succeeded = status == "succeeded";
    let ended = matches!(status, "succeeded" | "failed" | "cancelled" | "expired");
    // a running command's live attempt; a succeeded one's successful attempt, kept or not; none otherwise
    let attempt_kept = |set: bool| if running { set } else { succeeded || !set };
    attempts >= 0
        && (!running || attempts >= 1)
        && ended == finished
        && stop_reason.is_none_or(|reason| {
            matches!(
                reason,
                "permanent"
                    | "attempt_limit"
                    | "elapsed_limit"
                    | "deadline_before_next_attempt"
                    | "cancelled"
                    | "run_failed"
                    | "deadline"
            )
        })
        && attempt_kept(lease_token)
        && attempt_kept(attempt_started)
        && running == lease_expires
        && (running || !lease_pid)
        && (succeeded || !result)
}
