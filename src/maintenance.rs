//! The maintenance worker: one background process, `flow maintenance`, that
//! keeps the engine's upkeep out from behind handlers. It never runs a
//! handler. Each round (every RECOVERY_INTERVAL, or at once when woken by an
//! abandoned external attempt): recovery (src/recovery.rs: gone workers'
//! attempts and leases, expired external leases, abandoned held attempts),
//! runs past their deadline (flow._expire_runs), and pruning
//! (src/retention.rs). Each step is a short transaction of its own that
//! never waits for a lock, so an idle client transaction holding a run holds
//! up that run alone, not recovery.

use crate::recovery::Recovery;
use crate::retention::Pruning;
use crate::spi::{engine_query, transaction};
use crate::{gateway, gucs, shmem, spi, worker};
use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, SignalWakeFlags};
use pgrx::prelude::*;
use std::time::{Duration, Instant};

/// How often recovery looks for attempts whose owner is gone, and runs past
/// their deadline: one index scan of running commands, and one of the
/// unfinished commands with a deadline, each a fraction of a millisecond.
const RECOVERY_INTERVAL: Duration = Duration::from_secs(1);

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
    while !BackgroundWorker::sigterm_received() {
        if BackgroundWorker::sighup_received() {
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
        let mut sleep = RECOVERY_INTERVAL.min(gucs::poll_interval());
        // (each round: the extension may have been dropped or updated since)
        let ready = transaction(worker::extension_installed).unwrap_or(false);
        if ready && gucs::enabled() {
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
                worker::report_activity("flow maintenance: pruning");
                if pruning.maybe_prune() {
                    sleep = Duration::ZERO; // more is due: keep pace
                }
                if failed {
                    spi::forget_plans();
                }
            }
        }
        if !sleep.is_zero() {
            worker::report_activity("flow maintenance: idle");
            worker::wait_on_latch(sleep);
        }
    }
}

/// End the runs whose deadline has passed (flow._expire_runs); how many.
fn expire_runs() -> Option<i32> {
    engine_query("SELECT flow._expire_runs()", &[], &[], |rows| rows.first().get_one::<i32>().ok().flatten())
}
