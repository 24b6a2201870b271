//! SQLite store (being written).
use crate::*;
pub struct SqliteStore;
impl SqliteStore {
    pub async fn open(_url: &str) -> StoreResult<SqliteStore> {
        Err(StoreError::Database("sqlite store not written yet".into()))
    }
}
