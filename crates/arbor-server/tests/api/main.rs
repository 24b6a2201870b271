//! HTTP API tests: each starts Arbor in-process on a random loopback port
//! with a temporary SQLite database (`arbor_testkit::spawn_app`), and mock
//! providers on loopback where a real provider would be called. One test
//! binary, so the workspace links it once.

mod errors;
mod providers;
mod tree;
mod turns;
