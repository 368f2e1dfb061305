//! External workers' claims: they take up where the last full claim of the
//! same definition ended, as in-database workers' claims do (flow.claim in
//! sql/api.sql; the shared ends are in `shmem::note_external_end`); and the
//! claims held by a client's own transaction (below).

use crate::{api, executor, shmem};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::time::Duration;

/// How long external claims of one definition take up where the last full
/// one ended before one starts from the queue's head again. (In-database
/// workers keep theirs longer, worker::CURSOR_SPAN: a commit that makes a
/// command due behind their cursor tells them, shmem::DueFloors; external
/// claims are not told.)
const EXTERNAL_CURSOR_SPAN: Duration = Duration::from_millis(250);

/// Where the last full claim of `definition` (claimed alone) ended, while
/// that is good: no row, or one.
#[pg_extern(volatile, parallel_unsafe)]
fn _external_claim_start(
    definition: Option<&str>,
) -> TableIterator<'static, (name!(queue, String), name!(due_at, TimestampWithTimeZone), name!(id, pgrx::Uuid))> {
    let end = definition
        .and_then(shmem::external_end)
        .and_then(|(queue, due_at, id)| Some((queue, api::timestamp_from_pg(due_at)?, pgrx::Uuid::from_bytes(id))));
    TableIterator::new(end)
}

/// Note how a claim of `definition` alone ended: `asked` commands were
/// asked for and these were taken (their queues, due times and ids). Full
/// and from one queue, its last command is where the next claims start;
/// otherwise they start from the head. Returns true (it is called in a
/// one-time filter, see flow._claim).
#[pg_extern(volatile, parallel_unsafe)]
fn _external_claim_ended(
    definition: Option<&str>,
    asked: i32,
    queues: Option<Vec<String>>,
    due_ats: Option<Vec<TimestampWithTimeZone>>,
    ids: Option<Vec<pgrx::Uuid>>,
) -> bool {
    let Some(definition) = definition else { return true };
    let (queues, due_ats, ids) = (queues.unwrap_or_default(), due_ats.unwrap_or_default(), ids.unwrap_or_default());
    let full = queues.len() >= asked.max(1) as usize && due_ats.len() == queues.len() && ids.len() == queues.len();
    let one_queue = queues.windows(2).all(|w| w[0] == w[1]);
    let last = due_ats.iter().zip(&ids).map(|(at, id)| executor::claim_position(*at, id)).max();
    // the longest a command that became due behind that point (an expired
    // lease, a claim rolled back) waits while a backlog drains
    let span_us = EXTERNAL_CURSOR_SPAN.as_micros() as i64;
    match (full && one_queue, last) {
        (true, Some((due_at, id))) => shmem::note_external_end(definition, Some((&queues[0], due_at, id)), span_us),
        _ => shmem::note_external_end(definition, None, span_us),
    }
    true
}

// ------------------------------------------------------------------ held claims
//
// `flow.claim(..., hold => true)` claims commands for the caller's own
// transaction: the claim locks their rows and writes nothing, and their
// settlement in the same transaction (flow.complete_many, flow.complete,
// flow.fail) is the one write of each attempt (see flow._claim, `held`). The
// row locks keep every other claim off them until the transaction ends.
//
// Nothing in the database says such an attempt started, so a client that
// dies in it (its transaction rolls back) would leave it uncounted, and a
// command that kills its client every time would run forever (engine rule
// 3). This backend keeps the held claims of its open transaction here; a
// transaction (or subtransaction) that ends with some unsettled leaves them
// in shared memory to worker 0 (shmem::abandon), which concludes each as
// interrupted in a transaction of its own (retried by policy), and external
// claims leave those commands alone until it has. A backend's exit rolls
// its transaction back the same way. Only a crash of the server (which
// empties shared memory) loses an abandoned attempt's count: every held
// command has its place from its claim on (shmem::reserve_abandon_room,
// HELD_PER_ROLE of them per role).

/// A command claimed held by the open transaction.
struct HeldClaim {
    token: [u8; 16],
    attempt: i32,
    /// the role whose claim it was (only its settlements find it here)
    caller: pg_sys::Oid,
    /// where its row is (its tid, as text): the claim's lock keeps it there
    row_at: String,
    /// held (its row locked, pending); false: claimed with a lease in this
    /// transaction (a limited queue's command: the lease counts it as running)
    held: bool,
    /// the subtransaction level that claimed it, and that settled it
    level: i32,
    settled: Option<i32>,
}

thread_local! {
    static HELD: std::cell::RefCell<std::collections::HashMap<[u8; 16], HeldClaim>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
    /// the worker name of the open transaction's held claims (one per transaction)
    static HELD_WORKER: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

pub fn init() {
    unsafe {
        pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(on_subxact_event), std::ptr::null_mut());
    }
}

fn nest_level() -> i32 {
    unsafe { pg_sys::GetCurrentTransactionNestLevel() }
}

/// Whether the caller is inside a transaction block (BEGIN ... COMMIT): a
/// held claim outside one would end, and release its rows, with its statement.
#[pg_extern(volatile, parallel_unsafe)]
fn _in_transaction_block() -> bool {
    unsafe { pg_sys::IsTransactionBlock() }
}

/// The worker name of the open transaction's held claims (NULL: none yet).
#[pg_extern(volatile, parallel_unsafe)]
fn _holding_worker() -> Option<String> {
    HELD_WORKER.with(|w| w.borrow().clone())
}

/// Note a command claimed by `flow.claim(..., hold => true)` in the open
/// transaction, for `caller` (called for each row it returns; returns true).
#[pg_extern(volatile, parallel_unsafe)]
fn _note_holding(
    caller: pg_sys::Oid,
    command_id: pgrx::Uuid,
    lease_token: pgrx::Uuid,
    attempt: i32,
    held: bool,
    row_at: Option<String>,
    worker: &str,
) -> bool {
    // (a place for its attempt among the abandoned ones, kept until the
    // transaction has ended: an error here aborts the claim, whose commands
    // noted so far have theirs)
    if let Err(full) = shmem::reserve_abandon_room(caller) {
        let message = match full {
            shmem::NoPlace::All => {
                "flow: 16384 commands are held by open transactions or wait for worker 0".to_string()
            }
            shmem::NoPlace::Role => format!(
                "flow: this role holds {} commands in open transactions or waiting for worker 0 already",
                shmem::HELD_PER_ROLE
            ),
        };
        pgrx::ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            message,
            "End some of those transactions first, or claim with a lease."
        );
    }
    HELD_WORKER.with(|w| {
        w.borrow_mut().get_or_insert_with(|| worker.to_string());
    });
    let claim = HeldClaim {
        token: *lease_token.as_bytes(),
        attempt,
        caller,
        row_at: row_at.unwrap_or_default(),
        held,
        level: nest_level(),
        settled: None,
    };
    if let Some(earlier) = HELD.with(|h| h.borrow_mut().insert(*command_id.as_bytes(), claim)) {
        // (claimed again after its earlier attempt ended: one place is enough)
        shmem::abandon(&[], &[earlier.caller]);
    }
    true
}

/// The claim `caller` holds `id` under `token` by, unsettled.
fn held_claim<'a>(
    held: &'a std::collections::HashMap<[u8; 16], HeldClaim>,
    caller: pg_sys::Oid,
    id: Option<&pgrx::Uuid>,
    token: Option<&pgrx::Uuid>,
) -> Option<&'a HeldClaim> {
    let claim = held.get(id?.as_bytes())?;
    (claim.held && claim.settled.is_none() && claim.caller == caller && claim.token == *token?.as_bytes())
        .then_some(claim)
}

/// For each (command, token): the number of the attempt the open
/// transaction holds it in for `caller` under that token and has not
/// settled, or NULL. NULL for all: none is held.
#[pg_extern(volatile, parallel_unsafe)]
fn _holding_attempts(
    caller: pg_sys::Oid,
    command_ids: Vec<Option<pgrx::Uuid>>,
    lease_tokens: Vec<Option<pgrx::Uuid>>,
) -> Option<Vec<Option<i32>>> {
    HELD.with(|h| {
        let h = h.borrow();
        if h.is_empty() {
            return None;
        }
        let attempts: Vec<Option<i32>> = command_ids
            .iter()
            .zip(lease_tokens.iter().chain(std::iter::repeat(&None)))
            .map(|(id, token)| held_claim(&h, caller, id.as_ref(), token.as_ref()).map(|c| c.attempt))
            .collect();
        attempts.iter().any(Option::is_some).then_some(attempts)
    })
}

/// Where the rows of these held commands are (tids as text, NULL for a
/// command not held).
#[pg_extern(volatile, parallel_unsafe)]
fn _holding_rows(command_ids: Vec<Option<pgrx::Uuid>>) -> Vec<Option<String>> {
    HELD.with(|h| {
        let h = h.borrow();
        command_ids.iter().map(|id| Some(h.get(id.as_ref()?.as_bytes())?.row_at.clone())).collect()
    })
}

/// Note that these commands were settled by the open transaction (those it
/// did not claim are ignored). Returns true.
#[pg_extern(volatile, parallel_unsafe)]
fn _holding_settled(command_ids: Vec<Option<pgrx::Uuid>>) -> bool {
    let level = nest_level();
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        for id in command_ids.iter().flatten() {
            if let Some(claim) = h.get_mut(id.as_bytes()) {
                claim.settled.get_or_insert(level);
            }
        }
    });
    true
}

/// The commands an external claim leaves alone (NULL: none): those whose
/// abandoned held attempts wait for worker 0, and those this transaction
/// holds unsettled (their rows are locked by this very transaction, which
/// SKIP LOCKED does not skip).
#[pg_extern(volatile, parallel_unsafe)]
fn _claim_excluded() -> Option<Vec<pgrx::Uuid>> {
    let mut commands = shmem::abandoned_commands();
    HELD.with(|h| commands.extend(h.borrow().iter().filter(|(_, c)| c.held && c.settled.is_none()).map(|(id, _)| *id)));
    (!commands.is_empty()).then(|| commands.into_iter().map(pgrx::Uuid::from_bytes).collect())
}

/// Forget the claims that `ended` picks, giving back their places, and
/// leave the attempts of those `abandoned` picks to worker 0 (their places
/// go to them).
fn abandon_where(ended: impl Fn(&HeldClaim) -> bool, abandoned: impl Fn(&HeldClaim) -> bool) {
    let worker = HELD_WORKER.with(|w| w.borrow().clone()).unwrap_or_default();
    let (left, forgotten): (Vec<([u8; 16], i32, [u8; 16], pg_sys::Oid)>, Vec<pg_sys::Oid>) = HELD.with(|h| {
        let mut h = h.borrow_mut();
        let picked: Vec<[u8; 16]> = h.iter().filter(|(_, c)| ended(c)).map(|(id, _)| *id).collect();
        let mut forgotten = Vec::with_capacity(picked.len());
        let left = picked
            .into_iter()
            .filter_map(|id| {
                let claim = h.remove(&id)?;
                forgotten.push(claim.caller);
                abandoned(&claim).then_some((id, claim.attempt, claim.token, claim.caller))
            })
            .collect();
        (left, forgotten)
    });
    let list: Vec<_> = left.iter().map(|(id, n, token, role)| (*id, *n, *token, worker.as_str(), *role)).collect();
    let lost = shmem::abandon(&list, &forgotten);
    if lost > 0 {
        // (as a transaction ends: a LOG line, never an error)
        pgrx::log!("flow: {lost} abandoned held attempts could not be left to worker 0 and go uncounted");
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact_event(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    if HELD.with(|h| h.borrow().is_empty()) {
        HELD_WORKER.with(|w| w.borrow_mut().take());
        return;
    }
    match event {
        pg_sys::XactEvent::XACT_EVENT_PRE_PREPARE => {
            // (before the transaction is prepared: it may still fail)
            pgrx::ereport!(
                ERROR,
                PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
                "flow: a transaction that claimed commands with hold => true cannot be prepared"
            );
        }
        // Before the commit the unsettled ones: their rows are still locked,
        // so no claim takes them before worker 0 is told (it never waits for
        // them, and counts them once this commit is over). The settled ones
        // stay until the commit is done: a commit can still fail after this
        // (a serialization failure), and then their settlements are rolled
        // back too. A command claimed with a lease and not settled keeps its
        // lease: it is concluded when that expires.
        pg_sys::XactEvent::XACT_EVENT_PRE_COMMIT => {
            abandon_where(|c| c.held && c.settled.is_none(), |_| true);
            return;
        }
        pg_sys::XactEvent::XACT_EVENT_COMMIT | pg_sys::XactEvent::XACT_EVENT_PARALLEL_COMMIT => {
            abandon_where(|_| true, |_| false) // (settled, or leased: nothing is left to worker 0)
        }
        // rolled back: every claim with it, and every settlement
        pg_sys::XactEvent::XACT_EVENT_ABORT | pg_sys::XactEvent::XACT_EVENT_PARALLEL_ABORT => {
            abandon_where(|_| true, |_| true)
        }
        _ => return,
    }
    HELD_WORKER.with(|w| w.borrow_mut().take());
}

#[pg_guard]
unsafe extern "C-unwind" fn on_subxact_event(
    event: pg_sys::SubXactEvent::Type,
    _mine: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    if HELD.with(|h| h.borrow().is_empty()) {
        return;
    }
    let level = nest_level();
    match event {
        pg_sys::SubXactEvent::SUBXACT_EVENT_COMMIT_SUB => HELD.with(|h| {
            for claim in h.borrow_mut().values_mut() {
                claim.level = claim.level.min(level - 1);
                claim.settled = claim.settled.map(|s| s.min(level - 1));
            }
        }),
        pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB => {
            // its claims were rolled back (their rows are free again), and its settlements
            abandon_where(|c| c.level >= level, |_| true);
            let none_left = HELD.with(|h| {
                let mut h = h.borrow_mut();
                for claim in h.values_mut() {
                    if claim.settled.is_some_and(|s| s >= level) {
                        claim.settled = None;
                    }
                }
                h.is_empty()
            });
            if none_left {
                // (the worker name went with the last of the claims it named)
                HELD_WORKER.with(|w| w.borrow_mut().take());
            }
        }
        _ => {}
    }
}
