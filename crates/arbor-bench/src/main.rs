//! `arbor-bench`: the load client of Arbor's benchmark (`bench/run.sh`).
//! `load` drives open-loop traffic at a fixed rate against Arbor or an
//! OpenAI-compatible endpoint (the mock, for the baseline, or another
//! gateway) and writes one JSON line of percentiles per measured run;
//! `tree` times the long-conversation operations. All times are
//! microseconds unless a field says otherwise.

#![forbid(unsafe_code)]

mod load;
mod stats;
mod tree;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "arbor-bench", about = "Load client for Arbor's benchmark")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Open-loop load at a fixed rate (JSON or SSE turns, or direct calls).
    Load(load::LoadArgs),
    /// The long-conversation scenario: record a big tree, then time reads.
    Tree(tree::TreeArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // One worker per core the process may use: under `taskset -c 1` that is
    // one, so the client never competes with the server's core.
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        match cli.command {
            Command::Load(args) => load::run(args).await,
            Command::Tree(args) => tree::run(args).await,
        }
    })
}

/// The HTTP client, built as Arbor builds its own. Connections are pooled
/// without limit, so open-loop load opens as many as it needs.
fn http_client() -> anyhow::Result<reqwest::Client> {
    let timeouts = arbor_providers::http::HttpTimeouts::default();
    Ok(arbor_providers::http::build_client(&timeouts)?)
}
