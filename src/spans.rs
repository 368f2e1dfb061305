//! Durations: which intervals flow keeps, and adding one to a time without
//! ever raising. An interval has three fields, months, days and
//! microseconds, that PostgreSQL compares as if a month were 30 days and a
//! day 24 hours, but adds to a timestamp one by one: so '4000000 mons
//! -119999999 days' compares as one day and overflows any timestamp. flow
//! keeps only intervals with no negative field, at most 100 years as
//! compared (`_span_ok`: the API's checks and the tables' CHECKs), and adds
//! a command's intervals to its times with `_deadline`, which gives NULL
//! (no such deadline) where the sum would be no time at all, so that one
//! row can never fail a statement that serves every role (the claim).

use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{FromDatum, IntoDatum};

unsafe extern "C-unwind" {
    /// `timestamptz + interval`, as fmgr calls it (pgrx's binding is a Rust wrapper).
    fn timestamptz_pl_interval(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum;
}

const MICROS_PER_DAY: i128 = 86_400_000_000;
/// 100 years as PostgreSQL compares intervals: 1,200 months of 30 days.
const MAX_SPAN_MICROS: i128 = 1_200 * 30 * MICROS_PER_DAY;

/// Whether `span` is a duration flow keeps (see the module comment).
/// Declared in sql/schema.sql (the tables' CHECKs need it before the
/// functions pgrx writes), hence `sql = false`.
#[pg_extern(immutable, strict, parallel_safe, sql = false)]
fn _span_ok(span: Interval, zero_ok: bool) -> bool {
    let (months, days, micros) = (span.months(), span.days(), span.micros());
    months >= 0
        && days >= 0
        && micros >= 0
        && (zero_ok || months > 0 || days > 0 || micros > 0)
        && span.as_micros() <= MAX_SPAN_MICROS
}

/// The largest field values `_deadline` adds: a thousand years each, ten
/// times what `_span_ok` lets any stored interval hold.
const MAX_MONTHS: i64 = 12_000;
const MAX_DAYS: i64 = 366_000;
const MAX_MICROS: i64 = 366_000 * 86_400_000_000;
/// The latest (and earliest) start it adds to: a hundred thousand years from
/// 2000-01-01, a third of the way to where timestamps end.
const MAX_START_MICROS: i64 = 100_000 * 366 * 86_400_000_000;

/// `start + span`, or NULL where that is no finite time (an infinite start,
/// a field beyond a thousand years): the attempt deadlines of the claim.
/// Never raises, whatever the row holds.
#[pg_extern(stable, strict, parallel_safe)]
fn _deadline(start: TimestampWithTimeZone, span: Interval) -> Option<TimestampWithTimeZone> {
    let at = start.into_inner();
    let bounded = at.unsigned_abs() <= MAX_START_MICROS as u64
        && i64::from(span.months()).abs() <= MAX_MONTHS
        && i64::from(span.days()).abs() <= MAX_DAYS
        && span.micros().unsigned_abs() <= MAX_MICROS as u64;
    if !bounded {
        return None;
    }
    // SAFETY: a finite timestamp plus fields this small stays within
    // timestamps' range (294276 AD), so timestamptz_pl_interval cannot raise
    unsafe {
        let sum = pg_sys::DirectFunctionCall2Coll(
            Some(timestamptz_pl_interval),
            pg_sys::InvalidOid,
            start.into_datum()?,
            span.into_datum()?,
        );
        TimestampWithTimeZone::from_datum(sum, false)
    }
}

pub fn timestamp_from_pg(micros: i64) -> Option<TimestampWithTimeZone> {
    unsafe { TimestampWithTimeZone::from_datum(pg_sys::Datum::from(micros), false) }
}
