//! The configuration file (DESIGN.md §9): strict TOML (unknown keys are an
//! error), parsed into raw structs, then validated into [`Config`]. Secrets
//! never appear in the file: a provider names the environment variable that
//! holds its key, and keys are redacted from `Debug`.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use arbor_providers::registry::ModelEntry;
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config file {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config: {0}")]
    Invalid(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    /// The model new conversations use when they name none.
    default_model: Option<String>,
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    storage: RawStorage,
    #[serde(default)]
    providers: BTreeMap<String, RawProvider>,
    #[serde(default)]
    models: BTreeMap<String, ModelEntry>,
    #[serde(default)]
    limits: RawLimits,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<String>,
    /// Largest request body accepted, in bytes.
    max_body_bytes: Option<usize>,
    /// How long running turns may finish after a stop signal.
    shutdown_grace_secs: Option<u64>,
    /// With several nodes: how long a running turn's lease lasts; a node
    /// silent for this long has its turns taken over.
    turn_lease_secs: Option<u64>,
    /// Quiet conversations kept in memory at most (their event hub and
    /// cached tree); the rest are read from the store when next used.
    idle_conversations_kept: Option<usize>,
    /// The memory (MiB) quiet conversations (cached trees, recent events)
    /// may hold together.
    idle_conversations_mb: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStorage {
    database_url: Option<String>,
    media_dir: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProvider {
    kind: String,
    base_url: Option<String>,
    api_key_env: Option<String>,
    connect_timeout_secs: Option<u64>,
    read_timeout_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    max_tool_rounds: Option<u32>,
    max_parallel_tools: Option<u32>,
    tool_timeout_secs: Option<u64>,
    turn_timeout_secs: Option<u64>,
    max_message_bytes: Option<usize>,
}

/// An API key read from the environment; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// The wire protocols Arbor speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderKind {
    OpenAi,
    Anthropic,
    Gemini,
    Demo,
}

impl ProviderKind {
    fn parse(text: &str) -> Option<ProviderKind> {
        match text {
            "openai" => Some(ProviderKind::OpenAi),
            "anthropic" => Some(ProviderKind::Anthropic),
            "gemini" => Some(ProviderKind::Gemini),
            "demo" => Some(ProviderKind::Demo),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ProviderConfig {
    pub name: String,
    pub kind: ProviderKind,
    pub base_url: Option<String>,
    pub api_key: Option<Secret>,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub database_url: String,
    pub media_dir: PathBuf,
    pub max_body_bytes: usize,
    pub shutdown_grace: Duration,
    pub turn_lease: Duration,
    pub idle_conversations_kept: usize,
    pub idle_conversations_bytes: usize,
    pub default_model: Option<String>,
    pub providers: Vec<ProviderConfig>,
    pub models: BTreeMap<String, ModelEntry>,
    pub limits: arbor_engine::Limits,
}

/// What the command line (or its environment variables) sets over the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub listen: Option<String>,
    pub data_dir: Option<PathBuf>,
}

/// The built-in providers, enabled when their key variable is set.
const BUILT_IN: [(&str, ProviderKind, &str); 3] = [
    ("openai", ProviderKind::OpenAi, "OPENAI_API_KEY"),
    ("anthropic", ProviderKind::Anthropic, "ANTHROPIC_API_KEY"),
    ("gemini", ProviderKind::Gemini, "GEMINI_API_KEY"),
];

impl Config {
    /// Whether several Arbor processes may share this database.
    pub fn shared_database(&self) -> bool {
        self.database_url.starts_with("postgres:") || self.database_url.starts_with("postgresql:")
    }

    /// Reads `path` (if given) and applies the overrides.
    pub fn load(path: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        let raw = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
                toml::from_str(&text)
                    .map_err(|error| ConfigError::Parse { path: path.to_path_buf(), message: error.to_string() })?
            }
            None => RawConfig::default(),
        };
        Config::validate(raw, overrides, &|name| std::env::var(name).ok())
    }

    /// Parses config text (tests).
    pub fn from_toml(
        text: &str,
        overrides: &Overrides,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text)
            .map_err(|error| ConfigError::Parse { path: PathBuf::from("<text>"), message: error.to_string() })?;
        Config::validate(raw, overrides, env)
    }

    fn validate(
        raw: RawConfig,
        overrides: &Overrides,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let listen_text = overrides.listen.clone().or(raw.server.listen).unwrap_or_else(|| "127.0.0.1:8080".into());
        let listen: SocketAddr = listen_text.parse().map_err(|_| {
            ConfigError::Invalid(format!("listen address {listen_text:?} is not IP:PORT (e.g. 127.0.0.1:8080)"))
        })?;
        let data_dir = overrides.data_dir.clone().unwrap_or_else(|| PathBuf::from("./arbor-data"));
        let database_url =
            raw.storage.database_url.unwrap_or_else(|| format!("sqlite://{}", data_dir.join("arbor.db").display()));
        let media_dir = raw.storage.media_dir.map(PathBuf::from).unwrap_or_else(|| data_dir.join("media"));

        let mut providers = Vec::new();
        for (name, provider) in raw.providers {
            let kind = ProviderKind::parse(&provider.kind).ok_or_else(|| {
                ConfigError::Invalid(format!(
                    "[providers.{name}] kind {:?} is not one of openai, anthropic, gemini, demo",
                    provider.kind
                ))
            })?;
            let api_key = match &provider.api_key_env {
                Some(variable) => env(variable).filter(|key| !key.is_empty()).map(Secret),
                None => None,
            };
            // A hosted provider without its key is left out (its models
            // answer "not configured"); a local server needs no key.
            let needs_key = provider.base_url.is_none() && kind != ProviderKind::Demo;
            if needs_key && api_key.is_none() {
                tracing::warn!(provider = %name, "provider has no API key set; its models are unavailable");
                continue;
            }
            providers.push(ProviderConfig {
                name,
                kind,
                base_url: provider.base_url,
                api_key,
                connect_timeout: Duration::from_secs(provider.connect_timeout_secs.unwrap_or(10)),
                read_timeout: Duration::from_secs(provider.read_timeout_secs.unwrap_or(120)),
            });
        }
        for (name, kind, variable) in BUILT_IN {
            if providers.iter().any(|provider| provider.name == name) {
                continue;
            }
            if let Some(key) = env(variable).filter(|key| !key.is_empty()) {
                providers.push(ProviderConfig {
                    name: name.into(),
                    kind,
                    base_url: None,
                    api_key: Some(Secret(key)),
                    connect_timeout: Duration::from_secs(10),
                    read_timeout: Duration::from_secs(120),
                });
            }
        }

        let defaults = arbor_engine::Limits::default();
        let limits = arbor_engine::Limits {
            max_tool_rounds: raw.limits.max_tool_rounds.unwrap_or(defaults.max_tool_rounds),
            max_parallel_tools: raw.limits.max_parallel_tools.unwrap_or(defaults.max_parallel_tools),
            tool_timeout: raw.limits.tool_timeout_secs.map(Duration::from_secs).unwrap_or(defaults.tool_timeout),
            turn_timeout: raw.limits.turn_timeout_secs.map(Duration::from_secs).unwrap_or(defaults.turn_timeout),
            max_message_bytes: raw.limits.max_message_bytes.unwrap_or(defaults.max_message_bytes),
        };
        if limits.turn_timeout.is_zero() {
            return Err(ConfigError::Invalid("limits.turn_timeout_secs must be at least 1".into()));
        }
        Ok(Config {
            listen,
            data_dir,
            database_url,
            media_dir,
            max_body_bytes: raw.server.max_body_bytes.unwrap_or(1024 * 1024),
            shutdown_grace: Duration::from_secs(raw.server.shutdown_grace_secs.unwrap_or(10)),
            turn_lease: Duration::from_secs(raw.server.turn_lease_secs.unwrap_or(15).max(1)),
            idle_conversations_kept: raw
                .server
                .idle_conversations_kept
                .unwrap_or(arbor_engine::IDLE_CONVERSATIONS_KEPT),
            idle_conversations_bytes: raw
                .server
                .idle_conversations_mb
                .map_or(arbor_engine::IDLE_CONVERSATIONS_BYTES, |mb| mb.saturating_mul(1 << 20)),
            default_model: raw.default_model,
            providers,
            models: raw.models,
            limits,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn defaults_are_the_embedded_setup() {
        let config = Config::from_toml("", &Overrides::default(), &no_env).expect("empty config is valid");
        assert_eq!(config.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(config.database_url, "sqlite://./arbor-data/arbor.db");
        assert!(config.providers.is_empty());
        assert_eq!(config.idle_conversations_bytes, 32 << 20);
    }

    #[test]
    fn quiet_conversations_memory_is_set_in_mib() {
        let toml = "[server]\nidle_conversations_mb = 8\n";
        let config = Config::from_toml(toml, &Overrides::default(), &no_env).expect("valid");
        assert_eq!(config.idle_conversations_bytes, 8 << 20);
    }

    #[test]
    fn unknown_keys_are_refused_with_their_name() {
        let error =
            Config::from_toml("[server]\nlisten = \"127.0.0.1:1\"\nlisen = 2\n", &Overrides::default(), &no_env)
                .expect_err("typo");
        assert!(error.to_string().contains("lisen"), "{error}");
    }

    #[test]
    fn provider_keys_come_from_the_environment_and_are_redacted() {
        let env = |name: &str| (name == "MY_KEY").then(|| "sk-secret".to_string());
        let config = Config::from_toml(
            "[providers.openai]\nkind = \"openai\"\napi_key_env = \"MY_KEY\"\n[providers.local]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:11434/v1\"\n",
            &Overrides { listen: Some("127.0.0.1:9999".into()), data_dir: Some("/tmp/x".into()) },
            &env,
        )
        .expect("valid");
        assert_eq!(config.listen.port(), 9999);
        assert_eq!(config.database_url, "sqlite:///tmp/x/arbor.db");
        assert_eq!(config.providers.len(), 2);
        let debug = format!("{config:?}");
        assert!(!debug.contains("sk-secret"), "secrets never show in Debug");
    }
}
