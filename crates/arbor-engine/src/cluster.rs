//! Several Arbor nodes on one PostgreSQL database (DESIGN.md §9). The store
//! stays the source of truth; notices (LISTEN/NOTIFY) only wake nodes up, so
//! a lost notice costs latency, never data:
//!
//! - `Events`: another node stored events of a conversation someone watches
//!   here; read them from the store and publish them to local viewers.
//! - `CancelTurn` / `HeadMoved`: stop a turn running here.
//! - `TurnFinished`: a conversation's slot is free; start a turn queued here.
//! - Leases: a running turn's node renews its lease; the sweeper on every
//!   node takes over turns whose lease expired (their node died) and records
//!   them as interrupted, keeping what they had streamed.

use std::sync::Arc;

use arbor_core::EventName;
use arbor_core::ids::now_millis;
use arbor_store::{Notice, Turn};
use serde_json::json;
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;

use crate::hub::Hub;
use crate::{Engine, EngineResult, Inner};

/// Store pages read when catching up with another node's events.
const CATCH_UP_PAGE: u32 = 500;

pub(crate) async fn start(engine: Engine) -> EngineResult<()> {
    let mut notices = engine.inner.store.listen().await?;
    let listener = engine.clone();
    tokio::spawn(async move {
        loop {
            match notices.recv().await {
                Ok(notice) => handle(&listener, notice).await,
                Err(RecvError::Lagged(_)) => resync(&listener).await,
                Err(RecvError::Closed) => break,
            }
        }
    });
    tokio::spawn(sweep(engine));
    Ok(())
}

async fn handle(engine: &Engine, notice: Notice) {
    match notice {
        Notice::Events { conversation_id, seq } => {
            if let Some(hub) = engine.hub_if_loaded(&conversation_id)
                && hub.last_published() < seq
            {
                catch_up(&engine.inner, &hub).await;
            }
        }
        Notice::CancelTurn { conversation_id, turn_id } => {
            let Some(hub) = engine.hub_if_loaded(&conversation_id) else { return };
            if let Some(running) = hub.running().filter(|running| *running.turn_id == *turn_id) {
                running.cancel.cancel();
            } else if let Some(queued) = hub.remove_queued(&turn_id) {
                let owner = queued.user.id.clone();
                if let Err(error) = engine.inner.cancel_queued(&hub, &owner, queued).await {
                    tracing::warn!(%error, %turn_id, "cancelling a queued turn failed");
                }
            }
        }
        Notice::HeadMoved { conversation_id, head_id, head_version } => {
            let (Some(hub), Some(head_id)) = (engine.hub_if_loaded(&conversation_id), head_id) else { return };
            if let Err(error) = engine.inner.stop_if_branch_left(&hub, &conversation_id, &head_id, head_version).await {
                tracing::warn!(%error, "checking a remote head move against the running turn failed");
            }
        }
        Notice::TurnFinished { conversation_id, .. } => {
            let Some(hub) = engine.hub_if_loaded(&conversation_id) else { return };
            if let Some(next) = hub.take_next_queued() {
                let owner = next.user.id.clone();
                engine.inner.queue_launch(hub, owner, next);
            }
        }
        Notice::Resync => resync(engine).await,
    }
}

/// Re-reads every watched conversation after notices may have been missed.
async fn resync(engine: &Engine) {
    for hub in engine.loaded_hubs() {
        catch_up(&engine.inner, &hub).await;
        // A `TurnFinished` may have been among the missed notices.
        if let Some(next) = hub.take_next_queued() {
            let owner = next.user.id.clone();
            engine.inner.queue_launch(hub, owner, next);
        }
    }
}

/// Publishes the stored events this node has not shown yet.
pub(crate) async fn catch_up(inner: &Inner, hub: &Hub) {
    loop {
        let after = hub.last_published();
        match inner.store.events_after(&hub.conversation_id, after, CATCH_UP_PAGE).await {
            Ok(events) => {
                hub.publish(&events, 0);
                if events.len() < CATCH_UP_PAGE as usize {
                    return;
                }
            }
            Err(error) => {
                tracing::warn!(%error, "reading another node's events failed");
                return;
            }
        }
    }
}

/// Keeps a running turn's lease while it runs; if another node took the turn
/// over (this node was thought dead), stops it. The turn started holding
/// the lease (`start_turn`), so the first renewal is a third of it later.
pub(crate) async fn keep_lease(inner: Arc<Inner>, turn_id: String, cancel: CancellationToken) {
    let lease = inner.config.turn_lease;
    loop {
        tokio::time::sleep(lease / 3).await;
        let expires_at = now_millis() + lease.as_millis() as i64;
        match inner.store.renew_lease(&turn_id, &inner.node_id, expires_at).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(%turn_id, "another node took this turn over; stopping it here");
                cancel.cancel();
                return;
            }
            Err(error) => tracing::warn!(%error, %turn_id, "renewing a turn's lease failed"),
        }
    }
}

/// Takes over turns whose node stopped renewing their lease, and gives back
/// credits such nodes had reserved.
async fn sweep(engine: Engine) {
    let lease = engine.inner.config.turn_lease;
    loop {
        tokio::time::sleep(lease / 2).await;
        if engine.inner.closing.is_cancelled() {
            return;
        }
        let now = now_millis();
        let expired = match engine.inner.store.expired_running_turns(now).await {
            Ok(expired) => expired,
            Err(error) => {
                tracing::warn!(%error, "looking for turns of dead nodes failed");
                continue;
            }
        };
        for turn in expired {
            let expires_at = now + lease.as_millis() as i64;
            match engine.inner.store.take_over_turn(&turn.id, &engine.inner.node_id, now, expires_at).await {
                Ok(true) => {
                    if let Err(error) = interrupt(&engine, turn).await {
                        tracing::error!(%error, "recording a taken-over turn failed");
                    }
                }
                Ok(false) => {}
                Err(error) => tracing::warn!(%error, "taking over a turn failed"),
            }
        }
        // Queued turns left by a node that died (they would have run long
        // ago): their messages go into the tree, the turns are closed.
        let abandoned_before = now - 10 * engine.inner.config.limits.turn_timeout.as_millis() as i64;
        match engine.inner.store.turns_with_status(&[arbor_store::TurnStatus::Queued]).await {
            Ok(queued) => {
                for turn in queued.into_iter().filter(|turn| turn.created_at < abandoned_before) {
                    if let Err(error) = interrupt(&engine, turn).await {
                        tracing::warn!(%error, "closing an abandoned queued turn failed");
                    }
                }
            }
            Err(error) => tracing::warn!(%error, "looking for abandoned queued turns failed"),
        }
        if let Err(error) = engine.inner.store.release_expired_reservations(now).await {
            tracing::warn!(%error, "releasing expired credit reservations failed");
        }
    }
}

/// Records a turn whose process is gone as interrupted: what it streamed is
/// kept as an interrupted reply, viewers are told, and its slot is freed.
pub(crate) async fn interrupt(engine: &Engine, mut turn: Turn) -> EngineResult<()> {
    tracing::warn!(turn_id = %turn.id, conversation_id = %turn.conversation_id, "recording a turn whose process stopped as interrupted");
    record_pending_messages(engine, &mut turn).await?;
    let reply = engine.salvage_partial_reply(&turn).await?;
    turn.status = arbor_store::TurnStatus::Interrupted;
    turn.error_code = Some("interrupted".into());
    turn.error_message = Some("the server stopped during this turn; send the message again".into());
    turn.finished_at = Some(now_millis());
    turn.reply_message_id = reply.as_ref().map(|node| node.id.clone());
    engine.inner.store.update_turn(&turn).await?;
    let hub = engine.hub(&turn.conversation_id).await?;
    // The messages recorded above moved the head without the hub.
    hub.forget_conversation();
    let turn_id: Arc<str> = Arc::from(turn.id.as_str());
    hub.emit(
        Some(&turn_id),
        EventName::Error,
        &json!({"turn_id": turn.id, "code": "interrupted", "message": turn.error_message}),
    );
    if engine.inner.config.shared {
        let notice = Notice::TurnFinished { conversation_id: turn.conversation_id.clone(), turn_id: turn.id.clone() };
        let _ = engine.inner.store.notify(&notice).await;
    }
    Ok(())
}

/// A queued turn's messages were only in its row: records them in the tree,
/// under the head, so nothing the user sent is lost.
async fn record_pending_messages(engine: &Engine, turn: &mut Turn) -> EngineResult<()> {
    if turn.pending_messages.is_empty() {
        return Ok(());
    }
    let Some(conversation) = engine.inner.store.conversation(&turn.user_id, &turn.conversation_id).await? else {
        return Ok(());
    };
    let mut parent = conversation.head_id.clone();
    let nodes: Vec<arbor_core::Node> = std::mem::take(&mut turn.pending_messages)
        .into_iter()
        .map(|node| {
            let chained = arbor_core::Node { parent_id: parent.clone(), ..node };
            parent = Some(chained.id.clone());
            chained
        })
        .collect();
    engine.inner.store.append_messages(&nodes, now_millis()).await?;
    if let Some(last) = nodes.last() {
        turn.user_message_id = last.id.clone();
    }
    Ok(())
}
