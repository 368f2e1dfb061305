//! Queues' rate limits (flow.set_queue's `rate` per `per`): a GCRA (generic
//! cell rate algorithm) per queue in shared memory, so a command's start
//! costs no row write, and every claimant (in-database workers and external
//! claims) takes from the same bucket. Each command is one cell: cells are
//! `per / rate` apart, and up to `rate` may start at once after an idle
//! spell, so at most `rate` start in any window of `per`. The claim peeks
//! (`_rate_room`) to size its scan, admits each row it locked
//! (`_rate_admit`), and an idle worker sleeps until the next cell
//! (`_rate_next`). The buckets are not durable: after a restart a queue may
//! start one burst of `rate` at once.

use crate::shmem::SharedName;
use pgrx::datum::TimestampWithTimeZone;
use pgrx::lwlock::PgLwLock;
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory};

/// How many queues may have a rate limit at once in a cluster; beyond it,
/// queues share buckets (they are limited together, never beyond their rates).
const BUCKETS: usize = 1024;

#[derive(Copy, Clone)]
struct Bucket {
    queue: SharedName,
    /// The theoretical arrival time of the next cell (TimestampTz µs).
    tat: i64,
}

#[derive(Copy, Clone)]
pub struct Buckets {
    slots: [Bucket; BUCKETS],
}

impl Default for Buckets {
    fn default() -> Self {
        Buckets { slots: [Bucket { queue: SharedName::NONE, tat: i64::MIN }; BUCKETS] }
    }
}

unsafe impl PGRXSharedMemory for Buckets {}

static BUCKETS_TABLE: PgLwLock<Buckets> = unsafe { PgLwLock::new(c"flow_rate_buckets") };

pub fn init() {
    pg_shmem_init!(BUCKETS_TABLE);
}

/// The bucket of `queue`: its own slot, or a free one it takes (open
/// addressing from its name's hash); the last probed when all are taken.
fn slot_of(buckets: &mut Buckets, queue: &str) -> usize {
    let start = queue.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100000001b3));
    let mut index = (start % BUCKETS as u64) as usize;
    for _ in 0..BUCKETS {
        let slot = &mut buckets.slots[index];
        if slot.queue.len > 0 && slot.queue.is(queue) {
            return index;
        }
        if slot.queue.len == 0 {
            if let Some(name) = SharedName::new(queue) {
                *slot = Bucket { queue: name, tat: i64::MIN };
                return index;
            }
        }
        index = (index + 1) % BUCKETS;
    }
    index
}

fn now_us() -> i64 {
    unsafe { pgrx::pg_sys::GetCurrentTimestamp() }
}

/// A cell's spacing (µs) and how far ahead of now the bucket may be booked.
fn spacing(rate: i32, per_us: i64) -> Option<(i64, i64)> {
    (rate > 0 && per_us > 0).then(|| ((per_us / i64::from(rate)).max(1), per_us))
}

/// How many commands of `queue` may start now (at most `rate`): 0 when its
/// rate is 0. Takes nothing.
#[pg_extern(volatile, parallel_unsafe)]
fn _rate_room(queue: &str, rate: i32, per_us: i64) -> i32 {
    let Some((cell, window)) = spacing(rate, per_us) else { return 0 };
    let now = now_us();
    let mut buckets = BUCKETS_TABLE.exclusive();
    let slot = slot_of(&mut buckets, queue);
    let tat = buckets.slots[slot].tat.max(now);
    let room = ((now + window - tat) / cell).clamp(0, i64::from(rate)) as i32;
    if room == 0 {
        crate::shmem::observe("rate_limited", 1);
    }
    room
}

/// Take one cell of `queue`'s bucket for a command that starts now; false
/// when there is none (the command is left for a later claim).
#[pg_extern(volatile, parallel_unsafe)]
fn _rate_admit(queue: &str, rate: i32, per_us: i64) -> bool {
    let Some((cell, window)) = spacing(rate, per_us) else { return false };
    let now = now_us();
    let mut buckets = BUCKETS_TABLE.exclusive();
    let slot = slot_of(&mut buckets, queue);
    let tat = buckets.slots[slot].tat.max(now);
    if tat + cell - now > window {
        crate::shmem::observe("rate_limited", 1);
        return false;
    }
    buckets.slots[slot].tat = tat + cell;
    true
}

/// When `queue`'s next cell is free: now if one is, 'infinity' for a rate of 0.
#[pg_extern(volatile, parallel_unsafe)]
fn _rate_next(queue: &str, rate: i32, per_us: i64) -> TimestampWithTimeZone {
    let Some((cell, window)) = spacing(rate, per_us) else { return TimestampWithTimeZone::positive_infinity() };
    let now = now_us();
    let mut buckets = BUCKETS_TABLE.exclusive();
    let slot = slot_of(&mut buckets, queue);
    let tat = buckets.slots[slot].tat.max(now);
    crate::spans::timestamp_from_pg((tat + cell - window).max(now)).unwrap_or(TimestampWithTimeZone::positive_infinity())
}
