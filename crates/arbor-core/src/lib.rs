//! Arbor's core vocabulary: the internal message format every provider adapter
//! translates to and from, the conversation tree's nodes, the events a client
//! sees, usage and cost arithmetic, and the error codes shared by every crate.
//!
//! Nothing here does I/O: no HTTP, no SQL, no tokio. Ids and timestamps are
//! *made* by the engine (through [`ids`]), and only carried by these types.
#![forbid(unsafe_code)]

pub mod cost;
pub mod error;
pub mod event;
pub mod ids;
pub mod json;
pub mod message;
pub mod tokens;
pub mod tree;

pub use cost::{Cost, Prices, Usage};
pub use error::{ErrorCode, ProviderError};
pub use event::{Event, EventName};
pub use message::{Message, Node, Part, Role, SharedMessage, ToolCall, ToolStatus};
