//! Args and results as jsonb's own bytes. A claimed command's args and a
//! handler's result are copied out of their datum once and handed on as
//! datums: to the handler, to the args check, to the settlement. Read as
//! JSON text and parsed again (pgrx's `JsonB` goes through `serde_json`
//! both ways), a 1 KB payload cost a worker more than the rest of its command
//! (a drain of no-op commands with 1 KB args ran at half the speed of one
//! with `{}`, and a handler that returned its args at a quarter).

use pgrx::pg_sys;
use pgrx::{FromDatum, IntoDatum};

unsafe extern "C-unwind" {
    /// jsonb's output function, as fmgr calls it (pgrx's binding is a Rust wrapper).
    fn jsonb_out(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum;
}

/// A jsonb value: the bytes of its varlena (4-byte header, not compressed,
/// not toasted), owned by Rust, so it outlives the statement, memory context
/// or transaction it came from.
#[derive(Clone)]
pub struct Jsonb(Vec<u8>);

impl Jsonb {
    /// A copy in the current memory context, as a datum.
    pub fn to_datum(&self) -> pg_sys::Datum {
        // SAFETY: palloc'd (MAXALIGNed) memory of the varlena's own size
        unsafe {
            let copy = pg_sys::palloc(self.0.len()).cast::<u8>();
            std::ptr::copy_nonoverlapping(self.0.as_ptr(), copy, self.0.len());
            pg_sys::Datum::from(copy)
        }
    }

    /// Its size as JSON text: what flow.max_result_bytes limits (as the SQL
    /// side's `octet_length(value::text)`; the binary size cannot bound it:
    /// a number such as 1e1000 is a few bytes in jsonb).
    pub fn text_size(&self) -> usize {
        // SAFETY: jsonb_out of a valid jsonb datum returns a palloc'd C string
        unsafe {
            let datum = self.to_datum();
            let text = pg_sys::DirectFunctionCall1Coll(Some(jsonb_out), pg_sys::InvalidOid, datum);
            let size = std::ffi::CStr::from_ptr(text.cast_mut_ptr()).to_bytes().len();
            pg_sys::pfree(text.cast_mut_ptr());
            pg_sys::pfree(datum.cast_mut_ptr());
            size
        }
    }
}

impl FromDatum for Jsonb {
    unsafe fn from_polymorphic_datum(datum: pg_sys::Datum, is_null: bool, _: pg_sys::Oid) -> Option<Jsonb> {
        if is_null {
            return None;
        }
        let stored = datum.cast_mut_ptr::<pg_sys::varlena>();
        // a short-header, compressed or toasted value becomes a plain one (a
        // copy); a plain one is itself
        let plain = pg_sys::pg_detoast_datum(stored);
        let bytes = std::slice::from_raw_parts(plain.cast::<u8>(), pgrx::varlena::varsize(plain)).to_vec();
        if plain != stored {
            pg_sys::pfree(plain.cast());
        }
        Some(Jsonb(bytes))
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
