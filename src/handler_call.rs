//! Calling a handler: directly through fmgr with a call info kept per
//! function (PL/pgSQL, C and Rust handlers: a fraction of a microsecond), or
//! through an SPI plan kept per (handler, owner) (`LANGUAGE sql` handlers,
//! which SPI inlines). The caller runs it inside the gateway
//! (src/gateway.rs), in its attempt's subtransaction.

use crate::claim::Claimed;
use crate::payload::{Context, Jsonb, RawDatum};
use crate::spi::JSONB;
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{self, PgOid};
use pgrx::prelude::*;
use pgrx::spi::OwnedPreparedStatement;
use pgrx::FromDatum;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_int;

thread_local! {
    /// Per (handler, owner): the kept plan of its call, and its shape.
    static HANDLER_PLANS: RefCell<HashMap<(u32, u32), (OwnedPreparedStatement, CallShape)>> = RefCell::new(HashMap::new());
}

/// Forget every kept handler call (with the engine's plans: spi::forget_plans).
pub fn forget() {
    DirectCall::forget();
    HANDLER_PLANS.with(|p| p.borrow_mut().clear());
}

/// Call the handler: directly through fmgr (see DirectCall) unless it is a
/// `LANGUAGE sql` function whose body may be inlined, otherwise through a plan
/// kept per (handler function, owner): SPI inlines its body, resolving names as the owner, and
/// re-validates the plan when the function is replaced. The statement names
/// everything with its schema, so nothing in it resolves through the owner's
/// search_path. A handler that takes a context gets the attempt's: cut off at
/// `deadline`, started `now` (TimestampTz µs; the claim computed them for a
/// start at claim time).
pub fn call_handler(command: &Claimed, deadline: Option<i64>, now: i64) -> Option<Jsonb> {
    if let Some(result) = DirectCall::call(command, deadline, now) {
        return result;
    }
    let key = (command.handler.to_u32(), command.owner.to_u32());
    let missing = HANDLER_PLANS.with(|p| !p.borrow().contains_key(&key));
    if missing {
        let (sql, context_type, returns_void) = handler_call_sql(command.handler);
        let types: Vec<PgOid> = std::iter::once(JSONB).chain(context_type.map(PgOid::from)).collect();
        let plan = Spi::connect_mut(|client| {
            client.prepare_mut(sql.as_str(), &types).unwrap_or_else(|e| error!("flow: {e}")).keep()
        });
        let shape = CallShape { takes_context: context_type.is_some(), returns_void };
        HANDLER_PLANS.with(|p| p.borrow_mut().insert(key, (plan, shape)));
    }
    Spi::connect_mut(|client| {
        HANDLER_PLANS.with(|plans| {
            let plans = plans.borrow();
            let (plan, shape) = &plans[&key];
            let mut args: Vec<DatumWithOid> = vec![(&command.args).into()];
            if shape.takes_context {
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
                .and_then(|t| if shape.returns_void { Ok(None) } else { t.first().get_one::<Jsonb>() })
                .unwrap_or_else(|e| error!("flow: {e}"))
        })
    })
}

/// What a kept handler call passes and gives back (through SPI or directly).
#[derive(Clone, Copy)]
struct CallShape {
    /// It takes a `flow.context` as its second argument.
    takes_context: bool,
    /// It returns void: its call's value is not read (the result is NULL).
    returns_void: bool,
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
/// handler whose body may be inlined is not: SPI inlines it, where fmgr would
/// plan it again in every subtransaction). The function's own SECURITY DEFINER and SET clauses
/// apply as under SPI (fmgr_info wraps it); the caller runs it as its owner
/// with its owner's search_path (gateway::run_handler), in its subtransaction.
struct DirectCall {
    /// In DIRECT_CALL_MEMORY: the function's FmgrInfo and a call info for its arguments.
    fcinfo: *mut pg_sys::FunctionCallInfoBaseData,
    shape: CallShape,
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
        let (fcinfo, CallShape { takes_context, returns_void }) = DIRECT_CALLS.with(|calls| {
            let mut calls = calls.borrow_mut();
            let call = calls.entry(handler.to_u32()).or_insert_with(|| Self::prepare(handler));
            call.as_ref().map(|c| (c.fcinfo, c.shape))
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
            let inlined = language == SQL_LANGUAGE && sql_body_may_inline(tuple, proc_.prosecdef);
            pg_sys::ReleaseSysCache(tuple);
            if !(1..=2).contains(&nargs) || retset || inlined {
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
            Some(DirectCall {
                fcinfo,
                shape: CallShape { takes_context: nargs == 2, returns_void: rettype == pg_sys::VOIDOID },
            })
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

/// Whether the planner may inline the body of this `LANGUAGE sql` function
/// (`tuple`, its pg_proc row) into a statement that calls it: one SELECT
/// without FROM, WITH or a set operation, and no SET clause or SECURITY
/// DEFINER (a `BEGIN ATOMIC` body is taken to). Such a handler goes through
/// SPI, where its body becomes part of the kept plan. Any other body is
/// planned again by fmgr at every call made through SPI (a new executor each
/// time), and once per subtransaction when called directly, which a group
/// of held attempts shares (execute::GROUP_SIZE): a handler that INSERTs one
/// row took 35-60 µs a call through SPI here.
unsafe fn sql_body_may_inline(tuple: pg_sys::HeapTuple, security_definer: bool) -> bool {
    let attribute = |number: u32| {
        let mut isnull = false;
        let datum = pg_sys::SysCacheGetAttr(
            pg_sys::SysCacheIdentifier::PROCOID as c_int,
            tuple,
            number as pg_sys::AttrNumber,
            &mut isnull,
        );
        (!isnull).then_some(datum)
    };
    if security_definer || attribute(pg_sys::Anum_pg_proc_proconfig).is_some() {
        return false;
    }
    if attribute(pg_sys::Anum_pg_proc_prosqlbody).is_some() {
        return true;
    }
    let Some(source) = attribute(pg_sys::Anum_pg_proc_prosrc) else { return true };
    let statements = pgrx::PgList::<pg_sys::RawStmt>::from_pg(pg_sys::pg_parse_query(pg_sys::text_to_cstring(
        source.cast_mut_ptr(),
    )));
    let Some(raw) = statements.get_ptr(0) else { return false };
    if statements.len() != 1 || (*(*raw).stmt).type_ != pg_sys::NodeTag::T_SelectStmt {
        return false;
    }
    let select = &*(*raw).stmt.cast::<pg_sys::SelectStmt>();
    select.fromClause.is_null() && select.withClause.is_null() && select.op == pg_sys::SetOperation::SETOP_NONE
}

/// `SELECT schema.fn($1 [, $2])` for a handler, read from the catalog
/// caches (no SQL, so nothing a handler left behind can change its meaning),
/// the type of its second parameter, flow.context, if it takes one, and
/// whether it returns void. (The call is in the select list, void or not:
/// there the planner inlines a `LANGUAGE sql` function's body into the kept
/// plan; called in FROM, a void function's body was parsed and planned again
/// at every call, 0.1-0.2 ms of each.)
fn handler_call_sql(handler: pg_sys::Oid) -> (String, Option<pg_sys::Oid>, bool) {
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
        let sql =
            format!("SELECT {function}($1::pg_catalog.jsonb{})", if context_type.is_some() { ", $2" } else { "" });
        (sql, context_type, returns_void)
    }
}
