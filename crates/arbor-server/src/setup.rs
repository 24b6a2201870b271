//! Building a running Arbor from its [`Config`]: open the store (applying
//! migrations), build the provider adapters, the model registry and the
//! engine, and create the first admin on an empty database.

use std::collections::HashMap;
use std::sync::Arc;

use arbor_engine::{Engine, EngineConfig, Models};
use arbor_providers::anthropic::{AnthropicConfig, AnthropicProvider};
use arbor_providers::demo::DemoProvider;
use arbor_providers::gemini::{GeminiConfig, GeminiProvider};
use arbor_providers::http::HttpTimeouts;
use arbor_providers::openai::{OpenAiConfig, OpenAiProvider};
use arbor_providers::{Provider, Registry};
use tokio_util::sync::CancellationToken;

use crate::AppState;
use crate::config::{Config, ProviderConfig, ProviderKind};

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("cannot create the data directory {path}: {source}")]
    DataDir { path: String, source: std::io::Error },
    #[error("cannot open the database: {0}")]
    Store(#[from] arbor_store::StoreError),
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Engine(#[from] arbor_engine::EngineError),
}

/// A first admin created on an empty database; its key is shown once.
pub struct FirstAdmin {
    pub name: String,
    pub key: String,
}

pub struct App {
    pub state: AppState,
    pub config: Config,
    pub first_admin: Option<FirstAdmin>,
}

/// Opens everything `config` names. With `create_admin`, an empty database
/// gets an `admin` user whose key is returned in [`App::first_admin`].
pub async fn build(config: Config, create_admin: bool) -> Result<App, SetupError> {
    let engine = build_engine(&config).await?;
    let first_admin = if create_admin && engine.store().count_users().await? == 0 {
        let (user, key) = engine.create_user("admin", true).await?;
        Some(FirstAdmin { name: user.name, key })
    } else {
        None
    };
    let state = AppState { engine, streams_end: CancellationToken::new() };
    Ok(App { state, config, first_admin })
}

/// The store and engine alone (the CLI's user and key commands).
pub async fn build_engine(config: &Config) -> Result<Engine, SetupError> {
    for dir in [&config.data_dir, &config.media_dir] {
        std::fs::create_dir_all(dir)
            .map_err(|source| SetupError::DataDir { path: dir.display().to_string(), source })?;
    }
    let store = arbor_store::open(&config.database_url).await?;
    let models = build_models(config)?;
    let engine_config = EngineConfig {
        limits: config.limits.clone(),
        shared: config.shared_database(),
        turn_lease: config.turn_lease,
        idle_conversations_kept: config.idle_conversations_kept,
        idle_conversations_bytes: config.idle_conversations_bytes,
        ..EngineConfig::default()
    };
    Ok(Engine::start(store, models, engine_config).await?)
}

/// The registry (shipped + config) and one adapter per configured provider.
pub fn build_models(config: &Config) -> Result<Models, SetupError> {
    let mut registry = Registry::shipped();
    registry.apply(config.models.clone()).map_err(|error| SetupError::Config(error.to_string()))?;
    let mut providers: HashMap<String, Arc<dyn Provider>> = HashMap::new();
    providers.insert("demo".into(), Arc::new(DemoProvider::default()));
    for provider in &config.providers {
        providers.insert(provider.name.clone(), build_provider(provider)?);
    }
    let default_model = match &config.default_model {
        Some(model) => model.clone(),
        None => preferred_default(&registry, &providers),
    };
    Models::new(registry, providers, default_model)
        .map_err(|error| SetupError::Config(format!("default_model: {error}")))
}

/// With no default configured: a real provider's everyday model when one is
/// configured, else the offline demo.
fn preferred_default(registry: &Registry, providers: &HashMap<String, Arc<dyn Provider>>) -> String {
    ["gpt-4o-mini", "claude-sonnet-4-5", "gemini-2.5-flash"]
        .into_iter()
        .find(|model| registry.get(model).is_some_and(|info| providers.contains_key(&info.provider)))
        .unwrap_or("demo")
        .to_string()
}

fn build_provider(config: &ProviderConfig) -> Result<Arc<dyn Provider>, SetupError> {
    let timeouts = HttpTimeouts { connect: config.connect_timeout, read_idle: config.read_timeout };
    let api_key = config.api_key.as_ref().map(|secret| secret.0.clone());
    let provider: Arc<dyn Provider> = match config.kind {
        ProviderKind::Demo => Arc::new(DemoProvider::default()),
        ProviderKind::OpenAi => {
            let defaults = OpenAiConfig::default();
            let base_url = config.base_url.clone().unwrap_or(defaults.base_url.clone());
            Arc::new(
                OpenAiProvider::new(OpenAiConfig { base_url, api_key, timeouts, ..defaults })
                    .map_err(adapter_error(config))?,
            )
        }
        ProviderKind::Anthropic => {
            let defaults = AnthropicConfig::default();
            let base_url = config.base_url.clone().unwrap_or(defaults.base_url.clone());
            Arc::new(
                AnthropicProvider::new(AnthropicConfig { base_url, api_key, timeouts, ..defaults })
                    .map_err(adapter_error(config))?,
            )
        }
        ProviderKind::Gemini => {
            let defaults = GeminiConfig::default();
            let base_url = config.base_url.clone().unwrap_or(defaults.base_url.clone());
            Arc::new(GeminiProvider::new(GeminiConfig { base_url, api_key, timeouts }).map_err(adapter_error(config))?)
        }
    };
    Ok(provider)
}

fn adapter_error(config: &ProviderConfig) -> impl Fn(arbor_core::ProviderError) -> SetupError + '_ {
    move |error| SetupError::Config(format!("[providers.{}]: {}", config.name, error.message))
}
