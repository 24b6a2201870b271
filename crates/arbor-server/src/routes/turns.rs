//! Turns: `POST /v1/conversations/{id}/messages` starts one (streamed as SSE
//! with `Accept: text/event-stream`, else answered as JSON when it ends),
//! plus reading and cancelling turns and tailing a conversation's events.

use arbor_core::tree::ViewMessage;
use arbor_engine::{QueueMode, Submit, Submitted, TurnHandle, TurnOutcome, Until};
use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::json;

use crate::AppState;
use crate::error::{ApiError, ApiResult};
use crate::extract::{Caller, Json, NodesJson, Query, WantsEventStream};
use crate::{sse, views};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/conversations/{id}/messages", post(submit))
        .route("/v1/conversations/{id}/regenerate", post(regenerate))
        .route("/v1/conversations/{id}/head", axum::routing::put(move_head))
        .route("/v1/conversations/{id}/fork", post(fork))
        .route("/v1/conversations/{id}/events", get(events))
        .route("/v1/conversations/{id}/turns/{turn}", get(read_turn))
        .route("/v1/conversations/{id}/turns/{turn}/cancel", post(cancel_turn))
}

/// `queue`: `false` (409 while a turn runs), `true` (wait in line) or
/// `"merge"` (join the next turn).
#[derive(Deserialize)]
#[serde(untagged)]
enum QueueField {
    Flag(bool),
    Word(String),
}

fn queue_mode(field: Option<QueueField>) -> ApiResult<QueueMode> {
    match field {
        None | Some(QueueField::Flag(false)) => Ok(QueueMode::Refuse),
        Some(QueueField::Flag(true)) => Ok(QueueMode::Fifo),
        Some(QueueField::Word(word)) if word == "merge" => Ok(QueueMode::Merge),
        Some(QueueField::Word(word)) => {
            Err(ApiError::bad_request(format!("queue {word:?} is not one of false, true, \"merge\"")))
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SubmitRequest {
    /// The simple form: one message under the head (or `parent_id`).
    content: Option<String>,
    id: Option<String>,
    parent_id: Option<String>,
    /// The view form: the client's view of the path.
    messages: Option<Vec<ViewMessage>>,
    model: Option<String>,
    queue: Option<QueueField>,
    run: Option<bool>,
    if_head_version: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamQuery {
    visibility: Option<String>,
    after: Option<i64>,
}

async fn submit(
    State(state): State<AppState>,
    Caller(user): Caller,
    Path(id): Path<String>,
    Query(query): Query<StreamQuery>,
    WantsEventStream(stream): WantsEventStream,
    Json(body): Json<SubmitRequest>,
) -> ApiResult<Response> {
    let visibility = sse::visibility(query.visibility.as_deref())?;
    let submit = match (body.content, body.messages) {
        (Some(content), None) => Submit { content, id: body.id, parent_id: body.parent_id, ..Submit::default() },
        (None, Some(view)) => {
            if body.id.is_some() || body.parent_id.is_some() {
                return Err(ApiError::bad_request(
                    "id and parent_id go with content; in a view, give each message its id",
                ));
            }
            Submit { view: Some(view), ..Submit::default() }
        }
        (Some(_), Some(_)) => return Err(ApiError::bad_request("send either content or messages, not both")),
        (None, None) => {
            return Err(ApiError::bad_request("send content (a message) or messages (your view of the path)"));
        }
    };
    let submit = Submit {
        model: body.model,
        queue: queue_mode(body.queue)?,
        run: body.run.unwrap_or(true),
        if_head_version: body.if_head_version,
        ..submit
    };
    match state.engine.submit(&user, &id, submit).await? {
        Submitted::Turn(handle) => respond_turn(&state, *handle, stream, visibility).await,
        Submitted::Recorded { messages, head_id, head_version } => {
            // Written straight from the views, a part at a time: a view
            // can record thousands of messages.
            #[derive(serde::Serialize)]
            struct Head {
                head_id: Option<String>,
                head_version: i64,
            }
            let nodes = views::path(messages);
            Ok((StatusCode::CREATED, NodesJson { fields: Head { head_id, head_version }, nodes }).into_response())
        }
        Submitted::HeadMoved { head_id, head_version } => {
            Ok(Json(json!({"head_id": head_id, "head_version": head_version})).into_response())
        }
    }
}

/// A started (or queued) turn: its SSE stream, or its outcome as JSON.
async fn respond_turn(
    state: &AppState,
    handle: TurnHandle,
    stream: bool,
    visibility: arbor_core::event::Visibility,
) -> ApiResult<Response> {
    if stream {
        return Ok(sse::respond(handle.events().await, visibility, state.streams_end.clone()).into_response());
    }
    let outcome = handle.outcome().await?;
    Ok(outcome_response(&outcome))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegenerateRequest {
    message_id: Option<String>,
    model: Option<String>,
    queue: Option<QueueField>,
}

async fn regenerate(
    State(state): State<AppState>,
    Caller(user): Caller,
    Path(id): Path<String>,
    Query(query): Query<StreamQuery>,
    WantsEventStream(stream): WantsEventStream,
    Json(body): Json<RegenerateRequest>,
) -> ApiResult<Response> {
    let visibility = sse::visibility(query.visibility.as_deref())?;
    let queue = queue_mode(body.queue)?;
    let handle = state.engine.regenerate(&user, &id, body.message_id.as_deref(), body.model.as_deref(), queue).await?;
    respond_turn(&state, handle, stream, visibility).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HeadRequest {
    message_id: String,
    if_head_version: Option<i64>,
}

async fn move_head(
    State(state): State<AppState>,
    Caller(user): Caller,
    Path(id): Path<String>,
    Json(body): Json<HeadRequest>,
) -> ApiResult<impl IntoResponse> {
    let head_version = state.engine.set_head(&user, &id, &body.message_id, body.if_head_version).await?;
    Ok(Json(json!({"head_id": body.message_id, "head_version": head_version})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkRequest {
    message_id: String,
}

async fn fork(
    State(state): State<AppState>,
    Caller(user): Caller,
    Path(id): Path<String>,
    Json(body): Json<ForkRequest>,
) -> ApiResult<impl IntoResponse> {
    let conversation = state.engine.fork(&user, &id, &body.message_id).await?;
    Ok((StatusCode::CREATED, Json(views::conversation(&conversation))).into_response())
}

/// The JSON answer of a finished turn: 200 with the reply, or the turn's
/// error with a status that says whose fault it was.
fn outcome_response(outcome: &TurnOutcome) -> Response {
    #[derive(serde::Serialize)]
    struct Body<'a> {
        head_version: i64,
        turn: views::TurnView<'a>,
        message: Option<views::NodeView<'a>>,
    }
    let body = Body {
        head_version: outcome.head_version,
        turn: views::turn(&outcome.turn),
        message: outcome.reply.as_deref().map(views::leaf),
    };
    // Arbor's own share of the turn's time, and of that the wait for its
    // durable writes, for callers measuring overhead (static names, values
    // written from integers: nothing parsed or formatted per response).
    let micros = |time: std::time::Duration| HeaderValue::from(u64::try_from(time.as_micros()).unwrap_or(u64::MAX));
    let overhead = [
        (HeaderName::from_static("x-arbor-overhead-us"), micros(outcome.overhead)),
        (HeaderName::from_static("x-arbor-store-wait-us"), micros(outcome.store_wait)),
    ];
    let Some(code) = outcome.turn.error_code.as_deref() else {
        return (StatusCode::OK, overhead, Json(body)).into_response();
    };
    let status = match code {
        "rate_limit" => StatusCode::TOO_MANY_REQUESTS,
        "quota_exceeded" => StatusCode::PAYMENT_REQUIRED,
        "context_length_exceeded" | "invalid_request" | "content_filter" => StatusCode::UNPROCESSABLE_ENTITY,
        "timeout" => StatusCode::GATEWAY_TIMEOUT,
        "cancelled" | "interrupted" => StatusCode::CONFLICT,
        _ => StatusCode::BAD_GATEWAY,
    };
    let message = outcome.turn.error_message.clone().unwrap_or_default();
    ApiError::new(status, code, message)
        .with("turn_id", outcome.turn.id.clone())
        .with("turn", json!(body.turn))
        .with("partial_message", json!(body.message))
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
    let last_event_id = headers.get("last-event-id").and_then(|value| value.to_str().ok()).map(str::trim);
    let after = match (query.after, last_event_id) {
        (Some(after), _) => after,
        (None, Some(text)) => text
            .parse()
            .map_err(|_| ApiError::bad_request(format!("Last-Event-ID {text:?} is not an event id (a number)")))?,
        (None, None) => 0,
    };
    if after < 0 {
        return Err(ApiError::bad_request("after must be 0 or more"));
    }
    let stream = state.engine.events(&user, &id, after, Until::Forever).await?;
    Ok(sse::respond(stream, visibility, state.streams_end.clone()).into_response())
}

async fn read_turn(
    State(state): State<AppState>,
    Caller(user): Caller,
    Path((id, turn)): Path<(String, String)>,
) -> ApiResult<impl IntoResponse> {
    let details = state.engine.turn_details(&user, &id, &turn).await?;
    #[derive(serde::Serialize)]
    struct Details<'a> {
        #[serde(flatten)]
        turn: views::TurnView<'a>,
        api_calls: Vec<views::ApiCallView<'a>>,
        trace: Vec<views::TraceEventView<'a>>,
    }
    let body = Details {
        turn: views::turn(&details.turn),
        api_calls: details.api_calls.iter().map(views::api_call).collect(),
        trace: details.events.iter().map(views::trace_event).collect(),
    };
    Ok(Json(body).into_response())
}

async fn cancel_turn(
    State(state): State<AppState>,
    Caller(user): Caller,
    Path((id, turn)): Path<(String, String)>,
) -> ApiResult<impl IntoResponse> {
    let turn = state.engine.cancel_turn(&user, &id, &turn).await?;
    Ok((StatusCode::ACCEPTED, Json(views::turn(&turn))).into_response())
}
