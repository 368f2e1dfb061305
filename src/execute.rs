//! Execute: running claimed commands in chunks, one transaction per chunk
//! (engine rule 4). A chunk holds one owner's commands; each attempt runs its
//! handler through the gateway (src/gateway.rs), in a subtransaction of its
//! own or shared with the same owner's held attempts (a group), under the
//! attempt's deadline (PostgreSQL's statement-timeout timer, and a hard stop
//! for a handler that swallows it). Handlers' writes, events and children
//! commit with their settlement in the chunk's transaction, or not at all.
//!
//! Held commands (locked by the claim, with their runs) are settled together
//! at the end of the chunk, failures one by one as they happen; each held
//! attempt has FAST_BUDGET_US to finish, or it is cut and given back uncharged,
//! its handler no longer taken for fast. A leased command holds no lock while
//! its handler runs: its handler and its settlement share a subtransaction,
//! its run locked at the settlement, and a lease lost meanwhile (a cancel,
//! the run's end) rolls its writes back.

use crate::claim::{self, Claimed};
use crate::outcome::{self, Class, Failure};
use crate::payload::Jsonb;
use crate::settle::{self, HandBack, LeasedSettled, RunWait, Settled};
use crate::spi::{self, in_subtransaction, Subtransaction};
use crate::{gateway, gucs, handler_call, shmem, spans};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::ffi::c_int;

thread_local! {
    static CURRENT_COMMAND: Cell<Option<[u8; 16]>> = const { Cell::new(None) };
    /// The run of the command whose handler runs now, and whether that
    /// handler ended its own run (flow.cancel of it: see `note_run_interrupted`).
    static CURRENT_RUN: Cell<Option<[u8; 16]>> = const { Cell::new(None) };
    static ENDED_OWN_RUN: Cell<bool> = const { Cell::new(false) };
    /// A command was spawned in this backend since the current chunk began
    /// (flow._note_spawn): its settlement must look for children (see
    /// flow._settle_batch's `alone`).
    static SPAWNED_IN_CHUNK: Cell<bool> = const { Cell::new(false) };
    /// Handlers that failed lately in this worker, with how many more of
    /// their attempts run alone before they are grouped again (see GROUP_SIZE).
    static FAILING_HANDLERS: RefCell<HashMap<u32, u32>> = RefCell::new(HashMap::new());
}

/// Held attempts of one role's handlers that have not failed lately share one
/// subtransaction, up to this many, instead of one each. A handler that
/// writes takes a subtransaction id, and a transaction with more than 64 of
/// them overflows every snapshot in the server (see subxid_cache_nearly_full):
/// so a chunk of writing handlers each in its own subtransaction ends after
/// 56 commands, and its claim, settlement and commit are shared by only 56.
/// Grouped, a chunk runs up to 56 groups. When an attempt in a group fails
/// (or is cut short), the group's subtransaction is rolled back — nothing of
/// it was settled or committed — and its earlier members run again, each in
/// a subtransaction of its own; the failed one is concluded with the failure
/// it had. Their writes commit once either way.
const GROUP_SIZE: usize = 32;
/// After a failure, this many of the handler's attempts run alone.
const ALONE_AFTER_FAILURE: u32 = 256;

/// How long an attempt of a handler known to be fast may run (µs). Such
/// commands are claimed many at a time and run one after the other (held in
/// the claim's transaction, with their runs locked, or leased in a batch): a
/// fast handler that turns slow (a lock wait, a slow call) would hold all the
/// others. Past this, its attempt is cut (a statement cancel) and given back
/// uncharged, the chunk ends, the rest of the claim goes back to its queue,
/// and the handler is run alone, leased, from then on. Ten times
/// FAST_HANDLER (src/claim.rs): a fast handler's occasional slow call is not cut.
const FAST_BUDGET_US: i64 = 100_000;

/// Whether a held attempt of `handler` may join a group.
fn groupable(handler: pg_sys::Oid) -> bool {
    FAILING_HANDLERS.with(|f| {
        let mut f = f.borrow_mut();
        match f.get_mut(&handler.to_u32()) {
            None => true,
            Some(left) if *left <= 1 => {
                f.remove(&handler.to_u32());
                false
            }
            Some(left) => {
                *left -= 1;
                false
            }
        }
    })
}

fn note_handler_failed(handler: pg_sys::Oid) {
    FAILING_HANDLERS.with(|f| f.borrow_mut().insert(handler.to_u32(), ALONE_AFTER_FAILURE));
}

// utils/timeout.h is not in pgrx-pg-sys 0.18.1. STATEMENT_TIMEOUT is 3 in
// PostgreSQL 15's TimeoutId enum (re-check on a new major version).
const STATEMENT_TIMEOUT: u32 = 3;
unsafe extern "C-unwind" {
    fn enable_timeout_after(id: u32, delay_ms: c_int);
    fn RegisterTimeout(id: u32, handler: Option<unsafe extern "C-unwind" fn()>) -> u32;
    fn disable_timeout(id: u32, keep_indicator: bool);
    fn get_timeout_indicator(id: u32, reset_indicator: bool) -> bool;
}

/// Whether this transaction's subtransactions that wrote (each handler that
/// writes has one) nearly fill PostgreSQL's per-backend cache of them
/// (PGPROC_MAX_CACHED_SUBXIDS, 64): one more and every snapshot taken in the
/// server would be "suboverflowed" and read pg_subtrans, slowing every
/// session. A chunk ends here; a few slots stay free for the settlements of
/// failures, which run in subtransactions of their own.
pub fn subxid_cache_nearly_full() -> bool {
    const MAX_CACHED_SUBXIDS: u8 = 64;
    let status = unsafe { (*pg_sys::MyProc).subxidStatus };
    status.overflowed || status.count >= MAX_CACHED_SUBXIDS - 8
}

/// flow.cancel of `run` in this backend (flow._interrupt_run): if a handler
/// running here cancels its own run, its attempt's settlement finds its
/// command ended by its own transaction, and keeps what it did (the cancel).
pub fn note_run_interrupted(run: [u8; 16]) {
    if CURRENT_RUN.with(|r| r.get()) == Some(run) {
        ENDED_OWN_RUN.with(|e| e.set(true));
    }
}

pub fn current_command() -> Option<[u8; 16]> {
    CURRENT_COMMAND.with(|c| c.get())
}

/// Called by flow._spawn_many before it inserts a child (in any backend; only an
/// in-database worker's chunk reads it).
#[pg_extern(volatile, parallel_unsafe)]
fn _note_spawn() {
    SPAWNED_IN_CHUNK.with(|s| s.set(true));
}

/// Called by flow.fail / flow.retry_after / an invalid spawn or emit. Returns
/// whether a handler is running in this backend (flow.fail with keep_writes
/// needs one).
#[pg_extern(volatile, parallel_unsafe)]
fn _decide(class: &str, code: &str, message: &str, delay_us: Option<i64>) -> bool {
    outcome::decide(outcome::Decided::from_sql(class), code, message, delay_us);
    current_command().is_some()
}

/// What a finished chunk leaves to its worker (`Chunk::finish`).
pub struct Finished {
    /// Commands to hand back to their queue uncharged: (id, lease token).
    pub handed_back: Vec<HandBack>,
    /// Held commands left to a cancel.
    pub left: Vec<pgrx::Uuid>,
    /// Leased commands to hand back at once (an attempt cut at its budget).
    pub released_now: Vec<HandBack>,
}

/// Claimed commands executed in one transaction, one owner's: held ones
/// (`held`, locked by the claim with their runs), their successes settled
/// together by `finish` (flow._settle_batch) and failures one by one as they
/// happen, after the successes before them; or leased ones (`leased`), each
/// settled right after its handler (`run_leased`). Commands a cancel stopped
/// are left to it; attempts cut at their budget are voided (counted, not
/// charged) and run again alone.
pub struct Chunk<'a> {
    /// The worker's name: the owner of held attempts.
    worker: &'a str,
    live: HashSet<[u8; 16]>,
    /// Runs that failed in this chunk: their other commands were cancelled.
    failed_runs: HashSet<[u8; 16]>,
    /// (command, result, when its handler started)
    successes: Vec<(&'a Claimed, Option<Jsonb>, Option<TimestampWithTimeZone>)>,
    /// Commands to hand back uncharged (see `finish`).
    handed_back: Vec<HandBack>,
    /// Held commands left to a cancel: nothing of them was written, so they
    /// are due again at once (see `finish`).
    left: Vec<pgrx::Uuid>,
    /// An attempt overran FAST_BUDGET_US: the chunk ends (see `demoted`).
    demoted: bool,
    /// A leased settlement found its run locked elsewhere: the chunk ends
    /// (see `run_stayed_locked`).
    cut_short: bool,
    /// Leased commands whose attempt was cut so: back to their queue at once.
    released_now: Vec<HandBack>,
    /// The open group of held attempts sharing a subtransaction, if any.
    group: Option<Group<'a>>,
}

/// Held attempts sharing a subtransaction (see GROUP_SIZE).
struct Group<'a> {
    /// Whose handlers they all are: a role's failure can only make its own
    /// handlers run again, never another role's (whose handler could have
    /// effects outside the database, such as a call to another service).
    owner: pg_sys::Oid,
    members: Vec<&'a Claimed>,
    /// How many successes the chunk had when the group began: those after
    /// are its members'.
    successes_before: usize,
    subtransaction: Subtransaction,
}

impl<'a> Chunk<'a> {
    /// Held commands, in the claim's transaction: their rows and runs are
    /// locked already.
    pub fn held(worker: &'a str, commands: &[Claimed]) -> Chunk<'a> {
        let live = commands.iter().map(|c| *c.command_id.as_bytes()).collect();
        Chunk::with(worker, live)
    }

    fn with(worker: &'a str, live: HashSet<[u8; 16]>) -> Self {
        SPAWNED_IN_CHUNK.with(|s| s.set(false));
        Chunk {
            worker,
            live,
            failed_runs: HashSet::new(),
            successes: Vec::new(),
            handed_back: Vec::new(),
            left: Vec::new(),
            demoted: false,
            cut_short: false,
            released_now: Vec::new(),
            group: None,
        }
    }

    /// Leased commands, in a transaction of their own (their leases are
    /// checked at each one's settlement).
    pub fn leased(worker: &'a str, commands: &[Claimed]) -> Chunk<'a> {
        let live = commands.iter().map(|c| *c.command_id.as_bytes()).collect();
        Chunk::with(worker, live)
    }

    /// The chunk must end here: an attempt overran FAST_BUDGET_US (a held
    /// chunk's other commands are locked until it commits), or a run stayed
    /// locked at a leased settlement.
    pub fn must_end(&self) -> bool {
        self.demoted || self.cut_short
    }

    /// Run one command of the chunk for worker `index`; commands of a run
    /// that failed in this chunk are skipped, those a cancel asked for are
    /// handed back (the cancel closes them once it has the run's lock).
    pub fn execute(&mut self, index: usize, command: &'a Claimed) {
        self.run(index, command, true);
    }

    /// `execute`; `may_group`: a held attempt may join the open group (see
    /// GROUP_SIZE), or open one.
    fn run(&mut self, index: usize, command: &'a Claimed, may_group: bool) {
        let run = *command.run_id.as_bytes();
        if !self.live.contains(command.command_id.as_bytes()) || self.failed_runs.contains(&run) {
            return;
        }
        // A cancelled command is left to the cancel, which closes it once it
        // has the run's lock: a leased one is handed back a moment later, a
        // held one simply stays unsettled.
        if shmem::cancel_requested(index, &run) {
            self.leave(command, false);
            return;
        }
        crate::attempt_record::write(command.command_id.as_bytes(), command.attempt);
        if command.held_attempt.is_none() {
            self.run_leased(index, command);
            return;
        }
        let grouped = may_group && groupable(command.handler);
        if !grouped || self.group.as_ref().is_some_and(|g| g.members.len() >= GROUP_SIZE || g.owner != command.owner) {
            self.close_group();
        }
        if grouped && self.group.is_none() {
            self.group = Some(Group {
                owner: command.owner,
                members: Vec::new(),
                successes_before: self.successes.len(),
                subtransaction: Subtransaction::begin(),
            });
        }
        // when the attempt started: what its context and its attempt row say
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        let started = spans::timestamp_from_pg(now);
        let group = self.group.as_ref().filter(|_| grouped).map(|g| &g.subtransaction);
        let outcome = attempt(index, command, group, now, Some(now + FAST_BUDGET_US));
        if let Attempted::Succeeded(result) = outcome {
            self.successes.push((command, result, started));
            if let Some(group) = self.group.as_mut().filter(|_| grouped) {
                group.members.push(command);
            }
            return;
        }
        if grouped {
            // The attempt rolled the group back (its members' writes and this
            // one's): the members run again, each alone, and this attempt is
            // concluded with its failure (again alone if its writes were to be kept).
            let group = self.group.take().expect("a grouped attempt has a group");
            self.successes.truncate(group.successes_before);
            shmem::observe("group_reruns", group.members.len() as u64);
            for member in group.members {
                self.run(index, member, false);
            }
            if let Attempted::FailedKeepingWrites(_) = outcome {
                self.run(index, command, false);
                return;
            }
        }
        match outcome {
            Attempted::Succeeded(_) => unreachable!(),
            Attempted::Failed(failure) if failure.class == Class::Cancelled => {
                if shmem::cancel_requested(index, &run) {
                    // Counted now, while this chunk holds the command: the
                    // cancel gets the run once the chunk commits, when nothing
                    // (shared memory, the attempt record) names it any more.
                    settle::void_held(&command.id(), started, self.worker, "cancelled");
                    self.leave(command, true);
                } else {
                    // (a cancel signal meant for the attempt before it)
                    settle::void_held(&command.id(), started, self.worker, "late_cancel");
                }
            }
            // (counted, not charged: due again once this chunk commits, when
            // the claims start from before it again)
            Attempted::Failed(failure) if failure.class == Class::Demoted => {
                self.demoted = true;
                shmem::observe("demoted", 1);
                settle::void_held(&command.id(), started, self.worker, "demoted");
                shmem::wake_at_commit(command.due_at.into_inner() - 1);
            }
            Attempted::Failed(failure) | Attempted::FailedKeepingWrites(failure) => {
                // Successes before this failure settle first: they happened first.
                self.settle_successes();
                // (this chunk holds the command: it must not wait for the run, see
                // flow._settle_failure's wait_for_run; a run locked elsewhere leaves
                // the attempt to whoever holds it, a cancel)
                let settled = settle::settle_failure(&command.id(), &failure, started, self.worker, RunWait::Never);
                if settled == (Settled::Failed { retry: false }) {
                    self.failed_runs.insert(run);
                }
            }
        }
    }

    /// A leased attempt: its handler and its settlement share a subtransaction
    /// of their own, and its run is locked at the settlement (waited for:
    /// this transaction holds no command's row). A lease that is no longer
    /// ours by then (a cancel, the run's failure or deadline ended the
    /// command while its handler ran) settles nothing, and the handler's
    /// writes roll back with the subtransaction.
    fn run_leased(&mut self, index: usize, command: &'a Claimed) {
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        let started = spans::timestamp_from_pg(now);
        SPAWNED_IN_CHUNK.with(|s| s.set(false));
        let whole = Subtransaction::begin();
        let budget = command.fast.then_some(now + FAST_BUDGET_US);
        let settled = match attempt(index, command, None, now, budget) {
            Attempted::Succeeded(result) => {
                let spawned = SPAWNED_IN_CHUNK.with(|s| s.get());
                match settle::settle_leased_success(command, result, started, self.worker, spawned) {
                    LeasedSettled::Settled => true,
                    // (a handler that cancelled its own run: its cancel closed
                    // the command, and commits with its attempt)
                    LeasedSettled::NotOurs => ENDED_OWN_RUN.with(|e| e.replace(false)),
                    LeasedSettled::RunLocked => {
                        whole.end(false);
                        self.run_stayed_locked(command);
                        return;
                    }
                }
            }
            Attempted::Failed(failure) if failure.class == Class::Cancelled => {
                whole.end(true);
                self.leave(command, true);
                return;
            }
            Attempted::Failed(failure) if failure.class == Class::Demoted => {
                whole.end(false);
                self.demoted = true;
                shmem::observe("demoted", 1);
                self.released_now.push(HandBack {
                    id: command.command_id,
                    token: command.lease_token,
                    voided: Some("demoted"),
                });
                return;
            }
            Attempted::Failed(failure) | Attempted::FailedKeepingWrites(failure) => {
                match settle::settle_failure(&command.id(), &failure, started, self.worker, RunWait::Briefly) {
                    Settled::Failed { retry: false } => {
                        self.failed_runs.insert(*command.run_id.as_bytes());
                        true
                    }
                    Settled::Failed { retry: true } => true,
                    Settled::Expired => false,
                    Settled::Locked => {
                        whole.end(false);
                        self.run_stayed_locked(command);
                        return;
                    }
                }
            }
        };
        whole.end(settled);
    }

    /// A leased attempt whose run stayed locked elsewhere at its settlement
    /// (settle::LeasedSettled::RunLocked): its writes are rolled back, it is
    /// voided and handed back a moment later (HAND_BACK_DELAY: whoever holds
    /// the run, say a client idle in its transaction, is not raced at once),
    /// and the chunk ends, letting go of the runs it settled so far.
    fn run_stayed_locked(&mut self, command: &Claimed) {
        self.handed_back.push(HandBack {
            id: command.command_id,
            token: command.lease_token,
            voided: Some("run_locked"),
        });
        self.cut_short = true;
    }

    /// Leave a cancelled command to the cancel (see `run`). `started`: its
    /// attempt had started; a leased one handed back after the cancel's
    /// moment is then voided (counted, not charged): the cancel concluded
    /// it first, unless it was meant for an earlier attempt.
    fn leave(&mut self, command: &Claimed, started: bool) {
        match command.held_attempt {
            None => self.handed_back.push(HandBack {
                id: command.command_id,
                token: command.lease_token,
                voided: started.then_some("late_cancel"),
            }),
            Some(_) => self.left.push(command.command_id),
        }
    }

    /// Keep the open group's subtransaction, if any: its members' writes
    /// join the chunk's transaction.
    fn close_group(&mut self) {
        if let Some(group) = self.group.take() {
            group.subtransaction.end(true);
        }
    }

    /// Settle the successes; returns the commands to hand back, and the held
    /// ones left to a cancel. The worker releases the first a moment later
    /// (HAND_BACK_DELAY), and claims none of the others meanwhile: a cancel
    /// that interrupted their handlers takes their run's lock (for a run
    /// without a row of its own, its root's) once this chunk commits, and
    /// must find them as they were, not claimed and run again. If the cancel
    /// rolled back instead, they run again.
    pub fn finish(mut self) -> Finished {
        self.close_group();
        self.settle_successes();
        Finished {
            handed_back: std::mem::take(&mut self.handed_back),
            left: std::mem::take(&mut self.left),
            released_now: std::mem::take(&mut self.released_now),
        }
    }

    fn settle_successes(&mut self) {
        if self.successes.is_empty() {
            return;
        }
        let (mut ids, mut tokens, mut results, mut starts, mut held, mut rows) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (command, result, started) in self.successes.drain(..) {
            if command.held_attempt.is_some() && command.row_at.is_none() {
                // (settled by its row: without it, its writes would commit unsettled)
                error!("flow: a held command was claimed without its row");
            }
            ids.push(command.command_id);
            tokens.push(command.lease_token);
            results.push(result);
            starts.push(started);
            held.push(command.held_attempt);
            rows.push(command.row_at);
        }
        // Built once, in the chunk's memory context: every try reuses them.
        // (flow._settle_batch counts what it settled, at commit.)
        let spawned = SPAWNED_IN_CHUNK.with(|s| s.get());
        let args = [
            ids.into(),
            tokens.into(),
            results.into(),
            starts.into(),
            held.into(),
            self.worker.into(),
            rows.into(),
            spawned.into(),
        ];
        // (held commands only: leased ones settle one by one, run_leased)
        // Not in a subtransaction: this transaction locked the rows it
        // updates, and a row locked by a transaction and updated by its
        // subtransaction gets a MultiXact as its xmax. Index entries of such
        // a row version are never marked dead by the scans that pass them
        // (only VACUUM removes them), so every claim would walk all the
        // commands settled since the last vacuum. Nothing here waits for a
        // lock, so a transient error has nothing to retry; any error goes up
        // to the chunk, which is contained.
        gucs::inject_fault("settle_success");
        settle::settle_batch(&args);
    }
}

/// Why an attempt fails before its handler starts, if it does: its deadline
/// passed, or its args no longer fit the definition's args_type (retrying
/// cannot fix them, as the reference's decode step; checked as the owner
/// through the gateway, so whatever a domain's check does fails this
/// command alone and is undone).
fn refused_before_start(command: &Claimed, remaining_ms: Option<i64>) -> Option<Failure> {
    if let Some(ms) = remaining_ms.filter(|ms| *ms <= 0) {
        return Some(Failure::timeout(ms));
    }
    let args_type = command.args_type?;
    let message = match gateway::check_args(command.owner, args_type, &command.args.to_text()) {
        Ok(misfit) => misfit?,
        Err(caught) => spi::caught_report(&caught).message().to_string(),
    };
    Some(Failure::new(Class::Permanent, "argument_decode", message))
}

/// How an attempt ended.
enum Attempted {
    Succeeded(Option<Jsonb>),
    /// Its writes were rolled back.
    Failed(Failure),
    /// flow.fail(keep_writes => true): its writes are kept.
    FailedKeepingWrites(Failure),
}

/// Run a command's handler in its own subtransaction, or in `group`'s (see
/// GROUP_SIZE). On success the subtransaction is kept (its writes commit
/// with the chunk's settlement); on failure it is rolled back and the
/// failure classified — a group's too, whatever the failure. `demote_at`:
/// a held attempt's budget ends then (see FAST_BUDGET_US).
fn attempt(
    index: usize,
    command: &Claimed,
    group: Option<&Subtransaction>,
    now: i64,
    demote_at: Option<i64>,
) -> Attempted {
    let deadline = command.deadline(now);
    let remaining_ms = deadline.map(|d| (d - now) / 1000);
    // the statement timer fires at the deadline, or at the budget's end before it
    let timer_ms = match (deadline, demote_at) {
        (Some(d), Some(b)) => Some((d.min(b) - now) / 1000),
        (d, b) => d.or(b).map(|at| (at - now) / 1000),
    };
    let demoted = move || demote_at.is_some_and(|at| unsafe { pg_sys::GetCurrentTimestamp() } >= at);
    if let Some(failure) = refused_before_start(command, remaining_ms) {
        if let Some(group) = group {
            group.end(false);
        }
        return Attempted::Failed(failure);
    }

    outcome::forget_decisions();
    let run = *command.run_id.as_bytes();
    let started = std::time::Instant::now();
    let body = || {
        CURRENT_COMMAND.with(|c| c.set(Some(*command.command_id.as_bytes())));
        CURRENT_RUN.with(|c| c.set(Some(run)));
        ENDED_OWN_RUN.with(|e| e.set(false));
        gucs::inject_fault("handler_start");
        // The deadline covers what fires when the handler returns, too.
        let result = with_deadline(timer_ms, remaining_ms, || {
            outcome::noting_error_code(|| {
                gateway::run_handler(command.owner, || handler_call::call_handler(command, deadline, now))
            })
        });
        CURRENT_COMMAND.with(|c| c.set(None));
        CURRENT_RUN.with(|c| c.set(None));
        gucs::inject_fault("handler_return");
        // Test-only: die with the handler's writes done and nothing settled.
        gucs::inject_fault("before_settle");
        // What happened to the attempt beats what the handler returned: a
        // handler that caught its own timeout or a cancel and returned
        // normally is still timed out or cancelled, and one that caught an
        // invalid spawn or emit still made an invalid decision.
        // (PostgreSQL resets the timer's indicator when it raises the
        // cancel, so the clock tells whether the deadline passed.)
        if deadline.is_some_and(|d| unsafe { pg_sys::GetCurrentTimestamp() } >= d) {
            return Err(Failure::timeout(0));
        }
        if demoted() {
            return Err(Failure::demoted());
        }
        if shmem::cancel_requested(index, &run) {
            return Err(Failure::cancelled());
        }
        if let Some(invalid) = outcome::take_invalid_decision() {
            return Err(invalid);
        }
        let size = result.as_ref().map(Jsonb::text_size);
        if let Some(size) = size.filter(|s| *s > gucs::max_result_bytes() as usize) {
            let limit = gucs::max_result_bytes();
            let message = format!("handler result is {size} bytes, over flow.max_result_bytes ({limit})");
            return Err(Failure::new(Class::Permanent, "result_too_large", message));
        }
        // flow.fail(keep_writes => true): keep the subtransaction, fail the command.
        if let Some(kept) = outcome::take_kept_failure() {
            return Ok(Err(kept));
        }
        Ok(Ok(result))
    };
    let signals_before = note_cancel_signals(index);
    let on_error = |caught| {
        let late_cancel = shmem::cancel_signals(index) != signals_before;
        let failure = outcome::classify(caught, deadline, shmem::cancel_requested(index, &run), late_cancel);
        // (cut at the budget's end, before its deadline: whatever it raised
        // then, the statement timer's cancel included, it was this)
        let past_deadline = deadline.is_some_and(|d| unsafe { pg_sys::GetCurrentTimestamp() } >= d);
        if !past_deadline && failure.class != Class::Cancelled && demoted() {
            return Failure::demoted();
        }
        failure
    };
    let outcome = match group {
        None => in_subtransaction(body, on_error),
        Some(group) => {
            let outcome = spi::catching(body, on_error);
            if !matches!(outcome, Ok(Ok(_))) {
                group.end(false);
            }
            outcome
        }
    };
    CURRENT_COMMAND.with(|c| c.set(None));
    CURRENT_RUN.with(|c| c.set(None));
    stop_deadline_timer();
    shmem::observe("handler_us", started.elapsed().as_micros() as u64);
    claim::note_handler_time(command.handler, started.elapsed());
    // A cancel that comes late, after the handler, must not hit the cleanup.
    spi::holding_off_cancels(gateway::after_handler);
    match outcome {
        Ok(Ok(result)) => Attempted::Succeeded(result),
        Ok(Err(kept)) => {
            note_handler_failed(command.handler);
            Attempted::FailedKeepingWrites(kept)
        }
        Err(failure) => {
            note_handler_failed(command.handler);
            Attempted::Failed(failure)
        }
    }
}

thread_local! {
    /// flow.cancel's signals to this worker when its last attempt started.
    static CANCEL_SIGNALS_AT_START: Cell<u32> = const { Cell::new(0) };
}

/// At an attempt's start: how many cancels flow.cancel had sent this worker
/// when the attempt before it started (see shmem::cancel_signals).
fn note_cancel_signals(index: usize) -> u32 {
    CANCEL_SIGNALS_AT_START.with(|c| c.replace(shmem::cancel_signals(index)))
}

/// A handler that swallows its own timeout (catches query_canceled in a
/// loop) would hold its worker, and the batch it claimed, forever. This long
/// after its deadline the worker stops itself: `die` makes the handler's next
/// interrupt check a FATAL, which no exception block catches, and recovery
/// concludes the attempt as interrupted (so a poison handler still reaches
/// its attempt limit).
const HARD_STOP_GRACE_MS: i64 = 2000;
/// PostgreSQL 15's first user-defined TimeoutId; RegisterTimeout allocates a
/// free one from there.
const USER_TIMEOUT: u32 = 12;
static HARD_STOPPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
thread_local! {
    static HARD_STOP_TIMEOUT: Cell<Option<u32>> = const { Cell::new(None) };
}

unsafe extern "C-unwind" fn hard_stop() {
    // A signal handler: only flags and the latch, as PostgreSQL's own `die`.
    HARD_STOPPED.store(true, std::sync::atomic::Ordering::Relaxed);
    unsafe {
        pg_sys::ProcDiePending = 1;
        pg_sys::InterruptPending = 1;
        pg_sys::SetLatch(pg_sys::MyLatch);
    }
}

/// Register the hard-stop timeout; called once when a worker starts.
pub fn register_hard_stop() {
    let id = unsafe { RegisterTimeout(USER_TIMEOUT, Some(hard_stop)) };
    HARD_STOP_TIMEOUT.with(|t| t.set(Some(id)));
}

/// Whether this process stopped itself because a handler ignored its deadline.
pub fn hard_stopped() -> bool {
    HARD_STOPPED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Run `f` with the statement timer set to fire in `timer_ms`, and the hard
/// stop HARD_STOP_GRACE_MS after the deadline, in `deadline_ms`.
fn with_deadline<R>(timer_ms: Option<i64>, deadline_ms: Option<i64>, f: impl FnOnce() -> R) -> R {
    unsafe {
        if let Some(ms) = timer_ms {
            enable_timeout_after(STATEMENT_TIMEOUT, ms.clamp(1, i32::MAX as i64) as c_int);
        }
        if let (Some(ms), Some(id)) = (deadline_ms, HARD_STOP_TIMEOUT.with(|t| t.get())) {
            enable_timeout_after(id, (ms + HARD_STOP_GRACE_MS).clamp(1, i32::MAX as i64) as c_int);
        }
    }
    let result = f();
    stop_deadline_timer();
    result
}

/// Disarm the attempt timer and drop a cancel it may have requested too late
/// to hit the handler, so it cannot hit the engine's own SQL.
fn stop_deadline_timer() {
    unsafe {
        if let Some(id) = HARD_STOP_TIMEOUT.with(|t| t.get()) {
            disable_timeout(id, false);
        }
        disable_timeout(STATEMENT_TIMEOUT, false);
        if get_timeout_indicator(STATEMENT_TIMEOUT, true) {
            pg_sys::QueryCancelPending = 0;
        }
    }
}
