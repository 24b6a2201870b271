//! The JSON of a long conversation's messages, kept from one turn to the
//! next.
//!
//! Every turn sends the whole path from the root to the new message, so a
//! conversation of thousands of messages wrote all of them again for each
//! turn: ~800 instructions a message in OpenAI's wire form, most of what a
//! turn deep in a long conversation spends (`bench/treeprofile.sh`). A
//! request's messages are the tree's own nodes ([`SharedMessage`]), which
//! are never changed in place, and an adapter writes each message from
//! itself alone. So what one request wrote stays right for the next as far
//! as the two paths hold the same nodes, and the next turn writes only the
//! rest: the reply and the new message, or, on another branch, what comes
//! after the fork.
//!
//! Only paths of [`LEAST_MESSAGES`] or more are kept (a short
//! conversation's turns keep nothing), at most [`MOST_PATHS`] of them and
//! [`BUDGET_BYTES`] of text in all, the least recently used dropped first.
//! The limits are the process's, whatever the number of providers: every
//! provider keeps its paths in one list ([`Kept::shared`]), and takes back
//! only its own, since two providers may write the same messages
//! differently. A kept path holds its messages, so their nodes stay in
//! memory with it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use arbor_core::{ProviderError, SharedMessage};
use serde::Serialize;

/// Paths shorter than this are written whole every time.
pub(crate) const LEAST_MESSAGES: usize = 64;
/// Paths kept at most.
pub(crate) const MOST_PATHS: usize = 64;
/// Text kept at most, over all paths.
pub(crate) const BUDGET_BYTES: usize = 16 << 20;

/// A JSON array being written: `[`, the elements that come before the
/// path's (the head: a system prompt, say), then the path's messages'
/// elements, and where each message's elements end.
#[derive(Debug)]
pub(crate) struct Elements {
    text: String,
    /// Where the head ends.
    head: usize,
    /// For each message written, the length of `text` after its elements,
    /// or `None` where the text cannot be cut: what comes next depends on
    /// what came before (a tool result's images wait for the end of its run).
    ends: Vec<Option<usize>>,
    /// Whether `ends` are recorded: only for a path that may be kept.
    recording: bool,
    /// Whether a message's end is a cut only because the next message
    /// started something new there (set by [`Elements::cut_before`]): then
    /// it is one only while that next message is shared too.
    cuts_at_starts: bool,
}

impl Default for Elements {
    fn default() -> Elements {
        // Room for a short conversation's messages, so that its array is
        // not moved to larger buffers as it grows.
        let mut text = String::with_capacity(1024);
        text.push('[');
        Elements { text, head: 1, ends: Vec::new(), recording: false, cuts_at_starts: false }
    }
}

impl Elements {
    /// Appends one element.
    pub(crate) fn push<T: ?Sized + Serialize>(&mut self, element: &T) -> Result<(), ProviderError> {
        if self.text.len() > 1 {
            self.text.push(',');
        }
        arbor_core::json::write(&mut self.text, element).map_err(crate::http::not_encoded)
    }

    /// Closes a message's elements; `cut` says whether the next message's
    /// can start from nothing.
    pub(crate) fn end_message(&mut self, cut: bool) {
        if self.recording {
            self.ends.push(cut.then_some(self.text.len()));
        }
    }

    /// An array whose text can be cut only where a message starts
    /// something new (an adapter that merges messages into one element).
    pub(crate) fn cut_at_starts(self) -> Elements {
        Elements { cuts_at_starts: true, ..self }
    }

    /// The text so far ends where the message being written starts
    /// something new: the previous message's end is a cut.
    pub(crate) fn cut_before(&mut self) {
        let end = self.text.len();
        // Nothing is recorded for a path that is not kept.
        if let Some(last) = self.ends.last_mut() {
            *last = Some(end);
        }
    }

    /// `use_array` given the whole array, closed.
    pub(crate) fn with_array<R>(&mut self, use_array: impl FnOnce(&str) -> R) -> R {
        self.text.push(']');
        let result = use_array(&self.text);
        self.text.pop();
        result
    }

    /// The head's text, `[` included.
    fn head(&self) -> &str {
        &self.text[..self.head]
    }

    /// Keeps the head and the first `messages` messages' elements, ending
    /// at `end`.
    fn truncate(&mut self, messages: usize, end: usize) {
        self.ends.truncate(messages);
        self.text.truncate(end);
    }
}

/// What was written for one path: its messages and their elements.
#[derive(Debug)]
pub(crate) struct Written {
    /// The provider that wrote it ([`Kept`]).
    owner: u64,
    /// The messages whose elements are in `elements`, held so that they
    /// are compared by where they are held ([`SharedMessage::same`]): the
    /// place of a message kept here cannot be taken by another.
    messages: Vec<SharedMessage>,
    elements: Elements,
}

impl Written {
    /// What nothing is written for yet but `head` (the array's elements
    /// before the path's); for a path that may be kept, where each message
    /// ends is recorded.
    fn starting(owner: u64, head: Elements, path: &[SharedMessage]) -> Written {
        let head_end = head.text.len();
        let recording = path.len() >= LEAST_MESSAGES;
        let ends = if recording { Vec::with_capacity(path.len()) } else { Vec::new() };
        Written { owner, messages: Vec::new(), elements: Elements { head: head_end, ends, recording, ..head } }
    }

    /// How many of the messages kept here start `path` too, no more than
    /// `settled` of them, cut back to where the text can be cut, and where
    /// their text ends.
    fn reusable(&self, path: &[SharedMessage], settled: usize) -> (usize, usize) {
        let shared = self.messages.iter().zip(&path[..settled.min(path.len())]);
        let mut shared = shared.take_while(|(kept, asked)| kept.same(asked)).count();
        if self.elements.cuts_at_starts {
            // A cut made by the message after it holds only while that
            // message is the same.
            shared = shared.saturating_sub(1);
        }
        let mut ends = self.elements.ends[..shared].iter().enumerate().rev();
        ends.find_map(|(index, end)| Some((index + 1, (*end)?))).unwrap_or((0, self.elements.head))
    }

    /// The messages of `path` left to write.
    fn unwritten<'a>(&self, path: &'a [SharedMessage]) -> &'a [SharedMessage] {
        &path[self.messages.len()..]
    }
}

/// Where in `paths` the kept path for `path` is: the one `owner` wrote
/// that starts with the same message, for a path long enough to be kept.
fn kept_for(paths: &[Written], owner: u64, path: &[SharedMessage]) -> Option<usize> {
    let first = path.first().filter(|_| path.len() >= LEAST_MESSAGES)?;
    paths.iter().position(|kept| kept.owner == owner && kept.messages.first().is_some_and(|kept| kept.same(first)))
}

/// One provider's paths, kept in a list ([`WrittenPaths`]) and taken back
/// only by the provider that wrote them.
#[derive(Debug, Clone)]
pub(crate) struct Kept {
    paths: Arc<WrittenPaths>,
    owner: u64,
}

impl Kept {
    /// A provider's paths in the process's one list: the limits hold for
    /// all providers together.
    pub(crate) fn shared() -> Kept {
        static PATHS: LazyLock<Arc<WrittenPaths>> = LazyLock::new(Arc::default);
        Kept { paths: PATHS.clone(), owner: next_owner() }
    }

    /// Paths kept apart from every provider's: a body written whole
    /// (nothing was kept before it), or a test's own.
    pub(crate) fn alone() -> Kept {
        Kept { paths: Arc::default(), owner: next_owner() }
    }

    /// A request body whose messages are `path`: `head` and the messages
    /// a kept path shares with it as they were written, the rest appended
    /// by `write_messages`, the array closed and given to `write_request`,
    /// which writes the request around it into a buffer of its size.
    ///
    /// Only the first `settled` messages of `path` may be taken as kept:
    /// those whose text this request writes as any other would (an adapter
    /// that writes the current turn's messages differently says where that
    /// turn starts).
    pub(crate) fn body(
        &self,
        path: &[SharedMessage],
        settled: usize,
        head: Elements,
        write_messages: impl FnOnce(&[SharedMessage], &mut Elements) -> Result<(), ProviderError>,
        write_request: impl FnOnce(&mut String, &str) -> Result<(), serde_json::Error>,
    ) -> Result<Vec<u8>, ProviderError> {
        let mut written = self.paths.take(self.owner, path, settled, head);
        write_messages(written.unwritten(path), &mut written.elements)?;
        let body = written.elements.with_array(|messages| {
            // The messages are most of the body.
            let mut body = String::with_capacity(messages.len() + 512);
            write_request(&mut body, messages).map_err(crate::http::not_encoded)?;
            Ok::<_, ProviderError>(body.into_bytes())
        })?;
        self.paths.keep(written, path);
        Ok(body)
    }

    /// How many messages of `path` this provider has written already.
    #[cfg(test)]
    pub(crate) fn reusable(&self, path: &[SharedMessage]) -> usize {
        self.paths.reusable(self.owner, path)
    }
}

/// A number no other provider has.
fn next_owner() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The paths kept, the most recently used last.
#[derive(Debug, Default)]
pub(crate) struct WrittenPaths {
    paths: Mutex<Vec<Written>>,
}

impl WrittenPaths {
    /// What is already written of `path` after `head` (an array holding
    /// the elements that come before the path's): the kept path `owner`
    /// wrote that starts with the same message and the same head, cut back to the
    /// last message the two share, among the first `settled` of `path`, at
    /// a place its text can be cut; or `head` alone. Taken out until
    /// [`WrittenPaths::keep`] puts it back, so a path is never written by
    /// two at once.
    fn take(&self, owner: u64, path: &[SharedMessage], settled: usize, head: Elements) -> Written {
        let mut written = {
            let mut paths = self.lock();
            match kept_for(&paths, owner, path) {
                Some(index) => paths.remove(index),
                None => return Written::starting(owner, head, path),
            }
        };
        if written.elements.head() != head.text {
            return Written::starting(owner, head, path);
        }
        let (messages, end) = written.reusable(path, settled);
        written.messages.truncate(messages);
        written.elements.truncate(messages, end);
        written
    }

    /// How many messages of `path` are written already (what [`take`]
    /// would reuse), leaving the kept paths as they are.
    ///
    /// [`take`]: WrittenPaths::take
    #[cfg(test)]
    pub(crate) fn reusable(&self, owner: u64, path: &[SharedMessage]) -> usize {
        let paths = self.lock();
        kept_for(&paths, owner, path).map_or(0, |index| paths[index].reusable(path, path.len()).0)
    }

    /// Keeps what was written for `path` (taken by [`WrittenPaths::take`]
    /// for the same path, the rest appended since), if the path is long
    /// enough and within the budget by itself; drops the least recently used
    /// paths past the limits.
    fn keep(&self, mut written: Written, path: &[SharedMessage]) {
        if !written.elements.recording || written.elements.text.len() > BUDGET_BYTES {
            return;
        }
        let unwritten = written.unwritten(path);
        written.messages.extend_from_slice(unwritten);
        debug_assert_eq!(written.messages.len(), written.elements.ends.len(), "one end a message");
        let mut paths = self.lock();
        paths.push(written);
        let mut total: usize = paths.iter().map(|kept| kept.elements.text.len()).sum();
        let mut oldest = 0;
        while paths.len() - oldest > MOST_PATHS || total > BUDGET_BYTES {
            total -= paths[oldest].elements.text.len();
            oldest += 1;
        }
        paths.drain(..oldest);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Written>> {
        // The list holds no invariant a panic could break half-way.
        self.paths.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    #[cfg(test)]
    fn kept(&self) -> Vec<usize> {
        self.lock().iter().map(|kept| kept.messages.len()).collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use arbor_core::Message;

    use super::*;

    /// Writes each message's content as one element; a message whose text
    /// starts with `~` leaves the text uncuttable after it (as a tool
    /// result's images do), and its element comes only with the next
    /// message's (or at the end). Returns how many messages it wrote.
    fn write(paths: &WrittenPaths, path: &[SharedMessage]) -> (String, usize) {
        write_after(paths, path, None)
    }

    /// The same, the array starting with `head`'s element.
    fn write_after(paths: &WrittenPaths, path: &[SharedMessage], head: Option<&str>) -> (String, usize) {
        write_as(paths, 0, path, head)
    }

    /// The same, as the provider `owner`.
    fn write_as(paths: &WrittenPaths, owner: u64, path: &[SharedMessage], head: Option<&str>) -> (String, usize) {
        let mut elements = Elements::default();
        if let Some(head) = head {
            elements.push(head).unwrap();
        }
        let mut written = paths.take(owner, path, path.len(), elements);
        let unwritten = written.unwritten(path);
        let elements = &mut written.elements;
        let mut held = Vec::new();
        for message in unwritten {
            let text = message.content.clone().unwrap_or_default();
            if let Some(rest) = text.strip_prefix('~') {
                held.push(rest.to_string());
            } else {
                for earlier in held.drain(..) {
                    elements.push(&earlier).unwrap();
                }
                elements.push(&text).unwrap();
            }
            elements.end_message(held.is_empty());
        }
        for earlier in held.drain(..) {
            elements.push(&earlier).unwrap();
        }
        let text = elements.with_array(str::to_string);
        paths.keep(written, path);
        (text, unwritten.len())
    }

    /// Ends the `index`th exchange of a test conversation with its answer,
    /// and every fourth with messages that an adapter merging runs of one
    /// side merges with their neighbours: an assistant message with
    /// nothing to send, then a second user message in a row, and a reply.
    pub(crate) fn answer(index: usize, turn: &mut Vec<Message>) {
        turn.push(Message::assistant(format!("answer {index}")));
        if index.is_multiple_of(4) {
            turn.push(Message::assistant(""));
            turn.push(Message::user(format!("and also {index}")));
            turn.push(Message::assistant(format!("more {index}")));
        }
    }

    /// Checks paths made from a long conversation's `trunk`, as an
    /// adapter's test does: another branch after the exchange of
    /// "question 11" (then `after_branch`, given where that exchange
    /// starts), the trunk again, an edited message, and a second user
    /// message in a row at the end.
    pub(crate) fn check_variations(
        trunk: &[SharedMessage],
        check: impl Fn(&[SharedMessage], &str),
        after_branch: impl FnOnce(usize),
    ) {
        let fork = trunk.iter().position(|message| message.content.as_deref() == Some("question 11")).expect("there");
        let mut branch = trunk[..fork + 2].to_vec();
        branch.push(SharedMessage::from(Message::user("another way")));
        check(&branch, "another branch");
        after_branch(fork);
        check(trunk, "back to the trunk");
        let mut edited = trunk.to_vec();
        edited[40].to_mut().content = Some("edited".into());
        check(&edited, "an edited message");
        let mut merged = trunk.to_vec();
        merged.push(SharedMessage::from(Message::user("a second question in a row")));
        check(&merged, "a message that joins the last turn");
    }

    fn fresh(path: &[SharedMessage]) -> String {
        write(&WrittenPaths::default(), path).0
    }

    fn messages(prefix: &str, count: usize) -> Vec<SharedMessage> {
        SharedMessage::all((0..count).map(|index| Message::user(format!("{prefix}{index}"))))
    }

    #[test]
    fn a_longer_path_writes_only_its_new_messages_and_reads_as_if_written_whole() {
        let paths = WrittenPaths::default();
        let mut path = messages("m", 100);
        assert_eq!(write(&paths, &path), (fresh(&path), 100));
        path.extend(messages("reply", 2));
        assert_eq!(write(&paths, &path), (fresh(&path), 2), "the reply and the new message only");
        assert_eq!(paths.kept(), [102]);
    }

    #[test]
    fn the_head_is_written_first_and_another_head_starts_over() {
        let paths = WrittenPaths::default();
        let path = messages("m", 100);
        let (text, _) = write_after(&paths, &path, Some("system"));
        assert!(text.starts_with(r#"["system","m0","m1""#), "{text}");
        assert_eq!(write_after(&paths, &path, Some("system")).1, 0, "the same head: all of it reused");
        let (text, written) = write_after(&paths, &path, Some("changed"));
        assert_eq!(written, 100, "another head: written again");
        assert!(text.starts_with(r#"["changed","m0""#), "{text}");
        assert_eq!(write_after(&paths, &path, None), (fresh(&path), 100), "no head");
        assert!(fresh(&path).starts_with(r#"["m0","m1""#));
        assert_eq!(fresh(&[]), "[]");
    }

    #[test]
    fn another_branch_reuses_what_comes_before_the_fork() {
        let paths = WrittenPaths::default();
        let trunk = messages("t", 80);
        let one = [trunk.clone(), messages("a", 10)].concat();
        let other = [trunk.clone(), messages("b", 5)].concat();
        write(&paths, &one);
        assert_eq!(write(&paths, &other), (fresh(&other), 5));
        assert_eq!(write(&paths, &one), (fresh(&one), 10), "and back");
        let shorter = &trunk[..70];
        assert_eq!(write(&paths, shorter), (fresh(shorter), 0), "a regeneration earlier on the path");
    }

    #[test]
    fn an_equal_message_held_elsewhere_or_changed_is_written_again() {
        let paths = WrittenPaths::default();
        let path = messages("m", 100);
        write(&paths, &path);
        let mut edited = path.clone();
        edited[50].to_mut().content = Some("edited".into());
        assert_eq!(write(&paths, &edited), (fresh(&edited), 50), "from the changed message on");
        let copied = messages("m", 100);
        assert_eq!(copied, path, "equal messages");
        assert_eq!(write(&paths, &copied), (fresh(&copied), 100), "held elsewhere: nothing is taken for them");
    }

    #[test]
    fn text_is_cut_only_where_the_next_message_starts_from_nothing() {
        let paths = WrittenPaths::default();
        let mut path = messages("m", 70);
        path.extend(SharedMessage::all([Message::user("~x"), Message::user("~y")]));
        let (text, _) = write(&paths, &path);
        assert!(text.ends_with(r#""m69","x","y"]"#), "the held ones come at the end: {text}");
        path.push(SharedMessage::from(Message::user("z")));
        let (text, written) = write(&paths, &path);
        assert_eq!(written, 3, "the held two are written again, before the new one");
        assert!(text.ends_with(r#""m69","x","y","z"]"#), "{text}");
        assert_eq!(text, fresh(&path));
    }

    #[test]
    fn providers_take_back_only_their_own_paths_and_share_the_limits() {
        let paths = WrittenPaths::default();
        let path = messages("m", 100);
        assert_eq!(write_as(&paths, 1, &path, None).1, 100);
        assert_eq!(
            write_as(&paths, 2, &path, None),
            (fresh(&path), 100),
            "another provider writes the same nodes itself"
        );
        assert_eq!(write_as(&paths, 1, &path, None).1, 0, "each takes back its own");
        assert_eq!(write_as(&paths, 2, &path, None).1, 0);
        for _ in 0..MOST_PATHS - 1 {
            write_as(&paths, 3, &messages("p", LEAST_MESSAGES), None);
        }
        assert_eq!(paths.kept().len(), MOST_PATHS, "one limit for all");
        assert_eq!(write_as(&paths, 2, &path, None).1, 0, "the most recently used of the two stays");
        assert_eq!(write_as(&paths, 1, &path, None).1, 100, "the other was pushed out by a third provider's");

        let (one, other) = (Kept::shared(), Kept::shared());
        assert!(Arc::ptr_eq(&one.paths, &other.paths), "every provider's paths are in the process's one list");
        assert_ne!(one.owner, other.owner);
        assert!(!Arc::ptr_eq(&Kept::alone().paths, &one.paths));
    }

    #[test]
    fn short_paths_are_not_kept_and_the_limits_drop_the_least_recently_used() {
        let paths = WrittenPaths::default();
        write(&paths, &messages("s", LEAST_MESSAGES - 1));
        assert!(paths.kept().is_empty(), "a short conversation keeps nothing");
        let all: Vec<Vec<SharedMessage>> = (0..=MOST_PATHS).map(|_| messages("p", LEAST_MESSAGES)).collect();
        for path in &all {
            write(&paths, path);
        }
        assert_eq!(paths.kept().len(), MOST_PATHS);
        assert_eq!(write(&paths, &all[0]).1, LEAST_MESSAGES, "the oldest was dropped");
        assert_eq!(write(&paths, &all[MOST_PATHS]).1, 0, "the newest is kept");

        // Three paths of a third of the budget each (and a little more):
        // two fit.
        let paths = WrittenPaths::default();
        let big = "x".repeat(BUDGET_BYTES / 3 / LEAST_MESSAGES);
        let heavy: Vec<Vec<SharedMessage>> =
            (0..3).map(|_| SharedMessage::all((0..LEAST_MESSAGES).map(|_| Message::user(big.clone())))).collect();
        let bytes = |paths: &WrittenPaths| paths.lock().iter().map(|kept| kept.elements.text.len()).sum::<usize>();
        for path in &heavy {
            write(&paths, path);
            assert!(bytes(&paths) <= BUDGET_BYTES, "within the budget");
        }
        assert_eq!(paths.kept().len(), 2);
        assert_eq!(write(&paths, &heavy[2]).1, 0, "the last is kept");
        assert_eq!(write(&paths, &heavy[0]).1, LEAST_MESSAGES, "the first was dropped");
        let huge = SharedMessage::all((0..LEAST_MESSAGES).map(|_| Message::user(big.repeat(4))));
        write(&paths, &huge);
        assert_eq!(write(&paths, &huge).1, LEAST_MESSAGES, "a path over the budget by itself is not kept");
        assert_eq!(paths.kept().len(), 2, "and the others stay");
    }
}
