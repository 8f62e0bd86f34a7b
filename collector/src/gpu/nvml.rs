//! Real GPUs through NVML (`nvml-wrapper`). The library is loaded and initialised once, when the
//! agent starts, and stays loaded for the life of the process (the XID/ECC event set borrows
//! it); every sample then asks each device for its current values ([`extended`] reads the
//! health and interconnect counters and the processes) and drains the event set.
//!
//! A few reads cost far more than the rest, and are made every
//! [`NvmlGpus::set_slow_interval`] (30 s by default, dcgm-exporter's collection interval)
//! instead of every sample. Measured on an H200 (driver 580.159.04), per GPU and call: the
//! total-energy counter 4.2-4.8 ms of CPU, per-process utilization 1.8-2.5 ms, PCIe throughput
//! 0.6-0.8 ms of CPU and 20 ms of waiting each way, the PCIe replay counter and the MIG mode
//! 0.15 ms each, against about 0.2 ms for all the others together. Read every second they cost
//! 0.9% of a core per GPU. Which columns are slow is their catalogue line's
//! ([`Cadence::Slow`]); between reads they repeat their last reading, per-process utilization is
//! absent, and the energy counter ([`EnergyCounter`]) advances by the measured power instead,
//! so a job's energy stays exact to the sample at its start and end.
//!
//! A column whose catalogue line names an NVML field
//! ([`perch_model::catalogue::Column::nvml_field`]) needs no code here: [`fields`] reads all of
//! them in one call per cadence.
//!
//! Any call a device or driver does not support (`NotSupported`, `FunctionNotFound`, ...) leaves
//! that one field absent: a missing metric is never reported as zero. A device that cannot be
//! opened at sampling time (fallen off the bus) yields no sample, one `gpu_lost` event and one
//! log line, and a `gpu_recovered` event if it comes back; the other GPUs carry on. One that
//! cannot be opened at start is kept in its place (every GPU keeps its NVML index, the one
//! `CUDA_VISIBLE_DEVICES` names) and reported the same way from the first sample.

mod extended;
pub mod fields;

use super::NvmlMode;
use crate::error::{CollectorError, Result};
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;
use perch_model::catalogue::{self, Cadence};
use perch_model::{GpuEvent, GpuEventKind, GpuIndex, GpuProcessSample, GpuSample};
use std::collections::HashSet;

/// What stays fixed about a device while the agent runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlDeviceInfo {
    pub index: u32,
    pub uuid: String,
    /// Empty while the device has not answered (it could not be opened at start).
    pub model: String,
}

/// What one NVML round produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NvmlRound {
    pub gpus: Vec<GpuSample>,
    pub events: Vec<GpuEvent>,
    pub processes: Vec<GpuProcessSample>,
}

/// The slow reads' default period (see the module's documentation).
pub const DEFAULT_SLOW_INTERVAL_MS: i64 = 30_000;

/// Per-device state kept between rounds.
#[derive(Debug, Clone, Default)]
struct DeviceState {
    xid_total: u64,
    ecc_events_total: u64,
    /// NVML's timestamp of the last process utilization sample read (µs).
    last_process_sample: Option<u64>,
    /// When the slow columns were last read.
    slow_read_ms: Option<i64>,
    energy: EnergyCounter,
    /// The sample of the last slow read; the samples until the next one repeat its slow columns.
    slow: GpuSample,
}

/// Repeats the slow columns' last reading in `sample`: the columns the catalogue marks slow,
/// whatever reads them (see the module's documentation). A column read slowly without its
/// line saying so is absent between reads, which the stand-in tests show.
fn repeat_slow(last: &GpuSample, sample: &mut GpuSample) {
    for column in catalogue::GPU.iter().filter(|c| c.cadence == Cadence::Slow) {
        column.copy(last, sample);
    }
}

/// The GPU's total-energy counter as the agent reports it: the driver's counter where it was
/// read, advanced between reads by the power each sample measured (a 1 s average on Ampere and
/// later). It never goes backwards, except when the driver's own counter does (a driver
/// reload), which a consumer sees as a counter reset.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EnergyCounter {
    /// The driver's counter at the last read, joules.
    read: Option<f64>,
    /// Energy estimated from power since that read, joules.
    since_read: f64,
    /// The last value reported.
    reported: Option<f64>,
    last_ms: Option<i64>,
}

impl EnergyCounter {
    /// The counter read from the driver at `now_ms` (`None`: the read failed, and the counter
    /// is unknown until the next one succeeds).
    pub fn read(&mut self, now_ms: i64, joules: Option<f64>) -> Option<f64> {
        let Some(joules) = joules else {
            *self = Self::default();
            return None;
        };
        let reset = self.read.is_some_and(|previous| joules < previous);
        self.reported = Some(match self.reported {
            // The estimate ran ahead of the driver: hold until the driver passes it.
            Some(r) if !reset => r.max(joules),
            _ => joules,
        });
        self.read = Some(joules);
        self.since_read = 0.0;
        self.last_ms = Some(now_ms);
        self.reported
    }

    /// The counter at `now_ms` between reads, from the power measured then (`None`: unknown,
    /// and the counter holds).
    pub fn advance(&mut self, now_ms: i64, power_watts: Option<f64>) -> Option<f64> {
        let read = self.read?;
        let last = self.last_ms.unwrap_or(now_ms);
        // Of a long gap (a stopped agent) at most a minute is filled in from one reading.
        let seconds = (now_ms - last).clamp(0, 60_000) as f64 / 1000.0;
        if let Some(watts) = power_watts.filter(|w| w.is_finite() && *w >= 0.0) {
            self.since_read += watts * seconds;
        }
        self.last_ms = Some(now_ms);
        let value = (read + self.since_read).max(self.reported.unwrap_or(read));
        self.reported = Some(value);
        self.reported
    }
}

/// An initialised NVML handle and the devices it found.
pub struct NvmlGpus {
    nvml: &'static Nvml,
    devices: Vec<NvmlDeviceInfo>,
    state: Vec<DeviceState>,
    lost: HashSet<u32>,
    events: Option<EventSet<'static>>,
    slow_interval_ms: i64,
}

impl std::fmt::Debug for NvmlGpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlGpus")
            .field("devices", &self.devices)
            .field("events", &self.events.is_some())
            .finish_non_exhaustive()
    }
}

/// The events perch listens for.
fn wanted_events() -> EventTypes {
    EventTypes::CRITICAL_XID_ERROR
        | EventTypes::SINGLE_BIT_ECC_ERROR
        | EventTypes::DOUBLE_BIT_ECC_ERROR
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
        // The event set borrows the handle for as long as the agent samples: keep NVML loaded
        // for the life of the process, as a driver client normally does.
        let nvml: &'static Nvml = Box::leak(Box::new(nvml));
        let count = nvml
            .device_count()
            .map_err(|e| CollectorError::Nvml(format!("cannot count devices: {e}")))?;
        let mut devices = Vec::new();
        let mut events = nvml.create_event_set().ok();
        for index in 0..count {
            match nvml.device_by_index(index) {
                Ok(d) => {
                    devices.push(NvmlDeviceInfo {
                        index,
                        uuid: d
                            .uuid()
                            .unwrap_or_else(|_| format!("GPU-UNKNOWN-UUID-{index}")),
                        model: d
                            .name()
                            .unwrap_or_else(|_| "NVIDIA GPU (model unknown)".to_string()),
                    });
                    let supported = d.supported_event_types().unwrap_or(wanted_events());
                    let wanted = wanted_events() & supported;
                    // A failed registration frees the set (NVML's rule); we carry on without.
                    events = events.and_then(|set| match d.register_events(wanted, set) {
                        Ok(set) => Some(set),
                        Err(e) => {
                            tracing::info!(gpu = index, error = %e.error, "no XID/ECC events from NVML; they will not be recorded");
                            None
                        }
                    });
                }
                // Kept, so every GPU keeps its NVML index (the one CUDA_VISIBLE_DEVICES names):
                // the first sample reports it lost, and no job is placed on it until it answers.
                Err(e) => {
                    tracing::warn!(gpu = index, error = %e, "cannot open GPU; it is reported lost until it answers");
                    devices.push(NvmlDeviceInfo {
                        index,
                        uuid: format!("GPU-UNKNOWN-UUID-{index}"),
                        model: String::new(),
                    });
                }
            }
        }
        Ok(Some(Self {
            nvml,
            state: vec![DeviceState::default(); devices.len()],
            devices,
            lost: HashSet::new(),
            events,
            slow_interval_ms: DEFAULT_SLOW_INTERVAL_MS,
        }))
    }

    /// Makes the costly reads (the energy counter, per-process utilization, PCIe, MIG mode)
    /// every `interval` (0: every sample) instead of every [`DEFAULT_SLOW_INTERVAL_MS`].
    pub fn set_slow_interval(&mut self, interval: std::time::Duration) {
        self.slow_interval_ms = i64::try_from(interval.as_millis()).unwrap_or(i64::MAX);
    }

    /// The devices found at start.
    pub fn devices(&self) -> &[NvmlDeviceInfo] {
        &self.devices
    }

    /// The MIG instances of the devices in MIG mode, read now (operators partition GPUs with
    /// `nvidia-smi mig`; perch creates none).
    pub fn mig_instances(&self) -> Vec<perch_model::control::MigInstance> {
        self.devices
            .iter()
            .filter_map(|d| {
                let device = self.nvml.device_by_index(d.index).ok()?;
                Some(extended::mig_instances(&device, d.index))
            })
            .flatten()
            .collect()
    }

    /// The NVLink islands of the devices (see [`super::nvlink`]), by their indices; `None`
    /// when NVML cannot tell (an old driver, a device that cannot be opened), which the
    /// scheduler treats as one island.
    pub fn nvlink_islands(&self) -> Option<Vec<Vec<u32>>> {
        use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus};
        let devices: Vec<_> = self
            .devices
            .iter()
            .map(|d| self.nvml.device_by_index(d.index))
            .collect::<std::result::Result<_, _>>()
            .ok()?;
        let n = devices.len();
        let mut linked = vec![false; n * n];
        for a in 0..n {
            for b in a + 1..n {
                let status = devices[a]
                    .p2p_status(&devices[b], P2pCapabilitiesIndex::NvLink)
                    .ok()?;
                linked[a * n + b] = status == P2pStatus::Ok;
            }
        }
        let islands = super::nvlink::islands(n as u32, |a, b| {
            let (a, b) = (a.min(b) as usize, a.max(b) as usize);
            linked[a * n + b]
        });
        // Positions to NVML indices (the same unless a device could not be opened at start).
        Some(
            islands
                .into_iter()
                .map(|i| {
                    i.into_iter()
                        .map(|p| self.devices[p as usize].index)
                        .collect()
                })
                .collect(),
        )
    }

    /// The driver version, when NVML reports one.
    pub fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok()
    }

    /// The CUDA version the driver supports (`12.4`), when NVML reports it.
    pub fn cuda_version(&self) -> Option<String> {
        self.nvml
            .sys_cuda_driver_version()
            .ok()
            .map(perch_model::provenance::cuda_version_text)
    }

    /// Takes every pending XID/ECC event off the event set, counts it and returns it.
    fn drain_events(&mut self, now_ms: i64) -> Vec<GpuEvent> {
        let mut out = Vec::new();
        let Some(set) = &self.events else {
            return out;
        };
        loop {
            let data = match set.wait(0) {
                Ok(d) => d,
                Err(NvmlError::Timeout) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "reading NVML events failed; stopping event collection");
                    self.events = None;
                    break;
                }
            };
            let Some(pos) = data
                .device
                .index()
                .ok()
                .and_then(|i| self.devices.iter().position(|d| d.index == i))
            else {
                continue;
            };
            let (kind, xid) = if data.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                let xid = match data.event_data {
                    Some(XidError::Value(v)) => Some(v),
                    _ => None,
                };
                self.state[pos].xid_total += 1;
                (GpuEventKind::Xid, xid)
            } else if data.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
                self.state[pos].ecc_events_total += 1;
                (GpuEventKind::EccDoubleBit, None)
            } else if data.event_type.contains(EventTypes::SINGLE_BIT_ECC_ERROR) {
                self.state[pos].ecc_events_total += 1;
                (GpuEventKind::EccSingleBit, None)
            } else {
                continue;
            };
            let info = &self.devices[pos];
            tracing::warn!(gpu = info.index, uuid = %info.uuid, kind = kind.as_str(), xid, "GPU event");
            out.push(GpuEvent {
                time_ms: now_ms,
                gpu: GpuIndex(info.index),
                uuid: info.uuid.clone(),
                simulated: false,
                kind,
                xid,
                message: None,
            });
        }
        out
    }

    /// One sample per reachable device, stamped `now_ms`, with the round's events and the
    /// processes on each GPU (not yet attributed to jobs).
    pub fn sample(&mut self, now_ms: i64) -> NvmlRound {
        let mut round = NvmlRound {
            events: self.drain_events(now_ms),
            ..NvmlRound::default()
        };
        let mut identified = Vec::new();
        for (pos, info) in self.devices.iter().enumerate() {
            let event = |kind, message: Option<String>| GpuEvent {
                time_ms: now_ms,
                gpu: GpuIndex(info.index),
                uuid: info.uuid.clone(),
                simulated: false,
                kind,
                xid: None,
                message,
            };
            let device = match self.nvml.device_by_index(info.index) {
                Ok(d) => {
                    if self.lost.remove(&info.index) {
                        tracing::info!(gpu = info.index, uuid = %info.uuid, "GPU is reachable again");
                        round.events.push(event(GpuEventKind::GpuRecovered, None));
                    }
                    if info.model.is_empty()
                        && let (Ok(uuid), Ok(model)) = (d.uuid(), d.name())
                    {
                        identified.push((pos, uuid, model));
                    }
                    d
                }
                Err(e) => {
                    if self.lost.insert(info.index) {
                        tracing::warn!(gpu = info.index, uuid = %info.uuid, error = %e, "GPU unreachable, no samples until it returns");
                        round
                            .events
                            .push(event(GpuEventKind::GpuLost, Some(e.to_string())));
                    }
                    continue;
                }
            };
            let util = device.utilization_rates().ok();
            let memory = device.memory_info().ok();
            let state = &mut self.state[pos];
            // Due when the period has passed, give or take 5% (sampling rounds jitter), or
            // when the clock went back.
            let slow = state.slow_read_ms.is_none_or(|t| {
                let elapsed = now_ms - t;
                elapsed < 0
                    || elapsed.saturating_mul(20) >= self.slow_interval_ms.saturating_mul(19)
            });
            let power_watts = device.power_usage().ok().map(|mw| f64::from(mw) / 1000.0);
            let energy_joules = if slow {
                state.slow_read_ms = Some(now_ms);
                let counter = device.total_energy_consumption().ok();
                state
                    .energy
                    .read(now_ms, counter.map(|mj| mj as f64 / 1000.0))
            } else {
                state.energy.advance(now_ms, power_watts)
            };
            let mut sample = GpuSample {
                time_ms: now_ms,
                gpu: GpuIndex(info.index),
                uuid: info.uuid.clone(),
                model: info.model.clone(),
                simulated: false,
                utilization_gpu_pct: util.as_ref().map(|u| f64::from(u.gpu.min(100))),
                utilization_memory_pct: util.as_ref().map(|u| f64::from(u.memory.min(100))),
                memory_used_bytes: memory.as_ref().map(|m| m.used.min(m.total)),
                memory_total_bytes: memory.as_ref().map(|m| m.total),
                power_watts,
                temperature_celsius: device
                    .temperature(TemperatureSensor::Gpu)
                    .ok()
                    .map(f64::from),
                sm_clock_mhz: device.clock_info(Clock::SM).ok(),
                memory_clock_mhz: device.clock_info(Clock::Memory).ok(),
                xid_errors_total: self.events.as_ref().map(|_| state.xid_total),
                ecc_error_events_total: self.events.as_ref().map(|_| state.ecc_events_total),
                ..GpuSample::default()
            };
            extended::fill(&device, &mut sample);
            fields::read(&device, catalogue::GPU, Cadence::EverySample, &mut sample);
            if slow {
                extended::read_slow(&device, &mut sample);
                fields::read(&device, catalogue::GPU, Cadence::Slow, &mut sample);
                state.slow = sample.clone();
            } else {
                repeat_slow(&state.slow, &mut sample);
            }
            // Slow too, but between reads advanced by the power rather than repeated.
            sample.energy_joules = energy_joules;
            let last_seen = slow.then_some(&mut state.last_process_sample);
            if let Some(procs) = extended::processes(&device, &sample, last_seen) {
                sample.processes = Some(procs.len() as u32);
                round.processes.extend(procs);
            }
            round.gpus.push(sample);
        }
        // A device that could not be opened at start, answering now: its identity from the
        // next sample on.
        for (pos, uuid, model) in identified {
            self.devices[pos].uuid = uuid;
            self.devices[pos].model = model;
        }
        round
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
    fn energy_between_reads_advances_by_power_and_never_goes_back() {
        let mut e = EnergyCounter::default();
        assert_eq!(
            e.advance(0, Some(500.0)),
            None,
            "nothing before the first read"
        );
        assert_eq!(e.read(1_000, Some(10_000.0)), Some(10_000.0));
        // 700 W for 1 s, then 1.5 s (a late round), then no power reading: it holds.
        assert_eq!(e.advance(2_000, Some(700.0)), Some(10_700.0));
        assert_eq!(e.advance(3_500, Some(700.0)), Some(11_750.0));
        assert_eq!(e.advance(4_500, None), Some(11_750.0));
        // The driver says less than the estimate: hold, never back...
        assert_eq!(e.read(5_000, Some(11_600.0)), Some(11_750.0));
        assert_eq!(e.advance(6_000, Some(100.0)), Some(11_750.0));
        // ...until it passes it; then the driver's value is reported as it is.
        assert_eq!(e.advance(7_000, Some(100.0)), Some(11_800.0));
        assert_eq!(e.read(8_000, Some(12_000.0)), Some(12_000.0));
        // A driver reload restarts its counter: reported as the reset it is.
        assert_eq!(e.read(9_000, Some(50.0)), Some(50.0));
        // A failed read: unknown, not the old value, until a read succeeds.
        assert_eq!(e.read(10_000, None), None);
        assert_eq!(e.advance(11_000, Some(700.0)), None);
        assert_eq!(e.read(12_000, Some(60.0)), Some(60.0));
        // A stopped agent's gap is not filled from one power reading; nor is a clock going back.
        assert_eq!(e.advance(600_000, Some(100.0)), Some(6_060.0));
        assert_eq!(e.advance(500_000, Some(100.0)), Some(6_060.0));
        // Garbage power is ignored.
        assert_eq!(e.advance(501_000, Some(f64::NAN)), Some(6_060.0));
        assert_eq!(e.advance(502_000, Some(-5.0)), Some(6_060.0));
    }

    #[test]
    fn a_missing_library_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().expect("temp dir");
        let bogus = dir.path().join("libnvidia-ml-missing.so");
        let err = NvmlGpus::open(&NvmlMode::Path(bogus)).expect_err("no library there");
        assert!(err.to_string().starts_with("NVML:"), "{err}");
    }
}
