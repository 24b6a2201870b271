//! The message tree of a conversation (`shared/seeds/conversation-tree.txt`):
//! every message is a node with a parent, the head is the active leaf, and
//! what a model reads is the path from the head to the root.

use std::collections::HashMap;

use crate::message::Node;

/// An index over a conversation's nodes, in creation order.
#[derive(Debug, Clone, Default)]
pub struct Tree {
    nodes: Vec<Node>,
    by_id: HashMap<String, usize>,
}

impl Tree {
    pub fn new(nodes: Vec<Node>) -> Tree {
        let by_id = nodes
            .iter()
            .enumerate()
            .map(|(index, node)| (node.id.clone(), index))
            .collect();
        Tree { nodes, by_id }
    }

    pub fn get(&self, id: &str) -> Option<&Node> {
        self.by_id.get(id).map(|&index| &self.nodes[index])
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The ids of a node's children, in creation order.
    pub fn children(&self, id: &str) -> Vec<&str> {
        self.nodes
            .iter()
            .filter(|node| node.parent_id.as_deref() == Some(id))
            .map(|node| node.id.as_str())
            .collect()
    }

    /// The path from the root to `leaf` (inclusive), oldest first. Empty when
    /// `leaf` is unknown. A parent cycle (which the store never writes) stops
    /// the walk instead of looping.
    pub fn path_to(&self, leaf: &str) -> Vec<&Node> {
        let mut path = Vec::new();
        let mut current = self.get(leaf);
        while let Some(node) = current {
            if path.len() > self.nodes.len() {
                break;
            }
            path.push(node);
            current = node
                .parent_id
                .as_deref()
                .and_then(|parent| self.get(parent));
        }
        path.reverse();
        path
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{Message, NodeStatus};

    pub(crate) fn node(id: &str, parent: Option<&str>) -> Node {
        Node {
            id: id.into(),
            conversation_id: "c".into(),
            parent_id: parent.map(Into::into),
            message: Message::user(id),
            model: None,
            provider: None,
            turn_id: None,
            copied_from: None,
            status: NodeStatus::Complete,
            created_at: 0,
        }
    }

    #[test]
    fn path_runs_from_root_to_the_leaf_and_ignores_other_branches() {
        // u1 → a1 → u2, and an edit e1 under u1.
        let tree = Tree::new(vec![
            node("u1", None),
            node("a1", Some("u1")),
            node("u2", Some("a1")),
            node("e1", Some("u1")),
        ]);
        let ids = |leaf| {
            tree.path_to(leaf)
                .iter()
                .map(|node| node.id.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(ids("u2"), ["u1", "a1", "u2"]);
        assert_eq!(ids("e1"), ["u1", "e1"]);
        assert!(ids("missing").is_empty());
        assert_eq!(tree.children("u1"), ["a1", "e1"]);
    }
}
