//! The message tree of a conversation (`shared/seeds/conversation-tree.txt`):
//! every message is a node with a parent, the head is the active leaf, and
//! what a model reads is the path from the head to the root.

use std::hash::BuildHasher;
use std::sync::Arc;

use foldhash::fast::RandomState;
use hashbrown::hash_table::{Entry, HashTable};
use serde::{Deserialize, Serialize};

use crate::message::{Message, Node, Part, Role, ToolCall, ToolStatus};

/// What a node costs the tree beyond its own size: the `Arc`'s two counts,
/// its slot in `nodes`, its entry in `by_id` and its links.
const NODE_OVERHEAD: usize = 2 * size_of::<usize>() + size_of::<Arc<Node>>() + size_of::<usize>() + size_of::<Links>();

/// An index over a conversation's nodes, in creation order.
///
/// A busy conversation's tree stays in memory (the engine's hub), so it is
/// kept small: each node is one shared allocation (a copy of the tree, made
/// when a reader still holds it while a turn extends it, copies pointers,
/// not messages), and the index holds positions, not copies of the ids.
#[derive(Debug, Clone, Default)]
pub struct Tree {
    nodes: Vec<Arc<Node>>,
    /// Positions in `nodes`, found by the hash of the node's id.
    by_id: HashTable<usize>,
    /// Each node's parent and children, by position, beside `nodes`: a
    /// reader of the whole tree lists every node's children without a pass
    /// over all of them first, and a path to the root hashes no id.
    links: Vec<Links>,
    /// foldhash, seeded at random per tree: a path from the head to the
    /// root hashes each id on it (~20 a JSON turn of the benchmark's
    /// conversations), and std's SipHash took ~250 instructions for a
    /// 36-byte id. Ids a client chose can only collide within its own
    /// conversation, whose size is limited.
    hasher: RandomState,
    /// About how much memory the nodes hold ([`Tree::size_in_memory`]).
    bytes: usize,
}

impl Tree {
    pub fn new(nodes: Vec<Node>) -> Tree {
        let mut tree = Tree {
            nodes: Vec::with_capacity(nodes.len()),
            by_id: HashTable::with_capacity(nodes.len()),
            links: Vec::with_capacity(nodes.len()),
            hasher: RandomState::default(),
            bytes: 0,
        };
        for node in nodes {
            tree.push(node);
        }
        tree
    }

    /// Adds a node (a new leaf) to the index, as its parent's last child
    /// when the parent is in the tree. A node whose id is already there
    /// takes its place in the index (the store never writes one). A node
    /// already shared (`Arc`) joins the tree without a copy.
    pub fn push(&mut self, node: impl Into<Arc<Node>>) {
        let node = node.into();
        let parent = node.parent_id.as_deref().and_then(|parent| self.place(parent));
        let Tree { nodes, by_id, links, hasher, bytes } = self;
        let position = nodes.len();
        // A conversation is far shorter than u32::MAX nodes; a longer tree
        // would only leave the nodes past it unlinked (out of their
        // parents' children, each the root of its path).
        let mut own = Links::default();
        if let (Some(parent), Ok(child)) = (parent, u32::try_from(position)) {
            match links[parent].last_child {
                Some(last) => links[last as usize].next_sibling = Some(child),
                None => links[parent].first_child = Some(child),
            }
            links[parent].last_child = Some(child);
            own.parent = u32::try_from(parent).ok();
        }
        links.push(own);
        let hash = hasher.hash_one(node.id.as_str());
        let entry =
            by_id.entry(hash, |&known| nodes[known].id == node.id, |&known| hasher.hash_one(nodes[known].id.as_str()));
        match entry {
            Entry::Occupied(mut occupied) => *occupied.get_mut() = position,
            Entry::Vacant(vacant) => {
                vacant.insert(position);
            }
        }
        *bytes += node.size_in_memory() + NODE_OVERHEAD;
        nodes.push(node);
    }

    /// About how many bytes the tree's messages hold in memory, summed as
    /// they were added ([`Node::size_in_memory`]). A copy shares its nodes
    /// with the original, so this is what dropping the last copy frees.
    pub fn size_in_memory(&self) -> usize {
        self.bytes
    }

    pub fn get(&self, id: &str) -> Option<&Node> {
        self.place(id).map(|position| &*self.nodes[position])
    }

    /// Where the node is in [`Tree::nodes`]'s order.
    pub fn place(&self, id: &str) -> Option<usize> {
        let hash = self.hasher.hash_one(id);
        self.by_id.find(hash, |&known| self.nodes[known].id == id).copied()
    }

    /// The node at `place` in [`Tree::nodes`]'s order.
    pub fn at(&self, place: usize) -> &Arc<Node> {
        &self.nodes[place]
    }

    /// The places of the node at `place`'s children, in creation order.
    pub fn child_places(&self, place: usize) -> ChildPlaces<'_> {
        ChildPlaces { links: &self.links, next: self.links[place].first_child }
    }

    /// The nodes in creation order, as the tree shares them.
    pub fn nodes(&self) -> impl ExactSizeIterator<Item = &Arc<Node>> {
        self.nodes.iter()
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The ids of a node's children, in creation order.
    pub fn children(&self, id: &str) -> Vec<&str> {
        let Some(place) = self.place(id) else { return Vec::new() };
        self.child_places(place).map(|child| self.nodes[child].id.as_str()).collect()
    }

    /// The path from the root to `leaf` (inclusive), oldest first. Empty when
    /// `leaf` is unknown. It follows the links made as each node was
    /// pushed, which always lead to an earlier node, so it cannot loop
    /// (a node's parent is the node of that id when it was pushed).
    ///
    /// The nodes come as the tree shares them, so that a model call's
    /// request can share them too ([`crate::message::SharedMessage`]).
    pub fn path_to(&self, leaf: &str) -> Vec<&Arc<Node>> {
        let mut path = Vec::new();
        let mut current = self.place(leaf);
        while let Some(place) = current {
            path.push(&self.nodes[place]);
            current = self.links[place].parent.map(|parent| parent as usize);
        }
        path.reverse();
        path
    }
}

/// A node's links to its parent and children, by position in the tree's
/// nodes.
#[derive(Debug, Clone, Copy, Default)]
struct Links {
    parent: Option<u32>,
    first_child: Option<u32>,
    last_child: Option<u32>,
    /// The parent's next child after this one.
    next_sibling: Option<u32>,
}

/// The places of a node's children ([`Tree::child_places`]).
#[derive(Debug, Clone)]
pub struct ChildPlaces<'a> {
    links: &'a [Links],
    next: Option<u32>,
}

impl Iterator for ChildPlaces<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let place = self.next? as usize;
        self.next = self.links[place].next_sibling;
        Some(place)
    }
}

/// One message of a client's view of the conversation path: a message
/// with its id beside its fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "ViewMessageFields")]
pub struct ViewMessage {
    /// The message's id: a known id matches a node, a new one names the node
    /// to create, none lets the engine choose.
    #[serde(default)]
    pub id: Option<String>,
    #[serde(flatten)]
    pub message: Message,
}

/// A [`ViewMessage`] as it is read: the id and [`Message`]'s fields, read
/// in one pass. Read through `#[serde(flatten)]`, every field of every
/// message (a client that sends its whole history sends thousands) was
/// first copied into serde's buffer of any value and then read again from
/// it. A test holds this to `Message`'s own reading, so a field added to
/// `Message` is added here too.
#[derive(Deserialize)]
struct ViewMessageFields {
    #[serde(default)]
    id: Option<String>,
    role: Role,
    content: Option<String>,
    #[serde(default)]
    parts: Vec<Part>,
    #[serde(default)]
    tool_calls: Vec<ToolCall>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    tool_name: Option<String>,
    #[serde(default)]
    tool_status: Option<ToolStatus>,
}

impl From<ViewMessageFields> for ViewMessage {
    fn from(fields: ViewMessageFields) -> ViewMessage {
        let ViewMessageFields { id, role, content, parts, tool_calls, tool_call_id, tool_name, tool_status } = fields;
        ViewMessage { id, message: Message { role, content, parts, tool_calls, tool_call_id, tool_name, tool_status } }
    }
}

/// What merging a view into the tree does.
#[derive(Debug, Clone, PartialEq)]
pub enum MergePlan {
    /// The view ends at a node that exists: write nothing, move the head there.
    MoveHead { to: String },
    /// Record `messages` as a new branch under `parent` (the last matching
    /// node, `None` for a new root); the head moves to the last of them.
    /// `new_from` is the index of the first new message in the view.
    Append { parent: Option<String>, new_from: usize, messages: Vec<ViewMessage> },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MergeError {
    #[error("the view has no messages")]
    EmptyView,
    #[error(
        "message {id:?} is in the tree under {actual:?}, but the view puts it under {expected:?}; send the path from the first message"
    )]
    NotOnPath { id: String, expected: Option<String>, actual: Option<String> },
    #[error("message id {id:?} is already used elsewhere in this conversation; give the new message a new id or none")]
    IdTaken { id: String },
    #[error("message id {id:?} appears twice in the view")]
    DuplicateInView { id: String },
}

/// Merges a client's view into the tree (`shared/seeds/conversation-tree.txt`):
/// known ids at the start match existing nodes, which must form a path from
/// the root; the first message that is new or has no id starts a branch under
/// the last match, and everything after it is new. Matching is by id only,
/// never by content, so re-sending a known message changes nothing.
pub fn merge_view(tree: &Tree, view: &[ViewMessage]) -> Result<MergePlan, MergeError> {
    if view.is_empty() {
        return Err(MergeError::EmptyView);
    }
    let mut last_match: Option<String> = None;
    let mut index = 0;
    while let Some(node) = view.get(index).and_then(|message| message.id.as_deref()).and_then(|id| tree.get(id)) {
        if node.parent_id != last_match {
            return Err(MergeError::NotOnPath {
                id: node.id.clone(),
                expected: last_match,
                actual: node.parent_id.clone(),
            });
        }
        last_match = Some(node.id.clone());
        index += 1;
    }
    if index == view.len() {
        let to = last_match.ok_or(MergeError::EmptyView)?;
        return Ok(MergePlan::MoveHead { to });
    }
    let mut seen = std::collections::HashSet::new();
    for message in &view[index..] {
        if let Some(id) = &message.id {
            if tree.get(id).is_some() {
                return Err(MergeError::IdTaken { id: id.clone() });
            }
            if !seen.insert(id.as_str()) {
                return Err(MergeError::DuplicateInView { id: id.clone() });
            }
        }
    }
    Ok(MergePlan::Append { parent: last_match, new_from: index, messages: view[index..].to_vec() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::SharedMessage;

    #[test]
    fn a_tree_knows_about_how_much_memory_its_messages_hold() {
        let mut tree = Tree::new(vec![node("a", None)]);
        let one = tree.size_in_memory();
        assert!(one > size_of::<Node>());
        tree.push(node("b", Some("a")));
        assert_eq!(tree.size_in_memory(), 2 * one + 1, "b's parent id is one byte more");
        let mut long = node("c", Some("b"));
        long.message.content = Some("x".repeat(100_000));
        tree.push(long);
        assert!(tree.size_in_memory() > 100_000);
        assert_eq!(tree.clone().size_in_memory(), tree.size_in_memory());
    }

    #[test]
    fn a_shared_node_joins_the_tree_without_a_copy() {
        let mut tree = Tree::new(vec![node("a", None)]);
        let reply = Arc::new(node("b", Some("a")));
        tree.push(reply.clone());
        assert!(std::ptr::eq(tree.get("b").expect("b is in the tree"), &*reply));
        assert_eq!(tree.path_to("b").len(), 2);
    }

    #[test]
    fn a_path_shares_the_trees_nodes_and_a_request_reads_them_in_place() {
        let root = Arc::new(node("a", None));
        let mut tree = Tree::new(Vec::new());
        tree.push(root.clone());
        tree.push(node("b", Some("a")));
        let path = tree.path_to("b");
        assert!(Arc::ptr_eq(path[0], &root), "the path holds the tree's own node");
        let shared: Vec<SharedMessage> = path.into_iter().map(|node| SharedMessage::from(Arc::clone(node))).collect();
        assert!(std::ptr::eq(&*shared[0], &root.message), "the request reads the node's message, not a copy");
        assert_eq!(Arc::strong_count(&root), 3, "the test's, the tree's and the request's");
        assert_eq!(shared, SharedMessage::all([Message::user("a"), Message::user("b")]), "compared as messages");
        assert_eq!(format!("{:?}", shared[1]), format!("{:?}", Message::user("b")), "shown as the message");
        let mut edited = shared[0].clone();
        edited.to_mut().content = Some("edited".into());
        assert_eq!(edited.content.as_deref(), Some("edited"));
        assert_eq!(root.message.content.as_deref(), Some("a"), "the tree's node is not changed");
        assert_eq!(shared[0].content.as_deref(), Some("a"), "nor the request's");
        assert!(shared[0].same(&SharedMessage::from(root.clone())), "the same node, held twice");
        assert!(!edited.same(&shared[0]), "a copy made to change it is another message");
        assert!(!shared[0].same(&SharedMessage::from(Message::user("a"))), "an equal message is not the same");
        let alone = SharedMessage::from(Message::user("x"));
        assert!(alone.same(&alone.clone()) && !alone.same(&SharedMessage::from(Message::user("x"))));
    }

    pub(crate) fn node(id: &str, parent: Option<&str>) -> Node {
        Node::new(id, "c", parent.map(Into::into), Message::user(id), 0)
    }

    #[test]
    fn path_runs_from_root_to_the_leaf_and_ignores_other_branches() {
        // u1 → a1 → u2, and an edit e1 under u1.
        let tree =
            Tree::new(vec![node("u1", None), node("a1", Some("u1")), node("u2", Some("a1")), node("e1", Some("u1"))]);
        let ids = |leaf| tree.path_to(leaf).iter().map(|node| node.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids("u2"), ["u1", "a1", "u2"]);
        assert_eq!(ids("e1"), ["u1", "e1"]);
        assert!(ids("missing").is_empty());
        assert_eq!(tree.children("u1"), ["a1", "e1"]);
    }

    #[test]
    fn a_nodes_children_are_its_own_in_creation_order_as_the_tree_grows() {
        // Each node hangs under one of the ten before it; every fiftieth
        // under a parent the tree does not have.
        let nodes: Vec<Node> = (0..500)
            .map(|index: usize| {
                let parent = match index {
                    0 => None,
                    _ if index.is_multiple_of(50) => Some("missing".to_string()),
                    _ => Some(format!("n{}", index - 1 - (index * 31) % index.min(10))),
                };
                Node::new(format!("n{index}"), "c", parent, Message::user("x"), 0)
            })
            .collect();
        let grown = nodes.iter().cloned().fold(Tree::new(Vec::new()), |mut tree, node| {
            tree.push(node);
            tree
        });
        for tree in [Tree::new(nodes.clone()), grown] {
            for (place, node) in nodes.iter().enumerate() {
                let expected: Vec<&str> = nodes
                    .iter()
                    .filter(|child| child.parent_id.as_deref() == Some(node.id.as_str()))
                    .map(|child| child.id.as_str())
                    .collect();
                assert_eq!(tree.children(&node.id), expected, "{}", node.id);
                let by_place: Vec<&str> = tree.child_places(place).map(|child| tree.at(child).id.as_str()).collect();
                assert_eq!(by_place, expected);
                assert_eq!(tree.place(&node.id), Some(place));
                // The path, walked by id.
                let mut expected = vec![node.id.as_str()];
                while let Some(parent) = tree.get(expected[expected.len() - 1]).and_then(|n| n.parent_id.as_deref()) {
                    if tree.get(parent).is_none() {
                        break;
                    }
                    expected.push(parent);
                }
                expected.reverse();
                let path: Vec<&str> = tree.path_to(&node.id).iter().map(|found| found.id.as_str()).collect();
                assert_eq!(path, expected);
            }
            assert!(tree.children("missing").is_empty());
            let branching = nodes.iter().filter(|node| tree.children(&node.id).len() > 1).count();
            assert!(branching > 40, "{branching} nodes with more than one child");
        }
    }

    #[test]
    fn a_view_message_reads_as_its_id_and_the_message_read_alone() {
        use crate::message::ProviderOpaque;
        // Every field set (a literal, so a field added to Message is
        // added here), then a bare one, text that needs unescaping, an
        // unknown field, a null and a missing content.
        let full = Message {
            role: Role::Assistant,
            content: Some("calling".into()),
            parts: vec![
                Part::Image { media_id: Some("m1".into()), url: None, data: None, mime_type: Some("image/png".into()) },
                Part::Thinking {
                    text: "hmm".into(),
                    signature: Some(ProviderOpaque { provider: "anthropic".into(), data: "sig".into() }),
                },
            ],
            tool_calls: vec![ToolCall {
                id: "call_1".into(),
                name: "lookup".into(),
                arguments: serde_json::json!({"q": [1, 2.5, -3, null, true], "deep": {"x": "y"}}),
                signature: None,
            }],
            tool_call_id: Some("call_0".into()),
            tool_name: Some("search".into()),
            tool_status: Some(ToolStatus::Denied),
        };
        let mut with_id = serde_json::to_value(&full).expect("serializes");
        with_id["id"] = "v1".into();
        let samples = [
            with_id,
            serde_json::to_value(&full).expect("serializes"),
            serde_json::json!({"role": "user", "content": "é \"quoted\"\n😀", "id": "v2"}),
            serde_json::json!({"role": "user", "content": "hi", "name": "bob", "extra": {"a": [1]}}),
            serde_json::json!({"role": "assistant", "content": null}),
            serde_json::json!({"role": "assistant"}),
        ];
        for sample in samples {
            let read: ViewMessage = serde_json::from_value(sample.clone()).expect("a view message");
            let id = sample.get("id").and_then(|id| id.as_str()).map(str::to_string);
            let alone: Message = serde_json::from_value(sample.clone()).expect("a message");
            assert_eq!(read, ViewMessage { id, message: alone }, "{sample}");
            let text = sample.to_string();
            assert_eq!(serde_json::from_str::<ViewMessage>(&text).expect("from text"), read, "{text}");
        }
        // What Message refuses, a view message refuses.
        for bad in [
            serde_json::json!({"content": "no role"}),
            serde_json::json!({"role": "wizard", "content": "x"}),
            serde_json::json!({"role": "user", "content": 5}),
            serde_json::json!({"role": "user", "tool_status": "maybe"}),
            serde_json::json!({"role": "user", "id": 7}),
        ] {
            assert!(serde_json::from_value::<ViewMessage>(bad.clone()).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_node_is_found_by_id_as_the_tree_grows_and_copies_stay_apart() {
        let mut tree = Tree::new(vec![node("n0", None)]);
        for index in 1..1000 {
            tree.push(node(&format!("n{index}"), Some(&format!("n{}", index - 1))));
        }
        assert_eq!(tree.len(), 1000);
        for index in [0, 1, 7, 8, 9, 63, 64, 65, 511, 999] {
            let id = format!("n{index}");
            assert_eq!(tree.get(&id).map(|found| found.id.as_str()), Some(id.as_str()));
        }
        assert!(tree.get("n1000").is_none());
        assert_eq!(tree.path_to("n999").len(), 1000);

        // A copy extended by a turn leaves the tree a reader holds as it was.
        let mut extended = tree.clone();
        extended.push(node("reply", Some("n999")));
        assert!(tree.get("reply").is_none());
        assert_eq!(extended.get("reply").and_then(|found| found.parent_id.as_deref()), Some("n999"));
        assert_eq!((tree.len(), extended.len()), (1000, 1001));
        assert_eq!(extended.children("n999"), ["reply"]);
        assert!(tree.children("n999").is_empty(), "the reader's tree has no link to the copy's reply");

        // A repeated id (which the store never writes) names the newer node.
        let mut repeated = Tree::new(vec![node("a", None), node("b", Some("a"))]);
        repeated.push(node("a", Some("b")));
        assert_eq!(repeated.get("a").and_then(|found| found.parent_id.as_deref()), Some("b"));
        let path: Vec<_> = repeated.path_to("a").iter().map(|found| found.parent_id.clone()).collect();
        assert_eq!(path, [None, Some("a".into()), Some("b".into())], "the older a, b, the newer a: no loop");
    }

    fn view(messages: &[(Option<&str>, &str)]) -> Vec<ViewMessage> {
        messages
            .iter()
            .map(|(id, text)| ViewMessage { id: id.map(Into::into), message: Message::user(*text) })
            .collect()
    }

    #[test]
    fn seed_example_editing_the_first_question_branches_under_it() {
        // u1 → a1 → u2; the client edits back to the first question.
        let tree = Tree::new(vec![node("u1", None), node("a1", Some("u1")), node("u2", Some("a1"))]);
        let plan = merge_view(&tree, &view(&[(Some("u1"), "weather in NYC?"), (None, "weather in LA instead")]))
            .expect("merges");
        match plan {
            MergePlan::Append { parent, new_from, messages } => {
                assert_eq!(parent.as_deref(), Some("u1"));
                assert_eq!(new_from, 1);
                assert_eq!(messages.len(), 1);
                assert_eq!(messages[0].message.content.as_deref(), Some("weather in LA instead"));
            }
            other => panic!("expected a branch, got {other:?}"),
        }
    }

    #[test]
    fn resending_known_ids_changes_nothing_and_an_earlier_end_moves_the_head() {
        let tree = Tree::new(vec![node("u1", None), node("a1", Some("u1")), node("u2", Some("a1"))]);
        // Same ids, different text: matched by id, never by content.
        let same =
            merge_view(&tree, &view(&[(Some("u1"), "changed"), (Some("a1"), "x"), (Some("u2"), "y")])).expect("merges");
        assert_eq!(same, MergePlan::MoveHead { to: "u2".into() });
        let earlier = merge_view(&tree, &view(&[(Some("u1"), "")])).expect("merges");
        assert_eq!(earlier, MergePlan::MoveHead { to: "u1".into() });
    }

    #[test]
    fn views_off_the_tree_or_reusing_ids_are_refused() {
        let tree = Tree::new(vec![node("u1", None), node("a1", Some("u1")), node("u2", Some("a1"))]);
        assert_eq!(merge_view(&tree, &[]), Err(MergeError::EmptyView));
        let skipping = merge_view(&tree, &view(&[(Some("a1"), "")]));
        assert!(matches!(skipping, Err(MergeError::NotOnPath { .. })), "{skipping:?}");
        let reused = merge_view(&tree, &view(&[(Some("u1"), ""), (None, "new"), (Some("u2"), "again")]));
        assert_eq!(reused, Err(MergeError::IdTaken { id: "u2".into() }));
        let twice = merge_view(&tree, &view(&[(Some("x"), ""), (Some("x"), "")]));
        assert_eq!(twice, Err(MergeError::DuplicateInView { id: "x".into() }));
        // A view of only new messages starts a new root.
        let fresh = merge_view(&tree, &view(&[(Some("r2"), "hi")])).expect("merges");
        assert!(matches!(fresh, MergePlan::Append { parent: None, new_from: 0, .. }));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// A random tree: node i hangs under a random earlier node (or is a root).
        fn arbitrary_tree() -> impl Strategy<Value = Tree> {
            proptest::collection::vec(any::<prop::sample::Index>(), 1..40).prop_map(|parents| {
                let mut nodes: Vec<Node> = Vec::new();
                for (index, parent) in parents.iter().enumerate() {
                    let parent_id = if index == 0 || parent.index(4) == 0 {
                        None
                    } else {
                        Some(format!("n{}", parent.index(index)))
                    };
                    nodes.push(node(&format!("n{index}"), parent_id.as_deref()));
                }
                Tree::new(nodes)
            })
        }

        /// Applies a plan the way the engine does; returns the new head.
        fn apply(tree: &Tree, plan: &MergePlan) -> (Tree, String) {
            match plan {
                MergePlan::MoveHead { to } => (tree.clone(), to.clone()),
                MergePlan::Append { parent, messages, .. } => {
                    let mut nodes: Vec<Node> = tree.nodes().map(|node| Node::clone(node)).collect();
                    let mut parent = parent.clone();
                    for (index, message) in messages.iter().enumerate() {
                        let id = message.id.clone().unwrap_or_else(|| format!("generated{index}"));
                        nodes.push(node(&id, parent.as_deref()));
                        parent = Some(id);
                    }
                    let head = parent.expect("at least one message");
                    (Tree::new(nodes), head)
                }
            }
        }

        proptest! {
            #[test]
            fn merging_never_loses_or_duplicates_and_the_head_is_on_the_reported_path(
                tree in arbitrary_tree(),
                leaf in any::<prop::sample::Index>(),
                keep in any::<prop::sample::Index>(),
                new_count in 0usize..4,
                reuse in any::<bool>(),
            ) {
                // The view: a prefix of the path to a random leaf, then new messages
                // (some with fresh ids, one maybe reusing a known id).
                let leaf_id = tree.nodes().nth(leaf.index(tree.len())).expect("in range").id.clone();
                let path: Vec<String> = tree.path_to(&leaf_id).iter().map(|node| node.id.clone()).collect();
                let kept = keep.index(path.len()) + 1;
                let mut view: Vec<ViewMessage> = path[..kept].iter().map(|id| ViewMessage { id: Some(id.clone()), message: Message::user("x") }).collect();
                for index in 0..new_count {
                    let id = if reuse && index == 0 { tree.nodes().next().map(|node| node.id.clone()) } else if index % 2 == 0 { Some(format!("new{index}")) } else { None };
                    view.push(ViewMessage { id, message: Message::user("y") });
                }
                match merge_view(&tree, &view) {
                    // A reused id is refused: as a new message (taken), or, right
                    // after the prefix, as a known node that is not on the path.
                    Err(MergeError::IdTaken { id }) => prop_assert!(reuse && tree.get(&id).is_some()),
                    Err(MergeError::NotOnPath { .. }) => prop_assert!(reuse),
                    Err(other) => prop_assert!(false, "unexpected error {other:?}"),
                    Ok(plan) => {
                        let (merged, head) = apply(&tree, &plan);
                        // Nothing lost, nothing duplicated.
                        prop_assert!(!reuse || new_count == 0, "a reused id was accepted");
                        prop_assert_eq!(merged.len(), tree.len() + new_count);
                        for node in tree.nodes() {
                            prop_assert!(merged.get(&node.id).is_some());
                        }
                        let mut ids: Vec<&str> = merged.nodes().map(|node| node.id.as_str()).collect();
                        ids.sort_unstable();
                        let before = ids.len();
                        ids.dedup();
                        prop_assert_eq!(ids.len(), before);
                        // The head's path is the view's matched prefix followed by the new messages.
                        let head_path: Vec<String> = merged.path_to(&head).iter().map(|node| node.id.clone()).collect();
                        prop_assert_eq!(&head_path[..kept], &path[..kept]);
                        prop_assert_eq!(head_path.len(), kept + new_count);
                    }
                }
            }
        }
    }
}
