//! Real GPUs through NVML (`nvml-wrapper`). The library is loaded and initialised once, when the
//! agent starts; every sample then asks each device for its current values.
//!
//! Any call a device or driver does not support (`NotSupported`, `FunctionNotFound`, ...) leaves
//! that one field absent: a missing metric is never reported as zero. A device that cannot be
//! opened at sampling time (fallen off the bus) yields no sample and is logged once.

use super::NvmlMode;
use crate::error::{CollectorError, Result};
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use perch_model::{GpuIndex, GpuSample};
use std::collections::HashSet;

/// What stays fixed about a device while the agent runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlDeviceInfo {
    pub index: u32,
    pub uuid: String,
    pub model: String,
}

/// An initialised NVML handle and the devices it found.
pub struct NvmlGpus {
    nvml: Nvml,
    devices: Vec<NvmlDeviceInfo>,
    lost: HashSet<u32>,
}

impl std::fmt::Debug for NvmlGpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlGpus")
            .field("devices", &self.devices)
            .finish_non_exhaustive()
    }
}

impl NvmlGpus {
    /// Loads and initialises NVML as `mode` says and lists its devices. `Ok(None)` for
    /// [`NvmlMode::Off`]; an error (not logged here) when the library or driver is missing.
    pub fn open(mode: &NvmlMode) -> Result<Option<Self>> {
        let nvml = match mode {
            NvmlMode::Off => return Ok(None),
            NvmlMode::Auto => Nvml::init(),
            NvmlMode::Path(path) => Nvml::builder().lib_path(path.as_os_str()).init(),
        }
        .map_err(|e| CollectorError::Nvml(e.to_string()))?;
        let count = nvml
            .device_count()
            .map_err(|e| CollectorError::Nvml(format!("cannot count devices: {e}")))?;
        let mut devices = Vec::new();
        for index in 0..count {
            match nvml.device_by_index(index) {
                Ok(d) => devices.push(NvmlDeviceInfo {
                    index,
                    uuid: d
                        .uuid()
                        .unwrap_or_else(|_| format!("GPU-UNKNOWN-UUID-{index}")),
                    model: d
                        .name()
                        .unwrap_or_else(|_| "NVIDIA GPU (model unknown)".to_string()),
                }),
                Err(e) => tracing::warn!(gpu = index, error = %e, "cannot open GPU, skipping it"),
            }
        }
        Ok(Some(Self {
            nvml,
            devices,
            lost: HashSet::new(),
        }))
    }

    /// The devices found at start.
    pub fn devices(&self) -> &[NvmlDeviceInfo] {
        &self.devices
    }

    /// The driver version, when NVML reports one.
    pub fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok()
    }

    /// One sample per reachable device, stamped `now_ms`.
    pub fn sample(&mut self, now_ms: i64) -> Vec<GpuSample> {
        let mut out = Vec::with_capacity(self.devices.len());
        for info in &self.devices {
            let device = match self.nvml.device_by_index(info.index) {
                Ok(d) => {
                    if self.lost.remove(&info.index) {
                        tracing::info!(gpu = info.index, uuid = %info.uuid, "GPU is reachable again");
                    }
                    d
                }
                Err(e) => {
                    if self.lost.insert(info.index) {
                        tracing::warn!(gpu = info.index, uuid = %info.uuid, error = %e, "GPU unreachable, no samples until it returns");
                    }
                    continue;
                }
            };
            let util = device.utilization_rates().ok();
            let memory = device.memory_info().ok();
            out.push(GpuSample {
                time_ms: now_ms,
                gpu: GpuIndex(info.index),
                uuid: info.uuid.clone(),
                model: info.model.clone(),
                simulated: false,
                utilization_gpu_pct: util.as_ref().map(|u| f64::from(u.gpu.min(100))),
                utilization_memory_pct: util.as_ref().map(|u| f64::from(u.memory.min(100))),
                memory_used_bytes: memory.as_ref().map(|m| m.used.min(m.total)),
                memory_total_bytes: memory.as_ref().map(|m| m.total),
                power_watts: device.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
                energy_joules: device
                    .total_energy_consumption()
                    .ok()
                    .map(|mj| mj as f64 / 1000.0),
                temperature_celsius: device
                    .temperature(TemperatureSensor::Gpu)
                    .ok()
                    .map(f64::from),
                sm_clock_mhz: device.clock_info(Clock::SM).ok(),
                memory_clock_mhz: device.clock_info(Clock::Memory).ok(),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_opens_nothing() {
        assert!(
            NvmlGpus::open(&NvmlMode::Off)
                .expect("off never fails")
                .is_none()
        );
    }

    #[test]
    fn a_missing_library_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().expect("temp dir");
        let bogus = dir.path().join("libnvidia-ml-missing.so");
        let err = NvmlGpus::open(&NvmlMode::Path(bogus)).expect_err("no library there");
        assert!(err.to_string().starts_with("NVML:"), "{err}");
    }
}
