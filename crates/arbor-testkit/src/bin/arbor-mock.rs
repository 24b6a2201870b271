//! `arbor-mock`: a mock provider server for benchmarks and demos. It speaks
//! one wire protocol and answers every chat call with the same reply, encoded
//! once at start-up for each framing (JSON, SSE, Gemini's JSON array), so
//! serving a request costs a body clone and the timings measure Arbor, not
//! the mock. Unlike the test `MockServer` it records nothing, so memory stays
//! flat under load.
//!
//! ```text
//! cargo run -p arbor-testkit --bin arbor-mock -- --protocol openai \
//!     --listen 127.0.0.1:9100 --chunks 20 --chunk-delay-ms 0 --delay-ms 60
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arbor_testkit::mock::{Prebuilt, Protocol, Reply};
use axum::Router;
use axum::extract::{Request, State};
use axum::response::Response;
use axum::serve::ListenerExt;
use clap::Parser;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// Serve a fixed scripted reply in a provider's wire protocol.
#[derive(Debug, Parser)]
#[command(name = "arbor-mock")]
struct Args {
    /// Wire protocol: openai, anthropic or gemini.
    #[arg(long, default_value = "openai")]
    protocol: Protocol,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9100")]
    listen: SocketAddr,
    /// Number of text deltas in the reply.
    #[arg(long, default_value_t = 20)]
    chunks: usize,
    /// Pause between streamed chunks, in milliseconds.
    #[arg(long, default_value_t = 0)]
    chunk_delay_ms: u64,
    /// Pause before the response headers (time to first byte), in milliseconds.
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
    /// Start the reply with a thinking block of this many deltas (with a signature).
    #[arg(long, default_value_t = 0)]
    thinking_chunks: usize,
}

struct Served {
    prebuilt: Prebuilt,
    header_delay: Duration,
    chunk_delay: Duration,
    shutdown: CancellationToken,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let reply = build_reply(args.chunks, args.thinking_chunks);
    let served = Arc::new(Served {
        prebuilt: Prebuilt::new(args.protocol, &reply),
        header_delay: Duration::from_millis(args.delay_ms),
        chunk_delay: Duration::from_millis(args.chunk_delay_ms),
        shutdown: CancellationToken::new(),
    });
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let address = listener.local_addr()?;
    let base_url = format!("http://{address}{}", args.protocol.base_path());
    println!("arbor-mock: {} on {base_url} ({} chunks)", args.protocol, args.chunks);

    let shutdown = served.shutdown.clone();
    let router = Router::new().fallback(handle).with_state(served);
    // Streamed chunks leave at once, as from a real provider.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router)
        .with_graceful_shutdown(async move {
            // Without a signal handler the server runs until killed, which is
            // still a clean exit for a benchmark helper.
            if tokio::signal::ctrl_c().await.is_ok() {
                shutdown.cancel();
            } else {
                std::future::pending::<()>().await;
            }
        })
        .await
}

/// A reply of `chunks` word deltas, optionally after a thinking block.
fn build_reply(chunks: usize, thinking_chunks: usize) -> Reply {
    let words = |count: usize, word: &str| -> String {
        (0..count).map(|index| if index == 0 { format!("{word}{index}") } else { format!(" {word}{index}") }).collect()
    };
    let answer = words(chunks.max(1), "token");
    if thinking_chunks == 0 {
        return Reply::text(&answer);
    }
    Reply::thinking(&words(thinking_chunks, "thought"), "bW9jay1zaWduYXR1cmU=").then_text(&answer)
}

async fn handle(State(served): State<Arc<Served>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 64 * 1024 * 1024).await else {
        return served.prebuilt.bad_request();
    };
    // Only `stream` and `stream_options` matter; an unparsable body is a 400
    // like the real services answer.
    let Ok(json) = serde_json::from_slice::<Value>(&bytes) else {
        return served.prebuilt.bad_request();
    };
    let Some(response) = served.prebuilt.lookup(&parts.method, parts.uri.path(), parts.uri.query(), &json) else {
        return served.prebuilt.not_found(&parts.method, parts.uri.path());
    };
    if !served.header_delay.is_zero() {
        // tokio's millisecond timer, not the chunks' exact one (mock/pace.rs):
        // S2's 60 ms figures stay comparable with the runs before it.
        tokio::time::sleep(served.header_delay).await;
    }
    response.respond(served.chunk_delay, served.shutdown.clone())
}
