//! Submitting input (`shared/seeds/conversation-tree.txt`): a message under
//! the head (or a named parent), or a client's view of the path merged into
//! the tree. The engine records what is new, moves the head, and starts a
//! turn — now, after the running one (`queue: true`), or merged into the next
//! one (`queue: "merge"`). A view that ends at an earlier node only moves the
//! head, and stops work in flight on the branch that was left.

use std::sync::Arc;

use arbor_core::ids::{new_id, now_millis};
use arbor_core::tree::{MergePlan, Tree, ViewMessage, merge_view};
use arbor_core::{EventName, Message, Node, Role};
use arbor_store::{Conversation, StoreError, Turn, TurnStarted, TurnStatus, User};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::hub::{Hub, QueuedTurn, RunningTurn, Slot};
use crate::models::ResolvedModel;
use crate::payloads::{self, MessageNew};
use crate::stream::{self, Until};
use crate::turn::{Hold, TurnTask, reservation_for};
use crate::{Engine, EngineError, EngineResult, Inner, TurnHandle, validate_message_id, validate_text};

/// What to do when a turn is already running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueMode {
    /// Refuse with 409 naming the running turn.
    #[default]
    Refuse,
    /// Wait: run after the running (and earlier queued) turns, in order.
    Fifo,
    /// Join the next turn together with other messages sent meanwhile.
    Merge,
}

/// Input for a conversation.
#[derive(Debug, Clone, Default)]
pub struct Submit {
    /// A message's text (the simple form).
    pub content: String,
    /// A client-chosen id for the message (the simple form).
    pub id: Option<String>,
    /// Where to attach the message (the simple form; default: the head).
    pub parent_id: Option<String>,
    /// The client's view of the path (instead of `content`).
    pub view: Option<Vec<ViewMessage>>,
    /// The model for this turn (default: the conversation's).
    pub model: Option<String>,
    pub queue: QueueMode,
    /// `false` only records the messages (the seed's `client.append`).
    pub run: bool,
    /// Refuse (409, nothing written) unless the head is still at this version.
    pub if_head_version: Option<i64>,
}

impl Submit {
    /// A message under the head that runs a turn.
    pub fn message(content: impl Into<String>) -> Submit {
        Submit { content: content.into(), run: true, ..Submit::default() }
    }
}

/// What a submit did.
pub enum Submitted {
    /// A turn started, or was queued; its events follow.
    Turn(Box<TurnHandle>),
    /// Messages were recorded without a turn: a new branch, each message
    /// the parent of the next.
    Recorded { messages: Vec<Node>, head_id: Option<String>, head_version: i64 },
    /// Nothing new: the head moved to an existing node.
    HeadMoved { head_id: String, head_version: i64 },
}

impl Submitted {
    pub fn into_turn(self) -> Option<TurnHandle> {
        match self {
            Submitted::Turn(handle) => Some(*handle),
            _ => None,
        }
    }
}

/// A turn that holds the slot, with its messages recorded.
struct Prepared {
    turn: Arc<Turn>,
    /// The messages recorded with it.
    nodes: Vec<Arc<Node>>,
    /// The conversation's head version after them.
    head_version: i64,
    /// What is held for its first call.
    hold: Hold,
    /// How long recording it took.
    store_wait: std::time::Duration,
}

/// Messages a view or simple submit adds, and where they hang.
struct NewMessages {
    parent: Option<String>,
    nodes: Vec<Node>,
}

impl Engine {
    /// Records input and (when it ends with a user message and `run`) starts
    /// or queues a turn on it.
    pub async fn submit(&self, user: &User, conversation_id: &str, submit: Submit) -> EngineResult<Submitted> {
        let accepted = std::time::Instant::now();
        if self.inner.closing.is_cancelled() {
            return Err(EngineError::ShuttingDown);
        }
        let (conversation, available) = self.conversation_for_turn(user, conversation_id).await?;
        let model = self.inner.models.resolve(submit.model.as_deref().unwrap_or(&conversation.model))?;
        if let Some(expected) = submit.if_head_version
            && expected != conversation.head_version
        {
            return Err(EngineError::HeadVersionMismatch { current: conversation.head_version });
        }
        let hub = self.hub(&conversation.id).await?;

        let new = match &submit.view {
            Some(view) => {
                let tree = self.inner.tree(&hub, &conversation.id, conversation.head_version).await?;
                match merge_view(&tree, view).map_err(|error| EngineError::InvalidInput(error.to_string()))? {
                    MergePlan::MoveHead { to } => {
                        let head_version =
                            self.inner.move_head(&hub, &conversation, &to, submit.if_head_version).await?;
                        return Ok(Submitted::HeadMoved { head_id: to, head_version });
                    }
                    MergePlan::Append { parent, messages, .. } => self.view_nodes(&conversation, parent, messages)?,
                }
            }
            None => self.simple_node(&conversation, &submit).await?,
        };

        check_capabilities(&model, &new.nodes)?;
        let anchored = submit.view.is_some() || submit.parent_id.is_some();
        let ends_with_user = new.nodes.last().is_some_and(|node| matches!(node.message.role, Role::User | Role::Tool));
        if !submit.run || !ends_with_user {
            let head_version = self.inner.record(&hub, &conversation, &new.nodes, None).await?;
            let head_id = new.nodes.last().map(|node| node.id.clone());
            return Ok(Submitted::Recorded { messages: new.nodes, head_id, head_version });
        }
        let limited = check_quota(available)?;
        let handle = self
            .inner
            .clone()
            .begin_turn(
                &hub,
                user.clone(),
                conversation,
                model,
                new.nodes,
                new.parent,
                submit.queue,
                anchored,
                limited,
                accepted,
            )
            .await?;
        Ok(Submitted::Turn(Box::new(handle)))
    }

    /// Records a new assistant reply beside `message_id` (an assistant
    /// message; default: the head), or under it when it is a user message.
    pub async fn regenerate(
        &self,
        user: &User,
        conversation_id: &str,
        message_id: Option<&str>,
        model: Option<&str>,
        queue: QueueMode,
    ) -> EngineResult<TurnHandle> {
        let accepted = std::time::Instant::now();
        if self.inner.closing.is_cancelled() {
            return Err(EngineError::ShuttingDown);
        }
        let (conversation, available) = self.conversation_for_turn(user, conversation_id).await?;
        let model = self.inner.models.resolve(model.unwrap_or(&conversation.model))?;
        let target_id = message_id
            .map(str::to_string)
            .or_else(|| conversation.head_id.clone())
            .ok_or_else(|| EngineError::InvalidInput("the conversation has no messages to regenerate".into()))?;
        let target =
            self.inner.store.message(&conversation.id, &target_id).await?.ok_or_else(|| {
                EngineError::InvalidInput(format!("message {target_id:?} is not in this conversation"))
            })?;
        let reply_parent = match target.message.role {
            Role::Assistant => target.parent_id.clone().ok_or_else(|| {
                EngineError::InvalidInput(format!("message {target_id:?} has no question above it to answer again"))
            })?,
            Role::User | Role::Tool => target.id.clone(),
            Role::System => return Err(EngineError::InvalidInput("a system message cannot be regenerated".into())),
        };
        let limited = check_quota(available)?;
        let hub = self.hub(&conversation.id).await?;
        self.inner
            .clone()
            .begin_turn(
                &hub,
                user.clone(),
                conversation,
                model,
                Vec::new(),
                Some(reply_parent),
                queue,
                true,
                limited,
                accepted,
            )
            .await
    }

    /// Moves the head to an existing message (`PUT /head`).
    pub async fn set_head(
        &self,
        user: &User,
        conversation_id: &str,
        message_id: &str,
        if_head_version: Option<i64>,
    ) -> EngineResult<i64> {
        let conversation = self.conversation(user, conversation_id).await?;
        if self.inner.store.message(&conversation.id, message_id).await?.is_none() {
            return Err(EngineError::InvalidInput(format!("message {message_id:?} is not in this conversation")));
        }
        let hub = self.hub(&conversation.id).await?;
        self.inner.move_head(&hub, &conversation, message_id, if_head_version).await
    }

    /// Copies the path up to `message_id` into a new conversation; each copy
    /// keeps its id and names the original in `copied_from`.
    pub async fn fork(&self, user: &User, conversation_id: &str, message_id: &str) -> EngineResult<Conversation> {
        let source = self.conversation(user, conversation_id).await?;
        let tree = Tree::new(self.inner.store.messages(&source.id).await?);
        if tree.get(message_id).is_none() {
            return Err(EngineError::InvalidInput(format!("message {message_id:?} is not in this conversation")));
        }
        let now = now_millis();
        let fork = Conversation {
            id: new_id(),
            owner_id: user.id.clone(),
            title: source.title.clone(),
            system_prompt: source.system_prompt.clone(),
            preset_id: source.preset_id.clone(),
            model: source.model.clone(),
            head_id: None,
            head_version: 0,
            summary: source.summary.clone(),
            created_at: now,
            updated_at: now,
        };
        self.inner.store.create_conversation(&fork).await?;
        let copies: Vec<Node> = tree
            .path_to(message_id)
            .into_iter()
            .map(|node| Node {
                conversation_id: fork.id.clone(),
                copied_from: Some(node.id.clone()),
                turn_id: None,
                created_at: now,
                ..Node::clone(node)
            })
            .collect();
        let head_version = self.inner.store.append_messages(&copies, now).await?;
        Ok(Conversation { head_id: copies.last().map(|node| node.id.clone()), head_version, ..fork })
    }

    fn view_nodes(
        &self,
        conversation: &Conversation,
        parent: Option<String>,
        messages: Vec<ViewMessage>,
    ) -> EngineResult<NewMessages> {
        let limits = &self.inner.config.limits;
        let mut nodes = Vec::with_capacity(messages.len());
        let mut previous = parent.clone();
        for view_message in messages {
            if let Some(id) = &view_message.id {
                validate_message_id(id)?;
            }
            let message = view_message.message;
            if message.role == Role::System {
                return Err(EngineError::InvalidInput(
                    "a view cannot add system messages; set the conversation's system_prompt instead".into(),
                ));
            }
            validate_text("content", message.content.as_deref(), limits.max_message_bytes)?;
            let node = self.inner.new_node(conversation, view_message.id, previous.clone(), message, None);
            previous = Some(node.id.clone());
            nodes.push(node);
        }
        Ok(NewMessages { parent, nodes })
    }

    async fn simple_node(&self, conversation: &Conversation, submit: &Submit) -> EngineResult<NewMessages> {
        if submit.content.trim().is_empty() {
            return Err(EngineError::InvalidInput("content must not be empty".into()));
        }
        validate_text("content", Some(&submit.content), self.inner.config.limits.max_message_bytes)?;
        if let Some(id) = &submit.id {
            validate_message_id(id)?;
            // Refused before anything is claimed or written.
            if self.inner.store.message(&conversation.id, id).await?.is_some() {
                return Err(EngineError::Conflict(format!("message id {id:?} already exists in this conversation")));
            }
        }
        let parent = match &submit.parent_id {
            Some(parent_id) => {
                self.inner.store.message(&conversation.id, parent_id).await?.ok_or_else(|| {
                    EngineError::InvalidInput(format!("parent_id {parent_id:?} is not a message of this conversation"))
                })?;
                Some(parent_id.clone())
            }
            None => conversation.head_id.clone(),
        };
        let node =
            self.inner.new_node(conversation, submit.id.clone(), parent.clone(), Message::user(&submit.content), None);
        Ok(NewMessages { parent, nodes: vec![node] })
    }
}

impl Inner {
    pub(crate) fn new_node(
        &self,
        conversation: &Conversation,
        id: Option<String>,
        parent_id: Option<String>,
        message: Message,
        turn_id: Option<&str>,
    ) -> Node {
        Node {
            turn_id: turn_id.map(str::to_string),
            ..Node::new(id.unwrap_or_else(new_id), conversation.id.clone(), parent_id, message, now_millis())
        }
    }

    /// The conversation's tree at `head_version`: the hub's copy when it is
    /// that version, else read from the store and kept in the hub.
    pub(crate) async fn tree(
        &self,
        hub: &Hub,
        conversation_id: &str,
        head_version: i64,
    ) -> Result<Arc<Tree>, StoreError> {
        if let Some(tree) = hub.cached_tree(head_version) {
            return Ok(tree);
        }
        let tree = Arc::new(Tree::new(self.store.messages(conversation_id).await?));
        hub.cache_tree(head_version, tree.clone());
        Ok(tree)
    }

    /// Cancels the running turn when the head (now `head_id`, at
    /// `head_version`) is no longer on a path through the message it answers.
    pub(crate) async fn stop_if_branch_left(
        &self,
        hub: &Hub,
        conversation_id: &str,
        head_id: &str,
        head_version: i64,
    ) -> EngineResult<()> {
        let Some(running) = hub.running() else { return Ok(()) };
        let tree = self.tree(hub, conversation_id, head_version).await?;
        if !tree.path_to(head_id).iter().any(|node| node.id == running.reply_parent) {
            tracing::info!(turn_id = %running.turn_id, "the head moved off the running turn's branch; cancelling it");
            running.cancel.cancel();
        }
        Ok(())
    }

    /// Appends nodes (moving the head to the last) and announces them.
    pub(crate) async fn record(
        &self,
        hub: &Hub,
        conversation: &Conversation,
        nodes: &[Node],
        turn_id: Option<&Arc<str>>,
    ) -> EngineResult<i64> {
        if nodes.is_empty() {
            return Ok(conversation.head_version);
        }
        let head_version = self.store.append_messages(nodes, now_millis()).await.map_err(|error| match error {
            StoreError::Conflict(_) => EngineError::Conflict(format!(
                "a message id in {:?} already exists in this conversation",
                nodes.iter().map(|node| node.id.as_str()).collect::<Vec<_>>()
            )),
            other => other.into(),
        })?;
        hub.advance_tree(conversation.head_version, head_version, nodes);
        for node in nodes {
            hub.emit(turn_id, EventName::MessageNew, &MessageNew { head_version: Some(head_version), message: node });
        }
        Ok(head_version)
    }

    /// Moves the head, tells every viewer, and stops a running turn whose
    /// branch is no longer the active one.
    pub(crate) async fn move_head(
        &self,
        hub: &Hub,
        conversation: &Conversation,
        to: &str,
        if_head_version: Option<i64>,
    ) -> EngineResult<i64> {
        let head_version =
            self.store.set_head(&conversation.id, Some(to), if_head_version, now_millis()).await.map_err(|error| {
                match error {
                    StoreError::HeadVersionMismatch { current } => EngineError::HeadVersionMismatch { current },
                    other => other.into(),
                }
            })?;
        hub.advance_tree::<Node>(conversation.head_version, head_version, &[]);
        hub.emit(
            None,
            EventName::HeadMoved,
            &json!({"head_id": to, "previous_head_id": conversation.head_id, "head_version": head_version}),
        );
        if self.config.shared {
            // A turn on this branch may run on another node.
            let notice = arbor_store::Notice::HeadMoved {
                conversation_id: conversation.id.clone(),
                head_id: Some(to.to_string()),
                head_version,
            };
            if let Err(error) = self.store.notify(&notice).await {
                tracing::warn!(%error, "announcing a head move to the other nodes failed");
            }
        }
        self.stop_if_branch_left(hub, &conversation.id, to, head_version).await?;
        Ok(head_version)
    }

    /// Starts a turn that records `nodes` and answers under the last of them
    /// (or under `reply_parent` when there are none) — or queues it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn begin_turn(
        self: Arc<Inner>,
        hub: &Arc<Hub>,
        user: User,
        conversation: Conversation,
        model: ResolvedModel,
        nodes: Vec<Node>,
        reply_parent: Option<String>,
        queue: QueueMode,
        anchored: bool,
        limited: bool,
        accepted: std::time::Instant,
    ) -> EngineResult<TurnHandle> {
        let turn_id: Arc<str> = Arc::from(new_id());
        let cancel = CancellationToken::new();
        let (outcome_sender, outcome) = watch::channel(None);
        let now = now_millis();
        let reply_parent = nodes.last().map(|node| node.id.clone()).or(reply_parent).unwrap_or_default();
        let nodes: Vec<Arc<Node>> =
            nodes.into_iter().map(|node| Arc::new(Node { turn_id: Some(turn_id.to_string()), ..node })).collect();
        // Marked queued until it holds the slot and starts.
        let turn = Turn {
            id: turn_id.to_string(),
            conversation_id: conversation.id.clone(),
            user_id: user.id.clone(),
            user_message_id: reply_parent.clone(),
            status: TurnStatus::Queued,
            model: model.info.id.clone(),
            iterations: 0,
            usage: Default::default(),
            cost_micro_usd: 0,
            reply_message_id: None,
            error_code: None,
            error_message: None,
            created_at: now,
            started_at: None,
            finished_at: None,
            pending_messages: Vec::new(),
        };
        let queued = QueuedTurn {
            turn: Arc::new(turn),
            nodes,
            merge: queue == QueueMode::Merge,
            anchored,
            waited: false,
            limited,
            accepted,
            user,
            model,
            cancel: cancel.clone(),
            outcome: outcome_sender,
        };
        let running =
            RunningTurn { turn_id: turn_id.clone(), cancel: cancel.clone(), reply_parent: reply_parent.clone() };
        match hub.claim_or_queue(running, queued, queue) {
            Slot::Claimed(queued) => {
                let events = stream::PendingEvents::new(
                    self.store.clone(),
                    hub.clone(),
                    None,
                    hub.last_published(),
                    Until::TurnEnds(turn_id.clone()),
                );
                let turn = queued.turn.clone();
                let user_message = queued.nodes.last().cloned();
                if let Err((error, queued)) = self.clone().launch(hub.clone(), conversation, *queued).await {
                    // Another node runs a turn here: wait for it like any
                    // queued turn, when the caller asked to wait.
                    if matches!(error, EngineError::TurnRunning { .. }) && queue != QueueMode::Refuse {
                        let mut waiting = Turn::clone(&queued.turn);
                        waiting.status = TurnStatus::Queued;
                        waiting.pending_messages = crate::hub::unshared(&queued.nodes);
                        self.store.insert_turn(&waiting).await?;
                        hub.requeue_front(*queued);
                        hub.emit(Some(&turn_id), EventName::TurnQueued, &json!({"turn_id": &*turn_id, "position": 1}));
                        return Ok(TurnHandle { turn: Arc::new(waiting), user_message: None, events, outcome });
                    }
                    hub.release(&turn_id);
                    return Err(error);
                }
                Ok(TurnHandle { turn, user_message, events, outcome })
            }
            Slot::Busy { running } => Err(EngineError::TurnRunning { turn_id: running.to_string() }),
            Slot::Queued { turn, position, subscription, last_seq } => {
                let events = stream::PendingEvents::new(
                    self.store.clone(),
                    hub.clone(),
                    Some(subscription),
                    last_seq,
                    Until::TurnEnds(turn_id.clone()),
                );
                self.store.insert_turn(&turn).await?;
                hub.emit(Some(&turn_id), EventName::TurnQueued, &json!({"turn_id": &*turn_id, "position": position}));
                Ok(TurnHandle { turn, user_message: None, events, outcome })
            }
            Slot::Merged { turn, subscription, last_seq, outcome: joined_outcome } => {
                let joined: Arc<str> = Arc::from(turn.id.as_str());
                // The joined turn's row keeps every merged message durable.
                self.store.update_turn(&turn).await?;
                let events = stream::PendingEvents::new(
                    self.store.clone(),
                    hub.clone(),
                    Some(subscription),
                    last_seq,
                    Until::TurnEnds(joined.clone()),
                );
                hub.emit(Some(&joined), EventName::TurnQueued, &json!({"turn_id": &*joined, "merged": true}));
                Ok(TurnHandle { turn, user_message: None, events, outcome: joined_outcome })
            }
        }
    }

    /// Runs a turn that holds the slot: records its messages, marks it
    /// running, announces it and spawns its task. On failure before the task
    /// starts, hands the turn back so the caller can record the failure.
    pub(crate) async fn launch(
        self: Arc<Inner>,
        hub: Arc<Hub>,
        conversation: Conversation,
        queued: QueuedTurn,
    ) -> Result<(), (EngineError, Box<QueuedTurn>)> {
        let prepared = self.prepare_launch(&hub, &conversation, &queued).await;
        let Prepared { turn, nodes, head_version, hold, store_wait } = match prepared {
            Ok(prepared) => prepared,
            Err(error) => return Err((error, Box::new(queued))),
        };
        let QueuedTurn { user, model, cancel, outcome, accepted, .. } = queued;
        let turn_id: Arc<str> = Arc::from(turn.id.as_str());
        hub.emit(
            Some(&turn_id),
            EventName::TurnStarted,
            &payloads::TurnStarted {
                head_version,
                message_id: &turn.user_message_id,
                model: &model.info.id,
                turn_id: &turn_id,
            },
        );
        for node in &nodes {
            hub.emit(
                Some(&turn_id),
                EventName::MessageNew,
                &MessageNew { head_version: Some(head_version), message: node },
            );
        }
        let deadline = std::time::Instant::now() + self.config.limits.turn_timeout;
        let head_id = nodes.last().map(|node| node.id.clone()).or(conversation.head_id.clone());
        let conversation = Conversation { head_version, head_id, ..conversation };
        let task =
            TurnTask::new(self.clone(), hub, user, conversation, turn, turn_id, model, cancel, outcome, deadline)
                .holding(hold)
                .accepted_at(accepted)
                .started_in(store_wait);
        self.tracker.spawn(task.run());
        Ok(())
    }

    /// Records the turn's messages (durable before any model call) and its
    /// row as running, holding a limited user's credits for the call in the
    /// same commit.
    async fn prepare_launch(
        &self,
        hub: &Hub,
        conversation: &Conversation,
        queued: &QueuedTurn,
    ) -> EngineResult<Prepared> {
        let nodes = chain(queued, conversation);
        let mut turn = Turn::clone(&queued.turn);
        if let Some(last) = nodes.last() {
            turn.user_message_id = last.id.clone();
        }
        // With several nodes, queued turns start in the order they arrived,
        // whichever node holds them: only the oldest may take the slot.
        if self.config.shared
            && queued.waited
            && let Some(oldest) = self.oldest_queued(&conversation.id).await?
            && oldest.id != turn.id
        {
            return Err(EngineError::TurnRunning { turn_id: oldest.id });
        }
        // One transaction claims the database's slot (one running turn per
        // conversation, on any node) and records the user's messages, which
        // are durable before any model is called; a turn that cannot run
        // yet has written nothing. A queued turn's messages move from its
        // row into the tree.
        turn.status = TurnStatus::Running;
        turn.pending_messages.clear();
        turn.started_at = Some(now_millis());
        // Shared from here on: the store's writer thread, the running turn
        // and its outcome hold this one copy.
        let turn = Arc::new(turn);
        let reservation = if queued.limited {
            Some(self.first_reservation(hub, conversation, queued, &turn, &nodes).await?)
        } else {
            None
        };
        // With several nodes the turn starts holding its lease, which
        // `cluster::keep_lease` then renews.
        let lease = self
            .config
            .shared
            .then(|| (self.node_id.as_str(), now_millis() + self.config.turn_lease.as_millis() as i64));
        let starting = std::time::Instant::now();
        let started =
            self.store.start_turn(&turn, &nodes, queued.waited, now_millis(), reservation.as_ref(), lease).await;
        let store_wait = starting.elapsed();
        let (head_version, hold) = match started {
            Ok(TurnStarted { head_version, reserved }) => (head_version, Hold::of(reservation.zip(reserved))),
            Err(StoreError::Conflict(_)) => {
                return Err(match self.running_elsewhere(&conversation.id).await {
                    running @ EngineError::TurnRunning { .. } => running,
                    _ => EngineError::Conflict(format!(
                        "a message id in {:?} already exists in this conversation",
                        nodes.iter().map(|node| node.id.as_str()).collect::<Vec<_>>()
                    )),
                });
            }
            Err(error) => return Err(error.into()),
        };
        if let Some(last) = nodes.last() {
            hub.set_reply_parent(&turn.id, &last.id);
            hub.advance_tree(conversation.head_version, head_version, &nodes);
        }
        Ok(Prepared { turn, nodes, head_version, hold, store_wait })
    }

    /// The reservation for a limited user's first call of `turn`: its input
    /// is the path to the message it answers, with the `nodes` it records.
    async fn first_reservation(
        &self,
        hub: &Hub,
        conversation: &Conversation,
        queued: &QueuedTurn,
        turn: &Turn,
        nodes: &[Arc<Node>],
    ) -> EngineResult<arbor_store::Reservation> {
        let tree = self.tree(hub, &conversation.id, conversation.head_version).await?;
        // New messages hang under their first one's parent; a regenerated
        // turn answers a message already in the tree.
        let anchor = match nodes.first() {
            Some(first) => first.parent_id.as_deref(),
            None => Some(turn.user_message_id.as_str()),
        };
        let path = anchor.map(|anchor| tree.path_to(anchor)).unwrap_or_default();
        let messages = path.into_iter().chain(nodes).map(|node| &node.message);
        Ok(reservation_for(self, &queued.user.id, &queued.model, conversation.system_prompt.as_deref(), messages))
    }

    /// The conversation's longest-waiting queued turn, on any node. A turn
    /// queued for longer than ten turn time limits is taken for abandoned (its
    /// node died) and no longer holds the others back.
    async fn oldest_queued(&self, conversation_id: &str) -> EngineResult<Option<Turn>> {
        let queued = self.store.turns_with_status(&[TurnStatus::Queued]).await?;
        let abandoned_before = now_millis() - 10 * self.config.limits.turn_timeout.as_millis() as i64;
        Ok(queued
            .into_iter()
            .filter(|turn| turn.conversation_id == conversation_id && turn.created_at >= abandoned_before)
            .min_by(|left, right| (left.created_at, &left.id).cmp(&(right.created_at, &right.id))))
    }

    /// The error for a turn slot the database says is taken by another node.
    async fn running_elsewhere(&self, conversation_id: &str) -> EngineError {
        let running = self.store.turns_with_status(&[TurnStatus::Running]).await.ok().and_then(|turns| {
            turns.into_iter().find(|turn| turn.conversation_id == conversation_id).map(|turn| turn.id)
        });
        match running {
            Some(turn_id) => EngineError::TurnRunning { turn_id },
            None => EngineError::Conflict("another turn is running on this conversation".into()),
        }
    }

    /// Launches the queued turn that just got the slot; if it cannot start,
    /// records it as failed and moves on to the next one.
    pub(crate) async fn launch_next(self: Arc<Inner>, hub: Arc<Hub>, owner_id: String, mut next: QueuedTurn) {
        loop {
            let conversation = match self.store.conversation(&owner_id, &hub.conversation_id).await {
                Ok(Some(conversation)) => conversation,
                Ok(None) => {
                    // Deleted meanwhile: nothing left to run the queue on.
                    let turn_id: Arc<str> = Arc::from(next.turn.id.as_str());
                    hub.finish(
                        &turn_id,
                        EventName::Error,
                        &json!({"turn_id": &*turn_id, "code": "not_found", "message": "the conversation was deleted"}),
                    );
                    return;
                }
                Err(error) => {
                    tracing::error!(%error, "reading the conversation to start a queued turn failed");
                    let turn_id: Arc<str> = Arc::from(next.turn.id.as_str());
                    match hub.finish(&turn_id, EventName::Error, &json!({"turn_id": &*turn_id, "code": "internal", "message": "the queued turn could not start"})) {
                        Some(following) => {
                            next = following;
                            continue;
                        }
                        None => return,
                    }
                }
            };
            match self.clone().launch(hub.clone(), conversation, next).await {
                Ok(()) => return,
                Err((EngineError::TurnRunning { .. }, waiting)) => {
                    // Another node's turn holds the slot; its end wakes us.
                    hub.requeue_front(*waiting);
                    return;
                }
                Err((error, failed)) => {
                    tracing::warn!(turn_id = %failed.turn.id, %error, "a queued turn could not start");
                    let mut turn = Turn::clone(&failed.turn);
                    turn.status = TurnStatus::Failed;
                    turn.error_code = Some("conflict".into());
                    turn.error_message = Some(error.to_string());
                    turn.finished_at = Some(now_millis());
                    if let Err(error) = self.store.update_turn(&turn).await {
                        tracing::error!(%error, "recording a failed queued turn failed");
                    }
                    let turn_id: Arc<str> = Arc::from(turn.id.as_str());
                    let following = hub.finish(
                        &turn_id,
                        EventName::Error,
                        &json!({"turn_id": &*turn_id, "code": "conflict", "message": error.to_string()}),
                    );
                    let _ = failed.outcome.send(Some(Arc::new(crate::TurnOutcome {
                        turn: Arc::new(turn),
                        reply: None,
                        head_version: conversation_head_version(&self.store, &hub.conversation_id, &owner_id).await,
                        overhead: Default::default(),
                        store_wait: Default::default(),
                    })));
                    match following {
                        Some(following) => next = following,
                        None => return,
                    }
                }
            }
        }
    }

    /// Cancels a turn that is still waiting in the queue: its messages are
    /// recorded all the same (nothing a user sent is lost), without a reply.
    pub(crate) async fn cancel_queued(&self, hub: &Hub, owner_id: &str, queued: QueuedTurn) -> EngineResult<Turn> {
        let conversation = self
            .store
            .conversation(owner_id, &hub.conversation_id)
            .await?
            .ok_or(EngineError::NotFound("conversation"))?;
        let nodes = crate::hub::unshared(&chain(&queued, &conversation));
        let turn_id: Arc<str> = Arc::from(queued.turn.id.as_str());
        self.record(hub, &conversation, &nodes, Some(&turn_id)).await?;
        let mut turn = Turn::clone(&queued.turn);
        turn.status = TurnStatus::Cancelled;
        turn.error_code = Some("cancelled".into());
        turn.error_message = Some("the turn was cancelled before it started".into());
        turn.finished_at = Some(now_millis());
        if let Some(last) = nodes.last() {
            turn.user_message_id = last.id.clone();
        }
        self.store.update_turn(&turn).await?;
        hub.emit(
            Some(&turn_id),
            EventName::Error,
            &json!({"turn_id": &*turn_id, "code": "cancelled", "message": turn.error_message}),
        );
        let _ = queued.outcome.send(Some(Arc::new(crate::TurnOutcome {
            turn: Arc::new(turn.clone()),
            reply: None,
            head_version: conversation.head_version,
            overhead: Default::default(),
            store_wait: Default::default(),
        })));
        Ok(turn)
    }
}

/// Refuses a turn of a user with no credits left. `available` is read with
/// the conversation, fresh for this request (a cached user may hold an old
/// balance). Returns whether the user's spending is limited (calls then
/// reserve credits before they are made).
fn check_quota(available: Option<i64>) -> EngineResult<bool> {
    if available.is_some_and(|credits| credits <= 0) {
        return Err(EngineError::QuotaExceeded);
    }
    Ok(available.is_some())
}

/// The queued turn's messages, hung under the head as it is now unless the
/// client placed them itself.
fn chain(queued: &QueuedTurn, conversation: &Conversation) -> Vec<Arc<Node>> {
    if queued.anchored || !queued.waited {
        return queued.nodes.clone();
    }
    let mut parent = conversation.head_id.clone();
    queued
        .nodes
        .iter()
        .map(|node| {
            let chained = Node { parent_id: parent.clone(), ..Node::clone(node) };
            parent = Some(node.id.clone());
            Arc::new(chained)
        })
        .collect()
}

/// The head version as stored now (0 when it cannot be read).
async fn conversation_head_version(
    store: &std::sync::Arc<dyn arbor_store::Store>,
    conversation_id: &str,
    owner_id: &str,
) -> i64 {
    match store.conversation(owner_id, conversation_id).await {
        Ok(Some(conversation)) => conversation.head_version,
        _ => 0,
    }
}

/// Refuses, before anything is recorded or called, input the model cannot
/// take: images for a model without vision.
pub(crate) fn check_capabilities(model: &ResolvedModel, nodes: &[Node]) -> EngineResult<()> {
    let has_image =
        nodes.iter().any(|node| node.message.parts.iter().any(|part| matches!(part, arbor_core::Part::Image { .. })));
    if has_image && !model.info.capabilities.vision {
        return Err(EngineError::InvalidInput(format!(
            "model {:?} cannot read images (it has no vision capability); choose a model with vision",
            model.info.id
        )));
    }
    Ok(())
}
