//! External workers' claims: they take up where the last full claim of the
//! same definition ended, as in-database workers' claims do (flow.claim in
//! sql/api.sql; the shared ends are in `note_external_end`); and the
//! claims held by a client's own transaction (below), with the attempts
//! they abandon, waiting in shared memory for the maintenance worker (src/recovery.rs).

use crate::shmem;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgLwLock};
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
fn _external_cursor_start(
    definition: Option<&str>,
) -> TableIterator<
    'static,
    (name!(queue, String), name!(priority, i16), name!(due_at, TimestampWithTimeZone), name!(id, pgrx::Uuid)),
> {
    let end = definition.and_then(external_end).and_then(|(queue, priority, due_at, id)| {
        Some((queue, priority, crate::spans::timestamp_from_pg(due_at)?, pgrx::Uuid::from_bytes(id)))
    });
    TableIterator::new(end)
}

/// Note how a claim of `definition` alone ended: `asked` commands were
/// asked for and these were taken (their queues, priorities, due times and
/// ids). Full and from one queue and priority, its last command is where the next claims start;
/// otherwise they start from the head. Returns true (it is called in a
/// one-time filter, see flow._claim).
#[pg_extern(volatile, parallel_unsafe)]
fn _external_cursor_end(
    definition: Option<&str>,
    asked: i32,
    queues: Option<Vec<String>>,
    priorities: Option<Vec<i16>>,
    due_ats: Option<Vec<TimestampWithTimeZone>>,
    ids: Option<Vec<pgrx::Uuid>>,
) -> bool {
    let Some(definition) = definition else { return true };
    let (queues, priorities) = (queues.unwrap_or_default(), priorities.unwrap_or_default());
    let (due_ats, ids) = (due_ats.unwrap_or_default(), ids.unwrap_or_default());
    let full = queues.len() >= asked.max(1) as usize
        && [due_ats.len(), ids.len(), priorities.len()].iter().all(|n| *n == queues.len());
    let one_queue = queues.windows(2).all(|w| w[0] == w[1]) && priorities.windows(2).all(|w| w[0] == w[1]);
    let last = due_ats.iter().zip(&ids).map(|(at, id)| crate::claim::claim_position(*at, id)).max();
    // the longest a command that became due behind that point (an expired
    // lease, a claim rolled back) waits while a backlog drains
    let span_us = EXTERNAL_CURSOR_SPAN.as_micros() as i64;
    match (full && one_queue, last) {
        (true, Some((due_at, id))) => {
            note_external_end(definition, Some((&queues[0], priorities[0], due_at, id)), span_us)
        }
        _ => note_external_end(definition, None, span_us),
    }
    true
}

/// 0.2.0's `_external_claim_start`, which its SQL calls until ALTER EXTENSION
/// UPDATE: the cursor of priority 0 only.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn _external_claim_start(
    definition: Option<&str>,
) -> TableIterator<'static, (name!(queue, String), name!(due_at, TimestampWithTimeZone), name!(id, pgrx::Uuid))> {
    TableIterator::new(_external_cursor_start(definition).filter(|end| end.1 == 0).map(|(q, _, at, id)| (q, at, id)))
}

/// 0.2.0's `_external_claim_ended` (see `_external_claim_start`).
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn _external_claim_ended(
    definition: Option<&str>,
    asked: i32,
    queues: Option<Vec<String>>,
    due_ats: Option<Vec<TimestampWithTimeZone>>,
    ids: Option<Vec<pgrx::Uuid>>,
) -> bool {
    let priorities = queues.as_ref().map(|q| vec![0; q.len()]);
    _external_cursor_end(definition, asked, queues, priorities, due_ats, ids)
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
// 3). This backend keeps the held claims of its open transaction here, and
// enters each in shared memory from its claim on (`register_held`); a
// transaction (or subtransaction) that ends with some unsettled leaves
// their entries to the maintenance worker (`end_held`), which concludes
// each as interrupted in a transaction of its own (retried by policy), and
// external claims leave those commands alone until it has. A backend's exit
// rolls its transaction back the same way. Only a crash of the server
// (which empties shared memory) loses an abandoned attempt's count (at most
// HELD_PER_ROLE entries per role).

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

static EXTERNAL_ENDS_TABLE: PgLwLock<ExternalEnds> = unsafe { PgLwLock::new(c"flow_external_ends") };
static ABANDONED_TABLE: PgLwLock<Abandoned> = unsafe { PgLwLock::new(c"flow_abandoned_attempts") };

/// Shared memory and the transaction callbacks of held claims (`_PG_init`).
pub fn init() {
    pg_shmem_init!(EXTERNAL_ENDS_TABLE);
    pg_shmem_init!(ABANDONED_TABLE);
    unsafe {
        PREVIOUS_SHMEM_REQUEST = pg_sys::shmem_request_hook;
        pg_sys::shmem_request_hook = Some(request_attempt_list);
        PREVIOUS_SHMEM_STARTUP = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(attach_attempt_list);
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
    // (its entry in shared memory, from now until the transaction has
    // ended: see `register_held`; an error here aborts the claim, whose
    // commands noted so far have theirs)
    if let Err(full) = register_held(*command_id.as_bytes(), attempt, *lease_token.as_bytes(), worker, caller) {
        let message = match full {
            NoPlace::All => {
                "flow: 16384 commands are held by open transactions or wait for the maintenance worker".to_string()
            }
            NoPlace::Role => format!(
                "flow: this role holds {} commands in open transactions or waiting for the maintenance worker already",
                HELD_PER_ROLE
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
        // (claimed again after its earlier attempt ended: that one's entry goes)
        end_held(&[], &[(*command_id.as_bytes(), earlier.attempt)]);
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
/// abandoned held attempts wait for the maintenance worker, and those this transaction
/// holds unsettled (their rows are locked by this very transaction, which
/// SKIP LOCKED does not skip).
#[pg_extern(volatile, parallel_unsafe)]
fn _claim_excluded() -> Option<Vec<pgrx::Uuid>> {
    let mut commands = abandoned_commands();
    HELD.with(|h| commands.extend(h.borrow().iter().filter(|(_, c)| c.held && c.settled.is_none()).map(|(id, _)| *id)));
    (!commands.is_empty()).then(|| commands.into_iter().map(pgrx::Uuid::from_bytes).collect())
}

/// Forget the claims that `ended` picks, and leave the attempts of those
/// `abandoned` picks to the maintenance worker (their entries stay, marked
/// abandoned; the others' go, with their places).
fn abandon_where(ended: impl Fn(&HeldClaim) -> bool, abandoned: impl Fn(&HeldClaim) -> bool) {
    let (left, released): (Vec<([u8; 16], i32)>, Vec<([u8; 16], i32)>) = HELD.with(|h| {
        let mut h = h.borrow_mut();
        let picked: Vec<[u8; 16]> = h.iter().filter(|(_, c)| ended(c)).map(|(id, _)| *id).collect();
        let (mut left, mut released) = (Vec::new(), Vec::new());
        for id in picked {
            if let Some(claim) = h.remove(&id) {
                if abandoned(&claim) {
                    left.push((id, claim.attempt))
                } else {
                    released.push((id, claim.attempt))
                }
            }
        }
        (left, released)
    });
    end_held(&left, &released);
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
        // so no claim takes them before the maintenance worker is told (it never waits for
        // them, and counts them once this commit is over). The settled ones
        // stay until the commit is done: a commit can still fail after this
        // (a serialization failure), and then their settlements are rolled
        // back too. A command claimed with a lease and not settled keeps its
        // lease: it is concluded when that expires.
        pg_sys::XactEvent::XACT_EVENT_PRE_COMMIT => {
            abandon_where(|c| c.held && c.settled.is_none(), |_| true);
            return;
        }
        // (an abort ends the transaction's row locks before this callback
        // runs: its entries kept every claim off its commands until now)
        pg_sys::XactEvent::XACT_EVENT_COMMIT | pg_sys::XactEvent::XACT_EVENT_PARALLEL_COMMIT => {
            abandon_where(|_| true, |_| false) // (settled, or leased: nothing is left to the maintenance worker)
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

// ---------------------------------------------------------------- shared memory
// The cursors of external claims, per definition, and the abandoned held
// attempts waiting for the maintenance worker.

/// How many definitions' external claim cursors are shared at once (see
/// `external_end`): a definition without one claims from its queue's head.
const EXTERNAL_ENDS: usize = 32;

/// Where the last full external claim of one definition ended (see
/// `note_external_end`), good until `until` (TimestampTz, µs).
#[derive(Copy, Clone)]
pub struct ExternalEnd {
    definition: shmem::SharedName,
    end: shmem::CursorEnd,
    until: i64,
}

impl Default for ExternalEnd {
    fn default() -> Self {
        ExternalEnd { definition: shmem::SharedName::NONE, end: shmem::CursorEnd::NONE, until: 0 }
    }
}

impl ExternalEnd {
    fn is(&self, definition: &str) -> bool {
        self.definition.len > 0 && self.definition.is(definition)
    }
}

#[derive(Copy, Clone, Default)]
pub struct ExternalEnds {
    slots: [ExternalEnd; EXTERNAL_ENDS],
}

unsafe impl PGRXSharedMemory for ExternalEnds {}

/// Where the last full external claim of `definition` ended (queue, due
/// time, id), while that is good (see `note_external_end`).
pub fn external_end(definition: &str) -> Option<shmem::End> {
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let ends = EXTERNAL_ENDS_TABLE.share();
    ends.slots.iter().find(|s| s.is(definition) && s.until > now)?.end.get()
}

/// After an external claim of `definition` alone: `end`, where it ended in
/// its queue when it came back full (None: it came back short, or from
/// several queues). The external workers claiming a definition share it, as
/// in-database workers share theirs (`publish_cursor`): the next claims take
/// up from the furthest end noted, for at most `span_us` after the first,
/// so they do not walk again the index entries of the commands claimed
/// before them, which stay in the due index until VACUUM. A claim that comes
/// back short, and every claim once the span is over, starts from the head.
pub fn note_external_end(definition: &str, end: Option<(&str, i16, i64, [u8; 16])>, span_us: i64) {
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let noted = end.and_then(|(queue, priority, due_at, id)| {
        Some((shmem::SharedName::new(definition)?, shmem::CursorEnd::new(queue, priority, due_at, id)?))
    });
    let mut ends = EXTERNAL_ENDS_TABLE.exclusive();
    let found = ends.slots.iter().position(|s| s.is(definition));
    let Some((name, end)) = noted else {
        if let Some(i) = found {
            ends.slots[i] = ExternalEnd::default();
        }
        return;
    };
    let slot = match found {
        Some(i) => &mut ends.slots[i],
        // a free or lapsed slot, else the one that lapses first
        None => ends.slots.iter_mut().min_by_key(|s| if s.until > now { s.until } else { i64::MIN }).expect("slots"),
    };
    let live = slot.is(definition) && slot.until > now;
    if live && slot.end.queue == end.queue && (slot.end.due_at, slot.end.id) >= (end.due_at, end.id) {
        return; // another claim got further already
    }
    if !live {
        (slot.definition, slot.until) = (name, now + span_us);
    }
    slot.end = end;
}

/// How many held commands' places there are in all (see `abandon`): held
/// by open transactions, or abandoned and waiting for the maintenance worker.
const ABANDONED: usize = 16_384;
/// How many of those places one role's claims may take at once: one role
/// holding thousands of commands in open transactions cannot lock every
/// other role out of held claims.
pub const HELD_PER_ROLE: u32 = 1_024;
/// How many roles may hold places at once.
const HOLDING_ROLES: usize = 1_024;

/// An attempt of a command held by an external client's transaction that
/// ended without settling it (src/external.rs): the command, the number of
/// the attempt, its token, the client's worker name, and the role whose
/// claim it was.
#[derive(Copy, Clone)]
struct AbandonedAttempt {
    command: [u8; 16],
    attempt: i32,
    token: [u8; 16],
    worker: shmem::SharedName,
    role: pg_sys::Oid,
    /// The backend whose open transaction holds it; 0: abandoned, waiting
    /// for the maintenance worker.
    holder: i32,
}

/// The places one role's claims take (0 roles: a free entry).
#[derive(Copy, Clone, Default)]
struct RolePlaces {
    role: u32,
    places: u32,
}

/// How many entries the list holds (`attempt_list`): every command an open
/// transaction holds has one from its claim on (`register_held`), which
/// stays, marked abandoned, if the transaction ends without settling it,
/// until the maintenance worker has counted it; and how many places each
/// role takes. The list is read and written under this one's lock.
#[derive(Copy, Clone)]
pub struct Abandoned {
    len: usize,
    roles: [RolePlaces; HOLDING_ROLES],
}

impl Default for Abandoned {
    fn default() -> Self {
        Abandoned { len: 0, roles: [RolePlaces::default(); HOLDING_ROLES] }
    }
}

/// The list of abandoned attempts itself, ABANDONED entries (1.7 MB) in
/// shared memory of its own, zero-filled when the server starts (zero bytes
/// are no attempt: `SharedName::NONE`, role 0). Not a PgLwLock's value:
/// pgrx builds that on the stack and copies it in, and a debug build's
/// copies of this list overflowed the postmaster's stack.
static ATTEMPT_LIST: std::sync::atomic::AtomicPtr<AbandonedAttempt> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());
const ATTEMPT_LIST_NAME: &std::ffi::CStr = c"flow_abandoned_attempt_list";
const ATTEMPT_LIST_BYTES: usize = ABANDONED * std::mem::size_of::<AbandonedAttempt>();
static mut PREVIOUS_SHMEM_REQUEST: pg_sys::shmem_request_hook_type = None;
static mut PREVIOUS_SHMEM_STARTUP: pg_sys::shmem_startup_hook_type = None;

#[pg_guard]
unsafe extern "C-unwind" fn request_attempt_list() {
    unsafe {
        if let Some(previous) = PREVIOUS_SHMEM_REQUEST {
            previous();
        }
        pg_sys::RequestAddinShmemSpace(ATTEMPT_LIST_BYTES);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn attach_attempt_list() {
    unsafe {
        if let Some(previous) = PREVIOUS_SHMEM_STARTUP {
            previous();
        }
        let init_lock = &raw mut (*pg_sys::MainLWLockArray.add(21)).lock; // AddinShmemInitLock
        pg_sys::LWLockAcquire(init_lock, pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let at = pg_sys::ShmemInitStruct(ATTEMPT_LIST_NAME.as_ptr(), ATTEMPT_LIST_BYTES, &mut found);
        if !found {
            std::ptr::write_bytes(at.cast::<u8>(), 0, ATTEMPT_LIST_BYTES);
        }
        ATTEMPT_LIST.store(at.cast(), std::sync::atomic::Ordering::Release);
        pg_sys::LWLockRelease(init_lock);
    }
}

/// The list, for a holder of ABANDONED_TABLE's lock (shared to read,
/// exclusive to write).
#[allow(clippy::mut_from_ref)]
fn attempt_list(_held: &Abandoned) -> &mut [AbandonedAttempt] {
    let at = ATTEMPT_LIST.load(std::sync::atomic::Ordering::Acquire);
    assert!(!at.is_null(), "flow's shared memory is attached");
    // SAFETY: ABANDONED entries in shared memory; the caller holds the lock
    // that guards them (`_held` is its guard's data)
    unsafe { std::slice::from_raw_parts_mut(at, ABANDONED) }
}

impl Abandoned {
    /// Add `delta` to `role`'s places (an entry is taken for a new role and
    /// freed at zero); false when it would go over `limit`, or no entry is
    /// free (nothing changed then).
    fn add_places(&mut self, role: pg_sys::Oid, delta: i64, limit: u32) -> bool {
        let role = role.to_u32();
        let at = self.roles.iter().position(|r| r.places > 0 && r.role == role);
        let Some(at) = at.or_else(|| (delta > 0).then(|| self.roles.iter().position(|r| r.places == 0)).flatten())
        else {
            return false;
        };
        let places = (i64::from(self.roles[at].places) + delta).max(0);
        if delta > 0 && places > i64::from(limit) {
            return false;
        }
        self.roles[at] = RolePlaces { role, places: places as u32 };
        true
    }
}

/// Why a held claim found no place (`register_held`).
pub enum NoPlace {
    /// every place is taken
    All,
    /// the role has HELD_PER_ROLE places already (or too many roles hold some)
    Role,
}

/// Enter a command that this backend's open transaction holds (attempt,
/// token, the client's worker name, the claiming role: a superuser's claims
/// have no limit of their own). Its entry is in the list from the claim on,
/// so an abandoned attempt always fits whatever other roles hold, and every
/// claim leaves the command alone until its entry goes: a transaction that
/// aborts releases its row locks before its callbacks run, and a claim in
/// between would take the command under the same attempt, uncounted.
fn register_held(
    command: [u8; 16],
    attempt: i32,
    token: [u8; 16],
    worker: &str,
    role: pg_sys::Oid,
) -> Result<(), NoPlace> {
    let limit = if unsafe { pg_sys::superuser_arg(role) } { u32::MAX } else { HELD_PER_ROLE };
    let mut table = ABANDONED_TABLE.exclusive();
    if table.len >= ABANDONED {
        return Err(NoPlace::All);
    }
    if !table.add_places(role, 1, limit) {
        return Err(NoPlace::Role);
    }
    // (a worker name longer than a shared name is cut at a character boundary)
    let mut cut = worker.len().min(shmem::SHARED_NAME_BYTES);
    while !worker.is_char_boundary(cut) {
        cut -= 1;
    }
    let at = table.len;
    attempt_list(&table)[at] = AbandonedAttempt {
        command,
        attempt,
        token,
        worker: shmem::SharedName::new(&worker[..cut]).unwrap_or(shmem::SharedName::NONE),
        role,
        holder: unsafe { pg_sys::MyProcPid },
    };
    table.len += 1;
    Ok(())
}

unsafe impl PGRXSharedMemory for Abandoned {}

/// This backend's transaction ended: the entries of the `abandoned`
/// attempts (command, attempt) are left to the maintenance worker, which
/// concludes them as interrupted (`abandoned`), and woken; those of the
/// `released` ones (settled, or leased) go, with their places. Called as a
/// transaction ends: raises nothing.
fn end_held(abandoned: &[([u8; 16], i32)], released: &[([u8; 16], i32)]) {
    if abandoned.is_empty() && released.is_empty() {
        return;
    }
    let me = unsafe { pg_sys::MyProcPid };
    let mut table = ABANDONED_TABLE.exclusive();
    let list = attempt_list(&table);
    let (mut kept, mut gone) = (0, Vec::new());
    for i in 0..table.len {
        let mut entry = list[i];
        let mine = |set: &[([u8; 16], i32)]| entry.holder == me && set.contains(&(entry.command, entry.attempt));
        if mine(released) {
            gone.push(entry.role);
            continue;
        }
        if mine(abandoned) {
            entry.holder = 0;
        }
        list[kept] = entry;
        kept += 1;
    }
    table.len = kept;
    for role in gone {
        table.add_places(role, -1, u32::MAX);
    }
    drop(table);
    if !abandoned.is_empty() {
        shmem::wake_maintenance();
    }
}

/// The commands held by open transactions, or whose abandoned attempts wait
/// for the maintenance worker: external claims leave them alone until then
/// (each would otherwise run again uncounted).
pub fn abandoned_commands() -> Vec<[u8; 16]> {
    let table = ABANDONED_TABLE.share();
    attempt_list(&table)[..table.len].iter().map(|a| a.command).collect()
}

/// The abandoned attempts, for the maintenance worker to conclude; each
/// stays (and its command left alone by claims) until `forget_abandoned`,
/// after its conclusion committed.
pub fn abandoned() -> Vec<([u8; 16], i32, [u8; 16], String)> {
    let table = ABANDONED_TABLE.share();
    attempt_list(&table)[..table.len]
        .iter()
        .filter(|a| a.holder == 0)
        .map(|a| (a.command, a.attempt, a.token, a.worker.to_string().unwrap_or_default()))
        .collect()
}

/// Drop these abandoned attempts (concluded, or given up on).
pub fn forget_abandoned(done: &[([u8; 16], i32)]) {
    if done.is_empty() {
        return;
    }
    let done: std::collections::HashSet<([u8; 16], i32)> = done.iter().copied().collect();
    let mut table = ABANDONED_TABLE.exclusive();
    let list = attempt_list(&table);
    let mut kept = 0;
    let mut gone = Vec::new();
    for i in 0..table.len {
        let a = list[i];
        if a.holder == 0 && done.contains(&(a.command, a.attempt)) {
            gone.push(a.role);
        } else {
            list[kept] = a;
            kept += 1;
        }
    }
    table.len = kept;
    for role in gone {
        table.add_places(role, -1, u32::MAX);
    }
}
