//! The record of the held attempt a worker is in (engine rule 3 for held
//! commands; see flow._claim).
//!
//! A held command is locked, run and settled in one transaction, so nothing
//! in the database says that its attempt started: if the handler takes the
//! backend down (a crash, a FATAL, the worker stopped past its deadline),
//! the transaction rolls back and the attempt would go uncounted, and a
//! poison command would loop forever. So before each held handler starts,
//! the worker writes the command and the number of its attempt to a small
//! file of its own, `pg_flow/held_attempt.<worker>` in the data directory,
//! and clears it once its transaction has ended.
//!
//! A record that is found set was left by a worker that stopped inside that
//! attempt: the worker's next incarnation (the same slot, restarted by the
//! postmaster) concludes it as interrupted, through flow._settle_failure,
//! which changes nothing if the command has moved on since. Until then every
//! other worker's claim leaves that command alone (`held_elsewhere`), so a
//! poison command is counted each time it takes a worker down.
//!
//! The file is mapped into the worker's memory, so the record is a store of
//! 20 bytes into the page cache, not a system call per command (a `pwrite`
//! per held handler was 3-4 % of a no-op drain's CPU). It survives a backend
//! crash and a server crash, not an OS crash: after an OS crash an attempt
//! that was in progress may go uncounted; its writes were rolled back with
//! its transaction, and it runs again. (So may one whose worker was killed
//! in the middle of those 20 bytes: the mixed record names no attempt, and
//! concluding it changes nothing.)

use std::cell::Cell;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

/// Relative to the data directory (every backend's working directory).
const DIR: &str = "pg_flow";
const PREFIX: &str = "held_attempt.";
/// A command id (16 bytes) and the attempt's number (4, little-endian).
const SIZE: usize = 20;

thread_local! {
    /// This worker's record, mapped shared (writes land in the file's pages).
    static RECORD: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

fn path(slot: usize) -> String {
    format!("{DIR}/{PREFIX}{slot}")
}

/// Open and map this worker's record (created if missing). Called once at start.
pub fn open(slot: usize) {
    let mapped = std::fs::create_dir_all(DIR)
        .and_then(|_| OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path(slot)))
        .and_then(|file| {
            if file.metadata()?.len() < SIZE as u64 {
                file.set_len(SIZE as u64)?; // zeros: no attempt
            }
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
        Err(e) => pgrx::error!("flow: cannot open {}: {e}", path(slot)),
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

/// Record that the held attempt `attempt` of `command` starts now.
pub fn write(command: &[u8; 16], attempt: i32) {
    let mut bytes = [0u8; SIZE];
    bytes[..16].copy_from_slice(command);
    bytes[16..].copy_from_slice(&attempt.to_le_bytes());
    write_bytes(&bytes);
}

/// The held attempts are over: settled and committed, or rolled back with
/// their transaction (an error the worker caught).
pub fn clear() {
    write_bytes(&[0u8; SIZE]);
}

fn parse(bytes: &[u8]) -> Option<([u8; 16], i32)> {
    if bytes.len() < SIZE || bytes.iter().all(|b| *b == 0) {
        return None;
    }
    let id: [u8; 16] = bytes[..16].try_into().ok()?;
    let attempt = i32::from_le_bytes(bytes[16..SIZE].try_into().ok()?);
    Some((id, attempt))
}

fn read_path(path: &str) -> Option<([u8; 16], i32)> {
    let mut bytes = [0u8; SIZE];
    let file = File::open(path).ok()?;
    let n = file.read_at(&mut bytes, 0).ok()?;
    parse(&bytes[..n])
}

/// The record this worker's slot holds (left by its previous incarnation).
pub fn left_behind(slot: usize) -> Option<([u8; 16], i32)> {
    read_path(&path(slot))
}

/// Records of slots no worker runs (flow.workers was lowered), with their
/// slot numbers.
pub fn orphans(workers: usize) -> Vec<(usize, ([u8; 16], i32))> {
    slots()
        .into_iter()
        .filter(|slot| *slot >= workers)
        .filter_map(|slot| read_path(&path(slot)).map(|record| (slot, record)))
        .collect()
}

/// Remove the record of a slot no worker runs.
pub fn remove(slot: usize) {
    let _ = std::fs::remove_file(path(slot));
}

fn slots() -> Vec<usize> {
    let Ok(entries) = std::fs::read_dir(DIR) else { return Vec::new() };
    entries.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix(PREFIX)?.parse().ok()).collect()
}

/// The commands other workers' records name: in an attempt of a live worker
/// (locked anyway), or left by one that stopped and not concluded yet.
pub fn held_elsewhere(slot: usize) -> Vec<pgrx::Uuid> {
    slots()
        .into_iter()
        .filter(|s| *s != slot)
        .filter_map(|s| read_path(&path(s)))
        .map(|(id, _)| pgrx::Uuid::from_bytes(id))
        .collect()
}
