//! The column lists of each table, shared by both stores' statements.
//!
//! They are macros, not constants, so `concat!` can splice them into
//! statements at compile time: every statement stays a `&'static str` (which
//! sqlx accepts as safe SQL) and every value a bound parameter, never
//! run-time formatted SQL. Both schemas name their columns alike, so one
//! list serves both, and the shared row decoders read these names.

macro_rules! user_columns {
    () => {
        "id, name, is_admin, balance_credits, created_at"
    };
}

macro_rules! conversation_columns {
    () => {
        "id, owner_id, title, system_prompt, preset_id, model, head_id, head_version, summary, \
         created_at, updated_at"
    };
}

macro_rules! node_columns {
    () => {
        "conversation_id, id, parent_id, role, content, parts, tool_calls, tool_call_id, \
         tool_name, tool_status, model, provider, turn_id, copied_from, status, created_at"
    };
}

macro_rules! turn_columns {
    () => {
        "id, conversation_id, user_id, user_message_id, status, model, iterations, \
         input_tokens, output_tokens, thinking_tokens, cached_tokens, cache_write_tokens, \
         cost_micro_usd, reply_message_id, error_code, error_message, created_at, started_at, \
         finished_at, pending_messages"
    };
}

macro_rules! api_call_columns {
    () => {
        "id, turn_id, conversation_id, user_id, kind, provider, model, input_tokens, \
         output_tokens, thinking_tokens, cached_tokens, cache_write_tokens, latency_ms, ttft_ms, \
         status, error_code, cost_micro_usd, created_at"
    };
}

macro_rules! ledger_columns {
    () => {
        "id, user_id, api_call_id, credits, balance_after, created_at"
    };
}

macro_rules! event_columns {
    () => {
        "conversation_id, seq, turn_id, name, data, created_at"
    };
}

/// What a message insert does when the id exists in the conversation: the
/// node is updated in place (its identity and place in the tree stay).
macro_rules! node_upsert_conflict {
    () => {
        "ON CONFLICT (conversation_id, id) DO UPDATE SET \
         content = excluded.content, parts = excluded.parts, tool_calls = excluded.tool_calls, \
         tool_call_id = excluded.tool_call_id, tool_name = excluded.tool_name, \
         tool_status = excluded.tool_status, model = excluded.model, \
         provider = excluded.provider, status = excluded.status"
    };
}
