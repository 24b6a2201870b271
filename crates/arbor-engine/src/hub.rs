//! A conversation's hub: the in-memory side of a busy conversation. It numbers
//! the conversation's events, fans them out to every live viewer, keeps the
//! recent ones for viewers that reconnect, and holds the turn slot (one
//! running turn per conversation).

use std::borrow::Borrow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use arbor_core::ids::now_millis;
use arbor_core::{Event, EventName};
use serde::Serialize;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use arbor_core::Node;
use arbor_core::tree::Tree;
use arbor_store::{Conversation, Turn, User};

use crate::models::ResolvedModel;
use crate::submit::QueueMode;
use crate::turn::{OutcomeReceiver, OutcomeSender};
use crate::writer::EventWriter;

/// Live viewers may fall this many events behind before they resynchronise
/// from the recent buffer and the store. The channel allocates every slot
/// (about 100 bytes each) when it is made, so a hub makes it for its first
/// viewer and drops it once the last one has gone (`HubState::sender`): a
/// JSON turn, which no one watches, never pays for it, and a hub may
/// outlive its last turn (`HUB_IDLE` and `IDLE_CONVERSATIONS_KEPT`,
/// lib.rs). At 1024 slots the hubs of a busy minute were most of the
/// process's memory in the benchmark. A viewer that keeps up is never more
/// than a few events behind (chunks that arrive together are one event);
/// one that lags resyncs.
const BROADCAST_CAPACITY: usize = 32;
/// Recent events kept in memory once stored (unstored ones are always kept).
const RECENT_KEPT: usize = 4096;
/// What stays of them once a turn has ended, in a conversation someone has
/// watched on this node: enough for a viewer that reconnects right after
/// `done`; one further back replays from the store. A conversation nobody
/// has watched here (a JSON client's) keeps none: a first viewer replays
/// from the store whatever is kept, and the few events were 14% of what
/// the loaded conversations held at S2's 2,000/s (bench/analysis.md).
const RECENT_BETWEEN_TURNS: usize = 8;

/// The turn that holds the conversation's slot.
#[derive(Clone)]
pub(crate) struct RunningTurn {
    pub turn_id: Arc<str>,
    pub cancel: CancellationToken,
    /// The message the turn answers; a head move that leaves it off the
    /// active path cancels the turn.
    pub reply_parent: String,
}

/// A turn waiting for the slot (or about to take it).
pub(crate) struct QueuedTurn {
    pub turn: Arc<Turn>,
    /// Messages to record when the turn starts (a queued message is recorded
    /// under the head as it is then, so it follows the reply it waited for).
    /// Shared: the store and the conversation's tree take them without a
    /// copy.
    pub nodes: Vec<Arc<Node>>,
    /// Whether messages sent with `queue: "merge"` may join this turn.
    pub merge: bool,
    /// Whether the client placed the messages itself (a view or a
    /// `parent_id`); otherwise they hang under the head at start.
    pub anchored: bool,
    /// Whether it waited in the queue (its row is stored as `queued`).
    pub waited: bool,
    /// Whether the user's spending is limited: each call reserves credits.
    pub limited: bool,
    /// When the engine took it in, or, for a turn that waited, when its
    /// wait ended: Arbor's overhead is measured from here.
    pub accepted: std::time::Instant,
    pub user: User,
    pub model: ResolvedModel,
    pub cancel: CancellationToken,
    pub outcome: OutcomeSender,
}

/// What [`Hub::claim_or_queue`] decided.
pub(crate) enum Slot {
    /// The slot was free: run this turn now.
    Claimed(Box<QueuedTurn>),
    /// A turn runs and the caller did not want to wait.
    Busy { running: Arc<str> },
    /// Queued at `position` (1 = next).
    Queued { turn: Arc<Turn>, position: usize, subscription: Subscription, last_seq: i64 },
    /// Joined the queued merge turn `turn`.
    Merged { turn: Arc<Turn>, subscription: Subscription, last_seq: i64, outcome: OutcomeReceiver },
}

struct HubState {
    /// One past the last event published to viewers.
    next_seq: i64,
    /// Events emitted here that the database has not numbered yet.
    unnumbered: usize,
    /// The latest events, oldest first; covers every event not yet stored.
    recent: VecDeque<Event>,
    running: Option<RunningTurn>,
    /// Turns waiting for the slot, in arrival order.
    queue: VecDeque<QueuedTurn>,
    last_active: Instant,
    /// The live viewers' channel, while there are any. Made and dropped
    /// under this lock, so the broadcast order stays the seq order.
    sender: Option<broadcast::Sender<Event>>,
    /// Whether anyone has watched this conversation here since it loaded.
    watched_once: bool,
}

impl HubState {
    /// A receiver of every event published from now on.
    fn viewer(&mut self) -> broadcast::Receiver<Event> {
        self.watched_once = true;
        self.sender.get_or_insert_with(|| broadcast::channel(BROADCAST_CAPACITY).0).subscribe()
    }

    fn viewers(&self) -> usize {
        self.sender.as_ref().map_or(0, broadcast::Sender::receiver_count)
    }
}

fn to_json(payload: &impl Serialize) -> Arc<str> {
    // Payloads are plain structs and json! values: serializing cannot fail.
    arbor_core::json::to_string(payload).unwrap_or_else(|_| "{}".to_string()).into()
}

/// Who numbers a conversation's events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Numbering {
    /// This process (one node): numbered in memory, stored in batches.
    Local,
    /// The shared database (several nodes): numbered as they are stored,
    /// then published here and announced to the other nodes.
    Database,
}

pub(crate) struct Hub {
    pub conversation_id: Arc<str>,
    /// This hub, for the writer to publish back to.
    me: Weak<Hub>,
    numbering: Numbering,
    state: Mutex<HubState>,
    writer: EventWriter,
    /// Highest seq the writer has stored.
    flushed: Arc<AtomicI64>,
    /// The conversation's tree as of a head version: the active branch and
    /// its neighbours served from memory while the conversation is busy.
    /// Any write elsewhere bumps the version, so a stale copy is never used.
    tree: Mutex<Option<(i64, Arc<Tree>)>>,
    /// The engine's count of bytes cached trees grew by since its last
    /// sweep of quiet hubs; this hub adds what it caches.
    trees_grown: Arc<AtomicUsize>,
    /// The conversation's row as this node last read or wrote it, kept only
    /// while the engine is the database's only writer (see
    /// [`Hub::known_conversation`]).
    known: Mutex<Known>,
}

/// A conversation's row kept in memory, and a count of the changes made to
/// it here: a row read from the store is kept only if no change came
/// between the read's start and its end.
#[derive(Default)]
struct Known {
    row: Option<Conversation>,
    changes: u64,
}

/// What a new viewer gets: the recent events after its position, and a
/// receiver for everything after those.
pub(crate) struct Subscription {
    pub backlog: Vec<Event>,
    /// The oldest seq the backlog could hold; earlier events come from the store.
    pub memory_from: i64,
    pub receiver: broadcast::Receiver<Event>,
}

/// The tree at `version` known without the store: `cached` when it is at
/// that version, the empty tree at version 0 (a new conversation has no
/// messages: see [`Hub::advance_tree`]).
fn known_tree(cached: Option<&(i64, Arc<Tree>)>, version: i64) -> Option<Arc<Tree>> {
    match cached {
        Some((at, tree)) if *at == version => Some(tree.clone()),
        _ if version == 0 => Some(Arc::new(Tree::default())),
        _ => None,
    }
}

impl Hub {
    pub(crate) fn new(
        conversation_id: &str,
        last_seq: i64,
        writer: EventWriter,
        numbering: Numbering,
        trees_grown: Arc<AtomicUsize>,
    ) -> Arc<Hub> {
        Arc::new_cyclic(|me| Hub {
            conversation_id: Arc::from(conversation_id),
            me: me.clone(),
            numbering,
            state: Mutex::new(HubState {
                next_seq: last_seq + 1,
                unnumbered: 0,
                recent: VecDeque::new(),
                running: None,
                queue: VecDeque::new(),
                last_active: Instant::now(),
                sender: None,
                watched_once: false,
            }),
            writer,
            flushed: Arc::new(AtomicI64::new(last_seq)),
            tree: Mutex::new(None),
            trees_grown,
            known: Mutex::new(Known::default()),
        })
    }

    /// The tree at `head_version`, when known without the store: the
    /// cached one at that version, or the empty tree of version 0.
    pub(crate) fn cached_tree(&self, head_version: i64) -> Option<Arc<Tree>> {
        let cache = self.tree.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        known_tree(cache.as_ref(), head_version)
    }

    /// About how much memory the hub holds: its cached tree (0 without
    /// one) and its recent events (a quiet hub keeps a few, each possibly a
    /// whole message).
    pub(crate) fn size_in_memory(&self) -> usize {
        let events = recent_size(&self.lock());
        events + self.tree_size()
    }

    /// For the sweep, on a quiet hub: trims its recent events as a turn's
    /// end does ([`Hub::trim_between_turns`]), then its size in memory.
    pub(crate) fn trim_and_size(&self) -> usize {
        let events = {
            let mut state = self.lock();
            self.trim_between_turns(&mut state);
            recent_size(&state)
        };
        events + self.tree_size()
    }

    fn tree_size(&self) -> usize {
        let cache = self.tree.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        cache.as_ref().map_or(0, |(_, tree)| tree.size_in_memory())
    }

    pub(crate) fn cache_tree(&self, head_version: i64, tree: Arc<Tree>) {
        self.trees_grown.fetch_add(tree.size_in_memory(), Ordering::Relaxed);
        *self.tree.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some((head_version, tree));
    }

    /// Records that this node wrote `nodes` (possibly none: a head move),
    /// taking the tree from `from_version` to `to_version`. A cache at any
    /// other version is dropped.
    ///
    /// Every write that adds messages or moves the head bumps the version
    /// by one (the callers record only such writes), so the copy is
    /// advanced only when `to_version` is one step from `from_version`: a
    /// larger step means another node wrote in between, and its messages
    /// are not in `nodes`. A conversation at version 0 has no
    /// messages (the engine creates every conversation there and nothing
    /// else writes without a bump), so its first write makes the copy
    /// without reading the store: a new conversation's first turn builds
    /// its context from memory.
    pub(crate) fn advance_tree<N: Borrow<Node> + Clone + Into<Arc<Node>>>(
        &self,
        from_version: i64,
        to_version: i64,
        nodes: &[N],
    ) {
        let one_step = to_version == from_version + 1;
        self.advance_known(from_version, to_version, nodes.last().map(N::borrow));
        let mut cache = self.tree.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // Taken out, so the copy grows in place when nobody else holds it.
        let base = known_tree(cache.take().as_ref(), from_version);
        match base {
            Some(mut tree) if one_step => {
                let index = Arc::make_mut(&mut tree);
                let before = index.size_in_memory();
                for node in nodes {
                    index.push(node.clone());
                }
                self.trees_grown.fetch_add(index.size_in_memory() - before, Ordering::Relaxed);
                *cache = Some((to_version, tree));
            }
            _ => *cache = None,
        }
    }

    /// The conversation's row as kept here, and the count of changes to
    /// pass to [`Hub::remember_conversation`] after reading it from the
    /// store instead.
    ///
    /// Only the engine keeps a row, and only when it is the database's
    /// only writer: then every change to the row is made by this process,
    /// and each one either updates the kept row (a head this node moved,
    /// [`Hub::advance_tree`]) or drops it ([`Hub::forget_conversation`]).
    pub(crate) fn known_conversation(&self) -> (Option<Conversation>, u64) {
        let known = crate::lock(&self.known);
        (known.row.clone(), known.changes)
    }

    /// Keeps `row`, read from the store after [`Hub::known_conversation`]
    /// returned `changes`, unless the row changed here since (the read may
    /// have seen the state before that change).
    pub(crate) fn remember_conversation(&self, row: Conversation, changes: u64) {
        let mut known = crate::lock(&self.known);
        if known.changes == changes {
            known.row = Some(row);
        }
    }

    /// Drops the kept row: something changed it that the hub cannot follow
    /// (its settings, its deletion, a recovery's messages).
    pub(crate) fn forget_conversation(&self) {
        let mut known = crate::lock(&self.known);
        known.row = None;
        known.changes += 1;
    }

    /// The kept row follows a head this node moved one step to `last`;
    /// any other step (a head moved to an older message, a jump another
    /// writer made) drops it.
    fn advance_known(&self, from_version: i64, to_version: i64, last: Option<&Node>) {
        let mut known = crate::lock(&self.known);
        known.changes += 1;
        match (known.row.as_mut(), last) {
            (Some(row), Some(last)) if row.head_version == from_version && to_version == from_version + 1 => {
                row.head_version = to_version;
                row.head_id = Some(last.id.clone());
            }
            _ => known.row = None,
        }
    }

    /// Between turns only a short tail of the recent events stays in memory
    /// (a viewer that resumes from further back replays from the store), and
    /// the buffer gives back the room a long turn's events took. Events not
    /// yet stored stay. Done when a turn ends and again by the sweep, since
    /// the writer may store a turn's last events after its end.
    fn trim_between_turns(&self, state: &mut HubState) {
        let flushed = self.flushed.load(Ordering::Acquire);
        let kept = if state.watched_once { RECENT_BETWEEN_TURNS } else { 0 };
        while state.recent.len() > kept && state.recent.front().is_some_and(|oldest| oldest.seq <= flushed) {
            state.recent.pop_front();
        }
        if state.recent.capacity() > 4 * kept.max(state.recent.len()) {
            state.recent.shrink_to_fit();
        }
    }

    fn lock(&self) -> MutexGuard<'_, HubState> {
        // A panic while holding this lock cannot leave the state half-written
        // (every update is a few field assignments), so poisoning is ignored.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Numbers, stores (batched) and broadcasts one event.
    pub(crate) fn emit(&self, turn_id: Option<&Arc<str>>, name: EventName, payload: &impl Serialize) {
        let data = to_json(payload);
        let mut state = self.lock();
        self.emit_locked(&mut state, turn_id, name, data)
    }

    /// Frees the turn slot and emits the turn's closing event atomically, so
    /// that no event of a next turn can come before it. Hands the slot to the
    /// first queued turn, which the caller must then launch.
    pub(crate) fn finish(&self, turn_id: &Arc<str>, name: EventName, payload: &impl Serialize) -> Option<QueuedTurn> {
        let data = to_json(payload);
        let mut state = self.lock();
        if state.running.as_ref().is_some_and(|running| running.turn_id == *turn_id) {
            state.running = None;
        }
        self.emit_locked(&mut state, Some(turn_id), name, data);
        self.trim_between_turns(&mut state);
        if state.running.is_some() {
            return None;
        }
        let mut next = state.queue.pop_front()?;
        next.accepted = std::time::Instant::now();
        state.running = Some(RunningTurn {
            turn_id: Arc::from(next.turn.id.as_str()),
            cancel: next.cancel.clone(),
            reply_parent: next
                .nodes
                .last()
                .map(|node| node.id.clone())
                .unwrap_or_else(|| next.turn.user_message_id.clone()),
        });
        Some(next)
    }

    /// Takes the slot if it is free; otherwise refuses, queues or merges as
    /// `mode` says. Subscriptions are made under the same lock, so a waiting
    /// client sees every event of its turn.
    pub(crate) fn claim_or_queue(&self, running: RunningTurn, mut turn: QueuedTurn, mode: QueueMode) -> Slot {
        let mut state = self.lock();
        state.last_active = Instant::now();
        if state.running.is_none() && state.queue.is_empty() {
            state.running = Some(running);
            return Slot::Claimed(Box::new(turn));
        }
        let busy_with = state.running.as_ref().map(|running| running.turn_id.clone());
        match mode {
            QueueMode::Refuse => {
                let running =
                    busy_with.or_else(|| state.queue.front().map(|queued| Arc::from(queued.turn.id.as_str())));
                Slot::Busy { running: running.unwrap_or_else(|| Arc::from("")) }
            }
            QueueMode::Merge
                if state.queue.back().is_some_and(|last| last.merge && !last.anchored && !turn.anchored) =>
            {
                let last = state.queue.back_mut().expect("checked above");
                for node in turn.nodes.drain(..) {
                    // A resent message id is not added twice.
                    if last.nodes.iter().all(|known| known.id != node.id) {
                        let node = Node { turn_id: Some(last.turn.id.clone()), ..Arc::unwrap_or_clone(node) };
                        last.nodes.push(Arc::new(node));
                    }
                }
                Arc::make_mut(&mut last.turn).pending_messages = unshared(&last.nodes);
                let merged = last.turn.clone();
                let outcome = last.outcome.subscribe();
                let receiver = state.viewer();
                let last_seq = state.next_seq - 1;
                let subscription = Subscription { backlog: Vec::new(), memory_from: state.next_seq, receiver };
                Slot::Merged { turn: merged, subscription, last_seq, outcome }
            }
            QueueMode::Fifo | QueueMode::Merge => {
                // Stored with the turn's row: durable until the turn starts.
                Arc::make_mut(&mut turn.turn).pending_messages = unshared(&turn.nodes);
                let queued_turn = turn.turn.clone();
                turn.waited = true;
                state.queue.push_back(turn);
                let receiver = state.viewer();
                let last_seq = state.next_seq - 1;
                let subscription = Subscription { backlog: Vec::new(), memory_from: state.next_seq, receiver };
                Slot::Queued { turn: queued_turn, position: state.queue.len(), subscription, last_seq }
            }
        }
    }

    /// Gives the free slot to the first queued turn (after another node's
    /// turn on this conversation finished).
    pub(crate) fn take_next_queued(&self) -> Option<QueuedTurn> {
        let mut state = self.lock();
        if state.running.is_some() {
            return None;
        }
        let mut next = state.queue.pop_front()?;
        next.accepted = std::time::Instant::now();
        state.running = Some(RunningTurn {
            turn_id: Arc::from(next.turn.id.as_str()),
            cancel: next.cancel.clone(),
            reply_parent: next
                .nodes
                .last()
                .map(|node| node.id.clone())
                .unwrap_or_else(|| next.turn.user_message_id.clone()),
        });
        Some(next)
    }

    /// Puts a turn that could not start (another node runs one) back at the
    /// head of the queue and frees the slot.
    pub(crate) fn requeue_front(&self, mut turn: QueuedTurn) {
        let mut state = self.lock();
        if state.running.as_ref().is_some_and(|running| *running.turn_id == *turn.turn.id) {
            state.running = None;
        }
        turn.waited = true;
        state.queue.push_front(turn);
    }

    /// Takes a queued turn out of the queue (it was cancelled).
    pub(crate) fn remove_queued(&self, turn_id: &str) -> Option<QueuedTurn> {
        let mut state = self.lock();
        let position = state.queue.iter().position(|queued| queued.turn.id == turn_id)?;
        state.queue.remove(position)
    }

    fn emit_locked(&self, state: &mut HubState, turn_id: Option<&Arc<str>>, name: EventName, data: Arc<str>) {
        let event = Event {
            seq: 0,
            conversation_id: self.conversation_id.clone(),
            turn_id: turn_id.cloned(),
            name,
            data,
            created_at: now_millis(),
        };
        state.last_active = Instant::now();
        match self.numbering {
            Numbering::Local => {
                let event = Event { seq: state.next_seq, ..event };
                self.publish_locked(state, &event);
                self.writer.write(event, self.flushed.clone());
            }
            Numbering::Database => {
                // Numbered by the database as the writer stores it, in the
                // order emitted; published back here by `publish`.
                state.unnumbered += 1;
                self.writer.write_unnumbered(event, self.me.clone());
            }
        }
    }

    /// Makes a numbered event visible to viewers.
    fn publish_locked(&self, state: &mut HubState, event: &Event) {
        if event.seq < state.next_seq {
            return;
        }
        state.next_seq = event.seq + 1;
        state.recent.push_back(event.clone());
        let flushed = self.flushed.load(Ordering::Acquire);
        while state.recent.len() > RECENT_KEPT && state.recent.front().is_some_and(|oldest| oldest.seq <= flushed) {
            state.recent.pop_front();
        }
        // Sending under the lock keeps the broadcast order equal to seq
        // order. A send that finds no viewer left drops the channel.
        if let Some(sender) = &state.sender
            && sender.send(event.clone()).is_err()
        {
            state.sender = None;
        }
    }

    /// Publishes events the database numbered and stored: this node's own
    /// (`own` of them, from the writer) or another node's (read back after a
    /// notice). Ones already published are skipped.
    pub(crate) fn publish(&self, events: &[Event], own: usize) {
        let mut state = self.lock();
        state.unnumbered = state.unnumbered.saturating_sub(own);
        if let Some(last) = events.last() {
            self.flushed.fetch_max(last.seq, Ordering::AcqRel);
        }
        for event in events {
            self.publish_locked(&mut state, event);
        }
    }

    /// The last seq published here: a stream that starts after it sees
    /// everything from now on.
    pub(crate) fn last_published(&self) -> i64 {
        self.lock().next_seq - 1
    }

    /// Subscribes a viewer that has seen everything up to `after`.
    pub(crate) fn subscribe(&self, after: i64) -> Subscription {
        let mut state = self.lock();
        let receiver = self.add_viewer(&mut state);
        let memory_from = state.recent.front().map_or(state.next_seq, |oldest| oldest.seq);
        let backlog = state.recent.iter().filter(|event| event.seq > after).cloned().collect();
        Subscription { backlog, memory_from, receiver }
    }

    /// A new viewer's receiver. Events the writer holds because nobody
    /// watched are stored (and so published) now, not after its hold.
    fn add_viewer(&self, state: &mut HubState) -> broadcast::Receiver<Event> {
        if state.unnumbered > 0 {
            self.writer.release();
        }
        state.viewer()
    }

    /// Whether someone on this node follows this conversation's events.
    pub(crate) fn watched(&self) -> bool {
        self.lock().viewers() > 0
    }

    /// Records which message the running turn answers (known once a queued
    /// turn's messages are recorded).
    pub(crate) fn set_reply_parent(&self, turn_id: &str, reply_parent: &str) {
        let mut state = self.lock();
        if let Some(running) = state.running.as_mut().filter(|running| &*running.turn_id == turn_id) {
            running.reply_parent = reply_parent.to_string();
        }
    }

    /// Frees the slot if `turn_id` holds it.
    pub(crate) fn release(&self, turn_id: &str) {
        let mut state = self.lock();
        if state.running.as_ref().is_some_and(|running| &*running.turn_id == turn_id) {
            state.running = None;
        }
        state.last_active = Instant::now();
    }

    pub(crate) fn running(&self) -> Option<RunningTurn> {
        self.lock().running.clone()
    }

    /// When the hub was last busy, if it can be dropped from memory without
    /// losing anything: no turn, no viewer, every event stored.
    pub(crate) fn idle_since(&self) -> Option<Instant> {
        let state = self.lock();
        let idle = state.running.is_none()
            && state.queue.is_empty()
            && state.unnumbered == 0
            && state.viewers() == 0
            && self.flushed.load(Ordering::Acquire) >= state.next_seq - 1;
        idle.then_some(state.last_active)
    }
}

/// Copies of shared nodes, for a turn row's pending messages (stored with
/// a queued turn until it starts).
pub(crate) fn unshared(nodes: &[Arc<Node>]) -> Vec<Node> {
    nodes.iter().map(|node| Node::clone(node)).collect()
}

/// The recent events' buffer and their payloads, in bytes.
fn recent_size(state: &HubState) -> usize {
    let payloads: usize = state.recent.iter().map(|event| event.data.len()).sum();
    state.recent.capacity() * size_of::<Event>() + payloads
}
