//! Claim: which due commands a worker takes, and how (engine rules 1-3).
//! `flow._claim` (sql/claim.sql) locks them; here its rows become `Claimed`
//! commands (read by column name), the leases of those not held are written
//! (`flow._lease`), a claim from several queues is put in round-robin order,
//! and `ClaimCursor` keeps where the claims of a backlog take up. Which
//! handlers' commands are held, run and settled in the claim's own
//! transaction, and how many of a slow handler's a claim may take ahead, is
//! learnt here too (`HANDLER_TIMES`).

use crate::ids;
use crate::payload::{Context, Jsonb};
use crate::spi::{
    engine_query, BOOL, INT2, INT2_ARRAY, INT4, INT8, JSONB, OID, OID_ARRAY, TEXT, TEXT_ARRAY, TID, TID_ARRAY,
    TIMESTAMPTZ, TIMESTAMPTZ_ARRAY, UUID, UUID_ARRAY,
};
use crate::{gateway, gucs, shmem, spi};
use pgrx::pg_sys::{self, PgOid};
use pgrx::prelude::*;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};

/// A command claimed by this worker, as `flow._claim` handed it out.
pub struct Claimed {
    pub command_id: pgrx::Uuid,
    pub run_id: pgrx::Uuid,
    pub lease_token: pgrx::Uuid,
    /// min(retry budget end, run deadline) as a PostgreSQL TimestampTz (µs).
    pub hard_deadline: Option<i64>,
    /// The definition's attempt timeout (µs), counted from the handler's start:
    /// a command claimed in a batch may start well after its claim.
    pub timeout_us: Option<i64>,
    pub handler: pg_sys::Oid,
    pub owner: pg_sys::Oid,
    /// The args, handed to the handler as the datum they were (see payload).
    pub args: Jsonb,
    /// Only for handlers that take a `flow.context` (see payload::Context).
    pub context: Option<Context>,
    /// The definition's args_type, if any: the args must still fit it.
    pub args_type: Option<pg_sys::Oid>,
    /// The number of the attempt it makes (what its attempt record names).
    pub attempt: i32,
    /// Its handler was known to be fast when it was claimed: it runs under a
    /// budget (src/execute.rs, FAST_BUDGET_US), held or in a leased batch.
    pub fast: bool,
    /// How long its handler's last attempt in this worker took, if it ran here.
    pub handler_took: Option<std::time::Duration>,
    /// Held, not leased (see flow._claim): the number of the attempt it makes,
    /// counted when it is settled in the claim's own transaction.
    pub held_attempt: Option<i32>,
    /// A held command's row, locked by the claim: where its settlement writes.
    pub row_at: Option<pg_sys::ItemPointerData>,
    /// Its queue, priority and due time: where it is in its queue's claim order (with its id).
    pub queue: String,
    pub priority: i16,
    pub due_at: TimestampWithTimeZone,
    /// Its group's hash (0: it has none). A grouped command's claims read its
    /// group from its head, and it moves no cursor (see flow._claim).
    pub group: i64,
    /// The attempt's deadline as the claim computed it (what a lease expires at).
    pub attempt_deadline: Option<TimestampWithTimeZone>,
}

/// What a settlement names: the command, and its lease or held attempt.
#[derive(Clone, Copy)]
pub struct AttemptId {
    pub command_id: pgrx::Uuid,
    pub lease_token: pgrx::Uuid,
    pub held_attempt: Option<i32>,
}

impl Claimed {
    pub fn id(&self) -> AttemptId {
        AttemptId { command_id: self.command_id, lease_token: self.lease_token, held_attempt: self.held_attempt }
    }

    /// The attempt's deadline for a handler starting at `now` (TimestampTz µs):
    /// its timeout (the definition's, else the statement_timeout its owner
    /// inherits), within `flow.max_attempt_timeout`, and its hard deadline.
    pub fn deadline(&self, now: i64) -> Option<i64> {
        let timeout = self.timeout_us.or_else(gateway::default_attempt_timeout_us);
        let timeout = match (timeout, gucs::max_attempt_timeout_us()) {
            (Some(t), Some(max)) => Some(t.min(max)),
            (t, max) => t.or(max),
        };
        let soft = timeout.map(|t| now.saturating_add(t));
        match (soft, self.hard_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// A handler whose last attempt in this worker finished within this long has
/// its next commands held: run and settled in the claim's transaction, one
/// write each and no commit before it starts. Others are leased, so a long
/// attempt shows as `running` while it runs (and the first attempt of a
/// handler, before anything is known of it, is leased too).
pub const FAST_HANDLER: std::time::Duration = std::time::Duration::from_millis(10);

thread_local! {
    /// How long each handler's last attempt in this worker took: the commands
    /// of those under FAST_HANDLER are held (see flow._claim), and a slow
    /// one's time says how many of its commands a claim may take ahead
    /// (keep_what_starts_now).
    static HANDLER_TIMES: RefCell<HashMap<u32, std::time::Duration>> = RefCell::new(HashMap::new());
}

pub fn note_handler_time(handler: pg_sys::Oid, took: std::time::Duration) {
    HANDLER_TIMES.with(|t| t.borrow_mut().insert(handler.to_u32(), took));
}

/// Where a claim ended in each queue and priority: the due time and id of
/// the last command it took there, in the claim's (next_run_at, id) order.
/// The next claim may start after it (see flow._claim).
#[derive(Default, Clone)]
pub struct ClaimCursor(Vec<(String, i16, TimestampWithTimeZone, pgrx::Uuid)>);

/// A command's place in its queue's claim order within its priority,
/// (next_run_at, id), as PostgreSQL compares it (uuids as their bytes).
pub(crate) fn claim_position(at: TimestampWithTimeZone, id: &pgrx::Uuid) -> (i64, [u8; 16]) {
    (at.into_inner(), *id.as_bytes())
}

impl ClaimCursor {
    fn advance(&mut self, queue: String, priority: i16, due_at: TimestampWithTimeZone, id: pgrx::Uuid) {
        match self.0.iter_mut().find(|(q, p, _, _)| *q == queue && *p == priority) {
            Some(last) if claim_position(last.2, &last.3) >= claim_position(due_at, &id) => {}
            Some(last) => (last.2, last.3) = (due_at, id),
            None => self.0.push((queue, priority, due_at, id)),
        }
    }

    /// Start at `command` (claimed, not run) in its queue, if it ends after it
    /// there: the end moves to just before it (the same due time, the id one less).
    pub fn rewind_to(&mut self, command: &Claimed) {
        let id = u128::from_be_bytes(*command.command_id.as_bytes()).saturating_sub(1);
        let before = pgrx::Uuid::from_bytes(id.to_be_bytes());
        let at = self.0.iter_mut().find(|(q, p, _, _)| *q == command.queue && *p == command.priority);
        if let Some(end) = at.filter(|_| command.group == 0) {
            if claim_position(end.2, &end.3) >= claim_position(command.due_at, &before) {
                (end.2, end.3) = (command.due_at, before);
            }
        }
    }

    /// Start after these ends too, where they are further on.
    pub fn take_up(&mut self, ends: Vec<shmem::End>) {
        for (queue, priority, due_at, id) in ends {
            if let Ok(due_at) = TimestampWithTimeZone::try_from(due_at) {
                self.advance(queue, priority, due_at, pgrx::Uuid::from_bytes(id));
            }
        }
    }

    /// Its ends, as `take_up` takes them.
    pub fn ends(&self) -> Vec<shmem::End> {
        self.0
            .iter()
            .map(|(queue, priority, at, id)| (queue.clone(), *priority, at.into_inner(), *id.as_bytes()))
            .collect()
    }

    /// The latest of its ends' due times (TimestampTz µs); None: no ends.
    /// Claims may take up from it while nothing was made due before this:
    /// a command made due before any end may be behind it. (By the earliest
    /// end, a cursor that ended in a queue long ago, the root's of a fan-out,
    /// kept its end in the children's queue past children made due again
    /// behind it: they waited a second.)
    pub fn latest(&self) -> Option<i64> {
        self.0.iter().map(|(_, _, at, _)| at.into_inner()).max()
    }

    /// As flow._claim and flow._next_due_ms take it: queues, priorities, due
    /// times and ids, one array each.
    #[allow(clippy::type_complexity)]
    pub(crate) fn columns(&self) -> (Vec<String>, Vec<i16>, Vec<TimestampWithTimeZone>, Vec<pgrx::Uuid>) {
        let mut columns = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (queue, priority, at, id) in &self.0 {
            columns.0.push(queue.clone());
            columns.1.push(*priority);
            columns.2.push(*at);
            columns.3.push(*id);
        }
        columns
    }
}

/// What a claim took (`claim`).
pub struct Claim {
    /// In claim order: held ones, which must run in this same transaction,
    /// and leased ones, whose leases commit with the claim.
    pub commands: Vec<Claimed>,
    /// Where the claim ended in each queue.
    pub ended_at: ClaimCursor,
    /// It interleaved several queues, or was one owner's turn of several:
    /// each queue gave no more than its share, so a claim short of its size
    /// may have left some due.
    pub interleaved: bool,
    /// It left commands it locked (see `one_slow_command_at_most`): more is due.
    pub left_some: bool,
}

/// The columns of the claim's statement, in its order, read by name.
#[derive(Clone, Copy)]
enum Col {
    CommandId = 1,
    RunId,
    Attempt,
    HardDeadlineUs,
    TimeoutUs,
    Handler,
    HandlerOwner,
    Args,
    ArgsType,
    Held,
    Context,
    Queue,
    DueAt,
    ClaimOrder,
    RowAt,
    AttemptDeadline,
    Priority,
    GroupHash,
}

/// The claim's statement: flow._claim's rows, with the two durations an
/// in-database worker needs as microseconds.
const CLAIM_SQL: &str = "SELECT command_id, run_id, attempt,
        (extract(epoch FROM hard_deadline) * 1000000)::bigint - 946684800000000,
        (extract(epoch FROM attempt_timeout) * 1000000)::bigint,
        handler, handler_owner, args, args_type::oid, held,
        context, queue, due_at, claim_order, row_at, deadline, priority, group_hash
 FROM flow._claim($1, NULL, $2, $3, $4, $5, $6, $7, $8, false, $9)";
/// The types of its columns (a composite: PgOid::Invalid), in Col's order.
const CLAIM_TYPES: [PgOid; 18] = [
    UUID,
    UUID,
    INT4,
    INT8,
    INT8,
    OID,
    OID,
    JSONB,
    OID,
    BOOL,
    PgOid::Invalid,
    TEXT,
    TIMESTAMPTZ,
    INT4,
    TID,
    TIMESTAMPTZ,
    INT2,
    INT8,
];

fn get<T: pgrx::FromDatum>(row: &spi::Row, col: Col) -> Option<T> {
    row.get(col as usize)
}

/// Commands this transaction locked and leases, with what their leases need.
#[derive(Default)]
struct ToLease {
    ids: Vec<pgrx::Uuid>,
    rows: Vec<pg_sys::ItemPointerData>,
    attempt_deadlines: Vec<Option<TimestampWithTimeZone>>,
}

/// Claim up to `max` due commands for this worker process (flow._claim), in
/// claim order: held ones, of the handlers known to be fast
/// (`HANDLER_TIMES`), which must run in this same transaction, and leased
/// ones, whose leases are written here too (flow._lease) and commit with the
/// claim. Commands named in `excluded`, and those of `busy_runs` (their locks
/// held by other workers' chunks), are left alone; the claim takes up after
/// `after`'s ends in their queues. Commands of handlers that may be slow
/// start now, one, or (`ahead`) as many as start within that long of the
/// claim (see keep_what_starts_now).
#[allow(clippy::too_many_arguments)]
pub fn claim(
    owner: &str,
    backend_start: Option<TimestampWithTimeZone>,
    max: i32,
    turn: i32,
    excluded: Vec<pgrx::Uuid>,
    busy_runs: Vec<pgrx::Uuid>,
    after: Option<&ClaimCursor>,
    recorded_elsewhere: &dyn Fn() -> Vec<pgrx::Uuid>,
    ahead: Option<std::time::Duration>,
) -> Claim {
    let (after_queues, after_priorities, after_at, after_ids) = after.map(ClaimCursor::columns).unwrap_or_default();
    let times = HANDLER_TIMES.with(|t| t.borrow().clone());
    let fast: Vec<pg_sys::Oid> =
        times.iter().filter(|(_, took)| **took < FAST_HANDLER).map(|(oid, _)| pg_sys::Oid::from(*oid)).collect();
    let (mut commands, to_lease, interleaved) = engine_query(
        CLAIM_SQL,
        &[INT4, INT4, OID_ARRAY, UUID_ARRAY, TEXT_ARRAY, INT2_ARRAY, TIMESTAMPTZ_ARRAY, UUID_ARRAY, UUID_ARRAY],
        &[
            max.into(),
            turn.into(),
            fast.clone().into(),
            excluded.into(),
            after_queues.into(),
            after_priorities.into(),
            after_at.into(),
            after_ids.into(),
            // (NULL when there are none: the claim's test of each command is then one of NULL)
            (!busy_runs.is_empty()).then_some(busy_runs).into(),
        ],
        |rows| {
            // A claim from one queue has no claim order (NULL): its rows come
            // in due order, and are run so. A claim from several queues (claim
            // order 0) is put in claim order here, not by the claim's
            // statement (into_round_robin).
            let mut interleaved = false;
            let mut to_lease = ToLease::default();
            let commands: Vec<Claimed> = spi::rows(rows, &CLAIM_TYPES, |row| {
                let command_id = get(row, Col::CommandId).expect("command_id");
                let queue: String = get(row, Col::Queue).expect("queue");
                let due_at: TimestampWithTimeZone = get(row, Col::DueAt).expect("due_at");
                interleaved |= get::<i32>(row, Col::ClaimOrder).is_some();
                let row_at: pg_sys::ItemPointerData = get(row, Col::RowAt).expect("row_at");
                let held: bool = get(row, Col::Held).expect("held");
                let attempt_deadline = get::<TimestampWithTimeZone>(row, Col::AttemptDeadline);
                if !held {
                    to_lease.ids.push(command_id);
                    to_lease.rows.push(row_at);
                    to_lease.attempt_deadlines.push(attempt_deadline);
                }
                let handler: pg_sys::Oid = get(row, Col::Handler).expect("handler");
                let handler_took = times.get(&handler.to_u32()).copied();
                Claimed {
                    command_id,
                    fast: held || handler_took.is_some_and(|took| took < FAST_HANDLER),
                    handler_took,
                    run_id: get(row, Col::RunId).expect("run_id"),
                    // (a held attempt's token never leaves the worker: it
                    // names the attempt, and no client presents it, so it need
                    // not be unguessable as a lease's: a time-ordered id does;
                    // a leased one's is its lease's, below)
                    lease_token: if held { ids::_new_id() } else { pgrx::Uuid::from_bytes([0; 16]) },
                    hard_deadline: get(row, Col::HardDeadlineUs),
                    timeout_us: get(row, Col::TimeoutUs),
                    handler,
                    owner: get(row, Col::HandlerOwner).expect("handler_owner"),
                    args: get(row, Col::Args).expect("args"),
                    args_type: get(row, Col::ArgsType),
                    attempt: get(row, Col::Attempt).expect("attempt"),
                    held_attempt: held.then(|| get(row, Col::Attempt).expect("attempt")),
                    context: get(row, Col::Context),
                    queue,
                    priority: get(row, Col::Priority).unwrap_or(0),
                    group: get(row, Col::GroupHash).unwrap_or(0),
                    due_at,
                    row_at: held.then_some(row_at),
                    attempt_deadline,
                }
            });
            (commands, to_lease, interleaved)
        },
    );
    let claimed = commands.len();
    let to_lease = keep_what_starts_now(&mut commands, to_lease, &recorded_elsewhere, ahead);
    let left_some = commands.len() < claimed;
    // (where the commands kept end: those left are claimed again)
    let mut ended_at = ClaimCursor::default();
    for command in commands.iter().filter(|c| c.group == 0) {
        ended_at.advance(command.queue.clone(), command.priority, command.due_at, command.command_id);
    }
    if !to_lease.ids.is_empty() {
        let tokens = lease(owner, backend_start, to_lease);
        // (each leased command's row is locked by this transaction: every
        // lease is written; one that was not would not run)
        commands.retain_mut(|command| {
            command.held_attempt.is_some()
                || tokens.get(command.command_id.as_bytes()).map(|token| command.lease_token = *token).is_some()
        });
    }
    if interleaved {
        into_round_robin(&mut commands, turn);
    }
    Claim { commands, ended_at, interleaved, left_some }
}

/// Keep, of the commands a claim locked, those that start now:
/// - none that another worker's attempt record names (`recorded_elsewhere`,
///   read again now that the rows are locked: a worker that wrote its record
///   after the claim read the records, then died in that attempt, unlocked
///   the command, and only its record says that attempt started);
/// - held commands, and leased ones of handlers known to be fast (commands
///   of limited queues, run in batches);
/// - of the others, the first only: a handler that may be slow runs one
///   command per claim, so a burst of slow commands spreads over the idle
///   workers instead of queueing behind one (the reference's "claim only
///   what can start now"). When no other worker is idle (`ahead`), those
///   after it too that start within `ahead` of the claim by their handlers'
///   last times here (none after a handler of unknown time): each later
///   command of 50 ms handlers at 8 busy workers cost its own claim's
///   transaction, some 0.7 ms of each 52 ms cycle.
///
/// The rest stay locked until the claim's transaction ends and are due again
/// then: its commit wakes the workers, whose claims start from where they
/// are. Returns the leases to write.
fn keep_what_starts_now(
    commands: &mut Vec<Claimed>,
    to_lease: ToLease,
    recorded_elsewhere: &dyn Fn() -> Vec<pgrx::Uuid>,
    ahead: Option<std::time::Duration>,
) -> ToLease {
    if commands.is_empty() {
        return to_lease;
    }
    let recorded: HashSet<[u8; 16]> = recorded_elsewhere().iter().map(|id| *id.as_bytes()).collect();
    // when the next slow command kept would start, after those kept before it
    let mut slow_start: Option<std::time::Duration> = None;
    let mut starts_now = |c: &Claimed| {
        let starts_at = slow_start.unwrap_or_default();
        let kept = slow_start.is_none() || ahead.is_some_and(|ahead| starts_at < ahead);
        if kept {
            slow_start = Some(starts_at.saturating_add(c.handler_took.unwrap_or(std::time::Duration::MAX)));
        }
        kept
    };
    let keep: HashSet<[u8; 16]> = commands
        .iter()
        .filter(|c| !recorded.contains(c.command_id.as_bytes()))
        .filter(|c| c.fast || starts_now(c))
        .map(|c| *c.command_id.as_bytes())
        .collect();
    if keep.len() == commands.len() {
        return to_lease;
    }
    let left = commands.iter().filter(|c| !keep.contains(c.command_id.as_bytes()));
    // (a microsecond before: cursors that ended at that very time, on the
    // commands of the same enqueue_many, may have passed these by id)
    if let Some(earliest) = left.map(|c| c.due_at.into_inner()).min() {
        shmem::wake_at_commit(earliest - 1);
    }
    commands.retain(|c| keep.contains(c.command_id.as_bytes()));
    let mut kept = ToLease::default();
    for ((id, row), deadline) in to_lease.ids.into_iter().zip(to_lease.rows).zip(to_lease.attempt_deadlines) {
        if keep.contains(id.as_bytes()) {
            kept.ids.push(id);
            kept.rows.push(row);
            kept.attempt_deadlines.push(deadline);
        }
    }
    kept
}

/// Lease, in the claim's transaction, held commands this worker will not run
/// in it: those of other owners than the one whose handlers the claim's
/// chunk runs (a transaction never holds two owners' handlers). They run
/// later, leased, in chunks of their own owner's.
pub fn lease_instead(
    owner: &str,
    backend_start: Option<TimestampWithTimeZone>,
    mut held: Vec<Claimed>,
) -> Vec<Claimed> {
    if held.is_empty() {
        return held;
    }
    let to_lease = ToLease {
        ids: held.iter().map(|c| c.command_id).collect(),
        rows: held.iter().map(|c| c.row_at.expect("a held command has its row")).collect(),
        attempt_deadlines: held.iter().map(|c| c.attempt_deadline).collect(),
    };
    let tokens = lease(owner, backend_start, to_lease);
    // (each row is locked by this transaction: every lease is written)
    held.retain_mut(|command| {
        let token = tokens.get(command.command_id.as_bytes());
        if let Some(token) = token {
            (command.lease_token, command.held_attempt, command.row_at) = (*token, None, None);
        }
        token.is_some()
    });
    held
}

/// Write the leases of commands this transaction's claim locked and does not
/// hold (flow._lease): their ids, rows and attempt deadlines. Returns each
/// one's lease token.
fn lease(
    owner: &str,
    backend_start: Option<TimestampWithTimeZone>,
    ToLease { ids, rows: row_ats, attempt_deadlines: deadlines }: ToLease,
) -> HashMap<[u8; 16], pgrx::Uuid> {
    engine_query(
        "SELECT command_id, lease_token FROM flow._lease($1, $2, $3, NULL, $4, $5, $6)",
        &[TEXT, INT4, TIMESTAMPTZ, UUID_ARRAY, TID_ARRAY, TIMESTAMPTZ_ARRAY],
        &[
            owner.into(),
            unsafe { pg_sys::MyProcPid }.into(),
            backend_start.into(),
            ids.into(),
            row_ats.into(),
            deadlines.into(),
        ],
        |rows| {
            spi::rows(rows, &[UUID, UUID], |row| {
                let id: pgrx::Uuid = row.get(1).expect("command_id");
                (*id.as_bytes(), row.get(2).expect("lease_token"))
            })
            .into_iter()
            .collect()
        },
    )
}

/// A claim from several queues in the order a worker runs it: round-robin
/// (each queue's first command, then each one's second, and so on), every
/// queue's commands in priority and due order, the queues in name order from the one whose
/// turn the claim is (flow._claim gives each queue its share by the same
/// turn). Ordered here, not by the claim's statement: a window and a sort
/// there copied every claimed row, args and context included, twice more (a
/// drain of two busy queues ran 0.91-0.92x a drain of one; 0.97x now).
fn into_round_robin(claimed: &mut Vec<Claimed>, turn: i32) {
    let due = |command: &Claimed| (command.priority, command.due_at.into_inner(), *command.command_id.as_bytes());
    claimed.sort_by(|a, b| a.queue.cmp(&b.queue).then_with(|| due(a).cmp(&due(b))));
    // each command's queue's place in name order, and its rank in that queue
    let mut places: Vec<(i64, usize)> = Vec::with_capacity(claimed.len());
    for (i, command) in claimed.iter().enumerate() {
        places.push(match places.last() {
            Some(&(lane, rank)) if command.queue == claimed[i - 1].queue => (lane, rank + 1),
            Some(&(lane, _)) => (lane + 1, 0),
            None => (0, 0),
        });
    }
    let lanes = places.last().map_or(1, |&(lane, _)| lane + 1);
    let mut ranked: Vec<((usize, i64), Claimed)> = places
        .into_iter()
        .zip(claimed.drain(..))
        .map(|((lane, rank), command)| ((rank, (lane - turn as i64).rem_euclid(lanes)), command))
        .collect();
    ranked.sort_by_key(|(key, _)| *key);
    claimed.extend(ranked.into_iter().map(|(_, command)| command));
}
