//! flow's one ProcessUtility hook (installed in `_PG_init`, so it runs in
//! every backend of the server): it costs a thread-local read and a node tag
//! comparison per utility statement, and dispatches to the concern it serves.
//! - `gateway`: inside a check, refuse every SQL command; inside a handler,
//!   refuse what would outlive its attempt.
//! - `roles`: DROP ROLE cannot leave flow objects with a dangling owner;
//!   REASSIGN OWNED moves flow's ownership too.
//! - `shmem`: a prepared transaction's wake-up and counters wait for its
//!   COMMIT PREPARED (or go with its ROLLBACK PREPARED).

use crate::{gateway, roles, shmem};
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
    let prepared = prepared_transaction(stmt);
    if let Some((pg_sys::TransactionStmtKind::TRANS_STMT_PREPARE, gid)) = &prepared {
        shmem::note_preparing(gid);
    }
    unsafe {
        match PREVIOUS_UTILITY_HOOK {
            Some(previous) => previous(pstmt, query, read_only_tree, context, params, query_env, dest, qc),
            None => pg_sys::standard_ProcessUtility(pstmt, query, read_only_tree, context, params, query_env, dest, qc),
        }
    }
    roles::after_utility(stmt);
    match prepared {
        Some((pg_sys::TransactionStmtKind::TRANS_STMT_COMMIT_PREPARED, gid)) => shmem::finish_prepared(&gid, true),
        Some((pg_sys::TransactionStmtKind::TRANS_STMT_ROLLBACK_PREPARED, gid)) => shmem::finish_prepared(&gid, false),
        _ => {}
    }
}

/// PREPARE TRANSACTION, COMMIT PREPARED, ROLLBACK PREPARED: its kind and GID.
fn prepared_transaction(stmt: *mut pg_sys::Node) -> Option<(pg_sys::TransactionStmtKind::Type, String)> {
    unsafe {
        if stmt.is_null() || (*stmt).type_ != pg_sys::NodeTag::T_TransactionStmt {
            return None;
        }
        let tx = stmt.cast::<pg_sys::TransactionStmt>();
        let kind = (*tx).kind;
        let prepared = [
            pg_sys::TransactionStmtKind::TRANS_STMT_PREPARE,
            pg_sys::TransactionStmtKind::TRANS_STMT_COMMIT_PREPARED,
            pg_sys::TransactionStmtKind::TRANS_STMT_ROLLBACK_PREPARED,
        ];
        if !prepared.contains(&kind) || (*tx).gid.is_null() {
            return None;
        }
        Some((kind, std::ffi::CStr::from_ptr((*tx).gid).to_string_lossy().into_owned()))
    }
}
