//! The engine's own statements and transactions: statements run through
//! plans kept for the worker's life (and planned again when a relation they
//! read changes), their rows read by column without pgrx's per-column checks,
//! and the transactions and subtransactions the engine runs them in, with
//! ERRORs caught and turned into values.

use crate::{gateway, handler_call};
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{self, PgBuiltInOids, PgOid};
use pgrx::prelude::*;
use pgrx::spi::OwnedPreparedStatement;
use pgrx::{FromDatum, PgTryBuilder};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

thread_local! {
    static ENGINE_PLANS: RefCell<HashMap<&'static str, OwnedPreparedStatement>> = RefCell::new(HashMap::new());
    /// A relation's description changed since the engine's plans were last
    /// warmed (see `warm_plans`).
    static PLANS_MAY_BE_STALE: Cell<bool> = const { Cell::new(false) };
}

/// Forget every cached plan: after an error outside a handler, or when the
/// extension was dropped or upgraded under the worker.
pub fn forget_plans() {
    handler_call::forget();
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

/// Whether a relation changed since the plans were last warmed, and take
/// them to be warm again (see worker.rs, `warm_plans`).
pub fn take_plans_stale() -> bool {
    PLANS_MAY_BE_STALE.with(|s| s.replace(false))
}

/// Run one of the engine's own statements through a plan kept across calls.
pub fn engine_query<R>(
    sql: &'static str,
    types: &[PgOid],
    args: &[DatumWithOid],
    read: impl FnOnce(pgrx::spi::SpiTupleTable) -> R,
) -> R {
    gateway::ensure_engine_path();
    kept_query(sql, types, args, read)
}

/// `engine_query` in any session (a client's too, whose search_path is its
/// own): for statements that name only schema-qualified objects.
pub fn kept_query<R>(
    sql: &'static str,
    types: &[PgOid],
    args: &[DatumWithOid],
    read: impl FnOnce(pgrx::spi::SpiTupleTable) -> R,
) -> R {
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
pub(crate) fn holding_off_cancels<R>(f: impl FnOnce() -> R) -> R {
    unsafe { pg_sys::QueryCancelHoldoffCount += 1 };
    let result = f();
    unsafe {
        pg_sys::QueryCancelHoldoffCount -= 1;
        pg_sys::QueryCancelPending = 0;
    }
    result
}

pub(crate) const UUID: PgOid = PgOid::BuiltIn(PgBuiltInOids::UUIDOID);
pub(crate) const TEXT: PgOid = PgOid::BuiltIn(PgBuiltInOids::TEXTOID);
pub(crate) const INT8: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT8OID);
pub(crate) const INT4: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT4OID);
pub(crate) const FLOAT8: PgOid = PgOid::BuiltIn(PgBuiltInOids::FLOAT8OID);
pub(crate) const BOOL: PgOid = PgOid::BuiltIn(PgBuiltInOids::BOOLOID);
pub(crate) const TIMESTAMPTZ: PgOid = PgOid::BuiltIn(PgBuiltInOids::TIMESTAMPTZOID);
pub(crate) const UUID_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::UUIDARRAYOID);
pub(crate) const JSONB: PgOid = PgOid::BuiltIn(PgBuiltInOids::JSONBOID);
pub(crate) const JSONB_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::JSONBARRAYOID);
pub(crate) const TIMESTAMPTZ_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::TIMESTAMPTZARRAYOID);
pub(crate) const INT2: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT2OID);
pub(crate) const INT2_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT2ARRAYOID);
pub(crate) const INT4_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT4ARRAYOID);
pub(crate) const OID_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::OIDARRAYOID);
pub(crate) const OID: PgOid = PgOid::BuiltIn(PgBuiltInOids::OIDOID);
pub(crate) const TID: PgOid = PgOid::BuiltIn(PgBuiltInOids::TIDOID);
pub(crate) const TID_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::TIDARRAYOID);
pub(crate) const TEXT_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::TEXTARRAYOID);
pub(crate) const BOOL_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::BOOLARRAYOID);

/// The error report inside a caught error (a Rust panic carries one too).
pub fn caught_report(caught: &pg_sys::panic::CaughtError) -> &pg_sys::panic::ErrorReportWithLevel {
    use pg_sys::panic::CaughtError;
    match caught {
        CaughtError::PostgresError(r) | CaughtError::ErrorReport(r) | CaughtError::RustPanic { ereport: r, .. } => r,
    }
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
    let (outer_context, outer_owner, outer_error_context) =
        unsafe { (pg_sys::CurrentMemoryContext, pg_sys::CurrentResourceOwner, pg_sys::error_context_stack) };
    // catch_others wants an FnMut; on_error runs at most once.
    let on_error = std::panic::AssertUnwindSafe(Cell::new(Some(on_error)));
    let outcome = PgTryBuilder::new(std::panic::AssertUnwindSafe(body))
        .catch_others(move |caught| Err((on_error.take().expect("on_error runs once"))(caught)))
        .execute();
    unsafe {
        pg_sys::MemoryContextSwitchTo(outer_context);
        pg_sys::CurrentResourceOwner = outer_owner;
        // (an error context the body pushed, on a stack frame that is gone now)
        pg_sys::error_context_stack = outer_error_context;
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

/// The five-character SQLSTATE of an error code.
pub(crate) fn sqlstate(code: PgSqlErrorCode) -> String {
    unpack_sqlstate(code as i32)
}

/// The five characters of a SQLSTATE as PostgreSQL packs it (MAKE_SQLSTATE).
pub(crate) fn unpack_sqlstate(packed: i32) -> String {
    (0..5).map(|i| ((((packed >> (6 * i)) & 0x3F) as u8) + b'0') as char).collect()
}

/// Run `body` in its own transaction. An ERROR rolls the transaction back and
/// returns None (logged as a WARNING); the worker lives on.
pub fn transaction<R>(body: impl FnOnce() -> R) -> Option<R> {
    try_transaction(body).ok()
}

/// `transaction`, returning the ERROR's message and SQLSTATE.
pub fn try_transaction<R>(body: impl FnOnce() -> R) -> Result<R, (String, String)> {
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
    let outcome = PgTryBuilder::new(std::panic::AssertUnwindSafe(|| Ok(body())))
        .catch_others(|caught| {
            let report = caught_report(&caught);
            let (message, sqlstate) = (report.message().to_string(), sqlstate(report.sql_error_code()));
            pgrx::warning!("flow worker: {message}");
            Err((message, sqlstate))
        })
        .execute();
    unsafe {
        match outcome {
            Ok(_) => {
                pg_sys::PopActiveSnapshot();
                pg_sys::CommitTransactionCommand();
            }
            Err(_) => {
                pg_sys::QueryCancelPending = 0;
                // (every level: an ERROR may leave subtransactions open, such
                // as a leased attempt's, which AbortCurrentTransaction would
                // only mark aborted)
                pg_sys::AbortOutOfAnyTransaction();
            }
        }
        pg_sys::pgstat_report_stat(false);
    }
    outcome
}
