//! External workers' claims take up where the last full claim of the same
//! definition ended, as in-database workers' claims do (flow.claim in
//! sql/api.sql; the shared ends are in `shmem::note_external_end`).

use crate::{api, executor, shmem};
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
