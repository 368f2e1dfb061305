//! Ids: time-ordered run and command ids (UUIDv7) and unguessable lease
//! tokens (UUIDv4), both from rand's thread-local generator.

use pgrx::prelude::*;

thread_local! {
    /// The last id's millisecond and counter (see `_new_id`).
    static LAST_ID: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

/// A new time-ordered id (UUIDv7, RFC 9562, built by `uuid`'s v7 builder):
/// 48 bits of Unix milliseconds, a 42-bit counter (12 bits of rand_a and the
/// top 30 of rand_b) that starts at a random value in each new millisecond
/// and counts up within it, so ids made by one process are strictly
/// increasing, and 32 random bits. The random bits come from rand's
/// thread-local generator (ChaCha, seeded from the OS, reseeded after fork),
/// not a getrandom system call per id as `uuid::Uuid::now_v7`'s: that call
/// was 6 % of an enqueue_many.
#[pg_extern(volatile, parallel_safe)]
pub(crate) fn _new_id() -> pgrx::Uuid {
    use rand::Rng;
    const COUNTER_MAX: u64 = (1 << 42) - 1;
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let mut rng = rand::thread_rng();
    let (ms, counter) = LAST_ID.with(|last| {
        let (last_ms, last_counter) = last.get();
        let next = if now_ms > last_ms {
            // a fresh start in the lower half, so counting up has room
            (now_ms, rng.gen::<u64>() & (COUNTER_MAX >> 1))
        } else if last_counter < COUNTER_MAX {
            // the same millisecond (or the clock went back): count up
            (last_ms, last_counter + 1)
        } else {
            (last_ms + 1, rng.gen::<u64>() & (COUNTER_MAX >> 1))
        };
        last.set(next);
        next
    });
    // The builder's 10 bytes after the timestamp: the counter's top 12 bits
    // (rand_a, under the version), its low 30 (rand_b, under the variant),
    // then 32 random bits.
    let mut tail = [0u8; 10];
    tail[..2].copy_from_slice(&((counter >> 30) as u16).to_be_bytes());
    tail[2..6].copy_from_slice(&((counter & 0x3FFF_FFFF) as u32).to_be_bytes());
    tail[6..].copy_from_slice(&rng.gen::<u32>().to_be_bytes());
    pgrx::Uuid::from_bytes(*uuid::Builder::from_unix_timestamp_millis(ms, &tail).into_uuid().as_bytes())
}

/// A new lease token (UUIDv4: 122 random bits). A token is what an external
/// worker presents to settle or extend its lease, so it must be unguessable:
/// its bits come from rand's thread-local generator, a cryptographically
/// secure one (ChaCha12, seeded from the OS, reseeded every 64 KiB and after
/// fork). `gen_random_uuid()` drew each token from OpenSSL under a lock, about
/// a microsecond each: 3 % of an external claim-and-complete.
#[pg_extern(volatile, parallel_safe)]
fn _lease_token() -> pgrx::Uuid {
    use rand::Rng;
    let mut bytes: [u8; 16] = rand::thread_rng().gen();
    bytes[6] = (bytes[6] & 0x0F) | 0x40; // version 4
    bytes[8] = (bytes[8] & 0x3F) | 0x80; // variant
    pgrx::Uuid::from_bytes(bytes)
}
