//! flow's own locks: event keys, event key buckets and queue names are
//! locked under lock tags of flow's own (field 4 of an advisory lock tag,
//! which `pg_advisory_lock()` never uses: it only ever sets 1, one bigint
//! key, and 2, two int keys), so no role can take them from SQL and stall
//! another role's emits, waits or queues. What is locked is hashed to the
//! tag's 64 bits with FNV-1a over its bytes: the same in every backend and
//! every build (std's DefaultHasher may change between Rust releases).

use pgrx::pg_sys;
use pgrx::prelude::*;

/// One lock tag kind per kind of thing locked, so an event key and a queue
/// never share a lock.
const EVENT_LOCK_TAG: u16 = 0x464C; // "FL"
const QUEUE_LOCK_TAG: u16 = 0x4651; // "FQ"
const EVENT_BUCKET_LOCK_TAG: u16 = 0x4652; // "FR"

/// FNV-1a, 64 bits, over `parts`, each followed by a 0xFF byte (which no
/// UTF-8 text contains), so ("ab", "c") and ("a", "bc") differ.
fn hash64(parts: &[&[u8]]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    for part in parts {
        for byte in part.iter().chain(std::iter::once(&0xFF)) {
            hash = (hash ^ u64::from(*byte)).wrapping_mul(PRIME);
        }
    }
    hash
}

/// Lock `hash` (two things whose hashes agree only wait for each other
/// needlessly) in `mode` until the end of the transaction, under a lock tag
/// of flow's own. With `wait` false, only if no other transaction holds it
/// in a conflicting mode (then false).
fn lock_own(kind: u16, hash: u64, mode: pg_sys::LOCKMODE, wait: bool) -> bool {
    let tag = pg_sys::LOCKTAG {
        locktag_field1: unsafe { pg_sys::MyDatabaseId }.to_u32(),
        locktag_field2: (hash >> 32) as u32,
        locktag_field3: hash as u32,
        locktag_field4: kind,
        locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
        locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
    };
    let got = unsafe { pg_sys::LockAcquire(&tag, mode, false, !wait) };
    got != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
}

/// Lock the event key (name, key) of one owner's runs (`domain`; 0: of every
/// owner) until the end of the transaction. Emitting and creating a wait on
/// the same key conflict, so a wait created while the event is emitted is
/// never missed by both sides (see flow._lock_event_emit and
/// flow._lock_event_waits). `mode`: 'share', 'row exclusive' or 'exclusive'.
#[pg_extern(volatile, parallel_unsafe)]
fn _lock_event_key(name: &str, key: &str, domain: pg_sys::Oid, mode: &str) {
    let mode = match mode {
        "share" => pg_sys::ShareLock,
        "row exclusive" => pg_sys::RowExclusiveLock,
        "exclusive" => pg_sys::ExclusiveLock,
        _ => pgrx::error!("flow: unknown event lock mode {mode}"),
    };
    let hash = hash64(&[name.as_bytes(), key.as_bytes(), &domain.to_u32().to_le_bytes()]);
    lock_own(EVENT_LOCK_TAG, hash, mode as pg_sys::LOCKMODE, true);
}

/// Event retention and the creation of waits on the same event key conflict
/// through one of EVENT_BUCKETS locks (the key's bucket), not a lock per key:
/// a pass of retention deletes thousands of events, and a lock each would
/// fill the server's lock table. A wait's creation takes its key's bucket
/// (`share` false: row exclusive, never in another creation's way) and
/// holds it to commit; flow._retire_events deletes an event only under its
/// bucket (`share` true), taken without waiting (`wait` false: false when a
/// wait is being created in that bucket, and the event stays this pass). So
/// a wait created meanwhile either waits for the deletion to commit and does
/// not find the event, or keeps it (a wait referring to an event being
/// deleted failed its foreign key).
const EVENT_BUCKETS: u64 = 64;

#[pg_extern(volatile, parallel_unsafe)]
fn _lock_event_bucket(name: &str, key: &str, share: bool, wait: bool) -> bool {
    let bucket = hash64(&[name.as_bytes(), key.as_bytes()]) % EVENT_BUCKETS;
    let mode = if share { pg_sys::ShareLock } else { pg_sys::RowExclusiveLock };
    lock_own(EVENT_BUCKET_LOCK_TAG, bucket, mode as pg_sys::LOCKMODE, wait)
}

/// Lock a queue's name until the end of the transaction: shared by whoever
/// puts a definition or a command in the queue (flow._hold_queue, and a
/// re-drive: flow._retry), exclusive by flow.drop_queue, which so waits for
/// them to commit before it looks for what uses the queue, and makes them
/// wait until it has dropped it.
#[pg_extern(volatile, parallel_unsafe)]
fn _lock_queue_name(name: &str, exclusive: bool) {
    let mode = if exclusive { pg_sys::ExclusiveLock } else { pg_sys::ShareLock };
    lock_own(QUEUE_LOCK_TAG, hash64(&[name.as_bytes()]), mode as pg_sys::LOCKMODE, true);
}

/// Lock a queue's name exclusively, as flow.drop_queue does, but only if no
/// transaction is putting commands in it now (else false, at once): the
/// maintenance worker forgetting the priorities its commands no longer use
/// (flow._retire_priorities) never waits for a role's open transaction.
#[pg_extern(volatile, parallel_unsafe)]
fn _try_lock_queue_name(name: &str) -> bool {
    lock_own(QUEUE_LOCK_TAG, hash64(&[name.as_bytes()]), pg_sys::ExclusiveLock as pg_sys::LOCKMODE, false)
}
