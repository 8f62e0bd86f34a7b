//! InfiniBand ports (`/sys/class/infiniband/<device>/ports/<port>/`): data counters in bytes
//! (the kernel counts 4-byte words; the agent multiplies), error counters, state and rate.

use crate::telemetry::{BatchError, check_label, check_time};
use serde::{Deserialize, Serialize};

/// One InfiniBand port at one instant. Counters are cumulative as the HCA reports them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IbPortSample {
    pub time_ms: i64,
    /// HCA name, e.g. `mlx5_0`.
    pub device: String,
    pub port: u32,
    pub simulated: bool,
    /// Port state as the kernel names it: `ACTIVE`, `DOWN`, `INIT`, `ARMED`.
    #[serde(default)]
    pub state: Option<String>,
    /// Signalling rate in Gbit/s (`rate`: "400 Gb/sec (4X NDR)").
    #[serde(default)]
    pub rate_gbps: Option<f64>,
    #[serde(default)]
    pub rx_bytes: Option<u64>,
    #[serde(default)]
    pub tx_bytes: Option<u64>,
    #[serde(default)]
    pub rx_packets: Option<u64>,
    #[serde(default)]
    pub tx_packets: Option<u64>,
    #[serde(default)]
    pub symbol_errors: Option<u64>,
    #[serde(default)]
    pub link_downed: Option<u64>,
    #[serde(default)]
    pub rx_errors: Option<u64>,
    /// Ticks the port had data to send but no credits (`port_xmit_wait`).
    #[serde(default)]
    pub tx_wait: Option<u64>,
}

pub(crate) fn validate(ports: &[IbPortSample], now_ms: i64) -> Result<(), BatchError> {
    for (i, p) in ports.iter().enumerate() {
        let f = |name: &str| format!("ib_ports[{i}].{name}");
        check_time(|| f("time_ms"), p.time_ms, now_ms)?;
        check_label(|| f("device"), &p.device)?;
        if let Some(s) = &p.state {
            check_label(|| f("state"), s)?;
        }
        for c in crate::catalogue::IB_PORT {
            c.validate(p, f)?;
        }
    }
    Ok(())
}
