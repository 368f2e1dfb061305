//! The Rust half of flow's SQL surface: small internal functions the SQL API
//! (sql/*.sql) is built on. Public functions live in SQL; these are `flow._*`.

use crate::{execute, gucs, shmem};
use pgrx::prelude::*;
use std::cell::RefCell;
use std::collections::HashMap;

thread_local! {
    /// Tickets handed out by `_ticket()` and not yet redeemed: ticket → the
    /// role, and the optional parameters its call left out.
    static TICKETS: RefCell<HashMap<i64, (pg_sys::Oid, Vec<String>)>> = RefCell::new(HashMap::new());
    /// The optional parameters `_left_out` noted since the last ticket.
    static LEFT_OUT: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Remember the current role under a random one-shot ticket. Called in the
/// default expression of a public SECURITY DEFINER function, this runs in the
/// caller's security context; `_redeem` then tells the function who called it.
/// A role can only ever make tickets for itself. The ticket also takes the
/// parameters `_left_out` noted for the same call (its `caller_ticket`
/// comes last, so its default is evaluated after theirs).
#[pg_extern(volatile, parallel_unsafe)]
fn _ticket() -> i64 {
    let ticket: i64 = rand::random();
    let role = unsafe { pg_sys::GetUserId() };
    let left_out = LEFT_OUT.with(|l| std::mem::take(&mut *l.borrow_mut()));
    TICKETS.with(|t| {
        let mut t = t.borrow_mut();
        // Tickets of calls that failed before redeeming are never used again.
        if t.len() > 1024 {
            t.clear();
        }
        t.insert(ticket, (role, left_out));
    });
    ticket
}

/// The default of an optional parameter whose omission means "keep the
/// value it has" (flow.set_queue's): NULL, and a note that the call left
/// `what` out (a default expression is evaluated only for an argument the
/// call leaves out), which the call's ticket takes (`_left_out_of`). So a
/// NULL that is given (no limit) differs from one that is not (unchanged).
#[pg_extern(volatile, parallel_unsafe)]
fn _left_out(what: &str) -> Option<String> {
    LEFT_OUT.with(|l| l.borrow_mut().push(what.to_string()));
    None
}

/// Forget what `_left_out` noted for a call that failed before its ticket
/// was made (a (sub)transaction's abort; see `init`).
#[pg_guard]
unsafe extern "C-unwind" fn forget_left_out_on_abort(
    event: pg_sys::SubXactEvent::Type,
    _mine: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    if event == pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB {
        LEFT_OUT.with(|l| l.borrow_mut().clear());
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn forget_left_out_on_xact_abort(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    if event == pg_sys::XactEvent::XACT_EVENT_ABORT {
        LEFT_OUT.with(|l| l.borrow_mut().clear());
    }
}

/// Register the callbacks that forget stale `_left_out` notes (`_PG_init`).
pub fn init() {
    unsafe {
        pg_sys::RegisterXactCallback(Some(forget_left_out_on_xact_abort), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(forget_left_out_on_abort), std::ptr::null_mut());
    }
}

/// The optional parameters a ticket's call left out (see `_left_out`),
/// before the ticket is redeemed.
#[pg_extern(volatile, parallel_unsafe)]
fn _left_out_of(ticket: Option<i64>) -> Vec<String> {
    ticket.and_then(|ticket| TICKETS.with(|t| t.borrow().get(&ticket).map(|(_, l)| l.clone()))).unwrap_or_default()
}

/// Exchange a ticket for the role that made it. Each ticket works once.
#[pg_extern(volatile, parallel_unsafe)]
fn _redeem(ticket: Option<i64>) -> pg_sys::Oid {
    let role = ticket.and_then(|ticket| TICKETS.with(|t| t.borrow_mut().remove(&ticket))).map(|(role, _)| role);
    let Some(role) = role else {
        pgrx::ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            "flow: caller_ticket is not a ticket of this session; leave it to its default"
        );
    };
    role
}

/// Wake the idle workers when the current transaction commits. What it made
/// due may be due at any time, even before where the workers' claims ended:
/// their next claims start from the queues' heads.
#[pg_extern(volatile, parallel_unsafe)]
fn _wake() {
    shmem::wake_at_commit(i64::MIN);
}

/// `_wake`, for a transaction whose commands made due are all due at `due`
/// or later ('infinity': it made none due): the workers' claims may go on
/// from where they ended if that is before `due` (see shmem::DueFloors).
#[pg_extern(volatile, parallel_unsafe)]
fn _wake_due_from(due: TimestampWithTimeZone) {
    shmem::wake_at_commit(due.into_inner());
}

/// Whether a row version whose xmin is `xmin` (as text, then bigint) was
/// written by the current transaction or one of its subtransactions: its
/// changes cannot be seen by the workers before it commits (flow._await).
#[pg_extern(stable, parallel_safe)]
fn _written_here(xmin: i64) -> bool {
    u32::try_from(xmin).is_ok_and(|xid| unsafe { pg_sys::TransactionIdIsCurrentTransactionId(xid.into()) })
}

/// A command flow._claim locked and leaves out, its run locked elsewhere:
/// due again at `due` when the claim's transaction ends, so the workers'
/// next claims start before it (see shmem::DueFloors) instead of going on
/// after it, as they would from where theirs ended (it waited a second for
/// the cursors to run out). Returns false.
#[pg_extern(volatile, parallel_unsafe)]
fn _left_behind(due: TimestampWithTimeZone) -> bool {
    // (a microsecond before: see claim::keep_what_starts_now)
    shmem::wake_at_commit(due.into_inner() - 1);
    false
}

/// What a group may start, `free` of its group_concurrency being free:
/// none below 0, counted as `group_limited` when none (flow._claim).
#[pg_extern(volatile, parallel_unsafe)]
fn _group_room(free: i32) -> i32 {
    if free <= 0 {
        shmem::observe("group_limited", 1);
    }
    free.max(0)
}

/// Wake the maintenance worker when the current transaction commits: a
/// schedule changed, and its next tick may come before the worker's sleep ends.
#[pg_extern(volatile, parallel_unsafe)]
fn _wake_maintenance() {
    shmem::wake_maintenance_at_commit();
}

/// Ask the workers to stop running handlers of `run` (flow.cancel calls this
/// before it waits for the run's lock).
#[pg_extern(volatile, parallel_unsafe)]
fn _interrupt_run(run: pgrx::Uuid) {
    crate::execute::note_run_interrupted(*run.as_bytes());
    shmem::interrupt_run(*run.as_bytes());
}

/// Stop the workers running handlers of `run` that ignored flow.cancel.
#[pg_extern(volatile, parallel_unsafe)]
fn _stop_workers_of(run: pgrx::Uuid) -> i32 {
    shmem::stop_workers_of(*run.as_bytes())
}

/// flow.max_result_bytes, in bytes, for the SQL side's payload checks.
#[pg_extern(stable, parallel_safe)]
fn _max_payload_bytes() -> i32 {
    gucs::max_result_bytes()
}

/// flow.lease_duration in seconds: the default lease of external claims.
#[pg_extern(stable, parallel_safe)]
fn _lease_duration_s() -> i32 {
    gucs::lease_duration().as_secs() as i32
}

/// The command whose handler is running in this backend, NULL outside a handler.
#[pg_extern(volatile, parallel_unsafe)]
fn _current_command() -> Option<pgrx::Uuid> {
    execute::current_command().map(pgrx::Uuid::from_bytes)
}

/// One row per configured worker, from shared memory (the engine's: the
/// views read it through flow._worker_rows, which names only the caller's
/// commands).
#[pg_extern(volatile, parallel_safe)]
fn _worker_states() -> TableIterator<
    'static,
    (
        name!(worker, i32),
        name!(pid, Option<i32>),
        name!(state, String),
        name!(command_id, Option<pgrx::Uuid>),
        name!(since, Option<TimestampWithTimeZone>),
        name!(handled, i64),
    ),
> {
    let rows: Vec<_> = shmem::worker_activities()
        .into_iter()
        .enumerate()
        .map(|(i, (pid, now))| {
            let state = match (pid, now.busy) {
                (None, _) => "stopped",
                (Some(_), false) => "idle",
                (Some(_), true) => "busy",
            };
            let command = (now.command != [0; 16]).then(|| pgrx::Uuid::from_bytes(now.command));
            let since = pid.and_then(|_| crate::spans::timestamp_from_pg(now.since));
            (i as i32, pid, state.to_string(), command, since, now.handled as i64)
        })
        .collect();
    TableIterator::new(rows)
}

/// The commands workers hold now (run in their claim's transaction: nothing
/// in the table says they run), with the worker's pid and since when (the
/// engine's: the views read them through flow._held_rows). A leased command
/// is not among them: its row says it runs, as of the reader's snapshot.
#[pg_extern(volatile, parallel_safe)]
fn _held_states(
) -> TableIterator<'static, (name!(command_id, pgrx::Uuid), name!(pid, i32), name!(since, Option<TimestampWithTimeZone>))>
{
    let rows: Vec<_> = shmem::worker_activities()
        .into_iter()
        .filter_map(|(pid, now)| {
            let pid = pid.filter(|_| now.busy && now.held && now.command != [0; 16])?;
            Some((pgrx::Uuid::from_bytes(now.command), pid, crate::spans::timestamp_from_pg(now.since)))
        })
        .collect();
    TableIterator::new(rows)
}

/// The engine's counters, one row each (see shmem::METRICS).
#[pg_extern(volatile, parallel_safe)]
fn _counters() -> TableIterator<'static, (name!(name, String), name!(value, i64))> {
    TableIterator::new(shmem::counter_values().into_iter().map(|(name, v)| (name.to_string(), v as i64)))
}

/// Count `n` of a metric when the current transaction commits (the engine's SQL).
#[pg_extern(volatile, parallel_unsafe)]
fn _observe(metric: &str, n: i64) {
    shmem::observe(metric, n.max(0) as u64);
}

// flow._stopped_in (0.1.0-0.2.0) asked shared memory which attempt a stopped
// worker was in; attempt records answer that now (src/attempt_record.rs), and
// the 0.2.0--0.3.0 script drops the function. Its symbol stays for the
// 0.1.0--0.2.0 script, which creates it on the way: it says "nothing known".
#[unsafe(no_mangle)]
pub extern "C" fn pg_finfo__stopped_in_wrapper() -> &'static pg_sys::Pg_finfo_record {
    static V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn _stopped_in_wrapper(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe { (*fcinfo).isnull = true };
    pg_sys::Datum::from(0)
}
