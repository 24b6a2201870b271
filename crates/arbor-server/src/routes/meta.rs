//! Small resources: health, the model registry, the caller.

use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::get;
use serde_json::json;

use crate::AppState;
use crate::extract::{Caller, Json};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/me", get(me))
}

/// Answers once the server is ready (store opened, engine started).
async fn health() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

/// Prometheus text: turn overhead and duration histograms, turn counts, the
/// conversations loaded in memory. Aggregates only, so it needs no key.
async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.engine.render_metrics())
}

async fn models(State(state): State<AppState>, Caller(_user): Caller) -> impl IntoResponse {
    let models = state.engine.models();
    let list: Vec<_> = models
        .registry()
        .iter()
        .map(|model| {
            json!({
                "id": model.id,
                "provider": model.provider,
                "available": models.is_available(model),
                "context_window": model.context_window,
                "max_output": model.max_output,
                "capabilities": model.capabilities,
                "prices_micro_usd_per_million_tokens": model.prices,
            })
        })
        .collect();
    Json(json!({"default_model": models.default_model(), "models": list}))
}

async fn me(Caller(user): Caller) -> impl IntoResponse {
    Json(json!({
        "id": user.id,
        "name": user.name,
        "is_admin": user.is_admin,
        "balance_credits": user.balance_credits,
        "created_at": arbor_core::ids::rfc3339(user.created_at),
    }))
}
