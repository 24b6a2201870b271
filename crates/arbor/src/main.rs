//! The `arbor` command: `serve` runs the server; `users add`, `keys create`
//! and `migrate` manage a deployment from the shell. Thin by design: argument
//! parsing here, everything else in the library crates.
#![forbid(unsafe_code)]

mod logline;
mod logsink;

use std::path::PathBuf;

use anyhow::Context;
use arbor_server::config::{Config, Overrides};
use clap::{Args, Parser, Subcommand};
use logsink::LogSink;

/// mimalloc instead of glibc's malloc (ARCHITECTURE.md, "Deliberate choices").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "arbor", version, about = "A self-hosted LLM conversation engine")]
struct Cli {
    /// Log level filter (overrides RUST_LOG), e.g. `info` or `arbor=debug`.
    #[arg(long, global = true)]
    log_level: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Clone)]
struct Common {
    /// The TOML config file.
    #[arg(long, env = "ARBOR_CONFIG")]
    config: Option<PathBuf>,
    /// Where the SQLite database and media live (default ./arbor-data).
    #[arg(long, env = "ARBOR_DATA_DIR")]
    data_dir: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the server.
    Serve {
        #[command(flatten)]
        common: Common,
        /// The address to listen on (default 127.0.0.1:8080).
        #[arg(long, env = "ARBOR_LISTEN")]
        listen: Option<String>,
    },
    /// Manage users.
    Users {
        #[command(subcommand)]
        command: UsersCommand,
    },
    /// Manage API keys.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Apply database migrations and exit.
    Migrate {
        #[command(flatten)]
        common: Common,
    },
}

#[derive(Subcommand)]
enum UsersCommand {
    /// Set a user's credit balance (1 credit = 1 micro-dollar).
    Credits {
        name: String,
        /// The new balance.
        #[arg(long, conflicts_with = "unlimited")]
        set: Option<i64>,
        /// Remove the limit.
        #[arg(long)]
        unlimited: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Create a user; prints their first API key alone on stdout.
    Add {
        name: String,
        #[arg(long)]
        admin: bool,
        #[command(flatten)]
        common: Common,
    },
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Create a key for a user; prints it alone on stdout.
    Create {
        #[arg(long)]
        user: String,
        #[command(flatten)]
        common: Common,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let sink = LogSink::new(std::io::stderr());
    init_logging(cli.log_level.as_deref(), sink.clone());
    let on_panic = sink.clone();
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        on_panic.try_flush();
        report(info);
    }));
    // reqwest is built without a default TLS crypto provider; pick ring.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = sink
        .written_when_idle(tokio::runtime::Builder::new_multi_thread().enable_all())
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(run(cli.command));
    drop(runtime);
    sink.flush();
    result
}

/// Logs to `sink` (stderr, see `logsink`).
fn init_logging(level: Option<&str>, sink: LogSink<std::io::Stderr>) {
    use tracing_subscriber::EnvFilter;
    let filter = match level {
        Some(level) => EnvFilter::new(level),
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
    };
    // Logs go to stderr so that stdout carries only what scripts read.
    // Colours only for a terminal: a log file or a collector gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(sink)
        .event_format(logline::LogLine::default())
        .init();
}

fn load(common: &Common, listen: Option<String>) -> anyhow::Result<Config> {
    let overrides = Overrides { listen, data_dir: common.data_dir.clone() };
    Ok(Config::load(common.config.as_deref(), &overrides)?)
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve { common, listen } => serve(load(&common, listen)?).await,
        Command::Users { command: UsersCommand::Add { name, admin, common } } => {
            let engine = arbor_server::setup::build_engine(&load(&common, None)?).await?;
            let (_, key) = engine.create_user(&name, admin).await?;
            engine.flush_events().await;
            println!("{key}");
            Ok(())
        }
        Command::Users { command: UsersCommand::Credits { name, set, unlimited, common } } => {
            if set.is_none() && !unlimited {
                anyhow::bail!("give --set N or --unlimited");
            }
            let engine = arbor_server::setup::build_engine(&load(&common, None)?).await?;
            let user = engine.store().user_by_name(&name).await?.with_context(|| format!("no user named {name:?}"))?;
            engine.store().set_balance(&user.id, set).await?;
            eprintln!("{name}: {}", set.map_or("unlimited".to_string(), |credits| format!("{credits} credits")));
            Ok(())
        }
        Command::Keys { command: KeysCommand::Create { user, common } } => {
            let engine = arbor_server::setup::build_engine(&load(&common, None)?).await?;
            let key = engine.create_key(&user).await?;
            println!("{key}");
            Ok(())
        }
        Command::Migrate { common } => {
            let config = load(&common, None)?;
            arbor_store::open(&config.database_url).await?;
            eprintln!("migrations applied to {}", redact_url(&config.database_url));
            Ok(())
        }
    }
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let listen = config.listen;
    let app = arbor_server::setup::build(config, true).await?;
    if let Some(admin) = &app.first_admin {
        // Shown once: only the hash is stored.
        println!("Created the first user, {:?} (admin). Its API key, shown only this once:", admin.name);
        println!();
        println!("    {}", admin.key);
        println!();
        println!("Use it as:  curl -H 'Authorization: Bearer {}' http://{listen}/v1/models", admin.key);
    }
    // The handlers go in before the port opens: a SIGTERM sent as soon as the port answers must stop us cleanly,
    // not meet the default action.
    let shutdown = shutdown_signal()?;
    let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("cannot listen on {listen}"))?;
    let default_model = app.state.engine.models().default_model().to_string();
    tracing::info!(address = %listener.local_addr()?, %default_model, database = %redact_url(&app.config.database_url), "arbor is serving");
    arbor_server::serve(listener, app.state, app.config.max_body_bytes, app.config.shutdown_grace, shutdown).await?;
    Ok(())
}

/// Installs the Ctrl-C and SIGTERM handlers now and returns a future that resolves on either.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot install the SIGTERM handler")?;
    #[cfg(unix)]
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("cannot install the SIGINT handler")?;
    Ok(async move {
        #[cfg(unix)]
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    })
}

/// A database URL without its password, for logs.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            format!("{}://…{}", &url[..scheme_end], &url[at..])
        }
        _ => url.to_string(),
    }
}
