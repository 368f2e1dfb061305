//! The gateway to user code: every call the engine makes of a role's code
//! goes through here, and nothing else calls user code. User code is a
//! handler, an `args_type` check (a domain's CHECK, a composite's column
//! types), and whatever they fire in turn: triggers, deferred constraints,
//! operators, casts, functions. All roles' handlers run in a few shared
//! worker backends whose session user is a superuser, and checks run inside
//! engine functions that run as the extension owner, so each call:
//!
//! - **runs as its owner**, never as the caller: `SECURITY_LOCAL_USERID_CHANGE`
//!   (no `SET ROLE` / `SET SESSION AUTHORIZATION` back to the superuser), and
//!   for a check `SECURITY_RESTRICTED_OPERATION` as well (PostgreSQL's own
//!   rule for code run inside a privileged operation: no temp objects, no
//!   `WITH HOLD` cursors, no deferred triggers);
//! - **with the owner's own `search_path`**: what their session would start
//!   with here (`ALTER ROLE ... IN DATABASE ... SET`, `ALTER ROLE ... SET`,
//!   `ALTER DATABASE ... SET`, in that order), `"$user"` alone when they set
//!   none: never a schema of someone else's choosing (a writable `public`);
//! - **in a GUC nest level of its own**, rolled back when it returns, failed or
//!   not: no setting it makes (`SET`, `set_config(..., false)`) outlives it, so
//!   the engine's statements after it are planned under the engine's own path;
//! - **leaving no session state behind**. A check runs in a subtransaction that
//!   is always rolled back (constraint mode, large objects, cursors and all
//!   else it started end with it), may run no SQL command at all (PREPARE,
//!   SET CONSTRAINTS, LOAD, ...: `check_utility`), and may not call the few
//!   functions whose state outlives a subtransaction (`setseed`, session
//!   advisory locks: `object_access`). A handler's subtransaction is its
//!   attempt's; after it the worker drops temp objects, closes cursors,
//!   deallocates prepared statements and releases session advisory locks
//!   (`after_handler`), fires what it deferred while still its owner
//!   (`run_handler`), and refuses what would outlive it (`WITH HOLD`,
//!   `LISTEN`). A worker's transaction only ever holds one owner's handlers
//!   (src/worker.rs), and the random generator is seeded anew when the owner
//!   changes, so what is scoped to a transaction or to the backend (large
//!   objects, `setseed`, a worker killed on purpose) never reaches another role.
//!
//! The engine's own statements resolve nothing through a schema a role can
//! write: the worker session's `search_path` is `pg_catalog, pg_temp`
//! (checked before each of its statements: `ensure_engine_path`), and the
//! engine's SQL functions pin the same path.

use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, CStr, CString};

unsafe extern "C-unwind" {
    /// `setseed(float8)`, as fmgr calls it (pgrx's binding is a Rust wrapper).
    fn setseed(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum;
}

/// What kind of user code this backend is running, if any.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum UserCode {
    None,
    Handler,
    Check,
}

/// The engine's own `search_path` in a worker session.
const ENGINE_SEARCH_PATH: &CStr = c"pg_catalog, pg_temp";

/// Session settings of a worker backend: the engine's, not those of `ALTER
/// DATABASE` / `ALTER ROLE` (see the README's security model).
const WORKER_SETTINGS: &[(&CStr, &CStr)] = &[
    (c"search_path", ENGINE_SEARCH_PATH),
    (c"default_transaction_isolation", c"read committed"),
    (c"default_transaction_read_only", c"off"),
    (c"default_transaction_deferrable", c"off"),
    (c"lock_timeout", c"0"),
    (c"statement_timeout", c"0"),
    (c"idle_in_transaction_session_timeout", c"0"),
    (c"synchronous_commit", c"on"),
    (c"session_replication_role", c"origin"),
    (c"row_security", c"on"),
];

thread_local! {
    static IN_USER_CODE: Cell<UserCode> = const { Cell::new(UserCode::None) };
    /// The handlers' `search_path` value in place while a handler runs
    /// (malloc'd, as PostgreSQL's own setting values), and its text.
    static HANDLER_PATH: RefCell<(String, *mut c_char)> = const { RefCell::new((String::new(), std::ptr::null_mut())) };
    /// The worker's own `search_path` value while a handler runs (null otherwise).
    static WORKER_PATH_VALUE: Cell<*mut c_char> = const { Cell::new(std::ptr::null_mut()) };
    static CONSTRAINT_STATE_CHANGED: Cell<bool> = const { Cell::new(false) };
    /// The statement_timeout the worker inherited (ms, 0: none): the default attempt timeout.
    static INHERITED_STATEMENT_TIMEOUT_MS: Cell<i32> = const { Cell::new(0) };
    /// Owners' search paths read in the current transaction (its local id).
    static OWNER_PATHS: RefCell<(u32, Vec<(pg_sys::Oid, String)>)> = const { RefCell::new((0, Vec::new())) };
    /// Whose handlers this worker ran last (see `begin_owner`).
    static LAST_OWNER: Cell<pg_sys::Oid> = const { Cell::new(pg_sys::InvalidOid) };
    /// The object-access hook that was installed before flow's.
    static PREVIOUS_OBJECT_ACCESS: Cell<pg_sys::object_access_hook_type> = const { Cell::new(None) };
}

/// What user code, if any, this backend is running now.
pub fn in_user_code() -> UserCode {
    IN_USER_CODE.with(|c| c.get())
}

/// Install the object-access hook (`_PG_init`, so in every backend).
pub fn init() {
    unsafe {
        PREVIOUS_OBJECT_ACCESS.with(|p| p.set(pg_sys::object_access_hook));
        pg_sys::object_access_hook = Some(object_access);
    }
}

// ---------------------------------------------------------------- the engine's session

/// Pin the worker session's settings; called once after the worker connects.
pub fn pin_worker_session() {
    unsafe {
        INHERITED_STATEMENT_TIMEOUT_MS.with(|t| t.set(pg_sys::StatementTimeout.max(0)));
        for (name, value) in WORKER_SETTINGS {
            pg_sys::SetConfigOption(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_SUSET,
                pg_sys::GucSource::PGC_S_SESSION,
            );
        }
    }
}

/// Before each of the engine's statements in a worker: its `search_path` is
/// the engine's. Every call of user code rolls back what it set, so this
/// only ever finds the path changed if a call bypassed the gateway: it puts
/// the path back and says so, loudly.
pub fn ensure_engine_path() {
    unsafe {
        let current = pg_sys::namespace_search_path;
        if !current.is_null() && CStr::from_ptr(current) == ENGINE_SEARCH_PATH {
            return;
        }
        pgrx::warning!("flow: the worker's search_path was changed outside the gateway; restoring it");
        pg_sys::SetConfigOption(
            c"search_path".as_ptr(),
            ENGINE_SEARCH_PATH.as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_SESSION,
        );
    }
}

/// The attempt timeout of a handler whose definition has none: the
/// statement_timeout of the server or database, if any (µs).
pub fn default_attempt_timeout_us() -> Option<i64> {
    let ms = INHERITED_STATEMENT_TIMEOUT_MS.with(|t| t.get());
    (ms > 0).then(|| ms as i64 * 1000)
}

/// Run `f` as `role`, with `flags` added to the security context (always
/// SECURITY_LOCAL_USERID_CHANGE: no SET ROLE back). On an ERROR the
/// (sub)transaction's abort restores the user, so there is no guard.
/// (The engine's own SQL about roles runs so too: src/roles.rs.)
pub fn as_role<R>(role: pg_sys::Oid, flags: u32, f: impl FnOnce() -> R) -> R {
    unsafe {
        let (mut saved_user, mut saved_context) = (pg_sys::InvalidOid, 0);
        pg_sys::GetUserIdAndSecContext(&mut saved_user, &mut saved_context);
        pg_sys::SetUserIdAndSecContext(role, saved_context | (pg_sys::SECURITY_LOCAL_USERID_CHANGE | flags) as c_int);
        let result = f();
        pg_sys::SetUserIdAndSecContext(saved_user, saved_context);
        result
    }
}

// ---------------------------------------------------------------- the owner's search_path

/// The `search_path` `owner`'s own session would start with in this
/// database (flow._search_path_of), read once per transaction and owner:
/// a worker's chunk holds one owner's handlers, so that is once per chunk.
fn owner_search_path(owner: pg_sys::Oid) -> String {
    let lxid = unsafe { (*pg_sys::MyProc).lxid };
    if let Some(path) = OWNER_PATHS.with(|p| {
        let p = p.borrow();
        (p.0 == lxid).then(|| p.1.iter().find(|(o, _)| *o == owner).map(|(_, path)| path.clone())).flatten()
    }) {
        return path;
    }
    // (a kept plan: parsed and planned for every chunk, this statement was a
    // tenth of a slow handler's cycle outside its handler; in the caller's
    // session too, for a check at enqueue)
    let path = crate::spi::kept_query("SELECT flow._search_path_of($1)", &[crate::spi::OID], &[owner.into()], |rows| {
        rows.first().get_one::<String>().unwrap_or_else(|e| pgrx::error!("flow: {e}"))
    })
    .unwrap_or_else(|| "\"$user\"".to_string());
    OWNER_PATHS.with(|p| {
        let mut p = p.borrow_mut();
        if p.0 != lxid {
            *p = (lxid, Vec::new());
        }
        p.1.push((owner, path.clone()));
    });
    path
}

/// Give `search_path` the handler's value, in place of the worker's, until
/// `leave_handler_search_path`. The value is swapped under the setting, not
/// SET: a SET gives the setting an entry on the nest level's stack, and then
/// reverting the level at the attempt's end walks every setting of the
/// server (PostgreSQL 15's AtEOXact_GUC; about 3 % of a no-op drain's CPU
/// with the SET's own parsing), where a handler that SETs nothing costs
/// nothing to revert. The handler still sees and may change the setting as
/// its own: SHOW and current_setting read the value in place, and a SET it
/// makes is stacked over it and reverted to it (the stack then refers to
/// this value, so PostgreSQL never frees it; once the attempt is over no
/// stack entry does, and `enter` may replace it).
unsafe fn enter_handler_search_path(path: &str) {
    let value = HANDLER_PATH.with(|h| {
        let mut h = h.borrow_mut();
        if h.1.is_null() || h.0 != path {
            let text = CString::new(path).unwrap_or_else(|_| CString::from(c"\"$user\""));
            let fresh = unsafe { libc::strdup(text.as_ptr()) };
            if fresh.is_null() {
                pgrx::error!("flow: out of memory");
            }
            if !h.1.is_null() {
                // (not in use: no handler runs, and the worker's value is in place)
                unsafe { libc::free(h.1.cast()) };
            }
            *h = (path.to_string(), fresh);
        }
        h.1
    });
    // (kept if already set: the worker's value is never replaced by a handler's)
    WORKER_PATH_VALUE.with(|w| {
        if w.get().is_null() {
            w.set(unsafe { pg_sys::namespace_search_path });
        }
    });
    unsafe {
        pg_sys::namespace_search_path = value;
        pg_sys::assign_search_path(value, std::ptr::null_mut()); // (the next lookup computes the path anew)
    }
}

/// The worker's `search_path` back (after an attempt, on every path: on an
/// ERROR the subtransaction's abort first reverts the handler's own SETs,
/// back to the handler's value). Does nothing outside an attempt.
fn leave_handler_search_path() {
    let worker = WORKER_PATH_VALUE.with(|w| w.replace(std::ptr::null_mut()));
    if worker.is_null() {
        return;
    }
    unsafe {
        pg_sys::namespace_search_path = worker;
        pg_sys::assign_search_path(worker, std::ptr::null_mut());
    }
}

// ---------------------------------------------------------------- handlers

/// A worker's chunk is about to run `owner`'s handlers (and only theirs): if
/// the last chunk ran another owner's, the backend's random generator is
/// seeded anew, so no role can set (`setseed`) or predict what another
/// role's handlers draw from `random()`.
pub fn begin_owner(owner: pg_sys::Oid) {
    if LAST_OWNER.with(|l| l.replace(owner)) == owner {
        return;
    }
    use rand::Rng;
    let seed: f64 = rand::thread_rng().gen_range(-1.0..=1.0);
    unsafe {
        pg_sys::DirectFunctionCall1Coll(Some(setseed), pg_sys::InvalidOid, seed.into_datum().unwrap());
    }
}

/// Run a handler (`f`) as `owner`, inside the caller's subtransaction, and
/// fire what it deferred before returning. On an ERROR the subtransaction's
/// abort restores the user and the settings; the caller then calls
/// `after_handler` on both paths.
pub fn run_handler<R>(owner: pg_sys::Oid, f: impl FnOnce() -> R) -> R {
    let path = owner_search_path(owner);
    as_role(owner, 0, || unsafe {
        let nest = pg_sys::NewGUCNestLevel();
        enter_handler_search_path(&path);
        IN_USER_CODE.with(|c| c.set(UserCode::Handler));
        let result = f();
        // Deferred triggers and constraints of this handler fire now, as its
        // owner, under its settings and deadline; an error fails this attempt.
        pg_sys::AfterTriggerFireDeferred();
        IN_USER_CODE.with(|c| c.set(UserCode::None));
        // false even on success: a handler's own SET must not leak into the
        // engine's SQL (or the next handler). Nearly free when it made none.
        pg_sys::AtEOXact_GUC(false, nest);
        leave_handler_search_path();
        result
    })
}

/// After every attempt (its subtransaction committed or rolled back), as the
/// worker: nothing the handler started survives it. Prepared statements and
/// session advisory locks are not transactional, so a failed attempt needs
/// this as much as a successful one.
pub fn after_handler() {
    IN_USER_CODE.with(|c| c.set(UserCode::None));
    leave_handler_search_path();
    unsafe {
        let (mut temp, mut temp_toast) = (pg_sys::InvalidOid, pg_sys::InvalidOid);
        pg_sys::GetTempNamespaceState(&mut temp, &mut temp_toast);
        if temp != pg_sys::InvalidOid {
            pg_sys::ResetTempTableNamespace();
        }
        pg_sys::DropAllPreparedStatements();
        // Cursors a handler left open would live until the chunk commits, where
        // a later handler could FETCH what they read as their owner.
        pg_sys::PortalHashTableDeleteAll();
        pg_sys::LockReleaseSession(pg_sys::USER_LOCKMETHOD as pg_sys::LOCKMETHODID);
    }
}

/// Whether a handler ran SET CONSTRAINTS since the last call (which resets
/// it): its chunk must commit before the next handler runs, or that handler's
/// deferred constraints would be checked on another handler's terms.
pub fn constraint_state_changed() -> bool {
    CONSTRAINT_STATE_CHANGED.with(|c| c.replace(false))
}

// ---------------------------------------------------------------- checks

/// Why `args` do not fit `args_type` (None: they fit), checked as `owner`
/// (flow._args_misfit): at enqueue and spawn in the caller's session, and
/// by a worker before each attempt. `args` is jsonb's text, read back as
/// jsonb by the check (pgrx's `JsonB` would pass the numbers through
/// doubles, and the check would see other args than the handler gets).
/// An ERROR the check raises (other than a misfit) comes back as Err, after
/// everything the check did was rolled back.
pub fn check_args(
    owner: pg_sys::Oid,
    args_type: pg_sys::Oid,
    args: &str,
) -> Result<Option<String>, pg_sys::panic::CaughtError> {
    let path = owner_search_path(owner);
    let outer = IN_USER_CODE.with(|c| c.get());
    // Always rolled back: the check may change nothing, and whatever
    // transaction-scoped state it started ends here.
    let subtransaction = crate::spi::Subtransaction::begin();
    let outcome = crate::spi::catching(
        || {
            Ok(as_role(owner, pg_sys::SECURITY_RESTRICTED_OPERATION, || unsafe {
                let nest = pg_sys::NewGUCNestLevel();
                IN_USER_CODE.with(|c| c.set(UserCode::Check));
                let misfit = Spi::get_one_with_args::<String>(
                    "SELECT flow._args_misfit($1::pg_catalog.regtype, $2::pg_catalog.jsonb, $3::pg_catalog.text)",
                    &[args_type.into(), args.into(), path.as_str().into()],
                )
                .unwrap_or_else(|e| pgrx::error!("flow: {e}"));
                IN_USER_CODE.with(|c| c.set(outer));
                pg_sys::AtEOXact_GUC(false, nest);
                misfit
            }))
        },
        |caught| caught,
    );
    IN_USER_CODE.with(|c| c.set(outer));
    subtransaction.end(false);
    outcome
}

/// `check_args` for the engine's SQL (enqueue, enqueue_many, spawn): an
/// ERROR the check raises is raised again, for the caller.
#[pg_extern(volatile, parallel_unsafe)]
fn _args_misfit_as(owner: pg_sys::Oid, args_type: pg_sys::Oid, args: &str) -> Option<String> {
    check_args(owner, args_type, args).unwrap_or_else(|caught| caught.rethrow())
}

/// The functions whose effects outlive a rolled-back subtransaction, which a
/// check may not call (pg_catalog's, by name).
const OUTLIVE_A_CHECK: &[&str] = &[
    "setseed",
    "pg_advisory_lock",
    "pg_advisory_lock_shared",
    "pg_try_advisory_lock",
    "pg_try_advisory_lock_shared",
    "pg_advisory_unlock",
    "pg_advisory_unlock_shared",
    "pg_advisory_unlock_all",
];

/// PostgreSQL's object-access hook: it sees every function an expression is
/// about to call (OAT_FUNCTION_EXECUTE, once per expression set up), and
/// refuses, inside a check, the functions of OUTLIVE_A_CHECK. Elsewhere it
/// costs a thread-local read.
#[pg_guard]
unsafe extern "C-unwind" fn object_access(
    access: pg_sys::ObjectAccessType::Type,
    class: pg_sys::Oid,
    object: pg_sys::Oid,
    sub_id: c_int,
    arg: *mut std::ffi::c_void,
) {
    if let Some(previous) = PREVIOUS_OBJECT_ACCESS.with(|p| p.get()) {
        unsafe { previous(access, class, object, sub_id, arg) };
    }
    if access != pg_sys::ObjectAccessType::OAT_FUNCTION_EXECUTE || in_user_code() != UserCode::Check {
        return;
    }
    let refused = unsafe {
        let name = pg_sys::get_func_name(object);
        !name.is_null()
            && pg_sys::get_func_namespace(object) == pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE)
            && OUTLIVE_A_CHECK.iter().any(|f| CStr::from_ptr(name).to_bytes() == f.as_bytes())
    };
    if refused {
        pgrx::ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            "flow: an args_type check cannot call setseed or session advisory lock functions",
            "Their effects would outlive the check, in a session that is not its owner's."
        );
    }
}

// ---------------------------------------------------------------- utility statements

/// Before a utility statement (src/hooks.rs): inside a check, none may run;
/// inside a handler, refuse what would outlive its attempt in the shared
/// worker session.
pub fn check_utility(stmt: *mut pg_sys::Node) {
    let refused = match in_user_code() {
        UserCode::None => return,
        UserCode::Check => Some((
            "flow: an args_type check cannot run SQL commands (SET, PREPARE, SET CONSTRAINTS, ...)",
            "A check only tells whether args fit; what it ran would act in the caller's session.",
        )),
        UserCode::Handler => unsafe {
            let outlives = match (*stmt).type_ {
                // SET CONSTRAINTS lasts to the end of the transaction, which the
                // same owner's handlers after this one share: the worker commits
                // right after it (see constraint_state_changed).
                pg_sys::NodeTag::T_ConstraintsSetStmt => {
                    CONSTRAINT_STATE_CHANGED.with(|c| c.set(true));
                    false
                }
                pg_sys::NodeTag::T_DeclareCursorStmt => {
                    ((*(stmt as *mut pg_sys::DeclareCursorStmt)).options & pg_sys::CURSOR_OPT_HOLD as c_int) != 0
                }
                pg_sys::NodeTag::T_ListenStmt => true,
                _ => false,
            };
            outlives.then_some((
                "flow: a handler cannot use WITH HOLD cursors or LISTEN",
                "They would outlive the handler's attempt in a worker session that other roles' handlers share.",
            ))
        },
    };
    if let Some((message, hint)) = refused {
        pgrx::ereport!(ERROR, PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED, message, hint);
    }
}
