//! The NVML reads beyond the basics: throttle reasons, ECC counts, retired pages, PCIe, NVLink,
//! MIG, and the processes on a GPU with their utilization. Each value is absent when the call
//! fails (unsupported, missing from the driver, lost), never zero.
//!
//! Remapped rows (Ampere and later) are not read: nvml-wrapper 0.13 has no safe call for
//! `nvmlDeviceGetRemappedRows`; retired pages cover the older GPUs and the ECC counts all.

use nvml_wrapper::Device;
use nvml_wrapper::enum_wrappers::device::RetirementCause;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, PcieUtilCounter};
use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::nv_link::Counter;
use perch_model::{GpuProcessSample, GpuSample};
use std::collections::HashMap;

/// NVML's `NVML_NVLINK_MAX_LINKS`.
const MAX_NVLINKS: u32 = 18;

/// Sums a value over NVLinks, absent when no link reports it.
fn sum_links(values: impl Iterator<Item = Option<u64>>) -> Option<u64> {
    values.fold(None, |acc, v| match (acc, v) {
        (acc, None) => acc,
        (None, Some(v)) => Some(v),
        (Some(a), Some(v)) => Some(a.saturating_add(v)),
    })
}

/// Fills the health, interconnect and MIG fields of `s` from `device`.
pub(super) fn fill(device: &Device<'_>, s: &mut GpuSample) {
    s.throttle_reasons = device.current_throttle_reasons().ok().map(|r| r.bits());
    let ecc = |e: MemoryError, c: EccCounter| device.total_ecc_errors(e, c).ok();
    s.ecc_corrected_volatile = ecc(MemoryError::Corrected, EccCounter::Volatile);
    s.ecc_uncorrected_volatile = ecc(MemoryError::Uncorrected, EccCounter::Volatile);
    s.ecc_corrected_aggregate = ecc(MemoryError::Corrected, EccCounter::Aggregate);
    s.ecc_uncorrected_aggregate = ecc(MemoryError::Uncorrected, EccCounter::Aggregate);
    let retired = |cause| device.retired_pages(cause).ok().map(|p| p.len() as u32);
    s.retired_pages_single_bit = retired(RetirementCause::MultipleSingleBitEccErrors);
    s.retired_pages_double_bit = retired(RetirementCause::DoubleBitEccError);
    s.retired_pages_pending = device.are_pages_pending_retired().ok();

    let mut states = Vec::new();
    for link in 0..MAX_NVLINKS {
        match device.link_wrapper_for(link).is_active() {
            Ok(up) => states.push(up),
            Err(_) => break,
        }
    }
    if !states.is_empty() {
        s.nvlink_links = Some(states.len() as u32);
        s.nvlink_links_up = Some(states.iter().filter(|u| **u).count() as u32);
        let links = || (0..states.len() as u32).map(|l| device.link_wrapper_for(l));
        s.nvlink_errors_total = sum_links(links().map(|l| {
            let counters = [
                ErrorCounter::DlReplay,
                ErrorCounter::DlRecovery,
                ErrorCounter::DlCrcFlit,
                ErrorCounter::DlCrcData,
            ];
            sum_links(counters.into_iter().map(|c| l.error_counter(c).ok()))
        }));
        let counters: Vec<_> = links()
            .map(|l| l.utilization_counter(Counter::Zero).ok())
            .collect();
        s.nvlink_rx_bytes = sum_links(counters.iter().map(|c| c.as_ref().map(|c| c.receive)));
        s.nvlink_tx_bytes = sum_links(counters.iter().map(|c| c.as_ref().map(|c| c.send)));
    }
}

/// Reads into `s`, on the rounds that make the slow reads, the columns the catalogue marks
/// slow ([`Cadence::Slow`](perch_model::catalogue::Cadence)) that have code of their own here:
/// PCIe throughput (NVML measures it over a 20 ms window each way, which the call waits for),
/// the PCIe replay counter and the MIG mode (each 0.15 ms of CPU on an H200, and rarely
/// changing). The samples between repeat them; the energy counter, slow too, is the caller's.
pub(super) fn read_slow(device: &Device<'_>, s: &mut GpuSample) {
    // NVML reports KB/s.
    let pcie = |c| {
        device
            .pcie_throughput(c)
            .ok()
            .map(|kb| f64::from(kb) * 1024.0)
    };
    let mig = device.mig_mode().ok().map(|mode| mode.current == 1);
    s.mig_instances = mig.filter(|on| *on).map(|_| {
        let max = device.mig_device_count().unwrap_or(0);
        (0..max)
            .filter(|i| device.mig_device_by_index(*i).is_ok())
            .count() as u32
    });
    s.pcie_tx_bytes_per_second = pcie(PcieUtilCounter::Send);
    s.pcie_rx_bytes_per_second = pcie(PcieUtilCounter::Receive);
    s.pcie_replay_total = device.pcie_replay_counter().ok().map(u64::from);
    s.mig_enabled = mig;
}

/// The MIG instances of `device` (NVML index `gpu`) when it is in MIG mode: each MIG device's
/// UUID, its profile (the end of its name, `NVIDIA A100-SXM4-80GB MIG 3g.40gb`) and memory.
/// Empty when it is not in MIG mode or NVML cannot tell; an instance whose name carries no
/// profile is left out.
pub(super) fn mig_instances(
    device: &Device<'_>,
    gpu: u32,
) -> Vec<perch_model::control::MigInstance> {
    if !device.mig_mode().is_ok_and(|m| m.current == 1) {
        return Vec::new();
    }
    let max = device.mig_device_count().unwrap_or(0);
    (0..max)
        .filter_map(|i| {
            let d = device.mig_device_by_index(i).ok()?;
            let uuid = d.uuid().ok()?;
            let name = d.name().ok()?;
            let profile = name.rsplit_once("MIG ")?.1.trim().to_owned();
            let memory_mb = d.memory_info().ok().map(|m| m.total >> 20);
            Some(perch_model::control::MigInstance {
                gpu,
                profile,
                uuid,
                memory_mb,
            })
        })
        .collect()
}

/// The compute processes on `device` with their memory and, when `last_seen` is given (NVML's
/// timestamp of the last utilization sample read), their utilization since then; `None` when
/// NVML cannot list them.
pub(super) fn processes(
    device: &Device<'_>,
    s: &GpuSample,
    last_seen: Option<&mut Option<u64>>,
) -> Option<Vec<GpuProcessSample>> {
    let procs = device.running_compute_processes().ok()?;
    let mut util: HashMap<u32, (u32, u32)> = HashMap::new();
    if let Some(last_seen) = last_seen
        && let Ok(samples) = device.process_utilization_stats(*last_seen)
    {
        for p in samples {
            *last_seen = Some(last_seen.unwrap_or(0).max(p.timestamp));
            util.insert(p.pid, (p.sm_util.min(100), p.mem_util.min(100)));
        }
    }
    let out = procs
        .into_iter()
        .map(|p| {
            let u = util.get(&p.pid);
            GpuProcessSample {
                time_ms: s.time_ms,
                gpu: s.gpu,
                uuid: s.uuid.clone(),
                simulated: false,
                pid: p.pid,
                used_memory_bytes: match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(b),
                    UsedGpuMemory::Unavailable => None,
                },
                sm_utilization_pct: u.map(|u| f64::from(u.0)),
                memory_utilization_pct: u.map(|u| f64::from(u.1)),
                job: None,
                rogue: false,
            }
        })
        .collect();
    Some(out)
}
