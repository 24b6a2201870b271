//! Where log lines go: stderr, written when the runtime has nothing else
//! to do. A turn logs two lines (the request and the finished turn), and
//! each was a `write` to stderr on the worker between the turn's last
//! commit and its answer going out. Here a runtime worker only appends a
//! line below `WARN` to memory; the lines held are written when a worker
//! is about to go idle ([`LogSink::idle`], tokio's `on_thread_park`), once
//! they pass [`HELD_LIMIT`], before any line that is written at once, and
//! when the program ends or panics. Warnings and errors, and every line of
//! a thread that is not a runtime worker, are written at once (after what
//! is held, so the order is kept). A process killed outright can lose the
//! lines of its last busy moment.

use std::cell::Cell;
use std::io::{self, Write};
use std::sync::{Arc, Mutex, MutexGuard};

use tracing::{Level, Metadata};
use tracing_subscriber::fmt::MakeWriter;

/// Bytes of held lines past which a line is written at once with them (a
/// worker that never goes idle under load; ~150 lines).
const HELD_LIMIT: usize = 32 * 1024;

thread_local! {
    /// Whether this thread is a runtime worker (it has gone idle once), whose
    /// lines may wait for its next idle moment.
    static WORKER: Cell<bool> = const { Cell::new(false) };
}

/// A handle on the sink; clones share it.
pub struct LogSink<W> {
    state: Arc<Mutex<State<W>>>,
}

impl<W> Clone for LogSink<W> {
    fn clone(&self) -> LogSink<W> {
        LogSink { state: self.state.clone() }
    }
}

struct State<W> {
    held: Vec<u8>,
    out: W,
}

impl<W: Write> State<W> {
    fn write_held(&mut self) -> io::Result<()> {
        if self.held.is_empty() {
            return Ok(());
        }
        let written = self.out.write_all(&self.held);
        self.held.clear();
        written
    }
}

impl<W: Write> LogSink<W> {
    pub fn new(out: W) -> LogSink<W> {
        LogSink { state: Arc::new(Mutex::new(State { held: Vec::new(), out })) }
    }

    /// A runtime worker is about to go idle: writes the lines held. From now
    /// on this thread's lines below `WARN` wait for such a moment.
    pub fn idle(&self) {
        WORKER.set(true);
        self.flush();
    }

    /// Writes the lines held now.
    pub fn flush(&self) {
        // A log line that cannot be written has nowhere to be reported.
        let _ = self.lock().write_held();
    }

    /// [`LogSink::flush`] unless another thread is writing (a panic while it
    /// held the lock must not wait for itself).
    pub fn try_flush(&self) {
        if let Ok(mut state) = self.state.try_lock() {
            let _ = state.write_held();
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<W>> {
        // A thread that panicked while writing left the lines as they were.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write_line(&self, line: &[u8], may_wait: bool) -> io::Result<()> {
        let mut state = self.lock();
        if may_wait && WORKER.get() {
            state.held.extend_from_slice(line);
            return if state.held.len() < HELD_LIMIT { Ok(()) } else { state.write_held() };
        }
        state.write_held()?;
        state.out.write_all(line)
    }
}

impl<W: Write + Send + 'static> LogSink<W> {
    /// Wires `runtime`'s workers to this sink: each writes the lines held
    /// when it is about to go idle ([`LogSink::idle`]).
    pub fn written_when_idle<'b>(&self, runtime: &'b mut tokio::runtime::Builder) -> &'b mut tokio::runtime::Builder {
        let sink = self.clone();
        runtime.on_thread_park(move || sink.idle())
    }
}

/// One line's writer: `may_wait` for a line below `WARN`.
pub struct LineWriter<'a, W> {
    sink: &'a LogSink<W>,
    may_wait: bool,
}

impl<W: Write> Write for LineWriter<'_, W> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.sink.write_line(bytes, self.may_wait)?;
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a, W: Write + 'a> MakeWriter<'a> for LogSink<W> {
    type Writer = LineWriter<'a, W>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter { sink: self, may_wait: false }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Self::Writer {
        // Levels compare by verbosity: INFO, DEBUG and TRACE are above WARN.
        LineWriter { sink: self, may_wait: *meta.level() > Level::WARN }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[derive(Clone, Default)]
    struct Output(Arc<Mutex<Vec<u8>>>);

    impl Write for Output {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Output {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    fn line(sink: &LogSink<Output>, level: Level, text: &str) {
        sink.write_line(text.as_bytes(), level > Level::WARN).expect("writes");
    }

    /// Runs `test` with a sink writing to an output it can read, on a
    /// thread of its own: whether a thread is a worker is kept per thread,
    /// and the test harness reuses its threads.
    fn with_sink(test: impl FnOnce(&LogSink<Output>, &Output) + Send + 'static) {
        std::thread::spawn(move || {
            let output = Output::default();
            test(&LogSink::new(output.clone()), &output);
        })
        .join()
        .expect("the test passed");
    }

    #[test]
    fn a_thread_that_is_not_a_worker_writes_at_once() {
        with_sink(|sink, output| {
            line(sink, Level::INFO, "one\n");
            assert_eq!(output.text(), "one\n");
        });
    }

    #[test]
    fn a_workers_lines_wait_for_its_idle_moment_and_keep_their_order() {
        with_sink(|sink, output| {
            sink.idle();
            line(sink, Level::INFO, "request\n");
            line(sink, Level::DEBUG, "detail\n");
            assert_eq!(output.text(), "", "written before the worker went idle");
            sink.idle();
            assert_eq!(output.text(), "request\ndetail\n");
            line(sink, Level::INFO, "turn finished\n");
            line(sink, Level::WARN, "retrying\n");
            assert_eq!(output.text(), "request\ndetail\nturn finished\nretrying\n", "a warning waited, or came first");
        });
    }

    #[test]
    fn held_lines_past_the_limit_are_written_without_waiting() {
        with_sink(|sink, output| {
            sink.idle();
            let text = format!("{}\n", "x".repeat(99));
            let lines = HELD_LIMIT / text.len() + 1;
            for _ in 0..lines {
                line(sink, Level::INFO, &text);
            }
            assert_eq!(output.text().len(), lines * text.len(), "held past the limit");
        });
    }

    /// Wired as the program wires it: a worker's line waits while its task
    /// runs and is written once the worker goes idle, with nothing else
    /// happening.
    #[test]
    fn a_runtime_writes_its_tasks_lines_when_it_goes_idle() {
        let output = Output::default();
        let sink = LogSink::new(output.clone());
        let runtime = sink
            .written_when_idle(tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_time())
            .build()
            .expect("runtime");
        let logging = sink.clone();
        let seen = output.clone();
        runtime.block_on(async move {
            tokio::spawn(async move {
                // The worker goes idle once, as it does between requests.
                tokio::time::sleep(Duration::from_millis(10)).await;
                logging.write_line(b"turn finished\n", true).expect("writes");
                assert_eq!(seen.text(), "", "written while the task still ran");
            })
            .await
            .expect("the task's checks passed");
        });
        let started = Instant::now();
        while output.text().is_empty() {
            assert!(started.elapsed() < Duration::from_secs(5), "the line was never written");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(output.text(), "turn finished\n");
    }
}
