//! A client-side reader for Server-Sent Events, for asserting what a viewer
//! of an Arbor stream saw.

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct SseEvent {
    pub id: Option<i64>,
    pub event: String,
    pub data: Value,
}

/// Parses a whole `text/event-stream` body (comments and keep-alives skipped).
pub fn parse_sse(text: &str) -> Vec<SseEvent> {
    let mut events = Vec::new();
    for block in text.replace("\r\n", "\n").split("\n\n") {
        let mut id = None;
        let mut event = String::from("message");
        let mut data = Vec::new();
        for line in block.lines() {
            if let Some(value) = line.strip_prefix("id:") {
                id = value.trim().parse().ok();
            } else if let Some(value) = line.strip_prefix("event:") {
                event = value.trim().to_string();
            } else if let Some(value) = line.strip_prefix("data:") {
                data.push(value.strip_prefix(' ').unwrap_or(value).to_string());
            }
        }
        if data.is_empty() {
            continue;
        }
        let joined = data.join("\n");
        let data = serde_json::from_str(&joined).unwrap_or(Value::String(joined));
        events.push(SseEvent { id, event, data });
    }
    events
}

/// Reads a live SSE response one event at a time.
pub struct SseReader {
    body: std::pin::Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    buffer: String,
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
}

impl SseReader {
    pub fn new(response: reqwest::Response) -> SseReader {
        let (status, headers) = (response.status().as_u16(), response.headers().clone());
        SseReader { body: Box::pin(response.bytes_stream()), buffer: String::new(), status, headers }
    }

    /// The next event, or `None` when the stream ended or `deadline` passed.
    pub async fn next(&mut self, deadline: std::time::Duration) -> Option<SseEvent> {
        use futures_util::StreamExt;
        let until = tokio::time::Instant::now() + deadline;
        loop {
            let normalized = self.buffer.replace("\r\n", "\n");
            if let Some(end) = normalized.find("\n\n") {
                let block = normalized[..end].to_string();
                self.buffer = normalized[end + 2..].to_string();
                if let Some(event) = parse_sse(&format!("{block}\n\n")).into_iter().next() {
                    return Some(event);
                }
                continue;
            }
            match tokio::time::timeout_at(until, self.body.next()).await {
                Ok(Some(Ok(bytes))) => self.buffer.push_str(&String::from_utf8_lossy(&bytes)),
                _ => return None,
            }
        }
    }

    /// Reads events until one named `name` (inclusive).
    pub async fn until(&mut self, name: &str, deadline: std::time::Duration) -> Vec<SseEvent> {
        let mut events = Vec::new();
        while let Some(event) = self.next(deadline).await {
            let last = event.event == name;
            events.push(event);
            if last {
                break;
            }
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ids_names_and_json_and_skips_comments() {
        let events = parse_sse(
            "id: 1\nevent: delta\ndata: {\"text\":\"hi\"}\n\n: keep-alive\n\nid: 2\nevent: done\ndata: {}\n\n",
        );
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].id, Some(1));
        assert_eq!(events[0].event, "delta");
        assert_eq!(events[0].data["text"], "hi");
        assert_eq!(events[1].event, "done");
    }
}
