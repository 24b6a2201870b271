//! One module per resource, each with its own `router()`.

pub mod conversations;
pub mod meta;
pub mod turns;
