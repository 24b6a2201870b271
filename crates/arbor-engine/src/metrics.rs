//! Arbor's own measurements, cheap enough for the hot path: fixed-bucket
//! histograms on atomics, rendered in the Prometheus text format. The key
//! one is the time a turn spends outside the provider call — what Arbor adds
//! on top of the model.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Bucket upper bounds in microseconds: 50 µs to 10 s.
const BOUNDS_US: [u64; 16] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000,
    10_000_000,
];

/// A histogram of durations.
pub struct Histogram {
    buckets: [AtomicU64; BOUNDS_US.len() + 1],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Histogram {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn observe(&self, duration: Duration) {
        let micros = u64::try_from(duration.as_micros()).unwrap_or(u64::MAX);
        let index = BOUNDS_US.iter().position(|bound| micros <= *bound).unwrap_or(BOUNDS_US.len());
        self.buckets[index].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(micros, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, bucket) in BOUNDS_US.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{}\"}} {cumulative}", *bound as f64 / 1e6);
        }
        cumulative += self.buckets[BOUNDS_US.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_us.load(Ordering::Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {}", self.count.load(Ordering::Relaxed));
    }
}

/// The engine's metrics.
#[derive(Default)]
pub struct Metrics {
    /// Turn time outside provider calls.
    pub turn_overhead: Histogram,
    /// Of that, waiting for a turn's start and end to be stored.
    pub turn_store_wait: Histogram,
    /// Whole turns, from accepted to recorded.
    pub turn_duration: Histogram,
    pub turns_succeeded: AtomicU64,
    pub turns_failed: AtomicU64,
}

impl Metrics {
    /// Prometheus text of the counters and histograms, then `gauges`
    /// (name, help, value) read from the engine's state at the time.
    pub fn render(&self, gauges: &[(&str, &str, u64)]) -> String {
        let mut out = String::new();
        self.turn_overhead.render(
            "arbor_turn_overhead_seconds",
            "Time a turn spent outside provider calls (Arbor's own cost).",
            &mut out,
        );
        self.turn_store_wait.render(
            "arbor_turn_store_wait_seconds",
            "Of a turn's own time, the wait for its start and its end to be stored (durable writes).",
            &mut out,
        );
        self.turn_duration.render("arbor_turn_duration_seconds", "Whole turns, from accepted to recorded.", &mut out);
        let _ = writeln!(out, "# TYPE arbor_turns_total counter");
        let _ =
            writeln!(out, "arbor_turns_total{{status=\"succeeded\"}} {}", self.turns_succeeded.load(Ordering::Relaxed));
        let _ = writeln!(out, "arbor_turns_total{{status=\"other\"}} {}", self.turns_failed.load(Ordering::Relaxed));
        for (name, help, value) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name} {value}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_cumulative_buckets() {
        let histogram = Histogram::default();
        histogram.observe(Duration::from_micros(40));
        histogram.observe(Duration::from_micros(700));
        histogram.observe(Duration::from_secs(60));
        let mut out = String::new();
        histogram.render("x", "help", &mut out);
        assert!(out.contains("x_bucket{le=\"0.00005\"} 1"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.001\"} 2"), "{out}");
        assert!(out.contains("x_bucket{le=\"10\"} 2"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3"), "{out}");
        assert!(out.contains("x_count 3"));
    }
}
