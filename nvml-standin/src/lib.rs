//! A stand-in for `libnvidia-ml.so`: a shared library exporting the NVML C functions that
//! perch's agent calls through `nvml-wrapper`, answering from a scenario file instead of a
//! driver. Tests and benchmarks load it with `NvmlMode::Path` (nvml-wrapper's `lib_path`), so the
//! real nvml-wrapper code path runs: symbol loading, error mapping, buffer-size negotiation.
//!
//! The scenario's path comes from `PERCH_NVML_STANDIN_SCENARIO` when NVML is initialised; see
//! [`scenario`] for its format and clock. Functions not exported here fail in nvml-wrapper with
//! `FailedToLoadSymbol` at call time only, exactly as on an old driver.
//!
//! Handles are not pointers to memory: a device handle is its index plus one, a MIG device
//! handle is `0x10000 + 256 * gpu + instance`, an event set handle its slot plus one. This file
//! is the only place with `unsafe`: writes through the caller's out-pointers, each after a null
//! check, in [`put`], [`put_str`], [`put_slice`] and [`caller_slice`].
//!
//! `nvmlDeviceGetFieldValues` answers every NVML field a scenario sets (`fields`), whatever its
//! id: a metric the agent's catalogue reads by field id needs no export of its own here.
// The safety contract of every exported function is NVML's own (valid out-pointers of the
// documented types); restating it per function adds nothing.
#![allow(clippy::missing_safety_doc)]

pub mod scenario;

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlFieldValue_t, nvmlMemory_v2_t,
    nvmlProcessInfo_t, nvmlProcessUtilizationSample_t, nvmlReturn_t, nvmlUtilization_t,
    nvmlValue_t,
};
use scenario::{Clock, FieldValue, GpuScript, Scenario, Values};
use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

/// Environment variable naming the scenario file.
pub const SCENARIO_ENV: &str = "PERCH_NVML_STANDIN_SCENARIO";

const SUCCESS: nvmlReturn_t = 0;
const UNINITIALIZED: nvmlReturn_t = 1;
const INVALID_ARGUMENT: nvmlReturn_t = 2;
const NOT_SUPPORTED: nvmlReturn_t = 3;
const NOT_FOUND: nvmlReturn_t = 6;
const INSUFFICIENT_SIZE: nvmlReturn_t = 7;
const DRIVER_NOT_LOADED: nvmlReturn_t = 9;
const TIMEOUT: nvmlReturn_t = 10;
const GPU_IS_LOST: nvmlReturn_t = 15;
const UNKNOWN: nvmlReturn_t = 999;
const MIG_BASE: usize = 0x10000;

struct EventSet {
    registered: Vec<(usize, u64)>,
    delivered: HashSet<(usize, usize)>,
}

struct State {
    scenario: Scenario,
    started: Instant,
    handle_calls: u64,
    sets: Vec<Option<EventSet>>,
    /// GPUs whose scripted hang has happened.
    hung: HashSet<usize>,
}

impl State {
    fn now(&self) -> f64 {
        match self.scenario.clock {
            Clock::Rounds => self.handle_calls.saturating_sub(1) as f64,
            Clock::Seconds => self.started.elapsed().as_secs_f64(),
        }
    }
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Writes `value` through a caller's out-pointer; null is `NVML_ERROR_INVALID_ARGUMENT`.
fn put<T>(out: *mut T, value: T) -> nvmlReturn_t {
    if out.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: NVML's contract: a non-null out-pointer points to writable memory for one T.
    unsafe { out.write(value) };
    SUCCESS
}

/// Copies `items` into a caller's array of `*count` entries, NVML style: `*count` always
/// receives the number available; too small a buffer is `NVML_ERROR_INSUFFICIENT_SIZE`.
fn put_slice<T: Copy>(count: *mut c_uint, out: *mut T, items: &[T]) -> nvmlReturn_t {
    if count.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: `count` is non-null and, by NVML's contract, points to a readable c_uint.
    let room = unsafe { count.read() } as usize;
    put(count, items.len() as c_uint);
    if items.is_empty() {
        return SUCCESS;
    }
    if out.is_null() || room < items.len() {
        return INSUFFICIENT_SIZE;
    }
    // SAFETY: the caller said `out` has room for `room >= items.len()` entries of T.
    unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), out, items.len()) };
    SUCCESS
}

/// The caller's array of `count` entries at `items`, to read and fill in place (NVML's
/// in-out arrays); `None` for a null pointer or a negative count.
fn caller_slice<'a, T>(items: *mut T, count: c_int) -> Option<&'a mut [T]> {
    let count = usize::try_from(count).ok()?;
    if items.is_null() {
        return None;
    }
    // SAFETY: NVML's contract: a non-null `items` points to `count` initialised, writable
    // entries of T, which the caller does not touch until the call returns.
    Some(unsafe { std::slice::from_raw_parts_mut(items, count) })
}

/// Copies a string with its NUL into a caller's buffer of `len` bytes.
fn put_str(out: *mut c_char, len: c_uint, s: &str) -> nvmlReturn_t {
    if out.is_null() {
        return INVALID_ARGUMENT;
    }
    let bytes = s.as_bytes();
    if bytes.len() + 1 > len as usize {
        return INSUFFICIENT_SIZE;
    }
    // SAFETY: `out` is non-null with room for `len >= bytes.len() + 1` bytes (NVML contract).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), out, bytes.len());
        out.add(bytes.len()).write(0);
    }
    SUCCESS
}

fn init() -> nvmlReturn_t {
    let Ok(path) = std::env::var(SCENARIO_ENV) else {
        eprintln!("nvml-standin: set {SCENARIO_ENV} to a scenario file");
        return DRIVER_NOT_LOADED;
    };
    let scenario = match std::fs::read_to_string(&path).map_err(|e| e.to_string()) {
        Ok(text) => Scenario::parse(&text),
        Err(e) => Err(e),
    };
    match scenario {
        Ok(scenario) => {
            *state() = Some(State {
                scenario,
                started: Instant::now(),
                handle_calls: 0,
                sets: Vec::new(),
                hung: HashSet::new(),
            });
            SUCCESS
        }
        Err(e) => {
            eprintln!("nvml-standin: scenario {path}: {e}");
            UNKNOWN
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    init()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    init()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    *state() = None;
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let s = match result {
        SUCCESS => c"Success",
        UNINITIALIZED => c"Uninitialized",
        INVALID_ARGUMENT => c"Invalid Argument",
        NOT_SUPPORTED => c"Not Supported",
        NOT_FOUND => c"Not Found",
        INSUFFICIENT_SIZE => c"Insufficient Size",
        DRIVER_NOT_LOADED => c"Driver Not Loaded",
        TIMEOUT => c"Timeout",
        GPU_IS_LOST => c"GPU is lost",
        _ => c"Unknown Error",
    };
    s.as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(out: *mut c_char, len: c_uint) -> nvmlReturn_t {
    match state().as_ref() {
        Some(s) => put_str(out, len, &s.scenario.driver_version),
        None => UNINITIALIZED,
    }
}

/// The CUDA version the scenario's driver supports (`cuda_version`, default 12.6).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(out: *mut c_int) -> nvmlReturn_t {
    match state().as_ref() {
        Some(s) => put(out, s.scenario.cuda_version),
        None => UNINITIALIZED,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    match state().as_ref() {
        Some(s) => put(count, s.scenario.gpus.len() as c_uint),
        None => UNINITIALIZED,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    let mut guard = state();
    let Some(s) = guard.as_mut() else {
        return UNINITIALIZED;
    };
    if index == 0 {
        s.handle_calls += 1;
    }
    let now = s.now();
    let hang = s
        .scenario
        .gpus
        .get(index as usize)
        .and_then(|g| g.hang)
        .filter(|h| h.at <= now);
    if let Some(h) = hang
        && s.hung.insert(index as usize)
    {
        // Wedged: block this caller (not the library's lock), then answer.
        drop(guard);
        std::thread::sleep(std::time::Duration::from_secs_f64(h.secs));
        guard = state();
    }
    let Some(s) = guard.as_mut() else {
        return UNINITIALIZED;
    };
    match s.scenario.gpus.get(index as usize) {
        None => INVALID_ARGUMENT,
        Some(g) if g.lost(now) => GPU_IS_LOST,
        Some(_) => put(device, std::ptr::without_provenance_mut(index as usize + 1)),
    }
}

/// The GPU index and instance index a MIG device handle names, or `None` for any other
/// handle.
fn mig_of(device: nvmlDevice_t) -> Option<(usize, usize)> {
    let addr = device.addr().checked_sub(MIG_BASE)?;
    Some((addr / 256, addr % 256))
}

/// Runs `f` on the MIG instance a MIG handle names (its GPU's script, its index, its profile);
/// `None` when `device` is no MIG handle, so the caller answers for a GPU.
fn with_mig(
    device: nvmlDevice_t,
    f: impl FnOnce(&GpuScript, usize, &str) -> nvmlReturn_t,
) -> Option<nvmlReturn_t> {
    let (gpu, index) = mig_of(device)?;
    let guard = state();
    let Some(s) = guard.as_ref() else {
        return Some(UNINITIALIZED);
    };
    let Some(g) = s.scenario.gpus.get(gpu) else {
        return Some(INVALID_ARGUMENT);
    };
    let values = g.values_at(s.now());
    let Some(profile) = values.mig_profiles.as_ref().and_then(|p| p.get(index)) else {
        return Some(NOT_SUPPORTED);
    };
    Some(f(g, index, profile))
}

/// A MIG instance's UUID: `MIG-` and the GPU's UUID without its `GPU-`, with the instance
/// index in its last group.
fn mig_uuid(g: &GpuScript, index: usize) -> String {
    let base = g.uuid.strip_prefix("GPU-").unwrap_or(&g.uuid);
    format!("MIG-{base}-{index}")
}

/// Runs `f` on the GPU a handle names with its values now; lost and unknown GPUs answer for
/// themselves. `f` returns `None` for an unsupported metric.
fn with_gpu(
    device: nvmlDevice_t,
    f: impl FnOnce(usize, &GpuScript, &Values) -> Option<nvmlReturn_t>,
) -> nvmlReturn_t {
    let guard = state();
    let Some(s) = guard.as_ref() else {
        return UNINITIALIZED;
    };
    let index = device.addr().wrapping_sub(1);
    let Some(gpu) = s.scenario.gpus.get(index) else {
        return INVALID_ARGUMENT;
    };
    let now = s.now();
    if gpu.lost(now) {
        return GPU_IS_LOST;
    }
    f(index, gpu, &gpu.values_at(now)).unwrap_or(NOT_SUPPORTED)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu(device, |i, _, _| Some(put(out, i as c_uint)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    out: *mut c_char,
    len: c_uint,
) -> nvmlReturn_t {
    if let Some(r) = with_mig(device, |g, i, _| put_str(out, len, &mig_uuid(g, i))) {
        return r;
    }
    with_gpu(device, |_, g, _| Some(put_str(out, len, &g.uuid)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    out: *mut c_char,
    len: c_uint,
) -> nvmlReturn_t {
    if let Some(r) = with_mig(device, |g, _, p| {
        put_str(out, len, &format!("{} MIG {p}", g.name))
    }) {
        return r;
    }
    with_gpu(device, |_, g, _| Some(put_str(out, len, &g.name)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    out: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, v| {
        let (gpu, memory) = (v.util_gpu?, v.util_memory?);
        Some(put(out, nvmlUtilization_t { gpu, memory }))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    out: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    let mig = with_mig(device, |_, _, p| {
        // The profile's memory, none of it used.
        let gb: u64 = p
            .split_once("g.")
            .and_then(|(_, m)| m.strip_suffix("gb"))
            .and_then(|m| m.parse().ok())
            .unwrap_or(0);
        let total = gb << 30;
        let memory = nvmlMemory_v2_t {
            version: (std::mem::size_of::<nvmlMemory_v2_t>() | (2 << 24)) as c_uint,
            total,
            reserved: 0,
            free: total,
            used: 0,
        };
        put(out, memory)
    });
    if let Some(r) = mig {
        return r;
    }
    with_gpu(device, |_, _, v| {
        let (used, total) = (v.memory_used_bytes?, v.memory_total_bytes?);
        let memory = nvmlMemory_v2_t {
            version: (std::mem::size_of::<nvmlMemory_v2_t>() | (2 << 24)) as c_uint,
            total,
            reserved: 0,
            free: total.saturating_sub(used),
            used,
        };
        Some(put(out, memory))
    })
}

macro_rules! scalar {
    ($name:ident, $ty:ty, $field:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(device: nvmlDevice_t, out: *mut $ty) -> nvmlReturn_t {
            with_gpu(device, |_, _, v| Some(put(out, v.$field?)))
        }
    };
}

scalar!(nvmlDeviceGetPowerUsage, c_uint, power_mw);
scalar!(nvmlDeviceGetTotalEnergyConsumption, c_ulonglong, energy_mj);
scalar!(
    nvmlDeviceGetCurrentClocksThrottleReasons,
    c_ulonglong,
    throttle_reasons
);
scalar!(nvmlDeviceGetPcieReplayCounter, c_uint, pcie_replay_counter);

/// `nvmlValueType_t`: double, unsigned long long, signed long long.
const VALUE_DOUBLE: c_uint = 0;
const VALUE_UNSIGNED_LONG_LONG: c_uint = 3;
const VALUE_SIGNED_LONG_LONG: c_uint = 4;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    device: nvmlDevice_t,
    count: c_int,
    values: *mut nvmlFieldValue_t,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, v| {
        let Some(entries) = caller_slice(values, count) else {
            return Some(INVALID_ARGUMENT);
        };
        for entry in entries {
            let set = v.fields.as_ref().and_then(|f| f.get(&entry.fieldId));
            let (value_type, value) = match set {
                Some(FieldValue::Unsigned(u)) => {
                    (VALUE_UNSIGNED_LONG_LONG, nvmlValue_t { ullVal: *u })
                }
                Some(FieldValue::Signed(i)) => (VALUE_SIGNED_LONG_LONG, nvmlValue_t { sllVal: *i }),
                Some(FieldValue::Double(d)) => (VALUE_DOUBLE, nvmlValue_t { dVal: *d }),
                None => {
                    entry.nvmlReturn = NOT_SUPPORTED;
                    continue;
                }
            };
            entry.valueType = value_type;
            entry.value = value;
            entry.nvmlReturn = SUCCESS;
        }
        Some(SUCCESS)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor: c_uint,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, v| match sensor {
        0 => Some(put(out, v.temperature_c?)),
        _ => Some(INVALID_ARGUMENT),
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(
    device: nvmlDevice_t,
    clock: c_uint,
    out: *mut c_uint,
) -> nvmlReturn_t {
    // 0 graphics, 1 SM, 2 memory, 3 video; graphics follows the SM clock.
    with_gpu(device, |_, _, v| match clock {
        0 | 1 => Some(put(out, v.sm_clock_mhz?)),
        2 => Some(put(out, v.memory_clock_mhz?)),
        _ => None,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    device: nvmlDevice_t,
    error_type: c_uint,
    counter_type: c_uint,
    out: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, v| {
        let value = match (error_type, counter_type) {
            (0, 0) => v.ecc_corrected_volatile?,
            (1, 0) => v.ecc_uncorrected_volatile?,
            (0, 1) => v.ecc_corrected_aggregate?,
            (1, 1) => v.ecc_uncorrected_aggregate?,
            _ => return Some(INVALID_ARGUMENT),
        };
        Some(put(out, value))
    })
}

fn retired(v: &Values, cause: c_uint) -> Option<Vec<c_ulonglong>> {
    let n = match cause {
        0 => v.retired_pages_single_bit?,
        _ => v.retired_pages_double_bit?,
    };
    Some((0..u64::from(n)).map(|p| 0x1000 * (p + 1)).collect())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPages(
    device: nvmlDevice_t,
    cause: c_uint,
    count: *mut c_uint,
    addresses: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, v| {
        Some(put_slice(count, addresses, &retired(v, cause)?))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPages_v2(
    device: nvmlDevice_t,
    cause: c_uint,
    count: *mut c_uint,
    addresses: *mut c_ulonglong,
    timestamps: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, v| {
        let pages = retired(v, cause)?;
        let times = vec![0; pages.len()];
        if count.is_null() {
            return Some(INVALID_ARGUMENT);
        }
        // SAFETY: non-null `count` points to a readable c_uint (NVML contract).
        let room = unsafe { count.read() };
        match put_slice(count, addresses, &pages) {
            SUCCESS => {
                put(count, room);
                Some(put_slice(count, timestamps, &times))
            }
            other => Some(other),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPagesPendingStatus(
    device: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    // nvmlEnableState_t: 0 disabled, 1 enabled.
    with_gpu(device, |_, _, v| {
        Some(put(out, c_uint::from(v.retired_pages_pending?)))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPcieThroughput(
    device: nvmlDevice_t,
    counter: c_uint,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, v| match counter {
        0 => Some(put(out, v.pcie_tx_kbps?)),
        1 => Some(put(out, v.pcie_rx_kbps?)),
        _ => Some(INVALID_ARGUMENT),
    })
}

/// Runs `f` on one NVLink of a GPU; links past the last are `NVML_ERROR_INVALID_ARGUMENT`.
fn with_link(
    device: nvmlDevice_t,
    link: c_uint,
    f: impl FnOnce(&Values, usize) -> Option<nvmlReturn_t>,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, v| {
        let links = v.nvlink_up.as_ref()?.len();
        if link as usize >= links {
            return Some(INVALID_ARGUMENT);
        }
        f(v, link as usize)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_link(device, link, |v, l| {
        let up = *v.nvlink_up.as_ref()?.get(l)?;
        Some(put(out, c_uint::from(up)))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkErrorCounter(
    device: nvmlDevice_t,
    link: c_uint,
    counter: c_uint,
    out: *mut c_ulonglong,
) -> nvmlReturn_t {
    // Counter 3 is NVML_NVLINK_ERROR_DL_CRC_DATA; the others read 0.
    with_link(device, link, |v, l| {
        let errors = *v.nvlink_errors.as_ref()?.get(l)?;
        Some(put(out, if counter == 3 { errors } else { 0 }))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkUtilizationCounter(
    device: nvmlDevice_t,
    link: c_uint,
    counter: c_uint,
    rx: *mut c_ulonglong,
    tx: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_link(device, link, |v, l| {
        if counter != 0 {
            return None;
        }
        let r = *v.nvlink_rx_bytes.as_ref()?.get(l)?;
        let t = *v.nvlink_tx_bytes.as_ref()?.get(l)?;
        match put(rx, r) {
            SUCCESS => Some(put(tx, t)),
            e => Some(e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, v| {
        let items: Vec<nvmlProcessInfo_t> = v
            .processes
            .as_ref()?
            .iter()
            .map(|p| nvmlProcessInfo_t {
                pid: p.pid,
                // NVML_VALUE_NOT_AVAILABLE when the memory is unknown.
                usedGpuMemory: p.used_memory_bytes.unwrap_or(u64::MAX),
                gpuInstanceId: u32::MAX,
                computeInstanceId: u32::MAX,
            })
            .collect();
        Some(put_slice(count, infos, &items))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    samples: *mut nvmlProcessUtilizationSample_t,
    count: *mut c_uint,
    _last_seen: c_ulonglong,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, v| {
        let items: Vec<nvmlProcessUtilizationSample_t> = v
            .processes
            .as_ref()?
            .iter()
            .filter_map(|p| {
                Some(nvmlProcessUtilizationSample_t {
                    pid: p.pid,
                    timeStamp: 1,
                    smUtil: p.sm_util?,
                    memUtil: p.mem_util.unwrap_or(0),
                    encUtil: 0,
                    decUtil: 0,
                })
            })
            .collect();
        Some(put_slice(count, samples, &items))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, v| {
        let on = c_uint::from(v.mig_mode?);
        match put(current, on) {
            SUCCESS => Some(put(pending, on)),
            e => Some(e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, v| {
        v.mig_mode?;
        Some(put(out, 7))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    out: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_gpu(device, |gpu, _, v| {
        if !v.mig_mode? {
            return Some(INVALID_ARGUMENT);
        }
        let count = match &v.mig_profiles {
            Some(p) => p.len() as u32,
            None => v.mig_instances.unwrap_or(0),
        };
        if index >= count {
            return Some(NOT_FOUND);
        }
        let handle = MIG_BASE + 256 * gpu + index as usize;
        Some(put(out, std::ptr::without_provenance_mut(handle)))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    out: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, _| Some(put(out, 1 | 2 | 8)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(out: *mut nvmlEventSet_t) -> nvmlReturn_t {
    let mut guard = state();
    let Some(s) = guard.as_mut() else {
        return UNINITIALIZED;
    };
    s.sets.push(Some(EventSet {
        registered: Vec::new(),
        delivered: HashSet::new(),
    }));
    put(out, std::ptr::without_provenance_mut(s.sets.len()))
}

fn with_set(
    set: nvmlEventSet_t,
    f: impl FnOnce(&mut EventSet, &Scenario, f64) -> nvmlReturn_t,
) -> nvmlReturn_t {
    let mut guard = state();
    let Some(s) = guard.as_mut() else {
        return UNINITIALIZED;
    };
    let now = s.now();
    match s.sets.get_mut(set.addr().wrapping_sub(1)) {
        Some(Some(es)) => f(es, &s.scenario, now),
        _ => INVALID_ARGUMENT,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    let index = device.addr().wrapping_sub(1);
    with_set(set, |es, scenario, now| match scenario.gpus.get(index) {
        None => INVALID_ARGUMENT,
        Some(g) if g.lost(now) => GPU_IS_LOST,
        Some(_) => {
            es.registered.push((index, types));
            SUCCESS
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    _timeout_ms: c_uint,
) -> nvmlReturn_t {
    // Never blocks: an event is either due by the scenario's clock or the wait times out.
    with_set(set, |es, scenario, now| {
        for &(gpu, mask) in &es.registered {
            let Some(script) = scenario.gpus.get(gpu) else {
                continue;
            };
            for (n, e) in script.events.iter().enumerate() {
                if e.at > now || mask & e.kind.mask() == 0 || es.delivered.contains(&(gpu, n)) {
                    continue;
                }
                es.delivered.insert((gpu, n));
                let event = nvmlEventData_t {
                    device: std::ptr::without_provenance_mut(gpu + 1),
                    eventType: e.kind.mask(),
                    eventData: e.xid.unwrap_or(0),
                    gpuInstanceId: u32::MAX,
                    computeInstanceId: u32::MAX,
                };
                return put(data, event);
            }
        }
        TIMEOUT
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    let mut guard = state();
    let Some(s) = guard.as_mut() else {
        return UNINITIALIZED;
    };
    match s.sets.get_mut(set.addr().wrapping_sub(1)) {
        Some(slot @ Some(_)) => {
            *slot = None;
            SUCCESS
        }
        _ => INVALID_ARGUMENT,
    }
}
