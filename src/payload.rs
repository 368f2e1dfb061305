//! What a handler is given and returns, as datums' own bytes. A claimed
//! command's args and a handler's result are copied out of their datum once
//! and handed on as datums: to the handler, to the args check, to the
//! settlement. Read as JSON text and parsed again (pgrx's `JsonB` goes
//! through `serde_json` both ways), a 1 KB payload cost a worker more than
//! the rest of its command (a drain of no-op commands with 1 KB args ran at
//! half the speed of one with `{}`, and a handler that returned its args at a
//! quarter). A handler's `flow.context` is kept as the composite the claim
//! built, and given to the handler as a datum too (see `Context`).

use pgrx::pg_sys;
use pgrx::{FromDatum, IntoDatum};

unsafe extern "C-unwind" {
    /// jsonb's output function, as fmgr calls it (pgrx's binding is a Rust wrapper).
    fn jsonb_out(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum;
}

/// The bytes of a varlena datum (4-byte header, not compressed, not
/// toasted), owned by Rust, so they outlive the statement, memory context or
/// transaction they came from.
///
/// # Safety
/// `datum` must be a valid varlena datum.
unsafe fn varlena_bytes(datum: pg_sys::Datum) -> Vec<u8> {
    let stored = datum.cast_mut_ptr::<pg_sys::varlena>();
    // a short-header, compressed or toasted value becomes a plain one (a
    // copy); a plain one is itself
    let plain = pg_sys::pg_detoast_datum(stored);
    let bytes = std::slice::from_raw_parts(plain.cast::<u8>(), pgrx::varlena::varsize(plain)).to_vec();
    if plain != stored {
        pg_sys::pfree(plain.cast());
    }
    bytes
}

/// A copy of varlena bytes in the current memory context, as a datum.
fn palloc_copy(bytes: &[u8]) -> pg_sys::Datum {
    // SAFETY: palloc'd (MAXALIGNed) memory of the varlena's own size
    unsafe {
        let copy = pg_sys::palloc(bytes.len()).cast::<u8>();
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), copy, bytes.len());
        pg_sys::Datum::from(copy)
    }
}

/// A jsonb value, as its varlena's bytes (see `varlena_bytes`).
#[derive(Clone)]
pub struct Jsonb(Vec<u8>);

impl Jsonb {
    /// A copy in the current memory context, as a datum.
    pub fn to_datum(&self) -> pg_sys::Datum {
        palloc_copy(&self.0)
    }

    /// Its size as JSON text: what flow.max_result_bytes limits (as the SQL
    /// side's `octet_length(value::text)`; the binary size cannot bound it:
    /// a number such as 1e1000 is a few bytes in jsonb).
    pub fn text_size(&self) -> usize {
        self.with_text(|text| text.to_bytes().len())
    }

    /// Its JSON text, as jsonb's output function writes it.
    pub fn to_text(&self) -> String {
        self.with_text(|text| text.to_string_lossy().into_owned())
    }

    fn with_text<R>(&self, read: impl FnOnce(&std::ffi::CStr) -> R) -> R {
        // SAFETY: jsonb_out of a valid jsonb datum returns a palloc'd C string
        unsafe {
            let datum = self.to_datum();
            let text = pg_sys::DirectFunctionCall1Coll(Some(jsonb_out), pg_sys::InvalidOid, datum);
            let result = read(std::ffi::CStr::from_ptr(text.cast_mut_ptr()));
            pg_sys::pfree(text.cast_mut_ptr());
            pg_sys::pfree(datum.cast_mut_ptr());
            result
        }
    }
}

impl FromDatum for Jsonb {
    unsafe fn from_polymorphic_datum(datum: pg_sys::Datum, is_null: bool, _: pg_sys::Oid) -> Option<Jsonb> {
        if is_null {
            return None;
        }
        Some(Jsonb(varlena_bytes(datum)))
    }
}

impl IntoDatum for Jsonb {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(self.to_datum())
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

/// As a statement's parameter, without cloning the bytes first (`to_datum`
/// makes the one copy the statement gets).
impl IntoDatum for &Jsonb {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(self.to_datum())
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

/// A claimed command's `flow.context`, as the claim built it (a composite
/// datum's bytes). What the handler's start decides, its deadline and start
/// time, is filled in when it starts (`to_datum`): handed over as one datum,
/// the context costs a handler call a tuple deformed and formed again, where
/// fifteen fields read out of the claim's rows, converted and passed to SPI
/// as parameters of a `ROW(...)` cost a context handler a sixth of its drain.
pub struct Context(Vec<u8>);

impl Context {
    /// The composite type (flow.context) of this value.
    pub fn type_oid(&self) -> pg_sys::Oid {
        // SAFETY: the bytes are a composite datum: a HeapTupleHeader (read
        // unaligned: a Vec<u8> promises no alignment)
        unsafe {
            let header = self.0.as_ptr().cast::<pg_sys::HeapTupleHeaderData>();
            std::ptr::addr_of!((*header).t_choice.t_datum.datum_typeid).read_unaligned()
        }
    }

    /// The context of an attempt that started at `started` and is cut off at
    /// `deadline` (TimestampTz µs; None: never), as a new composite datum in
    /// the current memory context.
    pub fn to_datum(&self, deadline: Option<i64>, started: i64) -> pg_sys::Datum {
        // SAFETY: the bytes are a composite datum of a type whose descriptor
        // the type cache has; deformed values point into `header`, which
        // lives until the new tuple is formed from them
        unsafe {
            let header = palloc_copy(&self.0).cast_mut_ptr::<pg_sys::HeapTupleHeaderData>();
            let datum = &(*header).t_choice.t_datum;
            let tupdesc = pg_sys::lookup_rowtype_tupdesc(datum.datum_typeid, datum.datum_typmod);
            let natts = (*tupdesc).natts as usize;
            let mut tuple: pg_sys::HeapTupleData = std::mem::zeroed();
            tuple.t_len = self.0.len() as u32;
            tuple.t_data = header;
            let mut values = vec![pg_sys::Datum::from(0); natts];
            let mut nulls = vec![false; natts];
            pg_sys::heap_deform_tuple(&mut tuple, tupdesc, values.as_mut_ptr(), nulls.as_mut_ptr());
            for (i, attribute) in (*tupdesc).attrs.as_slice(natts).iter().enumerate() {
                match std::ffi::CStr::from_ptr(attribute.attname.data.as_ptr()).to_bytes() {
                    b"deadline" => {
                        nulls[i] = deadline.is_none();
                        values[i] = pg_sys::Datum::from(deadline.unwrap_or(0));
                    }
                    b"attempt_started_at" => {
                        nulls[i] = false;
                        values[i] = pg_sys::Datum::from(started);
                    }
                    _ => {}
                }
            }
            let formed = pg_sys::heap_form_tuple(tupdesc, values.as_mut_ptr(), nulls.as_mut_ptr());
            if (*tupdesc).tdrefcount >= 0 {
                pg_sys::DecrTupleDescRefCount(tupdesc);
            }
            pg_sys::Datum::from((*formed).t_data)
        }
    }
}

impl FromDatum for Context {
    unsafe fn from_polymorphic_datum(datum: pg_sys::Datum, is_null: bool, _: pg_sys::Oid) -> Option<Context> {
        if is_null {
            return None;
        }
        Some(Context(varlena_bytes(datum)))
    }
}

/// (for reading it from a row: the row's column must be a composite)
impl IntoDatum for Context {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(palloc_copy(&self.0))
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::InvalidOid
    }

    fn is_compatible_with(other: pg_sys::Oid) -> bool {
        // SAFETY: a type cache lookup
        unsafe { pg_sys::type_is_rowtype(other) }
    }
}

/// A datum built elsewhere, as a statement's parameter (its type is given
/// beside it).
pub struct RawDatum(pub pg_sys::Datum);

impl IntoDatum for RawDatum {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(self.0)
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::InvalidOid
    }
}
