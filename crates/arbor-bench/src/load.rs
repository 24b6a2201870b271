//! Open-loop load at a fixed rate, against Arbor (a turn per request, JSON
//! or SSE) or against any OpenAI-compatible endpoint (the mock itself, the
//! baseline; or a gateway such as LiteLLM).
//!
//! Open loop means requests are released on a schedule (request `i` at
//! `start + i / rate`) whether or not earlier ones have answered, and every
//! latency is measured from the scheduled time, not from when the client got
//! round to sending it. A server that falls behind therefore shows its
//! queueing in the percentiles instead of silently slowing the client down
//! (coordinated omission; `oha --latency-correction` does the same). The
//! schedule is kept by a plain thread with `thread::sleep`, which wakes
//! within tens of microseconds; tokio's timer only has millisecond steps.
//!
//! Arbor runs one turn per conversation at a time, so the client keeps a
//! pool of conversations and gives each request one that is idle. Each
//! conversation takes a bounded number of turns and is then replaced by a
//! fresh one (as a chat app starts new chats), so the context a turn sends
//! upstream stays small and comparable with the direct baseline. The pool
//! also bounds the requests in flight; a request that has to wait for a
//! conversation waits inside its measured latency.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;

use crate::stats::{self, Micros, Summary};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    /// Arbor: `POST /v1/conversations/{id}/messages`.
    Arbor,
    /// An OpenAI-compatible server: `POST {base}/chat/completions`.
    Openai,
}

#[derive(Debug, Args)]
pub struct LoadArgs {
    /// What the base URL points at.
    #[arg(long, value_enum)]
    target: Target,
    /// Arbor's root (`http://127.0.0.1:8080`) or an OpenAI base URL
    /// (`http://127.0.0.1:9100/v1`).
    #[arg(long)]
    base_url: String,
    /// Bearer key (Arbor's key; any string for the mock).
    #[arg(long, env = "ARBOR_BENCH_KEY", default_value = "bench", hide_env_values = true)]
    key: String,
    /// Model name sent with each request.
    #[arg(long, default_value = "mock-model")]
    model: String,
    /// Stream the reply (SSE) instead of waiting for the JSON answer.
    #[arg(long)]
    stream: bool,
    /// Requests per second.
    #[arg(long)]
    rate: f64,
    /// Seconds per measured run.
    #[arg(long, default_value_t = 5.0)]
    duration: f64,
    /// Seconds of load before the first measured run (discarded).
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Measured runs at this rate (each reported on its own line).
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Conversations (Arbor) or request slots (OpenAI): the most requests
    /// in flight. Default: a quarter second's worth of requests, 32 to 2000.
    #[arg(long)]
    pool: Option<usize>,
    /// Turns a conversation takes before the client replaces it.
    #[arg(long, default_value_t = 10)]
    turns_per_conversation: u32,
    /// Seconds before a request counts as failed.
    #[arg(long, default_value_t = 15.0)]
    timeout: f64,
    /// Process whose CPU time and peak RSS are read around each run
    /// (the server under test).
    #[arg(long)]
    server_pid: Option<u32>,
    /// Scenario label written with the results (S0, S1, ...).
    #[arg(long, default_value = "adhoc")]
    scenario: String,
    /// Free-form label (e.g. the backend) written with the results.
    #[arg(long, default_value = "")]
    variant: String,
    /// Append one JSON line per measured run to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One measured run, as written to the results file.
#[derive(Debug, Serialize)]
struct RunReport {
    scenario: String,
    variant: String,
    target: Target,
    stream: bool,
    rate: f64,
    run: u32,
    duration_secs: f64,
    started_unix_ms: u128,
    sent: u64,
    ok: u64,
    errors: BTreeMap<String, u64>,
    achieved_rps: f64,
    /// Requests released more than 1 ms late by the client (its own
    /// saturation; should be 0).
    late_dispatches: u64,
    /// Requests that waited for a free conversation or slot.
    pool_waits: u64,
    pool: usize,
    /// Scheduled send → full response (JSON) or `done` (SSE), successes only.
    latency_us: Option<Summary>,
    /// SSE: scheduled send → first event of any kind.
    first_event_us: Option<Summary>,
    /// SSE: scheduled send → first text delta (time to first token).
    first_delta_us: Option<Summary>,
    /// SSE: gaps between consecutive text deltas.
    delta_gap_us: Option<Summary>,
    /// Arbor's `x-arbor-overhead-us` header (JSON mode).
    header_overhead_us: Option<Summary>,
    /// Of that, `x-arbor-store-wait-us`: the wait for the turn's start and
    /// end to be stored (JSON mode).
    header_store_wait_us: Option<Summary>,
    /// Each turn's overhead minus its store wait: Arbor's work and the
    /// turn's waits for the CPU (JSON mode).
    header_rest_us: Option<Summary>,
    /// Arbor's `arbor_turn_overhead_seconds` histogram over the run
    /// (bucket-interpolated p50, p99), any mode.
    metric_overhead_us: Option<[u64; 2]>,
    /// Server CPU time per successful request, in microseconds.
    server_cpu_us_per_request: Option<f64>,
    /// Server CPU use over the run, in percent of one core.
    server_cpu_percent: Option<f64>,
    /// The share of the server's core that was idle during the run, and
    /// the share the hypervisor took for other guests (steal), in percent;
    /// when the server is pinned to one core.
    server_core_idle_percent: Option<f64>,
    server_core_steal_percent: Option<f64>,
    /// Server peak RSS during the run (VmHWM after a reset), KiB.
    server_peak_rss_kib: Option<u64>,
    server_rss_kib: Option<u64>,
}

/// What one request produced.
#[derive(Default)]
struct Sample {
    error: Option<String>,
    latency: Duration,
    first_event: Option<Duration>,
    first_delta: Option<Duration>,
    delta_gaps: Vec<Duration>,
    header_overhead_us: Option<u64>,
    header_store_wait_us: Option<u64>,
    late: bool,
    waited: bool,
}

#[derive(Default)]
struct Recorder {
    sent: u64,
    ok: u64,
    errors: BTreeMap<String, u64>,
    late: u64,
    pool_waits: u64,
    latency: Micros,
    first_event: Micros,
    first_delta: Micros,
    delta_gap: Micros,
    header_overhead: Micros,
    header_store_wait: Micros,
    header_rest: Micros,
}

impl Recorder {
    fn add(&mut self, sample: Sample) {
        self.sent += 1;
        self.late += u64::from(sample.late);
        self.pool_waits += u64::from(sample.waited);
        if let Some(error) = sample.error {
            *self.errors.entry(error).or_default() += 1;
            return;
        }
        self.ok += 1;
        self.latency.record(sample.latency);
        if let Some(first) = sample.first_event {
            self.first_event.record(first);
        }
        if let Some(first) = sample.first_delta {
            self.first_delta.record(first);
        }
        for gap in sample.delta_gaps {
            self.delta_gap.record(gap);
        }
        if let Some(micros) = sample.header_overhead_us {
            self.header_overhead.record_micros(micros);
        }
        if let Some(micros) = sample.header_store_wait_us {
            self.header_store_wait.record_micros(micros);
            if let Some(overhead) = sample.header_overhead_us {
                self.header_rest.record_micros(overhead.saturating_sub(micros));
            }
        }
    }
}

/// A conversation (Arbor) or just a slot (OpenAI) and how often it was used.
struct Slot {
    conversation: String,
    turns: u32,
}

/// Idle slots; the semaphore counts them so a request can wait for one.
struct Pool {
    idle: Mutex<VecDeque<Slot>>,
    available: Semaphore,
}

impl Pool {
    fn new(slots: Vec<Slot>) -> Pool {
        let count = slots.len();
        Pool { idle: Mutex::new(slots.into()), available: Semaphore::new(count) }
    }

    /// Takes an idle slot; `true` when it had to wait for one.
    async fn take(&self) -> (Slot, bool) {
        let waited = self.available.available_permits() == 0;
        let permit = self.available.acquire().await.expect("the pool's semaphore is never closed");
        permit.forget();
        let slot = self.idle.lock().expect("pool lock").pop_front().expect("a permit means an idle slot");
        (slot, waited)
    }

    fn put(&self, slot: Slot) {
        self.idle.lock().expect("pool lock").push_back(slot);
        self.available.add_permits(1);
    }
}

struct Shared {
    client: reqwest::Client,
    args: LoadArgs,
    pool: Pool,
    timeout: Duration,
}

pub async fn run(args: LoadArgs) -> anyhow::Result<()> {
    if !(args.rate > 0.0 && args.duration > 0.0) {
        bail!("--rate and --duration must be positive");
    }
    let client = crate::http_client()?;
    let pool_size = args.pool.unwrap_or_else(|| ((args.rate * 0.25).ceil() as usize).clamp(32, 2000));
    let slots = match args.target {
        Target::Arbor => create_conversations(&client, &args.base_url, &args.key, pool_size).await?,
        Target::Openai => (0..pool_size).map(|_| Slot { conversation: String::new(), turns: 0 }).collect(),
    };
    let timeout = Duration::from_secs_f64(args.timeout);
    let shared = Arc::new(Shared { client, pool: Pool::new(slots), timeout, args });
    let args = &shared.args;

    if args.warmup > 0.0 {
        let warm = drive(&shared, args.warmup).await;
        eprintln!(
            "[{} {}{} {} rps] warm-up: {}/{} ok",
            args.scenario,
            target_name(args.target),
            if args.stream { " stream" } else { "" },
            args.rate,
            warm.ok,
            warm.sent
        );
    }
    // The server's core, when it is pinned to one, whose idle and stolen
    // time each run reads.
    let core = args.server_pid.and_then(stats::pinned_core);
    for run in 1..=args.runs {
        let metrics_before = scrape_overhead(&shared).await;
        if let Some(pid) = args.server_pid {
            stats::reset_peak_rss(pid);
        }
        let cpu_before = args.server_pid.and_then(stats::cpu_time);
        let core_before = core.and_then(stats::core_times);
        let started_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| since.as_millis());
        let started = Instant::now();
        let recorder = drive(&shared, args.duration).await;
        let elapsed = started.elapsed();
        let cpu_after = args.server_pid.and_then(stats::cpu_time);
        let core_shares = core_before
            .zip(core.and_then(stats::core_times))
            .and_then(|(before, after)| stats::core_shares(before, after));
        let memory = args.server_pid.and_then(stats::memory_kib);
        let metrics_after = scrape_overhead(&shared).await;

        let server_cpu = cpu_before.zip(cpu_after).map(|(before, after)| after.saturating_sub(before));
        let report = RunReport {
            scenario: args.scenario.clone(),
            variant: args.variant.clone(),
            target: args.target,
            stream: args.stream,
            rate: args.rate,
            run,
            duration_secs: args.duration,
            started_unix_ms,
            sent: recorder.sent,
            ok: recorder.ok,
            errors: recorder.errors.clone(),
            // Successes over the scheduled window: the rate the server
            // sustained. (Stragglers finishing after it count, slightly
            // flattering an overloaded server; the errors show that case.)
            achieved_rps: recorder.ok as f64 / args.duration,
            late_dispatches: recorder.late,
            pool_waits: recorder.pool_waits,
            pool: pool_size,
            latency_us: recorder.latency.summary(),
            first_event_us: recorder.first_event.summary(),
            first_delta_us: recorder.first_delta.summary(),
            delta_gap_us: recorder.delta_gap.summary(),
            header_overhead_us: recorder.header_overhead.summary(),
            header_store_wait_us: recorder.header_store_wait.summary(),
            header_rest_us: recorder.header_rest.summary(),
            metric_overhead_us: metrics_before
                .zip(metrics_after)
                .and_then(|(before, after)| stats::bucket_quantiles(&before, &after, &[0.5, 0.99]))
                .map(|values| [values[0], values[1]]),
            server_cpu_us_per_request: server_cpu
                .filter(|_| recorder.ok > 0)
                .map(|cpu| cpu.as_micros() as f64 / recorder.ok as f64),
            server_cpu_percent: server_cpu.map(|cpu| 100.0 * cpu.as_secs_f64() / elapsed.as_secs_f64()),
            server_core_idle_percent: core_shares.map(|(idle, _)| idle),
            server_core_steal_percent: core_shares.map(|(_, steal)| steal),
            server_peak_rss_kib: memory.map(|(peak, _)| peak),
            server_rss_kib: memory.map(|(_, now)| now),
        };
        print_summary(&report);
        if let Some(path) = &args.out {
            append_line(path, &serde_json::to_string(&report)?)?;
        }
    }
    Ok(())
}

fn target_name(target: Target) -> &'static str {
    match target {
        Target::Arbor => "arbor",
        Target::Openai => "openai",
    }
}

fn print_summary(report: &RunReport) {
    let percentiles = |summary: &Option<Summary>| {
        summary.map_or_else(|| "-".to_string(), |summary| format!("p50 {} p99 {}", summary.p50, summary.p99))
    };
    eprintln!(
        "[{} {}{} {} rps] run {}: {}/{} ok, {:.0} rps, latency µs {}, ttft µs {}, header overhead µs {} (store wait {}, the rest {}), metric overhead µs {:?}, peak rss {:?} KiB, server core idle / stolen % {}, errors {:?}",
        report.scenario,
        target_name(report.target),
        if report.stream { " stream" } else { "" },
        report.rate,
        report.run,
        report.ok,
        report.sent,
        report.achieved_rps,
        percentiles(&report.latency_us),
        percentiles(&report.first_delta_us),
        percentiles(&report.header_overhead_us),
        percentiles(&report.header_store_wait_us),
        percentiles(&report.header_rest_us),
        report.metric_overhead_us,
        report.server_peak_rss_kib,
        report
            .server_core_idle_percent
            .zip(report.server_core_steal_percent)
            .map_or_else(|| "-".to_string(), |(idle, steal)| format!("{idle:.1} / {steal:.1}")),
        report.errors,
    );
}

fn append_line(path: &PathBuf, line: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(file, "{line}")?;
    Ok(())
}

/// Creates `count` conversations, 32 at a time.
async fn create_conversations(
    client: &reqwest::Client,
    base_url: &str,
    key: &str,
    count: usize,
) -> anyhow::Result<Vec<Slot>> {
    let created: Vec<anyhow::Result<String>> = futures_util::stream::iter(0..count)
        .map(|_| create_conversation(client, base_url, key))
        .buffer_unordered(32)
        .collect()
        .await;
    created.into_iter().map(|id| Ok(Slot { conversation: id?, turns: 0 })).collect()
}

pub async fn create_conversation(client: &reqwest::Client, base_url: &str, key: &str) -> anyhow::Result<String> {
    let response = client
        .post(format!("{base_url}/v1/conversations"))
        .bearer_auth(key)
        .json(&json!({}))
        .send()
        .await
        .context("creating a conversation")?;
    let status = response.status();
    let body: Value = response.json().await.context("reading the new conversation")?;
    match body["id"].as_str() {
        Some(id) if status.is_success() => Ok(id.to_string()),
        _ => bail!("creating a conversation answered {status}: {body}"),
    }
}

/// Arbor's overhead histogram, when the target is Arbor.
async fn scrape_overhead(shared: &Shared) -> Option<stats::Buckets> {
    if shared.args.target != Target::Arbor {
        return None;
    }
    let response = shared.client.get(format!("{}/metrics", shared.args.base_url)).send().await.ok()?;
    let text = response.text().await.ok()?;
    Some(stats::parse_buckets(&text, "arbor_turn_overhead_seconds"))
}

/// Releases requests at the configured rate for `seconds`, then waits for
/// all of them to finish.
async fn drive(shared: &Arc<Shared>, seconds: f64) -> Recorder {
    let recorder = Arc::new(Mutex::new(Recorder::default()));
    let mut schedule = start_schedule(shared.args.rate, Duration::from_secs_f64(seconds));
    let mut requests = JoinSet::new();
    while let Some(scheduled) = schedule.recv().await {
        let shared = Arc::clone(shared);
        let recorder = Arc::clone(&recorder);
        requests.spawn(async move {
            let sample = one_request(&shared, scheduled).await;
            recorder.lock().expect("recorder lock").add(sample);
        });
    }
    while requests.join_next().await.is_some() {}
    Arc::try_unwrap(recorder)
        .ok()
        .map(|recorder| recorder.into_inner().expect("recorder lock"))
        .expect("every request task has finished")
}

/// A thread that sends each request's scheduled time when it comes.
fn start_schedule(rate: f64, length: Duration) -> mpsc::UnboundedReceiver<Instant> {
    let (sender, receiver) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        let end = start + length;
        for index in 0u64.. {
            let at = start + Duration::from_secs_f64(index as f64 / rate);
            if at >= end {
                break;
            }
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            if sender.send(at).is_err() {
                break;
            }
        }
    });
    receiver
}

async fn one_request(shared: &Shared, scheduled: Instant) -> Sample {
    let late = scheduled.elapsed() > Duration::from_millis(1);
    let (mut slot, waited) = shared.pool.take().await;
    let mut sample = match tokio::time::timeout(shared.timeout, call(shared, &slot.conversation, scheduled)).await {
        Ok(sample) => sample,
        Err(_) => Sample { error: Some("timeout".into()), ..Sample::default() },
    };
    sample.late = late;
    sample.waited = waited;
    slot.turns += 1;
    if shared.args.target == Target::Arbor && slot.turns >= shared.args.turns_per_conversation {
        // Outside the measured time; on failure the old one serves on.
        if let Ok(id) = create_conversation(&shared.client, &shared.args.base_url, &shared.args.key).await {
            slot = Slot { conversation: id, turns: 0 };
        }
    }
    shared.pool.put(slot);
    sample
}

async fn call(shared: &Shared, conversation: &str, scheduled: Instant) -> Sample {
    let args = &shared.args;
    let prompt = "Say hello in one short sentence.";
    let (url, body) = match args.target {
        Target::Arbor => (
            format!("{}/v1/conversations/{conversation}/messages", args.base_url),
            json!({"content": prompt, "model": args.model}),
        ),
        Target::Openai => (
            format!("{}/chat/completions", args.base_url),
            json!({
                "model": args.model,
                "messages": [{"role": "user", "content": prompt}],
                "stream": args.stream,
            }),
        ),
    };
    let mut request = shared.client.post(url).bearer_auth(&args.key).json(&body);
    if args.stream {
        request = request.header(reqwest::header::ACCEPT, "text/event-stream");
    }
    let failed = |error: String| Sample { error: Some(error), ..Sample::default() };
    let response = match request.send().await {
        Ok(response) => response,
        Err(error) => return failed(classify(&error)),
    };
    let status = response.status();
    if !status.is_success() {
        return failed(format!("http {}", status.as_u16()));
    }
    if !args.stream {
        let micros = |name: &str| response.headers().get(name)?.to_str().ok()?.parse().ok();
        let header_overhead_us = micros("x-arbor-overhead-us");
        let header_store_wait_us = micros("x-arbor-store-wait-us");
        return match response.bytes().await {
            Ok(_) => {
                Sample { latency: scheduled.elapsed(), header_overhead_us, header_store_wait_us, ..Sample::default() }
            }
            Err(error) => failed(classify(&error)),
        };
    }
    read_stream(args.target, response, scheduled).await
}

/// Times an SSE reply: Arbor's named events (`delta`, `done`, `error`) or
/// OpenAI's `data:` chunks ending in `[DONE]`.
async fn read_stream(target: Target, response: reqwest::Response, scheduled: Instant) -> Sample {
    let mut sample = Sample::default();
    let mut last_delta: Option<Instant> = None;
    let mut events = response.bytes_stream().eventsource();
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(error) => return Sample { error: Some(format!("stream: {error}")), ..Sample::default() },
        };
        let now = Instant::now();
        sample.first_event.get_or_insert(now - scheduled);
        let (is_delta, is_done) = match target {
            Target::Arbor => match event.event.as_str() {
                "delta" => (true, false),
                "done" => (false, true),
                "error" => return Sample { error: Some("error event".into()), ..Sample::default() },
                _ => (false, false),
            },
            Target::Openai => {
                if event.data.trim() == "[DONE]" {
                    (false, true)
                } else {
                    (openai_chunk_has_text(&event.data), false)
                }
            }
        };
        if is_delta {
            sample.first_delta.get_or_insert(now - scheduled);
            if let Some(previous) = last_delta {
                sample.delta_gaps.push(now - previous);
            }
            last_delta = Some(now);
        }
        if is_done {
            sample.latency = now - scheduled;
            return sample;
        }
    }
    Sample { error: Some("stream ended before done".into()), ..Sample::default() }
}

fn openai_chunk_has_text(data: &str) -> bool {
    serde_json::from_str::<Value>(data)
        .ok()
        .is_some_and(|chunk| chunk["choices"][0]["delta"]["content"].as_str().is_some_and(|text| !text.is_empty()))
}

fn classify(error: &reqwest::Error) -> String {
    if error.is_timeout() {
        "timeout".into()
    } else if error.is_connect() {
        "connect".into()
    } else if error.is_body() || error.is_decode() {
        "body".into()
    } else {
        "request".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_openai_chunks_with_text_count_as_deltas() {
        assert!(openai_chunk_has_text(r#"{"choices":[{"delta":{"content":"hi"}}]}"#));
        assert!(!openai_chunk_has_text(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#));
        assert!(!openai_chunk_has_text(r#"{"choices":[],"usage":{"prompt_tokens":3}}"#));
    }

    #[test]
    fn the_schedule_releases_rate_times_length_requests() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let count = runtime.block_on(async {
            let mut schedule = start_schedule(1000.0, Duration::from_millis(50));
            let mut count = 0;
            while schedule.recv().await.is_some() {
                count += 1;
            }
            count
        });
        assert_eq!(count, 50);
    }
}
