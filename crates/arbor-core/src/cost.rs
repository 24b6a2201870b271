//! Usage and money. Money is integers only: prices are micro-dollars per
//! million tokens, a call's cost is whole micro-dollars (rounded up, so Arbor
//! never under-charges), and one credit is one micro-dollar. Cents are derived
//! for display only.

use serde::{Deserialize, Serialize};

/// Tokens one model call used, as the provider reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// All input tokens, including `cached_tokens` and `cache_write_tokens`.
    pub input_tokens: u64,
    /// All output tokens, including `thinking_tokens`.
    pub output_tokens: u64,
    #[serde(default)]
    pub thinking_tokens: u64,
    /// Input tokens served from the provider's prompt cache.
    #[serde(default)]
    pub cached_tokens: u64,
    /// Input tokens written to the provider's prompt cache.
    #[serde(default)]
    pub cache_write_tokens: u64,
}

impl Usage {
    pub fn add(&mut self, other: &Usage) {
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.thinking_tokens += other.thinking_tokens;
        self.cached_tokens += other.cached_tokens;
        self.cache_write_tokens += other.cache_write_tokens;
    }
}

/// Prices in micro-dollars (1e-6 USD) per million tokens. `None` for cached,
/// cache-write or thinking tokens means "same as the plain rate".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    pub input: u64,
    pub output: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<u64>,
}

/// What one call cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cost {
    pub micro_usd: u64,
}

impl Cost {
    /// The quota unit: one credit is one micro-dollar.
    pub fn credits(self) -> i64 {
        i64::try_from(self.micro_usd).unwrap_or(i64::MAX)
    }

    /// Cents of a dollar, for display (`cost_cents_usd` in `done`).
    pub fn cents_usd(self) -> f64 {
        self.micro_usd as f64 / 10_000.0
    }
}

impl std::ops::Add for Cost {
    type Output = Cost;

    fn add(self, other: Cost) -> Cost {
        Cost { micro_usd: self.micro_usd.saturating_add(other.micro_usd) }
    }
}

impl Prices {
    /// The cost of `usage` at these prices. Each token class is charged at
    /// its own rate: cached and cache-write input are taken out of the plain
    /// input count, thinking out of the plain output count.
    pub fn cost(&self, usage: &Usage) -> Cost {
        let cached = usage.cached_tokens.min(usage.input_tokens);
        let cache_write = usage.cache_write_tokens.min(usage.input_tokens - cached);
        let plain_input = usage.input_tokens - cached - cache_write;
        let thinking = usage.thinking_tokens.min(usage.output_tokens);
        let plain_output = usage.output_tokens - thinking;

        let per_million: u128 = u128::from(plain_input) * u128::from(self.input)
            + u128::from(cached) * u128::from(self.cached_input.unwrap_or(self.input))
            + u128::from(cache_write) * u128::from(self.cache_write.unwrap_or(self.input))
            + u128::from(plain_output) * u128::from(self.output)
            + u128::from(thinking) * u128::from(self.thinking.unwrap_or(self.output));
        let micro_usd = per_million.div_ceil(1_000_000);
        Cost { micro_usd: u64::try_from(micro_usd).unwrap_or(u64::MAX) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt_4o() -> Prices {
        // $2.50 / $10.00 per million, cached input $1.25.
        Prices {
            input: 2_500_000,
            output: 10_000_000,
            cached_input: Some(1_250_000),
            cache_write: None,
            thinking: None,
        }
    }

    #[test]
    fn cost_of_the_seed_example() {
        // done {input 1200, output 350, cached 800} at gpt-4o prices:
        // 400 × 2.5 + 800 × 1.25 + 350 × 10 = 1000 + 1000 + 3500 = 5500 µ$.
        let usage = Usage { input_tokens: 1200, output_tokens: 350, cached_tokens: 800, ..Usage::default() };
        let cost = gpt_4o().cost(&usage);
        assert_eq!(cost.micro_usd, 5500);
        assert_eq!(cost.credits(), 5500);
        assert!((cost.cents_usd() - 0.55).abs() < 1e-9);
    }

    #[test]
    fn fractions_of_a_micro_dollar_round_up() {
        let one_token = Usage { input_tokens: 1, ..Usage::default() };
        assert_eq!(gpt_4o().cost(&one_token).micro_usd, 3, "2.5 µ$ rounds up to 3");
        assert_eq!(gpt_4o().cost(&Usage::default()).micro_usd, 0);
    }

    #[test]
    fn thinking_and_cache_writes_have_their_own_rates() {
        let prices = Prices {
            input: 3_000_000,
            output: 15_000_000,
            cached_input: Some(300_000),
            cache_write: Some(3_750_000),
            thinking: Some(20_000_000),
        };
        let usage = Usage {
            input_tokens: 1000,
            output_tokens: 500,
            thinking_tokens: 200,
            cached_tokens: 400,
            cache_write_tokens: 100,
        };
        // 500×3 + 400×0.3 + 100×3.75 + 300×15 + 200×20 = 1500+120+375+4500+4000
        assert_eq!(prices.cost(&usage).micro_usd, 10_495);
    }

    #[test]
    fn inconsistent_usage_never_underflows() {
        let usage = Usage {
            input_tokens: 10,
            output_tokens: 1,
            thinking_tokens: 50,
            cached_tokens: 99,
            cache_write_tokens: 99,
        };
        // Clamped to 10 cached input and 1 thinking output: 12.5 + 10 = 22.5 → 23.
        assert_eq!(gpt_4o().cost(&usage).micro_usd, 23);
    }

    #[test]
    fn huge_usage_saturates_instead_of_wrapping() {
        let usage = Usage { input_tokens: u64::MAX, output_tokens: u64::MAX, ..Usage::default() };
        assert!(gpt_4o().cost(&usage).micro_usd > 0);
    }
}
