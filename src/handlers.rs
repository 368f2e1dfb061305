//! Built-in handlers compiled into the extension. A Rust handler is an ordinary
//! `#[pg_extern]` function with a handler's signature, so `flow.define` takes it
//! like any SQL function and the worker calls it the same way: this module is
//! the registry. Add a handler here and define it with `flow.define`.

use pgrx::prelude::*;
use pgrx::JsonB;

/// Does nothing and returns NULL: for benchmarks and smoke tests. (Its SQL
/// is written out only so that its argument stays unread: taken as a `JsonB`,
/// pgrx would first turn the args into a Rust value, about 1 % of a no-op
/// drain's CPU.)
#[pg_extern(sql = r#"
CREATE FUNCTION "noop"(
	"_args" jsonb /* JsonB */
) RETURNS jsonb /* Option < JsonB > */
IMMUTABLE STRICT PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '@FUNCTION_NAME@';
"#)]
fn noop(_fcinfo: pg_sys::FunctionCallInfo) -> Option<JsonB> {
    None
}

/// Runs `args->>'sql'` as the definition's owner (the worker switches to the
/// owner before calling any handler), pg_cron style. Returns
/// `{"rows": <rows affected or returned>}`.
#[pg_extern(volatile, parallel_unsafe)]
fn run_sql(args: JsonB) -> JsonB {
    let Some(sql) = args.0.get("sql").and_then(|v| v.as_str()) else {
        let message = "flow.run_sql: args must be {\"sql\": \"<statement>\"}";
        // Retrying cannot fix the args: fail permanently.
        crate::outcome::decide(crate::outcome::Decided::Permanent, "permanent", message, None);
        pgrx::ereport!(ERROR, PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE, message);
    };
    let rows = Spi::connect_mut(|client| client.update(sql, None, &[]).map(|t| t.len()))
        .unwrap_or_else(|e| pgrx::error!("flow.run_sql: {e}"));
    JsonB(serde_json::json!({ "rows": rows }))
}

/// Panics: lets the tests check that a Rust panic in a handler is contained
/// and classified as a crash. Internal (not executable by PUBLIC).
#[pg_extern(volatile, parallel_unsafe)]
fn _test_panic(_args: JsonB) -> Option<JsonB> {
    panic!("flow._test_panic was called");
}
