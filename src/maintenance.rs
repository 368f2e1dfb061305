//! The maintenance worker: one background process, `flow maintenance`, that
//! keeps the engine's upkeep out from behind handlers. It never runs a
//! handler. It adds the priorities enqueues noted to their queues
//! (flow._fold_priority_notes: woken by the note's commit), and forgets
//! those no command has any more (flow._retire_priorities). It fires
//! schedules' ticks on time (flow._fire_schedules: it sleeps until the next
//! tick, and a change of schedule wakes it). Each round
//! (every RECOVERY_INTERVAL, or at once when woken by an abandoned external
//! attempt, a tick or a schedule changed): recovery (src/recovery.rs: gone workers'
//! attempts and leases, expired external leases, abandoned held attempts),
//! runs past their deadline (flow._expire_runs), and pruning
//! (src/retention.rs). Each step is a short transaction of its own that
//! never waits for a lock, so an idle client transaction holding a run holds
//! up that run alone, not recovery.

use crate::recovery::Recovery;
use crate::retention::Pruning;
use crate::spi::{engine_query, transaction, TEXT};
use crate::{gateway, gucs, shmem, spi, worker};
use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, SignalWakeFlags};
use pgrx::prelude::*;
use std::time::{Duration, Instant};

/// How often recovery looks for attempts whose owner is gone, and runs past
/// their deadline: one index scan of running commands, and one of the
/// unfinished commands with a deadline, each a fraction of a millisecond.
const RECOVERY_INTERVAL: Duration = Duration::from_secs(1);

/// How often the priorities no unfinished command has are forgotten
/// (flow._retire_priorities): a look under each queue's lock, a probe per
/// priority; one used again within it is not noted again (a note delays its
/// first commands by a round of this worker).
const PRIORITY_RETIREMENT_INTERVAL: Duration = Duration::from_secs(60);

/// How long one round looks at queues' priorities before the rest of the
/// round has its turn (the pass goes on in the next round): a queue takes a
/// fraction of a millisecond, thousands of them (one role may make 1,000) more.
const PRIORITY_RETIREMENT_BUDGET: Duration = Duration::from_millis(25);

/// How many ticks one transaction fires: each is an enqueue in a
/// subtransaction of its own, and a transaction with more than 64 of them
/// slows every other backend's snapshot checks (the subxid cache overflows).
const SCHEDULE_TICKS_PER_TRANSACTION: i32 = 50;

/// How long one round fires ticks before the upkeep (recovery, deadlines,
/// pruning) has its turn: 1,000 ticks took 130-230 ms here.
const FIRING_BUDGET: Duration = Duration::from_millis(250);

/// How far ahead of its time a tick is enqueued (due at its time): firing a
/// thousand ticks took 130-230 ms on 2 cores, and a second covers several times that.
const TICK_LEAD: &str = "1 second";

/// How long to wait before firing again when a due schedule is held by
/// another transaction (flow.schedule in an open transaction).
const HELD_SCHEDULE_RETRY: Duration = Duration::from_millis(50);

/// Register the maintenance worker; called from `_PG_init` while preloading.
pub fn register() {
    BackgroundWorkerBuilder::new("flow maintenance")
        .set_type("flow maintenance")
        .set_library("flow")
        .set_function("flow_maintenance_main")
        .enable_spi_access()
        .set_restart_time(Some(Duration::from_secs(1)))
        .load();
}

#[pg_guard]
unsafe extern "C-unwind" fn on_exit(_code: std::ffi::c_int, _arg: pg_sys::Datum) {
    shmem::register_maintenance(false);
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn flow_maintenance_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    BackgroundWorker::connect_worker_to_spi(Some(&gucs::database_name()), None);
    gateway::pin_worker_session();
    spi::watch_plans();
    shmem::register_maintenance(true);
    unsafe { pg_sys::before_shmem_exit(Some(on_exit), pg_sys::Datum::from(0)) };
    let name = format!("{}:maintenance:{}", gucs::database_name(), unsafe { pg_sys::MyProcPid });
    let mut recovery = Recovery::default();
    let mut pruning = Pruning::default();
    let mut last_round: Option<Instant> = None;
    let mut last_retirement = Instant::now();
    // (a pass in progress: the last queue it looked at)
    let mut retirement: Option<String> = None;
    // (ticks that passed before now were missed: see src/schedules.rs)
    let started = crate::spans::timestamp_from_pg(unsafe { pg_sys::GetCurrentTimestamp() });
    while !BackgroundWorker::sigterm_received() {
        if BackgroundWorker::sighup_received() {
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
        let mut sleep = RECOVERY_INTERVAL.min(gucs::poll_interval());
        let mut next_tick_at: Option<Instant> = None;
        // (each round: the extension may have been dropped or updated since)
        let ready = transaction(worker::extension_installed).unwrap_or(false);
        if ready && gucs::enabled() {
            // (first: the first commands of a priority new to their queue
            // are claimed once it is added, and their commit woke this worker)
            worker::report_activity("flow maintenance: adding priorities");
            if transaction(fold_priority_notes).flatten().is_none() {
                spi::forget_plans();
            }
            if retirement.is_none() && last_retirement.elapsed() >= PRIORITY_RETIREMENT_INTERVAL {
                last_retirement = Instant::now();
                // (first, the net under the last pass: flow._renote_stranded_priorities)
                match transaction(renote_stranded_priorities).flatten() {
                    None => spi::forget_plans(),
                    Some(n) if n > 0 => {
                        pgrx::log!("flow: {n} priorities of due commands were missing from their queues; noted again")
                    }
                    Some(_) => {}
                }
                retirement = Some(String::new());
            }
            if let Some(after) = retirement.take() {
                worker::report_activity("flow maintenance: forgetting unused priorities");
                retirement = retire_priorities(after);
            }
            worker::report_activity("flow maintenance: firing schedules");
            let next_tick = fire_schedules(started);
            next_tick_at = Instant::now().checked_add(next_tick);
            worker::report_activity("flow maintenance: recovering");
            // (woken early, by an abandoned attempt: recovery at once, the rest on time)
            let failed = recovery.round(&name).is_none();
            if last_round.is_none_or(|at| at.elapsed() >= RECOVERY_INTERVAL) {
                last_round = Some(Instant::now());
                let expired = transaction(expire_runs).flatten();
                let failed = failed || expired.is_none();
                if let Some(n) = expired.filter(|n| *n > 0) {
                    gucs::log(&format!("flow: {n} runs ended at their deadline"));
                }
                if failed {
                    spi::forget_plans();
                }
            }
            // (at its own pace, not the rounds': a pass every PRUNE_INTERVAL,
            // and the next one at once while more is due; gated by the round,
            // it ran 25 ms a second, 5,000-10,000 runs/s, and a churn of
            // 55,000 runs/s grew the tables without end)
            worker::report_activity("flow maintenance: pruning");
            if pruning.maybe_prune() {
                sleep = Duration::ZERO; // more is due: keep pace
            }
        }
        // (until the next tick, whatever the upkeep above took)
        if let Some(at) = next_tick_at {
            sleep = sleep.min(at.saturating_duration_since(Instant::now()));
        }
        if !sleep.is_zero() {
            worker::report_activity("flow maintenance: idle");
            worker::wait_on_latch(sleep);
        }
    }
}

/// Fire the due ticks (flow._fire_schedules), SCHEDULE_TICKS_PER_TRANSACTION
/// per transaction, for at most FIRING_BUDGET; how long until the next one.
/// (Not an engine statement: cancels are not held off, so its lock_timeout
/// bounds what a role's open transaction can make a tick wait for.)
fn fire_schedules(started: Option<pgrx::datum::TimestampWithTimeZone>) -> Duration {
    let began = Instant::now();
    loop {
        let more = transaction(|| {
            Spi::get_one_with_args::<bool>(
                "SELECT flow._fire_schedules($1, $2, $3::interval)",
                &[started.into(), SCHEDULE_TICKS_PER_TRANSACTION.into(), TICK_LEAD.into()],
            )
            .ok()
            .flatten()
        })
        .flatten();
        match more {
            // (the rest after the upkeep: a flood of ticks never holds up recovery)
            Some(true) if began.elapsed() >= FIRING_BUDGET => return Duration::ZERO,
            Some(true) => continue,
            Some(false) => break,
            None => {
                spi::forget_plans();
                return HELD_SCHEDULE_RETRY;
            }
        }
    }
    let next_ms = transaction(|| {
        engine_query("SELECT flow._next_tick_ms($1::interval)", &[TEXT], &[TICK_LEAD.into()], |rows| {
            rows.first().get_one::<i64>().ok().flatten()
        })
    })
    .flatten();
    match next_ms {
        None => Duration::MAX,
        // (due now, yet not fired: held by another transaction)
        Some(ms) if ms <= 0 => HELD_SCHEDULE_RETRY,
        Some(ms) => Duration::from_millis(ms as u64),
    }
}

/// Forget the priorities no unfinished command has (flow._retire_priorities),
/// queue by queue after `after`, each in a transaction of its own, for at
/// most PRIORITY_RETIREMENT_BUDGET; the last queue looked at if the pass is
/// not done (None: done, or a look failed and the pass waits for the next).
fn retire_priorities(mut after: String) -> Option<String> {
    let started = Instant::now();
    while started.elapsed() < PRIORITY_RETIREMENT_BUDGET {
        let looked = transaction(|| {
            engine_query(
                "SELECT queue, changed FROM flow._retire_priorities($1)",
                &[TEXT],
                &[after.as_str().into()],
                |rows| {
                    let row = rows.first();
                    Some((row.get::<String>(1).ok().flatten(), row.get::<bool>(2).ok().flatten().unwrap_or(false)))
                },
            )
        })
        .flatten();
        match looked {
            None => {
                spi::forget_plans();
                return None;
            }
            Some((None, _)) => return None,
            Some((Some(queue), changed)) => {
                if changed {
                    gucs::log(&format!("flow: queue {queue} forgot the priorities no command has"));
                }
                after = queue;
            }
        }
    }
    Some(after)
}

/// Note the priorities of due commands their queues lack (flow._renote_stranded_priorities); how many.
fn renote_stranded_priorities() -> Option<i32> {
    engine_query("SELECT flow._renote_stranded_priorities()", &[], &[], |rows| {
        rows.first().get_one::<i32>().ok().flatten()
    })
}

/// Add the priorities enqueues noted to their queues (flow._fold_priority_notes); how many queues changed.
fn fold_priority_notes() -> Option<i32> {
    engine_query("SELECT flow._fold_priority_notes()", &[], &[], |rows| rows.first().get_one::<i32>().ok().flatten())
}

/// End the runs whose deadline has passed (flow._expire_runs); how many.
fn expire_runs() -> Option<i32> {
    engine_query("SELECT flow._expire_runs()", &[], &[], |rows| rows.first().get_one::<i32>().ok().flatten())
}
