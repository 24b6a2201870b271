//! Turns: `POST /v1/conversations/{id}/messages` starts one (streamed as SSE
//! with `Accept: text/event-stream`, else answered as JSON when it ends),
//! plus reading and cancelling turns and tailing a conversation's events.

use arbor_engine::{Submit, TurnOutcome, Until};
use axum::Router;
use axum::extract::{Path, State};
use axum::http::header::ACCEPT;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::json;

use crate::AppState;
use crate::error::{ApiError, ApiResult};
use crate::extract::{Caller, Json, Query};
use crate::{sse, views};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/conversations/{id}/messages", post(submit))
        .route("/v1/conversations/{id}/events", get(events))
        .route("/v1/conversations/{id}/turns/{turn}", get(read_turn))
        .route(
            "/v1/conversations/{id}/turns/{turn}/cancel",
            post(cancel_turn),
        )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SubmitRequest {
    content: String,
    model: Option<String>,
    id: Option<String>,
    parent_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamQuery {
    visibility: Option<String>,
    after: Option<i64>,
}

fn wants_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(ACCEPT)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|accept| accept.contains("text/event-stream"))
}

async fn submit(
    State(state): State<AppState>,
    Caller(user): Caller,
    Path(id): Path<String>,
    Query(query): Query<StreamQuery>,
    headers: HeaderMap,
    Json(body): Json<SubmitRequest>,
) -> ApiResult<Response> {
    let visibility = sse::visibility(query.visibility.as_deref())?;
    let submit = Submit {
        content: body.content,
        model: body.model,
        id: body.id,
        parent_id: body.parent_id,
    };
    let handle = state.engine.submit(&user, &id, submit).await?;
    if wants_event_stream(&headers) {
        return Ok(
            sse::respond(handle.events, visibility, state.streams_end.clone()).into_response(),
        );
    }
    let outcome = handle.outcome().await?;
    Ok(outcome_response(&outcome))
}

/// The JSON answer of a finished turn: 200 with the reply, or the turn's
/// error with a status that says whose fault it was.
fn outcome_response(outcome: &TurnOutcome) -> Response {
    let body = json!({
        "turn": views::turn(&outcome.turn),
        "message": outcome.reply.as_ref().map(|reply| views::nodes(std::slice::from_ref(reply)).remove(0)),
    });
    let Some(code) = outcome.turn.error_code.as_deref() else {
        return (StatusCode::OK, axum::Json(body)).into_response();
    };
    let status = match code {
        "rate_limit" => StatusCode::TOO_MANY_REQUESTS,
        "context_length_exceeded" | "invalid_request" | "content_filter" => {
            StatusCode::UNPROCESSABLE_ENTITY
        }
        "timeout" => StatusCode::GATEWAY_TIMEOUT,
        "cancelled" | "interrupted" => StatusCode::CONFLICT,
        _ => StatusCode::BAD_GATEWAY,
    };
    let message = outcome.turn.error_message.clone().unwrap_or_default();
    ApiError::new(status, code, message)
        .with("turn_id", outcome.turn.id.clone())
        .with("turn", body["turn"].clone())
        .with("partial_message", body["message"].clone())
        .into_response()
}

async fn events(
    State(state): State<AppState>,
    Caller(user): Caller,
    Path(id): Path<String>,
    Query(query): Query<StreamQuery>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let visibility = sse::visibility(query.visibility.as_deref())?;
    let last_event_id = headers
        .get("last-event-id")
        .and_then(|value| value.to_str().ok())
        .map(str::trim);
    let after = match (query.after, last_event_id) {
        (Some(after), _) => after,
        (None, Some(text)) => text.parse().map_err(|_| {
            ApiError::bad_request(format!(
                "Last-Event-ID {text:?} is not an event id (a number)"
            ))
        })?,
        (None, None) => 0,
    };
    if after < 0 {
        return Err(ApiError::bad_request("after must be 0 or more"));
    }
    let stream = state
        .engine
        .events(&user, &id, after, Until::Forever)
        .await?;
    Ok(sse::respond(stream, visibility, state.streams_end.clone()).into_response())
}

async fn read_turn(
    State(state): State<AppState>,
    Caller(user): Caller,
    Path((id, turn)): Path<(String, String)>,
) -> ApiResult<impl IntoResponse> {
    let details = state.engine.turn_details(&user, &id, &turn).await?;
    let mut body = views::turn(&details.turn);
    body["api_calls"] = json!(
        details
            .api_calls
            .iter()
            .map(views::api_call)
            .collect::<Vec<_>>()
    );
    Ok(axum::Json(body))
}

async fn cancel_turn(
    State(state): State<AppState>,
    Caller(user): Caller,
    Path((id, turn)): Path<(String, String)>,
) -> ApiResult<impl IntoResponse> {
    let turn = state.engine.cancel_turn(&user, &id, &turn).await?;
    Ok((StatusCode::ACCEPTED, axum::Json(views::turn(&turn))))
}
