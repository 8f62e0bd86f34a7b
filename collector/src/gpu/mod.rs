//! GPU sources: real NVIDIA GPUs through NVML ([`nvml`]) and simulated GPUs ([`sim`]).
//!
//! Both produce [`perch_model::GpuSample`]s for a given `now_ms`; the agent uses NVML when it
//! can and adds simulated GPUs only when asked to, always labelled `simulated: true`.

pub mod nvlink;
pub mod nvml;
pub mod sim;

use nvml::NvmlGpus;
use std::path::PathBuf;

/// How the agent finds NVML.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum NvmlMode {
    /// Load `libnvidia-ml.so.1` from the system; its absence means "no NVIDIA GPUs here".
    #[default]
    Auto,
    /// Do not touch NVML at all.
    Off,
    /// Load NVML from this path (a specific driver, or a stand-in library in tests).
    Path(PathBuf),
}

/// What `perch up` needs to tell the user about GPUs on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuDetection {
    pub nvml_available: bool,
    pub count: u32,
    pub models: Vec<String>,
    /// One line for the user, e.g. "found 8 NVIDIA GPUs: NVIDIA H100 80GB HBM3 x8" or
    /// "no NVIDIA GPUs found (NVML not available: ...)".
    pub message: String,
}

/// Probes NVML once (without logging) and describes what it found.
pub fn detect_gpus(nvml: &NvmlMode) -> GpuDetection {
    match NvmlGpus::open(nvml) {
        Ok(Some(gpus)) => {
            let models: Vec<String> = gpus
                .devices()
                .iter()
                .map(|d| match d.model.as_str() {
                    "" => "a GPU not answering".to_owned(),
                    model => model.to_owned(),
                })
                .collect();
            let count = models.len() as u32;
            let message = if count == 0 {
                "no NVIDIA GPUs found (NVML loaded, but it reports no devices)".to_string()
            } else {
                let mut distinct: Vec<&String> = Vec::new();
                for m in &models {
                    if !distinct.contains(&m) {
                        distinct.push(m);
                    }
                }
                let kinds: Vec<String> = distinct
                    .iter()
                    .map(|m| format!("{m} x{}", models.iter().filter(|x| x == m).count()))
                    .collect();
                format!(
                    "found {count} NVIDIA GPU{}: {}",
                    if count == 1 { "" } else { "s" },
                    kinds.join(", ")
                )
            };
            GpuDetection {
                nvml_available: true,
                count,
                models,
                message,
            }
        }
        Ok(None) => GpuDetection {
            nvml_available: false,
            count: 0,
            models: vec![],
            message: "no NVIDIA GPUs sampled (NVML is turned off)".to_string(),
        },
        Err(e) => GpuDetection {
            nvml_available: false,
            count: 0,
            models: vec![],
            message: format!("no NVIDIA GPUs found ({e})"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection_without_nvml_says_so() {
        let d = detect_gpus(&NvmlMode::Off);
        assert!(!d.nvml_available && d.count == 0);
        assert!(d.message.contains("turned off"), "{}", d.message);
        let d = detect_gpus(&NvmlMode::Path("/nonexistent/libnvidia-ml.so.1".into()));
        assert!(!d.nvml_available);
        assert!(
            d.message.starts_with("no NVIDIA GPUs found (NVML:"),
            "{}",
            d.message
        );
    }
}
