//! The record of the attempt a worker is in (engine rule 3: a crash, a kill
//! or a restart charges the attempt each worker was in, and nothing else).
//!
//! Before each handler starts, held or leased, the worker appends the command
//! and the number of its attempt to a small file of its own process,
//! `pg_flow/attempt.<slot>.<pid>.<backend start>` in the data directory, and
//! empties it once the transaction of those attempts has ended. So the
//! record names every attempt of the open transaction, the last one the
//! attempt the worker is in. The file is mapped into the worker's memory, so
//! a record is a store of 24 bytes into the page cache, not a system call
//! per command (a `pwrite` per held handler was 3-4 % of a no-op drain's
//! CPU). It survives a backend crash and a server crash, not an OS crash.
//!
//! A record found in the file of a process that is gone was left by a
//! worker that stopped inside its last attempt: the maintenance worker
//! concludes that one as interrupted (`flow._conclude_record`, which changes
//! nothing if the command has moved on since), voids the earlier ones (they
//! ended, but their settlements rolled back with the worker's transaction:
//! counted, not charged) and removes the file. Until then every claim leaves
//! those commands alone (`named_elsewhere`), so a poison command is counted
//! each time it takes a worker down; and recovery gives the other commands a
//! dead worker had leased back uncharged: they never started an attempt,
//! and only a record names one that did. After an OS crash an attempt that
//! was in progress may go uncounted; its writes were rolled back with its
//! transaction, and it runs again. (An entry is written before the count
//! that includes it, so a worker killed in the middle of one leaves it out:
//! its handler had not started.)

use std::cell::Cell;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

/// Relative to the data directory (every backend's working directory).
const DIR: &str = "pg_flow";
const PREFIX: &str = "attempt.";
/// The count of entries (4 bytes, little-endian), then the entries: a command
/// id (16 bytes) and the attempt's number (4, little-endian) each.
const COUNT: usize = 4;
const ENTRY: usize = 20;
/// Entries kept per transaction: a held chunk runs at most about 100 ms of
/// work (a no-op's chunk, about 1,000 commands). Past it the last entry is
/// overwritten: the attempt the worker is in is always named.
const CAPACITY: usize = 1024;
const SIZE: usize = COUNT + CAPACITY * ENTRY;

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
    crate::shmem::note_record_files_changed();
    match mapped {
        Ok(at) => RECORD.with(|r| r.set(at)),
        Err(e) => pgrx::error!("flow: cannot open {path}: {e}"),
    }
}

fn store(offset: usize, bytes: &[u8]) {
    let at = RECORD.with(|r| r.get());
    assert!(!at.is_null(), "attempt_record::open was called");
    assert!(offset + bytes.len() <= SIZE);
    for (i, b) in bytes.iter().enumerate() {
        // SAFETY: `at` maps SIZE bytes; volatile, so the stores are made
        // here, in this order, before the handler is called, not moved past it
        unsafe { at.add(offset + i).write_volatile(*b) };
    }
}

fn stored_count() -> usize {
    let at = RECORD.with(|r| r.get());
    assert!(!at.is_null(), "attempt_record::open was called");
    let mut bytes = [0u8; COUNT];
    for (i, b) in bytes.iter_mut().enumerate() {
        // SAFETY: as in `store`
        *b = unsafe { at.add(i).read_volatile() };
    }
    (u32::from_le_bytes(bytes) as usize).min(CAPACITY)
}

/// Record that the attempt `attempt` of `command` starts now, in the open transaction.
pub fn write(command: &[u8; 16], attempt: i32) {
    let count = stored_count();
    let mut entry = [0u8; ENTRY];
    entry[..16].copy_from_slice(command);
    entry[16..].copy_from_slice(&attempt.to_le_bytes());
    // the entry first, then the count that includes it
    store(COUNT + count.min(CAPACITY - 1) * ENTRY, &entry);
    if count < CAPACITY {
        store(0, &((count + 1) as u32).to_le_bytes());
    }
}

/// The transaction of the recorded attempts is over: committed, or rolled
/// back (an error the worker caught).
pub fn clear() {
    store(0, &[0u8; COUNT]);
}

fn parse(bytes: &[u8]) -> Vec<Recorded> {
    bytes
        .chunks_exact(ENTRY)
        .filter(|entry| entry.iter().any(|b| *b != 0))
        .map(|entry| Recorded {
            command: entry[..16].try_into().expect("16 bytes"),
            attempt: i32::from_le_bytes(entry[16..].try_into().expect("4 bytes")),
        })
        .collect()
}

/// What a writer's record names, in the order the attempts started (the
/// last: the attempt it is or was in); `last_only`: that one alone.
fn read_entries(writer: &Writer, last_only: bool) -> Vec<Recorded> {
    let Ok(file) = File::open(writer.path()) else { return Vec::new() };
    entries_read_by(|offset, into| file.read_at(into, offset as u64).ok(), last_only)
}

/// What a record names (see `read_entries`), its bytes read by `read`
/// (offset, buffer; how many it read, None on an error).
fn entries_read_by(read: impl Fn(usize, &mut [u8]) -> Option<usize>, last_only: bool) -> Vec<Recorded> {
    let mut count = [0u8; COUNT];
    if read(0, &mut count) != Some(COUNT) {
        return Vec::new();
    }
    let count = (u32::from_le_bytes(count) as usize).min(CAPACITY);
    let first = if last_only { count.saturating_sub(1) } else { 0 };
    let mut entries = vec![0u8; (count - first) * ENTRY];
    match read(COUNT + first * ENTRY, &mut entries) {
        Some(n) => parse(&entries[..n - n % ENTRY]),
        None => Vec::new(),
    }
}

/// Everything a writer's record names (see `read_entries`).
pub fn read(writer: &Writer) -> Vec<Recorded> {
    read_entries(writer, false)
}

/// Every worker process that has a record file.
pub fn writers() -> Vec<Writer> {
    let Ok(entries) = std::fs::read_dir(DIR) else { return Vec::new() };
    entries.filter_map(|e| Writer::parse(e.ok()?.file_name().to_str()?)).collect()
}

/// Every worker process that has a record file, and what its record names.
pub fn all() -> Vec<(Writer, Vec<Recorded>)> {
    writers().into_iter().map(|writer| (writer, read(&writer))).collect()
}

/// Whether a writer's process still exists (a pid reused since is taken
/// for the writer: its record then waits for the maintenance worker).
fn alive(writer: &Writer) -> bool {
    // SAFETY: signal 0 only checks that the process exists
    unsafe { libc::kill(writer.pid, 0) == 0 }
}

/// The commands other worker processes' records name: in an attempt of a
/// live worker (locked anyway), or left by one that stopped and not
/// concluded yet. Claims leave them alone.
///
/// Of a live worker only the attempt it is in: the earlier ones of its open
/// transaction are its own (held: locked; leased: running), and a held
/// chunk's can be a thousand, which every claim would then carry. Of a gone
/// one everything, until recovery has concluded or voided it.
///
/// Read twice per claim, so the other records stay mapped (see `Mapped`),
/// and are listed again only when a record file was made or removed since:
/// opening and reading every file each time was about 40 system calls a
/// claim, 0.1-0.2 ms of a slow command's 4 ms between its handlers.
pub fn named_elsewhere(slot: usize) -> Vec<pgrx::Uuid> {
    let generation = crate::shmem::record_files_generation();
    OTHERS.with(|others| {
        let mut others = others.borrow_mut();
        if others.0 != Some(generation) {
            let me = Writer::me(slot);
            let listed: Vec<Writer> = writers().into_iter().filter(|writer| *writer != me).collect();
            others.1.retain(|m| listed.contains(&m.writer));
            let mut complete = true;
            for writer in listed {
                if !others.1.iter().any(|m| m.writer == writer) {
                    match Mapped::new(writer) {
                        Some(mapped) => others.1.push(mapped),
                        None => complete = false, // (being made: list it again next time)
                    }
                }
            }
            others.0 = complete.then_some(generation);
        }
        others.1.iter().flat_map(|m| m.entries(alive(&m.writer))).map(|r| pgrx::Uuid::from_bytes(r.command)).collect()
    })
}

thread_local! {
    /// The other workers' records `named_elsewhere` reads, and the generation
    /// of the record files (shmem::record_files_generation) they were listed
    /// at (None: list them again).
    static OTHERS: std::cell::RefCell<(Option<u64>, Vec<Mapped>)> = const { std::cell::RefCell::new((None, Vec::new())) };
}

/// Another worker's record, mapped read-only: what it writes is read in place.
/// A removed file stays mapped until the next listing drops it.
struct Mapped {
    writer: Writer,
    at: *const u8,
}

impl Mapped {
    /// None if the file is gone, or not yet of its full size (a mapping past
    /// a file's end would fault when read).
    fn new(writer: Writer) -> Option<Mapped> {
        let file = File::open(writer.path()).ok()?;
        if file.metadata().ok()?.len() < SIZE as u64 {
            return None;
        }
        // SAFETY: a read-only shared mapping of the file's first SIZE bytes,
        // which exist; unmapped on drop
        let at =
            unsafe { libc::mmap(std::ptr::null_mut(), SIZE, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        (at != libc::MAP_FAILED).then(|| Mapped { writer, at: at.cast::<u8>() })
    }

    /// As `read_entries`.
    fn entries(&self, last_only: bool) -> Vec<Recorded> {
        entries_read_by(
            |offset, into| {
                for (i, b) in into.iter_mut().enumerate() {
                    // SAFETY: `at` maps SIZE bytes, and a record's reads stay
                    // within them; volatile: its writer changes them
                    *b = unsafe { self.at.add(offset + i).read_volatile() };
                }
                Some(into.len())
            },
            last_only,
        )
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: mapped by `new`, SIZE bytes
        unsafe { libc::munmap(self.at as *mut libc::c_void, SIZE) };
    }
}

/// Remove the record of a process that is gone, once what it named is concluded.
pub fn remove(writer: &Writer) {
    let _ = std::fs::remove_file(writer.path());
    crate::shmem::note_record_files_changed();
}

/// Every attempt a record names, of live workers and of gone ones not
/// concluded yet: what a cancel or a run's end counts of held attempts whose
/// worker is gone (flow._close_open_commands), which nothing else in the
/// database says started.
#[pgrx::pg_extern(volatile, parallel_unsafe)]
fn _recorded_attempts(
) -> pgrx::iter::TableIterator<'static, (pgrx::name!(command_id, pgrx::Uuid), pgrx::name!(attempt, i32))> {
    let named: Vec<(pgrx::Uuid, i32)> =
        all().into_iter().flat_map(|(_, r)| r).map(|r| (pgrx::Uuid::from_bytes(r.command), r.attempt)).collect();
    pgrx::iter::TableIterator::new(named)
}
