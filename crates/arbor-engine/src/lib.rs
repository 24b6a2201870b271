//! The turn orchestrator. The engine owns conversations at run time: it makes
//! every id and timestamp, records the user's message before any model is
//! called, runs each turn as a task of its own (a client that goes away does
//! not stop it), numbers and fans out the conversation's events, and records
//! what every model call cost. It knows nothing of HTTP.
#![forbid(unsafe_code)]

mod cluster;
pub mod error;
mod hub;
pub mod keys;
pub mod metrics;
pub mod models;
mod payloads;
pub mod stream;
mod submit;
mod turn;
mod writer;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arbor_core::ids::{new_id, now_millis};
use arbor_core::tree::Tree;
use arbor_core::{EventName, Node};
use arbor_store::{
    ApiCall, Conversation, ConversationCursor, ConversationUpdate, Store, StoreError, Turn, TurnStatus, User,
};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use error::{EngineError, EngineResult};
pub use models::{Models, ResolvedModel};
pub use stream::{EventStream, Until};
pub use submit::{QueueMode, Submit, Submitted};
pub use turn::TurnOutcome;

use crate::hub::Hub;
use crate::writer::EventWriter;

/// The hasher of the engine's per-request maps (loaded conversations by id,
/// recent API keys): foldhash, seeded at random per map, where std's
/// SipHash took ~250 instructions for a 36-byte id. Their keys are ids the
/// server made and SHA-256 digests.
type FastHash = foldhash::fast::RandomState;

/// Limits on a turn (DESIGN.md §5).
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_tool_rounds: u32,
    pub max_parallel_tools: u32,
    pub tool_timeout: Duration,
    pub turn_timeout: Duration,
    /// Longest message text accepted, in bytes.
    pub max_message_bytes: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_tool_rounds: 10,
            max_parallel_tools: 5,
            tool_timeout: Duration::from_secs(30),
            turn_timeout: Duration::from_secs(120),
            max_message_bytes: 256 * 1024,
        }
    }
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub limits: Limits,
    /// Several Arbor processes share the database (PostgreSQL): events are
    /// numbered by the database and announced between nodes, running turns
    /// hold leases, and a node that dies has its turns taken over.
    pub shared: bool,
    /// How long a running turn's lease lasts without renewal (shared mode).
    pub turn_lease: Duration,
    /// Quiet conversations kept loaded (their hub and cached tree) at most;
    /// beyond this the longest quiet leave memory first, and come back from
    /// the store when next used.
    pub idle_conversations_kept: usize,
    /// The memory quiet conversations may hold together, in bytes: their
    /// cached trees (as [`arbor_core::tree::Tree::size_in_memory`] counts
    /// them) and recent events. A count alone does not bound it, since one
    /// conversation may hold thousands of messages. The most recently busy
    /// are kept first.
    pub idle_conversations_bytes: usize,
    /// How often quiet conversations are swept when no new one comes to
    /// trigger it, so that memory goes back once the load does.
    pub sweep_every: Duration,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            limits: Limits::default(),
            shared: false,
            turn_lease: Duration::from_secs(15),
            idle_conversations_kept: IDLE_CONVERSATIONS_KEPT,
            idle_conversations_bytes: IDLE_CONVERSATIONS_BYTES,
            sweep_every: Duration::from_secs(15),
        }
    }
}

/// A new conversation's settings.
#[derive(Debug, Clone, Default)]
pub struct NewConversation {
    pub title: Option<String>,
    pub model: Option<String>,
    pub system_prompt: Option<String>,
}

/// A started turn: its row, the user message, the turn's own event stream
/// (from `turn.started` to `done`/`error`), and a way to wait for its end.
pub struct TurnHandle {
    pub turn: Arc<Turn>,
    /// The message the turn answers, when this submit recorded it now (not
    /// for a queued or merged submit, whose messages are recorded at start).
    pub user_message: Option<Arc<Node>>,
    events: stream::PendingEvents,
    outcome: turn::OutcomeReceiver,
}

impl TurnHandle {
    /// The turn's own events, from its first (`turn.started`, or
    /// `turn.queued`) to its `done` or `error`.
    ///
    /// Yields once before the stream starts, so that a turn that just
    /// started sends its model call first: the viewer's stream (a task,
    /// the response's headers, the first events) is then not on the first
    /// token's path, and replays whatever it missed. At 100 streamed turns
    /// a second the first token came ~76 µs sooner at the median
    /// (bench/analysis.md, "Since the forty-first run").
    pub async fn events(self) -> EventStream {
        tokio::task::yield_now().await;
        self.events.start()
    }

    /// Waits until the turn has finished and been recorded.
    pub async fn outcome(mut self) -> EngineResult<Arc<TurnOutcome>> {
        drop(self.events);
        let outcome = self
            .outcome
            .wait_for(Option::is_some)
            .await
            .map_err(|_| EngineError::Internal("the turn task ended without an outcome".into()))?;
        outcome.clone().ok_or_else(|| EngineError::Internal("the turn has no outcome".into()))
    }
}

/// A conversation with its whole tree ([`Engine::conversation_tree`]).
#[derive(Debug, Clone)]
pub struct ConversationTree {
    pub conversation: Conversation,
    /// The conversation's tree in memory when it is busy (shared, not
    /// copied), else read from the store.
    pub tree: Arc<Tree>,
}

/// A conversation with its active path ([`Engine::conversation_path`]).
#[derive(Debug, Clone)]
pub struct ConversationPath {
    pub conversation: Conversation,
    /// Root to head, shared with the conversation's tree when it is in
    /// memory.
    pub messages: Vec<Arc<Node>>,
}

/// A turn with its api calls.
#[derive(Debug, Clone)]
pub struct TurnDetails {
    pub turn: Turn,
    pub api_calls: Vec<ApiCall>,
    /// The turn's events as stored, in order: its whole trace.
    pub events: Vec<arbor_core::Event>,
}

pub(crate) struct Inner {
    pub store: Arc<dyn Store>,
    pub models: Models,
    pub config: EngineConfig,
    hubs: Mutex<Hubs>,
    writer: EventWriter,
    tracker: TaskTracker,
    /// Set when the server stops accepting turns.
    closing: CancellationToken,
    /// Cancelled when the shutdown grace period ends: running turns stop
    /// and are recorded as interrupted.
    pub interrupt: CancellationToken,
    /// Recently seen API keys (SHA-256 → user, when checked), so that a busy
    /// client does not cost a database read per request.
    key_cache: Mutex<HashMap<[u8; 32], (User, Instant), FastHash>>,
    /// Queued turns that just got their conversation's slot, for the
    /// launcher task to start.
    launcher: tokio::sync::mpsc::UnboundedSender<(Arc<Hub>, String, hub::QueuedTurn)>,
    pub metrics: metrics::Metrics,
    /// This process's name among the nodes sharing the database.
    pub node_id: String,
    /// One node on a database no other process writes: every change to a
    /// conversation's row is made here, so a busy conversation's row is
    /// kept in its hub instead of read for each turn.
    keeps_rows: bool,
}

impl Inner {
    fn numbering(&self) -> hub::Numbering {
        if self.config.shared { hub::Numbering::Database } else { hub::Numbering::Local }
    }

    pub(crate) fn queue_launch(&self, hub: Arc<Hub>, owner_id: String, next: hub::QueuedTurn) {
        // The launcher lives as long as the engine.
        let _ = self.launcher.send((hub, owner_id, next));
    }
}

/// How long an authenticated key is trusted without asking the store again.
const KEY_CACHE_TTL: Duration = Duration::from_secs(30);
/// Hubs quiet for this long (and fully stored) leave memory.
const HUB_IDLE: Duration = Duration::from_secs(30);
/// Quiet hubs kept at most, by default ([`EngineConfig::idle_conversations_kept`]). A quiet hub with
/// its cached tree of a short conversation is ~20-30 KB: kept for `HUB_IDLE` alone, the
/// conversations of the benchmark's last 30 s at 2,000 turns/s (a new one every 10 turns) took the
/// process to 111-164 MB, against 68-83 MB with this bound (bench/memprobe.sh, bench/analysis.md).
pub const IDLE_CONVERSATIONS_KEPT: usize = 512;
/// The memory quiet conversations (cached trees, recent events) may hold together, by default
/// ([`EngineConfig::idle_conversations_bytes`]): 512 short conversations (~20 messages) count
/// ~5 MB, one of 10,000 messages ~5 MB.
pub const IDLE_CONVERSATIONS_BYTES: usize = 32 << 20;
/// The fewest new hubs between two sweeps (fewer when fewer quiet ones may stay).
const HUB_SWEEP_MIN: usize = 256;
/// The least growth of the cached trees that sweeps on its own (with a limit of 0 every new hub
/// would sweep, a scan of all of them each time).
const SWEEP_GROWTH_MIN: usize = 64 << 10;

/// The conversations loaded in memory.
struct Hubs {
    map: HashMap<String, Arc<Hub>, FastHash>,
    /// The size at which the next sweep runs: [`Hubs::gap`] more than the last one kept, so each
    /// sweep is paid for by new hubs in proportion to what it scanned (a sweep on every new hub
    /// once 256 were busy made loading O(hubs)).
    sweep_at: usize,
    /// Quiet hubs kept at most after a sweep.
    idle_kept: usize,
    /// The bytes quiet hubs may hold together after a sweep ([`Hub::size_in_memory`]).
    idle_bytes: usize,
    /// Bytes the loaded hubs' cached trees have grown by since the last sweep (each hub adds
    /// what it caches).
    grown: Arc<AtomicUsize>,
}

impl Hubs {
    fn new(idle_kept: usize, idle_bytes: usize) -> Hubs {
        let grown = Arc::new(AtomicUsize::new(0));
        let mut hubs = Hubs { map: HashMap::default(), sweep_at: 0, idle_kept, idle_bytes, grown };
        hubs.sweep_at = hubs.gap();
        hubs
    }

    /// How many hubs may be added before the next sweep: an eighth of those loaded (each new hub
    /// pays for visiting ~8 at the next sweep, ~1 µs), at least [`HUB_SWEEP_MIN`]. Half, as it was,
    /// let the map grow to 1.5 times the busy and kept ones between sweeps: ~1,900 loaded instead of
    /// ~1,500 when 750 conversations queued, ~5 MB (bench/analysis.md).
    fn gap(&self) -> usize {
        (self.map.len() / 8).max(HUB_SWEEP_MIN.min(self.idle_kept)).max(1)
    }

    /// The conversation's hub, adding the one `make` builds (given the counter its cached tree
    /// grows) when none is loaded. It sweeps first when the map has grown enough, or the trees
    /// by half of `idle_bytes`: a few long conversations would otherwise take memory far past
    /// the limit before enough new hubs came.
    fn get_or_insert(&mut self, conversation_id: &str, make: impl FnOnce(Arc<AtomicUsize>) -> Arc<Hub>) -> Arc<Hub> {
        if let Some(hub) = self.map.get(conversation_id) {
            return hub.clone();
        }
        let grown = self.grown.load(Ordering::Relaxed);
        if self.map.len() >= self.sweep_at || grown > (self.idle_bytes / 2).max(SWEEP_GROWTH_MIN) {
            self.sweep();
        }
        let hub = make(self.grown.clone());
        self.map.insert(conversation_id.to_string(), hub.clone());
        hub
    }

    /// Drops the hubs that can go without losing anything (see [`Hub::idle_since`]) and that nobody
    /// else holds: those quiet for `HUB_IDLE`, then, of the others, each that does not fit in
    /// `idle_kept` hubs and `idle_bytes` (trees and recent events), the most recently busy placed
    /// first.
    fn sweep(&mut self) {
        let mut quiet = Vec::new();
        self.map.retain(|id, hub| {
            // Held elsewhere (a request between finding the hub and using it): kept, or that
            // request would use a hub the next one for this conversation does not see.
            let since = if Arc::strong_count(hub) == 1 { hub.idle_since() } else { None };
            match since {
                Some(since) if since.elapsed() >= HUB_IDLE => false,
                Some(since) => {
                    quiet.push((since, hub.trim_and_size(), id.clone()));
                    true
                }
                None => true,
            }
        });
        quiet.sort_unstable_by_key(|&(since, _, _)| std::cmp::Reverse(since));
        let (mut kept, mut bytes) = (0, 0);
        for (_, size, id) in &quiet {
            if kept < self.idle_kept && bytes + size <= self.idle_bytes {
                kept += 1;
                bytes += size;
            } else {
                self.map.remove(id);
            }
        }
        self.sweep_at = self.map.len() + self.gap();
        self.grown.store(0, Ordering::Relaxed);
    }
}

#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl Engine {
    /// Starts the engine: the event writer, and recovery of turns a previous
    /// process left running (they are marked interrupted).
    pub async fn start(store: Arc<dyn Store>, models: Models, config: EngineConfig) -> EngineResult<Engine> {
        let closing = CancellationToken::new();
        let (writer, _task) = EventWriter::start(store.clone(), closing.clone());
        let (launcher, mut launches) = tokio::sync::mpsc::unbounded_channel();
        let hubs = Hubs::new(config.idle_conversations_kept, config.idle_conversations_bytes);
        let keeps_rows = !config.shared && store.sole_writer();
        let engine = Engine {
            inner: Arc::new(Inner {
                keeps_rows,
                store,
                models,
                config,
                hubs: Mutex::new(hubs),
                writer,
                tracker: TaskTracker::new(),
                closing,
                interrupt: CancellationToken::new(),
                key_cache: Mutex::new(HashMap::default()),
                launcher,
                metrics: metrics::Metrics::default(),
                node_id: new_id(),
            }),
        };
        // Quiet hubs also leave on a timer, not only when new ones come.
        let weak = Arc::downgrade(&engine.inner);
        let every = engine.inner.config.sweep_every;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(inner) = weak.upgrade() else { return };
                lock(&inner.hubs).sweep();
            }
        });
        let inner = engine.inner.clone();
        tokio::spawn(async move {
            while let Some((hub, owner_id, next)) = launches.recv().await {
                tokio::spawn(inner.clone().launch_next(hub, owner_id, next));
            }
        });
        if engine.inner.config.shared {
            // Other nodes may be running turns right now: only turns whose
            // lease expired are taken over, by the sweeper.
            cluster::start(engine.clone()).await?;
        } else {
            engine.recover_interrupted_turns().await?;
            // Credits held by calls that never settled (a store fault
            // mid-turn) go back once their reservation expires.
            let store = engine.inner.store.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    if let Err(error) = store.release_expired_reservations(now_millis()).await {
                        tracing::warn!(%error, "releasing expired credit reservations failed");
                    }
                }
            });
        }
        Ok(engine)
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    pub fn models(&self) -> &Models {
        &self.inner.models
    }

    /// The `/metrics` text: the counters and histograms, and the
    /// conversations loaded in memory now.
    pub fn render_metrics(&self) -> String {
        let hubs = self.loaded_hubs();
        let bytes: usize = hubs.iter().map(|hub| hub.size_in_memory()).sum();
        self.inner.metrics.render(&[
            (
                "arbor_conversations_loaded",
                "Conversations held in memory (busy, or quiet and kept).",
                hubs.len() as u64,
            ),
            (
                "arbor_conversations_bytes",
                "About how many bytes the loaded conversations hold (cached trees, recent events).",
                bytes as u64,
            ),
        ])
    }

    pub fn limits(&self) -> &Limits {
        &self.inner.config.limits
    }

    // ---- users and keys ----

    /// The user a bearer key belongs to.
    pub async fn authenticate(&self, key: &str) -> EngineResult<Option<User>> {
        let digest = keys::key_digest(key);
        {
            let cache = lock(&self.inner.key_cache);
            if let Some((user, seen)) = cache.get(&digest)
                && seen.elapsed() < KEY_CACHE_TTL
            {
                return Ok(Some(user.clone()));
            }
        }
        let user = self.inner.store.user_by_key_hash(&hex::encode(digest)).await?;
        let mut cache = lock(&self.inner.key_cache);
        if cache.len() > 10_000 {
            cache.retain(|_, (_, seen)| seen.elapsed() < KEY_CACHE_TTL);
        }
        match &user {
            Some(user) => cache.insert(digest, (user.clone(), Instant::now())),
            None => cache.remove(&digest),
        };
        Ok(user)
    }

    pub async fn create_user(&self, name: &str, is_admin: bool) -> EngineResult<(User, String)> {
        keys::create_user(self.inner.store.as_ref(), name, is_admin).await
    }

    pub async fn create_key(&self, user_name: &str) -> EngineResult<String> {
        keys::create_key(self.inner.store.as_ref(), user_name).await
    }

    // ---- conversations ----

    pub async fn create_conversation(&self, user: &User, new: NewConversation) -> EngineResult<Conversation> {
        let model = match new.model {
            Some(model) => {
                self.inner.models.resolve(&model)?;
                model
            }
            None => self.inner.models.default_model().to_string(),
        };
        validate_text("title", new.title.as_deref(), 1024)?;
        validate_text("system_prompt", new.system_prompt.as_deref(), self.inner.config.limits.max_message_bytes)?;
        let now = now_millis();
        let conversation = Conversation {
            id: new_id(),
            owner_id: user.id.clone(),
            title: new.title,
            system_prompt: new.system_prompt,
            preset_id: None,
            model,
            head_id: None,
            head_version: 0,
            summary: None,
            created_at: now,
            updated_at: now,
        };
        self.inner.store.create_conversation(&conversation).await?;
        Ok(conversation)
    }

    pub async fn conversation(&self, user: &User, conversation_id: &str) -> EngineResult<Conversation> {
        self.inner.store.conversation(&user.id, conversation_id).await?.ok_or(EngineError::NotFound("conversation"))
    }

    /// The user's conversation and their available credits (`None`:
    /// unlimited), in one read, or without one: a busy conversation of an
    /// unlimited user is kept in its hub when the engine is the database's
    /// only writer (`Inner::keeps_rows`). A user's credits are only set
    /// with the server stopped then (`arbor users credits` cannot open the
    /// database beside it), so an unlimited user stays unlimited; a
    /// limited user's credits change with each call and are always read.
    async fn conversation_for_turn(
        &self,
        user: &User,
        conversation_id: &str,
    ) -> EngineResult<(Conversation, Option<i64>)> {
        // The hub that may keep the row read below, with its count of
        // changes at the read's start.
        let mut keeper = None;
        if let Some(hub) = self.hub_if_loaded(conversation_id).filter(|_| self.inner.keeps_rows) {
            match hub.known_conversation() {
                (Some(row), _) if row.owner_id == user.id => return Ok((row, None)),
                (_, changes) => keeper = Some((hub, changes)),
            }
        }
        let (row, available) = self
            .inner
            .store
            .conversation_for_turn(&user.id, conversation_id)
            .await?
            .ok_or(EngineError::NotFound("conversation"))?;
        if let (Some((hub, changes)), None) = (keeper, available) {
            hub.remember_conversation(row.clone(), changes);
        }
        Ok((row, available))
    }

    pub async fn conversation_tree(&self, user: &User, conversation_id: &str) -> EngineResult<ConversationTree> {
        let conversation = self.conversation(user, conversation_id).await?;
        let tree = self.tree_of(&conversation).await?;
        Ok(ConversationTree { conversation, tree })
    }

    /// The conversation with only its active path (root to head, the
    /// context a turn sends). Walked in the busy conversation's tree in
    /// memory, or in one read from the store. The messages are the tree's,
    /// shared: none is copied.
    pub async fn conversation_path(&self, user: &User, conversation_id: &str) -> EngineResult<ConversationPath> {
        let conversation = self.conversation(user, conversation_id).await?;
        let Some(head) = conversation.head_id.as_deref() else {
            return Ok(ConversationPath { conversation, messages: Vec::new() });
        };
        let tree = self.tree_of(&conversation).await?;
        let messages = tree.path_to(head).into_iter().cloned().collect();
        Ok(ConversationPath { conversation, messages })
    }

    /// The conversation's tree at its head version: a busy conversation's
    /// is in memory (the hub's), others are read from the store.
    async fn tree_of(&self, conversation: &Conversation) -> EngineResult<Arc<Tree>> {
        Ok(match self.hub_if_loaded(&conversation.id) {
            Some(hub) => self.inner.tree(&hub, &conversation.id, conversation.head_version).await?,
            None => Arc::new(Tree::new(self.inner.store.messages(&conversation.id).await?)),
        })
    }

    pub async fn list_conversations(
        &self,
        user: &User,
        cursor: Option<ConversationCursor>,
        limit: u32,
    ) -> EngineResult<Vec<Conversation>> {
        Ok(self.inner.store.list_conversations(&user.id, cursor.as_ref(), limit.clamp(1, 100)).await?)
    }

    pub async fn update_conversation(
        &self,
        user: &User,
        conversation_id: &str,
        mut update: ConversationUpdate,
    ) -> EngineResult<Conversation> {
        if let Some(model) = &update.model {
            self.inner.models.resolve(model)?;
        }
        validate_text("title", update.title.as_deref(), 1024)?;
        validate_text("system_prompt", update.system_prompt.as_deref(), self.inner.config.limits.max_message_bytes)?;
        update.updated_at = now_millis();
        let updated = self
            .inner
            .store
            .update_conversation(&user.id, conversation_id, &update)
            .await
            .map_err(not_found("conversation"));
        self.forget_conversation(conversation_id);
        updated
    }

    pub async fn delete_conversation(&self, user: &User, conversation_id: &str) -> EngineResult<()> {
        let conversation = self.conversation(user, conversation_id).await?;
        if let Some(running) = self.hub_if_loaded(&conversation.id).and_then(|hub| hub.running()) {
            running.cancel.cancel();
        }
        let deleted =
            self.inner.store.delete_conversation(&user.id, conversation_id).await.map_err(not_found("conversation"));
        self.forget_conversation(conversation_id);
        deleted
    }

    /// Drops the row a loaded conversation keeps (see
    /// [`Engine::conversation_for_turn`]) after a change the hub cannot
    /// follow.
    fn forget_conversation(&self, conversation_id: &str) {
        if let Some(hub) = self.hub_if_loaded(conversation_id) {
            hub.forget_conversation();
        }
    }

    // ---- turns ----

    /// The events of a conversation after `after`, then live ones.
    pub async fn events(
        &self,
        user: &User,
        conversation_id: &str,
        after: i64,
        until: Until,
    ) -> EngineResult<EventStream> {
        let conversation = self.conversation(user, conversation_id).await?;
        let hub = self.hub(&conversation.id).await?;
        let subscription = hub.subscribe(after);
        Ok(stream::follow(self.inner.store.clone(), hub, subscription, after, until))
    }

    pub async fn turn_details(&self, user: &User, conversation_id: &str, turn_id: &str) -> EngineResult<TurnDetails> {
        let conversation = self.conversation(user, conversation_id).await?;
        let turn = self.inner.store.turn(&conversation.id, turn_id).await?.ok_or(EngineError::NotFound("turn"))?;
        let api_calls = self.inner.store.api_calls(&turn.id).await?;
        let of_turn = |event: &arbor_core::Event| event.turn_id.as_deref() == Some(turn.id.as_str());
        // As a viewer's replay does (stream.rs): the hub's memory holds every
        // event not stored yet, so subscribing first fixes where it starts,
        // and everything before that is in the store.
        let memory = self.hub_if_loaded(&conversation.id).map(|hub| hub.subscribe(0));
        let stored_below = memory.as_ref().map_or(i64::MAX, |memory| memory.memory_from);
        let mut events = Vec::new();
        let mut after = 0;
        while after + 1 < stored_below {
            let page = self.inner.store.events_after(&conversation.id, after, 1000).await?;
            let Some(last) = page.last() else { break };
            after = last.seq;
            events.extend(page.into_iter().filter(|event| event.seq < stored_below).filter(of_turn));
        }
        if let Some(memory) = memory {
            events.extend(memory.backlog.into_iter().filter(of_turn));
        }
        Ok(TurnDetails { turn, api_calls, events })
    }

    /// Stops a running turn now. Cancelling a finished turn changes nothing.
    pub async fn cancel_turn(&self, user: &User, conversation_id: &str, turn_id: &str) -> EngineResult<Turn> {
        let conversation = self.conversation(user, conversation_id).await?;
        let turn = self.inner.store.turn(&conversation.id, turn_id).await?.ok_or(EngineError::NotFound("turn"))?;
        if turn.status.is_finished() {
            return Ok(turn);
        }
        if let Some(hub) = self.hub_if_loaded(&conversation.id) {
            if let Some(running) = hub.running()
                && &*running.turn_id == turn_id
            {
                running.cancel.cancel();
                return Ok(turn);
            }
            if let Some(queued) = hub.remove_queued(turn_id) {
                return self.inner.cancel_queued(&hub, &user.id, queued).await;
            }
        }
        if self.inner.config.shared {
            // The turn runs (or waits) on another node.
            let notice =
                arbor_store::Notice::CancelTurn { conversation_id: conversation.id.clone(), turn_id: turn.id.clone() };
            self.inner.store.notify(&notice).await?;
        }
        Ok(turn)
    }

    // ---- lifecycle ----

    /// Stops accepting turns, lets running ones finish for `grace`, then
    /// interrupts the rest (recorded as `interrupted`) and stores every event.
    pub async fn shutdown(&self, grace: Duration) {
        self.inner.closing.cancel();
        self.inner.tracker.close();
        if tokio::time::timeout(grace, self.inner.tracker.wait()).await.is_err() {
            tracing::warn!("turns still running after the grace period; interrupting them");
            self.inner.interrupt.cancel();
            self.inner.tracker.wait().await;
        }
        self.inner.writer.flush().await;
    }

    /// Waits until every event emitted so far is stored (tests, shutdown).
    pub async fn flush_events(&self) {
        self.inner.writer.flush().await;
    }

    async fn hub(&self, conversation_id: &str) -> EngineResult<Arc<Hub>> {
        if let Some(hub) = self.hub_if_loaded(conversation_id) {
            return Ok(hub);
        }
        let last_seq = self.inner.store.last_event_seq(conversation_id).await?;
        let make =
            |grown| Hub::new(conversation_id, last_seq, self.inner.writer.clone(), self.inner.numbering(), grown);
        Ok(lock(&self.inner.hubs).get_or_insert(conversation_id, make))
    }

    fn hub_if_loaded(&self, conversation_id: &str) -> Option<Arc<Hub>> {
        lock(&self.inner.hubs).map.get(conversation_id).cloned()
    }

    /// How many conversations are loaded in memory now (busy or kept quiet).
    pub fn loaded_conversations(&self) -> usize {
        lock(&self.inner.hubs).map.len()
    }

    /// Hubs in memory now.
    pub(crate) fn loaded_hubs(&self) -> Vec<Arc<Hub>> {
        lock(&self.inner.hubs).map.values().cloned().collect()
    }

    /// Marks turns a crashed process left running (or queued) as
    /// interrupted, keeping what they streamed, and tells any viewer that
    /// resumes their stream. Only for one node: with several, the sweeper
    /// takes over turns whose lease expired instead.
    async fn recover_interrupted_turns(&self) -> EngineResult<()> {
        let stale = self.inner.store.turns_with_status(&[TurnStatus::Running, TurnStatus::Queued]).await?;
        for turn in stale {
            cluster::interrupt(self, turn).await?;
        }
        self.inner.writer.flush().await;
        Ok(())
    }

    /// Rebuilds the answer a dead turn had streamed from its stored `delta`
    /// events and keeps it as an interrupted reply (the head moves to it).
    pub(crate) async fn salvage_partial_reply(&self, turn: &Turn) -> EngineResult<Option<Node>> {
        if turn.reply_message_id.is_some() {
            return Ok(None);
        }
        let mut text = String::new();
        let mut after = 0;
        loop {
            let page = self.inner.store.events_after(&turn.conversation_id, after, 1000).await?;
            let Some(last) = page.last() else { break };
            after = last.seq;
            for event in page
                .iter()
                .filter(|event| event.name == EventName::Delta && event.turn_id.as_deref() == Some(turn.id.as_str()))
            {
                if let Some(delta) = event.data_json()["text"].as_str() {
                    text.push_str(delta);
                }
            }
        }
        if text.is_empty() || self.inner.store.message(&turn.conversation_id, &turn.user_message_id).await?.is_none() {
            return Ok(None);
        }
        let node = Node {
            id: new_id(),
            conversation_id: turn.conversation_id.clone(),
            parent_id: Some(turn.user_message_id.clone()),
            message: arbor_core::Message::assistant(text),
            model: Some(turn.model.clone()),
            provider: self.inner.models.registry().get(&turn.model).map(|model| model.provider.clone()),
            turn_id: Some(turn.id.clone()),
            copied_from: None,
            status: arbor_core::message::NodeStatus::Interrupted,
            created_at: now_millis(),
        };
        self.inner.store.append_messages(std::slice::from_ref(&node), now_millis()).await?;
        Ok(Some(node))
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn not_found(what: &'static str) -> impl Fn(StoreError) -> EngineError {
    move |error| match error {
        StoreError::NotFound => EngineError::NotFound(what),
        other => other.into(),
    }
}

fn validate_text(field: &str, text: Option<&str>, max_bytes: usize) -> EngineResult<()> {
    match text {
        Some(text) if text.len() > max_bytes => {
            Err(EngineError::InvalidInput(format!("{field} is {} bytes; the limit is {max_bytes}", text.len())))
        }
        _ => Ok(()),
    }
}

/// Client-chosen message ids: 1–128 printable characters, no whitespace.
fn validate_message_id(id: &str) -> EngineResult<()> {
    let valid = !id.is_empty() && id.len() <= 128 && id.chars().all(|c| c.is_ascii_graphic());
    if valid {
        Ok(())
    } else {
        Err(EngineError::InvalidInput(format!(
            "message id {id:?} is not valid: use 1-128 printable ASCII characters without spaces"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::writer::EventWriter;
    use arbor_core::{Event, Message};
    use futures_util::StreamExt;

    /// Loads a hub the way `Engine::hub` does.
    fn load(hubs: &mut Hubs, writer: &EventWriter, id: &str) -> Arc<Hub> {
        hubs.get_or_insert(id, |grown| Hub::new(id, 0, writer.clone(), hub::Numbering::Local, grown))
    }

    fn loaded(hubs: &Hubs) -> Vec<&str> {
        let mut ids: Vec<&str> = hubs.map.keys().map(String::as_str).collect();
        ids.sort();
        ids
    }

    #[tokio::test]
    async fn quiet_conversations_beyond_the_limit_leave_memory_longest_quiet_first() {
        let writer = EventWriter::in_memory().await;
        let mut hubs = Hubs::new(2, usize::MAX);
        // c0 has a viewer and c1 is held by a request: neither may go.
        let c0 = load(&mut hubs, &writer, "c0");
        let _viewer = c0.subscribe(c0.last_published());
        drop(c0);
        let _held = load(&mut hubs, &writer, "c1");
        for id in ["c2", "c3", "c4", "c5"] {
            std::thread::sleep(Duration::from_millis(2));
            drop(load(&mut hubs, &writer, id));
        }
        hubs.sweep();
        assert_eq!(loaded(&hubs), ["c0", "c1", "c4", "c5"], "the two most recently busy quiet ones stay");

        // Kept under the limit, nothing quiet goes before `HUB_IDLE`.
        let mut roomy = Hubs::new(10, usize::MAX);
        for id in ["a", "b", "c"] {
            drop(load(&mut roomy, &writer, id));
        }
        roomy.sweep();
        assert_eq!(loaded(&roomy), ["a", "b", "c"]);
    }

    /// A cached tree of one message of `bytes` bytes of text.
    fn tree_of(bytes: usize) -> Arc<arbor_core::tree::Tree> {
        Arc::new(arbor_core::tree::Tree::new(vec![Node::new("m", "c", None, Message::user("x".repeat(bytes)), 0)]))
    }

    #[tokio::test]
    async fn a_new_conversations_first_write_makes_its_tree_and_a_write_from_elsewhere_drops_it() {
        let writer = EventWriter::in_memory().await;
        let mut hubs = Hubs::new(10, usize::MAX);
        let hub = load(&mut hubs, &writer, "c");
        let user = Node::new("u1", "c", None, Message::user("hello"), 0);
        hub.advance_tree(0, 1, std::slice::from_ref(&user));
        let tree = hub.cached_tree(1).expect("version 0 has no messages: the first write is the whole tree");
        assert_eq!(tree.path_to("u1").iter().map(|node| node.id.as_str()).collect::<Vec<_>>(), ["u1"]);
        drop(tree);

        let reply = Node::new("a1", "c", Some("u1".into()), Message::assistant("hi"), 1);
        hub.advance_tree(1, 2, std::slice::from_ref(&reply));
        let tree = hub.cached_tree(2).expect("advanced");
        assert_eq!(tree.path_to("a1").iter().map(|node| node.id.as_str()).collect::<Vec<_>>(), ["u1", "a1"]);
        drop(tree);

        // Version 2 to 4 in one write of ours: another node wrote in between,
        // and its messages are not ours to add.
        let next = Node::new("u2", "c", Some("a1".into()), Message::user("more"), 2);
        hub.advance_tree(2, 4, std::slice::from_ref(&next));
        assert!(hub.cached_tree(4).is_none(), "a copy that may miss messages is dropped, not kept");
        // The same from a new conversation another node wrote to first.
        let fresh = load(&mut hubs, &writer, "d");
        fresh.advance_tree(0, 2, &[Node::new("u1", "d", None, Message::user("hello"), 0)]);
        assert!(fresh.cached_tree(2).is_none());
    }

    #[tokio::test]
    async fn quiet_conversations_whose_trees_do_not_fit_the_memory_limit_leave_most_recently_busy_kept() {
        let writer = EventWriter::in_memory().await;
        let mut hubs = Hubs::new(10, 250_000);
        for (id, bytes) in [("first", 100_000), ("second", 100_000), ("third", 100_000), ("small", 1_000)] {
            std::thread::sleep(Duration::from_millis(2));
            load(&mut hubs, &writer, id).cache_tree(1, tree_of(bytes));
        }
        hubs.sweep();
        assert_eq!(loaded(&hubs), ["second", "small", "third"], "the first no longer fits in 250,000 bytes");

        // One that alone is over the limit goes, and older small ones stay.
        let mut hubs = Hubs::new(10, 250_000);
        for (id, bytes) in [("a", 1_000), ("b", 1_000), ("huge", 300_000)] {
            std::thread::sleep(Duration::from_millis(2));
            load(&mut hubs, &writer, id).cache_tree(1, tree_of(bytes));
        }
        hubs.sweep();
        assert_eq!(loaded(&hubs), ["a", "b"]);

        // Trees that grew by half the limit sweep at the next new hub, however few came.
        let mut hubs = Hubs::new(10, 150_000);
        for id in ["a", "b", "c"] {
            load(&mut hubs, &writer, id).cache_tree(1, tree_of(100_000));
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(loaded(&hubs), ["b", "c"], "a and b did not fit together");

        // The few events a quiet hub keeps (one someone watched) count too: one can be a whole
        // message.
        let mut hubs = Hubs::new(10, 250_000);
        let talkative = load(&mut hubs, &writer, "talkative");
        drop(talkative.subscribe(0));
        talkative.emit(None, EventName::MessageNew, &serde_json::json!({"content": "x".repeat(300_000)}));
        drop(talkative);
        drop(load(&mut hubs, &writer, "plain"));
        writer.flush().await;
        hubs.sweep();
        assert_eq!(loaded(&hubs), ["plain"]);

        // A busy one stays whatever its size.
        let mut hubs = Hubs::new(10, 1_000);
        let busy = load(&mut hubs, &writer, "busy");
        busy.cache_tree(1, tree_of(300_000));
        hubs.sweep();
        assert_eq!(loaded(&hubs), ["busy"]);
    }

    #[tokio::test]
    async fn a_quiet_conversation_keeps_only_the_last_few_events_of_its_last_turn() {
        let writer = EventWriter::in_memory().await;
        let mut hubs = Hubs::new(10, usize::MAX);
        let turn: Arc<str> = Arc::from("t1");
        let mut at_the_end = HashMap::new();
        for id in ["watched", "unwatched"] {
            let hub = load(&mut hubs, &writer, id);
            if id == "watched" {
                // A viewer came and went during the turn.
                drop(hub.subscribe(0));
            }
            for index in 0..1_000 {
                hub.emit(Some(&turn), EventName::TraceDelta, &serde_json::json!({"text": index}));
            }
            // The turn ends before the writer has stored its events: they stay.
            hub.finish(&turn, EventName::Done, &serde_json::json!({}));
            at_the_end.insert(id, hub.size_in_memory());
            assert!(at_the_end[id] > 1_000 * size_of::<arbor_core::Event>(), "{at_the_end:?}");
        }
        writer.flush().await;
        hubs.sweep();
        let quiet = |id: &str| hubs.map.get(id).expect("kept").size_in_memory();
        // A tail for a viewer that reconnects; none where nobody watched.
        assert!(quiet("watched") > 0 && quiet("watched") * 20 < at_the_end["watched"], "{}", quiet("watched"));
        assert_eq!(quiet("unwatched"), 0, "no events (nor room for them) kept");
    }

    #[tokio::test]
    async fn quiet_conversations_leave_on_the_timer_when_no_new_one_comes() {
        let engine = demo_engine(EngineConfig {
            idle_conversations_kept: 0,
            sweep_every: Duration::from_millis(20),
            ..EngineConfig::default()
        })
        .await;
        drop(engine.hub("c1").await.expect("loads"));
        assert_eq!(engine.loaded_conversations(), 1, "no sweep has come yet");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(engine.loaded_conversations(), 0, "the timer's sweep sent the quiet conversation out");
    }

    /// An engine on an in-memory SQLite store whose one model is the offline demo.
    async fn demo_engine(config: EngineConfig) -> Engine {
        engine_with(Arc::new(arbor_providers::demo::DemoProvider::default()), config).await
    }

    /// An engine on an in-memory database whose `demo` model is `provider`.
    async fn engine_with(provider: Arc<dyn arbor_providers::Provider>, config: EngineConfig) -> Engine {
        engine_on("sqlite::memory:", provider, config).await
    }

    /// An engine on the SQLite database at `url` whose `demo` model is `provider`.
    async fn engine_on(url: &str, provider: Arc<dyn arbor_providers::Provider>, config: EngineConfig) -> Engine {
        let store = arbor_store::sqlite::SqliteStore::open(url).await.expect("opens");
        let providers = HashMap::from([("demo".to_string(), provider)]);
        let models = Models::new(arbor_providers::registry::Registry::shipped(), providers, "demo".into())
            .expect("the demo model");
        Engine::start(Arc::new(store), models, config).await.expect("starts")
    }

    async fn start_turn(engine: &Engine, user: &User, conversation: &str, text: &str) -> TurnHandle {
        match engine.submit(user, conversation, Submit::message(text)).await.expect("submits") {
            Submitted::Turn(handle) => *handle,
            _ => panic!("no turn started"),
        }
    }

    /// A caller that only waits for the outcome (a JSON turn) costs no
    /// viewer: its conversation is never watched, so its events may wait
    /// to be stored together.
    #[tokio::test]
    async fn a_turn_nobody_streams_leaves_its_conversation_unwatched() {
        let engine = demo_engine(EngineConfig::default()).await;
        let (user, _) = engine.create_user("ann", false).await.expect("user");
        let conversation = engine.create_conversation(&user, NewConversation::default()).await.expect("conversation");
        let handle = start_turn(&engine, &user, &conversation.id, "hello").await;
        let hub = engine.hub_if_loaded(&conversation.id).expect("loaded while busy");
        assert!(!hub.watched(), "watched before anyone asked for the events");
        let outcome = handle.outcome().await.expect("outcome");
        assert_eq!(outcome.turn.status, arbor_store::TurnStatus::Succeeded);
        assert!(outcome.reply.as_ref().is_some_and(|reply| reply.message.content.is_some()));
        assert!(!hub.watched());
    }

    /// The stream asked for late (here after the turn has ended) is still the
    /// turn's whole stream, from `turn.started` to `done`, each event once.
    #[tokio::test]
    async fn a_turn_stream_asked_for_late_starts_at_the_turn_start() {
        let engine = demo_engine(EngineConfig::default()).await;
        let (user, _) = engine.create_user("ann", false).await.expect("user");
        let conversation = engine.create_conversation(&user, NewConversation::default()).await.expect("conversation");
        let first = start_turn(&engine, &user, &conversation.id, "one").await.events().await;
        let first: Vec<Event> = tokio::time::timeout(Duration::from_secs(10), first.collect()).await.expect("ends");

        let second = start_turn(&engine, &user, &conversation.id, "two").await;
        let turn_id = second.turn.id.clone();
        // Let the turn run to its end, unwatched, before asking.
        let hub = engine.hub_if_loaded(&conversation.id).expect("loaded");
        while hub.idle_since().is_none() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let events: Vec<Event> =
            tokio::time::timeout(Duration::from_secs(10), second.events().await.collect()).await.expect("ends");
        let names: Vec<EventName> = events.iter().map(|event| event.name).collect();
        assert_eq!(names.first(), Some(&EventName::TurnStarted), "{names:?}");
        assert_eq!(names.last(), Some(&EventName::Done), "{names:?}");
        assert!(names.contains(&EventName::Delta), "{names:?}");
        assert!(events.iter().all(|event| event.turn_id.as_deref().is_none_or(|id| id == turn_id)), "{names:?}");
        assert!(events.windows(2).all(|pair| pair[0].seq < pair[1].seq), "in order, each once");
        assert!(events[0].seq > first.last().expect("first turn's events").seq, "nothing of the first turn");
    }

    /// A viewer that falls behind the live channel (it holds a few dozen
    /// events) catches up from the store and the hub's memory: it still
    /// gets every event once and in order, then the live ones.
    #[tokio::test]
    async fn a_viewer_that_falls_behind_gets_every_event_once_in_order() {
        let engine = demo_engine(EngineConfig::default()).await;
        let (user, _) = engine.create_user("ann", false).await.expect("user");
        let conversation = engine.create_conversation(&user, NewConversation::default()).await.expect("conversation");
        let mut events = engine.events(&user, &conversation.id, 0, Until::Forever).await.expect("stream");
        let hub = engine.hub_if_loaded(&conversation.id).expect("loaded");
        let turn: Arc<str> = Arc::from("t1");
        // Emitted without a pause for the viewer: far more than the live
        // channel holds. Half are stored before the viewer reads anything.
        for index in 0..300 {
            hub.emit(Some(&turn), EventName::TraceDelta, &serde_json::json!({"n": index}));
            if index == 150 {
                engine.inner.writer.flush().await;
            }
        }
        let mut next = async || {
            let event = tokio::time::timeout(Duration::from_secs(10), events.next()).await.expect("in time");
            event.expect("open").data_json()["n"].as_i64().expect("n")
        };
        let mut seen = Vec::new();
        for _ in 0..300 {
            seen.push(next().await);
        }
        assert_eq!(seen, (0..300).collect::<Vec<_>>());
        hub.emit(Some(&turn), EventName::TraceDelta, &serde_json::json!({"n": 300}));
        assert_eq!(next().await, 300, "live again after catching up");
    }

    /// The demo model, keeping each request's system prompt and how many
    /// messages of context it carried (so also when and how often it was
    /// called).
    #[derive(Default)]
    struct RecordingDemo {
        requests: Mutex<Vec<(Option<String>, usize)>>,
    }

    impl RecordingDemo {
        fn calls(&self) -> usize {
            lock(&self.requests).len()
        }
    }

    #[async_trait::async_trait]
    impl arbor_providers::Provider for RecordingDemo {
        fn kind(&self) -> &'static str {
            "demo"
        }

        async fn stream(
            &self,
            request: arbor_providers::ChatRequest,
        ) -> Result<arbor_providers::ChunkStream, arbor_core::ProviderError> {
            lock(&self.requests).push((request.system.clone(), request.messages.len()));
            arbor_providers::demo::DemoProvider::default().stream(request).await
        }
    }

    /// A kept row follows a head moved one step to a new message; a read
    /// that a change overtook is not kept (it may predate the change); any
    /// other move drops the row.
    #[tokio::test]
    async fn a_kept_row_is_never_older_than_the_last_change() {
        let writer = EventWriter::in_memory().await;
        let mut hubs = Hubs::new(10, usize::MAX);
        let hub = load(&mut hubs, &writer, "c");
        let user = Node::new("u1", "c", None, Message::user("hello"), 0);

        let (none, changes) = hub.known_conversation();
        assert!(none.is_none());
        hub.advance_tree(0, 1, std::slice::from_ref(&user));
        hub.remember_conversation(arbor_store::testing::conversation("ann", "c"), changes);
        assert!(hub.known_conversation().0.is_none(), "read before the head moved: not kept");

        let (_, changes) = hub.known_conversation();
        let row = Conversation {
            head_id: Some("u1".into()),
            head_version: 1,
            ..arbor_store::testing::conversation("ann", "c")
        };
        hub.remember_conversation(row, changes);
        let reply = Node::new("a1", "c", Some("u1".into()), Message::assistant("hi"), 0);
        hub.advance_tree(1, 2, std::slice::from_ref(&reply));
        let kept = hub.known_conversation().0.expect("followed");
        assert_eq!((kept.head_id.as_deref(), kept.head_version), (Some("a1"), 2));

        // A head moved back to an older message (no new one), a jump of
        // two versions, an explicit forget: each drops it.
        hub.advance_tree::<Node>(2, 3, &[]);
        assert!(hub.known_conversation().0.is_none());
        let (_, changes) = hub.known_conversation();
        hub.remember_conversation(Conversation { head_version: 3, ..kept.clone() }, changes);
        hub.advance_tree(3, 5, std::slice::from_ref(&reply));
        assert!(hub.known_conversation().0.is_none());
        let (_, changes) = hub.known_conversation();
        hub.remember_conversation(kept, changes);
        hub.forget_conversation();
        assert!(hub.known_conversation().0.is_none());
    }

    /// On a database only the engine writes (here in memory), a busy
    /// conversation's turns take its row from the hub: the kept row
    /// follows each head the turns move, so every turn answers the whole
    /// path; a change of settings drops it, so the next turn has the new
    /// system prompt; and a deleted conversation is not found.
    #[tokio::test]
    async fn a_busy_conversations_kept_row_follows_every_change() {
        let provider = Arc::new(RecordingDemo::default());
        let engine = engine_with(provider.clone(), EngineConfig::default()).await;
        assert!(engine.inner.keeps_rows, "an in-memory database has one writer");
        let (user, _) = engine.create_user("ann", false).await.expect("user");
        let conversation = engine.create_conversation(&user, NewConversation::default()).await.expect("conversation");
        for text in ["one", "two", "three", "four"] {
            start_turn(&engine, &user, &conversation.id, text).await.outcome().await.expect("turn");
        }
        let hub = engine.hub_if_loaded(&conversation.id).expect("loaded");
        let kept = hub.known_conversation().0.expect("kept after a turn read it");
        let row = engine.store().conversation(&user.id, &conversation.id).await.expect("read").expect("exists");
        assert_eq!((&kept.head_id, kept.head_version), (&row.head_id, row.head_version), "follows the head");
        // Turns 3 and 4 took the kept row; each sent the whole path.
        let contexts: Vec<usize> = lock(&provider.requests).iter().map(|(_, messages)| *messages).collect();
        assert_eq!(contexts, [1, 3, 5, 7]);

        let update = ConversationUpdate { system_prompt: Some("Answer in French.".into()), ..Default::default() };
        engine.update_conversation(&user, &conversation.id, update).await.expect("updates");
        assert!(hub.known_conversation().0.is_none(), "dropped by the change");
        start_turn(&engine, &user, &conversation.id, "five").await.outcome().await.expect("turn");
        start_turn(&engine, &user, &conversation.id, "six").await.outcome().await.expect("turn");
        let last: Vec<_> = lock(&provider.requests).iter().skip(4).cloned().collect();
        assert_eq!(last, [(Some("Answer in French.".into()), 9), (Some("Answer in French.".into()), 11)]);

        // Another user cannot reach it through the kept row.
        let (bob, _) = engine.create_user("bob", false).await.expect("user");
        assert!(hub.known_conversation().0.is_some());
        let refused = engine.submit(&bob, &conversation.id, Submit::message("mine?")).await;
        assert!(matches!(refused, Err(EngineError::NotFound("conversation"))), "{:?}", refused.err());

        engine.delete_conversation(&user, &conversation.id).await.expect("deletes");
        let gone = engine.submit(&user, &conversation.id, Submit::message("seven")).await;
        assert!(matches!(gone, Err(EngineError::NotFound("conversation"))), "{:?}", gone.err());
    }

    /// A row is kept only for an unlimited user on a database no other
    /// process writes: a limited user's credits change with every call, and
    /// another process may change anything on a shared database file.
    #[tokio::test]
    async fn rows_are_read_for_limited_users_and_on_shared_databases() {
        let engine = demo_engine(EngineConfig::default()).await;
        let (user, _) = engine.create_user("ann", false).await.expect("user");
        engine.store().set_balance(&user.id, Some(1_000_000)).await.expect("limits");
        let conversation = engine.create_conversation(&user, NewConversation::default()).await.expect("conversation");
        for text in ["one", "two", "three"] {
            start_turn(&engine, &user, &conversation.id, text).await.outcome().await.expect("turn");
        }
        let hub = engine.hub_if_loaded(&conversation.id).expect("loaded");
        assert!(hub.known_conversation().0.is_none(), "a limited user's turn reads its credits");

        let folder = tempfile::tempdir().expect("folder");
        let url = format!("sqlite://{}", folder.path().join("shared.db").display());
        let engine =
            engine_on(&url, Arc::new(arbor_providers::demo::DemoProvider::default()), EngineConfig::default()).await;
        assert!(!engine.store().sole_writer(), "the default locking lets other processes write");
        let (user, _) = engine.create_user("ann", false).await.expect("user");
        let conversation = engine.create_conversation(&user, NewConversation::default()).await.expect("conversation");
        for text in ["one", "two", "three"] {
            start_turn(&engine, &user, &conversation.id, text).await.outcome().await.expect("turn");
        }
        let hub = engine.hub_if_loaded(&conversation.id).expect("loaded");
        assert!(hub.known_conversation().0.is_none(), "another process may have changed it");
    }

    /// A streamed turn's model call goes out before its viewer's stream
    /// starts (the stream is not on the first token's path), and the
    /// stream still carries the turn's events from `turn.started` on.
    #[tokio::test]
    async fn a_streamed_turn_calls_its_model_before_its_stream_starts() {
        let provider = Arc::new(RecordingDemo::default());
        let engine = engine_with(provider.clone(), EngineConfig::default()).await;
        let (user, _) = engine.create_user("ann", false).await.expect("user");
        let conversation = engine.create_conversation(&user, NewConversation::default()).await.expect("conversation");
        // The conversation's tree is in memory after a first turn, as it
        // is for any conversation someone is talking in.
        start_turn(&engine, &user, &conversation.id, "one").await.outcome().await.expect("first turn");

        let handle = start_turn(&engine, &user, &conversation.id, "two").await;
        assert_eq!(provider.calls(), 1, "the call is the turn task's, after the submit");
        let events = handle.events().await;
        assert_eq!(provider.calls(), 2, "the model was called before the stream started");
        let events: Vec<Event> = tokio::time::timeout(Duration::from_secs(10), events.collect()).await.expect("ends");
        let names: Vec<EventName> = events.iter().map(|event| event.name).collect();
        assert_eq!(names.first(), Some(&EventName::TurnStarted), "{names:?}");
        assert_eq!(names.last(), Some(&EventName::Done), "{names:?}");
    }

    #[tokio::test]
    async fn sweeps_come_often_enough_to_hold_the_limit_and_seldom_enough_to_stay_cheap() {
        let writer = EventWriter::in_memory().await;
        let mut hubs = Hubs::new(8, usize::MAX);
        let mut peak = 0;
        for index in 0..2000 {
            drop(load(&mut hubs, &writer, &format!("c{index}")));
            peak = peak.max(hubs.map.len());
        }
        // At most the limit plus the new ones since the last sweep.
        assert!(peak <= 8 + 8, "peak {peak}");

        // With many busy (held) hubs, a sweep does not run on every new one.
        let mut busy_hubs = Hubs::new(0, usize::MAX);
        let mut busy = Vec::new();
        let (mut sweeps, mut visited) = (0, 0);
        for index in 0..2000 {
            if busy_hubs.map.len() >= busy_hubs.sweep_at {
                sweeps += 1;
                visited += busy_hubs.map.len();
            }
            busy.push(load(&mut busy_hubs, &writer, &format!("c{index}")));
        }
        assert_eq!(busy_hubs.map.len(), 2000, "held hubs stay");
        // Each sweep scans every hub: ~60 sweeps for 2000 new hubs, ~9 hubs visited a new one
        // (a sweep on each would be ~1000).
        assert!(sweeps < 100, "{sweeps} sweeps for 2000 busy hubs");
        assert!(visited < 10 * 2000, "{visited} hubs visited by sweeps for 2000 new ones");
    }
}
