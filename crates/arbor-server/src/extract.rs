//! Extractors: the caller's identity from the bearer key, and JSON / query
//! bodies whose rejections become [`ApiError`]s with the problem named.

use arbor_store::User;
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::AppState;
use crate::error::ApiError;

/// The authenticated caller.
pub struct Caller(pub User);

/// Whether the client asked for an event stream (`Accept:
/// text/event-stream`). Read here rather than by keeping the request's
/// headers: their values share hyper's read buffer, and a turn in flight
/// that held them would make the connection allocate a second buffer for
/// the rest of the turn (`bench/memprobe.sh`, ARCHITECTURE.md).
pub struct WantsEventStream(pub bool);

impl<S: Send + Sync> FromRequestParts<S> for WantsEventStream {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<WantsEventStream, Self::Rejection> {
        let accept = parts.headers.get(ACCEPT).and_then(|value| value.to_str().ok());
        Ok(WantsEventStream(accept.is_some_and(|accept| accept.contains("text/event-stream"))))
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Caller, ApiError> {
        let header = parts
            .headers
            .get(AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .ok_or_else(ApiError::unauthorized)?;
        let key = header
            .strip_prefix("Bearer ")
            .or_else(|| header.strip_prefix("bearer "))
            .map(str::trim)
            .filter(|key| !key.is_empty() && key.len() <= 256)
            .ok_or_else(ApiError::unauthorized)?;
        let user = state.engine.authenticate(key).await?.ok_or_else(ApiError::unauthorized)?;
        Ok(Caller(user))
    }
}

/// A JSON body; malformed JSON, wrong types and unknown fields are a 400
/// naming the problem, an oversized body a 413. Also a JSON response (below).
pub struct Json<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Json<T> {
    type Rejection = ApiError;

    /// serde_json parses the body directly; only a body it refuses is
    /// parsed again by `axum::Json`, whose `serde_path_to_error` names
    /// where it went wrong. Tracking that path on every body cost ~12% of
    /// parsing one, which for a view of a long conversation is thousands
    /// of messages (bench/analysis.md).
    async fn from_request(request: Request, state: &S) -> Result<Json<T>, ApiError> {
        if !json_content_type(request.headers()) {
            return Err(ApiError::not_json());
        }
        let body = Bytes::from_request(request, state).await?;
        match serde_json::from_slice(&body) {
            Ok(value) => Ok(Json(value)),
            Err(_) => {
                let axum::Json(value) = axum::Json::<T>::from_bytes(&body)?;
                Ok(Json(value))
            }
        }
    }
}

/// Whether the body is declared JSON: `application/json` or
/// `application/<something>+json`, parameters aside, in any case (what
/// `axum::Json` accepts).
fn json_content_type(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(CONTENT_TYPE).and_then(|value| value.to_str().ok()) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    // A header's text is visible ASCII, so any byte is a boundary.
    let suffix = subtype.len().checked_sub(5).map(|at| &subtype[at..]);
    kind.eq_ignore_ascii_case("application")
        && (subtype.eq_ignore_ascii_case("json") || suffix.is_some_and(|suffix| suffix.eq_ignore_ascii_case("+json")))
}

/// A JSON response body, written by `arbor_core::json` (serde_json's
/// output, with a faster string escape: a turn's response is mostly ids,
/// timestamps and text). A value that cannot be written, which no
/// response type here allows, is a plain-text 500 as with `axum::Json`.
impl<T: Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        json_response(&self.0, 128)
    }
}

/// A JSON response whose size is known roughly beforehand (a tree of
/// thousands of messages, [`crate::views::NodeViews::bytes`]): written into
/// a buffer of about that size.
pub struct LargeJson<T> {
    pub body: T,
    pub bytes: usize,
}

impl<T: Serialize> IntoResponse for LargeJson<T> {
    fn into_response(self) -> Response {
        json_response(&self.body, self.bytes)
    }
}

/// `body` as a JSON response, written into a buffer of `capacity` bytes to
/// start with.
fn json_response<T: Serialize>(body: &T, capacity: usize) -> Response {
    match arbor_core::json::to_vec_with_capacity(body, capacity) {
        Ok(body) => ([(CONTENT_TYPE, HeaderValue::from_static("application/json"))], body).into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"))],
            error.to_string(),
        )
            .into_response(),
    }
}

/// Query parameters, with a 400 naming the bad one.
pub struct Query<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Query<T>, ApiError> {
        let axum::extract::Query(value) = axum::extract::Query::<T>::from_request_parts(parts, state).await?;
        Ok(Query(value))
    }
}
