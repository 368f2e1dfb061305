//! What an attempt came to (engine rule 5): the failure classes, what a
//! handler decided (flow.fail, flow.retry_after, an invalid spawn or emit),
//! and how a caught handler error, a deadline or a cancel is classified.

use crate::spi::{sqlstate, unpack_sqlstate};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::RefCell;

/// The class of a failed attempt, as `flow._settle_failure` and the
/// attempts' `outcome` name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// flow.fail, bad args, a result too large, an invalid decision: no retry.
    Permanent,
    /// flow.retry_after: retry at the delay the handler gave.
    RetryAfter,
    /// The attempt's deadline passed.
    Timeout,
    /// The worker stopped, the server shut down, the backend was cancelled.
    Interrupted,
    /// A Rust panic, or an internal error in C code.
    Crash,
    /// Any other error.
    Retryable,
    /// flow.cancel stopped it: not settled as a failure, left to the cancel.
    Cancelled,
    /// An attempt of a fast handler cut at the end of its budget
    /// (src/execute.rs, FAST_BUDGET_US): voided (counted, not charged), its
    /// command run again alone.
    Demoted,
}

impl Class {
    /// Its name in SQL.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Permanent => "permanent",
            Class::RetryAfter => "retry_after",
            Class::Timeout => "timeout",
            Class::Interrupted => "interrupted",
            Class::Crash => "crash",
            Class::Retryable => "retryable",
            Class::Cancelled => "cancelled",
            Class::Demoted => "demoted",
        }
    }
}

/// A failure's class (see `flow._settle_failure`), code and message.
#[derive(Debug)]
pub struct Failure {
    pub class: Class,
    pub code: String,
    pub message: String,
    /// flow.retry_after's delay (µs).
    pub delay_us: Option<i64>,
}

impl Failure {
    pub fn new(class: Class, code: &str, message: impl Into<String>) -> Failure {
        Failure { class, code: code.to_string(), message: message.into(), delay_us: None }
    }

    /// The attempt's deadline passed: before its handler could start (`over_ms`
    /// < 0: by that much), or while it ran.
    pub fn timeout(over_ms: i64) -> Failure {
        let message = if over_ms < 0 {
            format!("the attempt deadline passed {} ms before the handler could start", -over_ms)
        } else {
            "the handler ran past its attempt deadline".into()
        };
        Failure::new(Class::Timeout, "attempt_timeout", message)
    }

    pub fn demoted() -> Failure {
        Failure::new(Class::Demoted, "demoted", "a fast handler's attempt ran past its budget: run again alone")
    }

    pub fn cancelled() -> Failure {
        Failure::new(Class::Cancelled, "cancelled", "the run was cancelled")
    }
}

/// What a handler announced before it raised (or, for flow.fail with
/// keep_writes, returned). pgrx reports flow's own SQLSTATEs as XX000, so the
/// class travels beside the error; it only counts when the caught error
/// carries the same message.
struct Decision(Failure);

thread_local! {
    /// flow.fail, flow.retry_after, or an invalid spawn or emit, of the running attempt.
    static DECISION: RefCell<Option<Decision>> = const { RefCell::new(None) };
    /// flow.fail(message, keep_writes => true): the handler returns normally,
    /// its writes commit, and the command fails permanently.
    static KEPT_FAILURE: RefCell<Option<Decision>> = const { RefCell::new(None) };
    /// The first invalid decision (a bad spawn or emit) of this attempt: it
    /// fails the command even if the handler caught the error (as the reference).
    static INVALID_DECISION: RefCell<Option<Decision>> = const { RefCell::new(None) };
}

/// What a handler may decide (the `class` flow.fail & co. pass `_decide`).
pub enum Decided {
    Permanent,
    RetryAfter,
    /// flow.fail(keep_writes => true)
    KeptFailure,
    /// an invalid spawn or emit
    Invalid,
    Other,
}

impl Decided {
    pub fn from_sql(class: &str) -> Decided {
        match class {
            "permanent" => Decided::Permanent,
            "retry_after" => Decided::RetryAfter,
            "kept_failure" => Decided::KeptFailure,
            "invalid_decision" => Decided::Invalid,
            _ => Decided::Other,
        }
    }
}

/// Note what the running handler decided (the first kept failure and the
/// first invalid decision count; otherwise the last decision).
pub fn decide(decided: Decided, code: &str, message: &str, delay_us: Option<i64>) {
    let decision = |class| Decision(Failure { class, code: code.to_string(), message: message.to_string(), delay_us });
    match decided {
        Decided::KeptFailure => KEPT_FAILURE.with(|k| {
            k.borrow_mut().get_or_insert_with(|| decision(Class::Permanent));
        }),
        Decided::Invalid => {
            INVALID_DECISION.with(|d| {
                d.borrow_mut().get_or_insert_with(|| decision(Class::Permanent));
            });
            DECISION.with(|d| *d.borrow_mut() = Some(decision(Class::Permanent)));
        }
        Decided::Permanent => DECISION.with(|d| *d.borrow_mut() = Some(decision(Class::Permanent))),
        Decided::RetryAfter => DECISION.with(|d| *d.borrow_mut() = Some(decision(Class::RetryAfter))),
        Decided::Other => DECISION.with(|d| *d.borrow_mut() = Some(decision(Class::Retryable))),
    }
}

/// Forget what an earlier attempt decided (before an attempt starts).
pub fn forget_decisions() {
    DECISION.with(|d| d.borrow_mut().take());
    KEPT_FAILURE.with(|d| d.borrow_mut().take());
    INVALID_DECISION.with(|d| d.borrow_mut().take());
}

/// The attempt's invalid decision, if it made one (it fails the attempt even
/// if the handler caught its error).
pub fn take_invalid_decision() -> Option<Failure> {
    INVALID_DECISION.with(|d| d.borrow_mut().take()).map(|d| d.0)
}

/// flow.fail(keep_writes => true) of the attempt, if it made one.
pub fn take_kept_failure() -> Option<Failure> {
    KEPT_FAILURE.with(|d| d.borrow_mut().take()).map(|d| d.0)
}

thread_local! {
    /// The SQLSTATE of the last error raised while a handler ran, as
    /// PostgreSQL packs it (0: none): pgrx's CaughtError maps a code it does
    /// not know (a handler's own `RAISE ... USING ERRCODE = 'AB123'`) to
    /// XX000, so the code is read from the error data itself, by an error
    /// context callback around the handler's call.
    static RAISED: std::cell::Cell<i32> = const { std::cell::Cell::new(0) };
}

#[pg_guard]
unsafe extern "C-unwind" fn note_error_code(_arg: *mut std::ffi::c_void) {
    // (called by errfinish for every message it reports, an ERROR last)
    RAISED.with(|r| r.set(unsafe { pg_sys::geterrcode() }));
}

/// Run `f` (a handler's call) noting the SQLSTATE of what it raises, for
/// `classify`. The caller's catch restores the error context stack on an
/// ERROR (spi::catching).
pub fn noting_error_code<R>(f: impl FnOnce() -> R) -> R {
    RAISED.with(|r| r.set(0));
    unsafe {
        let mut callback = pg_sys::ErrorContextCallback {
            previous: pg_sys::error_context_stack,
            callback: Some(note_error_code),
            arg: std::ptr::null_mut(),
        };
        pg_sys::error_context_stack = &mut callback;
        let result = f();
        pg_sys::error_context_stack = callback.previous;
        result
    }
}

/// The SQLSTATE the handler's error carries, from the error data itself
/// (see RAISED), else as pgrx read it.
fn raised_sqlstate(report: &pg_sys::panic::ErrorReportWithLevel) -> String {
    match RAISED.with(|r| r.replace(0)) {
        0 => sqlstate(report.sql_error_code()),
        code => unpack_sqlstate(code),
    }
}

/// Classify a caught handler error (rule 5). `late_cancel`: flow.cancel
/// signalled this worker since the attempt before this one started, so a
/// statement cancel of a run nobody cancelled was meant for that attempt's:
/// this one is given back uncharged, as a cancelled one is.
pub fn classify(
    caught: pg_sys::panic::CaughtError,
    deadline: Option<i64>,
    cancel_requested: bool,
    late_cancel: bool,
) -> Failure {
    use pg_sys::panic::CaughtError;
    let report = match &caught {
        CaughtError::PostgresError(r) | CaughtError::ErrorReport(r) => r,
        CaughtError::RustPanic { ereport, .. } => {
            return Failure::new(Class::Crash, "panic", ereport.message());
        }
    };
    let message = report.message().to_string();
    // The attempt's cause beats the handler's error (as the reference's
    // context cause): past the deadline it timed out, under a cancel it was cancelled.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    if deadline.is_some_and(|d| now >= d) {
        return Failure::timeout(0);
    }
    if cancel_requested {
        return Failure::cancelled();
    }
    if let Some(Decision(decided)) = DECISION.with(|d| d.borrow_mut().take()).filter(|d| d.0.message == message) {
        return decided;
    }
    let code = raised_sqlstate(report);
    if code == "57014" {
        if message.contains("statement timeout") {
            return Failure::timeout(0);
        }
        if late_cancel {
            return Failure::cancelled();
        }
        return Failure::new(Class::Interrupted, "cancelled", message);
    }
    if code == "XX000" {
        // a Rust panic (pgrx reports it as XX000) or an internal error in C code
        return Failure::new(Class::Crash, "XX000", message);
    }
    Failure::new(Class::Retryable, &code, message)
}
