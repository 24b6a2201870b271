//! The log line, written directly. Arbor logs two lines a turn (the request
//! and the finished turn), and `tracing-subscriber`'s default formatter spent
//! ~22,000 instructions on them, 3.4% of a turn (bench/profile.md): the
//! timestamp through `Display` and `write!`, each field name painted with an
//! empty style, every value through `fmt`. [`LogLine`] writes the same bytes
//! (timestamp, padded level, target, message, `name=value` fields; the
//! message's terminal escapes made harmless the same way) with plain string
//! writes. Lines it does not handle the same way are handed to the default
//! formatter whole: coloured output (a terminal), events inside spans,
//! records forwarded from the `log` crate, and a clock before 1970. The
//! tests compare the two line for line.

use std::fmt::{self, Write as _};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::field::VisitOutput;
use tracing_subscriber::fmt::format::{DefaultVisitor, Format, Full, Writer};
use tracing_subscriber::fmt::time::SystemTime as DefaultTimer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The default `Full` format's lines, written without `fmt` where it can.
#[derive(Default)]
pub struct LogLine {
    fallback: Format<Full, DefaultTimer>,
}

impl<S, N> FormatEvent<S, N> for LogLine
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, context: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let metadata = event.metadata();
        let stamp = timestamp(SystemTime::now());
        let stamp = stamp.as_ref().and_then(|stamp| std::str::from_utf8(stamp).ok());
        let Some(stamp) = stamp.filter(|_| {
            !writer.has_ansi_escapes()
                && context.event_scope().is_none()
                && metadata.fields().field("log.target").is_none()
        }) else {
            return self.fallback.format_event(context, writer, event);
        };
        writer.write_str(stamp)?;
        writer.write_str(level_column(metadata.level()))?;
        writer.write_str(metadata.target())?;
        writer.write_str(": ")?;
        let mut fields = Fields { writer: &mut writer, first: true, result: Ok(()) };
        event.record(&mut fields);
        fields.result?;
        writer.write_char('\n')
    }
}

/// The level as the default format pads it, with the space after it.
fn level_column(level: &Level) -> &'static str {
    match *level {
        Level::TRACE => "TRACE ",
        Level::DEBUG => "DEBUG ",
        Level::INFO => " INFO ",
        Level::WARN => " WARN ",
        Level::ERROR => "ERROR ",
    }
}

/// `2026-12-06T00:37:49.018199Z ` (UTC, microseconds, then a space), as
/// the default timer writes it; `None` for a clock before 1970 or after
/// 9999, which the default formatter writes its own way.
fn timestamp(now: SystemTime) -> Option<[u8; 28]> {
    let since_epoch = time::Duration::try_from(now.duration_since(UNIX_EPOCH).ok()?).ok()?;
    let now = time::OffsetDateTime::UNIX_EPOCH.checked_add(since_epoch)?;
    let year = u64::try_from(now.year()).ok().filter(|year| *year <= 9999)?;
    let mut stamp = *b"0000-00-00T00:00:00.000000Z ";
    put_digits(&mut stamp[0..4], year);
    put_digits(&mut stamp[5..7], u64::from(u8::from(now.month())));
    put_digits(&mut stamp[8..10], u64::from(now.day()));
    put_digits(&mut stamp[11..13], u64::from(now.hour()));
    put_digits(&mut stamp[14..16], u64::from(now.minute()));
    put_digits(&mut stamp[17..19], u64::from(now.second()));
    put_digits(&mut stamp[20..26], u64::from(now.microsecond()));
    Some(stamp)
}

/// Writes `value`'s last `out.len()` decimal digits, zero-padded.
fn put_digits(out: &mut [u8], mut value: u64) {
    for digit in out.iter_mut().rev() {
        *digit = b'0' + (value % 10) as u8;
        value /= 10;
    }
}

/// The event's fields as the default visitor writes them: the message bare,
/// the others `name=value` with `Debug` values, separated by spaces.
struct Fields<'a, 'w> {
    writer: &'a mut Writer<'w>,
    first: bool,
    result: fmt::Result,
}

impl Fields<'_, '_> {
    /// Starts a field: the space before it, and `name=` unless it is the
    /// message. `None` for a field the default visitor leaves out (the
    /// `log` crate's metadata) or after a failed write.
    fn start(&mut self, field: &Field) -> Option<Kind> {
        let name = field.name();
        if self.result.is_err() || name.starts_with("log.") {
            return None;
        }
        if !std::mem::take(&mut self.first) {
            self.result = self.writer.write_char(' ');
        }
        if name == "message" {
            return Some(Kind::Message);
        }
        let name = name.strip_prefix("r#").unwrap_or(name);
        self.result = self.result.and_then(|()| self.writer.write_str(name)).and_then(|()| self.writer.write_char('='));
        Some(Kind::Named)
    }

    fn write(&mut self, write: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        self.result = self.result.and_then(|()| write(self.writer));
    }

    fn integer(&mut self, field: &Field, value: impl itoa::Integer) {
        if self.start(field).is_some() {
            self.write(|writer| writer.write_str(itoa::Buffer::new().format(value)));
        }
    }
}

enum Kind {
    Message,
    Named,
}

impl Visit for Fields<'_, '_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        match self.start(field) {
            Some(Kind::Message) => self.write(|writer| Sanitizing(writer).write_str(value)),
            Some(Kind::Named) => self.write(|writer| write!(writer, "{value:?}")),
            None => {}
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.integer(field, value);
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.integer(field, value);
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        if self.start(field).is_some() {
            self.write(|writer| writer.write_str(if value { "true" } else { "false" }));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        // Rare (failures only) and written in a longer form when the error
        // has sources: the default visitor writes it.
        if self.result.is_err() || field.name().starts_with("log.") {
            return;
        }
        let mut default = DefaultVisitor::new(self.writer.by_ref(), std::mem::take(&mut self.first));
        default.record_error(field, value);
        self.result = default.finish();
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        match self.start(field) {
            // The message (`format_args!`), whose `Debug` is its text.
            Some(Kind::Message) => self.write(|writer| write!(Sanitizing(writer), "{value:?}")),
            Some(Kind::Named) => self.write(|writer| write!(writer, "{value:?}")),
            None => {}
        }
    }
}

/// Writes a message as the default visitor does: the control characters a
/// terminal could take for an escape sequence are written escaped (ESC, BEL,
/// BS, FF, DEL as `\x1b` and so on, C1 controls as `\u{80}`…). Text without
/// them, nearly all, is written in one piece.
struct Sanitizing<'a, 'w>(&'a mut Writer<'w>);

impl fmt::Write for Sanitizing<'_, '_> {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        // C1 controls are U+0080..U+009F, encoded as 0xC2 0x80..0x9F.
        let clean = !text.bytes().any(|byte| matches!(byte, 0x1b | 0x07 | 0x08 | 0x0c | 0x7f | 0xc2));
        if clean {
            return self.0.write_str(text);
        }
        for character in text.chars() {
            match character {
                '\x1b' => self.0.write_str("\\x1b")?,
                '\x07' => self.0.write_str("\\x07")?,
                '\x08' => self.0.write_str("\\x08")?,
                '\x0c' => self.0.write_str("\\x0c")?,
                '\x7f' => self.0.write_str("\\x7f")?,
                character if ('\u{80}'..='\u{9f}').contains(&character) => {
                    write!(self.0, "\\u{{{:x}}}", character as u32)?
                }
                character => self.0.write_char(character)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tracing::{debug, error, info, info_span, trace, warn};
    use tracing_subscriber::fmt::MakeWriter;

    use super::*;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Captured {
        type Writer = Captured;

        fn make_writer(&'a self) -> Captured {
            self.clone()
        }
    }

    #[derive(Debug)]
    struct Cause;

    impl fmt::Display for Cause {
        fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
            formatter.write_str("the disk is full")
        }
    }

    impl std::error::Error for Cause {}

    /// An error with a source, which the default visitor writes with its
    /// chain.
    #[derive(Debug)]
    struct Failed(Cause);

    impl fmt::Display for Failed {
        fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
            formatter.write_str("the write failed")
        }
    }

    impl std::error::Error for Failed {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    /// Every kind of line Arbor logs, and the kinds it might.
    fn log_everything() {
        info!("turn finished");
        info!(request_id = %"01a2", method = %"POST", path = %"/v1/conversations", status = 200u16, elapsed_us = 545u64, "request");
        info!(turn_id = %"t1", status = "succeeded", elapsed_ms = 0u64, cost = -3i64, ok = true, ratio = 0.5f64, "turn finished");
        let node_id = "n1";
        warn!(%node_id, "displayed, named after its variable");
        warn!(error = %"boom", "announcing a head move failed");
        error!(r#type = "x", bytes = ?b"ab", "typed");
        info!("an \x1b[31mescape\x07, a C1 \u{85} and é");
        info!(quoted = "a \"quote\"\nand a newline\x1b", message = "a message given as a string");
        info!(count = 3);
        debug!(level = "debug", "quiet");
        trace!("quieter");
        // A dependency that logs through the `log` crate.
        log::warn!(target: "some_crate::pool", "a {} record", "forwarded");
        let plain = std::io::Error::other("plain");
        let chained = Failed(Cause);
        error!(error = &plain as &(dyn std::error::Error + 'static), "failed");
        error!(error = &chained as &(dyn std::error::Error + 'static), "failed with a cause");
        let span = info_span!("outer", id = 3);
        let _entered = span.enter();
        info!("inside a span");
    }

    fn lines(ansi: bool, fast: bool) -> Vec<String> {
        // `log` records reach tracing as `serve` sets it up (`init`
        // installs this forwarder); a second test's call finds it set.
        let _ = tracing_log::LogTracer::init();
        let captured = Captured::default();
        let builder =
            tracing_subscriber::fmt().with_max_level(Level::TRACE).with_ansi(ansi).with_writer(captured.clone());
        if fast {
            tracing::subscriber::with_default(builder.event_format(LogLine::default()).finish(), log_everything);
        } else {
            tracing::subscriber::with_default(builder.finish(), log_everything);
        }
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        text.lines().map(str::to_owned).collect()
    }

    /// The line without its timestamp (the two formatters read the clock at
    /// different moments).
    fn after_timestamp(line: &str, ansi: bool) -> &str {
        if ansi {
            // Dimmed: the timestamp sits between `ESC[2m` and `ESC[0m`.
            line.split_once("\x1b[0m").map_or(line, |(_, rest)| rest)
        } else {
            &line[27..]
        }
    }

    #[test]
    fn lines_are_the_default_formatters() {
        for ansi in [false, true] {
            let expected = lines(ansi, false);
            let written = lines(ansi, true);
            assert_eq!(expected.len(), 15, "{expected:#?}");
            assert_eq!(written.len(), expected.len(), "{written:#?}");
            for (written, expected) in written.iter().zip(&expected) {
                assert_eq!(after_timestamp(written, ansi), after_timestamp(expected, ansi));
                if !ansi {
                    let stamp = &written[..27];
                    assert!(stamp.starts_with("20") && stamp.ends_with('Z'), "{written}");
                    assert_eq!(stamp.as_bytes()[10], b'T', "{written}");
                }
            }
        }
        // The sanitised message, and the `log` record under its own target.
        let written = lines(false, true);
        assert!(written[6].ends_with(r"an \x1b[31mescape\x07, a C1 \u{85} and é"), "{}", written[6]);
        assert!(written[11].ends_with(" WARN some_crate::pool: a forwarded record"), "{}", written[11]);
    }

    fn stamp(seconds: u64, micros: u32) -> String {
        let stamp = timestamp(UNIX_EPOCH + Duration::new(seconds, micros * 1000)).expect("a timestamp");
        String::from_utf8(stamp.to_vec()).unwrap()
    }

    #[test]
    fn timestamps_are_utc_with_microseconds() {
        assert_eq!(stamp(0, 0), "1970-01-01T00:00:00.000000Z ");
        assert_eq!(stamp(1_796_517_469, 18_199), "2026-12-06T00:37:49.018199Z ");
        assert_eq!(stamp(1_709_251_199, 999_999), "2024-02-29T23:59:59.999999Z ");
        assert_eq!(stamp(951_868_800, 1), "2000-03-01T00:00:00.000001Z ");
        // The year 2100 is not a leap year.
        assert_eq!(stamp(4_107_542_400, 0), "2100-03-01T00:00:00.000000Z ");
        // Before 1970 the default formatter writes the line.
        assert_eq!(timestamp(UNIX_EPOCH - Duration::from_secs(1)), None);
    }
}
