//! The isolation model: a handler runs with exactly the rights, and the
//! effects, of its owner running it in a session of their own. All handlers of
//! all roles share a few worker backends whose session user is a superuser, so
//! each rule below closes a way one handler could act in another's name:
//!
//! - **Rights.** The handler runs as its definition's owner with
//!   `SECURITY_LOCAL_USERID_CHANGE` (no `SET ROLE` / `SET SESSION
//!   AUTHORIZATION` back to the superuser), `search_path` pinned to
//!   `"$user", public`, and every setting it changes (`SET`, `set_config`, even
//!   without `LOCAL`) reverted when it returns.
//! - **Commit-time code runs inside the attempt.** Deferred triggers and
//!   deferred constraints (Django makes every foreign key `DEFERRABLE INITIALLY
//!   DEFERRED`) fire when the handler returns, still as its owner and inside
//!   its subtransaction: a violation fails that command alone, and nothing the
//!   handler queued runs later as the worker's superuser. (PostgreSQL's own
//!   `SECURITY_RESTRICTED_OPERATION` refuses deferred triggers outright; that
//!   would shut out such schemas.)
//! - **Nothing outlives the attempt.** After every attempt, succeeded or not,
//!   the worker drops the session's temp objects (with their `ON COMMIT`
//!   actions), closes its cursors, deallocates prepared statements and
//!   releases session advisory locks; a handler's `WITH HOLD` cursor or `LISTEN`, which would run or linger
//!   in the worker's session after it, is refused with an error. So one role's
//!   temp table can never shadow another role's table or type.
//! - **The engine's own SQL resolves nothing through a schema a non-superuser
//!   can write.** The worker session's `search_path` is `pg_catalog, pg_temp`
//!   (temp relations last; functions and operators are never looked up in
//!   `pg_temp`), and the engine's PL/pgSQL functions pin the same path.
//! - **The worker's session settings are the engine's,** not those of `ALTER
//!   DATABASE` / `ALTER ROLE`: isolation level, read-only default, lock and
//!   statement timeouts, `synchronous_commit`, `session_replication_role` and
//!   `row_security` are pinned at start. A server or database
//!   `statement_timeout` becomes the default attempt timeout of handlers that
//!   have none.
//! - **Event keys are locked under flow's own lock tag**, which
//!   `pg_advisory_lock` cannot take, so no role can stall another's emits.

use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::Cell;
use std::ffi::{c_char, c_int, CStr};

/// The `search_path` every handler starts with, whatever the worker's own is.
const HANDLER_SEARCH_PATH: &CStr = c"\"$user\", public";

/// Session settings of a worker backend (see the module comment).
const WORKER_SETTINGS: &[(&CStr, &CStr)] = &[
    (c"search_path", c"pg_catalog, pg_temp"),
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

/// Lock tag field 4 of flow's own locks (see `lock_own`): pg_advisory_lock()
/// only ever uses 1 (one bigint key) and 2 (two int keys). One per kind of
/// thing locked, so an event key and a queue never share a lock.
const EVENT_LOCK_TAG: u16 = 0x464C; // "FL"
const QUEUE_LOCK_TAG: u16 = 0x4651; // "FQ"
const EVENT_BUCKET_LOCK_TAG: u16 = 0x4652; // "FR"

/// Whether a handler ran SET CONSTRAINTS since the last call (which resets
/// it): its chunk must commit before the next handler runs, or that handler's
/// deferred constraints would be checked on another handler's terms.
pub fn constraint_state_changed() -> bool {
    CONSTRAINT_STATE_CHANGED.with(|c| c.replace(false))
}

thread_local! {
    /// HANDLER_SEARCH_PATH as the value `search_path` holds while a handler
    /// runs: allocated once, with malloc as PostgreSQL's own setting values.
    static HANDLER_PATH_VALUE: Cell<*mut c_char> = const { Cell::new(std::ptr::null_mut()) };
    /// The worker's own `search_path` value while a handler runs (null otherwise).
    static WORKER_PATH_VALUE: Cell<*mut c_char> = const { Cell::new(std::ptr::null_mut()) };
    static CONSTRAINT_STATE_CHANGED: Cell<bool> = const { Cell::new(false) };
    /// True while a handler runs in this backend.
    static IN_HANDLER: Cell<bool> = const { Cell::new(false) };
    /// The statement_timeout the worker inherited (ms, 0: none): the default attempt timeout.
    static INHERITED_STATEMENT_TIMEOUT_MS: Cell<i32> = const { Cell::new(0) };
}

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

/// The attempt timeout of a handler whose definition has none: the
/// statement_timeout of the server or database, if any (µs).
pub fn default_attempt_timeout_us() -> Option<i64> {
    let ms = INHERITED_STATEMENT_TIMEOUT_MS.with(|t| t.get());
    (ms > 0).then(|| ms as i64 * 1000)
}

/// Run `f` as `role`, with `flags` added to the security context (always
/// SECURITY_LOCAL_USERID_CHANGE: no SET ROLE back). On an ERROR the
/// (sub)transaction's abort restores the user, so there is no guard.
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

/// Run a handler (`f`) as `owner`, inside the caller's subtransaction, and
/// fire what it deferred before returning. On an ERROR the subtransaction's
/// abort restores the user and the settings; the caller then calls
/// `after_attempt` on both paths.
pub fn run_as_owner<R>(owner: pg_sys::Oid, f: impl FnOnce() -> R) -> R {
    as_role(owner, 0, || unsafe {
        let nest = pg_sys::NewGUCNestLevel();
        enter_handler_search_path();
        IN_HANDLER.with(|h| h.set(true));
        let result = f();
        // Deferred triggers and constraints of this handler fire now, as its
        // owner, under its settings and deadline; an error fails this attempt.
        pg_sys::AfterTriggerFireDeferred();
        IN_HANDLER.with(|h| h.set(false));
        // false even on success: a handler's own SET must not leak into the
        // engine's SQL (or the next handler). Nearly free when it made none.
        pg_sys::AtEOXact_GUC(false, nest);
        leave_handler_search_path();
        result
    })
}

/// Give `search_path` the handlers' value, in place of the worker's, until
/// `leave_handler_search_path`. The value is swapped under the setting, not
/// SET: a SET gives the setting an entry on the nest level's stack, and then
/// reverting the level at the attempt's end walks every setting of the
/// server (PostgreSQL 15's AtEOXact_GUC; about 3 % of a no-op drain's CPU
/// with the SET's own parsing), where a handler that SETs nothing costs
/// nothing to revert. The handler still sees and may change the setting as
/// its own: SHOW and current_setting read the value in place, and a SET it
/// makes is stacked over it and reverted to it (the stack then refers to
/// this value, so PostgreSQL never frees it).
unsafe fn enter_handler_search_path() {
    let handler = HANDLER_PATH_VALUE.with(|v| {
        if v.get().is_null() {
            v.set(unsafe { libc::strdup(HANDLER_SEARCH_PATH.as_ptr()) });
        }
        v.get()
    });
    if handler.is_null() {
        pgrx::error!("flow: out of memory");
    }
    // (kept if already set: the worker's value is never replaced by the handlers')
    WORKER_PATH_VALUE.with(|w| {
        if w.get().is_null() {
            w.set(unsafe { pg_sys::namespace_search_path });
        }
    });
    unsafe {
        pg_sys::namespace_search_path = handler;
        pg_sys::assign_search_path(handler, std::ptr::null_mut()); // (the next lookup computes the path anew)
    }
}

/// The worker's `search_path` back (after an attempt, on every path: on an
/// ERROR the subtransaction's abort first reverts the handler's own SETs,
/// back to the handlers' value). Does nothing outside an attempt.
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

/// After every attempt (its subtransaction committed or rolled back), as the
/// worker: nothing the handler started survives it. Prepared statements and
/// session advisory locks are not transactional, so a failed attempt needs
/// this as much as a successful one.
pub fn after_attempt() {
    IN_HANDLER.with(|h| h.set(false));
    leave_handler_search_path();
    unsafe {
        let (mut temp, mut temp_toast) = (pg_sys::InvalidOid, pg_sys::InvalidOid);
        pg_sys::GetTempNamespaceState(&mut temp, &mut temp_toast);
        if temp != pg_sys::InvalidOid {
            pg_sys::ResetTempTableNamespace();
        }
        pg_sys::DropAllPreparedStatements();
        // Cursors a handler left open would live until the chunk commits, where
        // a later handler of another role could FETCH what they read as their owner.
        pg_sys::PortalHashTableDeleteAll();
        pg_sys::LockReleaseSession(pg_sys::USER_LOCKMETHOD as pg_sys::LOCKMETHODID);
    }
}

/// Before a utility statement (src/hooks.rs): inside a handler, refuse what
/// would outlive its attempt in the shared worker session.
pub fn check_utility(stmt: *mut pg_sys::Node) {
    if !IN_HANDLER.with(|h| h.get()) {
        return;
    }
    let refused = unsafe {
        match (*stmt).type_ {
            // SET CONSTRAINTS lasts to the end of the transaction, which the
            // handlers after this one share: the worker commits right after it
            // (see constraint_state_changed).
            pg_sys::NodeTag::T_ConstraintsSetStmt => {
                CONSTRAINT_STATE_CHANGED.with(|c| c.set(true));
                false
            }
            pg_sys::NodeTag::T_DeclareCursorStmt => {
                ((*(stmt as *mut pg_sys::DeclareCursorStmt)).options & pg_sys::CURSOR_OPT_HOLD as c_int) != 0
            }
            pg_sys::NodeTag::T_ListenStmt => true,
            _ => false,
        }
    };
    if refused {
        pgrx::ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            "flow: a handler cannot use WITH HOLD cursors or LISTEN",
            "They would outlive the handler's attempt in a worker session that other roles' handlers share."
        );
    }
}

/// Why `args` do not fit `args_type` (NULL: they fit), checked as `owner`
/// under SECURITY_RESTRICTED_OPERATION: a domain's CHECK or a type's input
/// function is the owner's code, never run with the caller's or the worker's
/// rights. (Called by the engine's SQL at enqueue and spawn, and by the worker
/// before an attempt.) `args` is jsonb's text, read back as jsonb by the
/// check: pgrx's `JsonB` would pass the numbers through doubles, and the
/// check would see other args than the handler gets.
#[pg_extern(volatile, parallel_unsafe)]
fn _args_misfit_as(owner: pg_sys::Oid, args_type: pg_sys::Oid, args: &str) -> Option<String> {
    as_role(owner, pg_sys::SECURITY_RESTRICTED_OPERATION, || {
        Spi::get_one_with_args::<String>(
            "SELECT flow._args_misfit($1::pg_catalog.regtype, $2::pg_catalog.jsonb)",
            &[args_type.into(), args.into()],
        )
        .unwrap_or_else(|e| pgrx::error!("flow: {e}"))
    })
}

/// A 64-bit hash of `what`, the same in every backend (fixed keys).
fn hash64(what: impl std::hash::Hash) -> u64 {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    what.hash(&mut h);
    h.finish()
}

/// Lock `what` (hashed; two things whose hashes agree only wait for each
/// other needlessly) in `mode` until the end of the transaction, under a lock
/// tag of flow's own that no role can take from SQL. With `wait` false, only
/// if no other transaction holds it in a conflicting mode (then false).
fn lock_own(kind: u16, what: impl std::hash::Hash, mode: pg_sys::LOCKMODE, wait: bool) -> bool {
    let hash = hash64(what);
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
    lock_own(EVENT_LOCK_TAG, (name, key, domain.to_u32()), mode as pg_sys::LOCKMODE, true);
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
    let bucket = hash64((name, key)) % EVENT_BUCKETS;
    let mode = if share { pg_sys::ShareLock } else { pg_sys::RowExclusiveLock };
    lock_own(EVENT_BUCKET_LOCK_TAG, bucket, mode as pg_sys::LOCKMODE, wait)
}

/// Lock a queue's name until the end of the transaction: shared by whoever
/// puts a definition or a command in the queue (flow._hold_queue), exclusive
/// by flow.drop_queue, which so waits for them to commit before it looks
/// for what uses the queue, and makes them wait until it has dropped it.
#[pg_extern(volatile, parallel_unsafe)]
fn _lock_queue_name(name: &str, exclusive: bool) {
    let mode = if exclusive { pg_sys::ExclusiveLock } else { pg_sys::ShareLock };
    lock_own(QUEUE_LOCK_TAG, name, mode as pg_sys::LOCKMODE, true);
}
