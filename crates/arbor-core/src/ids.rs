//! Ids and timestamps. Only the engine calls these, so that every id and time
//! in the store was made in one place; stores and handlers keep what they get.

use std::time::{SystemTime, UNIX_EPOCH};

use time::OffsetDateTime;

/// A new time-ordered id (UUID v7, hyphenated). Used for conversations,
/// turns, users, keys, api calls and generated message ids. Its random bits
/// come from a thread-local CSPRNG seeded by the OS (uuid's `fast-rng`,
/// i.e. rand's `ThreadRng`), not from a `getrandom` system call per id.
/// Ids are not secrets; API keys draw their own 32 random bytes.
pub fn new_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

/// Milliseconds since the Unix epoch, the form timestamps are stored in.
pub type Millis = i64;

/// Now, from the system clock (negative before 1970). Read as a duration
/// since the epoch: the time crate's `now_utc` works out the calendar date
/// first, which cost ~200 instructions more a call, and a turn takes ~16.
pub fn now_millis() -> Millis {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(since) => since.as_millis() as Millis,
        Err(before) => -(before.duration().as_millis() as Millis),
    }
}

/// RFC 3339 text for a stored timestamp, as the API shows it.
pub fn rfc3339(millis: Millis) -> String {
    let nanos = i128::from(millis) * 1_000_000;
    OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .ok()
        .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_default()
}

/// Serde helpers that write a stored millisecond timestamp as RFC 3339 text.
pub mod serde_rfc3339 {
    use super::Millis;
    use serde::{Deserialize, Deserializer, Serializer};
    use time::OffsetDateTime;
    use time::format_description::well_known::Rfc3339;

    pub fn serialize<S: Serializer>(millis: &Millis, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&super::rfc3339(*millis))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Millis, D::Error> {
        let text = String::deserialize(deserializer)?;
        let time = OffsetDateTime::parse(&text, &Rfc3339).map_err(serde::de::Error::custom)?;
        Ok((time.unix_timestamp_nanos() / 1_000_000) as Millis)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_time_ordered() {
        let first = new_id();
        let second = new_id();
        assert_ne!(first, second);
        assert!(first < second, "v7 ids sort by creation time");
    }

    #[test]
    fn timestamps_render_as_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(rfc3339(-1), "1969-12-31T23:59:59.999Z");
    }

    #[test]
    fn now_is_the_system_clock_in_milliseconds() {
        let before = OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000;
        let now = i128::from(now_millis());
        let after = OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000;
        assert!(before <= now && now <= after, "{before} <= {now} <= {after}");
    }
}
