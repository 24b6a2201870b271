//! `/v1/conversations`: create, list (newest first, paginated), read with the
//! whole tree, change, delete.

use arbor_engine::{ConversationPath, ConversationTree, NewConversation};
use arbor_store::{ConversationCursor, ConversationUpdate};
use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use serde::Deserialize;

use crate::AppState;
use crate::error::{ApiError, ApiResult};
use crate::extract::{Caller, Json, NodesJson, Query};
use crate::views;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/conversations", get(list).post(create))
        .route("/v1/conversations/{id}", get(read).patch(update).delete(remove))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRequest {
    title: Option<String>,
    model: Option<String>,
    system_prompt: Option<String>,
}

async fn create(
    State(state): State<AppState>,
    Caller(user): Caller,
    Json(body): Json<CreateRequest>,
) -> ApiResult<impl IntoResponse> {
    let conversation = state
        .engine
        .create_conversation(
            &user,
            NewConversation { title: body.title, model: body.model, system_prompt: body.system_prompt },
        )
        .await?;
    Ok((StatusCode::CREATED, Json(views::conversation(&conversation))).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    limit: Option<u32>,
    /// The `next_cursor` of the previous page.
    cursor: Option<String>,
}

async fn list(
    State(state): State<AppState>,
    Caller(user): Caller,
    Query(query): Query<ListQuery>,
) -> ApiResult<impl IntoResponse> {
    let cursor = query.cursor.as_deref().map(parse_cursor).transpose()?;
    let limit = query.limit.unwrap_or(20).clamp(1, 100);
    let conversations = state.engine.list_conversations(&user, cursor, limit).await?;
    let next_cursor = (conversations.len() == limit as usize)
        .then(|| conversations.last().map(|last| format!("{}.{}", last.created_at, last.id)))
        .flatten();
    #[derive(serde::Serialize)]
    struct Page<'a> {
        conversations: Vec<views::ConversationView<'a>>,
        next_cursor: Option<String>,
    }
    Ok(Json(Page { conversations: conversations.iter().map(views::conversation).collect(), next_cursor })
        .into_response())
}

fn parse_cursor(text: &str) -> ApiResult<ConversationCursor> {
    let invalid =
        || ApiError::bad_request(format!("cursor {text:?} is not valid: pass the next_cursor of the previous page"));
    let (millis, id) = text.split_once('.').ok_or_else(invalid)?;
    let created_at = millis.parse().map_err(|_| invalid())?;
    Ok(ConversationCursor { created_at, id: id.to_string() })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadQuery {
    /// `1`: only the active path (root to head), not the whole tree.
    path: Option<u8>,
}

async fn read(
    State(state): State<AppState>,
    Caller(user): Caller,
    Path(id): Path<String>,
    Query(query): Query<ReadQuery>,
) -> ApiResult<impl IntoResponse> {
    Ok(match query.path {
        Some(1) => {
            let ConversationPath { conversation, messages } = state.engine.conversation_path(&user, &id).await?;
            NodesJson { fields: views::conversation(&conversation), nodes: views::path(messages) }.into_response()
        }
        Some(0) | None => {
            let ConversationTree { conversation, tree } = state.engine.conversation_tree(&user, &id).await?;
            NodesJson { fields: views::conversation(&conversation), nodes: tree }.into_response()
        }
        Some(other) => return Err(ApiError::bad_request(format!("path={other} is not 0 or 1"))),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateRequest {
    title: Option<String>,
    model: Option<String>,
    system_prompt: Option<String>,
}

async fn update(
    State(state): State<AppState>,
    Caller(user): Caller,
    Path(id): Path<String>,
    Json(body): Json<UpdateRequest>,
) -> ApiResult<impl IntoResponse> {
    let update =
        ConversationUpdate { title: body.title, system_prompt: body.system_prompt, model: body.model, updated_at: 0 };
    let conversation = state.engine.update_conversation(&user, &id, update).await?;
    Ok(Json(views::conversation(&conversation)).into_response())
}

async fn remove(
    State(state): State<AppState>,
    Caller(user): Caller,
    Path(id): Path<String>,
) -> ApiResult<impl IntoResponse> {
    state.engine.delete_conversation(&user, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}
