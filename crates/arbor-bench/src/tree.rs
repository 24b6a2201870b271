//! The long-conversation scenario (S5): one conversation of `trunk` messages
//! with `branches` side branches of `branch_length` messages each (10,000
//! messages and 100 branches by default), recorded through views without
//! calling the model. Then, one request at a time: loading the whole tree,
//! loading the active path (what a turn's context is built from), moving
//! the head to another branch, and a turn at a branch's leaf.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::Args;
use serde::Serialize;
use serde_json::{Value, json};

use crate::stats::{Micros, Summary};

#[derive(Debug, Args)]
pub struct TreeArgs {
    /// Arbor's root URL.
    #[arg(long)]
    base_url: String,
    #[arg(long, env = "ARBOR_BENCH_KEY", hide_env_values = true)]
    key: String,
    /// Messages on the main line.
    #[arg(long, default_value_t = 5000)]
    trunk: usize,
    /// Side branches, forking at evenly spaced points of the trunk.
    #[arg(long, default_value_t = 100)]
    branches: usize,
    /// Messages in each side branch.
    #[arg(long, default_value_t = 50)]
    branch_length: usize,
    /// Timed repetitions of each operation.
    #[arg(long, default_value_t = 20)]
    repeats: usize,
    /// Model for the timed turns (0 turns when empty).
    #[arg(long, default_value = "mock-model")]
    model: String,
    /// Append the result as one JSON line to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
struct TreeReport {
    scenario: &'static str,
    messages: usize,
    branches: usize,
    trunk: usize,
    branch_length: usize,
    /// Recording the trunk (one view of `trunk` messages).
    record_trunk_ms: f64,
    /// Recording one branch (a view: the trunk prefix plus the branch).
    record_branch_us: Option<Summary>,
    /// `GET /v1/conversations/{id}`: the whole tree.
    load_tree_us: Option<Summary>,
    /// The same reads, until the response's head arrived: a tree longer
    /// than a part is sent as it is written, and its head comes with the
    /// first parts.
    load_tree_head_us: Option<Summary>,
    load_tree_bytes: usize,
    /// `GET /v1/conversations/{id}?path=1`: the active path.
    load_path_us: Option<Summary>,
    path_length: usize,
    /// `PUT /v1/conversations/{id}/head`: switch to another branch's leaf.
    switch_branch_us: Option<Summary>,
    /// A JSON-mode turn at a branch leaf deep in the tree: client latency.
    turn_us: Option<Summary>,
    /// The same turns: Arbor's `x-arbor-overhead-us`.
    turn_overhead_us: Option<Summary>,
    /// Of that, what is not the wait for the durable writes
    /// (`x-arbor-store-wait-us`): Arbor's own work, without the disk.
    turn_rest_us: Option<Summary>,
    /// The turn right after it, on the same branch (its path is the one
    /// before, the reply and the new message): client latency.
    next_turn_us: Option<Summary>,
    /// The same turns: Arbor's `x-arbor-overhead-us`.
    next_turn_overhead_us: Option<Summary>,
    /// Of that, what is not the wait for the durable writes.
    next_turn_rest_us: Option<Summary>,
}

fn view_message(id: &str, index: usize, content: &str) -> Value {
    let role = if index.is_multiple_of(2) { "user" } else { "assistant" };
    json!({"id": id, "role": role, "content": content})
}

pub async fn run(args: TreeArgs) -> anyhow::Result<()> {
    let client = crate::http_client()?;
    let base = &args.base_url;
    let conversation = crate::load::create_conversation(&client, base, &args.key).await?;
    let messages_url = format!("{base}/v1/conversations/{conversation}/messages");
    let record = |view: Vec<Value>| {
        let request = client.post(&messages_url).bearer_auth(&args.key).json(&json!({"messages": view, "run": false}));
        async move {
            let response = request.send().await.context("recording a view")?;
            let status = response.status();
            if !status.is_success() {
                bail!("recording a view answered {status}: {}", response.text().await.unwrap_or_default());
            }
            Ok(())
        }
    };

    let trunk_ids: Vec<String> = (0..args.trunk).map(|index| format!("t{index}")).collect();
    let started = Instant::now();
    let trunk_view = trunk_ids
        .iter()
        .enumerate()
        .map(|(index, id)| view_message(id, index, &format!("trunk message {index}: a line of ordinary chat text")))
        .collect();
    record(trunk_view).await?;
    let record_trunk_ms = started.elapsed().as_secs_f64() * 1e3;

    // Known messages in a view are matched by id only, so the prefix is
    // sent without its text.
    let mut record_branch = Micros::default();
    let mut leaves = Vec::new();
    for branch in 0..args.branches {
        let fork_at = (branch + 1) * args.trunk / (args.branches + 1);
        let mut view: Vec<Value> =
            trunk_ids[..=fork_at].iter().enumerate().map(|(index, id)| view_message(id, index, "")).collect();
        for step in 0..args.branch_length {
            let index = fork_at + 1 + step;
            view.push(view_message(&format!("b{branch}-{step}"), index, &format!("branch {branch} message {step}")));
        }
        leaves.push(format!("b{branch}-{}", args.branch_length.saturating_sub(1)));
        let started = Instant::now();
        record(view).await?;
        record_branch.record(started.elapsed());
    }
    let messages = args.trunk + args.branches * args.branch_length;
    eprintln!("[S5] recorded {messages} messages in {} branches", args.branches);

    let conversation_url = format!("{base}/v1/conversations/{conversation}");
    let mut load_tree = Micros::default();
    let mut load_tree_head = Micros::default();
    let mut load_tree_bytes = 0;
    let mut load_path = Micros::default();
    let mut path_length = 0;
    let mut switch_branch = Micros::default();
    let mut turn = Micros::default();
    let mut turn_overhead = Micros::default();
    let mut next_turn = Micros::default();
    let mut next_turn_overhead = Micros::default();
    let mut turn_rest = Micros::default();
    let mut next_turn_rest = Micros::default();
    for repeat in 0..args.repeats {
        // Visit branches spread over the trunk, deep and shallow.
        let leaf = &leaves[(repeat * 37) % leaves.len().max(1)];
        let started = Instant::now();
        let response = client
            .put(format!("{conversation_url}/head"))
            .bearer_auth(&args.key)
            .json(&json!({"message_id": leaf}))
            .send()
            .await?;
        ensure!(response.status().is_success(), "moving the head answered {}", response.status());
        response.bytes().await?;
        switch_branch.record(started.elapsed());

        let started = Instant::now();
        let (head, body) = get(&client, &conversation_url, &args.key).await?;
        load_tree.record(started.elapsed());
        load_tree_head.record(head);
        load_tree_bytes = body.len();
        if repeat == 0 {
            let tree: Value = serde_json::from_slice(&body)?;
            let count = tree["messages"].as_array().map_or(0, Vec::len);
            ensure!(count >= messages, "the tree has {count} messages, expected at least {messages}");
        }

        let started = Instant::now();
        let (_, body) = get(&client, &format!("{conversation_url}?path=1"), &args.key).await?;
        load_path.record(started.elapsed());
        let path: Value = serde_json::from_slice(&body)?;
        path_length = path["messages"].as_array().map_or(0, Vec::len);

        if !args.model.is_empty() {
            // A turn at the leaf, then the next one on the same branch.
            let turns = [
                (&mut turn, &mut turn_overhead, &mut turn_rest),
                (&mut next_turn, &mut next_turn_overhead, &mut next_turn_rest),
            ];
            for (latency, overhead, rest) in turns {
                let started = Instant::now();
                let response = client
                    .post(&messages_url)
                    .bearer_auth(&args.key)
                    .json(&json!({"content": "And one more question.", "model": args.model}))
                    .send()
                    .await?;
                let status = response.status();
                let header = |name: &str| -> Option<u64> {
                    response
                        .headers()
                        .get(name)
                        .and_then(|value| value.to_str().ok())
                        .and_then(|text| text.parse().ok())
                };
                let (micros, store_wait) = (header("x-arbor-overhead-us"), header("x-arbor-store-wait-us"));
                let body = response.bytes().await?;
                ensure!(status.is_success(), "a turn on the long conversation answered {status}: {body:?}");
                latency.record(started.elapsed());
                if let Some(micros) = micros {
                    overhead.record_micros(micros);
                    if let Some(store_wait) = store_wait {
                        rest.record_micros(micros.saturating_sub(store_wait));
                    }
                }
            }
        }
    }

    let report = TreeReport {
        scenario: "S5",
        messages,
        branches: args.branches,
        trunk: args.trunk,
        branch_length: args.branch_length,
        record_trunk_ms,
        record_branch_us: record_branch.summary(),
        load_tree_us: load_tree.summary(),
        load_tree_head_us: load_tree_head.summary(),
        load_tree_bytes,
        load_path_us: load_path.summary(),
        path_length,
        switch_branch_us: switch_branch.summary(),
        turn_us: turn.summary(),
        turn_overhead_us: turn_overhead.summary(),
        next_turn_us: next_turn.summary(),
        next_turn_overhead_us: next_turn_overhead.summary(),
        turn_rest_us: turn_rest.summary(),
        next_turn_rest_us: next_turn_rest.summary(),
    };
    let line = serde_json::to_string(&report)?;
    eprintln!("[S5] {line}");
    if let Some(path) = &args.out {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        writeln!(file, "{line}")?;
    }
    Ok(())
}

/// GETs `url`: the time until the response's head arrived, and its body.
async fn get(client: &reqwest::Client, url: &str, key: &str) -> anyhow::Result<(Duration, bytes::Bytes)> {
    let started = Instant::now();
    let response = client.get(url).bearer_auth(key).timeout(Duration::from_secs(60)).send().await?;
    let head = started.elapsed();
    let status = response.status();
    ensure!(status.is_success(), "GET {url} answered {status}");
    Ok((head, response.bytes().await?))
}
