//! How stored records look on the wire. Times are RFC 3339 text; money is
//! credits (integers) with cents of a dollar derived for display.

use std::borrow::Borrow;
use std::sync::Arc;

use arbor_core::Cost;
use arbor_core::Event;
use arbor_core::Node;
use arbor_core::ids::Rfc3339;
use arbor_core::json::Verbatim;
use arbor_core::tree::{ChildPlaces, Tree};
use arbor_store::{ApiCall, Conversation, Turn};
use serde::Serialize;

/// A conversation as the API shows it. The views are typed and borrow the
/// record, so a response is serialized straight to bytes (a tree of 10,000
/// nodes included) instead of through a `serde_json::Value` per field.
#[derive(Serialize)]
pub struct ConversationView<'a> {
    id: &'a str,
    title: Option<&'a str>,
    system_prompt: Option<&'a str>,
    model: &'a str,
    head_id: Option<&'a str>,
    head_version: i64,
    summary: Option<&'a str>,
    created_at: Rfc3339,
    updated_at: Rfc3339,
}

pub fn conversation(conversation: &Conversation) -> ConversationView<'_> {
    ConversationView {
        id: &conversation.id,
        title: conversation.title.as_deref(),
        system_prompt: conversation.system_prompt.as_deref(),
        model: &conversation.model,
        head_id: conversation.head_id.as_deref(),
        head_version: conversation.head_version,
        summary: conversation.summary.as_deref(),
        created_at: Rfc3339(conversation.created_at),
        updated_at: Rfc3339(conversation.updated_at),
    }
}

/// A tree node as the API shows it: the node's fields as `Node` serializes
/// them, then its children's ids.
pub struct NodeView<'a> {
    node: &'a Node,
    children: Children<'a>,
}

/// As [`NodeView::write`] writes it (a turn's reply, a test's list).
impl Serialize for NodeView<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut text = String::with_capacity(512);
        self.write(&mut text).map_err(serde::ser::Error::custom)?;
        Verbatim(&text).serialize(serializer)
    }
}

impl NodeView<'_> {
    /// Appends the view's JSON to `out`: `Node`'s derived text with the
    /// children after it (a test compares the two), field by field. serde
    /// writes a flattened struct as a map, an entry at a time (~240
    /// instructions a field, ~3,000 a node of a long tree); this writes the
    /// keys as they are and only the values through `arbor_core::json`. A
    /// field added to `Node` or `Message` is added here too: the test's full
    /// node sets every field, so a missing one fails it.
    pub fn write(&self, out: &mut String) -> Result<(), arbor_core::json::Error> {
        use arbor_core::json::write;
        let optional = |out: &mut String, key: &str, value: Option<&str>| {
            out.push_str(key);
            match value {
                Some(text) => write(out, text),
                None => {
                    out.push_str("null");
                    Ok(())
                }
            }
        };
        let (node, message) = (self.node, &self.node.message);
        out.push_str("{\"id\":");
        write(out, node.id.as_str())?;
        out.push_str(",\"conversation_id\":");
        write(out, node.conversation_id.as_str())?;
        optional(out, ",\"parent_id\":", node.parent_id.as_deref())?;
        out.push_str(",\"role\":");
        write(out, &message.role)?;
        optional(out, ",\"content\":", message.content.as_deref())?;
        if !message.parts.is_empty() {
            out.push_str(",\"parts\":");
            write(out, &message.parts)?;
        }
        if !message.tool_calls.is_empty() {
            out.push_str(",\"tool_calls\":");
            write(out, &message.tool_calls)?;
        }
        if let Some(id) = &message.tool_call_id {
            optional(out, ",\"tool_call_id\":", Some(id))?;
        }
        if let Some(name) = &message.tool_name {
            optional(out, ",\"tool_name\":", Some(name))?;
        }
        if let Some(status) = &message.tool_status {
            out.push_str(",\"tool_status\":");
            write(out, status)?;
        }
        optional(out, ",\"model\":", node.model.as_deref())?;
        optional(out, ",\"provider\":", node.provider.as_deref())?;
        optional(out, ",\"turn_id\":", node.turn_id.as_deref())?;
        optional(out, ",\"copied_from\":", node.copied_from.as_deref())?;
        out.push_str(",\"status\":");
        write(out, &node.status)?;
        out.push_str(",\"created_at\":");
        Rfc3339(node.created_at).push_json(out);
        out.push_str(",\"children\":[");
        for (index, place) in self.children.places.clone().enumerate() {
            if index > 0 {
                out.push(',');
            }
            write(out, self.children.list.id(place))?;
        }
        out.push_str("]}");
        Ok(())
    }
}

/// A node's children's ids, by their places in a list of nodes.
struct Children<'a> {
    list: &'a dyn Ids,
    places: Places<'a>,
}

/// A list of nodes' ids by place.
trait Ids {
    fn id(&self, place: usize) -> &str;
}

impl<N: Borrow<Node>> Ids for Vec<N> {
    fn id(&self, place: usize) -> &str {
        &self[place].borrow().id
    }
}

impl Ids for Tree {
    fn id(&self, place: usize) -> &str {
        &self.at(place).id
    }
}

/// A node's children's places: the tree's own links, or a path's next
/// node.
#[derive(Clone)]
enum Places<'a> {
    Linked(ChildPlaces<'a>),
    Next(std::option::IntoIter<usize>),
}

impl Iterator for Places<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        match self {
            Places::Linked(places) => places.next(),
            Places::Next(place) => place.next(),
        }
    }
}

/// Nodes with their children's ids, shown as a list of [`NodeView`]s. A
/// list owns its nodes (shared ones are `Arc`s) so that a long one can be
/// written a part at a time as the response body is sent
/// ([`crate::extract::NodesJson`]).
pub trait NodeList: Send + 'static {
    /// How many nodes the list has.
    fn count(&self) -> usize;

    /// The node at `place` with its children.
    fn view(&self, place: usize) -> NodeView<'_>;

    /// About how many bytes of JSON the views are, counted until they pass
    /// `limit`: their text and ids, and what a node's other fields take (a
    /// little more than a plain message's). A node's parts and tool calls
    /// are not counted. A long list is known to be long after its first
    /// few hundred nodes.
    fn bytes_up_to(&self, limit: usize) -> usize {
        let mut bytes = 2;
        for place in 0..self.count() {
            let NodeView { node, children } = self.view(place);
            let content = node.message.content.as_ref().map_or(0, String::len);
            bytes += NODE_FIELDS_BYTES + content + node.id.len() + node.conversation_id.len();
            bytes += children.places.map(|child| children.list.id(child).len() + 3).sum::<usize>();
            if bytes > limit {
                break;
            }
        }
        bytes
    }
}

/// A chain of nodes, each the parent of the next: a conversation's active
/// path from the root (as the engine walks it), or the new branch a view
/// recorded. Each node's one child in the list is the node after it, so
/// nothing is looked up before the first node is written.
pub struct PathViews<N>(Vec<N>);

pub fn path<N: Borrow<Node>>(nodes: Vec<N>) -> PathViews<N> {
    PathViews(nodes)
}

impl<N: Borrow<Node> + Send + 'static> NodeList for PathViews<N> {
    fn count(&self) -> usize {
        self.0.len()
    }

    fn view(&self, place: usize) -> NodeView<'_> {
        let next = (place + 1 < self.0.len()).then_some(place + 1);
        NodeView {
            node: self.0[place].borrow(),
            children: Children { list: &self.0, places: Places::Next(next.into_iter()) },
        }
    }
}

/// A conversation's whole tree, in creation order, with each node's
/// children as the tree links them: nothing is found or copied before the
/// first node is written (a busy conversation's tree is the hub's, held
/// while the response is sent).
impl NodeList for Arc<Tree> {
    fn count(&self) -> usize {
        self.len()
    }

    fn view(&self, place: usize) -> NodeView<'_> {
        let tree: &Tree = self;
        NodeView {
            node: tree.at(place),
            children: Children { list: tree, places: Places::Linked(tree.child_places(place)) },
        }
    }
}

/// What a [`NodeView`]'s fields but its content, own id and conversation
/// id take, about: the keys, a parent's id, a time, and every other node's
/// model, provider and turn id (a user's message and its reply).
const NODE_FIELDS_BYTES: usize = 300;

/// No nodes: the list a [`leaf`]'s children are places in.
static NO_NODES: Vec<Node> = Vec::new();

/// A node nothing hangs under yet (a reply just written).
pub fn leaf(node: &Node) -> NodeView<'_> {
    NodeView { node, children: Children { list: &NO_NODES, places: Places::Next(None.into_iter()) } }
}

#[derive(Serialize)]
pub struct TurnView<'a> {
    id: &'a str,
    conversation_id: &'a str,
    user_message_id: &'a str,
    reply_message_id: Option<&'a str>,
    status: &'static str,
    model: &'a str,
    iterations: u32,
    input_tokens: u64,
    output_tokens: u64,
    thinking_tokens: u64,
    cached_tokens: u64,
    cost_credits: i64,
    cost_cents_usd: f64,
    error: Option<TurnError<'a>>,
    created_at: Rfc3339,
    finished_at: Option<Rfc3339>,
}

#[derive(Serialize)]
struct TurnError<'a> {
    code: &'a str,
    message: Option<&'a str>,
}

pub fn turn(turn: &Turn) -> TurnView<'_> {
    let cost = Cost { micro_usd: turn.cost_micro_usd };
    TurnView {
        id: &turn.id,
        conversation_id: &turn.conversation_id,
        user_message_id: &turn.user_message_id,
        reply_message_id: turn.reply_message_id.as_deref(),
        status: turn.status.as_str(),
        model: &turn.model,
        iterations: turn.iterations,
        input_tokens: turn.usage.input_tokens,
        output_tokens: turn.usage.output_tokens,
        thinking_tokens: turn.usage.thinking_tokens,
        cached_tokens: turn.usage.cached_tokens,
        cost_credits: cost.credits(),
        cost_cents_usd: cost.cents_usd(),
        error: turn.error_code.as_deref().map(|code| TurnError { code, message: turn.error_message.as_deref() }),
        created_at: Rfc3339(turn.created_at),
        finished_at: turn.finished_at.map(Rfc3339),
    }
}

/// A model call as the API shows it.
#[derive(Serialize)]
pub struct ApiCallView<'a> {
    id: &'a str,
    kind: &'a str,
    provider: &'a str,
    model: &'a str,
    status: &'a str,
    error_code: Option<&'a str>,
    input_tokens: u64,
    output_tokens: u64,
    thinking_tokens: u64,
    cached_tokens: u64,
    latency_ms: u64,
    ttft_ms: Option<u64>,
    cost_credits: i64,
    cost_cents_usd: f64,
    created_at: Rfc3339,
}

pub fn api_call(call: &ApiCall) -> ApiCallView<'_> {
    let cost = Cost { micro_usd: call.cost_micro_usd };
    ApiCallView {
        id: &call.id,
        kind: &call.kind,
        provider: &call.provider,
        model: &call.model,
        status: &call.status,
        error_code: call.error_code.as_deref(),
        input_tokens: call.usage.input_tokens,
        output_tokens: call.usage.output_tokens,
        thinking_tokens: call.usage.thinking_tokens,
        cached_tokens: call.usage.cached_tokens,
        latency_ms: call.latency_ms,
        ttft_ms: call.ttft_ms,
        cost_credits: cost.credits(),
        cost_cents_usd: cost.cents_usd(),
        created_at: Rfc3339(call.created_at),
    }
}

/// One of a turn's stored events as its trace shows it: the number a
/// client saw it under, its name and its data, copied as stored (data that
/// is not JSON, which Arbor never stores, shows as `null`).
#[derive(Serialize)]
pub struct TraceEventView<'a> {
    id: i64,
    event: &'a str,
    data: Option<Verbatim<'a>>,
}

pub fn trace_event(event: &Event) -> TraceEventView<'_> {
    let json = serde_json::from_str::<serde::de::IgnoredAny>(&event.data).is_ok();
    TraceEventView { id: event.seq, event: event.name.as_str(), data: json.then_some(Verbatim(&event.data)) }
}

#[cfg(test)]
mod tests {
    use arbor_core::message::{NodeStatus, ProviderOpaque};
    use arbor_core::{Message, Part, Role, ToolCall, ToolStatus};
    use serde_json::{Value, json};

    use super::*;

    /// What `Node` itself serializes to, with the children's ids beside it.
    fn flattened(node: &Node, children: &[&str]) -> Value {
        let mut value = serde_json::to_value(node).expect("a node serializes");
        value["children"] = json!(children);
        value
    }

    #[test]
    fn a_node_view_is_the_node_as_it_serializes_with_its_children() {
        let opaque = || Some(ProviderOpaque { provider: "anthropic".into(), data: "sig".into() });
        let call =
            ToolCall { id: "call_1".into(), name: "add".into(), arguments: json!({"a": 1}), signature: opaque() };
        let full = Node {
            id: "m2".into(),
            conversation_id: "c1".into(),
            parent_id: Some("m1".into()),
            message: Message {
                role: Role::Assistant,
                content: Some("two \"quoted\" words".into()),
                parts: vec![
                    Part::Thinking { text: "hmm".into(), signature: opaque() },
                    Part::Image {
                        media_id: Some("med_1".into()),
                        url: None,
                        data: Some("aGk=".into()),
                        mime_type: Some("image/png".into()),
                    },
                ],
                tool_calls: vec![call],
                tool_call_id: Some("call_0".into()),
                tool_name: Some("lookup".into()),
                tool_status: Some(ToolStatus::Denied),
            },
            model: Some("gpt-4o-mini".into()),
            provider: Some("openai".into()),
            turn_id: Some("t1".into()),
            copied_from: Some("m0".into()),
            status: NodeStatus::Interrupted,
            created_at: 1_764_000_000_123,
        };
        let bare = Node::new("m1", "c1", None, Message::user("hi"), 0);
        let shown = |list: &[Node]| serde_json::from_str::<Value>(&text(&path(list.to_vec()))).expect("JSON");
        assert_eq!(shown(std::slice::from_ref(&full)), json!([flattened(&full, &[])]));
        assert_eq!(
            shown(&[bare.clone(), full.clone()]),
            json!([flattened(&bare, &["m2"]), flattened(&full, &[])]),
            "the user message has the reply as its child"
        );
        assert_eq!(shown(&[]), json!([]));
        let bare_view = serde_json::to_value(leaf(&bare)).expect("serializes");
        for absent in ["parts", "tool_calls", "tool_call_id", "tool_name", "tool_status"] {
            assert!(bare_view.get(absent).is_none(), "{absent} is left out when empty");
        }
        for null in ["parent_id", "model", "provider", "turn_id", "copied_from"] {
            assert_eq!(bare_view[null], Value::Null, "{null} is shown as null");
        }
        assert_eq!(bare_view["created_at"], "1970-01-01T00:00:00Z");

        // Written field by field, the views are the node's derived text and
        // its children, byte for byte: every field set, none set, text that
        // needs escaping.
        let odd = Node {
            id: "m\"3\u{7}".into(),
            parent_id: Some("m2".into()),
            message: Message {
                tool_call_id: Some("call\\1".into()),
                tool_status: Some(ToolStatus::Success),
                ..Message::text(Role::Tool, "é\n€ 😀")
            },
            ..bare.clone()
        };
        let derived = |node: &Node, children: &[&str]| {
            let mut text = serde_json::to_string(node).expect("serializes");
            text.pop();
            text + ",\"children\":" + &serde_json::to_string(children).expect("serializes") + "}"
        };
        let expected = [derived(&bare, &["m2"]), derived(&full, &[odd.id.as_str()]), derived(&odd, &[])];
        let views = path(vec![bare.clone(), full.clone(), odd.clone()]);
        for (place, expected) in expected.iter().enumerate() {
            let view = views.view(place);
            let mut written = String::new();
            view.write(&mut written).expect("written");
            assert_eq!(&written, expected, "node {place}");
            assert_eq!(&serde_json::to_string(&view).expect("serializes"), expected, "node {place}");
            assert_eq!(&arbor_core::json::to_string(&view).expect("serializes"), expected, "node {place}");
        }
    }

    /// The size a tree's response is written into is enough for a
    /// conversation of plain messages (no buffer grown on the way) without
    /// being much more than it.
    #[test]
    fn a_trees_size_is_known_beforehand_within_a_tenth() {
        let conversation = arbor_core::ids::new_id();
        let mut list: Vec<Node> = Vec::new();
        for index in 0..400 {
            let parent = list.last().map(|node: &Node| node.id.clone());
            let text = "word ".repeat(index % 80 + 2);
            let node = if index % 2 == 0 {
                Node::new(arbor_core::ids::new_id(), &conversation, parent, Message::user(text), 1_764_000_000_000)
            } else {
                Node {
                    model: Some("gpt-4o-mini".into()),
                    provider: Some("openai".into()),
                    turn_id: Some(arbor_core::ids::new_id()),
                    ..Node::new(
                        arbor_core::ids::new_id(),
                        &conversation,
                        parent,
                        Message::assistant(text),
                        1_764_000_000_321,
                    )
                }
            };
            list.push(node);
        }
        for count in [1, 2, 40, 400] {
            let views = path(list[..count].to_vec());
            let written = text(&views).len();
            let estimate = views.bytes_up_to(usize::MAX);
            assert!(estimate >= written, "{count}: {estimate} for {written} bytes");
            assert!(count < 40 || estimate <= written + written / 10, "{count}: {estimate} for {written} bytes");
            let tree = Arc::new(Tree::new(list[..count].to_vec()));
            assert_eq!(tree.bytes_up_to(usize::MAX), estimate, "{count}: the tree's nodes, the same estimate");
        }
        // Counted only until past the limit.
        let views = path(list.clone());
        let (all, first) = (views.bytes_up_to(usize::MAX), views.bytes_up_to(2_000));
        assert!(first > 2_000 && first < 2_000 + 1_000 && all > 20 * first, "{first} of {all}");
    }

    /// The list's views as a response lists them.
    fn text(list: &impl NodeList) -> String {
        let mut out = String::from("[");
        for place in 0..list.count() {
            if place > 0 {
                out.push(',');
            }
            list.view(place).write(&mut out).expect("written");
        }
        out.push(']');
        out
    }
}
