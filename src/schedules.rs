//! Schedules' times: which instants a cron expression names in an IANA time
//! zone, and which of a schedule's due ticks the maintenance worker fires
//! (sql/schedules.sql, flow._fire_schedules). Cron is parsed by `croner`
//! (5 fields, or 6 with a leading seconds field, or an @-nickname; its DST
//! rules: a wall-clock time a spring-forward skips runs at the first instant
//! after the gap, one a fall-back repeats runs once), zones come from
//! `chrono-tz` (the IANA database, compiled in).

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds, Year};
use croner::Cron;
use pgrx::datum::TimestampWithTimeZone;
use pgrx::prelude::*;
use std::collections::VecDeque;

/// Seconds from the Unix epoch to PostgreSQL's (2000-01-01).
const PG_EPOCH_UNIX_SECONDS: i64 = 946_684_800;
/// The most ticks one call looks at: a schedule of every second that was
/// stopped for a day has 86,400 missed ticks, about 40 ms of croner's time.
const MAX_TICKS_SEEN: usize = 1_000_000;

fn parse_cron(cron: &str) -> Result<Cron, String> {
    let fields = cron.split_whitespace().count();
    if !cron.trim_start().starts_with('@') && !(5..=6).contains(&fields) {
        return Err(format!("a cron expression has 5 fields (6 with seconds first), got {fields}"));
    }
    CronParser::builder()
        .seconds(Seconds::Optional)
        .year(Year::Disallowed)
        .build()
        .parse(cron)
        .map_err(|e| e.to_string())
}

fn parse_zone(timezone: &str) -> Result<Tz, String> {
    timezone.parse::<Tz>().map_err(|_| format!("unknown time zone {timezone:?} (an IANA name, such as Europe/Paris)"))
}

fn to_zoned(at: TimestampWithTimeZone, zone: Tz) -> Option<DateTime<Tz>> {
    let micros = at.into_inner();
    let unix = micros.div_euclid(1_000_000) + PG_EPOCH_UNIX_SECONDS;
    let nanos = (micros.rem_euclid(1_000_000) * 1_000) as u32;
    Some(DateTime::<Utc>::from_timestamp(unix, nanos)?.with_timezone(&zone))
}

fn to_pg(at: &DateTime<Tz>) -> Option<TimestampWithTimeZone> {
    let micros =
        (at.timestamp() - PG_EPOCH_UNIX_SECONDS).checked_mul(1_000_000)? + i64::from(at.timestamp_subsec_micros());
    crate::spans::timestamp_from_pg(micros)
}

/// What is wrong with a schedule's cron expression or time zone: NULL when
/// nothing is, else 'cron: <why>' or 'timezone: <why>' (flow._schedule
/// raises FL022 or FL023 with it).
#[pg_extern(stable, parallel_safe)]
fn _schedule_problem(cron: Option<&str>, timezone: Option<&str>) -> Option<String> {
    let Some(cron) = cron else { return Some("cron: must not be NULL".into()) };
    let Some(timezone) = timezone else { return Some("timezone: must not be NULL".into()) };
    if let Err(why) = parse_cron(cron) {
        return Some(format!("cron: {why}"));
    }
    if let Err(why) = parse_zone(timezone) {
        return Some(format!("timezone: {why}"));
    }
    // (a pattern no date matches, such as 30 February, has no next tick)
    let now = crate::spans::timestamp_from_pg(unsafe { pgrx::pg_sys::GetCurrentTransactionStartTimestamp() })?;
    if next_tick(cron, timezone, now).is_none() {
        return Some(format!("cron: {cron:?} names no time"));
    }
    None
}

/// The first tick of `cron` in `timezone` after `after`; NULL when there is
/// none or the expression is not valid (never raises: see _schedule_problem).
#[pg_extern(immutable, strict, parallel_safe, name = "_cron_next")]
fn next_tick(cron: &str, timezone: &str, after: TimestampWithTimeZone) -> Option<TimestampWithTimeZone> {
    let (cron, zone) = (parse_cron(cron).ok()?, parse_zone(timezone).ok()?);
    to_pg(&cron.find_next_occurrence(&to_zoned(after, zone)?, false).ok()?)
}

/// Which of a schedule's ticks from `next_tick` (its first unfired one) up to
/// `until` (now, or a little after: ticks are enqueued ahead of their time,
/// see flow._fire_schedules) to fire. A tick is missed when it passed while the maintenance
/// worker was not running (before `started`) or more than `grace` ago (a
/// restore of an old dump): of those, the last `catch_up` fire and the others
/// are skipped. Every other due tick fires, however late. Returns the ticks
/// to fire, in order (at most `max_fire`), how many were skipped, and the
/// schedule's next unfired tick.
#[pg_extern(immutable, parallel_safe)]
fn _schedule_due(
    cron: &str,
    timezone: &str,
    next_tick: TimestampWithTimeZone,
    started: TimestampWithTimeZone,
    now: TimestampWithTimeZone,
    until: TimestampWithTimeZone,
    grace_s: i64,
    catch_up: i32,
    max_fire: i32,
) -> TableIterator<
    'static,
    (name!(fire, Vec<TimestampWithTimeZone>), name!(skipped, i64), name!(next_tick, Option<TimestampWithTimeZone>)),
> {
    let nothing = || TableIterator::once((Vec::new(), 0, None));
    let (Ok(pattern), Ok(zone)) = (parse_cron(cron), parse_zone(timezone)) else { return nothing() };
    let (Some(first), Some(until_z)) = (to_zoned(next_tick, zone), to_zoned(until, zone)) else { return nothing() };
    let missed_before = started.into_inner().max(now.into_inner() - grace_s.saturating_mul(1_000_000));
    let mut missed: VecDeque<DateTime<Tz>> = VecDeque::new();
    let mut skipped = 0i64;
    let mut fire: Vec<DateTime<Tz>> = Vec::new();
    let keep = catch_up.max(0) as usize;
    let max_fire = max_fire.max(1) as usize;
    // (next_tick is itself a tick: the one the last round left unfired)
    let mut tick = pattern.find_next_occurrence(&first, true).ok();
    let mut seen = 0;
    while let Some(at) = tick.filter(|t| *t <= until_z && seen < MAX_TICKS_SEEN) {
        let was_missed = to_pg(&at).is_some_and(|t| t.into_inner() < missed_before);
        // (the budget stops only at a tick to fire: the missed are all looked at,
        // so the last `catch_up` of them are the ones fired)
        if !was_missed && missed.len() + fire.len() >= max_fire {
            break;
        }
        seen += 1;
        if was_missed {
            missed.push_back(at);
            if missed.len() > keep {
                missed.pop_front();
                skipped += 1;
            }
        } else {
            fire.push(at);
        }
        tick = pattern.find_next_occurrence(&at, false).ok();
    }
    if seen == MAX_TICKS_SEEN {
        // (stopped for longer than the walk: go on from then)
        tick = pattern.find_next_occurrence(&until_z, false).ok();
    }
    missed.extend(fire);
    let fire = missed.iter().filter_map(to_pg).collect();
    TableIterator::once((fire, skipped, tick.as_ref().and_then(to_pg)))
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use super::*;

    #[pg_test]
    fn cron_takes_five_or_six_fields_and_nicknames() {
        assert!(parse_cron("*/5 * * * *").is_ok());
        assert!(parse_cron("*/5 * * * * *").is_ok());
        assert!(parse_cron("@hourly").is_ok());
        assert!(parse_cron("* * * *").is_err());
        assert!(parse_cron("0 0 0 1 1 * 2030").is_err());
        assert!(parse_zone("Europe/Paris").is_ok());
        assert!(parse_zone("Mars/Olympus").is_err());
    }
}
