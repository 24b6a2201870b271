//! A direct reader for the chunk that makes up nearly all of a stream: a
//! choice whose delta holds text, or nothing, or a finish reason; and for
//! the chunk that ends most streams, the usage counts.
//!
//! serde_json reads such a chunk (~200–350 bytes, most of them fields
//! Arbor ignores: id, model, fingerprint) in ~6,000 instructions, through
//! its visitors and a `Value` for the text; a turn of 20 chunks spent more
//! on that than on any other single thing outside SQLite
//! (bench/profile.md). This reader walks the bytes once and builds the same
//! [`WireChunk`] in ~3,500 (the benchmark's chunks, callgrind). It reads
//! only what it is sure of and answers `None` for
//! anything else — tool calls, reasoning, a refusal, an error, an
//! escaped key, a duplicate field, malformed JSON — and the caller then asks
//! serde_json, whose answer (a chunk or an error) is the one that counts.
//! So the two never disagree: where this one answers, it answers what
//! serde_json would (the tests check every recorded chunk and mutations of
//! them).
//!
//! Within one stream, most servers send chunk after chunk that differ only
//! in their text: the same id, model, timestamp and fields around it. A
//! [`Template`] keeps the last text chunk read whole, with where its text
//! string stands; a chunk with the same bytes before that string and the
//! same bytes after it is that chunk with other text, because a string
//! value is one token to a JSON parser and changing it changes nothing
//! else. Such a chunk is read in two comparisons and one string: with the
//! benchmark's 20-chunk replies the decoder's instructions per turn fell
//! from ~103k to ~44k (callgrind). A chunk that differs anywhere else (a
//! field with a fresh value each time, such as OpenAI's `obfuscation`) is
//! read whole, as before, and a stream whose chunks keep differing stops
//! being compared ([`StreamReader`]).

use serde_json::Value;

use super::{WireChoice, WireChunk, WireCompletionDetails, WireDelta, WirePromptDetails, WireUsage};

/// Nesting this reader follows inside ignored values; deeper is serde's.
const MAX_DEPTH: usize = 16;

/// Consecutive chunks a stream's template may fail to match before the
/// stream is read whole for good: a server that puts a fresh value in
/// every chunk (OpenAI's `obfuscation`) would otherwise pay a comparison
/// and a copy of each chunk for nothing.
const MISSES_BEFORE_GIVING_UP: u8 = 4;

/// Reads one stream's chunks: by difference from its last text chunk
/// while that keeps matching, else whole.
#[derive(Debug, Default)]
pub(super) struct StreamReader {
    template: Option<Template>,
    misses: u8,
}

impl StreamReader {
    /// The chunk, when it is plain; `None` when serde_json must decide.
    #[cfg(test)]
    pub(super) fn read(&mut self, data: &str) -> Option<WireChunk> {
        match self.retext(data) {
            Some(found) => self.template.as_ref().map(|template| template.chunk(found)),
            None => self.read_unmatched(data),
        }
    }

    /// A chunk [`StreamReader::retext`] did not match, read whole (and
    /// kept as the template when it is a text chunk); `None` when
    /// serde_json must decide.
    pub(super) fn read_unmatched(&mut self, data: &str) -> Option<WireChunk> {
        if self.misses >= MISSES_BEFORE_GIVING_UP {
            return read(data);
        }
        read_keeping(data, &mut self.template)
    }

    /// The chunk's text and finish reason, when it is the last text chunk
    /// read with other text: everything else it says is known, so the
    /// caller needs no [`WireChunk`] (a few hundred bytes, built and moved
    /// for each chunk of a stream). `None`, counted as a miss, when it
    /// differs elsewhere; [`StreamReader::read_unmatched`] then reads it.
    pub(super) fn retext(&mut self, data: &str) -> Option<Retext> {
        if self.misses >= MISSES_BEFORE_GIVING_UP {
            return None;
        }
        let template = self.template.as_ref()?;
        match template.retext(data) {
            Some(found) => {
                self.misses = 0;
                Some(found)
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }
}

/// What a chunk matching its stream's template says: text, for choice 0,
/// and the template's finish reason (a plain text chunk has none).
#[derive(Debug, PartialEq)]
pub(super) struct Retext {
    pub(super) text: String,
    pub(super) finish_reason: Option<String>,
}

/// The chunk, when it is plain; `None` when serde_json must decide.
fn read(data: &str) -> Option<WireChunk> {
    read_whole(data).map(|(chunk, _)| chunk)
}

/// Like [`read`]; a chunk read whose choice 0 has text also becomes
/// `template`, for the chunks after it.
fn read_keeping(data: &str, template: &mut Option<Template>) -> Option<WireChunk> {
    let (chunk, text) = read_whole(data)?;
    if let Some((start, end)) = text {
        let kept = template.get_or_insert_with(Template::default);
        kept.data.clear();
        kept.data.push_str(data);
        (kept.start, kept.end) = (start, end);
        let choice = chunk.choices.0.as_ref().expect("text is only kept for choice 0");
        (kept.index, kept.finish_reason) = (choice.index, choice.finish_reason.clone());
    }
    Some(chunk)
}

/// The chunk and, when choice 0's delta holds text and no other string
/// was read as text, where that text's string stands (from its opening
/// quote to past its closing one).
fn read_whole(data: &str) -> Option<(WireChunk, Option<(usize, usize)>)> {
    let mut reader = Reader { text: data, bytes: data.as_bytes(), at: 0, texts: 0, text_at: (0, 0) };
    // Filled in place: the structs are a few hundred bytes, and returning
    // each level by value copied them up the chain, chunk after chunk.
    let mut chunk = WireChunk::default();
    reader.chunk(&mut chunk)?;
    reader.space();
    if reader.at != reader.bytes.len() {
        return None;
    }
    // One text string, and the choice kept has text: it is that string
    // (another choice's text would make two, or leave choice 0 without).
    let kept_text = chunk
        .choices
        .0
        .as_ref()
        .and_then(|choice| choice.delta.as_ref())
        .is_some_and(|delta| matches!(delta.content, Some(Value::String(_))));
    // A chunk that also counts usage is no template: a chunk matching it
    // is read as text and a finish reason alone.
    let text = (reader.texts == 1 && kept_text && chunk.usage.is_none()).then_some(reader.text_at);
    Some((chunk, text))
}

/// A plain chunk whose choice 0 has text, read whole: the pattern for the
/// chunks after it (see the module's documentation).
#[derive(Debug, Default)]
struct Template {
    data: String,
    /// The text's string: its opening quote, and the byte after its
    /// closing one.
    start: usize,
    end: usize,
    /// What else the chunk said (a plain chunk says nothing more).
    index: Option<u64>,
    finish_reason: Option<String>,
}

impl Template {
    /// The chunk, when `data` is this one with other text; `None` when it
    /// must be read whole.
    #[cfg(test)]
    fn read(&self, data: &str) -> Option<WireChunk> {
        self.retext(data).map(|found| self.chunk(found))
    }

    /// What [`Template::retext`] found, as the chunk serde_json reads.
    #[cfg(test)]
    fn chunk(&self, Retext { text, finish_reason }: Retext) -> WireChunk {
        let delta = WireDelta { content: Some(Value::String(text)), ..WireDelta::default() };
        let choice = WireChoice { index: self.index, delta: Some(delta), finish_reason, ..WireChoice::default() };
        WireChunk { choices: super::FirstChoice(Some(choice)), ..WireChunk::default() }
    }

    /// What the chunk says, when `data` is this one with other text;
    /// `None` when it must be read whole.
    fn retext(&self, data: &str) -> Option<Retext> {
        let (bytes, pattern) = (data.as_bytes(), self.data.as_bytes());
        if !bytes.starts_with(&pattern[..self.start]) {
            return None;
        }
        let mut reader = Reader { text: data, bytes, at: self.start, texts: 0, text_at: (0, 0) };
        let (raw, escaped) = reader.raw_string()?;
        if bytes[reader.at..] != pattern[self.end..] {
            return None;
        }
        let text = if escaped { reader.unescape_last(raw)? } else { raw.to_owned() };
        Some(Retext { text, finish_reason: self.finish_reason.clone() })
    }
}

struct Reader<'a> {
    text: &'a str,
    bytes: &'a [u8],
    at: usize,
    /// Text strings read (a delta's `content`), and where the last stands.
    texts: u32,
    text_at: (usize, usize),
}

/// Fields a struct knows, each allowed once (serde refuses a duplicate).
#[derive(Default)]
struct Seen(u8);

impl Seen {
    fn first(&mut self, bit: u8) -> Option<()> {
        let new = self.0 & bit == 0;
        self.0 |= bit;
        new.then_some(())
    }
}

impl<'a> Reader<'a> {
    fn chunk(&mut self, chunk: &mut WireChunk) -> Option<()> {
        let mut seen = Seen::default();
        self.object(|reader, key| match key {
            "choices" => seen.first(1).and_then(|()| reader.choices(&mut chunk.choices.0)),
            "usage" => seen.first(2).and_then(|()| reader.usage(&mut chunk.usage)),
            // Errors are serde's; absent or null they are None.
            "error" => seen.first(4).and_then(|()| reader.null()),
            _ => reader.skip(0),
        })
    }

    /// Keeps the first choice with index 0 (or none) in `first`.
    fn choices(&mut self, first: &mut Option<WireChoice>) -> Option<()> {
        self.list(|reader| {
            if first.is_some() {
                // An alternative after the one kept: read, then dropped.
                return reader.choice(&mut WireChoice::default());
            }
            let choice = first.insert(WireChoice::default());
            reader.choice(choice)?;
            if choice.index.unwrap_or(0) != 0 {
                *first = None;
            }
            Some(())
        })
    }

    fn choice(&mut self, choice: &mut WireChoice) -> Option<()> {
        let mut seen = Seen::default();
        self.object(|reader, key| match key {
            "index" => {
                seen.first(1)?;
                choice.index = if reader.null().is_some() { None } else { Some(reader.index()?) };
                Some(())
            }
            "delta" => {
                seen.first(2)?;
                if reader.null().is_some() {
                    choice.delta = None;
                    Some(())
                } else {
                    reader.delta(choice.delta.insert(WireDelta::default()))
                }
            }
            "finish_reason" => {
                seen.first(4)?;
                choice.finish_reason = if reader.null().is_some() { None } else { Some(reader.string()?) };
                Some(())
            }
            "message" => seen.first(8).and_then(|()| reader.null()),
            _ => reader.skip(0),
        })
    }

    fn delta(&mut self, delta: &mut WireDelta) -> Option<()> {
        let mut seen = Seen::default();
        self.object(|reader, key| match key {
            "content" => {
                seen.first(1)?;
                if reader.null().is_none() {
                    let start = reader.at;
                    delta.content = Some(Value::String(reader.string()?));
                    reader.texts += 1;
                    reader.text_at = (start, reader.at);
                }
                Some(())
            }
            "reasoning_content" => seen.first(2).and_then(|()| reader.null()),
            "reasoning" => seen.first(4).and_then(|()| reader.null()),
            "refusal" => seen.first(8).and_then(|()| reader.null()),
            "tool_calls" => seen.first(16).and_then(|()| reader.null()),
            "thought_signature" => seen.first(32).and_then(|()| reader.null()),
            _ => reader.skip(0),
        })
    }

    /// `{ "key": value, ... }`, each value read by `field`.
    fn object(&mut self, mut field: impl FnMut(&mut Self, &'a str) -> Option<()>) -> Option<()> {
        self.expect(b'{')?;
        if self.next_is(b'}') {
            return Some(());
        }
        loop {
            let key = self.key()?;
            self.expect(b':')?;
            field(self, key)?;
            if !self.next_is(b',') {
                return self.expect(b'}');
            }
        }
    }

    /// `[ value, ... ]`, each value read by `element`.
    fn list(&mut self, mut element: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.expect(b'[')?;
        if self.next_is(b']') {
            return Some(());
        }
        loop {
            element(self)?;
            if !self.next_is(b',') {
                return self.expect(b']');
            }
        }
    }

    /// Reads past any JSON value, checking it as serde_json would.
    fn skip(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.space();
        match *self.bytes.get(self.at)? {
            b'{' => self.object(|reader, _| reader.skip(depth + 1)),
            b'[' => self.list(|reader| reader.skip(depth + 1)),
            b'"' => match self.raw_string()? {
                // serde_json checks the escapes of a string it ignores.
                (raw, true) => self.unescape_last(raw).map(drop),
                (_, false) => Some(()),
            },
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => self.number().map(drop),
        }
    }

    /// `null`, consumed; `None` (nothing consumed) for anything else.
    fn null(&mut self) -> Option<()> {
        self.space();
        self.literal(b"null")
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let found = self.bytes.get(self.at..self.at + word.len())? == word;
        found.then(|| self.at += word.len())
    }

    /// `usage`: null, or counts that are each null or a plain integer
    /// (anything else, a float or a negative count, is serde's call). The
    /// last chunk of nearly every stream; serde_json read it in ~4,000
    /// instructions after this reader had given up on it halfway.
    fn usage(&mut self, usage: &mut Option<WireUsage>) -> Option<()> {
        if self.null().is_some() {
            *usage = None;
            return Some(());
        }
        let counts = usage.insert(WireUsage::default());
        let mut seen = Seen::default();
        self.object(|reader, key| {
            let (bit, count) = match key {
                "prompt_tokens" => (1, &mut counts.prompt_tokens),
                "completion_tokens" => (2, &mut counts.completion_tokens),
                "total_tokens" => (4, &mut counts.total_tokens),
                "prompt_cache_hit_tokens" => (8, &mut counts.prompt_cache_hit_tokens),
                "prompt_tokens_details" => {
                    seen.first(16)?;
                    counts.prompt_tokens_details =
                        reader.details("cached_tokens")?.map(|cached_tokens| WirePromptDetails { cached_tokens });
                    return Some(());
                }
                "completion_tokens_details" => {
                    seen.first(32)?;
                    counts.completion_tokens_details = reader
                        .details("reasoning_tokens")?
                        .map(|reasoning_tokens| WireCompletionDetails { reasoning_tokens });
                    return Some(());
                }
                _ => return reader.skip(0),
            };
            seen.first(bit)?;
            *count = reader.count()?;
            Some(())
        })
    }

    /// A details object of `usage`: `None` when not sure, `Some(None)` for
    /// null, else the one count kept (`field`) as [`Reader::count`] reads it.
    fn details(&mut self, field: &str) -> Option<Option<Option<u64>>> {
        if self.null().is_some() {
            return Some(None);
        }
        let (mut kept, mut seen) = (None, false);
        self.object(|reader, key| {
            if key != field {
                return reader.skip(0);
            }
            if std::mem::replace(&mut seen, true) {
                return None;
            }
            kept = reader.count()?;
            Some(())
        })?;
        Some(Some(kept))
    }

    /// A token count: null, or a non-negative integer that fits a u64.
    fn count(&mut self) -> Option<Option<u64>> {
        if self.null().is_some() { Some(None) } else { self.index().map(Some) }
    }

    /// A choice's index: a non-negative integer that fits a u64.
    fn index(&mut self) -> Option<u64> {
        let (digits, integer) = self.number()?;
        // A minus sign or too many digits fail to parse: serde's call then.
        if integer { digits.parse().ok() } else { None }
    }

    /// A JSON number's text, and whether it is a plain integer.
    fn number(&mut self) -> Option<(&'a str, bool)> {
        self.space();
        let start = self.at;
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.peek()? {
            b'0' => self.at += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        let mut integer = true;
        if self.peek() == Some(b'.') {
            self.at += 1;
            self.one_or_more_digits()?;
            integer = false;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            self.one_or_more_digits()?;
            integer = false;
        }
        // Only ASCII was consumed: both ends are char boundaries.
        Some((&self.text[start..self.at], integer))
    }

    fn one_or_more_digits(&mut self) -> Option<()> {
        let start = self.at;
        self.digits();
        (self.at > start).then_some(())
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|byte| byte.is_ascii_digit()) {
            self.at += 1;
        }
    }

    /// An object key: a string without escapes (serde would unescape one;
    /// such a key is left to it).
    fn key(&mut self) -> Option<&'a str> {
        match self.raw_string()? {
            (text, false) => Some(text),
            (_, true) => None,
        }
    }

    /// A string value, unescaped.
    fn string(&mut self) -> Option<String> {
        let (raw, escaped) = self.raw_string()?;
        if escaped { self.unescape_last(raw) } else { Some(raw.to_owned()) }
    }

    /// The string `raw_string` just read (`raw`, ending at the closing
    /// quote before `at`) with its escapes resolved by serde_json itself, so
    /// an escape JSON does not have, or a surrogate without its pair, fails
    /// here exactly as it fails there.
    fn unescape_last(&self, raw: &str) -> Option<String> {
        let quoted = &self.text[self.at - raw.len() - 2..self.at];
        serde_json::from_str(quoted).ok()
    }

    /// A string's text between its quotes, still escaped, and whether it
    /// holds escapes. Control characters are not allowed in it.
    fn raw_string(&mut self) -> Option<(&'a str, bool)> {
        self.expect(b'"')?;
        let (bytes, start) = (self.bytes, self.at);
        let mut at = start;
        let mut escaped = false;
        // Eight bytes at a time: the strings are short (keys, ids, a few
        // words of text), too short for a vectorised search to pay for its
        // setup, and a word's first special byte is found exactly.
        loop {
            while let Some(&word) = bytes[at..].first_chunk::<8>() {
                let found = arbor_core::json::special_bytes(u64::from_le_bytes(word));
                if found != 0 {
                    at += (found.trailing_zeros() / 8) as usize;
                    break;
                }
                at += 8;
            }
            match *bytes.get(at)? {
                b'"' => break,
                b'\\' => {
                    // The backslash and the character it escapes (\u's
                    // digits are checked when unescaping).
                    escaped = true;
                    at += 2;
                }
                0..0x20 => return None,
                // Only in the last seven bytes of the input.
                _ => at += 1,
            }
        }
        self.at = at + 1;
        // Both ends are quotes (ASCII), so both are char boundaries.
        Some((&self.text[start..at], escaped))
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        self.next_is(byte).then_some(())
    }

    /// Consumes `byte` (after whitespace) if it comes next.
    fn next_is(&mut self, byte: u8) -> bool {
        self.space();
        let found = self.peek() == Some(byte);
        if found {
            self.at += 1;
        }
        found
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            self.at += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Both readers on one chunk: where this one answers, serde_json must
    /// answer the same chunk.
    fn agree(data: &str) -> bool {
        let Some(plain) = read(data) else { return false };
        let serde: WireChunk = serde_json::from_str(data)
            .unwrap_or_else(|error| panic!("plain read a chunk serde refuses ({error}): {data}"));
        assert_eq!(plain, serde, "the readers disagree on {data}");
        true
    }

    fn recorded_chunks() -> &'static [String] {
        static CHUNKS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
        CHUNKS.get_or_init(|| recorded_streams().concat())
    }

    /// The data of every event in the recorded OpenAI and compatible
    /// streams, stream by stream, as the stream decoder is given it, in a
    /// fixed order (so proptest's cases name the same chunk on every
    /// machine).
    fn recorded_streams() -> Vec<Vec<String>> {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/providers");
        let mut streams: Vec<_> = ["openai", "openai-compatible"]
            .iter()
            .filter_map(|folder| std::fs::read_dir(format!("{root}/{folder}")).ok())
            .flat_map(|entries| entries.flatten().map(|entry| entry.path()))
            .filter(|path| path.extension().is_some_and(|extension| extension == "sse"))
            .collect();
        streams.sort();
        streams
            .iter()
            .map(|path| {
                let body = std::fs::read(path).unwrap();
                crate::sse::decode_chunked(&body, &[])
                    .into_iter()
                    .filter_map(Result::ok)
                    .map(|event| event.text().expect("recorded streams are UTF-8").trim().to_owned())
                    .filter(|data| data.starts_with('{'))
                    .collect()
            })
            .collect()
    }

    /// A stream's chunks read by difference from the last text chunk where
    /// that answers, else whole: the template alone, never giving up as
    /// [`StreamReader`] does, so every chunk is compared. Where the
    /// template answers, serde_json must answer the same; returns how often
    /// it did.
    fn read_by_difference(chunks: &[String]) -> usize {
        let mut template = None;
        let mut by_difference = 0;
        for data in chunks {
            if let Some(chunk) = template.as_ref().and_then(|template: &Template| template.read(data)) {
                let serde: WireChunk = serde_json::from_str(data)
                    .unwrap_or_else(|error| panic!("a chunk serde refuses was read by difference ({error}): {data}"));
                assert_eq!(chunk, serde, "reading by difference disagrees on {data}");
                by_difference += 1;
            } else {
                read_keeping(data, &mut template);
            }
        }
        by_difference
    }

    /// A stream like the benchmark's mock and most compatible servers send:
    /// the same fields in every chunk, the text aside.
    fn uniform_stream(texts: &[&str]) -> Vec<String> {
        texts
            .iter()
            .map(|text| {
                format!(
                    r#"{{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{{"index":0,"delta":{{"content":{text}}},"logprobs":null,"finish_reason":null}}]}}"#
                )
            })
            .collect()
    }

    #[test]
    fn recorded_streams_read_by_difference_as_serde_reads_them() {
        let by_difference: usize = recorded_streams().iter().map(|chunks| read_by_difference(chunks)).sum();
        // Several compatible servers repeat every other field; OpenAI's
        // own chunks each carry a fresh `obfuscation` and are read whole.
        assert!(by_difference > 20, "only {by_difference} recorded chunks were read by difference");
    }

    #[test]
    fn only_the_text_may_differ() {
        let stream = uniform_stream(&[
            r#""Hello""#,
            r#"" wor\\\"ld\u00e9""#,
            r#""""#,
            "null",
            "5",
            r#"["a"]"#,
            r#""a","content":"b""#,
            r#""\ud83d""#,
            "\"a\u{1}b\"",
            r#"" again""#,
        ]);
        let mut template = None;
        read_keeping(&stream[0], &mut template);
        let template = template.expect("a text chunk is a template");
        let text =
            |data: &str| template.read(data).map(|chunk| chunk.choices.0.unwrap().delta.unwrap().content.unwrap());
        assert_eq!(text(&stream[1]), Some(Value::String(" wor\\\"ld\u{e9}".into())));
        assert_eq!(text(&stream[2]), Some(Value::String(String::new())));
        // Not a string, two strings, a string serde refuses: read whole.
        for data in &stream[3..9] {
            assert_eq!(text(data), None, "read by difference: {data}");
        }
        // Hello, then by difference the next two and the last (the chunks
        // between are no template: text null, a number, a list, ...).
        assert_eq!(read_by_difference(&stream), 3);
        // Anything else changed: an id, a finish reason, trailing text.
        for changed in [
            stream[9].replace("chatcmpl-1", "chatcmpl-2"),
            stream[9].replace(r#""finish_reason":null"#, r#""finish_reason":"stop""#),
            format!("{} ", stream[9]),
        ] {
            assert_eq!(text(&changed), None, "read by difference: {changed}");
        }
    }

    #[test]
    fn a_stream_that_never_repeats_itself_is_read_whole() {
        // Each chunk carries a fresh value after its text, as OpenAI's do.
        let chunks: Vec<String> = (0..10)
            .map(|n| format!(r#"{{"choices":[{{"index":0,"delta":{{"content":"t{n}"}}}}],"obfuscation":"{n}"}}"#))
            .collect();
        let mut reader = StreamReader::default();
        for data in &chunks {
            assert_eq!(reader.read(data), serde_json::from_str(data).ok(), "{data}");
        }
        assert_eq!(reader.misses, MISSES_BEFORE_GIVING_UP, "the template was still compared");
        // A uniform stream keeps its template, a miss or two included.
        let mut reader = StreamReader::default();
        let mut uniform = uniform_stream(&[r#""a""#, r#""b""#]);
        uniform.insert(1, r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#.into());
        uniform.extend(uniform_stream(&[r#""c""#, r#""d""#, r#""e""#]));
        for data in &uniform {
            assert_eq!(reader.read(data), serde_json::from_str(data).ok(), "{data}");
        }
        assert_eq!(reader.misses, 0);
    }

    #[test]
    fn only_choice_zeros_text_makes_a_template() {
        for data in [
            // Another choice's text; two texts; no text.
            r#"{"choices":[{"index":1,"delta":{"content":"other"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"mine"}},{"index":1,"delta":{"content":"other"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
        ] {
            let mut template = None;
            assert!(read_keeping(data, &mut template).is_some());
            assert!(template.is_none(), "a template from {data}");
        }
    }

    #[test]
    fn recorded_text_chunks_read_as_serde_reads_them() {
        let chunks = recorded_chunks();
        assert!(chunks.len() > 100, "the recorded streams were not found ({} chunks)", chunks.len());
        let plain = chunks.iter().filter(|chunk| agree(chunk)).count();
        // Most recorded chunks are text deltas; the rest (tool calls,
        // reasoning, usage) are serde's.
        assert!(plain * 2 > chunks.len(), "only {plain} of {} chunks were read directly", chunks.len());
    }

    #[test]
    fn recorded_usage_reads_as_serde_reads_it() {
        let usage: Vec<_> = recorded_chunks().iter().filter(|chunk| chunk.contains(r#""usage":{"#)).collect();
        assert!(usage.len() >= 5, "the recorded streams' usage chunks were not found");
        for chunk in usage {
            assert!(agree(chunk), "not read directly: {chunk}");
        }
        // Counts and details null, absent or empty; other fields skipped.
        for data in [
            r#"{"choices":[],"usage":{"prompt_tokens":null,"prompt_tokens_details":null,"completion_tokens_details":{}}}"#,
            r#"{"choices":[],"usage":{"total_tokens":3,"cost":1.5e-3,"prompt_tokens_details":{"audio_tokens":[1]}}}"#,
            r#"{"choices":[],"usage":{"prompt_cache_hit_tokens":18446744073709551615}}"#,
        ] {
            assert!(agree(data), "not read directly: {data}");
        }
    }

    #[test]
    fn a_text_chunk_that_counts_usage_is_no_template() {
        let with_usage = r#"{"choices":[{"index":0,"delta":{"content":"a"}}],"usage":{"prompt_tokens":1}}"#;
        let mut template = None;
        assert!(read_keeping(with_usage, &mut template).is_some_and(|chunk| chunk.usage.is_some()));
        assert!(template.is_none(), "a chunk matching it would lose its usage");
    }

    #[test]
    fn text_escapes_and_finish_reasons_read_whole() {
        let chunk = read(
            r#"{"id":"x","created":1,"choices":[{"index":0,"delta":{"role":"assistant","content":"a\"b\\\n\u00e9\ud83d\ude00/\/"},"logprobs":null,"finish_reason":null}],"usage":null}"#,
        )
        .unwrap();
        let delta = chunk.choices.0.as_ref().unwrap().delta.as_ref().unwrap();
        assert_eq!(delta.content, Some(Value::String("a\"b\\\né😀//".into())));
        let end = read(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#).unwrap();
        assert_eq!(end.choices.0.unwrap().finish_reason.as_deref(), Some("stop"));
    }

    #[test]
    fn what_it_is_not_sure_of_is_left_to_serde() {
        for data in [
            // Tool calls, reasoning, a refusal, usage, an error.
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"refusal":"no"}}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":1.0}}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":-1}}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":1,"prompt_tokens":2}}"#,
            r#"{"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":1,"cached_tokens":1}}}"#,
            r#"{"choices":[],"usage":[]}"#,
            r#"{"error":{"message":"overloaded"}}"#,
            // Content as a list of parts; a whole message.
            r#"{"choices":[{"index":0,"delta":{"content":[{"type":"text","text":"a"}]}}]}"#,
            r#"{"choices":[{"index":0,"message":{"content":"a"}}]}"#,
            // A duplicate field, an escaped key, a lone surrogate, a raw
            // control character, a bad number, trailing text, null choices.
            r#"{"choices":[{"index":0,"delta":{"content":"a","content":"b"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"c\u006fntent":"a"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"\ud83d"}}]}"#,
            "{\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\u{1}b\"}}]}",
            r#"{"created":01,"choices":[]}"#,
            r#"{"choices":[{"index":1.0,"delta":{}}]}"#,
            r#"{"choices":[]} x"#,
            r#"{"choices":null}"#,
        ] {
            assert!(read(data).is_none(), "read directly: {data}");
        }
    }

    #[test]
    fn choice_zero_is_the_one_kept() {
        let chunk = read(
            r#"{"choices":[{"index":1,"delta":{"content":"other"}},{"delta":{"content":"mine"}},{"index":0,"delta":{"content":"late"}}]}"#,
        )
        .unwrap();
        let delta = chunk.choices.0.unwrap().delta.unwrap();
        assert_eq!(delta.content, Some(Value::String("mine".into())));
        assert!(agree(r#"{"choices":[{"index":2,"delta":{"content":"x"}}]}"#));
    }

    proptest! {
        /// Any edit of a recorded chunk — a byte replaced by one that means
        /// something in JSON, or a span cut out — is read the same by both,
        /// or left to serde.
        #[test]
        fn mutated_chunks_never_disagree(
            pick in any::<prop::sample::Index>(),
            at in any::<prop::sample::Index>(),
            cut in 0usize..8,
            byte in prop::sample::select(b"\"\\{}[],:0-.eE un\x01".to_vec()),
        ) {
            let chunks = recorded_chunks();
            let chunk = pick.get(chunks);
            let mut bytes = chunk.as_bytes().to_vec();
            let at = at.index(bytes.len());
            if cut == 0 {
                bytes[at] = byte;
            } else {
                bytes.drain(at..(at + cut).min(bytes.len()));
            }
            if let Ok(data) = String::from_utf8(bytes) {
                // Read whole, and by difference from the chunk it was.
                let mut template = None;
                read_keeping(chunk, &mut template);
                let by_difference = template.and_then(|template| template.read(&data));
                for plain in [read(&data), by_difference].into_iter().flatten() {
                    let serde = serde_json::from_str::<WireChunk>(&data);
                    prop_assert!(serde.is_ok(), "plain read a chunk serde refuses: {}", data);
                    prop_assert_eq!(plain, serde.unwrap());
                }
            }
        }
    }
}
