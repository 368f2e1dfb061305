//! Roles and flow's ownership. flow's owners (of definitions, queues, runs,
//! events) are rows in its tables, which PostgreSQL's dependency tracking
//! does not see, so this module makes the role commands aware of them, in the
//! database where flow is installed:
//! - DROP ROLE (and DROP OWNED) fails while the role still owns definitions,
//!   queues or unfinished runs here (as it fails for tables the role owns);
//!   from another database, PostgreSQL's own check refuses it, through the
//!   grant flow._mark_owner records;
//! - REASSIGN OWNED BY old TO new moves them to the new role.
//! (As for PostgreSQL's own objects, run REASSIGN OWNED in each database.)

use crate::gateway;
use pgrx::pg_sys;
use pgrx::prelude::*;

/// Whether flow is installed in the current database.
fn flow_installed() -> bool {
    unsafe { pg_sys::get_extension_oid(c"flow".as_ptr(), true) != pg_sys::InvalidOid }
}

/// The OIDs of a list of RoleSpec nodes (roles that do not exist are skipped).
fn role_oids(list: *mut pg_sys::List) -> Vec<pg_sys::Oid> {
    if list.is_null() {
        return Vec::new();
    }
    unsafe {
        (0..(*list).length as usize)
            .map(|i| (*(*list).elements.add(i)).ptr_value as *const pg_sys::RoleSpec)
            .map(|spec| pg_sys::get_rolespec_oid(spec, true))
            .filter(|oid| *oid != pg_sys::InvalidOid)
            .collect()
    }
}

/// Run flow's own SQL about roles as the bootstrap superuser: the statement's
/// privileges were checked by PostgreSQL, and flow's tables are not the
/// caller's to read or write.
fn as_superuser<R>(f: impl FnOnce() -> R) -> R {
    gateway::as_role(pg_sys::Oid::from(pg_sys::BOOTSTRAP_SUPERUSERID), 0, f)
}

/// Whether PostgreSQL will let the current user go on with this statement
/// for `role` (its own checks come after the hook): flow answers only then,
/// so that its answer tells nobody else whether a role owns flow objects.
/// DROP ROLE needs CREATEROLE (and superuser for a superuser); DROP OWNED
/// needs the role's privileges.
fn may_drop(dropping_role: bool, role: pg_sys::Oid) -> bool {
    unsafe {
        if dropping_role {
            pg_sys::has_createrole_privilege(pg_sys::GetUserId())
                && (!pg_sys::superuser_arg(role) || pg_sys::superuser())
        } else {
            pg_sys::has_privs_of_role(pg_sys::GetUserId(), role)
        }
    }
}

pub fn before_utility(stmt: *mut pg_sys::Node) {
    let (dropping_role, roles) = match unsafe { (*stmt).type_ } {
        pg_sys::NodeTag::T_DropRoleStmt => (true, unsafe { (*(stmt as *mut pg_sys::DropRoleStmt)).roles }),
        // DROP OWNED would revoke the mark that makes DROP ROLE elsewhere fail
        // (flow._mark_owner) and leave flow's objects behind without an owner.
        pg_sys::NodeTag::T_DropOwnedStmt => (false, unsafe { (*(stmt as *mut pg_sys::DropOwnedStmt)).roles }),
        _ => return,
    };
    if !flow_installed() {
        return;
    }
    for role in role_oids(roles).into_iter().filter(|role| may_drop(dropping_role, *role)) {
        let owns = as_superuser(|| Spi::get_one_with_args::<bool>("SELECT flow._owns_anything($1)", &[role.into()]));
        if let Ok(Some(true)) = owns {
            let name = unsafe { std::ffi::CStr::from_ptr(pg_sys::GetUserNameFromId(role, false)) }
                .to_string_lossy()
                .into_owned();
            pgrx::ereport!(
                ERROR,
                PgSqlErrorCode::ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST,
                format!("role \"{name}\" owns flow definitions, queues or unfinished runs in this database"),
                "REASSIGN OWNED BY the role TO another role first (it moves flow's ownership too)."
            );
        }
    }
}

pub fn after_utility(stmt: *mut pg_sys::Node) {
    if unsafe { (*stmt).type_ } != pg_sys::NodeTag::T_ReassignOwnedStmt || !flow_installed() {
        return;
    }
    let reassign = stmt as *mut pg_sys::ReassignOwnedStmt;
    let old = role_oids(unsafe { (*reassign).roles });
    let new = unsafe { pg_sys::get_rolespec_oid((*reassign).newrole, false) };
    as_superuser(|| {
        Spi::run_with_args("SELECT flow._reassign_owned($1, $2)", &[old.into(), new.into()])
            .unwrap_or_else(|e| pgrx::error!("flow: {e}"))
    });
}
