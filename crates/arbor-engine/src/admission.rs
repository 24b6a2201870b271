//! Load shedding: a bound on the turns being admitted at once, so that an
//! overload is refused at the door instead of queued without bound.
//!
//! Admitting a turn means reading its conversation and making its user
//! message durable, which takes a millisecond or two whatever the rate
//! while the store keeps up: at a few thousand turns a second only a
//! handful are being admitted at any moment. When more turns arrive than
//! the core and the disk can commit, they pile up there, and while the
//! overload lasts every turn waits longer than the one before: at 5,000
//! JSON turns/s on the benchmark's one core the median turn took over half
//! a second and kept growing (bench/analysis.md). Past the bound, while
//! the last admission took longer than it should (`ADMITTING_SLOW`), a
//! submit or regenerate is refused at once (`EngineError::Overloaded`: 503
//! with `Retry-After`), before it reads or writes anything. A burst that
//! the store takes in its stride is let through whole. Turns already
//! admitted, the time a turn then spends with its provider, cancels, reads
//! and event streams are not counted and never refused.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// What a refused client is told to wait before it tries again.
pub(crate) const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The default bound on turns being admitted at once: far above the
/// handful a store that keeps up holds, far below what an overload piles up.
pub const MAX_ADMITTING_TURNS: usize = 64;

/// The default time an admission may take before the bound applies: a few
/// times what one takes while the store keeps up, under what one takes
/// when the bound holds an overload back (so that the bound does not lift
/// and let the backlog flood in as soon as it works).
pub const ADMITTING_SLOW: Duration = Duration::from_millis(5);

#[derive(Debug)]
pub(crate) struct Admission {
    /// Turns being admitted at once past which new ones are refused, while
    /// admissions are slow. Zero: never refuse.
    max_admitting: usize,
    /// How long the last admission must have taken for the bound to apply:
    /// a burst that the store takes in its stride is let through whole.
    slow: Duration,
    admitting: AtomicUsize,
    /// How long the admission that ended last took, in microseconds.
    last_micros: AtomicU64,
}

/// A turn being admitted; counted, and timed, until dropped.
#[derive(Debug)]
pub(crate) struct Admitting<'a> {
    admission: &'a Admission,
    since: Instant,
}

impl Drop for Admitting<'_> {
    fn drop(&mut self) {
        let micros = u64::try_from(self.since.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.admission.last_micros.store(micros, Ordering::Relaxed);
        self.admission.admitting.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Admission {
    pub(crate) fn new(max_admitting: usize, slow: Duration) -> Admission {
        Admission { max_admitting, slow, admitting: AtomicUsize::new(0), last_micros: AtomicU64::new(0) }
    }

    /// Counts a new turn in, or `None` when the bound is reached and the
    /// last admission was slow.
    pub(crate) fn admit(&self) -> Option<Admitting<'_>> {
        let before = self.admitting.fetch_add(1, Ordering::Relaxed);
        let full = self.max_admitting != 0 && before >= self.max_admitting;
        if full && Duration::from_micros(self.last_micros.load(Ordering::Relaxed)) > self.slow {
            self.admitting.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Admitting { admission: self, since: Instant::now() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An admission that took `took`, as the last one.
    fn admitted_in(admission: &Admission, took: Duration) {
        let mut admitting = admission.admit().expect("admitted");
        admitting.since = Instant::now() - took;
    }

    #[test]
    fn past_the_bound_turns_are_refused_while_admissions_are_slow() {
        let admission = Admission::new(2, Duration::from_millis(20));
        admitted_in(&admission, Duration::from_millis(50));
        let first = admission.admit().expect("first");
        let second = admission.admit().expect("second");
        assert!(admission.admit().is_none(), "a third at once is refused");
        assert!(admission.admit().is_none(), "and a refusal neither counts nor times");
        assert_eq!(admission.admitting.load(Ordering::Relaxed), 2);
        drop(first);
        let third = admission.admit().expect("room again");
        drop((second, third));
        assert_eq!(admission.admitting.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_burst_the_store_takes_in_its_stride_is_let_through() {
        let admission = Admission::new(2, Duration::from_millis(20));
        admitted_in(&admission, Duration::from_millis(1));
        let burst: Vec<_> = (0..10).map(|_| admission.admit().expect("admitted")).collect();
        assert_eq!(burst.len(), 10);
    }

    #[test]
    fn a_zero_bound_never_refuses() {
        let admission = Admission::new(0, Duration::ZERO);
        admitted_in(&admission, Duration::from_secs(1));
        let held: Vec<_> = (0..1000).map(|_| admission.admit().expect("admitted")).collect();
        assert_eq!(held.len(), 1000);
    }
}
