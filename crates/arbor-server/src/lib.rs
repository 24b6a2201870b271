//! Arbor's HTTP API (DESIGN.md §4): JSON under `/v1`, bearer-key auth, SSE
//! streams of a conversation's events. Handlers are thin: they parse, call
//! the engine and shape the answer. Only this crate knows HTTP.
#![forbid(unsafe_code)]

pub mod config;
pub mod error;
pub mod extract;
pub mod listen;
pub mod routes;
pub mod setup;
pub mod sse;
pub mod views;

use std::future::Future;
use std::time::{Duration, Instant};

use arbor_engine::Engine;
use axum::Router;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::HeaderValue;
use axum::middleware::{self, Next};
use axum::response::Response;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::ApiError;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub engine: Engine,
    /// Cancelled when the server stops, to end open SSE streams.
    pub streams_end: CancellationToken,
}

/// The whole API.
pub fn router(state: AppState, max_body_bytes: usize) -> Router {
    Router::new()
        .merge(routes::meta::router())
        .merge(routes::conversations::router())
        .merge(routes::turns::router())
        .fallback(|| async { ApiError::new(axum::http::StatusCode::NOT_FOUND, "not_found", "no such route") })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(middleware::from_fn(log_request))
        .with_state(state)
}

/// One log line per request, with an id that is also returned to the client
/// as `x-request-id`.
async fn log_request(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let request_id = arbor_core::ids::new_id();
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let mut response = next.run(request).await;
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("x-request-id", value);
    }
    tracing::info!(
        %request_id,
        %method,
        %path,
        status = response.status().as_u16(),
        elapsed_us = started.elapsed().as_micros() as u64,
        "request"
    );
    response
}

/// Serves `state` on `listener` until `shutdown` resolves; then stops
/// accepting, lets running turns finish for `grace` (interrupting the rest),
/// ends open streams and returns.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    max_body_bytes: usize,
    grace: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let stop_accepting = CancellationToken::new();
    let engine = state.engine.clone();
    let streams_end = state.streams_end.clone();
    let app = router(state, max_body_bytes);
    let mut server = tokio::spawn(listen::serve_http1(listener, app, stop_accepting.clone()));
    tokio::select! {
        // The loop ends only once stopped: before that, only by panicking.
        result = &mut server => return result.map_err(std::io::Error::other),
        () = shutdown => {}
    }
    tracing::info!(grace_secs = grace.as_secs(), "stopping: no new requests; running turns may finish");
    stop_accepting.cancel();
    engine.shutdown(grace).await;
    streams_end.cancel();
    server.await.map_err(std::io::Error::other)?;
    tracing::info!("stopped");
    Ok(())
}
