//! The in-database worker: `flow.workers` background processes, each running
//! probe → claim → execute → settle (engine rules 1–9).
//!
//! Skeleton (after pg_cron): signals first, connect, register in shared
//! memory, recover what dead owners left, then loop: reload settings if
//! flagged, one bounded unit of work per transaction, wait on the latch until
//! the next due time. Errors outside a handler are caught per transaction and
//! never kill the worker; a handler's own errors never leave its
//! subtransaction (src/execute.rs). Upkeep (recovery, retention) is the
//! maintenance worker's (src/maintenance.rs): nothing waits behind a handler
//! for it.
//!
//! What a worker claims starts now (src/claim.rs, `keep_what_starts_now`):
//! held commands of handlers known to be fast, run in the claim's own
//! transaction under a time budget; leased commands of fast handlers
//! (limited queues), run in chunks; and one command of a handler that may be
//! slow (while no other worker is idle, those too that start within
//! CLAIM_AHEAD), each run in a transaction of its own with no run locked
//! while it runs (its run is locked at its settlement). Whatever a worker
//! claimed and has not started within CLAIM_TARGET goes back to its queue.

use crate::claim::{self, AttemptId, ClaimCursor, Claimed};
use crate::settle::HandBack;
use crate::spi::{self, engine_query, transaction, try_transaction};
use crate::{attempt_record, execute, gateway, gucs, maintenance, settle, shmem, spans};
use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, SignalWakeFlags};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::ffi::{c_int, CString};
use std::time::{Duration, Instant};

/// Adds the time from its start to `running` when dropped: a chunk's run,
/// however it ends (an ERROR in a handler's chunk unwinds through it too).
struct RunningTime<'a>(&'a Cell<Duration>, Instant);

impl Drop for RunningTime<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get() + self.1.elapsed());
    }
}

/// A worker claims about this much work at a time (see `claim_size`), and
/// hands back what it claimed and has not started this long after its claim
/// (see `run_batch`), so that an idle worker takes it.
const CLAIM_TARGET: Duration = Duration::from_millis(100);

/// While no other worker is idle, a claim takes the commands of handlers that
/// may be slow that would start within this long of it (three quarters of
/// CLAIM_TARGET: one of a 50 ms handler after the first, both started before
/// what has not is handed back).
const CLAIM_AHEAD: Duration = Duration::from_millis(75);

/// A chunk of claimed commands commits once this much time has been spent on
/// it (its handlers' results become visible together at commit).
const CHUNK_BUDGET: Duration = Duration::from_millis(50);

/// A chunk that runs a group's backlog (a second command of one group) ends
/// once it has run this long if commands became due since its claim (another
/// group's, maybe): the claim after it goes round the groups again. (A whole
/// CHUNK_BUDGET of one group's backlog made a new group's first command wait
/// up to 50 ms for its turn: 999 new groups' p99 39-105 ms against 100.)
const GROUP_TURN: Duration = Duration::from_millis(10);

/// After a chunk failed outside its handlers, commands run one per chunk for this long, so a command that makes the
/// engine's SQL fail is found and settled alone.
const ISOLATION_PERIOD: Duration = Duration::from_secs(10);

/// Commands a cancel stopped stay claimed this long before they are handed
/// back: long enough for the cancel, which signals before it locks, to close
/// them first.
const HAND_BACK_DELAY: Duration = Duration::from_millis(1000);

/// How long a worker waits before claiming again when work is due that its
/// last claim got nothing of (its runs or queues locked elsewhere): about ten
/// empty claims a second (0.2.0 made 160, 10 ms apart), while a long
/// transaction holds a run. A commit that makes work due wakes it sooner.
const EMPTY_CLAIM_PAUSE: Duration = Duration::from_millis(100);
/// The smallest chunk window (see Worker::chunk_window).
const MIN_CHUNK_WINDOW: usize = 8;
/// The most a worker's first claim after it slept takes (see Worker::claim).
const FIRST_CLAIM_AFTER_SLEEP: i32 = 128;
/// How long claims may take up where the last one ended (see flow._claim)
/// before one starts from the queues' heads again: the longest a command that
/// became due behind the cursor waits when no commit said so (a command whose
/// chunk rolled back, or whose worker died). A commit that makes commands due
/// before the cursor (a run enqueued by a transaction that began earlier, a
/// command handed back) makes the next claim start from the heads at once
/// (shmem::DueFloors). A claim from a queue's head walks the index entries of
/// every command claimed since the last VACUUM: under a churn of 60,000
/// runs/s, 7,500 pages and 16 ms each.
const CURSOR_SPAN: Duration = Duration::from_millis(1000);

/// How much longer claims may take up where a chain of them begun at `since`
/// ended (zero: the next starts from the queues' heads).
fn cursor_time_left(since: Instant) -> Duration {
    CURSOR_SPAN.saturating_sub(since.elapsed())
}

unsafe extern "C-unwind" {
    /// PostgreSQL's SIGTERM handler for backends: a fast shutdown cancels a
    /// running handler at its next interrupt check (pgrx's only sets a flag).
    fn die(signal: c_int);
}

unsafe extern "C-unwind" fn terminate(signal: c_int) {
    unsafe { die(signal) };
}

/// Register the workers and the maintenance worker; called from `_PG_init`
/// while preloading.
pub fn register() {
    maintenance::register();
    for index in 0..gucs::workers() {
        BackgroundWorkerBuilder::new(&format!("flow worker {index}"))
            .set_type("flow worker")
            .set_library("flow")
            .set_function("flow_worker_main")
            .set_argument(Some(pg_sys::Datum::from(index)))
            .enable_spi_access()
            .set_restart_time(Some(Duration::from_secs(1)))
            .load();
    }
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn flow_worker_main(arg: pg_sys::Datum) {
    let index = arg.value();
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    unsafe {
        pg_sys::pqsignal(pg_sys::SIGTERM as c_int, Some(terminate));
    }
    BackgroundWorker::connect_worker_to_spi(Some(&gucs::database_name()), None);
    gateway::pin_worker_session();
    execute::register_hard_stop();
    spi::watch_plans();
    shmem::register_worker(index);
    attempt_record::open(index);
    unsafe { pg_sys::before_shmem_exit(Some(on_exit), pg_sys::Datum::from(index)) };
    report_activity("flow: starting");

    let mut worker = Worker::new(index);
    loop {
        if BackgroundWorker::sighup_received() {
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
        let mut sleep = worker.turn();
        if !worker.unreleased.is_empty() {
            sleep = sleep.min(HAND_BACK_DELAY / 4);
        }
        if !sleep.is_zero() {
            shmem::set_worker_state(index, false, None, 0);
            report_activity("flow: idle");
            shmem::set_sleeping(index, true);
            wait_on_latch(sleep);
            shmem::set_sleeping(index, false);
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_exit(_code: c_int, arg: pg_sys::Datum) {
    if execute::hard_stopped() {
        pgrx::log!("flow: a handler ran past its deadline and ignored its cancel; its worker stopped (the attempt is concluded as interrupted)");
    }
    // (its attempt record says which attempt it was in, if any: the
    // maintenance worker charges that one and hands the rest of its claim back)
    shmem::unregister_worker(arg.value());
}

/// How far a chunk got (`Worker::run_chunk`): how many commands it entered,
/// and whether it was cut short by its limits (time, subtransaction ids,
/// SET CONSTRAINTS) rather than running out of commands.
#[derive(Default, Clone, Copy)]
struct ChunkRun {
    ran: usize,
    cut: bool,
}

/// What a claim's own transaction did (`Worker::claim_and_run_held`).
struct HeldTurn {
    /// Commands claimed, and of those held (and run or not in this transaction).
    claimed: usize,
    held: usize,
    run: ChunkRun,
    /// The runs of the held commands that ran.
    runs: Vec<[u8; 16]>,
    /// The leased ones, their claim committed: to run next.
    leased: Vec<Claimed>,
    /// Held commands the chunk did not reach: due again, unchanged.
    not_run: Vec<Claimed>,
}

struct Worker {
    index: usize,
    name: String,
    backend_start: Option<TimestampWithTimeZone>,
    /// Rotates which queue is offered first (rule 2).
    turn: Cell<i32>,
    /// The extension was found installed by the last check.
    ready: bool,
    /// Recent time per command (µs, moving average), to size the next claim.
    per_command_us: f64,
    /// Time spent running commands (run_chunk) since per_command_us was last noted.
    running: Cell<Duration>,
    /// The last claim came back short of its size (see turn).
    took_all_due: Cell<bool>,
    /// The worker slept since its last claim (see claim).
    slept: Cell<bool>,
    /// Since when claims have taken up from a cursor, and where the last full
    /// claim ended in each queue (None: the next claim starts at the heads).
    cursor: RefCell<Option<(Instant, ClaimCursor)>>,
    /// How many commands the next chunk locks runs for and may run (see run_batch).
    chunk_window: usize,
    /// Until when chunks hold one command each (see ISOLATION_PERIOD).
    isolate_until: Option<Instant>,
    /// Claimed commands to hand back to their queue (flow._release), with
    /// when they were put aside: released HAND_BACK_DELAY later, and tried
    /// again each turn while their row is locked elsewhere.
    unreleased: Vec<(HandBack, Instant)>,
    /// Held commands left to a cancel, and when: not claimed again for
    /// HAND_BACK_DELAY (see execute::Chunk::finish).
    left_to_cancels: RefCell<Vec<(pgrx::Uuid, Instant)>>,
}

impl Worker {
    fn new(index: usize) -> Self {
        Worker {
            index,
            name: format!("{}:{}", gucs::database_name(), unsafe { pg_sys::MyProcPid }),
            backend_start: spans::timestamp_from_pg(unsafe { pg_sys::MyStartTimestamp }),
            turn: Cell::new(index as i32),
            ready: false,
            per_command_us: 0.0,
            running: Cell::new(Duration::ZERO),
            isolate_until: None,
            unreleased: Vec::new(),
            left_to_cancels: RefCell::new(Vec::new()),
            chunk_window: usize::MAX,
            took_all_due: Cell::new(false),
            slept: Cell::new(false),
            cursor: RefCell::new(None),
        }
    }

    /// One unit of work; returns how long to sleep (zero: go on at once).
    fn turn(&mut self) -> Duration {
        let idle = gucs::poll_interval();
        // First, whatever happens below: commands put aside must not stay claimed.
        self.release_handed_back();
        if !gucs::enabled() {
            return idle;
        }
        if !self.ready {
            self.ready = transaction(extension_installed).unwrap_or(false);
            if !self.ready {
                return idle;
            }
        }
        // A claim that came back short took everything due then; anything due
        // since was committed with a wake-up (this worker's latch is set if
        // no other worker was idle), so the turn right after it skips the claim.
        let skip_claim = self.took_all_due.replace(false);
        if !skip_claim {
            let claimed_at = Instant::now();
            let Some((claimed, leased)) = self.claim_and_run_held() else { return self.failed_turn() };
            if !leased.is_empty() {
                self.run_batch(leased, claimed_at);
            }
            if claimed > 0 {
                return Duration::ZERO;
            }
        }
        // (from where the claims take up, while they may: see claim; a commit
        // that made a command due behind the cursor, as it may while the claim
        // is skipped, sends the look to the queues' heads)
        let floor = shmem::peek_due_floor(self.index);
        let cursor = self
            .cursor
            .borrow()
            .as_ref()
            .filter(|(since, c)| !cursor_time_left(*since).is_zero() && c.latest().is_some_and(|at| at <= floor))
            .cloned();
        let sleep = match transaction(|| next_due_ms(cursor.as_ref().map(|(_, at)| at))) {
            Some(Some(ms)) if ms > 0 => idle.min(Duration::from_millis(ms as u64)),
            // Due now in a queue with room: it came due after the claim (or the
            // claim was skipped), so claim again, after a breath in case what
            // holds it back is a lock (a run or a limited queue locked elsewhere).
            Some(Some(_)) if skip_claim => Duration::ZERO,
            Some(Some(_)) => EMPTY_CLAIM_PAUSE,
            Some(None) => idle,
            None => return self.failed_turn(),
        };
        // what is due behind the cursor is seen once it runs out
        let sleep = cursor.map_or(sleep, |(since, _)| sleep.min(cursor_time_left(since)));
        if !sleep.is_zero() && spi::plans_may_be_stale() {
            // (a failure is logged; the plans are then made at the next claim, as before)
            let _ = transaction(|| warm_plans(&self.name, self.backend_start));
            // A sleeping worker learns of the change only at its next
            // transaction, and would plan at its first claim of the next
            // burst, after the worker that woke it (3-4 ms of a 150 ms
            // drain of 20,000 was the second worker planning its claim).
            // Wake them to plan now; one whose plans are fresh sleeps again.
            shmem::wake_sleeping_workers();
        }
        if !sleep.is_zero() {
            self.slept.set(true);
        }
        sleep
    }

    /// Release the handed-back commands put aside at least HAND_BACK_DELAY ago.
    fn release_handed_back(&mut self) {
        let (due, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.unreleased).into_iter().partition(|(_, at)| at.elapsed() >= HAND_BACK_DELAY);
        self.unreleased = waiting;
        let due: Vec<HandBack> = due.into_iter().map(|(c, _)| c).collect();
        self.release_now(&due);
    }

    /// Give these leased commands back to their queues now (flow._release,
    /// which wakes the workers); those whose row is locked elsewhere are
    /// tried again next turn.
    fn release_now(&mut self, commands: &[HandBack]) {
        if commands.is_empty() {
            return;
        }
        self.forget_cursor(); // what goes back to its queue is behind it
        let still_locked = transaction(|| settle::release(commands)).unwrap_or_else(|| commands.to_vec());
        self.release_later(still_locked, true);
    }

    /// Put commands aside to release HAND_BACK_DELAY from now, or (`now`) at
    /// the start of the next turn.
    fn release_later(&mut self, commands: Vec<HandBack>, now: bool) {
        let at = if now { Instant::now() - HAND_BACK_DELAY } else { Instant::now() };
        self.unreleased.extend(commands.into_iter().map(|c| (c, at)));
    }

    fn isolating(&self) -> bool {
        self.isolate_until.is_some_and(|until| Instant::now() < until)
    }

    /// Claim, and run the held commands at once, in the claim's own
    /// transaction: each is written once, when it is settled, and nothing is
    /// committed before its handler starts (see flow._claim). Returns how
    /// many were claimed and the leased ones, committed, to run next; None if
    /// the transaction failed.
    fn claim_and_run_held(&mut self) -> Option<(usize, Vec<Claimed>)> {
        let isolating = self.isolating();
        let entered = RefCell::new(Vec::new());
        // (the chunk said which runs it holds: shmem::publish_busy_runs)
        let published_busy = Cell::new(false);
        let outcome = try_transaction(|| {
            let claimed = self.claim();
            let count = claimed.len();
            let (held, mut leased): (Vec<_>, Vec<_>) = claimed.into_iter().partition(|c| c.held_attempt.is_some());
            // One owner's handlers in this transaction: the first held
            // command's. The others' are leased instead and run in their own.
            let owner = held.first().map(|c| c.owner);
            let (held, others): (Vec<_>, Vec<_>) = held.into_iter().partition(|c| Some(c.owner) == owner);
            leased.extend(claim::lease_instead(&self.name, self.backend_start, others));
            // The runs the claim locked for its held commands (all but a
            // root's, held alone: see flow._claim), for the other workers'
            // claims to leave alone while the chunk runs.
            let mut busy: Vec<[u8; 16]> =
                held.iter().filter(|c| c.command_id != c.run_id).map(|c| *c.run_id.as_bytes()).collect();
            busy.sort_unstable();
            busy.dedup();
            if !busy.is_empty() {
                shmem::publish_busy_runs(self.index, &busy);
                published_busy.set(true);
            }
            if owner.is_none() && !leased.is_empty() {
                commit_leases_without_flush();
            }
            let mut run = ChunkRun::default();
            if let Some(owner) = owner {
                gateway::begin_owner(owner);
                report_activity(&format!("flow: running {} held commands", held.len()));
                let mut chunk = execute::Chunk::held(&self.name, &held);
                run = self.run_chunk(&mut chunk, &held, &entered, isolating);
                let at = Instant::now();
                self.left_to_cancels.borrow_mut().extend(chunk.finish().left.into_iter().map(|id| (id, at)));
            }
            HeldTurn {
                claimed: count,
                held: held.len(),
                runs: held[..run.ran].iter().map(|c| *c.run_id.as_bytes()).collect(),
                run,
                leased,
                not_run: held.into_iter().skip(run.ran).collect(),
            }
        });
        if published_busy.get() {
            shmem::publish_busy_runs(self.index, &[]);
        }
        shmem::set_worker_state(self.index, true, None, 0);
        if outcome.is_err() {
            self.forget_cursor(); // its claims rolled back: they are behind it
        }
        let turn = match outcome {
            Ok(HeldTurn { claimed, held, run, runs, leased, not_run }) => {
                if !not_run.is_empty() {
                    // the held commands not run stay due: the next claim
                    // starts at them, and so do the other workers', whose
                    // cursors may have taken up past them from this one's
                    shmem::publish_cursor(self.index, &[], 0);
                    // (a microsecond before: see claim::keep_what_starts_now)
                    if let Some(earliest) = not_run.iter().map(|c| c.due_at.into_inner()).min() {
                        shmem::note_due_again(earliest - 1);
                    }
                    if let Some((_, cursor)) = self.cursor.borrow_mut().as_mut() {
                        not_run.iter().for_each(|command| cursor.rewind_to(command));
                    }
                }
                if held > 0 {
                    // Those not run (the chunk was cut short) stay due, unchanged.
                    self.next_window(run);
                    shmem::clear_cancels(self.index, &runs);
                    self.note_time_per_command(run.ran);
                }
                Some((claimed, leased))
            }
            // The claim itself failed (the extension is being changed, ...).
            Err(_) if entered.borrow().is_empty() => None,
            Err((message, sqlstate)) => {
                // A held handler's chunk failed outside the handler. Everything
                // the transaction did rolled back: the held commands and the
                // leased claims alike are due again, uncharged.
                self.contain(&entered.borrow(), &message, &sqlstate, &[]);
                Some((1, Vec::new()))
            }
        };
        // Committed: the held attempts are over. Rolled back: the record named
        // them until `contain` counted them, for a cancel that takes their run
        // meanwhile counts what the record names (flow._close_open_commands).
        attempt_record::clear();
        turn
    }

    /// Run the commands of `window` in `chunk`, in the current transaction,
    /// until the chunk's limits; returns how many were entered.
    /// (The chunk window follows: see `next_window`.)
    fn run_chunk<'a>(
        &self,
        chunk: &mut execute::Chunk<'a>,
        window: &'a [Claimed],
        entered: &RefCell<Vec<AttemptId>>,
        isolating: bool,
    ) -> ChunkRun {
        let chunk_started = Instant::now();
        let mut ran = 0;
        let _noted = RunningTime(&self.running, chunk_started);
        let mut groups_run = HashSet::new();
        for command in window {
            let (id, run) = (*command.command_id.as_bytes(), *command.run_id.as_bytes());
            shmem::set_worker_state(self.index, true, Some((id, run, command.held_attempt.is_some())), 1);
            // Order matters: a cancel sets its flag before it signals, so
            // either the chunk sees the flag or its SIGINT reaches the handler.
            unsafe { pg_sys::QueryCancelPending = 0 };
            entered.borrow_mut().push(command.id());
            chunk.execute(self.index, command);
            ran += 1;
            // (a command of a handler that may be slow commits alone: its
            // result is not kept back by the next one's run)
            if isolating
                || !command.fast
                || chunk.must_end()
                || chunk_started.elapsed() >= CHUNK_BUDGET
                || (command.group != 0
                    && !groups_run.insert(command.group)
                    && chunk_started.elapsed() >= GROUP_TURN
                    && shmem::peek_due_floor(self.index) < i64::MAX)
                || execute::subxid_cache_nearly_full()
                || gateway::constraint_state_changed()
            {
                return ChunkRun { ran, cut: true };
            }
        }
        ChunkRun { ran, cut: false }
    }

    /// How many commands the next chunk may take: as many as a chunk cut
    /// short (time, subtransaction ids) managed; twice the window after one
    /// that ran all it had. Held commands a chunk does not reach were claimed
    /// for nothing, so the claim is no bigger than the window.
    fn next_window(&mut self, run: ChunkRun) {
        self.chunk_window = if run.cut { run.ran.max(MIN_CHUNK_WINDOW) } else { self.chunk_window.saturating_mul(2) };
    }

    /// A chunk failed outside its handlers (the engine's SQL for one of its
    /// commands) and everything in it rolled back. Contain it: the attempts
    /// it had started (`entered`) are voided (counted, not charged) and the
    /// leased rest of the batch (`batch`) goes back to its queues uncharged,
    /// and commands run one per chunk for a while. A one-command chunk that
    /// fails is the culprit: it alone is settled, with the real error, and
    /// retried by its policy.
    fn contain(&mut self, entered: &[AttemptId], message: &str, sqlstate: &str, batch: &[AttemptId]) {
        self.forget_cursor(); // what goes back to its queue is behind it
        gucs::inject_fault("chunk_failed");
        let culprit = if self.isolating() { entered.last().copied() } else { None };
        self.isolate_until = Some(Instant::now() + ISOLATION_PERIOD);
        let name = self.name.clone();
        let is_culprit = |c: &AttemptId| culprit.is_some_and(|k| k.command_id == c.command_id);
        let started = |c: &AttemptId| entered.iter().any(|e| e.command_id == c.command_id);
        let contained = try_transaction(|| {
            culprit.iter().all(|c| settle::settle_engine_error(c, message, sqlstate, &name)).then(|| {
                let now = spans::timestamp_from_pg(unsafe { pg_sys::GetCurrentTimestamp() });
                for held in entered.iter().filter(|c| c.held_attempt.is_some() && !is_culprit(c)) {
                    settle::void_held(held, now, &name, "engine_error");
                }
                let leased: Vec<HandBack> = entered
                    .iter()
                    .chain(batch.iter().filter(|c| !started(c)))
                    .filter(|c| c.held_attempt.is_none() && !is_culprit(c))
                    .map(|c| HandBack {
                        id: c.command_id,
                        token: c.lease_token,
                        voided: started(c).then_some("engine_error"),
                    })
                    .collect();
                settle::release(&leased)
            })
        });
        if let Ok(Some(locked_elsewhere)) = contained {
            self.release_later(locked_elsewhere, true);
        } else {
            // Not even that could be written: exit, and the maintenance
            // worker concludes what this worker's record names.
            pgrx::warning!("flow: a batch failed outside its handlers and could not be settled; restarting the worker");
            unsafe { pg_sys::proc_exit(1) };
        }
        spi::forget_plans();
    }

    /// Note how long the last `count` commands took to run: their handlers
    /// and what runs around each (run_chunk), not the claim, the settlement
    /// and the commit that a batch pays once whatever its size. (Counted in,
    /// those made single commands, each with its commit, look like 1-2 ms of
    /// work each, and the next burst's first claims were a hundred commands
    /// or so, growing over ten batches: a drain of 20,000 right after a
    /// pickup of 500 single commands ran 0.83-0.96x the drain after it.)
    fn note_time_per_command(&mut self, count: usize) {
        let elapsed = self.running.replace(Duration::ZERO);
        if count == 0 {
            return;
        }
        // (never 0, which claim_size reads as nothing measured yet)
        let per_command = (elapsed.as_secs_f64() * 1e6 / count as f64).max(0.001);
        // (a fall to a tenth is taken at once: the first command of a handler
        // this worker had not seen, claimed alone, seeds the average, which
        // then took some ten chunks to come down, claims growing by half each)
        self.per_command_us = if self.per_command_us == 0.0 || per_command < self.per_command_us / 10.0 {
            per_command
        } else {
            0.7 * self.per_command_us + 0.3 * per_command
        };
        gucs::log(&format!("flow: ran {count} commands in {} ms (their chunks' runs)", elapsed.as_millis()));
    }

    /// Execute leased commands (their claim is committed) in chunks, one
    /// transaction each, each of one owner's commands: grouped by owner (in
    /// the order their first commands came), a chunk ends where its owner's
    /// group does. A leased command holds no lock while its handler runs:
    /// its run is locked at its settlement, right after (execute::Chunk).
    /// What has not started CLAIM_TARGET after the claim (`claimed_at`) goes
    /// back to its queue at once, uncharged, for an idle worker to take.
    fn run_batch(&mut self, mut claimed: Vec<Claimed>, claimed_at: Instant) {
        let mut first_seen: Vec<pg_sys::Oid> = Vec::new();
        for command in &claimed {
            if !first_seen.contains(&command.owner) {
                first_seen.push(command.owner);
            }
        }
        // (and each owner's fast ones first: none waits behind a slow handler)
        claimed.sort_by_key(|c| (first_seen.iter().position(|o| *o == c.owner), !c.fast));
        let count = claimed.len();
        report_activity(&format!("flow: running {count} leased commands"));
        let mut rest: &[Claimed] = &claimed;
        let mut ran_in_all = 0;
        let isolating = self.isolating();
        while !rest.is_empty() {
            if claimed_at.elapsed() >= CLAIM_TARGET {
                self.hand_back(rest);
                break;
            }
            // The commands this chunk may run: as many as the last chunk
            // that ended early managed, or all.
            let owner = rest[0].owner;
            let same_owner = rest.iter().take_while(|c| c.owner == owner).count();
            let window = &rest[..same_owner.min(self.chunk_window)];
            let entered = RefCell::new(Vec::new());
            let this = &*self;
            let ran = try_transaction(|| {
                gateway::begin_owner(owner);
                let mut chunk = execute::Chunk::leased(&this.name, window);
                let run = this.run_chunk(&mut chunk, window, &entered, isolating);
                let finished = chunk.finish();
                (run, finished.handed_back, finished.released_now)
            });
            let failed = match ran {
                Ok((run, handed_back, released_now)) => {
                    self.next_window(run);
                    self.release_later(handed_back, false);
                    self.release_later(released_now, true);
                    let runs: Vec<[u8; 16]> = rest[..run.ran].iter().map(|c| *c.run_id.as_bytes()).collect();
                    shmem::clear_cancels(self.index, &runs);
                    rest = &rest[run.ran..];
                    ran_in_all += run.ran;
                    false
                }
                Err((message, sqlstate)) => {
                    let batch: Vec<AttemptId> = rest.iter().map(|c| c.id()).collect();
                    self.contain(&entered.borrow(), &message, &sqlstate, &batch);
                    true
                }
            };
            // its attempts are over (rolled back: once `contain` counted them)
            attempt_record::clear();
            if failed {
                break;
            }
        }
        shmem::set_worker_state(self.index, true, None, 0);
        // (the commands run: those a failed chunk left to `contain` were not)
        self.note_time_per_command(ran_in_all);
    }

    /// Give leased commands that did not start back to their queues now.
    fn hand_back(&mut self, commands: &[Claimed]) {
        let commands: Vec<HandBack> =
            commands.iter().map(|c| HandBack { id: c.command_id, token: c.lease_token, voided: None }).collect();
        self.release_now(&commands);
    }

    /// How many commands to claim: `flow.batch_size` for fast handlers, fewer
    /// for slow ones, so that one worker does not hoard a burst of slow
    /// commands while the others idle. Aims at a batch of about CLAIM_TARGET.
    /// `ahead`: this claim's claim_ahead.
    fn claim_size(&self, ahead: Option<Duration>) -> i32 {
        let max = gucs::batch_size();
        if self.per_command_us <= 0.0 {
            return 1; // nothing measured yet: learn from one command first
        }
        // Commands that take a slow handler's time: as many as the claim
        // keeps (claim::keep_what_starts_now), one, or those that start
        // within `ahead`. The rest, left locked, would make its commit send
        // every worker's claims back to the queues' heads (shmem::wake_at_commit).
        if self.per_command_us >= claim::FAST_HANDLER.as_micros() as f64 {
            return ahead.map_or(1, |ahead| (1 + (ahead.as_micros() as f64 / self.per_command_us) as i32).min(max));
        }
        let fitting = CLAIM_TARGET.as_micros() as f64 / self.per_command_us;
        (fitting as i32).clamp(1, max)
    }

    /// How far ahead a claim may take commands of handlers that may be slow
    /// (see claim::keep_what_starts_now): CLAIM_AHEAD while no other worker
    /// is idle, else none (one at most, the rest left to the idle ones).
    fn claim_ahead(&self) -> Option<Duration> {
        (!shmem::another_worker_sleeping()).then_some(CLAIM_AHEAD)
    }

    fn failed_turn(&mut self) -> Duration {
        self.ready = false;
        spi::forget_plans();
        gucs::poll_interval()
    }

    /// The next claim starts at the queues' heads, and the other workers'
    /// claims no longer start after where this one's ended (what goes back
    /// to its queue may be behind it; see shmem::publish_cursor).
    fn forget_cursor(&self) {
        self.cursor.take();
        shmem::publish_cursor(self.index, &[], 0);
    }

    fn claim(&self) -> Vec<Claimed> {
        let turn = self.turn.get().wrapping_add(1);
        self.turn.set(turn);
        let started = Instant::now();
        // no more than a chunk is likely to run: held commands it does not
        // reach are claimed again
        // (read once: the size and what the claim keeps must agree)
        let ahead = self.claim_ahead();
        let size = self.claim_size(ahead).min(self.chunk_window.min(i32::MAX as usize) as i32).max(1);
        // A burst into sleeping workers: the first one woken claims a little,
        // and its full claim wakes the next a fraction of a millisecond in,
        // not once it has claimed a whole batch (4 ms for 1,000); the claims
        // after that are whole again.
        let size = if self.slept.replace(false) { size.min(FIRST_CLAIM_AFTER_SLEEP) } else { size };
        // (the commands other workers' attempt records name: in an attempt,
        // or left by a worker that stopped in it and not concluded yet)
        let mut excluded = attempt_record::named_elsewhere(self.index);
        // and the held commands this worker left to a cancel lately (see execute::Chunk::finish)
        let mut left = self.left_to_cancels.borrow_mut();
        left.retain(|(_, at)| at.elapsed() < HAND_BACK_DELAY);
        excluded.extend(left.iter().map(|(id, _)| *id));
        drop(left);
        // Where the last claim ended, for at most CURSOR_SPAN, and while
        // nothing was made due before it (a run enqueued by a transaction
        // that began earlier and committed since, a command handed back).
        // Commands made due at the very time an end is at are taken to be
        // after it (the commit that made the claimed ones due usually says so
        // after they were claimed; another transaction's, due at that same
        // microsecond with a smaller id, would wait for the span's end).
        let floor = shmem::take_due_floor(self.index);
        let before_floor = |cursor: &ClaimCursor| cursor.latest().is_some_and(|at| at <= floor);
        let (others, others_until) = shmem::cursors_of_others(self.index);
        let mut kept =
            self.cursor.take().filter(|(since, cursor)| !cursor_time_left(*since).is_zero() && before_floor(cursor));
        match kept.as_mut() {
            // and after the commands the other workers hold (see shmem::publish_cursor)
            Some((_, cursor)) => cursor.take_up(others),
            // With none of its own, where the other workers' claims ended, for
            // as long as theirs are good: a worker woken while another one
            // runs the batch it was woken for would otherwise walk from the
            // head, through that batch too, and find nothing.
            None => {
                let mut theirs = ClaimCursor::default();
                theirs.take_up(others);
                if before_floor(&theirs) {
                    let left =
                        Duration::from_micros((others_until - unsafe { pg_sys::GetCurrentTimestamp() }).max(0) as u64);
                    let since =
                        Instant::now().checked_sub(CURSOR_SPAN.saturating_sub(left)).unwrap_or_else(Instant::now);
                    kept = Some((since, theirs));
                }
            }
        }
        gucs::inject_fault("claim");
        let claim::Claim { commands: claimed, ended_at, interleaved, left_some } = claim::claim(
            &self.name,
            self.backend_start,
            size,
            turn,
            excluded,
            shmem::busy_runs_of_others(self.index),
            kept.as_ref().map(|(_, at)| at),
            &|| attempt_record::named_elsewhere(self.index),
            ahead,
        );
        // (a claim from several queues took each one's share only, and one
        // that left commands it locked left them due: more may be due)
        let full = claimed.len() >= size as usize || interleaved || left_some;
        let (since, cursor) = if full {
            // more may be due: bring in an idle worker
            shmem::wake_workers();
            // and the next claim takes up from here, while a backlog drains,
            // and from where it started in the queues and priorities this
            // one did not reach: a queue or priority it had emptied would
            // otherwise be walked again from its head, through the index
            // entries of everything claimed from it (a drain of 5 priorities
            // claimed 15 % slower, the claims of 2 alternating queues too)
            match kept {
                Some((since, mut cursor)) => {
                    cursor.take_up(ended_at.ends());
                    (since, cursor)
                }
                None => (Instant::now(), ended_at),
            }
        } else {
            // It took what was due after where it started: the next claim
            // may start after where it ended too. Otherwise every claim of a
            // steady flow would walk from the queue's head through the index
            // entries of every command claimed since the last VACUUM (7,500
            // pages a claim were seen under a churn of 60,000 runs/s).
            let (since, mut cursor) = kept.unwrap_or_else(|| (started, ClaimCursor::default()));
            cursor.take_up(ended_at.ends());
            (since, cursor)
        };
        if cursor.latest().is_some() {
            let left = cursor_time_left(since).as_micros() as i64;
            shmem::publish_cursor(self.index, &cursor.ends(), unsafe { pg_sys::GetCurrentTimestamp() } + left);
            self.cursor.replace(Some((since, cursor)));
        }
        self.took_all_due.set(!full);
        shmem::observe("claims", 1);
        shmem::observe("claims_empty", claimed.is_empty() as u64);
        shmem::observe("claimed", claimed.len() as u64);
        shmem::observe("claim_us", started.elapsed().as_micros() as u64);
        claimed
    }
}

/// A claim's transaction that only leases commits without waiting for its
/// WAL to reach the disk (synchronous_commit off for it alone): its leases
/// are seen at once all the same, and the commit of the chunk that runs them,
/// which waits, flushes them first. A crash before that flush loses only
/// leases of commands that then never ran (their chunk's commit could not
/// have happened): they are due again, uncharged. (8 workers of a 50 ms
/// handler waited 1-2 ms a command for the flushes of their claims.)
fn commit_leases_without_flush() {
    unsafe {
        pg_sys::set_config_option(
            c"synchronous_commit".as_ptr(),
            c"off".as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_LOCAL,
            true,
            0,
            false,
        );
    }
}

pub(crate) fn extension_installed() -> bool {
    // Waits calmly while the extension is missing or being created, dropped or
    // updated, and while its SQL is of another release than this library (after
    // a new library was installed and the server restarted, until `ALTER
    // EXTENSION flow UPDATE` commits): the engine's SQL and this code must match.
    let installed = Spi::get_one_with_args::<String>(
        "SELECT e.extversion FROM pg_catalog.pg_extension e WHERE e.extname = 'flow'",
        &[],
    )
    .ok()
    .flatten();
    let ready = installed.as_deref() == Some(env!("CARGO_PKG_VERSION"));
    if !ready {
        if let Some(version) = installed {
            log_once_per_process(&format!(
                "flow: the installed extension is version {version}, this library is {}: waiting for ALTER EXTENSION flow UPDATE",
                env!("CARGO_PKG_VERSION")
            ));
        }
    }
    ready
}

/// A LOG line the first time only: a worker waiting for an update checks every poll.
fn log_once_per_process(message: &str) {
    thread_local! { static SAID: Cell<bool> = const { Cell::new(false) }; }
    if !SAID.with(|s| s.replace(true)) {
        pgrx::log!("{message}");
    }
}

// (The worker's statements run on plans kept for its lifetime, as the claim's
// and settlement's do: a statement run from its text is parsed and planned
// each time, and _next_due_ms runs on every wake-up, a tenth of the CPU a
// worker spent per pickup.)
/// Milliseconds until the next command is due (<= 0: one is due now) in
/// the in-database workers' lanes; after `after`'s ends in their queues.
fn next_due_ms(after: Option<&ClaimCursor>) -> Option<i64> {
    let (after_queues, after_priorities, after_at, after_ids) = after.map(ClaimCursor::columns).unwrap_or_default();
    engine_query(
        "SELECT flow._next_due_ms($1, $2, $3, $4)",
        &[spi::TEXT_ARRAY, spi::INT2_ARRAY, spi::TIMESTAMPTZ_ARRAY, spi::UUID_ARRAY],
        &[after_queues.into(), after_priorities.into(), after_at.into(), after_ids.into()],
        |rows| rows.first().get_one::<i64>(),
    )
    .ok()
    .flatten()
}

/// Sleep on the latch; settlements, enqueues and emits elsewhere set it.
pub(crate) fn wait_on_latch(timeout: Duration) {
    unsafe {
        pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as c_int,
            timeout.as_millis().min(i32::MAX as u128) as libc_long,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
        // A cancel that arrived while idle has nothing to cancel; a pending
        // `die` is still served by the interrupt check below.
        pg_sys::QueryCancelPending = 0;
    }
    pgrx::check_for_interrupts!();
}

#[allow(non_camel_case_types)]
type libc_long = std::ffi::c_long;

pub(crate) fn report_activity(text: &str) {
    if let Ok(text) = CString::new(text) {
        unsafe { pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_RUNNING, text.as_ptr()) };
    }
}

/// For an idle worker: plan again, now, the statements of the pickup path
/// (the claim and the settlement) if a relation changed since the last time,
/// so that the first command enqueued after an ANALYZE or a TRUNCATE does not
/// wait for them to be planned (one to a few milliseconds). A claim of no
/// command and a settlement of none run every statement and change nothing.
/// A handler's own statements are planned again at its next call.
fn warm_plans(owner: &str, backend_start: Option<TimestampWithTimeZone>) {
    if !spi::take_plans_stale() {
        return;
    }
    claim::claim(owner, backend_start, 0, 0, Vec::new(), Vec::new(), None, &Vec::new, None);
    let none: [DatumWithOid; 8] = [
        Vec::<pgrx::Uuid>::new().into(),
        Vec::<pgrx::Uuid>::new().into(),
        Vec::<Option<crate::payload::Jsonb>>::new().into(),
        Vec::<Option<TimestampWithTimeZone>>::new().into(),
        Vec::<Option<i32>>::new().into(),
        owner.into(),
        Vec::<Option<pg_sys::ItemPointerData>>::new().into(),
        false.into(),
    ];
    settle::settle_batch(&none);
}
