//! Ids and timestamps. Only the engine calls these, so that every id and time
//! in the store was made in one place; stores and handlers keep what they get.

use std::time::{SystemTime, UNIX_EPOCH};

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
    Rfc3339(millis).to_string()
}

/// A stored timestamp shown as RFC 3339 text in UTC, with the milliseconds
/// when there are any and no trailing zeros (`2023-11-14T22:13:20.123Z`,
/// `1970-01-01T00:00:00Z`): the text the time crate writes. Written into a
/// buffer on the stack, so a view that holds one serializes it without a
/// `String` (a JSON turn's answer shows about five). A time outside the years 0
/// to 9999, which RFC 3339 cannot write, shows as empty text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rfc3339(pub Millis);

/// The longest text: `YYYY-MM-DDTHH:MM:SS.mmmZ`.
const RFC3339_MAX: usize = 24;

/// The first and last millisecond RFC 3339 can write (0000-01-01 and
/// 9999-12-31, the last millisecond).
const RFC3339_RANGE: std::ops::RangeInclusive<Millis> = -62_167_219_200_000..=253_402_300_799_999;

impl Rfc3339 {
    /// Writes the text into `buffer` and returns it.
    fn render(self, buffer: &mut [u8; RFC3339_MAX]) -> &str {
        if !RFC3339_RANGE.contains(&self.0) {
            return "";
        }
        const DAY: Millis = 86_400_000;
        let (year, month, day) = civil_from_days(self.0.div_euclid(DAY));
        let in_day = self.0.rem_euclid(DAY);
        let (seconds, millis) = (in_day / 1000, in_day % 1000);
        *buffer = *b"0000-00-00T00:00:00.000Z";
        // Two digits at a time from a table, at fixed places.
        let mut pair = |at: usize, value: i64| {
            let value = value as usize * 2;
            buffer[at..at + 2].copy_from_slice(&DIGIT_PAIRS[value..value + 2]);
        };
        pair(0, year / 100);
        pair(2, year % 100);
        pair(5, month);
        pair(8, day);
        pair(11, seconds / 3600);
        pair(14, seconds / 60 % 60);
        pair(17, seconds % 60);
        let end = if millis == 0 {
            buffer[19] = b'Z';
            20
        } else {
            pair(20, millis / 10);
            buffer[22] = b'0' + (millis % 10) as u8;
            // Trailing zeros are left out: .1, .12, .123.
            let end = if millis % 100 == 0 {
                21
            } else if millis % 10 == 0 {
                22
            } else {
                23
            };
            buffer[end] = b'Z';
            end + 1
        };
        std::str::from_utf8(&buffer[..end]).unwrap_or_default()
    }
}

/// "00" to "99", each two ASCII digits.
const DIGIT_PAIRS: &[u8; 200] = b"\
    0001020304050607080910111213141516171819\
    2021222324252627282930313233343536373839\
    4041424344454647484950515253545556575859\
    6061626364656667686970717273747576777879\
    8081828384858687888990919293949596979899";

/// The proleptic Gregorian date of a day counted from 1970-01-01 (Howard
/// Hinnant's `civil_from_days`): year, month 1–12, day 1–31.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let of_era = days.rem_euclid(146_097);
    let year_of_era = (of_era - of_era / 1460 + of_era / 36_524 - of_era / 146_096) / 365;
    let of_year = of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * of_year + 2) / 153;
    let day = of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 { shifted_month + 3 } else { shifted_month - 9 };
    (year_of_era + era * 400 + i64::from(month <= 2), month, day)
}

impl Rfc3339 {
    /// Appends the text as a JSON string, as `json::write` writes it: its
    /// characters never need escaping, so it goes in as it is (a long
    /// tree's read writes one a node).
    pub fn push_json(self, out: &mut String) {
        out.push('"');
        out.push_str(self.render(&mut [0; RFC3339_MAX]));
        out.push('"');
    }
}

impl std::fmt::Display for Rfc3339 {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.render(&mut [0; RFC3339_MAX]))
    }
}

impl serde::Serialize for Rfc3339 {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.render(&mut [0; RFC3339_MAX]))
    }
}

/// Serde helpers that write a stored millisecond timestamp as RFC 3339 text.
pub mod serde_rfc3339 {
    use super::Millis;
    use serde::{Deserialize, Deserializer, Serializer};
    use time::OffsetDateTime;
    use time::format_description::well_known::Rfc3339;

    pub fn serialize<S: Serializer>(millis: &Millis, serializer: S) -> Result<S::Ok, S::Error> {
        serde::Serialize::serialize(&super::Rfc3339(*millis), serializer)
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
    use time::OffsetDateTime;

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
        assert_eq!(rfc3339(1_700_000_000_120), "2023-11-14T22:13:20.12Z");
        assert_eq!(rfc3339(1_700_000_000_100), "2023-11-14T22:13:20.1Z");
        assert_eq!(rfc3339(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(*RFC3339_RANGE.start()), "0000-01-01T00:00:00Z");
        assert_eq!(rfc3339(*RFC3339_RANGE.end()), "9999-12-31T23:59:59.999Z");
        assert_eq!(rfc3339(RFC3339_RANGE.start() - 1), "");
        assert_eq!(rfc3339(RFC3339_RANGE.end() + 1), "");
        assert_eq!(serde_json::to_string(&Rfc3339(0)).unwrap(), r#""1970-01-01T00:00:00Z""#);
        let edges = [*RFC3339_RANGE.start(), *RFC3339_RANGE.end(), RFC3339_RANGE.end() + 1];
        for millis in [0, -1, 1_700_000_000_123, 1_700_000_000_120, 1_700_000_000_100].into_iter().chain(edges) {
            let mut pushed = String::from("x");
            Rfc3339(millis).push_json(&mut pushed);
            assert_eq!(pushed, format!("x{}", crate::json::to_string(&Rfc3339(millis)).unwrap()), "{millis}");
        }
    }

    /// The time crate's text for a timestamp (empty where it has none).
    fn time_crate_text(millis: Millis) -> String {
        OffsetDateTime::from_unix_timestamp_nanos(i128::from(millis) * 1_000_000)
            .ok()
            .and_then(|time| time.format(&time::format_description::well_known::Rfc3339).ok())
            .unwrap_or_default()
    }

    proptest::proptest! {
        #[test]
        fn timestamps_render_as_the_time_crate_does(millis in -63_000_000_000_000_i64..254_000_000_000_000) {
            proptest::prop_assert_eq!(rfc3339(millis), time_crate_text(millis));
        }

        #[test]
        fn whole_seconds_render_as_the_time_crate_does(seconds in -62_167_219_200_i64..253_402_300_800) {
            proptest::prop_assert_eq!(rfc3339(seconds * 1000), time_crate_text(seconds * 1000));
        }
    }

    #[test]
    fn now_is_the_system_clock_in_milliseconds() {
        let before = OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000;
        let now = i128::from(now_millis());
        let after = OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000;
        assert!(before <= now && now <= after, "{before} <= {now} <= {after}");
    }
}
