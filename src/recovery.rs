//! Recovery (engine rule 8): concluding attempts whose owner is gone, as
//! interrupted, retried by their policy, and giving back uncharged what a
//! gone owner had claimed and not started. Run by the maintenance worker
//! (src/maintenance.rs), never behind a handler. Three sources:
//! - in-database workers that are gone (their pid and backend start no
//!   longer exist): the attempt each one's record names (src/attempt_record.rs)
//!   is charged, held or leased; its other leased commands go back to their
//!   queues uncharged (`flow._recover`, sql/recover.sql);
//! - external leases past their expiry, concluded as lease_lost;
//! - held attempts that external clients' transactions abandoned
//!   (src/external.rs), each in a transaction of its own.
//!
//! Nothing here waits for a lock: a run or a row locked elsewhere (a client's
//! open transaction, a long chunk) is left for a later round.

use crate::attempt_record::{self, Recorded, Writer};
use crate::spi::{self, engine_query, transaction};
use crate::{gucs, settle, shmem};
use pgrx::prelude::*;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long the maintenance worker waits before it tries again to conclude
/// an abandoned held attempt whose conclusion failed (see `conclude_abandoned`).
const FAILED_CONCLUSION_PAUSE: Duration = Duration::from_secs(1);

/// The maintenance worker's recovery: the abandoned attempts whose
/// conclusion failed, with when to try each again.
#[derive(Default)]
pub struct Recovery {
    failed_conclusions: HashMap<([u8; 16], i32), Instant>,
}

impl Recovery {
    /// One round: the gone workers' records and leases, expired external
    /// leases, abandoned external attempts. None if a transaction failed.
    pub fn round(&mut self, name: &str) -> Option<()> {
        let concluded = recover_gone_workers()?;
        if concluded > 0 {
            gucs::log(&format!("flow: concluded {concluded} attempts whose owner was gone"));
        }
        self.conclude_abandoned(name);
        Some(())
    }

    /// Conclude the held attempts external clients' transactions abandoned
    /// (src/external.rs), each in a transaction of its own, never waiting
    /// for a lock: one whose run or row is busy elsewhere (a client's open
    /// transaction) stays for a later round. Claims leave their commands
    /// alone until they are concluded here. One whose conclusion fails (an
    /// error) stays too, tried again every FAILED_CONCLUSION_PAUSE: dropped,
    /// its attempt would go uncounted and its command be claimed again (rule 3).
    fn conclude_abandoned(&mut self, name: &str) {
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
        crate::external::forget_abandoned(&done);
    }
}

/// Which worker processes that wrote attempt records are gone; then, their
/// records read again (a process that is gone writes no more), what they
/// name is concluded and their other leases given back (flow._recover), and
/// the files of those fully concluded removed. Returns how many attempts
/// were concluded.
fn recover_gone_workers() -> Option<i32> {
    let writers = attempt_record::writers();
    let gone = transaction(|| gone_writers(&writers))?;
    // (read after they were found gone: what they say now is final)
    let records: Vec<Vec<Recorded>> =
        writers.iter().zip(&gone).map(|(w, gone)| if *gone { attempt_record::read(w) } else { Vec::new() }).collect();
    let (concluded, done) = transaction(|| recover(&writers, &gone, &records))?;
    for (((writer, gone), done), record) in writers.iter().zip(&gone).zip(&done).zip(&records) {
        if *gone && *done {
            if let Some(&Recorded { command, attempt }) = record.last() {
                pgrx::log!(
                    "flow: concluded the attempt {attempt} of command {} as interrupted: its worker stopped in it (pid {})",
                    pgrx::Uuid::from_bytes(command),
                    writer.pid
                );
            }
            attempt_record::remove(writer);
        }
    }
    shmem::observe("recovered", concluded.max(0) as u64);
    Some(concluded)
}

fn starts(writers: &[Writer]) -> (Vec<i32>, Vec<Option<TimestampWithTimeZone>>) {
    writers.iter().map(|w| (w.pid, crate::spans::timestamp_from_pg(w.started))).unzip()
}

/// For each writer: whether its process is gone (flow._gone_workers).
fn gone_writers(writers: &[Writer]) -> Vec<bool> {
    if writers.is_empty() {
        return Vec::new();
    }
    let (pids, started) = starts(writers);
    engine_query(
        "SELECT flow._gone_workers($1, $2)",
        &[spi::INT4_ARRAY, spi::TIMESTAMPTZ_ARRAY],
        &[pids.into(), started.into()],
        |rows| rows.first().get_one::<Vec<bool>>().ok().flatten(),
    )
    .unwrap_or_else(|| vec![false; writers.len()])
}

/// flow._recover: returns how many attempts it concluded, and for each
/// writer whether its record is concluded (its file may go).
fn recover(writers: &[Writer], gone: &[bool], records: &[Vec<Recorded>]) -> (i32, Vec<bool>) {
    let (pids, started) = starts(writers);
    // each writer's last attempt, and the earlier ones of its transaction (with their writer's index, from 1)
    let commands: Vec<Option<pgrx::Uuid>> =
        records.iter().map(|r| r.last().map(|r| pgrx::Uuid::from_bytes(r.command))).collect();
    let attempts: Vec<Option<i32>> = records.iter().map(|r| r.last().map(|r| r.attempt)).collect();
    let earlier: Vec<(i32, &Recorded)> =
        records.iter().enumerate().flat_map(|(i, r)| r.iter().rev().skip(1).map(move |e| (i as i32 + 1, e))).collect();
    let earlier_writers: Vec<i32> = earlier.iter().map(|(i, _)| *i).collect();
    let earlier_commands: Vec<pgrx::Uuid> = earlier.iter().map(|(_, e)| pgrx::Uuid::from_bytes(e.command)).collect();
    let earlier_attempts: Vec<i32> = earlier.iter().map(|(_, e)| e.attempt).collect();
    engine_query(
        "SELECT concluded, records_done FROM flow._recover($1, $2, $3, $4, $5, $6, $7, $8)",
        &[
            spi::INT4_ARRAY,
            spi::TIMESTAMPTZ_ARRAY,
            spi::BOOL_ARRAY,
            spi::UUID_ARRAY,
            spi::INT4_ARRAY,
            spi::INT4_ARRAY,
            spi::UUID_ARRAY,
            spi::INT4_ARRAY,
        ],
        &[
            pids.into(),
            started.into(),
            gone.to_vec().into(),
            commands.into(),
            attempts.into(),
            earlier_writers.into(),
            earlier_commands.into(),
            earlier_attempts.into(),
        ],
        |rows| {
            let row = rows.first();
            let concluded = row.get::<i32>(1).ok().flatten().unwrap_or(0);
            let done = row.get::<Vec<bool>>(2).ok().flatten().unwrap_or_default();
            (concluded, done)
        },
    )
}
