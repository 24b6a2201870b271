//! `arbor-floor`: what the benchmark's shape costs without Arbor in it.
//!
//! A stateless pass-through built from the parts Arbor is built from —
//! Arbor's accept loop (`arbor_server::listen`: hyper's HTTP/1.1 with
//! `TCP_NODELAY`) serving an axum router, the HTTP client Arbor's providers
//! use (`arbor_providers::http::HttpClient`), mimalloc, a multi-thread tokio
//! runtime with one worker per core it may use — that forwards every
//! request's body to the upstream at the same path and answers with what
//! comes back, streamed or whole. With `--fsyncs`, it also makes the
//! durable writes a stateful turn cannot do without: the request before it
//! is forwarded (1), and the answer before it is returned (2). They go to
//! one writer thread that writes every record waiting, calls `fdatasync`
//! once and answers them all (group commit, as Arbor's SQLite writer does),
//! into a file written in full at start-up and then overwritten in a ring,
//! so a sync never has to grow the file (as SQLite's reused WAL does not).
//!
//! Run on Arbor's core against the same mock and load client (the
//! benchmark's F1 and F3 points, `bench/run.sh`), it says how much of
//! Arbor's overhead any server on this machine pays — the HTTP hops, the
//! wakes of an idle core, the disk — and how much is Arbor's own work.
//!
//! ```text
//! arbor-floor --listen 127.0.0.1:8090 --upstream http://127.0.0.1:9100 --fsyncs 2 --data-dir /tmp/floor
//! ```

use std::fs::{File, OpenOptions};
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;

use arbor_providers::http::{HttpClient, HttpRequest, HttpTimeouts, endpoint};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::Uri;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use clap::Parser;
use futures_util::{StreamExt, stream};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Bodies larger than this are refused (Arbor's own request limit is smaller).
const MAX_BODY: usize = 8 * 1024 * 1024;

/// The ring file's size; records wrap around to its start.
const RING_BYTES: u64 = 64 * 1024 * 1024;

/// Records written under one `fdatasync` at most.
const MAX_GROUP: usize = 64;

/// A stateless pass-through on Arbor's HTTP stack, optionally with durable writes.
#[derive(Debug, Parser)]
#[command(name = "arbor-floor")]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
    /// Where requests go: scheme, host and port; the request's path is kept.
    #[arg(long, default_value = "http://127.0.0.1:9100")]
    upstream: String,
    /// Durable writes a request waits for: 0, 1 (before forwarding) or 2
    /// (and before answering).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    fsyncs: u8,
    /// Folder for the ring file (needed with --fsyncs).
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

struct Floor {
    client: HttpClient,
    upstream: String,
    /// Where the request is made durable before it is forwarded (--fsyncs 1 or 2).
    request_log: Option<Log>,
    /// Where the answer is made durable before it is returned (--fsyncs 2).
    answer_log: Option<Log>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let log = match (args.fsyncs, &args.data_dir) {
        (0, _) => None,
        (_, Some(dir)) => Some(Log::open(&dir.join("floor.ring"))?),
        (_, None) => return Err("--fsyncs needs --data-dir".into()),
    };
    let client = HttpClient::new(&HttpTimeouts::default()).map_err(|error| error.to_string())?;
    let answer_log = if args.fsyncs == 2 { log.clone() } else { None };
    let upstream = endpoint(&args.upstream)?.to_string().trim_end_matches('/').to_owned();
    let floor = Arc::new(Floor { client, upstream, request_log: log, answer_log });
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen).await?;
        println!("arbor-floor: {} -> {} ({} fsyncs a request)", listener.local_addr()?, floor.upstream, args.fsyncs);
        let app = Router::new().fallback(forward).with_state(floor);
        // SIGTERM ends the process normally (its exit handlers run), which
        // an instrumented build needs to write its profile (`bench/pgo.sh`).
        let stop = CancellationToken::new();
        let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::spawn({
            let stop = stop.clone();
            async move {
                terminate.recv().await;
                stop.cancel();
            }
        });
        arbor_server::listen::serve_http1(listener, app, stop).await;
        Ok(())
    })
}

async fn forward(State(floor): State<Arc<Floor>>, request: Request) -> Response {
    match try_forward(&floor, request).await {
        Ok(response) => response,
        Err(error) => (StatusCode::BAD_GATEWAY, error).into_response(),
    }
}

async fn try_forward(floor: &Floor, request: Request) -> Result<Response, String> {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, MAX_BODY).await.map_err(|error| format!("reading the request: {error}"))?;
    if let Some(log) = &floor.request_log {
        log.write(body.clone()).await?;
    }
    // The upstream was checked once at start-up; only the path is added.
    let uri = Uri::try_from(format!("{}{}", floor.upstream, parts.uri.path())).map_err(|error| error.to_string())?;
    let request =
        HttpRequest::post(uri, body).header(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
    let upstream = floor.client.send(request).await.map_err(|error| format!("calling the upstream: {error}"))?;
    let status = StatusCode::from_u16(upstream.status()).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = upstream.headers().get(header::CONTENT_TYPE).cloned();
    let streamed = upstream.content_type().is_some_and(|value| value.starts_with("text/event-stream"));
    let answer_log = floor.answer_log.clone();
    let body = if streamed {
        // Chunks go on as they come; the answer's durable write ends the
        // stream (a stateful server would hold back its `done` for it).
        let tail = stream::once(async move {
            match answer_log {
                Some(log) => log.write(Bytes::from_static(b"done")).await.map_err(io::Error::other),
                None => Ok(()),
            }
        })
        .filter_map(|written| async move { written.err().map(Err) });
        Body::from_stream(
            upstream.into_stream().map(|chunk| chunk.map_err(|error| io::Error::other(error.to_string()))).chain(tail),
        )
    } else {
        let bytes = upstream.bytes().await.map_err(|error| format!("reading the upstream: {error}"))?;
        if let Some(log) = answer_log {
            log.write(bytes.clone()).await?;
        }
        Body::from(bytes)
    };
    let mut response = Response::new(body);
    *response.status_mut() = status;
    if let Some(value) = content_type {
        response.headers_mut().insert(header::CONTENT_TYPE, value);
    }
    Ok(response)
}

/// A record and where to say whether it is on disk (or why not).
type Job = (Bytes, oneshot::Sender<Result<(), String>>);

/// The durable log: a sender to the writer thread.
#[derive(Clone)]
struct Log {
    jobs: mpsc::Sender<Job>,
}

impl Log {
    /// Writes the ring file in full (so later writes never allocate) and
    /// starts the writer thread.
    fn open(path: &std::path::Path) -> io::Result<Log> {
        let file = OpenOptions::new().create(true).truncate(true).read(true).write(true).open(path)?;
        let zeros = vec![0u8; 1024 * 1024];
        for block in 0..RING_BYTES / zeros.len() as u64 {
            file.write_all_at(&zeros, block * zeros.len() as u64)?;
        }
        file.sync_all()?;
        if let Some(dir) = path.parent() {
            File::open(dir)?.sync_all()?;
        }
        let (jobs, queue) = mpsc::channel();
        std::thread::Builder::new().name("floor-log".into()).spawn(move || write_loop(&file, &queue))?;
        Ok(Log { jobs })
    }

    /// Returns once the record is on disk.
    async fn write(&self, record: Bytes) -> Result<(), String> {
        if record.len() as u64 > RING_BYTES {
            return Err(format!("a record of {} bytes does not fit the {RING_BYTES}-byte ring", record.len()));
        }
        let (reply, written) = oneshot::channel();
        self.jobs.send((record, reply)).map_err(|_| "the log writer stopped".to_owned())?;
        written.await.unwrap_or_else(|_| Err("the log writer stopped".to_owned()))
    }
}

fn write_loop(file: &File, queue: &mpsc::Receiver<Job>) {
    let mut offset = 0u64;
    let mut group = Vec::with_capacity(MAX_GROUP);
    while let Ok(first) = queue.recv() {
        group.push(first);
        while group.len() < MAX_GROUP {
            match queue.try_recv() {
                Ok(job) => group.push(job),
                Err(_) => break,
            }
        }
        let written = group
            .iter()
            .try_for_each(|(record, _)| {
                if offset + record.len() as u64 > RING_BYTES {
                    offset = 0;
                }
                file.write_all_at(record, offset)?;
                offset += record.len() as u64;
                Ok(())
            })
            .and_then(|()| file.sync_data())
            .map_err(|error| format!("writing the log: {error}"));
        for (_, reply) in group.drain(..) {
            let _ = reply.send(written.clone());
        }
    }
}
