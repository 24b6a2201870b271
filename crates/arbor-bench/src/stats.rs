//! Latency histograms (microseconds) and their summaries, plus the two
//! readings taken from outside the client: Arbor's `/metrics` overhead
//! histogram and a process's CPU time and peak RSS from `/proc`.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// A histogram of microseconds, 1 µs to 10 minutes at three significant
/// digits (so a 1 ms reading is exact to 1 µs).
pub struct Micros(Histogram<u64>);

impl Default for Micros {
    fn default() -> Micros {
        // The bounds are constants that hdrhistogram accepts.
        Micros(Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid histogram bounds"))
    }
}

impl Micros {
    pub fn record(&mut self, duration: Duration) {
        let micros = u64::try_from(duration.as_micros()).unwrap_or(u64::MAX).max(1);
        self.0.saturating_record(micros);
    }

    pub fn record_micros(&mut self, micros: u64) {
        self.0.saturating_record(micros.max(1));
    }

    pub fn summary(&self) -> Option<Summary> {
        if self.0.is_empty() {
            return None;
        }
        let at = |quantile: f64| self.0.value_at_quantile(quantile);
        Some(Summary {
            count: self.0.len(),
            mean: self.0.mean().round() as u64,
            p50: at(0.50),
            p90: at(0.90),
            p95: at(0.95),
            p99: at(0.99),
            p999: at(0.999),
            max: self.0.max(),
        })
    }
}

/// Percentiles in microseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Summary {
    pub count: u64,
    pub mean: u64,
    pub p50: u64,
    pub p90: u64,
    pub p95: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
}

/// The cumulative buckets of one Prometheus histogram: `(upper bound in
/// seconds, count)`, in order, `+Inf` last.
pub type Buckets = Vec<(f64, u64)>;

/// Reads the buckets of `name` from Prometheus text.
pub fn parse_buckets(text: &str, name: &str) -> Buckets {
    let prefix = format!("{name}_bucket{{le=\"");
    text.lines()
        .filter_map(|line| line.strip_prefix(&prefix))
        .filter_map(|rest| {
            let (bound, count) = rest.split_once("\"} ")?;
            let bound = if bound == "+Inf" { f64::INFINITY } else { bound.parse().ok()? };
            Some((bound, count.trim().parse().ok()?))
        })
        .collect()
}

/// Percentiles of the observations made between two scrapes, in
/// microseconds, interpolated linearly inside a bucket (as Prometheus'
/// `histogram_quantile` does). `None` when nothing was observed.
pub fn bucket_quantiles(before: &Buckets, after: &Buckets, quantiles: &[f64]) -> Option<Vec<u64>> {
    let counts: Vec<(f64, u64)> = after
        .iter()
        .map(|&(bound, count)| {
            let earlier = before.iter().find(|(other, _)| *other == bound).map_or(0, |(_, count)| *count);
            (bound, count.saturating_sub(earlier))
        })
        .collect();
    let total = counts.last()?.1;
    if total == 0 {
        return None;
    }
    let values = quantiles
        .iter()
        .map(|quantile| {
            let rank = quantile * total as f64;
            let mut lower_bound = 0.0;
            let mut lower_count = 0u64;
            for &(bound, count) in &counts {
                if count as f64 >= rank {
                    if bound.is_infinite() {
                        return (lower_bound * 1e6) as u64;
                    }
                    let inside = (count - lower_count) as f64;
                    let fraction = if inside > 0.0 { (rank - lower_count as f64) / inside } else { 1.0 };
                    return ((lower_bound + (bound - lower_bound) * fraction) * 1e6).round() as u64;
                }
                lower_bound = bound;
                lower_count = count;
            }
            (lower_bound * 1e6) as u64
        })
        .collect();
    Some(values)
}

/// A process's CPU time so far (user + system), from `/proc/PID/stat`.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; the fields after it are plain.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, counted in
    // USER_HZ ticks, which Linux fixes at 100 for this file.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// A CPU core's time so far, from `/proc/stat`, in USER_HZ ticks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoreTimes {
    /// Idle, or idle waiting for I/O.
    pub idle: u64,
    /// Taken by the hypervisor for other guests while this core had work.
    pub steal: u64,
    /// All of it (user, nice, system, idle, iowait, irq, softirq, steal).
    pub total: u64,
}

/// `core`'s times so far.
pub fn core_times(core: usize) -> Option<CoreTimes> {
    parse_core_times(&std::fs::read_to_string("/proc/stat").ok()?, core)
}

fn parse_core_times(stat: &str, core: usize) -> Option<CoreTimes> {
    let name = format!("cpu{core}");
    let line = stat.lines().find(|line| line.split_whitespace().next() == Some(name.as_str()))?;
    let ticks: Vec<u64> = line.split_whitespace().skip(1).map(|field| field.parse().ok()).collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal, then guest times that
    // `user` and `nice` already count.
    let field = |index: usize| ticks.get(index).copied().unwrap_or(0);
    Some(CoreTimes { idle: field(3) + field(4), steal: field(7), total: (0..8).map(field).sum() })
}

/// The shares of a core's time between two readings, in percent: (idle,
/// stolen). `None` when no tick passed.
pub fn core_shares(before: CoreTimes, after: CoreTimes) -> Option<(f64, f64)> {
    let total = after.total.checked_sub(before.total).filter(|&total| total > 0)? as f64;
    let share = |now: u64, then: u64| 100.0 * now.saturating_sub(then) as f64 / total;
    Some((share(after.idle, before.idle), share(after.steal, before.steal)))
}

/// The core a process is pinned to (`taskset -c N`), when it may run on
/// exactly one.
pub fn pinned_core(pid: u32) -> Option<usize> {
    parse_pinned_core(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

fn parse_pinned_core(status: &str) -> Option<usize> {
    // A list such as `0-1` or `0,2` is not one core, and does not parse.
    status.lines().find_map(|line| line.strip_prefix("Cpus_allowed_list:"))?.trim().parse().ok()
}

/// `(VmHWM, VmRSS)` of a process in KiB.
pub fn memory_kib(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|line| line.starts_with(name))?;
        line.split_whitespace().nth(1)?.parse().ok()
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

/// Resets a process's peak RSS to its current RSS, so the next `VmHWM`
/// reading is the peak of one run only.
pub fn reset_peak_rss(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cores_idle_and_stolen_time_is_read_from_its_own_line() {
        let stat = "cpu  143794 0 33554 269548 5723 0 6303 1019 0 0\n\
                    cpu0 71371 0 18791 133489 4753 0 2181 472 0 0\n\
                    cpu1 78423 0 14763 131059 976 0 4122 547 0 0\n\
                    cpu10 1 1 1 1 1 1 1 1 0 0\n\
                    intr 123\n";
        let cpu1 = parse_core_times(stat, 1).unwrap();
        assert_eq!(
            cpu1,
            CoreTimes { idle: 131059 + 976, steal: 547, total: 78423 + 14763 + 131059 + 976 + 4122 + 547 }
        );
        assert_eq!(parse_core_times(stat, 10).unwrap().total, 8);
        assert_eq!(parse_core_times(stat, 2), None);
    }

    #[test]
    fn shares_are_of_the_ticks_between_two_readings() {
        let before = CoreTimes { idle: 100, steal: 10, total: 1000 };
        let after = CoreTimes { idle: 140, steal: 50, total: 1500 };
        assert_eq!(core_shares(before, after), Some((8.0, 8.0)));
        assert_eq!(core_shares(after, after), None);
    }

    #[test]
    fn a_process_is_pinned_only_when_it_may_run_on_one_core() {
        let status =
            |list: &str| format!("Name:\tarbor\nCpus_allowed:\t3\nCpus_allowed_list:\t{list}\nMems_allowed:\t1\n");
        assert_eq!(parse_pinned_core(&status("0")), Some(0));
        assert_eq!(parse_pinned_core(&status("13")), Some(13));
        assert_eq!(parse_pinned_core(&status("0-1")), None);
        assert_eq!(parse_pinned_core(&status("0,2")), None);
        assert_eq!(parse_pinned_core("Name:\tarbor\n"), None);
    }

    #[test]
    fn bucket_quantiles_interpolate_inside_the_bucket_of_the_rank() {
        let text = "x_bucket{le=\"0.0001\"} 10\nx_bucket{le=\"0.001\"} 110\nx_bucket{le=\"+Inf\"} 110\nx_count 110\n";
        let before =
            parse_buckets("x_bucket{le=\"0.0001\"} 10\nx_bucket{le=\"0.001\"} 10\nx_bucket{le=\"+Inf\"} 10\n", "x");
        let after = parse_buckets(text, "x");
        assert_eq!(after.len(), 3);
        // 100 new observations, all in (100 µs, 1 ms]: the median sits halfway.
        let values = bucket_quantiles(&before, &after, &[0.5, 0.99]).expect("observations");
        assert_eq!(values, vec![550, 991]);
    }

    #[test]
    fn no_new_observations_give_no_quantiles() {
        let buckets = parse_buckets("x_bucket{le=\"0.001\"} 5\nx_bucket{le=\"+Inf\"} 5\n", "x");
        assert!(bucket_quantiles(&buckets, &buckets, &[0.5]).is_none());
    }

    #[test]
    fn summaries_report_microseconds() {
        let mut histogram = Micros::default();
        for micros in 1..=1000 {
            histogram.record_micros(micros);
        }
        let summary = histogram.summary().expect("samples");
        assert_eq!(summary.count, 1000);
        assert_eq!(summary.p50, 500);
        assert_eq!(summary.p99, 990);
        assert_eq!(summary.max, 1000);
    }
}
