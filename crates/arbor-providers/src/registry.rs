//! The model registry: which models exist, which provider serves each, what
//! they can do and what they cost. A TOML file shipped inside the binary
//! (`models.toml`), which the config can extend and override per field.

use std::collections::BTreeMap;
use std::sync::Arc;

use arbor_core::Prices;
use serde::{Deserialize, Serialize};

const SHIPPED: &str = include_str!("../models.toml");

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capabilities {
    pub vision: bool,
    pub tools: bool,
    pub thinking: bool,
    pub streaming: bool,
}

/// One model as clients and the engine see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Arbor's name for the model (what clients send as `model`).
    pub id: String,
    /// The configured provider that serves it (a `[providers.NAME]`).
    pub provider: String,
    /// The provider's own name for it, when different from `id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    pub context_window: u64,
    pub max_output: u64,
    pub capabilities: Capabilities,
    /// Micro-dollars per million tokens.
    pub prices: Prices,
}

impl ModelInfo {
    /// The name to send to the provider.
    pub fn upstream_name(&self) -> &str {
        self.upstream.as_deref().unwrap_or(&self.id)
    }
}

/// A partial model entry, as written in `models.toml` or the config: every
/// field may be left out when overriding a known model.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    pub provider: Option<String>,
    pub upstream: Option<String>,
    pub context_window: Option<u64>,
    pub max_output: Option<u64>,
    pub vision: Option<bool>,
    pub tools: Option<bool>,
    pub thinking: Option<bool>,
    pub streaming: Option<bool>,
    pub prices: Option<Prices>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegistryError {
    #[error("the model registry is not valid TOML: {0}")]
    Parse(String),
    #[error("model {model} needs a provider: add `provider = \"...\"` to [models.\"{model}\"]")]
    MissingProvider { model: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegistryFile {
    models: BTreeMap<String, ModelEntry>,
}

/// All known models, by id.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Registry {
    /// Shared: each turn takes the model it runs on (see [`Registry::shared`]).
    models: BTreeMap<String, Arc<ModelInfo>>,
}

impl Registry {
    /// The registry shipped with the binary.
    pub fn shipped() -> Registry {
        let mut registry = Registry::default();
        registry.apply_toml(SHIPPED).expect("the shipped models.toml is valid; a unit test checks it");
        registry
    }

    /// Applies a `[models."id"]` TOML document on top of this registry.
    pub fn apply_toml(&mut self, text: &str) -> Result<(), RegistryError> {
        let file: RegistryFile = toml::from_str(text).map_err(|error| RegistryError::Parse(error.to_string()))?;
        self.apply(file.models)
    }

    /// Adds new models and overrides fields of known ones.
    pub fn apply(&mut self, entries: BTreeMap<String, ModelEntry>) -> Result<(), RegistryError> {
        for (id, entry) in entries {
            let model = match self.models.remove(&id) {
                Some(known) => merge(Arc::unwrap_or_clone(known), entry),
                None => {
                    let provider =
                        entry.provider.clone().ok_or(RegistryError::MissingProvider { model: id.clone() })?;
                    let base = ModelInfo {
                        id: id.clone(),
                        provider,
                        upstream: None,
                        context_window: 8192,
                        max_output: 4096,
                        capabilities: Capabilities { streaming: true, ..Capabilities::default() },
                        prices: Prices::default(),
                    };
                    merge(base, entry)
                }
            };
            self.models.insert(id, Arc::new(model));
        }
        Ok(())
    }

    pub fn get(&self, id: &str) -> Option<&ModelInfo> {
        self.models.get(id).map(|model| &**model)
    }

    /// The model, shared rather than copied (a turn holds it while it runs).
    pub fn shared(&self, id: &str) -> Option<Arc<ModelInfo>> {
        self.models.get(id).cloned()
    }

    pub fn iter(&self) -> impl Iterator<Item = &ModelInfo> {
        self.models.values().map(|model| &**model)
    }
}

fn merge(mut model: ModelInfo, entry: ModelEntry) -> ModelInfo {
    if let Some(provider) = entry.provider {
        model.provider = provider;
    }
    if entry.upstream.is_some() {
        model.upstream = entry.upstream;
    }
    if let Some(window) = entry.context_window {
        model.context_window = window;
    }
    if let Some(max_output) = entry.max_output {
        model.max_output = max_output;
    }
    let capabilities = &mut model.capabilities;
    capabilities.vision = entry.vision.unwrap_or(capabilities.vision);
    capabilities.tools = entry.tools.unwrap_or(capabilities.tools);
    capabilities.thinking = entry.thinking.unwrap_or(capabilities.thinking);
    capabilities.streaming = entry.streaming.unwrap_or(capabilities.streaming);
    if let Some(prices) = entry.prices {
        model.prices = prices;
    }
    model
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_registry_has_demo_and_openai_models_with_prices() {
        let registry = Registry::shipped();
        let demo = registry.get("demo").expect("demo is shipped");
        assert_eq!(demo.provider, "demo");
        let gpt = registry.get("gpt-4o").expect("gpt-4o is shipped");
        assert_eq!(gpt.provider, "openai");
        assert_eq!(gpt.context_window, 128_000);
        assert!(gpt.capabilities.vision && gpt.capabilities.tools);
        assert_eq!(gpt.prices.input, 2_500_000);
        assert_eq!(gpt.prices.cached_input, Some(1_250_000));
    }

    #[test]
    fn config_overrides_fields_and_adds_models() {
        let mut registry = Registry::shipped();
        registry
            .apply_toml(
                r#"
                [models."gpt-4o"]
                context_window = 64000
                [models."llama3.2"]
                provider = "local"
                context_window = 128000
                "#,
            )
            .expect("valid override");
        let gpt = registry.get("gpt-4o").expect("still there");
        assert_eq!(gpt.context_window, 64_000);
        assert_eq!(gpt.prices.input, 2_500_000, "untouched fields stay");
        let llama = registry.get("llama3.2").expect("added");
        assert_eq!(llama.provider, "local");
        assert_eq!(llama.prices, Prices::default(), "a local model is free unless priced");
    }

    #[test]
    fn a_new_model_without_provider_is_refused() {
        let mut registry = Registry::shipped();
        let error = registry.apply_toml("[models.mystery]\ncontext_window = 1\n").expect_err("no provider");
        assert_eq!(error, RegistryError::MissingProvider { model: "mystery".into() });
        let error = registry.apply_toml("[models.x]\nprovider = \"a\"\ncolour = 1\n").expect_err("unknown key");
        assert!(matches!(error, RegistryError::Parse(text) if text.contains("colour")));
    }
}
