//! The models the engine can call: the registry plus the provider adapters
//! that are configured, and which model a turn uses.

use std::collections::HashMap;
use std::sync::Arc;

use arbor_providers::{ModelInfo, Provider, Registry};

use crate::error::{EngineError, EngineResult};

/// A model ready to call: its registry entry and the adapter serving it.
#[derive(Clone)]
pub struct ResolvedModel {
    /// The registry's own entry, shared.
    pub info: Arc<ModelInfo>,
    pub provider: Arc<dyn Provider>,
}

pub struct Models {
    registry: Registry,
    providers: HashMap<String, Arc<dyn Provider>>,
    default_model: String,
}

impl Models {
    /// `providers` maps the provider names the registry uses (`openai`,
    /// `demo`, a config's `[providers.NAME]`) to their adapters.
    pub fn new(
        registry: Registry,
        providers: HashMap<String, Arc<dyn Provider>>,
        default_model: String,
    ) -> EngineResult<Models> {
        let models = Models { registry, providers, default_model };
        models.resolve(&models.default_model)?;
        Ok(models)
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    pub fn default_model(&self) -> &str {
        &self.default_model
    }

    /// Whether the model's provider is configured on this server.
    pub fn is_available(&self, info: &ModelInfo) -> bool {
        self.providers.contains_key(&info.provider)
    }

    /// The model and its adapter, or a 400-class error naming the model.
    pub fn resolve(&self, model: &str) -> EngineResult<ResolvedModel> {
        let info = self.registry.shared(model).ok_or_else(|| EngineError::UnknownModel(model.to_string()))?;
        let provider = self.providers.get(&info.provider).cloned().ok_or_else(|| {
            EngineError::ModelUnavailable(format!(
                "model {model:?} is served by provider {:?}, which is not configured on this server: \
                 set its API key (e.g. OPENAI_API_KEY) or add [providers.{}] to the config",
                info.provider, info.provider
            ))
        })?;
        Ok(ResolvedModel { info, provider })
    }
}
