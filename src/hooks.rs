//! flow's one ProcessUtility hook (installed in `_PG_init`, so it runs in
//! every backend of the server): it costs a thread-local read and a node tag
//! comparison per utility statement, and dispatches to the concern it serves.
//! - `gateway`: inside a check, refuse every SQL command; inside a handler,
//!   refuse what would outlive its attempt.
//! - `roles`: DROP ROLE cannot leave flow objects with a dangling owner;
//!   REASSIGN OWNED moves flow's ownership too.

use crate::{gateway, roles};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::ffi::c_char;

static mut PREVIOUS_UTILITY_HOOK: pg_sys::ProcessUtility_hook_type = None;

pub fn init() {
    unsafe {
        PREVIOUS_UTILITY_HOOK = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(utility_hook);
    }
}

#[pg_guard]
#[allow(clippy::too_many_arguments)]
unsafe extern "C-unwind" fn utility_hook(
    pstmt: *mut pg_sys::PlannedStmt,
    query: *const c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    query_env: *mut pg_sys::QueryEnvironment,
    dest: *mut pg_sys::DestReceiver,
    qc: *mut pg_sys::QueryCompletion,
) {
    let stmt = unsafe { (*pstmt).utilityStmt };
    gateway::check_utility(stmt);
    roles::before_utility(stmt);
    unsafe {
        match PREVIOUS_UTILITY_HOOK {
            Some(previous) => previous(pstmt, query, read_only_tree, context, params, query_env, dest, qc),
            None => pg_sys::standard_ProcessUtility(pstmt, query, read_only_tree, context, params, query_env, dest, qc),
        }
    }
    roles::after_utility(stmt);
}
