//! Host sampling: CPU seconds by mode (`/proc/stat`), memory (`/proc/meminfo`), load
//! (`/proc/loadavg`), uptime (`/proc/uptime`) and the free space of the agent's data directory.
//!
//! The parsers are pure functions over the file text so they are tested on fixture strings;
//! [`HostReader`] reads the files under a configurable root (`/` in production, a fixture tree in
//! tests). A file that cannot be read or parsed leaves its fields absent and is logged once; it
//! never stops the agent.

use crate::error::{CollectorError, Result};
use perch_model::HostSample;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Cumulative CPU time over all cores, in seconds, by mode.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CpuTimes {
    pub user: f64,
    pub nice: f64,
    pub system: f64,
    pub idle: f64,
    pub iowait: Option<f64>,
    pub irq: Option<f64>,
    pub softirq: Option<f64>,
    pub steal: Option<f64>,
}

/// What `/proc/stat` tells us: aggregate CPU times and the number of online CPUs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcStat {
    pub cpu: CpuTimes,
    pub cpu_count: u32,
}

/// Parses `/proc/stat`. `ticks_per_second` is `USER_HZ` (sysconf `_SC_CLK_TCK`).
pub fn parse_proc_stat(text: &str, ticks_per_second: u64) -> Result<ProcStat> {
    let hz = ticks_per_second.max(1) as f64;
    let mut cpu = None;
    let mut cpu_count = 0u32;
    for line in text.lines() {
        let mut fields = line.split_ascii_whitespace();
        let Some(label) = fields.next() else { continue };
        if label == "cpu" {
            let ticks: Vec<u64> = fields
                .map(|f| f.parse::<u64>())
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| CollectorError::parse("/proc/stat", format!("line {line:?}: {e}")))?;
            if ticks.len() < 4 {
                return Err(CollectorError::parse(
                    "/proc/stat",
                    format!(
                        "the cpu line has {} fields, expected at least 4",
                        ticks.len()
                    ),
                ));
            }
            let secs = |i: usize| ticks.get(i).map(|t| *t as f64 / hz);
            cpu = Some(CpuTimes {
                user: ticks[0] as f64 / hz,
                nice: ticks[1] as f64 / hz,
                system: ticks[2] as f64 / hz,
                idle: ticks[3] as f64 / hz,
                iowait: secs(4),
                irq: secs(5),
                softirq: secs(6),
                steal: secs(7),
            });
        } else if label
            .strip_prefix("cpu")
            .is_some_and(|n| n.parse::<u32>().is_ok())
        {
            cpu_count += 1;
        }
    }
    let cpu = cpu.ok_or_else(|| CollectorError::parse("/proc/stat", "no aggregate `cpu` line"))?;
    Ok(ProcStat { cpu, cpu_count })
}

/// Memory totals from `/proc/meminfo`, in bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemInfo {
    pub total_bytes: u64,
    /// Absent on kernels older than 3.14, which lack `MemAvailable`.
    pub available_bytes: Option<u64>,
}

/// Parses `/proc/meminfo` (values are in kB, meaning KiB).
pub fn parse_meminfo(text: &str) -> Result<MemInfo> {
    let mut total = None;
    let mut available = None;
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let slot = match key.trim() {
            "MemTotal" => &mut total,
            "MemAvailable" => &mut available,
            _ => continue,
        };
        let mut parts = rest.split_ascii_whitespace();
        let value: u64 = parts
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| CollectorError::parse("/proc/meminfo", format!("line {line:?}")))?;
        let factor = match parts.next() {
            Some("kB") => 1024,
            None => 1,
            Some(unit) => {
                return Err(CollectorError::parse(
                    "/proc/meminfo",
                    format!("unknown unit {unit:?}"),
                ));
            }
        };
        *slot = Some(value * factor);
    }
    let total_bytes =
        total.ok_or_else(|| CollectorError::parse("/proc/meminfo", "no MemTotal line"))?;
    Ok(MemInfo {
        total_bytes,
        available_bytes: available,
    })
}

/// Parses `/proc/loadavg` into the 1, 5 and 15 minute load averages.
pub fn parse_loadavg(text: &str) -> Result<(f64, f64, f64)> {
    let v: Vec<f64> = text
        .split_ascii_whitespace()
        .take(3)
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| CollectorError::parse("/proc/loadavg", format!("{text:?}: {e}")))?;
    match v[..] {
        [a, b, c] => Ok((a, b, c)),
        _ => Err(CollectorError::parse(
            "/proc/loadavg",
            format!("{text:?} has fewer than 3 fields"),
        )),
    }
}

/// Parses `/proc/uptime` into seconds since boot.
pub fn parse_uptime(text: &str) -> Result<f64> {
    text.split_ascii_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| CollectorError::parse("/proc/uptime", format!("{text:?}")))
}

/// Free (available to unprivileged users) and total bytes of the filesystem holding `path`.
pub fn disk_space(path: &Path) -> Result<(u64, u64)> {
    let st = rustix::fs::statvfs(path).map_err(|e| CollectorError::io(path, e.into()))?;
    Ok((
        st.f_bavail.saturating_mul(st.f_frsize),
        st.f_blocks.saturating_mul(st.f_frsize),
    ))
}

/// `USER_HZ`, the unit of `/proc/stat` (100 on every mainstream Linux build).
pub fn ticks_per_second() -> u64 {
    rustix::param::clock_ticks_per_second()
}

/// Reads host samples from a `/proc` tree under `root` and the disk holding `data_dir`.
#[derive(Debug)]
pub struct HostReader {
    root: PathBuf,
    data_dir: PathBuf,
    ticks_per_second: u64,
    warned: HashSet<&'static str>,
}

impl HostReader {
    /// `root` is `/` in production; tests pass a fixture tree holding `proc/stat` etc.
    pub fn new(root: impl Into<PathBuf>, data_dir: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            data_dir: data_dir.into(),
            ticks_per_second: ticks_per_second(),
            warned: HashSet::new(),
        }
    }

    /// Overrides `USER_HZ` (for fixtures written with a known tick rate).
    pub fn with_ticks_per_second(mut self, hz: u64) -> Self {
        self.ticks_per_second = hz;
        self
    }

    fn read(&self, rel: &str) -> Result<String> {
        let path = self.root.join(rel);
        std::fs::read_to_string(&path).map_err(|e| CollectorError::io(path, e))
    }

    /// Logs a failing source once, then stays quiet about it.
    fn ok_or_warn<T>(&mut self, source: &'static str, r: Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                if self.warned.insert(source) {
                    tracing::warn!(source, error = %e, "host metric unavailable, leaving it absent");
                }
                None
            }
        }
    }

    /// Takes one host sample stamped `now_ms`. Never fails: what cannot be read is absent.
    pub fn sample(&mut self, now_ms: i64) -> HostSample {
        let hz = self.ticks_per_second;
        let stat = self.read("proc/stat").and_then(|t| parse_proc_stat(&t, hz));
        let stat = self.ok_or_warn("proc/stat", stat);
        let mem = self.read("proc/meminfo").and_then(|t| parse_meminfo(&t));
        let mem = self.ok_or_warn("proc/meminfo", mem);
        let load = self.read("proc/loadavg").and_then(|t| parse_loadavg(&t));
        let load = self.ok_or_warn("proc/loadavg", load);
        let uptime = self.read("proc/uptime").and_then(|t| parse_uptime(&t));
        let uptime = self.ok_or_warn("proc/uptime", uptime);
        let disk = disk_space(&self.data_dir);
        let disk = self.ok_or_warn("data_dir", disk);
        let cpu = stat.map(|s| s.cpu);
        HostSample {
            time_ms: now_ms,
            simulated: false,
            cpu_user_seconds: cpu.map(|c| c.user),
            cpu_nice_seconds: cpu.map(|c| c.nice),
            cpu_system_seconds: cpu.map(|c| c.system),
            cpu_idle_seconds: cpu.map(|c| c.idle),
            cpu_iowait_seconds: cpu.and_then(|c| c.iowait),
            cpu_irq_seconds: cpu.and_then(|c| c.irq),
            cpu_softirq_seconds: cpu.and_then(|c| c.softirq),
            cpu_steal_seconds: cpu.and_then(|c| c.steal),
            cpu_count: stat.map(|s| s.cpu_count).filter(|n| *n > 0),
            memory_total_bytes: mem.map(|m| m.total_bytes),
            memory_available_bytes: mem.and_then(|m| m.available_bytes),
            load1: load.map(|l| l.0),
            load5: load.map(|l| l.1),
            load15: load.map(|l| l.2),
            disk_free_bytes: disk.map(|d| d.0),
            disk_total_bytes: disk.map(|d| d.1),
            uptime_seconds: uptime,
        }
    }
}

#[cfg(test)]
mod tests;
