//! One turn, run as a task the engine owns: build the model's input, stream
//! the call, forward every chunk as events, and record the reply, the api
//! call and its charge. A client that disconnects does not stop it; a cancel,
//! the turn's deadline or a server shutdown does, and then whatever the model
//! wrote so far is kept, marked interrupted.

use std::sync::Arc;
use std::time::Instant;

use arbor_core::event::{DonePayload, ErrorPayload};
use arbor_core::ids::{new_id, now_millis};
use arbor_core::message::{NodeStatus, SharedMessage};
use arbor_core::{Cost, ErrorCode, EventName, Message, Node, ProviderError, Usage};
use arbor_providers::{ChatRequest, Chunk, Collected};
use arbor_store::{ApiCall, Conversation, Turn, TurnStatus, User};
use futures_util::{FutureExt, StreamExt};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::Inner;
use crate::hub::{Hub, QueuedTurn};
use crate::models::ResolvedModel;
use crate::payloads::{CallEnded, CallStarted, MessageNew};

/// The longest reply a limited user's call may ask for, so the credits held
/// for it stay a sensible amount.
const MAX_OUTPUT_WHEN_LIMITED: u64 = 4096;

/// Credits held for a turn's call, decided in the commit that starts the
/// turn (a user with a limited balance).
#[derive(Debug, Clone, Default)]
pub(crate) enum Hold {
    /// The user is unlimited: nothing is held.
    #[default]
    Unlimited,
    /// Held under this reservation id.
    Held(String),
    /// The credits left do not cover the call: the turn fails without it,
    /// with this message.
    Refused(String),
}

impl Hold {
    /// What the reservation asked of `start_turn` (if any) came to.
    pub(crate) fn of(outcome: Option<(arbor_store::Reservation, arbor_store::ReserveOutcome)>) -> Hold {
        match outcome {
            None => Hold::Unlimited,
            Some((reservation, arbor_store::ReserveOutcome::Reserved { .. })) => Hold::Held(reservation.id),
            Some((reservation, arbor_store::ReserveOutcome::Insufficient { available })) => Hold::Refused(format!(
                "this reply could cost up to {} credits and {available} are left; ask an administrator for more credits",
                reservation.credits
            )),
        }
    }
}

/// The most a limited user's call may ask the model to write, so the credits
/// held for it stay a sensible amount.
pub(crate) fn output_cap(model: &ResolvedModel) -> u64 {
    model.info.max_output.clamp(1, MAX_OUTPUT_WHEN_LIMITED)
}

/// The reservation for a limited user's call to `model` with this input: its
/// output capped by [`output_cap`] and its input over-estimated, so that the
/// credits held bound what the call can cost.
pub(crate) fn reservation_for<'a>(
    inner: &Inner,
    user_id: &str,
    model: &ResolvedModel,
    system: Option<&str>,
    messages: impl Iterator<Item = &'a Message>,
) -> arbor_store::Reservation {
    let system = system.map_or(0, |system| arbor_core::tokens::estimate_from_chars(system.len()));
    let messages: u64 = messages.map(arbor_core::tokens::estimate_message).sum();
    // The estimate is doubled: four characters a token undercounts some
    // scripts, and the reservation must be an upper bound.
    let input = 2 * (messages + system) + 256;
    let usage = Usage { input_tokens: input, output_tokens: output_cap(model), ..Usage::default() };
    let bound = model.info.prices.cost(&usage);
    let now = now_millis();
    arbor_store::Reservation {
        id: new_id(),
        user_id: user_id.to_string(),
        credits: bound.credits().max(1),
        created_at: now,
        expires_at: now + inner.config.limits.turn_timeout.as_millis() as i64 + 60_000,
    }
}

/// How a finished turn ended, for callers that wait (the JSON mode).
#[derive(Debug, Clone)]
pub struct TurnOutcome {
    pub turn: Arc<Turn>,
    /// The assistant message it produced (possibly interrupted), as the
    /// conversation's tree holds it.
    pub reply: Option<Arc<Node>>,
    /// The conversation's head version after the turn.
    pub head_version: i64,
    /// Time the turn spent outside provider calls: what Arbor added.
    pub overhead: std::time::Duration,
    /// Of `overhead`, the time it waited for the writes it must wait for:
    /// its start (the user's message, durable before the call) and its end
    /// (the finished turn, durable before the answer).
    pub store_wait: std::time::Duration,
}

/// Where a turn's end is announced. Shared, so that every caller waiting
/// for it (the submit's, a merged submit's) reads the one outcome instead of
/// copying the turn and its reply.
pub(crate) type OutcomeSender = watch::Sender<Option<Arc<TurnOutcome>>>;
pub(crate) type OutcomeReceiver = watch::Receiver<Option<Arc<TurnOutcome>>>;

/// Why a model call stopped before the provider finished it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stopped {
    Cancelled,
    TimedOut,
    /// The server is going down; the turn is `interrupted`.
    Shutdown,
}

pub(crate) struct TurnTask {
    inner: Arc<Inner>,
    hub: Arc<Hub>,
    user: User,
    conversation: Conversation,
    turn: Arc<Turn>,
    turn_id: Arc<str>,
    model: ResolvedModel,
    cancel: CancellationToken,
    outcome: OutcomeSender,
    /// When the turn's time limit runs out.
    deadline: Instant,
    /// The `llm_request` trace card of the call in flight.
    llm_trace_id: String,
    /// The provider's `retry-after`, passed on in the `error` event.
    retry_after_secs: Option<u64>,
    /// When the engine accepted the turn.
    accepted: Instant,
    /// Time spent inside provider calls.
    upstream: std::time::Duration,
    /// Time spent waiting for the turn's start and end to be stored.
    store_wait: std::time::Duration,
    /// Credits held for the call (the user's spending is limited).
    hold: Hold,
    /// Whether the finished turn is stored (with its last call).
    recorded: bool,
}

/// What one model call produced.
struct CallResult {
    collected: Collected,
    usage: Usage,
    latency_ms: u64,
    ttft_ms: Option<u64>,
    failure: Option<Failure>,
}

#[derive(Debug, Clone)]
enum Failure {
    Provider(ProviderError),
    Stopped(Stopped),
}

impl TurnTask {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        inner: Arc<Inner>,
        hub: Arc<Hub>,
        user: User,
        conversation: Conversation,
        turn: Arc<Turn>,
        turn_id: Arc<str>,
        model: ResolvedModel,
        cancel: CancellationToken,
        outcome: OutcomeSender,
        deadline: Instant,
    ) -> TurnTask {
        TurnTask {
            inner,
            hub,
            user,
            conversation,
            turn,
            turn_id,
            model,
            cancel,
            outcome,
            deadline,
            llm_trace_id: String::new(),
            retry_after_secs: None,
            accepted: Instant::now(),
            upstream: std::time::Duration::ZERO,
            store_wait: std::time::Duration::ZERO,
            hold: Hold::Unlimited,
            recorded: false,
        }
    }

    /// The turn, to change: shared with no one by then (the store's writes
    /// of it are over), so not copied.
    fn turn_mut(&mut self) -> &mut Turn {
        Arc::make_mut(&mut self.turn)
    }

    /// Marks the turn ended with `status` (not a success) and why.
    fn end_with(&mut self, status: TurnStatus, code: &str, message: String) {
        let turn = self.turn_mut();
        turn.status = status;
        turn.error_code = Some(code.to_string());
        turn.error_message = Some(message);
    }

    pub(crate) fn holding(mut self, hold: Hold) -> TurnTask {
        self.hold = hold;
        self
    }

    /// When the engine took the turn in (the submit), so that the overhead
    /// measured covers recording the user's message and claiming the slot.
    pub(crate) fn accepted_at(mut self, accepted: Instant) -> TurnTask {
        self.accepted = accepted;
        self
    }

    /// How long recording the turn's start took (before this task).
    pub(crate) fn started_in(mut self, waited: std::time::Duration) -> TurnTask {
        self.store_wait = waited;
        self
    }

    pub(crate) async fn run(mut self) {
        let started = Instant::now();
        tracing::debug!(turn_id = %self.turn_id, conversation_id = %self.conversation.id, model = %self.model.info.id, "turn started");
        // With several nodes, the turn holds a lease while it runs, so that
        // another node can take it over if this one dies.
        let lease = self.inner.config.shared.then(|| {
            tokio::spawn(crate::cluster::keep_lease(self.inner.clone(), self.turn.id.clone(), self.cancel.clone()))
        });
        let driven = self.drive().await;
        if let Some(lease) = lease {
            lease.abort();
        }
        let reply = match driven {
            Ok(reply) => reply,
            Err(error) => {
                // A store failure mid-turn: the turn cannot be recorded as
                // finished normally; say so to the viewers and free the slot.
                tracing::error!(turn_id = %self.turn_id, %error, "turn failed on a server fault");
                self.end_with(
                    TurnStatus::Failed,
                    ErrorCode::Internal.as_str(),
                    "the server could not record this turn".into(),
                );
                None
            }
        };
        // A turn that made its call was written whole by `finish_turn`; one
        // that ended before (refused, or a store fault) is written here.
        if !self.recorded {
            // Ended without its call: what was held for it goes back.
            if let Hold::Held(reservation) = std::mem::take(&mut self.hold)
                && let Err(error) = self.inner.store.release_reservation(&reservation).await
            {
                tracing::error!(turn_id = %self.turn_id, %error, "releasing the turn's credits failed");
            }
            self.turn_mut().finished_at = Some(now_millis());
            if let Err(error) = self.inner.store.update_turn(&self.turn).await {
                tracing::error!(turn_id = %self.turn_id, %error, "recording the finished turn failed");
            }
        }
        let next = self.finish_events(reply.as_deref());
        tracing::info!(
            turn_id = %self.turn_id,
            status = self.turn.status.as_str(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            cost_micro_usd = self.turn.cost_micro_usd,
            conversation_id = %self.conversation.id,
            model = %self.model.info.id,
            "turn finished"
        );
        let total = self.accepted.elapsed();
        let overhead = total.saturating_sub(self.upstream);
        let metrics = &self.inner.metrics;
        metrics.turn_overhead.observe(overhead);
        metrics.turn_store_wait.observe(self.store_wait);
        metrics.turn_duration.observe(total);
        let counter =
            if self.turn.status == TurnStatus::Succeeded { &metrics.turns_succeeded } else { &metrics.turns_failed };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Wakes nodes holding queued turns for this conversation (for a
        // recorded turn, `finish_turn` did).
        let notice = (self.inner.config.shared && !self.recorded).then(|| arbor_store::Notice::TurnFinished {
            conversation_id: self.conversation.id.clone(),
            turn_id: self.turn.id.clone(),
        });
        let _ = self.outcome.send(Some(Arc::new(TurnOutcome {
            turn: self.turn,
            reply,
            head_version: self.conversation.head_version,
            overhead,
            store_wait: self.store_wait,
        })));
        if let Some(next) = next {
            // The engine's launcher starts it: a turn task that launched the
            // next turn itself would be a future containing itself.
            self.inner.queue_launch(self.hub.clone(), self.conversation.owner_id.clone(), next);
        }
        if let Some(notice) = notice {
            // Last: the slot is free in the store already, and the round
            // trip kept the turn's answer and `done` waiting.
            if let Err(error) = self.inner.store.notify(&notice).await {
                tracing::warn!(%error, "announcing the end of a turn failed");
            }
        }
    }

    /// Releases the turn slot and emits the closing `done` or `error` in one
    /// step, so the next turn's events always follow this turn's end.
    fn finish_events(&self, reply: Option<&Node>) -> Option<QueuedTurn> {
        let turn = &self.turn;
        match (turn.status, reply) {
            (TurnStatus::Succeeded, Some(reply)) => {
                let cost = Cost { micro_usd: turn.cost_micro_usd };
                let latency_ms =
                    turn.finished_at.zip(turn.started_at).map_or(0, |(end, start)| (end - start).max(0) as u64);
                let payload = DonePayload {
                    turn_id: turn.id.clone(),
                    message_id: reply.id.clone(),
                    model: self.model.info.id.clone(),
                    input_tokens: turn.usage.input_tokens,
                    output_tokens: turn.usage.output_tokens,
                    thinking_tokens: turn.usage.thinking_tokens,
                    cached_tokens: turn.usage.cached_tokens,
                    latency_ms,
                    cost_credits: cost.credits(),
                    cost_cents_usd: cost.cents_usd(),
                    head_version: self.conversation.head_version,
                };
                self.hub.finish(&self.turn_id, EventName::Done, &payload)
            }
            _ => {
                let payload = ErrorPayload {
                    turn_id: Some(turn.id.clone()),
                    code: turn.error_code.clone().unwrap_or_else(|| ErrorCode::Internal.as_str().into()),
                    message: turn.error_message.clone().unwrap_or_else(|| "the turn failed".into()),
                    retry_after: self.retry_after_secs,
                };
                self.hub.finish(&self.turn_id, EventName::Error, &payload)
            }
        }
    }

    /// Runs the model call and records it. Returns the assistant message.
    async fn drive(&mut self) -> Result<Option<Arc<Node>>, arbor_store::StoreError> {
        let tree = self.inner.tree(&self.hub, &self.conversation.id, self.conversation.head_version).await?;
        // The request shares the tree's nodes: no text on the path is copied.
        let path: Vec<SharedMessage> = tree
            .path_to(&self.turn.user_message_id)
            .into_iter()
            .filter(|node| {
                !(node.status == NodeStatus::Interrupted && node.message.content.as_deref().unwrap_or("").is_empty())
            })
            .map(|node| SharedMessage::from(Arc::clone(node)))
            .collect();
        // Let go before the reply is added: the hub's copy then grows in
        // place instead of being cloned whole (`Arc::make_mut`) every turn.
        drop(tree);
        let parent_id = self.turn.user_message_id.clone();
        let has_image =
            path.iter().any(|message| message.parts.iter().any(|part| matches!(part, arbor_core::Part::Image { .. })));
        if has_image && !self.model.info.capabilities.vision {
            // Refused before any call: the model would reject or ignore it.
            let message = format!(
                "model {:?} cannot read images (it has no vision capability), and this conversation has some; choose a model with vision",
                self.model.info.id
            );
            self.end_with(TurnStatus::Failed, ErrorCode::InvalidRequest.as_str(), message);
            return Ok(None);
        }

        let request = ChatRequest {
            model: self.model.info.upstream_name().to_string(),
            system: self.conversation.system_prompt.clone(),
            messages: path,
            tools: Vec::new(),
            max_output_tokens: None,
            temperature: None,
            reasoning: None,
        };
        let mut request = request;
        let reservation = match std::mem::take(&mut self.hold) {
            Hold::Unlimited => None,
            Hold::Held(reservation) => {
                request.max_output_tokens = Some(u32::try_from(output_cap(&self.model)).unwrap_or(u32::MAX));
                Some(reservation)
            }
            Hold::Refused(message) => {
                self.end_with(TurnStatus::Failed, "quota_exceeded", message);
                return Ok(None);
            }
        };
        let result = self.call_model(request).await;

        // Price what the provider reported, even for a call that failed or
        // was cut short: the provider bills for it.
        let cost = self.model.info.prices.cost(&result.usage);
        let turn = self.turn_mut();
        turn.iterations += 1;
        turn.usage.add(&result.usage);
        turn.cost_micro_usd += cost.micro_usd;

        let has_output = !result.collected.text.is_empty()
            || !result.collected.tool_calls.is_empty()
            || !result.collected.parts.is_empty();
        let reply = (result.failure.is_none() || has_output).then(|| {
            Arc::new(Node {
                id: new_id(),
                conversation_id: self.conversation.id.clone(),
                parent_id: Some(parent_id),
                message: result.collected.message(),
                model: Some(self.model.info.id.clone()),
                provider: Some(self.model.info.provider.clone()),
                turn_id: Some(self.turn.id.clone()),
                copied_from: None,
                status: if result.failure.is_none() { NodeStatus::Complete } else { NodeStatus::Interrupted },
                created_at: now_millis(),
            })
        });

        let (status, error_code) = match &result.failure {
            None => ("ok", None),
            Some(Failure::Stopped(Stopped::Cancelled)) => ("cancelled", Some(ErrorCode::Cancelled)),
            Some(Failure::Stopped(Stopped::Shutdown)) => ("cancelled", Some(ErrorCode::Cancelled)),
            Some(Failure::Stopped(Stopped::TimedOut)) => ("error", Some(ErrorCode::Timeout)),
            Some(Failure::Provider(error)) => ("error", Some(error.code)),
        };
        let call = ApiCall {
            id: new_id(),
            turn_id: Some(self.turn.id.clone()),
            conversation_id: Some(self.conversation.id.clone()),
            user_id: self.user.id.clone(),
            kind: "chat".into(),
            provider: self.model.info.provider.clone(),
            model: self.model.info.id.clone(),
            usage: result.usage,
            latency_ms: result.latency_ms,
            ttft_ms: result.ttft_ms,
            status: status.into(),
            error_code: error_code.map(|code| code.as_str().to_string()),
            cost_micro_usd: cost.micro_usd,
            created_at: now_millis(),
        };
        // How the turn ends, decided before anything is written, so that the
        // reply, the call, its charge, the head and the finished turn are
        // stored in one transaction, before `done` is sent.
        let ending = match result.failure {
            None => None,
            Some(Failure::Stopped(Stopped::Cancelled)) => {
                Some((TurnStatus::Cancelled, ErrorCode::Cancelled, "the turn was cancelled".to_string()))
            }
            Some(Failure::Stopped(Stopped::Shutdown)) => Some((
                TurnStatus::Interrupted,
                ErrorCode::Cancelled,
                "the server shut down during the turn; send the message again".to_string(),
            )),
            Some(Failure::Stopped(Stopped::TimedOut)) => Some((
                TurnStatus::Failed,
                ErrorCode::Timeout,
                format!("the turn took longer than its limit of {} s", self.inner.config.limits.turn_timeout.as_secs()),
            )),
            Some(Failure::Provider(error)) => {
                self.retry_after_secs = error.retry_after.map(|delay| delay.as_secs().max(1));
                Some((TurnStatus::Failed, error.code, error.message))
            }
        };
        match &ending {
            None => self.turn_mut().status = TurnStatus::Succeeded,
            Some((turn_status, code, message)) => self.end_with(*turn_status, code.as_str(), message.clone()),
        }
        let now = now_millis();
        let turn = self.turn_mut();
        turn.reply_message_id = reply.as_ref().map(|node| node.id.clone());
        turn.finished_at = Some(now);
        let finishing = Instant::now();
        let (_, head_version) =
            self.inner.store.finish_turn(&self.turn, call, reply.as_ref(), reservation.as_deref(), now).await?;
        self.store_wait += finishing.elapsed();
        self.recorded = true;
        if let (Some(reply), Some(head_version)) = (&reply, head_version) {
            let before = self.conversation.head_version;
            self.conversation.head_version = head_version;
            self.conversation.head_id = Some(reply.id.clone());
            self.hub.advance_tree(before, head_version, std::slice::from_ref(reply));
        }

        self.hub.emit(
            Some(&self.turn_id),
            EventName::TraceEnd,
            &CallEnded {
                cached_tokens: result.usage.cached_tokens,
                cost_cents_usd: cost.cents_usd(),
                cost_credits: cost.credits(),
                id: &self.llm_trace_id,
                input_tokens: result.usage.input_tokens,
                latency_ms: result.latency_ms,
                model: &self.model.info.id,
                output_tokens: result.usage.output_tokens,
                provider: &self.model.info.provider,
                status,
                thinking_tokens: result.usage.thinking_tokens,
                ttft_ms: result.ttft_ms,
                kind: "llm_request",
            },
        );
        if let Some(reply) = &reply {
            self.hub.emit(
                Some(&self.turn_id),
                EventName::MessageNew,
                &MessageNew { head_version: None, message: reply },
            );
        }
        if let Some((turn_status, code, message)) = ending
            && turn_status == TurnStatus::Failed
        {
            let trace_id = new_id();
            self.hub.emit(
                Some(&self.turn_id),
                EventName::TraceStart,
                &json!({"id": trace_id, "type": "error", "code": code, "message": message}),
            );
            self.hub.emit(Some(&self.turn_id), EventName::TraceEnd, &json!({"id": trace_id, "type": "error"}));
        }
        Ok(reply)
    }

    /// Streams one model call, forwarding chunks as events as they come.
    async fn call_model(&mut self, request: ChatRequest) -> CallResult {
        let estimated_input = arbor_core::tokens::estimate_messages(&request.messages);
        self.llm_trace_id = new_id();
        self.hub.emit(
            Some(&self.turn_id),
            EventName::TraceStart,
            &CallStarted {
                id: &self.llm_trace_id,
                iteration: self.turn.iterations + 1,
                model: &self.model.info.id,
                provider: &self.model.info.provider,
                kind: "llm_request",
            },
        );
        let started = Instant::now();
        let deadline = tokio::time::Instant::from_std(self.deadline);
        let mut collected = Collected::default();
        let mut forwarder = ChunkForwarder::default();
        let mut ttft_ms = None;

        let provider = self.model.provider.clone();
        let opened = tokio::select! {
            biased;
            stop = self.stopped() => Err(Failure::Stopped(stop)),
            _ = tokio::time::sleep_until(deadline) => Err(Failure::Stopped(Stopped::TimedOut)),
            opened = provider.stream(request) => opened.map_err(Failure::Provider),
        };
        let failure = match opened {
            Err(failure) => Some(failure),
            Ok(mut stream) => {
                let mut taken_ready = 0;
                loop {
                    // Chunks that have already arrived are taken without waiting
                    // and their text goes out as one event; whatever is held is
                    // sent before waiting, so no text waits for a later chunk.
                    let ready = if taken_ready < MAX_MERGED { stream.next().now_or_never() } else { None };
                    let next = match ready {
                        Some(next) => {
                            taken_ready += 1;
                            next
                        }
                        None => {
                            taken_ready = 0;
                            forwarder.flush(&self.hub, &self.turn_id);
                            tokio::select! {
                                biased;
                                stop = self.stopped() => break Some(Failure::Stopped(stop)),
                                _ = tokio::time::sleep_until(deadline) => break Some(Failure::Stopped(Stopped::TimedOut)),
                                next = stream.next() => next,
                            }
                        }
                    };
                    match next {
                        None => break None,
                        Some(Err(error)) => break Some(Failure::Provider(error)),
                        Some(Ok(chunk)) => {
                            ttft_ms.get_or_insert_with(|| started.elapsed().as_millis() as u64);
                            forwarder.forward(&self.hub, &self.turn_id, &chunk);
                            collected.push(&chunk);
                        }
                    }
                }
            }
        };
        forwarder.close(&self.hub, &self.turn_id);
        let collected = collected.finish();
        // A server that reports no usage (some OpenAI-compatible ones) is
        // charged by estimate rather than not at all.
        let usage = collected.usage.unwrap_or_else(|| {
            if failure.is_some() && ttft_ms.is_none() {
                Usage::default()
            } else {
                Usage {
                    input_tokens: estimated_input,
                    output_tokens: arbor_core::tokens::estimate_from_chars(collected.text.len()),
                    ..Usage::default()
                }
            }
        });
        let elapsed = started.elapsed();
        self.upstream += elapsed;
        CallResult { collected, usage, latency_ms: elapsed.as_millis() as u64, ttft_ms, failure }
    }

    /// Resolves when the turn must stop: a cancel, or a server shutdown.
    async fn stopped(&self) -> Stopped {
        tokio::select! {
            _ = self.cancel.cancelled() => Stopped::Cancelled,
            _ = self.inner.interrupt.cancelled() => Stopped::Shutdown,
        }
    }
}

/// Payload of `delta` (no id) and of a thinking card's `trace_delta`.
/// Borrowed, typed payloads keep the per-chunk work to one serialization.
#[derive(serde::Serialize)]
struct TextDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    text: &'a str,
}

/// Payload of a tool call card's `trace_delta`.
#[derive(serde::Serialize)]
struct ArgumentsDelta<'a> {
    id: &'a str,
    arguments: &'a str,
}

/// Chunks taken without waiting in a row at most: past it the held text is
/// sent and the loop checks for a cancel before reading on.
const MAX_MERGED: usize = 64;

/// Turns chunks into trace and delta events, opening and closing trace cards
/// as the reply moves between thinking, tool calls and text.
///
/// Consecutive text of one kind (answer, thinking, one tool call's
/// arguments) is held and sent as one event by [`ChunkForwarder::flush`],
/// which the model loop calls whenever no further chunk has arrived. A
/// provider that sends a burst (a fast model, a reply already generated, a
/// network read holding several SSE events) then costs one event instead of
/// one per chunk — one row, one fan-out, one frame — and a paced stream is
/// forwarded chunk by chunk as before. Clients only ever concatenate deltas.
#[derive(Default)]
struct ChunkForwarder {
    thinking_trace: Option<String>,
    /// (chunk index, trace id) of tool calls being streamed.
    tool_traces: Vec<(usize, String)>,
    /// Text not yet sent, and whose it is.
    pending: Option<(Held, String)>,
}

/// Whose text a [`ChunkForwarder`] holds.
#[derive(PartialEq)]
enum Held {
    Answer,
    /// The open thinking card.
    Thinking,
    /// The arguments of the tool call streamed at this index, with its card.
    Arguments(usize),
}

impl ChunkForwarder {
    fn forward(&mut self, hub: &Hub, turn_id: &Arc<str>, chunk: &Chunk) {
        let turn = Some(turn_id);
        match chunk {
            Chunk::Text(text) => {
                self.close_thinking(hub, turn_id);
                self.hold(hub, turn_id, Held::Answer, text);
            }
            Chunk::Thinking(text) => {
                if self.thinking_trace.is_none() {
                    self.flush(hub, turn_id);
                    let id = new_id();
                    hub.emit(turn, EventName::TraceStart, &json!({"id": id, "type": "thinking"}));
                    self.thinking_trace = Some(id);
                }
                self.hold(hub, turn_id, Held::Thinking, text);
            }
            Chunk::ThinkingSignature(_) | Chunk::RedactedThinking(_) => self.close_thinking(hub, turn_id),
            Chunk::ToolCallStart { index, id, name } => {
                self.close_thinking(hub, turn_id);
                self.flush(hub, turn_id);
                let trace = new_id();
                hub.emit(
                    turn,
                    EventName::TraceStart,
                    &json!({"id": trace, "type": "tool_call_request", "tool_call_id": id, "name": name}),
                );
                self.tool_traces.push((*index, trace));
            }
            Chunk::ToolCallArguments { index, fragment } => {
                if self.tool_traces.iter().any(|(open, _)| open == index) {
                    self.hold(hub, turn_id, Held::Arguments(*index), fragment);
                }
            }
            Chunk::ToolCallEnd { index, .. } => {
                self.flush(hub, turn_id);
                if let Some(position) = self.tool_traces.iter().position(|(open, _)| open == index) {
                    let (_, trace) = self.tool_traces.remove(position);
                    hub.emit(turn, EventName::TraceEnd, &json!({"id": trace}));
                }
            }
            Chunk::Usage(_) | Chunk::Finish(_) => {}
        }
    }

    /// Adds `text` to what is held, sending what was held first when it
    /// belongs to someone else.
    fn hold(&mut self, hub: &Hub, turn_id: &Arc<str>, whose: Held, text: &str) {
        if self.pending.as_ref().is_some_and(|(held, _)| *held != whose) {
            self.flush(hub, turn_id);
        }
        self.pending.get_or_insert_with(|| (whose, String::new())).1.push_str(text);
    }

    /// Sends the held text as one event.
    fn flush(&mut self, hub: &Hub, turn_id: &Arc<str>) {
        let Some((whose, text)) = self.pending.take() else { return };
        let turn = Some(turn_id);
        match whose {
            Held::Answer => hub.emit(turn, EventName::Delta, &TextDelta { id: None, text: &text }),
            Held::Thinking => {
                if let Some(id) = &self.thinking_trace {
                    hub.emit(turn, EventName::TraceDelta, &TextDelta { id: Some(id), text: &text });
                }
            }
            Held::Arguments(index) => {
                if let Some((_, trace)) = self.tool_traces.iter().find(|(open, _)| *open == index) {
                    hub.emit(turn, EventName::TraceDelta, &ArgumentsDelta { id: trace, arguments: &text });
                }
            }
        }
    }

    fn close_thinking(&mut self, hub: &Hub, turn_id: &Arc<str>) {
        if self.thinking_trace.is_some() {
            self.flush(hub, turn_id);
        }
        if let Some(id) = self.thinking_trace.take() {
            hub.emit(Some(turn_id), EventName::TraceEnd, &json!({"id": id}));
        }
    }

    /// Sends what is held and closes every card still open (the stream
    /// ended or broke off).
    fn close(&mut self, hub: &Hub, turn_id: &Arc<str>) {
        self.flush(hub, turn_id);
        self.close_thinking(hub, turn_id);
        for (_, trace) in self.tool_traces.drain(..) {
            hub.emit(Some(turn_id), EventName::TraceEnd, &json!({"id": trace}));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::Numbering;
    use crate::writer::EventWriter;

    /// A hub numbering its events in memory, with a real event writer.
    async fn hub() -> Arc<Hub> {
        Hub::new("c1", 0, EventWriter::in_memory().await, Numbering::Local, Default::default())
    }

    fn events_of(hub: &Hub) -> Vec<(EventName, serde_json::Value)> {
        let backlog = hub.subscribe(0).backlog;
        backlog.iter().map(|event| (event.name, serde_json::from_str(&event.data).expect("json"))).collect()
    }

    #[tokio::test]
    async fn chunks_taken_together_go_out_as_one_event_per_kind_in_order() {
        let hub = hub().await;
        let turn: Arc<str> = Arc::from("t1");
        let mut forwarder = ChunkForwarder::default();
        let chunks = [
            Chunk::Thinking("let me ".into()),
            Chunk::Thinking("think".into()),
            Chunk::Text("Hel".into()),
            Chunk::Text("lo".into()),
            Chunk::ToolCallStart { index: 0, id: "call_1".into(), name: "add".into() },
            Chunk::ToolCallArguments { index: 0, fragment: "{\"a\":".into() },
            Chunk::ToolCallArguments { index: 0, fragment: "1}".into() },
            Chunk::ToolCallEnd { index: 0, signature: None },
            Chunk::Text(" again".into()),
            Chunk::Usage(Usage::default()),
        ];
        for chunk in &chunks {
            forwarder.forward(&hub, &turn, chunk);
        }
        forwarder.close(&hub, &turn);

        let events = events_of(&hub);
        let names: Vec<EventName> = events.iter().map(|(name, _)| *name).collect();
        use EventName::*;
        assert_eq!(names, [TraceStart, TraceDelta, TraceEnd, Delta, TraceStart, TraceDelta, TraceEnd, Delta]);
        let thinking = events[0].1["id"].clone();
        assert_eq!(events[1].1, json!({"id": thinking, "text": "let me think"}));
        assert_eq!(events[3].1, json!({"text": "Hello"}));
        let call = events[4].1["id"].clone();
        assert_eq!(events[5].1, json!({"id": call, "arguments": "{\"a\":1}"}));
        assert_eq!(events[6].1, json!({"id": call}));
        assert_eq!(events[7].1, json!({"text": " again"}));
    }

    #[tokio::test]
    async fn a_flush_between_chunks_sends_each_one_as_it_comes() {
        let hub = hub().await;
        let turn: Arc<str> = Arc::from("t1");
        let mut forwarder = ChunkForwarder::default();
        forwarder.forward(&hub, &turn, &Chunk::Text("first".into()));
        assert!(events_of(&hub).is_empty(), "held until the loop finds nothing more ready");
        forwarder.flush(&hub, &turn);
        assert_eq!(events_of(&hub), [(EventName::Delta, json!({"text": "first"}))]);
        forwarder.forward(&hub, &turn, &Chunk::Text("second".into()));
        forwarder.flush(&hub, &turn);
        forwarder.flush(&hub, &turn);
        let texts: Vec<serde_json::Value> = events_of(&hub).into_iter().map(|(_, data)| data).collect();
        assert_eq!(texts, [json!({"text": "first"}), json!({"text": "second"})]);
    }
}
