//! The Rust half of flow's SQL surface: small internal functions the SQL API
//! (sql/*.sql) is built on. Public functions live in SQL; these are `flow._*`.

use crate::{executor, gucs, shmem};
use pgrx::prelude::*;
use std::cell::RefCell;
use std::collections::HashMap;

thread_local! {
    /// Tickets handed out by `_ticket()` and not yet redeemed: ticket → role.
    static TICKETS: RefCell<HashMap<i64, pg_sys::Oid>> = RefCell::new(HashMap::new());
}

/// Remember the current role under a random one-shot ticket. Called in the
/// default expression of a public SECURITY DEFINER function, this runs in the
/// caller's security context; `_redeem` then tells the function who called it.
/// A role can only ever make tickets for itself.
#[pg_extern(volatile, parallel_unsafe)]
fn _ticket() -> i64 {
    let ticket: i64 = rand::random();
    let role = unsafe { pg_sys::GetUserId() };
    TICKETS.with(|t| {
        let mut t = t.borrow_mut();
        // Tickets of calls that failed before redeeming are never used again.
        if t.len() > 1024 {
            t.clear();
        }
        t.insert(ticket, role);
    });
    ticket
}

/// Exchange a ticket for the role that made it. Each ticket works once.
#[pg_extern(volatile, parallel_unsafe)]
fn _redeem(ticket: Option<i64>) -> pg_sys::Oid {
    let role = ticket.and_then(|ticket| TICKETS.with(|t| t.borrow_mut().remove(&ticket)));
    let Some(role) = role else {
        pgrx::ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            "flow: caller_ticket is not a ticket of this session; leave it to its default"
        );
    };
    role
}

/// Wake the idle workers when the current transaction commits. What it made
/// due may be due at any time, even before where the workers' claims ended:
/// their next claims start from the queues' heads.
#[pg_extern(volatile, parallel_unsafe)]
fn _wake() {
    shmem::wake_at_commit(i64::MIN);
}

/// `_wake`, for a transaction whose commands made due are all due at `due`
/// or later ('infinity': it made none due): the workers' claims may go on
/// from where they ended if that is before `due` (see shmem::DueFloors).
#[pg_extern(volatile, parallel_unsafe)]
fn _wake_due_from(due: TimestampWithTimeZone) {
    shmem::wake_at_commit(due.into_inner());
}

/// Ask the workers to stop running handlers of `run` (flow.cancel calls this
/// before it waits for the run's lock).
#[pg_extern(volatile, parallel_unsafe)]
fn _interrupt_run(run: pgrx::Uuid) {
    shmem::interrupt_run(*run.as_bytes());
}

/// Stop the workers running handlers of `run` that ignored flow.cancel.
#[pg_extern(volatile, parallel_unsafe)]
fn _stop_workers_of(run: pgrx::Uuid) -> i32 {
    shmem::stop_workers_of(*run.as_bytes())
}

thread_local! {
    /// The last id's millisecond and counter (see `_new_id`).
    static LAST_ID: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

/// A new time-ordered id (UUIDv7, RFC 9562): 48 bits of Unix milliseconds, a
/// 42-bit counter (12 bits of rand_a and the top 30 of rand_b) that starts at
/// a random value in each new millisecond and counts up within it, so ids made
/// by one process are strictly increasing, and 32 random bits.
/// The random bits come from rand's thread-local generator (ChaCha, seeded
/// from the OS, reseeded after fork), not from a getrandom system call per id
/// as `uuid::Uuid::now_v7` makes them: that call was 6 % of an enqueue_many.
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
    let bits = (u128::from(ms & 0xFFFF_FFFF_FFFF) << 80)
        | (0x7 << 76)                                       // version 7
        | (u128::from(counter >> 30) << 64)                 // rand_a: the counter's top 12 bits
        | (0b10 << 62)                                      // variant
        | (u128::from(counter & 0x3FFF_FFFF) << 32)         // rand_b: the counter's low 30 bits,
        | u128::from(rng.gen::<u32>()); // then random ones
    pgrx::Uuid::from_bytes(bits.to_be_bytes())
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

/// flow.max_result_bytes, in bytes, for the SQL side's payload checks.
#[pg_extern(stable, parallel_safe)]
fn _max_payload_bytes() -> i32 {
    gucs::max_result_bytes()
}

/// flow.lease_duration in seconds: the default lease of external claims.
#[pg_extern(stable, parallel_safe)]
fn _lease_duration_s() -> i32 {
    gucs::lease_duration().as_secs() as i32
}

/// The command whose handler is running in this backend, NULL outside a handler.
#[pg_extern(volatile, parallel_unsafe)]
fn _current_command() -> Option<pgrx::Uuid> {
    executor::current_command().map(pgrx::Uuid::from_bytes)
}

/// One row per configured worker, from shared memory (the engine's: the
/// views read it through flow._worker_rows, which names only the caller's
/// commands).
#[pg_extern(volatile, parallel_safe)]
fn _worker_states() -> TableIterator<
    'static,
    (
        name!(worker, i32),
        name!(pid, Option<i32>),
        name!(state, String),
        name!(command_id, Option<pgrx::Uuid>),
        name!(since, Option<TimestampWithTimeZone>),
        name!(handled, i64),
    ),
> {
    let table = *shmem::WORKERS.share();
    let rows: Vec<_> = (0..gucs::workers())
        .map(|i| {
            let slot = table.slots[i];
            let now = shmem::activity(i);
            let alive = slot.procno >= 0;
            let state = match (alive, now.busy) {
                (false, _) => "stopped",
                (true, false) => "idle",
                (true, true) => "busy",
            };
            let command = (now.command != [0; 16]).then(|| pgrx::Uuid::from_bytes(now.command));
            let since = alive.then(|| timestamp_from_pg(now.since)).flatten();
            (i as i32, alive.then_some(slot.pid), state.to_string(), command, since, now.handled as i64)
        })
        .collect();
    TableIterator::new(rows)
}

pub fn timestamp_from_pg(micros: i64) -> Option<TimestampWithTimeZone> {
    unsafe { TimestampWithTimeZone::from_datum(pg_sys::Datum::from(micros), false) }
}

/// The engine's counters, one row each (see shmem::METRICS).
#[pg_extern(volatile, parallel_safe)]
fn _counters() -> TableIterator<'static, (name!(name, String), name!(value, i64))> {
    TableIterator::new(shmem::counter_values().into_iter().map(|(name, v)| (name.to_string(), v as i64)))
}

/// Count `n` of a metric when the current transaction commits (the engine's SQL).
#[pg_extern(volatile, parallel_unsafe)]
fn _observe(metric: &str, n: i64) {
    shmem::observe(metric, n.max(0) as u64);
}

/// For recovery: the command whose attempt the stopped worker (pid,
/// backend_start) was in (the nil UUID: between attempts), or NULL when
/// nothing is known of how it ended (a crash, a server restart).
#[pg_extern(volatile, parallel_unsafe)]
fn _stopped_in(pid: i32, backend_start: TimestampWithTimeZone) -> Option<pgrx::Uuid> {
    let micros = backend_start.into_datum().map_or(0, |d| d.value() as i64);
    shmem::stopped_in(pid, micros).map(pgrx::Uuid::from_bytes)
}
