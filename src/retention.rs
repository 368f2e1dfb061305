//! Retention: the maintenance worker (src/maintenance.rs) deletes finished runs past `flow.retention` (with
//! their commands, attempts and waits: `flow._prune`, sql/retention.sql) and
//! retires journal entries past `flow.event_retention` that no wait refers
//! to (`flow._retire_events`), a bounded window at a time, each in a short
//! transaction of its own, so pruning never holds up the queue.

use crate::gucs;
use crate::spi::{engine_query, transaction, FLOAT8, INT4, UUID};
use std::time::{Duration, Instant};

/// How often the maintenance worker prunes when it last found nothing more to delete, how
/// many at most per transaction (each short: ~10 ms for 5,000 runs; batches
/// of 1,000 cost a quarter more per run), and how long one pass may go on
/// while more is due: between two of its rounds, the maintenance worker deletes
/// about as many runs as the engine finishes at its peak, so retention
/// keeps pace under load.
const PRUNE_INTERVAL: Duration = Duration::from_secs(1);
const PRUNE_BATCH: i32 = 5000;
const PRUNE_BUDGET: Duration = Duration::from_millis(25);

/// The maintenance worker's pruning: when it last ran, and where its next window starts.
#[derive(Default)]
pub struct Pruning {
    last_prune: Option<Instant>,
    /// Where the next pruning window starts (the last run the previous one
    /// looked at; None: from the oldest).
    prune_after: Option<pgrx::Uuid>,
}

impl Pruning {
    /// Delete what is past its retention, a bounded batch at a time, if a
    /// pass is due. Returns whether more is due for deletion now.
    pub fn maybe_prune(&mut self) -> bool {
        if self.last_prune.is_some_and(|at| at.elapsed() < PRUNE_INTERVAL) {
            return false;
        }
        let started = Instant::now();
        let (mut runs, mut events) = (0, 0);
        let more = loop {
            let (more, r, e) = self.prune_once();
            (runs, events) = (runs + r, events + e);
            if !more || started.elapsed() >= PRUNE_BUDGET {
                break more;
            }
        };
        if runs > 0 {
            let seconds = gucs::retention().map_or(0, |r| r.as_secs());
            gucs::log(&format!("flow: deleted {runs} runs finished more than {seconds} s ago"));
        }
        if events > 0 {
            let seconds = gucs::event_retention().map_or(0, |r| r.as_secs());
            gucs::log(&format!("flow: deleted {events} events emitted more than {seconds} s ago"));
        }
        more
    }

    /// One batch of each kind of deletion; returns whether more is due, and
    /// how many runs and events it deleted.
    fn prune_once(&mut self) -> (bool, i32, i32) {
        self.last_prune = Some(Instant::now());
        let (mut more, mut runs, mut events) = (false, 0, 0);
        if let Some(retention) = gucs::retention() {
            // A window of runs at a time, moving on from the last one looked at.
            let seconds = retention.as_secs() as f64;
            let after = self.prune_after;
            let window = transaction(|| {
                engine_query(
                    "SELECT pruned, last FROM flow._prune(pg_catalog.make_interval(secs => $1), $2, $3)",
                    &[FLOAT8, INT4, UUID],
                    &[seconds.into(), PRUNE_BATCH.into(), after.into()],
                    |rows| rows.first().get_two::<i32, pgrx::Uuid>(),
                )
            });
            if let Some(Ok((pruned, last))) = window {
                runs = pruned.unwrap_or(0);
                self.prune_after = last;
                more |= last.is_some();
            }
        }
        if let Some(retention) = gucs::event_retention() {
            let seconds = retention.as_secs() as f64;
            let retired = transaction(|| {
                engine_query(
                    "SELECT flow._retire_events(pg_catalog.make_interval(secs => $1), $2)",
                    &[FLOAT8, INT4],
                    &[seconds.into(), PRUNE_BATCH.into()],
                    |rows| rows.first().get_one::<i32>(),
                )
            });
            if let Some(Ok(Some(n))) = retired {
                events = n;
                more |= n == PRUNE_BATCH;
            }
        }
        if more {
            // More may be waiting: come back on the next turn, not in PRUNE_INTERVAL.
            self.last_prune = None;
        }
        (more, runs, events)
    }
}
