//! Extractors: the caller's identity from the bearer key, and JSON / query
//! bodies whose rejections become [`ApiError`]s with the problem named.

use arbor_store::User;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::AppState;
use crate::error::ApiError;
use crate::views::NodeList;

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
        match arbor_core::json::to_vec(&self.0) {
            Ok(body) => ([(CONTENT_TYPE, HeaderValue::from_static("application/json"))], body).into_response(),
            Err(error) => server_error(&error),
        }
    }
}

/// A JSON object whose last field, `messages`, is a list of nodes, which can
/// be long (a conversation's tree of thousands of messages, 3 MB of JSON
/// for 10,000).
/// A list longer than [`PART_BYTES`] is sent as it is written, a part of
/// about that size at a time (chunked): the client reads the first nodes
/// while the next are written, and a read holds one part in memory rather
/// than the whole text. A shorter one is written whole, with its length.
pub struct NodesJson<F, L> {
    /// The object's other fields: something that serializes as an object.
    pub fields: F,
    pub nodes: L,
}

/// About how much of a long list's JSON is written before it is sent.
pub const PART_BYTES: usize = 64 * 1024;

/// A part's buffer: room for the part and the node that passes its size.
const PART_CAPACITY: usize = PART_BYTES + PART_BYTES / 8;

impl<F: Serialize, L: NodeList> IntoResponse for NodesJson<F, L> {
    fn into_response(self) -> Response {
        let estimate = self.nodes.bytes_up_to(PART_BYTES);
        let whole = estimate <= PART_BYTES;
        // The whole text, or a part (and the head) in one buffer.
        let mut head = String::with_capacity(estimate.min(PART_CAPACITY) + 1024);
        let opened = arbor_core::json::write(&mut head, &self.fields).and_then(|()| {
            // `{…}` becomes `{…,"messages":[`.
            if head.pop() != Some('}') {
                return Err(serde::ser::Error::custom("the fields are not an object"));
            }
            if head.len() > 1 {
                head.push(',');
            }
            head.push_str("\"messages\":[");
            Ok(())
        });
        if let Err(error) = opened {
            return server_error(&error);
        }
        let mut parts = NodeParts {
            pending: head,
            nodes: self.nodes,
            next: 0,
            ended: false,
            limit: if whole { usize::MAX } else { PART_BYTES },
        };
        let json = [(CONTENT_TYPE, HeaderValue::from_static("application/json"))];
        if whole {
            return match parts.part() {
                Ok(body) => (json, body).into_response(),
                Err(error) => server_error(&error),
            };
        }
        (json, Body::from_stream(futures_util::stream::iter(parts))).into_response()
    }
}

/// A [`NodesJson`]'s text, a part at a time: the object's head first, then
/// nodes until the part holds `limit` bytes, and after the last node the
/// object's end. A node that cannot be written (no node's fields can fail)
/// ends the body with an error: hyper then drops the connection, and the
/// client sees a broken response rather than a short list.
struct NodeParts<L> {
    /// Written and not yet handed on: the head, before the first part.
    pending: String,
    nodes: L,
    /// The next node to write.
    next: usize,
    ended: bool,
    limit: usize,
}

impl<L: NodeList> NodeParts<L> {
    /// The next part; the last one ends the object. After an error, or the
    /// last part, there is nothing more to write.
    fn part(&mut self) -> Result<Bytes, arbor_core::json::Error> {
        let mut part = match std::mem::take(&mut self.pending) {
            text if text.capacity() > 0 => text,
            _ => String::with_capacity(PART_CAPACITY),
        };
        while part.len() < self.limit && self.next < self.nodes.count() {
            if self.next > 0 {
                part.push(',');
            }
            if let Err(error) = self.nodes.view(self.next).write(&mut part) {
                self.ended = true;
                return Err(error);
            }
            self.next += 1;
        }
        if self.next == self.nodes.count() {
            part.push_str("]}");
            self.ended = true;
        }
        Ok(Bytes::from(part))
    }
}

impl<L: NodeList> Iterator for NodeParts<L> {
    type Item = Result<Bytes, arbor_core::json::Error>;

    fn next(&mut self) -> Option<Self::Item> {
        (!self.ended).then(|| self.part())
    }
}

/// A plain-text 500 for a response that could not be written.
fn server_error(error: &dyn std::fmt::Display) -> Response {
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        [(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"))],
        error.to_string(),
    )
        .into_response()
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arbor_core::tree::Tree;
    use arbor_core::{Message, Node};
    use axum::body::HttpBody;
    use serde_json::{Value, json};

    use super::*;
    use crate::views;

    /// A path of `count` messages of about 200 bytes each, and a branch
    /// off its second node (so some node has two children).
    fn conversation(count: usize) -> Vec<Node> {
        let mut list: Vec<Node> = Vec::new();
        for index in 0..count {
            let parent = list.last().map(|node: &Node| node.id.clone());
            let text = format!("message {index} \"quoted\" {}", "word ".repeat(38));
            list.push(Node::new(format!("m{index}"), "c1", parent, Message::user(text), 1_764_000_000_000));
        }
        if count > 1 {
            list.push(Node::new("branch", "c1", Some("m1".into()), Message::user("edited"), 1_764_000_000_001));
        }
        list
    }

    #[derive(Serialize)]
    struct Fields {
        head_id: &'static str,
        head_version: i64,
    }

    /// What the response must read as: the fields, and each node as
    /// `Node` serializes it with the ids of its children in the list.
    fn expected(list: &[Node]) -> Value {
        let messages: Vec<Value> = list
            .iter()
            .map(|node| {
                let mut value = serde_json::to_value(node).expect("serializes");
                let children = list.iter().filter(|child| child.parent_id.as_deref() == Some(node.id.as_str()));
                value["children"] = json!(children.map(|child| child.id.as_str()).collect::<Vec<_>>());
                value
            })
            .collect();
        json!({"head_id": "m1", "head_version": 7, "messages": messages})
    }

    /// The responses for the path of `count` nodes and for their tree
    /// with its branch: each one's length, if sent whole, what it read as,
    /// and what it must read as.
    async fn both(count: usize) -> [(Option<usize>, Value, Value); 2] {
        let list = conversation(count);
        let path = &list[..count];
        let (path_length, path_body) = respond(views::path(path.to_vec())).await;
        let (tree_length, tree_body) = respond(Arc::new(Tree::new(list.clone()))).await;
        [(path_length, path_body, expected(path)), (tree_length, tree_body, expected(&list))]
    }

    async fn respond(nodes: impl NodeList) -> (Option<usize>, Value) {
        let fields = Fields { head_id: "m1", head_version: 7 };
        let response = NodesJson { fields, nodes }.into_response();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()[CONTENT_TYPE], "application/json");
        // The length hyper sends as `content-length`, when the body knows it.
        let length = HttpBody::size_hint(response.body()).exact().map(|length| length as usize);
        let body = axum::body::to_bytes(response.into_body(), usize::MAX).await.expect("the body is read");
        if let Some(length) = length {
            assert_eq!(body.len(), length);
        }
        (length, serde_json::from_slice(&body).expect("the body is JSON"))
    }

    #[tokio::test]
    async fn a_short_list_is_sent_whole_with_its_length() {
        for count in [0, 1, 2, 100] {
            for (length, body, expected) in both(count).await {
                assert!(length.is_some(), "{count} nodes: sent whole");
                assert_eq!(body, expected, "{count} nodes");
            }
        }
    }

    #[tokio::test]
    async fn a_long_list_is_sent_in_parts_that_read_as_the_whole() {
        for (length, body, expected) in both(2_000).await {
            assert_eq!(length, None, "sent as it is written, without a length");
            assert_eq!(body, expected);
        }

        // About a part's size each, the last one shorter.
        let mut parts = NodeParts {
            pending: String::from("{\"messages\":["),
            nodes: Arc::new(Tree::new(conversation(2_000))),
            next: 0,
            ended: false,
            limit: PART_BYTES,
        };
        let sizes: Vec<usize> = parts.by_ref().map(|part| part.expect("written").len()).collect();
        assert!(sizes.len() > 5, "{sizes:?}");
        let node_bytes = 400;
        for &size in &sizes[..sizes.len() - 1] {
            assert!((PART_BYTES..PART_BYTES + node_bytes).contains(&size), "{sizes:?}");
        }
        assert!(sizes.last().is_some_and(|&last| last < PART_BYTES + node_bytes));
        assert!(parts.next().is_none(), "nothing after the end");
    }

    #[tokio::test]
    async fn fields_that_are_not_an_object_are_a_server_error() {
        let response = NodesJson { fields: [1, 2], nodes: views::path(conversation(3)) }.into_response();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
