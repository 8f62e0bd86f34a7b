//! The scenario a stand-in NVML plays: GPUs, their values over time, events at given times, and
//! GPUs that fall off the bus. Pure data and lookups; no unsafe code and no C types here.
//!
//! A scenario is JSON; `collector/tests/fixtures/nvml/*.json` are examples. Time is the scenario's clock: with
//! `"clock": "rounds"` (the default) it is the number of times the caller has asked for GPU 0's
//! handle since `nvmlInit` minus one, so an agent that opens NVML (time 0) and then samples
//! every round sees time 1, 2, 3, ... whatever its interval; with `"clock": "seconds"` it is
//! wall-clock seconds since `nvmlInit` (benchmarks and end-to-end runs).
//!
//! A metric that no keyframe up to now has set is unsupported: the library answers
//! `NVML_ERROR_NOT_SUPPORTED`, as a real GPU without that feature does.
//!
//! Besides the values of the calls the agent makes one by one, a keyframe's `fields` sets NVML
//! field values by field id (`"fields": {"95": 3}`), which `nvmlDeviceGetFieldValues` answers:
//! a catalogue line that names an NVML field is read that way, so it needs no code here. Tests
//! build such scenarios from the catalogue.

use serde::Deserialize;
use std::collections::BTreeMap;

/// How the scenario's clock advances.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Clock {
    #[default]
    Rounds,
    Seconds,
}

/// A whole scenario file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    #[serde(default)]
    pub clock: Clock,
    #[serde(default = "default_driver")]
    pub driver_version: String,
    /// The CUDA version the driver supports, as NVML encodes it (`12060` is 12.6).
    #[serde(default = "default_cuda")]
    pub cuda_version: i32,
    pub gpus: Vec<GpuScript>,
}

fn default_driver() -> String {
    "560.35.03-standin".to_string()
}

fn default_cuda() -> i32 {
    12060
}

/// One GPU: fixed identity, values over time, events, and when (if ever) it is lost.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuScript {
    pub uuid: String,
    pub name: String,
    #[serde(default)]
    pub timeline: Vec<Keyframe>,
    #[serde(default)]
    pub events: Vec<EventScript>,
    /// From this time on every call about this GPU answers `NVML_ERROR_GPU_IS_LOST`.
    #[serde(default)]
    pub lost_at: Option<f64>,
    /// A wedged driver: the first request for this GPU's handle at or after `at` blocks for
    /// `secs` seconds before it answers.
    #[serde(default)]
    pub hang: Option<Hang>,
}

/// See [`GpuScript::hang`].
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hang {
    pub at: f64,
    pub secs: f64,
}

/// Values that take effect at `at` and hold until a later keyframe overrides them.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Keyframe {
    pub at: f64,
    #[serde(default)]
    pub set: Values,
}

/// One process on a GPU.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Process {
    pub pid: u32,
    #[serde(default)]
    pub used_memory_bytes: Option<u64>,
    /// Share of the last period this process ran kernels; absent = not in the utilization
    /// samples.
    #[serde(default)]
    pub sm_util: Option<u32>,
    #[serde(default)]
    pub mem_util: Option<u32>,
}

/// Every value a GPU can report, each absent (unsupported) until a keyframe sets it. Units are
/// NVML's: milliwatts, millijoules, KB/s for PCIe, bytes for NVLink counters.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Values {
    pub util_gpu: Option<u32>,
    pub util_memory: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub power_mw: Option<u32>,
    pub energy_mj: Option<u64>,
    pub temperature_c: Option<u32>,
    pub sm_clock_mhz: Option<u32>,
    pub memory_clock_mhz: Option<u32>,
    pub throttle_reasons: Option<u64>,
    pub ecc_corrected_volatile: Option<u64>,
    pub ecc_uncorrected_volatile: Option<u64>,
    pub ecc_corrected_aggregate: Option<u64>,
    pub ecc_uncorrected_aggregate: Option<u64>,
    pub retired_pages_single_bit: Option<u32>,
    pub retired_pages_double_bit: Option<u32>,
    pub retired_pages_pending: Option<bool>,
    pub pcie_tx_kbps: Option<u32>,
    pub pcie_rx_kbps: Option<u32>,
    pub pcie_replay_counter: Option<u32>,
    /// One entry per NVLink: whether it is active.
    pub nvlink_up: Option<Vec<bool>>,
    /// Per link: CRC data errors (other error counters read 0).
    pub nvlink_errors: Option<Vec<u64>>,
    /// Per link: cumulative bytes received / sent (utilization counter 0).
    pub nvlink_rx_bytes: Option<Vec<u64>>,
    pub nvlink_tx_bytes: Option<Vec<u64>>,
    pub processes: Option<Vec<Process>>,
    pub mig_mode: Option<bool>,
    pub mig_instances: Option<u32>,
    /// The profiles of its MIG instances in order (`["3g.40gb", "4g.40gb"]`), when in MIG
    /// mode: each answers as a MIG device named `<gpu name> MIG <profile>`, with a UUID
    /// `MIG-<n>` from the GPU's UUID and the profile's memory. Sets the instance count too.
    pub mig_profiles: Option<Vec<String>>,
    /// NVML field values by field id (`NVML_FI_DEV_*`, numbered as before driver 580.82);
    /// a later keyframe overrides only the fields it sets.
    pub fields: Option<BTreeMap<u32, FieldValue>>,
}

/// An NVML field's value, typed as NVML types it: an integer as an unsigned or signed 64-bit
/// value, anything else as a double.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum FieldValue {
    Unsigned(u64),
    Signed(i64),
    Double(f64),
}

impl Values {
    /// `self` with every value `later` sets replaced.
    fn overlay(&mut self, later: &Values) {
        macro_rules! take {
            ($($f:ident),*) => { $( if later.$f.is_some() { self.$f = later.$f.clone(); } )* };
        }
        take!(
            util_gpu,
            util_memory,
            memory_used_bytes,
            memory_total_bytes,
            power_mw,
            energy_mj,
            temperature_c,
            sm_clock_mhz,
            memory_clock_mhz,
            throttle_reasons,
            ecc_corrected_volatile,
            ecc_uncorrected_volatile,
            ecc_corrected_aggregate,
            ecc_uncorrected_aggregate,
            retired_pages_single_bit,
            retired_pages_double_bit,
            retired_pages_pending,
            pcie_tx_kbps,
            pcie_rx_kbps,
            pcie_replay_counter,
            nvlink_up,
            nvlink_errors,
            nvlink_rx_bytes,
            nvlink_tx_bytes,
            processes,
            mig_mode,
            mig_instances,
            mig_profiles
        );
        if let Some(later) = &later.fields {
            self.fields
                .get_or_insert_with(BTreeMap::new)
                .extend(later.iter().map(|(id, v)| (*id, *v)));
        }
    }
}

/// Kind of an NVML event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    Xid,
    EccSingleBit,
    EccDoubleBit,
}

impl EventKind {
    /// The `nvmlEventType*` bit.
    pub fn mask(self) -> u64 {
        match self {
            EventKind::EccSingleBit => 1,
            EventKind::EccDoubleBit => 2,
            EventKind::Xid => 8,
        }
    }
}

/// An event delivered through event sets once the scenario's clock reaches `at`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventScript {
    pub at: f64,
    pub kind: EventKind,
    /// The XID code (`kind: "xid"`).
    #[serde(default)]
    pub xid: Option<u64>,
}

impl GpuScript {
    /// The values in force at `now`.
    pub fn values_at(&self, now: f64) -> Values {
        let mut v = Values::default();
        for k in self.timeline.iter().filter(|k| k.at <= now) {
            v.overlay(&k.set);
        }
        v
    }

    pub fn lost(&self, now: f64) -> bool {
        self.lost_at.is_some_and(|t| t <= now)
    }
}

impl Scenario {
    pub fn parse(text: &str) -> Result<Scenario, String> {
        serde_json::from_str(text).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_keyframes_override_only_what_they_set() {
        let s = Scenario::parse(
            r#"{"gpus":[{"uuid":"GPU-1","name":"X","lost_at":3,
                "timeline":[{"at":0,"set":{"util_gpu":10,"power_mw":100000}},
                            {"at":2,"set":{"util_gpu":90}}]}]}"#,
        )
        .expect("valid scenario");
        let g = &s.gpus[0];
        let check = |now: f64, util: Option<u32>, power: Option<u32>, lost: bool| {
            let v = g.values_at(now);
            assert_eq!(
                (v.util_gpu, v.power_mw, g.lost(now)),
                (util, power, lost),
                "t={now}"
            );
            assert_eq!(
                v.ecc_corrected_volatile, None,
                "never set means unsupported"
            );
        };
        check(-1.0, None, None, false);
        check(0.0, Some(10), Some(100_000), false);
        check(2.0, Some(90), Some(100_000), false);
        check(3.0, Some(90), Some(100_000), true);
        assert_eq!(s.clock, Clock::Rounds);
    }

    #[test]
    fn field_values_are_typed_and_overridden_one_by_one() {
        let s = Scenario::parse(
            r#"{"gpus":[{"uuid":"GPU-1","name":"X",
                "timeline":[{"at":0,"set":{"fields":{"95":7,"96":-2,"97":1.5}}},
                            {"at":1,"set":{"fields":{"95":18446744073709551615}}}]}]}"#,
        )
        .expect("valid scenario");
        let fields = |now: f64| s.gpus[0].values_at(now).fields.unwrap_or_default();
        assert_eq!(
            fields(0.0),
            BTreeMap::from([
                (95, FieldValue::Unsigned(7)),
                (96, FieldValue::Signed(-2)),
                (97, FieldValue::Double(1.5))
            ])
        );
        assert_eq!(fields(1.0)[&95], FieldValue::Unsigned(u64::MAX));
        assert_eq!(fields(1.0)[&97], FieldValue::Double(1.5));
        assert!(fields(-1.0).is_empty());
    }

    #[test]
    fn typos_are_refused_with_the_field_name() {
        let err = Scenario::parse(r#"{"gpus":[{"uuid":"a","name":"b","timelin":[]}]}"#)
            .expect_err("unknown field");
        assert!(err.contains("timelin"), "{err}");
    }
}
