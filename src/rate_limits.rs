//! Queues' rate limits (flow.set_queue's `rate` per `per`): a GCRA (generic
//! cell rate algorithm) per queue in shared memory, so a command's start
//! costs no row write, and every claimant (in-database workers and external
//! claims) takes from the same bucket. Each command is one cell: cells are
//! `per / rate` apart, and a claim may take those of the last tenth of
//! `per` (10-200 ms) at once, no more after an idle spell, so at most `rate`
//! and a tenth start in any window of `per`. The claim peeks
//! (`_rate_room`) to size its scan, admits each row it locked
//! (`_rate_admit`), and an idle worker sleeps until the next cell
//! (`_rate_next`). The buckets are not durable: a restart forgets the cells
//! taken (at most `rate` more start in the window it falls in).

use pgrx::datum::TimestampWithTimeZone;
use pgrx::lwlock::PgLwLock;
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory};
use std::hash::Hasher;

/// How many queues may be held back by their rate limit at once in a
/// cluster (a bucket whose cells are all in the past is free again); past it,
/// a rate-limited queue starts nothing until one frees (`rate_limited`).
const BUCKETS: usize = 1024;

/// How far behind now a claim may take cells: a tenth of `per`, within
/// 10-200 ms (`tolerance`), so a claim takes several at once and no cell is
/// lost while the workers are busy (a queue of 500/s started 300-330/s with
/// 10 ms, 480/s with 50 ms), and the burst after an idle spell is a tenth of `rate`.
const TOLERANCE_MIN_US: i64 = 10_000;
const TOLERANCE_MAX_US: i64 = 200_000;

fn tolerance(per_us: i64) -> i64 {
    (per_us / 10).clamp(TOLERANCE_MIN_US, TOLERANCE_MAX_US)
}

#[derive(Copy, Clone)]
struct Bucket {
    /// Its queue's key (`key_of`); 0: free.
    key: u128,
    /// The time of the next free cell (TimestampTz µs).
    tat: i64,
}

#[derive(Copy, Clone)]
pub struct Buckets {
    slots: [Bucket; BUCKETS],
    /// The keys of the queues' hash, random per server start: a role cannot
    /// choose a queue name whose key is another's.
    hash_keys: [u64; 2],
}

impl Default for Buckets {
    fn default() -> Self {
        // (from the OS, not rand's thread-local generator: this runs in the
        // postmaster, and every backend forked after would start with the
        // same buffered output of that generator, and so make the same ids)
        use rand::RngCore;
        let hash_keys = [rand::rngs::OsRng.next_u64(), rand::rngs::OsRng.next_u64()];
        Buckets { slots: [Bucket { key: 0, tat: i64::MIN }; BUCKETS], hash_keys }
    }
}

unsafe impl PGRXSharedMemory for Buckets {}

static BUCKETS_TABLE: PgLwLock<Buckets> = unsafe { PgLwLock::new(c"flow_rate_buckets") };

pub fn init() {
    pg_shmem_init!(BUCKETS_TABLE);
}

/// A queue's key: a keyed 128-bit hash of its database and name (never 0).
fn key_of(buckets: &Buckets, queue: &str) -> u128 {
    let database = unsafe { pg_sys::MyDatabaseId }.to_u32();
    let half = |k0: u64, k1: u64| {
        #[allow(deprecated)]
        let mut h = std::hash::SipHasher::new_with_keys(k0, k1);
        h.write_u32(database);
        h.write(queue.as_bytes());
        h.finish()
    };
    let [k0, k1] = buckets.hash_keys;
    ((u128::from(half(k0, k1)) << 64) | u128::from(half(k1, k0))).max(1)
}

/// The bucket of `queue`: its own, or one that is free (never used, or all
/// its cells in the past: the same as a fresh one), found by open addressing
/// from its key; None when every bucket is some other queue's and in use.
fn slot_of(buckets: &mut Buckets, queue: &str, now: i64) -> Option<usize> {
    let key = key_of(buckets, queue);
    let start = (key % BUCKETS as u128) as usize;
    let mut free = None;
    for step in 0..BUCKETS {
        let index = (start + step) % BUCKETS;
        let slot = buckets.slots[index];
        if slot.key == key {
            return Some(index);
        }
        if free.is_none() && (slot.key == 0 || slot.tat <= now - TOLERANCE_MAX_US) {
            free = Some(index);
        }
        if slot.key == 0 {
            break; // (never used: no later slot can be this queue's)
        }
    }
    let index = free?;
    buckets.slots[index] = Bucket { key, tat: i64::MIN };
    Some(index)
}

fn now_us() -> i64 {
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// The earliest free cell of bucket `slot` a claim may take now: its next
/// one, or `tolerance` ago if that is later (after `now`: none is free).
fn first_free(buckets: &Buckets, slot: usize, now: i64, per_us: i64) -> i64 {
    buckets.slots[slot].tat.max(now - tolerance(per_us))
}

/// A cell's spacing (µs), for a rate of `rate` per `per_us`.
fn spacing(rate: i32, per_us: i64) -> Option<i64> {
    (rate > 0 && per_us > 0).then(|| (per_us / i64::from(rate)).max(1))
}

/// How many commands of `queue` may start now: the cells from `tolerance`
/// ago to now (at least one when one is free); 0 when its rate is 0. Takes nothing.
#[pg_extern(volatile, parallel_unsafe)]
fn _rate_room(queue: &str, rate: i32, per_us: i64) -> i32 {
    let Some(cell) = spacing(rate, per_us) else { return 0 };
    let now = now_us();
    let mut buckets = BUCKETS_TABLE.exclusive();
    let room = match slot_of(&mut buckets, queue, now) {
        Some(slot) => {
            let base = first_free(&buckets, slot, now, per_us);
            if base > now {
                0
            } else {
                ((now - base) / cell + 1).min(i64::from(rate)) as i32
            }
        }
        None => 0,
    };
    if room == 0 {
        crate::shmem::observe("rate_limited", 1);
    }
    room
}

/// Take the next cell of `queue`'s bucket for a command that starts now;
/// false when none is free (the command is left for a later claim).
#[pg_extern(volatile, parallel_unsafe)]
fn _rate_admit(queue: &str, rate: i32, per_us: i64) -> bool {
    let Some(cell) = spacing(rate, per_us) else { return false };
    let now = now_us();
    let mut buckets = BUCKETS_TABLE.exclusive();
    let Some(slot) = slot_of(&mut buckets, queue, now) else {
        crate::shmem::observe("rate_limited", 1);
        return false;
    };
    let base = first_free(&buckets, slot, now, per_us);
    if base > now {
        crate::shmem::observe("rate_limited", 1);
        return false;
    }
    buckets.slots[slot].tat = base + cell;
    true
}

/// When `queue`'s next cell is free: now if one is, 'infinity' for a rate of
/// 0 (or while every bucket is in use).
#[pg_extern(volatile, parallel_unsafe)]
fn _rate_next(queue: &str, rate: i32, per_us: i64) -> TimestampWithTimeZone {
    let Some(_) = spacing(rate, per_us) else { return TimestampWithTimeZone::positive_infinity() };
    let now = now_us();
    let mut buckets = BUCKETS_TABLE.exclusive();
    let Some(slot) = slot_of(&mut buckets, queue, now) else { return TimestampWithTimeZone::positive_infinity() };
    crate::spans::timestamp_from_pg(buckets.slots[slot].tat.max(now))
        .unwrap_or(TimestampWithTimeZone::positive_infinity())
}
