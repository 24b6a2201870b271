//! Users and API keys. A key is 32 random bytes shown once as
//! `arb_<64 hex>`; only its SHA-256 is stored, so a leaked database does not
//! leak working keys.

use arbor_core::ids::{new_id, now_millis};
use arbor_store::{ApiKey, Store, StoreError, User};
use sha2::{Digest, Sha256};

use crate::error::{EngineError, EngineResult};

const KEY_PREFIX: &str = "arb_";

/// A fresh random key.
pub fn generate_key() -> String {
    let bytes: [u8; 32] = rand::random();
    format!("{KEY_PREFIX}{}", hex::encode(bytes))
}

/// The stored form of a key: the hex of [`key_digest`].
pub fn hash_key(key: &str) -> String {
    hex::encode(key_digest(key))
}

/// A key's SHA-256, what the engine's cache of recently seen keys is keyed by
/// (no hex string made for a key the cache knows).
pub fn key_digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// A user name: 1–64 characters of letters, digits, `-`, `_` or `.`.
pub fn validate_user_name(name: &str) -> EngineResult<()> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if valid {
        Ok(())
    } else {
        Err(EngineError::InvalidInput(format!(
            "user name {name:?} is not valid: use 1-64 letters, digits, '-', '_' or '.'"
        )))
    }
}

/// Creates a user and a first key for them; returns the user and the key.
pub async fn create_user(store: &dyn Store, name: &str, is_admin: bool) -> EngineResult<(User, String)> {
    validate_user_name(name)?;
    let user = User { id: new_id(), name: name.to_string(), is_admin, balance_credits: None, created_at: now_millis() };
    store.create_user(&user).await.map_err(|error| match error {
        StoreError::Conflict(_) => EngineError::Conflict(format!("a user named {name:?} already exists")),
        other => other.into(),
    })?;
    let key = create_key_for(store, &user).await?;
    Ok((user, key))
}

/// Creates another key for the named user.
pub async fn create_key(store: &dyn Store, user_name: &str) -> EngineResult<String> {
    let user = store.user_by_name(user_name).await?.ok_or(EngineError::NotFound("user"))?;
    create_key_for(store, &user).await
}

async fn create_key_for(store: &dyn Store, user: &User) -> EngineResult<String> {
    let key = generate_key();
    let record = ApiKey {
        id: new_id(),
        user_id: user.id.clone(),
        key_hash: hash_key(&key),
        prefix: key.chars().take(KEY_PREFIX.len() + 6).collect(),
        created_at: now_millis(),
    };
    store.create_api_key(&record).await?;
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_long_random_and_hash_to_hex_sha256() {
        let first = generate_key();
        let second = generate_key();
        assert_ne!(first, second);
        assert_eq!(first.len(), 4 + 64);
        assert!(first.starts_with("arb_"));
        // SHA-256("abc"), the standard test vector.
        assert_eq!(hash_key("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn user_names_are_validated() {
        assert!(validate_user_name("alice-1.b_c").is_ok());
        assert!(validate_user_name("").is_err());
        assert!(validate_user_name("has space").is_err());
        assert!(validate_user_name(&"x".repeat(65)).is_err());
    }
}
