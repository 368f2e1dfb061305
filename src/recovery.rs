//! Recovery (engine rule 8): concluding attempts whose owner is gone, as
//! interrupted, and retrying them by their policy. Three sources:
//! - leased attempts of in-database workers that died (`flow._recover`,
//!   sql/recover.sql: their pid and backend start are gone), and external
//!   leases that expired, every RECOVERY_INTERVAL by every worker;
//! - the held attempt a worker's previous incarnation stopped in (its
//!   attempt record, src/attempt_record.rs), when the worker starts, and for
//!   worker 0 the records of slots no worker runs any more;
//! - held attempts that external clients' transactions abandoned
//!   (src/external.rs), by worker 0, each in a transaction of its own.

use crate::spi::{engine_query, transaction};
use crate::{attempt_record, gucs, settle, shmem};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How often a worker looks for attempts whose owner died or whose external
/// lease expired. Recovery is one index scan of running commands.
const RECOVERY_INTERVAL: Duration = Duration::from_secs(1);
/// How long worker 0 waits before it tries again to conclude an abandoned
/// held attempt whose conclusion failed (see `conclude_abandoned`).
const FAILED_CONCLUSION_PAUSE: Duration = Duration::from_secs(1);

/// A worker's recovery: when it last ran, and (worker 0) the abandoned
/// attempts whose conclusion failed, with when to try each again.
#[derive(Default)]
pub struct Recovery {
    last_run: Option<Instant>,
    failed_conclusions: HashMap<([u8; 16], i32), Instant>,
}

impl Recovery {
    /// Conclude the attempts of dead owners and expired leases, if a pass is
    /// due. None if its transaction failed.
    pub fn maybe_recover(&mut self) -> Option<()> {
        if self.last_run.is_some_and(|at| at.elapsed() < RECOVERY_INTERVAL) {
            return Some(());
        }
        self.last_run = Some(Instant::now());
        match transaction(recover)? {
            0 => {}
            n => gucs::log(&format!("flow: concluded {n} attempts whose owner was gone")),
        }
        Some(())
    }

    /// Worker 0: conclude the held attempts external clients' transactions
    /// abandoned (src/external.rs), each in a transaction of its own, never
    /// waiting for a lock: one whose run or row is busy elsewhere (a client's
    /// open transaction) stays for a later turn. Claims leave their commands
    /// alone until they are concluded here. One whose conclusion fails (an
    /// error) stays too, tried again every FAILED_CONCLUSION_PAUSE: dropped,
    /// its attempt would go uncounted and its command be claimed again (rule 3).
    pub fn conclude_abandoned(&mut self, name: &str) {
        let abandoned = crate::external::abandoned();
        if abandoned.is_empty() {
            self.failed_conclusions.clear();
            return;
        }
        let mut done = Vec::new();
        for (command, attempt, token, worker) in abandoned {
            if self.failed_conclusions.get(&(command, attempt)).is_some_and(|again| Instant::now() < *again) {
                continue;
            }
            let worker = if worker.is_empty() { name.to_string() } else { worker };
            match transaction(|| settle::conclude_held(command, attempt, &worker, Some(token))) {
                Some(settle::Conclusion::Busy) => continue,
                Some(_) => {} // counted, or it moved on meanwhile: nothing to count
                None => {
                    let again = Instant::now() + FAILED_CONCLUSION_PAUSE;
                    if self.failed_conclusions.insert((command, attempt), again).is_none() {
                        pgrx::log!(
                            "flow: the abandoned attempt {attempt} of command {} could not be concluded; \
                             trying again every {} s",
                            pgrx::Uuid::from_bytes(command),
                            FAILED_CONCLUSION_PAUSE.as_secs()
                        );
                    }
                    continue;
                }
            }
            self.failed_conclusions.remove(&(command, attempt));
            done.push((command, attempt));
        }
        // (what stays is tried again next turn: a poll interval later at most)
        crate::external::forget_abandoned(&done);
    }
}

/// Conclude what worker `index`'s record held when it started: the held
/// attempt its previous incarnation stopped in (and, for worker 0, the
/// records of slots no worker runs any more). Called in a transaction.
pub fn conclude_records(index: usize, name: &str) {
    let mut records: Vec<(Option<usize>, ([u8; 16], i32))> =
        attempt_record::left_behind(index).into_iter().map(|r| (None, r)).collect();
    if index == 0 {
        records.extend(attempt_record::orphans(gucs::workers()).into_iter().map(|(slot, r)| (Some(slot), r)));
    }
    for (slot, (command, attempt)) in records {
        if settle::conclude_held(command, attempt, name, None) == settle::Conclusion::Counted {
            pgrx::log!(
                "flow: concluded the attempt {attempt} of command {} as interrupted: its worker stopped in it",
                pgrx::Uuid::from_bytes(command)
            );
        }
        match slot {
            None => attempt_record::clear(),
            Some(slot) => attempt_record::remove(slot),
        }
    }
}

// (The worker's statements run on plans kept for its lifetime, as the claim's
// and settlement's do: a statement run from its text is parsed and planned
// each time.)
fn recover() -> i32 {
    let n = engine_query("SELECT flow._recover()", &[], &[], |rows| rows.first().get_one::<i32>())
        .ok()
        .flatten()
        .unwrap_or(0);
    shmem::observe("recovered", n.max(0) as u64);
    n
}
