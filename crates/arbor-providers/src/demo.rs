//! The built-in `demo` model: offline and deterministic, so a fresh install
//! shows the whole flow (streaming, usage, cost) with no provider key. It says
//! in every reply that it is the demo model, so nobody mistakes it for a real
//! one.

use std::time::Duration;

use arbor_core::tokens::estimate_messages;
use arbor_core::{ErrorCode, Message, ProviderError, Role, SharedMessage, Usage};
use futures_util::stream;

use crate::{ChatRequest, Chunk, ChunkStream, FinishReason, Provider};

/// The demo provider. `chunk_delay` paces the stream like a real model.
#[derive(Debug, Clone)]
pub struct DemoProvider {
    pub chunk_delay: Duration,
}

impl Default for DemoProvider {
    fn default() -> DemoProvider {
        DemoProvider { chunk_delay: Duration::from_millis(30) }
    }
}

/// The demo's reply to a conversation: it echoes the last user message.
pub fn demo_reply(messages: &[SharedMessage]) -> String {
    let last_user = messages
        .iter()
        .rev()
        .find(|message| message.role == Role::User)
        .and_then(|message| message.content.as_deref())
        .unwrap_or("");
    let shown: String = last_user.chars().take(200).collect();
    let ellipsis = if shown.len() < last_user.len() { "…" } else { "" };
    format!(
        "This is Arbor's built-in demo model, answering offline. You said: \"{shown}{ellipsis}\". \
         Configure a provider key (for example OPENAI_API_KEY) to talk to a real model."
    )
}

/// Splits text into chunks of a few words, as a model would stream them.
fn words_in_chunks(text: &str, words_per_chunk: usize) -> Vec<String> {
    let mut chunks = Vec::new();
    let mut current = String::new();
    let mut words = 0;
    for piece in text.split_inclusive(' ') {
        current.push_str(piece);
        words += 1;
        if words == words_per_chunk {
            chunks.push(std::mem::take(&mut current));
            words = 0;
        }
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

#[async_trait::async_trait]
impl Provider for DemoProvider {
    fn kind(&self) -> &'static str {
        "demo"
    }

    async fn stream(&self, request: ChatRequest) -> Result<ChunkStream, ProviderError> {
        if request.messages.is_empty() {
            return Err(ProviderError::new(ErrorCode::InvalidRequest, "the demo model needs at least one message"));
        }
        let reply = demo_reply(&request.messages);
        let system_tokens = request.system.as_deref().map_or(0, |system| estimate_messages(&[Message::system(system)]));
        let usage = Usage {
            input_tokens: estimate_messages(&request.messages) + system_tokens,
            output_tokens: arbor_core::tokens::estimate_from_chars(reply.len()),
            ..Usage::default()
        };
        let mut chunks: Vec<Chunk> = words_in_chunks(&reply, 3).into_iter().map(Chunk::Text).collect();
        chunks.push(Chunk::Finish(FinishReason::Stop));
        chunks.push(Chunk::Usage(usage));
        let delay = self.chunk_delay;
        let paced = stream::unfold((chunks.into_iter(), true), move |(mut rest, first)| async move {
            let chunk = rest.next()?;
            if !first && !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            Some((Ok(chunk), (rest, false)))
        });
        Ok(Box::pin(paced))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect_stream;

    #[tokio::test]
    async fn demo_streams_a_labelled_deterministic_reply_with_usage() {
        let provider = DemoProvider { chunk_delay: Duration::ZERO };
        let request = ChatRequest {
            model: "demo".into(),
            messages: SharedMessage::all([Message::user("hello there")]),
            ..ChatRequest::default()
        };
        let first = collect_stream(provider.stream(request.clone()).await.expect("starts")).await.expect("streams");
        let second = collect_stream(provider.stream(request).await.expect("starts")).await.expect("streams");
        assert_eq!(first, second, "deterministic");
        assert!(first.text.contains("demo model"));
        assert!(first.text.contains("hello there"));
        let usage = first.usage.expect("usage reported");
        assert!(usage.input_tokens > 0 && usage.output_tokens > 10);
        assert_eq!(first.finish, Some(FinishReason::Stop));
    }

    #[test]
    fn reply_comes_in_several_chunks() {
        let chunks = words_in_chunks("one two three four five six seven", 3);
        assert_eq!(chunks, vec!["one two three ", "four five six ", "seven"]);
    }
}
