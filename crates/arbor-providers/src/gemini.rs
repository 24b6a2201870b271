//! The Google Gemini adapter (`generateContent` and
//! `streamGenerateContent?alt=sse` under `{base}/models/{model}`).
//!
//! Going out, Arbor's messages become `contents` of `user` and `model` turns:
//! the system prompt goes to `systemInstruction`, tool calls become
//! `functionCall` parts (with the `thoughtSignature` Gemini gave them, sent
//! back verbatim — Gemini 3 refuses a tool loop without it), tool results
//! become `functionResponse` parts, and tool parameters are rewritten into
//! the OpenAPI subset Gemini's `parameters` field accepts ([`gemini_schema`]).
//! Coming back, each streamed `GenerateContentResponse` becomes [`Chunk`]s:
//! thought parts become thinking, a function call arrives whole (or, on
//! Vertex with streamed arguments, in `partialArgs` pieces that are
//! assembled here), and usage and the finish reason close the reply. The
//! wire types are private to this file; [`request_body`], [`StreamDecoder`],
//! [`decode_body`], [`decode_json_array_body`], [`response_chunks`] and
//! [`error_from_response`] are public so that fixture tests and mock servers
//! can drive each half on its own.

use std::time::Duration;

use arbor_core::json::Verbatim;
use arbor_core::message::ProviderOpaque;
use arbor_core::{ErrorCode, Message, Part, ProviderError, Role, SharedMessage, ToolStatus, Usage};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use hyper::header::{HeaderMap, HeaderName};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::decode::{self, Decode, Decoded};
use crate::http::{self, ErrorResponse, HttpClient, HttpRequest, HttpResponse, HttpTimeouts};
use crate::sse::{BodyError, sse_events};
use crate::written::{Elements, Kept};
use crate::{ChatRequest, Chunk, ChunkStream, Collected, FinishReason, Provider};

/// The provider kind, and the owner recorded on the thought signatures this
/// adapter produces and accepts back.
pub const KIND: &str = "gemini";
pub const DEFAULT_BASE_URL: &str = "https://generativelanguage.googleapis.com/v1beta";

/// How to reach the Gemini API.
#[derive(Clone)]
pub struct GeminiConfig {
    /// Up to and including the API version, e.g.
    /// `https://generativelanguage.googleapis.com/v1beta`.
    pub base_url: String,
    /// Sent as `x-goog-api-key` (a header, so the key stays out of URLs and
    /// their logs).
    pub api_key: Option<String>,
    pub timeouts: HttpTimeouts,
}

impl Default for GeminiConfig {
    fn default() -> GeminiConfig {
        GeminiConfig { base_url: DEFAULT_BASE_URL.into(), api_key: None, timeouts: HttpTimeouts::default() }
    }
}

// The key is a secret: never print it, not even in debug logs.
impl std::fmt::Debug for GeminiConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GeminiConfig")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("timeouts", &self.timeouts)
            .finish()
    }
}

/// The Gemini adapter. Cheap to share: the HTTP client pools connections.
#[derive(Debug, Clone)]
pub struct GeminiProvider {
    config: GeminiConfig,
    client: HttpClient,
    /// The headers every request carries: the content type and the key.
    headers: HeaderMap,
    /// The contents of recent long requests as written, shared by the
    /// provider's clones, so that what a request shares with an earlier
    /// one is not written again.
    written: Kept,
}

impl GeminiProvider {
    pub fn new(config: GeminiConfig) -> Result<GeminiProvider, ProviderError> {
        let client = HttpClient::new(&config.timeouts)?;
        let key = config.api_key.as_deref().map(|key| (HeaderName::from_static("x-goog-api-key"), key));
        let headers = http::request_headers(HeaderMap::new(), key)?;
        Ok(GeminiProvider { config, client, headers, written: Kept::shared() })
    }

    fn url(&self, model: &str, method: &str) -> String {
        // The API names models `models/x`; Arbor's registry says `x`.
        let model = model.strip_prefix("models/").unwrap_or(model);
        format!("{}/models/{model}:{method}", self.config.base_url.trim_end_matches('/'))
    }

    async fn send(&self, url: String, body: Vec<u8>) -> Result<HttpResponse, ProviderError> {
        // The model is part of the path, so the URL is made per request.
        let uri = http::endpoint(&url).map_err(|error| {
            ProviderError::new(ErrorCode::InvalidRequest, format!("{url:?} is not a valid URL: {error}"))
        })?;
        let request = HttpRequest { uri, headers: self.headers.clone(), body: body.into() };
        http::send(&self.client, request, error_from_response).await
    }
}

#[async_trait::async_trait]
impl Provider for GeminiProvider {
    fn kind(&self) -> &'static str {
        KIND
    }

    async fn stream(&self, request: ChatRequest) -> Result<ChunkStream, ProviderError> {
        let body = body_in(&self.written, &request)?;
        let url = self.url(&request.model, "streamGenerateContent?alt=sse");
        let response = self.send(url, body).await?;
        // Without `alt=sse` (a proxy may drop it) the same stream comes as
        // one JSON array; read whichever form arrived.
        let is_sse = response.content_type().is_none_or(|value| value.starts_with("text/event-stream"));
        let body = response.into_stream();
        Ok(if is_sse { decode_body(body) } else { decode_json_array_body(body) })
    }

    async fn complete(&self, request: ChatRequest) -> Result<Collected, ProviderError> {
        let body = body_in(&self.written, &request)?;
        let url = self.url(&request.model, "generateContent");
        let response = self.send(url, body).await?;
        let bytes = response.bytes().await?;
        let mut collected = Collected::default();
        for chunk in response_chunks(&bytes)? {
            collected.push(&chunk);
        }
        Ok(collected.finish())
    }
}

// ---------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct GenerateContentRequest<'a> {
    /// The JSON array of the contents.
    contents: Verbatim<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system_instruction: Option<SystemInstruction<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<WireTools<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    generation_config: Option<GenerationConfig>,
}

#[derive(Debug, Serialize)]
struct SystemInstruction<'a> {
    parts: Vec<WirePart<'a>>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct WireTools<'a> {
    function_declarations: Vec<FunctionDeclaration<'a>>,
}

#[derive(Debug, Serialize)]
struct FunctionDeclaration<'a> {
    name: &'a str,
    description: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<Value>,
}

#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
struct GenerationConfig {
    #[serde(skip_serializing_if = "Option::is_none")]
    max_output_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    thinking_config: Option<ThinkingConfig>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct ThinkingConfig {
    #[serde(skip_serializing_if = "Option::is_none")]
    thinking_budget: Option<u32>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    include_thoughts: bool,
}

#[derive(Debug, Serialize)]
struct Content<'a> {
    role: &'static str,
    parts: Vec<WirePart<'a>>,
}

/// Gemini's `Part`: one of its data fields, plus an optional signature.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
struct WirePart<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    inline_data: Option<InlineData<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    file_data: Option<FileData<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    function_call: Option<FunctionCall<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    function_response: Option<FunctionResponse<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    thought_signature: Option<&'a str>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct InlineData<'a> {
    mime_type: &'a str,
    data: &'a str,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct FileData<'a> {
    file_uri: &'a str,
    mime_type: &'a str,
}

#[derive(Debug, Serialize)]
struct FunctionCall<'a> {
    id: &'a str,
    name: &'a str,
    args: Value,
}

#[derive(Debug, Serialize)]
struct FunctionResponse<'a> {
    id: &'a str,
    name: &'a str,
    response: Value,
}

/// The request body Arbor sends for `request` (the same for streamed and
/// non-streamed calls; the URL differs), as JSON for tests and mocks: the
/// bytes the provider would send, written whole (nothing kept to reuse),
/// read back.
pub fn request_body(request: &ChatRequest) -> Result<Value, ProviderError> {
    serde_json::from_slice(&body_in(&Kept::alone(), request)?).map_err(http::not_encoded)
}

/// The body for `request`, reusing what `written` kept of the contents
/// before the current turn.
fn body_in(written: &Kept, request: &ChatRequest) -> Result<Vec<u8>, ProviderError> {
    let path = &request.messages;
    let current = current_turn(path);
    let sign = validates_signatures(&request.model);
    written.body(
        path,
        current,
        Elements::default().cut_at_starts(),
        |unwritten, elements| wire_contents(path, path.len() - unwritten.len(), current, sign, elements),
        |body, contents| arbor_core::json::write(body, &build_request(request, contents)),
    )
}

/// The request as sent: `contents` is the JSON array of its contents.
fn build_request<'a>(request: &'a ChatRequest, contents: &'a str) -> GenerateContentRequest<'a> {
    let thinking_config = request.reasoning.as_ref().map(|reasoning| match reasoning.budget_tokens {
        // A budget of 0 turns thinking off, so there are no thoughts to show.
        Some(budget) => ThinkingConfig { thinking_budget: Some(budget), include_thoughts: budget > 0 },
        // Reasoning asked for without a budget (an OpenAI-style effort):
        // let the model choose its budget, and show its thoughts.
        None => ThinkingConfig { thinking_budget: None, include_thoughts: true },
    });
    let generation_config = GenerationConfig {
        max_output_tokens: request.max_output_tokens,
        temperature: request.temperature,
        thinking_config,
    };
    let has_config = generation_config.max_output_tokens.is_some()
        || generation_config.temperature.is_some()
        || generation_config.thinking_config.is_some();
    let declarations: Vec<FunctionDeclaration<'_>> = request
        .tools
        .iter()
        .map(|tool| FunctionDeclaration {
            name: &tool.name,
            description: &tool.description,
            parameters: gemini_schema(&tool.parameters),
        })
        .collect();
    GenerateContentRequest {
        contents: Verbatim(contents),
        system_instruction: request
            .system
            .as_deref()
            .filter(|system| !system.is_empty())
            .map(|system| SystemInstruction { parts: vec![WirePart { text: Some(system), ..WirePart::default() }] }),
        tools: if declarations.is_empty() {
            Vec::new()
        } else {
            vec![WireTools { function_declarations: declarations }]
        },
        generation_config: has_config.then_some(generation_config),
    }
}

/// Which kind of turn a content is, for merging.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TurnKind {
    User,
    ToolResults,
    Model,
}

/// Appends Arbor's path, from the message at `from` on, to `elements` as
/// Gemini contents. Consecutive messages of one kind share a content (all
/// results of one round of calls must answer it together), but function
/// responses keep a content of their own, apart from user text, as Gemini's
/// own clients send them. So a content is written when the next one starts
/// (or at the end), and the text can be cut only there; and only up to the
/// current turn (which starts at `current`), whose model contents may be
/// signed ([`sign_foreign_call`]) while a later user message would leave
/// them as they are.
fn wire_contents<'a>(
    path: &'a [SharedMessage],
    from: usize,
    current: usize,
    sign: bool,
    elements: &mut Elements,
) -> Result<(), ProviderError> {
    // The content being filled: its kind, the message it starts with, and
    // its parts so far.
    let mut open: Option<(TurnKind, usize, Content<'a>)> = None;
    let write = |(kind, start, mut content): (TurnKind, usize, Content<'a>), elements: &mut Elements| {
        if sign && kind == TurnKind::Model && start >= current {
            sign_foreign_call(&mut content);
        }
        elements.push(&content)
    };
    for (index, message) in path.iter().enumerate().skip(from) {
        let (kind, parts) = match message.role {
            Role::User | Role::System => (TurnKind::User, user_parts(message)),
            Role::Tool => (TurnKind::ToolResults, vec![function_response_part(message, &path[..index])?]),
            Role::Assistant => (TurnKind::Model, model_parts(message)),
        };
        if !parts.is_empty() {
            match &mut open {
                Some((last, _, content)) if *last == kind => content.parts.extend(parts),
                _ => {
                    let role = if kind == TurnKind::Model { "model" } else { "user" };
                    if let Some(closed) = open.replace((kind, index, Content { role, parts })) {
                        write(closed, elements)?;
                        if index <= current {
                            elements.cut_before();
                        }
                    }
                }
            }
        }
        elements.end_message(false);
    }
    match open {
        Some(closed) => write(closed, elements),
        None => Ok(()),
    }
}

/// Where the current turn starts: after the last message that gives the
/// user's content a part (Gemini checks signatures only from there on).
fn current_turn(messages: &[SharedMessage]) -> usize {
    let user = |message: &SharedMessage| matches!(message.role, Role::User | Role::System);
    messages.iter().rposition(|message| user(message) && !user_parts(message).is_empty()).map_or(0, |last| last + 1)
}

/// The placeholder Google documents for function calls Gemini did not make
/// (a history from another provider, or calls injected by the client).
pub const FOREIGN_CALL_SIGNATURE: &str = "context_engineering_is_the_way_to_go";

/// Gemini 3 and later refuse a request whose current turn has a function
/// call without a thought signature; earlier models do not check.
fn validates_signatures(model: &str) -> bool {
    !(model.contains("gemini-1") || model.contains("gemini-2"))
}

/// A conversation that moved to Gemini in the middle of a tool loop carries
/// calls another provider made, with no signature. Only the current turn
/// (after the last user message) is checked, and only the first call of each
/// step, so the first call of each of its model contents gets the
/// placeholder.
fn sign_foreign_call(content: &mut Content<'_>) {
    if let Some(first_call) = content.parts.iter_mut().find(|part| part.function_call.is_some())
        && first_call.thought_signature.is_none()
    {
        first_call.thought_signature = Some(FOREIGN_CALL_SIGNATURE);
    }
}

fn user_parts(message: &Message) -> Vec<WirePart<'_>> {
    let mut parts = Vec::new();
    let images = message
        .parts
        .iter()
        .filter_map(|part| match part {
            Part::Image { url, data, mime_type, .. } => {
                image_part(url.as_deref(), data.as_deref(), mime_type.as_deref())
            }
            _ => None,
        })
        .collect::<Vec<_>>();
    if let Some(text) = message.content.as_deref() {
        // An empty text part is valid (and the only way to send an empty
        // prompt); next to an image it says nothing, so it is left out.
        if !text.is_empty() || images.is_empty() {
            parts.push(WirePart { text: Some(text), ..WirePart::default() });
        }
    }
    parts.extend(images);
    parts
}

fn image_part<'a>(url: Option<&'a str>, data: Option<&'a str>, mime_type: Option<&'a str>) -> Option<WirePart<'a>> {
    let inline = |mime_type: &'a str, data: &'a str| WirePart {
        inline_data: Some(InlineData { mime_type, data }),
        ..WirePart::default()
    };
    if let Some(data) = data {
        let mime_type = mime_type.unwrap_or_else(|| crate::anthropic::sniff_image_type(data));
        return Some(inline(mime_type, data));
    }
    let url = url?;
    if let Some((mime_type, data)) = crate::anthropic::parse_data_url(url) {
        return Some(inline(mime_type, data));
    }
    Some(WirePart {
        file_data: Some(FileData {
            file_uri: url,
            mime_type: mime_type.unwrap_or_else(|| mime_type_from_extension(url)),
        }),
        ..WirePart::default()
    })
}

/// `fileData` needs a mime type; a URL's extension is the best guess when
/// the media record has none.
fn mime_type_from_extension(url: &str) -> &'static str {
    let path = url.split(['?', '#']).next().unwrap_or(url).to_ascii_lowercase();
    match path.rsplit('.').next() {
        Some("png") => "image/png",
        Some("gif") => "image/gif",
        Some("webp") => "image/webp",
        Some("heic") => "image/heic",
        Some("heif") => "image/heif",
        _ => "image/jpeg",
    }
}

fn model_parts(message: &Message) -> Vec<WirePart<'_>> {
    // Only Gemini's own signatures mean anything to Gemini; thought summary
    // text is not sent back (it is a summary, not input the model needs).
    let mut signatures = message.parts.iter().filter_map(|part| match part {
        Part::Thinking { signature: Some(signature), .. } if signature.provider == KIND => {
            Some(signature.data.as_str())
        }
        _ => None,
    });
    let mut parts = Vec::new();
    if let Some(text) = message.content.as_deref().filter(|text| !text.is_empty()) {
        parts.push(WirePart { text: Some(text), thought_signature: signatures.next(), ..WirePart::default() });
    }
    // Signatures that came on empty text parts go back on empty text parts.
    for signature in signatures {
        parts.push(WirePart { text: Some(""), thought_signature: Some(signature), ..WirePart::default() });
    }
    for call in &message.tool_calls {
        let args = match &call.arguments {
            Value::Object(_) => call.arguments.clone(),
            Value::Null => json!({}),
            // `args` must be an object; keep what the model wrote visible.
            other => json!({ "arguments": other }),
        };
        parts.push(WirePart {
            function_call: Some(FunctionCall { id: &call.id, name: &call.name, args }),
            thought_signature: call
                .signature
                .as_ref()
                .filter(|signature| signature.provider == KIND)
                .map(|signature| signature.data.as_str()),
            ..WirePart::default()
        });
    }
    parts
}

/// `message`'s result as a function response. Gemini matches a response to
/// its call by name, so a result without a name borrows its call's, the
/// nearest call with its id among the `earlier` messages.
fn function_response_part<'a>(
    message: &'a Message,
    earlier: &'a [SharedMessage],
) -> Result<WirePart<'a>, ProviderError> {
    let id = message
        .tool_call_id
        .as_deref()
        .ok_or_else(|| ProviderError::new(ErrorCode::InvalidRequest, "a tool result message has no tool_call_id"))?;
    let call_name = || {
        let assistants = earlier.iter().rev().filter(|earlier| earlier.role == Role::Assistant);
        let calls = assistants.flat_map(|assistant| assistant.tool_calls.iter().rev());
        calls.filter(|call| call.id == id).map(|call| call.name.as_str()).next()
    };
    let name = message.tool_name.as_deref().or_else(call_name).ok_or_else(|| {
        ProviderError::new(
            ErrorCode::InvalidRequest,
            format!("the tool result for call {id} names no tool, and no earlier call has that id"),
        )
    })?;
    let content = message.content.as_deref().unwrap_or("");
    let failed = matches!(message.tool_status, Some(ToolStatus::Error | ToolStatus::Cancelled | ToolStatus::Denied));
    // `response` must be an object. Gemini reads an `output` key as the
    // function's output and an `error` key as its failure.
    let response = if failed {
        json!({ "error": content })
    } else {
        match serde_json::from_str::<Value>(content) {
            Ok(object @ Value::Object(_)) => object,
            _ => json!({ "output": content }),
        }
    };
    Ok(WirePart { function_response: Some(FunctionResponse { id, name, response }), ..WirePart::default() })
}

// ---------------------------------------------------------------------------
// Tool schemas
// ---------------------------------------------------------------------------

/// How deep `$ref`s are followed before a recursive schema is cut off.
const MAX_SCHEMA_DEPTH: usize = 12;

/// A JSON Schema rewritten into the OpenAPI 3.0 subset that Gemini's
/// function `parameters` accept, or `None` for a tool without parameters
/// (Gemini wants no `parameters` at all rather than an empty object).
///
/// Kept: `type` (a `["x", "null"]` array becomes `type` + `nullable`),
/// `description`, `enum` (strings only), `format` (only the ones Gemini
/// knows for the type), `properties`, `required` (only names that exist),
/// `items`, `anyOf` (`oneOf` is read as `anyOf`), `nullable`, and the
/// numeric, length and count bounds. `$ref`s into `$defs`/`definitions` are
/// inlined; `allOf` is merged. Everything else (`$schema`,
/// `additionalProperties`, `default`, `examples`, `patternProperties`,
/// `title`, `const`, ...) is dropped, because Gemini rejects the request
/// over a field it does not know.
pub fn gemini_schema(schema: &Value) -> Option<Value> {
    let converted = convert_schema(schema, schema, 0);
    let empty_object = converted.get("type").and_then(Value::as_str) == Some("object")
        && converted.get("properties").and_then(Value::as_object).is_none_or(Map::is_empty);
    (!empty_object).then_some(converted)
}

fn convert_schema(node: &Value, root: &Value, depth: usize) -> Value {
    let Some(node) = node.as_object() else {
        // `true` or `{}`-like "anything": Gemini needs a type, and a string
        // is the one any value can be written as.
        return json!({"type": "string"});
    };
    if depth > MAX_SCHEMA_DEPTH {
        return json!({"type": "object", "description": "(nested too deeply to describe)"});
    }
    // `$ref`: inline the definition, letting the referring node's own
    // keywords (a description, usually) win.
    if let Some(reference) = node.get("$ref").and_then(Value::as_str) {
        let mut merged = resolve_ref(reference, root).and_then(Value::as_object).cloned().unwrap_or_default();
        for (key, value) in node {
            if key != "$ref" {
                merged.insert(key.clone(), value.clone());
            }
        }
        return convert_schema(&Value::Object(merged), root, depth + 1);
    }
    if let Some(all_of) = node.get("allOf").and_then(Value::as_array) {
        let mut merged = node.clone();
        merged.remove("allOf");
        for member in all_of {
            let member = match member.get("$ref").and_then(Value::as_str) {
                Some(reference) => resolve_ref(reference, root).unwrap_or(member),
                None => member,
            };
            merge_schema(&mut merged, member);
        }
        return convert_schema(&Value::Object(merged), root, depth + 1);
    }

    let mut out = Map::new();
    let mut nullable = node.get("nullable").and_then(Value::as_bool) == Some(true);

    // Unions: `anyOf`/`oneOf`, with `null` members turned into `nullable`.
    if let Some(members) = node.get("anyOf").or_else(|| node.get("oneOf")).and_then(Value::as_array) {
        let mut kept: Vec<Value> = Vec::new();
        for member in members {
            if member.get("type").and_then(Value::as_str) == Some("null") {
                nullable = true;
            } else {
                kept.push(convert_schema(member, root, depth + 1));
            }
        }
        match kept.len() {
            0 => {
                out.insert("type".into(), json!("string"));
            }
            1 => {
                if let Some(Value::Object(only)) = kept.pop() {
                    out.extend(only);
                }
            }
            _ => {
                out.insert("anyOf".into(), Value::Array(kept));
            }
        }
    }

    let mut types: Vec<&str> = match node.get("type") {
        Some(Value::String(single)) => vec![single.as_str()],
        Some(Value::Array(many)) => many.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    if types.contains(&"null") {
        nullable = true;
        types.retain(|kind| *kind != "null");
        if types.is_empty() {
            types.push("string");
        }
    }
    let kind: Option<String> = match types.as_slice() {
        [] if !out.contains_key("type") && !out.contains_key("anyOf") => infer_type(node),
        [] => None,
        [single] => Some(single.to_ascii_lowercase()),
        several => {
            let members = several.iter().map(|kind| json!({"type": kind.to_ascii_lowercase()})).collect();
            out.insert("anyOf".into(), Value::Array(members));
            None
        }
    };
    if let Some(kind) = &kind {
        out.insert("type".into(), json!(kind));
    }
    let kind = kind.or_else(|| out.get("type").and_then(Value::as_str).map(String::from));

    if let Some(description) = node.get("description").and_then(Value::as_str) {
        out.insert("description".into(), json!(description));
    }
    convert_enum(node, kind.as_deref(), &mut out, &mut nullable);
    if let Some(format) = node.get("format").and_then(Value::as_str) {
        let allowed = match kind.as_deref() {
            Some("string") => ["enum", "date-time"].contains(&format),
            Some("number") => ["float", "double"].contains(&format),
            Some("integer") => ["int32", "int64"].contains(&format),
            _ => false,
        };
        if allowed {
            out.insert("format".into(), json!(format));
        }
    }
    if let Some(properties) = node.get("properties").and_then(Value::as_object) {
        let converted: Map<String, Value> =
            properties.iter().map(|(name, schema)| (name.clone(), convert_schema(schema, root, depth + 1))).collect();
        if let Some(required) = node.get("required").and_then(Value::as_array) {
            let required: Vec<Value> = required
                .iter()
                .filter(|name| name.as_str().is_some_and(|name| converted.contains_key(name)))
                .cloned()
                .collect();
            if !required.is_empty() {
                out.insert("required".into(), Value::Array(required));
            }
        }
        out.insert("properties".into(), Value::Object(converted));
    }
    match node.get("items") {
        Some(items @ Value::Object(_)) => {
            out.insert("items".into(), convert_schema(items, root, depth + 1));
        }
        // Tuples are not expressible; the first position's schema is the
        // closest Gemini can take.
        Some(Value::Array(positions)) => {
            let first = positions.first().cloned().unwrap_or(Value::Bool(true));
            out.insert("items".into(), convert_schema(&first, root, depth + 1));
        }
        _ if kind.as_deref() == Some("array") => {
            out.insert("items".into(), json!({"type": "string"}));
        }
        _ => {}
    }
    for bound in
        ["minimum", "maximum", "minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"]
    {
        if let Some(value) = node.get(bound).filter(|value| value.is_number()) {
            out.insert(bound.into(), value.clone());
        }
    }
    if nullable {
        out.insert("nullable".into(), json!(true));
    }
    Value::Object(out)
}

/// A schema without `type` still says what it is by its other keywords.
fn infer_type(node: &Map<String, Value>) -> Option<String> {
    let kind = if node.contains_key("properties") {
        "object"
    } else if node.contains_key("items") {
        "array"
    } else if let Some(values) = node.get("enum").and_then(Value::as_array) {
        match values.iter().find(|value| !value.is_null()) {
            Some(Value::Number(number)) if number.is_i64() || number.is_u64() => "integer",
            Some(Value::Number(_)) => "number",
            Some(Value::Bool(_)) => "boolean",
            _ => "string",
        }
    } else if let Some(constant) = node.get("const") {
        match constant {
            Value::Number(_) => "number",
            Value::Bool(_) => "boolean",
            _ => "string",
        }
    } else {
        "string"
    };
    Some(kind.into())
}

/// Gemini's `enum` lists strings. Other values are described in words
/// rather than lost; a `const` is a one-value enum.
fn convert_enum(node: &Map<String, Value>, kind: Option<&str>, out: &mut Map<String, Value>, nullable: &mut bool) {
    let values: Vec<Value> = match (node.get("enum"), node.get("const")) {
        (Some(Value::Array(values)), _) => values.clone(),
        (None, Some(constant)) => vec![constant.clone()],
        _ => return,
    };
    if values.iter().any(Value::is_null) {
        *nullable = true;
    }
    let values: Vec<&Value> = values.iter().filter(|value| !value.is_null()).collect();
    if kind == Some("string") && values.iter().all(|value| value.is_string()) {
        out.insert("enum".into(), Value::Array(values.into_iter().cloned().collect()));
        return;
    }
    let listed: Vec<String> = values.iter().map(|value| value.to_string()).collect();
    let note = format!("Allowed values: {}.", listed.join(", "));
    let description = match out.get("description").and_then(Value::as_str) {
        Some(text) => format!("{text} {note}"),
        None => note,
    };
    out.insert("description".into(), json!(description));
}

/// `#/$defs/Name` or `#/definitions/Name` (any JSON pointer into the root).
fn resolve_ref<'a>(reference: &str, root: &'a Value) -> Option<&'a Value> {
    let pointer = reference.strip_prefix('#')?;
    root.pointer(pointer)
}

/// Folds an `allOf` member into the schema that holds it.
fn merge_schema(into: &mut Map<String, Value>, member: &Value) {
    let Some(member) = member.as_object() else {
        return;
    };
    for (key, value) in member {
        match (key.as_str(), into.get_mut(key)) {
            ("properties", Some(Value::Object(existing))) => {
                if let Some(more) = value.as_object() {
                    existing.extend(more.clone());
                }
            }
            ("required", Some(Value::Array(existing))) => {
                if let Some(more) = value.as_array() {
                    existing.extend(more.iter().cloned());
                }
            }
            (_, Some(_)) => {}
            (_, None) => {
                into.insert(key.clone(), value.clone());
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct GenerateContentResponse {
    #[serde(default)]
    candidates: Vec<Candidate>,
    prompt_feedback: Option<PromptFeedback>,
    usage_metadata: Option<UsageMetadata>,
    response_id: Option<String>,
    /// An error reported inside a 200 stream.
    error: Option<GoogleError>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Candidate {
    content: Option<CandidateContent>,
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct CandidateContent {
    #[serde(default)]
    parts: Vec<ResponsePart>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ResponsePart {
    text: Option<String>,
    #[serde(default)]
    thought: bool,
    thought_signature: Option<String>,
    function_call: Option<ResponseFunctionCall>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ResponseFunctionCall {
    id: Option<String>,
    name: Option<String>,
    args: Option<Value>,
    #[serde(default)]
    partial_args: Vec<PartialArg>,
    #[serde(default)]
    will_continue: bool,
}

/// A piece of a streamed argument (Vertex AI `streamFunctionCallArguments`).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PartialArg {
    json_path: String,
    string_value: Option<String>,
    number_value: Option<f64>,
    bool_value: Option<bool>,
    null_value: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PromptFeedback {
    block_reason: Option<String>,
    block_reason_message: Option<String>,
}

#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(rename_all = "camelCase")]
struct UsageMetadata {
    prompt_token_count: Option<u64>,
    candidates_token_count: Option<u64>,
    thoughts_token_count: Option<u64>,
    cached_content_token_count: Option<u64>,
    tool_use_prompt_token_count: Option<u64>,
}

impl UsageMetadata {
    /// Gemini's prompt count already includes the cached part; thoughts are
    /// counted apart from the candidates, and Arbor's output is both.
    fn to_usage(self) -> Usage {
        let thoughts = self.thoughts_token_count.unwrap_or(0);
        Usage {
            input_tokens: self.prompt_token_count.unwrap_or(0) + self.tool_use_prompt_token_count.unwrap_or(0),
            output_tokens: self.candidates_token_count.unwrap_or(0) + thoughts,
            thinking_tokens: thoughts,
            cached_tokens: self.cached_content_token_count.unwrap_or(0),
            cache_write_tokens: 0,
        }
    }
}

#[derive(Debug, Deserialize)]
struct ErrorBody {
    error: GoogleError,
}

#[derive(Debug, Deserialize)]
struct GoogleError {
    #[serde(default)]
    code: Option<u16>,
    #[serde(default)]
    message: String,
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    details: Vec<Value>,
}

fn finish_reason(reason: &str, called_tools: bool) -> FinishReason {
    match reason {
        // Gemini says STOP after function calls too.
        "STOP" if called_tools => FinishReason::ToolCalls,
        "STOP" => FinishReason::Stop,
        "MAX_TOKENS" => FinishReason::Length,
        "SAFETY"
        | "PROHIBITED_CONTENT"
        | "RECITATION"
        | "BLOCKLIST"
        | "SPII"
        | "IMAGE_SAFETY"
        | "IMAGE_PROHIBITED_CONTENT" => FinishReason::ContentFilter,
        other => FinishReason::Other(other.to_ascii_lowercase()),
    }
}

fn signed(data: String) -> ProviderOpaque {
    ProviderOpaque { provider: KIND.into(), data }
}

fn unreadable(what: &str, error: &serde_json::Error) -> ProviderError {
    ProviderError::new(ErrorCode::StreamInterrupted, format!("the provider sent an unreadable {what}: {error}"))
}

/// A function call whose arguments are still streaming in.
#[derive(Debug)]
struct PartialCall {
    index: usize,
    args: Value,
    signature: Option<String>,
}

/// Turns `GenerateContentResponse`s into chunks, one response at a time.
/// Feed it each streamed response (or the one non-streamed response); call
/// [`StreamDecoder::finish`] when the body ends.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    calls: usize,
    partial: Option<PartialCall>,
    usage: Option<UsageMetadata>,
    finish: Option<String>,
    response_id: Option<String>,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// The chunks one response's JSON text carries.
    pub fn push(&mut self, data: &str) -> Result<Vec<Chunk>, ProviderError> {
        let response: GenerateContentResponse =
            serde_json::from_str(data).map_err(|error| unreadable("response", &error))?;
        self.push_response(response)
    }

    fn push_response(&mut self, response: GenerateContentResponse) -> Result<Vec<Chunk>, ProviderError> {
        if let Some(error) = response.error {
            return Err(map_error(None, error));
        }
        if let Some(usage) = response.usage_metadata {
            self.usage = Some(usage);
        }
        if self.response_id.is_none() {
            self.response_id = response.response_id;
        }
        let mut chunks = Vec::new();
        if response.candidates.is_empty()
            && let Some(reason) =
                response.prompt_feedback.as_ref().and_then(|feedback| feedback.block_reason.as_deref())
        {
            let explanation = response
                .prompt_feedback
                .as_ref()
                .and_then(|feedback| feedback.block_reason_message.as_deref())
                .unwrap_or("no reason given");
            return Err(ProviderError::new(
                ErrorCode::ContentFilter,
                format!("the prompt was blocked ({reason}): {explanation}"),
            ));
        }
        // Arbor asks for one candidate.
        if let Some(candidate) = response.candidates.into_iter().next() {
            for part in candidate.content.map(|content| content.parts).unwrap_or_default() {
                self.push_part(part, &mut chunks);
            }
            if let Some(reason) = candidate.finish_reason {
                self.finish = Some(reason);
            }
        }
        Ok(chunks)
    }

    fn push_part(&mut self, part: ResponsePart, chunks: &mut Vec<Chunk>) {
        if let Some(call) = part.function_call {
            self.push_function_call(call, part.thought_signature, chunks);
            return;
        }
        let text = part.text.unwrap_or_default();
        if part.thought {
            if !text.is_empty() {
                chunks.push(Chunk::Thinking(text));
            }
            if let Some(signature) = part.thought_signature {
                chunks.push(Chunk::ThinkingSignature(signed(signature)));
            }
            return;
        }
        // A signature on an answer part belongs to the model's reasoning:
        // it closes the thinking before the text, and goes back with it.
        if let Some(signature) = part.thought_signature {
            chunks.push(Chunk::ThinkingSignature(signed(signature)));
        }
        if !text.is_empty() {
            chunks.push(Chunk::Text(text));
        }
    }

    fn push_function_call(&mut self, call: ResponseFunctionCall, signature: Option<String>, chunks: &mut Vec<Chunk>) {
        let starts_new = call.name.is_some();
        if starts_new || !call.will_continue && call.partial_args.is_empty() {
            // A new call, or the empty `{}` that ends a streamed one.
            self.close_partial(chunks);
        }
        let Some(name) = call.name else {
            if let Some(partial) = &mut self.partial {
                for piece in call.partial_args {
                    apply_partial_arg(&mut partial.args, piece);
                }
            }
            return;
        };
        let index = self.calls;
        self.calls += 1;
        let id = call.id.unwrap_or_else(|| self.assign_id(index));
        chunks.push(Chunk::ToolCallStart { index, id, name });
        if call.will_continue {
            let mut args = call.args.unwrap_or_else(|| json!({}));
            for piece in call.partial_args {
                apply_partial_arg(&mut args, piece);
            }
            self.partial = Some(PartialCall { index, args, signature });
            return;
        }
        let args = call.args.unwrap_or_else(|| json!({}));
        chunks.push(Chunk::ToolCallArguments { index, fragment: args.to_string() });
        chunks.push(Chunk::ToolCallEnd { index, signature: signature.map(signed) });
    }

    fn close_partial(&mut self, chunks: &mut Vec<Chunk>) {
        if let Some(partial) = self.partial.take() {
            chunks.push(Chunk::ToolCallArguments { index: partial.index, fragment: partial.args.to_string() });
            chunks.push(Chunk::ToolCallEnd { index: partial.index, signature: partial.signature.map(signed) });
        }
    }

    /// Gemini (before 3) gives calls no ids; Arbor needs one to pair each
    /// call with its result. Derived from the response id, so that the
    /// same recorded reply always yields the same ids.
    fn assign_id(&self, index: usize) -> String {
        match &self.response_id {
            Some(response) => format!("call_{response}_{index}"),
            None => format!("call_{}_{index}", arbor_core::ids::new_id().replace('-', "")),
        }
    }

    /// The body ended: the usage and the finish reason close the reply. A
    /// stream that never said why it finished was cut off.
    pub fn finish(mut self) -> Result<Vec<Chunk>, ProviderError> {
        let mut chunks = Vec::new();
        self.close_partial(&mut chunks);
        let Some(reason) = self.finish else {
            return Err(ProviderError::new(
                ErrorCode::StreamInterrupted,
                "the provider's stream ended without a finish reason",
            ));
        };
        if let Some(usage) = self.usage {
            chunks.push(Chunk::Usage(usage.to_usage()));
        }
        chunks.push(Chunk::Finish(finish_reason(&reason, self.calls > 0)));
        Ok(chunks)
    }
}

/// Sets one streamed argument piece at its JSON path (`$.a.b`, `$.list[2]`,
/// `$['key']`); string pieces for the same path are appended.
fn apply_partial_arg(args: &mut Value, piece: PartialArg) {
    let mut target = args;
    for segment in json_path_segments(&piece.json_path) {
        target = match segment {
            PathSegment::Key(key) => {
                if !target.is_object() {
                    *target = json!({});
                }
                match target {
                    Value::Object(map) => map.entry(key).or_insert(Value::Null),
                    _ => return,
                }
            }
            PathSegment::Index(position) => {
                if !target.is_array() {
                    *target = json!([]);
                }
                match target {
                    Value::Array(items) => {
                        if items.len() <= position {
                            items.resize(position + 1, Value::Null);
                        }
                        &mut items[position]
                    }
                    _ => return,
                }
            }
        };
    }
    if let Some(text) = piece.string_value {
        match target {
            Value::String(existing) => existing.push_str(&text),
            other => *other = Value::String(text),
        }
    } else if let Some(number) = piece.number_value {
        *target = serde_json::Number::from_f64(number).map_or(Value::Null, Value::Number);
    } else if let Some(flag) = piece.bool_value {
        *target = Value::Bool(flag);
    } else if piece.null_value.is_some() {
        *target = Value::Null;
    }
}

enum PathSegment {
    Key(String),
    Index(usize),
}

fn json_path_segments(path: &str) -> Vec<PathSegment> {
    let mut segments = Vec::new();
    let mut rest = path.strip_prefix('$').unwrap_or(path);
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('.') {
            let end = after.find(['.', '[']).unwrap_or(after.len());
            segments.push(PathSegment::Key(after[..end].to_string()));
            rest = &after[end..];
        } else if let Some(after) = rest.strip_prefix("['") {
            let end = after.find("']").unwrap_or(after.len());
            segments.push(PathSegment::Key(after[..end].to_string()));
            rest = after.get(end + 2..).unwrap_or("");
        } else if let Some(after) = rest.strip_prefix('[') {
            let end = after.find(']').unwrap_or(after.len());
            if let Ok(position) = after[..end].parse() {
                segments.push(PathSegment::Index(position));
            }
            rest = after.get(end + 1..).unwrap_or("");
        } else {
            // Not a path this reader knows; stop rather than guess.
            break;
        }
    }
    segments
}

/// A non-streamed reply as the chunks a stream of it would have carried, so
/// that `complete` and `stream` fold through the same [`Collected`].
pub fn response_chunks(body: &[u8]) -> Result<Vec<Chunk>, ProviderError> {
    let response: GenerateContentResponse =
        serde_json::from_slice(body).map_err(|error| unreadable("response", &error))?;
    let mut decoder = StreamDecoder::new();
    let mut chunks = decoder.push_response(response)?;
    chunks.extend(decoder.finish()?);
    Ok(chunks)
}

/// Decodes a `streamGenerateContent?alt=sse` body into chunks. The stream
/// ends after the first error.
pub fn decode_body<S, E>(body: S) -> ChunkStream
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: BodyError + Send + 'static,
{
    let responses = sse_events(body).map(|event| event.and_then(|event| event.text().map(str::to_owned)));
    Box::pin(decode::drive(responses, StreamDecoder::new()))
}

/// Decodes the other form of `streamGenerateContent` (without `alt=sse`):
/// one JSON array whose elements arrive as the model writes them.
pub fn decode_json_array_body<S, E>(body: S) -> ChunkStream
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: BodyError + Send + 'static,
{
    let bytes = body.map(|item| item.map_err(BodyError::into_provider_error));
    let elements = decode::drive(bytes, JsonArraySplitter::default());
    Box::pin(decode::drive(elements, StreamDecoder::new()))
}

/// Response texts in, chunks out: the same decoder for both forms of a
/// streamed body.
impl Decode for StreamDecoder {
    type Piece = String;
    type Item = Chunk;

    fn feed(&mut self, text: String, out: &mut Decoded<Chunk>) {
        decode::items(self.push(&text), out);
    }

    fn end(self, out: &mut Decoded<Chunk>) {
        decode::items(self.finish(), out);
    }
}

/// Finds the elements of a top-level JSON array as its bytes arrive. Only
/// the structure is scanned here (brackets, strings, escapes, all ASCII, so
/// a cut inside a UTF-8 character is harmless); serde reads each element.
#[derive(Debug, Default)]
struct JsonArraySplitter {
    buffer: Vec<u8>,
    /// Where scanning resumes in `buffer`.
    scanned: usize,
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// Where the element being read starts in `buffer`.
    element_start: Option<usize>,
    opened: bool,
    closed: bool,
}

impl JsonArraySplitter {
    fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>, ProviderError> {
        self.buffer.extend_from_slice(bytes);
        let mut elements = Vec::new();
        let mut position = self.scanned;
        while position < self.buffer.len() {
            let byte = self.buffer[position];
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if byte == b'\\' {
                    self.escaped = true;
                } else if byte == b'"' {
                    self.in_string = false;
                }
            } else {
                match byte {
                    b'"' => self.in_string = true,
                    b'[' | b'{' => {
                        if self.depth == 0 {
                            if byte != b'[' || self.opened {
                                return Err(self.malformed());
                            }
                            self.opened = true;
                        } else if self.depth == 1 {
                            self.element_start = Some(position);
                        }
                        self.depth += 1;
                    }
                    b']' | b'}' => {
                        if self.depth == 0 {
                            return Err(self.malformed());
                        }
                        self.depth -= 1;
                        if self.depth == 1
                            && let Some(start) = self.element_start.take()
                        {
                            let text =
                                std::str::from_utf8(&self.buffer[start..=position]).map_err(|_| self.malformed())?;
                            elements.push(text.to_string());
                        } else if self.depth == 0 {
                            self.closed = true;
                        }
                    }
                    b',' | b' ' | b'\t' | b'\r' | b'\n' => {}
                    // Scalars inside elements; at the top level only
                    // objects are expected.
                    _ if self.depth >= 2 => {}
                    _ => return Err(self.malformed()),
                }
            }
            position += 1;
        }
        // Drop what has been read, keeping the element in progress.
        let keep_from = self.element_start.unwrap_or(position);
        self.buffer.drain(..keep_from);
        if let Some(start) = &mut self.element_start {
            *start -= keep_from;
        }
        self.scanned = position - keep_from;
        Ok(elements)
    }

    fn finish(&self) -> Result<(), ProviderError> {
        if self.closed {
            Ok(())
        } else {
            Err(ProviderError::new(
                ErrorCode::StreamInterrupted,
                "the provider's JSON stream ended before its closing bracket",
            ))
        }
    }

    fn malformed(&self) -> ProviderError {
        ProviderError::new(ErrorCode::StreamInterrupted, "the provider's JSON stream is not a JSON array of responses")
    }
}

/// Bytes in, element texts out: the framing step before [`StreamDecoder`].
impl Decode for JsonArraySplitter {
    type Piece = Bytes;
    type Item = String;

    fn feed(&mut self, bytes: Bytes, out: &mut Decoded<String>) {
        decode::items(self.push(&bytes), out);
    }

    fn end(self, out: &mut Decoded<String>) {
        decode::items(self.finish().map(|()| Vec::new()), out);
    }
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// The error an HTTP failure stands for: the body's `error.status` decides,
/// the HTTP status is the fallback, and the provider's message is kept. A
/// rate limit's wait comes from `retry-after` when present, else from the
/// body's `RetryInfo`.
pub fn error_from_response(response: &ErrorResponse) -> ProviderError {
    // `streamGenerateContent` without `alt=sse` wraps errors in an array.
    // (Read as a value first: serde would read a one-element array as the
    // struct itself, field by position, and lose the message.)
    let parsed = serde_json::from_str::<Value>(&response.body).and_then(|value| {
        let value = match value {
            Value::Array(mut items) if !items.is_empty() => items.swap_remove(0),
            other => other,
        };
        serde_json::from_value::<ErrorBody>(value)
    });
    let (error, retry_delay) = match parsed {
        Ok(body) => {
            let delay = retry_delay(&body.error.details);
            (map_error(Some(response.status), body.error), delay)
        }
        Err(_) => (ProviderError::new(crate::http::status_code(response.status), response.fallback_message()), None),
    };
    ProviderError {
        status: Some(response.status),
        retry_after: crate::http::retry_after(&response.headers).or(retry_delay),
        ..error
    }
}

fn map_error(status: Option<u16>, error: GoogleError) -> ProviderError {
    let status = status.or(error.code);
    let code = match error.status.as_deref() {
        Some("INVALID_ARGUMENT") if crate::http::mentions_context_length(&error.message) => {
            ErrorCode::ContextLengthExceeded
        }
        // Gemini answers a bad key with a 400, not a 401.
        Some("INVALID_ARGUMENT") if api_key_invalid(&error) => ErrorCode::Authentication,
        Some("INVALID_ARGUMENT" | "OUT_OF_RANGE") => ErrorCode::InvalidRequest,
        // Billing not enabled, or the free tier not offered in the region:
        // no retry helps.
        Some("FAILED_PRECONDITION") => ErrorCode::Permission,
        Some("UNAUTHENTICATED") => ErrorCode::Authentication,
        Some("PERMISSION_DENIED") => ErrorCode::Permission,
        Some("NOT_FOUND") => ErrorCode::NotFound,
        Some("RESOURCE_EXHAUSTED") => ErrorCode::RateLimit,
        Some("UNAVAILABLE") if error.message.to_ascii_lowercase().contains("overloaded") => ErrorCode::Overloaded,
        Some("UNAVAILABLE" | "INTERNAL" | "UNKNOWN" | "ABORTED" | "CANCELLED") => ErrorCode::ProviderUnavailable,
        Some("DEADLINE_EXCEEDED") => ErrorCode::Timeout,
        _ => status.map_or(ErrorCode::ProviderUnavailable, crate::http::status_code),
    };
    let message = if error.message.is_empty() {
        error.status.unwrap_or_else(|| "the provider reported an error".into())
    } else {
        error.message
    };
    ProviderError::new(code, message)
}

fn api_key_invalid(error: &GoogleError) -> bool {
    error.details.iter().any(|detail| detail.get("reason").and_then(Value::as_str) == Some("API_KEY_INVALID"))
        || error.message.contains("API key not valid")
}

/// `RetryInfo.retryDelay` from the details, e.g. `"34.4s"`.
fn retry_delay(details: &[Value]) -> Option<Duration> {
    details
        .iter()
        .filter(|detail| {
            detail.get("@type").and_then(Value::as_str).is_some_and(|kind| kind.ends_with("google.rpc.RetryInfo"))
        })
        .find_map(|detail| detail.get("retryDelay").and_then(Value::as_str))
        .and_then(|delay| delay.trim().strip_suffix('s'))
        .and_then(|seconds| seconds.parse::<f64>().ok())
        .and_then(|seconds| Duration::try_from_secs_f64(seconds).ok())
}

#[cfg(test)]
mod tests {
    use arbor_core::ToolCall;

    use super::*;

    /// A long conversation's turns, one after another, with tool loops
    /// whose calls another provider made (so the current turn's are signed
    /// with the placeholder, and only while they are current), results that
    /// name no tool, runs that merge into one content and a message that
    /// writes nothing: each body equals the one a provider that keeps
    /// nothing writes, and a turn writes only from the last content it
    /// shares with the request before, up to its current turn.
    #[test]
    fn a_long_conversations_bodies_are_written_as_if_whole_and_only_their_new_turns_are() {
        // Its own list, which no other test pushes its paths out of.
        let keeping =
            GeminiProvider { written: Kept::alone(), ..GeminiProvider::new(GeminiConfig::default()).expect("made") };
        let loop_of = |label: String| -> Vec<Message> {
            let calls: Vec<ToolCall> = (0..2)
                .map(|n| ToolCall {
                    id: format!("{label}-{n}"),
                    name: format!("look{n}"),
                    arguments: json!({"n": n}),
                    signature: None,
                })
                .collect();
            let asking = Message { tool_calls: calls.clone(), content: None, ..Message::assistant("") };
            let results = calls.iter().map(|call| Message {
                tool_name: None,
                ..Message::tool_result(call, ToolStatus::Success, r#"{"seen":true}"#)
            });
            [asking].into_iter().chain(results).collect()
        };
        let exchange = |index: usize| -> Vec<Message> {
            let mut turn = vec![Message::user(format!("question {index}"))];
            turn.extend(loop_of(format!("c{index}")));
            crate::written::tests::answer(index, &mut turn);
            turn
        };
        let request = |messages: &[SharedMessage]| ChatRequest {
            model: "gemini-3-pro-preview".into(),
            messages: messages.to_vec(),
            ..ChatRequest::default()
        };
        let check = |messages: &[SharedMessage], label: &str| -> usize {
            let whole = body_in(&Kept::alone(), &request(messages)).expect("body");
            let body = body_in(&keeping.written, &request(messages)).expect("body");
            assert_eq!(String::from_utf8(body).unwrap(), String::from_utf8(whole).unwrap(), "{label}");
            let value = request_body(&request(messages)).expect("body");
            let parts: Vec<&Value> = value["contents"]
                .as_array()
                .expect("contents")
                .iter()
                .flat_map(|content| content["parts"].as_array().expect("parts"))
                .collect();
            let names = parts.iter().filter_map(|part| part["functionResponse"]["name"].as_str());
            assert!(names.clone().count() > 0 && names.clone().all(|name| name.starts_with("look")), "{label}");
            parts.iter().filter(|part| part["thoughtSignature"] == FOREIGN_CALL_SIGNATURE).count()
        };

        let mut trunk: Vec<SharedMessage> = SharedMessage::all((0..12).flat_map(exchange));
        trunk.push(SharedMessage::from(Message::user("go on")));
        assert_eq!(check(&trunk, "first turn"), 0, "no call is in the current turn");
        trunk.extend(SharedMessage::all([Message::assistant("reply"), Message::user("next")]));
        check(&trunk, "grown by a reply and a question");
        assert!(keeping.written.reusable(&trunk) >= trunk.len() - 2, "all but the end kept");

        let mut looping = trunk.clone();
        looping.extend(SharedMessage::all(loop_of("now".into())));
        assert_eq!(check(&looping, "a tool loop"), 1, "the current turn's call is signed");
        let mut ended = looping.clone();
        ended.extend(SharedMessage::all([Message::assistant("done"), Message::user("thanks")]));
        assert_eq!(check(&ended, "the loop ended by a user message"), 0, "no longer current: not signed");
        assert_eq!(check(&looping, "back into the loop, on another branch"), 1, "current again");
        let mut twice = looping.clone();
        twice.extend(SharedMessage::all(loop_of("again".into())));
        assert_eq!(check(&twice, "a second step"), 2);

        crate::written::tests::check_variations(
            &trunk,
            |path, label| {
                check(path, label);
            },
            |_| (),
        );
    }

    #[test]
    fn json_paths_set_nested_values_and_append_strings() {
        let mut args = json!({});
        let piece = |path: &str, text: &str| PartialArg {
            json_path: path.into(),
            string_value: Some(text.into()),
            number_value: None,
            bool_value: None,
            null_value: None,
        };
        apply_partial_arg(&mut args, piece("$.location", "San "));
        apply_partial_arg(&mut args, piece("$.location", "Francisco"));
        apply_partial_arg(&mut args, piece("$.trip.stops[1]", "Oakland"));
        apply_partial_arg(&mut args, piece("$['odd key']", "x"));
        apply_partial_arg(
            &mut args,
            PartialArg {
                json_path: "$.days".into(),
                string_value: None,
                number_value: Some(3.0),
                bool_value: None,
                null_value: None,
            },
        );
        assert_eq!(
            args,
            json!({
                "location": "San Francisco",
                "trip": {"stops": [null, "Oakland"]},
                "odd key": "x",
                "days": 3.0
            })
        );
    }

    #[test]
    fn the_array_splitter_survives_brackets_in_strings() {
        let mut splitter = JsonArraySplitter::default();
        let body = br#"[{"a": "[}\"{"}, {"b": [1, {"c": 2}]}]"#;
        let mut elements = Vec::new();
        for byte in body {
            elements.extend(splitter.push(&[*byte]).expect("valid"));
        }
        assert_eq!(elements, vec![r#"{"a": "[}\"{"}"#, r#"{"b": [1, {"c": 2}]}"#]);
        assert!(splitter.finish().is_ok());
        let mut cut = JsonArraySplitter::default();
        cut.push(b"[{\"a\": 1}, {\"b\"").expect("valid so far");
        assert_eq!(cut.finish().map_err(|error| error.code), Err(ErrorCode::StreamInterrupted));
    }

    #[test]
    fn retry_delay_reads_protobuf_durations() {
        let details = vec![json!({"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "34.4s"})];
        assert_eq!(retry_delay(&details), Some(Duration::from_millis(34_400)));
        assert_eq!(retry_delay(&[]), None);
    }

    /// A result without a name takes its call's: the nearest earlier call
    /// with its id, in a long path written whole or only from where the
    /// kept text ends; with no such call the request is refused, naming the
    /// call, before anything is sent.
    #[test]
    fn a_result_without_a_name_takes_its_calls_or_is_refused() {
        let keeping =
            GeminiProvider { written: Kept::alone(), ..GeminiProvider::new(GeminiConfig::default()).expect("made") };
        let call =
            |name: &str| ToolCall { id: "same".into(), name: name.into(), arguments: json!({}), signature: None };
        let unnamed = Message { tool_name: None, ..Message::tool_result(&call("x"), ToolStatus::Success, "ok") };
        let asking = |name: &str| Message { tool_calls: vec![call(name)], content: None, ..Message::assistant("") };
        let request = |messages: &[SharedMessage]| ChatRequest {
            model: "gemini-2.5-flash".into(),
            messages: messages.to_vec(),
            ..ChatRequest::default()
        };
        let names = |messages: &[SharedMessage]| -> Vec<String> {
            let body = body_in(&keeping.written, &request(messages)).expect("body");
            assert_eq!(body, body_in(&Kept::alone(), &request(messages)).expect("body"), "as if written whole");
            let value: Value = serde_json::from_slice(&body).expect("json");
            let contents = value["contents"].as_array().expect("contents").iter();
            let parts = contents.flat_map(|content| content["parts"].as_array().expect("parts").iter());
            parts.filter_map(|part| part["functionResponse"]["name"].as_str().map(str::to_string)).collect()
        };

        let mut path = SharedMessage::all([Message::user("go"), asking("first"), unnamed.clone()]);
        path.extend(SharedMessage::all((0..70).map(|index| Message::user(format!("filler {index}")))));
        assert_eq!(names(&path), ["first"]);
        path.extend(SharedMessage::all([asking("second"), unnamed.clone(), Message::user("again")]));
        assert_eq!(names(&path), ["first", "second"], "each result its nearest call's name");
        assert!(keeping.written.reusable(&path) > 70, "the start was not written again");

        let orphan = SharedMessage::all([Message::user("go"), unnamed]);
        let error = body_in(&Kept::alone(), &request(&orphan)).expect_err("refused");
        assert_eq!(error.code, ErrorCode::InvalidRequest);
        assert!(error.message.contains("call same names no tool"), "{}", error.message);
    }

    #[test]
    fn model_names_may_carry_the_models_prefix() {
        let provider = GeminiProvider::new(GeminiConfig::default()).expect("client");
        assert_eq!(
            provider.url("models/gemini-2.5-flash", "generateContent"),
            "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash:generateContent"
        );
    }
}
