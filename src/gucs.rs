//! flow's settings (postgresql.conf GUCs): one private static each, one `init()`
//! that registers them, and typed accessors. Contexts are chosen on purpose:
//! what sizes shared memory or the worker count needs a restart (Postmaster),
//! what the workers read each turn reloads on SIGHUP, and the payload limit is
//! per session so a superuser can raise it for one bulk load.

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};
use std::ffi::CString;
use std::time::Duration;

/// The most workers a server can be configured with; sizes the shared worker table.
pub const MAX_WORKERS: usize = 64;

static DATABASE_NAME: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"postgres"));
static WORKERS: GucSetting<i32> = GucSetting::<i32>::new(2);
static ENABLED: GucSetting<bool> = GucSetting::<bool>::new(true);
static POLL_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(1000);
static BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(1000);
static LEASE_DURATION_S: GucSetting<i32> = GucSetting::<i32>::new(300);
static MAX_RESULT_BYTES: GucSetting<i32> = GucSetting::<i32>::new(256 * 1024);
static RETENTION_S: GucSetting<i32> = GucSetting::<i32>::new(7 * 86_400);
static MAX_QUEUES_PER_ROLE: GucSetting<i32> = GucSetting::<i32>::new(1000);
static MAX_SCHEDULES_PER_ROLE: GucSetting<i32> = GucSetting::<i32>::new(10_000);
static EVENT_RETENTION_S: GucSetting<i32> = GucSetting::<i32>::new(7 * 86_400);
static LOG_LEVEL: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"debug1"));
static MAX_ATTEMPT_TIMEOUT_S: GucSetting<i32> = GucSetting::<i32>::new(3600);
static FAULT_POINTS: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

pub fn init() {
    GucRegistry::define_string_guc(
        c"flow.database_name",
        c"Database the flow workers connect to.",
        c"The database where CREATE EXTENSION flow was run. Workers wait calmly while the extension is missing.",
        &DATABASE_NAME,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"flow.workers",
        c"Number of flow background worker processes.",
        c"Each worker runs one handler at a time; counts against max_worker_processes. 0 disables the in-database workers.",
        &WORKERS,
        0,
        MAX_WORKERS as i32,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"flow.enabled",
        c"Whether flow workers claim and run work.",
        c"off pauses every in-database worker without a restart; running handlers finish.",
        &ENABLED,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"flow.poll_interval",
        c"Longest time an idle worker sleeps before looking for work again.",
        c"Workers are woken at commit by enqueue, emit and settlement and sleep exactly until the next due command; this only bounds the sleep.",
        &POLL_INTERVAL_MS,
        10,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"flow.batch_size",
        c"Commands a worker claims per claim transaction.",
        c"Larger batches pay fewer commits per command; each claimed command counts against its queue's concurrency until it settles.",
        &BATCH_SIZE,
        1,
        10_000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"flow.lease_duration",
        c"Default lease for external workers that do not pass one.",
        c"An external lease expires by the database clock and its command is retried as lease_lost.",
        &LEASE_DURATION_S,
        1,
        86_400,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"flow.max_result_bytes",
        c"Largest args, result or event payload flow stores, in bytes of JSON text.",
        c"A handler result over the limit fails its command permanently; oversized args or payloads are rejected.",
        &MAX_RESULT_BYTES,
        1024,
        1 << 30,
        GucContext::Suset,
        GucFlags::UNIT_BYTE,
    );
    GucRegistry::define_int_guc(
        c"flow.retention",
        c"How long finished runs are kept before the workers delete them.",
        c"Runs that ended (with their commands, attempts and waits) are deleted once both created and finished longer ago than this; 0 keeps them forever. The event journal is kept.",
        &RETENTION_S,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"flow.max_schedules_per_role",
        c"Most schedules one role may own (superusers: any number)",
        c"Every schedule costs the maintenance worker, which serves every role.",
        &MAX_SCHEDULES_PER_ROLE,
        0,
        1_000_000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"flow.max_queues_per_role",
        c"Most queues one role may own (superusers: no limit).",
        c"Each queue with due work costs every claim an index probe; this keeps one role from slowing every other role's work with a flood of queues.",
        &MAX_QUEUES_PER_ROLE,
        1,
        1_000_000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"flow.event_retention",
        c"How long the event journal keeps events that no wait refers to.",
        c"A wait spawned later than this after its event was emitted no longer finds it; events a retained wait refers to are kept. 0 keeps the journal forever.",
        &EVENT_RETENTION_S,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"flow.max_attempt_timeout",
        c"Longest an in-database handler's attempt may run, whatever its definition's timeout.",
        c"Bounds a handler whose definition sets no timeout (the default) or a longer one: past it the attempt times out and is retried by its policy. 0: no bound.",
        &MAX_ATTEMPT_TIMEOUT_S,
        0,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_string_guc(
        c"flow.log_level",
        c"Server log level of flow's per-batch engine messages (debug1..log).",
        c"Claims, settlements and recoveries are logged at this level.",
        &LOG_LEVEL,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"flow.fault_points",
        c"Fault injection for chaos tests: comma-separated point[:error|:die|:stall|:transient|:invalid][@N|%P].",
        c"Points: claim, handler_start, handler_return, settle_success, settle_failure, chunk_failed (a chunk rolled back, before its attempts are counted), before_settle (default action die). error raises an ERROR there, die exits the worker process, stall sleeps 2 s, transient raises a serialization failure, invalid an invalid-value error; @N fires on the Nth hit in each worker process only, %P with probability P percent. Empty (the default) costs nothing.",
        &FAULT_POINTS,
        GucContext::Suset,
        GucFlags::default(),
    );
}

pub fn database_name() -> String {
    DATABASE_NAME.get().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "postgres".into())
}

pub fn workers() -> usize {
    WORKERS.get().max(0) as usize
}

pub fn enabled() -> bool {
    ENABLED.get()
}

pub fn poll_interval() -> Duration {
    Duration::from_millis(POLL_INTERVAL_MS.get() as u64)
}

pub fn batch_size() -> i32 {
    BATCH_SIZE.get()
}

pub fn lease_duration() -> Duration {
    Duration::from_secs(LEASE_DURATION_S.get() as u64)
}

/// None: keep finished runs forever.
pub fn retention() -> Option<Duration> {
    let seconds = RETENTION_S.get();
    (seconds > 0).then(|| Duration::from_secs(seconds as u64))
}

/// flow.max_attempt_timeout in µs; None: no bound.
pub fn max_attempt_timeout_us() -> Option<i64> {
    let seconds = MAX_ATTEMPT_TIMEOUT_S.get();
    (seconds > 0).then(|| seconds as i64 * 1_000_000)
}

/// None: keep the event journal forever.
pub fn event_retention() -> Option<Duration> {
    let seconds = EVENT_RETENTION_S.get();
    (seconds > 0).then(|| Duration::from_secs(seconds as u64))
}

pub fn max_result_bytes() -> i32 {
    MAX_RESULT_BYTES.get()
}

/// The elog level for engine messages, from `flow.log_level`.
pub fn log_level() -> pgrx::PgLogLevel {
    let level = LOG_LEVEL.get().map(|s| s.to_string_lossy().to_ascii_lowercase());
    match level.as_deref() {
        Some("log") => pgrx::PgLogLevel::LOG,
        Some("info") => pgrx::PgLogLevel::INFO,
        Some("debug2") => pgrx::PgLogLevel::DEBUG2,
        Some("debug3") | Some("debug4") | Some("debug5") => pgrx::PgLogLevel::DEBUG3,
        _ => pgrx::PgLogLevel::DEBUG1,
    }
}

/// What a fault point does when it fires (see `flow.fault_points`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fault {
    Error,
    Die,
    Stall,
    /// A serialization failure (40001): what a retry can get past.
    Transient,
    /// An invalid-value error (22023): what no retry can fix.
    Invalid,
}

thread_local! {
    /// Hits of each fault point in this process, for `@N`.
    static FAULT_HITS: std::cell::RefCell<std::collections::HashMap<String, u64>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// Whether the fault point `name` fires now, and how. Points are named in
/// `flow.fault_points` as `point[:error|:die|:stall][@N|%P]`; the default
/// action is `die` for `before_settle` and `error` for every other point.
pub fn fault_point(name: &str) -> Option<Fault> {
    let setting = FAULT_POINTS.get()?;
    let setting = setting.to_string_lossy();
    for entry in setting.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (spec, when) = match entry.find(['@', '%']) {
            Some(at) => (&entry[..at], Some(&entry[at..])),
            None => (entry, None),
        };
        let (point, action) = spec.split_once(':').unwrap_or((spec, ""));
        if point.trim() != name {
            continue;
        }
        let hits = FAULT_HITS.with(|h| {
            let mut h = h.borrow_mut();
            let n = h.entry(name.to_string()).or_insert(0);
            *n += 1;
            *n
        });
        let fires = match when {
            Some(w) if w.starts_with('@') => w[1..].trim().parse::<u64>().is_ok_and(|n| n == hits),
            Some(w) => w[1..].trim().parse::<f64>().is_ok_and(|p| rand::random::<f64>() * 100.0 < p),
            None => true,
        };
        if !fires {
            return None;
        }
        return Some(match action.trim() {
            "die" => Fault::Die,
            "stall" => Fault::Stall,
            "transient" => Fault::Transient,
            "invalid" => Fault::Invalid,
            "error" => Fault::Error,
            _ if name == "before_settle" => Fault::Die,
            _ => Fault::Error,
        });
    }
    None
}

/// Fire the fault point `name` if `flow.fault_points` asks for it.
pub fn inject_fault(name: &str) {
    match fault_point(name) {
        None => {}
        Some(Fault::Error) => {
            pgrx::ereport!(
                ERROR,
                pgrx::PgSqlErrorCode::ERRCODE_SYSTEM_ERROR,
                format!("flow: fault injected at {name}")
            );
        }
        Some(Fault::Transient) => {
            pgrx::ereport!(
                ERROR,
                pgrx::PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
                format!("flow: transient fault injected at {name}")
            );
        }
        Some(Fault::Invalid) => {
            pgrx::ereport!(
                ERROR,
                pgrx::PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                format!("flow: invalid value injected at {name}")
            );
        }
        Some(Fault::Die) => unsafe { pgrx::pg_sys::proc_exit(1) },
        Some(Fault::Stall) => std::thread::sleep(Duration::from_secs(2)),
    }
}

/// Ask for a log line at `flow.log_level`.
pub fn log(message: &str) {
    pgrx::ereport!(log_level(), pgrx::PgSqlErrorCode::ERRCODE_SUCCESSFUL_COMPLETION, message.to_string());
}
