//! Settle: writing what attempts came to (engine rules 6-7). Successes of a
//! chunk are settled together (`flow._settle_batch`), failures one by one
//! under the retry policy (`flow._settle_failure`), held attempts a stopped
//! worker or a client's transaction left are concluded as interrupted, and
//! claimed commands that never started go back to their queue uncharged
//! (`flow._release`). A settlement that meets a transient error is tried
//! again.

use crate::claim::{AttemptId, Claimed};
use crate::outcome::{Class, Failure};
use crate::payload::Jsonb;
use crate::spi::{
    self, engine_query, in_subtransaction, BOOL, INT4, INT4_ARRAY, INT8, JSONB_ARRAY, TEXT, TEXT_ARRAY, TID_ARRAY,
    TIMESTAMPTZ, TIMESTAMPTZ_ARRAY, UUID, UUID_ARRAY,
};
use crate::{gucs, ids};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use std::collections::HashMap;

/// How a failed attempt was settled.
#[derive(Debug, PartialEq)]
pub enum Settled {
    /// The lease was no longer ours (a held command: it moved on, or its run
    /// is locked elsewhere): nothing was written.
    Expired,
    /// Settled as a failure; `retry` tells whether another attempt is scheduled.
    Failed { retry: bool },
    /// Not settled: its run or its row is locked elsewhere (only when the
    /// caller would not wait for them).
    Locked,
}

/// Settle successes: (ids, lease tokens, results, handler starts, held
/// attempts, worker, held commands' rows, whether this chunk spawned a
/// command). Returns how many it settled (a command that moved on is not).
pub fn settle_batch(args: &[DatumWithOid; 8]) -> usize {
    engine_query(
        "SELECT cardinality(flow._settle_batch($1, $2, $3, $4, $5, $6, $7, $8))",
        &[UUID_ARRAY, UUID_ARRAY, JSONB_ARRAY, TIMESTAMPTZ_ARRAY, INT4_ARRAY, TEXT, TID_ARRAY, BOOL],
        args,
        |rows| rows.first().get_one::<i32>().ok().flatten().unwrap_or(0) as usize,
    )
}

/// How the settlement of a leased attempt's success went.
#[derive(Debug, PartialEq)]
pub enum LeasedSettled {
    Settled,
    /// The lease is no longer ours (a cancel, the run's failure or deadline):
    /// nothing written; the caller rolls back the handler's writes.
    NotOurs,
    /// Its run stayed locked elsewhere past lock_run_briefly's wait:
    /// nothing written; the caller rolls back the handler's writes, voids the
    /// attempt and ends its chunk (whose other run locks may be what the
    /// holder waits for).
    RunLocked,
}

/// Settle the success of a leased attempt: lock its run (waiting briefly:
/// the caller holds no command's row, but may hold other runs' locks), then
/// settle it if its lease is still ours. A root in its first attempt that
/// spawned nothing is its run's only command (flow._settle_batch's `alone`,
/// the step the claim's held test takes too): its settlement writes its own
/// row only, whose lock is what a cancel takes, so it takes no run lock
/// first (a lock of that same row: 0.18 ms of each slow root's settlement).
pub fn settle_leased_success(
    command: &Claimed,
    result: Option<Jsonb>,
    started: Option<TimestampWithTimeZone>,
    worker: &str,
    spawned: bool,
) -> LeasedSettled {
    let args = [
        vec![command.command_id].into(),
        vec![command.lease_token].into(),
        vec![result].into(),
        vec![started].into(),
        vec![None::<i32>].into(),
        worker.into(),
        vec![None::<pg_sys::ItemPointerData>].into(),
        spawned.into(),
    ];
    with_settlement_retries(|| {
        gucs::inject_fault("settle_success");
        let alone = command.command_id == command.run_id && command.attempt == 1 && !spawned;
        if !alone && !lock_run_briefly(&command.command_id) {
            LeasedSettled::RunLocked
        } else if settle_batch(&args) == 1 {
            LeasedSettled::Settled
        } else {
            LeasedSettled::NotOurs
        }
    })
}

/// How long a leased settlement waits for its run's lock: well past a
/// sibling's settlement and commit (about a millisecond), and under
/// deadlock_timeout. Past it the run is locked elsewhere for longer (a client
/// idle in its transaction, another chunk settling the same runs in the
/// other order): the worker voids the attempt and ends its chunk, which lets
/// its other locks go, instead of waiting without limit.
const RUN_LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// Lock a leased command's run (flow._try_lock_run_of), waiting RUN_LOCK_WAIT
/// at most: tried without waiting, then again after pauses that grow from
/// 50 µs to a millisecond (not lock_timeout: the engine's statements hold
/// query cancels off, src/spi.rs). A run locked by a sibling's settlement is
/// free within a millisecond or so: when 8 workers settled children of one
/// run, pauses of a whole millisecond (pg_sleep's least) made a lock take
/// 0.5 ms on average, against 0.18 ms unshared.
fn lock_run_briefly(command_id: &pgrx::Uuid) -> bool {
    let give_up = std::time::Instant::now() + RUN_LOCK_WAIT;
    let mut pause_us: i64 = 50;
    loop {
        let locked = engine_query("SELECT flow._try_lock_run_of($1)", &[UUID], &[(*command_id).into()], |rows| {
            rows.first().get_one::<bool>().ok().flatten().unwrap_or(false)
        });
        if locked {
            return true;
        }
        if std::time::Instant::now() >= give_up {
            return false;
        }
        // (a shutdown's SIGTERM is seen at the next try's statement)
        unsafe { pg_sys::pg_usleep(pause_us as _) };
        pause_us = (pause_us * 2).min(1000);
    }
}

/// A settlement that failed on a transient error (deadlock, serialization
/// failure, lock not available) is tried again, up to SETTLEMENT_TRIES times,
/// each in a subtransaction; each try re-checks the lease token, so an attempt
/// that stopped being ours meanwhile settles nothing (the reference's
/// ResolveCommandAttempt). Any other error, or the last one, goes up to the
/// chunk, whose failure is contained (worker.rs, `run_batch`).
const SETTLEMENT_TRIES: usize = 3;

pub fn with_settlement_retries<R>(settle: impl Fn() -> R) -> R {
    for _ in 1..SETTLEMENT_TRIES {
        match in_subtransaction(|| Ok(settle()), |caught| caught) {
            Ok(settled) => return settled,
            Err(caught) if is_transient(&caught) => continue,
            Err(caught) => caught.rethrow(),
        }
    }
    settle()
}

fn is_transient(caught: &pg_sys::panic::CaughtError) -> bool {
    matches!(
        spi::caught_report(caught).sql_error_code(),
        PgSqlErrorCode::ERRCODE_T_R_DEADLOCK_DETECTED
            | PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE
            | PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE
    )
}

/// Whether a failure's settlement waits for its run's lock.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RunWait {
    /// The caller holds the command's row (a held chunk): a run locked
    /// elsewhere is left to its holder (Settled::Locked).
    Never,
    /// RUN_LOCK_WAIT at most (lock_run_briefly), then Settled::Locked: a
    /// leased chunk, which may hold other runs' locks; the maintenance worker.
    Briefly,
    /// As long as it takes: a transaction that holds nothing else (containment).
    Always,
}

pub fn settle_failure(
    command: &AttemptId,
    failure: &Failure,
    started: Option<TimestampWithTimeZone>,
    worker: &str,
    wait: RunWait,
) -> Settled {
    let wait_for_run = wait != RunWait::Never;
    let status: Option<String> = with_settlement_retries(|| {
        gucs::inject_fault("settle_failure");
        // (a worker's leased settlement waits for its run briefly, as a success's)
        if wait == RunWait::Briefly && !lock_run_briefly(&command.command_id) {
            return Some("locked".to_string());
        }
        engine_query(
            "SELECT flow._settle_failure($1, $2, $3, $4, $5,
                    CASE WHEN $6 IS NULL THEN NULL ELSE pg_catalog.make_interval(secs => $6 / 1000000.0) END, $7, $8, $9, $10)",
            &[UUID, UUID, TEXT, TEXT, TEXT, INT8, TIMESTAMPTZ, INT4, TEXT, BOOL],
            &[
                command.command_id.into(),
                command.lease_token.into(),
                failure.class.as_str().into(),
                failure.code.as_str().into(),
                failure.message.as_str().into(),
                failure.delay_us.into(),
                started.into(),
                command.held_attempt.into(),
                worker.into(),
                wait_for_run.into(),
            ],
            |t| t.first().get_one().unwrap_or_else(|e| error!("flow: {e}")),
        )
    });
    match status.as_deref() {
        Some("retry") => Settled::Failed { retry: true },
        Some("failed") => Settled::Failed { retry: false },
        Some("locked") => Settled::Locked,
        _ => Settled::Expired,
    }
}

/// Containment after a one-command chunk failed outside its handler (see
/// worker.rs, `run_batch`): the command is settled with the engine's error
/// and retried by its policy; should even that fail (its own settlement is
/// what breaks), it fails permanently with that error. Returns false when
/// neither could be written.
pub fn settle_engine_error(command: &AttemptId, message: &str, sqlstate: &str, worker: &str) -> bool {
    // A settlement rejected as invalid (flow's own checks, bad data, a
    // violated constraint) cannot succeed when retried: an invalid decision.
    let invalid = sqlstate.starts_with("FL") || sqlstate.starts_with("22") || sqlstate.starts_with("23");
    if invalid {
        let decision = Failure::new(Class::Permanent, "invalid_decision", message);
        if in_subtransaction(|| Ok::<_, ()>(settle_failure(command, &decision, None, worker, RunWait::Always)), |_| ())
            .is_ok()
        {
            return true;
        }
    }
    let retryable = Failure::new(Class::Retryable, "engine_error", message);
    if in_subtransaction(|| Ok::<_, ()>(settle_failure(command, &retryable, None, worker, RunWait::Always)), |_| ())
        .is_ok()
    {
        return true;
    }
    let permanent = Failure { class: Class::Permanent, ..retryable };
    in_subtransaction(|| Ok::<_, ()>(settle_failure(command, &permanent, None, worker, RunWait::Always)), |_| ())
        .is_ok()
}

/// What concluding a held attempt came to (`conclude_held`).
#[derive(PartialEq, Eq, Debug)]
pub enum Conclusion {
    /// counted as interrupted
    Counted,
    /// the command had moved on (settled, or another attempt counted): nothing to count
    MovedOn,
    /// its run or its row is locked elsewhere: try again later
    Busy,
}

/// Conclude a held attempt that ended unsettled as interrupted, as recovery
/// concludes a leased one whose owner died: the one a stopped worker
/// recorded (see attempt_record.rs), or one an external client's transaction
/// abandoned (src/external.rs: `abandoned`, the token its client was given,
/// so that flow.resolve finds the attempt under it). The latter never waits
/// for a lock (a client's open transaction may hold its run or its row for
/// as long as it likes): Busy then; the former waits 200 ms at most.
pub fn conclude_held(command: [u8; 16], attempt: i32, worker: &str, abandoned: Option<[u8; 16]>) -> Conclusion {
    let held = AttemptId {
        command_id: pgrx::Uuid::from_bytes(command),
        lease_token: abandoned.map_or_else(ids::_new_id, pgrx::Uuid::from_bytes),
        held_attempt: Some(attempt),
    };
    let (code, message) = match abandoned {
        Some(_) => {
            ("transaction_ended", "the external worker's transaction holding this attempt ended without settling it")
        }
        None => ("owner_died", "the worker running this attempt exited before settling it"),
    };
    let interrupted = Failure::new(Class::Interrupted, code, message);
    let wait = if abandoned.is_none() { RunWait::Briefly } else { RunWait::Never };
    match settle_failure(&held, &interrupted, None, worker, wait) {
        Settled::Failed { .. } => Conclusion::Counted,
        Settled::Locked => Conclusion::Busy,
        Settled::Expired => Conclusion::MovedOn,
    }
}

/// A leased command to give back to its queue (flow._release): its attempt
/// never started (`voided` None), or started and the engine voided it (why:
/// 'demoted', 'engine_error', 'late_cancel'): counted, not charged.
#[derive(Clone, Copy, Debug)]
pub struct HandBack {
    pub id: pgrx::Uuid,
    pub token: pgrx::Uuid,
    pub voided: Option<&'static str>,
}

/// Hand leased commands back to their queue (flow._release). Returns those
/// whose row was locked elsewhere: try them again later.
pub fn release(commands: &[HandBack]) -> Vec<HandBack> {
    if commands.is_empty() {
        return Vec::new();
    }
    let ids: Vec<pgrx::Uuid> = commands.iter().map(|c| c.id).collect();
    let tokens: Vec<pgrx::Uuid> = commands.iter().map(|c| c.token).collect();
    let voided: Vec<Option<&str>> = commands.iter().map(|c| c.voided).collect();
    let by_id: HashMap<pgrx::Uuid, HandBack> = commands.iter().map(|c| (c.id, *c)).collect();
    engine_query(
        "SELECT flow._release($1, $2, $3)",
        &[UUID_ARRAY, UUID_ARRAY, TEXT_ARRAY],
        &[ids.into(), tokens.into(), voided.into()],
        |rows| rows.filter_map(|row| row.get::<pgrx::Uuid>(1).ok().flatten()).map(|id| by_id[&id]).collect(),
    )
}

/// Void a held attempt that started (flow._void_held): counted, not charged,
/// `code` saying why (see HandBack). Returns whether it was voided.
pub fn void_held(command: &AttemptId, started: Option<TimestampWithTimeZone>, worker: &str, code: &str) -> bool {
    let Some(attempt) = command.held_attempt else { return false };
    engine_query(
        "SELECT flow._void_held($1, $2, $3, $4, $5, $6)",
        &[UUID, INT4, UUID, TEXT, TIMESTAMPTZ, TEXT],
        &[
            command.command_id.into(),
            attempt.into(),
            command.lease_token.into(),
            worker.into(),
            started.into(),
            code.into(),
        ],
        |rows| rows.first().get_one::<bool>().ok().flatten().unwrap_or(false),
    )
}
