//! Pauses that end when they should. tokio's timer counts in whole
//! milliseconds and fires on the runtime's next turn after the tick, so a
//! 5 ms pause between streamed chunks lasts 5–7 ms depending on how busy the
//! mock's runtime is. In the twenty-seventh benchmark run the gaps between a
//! directly streamed reply's chunks were p50 5.9 ms and the same mock's
//! gaps through Arbor 6.2 ms, a difference that was the timer's, not
//! Arbor's. A benchmark that compares the time to the first token through
//! Arbor with the same mock called directly, to well under a millisecond,
//! needs the mock's own pauses to be exact.
//!
//! So one thread keeps every pending deadline in a heap and sleeps on a
//! condition variable until the earliest (the kernel's high-resolution
//! timer, within its default 50 µs slack), then wakes the paused tasks whose
//! deadlines have passed. A pause is a oneshot channel that thread fires.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Condvar, Mutex, Once, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// Waits `duration` from now, ending within tens of microseconds of it
/// (never before).
pub(crate) async fn sleep(duration: Duration) {
    let deadline = Instant::now() + duration;
    let (wake, woken) = oneshot::channel();
    pacer().schedule(deadline, wake);
    // The pacer fires a sender only once its deadline has passed, and never
    // drops one unfired while it runs.
    let _ = woken.await;
}

/// A pause the pacer has yet to end. Ordered by deadline alone: pauses due
/// at the same instant are woken in the same pass, in any order.
struct Pending {
    deadline: Instant,
    wake: oneshot::Sender<()>,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        self.deadline == other.deadline
    }
}

impl Eq for Pending {}

impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Pending {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.deadline.cmp(&other.deadline)
    }
}

/// The pending pauses, earliest first, and the condition variable the
/// pacing thread sleeps on.
struct Pacer {
    pending: Mutex<BinaryHeap<Reverse<Pending>>>,
    changed: Condvar,
}

static PACER: Pacer = Pacer { pending: Mutex::new(BinaryHeap::new()), changed: Condvar::new() };

/// The pacer, its thread started on first use.
fn pacer() -> &'static Pacer {
    static STARTED: Once = Once::new();
    STARTED.call_once(|| {
        std::thread::Builder::new()
            .name("mock-pacer".into())
            .spawn(|| PACER.run())
            .expect("the mock's pacing thread starts");
    });
    &PACER
}

impl Pacer {
    fn schedule(&self, deadline: Instant, wake: oneshot::Sender<()>) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let earliest = pending.peek().is_none_or(|Reverse(first)| deadline < first.deadline);
        pending.push(Reverse(Pending { deadline, wake }));
        drop(pending);
        // Only a new earliest deadline shortens the thread's sleep.
        if earliest {
            self.changed.notify_one();
        }
    }

    fn run(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            let now = Instant::now();
            while let Some(Reverse(first)) = pending.peek()
                && first.deadline <= now
            {
                if let Some(Reverse(due)) = pending.pop() {
                    // A pause whose task has gone (a cancelled stream) has
                    // no one to wake.
                    let _ = due.wake.send(());
                }
            }
            let next = pending.peek().map(|Reverse(first)| first.deadline - now);
            pending = match next {
                None => self.changed.wait(pending).unwrap_or_else(PoisonError::into_inner),
                Some(wait) => self.changed.wait_timeout(pending, wait).unwrap_or_else(PoisonError::into_inner).0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_pause_never_ends_before_its_deadline() {
        for millis in [0, 1, 3, 7] {
            let started = Instant::now();
            sleep(Duration::from_millis(millis)).await;
            assert!(started.elapsed() >= Duration::from_millis(millis), "{millis} ms ended early");
        }
    }

    #[tokio::test]
    async fn concurrent_pauses_end_in_deadline_order() {
        // Asked for longest first, so each new one becomes the earliest and
        // must cut the pacer's sleep short.
        let (done, mut order) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for millis in [40u64, 30, 20, 10] {
            let done = done.clone();
            tasks.push(tokio::spawn(async move {
                sleep(Duration::from_millis(millis)).await;
                let _ = done.send(millis);
            }));
        }
        for task in tasks {
            task.await.expect("the pause finishes");
        }
        drop(done);
        let mut ended = Vec::new();
        while let Some(millis) = order.recv().await {
            ended.push(millis);
        }
        assert_eq!(ended, [10, 20, 30, 40]);
    }

    #[tokio::test]
    async fn a_dropped_pause_leaves_the_others_running() {
        // Polled once, so the pacer holds it, then dropped before it is due:
        // the pacer finds no one to wake at 5 ms and must go on to 10 ms.
        let mut abandoned = Box::pin(sleep(Duration::from_millis(5)));
        assert!(futures_util::FutureExt::now_or_never(abandoned.as_mut()).is_none(), "not due yet");
        drop(abandoned);
        let started = Instant::now();
        tokio::time::timeout(Duration::from_secs(2), sleep(Duration::from_millis(10)))
            .await
            .expect("the later pause still ends");
        assert!(started.elapsed() >= Duration::from_millis(10));
    }
}
