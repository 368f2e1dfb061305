//! Shared memory: the table of worker slots (who is idle, what each runs) and
//! the engine's counters, plus the commit-time wake-up of idle workers.
//!
//! Waking: enqueue, emit and settlement call `flow._wake()` (or
//! `flow._wake_due_from`, saying from when what they made due is due), which
//! only sets a backend-local flag; a transaction callback registered once in `_PG_init`
//! sets every worker's latch when that transaction commits. Nothing is woken
//! for work that rolled back, and a transaction that enqueues 10,000 runs
//! wakes the workers once.

use crate::gucs::MAX_WORKERS;
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgAtomic, PgLwLock};
use std::cell::Cell;
use std::sync::atomic::{fence, AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};

/// How many cancels a worker remembers at once (more concurrent cancels of
/// runs it holds than this are served when its chunk commits).
pub const CANCEL_SLOTS: usize = 16;
/// How many queues of a worker's claim cursor the other workers see.
pub const CURSOR_QUEUES: usize = 8;
/// The longest queue or definition name shared (a longer one is simply not shared).
pub(crate) const SHARED_NAME_BYTES: usize = 64;

/// A queue's or a definition's name in shared memory.
#[derive(Copy, Clone)]
pub(crate) struct SharedName {
    bytes: [u8; SHARED_NAME_BYTES],
    pub(crate) len: usize,
}

impl SharedName {
    pub(crate) const NONE: SharedName = SharedName { bytes: [0; SHARED_NAME_BYTES], len: 0 };

    /// None for a name too long to share.
    pub(crate) fn new(name: &str) -> Option<SharedName> {
        let mut shared = SharedName::NONE;
        shared.bytes.get_mut(..name.len())?.copy_from_slice(name.as_bytes());
        shared.len = name.len();
        Some(shared)
    }

    pub(crate) fn is(&self, name: &str) -> bool {
        &self.bytes[..self.len] == name.as_bytes()
    }

    pub(crate) fn to_string(self) -> Option<String> {
        String::from_utf8(self.bytes[..self.len].to_vec()).ok()
    }
}

impl PartialEq for SharedName {
    fn eq(&self, other: &SharedName) -> bool {
        self.bytes[..self.len] == other.bytes[..other.len]
    }
}

/// Where a claim ended in one queue: a worker's last full claim (see
/// `publish_cursor`), or an external one's (see `note_external_end`).
#[derive(Copy, Clone)]
pub struct CursorEnd {
    pub(crate) queue: SharedName,
    pub(crate) priority: i16,
    pub(crate) due_at: i64,
    pub(crate) id: [u8; 16],
}

/// Where a claim ended in one queue and priority: (queue, priority, due time
/// as TimestampTz µs, id).
pub type End = (String, i16, i64, [u8; 16]);

impl CursorEnd {
    pub(crate) const NONE: CursorEnd = CursorEnd { queue: SharedName::NONE, priority: 0, due_at: 0, id: [0; 16] };

    /// None for a queue whose name is too long to share.
    pub(crate) fn new(queue: &str, priority: i16, due_at: i64, id: [u8; 16]) -> Option<CursorEnd> {
        Some(CursorEnd { queue: SharedName::new(queue)?, priority, due_at, id })
    }

    /// As `new` took it.
    pub(crate) fn get(&self) -> Option<End> {
        Some((self.queue.to_string()?, self.priority, self.due_at, self.id))
    }
}

/// What one worker process is doing, for the `flow.workers` view and wake-ups.
#[derive(Copy, Clone)]
pub struct WorkerSlot {
    /// PGPROC number of the worker's backend, -1 while the slot is empty.
    pub procno: i32,
    pub pid: i32,
    /// Waiting on its latch right now (an idle worker is awake between its
    /// waits: releasing what it hands back, the next due time).
    pub sleeping: bool,
    /// Runs flow.cancel asked this worker to stop working on (see
    /// `interrupt_run`): a ring, so concurrent cancels never overwrite each
    /// other. (How many entries are set: ActivitySlot::cancels.)
    pub cancel_runs: [[u8; 16]; CANCEL_SLOTS],
    pub next_cancel: usize,
    /// Where its last full claim ended, per queue, until `cursor_until`
    /// (TimestampTz, µs; see `publish_cursor`).
    pub cursor: [CursorEnd; CURSOR_QUEUES],
    pub cursor_len: usize,
    pub cursor_until: i64,
    /// The runs whose locks its open chunk holds (see `publish_busy_runs`).
    pub busy_runs: [[u8; 16]; BUSY_RUNS],
    pub busy_runs_len: usize,
}

impl Default for WorkerSlot {
    fn default() -> Self {
        WorkerSlot {
            procno: -1,
            pid: 0,
            sleeping: false,
            cancel_runs: [[0; 16]; CANCEL_SLOTS],
            next_cancel: 0,
            cursor: [CursorEnd::NONE; CURSOR_QUEUES],
            cursor_len: 0,
            cursor_until: 0,
            busy_runs: [[0; 16]; BUSY_RUNS],
            busy_runs_len: 0,
        }
    }
}

#[derive(Copy, Clone)]
pub struct WorkerTable {
    pub slots: [WorkerSlot; MAX_WORKERS],
    /// PGPROC number of the maintenance worker (src/maintenance.rs), -1: none.
    maintenance_procno: i32,
}

impl Default for WorkerTable {
    fn default() -> Self {
        WorkerTable { slots: [WorkerSlot::default(); MAX_WORKERS], maintenance_procno: -1 }
    }
}

unsafe impl PGRXSharedMemory for WorkerTable {}

/// The engine's counters since the server started (rule 11; reset by a crash
/// restart). Each counts what committed: increments wait in the transaction
/// (per subtransaction level) and reach shared memory at its commit, so a
/// handler's rolled-back emits or a failed chunk's claims are not counted.
pub const METRICS: &[&str] = &[
    "attempts_succeeded",
    "attempts_permanent",
    "attempts_retry_after",
    "attempts_timeout",
    "attempts_interrupted",
    "attempts_lease_lost",
    "attempts_crash",
    "attempts_retryable",
    "attempts_cancelled",
    "attempts_expired",
    "attempts_voided",
    "stops_permanent",
    "stops_attempt_limit",
    "stops_elapsed_limit",
    "stops_deadline_before_next_attempt",
    "stops_deadline",
    "runs_succeeded",
    "runs_failed",
    "runs_cancelled",
    "runs_retried",
    "commands_retried",
    "events",
    "claims",
    "claims_empty",
    "claimed",
    "claim_us",
    "handler_us",
    "handed_back",
    "recovered",
    "group_reruns",
    "demoted",
    "pruned_runs",
    "ticks_fired",
    "ticks_skipped",
    "rate_limited",
    "group_limited",
];
const METRIC_SLOTS: usize = 48;
const _: () = assert!(METRICS.len() <= METRIC_SLOTS);

pub struct Counters {
    values: [AtomicU64; METRIC_SLOTS],
}

impl Default for Counters {
    fn default() -> Self {
        Counters { values: std::array::from_fn(|_| AtomicU64::new(0)) }
    }
}

unsafe impl PGRXSharedMemory for Counters {}

/// Per worker slot: the earliest time at which the commands made due by
/// the transactions committed since the worker last looked are due
/// (TimestampTz µs; i64::MAX: none). A worker's claims take up from where the
/// last one ended (Worker::claim) only while nothing was made due before
/// that (`take_due_floor`).
pub struct DueFloors {
    values: [AtomicI64; MAX_WORKERS],
}

impl Default for DueFloors {
    fn default() -> Self {
        DueFloors { values: std::array::from_fn(|_| AtomicI64::new(i64::MAX)) }
    }
}

unsafe impl PGRXSharedMemory for DueFloors {}

/// What one worker is doing, written by that worker alone before every
/// handler it runs: in atomics of its own, under a sequence number, not in
/// the WORKERS table under its lock (which every worker would take three
/// times per command, each on the same lock). 128 bytes each, so that two
/// workers' slots share no cache line (PostgreSQL aligns shared memory
/// structures so). (Not `repr(align)`: shared memory is not guaranteed
/// to honour a Rust alignment above 8, and an atomic that straddles cache
/// lines is a bus error on kernels that detect split locks.)
#[derive(Default)]
#[repr(C)]
pub struct ActivitySlot {
    /// Odd while the worker writes the fields below (a seqlock: see `activity`).
    seq: AtomicU64,
    /// true while running a batch, false while idle on its latch.
    busy: AtomicBool,
    /// The command whose handler runs right now, and its run (all zero when none).
    command: [AtomicU64; 2],
    run: [AtomicU64; 2],
    /// When the worker entered its current state (TimestampTz, µs).
    since: AtomicI64,
    /// Handlers this process has run since it started.
    handled: AtomicU64,
    /// The command is held (run in the claim's transaction, nothing in the
    /// table says it runs), not leased.
    held: AtomicBool,
    /// How many of WorkerSlot::cancel_runs are set (changed under the WORKERS
    /// lock; read without it: none set, no cancel to look for).
    cancels: AtomicU32,
    /// How many statement cancels flow.cancel has sent this worker since it
    /// started (see `cancel_signals`).
    cancel_signals: AtomicU32,
    _pad: [u64; 6],
}

const _: () = assert!(std::mem::size_of::<ActivitySlot>() == 128);

pub struct Activities {
    slots: [ActivitySlot; MAX_WORKERS],
    /// Bumped when a worker's attempt record file is made or removed (see
    /// attempt_record::named_elsewhere, which lists the files again then).
    record_files: AtomicU64,
    /// Sessions in flow.await, a bit per PGPROC number (see `await_pause`).
    awaiting: [AtomicU64; AWAIT_WORDS],
}

/// flow.await is woken by the commits that end runs in sessions whose PGPROC
/// number is below 64 times this (4,096); the others poll, as all did before.
const AWAIT_WORDS: usize = 64;

/// In flow.await (flow._await): wait for a commit that ends runs, at most
/// `seconds`. The session stays marked as waiting until `_await_done`: a
/// commit between its look at the run and this wait sets its latch, and the
/// wait returns at once. (Before, flow.await polled every 50 ms at most: on
/// average 25 ms after its run had ended, 2 % of a fan-out of 1.3 s.)
#[pg_extern(volatile, parallel_unsafe)]
fn _await_pause(seconds: f64) {
    if let Some((word, bit)) = my_await_bit() {
        word.fetch_or(bit, Ordering::SeqCst);
    }
    unsafe {
        pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as std::ffi::c_int,
            (seconds.clamp(0.0, 3600.0) * 1000.0).ceil() as std::ffi::c_long,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
    }
    pgrx::check_for_interrupts!();
}

/// flow.await is over (an ERROR in it leaves the mark: a latch set for
/// nothing is harmless, and the next flow.await of the session clears it).
#[pg_extern(volatile, parallel_unsafe)]
fn _await_done() {
    if let Some((word, bit)) = my_await_bit() {
        word.fetch_and(!bit, Ordering::SeqCst);
    }
}

/// This session's bit in `awaiting`: its word and mask (None past AWAIT_WORDS).
fn my_await_bit() -> Option<(&'static AtomicU64, u64)> {
    let procno = unsafe { (*pg_sys::MyProc).pgprocno } as usize;
    (procno < AWAIT_WORDS * 64).then(|| (&ACTIVITIES.get().awaiting[procno / 64], 1 << (procno % 64)))
}

/// A commit ended runs: wake the sessions in flow.await (post-commit: must not raise).
fn wake_awaiters() {
    fence(Ordering::SeqCst);
    for (word, bits) in ACTIVITIES.get().awaiting.iter().enumerate() {
        let mut bits = bits.load(Ordering::Relaxed);
        while bits != 0 {
            let procno = word * 64 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            set_proc_latch(procno);
        }
    }
}

/// The counters whose increase means runs ended (see wake_awaiters).
const RUN_ENDS: [&str; 3] = ["runs_succeeded", "runs_failed", "runs_cancelled"];

/// The attempt record files changed (one was made or removed).
pub fn note_record_files_changed() {
    ACTIVITIES.get().record_files.fetch_add(1, Ordering::AcqRel);
}

/// How many times the attempt record files changed since the server started.
pub fn record_files_generation() -> u64 {
    ACTIVITIES.get().record_files.load(Ordering::Acquire)
}

impl Default for Activities {
    fn default() -> Self {
        Activities {
            slots: std::array::from_fn(|_| ActivitySlot::default()),
            record_files: AtomicU64::new(0),
            awaiting: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

unsafe impl PGRXSharedMemory for Activities {}

/// A worker's activity as `activity` read it.
#[derive(Copy, Clone, Default)]
pub struct Activity {
    pub busy: bool,
    pub command: [u8; 16],
    pub run: [u8; 16],
    pub since: i64,
    pub handled: u64,
    pub held: bool,
}

fn id_words(id: &[u8; 16]) -> [u64; 2] {
    [u64::from_ne_bytes(id[..8].try_into().unwrap()), u64::from_ne_bytes(id[8..].try_into().unwrap())]
}

fn id_bytes(words: &[AtomicU64; 2]) -> [u8; 16] {
    let mut id = [0; 16];
    id[..8].copy_from_slice(&words[0].load(Ordering::Relaxed).to_ne_bytes());
    id[8..].copy_from_slice(&words[1].load(Ordering::Relaxed).to_ne_bytes());
    id
}

pub static WORKERS: PgLwLock<WorkerTable> = unsafe { PgLwLock::new(c"flow_workers") };
pub static COUNTERS: PgAtomic<Counters> = unsafe { PgAtomic::new(c"flow_counters") };
static DUE_FLOORS: PgAtomic<DueFloors> = unsafe { PgAtomic::new(c"flow_due_floors") };
static ACTIVITIES: PgAtomic<Activities> = unsafe { PgAtomic::new(c"flow_worker_activities") };
static PREPARED: PgLwLock<PreparedCounts> = unsafe { PgLwLock::new(c"flow_prepared_counts") };

/// Prepared transactions whose counter increments wait at once (more are not
/// counted: their increments are dropped at PREPARE).
const PREPARED_SLOTS: usize = 32;
/// PostgreSQL's GIDSIZE: the longest transaction identifier PREPARE takes.
const GID_BYTES: usize = 200;

/// The counter increments of prepared transactions, by their GID, until
/// COMMIT PREPARED counts them or ROLLBACK PREPARED drops them (a prepared
/// transaction is finished by another session, where none of its own
/// transaction's state is).
#[derive(Copy, Clone)]
pub struct PreparedCounts {
    gids: [[u8; GID_BYTES]; PREPARED_SLOTS],
    used: [bool; PREPARED_SLOTS],
    values: [[u64; METRIC_SLOTS]; PREPARED_SLOTS],
}

impl Default for PreparedCounts {
    fn default() -> Self {
        PreparedCounts {
            gids: [[0; GID_BYTES]; PREPARED_SLOTS],
            used: [false; PREPARED_SLOTS],
            values: [[0; METRIC_SLOTS]; PREPARED_SLOTS],
        }
    }
}

unsafe impl PGRXSharedMemory for PreparedCounts {}

fn gid_key(gid: &str) -> Option<[u8; GID_BYTES]> {
    let mut key = [0; GID_BYTES];
    key.get_mut(..gid.len())?.copy_from_slice(gid.as_bytes());
    Some(key)
}

/// PREPARE TRANSACTION `gid` runs now (the utility hook, src/hooks.rs): at
/// the prepare, the transaction's counter increments wait under that GID.
pub fn note_preparing(gid: &str) {
    PREPARING.with(|p| p.replace(gid_key(gid)));
}

/// COMMIT PREPARED (`committed`) or ROLLBACK PREPARED of `gid` succeeded:
/// count its increments, or drop them; a commit wakes the workers when this
/// transaction commits (what it made due may be due at any time).
pub fn finish_prepared(gid: &str, committed: bool) {
    let Some(key) = gid_key(gid) else { return };
    let values = {
        let mut table = PREPARED.exclusive();
        let Some(at) = (0..PREPARED_SLOTS).find(|i| table.used[*i] && table.gids[*i] == key) else {
            if committed {
                wake_at_commit(i64::MIN);
                wake_maintenance_at_commit();
            }
            return;
        };
        table.used[at] = false;
        table.values[at]
    };
    if committed {
        wake_at_commit(i64::MIN);
        wake_maintenance_at_commit();
        let level = unsafe { pg_sys::GetCurrentTransactionNestLevel() };
        PENDING.with(|p| {
            p.borrow_mut().extend(values.iter().enumerate().filter(|(_, n)| **n > 0).map(|(i, n)| (i, level, *n)))
        });
    }
}

/// At PREPARE: the open transaction's increments wait under its GID.
fn stash_prepared() {
    let pending: Vec<(usize, i32, u64)> = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    let Some(key) = PREPARING.with(|p| p.take()) else { return };
    if pending.is_empty() {
        return;
    }
    let mut table = PREPARED.exclusive();
    if let Some(at) = (0..PREPARED_SLOTS).find(|i| !table.used[*i]) {
        table.used[at] = true;
        table.gids[at] = key;
        table.values[at] = [0; METRIC_SLOTS];
        for (index, _, n) in pending {
            table.values[at][index] += n;
        }
    }
}

thread_local! {
    static WAKE_AT_COMMIT: Cell<bool> = const { Cell::new(false) };
    static WAKE_MAINTENANCE_AT_COMMIT: Cell<bool> = const { Cell::new(false) };
    /// The earliest due time of what the open transaction made due (see DueFloors).
    static DUE_FLOOR: Cell<i64> = const { Cell::new(i64::MAX) };
    /// Counter increments of the open transaction: (metric, subtransaction level, n).
    static PENDING: std::cell::RefCell<Vec<(usize, i32, u64)>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The GID the open transaction is being prepared under (see `note_preparing`).
    static PREPARING: Cell<Option<[u8; GID_BYTES]>> = const { Cell::new(None) };
}

pub fn init() {
    pg_shmem_init!(WORKERS);
    pg_shmem_init!(COUNTERS);
    pg_shmem_init!(DUE_FLOORS);
    pg_shmem_init!(ACTIVITIES);
    pg_shmem_init!(PREPARED);
    unsafe {
        pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(on_subxact_event), std::ptr::null_mut());
    }
}

/// Count `n` of `metric` (one of METRICS) when the current transaction commits.
pub fn observe(metric: &str, n: u64) {
    let Some(index) = METRICS.iter().position(|m| *m == metric) else { return };
    if n == 0 {
        return;
    }
    let level = unsafe { pg_sys::GetCurrentTransactionNestLevel() };
    PENDING.with(|p| p.borrow_mut().push((index, level, n)));
}

/// The counters, in METRICS order.
pub fn counter_values() -> Vec<(&'static str, u64)> {
    let c = COUNTERS.get();
    METRICS.iter().enumerate().map(|(i, m)| (*m, c.values[i].load(Ordering::Relaxed))).collect()
}

#[pg_guard]
unsafe extern "C-unwind" fn on_subxact_event(
    event: pg_sys::SubXactEvent::Type,
    _mine: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    let level = unsafe { pg_sys::GetCurrentTransactionNestLevel() };
    match event {
        pg_sys::SubXactEvent::SUBXACT_EVENT_COMMIT_SUB => PENDING.with(|p| {
            for entry in p.borrow_mut().iter_mut().filter(|e| e.1 >= level) {
                entry.1 = level - 1;
            }
        }),
        pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB => PENDING.with(|p| p.borrow_mut().retain(|e| e.1 < level)),
        _ => {}
    }
}

/// Ask for the workers to be woken when the current transaction commits,
/// and tell them that what it made due is due at `due_from` or later
/// (TimestampTz µs: i64::MIN when that is not known, i64::MAX when it made
/// nothing due, only room in a limited queue).
pub fn wake_at_commit(due_from: i64) {
    WAKE_AT_COMMIT.with(|w| w.set(true));
    DUE_FLOOR.with(|f| f.set(f.get().min(due_from)));
}

/// Commands due from `due_from` (TimestampTz µs; i64::MAX: none) on are due
/// now, maybe behind where the workers' claims ended (a commit that made
/// them due, held commands a chunk did not reach): every worker's next claim
/// starts before them (see DueFloors), and the idle ones are woken.
pub fn note_due_again(due_from: i64) {
    // (before the latches are set: a woken worker's claim sees it)
    if due_from < i64::MAX {
        for value in &DUE_FLOORS.get().values {
            value.fetch_min(due_from, Ordering::AcqRel);
        }
        // (after the floors: see publish_cursor)
        expire_cursors_after(due_from);
    }
    wake_workers();
}

/// The published cursors (see `publish_cursor`) with an end after
/// `due_from` may pass commands just made due again: no claim takes them up
/// any more. A worker takes its floor once per claim, so one whose floor
/// said nothing when it took up another's cursor, published before a note,
/// went on past what the note made due (children of a fan-out waited a
/// second for the cursors to run out, one fan-out in about 25).
fn expire_cursors_after(due_from: i64) {
    let stale = |slot: &WorkerSlot| slot.cursor[..slot.cursor_len].iter().any(|end| end.due_at > due_from);
    if !WORKERS.share().slots.iter().any(stale) {
        return;
    }
    let mut table = WORKERS.exclusive();
    for slot in table.slots.iter_mut().filter(|slot| stale(slot)) {
        (slot.cursor_len, slot.cursor_until) = (0, 0);
    }
}

/// The earliest due time made due by the commits since worker `index` last
/// took it (see DueFloors), left for its next claim to take.
pub fn peek_due_floor(index: usize) -> i64 {
    DUE_FLOORS.get().values[index].load(Ordering::Acquire)
}

/// The earliest due time made due by the commits since worker `index` last
/// asked (see DueFloors), and none from now on.
pub fn take_due_floor(index: usize) -> i64 {
    DUE_FLOORS.get().values[index].swap(i64::MAX, Ordering::AcqRel)
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact_event(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    match event {
        pg_sys::XactEvent::XACT_EVENT_COMMIT | pg_sys::XactEvent::XACT_EVENT_PARALLEL_COMMIT => {
            let floor = DUE_FLOOR.with(|f| f.replace(i64::MAX));
            if WAKE_AT_COMMIT.with(|w| w.replace(false)) {
                note_due_again(floor);
            }
            if WAKE_MAINTENANCE_AT_COMMIT.with(|w| w.replace(false)) {
                wake_maintenance();
            }
            let counters = COUNTERS.get();
            let mut runs_ended = false;
            PENDING.with(|p| {
                for (index, _, n) in p.borrow_mut().drain(..) {
                    counters.values[index].fetch_add(n, Ordering::Relaxed);
                    runs_ended |= n > 0 && RUN_ENDS.contains(&METRICS[index]);
                }
            });
            if runs_ended {
                wake_awaiters();
            }
        }
        pg_sys::XactEvent::XACT_EVENT_ABORT | pg_sys::XactEvent::XACT_EVENT_PARALLEL_ABORT => {
            WAKE_AT_COMMIT.with(|w| w.set(false));
            WAKE_MAINTENANCE_AT_COMMIT.with(|w| w.set(false));
            DUE_FLOOR.with(|f| f.set(i64::MAX));
            PENDING.with(|p| p.borrow_mut().clear());
            PREPARING.with(|p| p.take());
        }
        pg_sys::XactEvent::XACT_EVENT_PREPARE => {
            // (the wake-up comes with COMMIT PREPARED: see finish_prepared)
            WAKE_AT_COMMIT.with(|w| w.set(false));
            WAKE_MAINTENANCE_AT_COMMIT.with(|w| w.set(false));
            DUE_FLOOR.with(|f| f.set(i64::MAX));
            stash_prepared();
        }
        _ => {}
    }
}

/// Wake one sleeping worker (post-commit: must not raise): enough for the work of one commit, and a worker
/// whose claim comes back full wakes the next (Worker::claim), so a burst
/// brings in every worker while a single enqueue costs one claim, not one per
/// worker. With no worker sleeping, the latch of every worker between its
/// chunks is set: a commit that lands while a worker finishes its upkeep
/// (after its last claim found nothing, before it waits) then makes that wait
/// return at once, instead of the worker sleeping a whole poll interval. A
/// worker in a chunk is left alone: after its chunk it claims, or asks what
/// is due (Worker::turn), and sees this commit; its latch would only cut its
/// handler's sleeps and waits short (8 workers of a 50 ms handler: 14 wake-ups
/// per command, a tenth of a core).
pub fn wake_workers() {
    let table = WORKERS.share();
    let live = || table.slots.iter().enumerate().filter(|(_, s)| is_another_worker(s));
    // The first one waiting on its latch: under light load the same worker
    // keeps serving, with its caches warm (a quarter of a millisecond of
    // pickup here). Not merely idle: an idle worker that is pruning or
    // recovering would claim only once that is done, while another sleeps.
    match live().find(|(_, s)| s.sleeping) {
        Some((_, idle)) => set_latch(idle),
        None => {
            // (what this commit made due is visible before the chunks are
            // looked at; a worker clears its command before it asks what is due)
            fence(Ordering::SeqCst);
            let activities = &ACTIVITIES.get().slots;
            live()
                .filter(|(index, _)| activities[*index].command.iter().all(|w| w.load(Ordering::Relaxed) == 0))
                .for_each(|(_, slot)| set_latch(slot))
        }
    }
}

/// Wake every other worker that waits on its latch (see Worker::turn: after a
/// relation changed, so that each plans again while idle).
pub fn wake_sleeping_workers() {
    let table = WORKERS.share();
    table.slots.iter().filter(|s| is_another_worker(s) && s.sleeping).for_each(set_latch);
}

/// Some other worker waits on its latch: it is idle.
pub fn another_worker_sleeping() -> bool {
    WORKERS.share().slots.iter().any(|s| is_another_worker(s) && s.sleeping)
}

/// A live worker's slot, and not this process's own.
fn is_another_worker(slot: &WorkerSlot) -> bool {
    slot.procno >= 0 && slot.pid != unsafe { pg_sys::MyProcPid }
}

pub(crate) fn set_latch(slot: &WorkerSlot) {
    set_proc_latch(slot.procno as usize);
}

/// Set the latch of the process with this PGPROC number (none past the last).
fn set_proc_latch(procno: usize) {
    unsafe {
        if procno < (*pg_sys::ProcGlobal).allProcCount as usize {
            pg_sys::SetLatch(&mut (*(*pg_sys::ProcGlobal).allProcs.add(procno)).procLatch);
        }
    }
}

/// Worker `index` starts (true) or stops (false) waiting on its latch.
pub fn set_sleeping(index: usize, sleeping: bool) {
    WORKERS.exclusive().slots[index].sleeping = sleeping;
}

/// Share where worker `index`'s last full claim ended in each queue (queue,
/// due time, id), good until `until` (TimestampTz, µs); no ends: nothing.
/// The commands up to there are held by its open chunk, so another worker's
/// claim that walked them would try and skip a locked row for each (SKIP
/// LOCKED): with N workers, each claim would walk the batches of the N - 1
/// others. A claim that takes up from its own cursor starts after theirs
/// too (`cursors_of_others`). What a skipped stretch leaves behind (a
/// command handed back, a chunk rolled back) waits for the next claim from
/// the queues' heads, as what became due behind a worker's own cursor does.
pub fn publish_cursor(index: usize, ends: &[End], until: i64) {
    let mut shared = [CursorEnd::NONE; CURSOR_QUEUES];
    let mut len = 0;
    for end in ends
        .iter()
        .filter_map(|(queue, priority, due_at, id)| CursorEnd::new(queue, *priority, *due_at, *id))
        .take(CURSOR_QUEUES)
    {
        shared[len] = end;
        len += 1;
    }
    let mut table = WORKERS.exclusive();
    // A note since this worker took its floor (its claim's start) that its
    // cursor may pass: not published (its own next claim drops it too). The
    // note lowers the floors before it expires the published cursors under
    // this lock, so a cursor published past it is expired by it or not
    // published at all.
    let floor = DUE_FLOORS.get().values[index].load(Ordering::Acquire);
    let (len, until) = if shared[..len].iter().any(|end| end.due_at > floor) { (0, 0) } else { (len, until) };
    let slot = &mut table.slots[index];
    (slot.cursor, slot.cursor_len, slot.cursor_until) = (shared, len, until);
}

/// The ends the other live workers shared (see `publish_cursor`) that are
/// still good, and until when the first of them is (TimestampTz µs; i64::MAX: none).
pub fn cursors_of_others(index: usize) -> (Vec<End>, i64) {
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let table = WORKERS.share();
    let good = || table.slots.iter().enumerate().filter(|(i, s)| *i != index && s.procno >= 0 && s.cursor_until > now);
    let ends = good().flat_map(|(_, s)| s.cursor[..s.cursor_len].iter()).filter_map(CursorEnd::get).collect();
    (ends, good().map(|(_, s)| s.cursor_until).min().unwrap_or(i64::MAX))
}

/// The most runs a worker's open chunk says it holds (see `publish_busy_runs`).
const BUSY_RUNS: usize = 8;

/// Say which runs worker `index`'s open chunk holds the locks of (none: it
/// ended), so that the other workers' claims leave those runs' commands
/// alone (flow._claim's `busy_runs`). Claiming one, they locked its row, could
/// not lock its run, and left it out, locked for the rest of their
/// transaction: the claims of the worker holding the run skipped it and went
/// on after it, and it waited a second. More than BUSY_RUNS: none is said,
/// and those claims go on as before.
pub fn publish_busy_runs(index: usize, runs: &[[u8; 16]]) {
    let mut table = WORKERS.exclusive();
    let slot = &mut table.slots[index];
    let len = if runs.len() <= BUSY_RUNS { runs.len() } else { 0 };
    slot.busy_runs[..len].copy_from_slice(&runs[..len]);
    slot.busy_runs_len = len;
}

/// The runs the other live workers' open chunks hold (see `publish_busy_runs`).
pub fn busy_runs_of_others(index: usize) -> Vec<pgrx::Uuid> {
    let table = WORKERS.share();
    table
        .slots
        .iter()
        .enumerate()
        .filter(|(i, s)| *i != index && s.procno >= 0)
        .flat_map(|(_, s)| s.busy_runs[..s.busy_runs_len].iter().map(|id| pgrx::Uuid::from_bytes(*id)))
        .collect()
}

/// Claim the slot for worker number `index` in this process.
pub fn register_worker(index: usize) {
    let mut table = WORKERS.exclusive();
    let slot = &mut table.slots[index];
    unsafe {
        slot.procno = (*pg_sys::MyProc).pgprocno;
        slot.pid = pg_sys::MyProcPid;
    }
    clear_activity(index, slot);
}

/// A slot taken or given up: nothing running, nothing handled, no cancel.
fn clear_activity(index: usize, slot: &mut WorkerSlot) {
    slot.cancel_runs = [[0; 16]; CANCEL_SLOTS];
    slot.next_cancel = 0;
    slot.busy_runs_len = 0;
    let activity = &ACTIVITIES.get().slots[index];
    activity.cancels.store(0, Ordering::SeqCst);
    write_activity(activity, |a| {
        a.handled.store(0, Ordering::Relaxed);
        set_activity(a, false, [0; 16], [0; 16]);
        a.held.store(false, Ordering::Relaxed);
        a.since.store(unsafe { pg_sys::GetCurrentTimestamp() }, Ordering::Relaxed);
    });
}

/// Called at process exit so a dead worker is never woken or shown.
pub fn unregister_worker(index: usize) {
    let mut table = WORKERS.exclusive();
    let slot = &mut table.slots[index];
    if slot.pid == unsafe { pg_sys::MyProcPid } {
        *slot = WorkerSlot::default();
        clear_activity(index, slot);
    }
}

/// The maintenance worker starts (true) or exits (false) in this process.
pub fn register_maintenance(live: bool) {
    WORKERS.exclusive().maintenance_procno = if live { unsafe { (*pg_sys::MyProc).pgprocno } } else { -1 };
}

/// Wake the maintenance worker when the current transaction commits.
pub fn wake_maintenance_at_commit() {
    WAKE_MAINTENANCE_AT_COMMIT.with(|w| w.set(true));
}

/// Wake the maintenance worker (an abandoned attempt to conclude, a schedule changed). Raises nothing.
pub fn wake_maintenance() {
    let procno = WORKERS.share().maintenance_procno;
    if procno >= 0 {
        set_proc_latch(procno as usize);
    }
}

/// A command a worker is about to run: its id, its run's, and whether it is held.
pub type Running = ([u8; 16], [u8; 16], bool);

/// Record what worker `index` is doing now: the command it is about to run,
/// or none.
/// (Called by that worker only: the one writer of its activity.)
pub fn set_worker_state(index: usize, busy: bool, command: Option<Running>, handled: u64) {
    let (command, run, held) = command.unwrap_or(([0; 16], [0; 16], false));
    write_activity(&ACTIVITIES.get().slots[index], |a| {
        a.handled.fetch_add(handled, Ordering::Relaxed);
        set_activity(a, busy, command, run);
        a.held.store(held, Ordering::Relaxed);
    });
}

fn set_activity(a: &ActivitySlot, busy: bool, command: [u8; 16], run: [u8; 16]) {
    if a.busy.load(Ordering::Relaxed) != busy || id_bytes(&a.command) != command {
        a.since.store(unsafe { pg_sys::GetCurrentTimestamp() }, Ordering::Relaxed);
    }
    a.busy.store(busy, Ordering::Relaxed);
    for (word, value) in a.command.iter().zip(id_words(&command)) {
        word.store(value, Ordering::Relaxed);
    }
    for (word, value) in a.run.iter().zip(id_words(&run)) {
        word.store(value, Ordering::Relaxed);
    }
}

/// Write a slot's activity: readers that see the sequence number odd, or
/// changed while they read, read again.
fn write_activity(a: &ActivitySlot, write: impl FnOnce(&ActivitySlot)) {
    let seq = a.seq.load(Ordering::Relaxed);
    a.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
    fence(Ordering::Release);
    write(a);
    a.seq.store(seq.wrapping_add(2), Ordering::Release);
    // (before any look at the cancels that follows: see interrupt_run)
    fence(Ordering::SeqCst);
}

/// Each configured worker's pid (None: its slot is empty) and activity.
pub fn worker_activities() -> Vec<(Option<i32>, Activity)> {
    let table = WORKERS.share();
    (0..crate::gucs::workers())
        .map(|i| {
            let slot = &table.slots[i];
            ((slot.procno >= 0).then_some(slot.pid), activity(i))
        })
        .collect()
}

/// What worker `index` is doing, as one consistent reading.
pub fn activity(index: usize) -> Activity {
    let a = &ACTIVITIES.get().slots[index];
    loop {
        let seq = a.seq.load(Ordering::Acquire);
        if seq % 2 == 1 {
            std::hint::spin_loop();
            continue;
        }
        let read = Activity {
            busy: a.busy.load(Ordering::Relaxed),
            command: id_bytes(&a.command),
            run: id_bytes(&a.run),
            since: a.since.load(Ordering::Relaxed),
            handled: a.handled.load(Ordering::Relaxed),
            held: a.held.load(Ordering::Relaxed),
        };
        fence(Ordering::Acquire);
        if a.seq.load(Ordering::Relaxed) == seq {
            return read;
        }
    }
}

/// flow.cancel: every worker is told not to run or settle commands of
/// `run`, and the one running a handler of it gets a statement cancel
/// (SIGINT), so the run's lock is released soon. A handler cancelling its own
/// run is not signalled: it holds the run's lock already.
pub fn interrupt_run(run: [u8; 16]) {
    let mut table = WORKERS.exclusive();
    // This backend's own slot is left alone: a handler cancelling its own run
    // holds the run's lock, and its cancel commits with its attempt.
    for (index, slot) in table.slots.iter_mut().enumerate().filter(|(_, s)| is_another_worker(s)) {
        if !slot.cancel_runs.contains(&run) {
            let at = slot.next_cancel % CANCEL_SLOTS;
            if slot.cancel_runs[at] == [0; 16] {
                ACTIVITIES.get().slots[index].cancels.fetch_add(1, Ordering::SeqCst);
            }
            slot.cancel_runs[at] = run;
            slot.next_cancel = at + 1;
        }
        // The worker notes the command it is about to run before it looks
        // for cancels (write_activity, cancel_requested), and this looks at
        // that note after setting the cancel: either the worker sees the
        // cancel before the handler starts, or this sees the handler's run.
        fence(Ordering::SeqCst);
        if runs_handler_of(index, &run) {
            // (counted before it is sent: see cancel_signals)
            ACTIVITIES.get().slots[index].cancel_signals.fetch_add(1, Ordering::SeqCst);
            unsafe { libc_kill(slot.pid, SIGINT) };
        }
    }
}

/// A handler of `run` ignored flow.cancel: stop the worker running it (as
/// PostgreSQL's pg_terminate_backend would; recovery concludes the attempt).
/// Returns how many workers were told to stop.
pub fn stop_workers_of(run: [u8; 16]) -> i32 {
    let table = WORKERS.share();
    let mut stopped = 0;
    for (_, slot) in table.slots.iter().enumerate().filter(|(i, s)| is_another_worker(s) && runs_handler_of(*i, &run)) {
        unsafe { libc_kill(slot.pid, SIGTERM) };
        stopped += 1;
    }
    stopped
}

/// Whether worker `index` runs a handler of `run` right now.
fn runs_handler_of(index: usize, run: &[u8; 16]) -> bool {
    let now = activity(index);
    now.busy && now.run == *run
}

/// How many statement cancels flow.cancel has sent worker `index`. A
/// signal is delivered some time after it is sent, and may land on the
/// handler after the one it was sent for: a worker that sees a cancel while
/// a handler of a run nobody cancelled runs, and this count moved since the
/// attempt before this one started, takes it for a late one and gives the
/// attempt back uncharged (src/execute.rs).
pub fn cancel_signals(index: usize) -> u32 {
    ACTIVITIES.get().slots[index].cancel_signals.load(Ordering::SeqCst)
}

/// Whether flow.cancel asked worker `index` to leave `run` alone.
pub fn cancel_requested(index: usize, run: &[u8; 16]) -> bool {
    // (the common case, no cancel set for this worker, takes no lock)
    ACTIVITIES.get().slots[index].cancels.load(Ordering::SeqCst) > 0
        && WORKERS.share().slots[index].cancel_runs.contains(run)
}

/// A chunk committed: the cancels of its runs can take their locks now; the
/// cancels of other runs stay for the chunks that hold them.
pub fn clear_cancels(index: usize, runs: &[[u8; 16]]) {
    let cancels = &ACTIVITIES.get().slots[index].cancels;
    if cancels.load(Ordering::SeqCst) == 0 {
        return;
    }
    let mut table = WORKERS.exclusive();
    for entry in table.slots[index].cancel_runs.iter_mut() {
        if *entry != [0; 16] && runs.contains(entry) {
            *entry = [0; 16];
            cancels.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

const SIGINT: std::ffi::c_int = 2;
const SIGTERM: std::ffi::c_int = 15;
unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, signal: std::ffi::c_int) -> std::ffi::c_int;
}
