//! `[accounting]`: how often job accounting folds telemetry, and the prices it charges.

use super::{DAY, SECONDS, WEEK, within};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// `[accounting]`: prices, and how often job accounting folds telemetry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AccountingSection {
    /// Seconds between folds of running jobs' telemetry into their accounting.
    pub fold_interval_secs: u64,
    /// Samples are folded once this many seconds old; later arrivals are not counted.
    pub settle_secs: u64,
    /// Price of a GPU-hour of models not in `gpu_prices`.
    pub gpu_price_per_hour: f64,
    /// Price of a kWh of GPU energy, added to allocated and used cost.
    pub energy_price_per_kwh: f64,
    /// Price of a GPU-hour by GPU model (as `gpu_samples.model` names it).
    pub gpu_prices: std::collections::BTreeMap<String, f64>,
}

impl Default for AccountingSection {
    fn default() -> Self {
        AccountingSection {
            fold_interval_secs: 300,
            settle_secs: 120,
            gpu_price_per_hour: 0.95,
            energy_price_per_kwh: 0.0,
            gpu_prices: Default::default(),
        }
    }
}

impl AccountingSection {
    /// Checks the keys of `[accounting]`; the message names the key.
    pub(super) fn check(&self) -> Result<()> {
        let fold = self.fold_interval_secs;
        within("accounting.fold_interval_secs", fold, 1, DAY, SECONDS)?;
        within("accounting.settle_secs", self.settle_secs, 0, WEEK, SECONDS)?;
        let price = |key: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(anyhow::anyhow!(
                    "config key {key}: {v} is not a price; give a number of at least 0"
                ))
            }
        };
        price("accounting.gpu_price_per_hour", self.gpu_price_per_hour)?;
        price("accounting.energy_price_per_kwh", self.energy_price_per_kwh)?;
        for (model, v) in &self.gpu_prices {
            price(&format!("accounting.gpu_prices.{model:?}"), *v)?;
        }
        Ok(())
    }

    /// The server's job accounting as this section sets it.
    pub(super) fn server_config(&self) -> perch_server::accounting::AccountingConfig {
        perch_server::accounting::AccountingConfig {
            fold_interval: Duration::from_secs(self.fold_interval_secs),
            settle: Duration::from_secs(self.settle_secs),
            prices: perch_server::accounting::Prices {
                default_gpu_per_hour: self.gpu_price_per_hour,
                gpu_per_hour: self.gpu_prices.clone(),
                energy_per_kwh: self.energy_price_per_kwh,
            },
        }
    }
}
