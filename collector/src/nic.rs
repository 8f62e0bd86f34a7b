//! NIC sampling: the counters of every interface in `/proc/net/dev` plus link state
//! (`/sys/class/net/<if>/operstate`) and speed (`/sys/class/net/<if>/speed`, in Mbps).
//!
//! The `/proc/net/dev` parser is a pure function; [`NicReader`] reads under a configurable root
//! so tests use a fixture tree. Speed is absent when the file cannot be read or reports `-1`
//! (a link that is down, or a virtual device), never zero.

use crate::error::{CollectorError, Result};
use perch_model::NicSample;
use std::path::PathBuf;

/// One interface's counters from `/proc/net/dev`, cumulative since boot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetDevCounters {
    pub device: String,
    pub rx_bytes: u64,
    pub rx_packets: u64,
    pub rx_errors: u64,
    pub rx_dropped: u64,
    pub tx_bytes: u64,
    pub tx_packets: u64,
    pub tx_errors: u64,
    pub tx_dropped: u64,
}

/// Parses `/proc/net/dev`: two header lines, then `name: 8 receive fields 8 transmit fields`.
/// The name may touch the first number (`ib0:9876543210 ...`) when the counter is wide.
pub fn parse_net_dev(text: &str) -> Result<Vec<NetDevCounters>> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some((name, rest)) = line.split_once(':') else {
            continue;
        };
        let name = name.trim();
        // Header lines carry '|' and no ':'; guard against odd lines anyway.
        if name.is_empty() || name.contains('|') {
            continue;
        }
        let v: Vec<u64> = rest
            .split_ascii_whitespace()
            .map(str::parse)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| CollectorError::parse("/proc/net/dev", format!("device {name}: {e}")))?;
        if v.len() < 16 {
            return Err(CollectorError::parse(
                "/proc/net/dev",
                format!("device {name} has {} counters, expected 16", v.len()),
            ));
        }
        out.push(NetDevCounters {
            device: name.to_string(),
            rx_bytes: v[0],
            rx_packets: v[1],
            rx_errors: v[2],
            rx_dropped: v[3],
            tx_bytes: v[8],
            tx_packets: v[9],
            tx_errors: v[10],
            tx_dropped: v[11],
        });
    }
    Ok(out)
}

/// Parses `operstate`: `up` is up, `down`/`lowerlayerdown`/`notpresent`/`dormant` are down,
/// `unknown` (loopback, many virtual devices) and `testing` are absent.
pub fn parse_operstate(text: &str) -> Option<bool> {
    match text.trim() {
        "up" => Some(true),
        "down" | "lowerlayerdown" | "notpresent" | "dormant" => Some(false),
        _ => None,
    }
}

/// Parses `speed` in Mbps; `-1` or garbage is absent.
pub fn parse_speed(text: &str) -> Option<u64> {
    text.trim()
        .parse::<i64>()
        .ok()
        .and_then(|v| u64::try_from(v).ok())
        .filter(|v| *v > 0)
}

/// Reads every NIC under `root` (`/` in production).
#[derive(Debug)]
pub struct NicReader {
    root: PathBuf,
    warned: bool,
}

impl NicReader {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            warned: false,
        }
    }

    fn read_sys(&self, device: &str, file: &str) -> Option<String> {
        // Device names come from the kernel and never hold '/', but do not trust that blindly.
        if device.contains('/') || device.starts_with('.') {
            return None;
        }
        std::fs::read_to_string(self.root.join("sys/class/net").join(device).join(file)).ok()
    }

    /// One sample per interface, stamped `now_ms`. Empty (and logged once) if `/proc/net/dev`
    /// cannot be read.
    pub fn sample(&mut self, now_ms: i64) -> Vec<NicSample> {
        let path = self.root.join("proc/net/dev");
        let parsed = std::fs::read_to_string(&path)
            .map_err(|e| CollectorError::io(&path, e))
            .and_then(|t| parse_net_dev(&t));
        let counters = match parsed {
            Ok(c) => c,
            Err(e) => {
                if !self.warned {
                    self.warned = true;
                    tracing::warn!(error = %e, "NIC metrics unavailable");
                }
                return Vec::new();
            }
        };
        counters
            .into_iter()
            .map(|c| NicSample {
                time_ms: now_ms,
                simulated: false,
                link_up: self
                    .read_sys(&c.device, "operstate")
                    .and_then(|t| parse_operstate(&t)),
                speed_mbps: self
                    .read_sys(&c.device, "speed")
                    .and_then(|t| parse_speed(&t)),
                rx_bytes: Some(c.rx_bytes),
                rx_packets: Some(c.rx_packets),
                rx_errors: Some(c.rx_errors),
                rx_dropped: Some(c.rx_dropped),
                tx_bytes: Some(c.tx_bytes),
                tx_packets: Some(c.tx_packets),
                tx_errors: Some(c.tx_errors),
                tx_dropped: Some(c.tx_dropped),
                device: c.device,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
