//! The record of the attempt a worker is in (engine rule 3: a crash, a kill
//! or a restart charges the attempt each worker was in, and nothing else).
//!
//! Before each handler starts, held or leased, the worker writes the command
//! and the number of its attempt to a small file of its own process,
//! `pg_flow/attempt.<slot>.<pid>.<backend start>` in the data directory, and
//! clears it once the attempt's transaction has ended. The file is mapped
//! into the worker's memory, so the record is a store of 20 bytes into the
//! page cache, not a system call per command (a `pwrite` per held handler
//! was 3-4 % of a no-op drain's CPU). It survives a backend crash and a
//! server crash, not an OS crash.
//!
//! A record found set in the file of a process that is gone was left by a
//! worker that stopped inside that attempt: the maintenance worker
//! concludes it as interrupted (`flow._conclude_record`, which changes
//! nothing if the command has moved on since) and removes the file. Until
//! then every claim leaves that command alone (`named_elsewhere`), so a
//! poison command is counted each time it takes a worker down; and recovery
//! gives the other commands a dead worker had leased back uncharged: they
//! never started an attempt (or had it rolled back with its chunk), and only
//! a record names one that did. After an OS crash an attempt that was in
//! progress may go uncounted; its writes were rolled back with its
//! transaction, and it runs again. (So may one whose worker was killed in
//! the middle of those 20 bytes: the mixed record names no attempt, and
//! concluding it changes nothing.)

use std::cell::Cell;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

/// Relative to the data directory (every backend's working directory).
const DIR: &str = "pg_flow";
const PREFIX: &str = "attempt.";
/// A command id (16 bytes) and the attempt's number (4, little-endian).
const SIZE: usize = 20;

thread_local! {
    /// This worker's record, mapped shared (writes land in the file's pages).
    static RECORD: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

/// Whose record a file is: the worker slot, and the process (pid and
/// backend start, TimestampTz µs) that wrote it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Writer {
    pub slot: usize,
    pub pid: i32,
    pub started: i64,
}

impl Writer {
    fn path(&self) -> String {
        format!("{DIR}/{PREFIX}{}.{}.{}", self.slot, self.pid, self.started)
    }

    fn parse(name: &str) -> Option<Writer> {
        let mut parts = name.strip_prefix(PREFIX)?.split('.');
        let writer = Writer {
            slot: parts.next()?.parse().ok()?,
            pid: parts.next()?.parse().ok()?,
            started: parts.next()?.parse().ok()?,
        };
        parts.next().is_none().then_some(writer)
    }

    /// This process, as worker `slot`.
    pub fn me(slot: usize) -> Writer {
        unsafe { Writer { slot, pid: pgrx::pg_sys::MyProcPid, started: pgrx::pg_sys::MyStartTimestamp } }
    }
}

/// An attempt a record names: the command and the attempt's number.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Recorded {
    pub command: [u8; 16],
    pub attempt: i32,
}

/// Create and map this worker process's record. Called once at start.
pub fn open(slot: usize) {
    let path = Writer::me(slot).path();
    let mapped = std::fs::create_dir_all(DIR)
        .and_then(|_| OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path))
        .and_then(|file| {
            file.set_len(SIZE as u64)?; // zeros: no attempt
            // SAFETY: a fresh shared mapping of the file's first SIZE bytes,
            // kept for the worker's life (the mapping outlives the descriptor)
            let at = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    SIZE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    0,
                )
            };
            if at == libc::MAP_FAILED {
                return Err(std::io::Error::last_os_error());
            }
            Ok(at.cast::<u8>())
        });
    match mapped {
        Ok(at) => RECORD.with(|r| r.set(at)),
        Err(e) => pgrx::error!("flow: cannot open {path}: {e}"),
    }
}

fn write_bytes(bytes: &[u8; SIZE]) {
    let at = RECORD.with(|r| r.get());
    assert!(!at.is_null(), "attempt_record::open was called");
    for (i, b) in bytes.iter().enumerate() {
        // SAFETY: `at` maps SIZE bytes; volatile, so the stores are made
        // here, before the handler is called, not moved past it
        unsafe { at.add(i).write_volatile(*b) };
    }
}

/// Record that the attempt `attempt` of `command` starts now.
pub fn write(command: &[u8; 16], attempt: i32) {
    let mut bytes = [0u8; SIZE];
    bytes[..16].copy_from_slice(command);
    bytes[16..].copy_from_slice(&attempt.to_le_bytes());
    write_bytes(&bytes);
}

/// The attempt is over: settled and committed, or rolled back with its
/// transaction (an error the worker caught).
pub fn clear() {
    write_bytes(&[0u8; SIZE]);
}

fn parse(bytes: &[u8]) -> Option<Recorded> {
    if bytes.len() < SIZE || bytes.iter().all(|b| *b == 0) {
        return None;
    }
    let command: [u8; 16] = bytes[..16].try_into().ok()?;
    let attempt = i32::from_le_bytes(bytes[16..SIZE].try_into().ok()?);
    Some(Recorded { command, attempt })
}

pub fn read(writer: &Writer) -> Option<Recorded> {
    let mut bytes = [0u8; SIZE];
    let file = File::open(writer.path()).ok()?;
    let n = file.read_at(&mut bytes, 0).ok()?;
    parse(&bytes[..n])
}

/// Every worker process that has a record file, and what its record names.
pub fn all() -> Vec<(Writer, Option<Recorded>)> {
    let Ok(entries) = std::fs::read_dir(DIR) else { return Vec::new() };
    entries
        .filter_map(|e| Writer::parse(e.ok()?.file_name().to_str()?))
        .map(|writer| (writer, read(&writer)))
        .collect()
}

/// The commands other worker processes' records name: in an attempt of a
/// live worker (locked anyway), or left by one that stopped and not
/// concluded yet. Claims leave them alone.
pub fn named_elsewhere(slot: usize) -> Vec<pgrx::Uuid> {
    let me = Writer::me(slot);
    all()
        .into_iter()
        .filter(|(writer, _)| *writer != me)
        .filter_map(|(_, recorded)| recorded)
        .map(|r| pgrx::Uuid::from_bytes(r.command))
        .collect()
}

/// Remove the record of a process that is gone, once what it named is concluded.
pub fn remove(writer: &Writer) {
    let _ = std::fs::remove_file(writer.path());
}

/// Every attempt a record names, of live workers and of gone ones not
/// concluded yet: what a cancel or a run's end counts of held attempts whose
/// worker is gone (flow._close_open_commands), which nothing else in the
/// database says started.
#[pgrx::pg_extern(volatile, parallel_unsafe)]
fn _recorded_attempts() -> pgrx::iter::TableIterator<'static, (pgrx::name!(command_id, pgrx::Uuid), pgrx::name!(attempt, i32))> {
    let named: Vec<(pgrx::Uuid, i32)> =
        all().into_iter().filter_map(|(_, r)| r).map(|r| (pgrx::Uuid::from_bytes(r.command), r.attempt)).collect();
    pgrx::iter::TableIterator::new(named)
}
