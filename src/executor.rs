//! Execute and settle claimed commands (engine rules 4–7).
//!
//! Claimed commands run in chunks, one transaction per chunk. The chunk first
//! locks the runs of its commands (flow._begin_batch), so no cancel or run
//! failure can take a lease away while it runs, and commands that lost their
//! lease since the claim are skipped. Each handler runs in its own
//! subtransaction, as its definition's owner with a pinned `search_path`,
//! under the attempt deadline enforced by PostgreSQL's statement-timeout timer.
//! A failed handler's subtransaction is rolled back and the failure settled at
//! once; successes are settled together at the end of the chunk in a few
//! set-based statements (flow._settle_batch). Handlers' writes, events and
//! children commit with their settlement in the chunk's transaction, or not at all.

use crate::payload::{Context, Jsonb, RawDatum};
use crate::{api, gateway, gucs, shmem};
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{self, PgBuiltInOids, PgOid};
use pgrx::prelude::*;
use pgrx::spi::OwnedPreparedStatement;
use pgrx::{FromDatum, PgTryBuilder};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::ffi::c_int;

/// A command claimed by this worker, as `flow._claim` handed it out.
pub struct Claimed {
    pub command_id: pgrx::Uuid,
    pub run_id: pgrx::Uuid,
    pub lease_token: pgrx::Uuid,
    /// min(retry budget end, run deadline) as a PostgreSQL TimestampTz (µs).
    pub hard_deadline: Option<i64>,
    /// The definition's attempt timeout (µs), counted from the handler's start:
    /// a command claimed in a batch may start well after its claim.
    pub timeout_us: Option<i64>,
    pub handler: pg_sys::Oid,
    pub owner: pg_sys::Oid,
    /// The args, handed to the handler as the datum they were (see payload).
    pub args: Jsonb,
    /// Only for handlers that take a `flow.context` (see payload::Context).
    pub context: Option<Context>,
    /// The definition's args_type, if any: the args must still fit it.
    pub args_type: Option<pg_sys::Oid>,
    /// Held, not leased (see flow._claim): the number of the attempt it makes,
    /// counted when it is settled in the claim's own transaction.
    pub held_attempt: Option<i32>,
    /// A held command's row, locked by the claim: where its settlement writes.
    pub row_at: Option<pg_sys::ItemPointerData>,
    /// Its queue and due time: where it is in its queue's claim order (with its id).
    pub queue: String,
    pub due_at: TimestampWithTimeZone,
    /// The attempt's deadline as the claim computed it (what a lease expires at).
    pub attempt_deadline: Option<TimestampWithTimeZone>,
}

/// What a settlement names: the command, and its lease or held attempt.
#[derive(Clone, Copy)]
pub struct AttemptId {
    pub command_id: pgrx::Uuid,
    pub lease_token: pgrx::Uuid,
    pub held_attempt: Option<i32>,
}

impl Claimed {
    pub fn id(&self) -> AttemptId {
        AttemptId { command_id: self.command_id, lease_token: self.lease_token, held_attempt: self.held_attempt }
    }

    /// The attempt's deadline for a handler starting at `now` (TimestampTz µs).
    fn deadline(&self, now: i64) -> Option<i64> {
        let timeout = self.timeout_us.or_else(gateway::default_attempt_timeout_us);
        let soft = timeout.map(|t| now.saturating_add(t));
        match (soft, self.hard_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// How a failed attempt was settled.
#[derive(Debug, PartialEq)]
enum Settled {
    /// The lease was no longer ours (a held command: it moved on, or its run
    /// is locked elsewhere): nothing was written.
    Expired,
    /// Settled as a failure; `retry` tells whether another attempt is scheduled.
    Failed { retry: bool },
    /// Not settled: its run or its row is locked elsewhere (only when the
    /// caller would not wait for them).
    Locked,
}

/// A failure's class (see `flow._settle_failure`), code and message.
#[derive(Debug)]
struct Failure {
    class: &'static str,
    code: String,
    message: String,
    delay_us: Option<i64>,
}

/// A decision a handler announced (flow.fail, flow.retry_after, an invalid
/// spawn or emit). pgrx reports flow's own SQLSTATEs as XX000, so the class
/// travels beside the error; it only counts when the caught error carries the
/// same message.
struct Decision {
    class: &'static str,
    code: String,
    message: String,
    delay_us: Option<i64>,
}

thread_local! {
    static CURRENT_COMMAND: Cell<Option<[u8; 16]>> = const { Cell::new(None) };
    static ATTEMPT_IN_PROGRESS: Cell<Option<[u8; 16]>> = const { Cell::new(None) };
    static DECISION: RefCell<Option<Decision>> = const { RefCell::new(None) };
    /// flow.fail(message, keep_writes => true): the handler returns normally,
    /// its writes commit, and the command fails permanently.
    static KEPT_FAILURE: RefCell<Option<Decision>> = const { RefCell::new(None) };
    /// The first invalid decision (a bad spawn or emit) of this attempt: it
    /// fails the command even if the handler caught the error (as the reference).
    static INVALID_DECISION: RefCell<Option<Decision>> = const { RefCell::new(None) };
    /// Per (handler, owner): the kept plan of its call, and whether it takes a context.
    static HANDLER_PLANS: RefCell<HashMap<(u32, u32), (OwnedPreparedStatement, bool)>> = RefCell::new(HashMap::new());
    static ENGINE_PLANS: RefCell<HashMap<&'static str, OwnedPreparedStatement>> = RefCell::new(HashMap::new());
    /// A relation's description changed since the engine's plans were last
    /// warmed (see `warm_plans`).
    static PLANS_MAY_BE_STALE: Cell<bool> = const { Cell::new(false) };
    /// A command was spawned in this backend since the current chunk began
    /// (flow._note_spawn): its settlement must look for children (see
    /// flow._settle_batch's `alone`).
    static SPAWNED_IN_CHUNK: Cell<bool> = const { Cell::new(false) };
    /// Handlers whose last attempt in this worker took under FAST_HANDLER:
    /// their commands are held, not leased (see flow._claim).
    static FAST_HANDLERS: RefCell<HashSet<u32>> = RefCell::new(HashSet::new());
    /// Handlers that failed lately in this worker, with how many more of
    /// their attempts run alone before they are grouped again (see GROUP_SIZE).
    static FAILING_HANDLERS: RefCell<HashMap<u32, u32>> = RefCell::new(HashMap::new());
}

/// Held attempts of one role's handlers that have not failed lately share one
/// subtransaction, up to this many, instead of one each. A handler that
/// writes takes a subtransaction id, and a transaction with more than 64 of
/// them overflows every snapshot in the server (see subxid_cache_nearly_full):
/// so a chunk of writing handlers each in its own subtransaction ends after
/// 56 commands, and its claim, settlement and commit are shared by only 56.
/// Grouped, a chunk runs up to 56 groups. When an attempt in a group fails
/// (or is cut short), the group's subtransaction is rolled back — nothing of
/// it was settled or committed — and its earlier members run again, each in
/// a subtransaction of its own; the failed one is concluded with the failure
/// it had. Their writes commit once either way.
const GROUP_SIZE: usize = 32;
/// After a failure, this many of the handler's attempts run alone.
const ALONE_AFTER_FAILURE: u32 = 256;

/// Whether a held attempt of `handler` may join a group.
fn groupable(handler: pg_sys::Oid) -> bool {
    FAILING_HANDLERS.with(|f| {
        let mut f = f.borrow_mut();
        match f.get_mut(&handler.to_u32()) {
            None => true,
            Some(left) if *left <= 1 => {
                f.remove(&handler.to_u32());
                false
            }
            Some(left) => {
                *left -= 1;
                false
            }
        }
    })
}

fn note_handler_failed(handler: pg_sys::Oid) {
    FAILING_HANDLERS.with(|f| f.borrow_mut().insert(handler.to_u32(), ALONE_AFTER_FAILURE));
}

/// A handler whose last attempt in this worker finished within this long has
/// its next commands held: run and settled in the claim's transaction, one
/// write each and no commit before it starts. Others are leased, so a long
/// attempt shows as `running` while it runs (and the first attempt of a
/// handler, before anything is known of it, is leased too).
const FAST_HANDLER: std::time::Duration = std::time::Duration::from_millis(10);

fn note_handler_time(handler: pg_sys::Oid, took: std::time::Duration) {
    FAST_HANDLERS.with(|f| {
        let mut f = f.borrow_mut();
        if took < FAST_HANDLER {
            f.insert(handler.to_u32());
        } else {
            f.remove(&handler.to_u32());
        }
    });
}

// utils/timeout.h is not in pgrx-pg-sys 0.18.1. STATEMENT_TIMEOUT is 3 in
// PostgreSQL 15's TimeoutId enum (re-check on a new major version).
const STATEMENT_TIMEOUT: u32 = 3;
unsafe extern "C-unwind" {
    fn enable_timeout_after(id: u32, delay_ms: c_int);
    fn RegisterTimeout(id: u32, handler: Option<unsafe extern "C-unwind" fn()>) -> u32;
    fn disable_timeout(id: u32, keep_indicator: bool);
    fn get_timeout_indicator(id: u32, reset_indicator: bool) -> bool;
}

/// Whether this transaction's subtransactions that wrote (each handler that
/// writes has one) nearly fill PostgreSQL's per-backend cache of them
/// (PGPROC_MAX_CACHED_SUBXIDS, 64): one more and every snapshot taken in the
/// server would be "suboverflowed" and read pg_subtrans, slowing every
/// session. A chunk ends here; a few slots stay free for the settlements of
/// failures, which run in subtransactions of their own.
pub fn subxid_cache_nearly_full() -> bool {
    const MAX_CACHED_SUBXIDS: u8 = 64;
    let status = unsafe { (*pg_sys::MyProc).subxidStatus };
    status.overflowed || status.count >= MAX_CACHED_SUBXIDS - 8
}

/// The command whose attempt this worker is in, from before its handler starts
/// until the attempt's outcome is known (what a worker stopped meanwhile is
/// charged for).
pub fn attempt_in_progress() -> Option<[u8; 16]> {
    ATTEMPT_IN_PROGRESS.with(|c| c.get())
}

pub fn current_command() -> Option<[u8; 16]> {
    CURRENT_COMMAND.with(|c| c.get())
}

/// Called by flow._spawn before it inserts a child (in any backend; only an
/// in-database worker's chunk reads it).
#[pg_extern(volatile, parallel_unsafe)]
fn _note_spawn() {
    SPAWNED_IN_CHUNK.with(|s| s.set(true));
}

/// Called by flow.fail / flow.retry_after / an invalid spawn or emit. Returns
/// whether a handler is running in this backend (flow.fail with keep_writes
/// needs one).
#[pg_extern(volatile, parallel_unsafe)]
fn _decide(class: &str, code: &str, message: &str, delay_us: Option<i64>) -> bool {
    decide(class, code, message, delay_us);
    current_command().is_some()
}

pub fn decide(class: &str, code: &str, message: &str, delay_us: Option<i64>) {
    let decision = |class| Decision { class, code: code.to_string(), message: message.to_string(), delay_us };
    match class {
        // the first of each counts
        "kept_failure" => KEPT_FAILURE.with(|k| {
            k.borrow_mut().get_or_insert_with(|| decision("permanent"));
        }),
        "invalid_decision" => {
            INVALID_DECISION.with(|d| {
                d.borrow_mut().get_or_insert_with(|| decision("permanent"));
            });
            DECISION.with(|d| *d.borrow_mut() = Some(decision("permanent")));
        }
        "permanent" | "retry_after" => {
            let class = if class == "permanent" { "permanent" } else { "retry_after" };
            DECISION.with(|d| *d.borrow_mut() = Some(decision(class)));
        }
        _ => DECISION.with(|d| *d.borrow_mut() = Some(decision("retryable"))),
    }
}

fn decided_failure(decision: Decision) -> Failure {
    Failure { class: decision.class, code: decision.code, message: decision.message, delay_us: decision.delay_us }
}

/// Forget every cached plan: after an error outside a handler, or when the
/// extension was dropped or upgraded under the worker.
pub fn forget_plans() {
    DirectCall::forget();
    HANDLER_PLANS.with(|p| p.borrow_mut().clear());
    ENGINE_PLANS.with(|p| p.borrow_mut().clear());
}

/// Watch for changes to relations' descriptions (ANALYZE, TRUNCATE, DDL, an
/// overflowed invalidation queue): each drops the kept plans that read the
/// relation, to be planned again at their next use. Called once when a worker starts.
pub fn watch_plans() {
    unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(relation_changed), pg_sys::Datum::from(0)) };
}

#[pg_guard]
unsafe extern "C-unwind" fn relation_changed(_arg: pg_sys::Datum, _relation: pg_sys::Oid) {
    PLANS_MAY_BE_STALE.with(|s| s.set(true));
}

/// Whether a relation changed since the plans were last warmed.
pub fn plans_may_be_stale() -> bool {
    PLANS_MAY_BE_STALE.with(|s| s.get())
}

/// For an idle worker: plan again, now, the statements of the pickup path
/// (the claim and the settlement) if a relation changed since the last time,
/// so that the first command enqueued after an ANALYZE or a TRUNCATE does not
/// wait for them to be planned (one to a few milliseconds). A claim of no
/// command and a settlement of none run every statement and change nothing.
/// A handler's own statements are planned again at its next call.
pub fn warm_plans(owner: &str, backend_start: Option<TimestampWithTimeZone>) {
    if !PLANS_MAY_BE_STALE.with(|s| s.replace(false)) {
        return;
    }
    claim(owner, backend_start, 0, 0, Vec::new(), None);
    let none: [DatumWithOid; 8] = [
        Vec::<pgrx::Uuid>::new().into(),
        Vec::<pgrx::Uuid>::new().into(),
        Vec::<Option<Jsonb>>::new().into(),
        Vec::<Option<TimestampWithTimeZone>>::new().into(),
        Vec::<Option<i32>>::new().into(),
        owner.into(),
        Vec::<Option<pg_sys::ItemPointerData>>::new().into(),
        false.into(),
    ];
    settle_batch(&none);
}

/// Run one of the engine's own statements through a plan kept across calls.
pub fn engine_query<R>(
    sql: &'static str,
    types: &[PgOid],
    args: &[DatumWithOid],
    read: impl FnOnce(pgrx::spi::SpiTupleTable) -> R,
) -> R {
    gateway::ensure_engine_path();
    holding_off_cancels(|| {
        Spi::connect_mut(|client| {
            ENGINE_PLANS.with(|plans| {
                let mut plans = plans.borrow_mut();
                if !plans.contains_key(sql) {
                    let plan = client.prepare_mut(sql, types).unwrap_or_else(|e| error!("flow: {e}")).keep();
                    plans.insert(sql, plan);
                }
                // select, not update: the plan was prepared mutating (it runs
                // read-write), and `update` would also force a transaction id on
                // the current (sub)transaction (see call_handler)
                let table = client.select(&plans[sql], None, args).unwrap_or_else(|e| error!("flow: {e}"));
                read(table)
            })
        })
    })
}

/// One row of the result `engine_query` just produced, taken apart once.
/// pgrx's row (`SpiHeapTupleData`) reads each column through two calls into
/// PostgreSQL, each behind its own error guard, and checks its type again on
/// every read: for a claim of 1,000 rows of 14 columns that was 6 % of a
/// drain's CPU. The engine knows the types of its own statements' columns.
pub struct Row {
    values: Vec<pg_sys::Datum>,
    nulls: Vec<bool>,
}

impl Row {
    /// Column `ordinal` (1-based); None for NULL. `T` must be the column's
    /// type, as the caller gave it to `rows` (which checked the result's).
    pub fn get<T: FromDatum>(&self, ordinal: usize) -> Option<T> {
        // SAFETY: the datum was deformed from the current result's tuple by
        // its own descriptor, and is read before that result is freed; the
        // caller names the column's type. (Values by reference are copied
        // out by every FromDatum the engine reads.)
        unsafe { T::from_polymorphic_datum(self.values[ordinal - 1], self.nulls[ordinal - 1], pg_sys::InvalidOid) }
    }
}

/// Each row of the result the statement just run by `engine_query` left in
/// SPI_tuptable (`table`), mapped by `each`. `types`: its columns' types
/// (`PgOid::Invalid` for a composite), checked once per result: a row read
/// as other types than it has would read memory that is not its own.
pub fn rows<R>(table: pgrx::spi::SpiTupleTable, types: &[PgOid], mut each: impl FnMut(&Row) -> R) -> Vec<R> {
    let count = table.len();
    if count == 0 {
        return Vec::new();
    }
    // SAFETY: SPI_tuptable is the result `table` reads (nothing ran since),
    // with `count` tuples of its descriptor
    unsafe {
        let result = pg_sys::SPI_tuptable;
        if result.is_null() || (*result).numvals as usize != count {
            error!("flow: the engine's statement left no result to read");
        }
        let tupdesc = (*result).tupdesc;
        let natts = (*tupdesc).natts as usize;
        let attributes = (*tupdesc).attrs.as_slice(natts);
        let fits = natts == types.len()
            && attributes.iter().zip(types).all(|(attribute, expected)| match expected {
                PgOid::Invalid => pg_sys::type_is_rowtype(attribute.atttypid),
                expected => attribute.atttypid == expected.value(),
            });
        if !fits {
            error!("flow: the engine's statement returned other columns than this library reads (is the extension's SQL of this release?)");
        }
        let mut row = Row { values: vec![pg_sys::Datum::from(0); natts], nulls: vec![true; natts] };
        std::slice::from_raw_parts((*result).vals, count)
            .iter()
            .map(|tuple| {
                pg_sys::heap_deform_tuple(*tuple, tupdesc, row.values.as_mut_ptr(), row.nulls.as_mut_ptr());
                each(&row)
            })
            .collect()
    }
}

/// Run the engine's own work with statement cancels held off, then drop any
/// that came: a cancel meant for a handler (flow.cancel, pg_cancel_backend,
/// a late attempt timer) must not abort the engine's SQL or its cleanup. An
/// ERROR resets the holdoff count (elog.c), so no guard is needed on that path.
fn holding_off_cancels<R>(f: impl FnOnce() -> R) -> R {
    unsafe { pg_sys::QueryCancelHoldoffCount += 1 };
    let result = f();
    unsafe {
        pg_sys::QueryCancelHoldoffCount -= 1;
        pg_sys::QueryCancelPending = 0;
    }
    result
}

pub(crate) const UUID: PgOid = PgOid::BuiltIn(PgBuiltInOids::UUIDOID);
const TEXT: PgOid = PgOid::BuiltIn(PgBuiltInOids::TEXTOID);
const INT8: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT8OID);
pub(crate) const INT4: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT4OID);
pub(crate) const FLOAT8: PgOid = PgOid::BuiltIn(PgBuiltInOids::FLOAT8OID);
const BOOL: PgOid = PgOid::BuiltIn(PgBuiltInOids::BOOLOID);
const TIMESTAMPTZ: PgOid = PgOid::BuiltIn(PgBuiltInOids::TIMESTAMPTZOID);
pub(crate) const UUID_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::UUIDARRAYOID);
const JSONB: PgOid = PgOid::BuiltIn(PgBuiltInOids::JSONBOID);
const JSONB_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::JSONBARRAYOID);
pub(crate) const TIMESTAMPTZ_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::TIMESTAMPTZARRAYOID);
const INT4_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT4ARRAYOID);
const OID_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::OIDARRAYOID);
const OID: PgOid = PgOid::BuiltIn(PgBuiltInOids::OIDOID);
const TID: PgOid = PgOid::BuiltIn(PgBuiltInOids::TIDOID);
const TID_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::TIDARRAYOID);
pub(crate) const TEXT_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::TEXTARRAYOID);

/// Where a claim ended in each queue: the due time and id of the last command
/// it took there, in the claim's (next_run_at, id) order. The next claim may
/// start after it (see flow._claim).
#[derive(Default, Clone)]
pub struct ClaimCursor(Vec<(String, TimestampWithTimeZone, pgrx::Uuid)>);

/// A command's place in its queue's claim order, (next_run_at, id), as
/// PostgreSQL compares it (uuids as their bytes).
pub(crate) fn claim_position(at: TimestampWithTimeZone, id: &pgrx::Uuid) -> (i64, [u8; 16]) {
    (at.into_inner(), *id.as_bytes())
}

impl ClaimCursor {
    fn advance(&mut self, queue: String, due_at: TimestampWithTimeZone, id: pgrx::Uuid) {
        match self.0.iter_mut().find(|(q, _, _)| *q == queue) {
            Some(last) if claim_position(last.1, &last.2) >= claim_position(due_at, &id) => {}
            Some(last) => (last.1, last.2) = (due_at, id),
            None => self.0.push((queue, due_at, id)),
        }
    }

    /// Start at `command` (claimed, not run) in its queue, if it ends after it
    /// there: the end moves to just before it (the same due time, the id one less).
    pub fn rewind_to(&mut self, command: &Claimed) {
        let id = u128::from_be_bytes(*command.command_id.as_bytes()).saturating_sub(1);
        let before = pgrx::Uuid::from_bytes(id.to_be_bytes());
        if let Some(end) = self.0.iter_mut().find(|(q, _, _)| *q == command.queue) {
            if claim_position(end.1, &end.2) >= claim_position(command.due_at, &before) {
                (end.1, end.2) = (command.due_at, before);
            }
        }
    }

    /// Start after these ends too (queue, due time as TimestampTz µs, id),
    /// where they are further on.
    pub fn take_up(&mut self, ends: Vec<(String, i64, [u8; 16])>) {
        for (queue, due_at, id) in ends {
            if let Ok(due_at) = TimestampWithTimeZone::try_from(due_at) {
                self.advance(queue, due_at, pgrx::Uuid::from_bytes(id));
            }
        }
    }

    /// Its ends, as `take_up` takes them.
    pub fn ends(&self) -> Vec<(String, i64, [u8; 16])> {
        self.0.iter().map(|(queue, at, id)| (queue.clone(), at.into_inner(), *id.as_bytes())).collect()
    }

    /// The earliest of its ends' due times (TimestampTz µs); None: no ends.
    pub fn earliest(&self) -> Option<i64> {
        self.0.iter().map(|(_, at, _)| at.into_inner()).min()
    }

    /// As flow._claim and flow._next_due_ms take it: queues, due times and ids, one array each.
    pub(crate) fn columns(&self) -> (Vec<String>, Vec<TimestampWithTimeZone>, Vec<pgrx::Uuid>) {
        let mut columns = (Vec::new(), Vec::new(), Vec::new());
        for (queue, at, id) in &self.0 {
            columns.0.push(queue.clone());
            columns.1.push(*at);
            columns.2.push(*id);
        }
        columns
    }
}

/// Claim up to `max` due commands for this worker process (flow._claim), in
/// claim order: held ones, of the handlers known to be fast
/// (`fast_handlers`), which must run in this same transaction, and leased
/// ones, whose leases are written here too (flow._lease) and commit with the
/// claim. Commands named in `excluded` are left alone. Also returns where
/// the claim ended in each queue, and whether it interleaved several
/// queues: each then gave no more than its share, so a claim short of `max`
/// may have left some due.
pub fn claim(
    owner: &str,
    backend_start: Option<TimestampWithTimeZone>,
    max: i32,
    turn: i32,
    excluded: Vec<pgrx::Uuid>,
    after: Option<&ClaimCursor>,
) -> (Vec<Claimed>, ClaimCursor, bool) {
    let (after_queues, after_at, after_ids) = after.map(ClaimCursor::columns).unwrap_or_default();
    let fast: Vec<pg_sys::Oid> = FAST_HANDLERS.with(|f| f.borrow().iter().map(|oid| pg_sys::Oid::from(*oid)).collect());
    let (mut claimed, leased, cursor, interleaved) = engine_query(
        "SELECT command_id, run_id, attempt,
                (extract(epoch FROM hard_deadline) * 1000000)::bigint - 946684800000000,
                (extract(epoch FROM attempt_timeout) * 1000000)::bigint,
                handler, handler_owner, args, args_type::oid, held,
                context, queue, due_at, claim_order, row_at, deadline
         FROM flow._claim($1, NULL, $2, $3, $4, $5, $6, $7)",
        &[INT4, INT4, OID_ARRAY, UUID_ARRAY, TEXT_ARRAY, TIMESTAMPTZ_ARRAY, UUID_ARRAY],
        &[
            max.into(),
            turn.into(),
            fast.into(),
            excluded.into(),
            after_queues.into(),
            after_at.into(),
            after_ids.into(),
        ],
        |rows| {
            let mut cursor = ClaimCursor::default();
            // A claim from one queue has no claim order (NULL): its rows come
            // in due order, and are run so. A claim from several queues (claim
            // order 0) is put in claim order here, not by the claim's
            // statement (into_round_robin).
            let types = [
                UUID,
                UUID,
                INT4,
                INT8,
                INT8,
                OID,
                OID,
                JSONB,
                OID,
                BOOL,
                PgOid::Invalid,
                TEXT,
                TIMESTAMPTZ,
                INT4,
                TID,
                TIMESTAMPTZ,
            ];
            let mut interleaved = false;
            // the leased ones' rows and attempt deadlines, for their leases
            let mut leased: (Vec<pgrx::Uuid>, Vec<pg_sys::ItemPointerData>, Vec<Option<TimestampWithTimeZone>>) =
                Default::default();
            let claimed: Vec<Claimed> = self::rows(rows, &types, |row| {
                let command_id = row.get(1).expect("command_id");
                let (queue, due_at): (String, TimestampWithTimeZone) =
                    (row.get(12).expect("queue"), row.get(13).expect("due_at"));
                cursor.advance(queue.clone(), due_at, command_id);
                interleaved |= row.get::<i32>(14).is_some();
                let attempt: i32 = row.get(3).expect("attempt");
                let row_at: pg_sys::ItemPointerData = row.get(15).expect("row_at");
                let held = row.get::<bool>(10).expect("held");
                let attempt_deadline = row.get::<TimestampWithTimeZone>(16);
                if !held {
                    leased.0.push(command_id);
                    leased.1.push(row_at);
                    leased.2.push(attempt_deadline);
                }
                Claimed {
                    command_id,
                    run_id: row.get(2).expect("run_id"),
                    // (a held attempt's token never leaves the worker: it
                    // names the attempt, and no client presents it, so it need
                    // not be unguessable as a lease's: a time-ordered id does;
                    // a leased one's is its lease's, below)
                    lease_token: if held { api::_new_id() } else { pgrx::Uuid::from_bytes([0; 16]) },
                    hard_deadline: row.get::<i64>(4),
                    timeout_us: row.get::<i64>(5),
                    handler: row.get::<pg_sys::Oid>(6).expect("handler"),
                    owner: row.get::<pg_sys::Oid>(7).expect("handler_owner"),
                    args: row.get::<Jsonb>(8).expect("args"),
                    args_type: row.get::<pg_sys::Oid>(9),
                    held_attempt: held.then_some(attempt),
                    context: row.get::<Context>(11),
                    queue,
                    due_at,
                    row_at: held.then_some(row_at),
                    attempt_deadline,
                }
            });
            (claimed, leased, cursor, interleaved)
        },
    );
    if !leased.0.is_empty() {
        let tokens = lease(owner, backend_start, leased);
        // (each leased command's row is locked by this transaction: every
        // lease is written; one that was not would not run)
        claimed.retain_mut(|command| {
            command.held_attempt.is_some()
                || tokens.get(command.command_id.as_bytes()).map(|token| command.lease_token = *token).is_some()
        });
    }
    if interleaved {
        into_round_robin(&mut claimed, turn);
    }
    (claimed, cursor, interleaved)
}

/// Lease, in the claim's transaction, held commands this worker will not run
/// in it: those of other owners than the one whose handlers the claim's
/// chunk runs (a transaction never holds two owners' handlers). They run
/// later, leased, in chunks of their own owner's.
pub fn lease_instead(
    owner: &str,
    backend_start: Option<TimestampWithTimeZone>,
    mut held: Vec<Claimed>,
) -> Vec<Claimed> {
    if held.is_empty() {
        return held;
    }
    let rows = (
        held.iter().map(|c| c.command_id).collect(),
        held.iter().map(|c| c.row_at.expect("a held command has its row")).collect(),
        held.iter().map(|c| c.attempt_deadline).collect(),
    );
    let tokens = lease(owner, backend_start, rows);
    // (each row is locked by this transaction: every lease is written)
    held.retain_mut(|command| {
        let token = tokens.get(command.command_id.as_bytes());
        if let Some(token) = token {
            (command.lease_token, command.held_attempt, command.row_at) = (*token, None, None);
        }
        token.is_some()
    });
    held
}

/// Write the leases of commands this transaction's claim locked and does not
/// hold (flow._lease): their ids, rows and attempt deadlines. Returns each
/// one's lease token.
fn lease(
    owner: &str,
    backend_start: Option<TimestampWithTimeZone>,
    (ids, row_ats, deadlines): (Vec<pgrx::Uuid>, Vec<pg_sys::ItemPointerData>, Vec<Option<TimestampWithTimeZone>>),
) -> HashMap<[u8; 16], pgrx::Uuid> {
    engine_query(
        "SELECT command_id, lease_token FROM flow._lease($1, $2, $3, NULL, $4, $5, $6)",
        &[TEXT, INT4, TIMESTAMPTZ, UUID_ARRAY, TID_ARRAY, TIMESTAMPTZ_ARRAY],
        &[
            owner.into(),
            unsafe { pg_sys::MyProcPid }.into(),
            backend_start.into(),
            ids.into(),
            row_ats.into(),
            deadlines.into(),
        ],
        |rows| {
            self::rows(rows, &[UUID, UUID], |row| {
                let id: pgrx::Uuid = row.get(1).expect("command_id");
                (*id.as_bytes(), row.get(2).expect("lease_token"))
            })
            .into_iter()
            .collect()
        },
    )
}

/// A claim from several queues in the order a worker runs it: round-robin
/// (each queue's first command, then each one's second, and so on), every
/// queue's commands in due order, the queues in name order from the one whose
/// turn the claim is (flow._claim gives each queue its share by the same
/// turn). Ordered here, not by the claim's statement: a window and a sort
/// there copied every claimed row, args and context included, twice more (a
/// drain of two busy queues ran 0.91-0.92x a drain of one; 0.97x now).
fn into_round_robin(claimed: &mut Vec<Claimed>, turn: i32) {
    let due = |command: &Claimed| (command.due_at.into_inner(), *command.command_id.as_bytes());
    claimed.sort_by(|a, b| a.queue.cmp(&b.queue).then_with(|| due(a).cmp(&due(b))));
    // each command's queue's place in name order, and its rank in that queue
    let mut places: Vec<(i64, usize)> = Vec::with_capacity(claimed.len());
    for (i, command) in claimed.iter().enumerate() {
        places.push(match places.last() {
            Some(&(lane, rank)) if command.queue == claimed[i - 1].queue => (lane, rank + 1),
            Some(&(lane, _)) => (lane + 1, 0),
            None => (0, 0),
        });
    }
    let lanes = places.last().map_or(1, |&(lane, _)| lane + 1);
    let mut ranked: Vec<((usize, i64), Claimed)> = places
        .into_iter()
        .zip(claimed.drain(..))
        .map(|((lane, rank), command)| ((rank, (lane - turn as i64).rem_euclid(lanes)), command))
        .collect();
    ranked.sort_by_key(|(key, _)| *key);
    claimed.extend(ranked.into_iter().map(|(_, command)| command));
}

/// Claimed commands executed in one transaction: `begin` locks their runs and
/// tells which still hold their lease (flow._begin_batch); successes are
/// settled together by `finish` (flow._settle_batch), failures one by one as
/// they happen, after the successes before them. Commands whose run is locked
/// elsewhere (a cancel, an external client's open transaction) or that a
/// cancel stopped are handed back to their queue, never waited for.
pub struct Chunk<'a> {
    /// The worker's name: the owner of held attempts.
    worker: &'a str,
    live: HashSet<[u8; 16]>,
    /// Runs that failed in this chunk: their other commands were cancelled.
    failed_runs: HashSet<[u8; 16]>,
    /// (command, result, when its handler started)
    successes: Vec<(&'a Claimed, Option<Jsonb>, Option<TimestampWithTimeZone>)>,
    /// Commands to hand back uncharged (see `finish`).
    handed_back: Vec<(pgrx::Uuid, pgrx::Uuid)>,
    /// Held commands left to a cancel: nothing of them was written, so they
    /// are due again at once (see `finish`).
    left: Vec<pgrx::Uuid>,
    /// Held commands: their rows and runs were locked by this transaction itself.
    held: bool,
    /// The open group of held attempts sharing a subtransaction, if any.
    group: Option<Group<'a>>,
}

/// Held attempts sharing a subtransaction (see GROUP_SIZE).
struct Group<'a> {
    /// Whose handlers they all are: a role's failure can only make its own
    /// handlers run again, never another role's (whose handler could have
    /// effects outside the database, such as a call to another service).
    owner: pg_sys::Oid,
    members: Vec<&'a Claimed>,
    /// How many successes the chunk had when the group began: those after
    /// are its members'.
    successes_before: usize,
    subtransaction: Subtransaction,
}

impl<'a> Chunk<'a> {
    /// Held commands, in the claim's transaction: their rows and runs are
    /// locked already.
    pub fn held(worker: &'a str, commands: &[Claimed]) -> Chunk<'a> {
        let live = commands.iter().map(|c| *c.command_id.as_bytes()).collect();
        Chunk::with(worker, live, Vec::new(), true)
    }

    fn with(worker: &'a str, live: HashSet<[u8; 16]>, handed_back: Vec<(pgrx::Uuid, pgrx::Uuid)>, held: bool) -> Self {
        SPAWNED_IN_CHUNK.with(|s| s.set(false));
        Chunk {
            worker,
            live,
            failed_runs: HashSet::new(),
            successes: Vec::new(),
            handed_back,
            left: Vec::new(),
            held,
            group: None,
        }
    }

    /// Leased commands, in a transaction of their own.
    pub fn begin(worker: &'a str, commands: &[Claimed]) -> Chunk<'a> {
        let ids: Vec<pgrx::Uuid> = commands.iter().map(|c| c.command_id).collect();
        let tokens: Vec<pgrx::Uuid> = commands.iter().map(|c| c.lease_token).collect();
        let states: Vec<([u8; 16], bool)> = engine_query(
            "SELECT command_id, run_locked FROM flow._begin_batch($1, $2)",
            &[UUID_ARRAY, UUID_ARRAY],
            &[ids.into(), tokens.into()],
            |table| {
                rows(table, &[UUID, BOOL], |row| {
                    row.get::<pgrx::Uuid>(1).map(|id| (*id.as_bytes(), row.get::<bool>(2).unwrap_or(false)))
                })
                .into_iter()
                .flatten()
                .collect()
            },
        );
        // held under a run we locked: live; held under a run locked elsewhere: handed back
        let (live, elsewhere): (Vec<_>, Vec<_>) = states.into_iter().partition(|(_, run_locked)| *run_locked);
        let elsewhere: HashSet<[u8; 16]> = elsewhere.into_iter().map(|(id, _)| id).collect();
        let handed_back = commands
            .iter()
            .filter(|c| elsewhere.contains(c.command_id.as_bytes()))
            .map(|c| (c.command_id, c.lease_token))
            .collect();
        let live = live.into_iter().map(|(id, _)| id).collect();
        Chunk::with(worker, live, handed_back, false)
    }

    /// Run one command of the chunk for worker `index`; commands whose lease
    /// or run is gone are skipped, those a cancel asked for are handed back
    /// (the cancel closes them once it has the run's lock).
    pub fn execute(&mut self, index: usize, command: &'a Claimed) {
        self.run(index, command, true);
    }

    /// `execute`; `may_group`: a held attempt may join the open group (see
    /// GROUP_SIZE), or open one.
    fn run(&mut self, index: usize, command: &'a Claimed, may_group: bool) {
        let run = *command.run_id.as_bytes();
        if !self.live.contains(command.command_id.as_bytes()) || self.failed_runs.contains(&run) {
            return;
        }
        // A cancelled command is left to the cancel, which closes it once it
        // has the run's lock: a leased one is handed back a moment later, a
        // held one simply stays unsettled.
        if shmem::cancel_requested(index, &run) {
            self.leave(command);
            return;
        }
        let grouped = may_group && command.held_attempt.is_some() && groupable(command.handler);
        if !grouped || self.group.as_ref().is_some_and(|g| g.members.len() >= GROUP_SIZE || g.owner != command.owner) {
            self.close_group();
        }
        if grouped && self.group.is_none() {
            self.group = Some(Group {
                owner: command.owner,
                members: Vec::new(),
                successes_before: self.successes.len(),
                subtransaction: Subtransaction::begin(),
            });
        }
        if let Some(attempt) = command.held_attempt {
            crate::attempt_record::write(command.command_id.as_bytes(), attempt);
        }
        // when the attempt started: what its context and its attempt row say
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        let started = crate::api::timestamp_from_pg(now);
        let outcome = attempt(index, command, self.group.as_ref().filter(|_| grouped).map(|g| &g.subtransaction), now);
        if let Attempted::Succeeded(result) = outcome {
            self.successes.push((command, result, started));
            if let Some(group) = self.group.as_mut().filter(|_| grouped) {
                group.members.push(command);
            }
            return;
        }
        if grouped {
            // The attempt rolled the group back (its members' writes and this
            // one's): the members run again, each alone, and this attempt is
            // concluded with its failure (again alone if its writes were to be kept).
            let group = self.group.take().expect("a grouped attempt has a group");
            self.successes.truncate(group.successes_before);
            shmem::observe("group_reruns", group.members.len() as u64);
            for member in group.members {
                self.run(index, member, false);
            }
            if let Attempted::FailedKeepingWrites(_) = outcome {
                self.run(index, command, false);
                return;
            }
        }
        match outcome {
            Attempted::Succeeded(_) => unreachable!(),
            Attempted::Failed(failure) if failure.class == "cancelled" => self.leave(command),
            Attempted::Failed(failure) | Attempted::FailedKeepingWrites(failure) => {
                // Successes before this failure settle first: they happened first.
                self.settle_successes();
                // (this chunk holds the command: it must not wait for the run, see
                // flow._settle_failure's wait_for_run; a run locked elsewhere leaves
                // the attempt to whoever holds it, a cancel)
                let settled = settle_failure(&command.id(), &failure, started, self.worker, false);
                if settled == (Settled::Failed { retry: false }) {
                    self.failed_runs.insert(run);
                }
            }
        }
    }

    /// Leave a cancelled command to the cancel (see `run`).
    fn leave(&mut self, command: &Claimed) {
        match command.held_attempt {
            None => self.handed_back.push((command.command_id, command.lease_token)),
            Some(_) => self.left.push(command.command_id),
        }
    }

    /// Keep the open group's subtransaction, if any: its members' writes
    /// join the chunk's transaction.
    fn close_group(&mut self) {
        if let Some(group) = self.group.take() {
            group.subtransaction.end(true);
        }
    }

    /// Settle the successes; returns the commands to hand back, and the held
    /// ones left to a cancel. The worker releases the first a moment later
    /// (HAND_BACK_DELAY), and claims none of the others meanwhile: a cancel
    /// that interrupted their handlers takes their run's lock (for a run
    /// without a row of its own, its root's) once this chunk commits, and
    /// must find them as they were, not claimed and run again. If the cancel
    /// rolled back instead, they run again.
    pub fn finish(mut self) -> (Vec<(pgrx::Uuid, pgrx::Uuid)>, Vec<pgrx::Uuid>) {
        self.close_group();
        self.settle_successes();
        (std::mem::take(&mut self.handed_back), std::mem::take(&mut self.left))
    }

    fn settle_successes(&mut self) {
        if self.successes.is_empty() {
            return;
        }
        let (mut ids, mut tokens, mut results, mut starts, mut held, mut rows) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (command, result, started) in self.successes.drain(..) {
            if command.held_attempt.is_some() && command.row_at.is_none() {
                // (settled by its row: without it, its writes would commit unsettled)
                error!("flow: a held command was claimed without its row");
            }
            ids.push(command.command_id);
            tokens.push(command.lease_token);
            results.push(result);
            starts.push(started);
            held.push(command.held_attempt);
            rows.push(command.row_at);
        }
        // Built once, in the chunk's memory context: every try reuses them.
        // (flow._settle_batch counts what it settled, at commit.)
        let spawned = SPAWNED_IN_CHUNK.with(|s| s.get());
        let args = [
            ids.into(),
            tokens.into(),
            results.into(),
            starts.into(),
            held.into(),
            self.worker.into(),
            rows.into(),
            spawned.into(),
        ];
        let settle = || {
            gucs::inject_fault("settle_success");
            settle_batch(&args)
        };
        if self.held {
            // Not in a subtransaction: this transaction locked the rows it
            // updates, and a row locked by a transaction and updated by its
            // subtransaction gets a MultiXact as its xmax. Index entries of
            // such a row version are never marked dead by the scans that pass
            // them (only VACUUM removes them), so every claim would walk all
            // the commands settled since the last vacuum. Nothing here waits
            // for a lock, so a transient error has nothing to retry; any
            // error goes up to the chunk, which is contained.
            settle()
        } else {
            with_settlement_retries(settle)
        }
    }
}

/// Settle successes: (ids, lease tokens, results, handler starts, held
/// attempts, worker, held commands' rows, whether this chunk spawned a command).
fn settle_batch(args: &[DatumWithOid; 8]) {
    engine_query(
        "SELECT flow._settle_batch($1, $2, $3, $4, $5, $6, $7, $8)",
        &[UUID_ARRAY, UUID_ARRAY, JSONB_ARRAY, TIMESTAMPTZ_ARRAY, INT4_ARRAY, TEXT, TID_ARRAY, BOOL],
        args,
        |_| (),
    )
}

/// A settlement that failed on a transient error (deadlock, serialization
/// failure, lock not available) is tried again, up to SETTLEMENT_TRIES times,
/// each in a subtransaction; each try re-checks the lease token, so an attempt
/// that stopped being ours meanwhile settles nothing (the reference's
/// ResolveCommandAttempt). Any other error, or the last one, goes up to the
/// chunk, whose failure is contained (worker.rs, `run_batch`).
const SETTLEMENT_TRIES: usize = 3;

fn with_settlement_retries<R>(settle: impl Fn() -> R) -> R {
    for _ in 1..SETTLEMENT_TRIES {
        match in_subtransaction(|| Ok(settle()), |caught| caught) {
            Ok(settled) => return settled,
            Err(caught) if is_transient(&caught) => continue,
            Err(caught) => caught.rethrow(),
        }
    }
    settle()
}

/// The error report inside a caught error (a Rust panic carries one too).
pub fn caught_report(caught: &pg_sys::panic::CaughtError) -> &pg_sys::panic::ErrorReportWithLevel {
    use pg_sys::panic::CaughtError;
    match caught {
        CaughtError::PostgresError(r) | CaughtError::ErrorReport(r) | CaughtError::RustPanic { ereport: r, .. } => r,
    }
}

fn is_transient(caught: &pg_sys::panic::CaughtError) -> bool {
    matches!(
        caught_report(caught).sql_error_code(),
        PgSqlErrorCode::ERRCODE_T_R_DEADLOCK_DETECTED
            | PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE
            | PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE
    )
}

/// A subtransaction begun by the engine, in which the caller goes on in its
/// own memory context; `end` keeps or rolls it back and restores the
/// caller's memory context and resource owner. After PL/pgSQL's exception
/// blocks.
pub(crate) struct Subtransaction {
    outer_context: pg_sys::MemoryContext,
    outer_owner: pg_sys::ResourceOwner,
}

impl Subtransaction {
    pub(crate) fn begin() -> Subtransaction {
        let (outer_context, outer_owner) = unsafe { (pg_sys::CurrentMemoryContext, pg_sys::CurrentResourceOwner) };
        unsafe {
            pg_sys::BeginInternalSubTransaction(std::ptr::null());
            pg_sys::MemoryContextSwitchTo(outer_context);
        }
        Subtransaction { outer_context, outer_owner }
    }

    pub(crate) fn end(&self, keep: bool) {
        unsafe {
            if keep {
                pg_sys::ReleaseCurrentSubTransaction();
            } else {
                pg_sys::RollbackAndReleaseCurrentSubTransaction();
            }
            pg_sys::MemoryContextSwitchTo(self.outer_context);
            pg_sys::CurrentResourceOwner = self.outer_owner;
        }
    }
}

/// Run `body`, turning an ERROR it raises into `on_error(caught)`, with the
/// caller's memory context and resource owner back. The (sub)transaction the
/// ERROR happened in must then be rolled back before anything else runs.
pub(crate) fn catching<R, E>(
    body: impl FnOnce() -> Result<R, E>,
    on_error: impl FnOnce(pg_sys::panic::CaughtError) -> E,
) -> Result<R, E> {
    let (outer_context, outer_owner) = unsafe { (pg_sys::CurrentMemoryContext, pg_sys::CurrentResourceOwner) };
    // catch_others wants an FnMut; on_error runs at most once.
    let on_error = std::panic::AssertUnwindSafe(Cell::new(Some(on_error)));
    let outcome = PgTryBuilder::new(std::panic::AssertUnwindSafe(body))
        .catch_others(move |caught| Err((on_error.take().expect("on_error runs once"))(caught)))
        .execute();
    unsafe {
        pg_sys::MemoryContextSwitchTo(outer_context);
        pg_sys::CurrentResourceOwner = outer_owner;
    }
    outcome
}

/// Run `body` in a subtransaction of the current transaction: kept when it
/// returns Ok, rolled back when it returns Err or raises (the ERROR becomes
/// `on_error(caught)`).
pub fn in_subtransaction<R, E>(
    body: impl FnOnce() -> Result<R, E>,
    on_error: impl FnOnce(pg_sys::panic::CaughtError) -> E,
) -> Result<R, E> {
    let subtransaction = Subtransaction::begin();
    let outcome = catching(body, on_error);
    subtransaction.end(outcome.is_ok());
    outcome
}

/// Why an attempt fails before its handler starts, if it does: its deadline
/// passed, or its args no longer fit the definition's args_type (retrying
/// cannot fix them, as the reference's decode step; checked as the owner
/// through the gateway, so whatever a domain's check does fails this
/// command alone and is undone).
fn refused_before_start(command: &Claimed, remaining_ms: Option<i64>) -> Option<Failure> {
    if let Some(ms) = remaining_ms.filter(|ms| *ms <= 0) {
        return Some(timeout_failure(ms));
    }
    let args_type = command.args_type?;
    let message = match gateway::check_args(command.owner, args_type, &command.args.to_text()) {
        Ok(misfit) => misfit?,
        Err(caught) => caught_report(&caught).message().to_string(),
    };
    Some(Failure { class: "permanent", code: "argument_decode".into(), message, delay_us: None })
}

/// How an attempt ended.
enum Attempted {
    Succeeded(Option<Jsonb>),
    /// Its writes were rolled back.
    Failed(Failure),
    /// flow.fail(keep_writes => true): its writes are kept.
    FailedKeepingWrites(Failure),
}

/// Run a command's handler in its own subtransaction, or in `group`'s (see
/// GROUP_SIZE). On success the subtransaction is kept (its writes commit
/// with the chunk's settlement); on failure it is rolled back and the
/// failure classified — a group's too, whatever the failure.
fn attempt(index: usize, command: &Claimed, group: Option<&Subtransaction>, now: i64) -> Attempted {
    let deadline = command.deadline(now);
    let remaining_ms = deadline.map(|d| (d - now) / 1000);
    if let Some(failure) = refused_before_start(command, remaining_ms) {
        if let Some(group) = group {
            group.end(false);
        }
        return Attempted::Failed(failure);
    }

    DECISION.with(|d| d.borrow_mut().take());
    KEPT_FAILURE.with(|d| d.borrow_mut().take());
    INVALID_DECISION.with(|d| d.borrow_mut().take());
    let run = *command.run_id.as_bytes();
    let started = std::time::Instant::now();
    ATTEMPT_IN_PROGRESS.with(|c| c.set(Some(*command.command_id.as_bytes())));
    let body = || {
        CURRENT_COMMAND.with(|c| c.set(Some(*command.command_id.as_bytes())));
        gucs::inject_fault("handler_start");
        // The deadline covers what fires when the handler returns, too.
        let result = with_deadline(remaining_ms, || {
            gateway::run_handler(command.owner, || call_handler(command, deadline, now))
        });
        CURRENT_COMMAND.with(|c| c.set(None));
        gucs::inject_fault("handler_return");
        // Test-only: die with the handler's writes done and nothing settled.
        gucs::inject_fault("before_settle");
        // What happened to the attempt beats what the handler returned: a
        // handler that caught its own timeout or a cancel and returned
        // normally is still timed out or cancelled, and one that caught an
        // invalid spawn or emit still made an invalid decision.
        // (PostgreSQL resets the timer's indicator when it raises the
        // cancel, so the clock tells whether the deadline passed.)
        if deadline.is_some_and(|d| unsafe { pg_sys::GetCurrentTimestamp() } >= d) {
            return Err(timeout_failure(0));
        }
        if shmem::cancel_requested(index, &run) {
            return Err(cancelled_failure());
        }
        if let Some(invalid) = INVALID_DECISION.with(|d| d.borrow_mut().take()) {
            return Err(decided_failure(invalid));
        }
        let size = result.as_ref().map(Jsonb::text_size);
        if let Some(size) = size.filter(|s| *s > gucs::max_result_bytes() as usize) {
            return Err(Failure {
                class: "permanent",
                code: "result_too_large".into(),
                message: format!(
                    "handler result is {size} bytes, over flow.max_result_bytes ({})",
                    gucs::max_result_bytes()
                ),
                delay_us: None,
            });
        }
        // flow.fail(keep_writes => true): keep the subtransaction, fail the command.
        if let Some(kept) = KEPT_FAILURE.with(|d| d.borrow_mut().take()) {
            return Ok(Err(decided_failure(kept)));
        }
        Ok(Ok(result))
    };
    let signals_before = note_cancel_signals(index);
    let on_error = |caught| {
        let late_cancel = shmem::cancel_signals(index) != signals_before;
        classify(caught, deadline, shmem::cancel_requested(index, &run), late_cancel)
    };
    let outcome = match group {
        None => in_subtransaction(body, on_error),
        Some(group) => {
            let outcome = catching(body, on_error);
            if !matches!(outcome, Ok(Ok(_))) {
                group.end(false);
            }
            outcome
        }
    };
    CURRENT_COMMAND.with(|c| c.set(None));
    stop_deadline_timer();
    shmem::observe("handler_us", started.elapsed().as_micros() as u64);
    note_handler_time(command.handler, started.elapsed());
    // A cancel that comes late, after the handler, must not hit the cleanup.
    holding_off_cancels(gateway::after_handler);
    ATTEMPT_IN_PROGRESS.with(|c| c.set(None));
    match outcome {
        Ok(Ok(result)) => Attempted::Succeeded(result),
        Ok(Err(kept)) => {
            note_handler_failed(command.handler);
            Attempted::FailedKeepingWrites(kept)
        }
        Err(failure) => {
            note_handler_failed(command.handler);
            Attempted::Failed(failure)
        }
    }
}

fn cancelled_failure() -> Failure {
    Failure { class: "cancelled", code: "cancelled".into(), message: "the run was cancelled".into(), delay_us: None }
}

/// A handler that swallows its own timeout (catches query_canceled in a
/// loop) would hold its worker, and the batch it claimed, forever. This long
/// after its deadline the worker stops itself: `die` makes the handler's next
/// interrupt check a FATAL, which no exception block catches, and recovery
/// concludes the attempt as interrupted (so a poison handler still reaches
/// its attempt limit).
const HARD_STOP_GRACE_MS: i64 = 2000;
/// PostgreSQL 15's first user-defined TimeoutId; RegisterTimeout allocates a
/// free one from there.
const USER_TIMEOUT: u32 = 12;
static HARD_STOPPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
thread_local! {
    static HARD_STOP_TIMEOUT: Cell<Option<u32>> = const { Cell::new(None) };
}

unsafe extern "C-unwind" fn hard_stop() {
    // A signal handler: only flags and the latch, as PostgreSQL's own `die`.
    HARD_STOPPED.store(true, std::sync::atomic::Ordering::Relaxed);
    unsafe {
        pg_sys::ProcDiePending = 1;
        pg_sys::InterruptPending = 1;
        pg_sys::SetLatch(pg_sys::MyLatch);
    }
}

/// Register the hard-stop timeout; called once when a worker starts.
pub fn register_hard_stop() {
    let id = unsafe { RegisterTimeout(USER_TIMEOUT, Some(hard_stop)) };
    HARD_STOP_TIMEOUT.with(|t| t.set(Some(id)));
}

/// Whether this process stopped itself because a handler ignored its deadline.
pub fn hard_stopped() -> bool {
    HARD_STOPPED.load(std::sync::atomic::Ordering::Relaxed)
}

fn with_deadline<R>(remaining_ms: Option<i64>, f: impl FnOnce() -> R) -> R {
    if let Some(ms) = remaining_ms {
        unsafe {
            enable_timeout_after(STATEMENT_TIMEOUT, ms.clamp(1, i32::MAX as i64) as c_int);
            if let Some(id) = HARD_STOP_TIMEOUT.with(|t| t.get()) {
                enable_timeout_after(id, (ms + HARD_STOP_GRACE_MS).clamp(1, i32::MAX as i64) as c_int);
            }
        }
    }
    let result = f();
    stop_deadline_timer();
    result
}

/// Disarm the attempt timer and drop a cancel it may have requested too late
/// to hit the handler, so it cannot hit the engine's own SQL.
fn stop_deadline_timer() {
    unsafe {
        if let Some(id) = HARD_STOP_TIMEOUT.with(|t| t.get()) {
            disable_timeout(id, false);
        }
        disable_timeout(STATEMENT_TIMEOUT, false);
        if get_timeout_indicator(STATEMENT_TIMEOUT, true) {
            pg_sys::QueryCancelPending = 0;
        }
    }
}

/// Call the handler: directly through fmgr when it is not `LANGUAGE sql`
/// (see DirectCall), otherwise through a plan kept per (handler function,
/// owner): SPI inlines SQL handlers, resolving names as the owner, and
/// re-validates the plan when the function is replaced. The statement names
/// everything with its schema, so nothing in it resolves through the owner's
/// search_path. A handler that takes a context gets the attempt's: cut off at
/// `deadline`, started `now` (TimestampTz µs; the claim computed them for a
/// start at claim time).
fn call_handler(command: &Claimed, deadline: Option<i64>, now: i64) -> Option<Jsonb> {
    if let Some(result) = DirectCall::call(command, deadline, now) {
        return result;
    }
    let key = (command.handler.to_u32(), command.owner.to_u32());
    let missing = HANDLER_PLANS.with(|p| !p.borrow().contains_key(&key));
    if missing {
        let (sql, context_type) = handler_call_sql(command.handler);
        let types: Vec<PgOid> = std::iter::once(JSONB).chain(context_type.map(PgOid::from)).collect();
        let plan = Spi::connect_mut(|client| {
            client.prepare_mut(sql.as_str(), &types).unwrap_or_else(|e| error!("flow: {e}")).keep()
        });
        HANDLER_PLANS.with(|p| p.borrow_mut().insert(key, (plan, context_type.is_some())));
    }
    Spi::connect_mut(|client| {
        HANDLER_PLANS.with(|plans| {
            let plans = plans.borrow();
            let (plan, takes_context) = &plans[&key];
            let mut args: Vec<DatumWithOid> = vec![(&command.args).into()];
            if *takes_context {
                let context = handler_context(command);
                // SAFETY: a composite datum of the context's own type
                args.push(unsafe { DatumWithOid::new(RawDatum(context.to_datum(deadline, now)), context.type_oid()) });
            }
            // The plan was prepared mutating, so it runs read-write; pgrx's
            // `update` would also assign the handler's subtransaction a
            // transaction id, which costs every handler that writes nothing a
            // pg_subtrans entry and a slot of the 64-entry subxid cache.
            client
                .select(plan, Some(1), &args)
                .and_then(|t| t.first().get_one::<Jsonb>())
                .unwrap_or_else(|e| error!("flow: {e}"))
        })
    })
}

/// The context of a command whose handler takes one (the definition says
/// whether it does; the function may have been replaced since).
fn handler_context(command: &Claimed) -> &Context {
    command.context.as_ref().unwrap_or_else(|| {
        error!("flow: handler {} takes a flow.context, and its definition says it does not", command.handler.to_u32())
    })
}

/// A handler called through fmgr with a call info kept per function, not
/// through SPI: a PL/pgSQL or C handler costs a fraction of a microsecond
/// instead of an executor start and end per command (a `LANGUAGE sql`
/// handler is not: fmgr would plan its body again in every subtransaction,
/// where SPI inlines it). The function's own SECURITY DEFINER and SET clauses
/// apply as under SPI (fmgr_info wraps it); the caller runs it as its owner
/// with its owner's search_path (gateway::run_handler), in its subtransaction.
struct DirectCall {
    /// In DIRECT_CALL_MEMORY: the function's FmgrInfo and a call info for its arguments.
    fcinfo: *mut pg_sys::FunctionCallInfoBaseData,
    returns_void: bool,
    /// It takes a `flow.context` as its second argument.
    takes_context: bool,
}

thread_local! {
    /// Per handler function: its direct call, or None when it goes through SPI.
    static DIRECT_CALLS: RefCell<HashMap<u32, Option<DirectCall>>> = RefCell::new(HashMap::new());
    /// Holds the FmgrInfos and call infos of DIRECT_CALLS; reset with it.
    static DIRECT_CALL_MEMORY: Cell<pg_sys::MemoryContext> = const { Cell::new(std::ptr::null_mut()) };
    /// A direct call's argument and result, emptied after each call.
    static DIRECT_CALL_ARGS_MEMORY: Cell<pg_sys::MemoryContext> = const { Cell::new(std::ptr::null_mut()) };
    /// A function was created, replaced or dropped somewhere (a pg_proc
    /// invalidation): the kept call infos may be stale, and are rebuilt
    /// before the next call (never during one: a handler may be running).
    static DIRECT_CALLS_STALE: Cell<bool> = const { Cell::new(false) };
}

// catalog/pg_language_d.h is not in pgrx-pg-sys 0.18.1: SQLlanguageId, the
// fixed OID of `LANGUAGE sql` in pg_language.dat.
const SQL_LANGUAGE: pg_sys::Oid = pg_sys::Oid::from_u32(14);

#[pg_guard]
unsafe extern "C-unwind" fn direct_calls_stale(_arg: pg_sys::Datum, _cache: c_int, _hash: u32) {
    DIRECT_CALLS_STALE.with(|s| s.set(true));
}

/// The memory context kept in `slot`, a child of TopMemoryContext for the
/// worker's life, created (and `created` run) on first use.
fn kept_context(
    slot: &'static std::thread::LocalKey<Cell<pg_sys::MemoryContext>>,
    name: &'static std::ffi::CStr,
    created: impl FnOnce(),
) -> pg_sys::MemoryContext {
    slot.with(|m| {
        if m.get().is_null() {
            // SAFETY: a new context under TopMemoryContext, never deleted
            m.set(unsafe {
                pg_sys::AllocSetContextCreateExtended(
                    pg_sys::TopMemoryContext,
                    name.as_ptr(),
                    pg_sys::ALLOCSET_DEFAULT_MINSIZE as usize,
                    pg_sys::ALLOCSET_DEFAULT_INITSIZE as usize,
                    pg_sys::ALLOCSET_DEFAULT_MAXSIZE as usize,
                )
            });
            created();
        }
        m.get()
    })
}

impl DirectCall {
    /// Call the command's handler if it is called directly (see
    /// call_handler): Some(its result), or None if it goes through SPI.
    fn call(command: &Claimed, deadline: Option<i64>, now: i64) -> Option<Option<Jsonb>> {
        Self::forget_if_stale();
        let handler = command.handler;
        let (fcinfo, returns_void, takes_context) = DIRECT_CALLS.with(|calls| {
            let mut calls = calls.borrow_mut();
            let call = calls.entry(handler.to_u32()).or_insert_with(|| Self::prepare(handler));
            call.as_ref().map(|c| (c.fcinfo, c.returns_void, c.takes_context))
        })?;
        let context = takes_context.then(|| handler_context(command));
        unsafe {
            // The args' datum and what the handler returns live in a context of
            // their own, emptied after each call (as SPI frees its own at the
            // end of a statement): a chunk of handlers with large args does not
            // keep them all until it commits. After an error, the next call
            // empties it.
            let call_memory = Self::call_memory();
            pg_sys::MemoryContextReset(call_memory);
            let caller_memory = pg_sys::MemoryContextSwitchTo(call_memory);
            let fc = &mut *fcinfo;
            fc.isnull = false;
            let arg = fc.args.as_mut_slice(fc.nargs as usize);
            arg[0].value = command.args.to_datum();
            arg[0].isnull = false;
            if let Some(context) = context {
                arg[1].value = context.to_datum(deadline, now);
                arg[1].isnull = false;
            }
            // As SPI would for a statement: the handler sees what the handlers
            // before it in this transaction wrote, under a fresh snapshot (a
            // STABLE function reads through the active one). An error pops it
            // with the subtransaction.
            pg_sys::CommandCounterIncrement();
            pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
            let addr = (*fc.flinfo).fn_addr.expect("fmgr_info set the function's address");
            let result = pg_sys::ffi::pg_guard_ffi_boundary(|| addr(fcinfo));
            pg_sys::PopActiveSnapshot();
            let returned = if returns_void || fc.isnull {
                None
            } else {
                Jsonb::from_polymorphic_datum(result, false, pg_sys::JSONBOID) // a copy, owned by Rust
            };
            pg_sys::MemoryContextSwitchTo(caller_memory);
            pg_sys::MemoryContextReset(call_memory);
            Some(returned)
        }
    }

    /// The direct call of `handler`, or None when it goes through SPI: a
    /// `LANGUAGE sql` function, or one that does not take its args (and a
    /// context) and return one value (read from one lookup of its pg_proc entry).
    fn prepare(handler: pg_sys::Oid) -> Option<DirectCall> {
        unsafe {
            let tuple = pg_sys::SearchSysCache1(pg_sys::SysCacheIdentifier::PROCOID as c_int, handler.into());
            if tuple.is_null() {
                error!("flow: handler function {} no longer exists", handler.to_u32());
            }
            let proc_ = &*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_proc>(tuple);
            let (nargs, retset, rettype, language) = (proc_.pronargs, proc_.proretset, proc_.prorettype, proc_.prolang);
            pg_sys::ReleaseSysCache(tuple);
            if !(1..=2).contains(&nargs) || retset || language == SQL_LANGUAGE {
                return None;
            }
            let memory = Self::memory();
            let flinfo = pg_sys::MemoryContextAllocZero(memory, std::mem::size_of::<pg_sys::FmgrInfo>())
                .cast::<pg_sys::FmgrInfo>();
            pg_sys::fmgr_info_cxt(handler, flinfo, memory);
            let size = std::mem::size_of::<pg_sys::FunctionCallInfoBaseData>()
                + nargs as usize * std::mem::size_of::<pg_sys::NullableDatum>();
            let fcinfo = pg_sys::MemoryContextAllocZero(memory, size).cast::<pg_sys::FunctionCallInfoBaseData>();
            (*fcinfo).flinfo = flinfo;
            (*fcinfo).nargs = nargs;
            (*fcinfo).fncollation = pg_sys::InvalidOid;
            Some(DirectCall { fcinfo, returns_void: rettype == pg_sys::VOIDOID, takes_context: nargs == 2 })
        }
    }

    /// Where a direct call's arguments and result live (see `call`).
    fn call_memory() -> pg_sys::MemoryContext {
        kept_context(&DIRECT_CALL_ARGS_MEMORY, c"flow direct handler call", || {})
    }

    /// Where the kept call infos live; created with the watch on pg_proc that
    /// marks them stale.
    fn memory() -> pg_sys::MemoryContext {
        kept_context(&DIRECT_CALL_MEMORY, c"flow direct handler calls", || unsafe {
            pg_sys::CacheRegisterSyscacheCallback(
                pg_sys::SysCacheIdentifier::PROCOID as c_int,
                Some(direct_calls_stale),
                pg_sys::Datum::from(0),
            );
        })
    }

    /// Forget every direct call (before a call, or with the kept plans).
    fn forget() {
        DIRECT_CALLS.with(|c| c.borrow_mut().clear());
        DIRECT_CALLS_STALE.with(|s| s.set(false));
        DIRECT_CALL_MEMORY.with(|m| {
            if !m.get().is_null() {
                unsafe { pg_sys::MemoryContextReset(m.get()) };
            }
        });
    }

    fn forget_if_stale() {
        if DIRECT_CALLS_STALE.with(|s| s.get()) {
            Self::forget();
        }
    }
}

/// `SELECT schema.fn($1 [, $2])` for a handler, read from the catalog
/// caches (no SQL, so nothing a handler left behind can change its meaning),
/// and the type of its second parameter, flow.context, if it takes one.
fn handler_call_sql(handler: pg_sys::Oid) -> (String, Option<pg_sys::Oid>) {
    unsafe {
        let name = pg_sys::get_func_name(handler);
        if name.is_null() {
            error!("flow: handler function {} no longer exists", handler.to_u32());
        }
        let schema = pg_sys::get_namespace_name(pg_sys::get_func_namespace(handler));
        let quote = |s: *const std::ffi::c_char| {
            std::ffi::CStr::from_ptr(pg_sys::quote_identifier(s)).to_string_lossy().into_owned()
        };
        let function = format!("{}.{}", quote(schema), quote(name));
        let mut arg_types: *mut pg_sys::Oid = std::ptr::null_mut();
        let mut nargs: c_int = 0;
        let returns_void = pg_sys::get_func_signature(handler, &mut arg_types, &mut nargs) == pg_sys::VOIDOID;
        let context_type = (nargs == 2).then(|| *arg_types.add(1));
        let sql = format!(
            "SELECT {}{function}($1::pg_catalog.jsonb{})",
            if returns_void { "NULL::pg_catalog.jsonb FROM " } else { "" },
            if context_type.is_some() { ", $2" } else { "" }
        );
        (sql, context_type)
    }
}

fn settle_failure(
    command: &AttemptId,
    failure: &Failure,
    started: Option<TimestampWithTimeZone>,
    worker: &str,
    wait_for_run: bool,
) -> Settled {
    let status: Option<String> = with_settlement_retries(|| {
        gucs::inject_fault("settle_failure");
        engine_query(
            "SELECT flow._settle_failure($1, $2, $3, $4, $5,
                    CASE WHEN $6 IS NULL THEN NULL ELSE pg_catalog.make_interval(secs => $6 / 1000000.0) END, $7, $8, $9, $10)",
            &[UUID, UUID, TEXT, TEXT, TEXT, INT8, TIMESTAMPTZ, INT4, TEXT, BOOL],
            &[
                command.command_id.into(),
                command.lease_token.into(),
                failure.class.into(),
                failure.code.as_str().into(),
                failure.message.as_str().into(),
                failure.delay_us.into(),
                started.into(),
                command.held_attempt.into(),
                worker.into(),
                wait_for_run.into(),
            ],
            |t| t.first().get_one().unwrap_or_else(|e| error!("flow: {e}")),
        )
    });
    match status.as_deref() {
        Some("retry") => Settled::Failed { retry: true },
        Some("failed") => Settled::Failed { retry: false },
        Some("locked") => Settled::Locked,
        _ => Settled::Expired,
    }
}

/// Containment after a one-command chunk failed outside its handler (see
/// worker.rs, `run_batch`): the command is settled with the engine's error
/// and retried by its policy; should even that fail (its own settlement is
/// what breaks), it fails permanently with that error. Returns false when
/// neither could be written.
pub fn settle_engine_error(command: &AttemptId, message: &str, sqlstate: &str, worker: &str) -> bool {
    // A settlement rejected as invalid (flow's own checks, bad data, a
    // violated constraint) cannot succeed when retried: an invalid decision.
    let invalid = sqlstate.starts_with("FL") || sqlstate.starts_with("22") || sqlstate.starts_with("23");
    if invalid {
        let decision =
            Failure { class: "permanent", code: "invalid_decision".into(), message: message.into(), delay_us: None };
        if in_subtransaction(|| Ok::<_, ()>(settle_failure(command, &decision, None, worker, true)), |_| ()).is_ok() {
            return true;
        }
    }
    let retryable =
        Failure { class: "retryable", code: "engine_error".into(), message: message.into(), delay_us: None };
    if in_subtransaction(|| Ok::<_, ()>(settle_failure(command, &retryable, None, worker, true)), |_| ()).is_ok() {
        return true;
    }
    let permanent = Failure { class: "permanent", ..retryable };
    in_subtransaction(|| Ok::<_, ()>(settle_failure(command, &permanent, None, worker, true)), |_| ()).is_ok()
}

/// What concluding a held attempt came to (`conclude_held`).
#[derive(PartialEq, Eq, Debug)]
pub enum Conclusion {
    /// counted as interrupted
    Counted,
    /// the command had moved on (settled, or another attempt counted): nothing to count
    MovedOn,
    /// its run or its row is locked elsewhere: try again later
    Busy,
}

/// Conclude a held attempt that ended unsettled as interrupted, as recovery
/// concludes a leased one whose owner died: the one a stopped worker
/// recorded (see attempt_record.rs), or one an external client's transaction
/// abandoned (src/external.rs: `abandoned`, the token its client was given,
/// so that flow.resolve finds the attempt under it). The latter never waits
/// for a lock (a client's open transaction may hold its run or its row for
/// as long as it likes): Busy then.
pub fn conclude_held(command: [u8; 16], attempt: i32, worker: &str, abandoned: Option<[u8; 16]>) -> Conclusion {
    let held = AttemptId {
        command_id: pgrx::Uuid::from_bytes(command),
        lease_token: abandoned.map_or_else(crate::api::_new_id, pgrx::Uuid::from_bytes),
        held_attempt: Some(attempt),
    };
    let (code, message) = match abandoned {
        Some(_) => {
            ("transaction_ended", "the external worker's transaction holding this attempt ended without settling it")
        }
        None => ("owner_died", "the worker running this attempt exited before settling it"),
    };
    let interrupted = Failure { class: "interrupted", code: code.into(), message: message.into(), delay_us: None };
    match settle_failure(&held, &interrupted, None, worker, abandoned.is_none()) {
        Settled::Failed { .. } => Conclusion::Counted,
        Settled::Locked => Conclusion::Busy,
        Settled::Expired => Conclusion::MovedOn,
    }
}

/// Hand claimed commands back to their queue with the attempt the claim
/// counted given back (flow._release): nothing of their attempt was kept.
/// Returns those whose row was locked elsewhere: try them again later.
pub fn release(ids: Vec<pgrx::Uuid>, tokens: Vec<pgrx::Uuid>) -> Vec<(pgrx::Uuid, pgrx::Uuid)> {
    if ids.is_empty() {
        return Vec::new();
    }
    let pairs: HashMap<pgrx::Uuid, pgrx::Uuid> = ids.iter().copied().zip(tokens.iter().copied()).collect();
    engine_query("SELECT flow._release($1, $2)", &[UUID_ARRAY, UUID_ARRAY], &[ids.into(), tokens.into()], |rows| {
        rows.filter_map(|row| row.get::<pgrx::Uuid>(1).ok().flatten()).map(|id| (id, pairs[&id])).collect()
    })
}

fn timeout_failure(over_ms: i64) -> Failure {
    Failure {
        class: "timeout",
        code: "attempt_timeout".into(),
        message: if over_ms < 0 {
            format!("the attempt deadline passed {} ms before the handler could start", -over_ms)
        } else {
            "the handler ran past its attempt deadline".into()
        },
        delay_us: None,
    }
}

thread_local! {
    /// flow.cancel's signals to this worker when its last attempt started.
    static CANCEL_SIGNALS_AT_START: Cell<u32> = const { Cell::new(0) };
}

/// At an attempt's start: how many cancels flow.cancel had sent this worker
/// when the attempt before it started (see shmem::cancel_signals).
fn note_cancel_signals(index: usize) -> u32 {
    CANCEL_SIGNALS_AT_START.with(|c| c.replace(shmem::cancel_signals(index)))
}

/// Classify a caught handler error (rule 5). `late_cancel`: flow.cancel
/// signalled this worker since the attempt before this one started, so a
/// statement cancel of a run nobody cancelled was meant for that attempt's:
/// this one is given back uncharged, as a cancelled one is.
fn classify(
    caught: pg_sys::panic::CaughtError,
    deadline: Option<i64>,
    cancel_requested: bool,
    late_cancel: bool,
) -> Failure {
    use pg_sys::panic::CaughtError;
    let report = match &caught {
        CaughtError::PostgresError(r) | CaughtError::ErrorReport(r) => r,
        CaughtError::RustPanic { ereport, .. } => {
            return Failure {
                class: "crash",
                code: "panic".into(),
                message: ereport.message().to_string(),
                delay_us: None,
            }
        }
    };
    let message = report.message().to_string();
    // The attempt's cause beats the handler's error (as the reference's
    // context cause): past the deadline it timed out, under a cancel it was cancelled.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    if deadline.is_some_and(|d| now >= d) {
        return timeout_failure(0);
    }
    if cancel_requested {
        return cancelled_failure();
    }
    if let Some(decision) = DECISION.with(|d| d.borrow_mut().take()).filter(|d| d.message == message) {
        return Failure {
            class: decision.class,
            code: decision.code,
            message: decision.message,
            delay_us: decision.delay_us,
        };
    }
    let code = report.sql_error_code();
    if code == PgSqlErrorCode::ERRCODE_QUERY_CANCELED {
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        if message.contains("statement timeout") || deadline.is_some_and(|d| now >= d) {
            return timeout_failure(0);
        }
        if late_cancel {
            return cancelled_failure();
        }
        return Failure { class: "interrupted", code: "cancelled".into(), message, delay_us: None };
    }
    if code == PgSqlErrorCode::ERRCODE_INTERNAL_ERROR {
        // a Rust panic (pgrx reports it as XX000) or an internal error in C code
        return Failure { class: "crash", code: "XX000".into(), message, delay_us: None };
    }
    Failure { class: "retryable", code: sqlstate(code), message, delay_us: None }
}

/// The five-character SQLSTATE of an error code.
pub(crate) fn sqlstate(code: PgSqlErrorCode) -> String {
    let packed = code as i32;
    (0..5).map(|i| ((((packed >> (6 * i)) & 0x3F) as u8) + b'0') as char).collect()
}

/// Ask for a log line at `flow.log_level`.
pub fn log(message: &str) {
    pgrx::ereport!(gucs::log_level(), PgSqlErrorCode::ERRCODE_SUCCESSFUL_COMPLETION, message.to_string());
}
