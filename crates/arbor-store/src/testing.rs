//! For tests of the store and of what uses it: throwaway PostgreSQL
//! databases on the server named by `ARBOR_TEST_POSTGRES_URL` (each test
//! gets its own database, created from that URL and dropped afterwards, so
//! runs never collide), and the plainest user and conversation records.

use crate::{Conversation, StoreError, StoreResult, User};

/// A user with no credit limit, not an admin, named after its id.
pub fn user(id: &str) -> User {
    User { id: id.into(), name: id.into(), is_admin: false, balance_credits: None, created_at: 1 }
}

/// A conversation of `owner_id` with nothing set but its model (`demo`).
pub fn conversation(owner_id: &str, id: &str) -> Conversation {
    Conversation {
        id: id.into(),
        owner_id: owner_id.into(),
        title: None,
        system_prompt: None,
        preset_id: None,
        model: "demo".into(),
        head_id: None,
        head_version: 0,
        summary: None,
        created_at: 1,
        updated_at: 1,
    }
}

/// A database made for one test. Call [`TestDatabase::drop_database`] when done.
pub struct TestDatabase {
    /// The URL of the new database.
    pub url: String,
    name: String,
    admin_url: String,
}

impl TestDatabase {
    /// Creates `arbor_test_<random>` on the server of `server_url`.
    pub async fn create(server_url: &str) -> StoreResult<TestDatabase> {
        let name = format!("arbor_test_{}", uuid::Uuid::now_v7().simple());
        // Administer through the `postgres` database, which every server has.
        let admin_url = with_database(server_url, "postgres");
        let admin = sqlx::PgPool::connect(&admin_url).await?;
        // The name is made above from a uuid, not from user input.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&admin).await?;
        admin.close().await;
        Ok(TestDatabase { url: with_database(server_url, &name), name, admin_url })
    }

    pub async fn drop_database(self) -> StoreResult<()> {
        let admin = sqlx::PgPool::connect(&self.admin_url).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)))
            .execute(&admin)
            .await
            .map_err(StoreError::from)?;
        admin.close().await;
        Ok(())
    }
}

/// `server_url` with its database name replaced by `database`.
pub fn with_database(server_url: &str, database: &str) -> String {
    let (base, query) = match server_url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (server_url, None),
    };
    let scheme_end = base.find("://").map_or(0, |index| index + 3);
    let base = match base[scheme_end..].find('/') {
        Some(slash) => &base[..scheme_end + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{base}/{database}?{query}"),
        None => format!("{base}/{database}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_database_name_is_replaced_and_options_kept() {
        assert_eq!(with_database("postgres://u@h:5432/test", "x"), "postgres://u@h:5432/x");
        assert_eq!(
            with_database("postgres://u@h:5432/test?sslmode=disable", "x"),
            "postgres://u@h:5432/x?sslmode=disable"
        );
        assert_eq!(with_database("postgres://u@h:5432", "x"), "postgres://u@h:5432/x");
    }
}
