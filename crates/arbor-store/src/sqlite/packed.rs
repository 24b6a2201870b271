//! A conversation's events as the SQLite store keeps them: each row holds a
//! run of consecutive events of one conversation (`seq` to `last_seq`), in
//! one text column.
//!
//! A turn emits about seven events (turn started, the user's message, the
//! model call's start and end, the answer, `done`), and the event writer
//! stores them in one or two batches. One row per event cost ~14,000
//! instructions each on the writer — the statement, the foreign key's
//! lookup of the conversation, the row, the conversation's index entry —
//! about a tenth of a turn (bench/profile.md). A row per run costs that
//! once, whatever the run's length.
//!
//! The body is text an operator can still read in the `sqlite3` shell: per
//! event a header, `created_at name turn_len data_len:` (lengths in bytes,
//! `turn_len` -1 for an event of no turn), then the turn id and the JSON
//! payload, exactly as given. Migration 10 writes the same format in SQL.

use std::sync::Arc;

use arbor_core::{Event, EventName};

use crate::{StoreError, StoreResult};

/// Runs of a batch: events of one conversation with consecutive numbers, in
/// the batch's order within each conversation. Each run is a range of
/// `events` through `order` (indices into `events`).
pub(super) struct Runs<'a> {
    events: &'a [Event],
    order: Vec<usize>,
    at: usize,
}

impl<'a> Runs<'a> {
    pub(super) fn new(events: &'a [Event]) -> Runs<'a> {
        let mut order: Vec<usize> = (0..events.len()).collect();
        // Usually a batch is one conversation's; otherwise group them,
        // keeping each conversation's events in the order they came.
        let first = events.first().map(|event| &event.conversation_id);
        if events.iter().any(|event| Some(&event.conversation_id) != first) {
            order.sort_by(|&a, &b| events[a].conversation_id.cmp(&events[b].conversation_id));
        }
        Runs { events, order, at: 0 }
    }
}

impl<'a> Iterator for Runs<'a> {
    type Item = Vec<&'a Event>;

    fn next(&mut self) -> Option<Vec<&'a Event>> {
        let start = *self.order.get(self.at)?;
        let mut run = vec![&self.events[start]];
        self.at += 1;
        while let Some(&index) = self.order.get(self.at) {
            let (last, event) = (run[run.len() - 1], &self.events[index]);
            if event.conversation_id != last.conversation_id || Some(event.seq) != last.seq.checked_add(1) {
                break;
            }
            run.push(event);
            self.at += 1;
        }
        Some(run)
    }
}

/// Writes a run's body into `body` (cleared first).
///
/// The numbers go through `itoa` rather than `write!`: formatting machinery
/// made this ~9,400 instructions for a turn's usual run of five events,
/// as much as a row's insert saved (callgrind).
pub(super) fn encode(run: &[&Event], body: &mut String) {
    // A header is at most ~60 bytes (a time, a name, two lengths); the
    // reservation need only be close.
    const HEADER: usize = 48;
    body.clear();
    let size: usize =
        run.iter().map(|event| HEADER + event.turn_id.as_ref().map_or(0, |turn| turn.len()) + event.data.len()).sum();
    body.reserve(size);
    let mut number = itoa::Buffer::new();
    for event in run {
        body.push_str(number.format(event.created_at));
        body.push(' ');
        body.push_str(event.name.as_str());
        body.push(' ');
        body.push_str(match &event.turn_id {
            Some(turn) => number.format(turn.len()),
            None => "-1",
        });
        body.push(' ');
        body.push_str(number.format(event.data.len()));
        body.push(':');
        if let Some(turn) = &event.turn_id {
            body.push_str(turn);
        }
        body.push_str(&event.data);
    }
}

/// Appends the events of a row (numbered from `first`) with `seq > after`
/// to `out`, until it holds `limit`.
pub(super) fn decode(
    conversation_id: &Arc<str>,
    first: i64,
    last: i64,
    body: &str,
    after: i64,
    limit: usize,
    out: &mut Vec<Event>,
) -> StoreResult<()> {
    let broken =
        |what: &str| StoreError::Database(format!("stored events {first}..={last} of {conversation_id}: {what}"));
    let mut rest = body;
    let mut seq = first;
    let mut turn: Option<Arc<str>> = None;
    while !rest.is_empty() {
        let (header, tail) = rest.split_once(':').ok_or_else(|| broken("a header without its end"))?;
        let mut fields = header.split(' ');
        let mut field = || fields.next().ok_or_else(|| broken("a header with a field missing"));
        let created_at: i64 = field()?.parse().map_err(|_| broken("a bad time"))?;
        let name = field()?;
        let name = EventName::parse(name).ok_or_else(|| broken(&format!("an unknown event {name:?}")))?;
        let turn_len: i64 = field()?.parse().map_err(|_| broken("a bad turn length"))?;
        let data_len: usize = field()?.parse().map_err(|_| broken("a bad payload length"))?;
        let turn_len = usize::try_from(turn_len).ok();
        let (turn_id, tail) = match turn_len {
            Some(length) => {
                let id = tail.get(..length).ok_or_else(|| broken("a turn id cut short"))?;
                (Some(id), &tail[length..])
            }
            None => (None, tail),
        };
        let data = tail.get(..data_len).ok_or_else(|| broken("a payload cut short"))?;
        rest = &tail[data_len..];
        if seq > after {
            if out.len() >= limit {
                return Ok(());
            }
            // A run's events mostly share one turn: one allocation for it.
            let turn_id = turn_id.map(|id| match &turn {
                Some(shared) if **shared == *id => shared.clone(),
                _ => turn.insert(Arc::from(id)).clone(),
            });
            out.push(Event {
                seq,
                conversation_id: conversation_id.clone(),
                turn_id,
                name,
                data: Arc::from(data),
                created_at,
            });
        }
        seq += 1;
    }
    if seq != last + 1 {
        return Err(broken(&format!("{} events where the row says {}", seq - first, last - first + 1)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(conversation: &str, seq: i64, turn: Option<&str>, name: EventName, data: &str) -> Event {
        Event {
            seq,
            conversation_id: Arc::from(conversation),
            turn_id: turn.map(Arc::from),
            name,
            data: Arc::from(data),
            created_at: 1_733_000_000_000 + seq,
        }
    }

    fn round_trip(events: &[Event], after: i64, limit: usize) -> Vec<Event> {
        let run: Vec<&Event> = events.iter().collect();
        let mut body = String::new();
        encode(&run, &mut body);
        let mut out = Vec::new();
        let conversation = events[0].conversation_id.clone();
        let (first, last) = (events[0].seq, events[events.len() - 1].seq);
        decode(&conversation, first, last, &body, after, limit, &mut out).expect("decodes");
        out
    }

    #[test]
    fn events_come_back_as_given() {
        // Payloads with the header's own characters, multi-byte text, an
        // empty payload, events of no turn and of two turns.
        let events = [
            event("c", 4, Some("t-1"), EventName::TurnStarted, r#"{"a": "1 2:3"}"#),
            event("c", 5, None, EventName::HeadMoved, "{}"),
            event("c", 6, Some("t-1"), EventName::Delta, "{\"text\":\"é: \\n 9 9\"}"),
            event("c", 7, Some("t-2"), EventName::Done, ""),
            event("c", 8, Some(""), EventName::Error, "null"),
        ];
        assert_eq!(round_trip(&events, 0, 100), events);
        assert_eq!(round_trip(&events, 5, 100), events[2..]);
        assert_eq!(round_trip(&events, 4, 2), events[1..3]);
        assert!(round_trip(&events, 8, 100).is_empty());
    }

    #[test]
    fn a_damaged_body_is_an_error_not_a_guess() {
        let events = [event("c", 1, Some("t"), EventName::Delta, r#"{"text":"hi"}"#)];
        let mut body = String::new();
        encode(&[&events[0]], &mut body);
        let conversation: Arc<str> = Arc::from("c");
        let mut out = Vec::new();
        for bad in [&body[..body.len() - 1], "1 delta 1 2", "x delta -1 2:{}", "1 nope -1 2:{}", "1 delta -1 9:{}"] {
            let result = decode(&conversation, 1, 1, bad, 0, 10, &mut out);
            assert!(result.is_err(), "{bad:?} read as {out:?}");
        }
        // The count must match the row's numbers.
        assert!(decode(&conversation, 1, 2, &body, 0, 10, &mut out).is_err());
    }

    #[test]
    fn runs_split_by_conversation_and_by_gaps_in_order() {
        let events = [
            event("b", 1, None, EventName::Delta, "{}"),
            event("a", 7, None, EventName::Delta, "{}"),
            event("b", 2, None, EventName::Delta, "{}"),
            event("a", 8, None, EventName::Delta, "{}"),
            event("b", 4, None, EventName::Delta, "{}"),
            event("b", 3, None, EventName::Delta, "{}"),
        ];
        let runs: Vec<Vec<(String, i64)>> = Runs::new(&events)
            .map(|run| run.iter().map(|event| (event.conversation_id.to_string(), event.seq)).collect())
            .collect();
        let expected: Vec<Vec<(String, i64)>> = vec![
            vec![("a".into(), 7), ("a".into(), 8)],
            vec![("b".into(), 1), ("b".into(), 2)],
            vec![("b".into(), 4)],
            vec![("b".into(), 3)],
        ];
        assert_eq!(runs, expected);
    }
}
