//! A simulated host and simulated NICs, for `perch demo` where the whole node is synthetic.
//!
//! Like the GPU simulator they are deterministic functions of (seed, node, `now_ms`) plus
//! counters integrated over the sample times. The host's CPU load and the NICs' traffic follow
//! the node's mean GPU utilization, so a busy node looks busy everywhere. Every sample says
//! `simulated: true`; NIC names start with `sim-`.

use crate::gpu::sim::{device_key, mix_all, unit};
use perch_model::{HostSample, NicSample, NodeId};

const CPU_COUNT: u32 = 128;
const MEMORY_TOTAL_BYTES: u64 = 2 << 40; // 2 TiB
const DISK_TOTAL_BYTES: u64 = 7_680_000_000_000;
/// Device keys for host and NICs live far from GPU indices.
const HOST_KEY: u32 = 1_000_000;

/// A simulated host with cumulative CPU counters.
#[derive(Debug, Clone)]
pub struct SimHost {
    key: u64,
    last_ms: Option<i64>,
    busy: [f64; 4], // user, system, iowait, softirq seconds
    idle: f64,
    load: f64,
    boot_ms: Option<i64>,
}

impl SimHost {
    pub fn new(node: &NodeId, seed: u64) -> Self {
        Self {
            key: device_key(seed, node, HOST_KEY),
            last_ms: None,
            busy: [0.0; 4],
            idle: 0.0,
            load: 0.0,
            boot_ms: None,
        }
    }

    /// One host sample; `gpu_util_pct` is the node's mean GPU utilization (0 when it has none).
    pub fn sample(&mut self, now_ms: i64, gpu_util_pct: f64) -> HostSample {
        let noise = unit(mix_all(&[self.key, now_ms.div_euclid(1000) as u64]));
        // Data loaders keep CPUs busy in proportion to GPU work, plus a small base load.
        let busy_frac = (0.03 + 0.5 * gpu_util_pct / 100.0 + 0.04 * noise).clamp(0.0, 1.0);
        let boot_ms = *self
            .boot_ms
            .get_or_insert(now_ms - 86_400_000 * (1 + (self.key % 30) as i64));
        let dt = self
            .last_ms
            .map_or(0.0, |l| (now_ms - l).max(0) as f64 / 1000.0);
        let cpu_secs = dt * f64::from(CPU_COUNT);
        let shares = [0.80, 0.15, 0.03, 0.02];
        for (b, share) in self.busy.iter_mut().zip(shares) {
            *b += cpu_secs * busy_frac * share;
        }
        self.idle += cpu_secs * (1.0 - busy_frac);
        let target_load = busy_frac * f64::from(CPU_COUNT);
        self.load += (target_load - self.load) * (1.0 - (-dt / 60.0).exp());
        if self.last_ms.is_none() {
            self.load = target_load;
        }
        self.last_ms = Some(now_ms.max(self.last_ms.unwrap_or(now_ms)));
        let mem_used_frac = 0.08 + 0.5 * gpu_util_pct / 100.0;
        let round2 = |v: f64| (v * 100.0).round() / 100.0;
        HostSample {
            time_ms: now_ms,
            simulated: true,
            cpu_user_seconds: Some(self.busy[0]),
            cpu_nice_seconds: Some(0.0),
            cpu_system_seconds: Some(self.busy[1]),
            cpu_idle_seconds: Some(self.idle),
            cpu_iowait_seconds: Some(self.busy[2]),
            cpu_irq_seconds: Some(0.0),
            cpu_softirq_seconds: Some(self.busy[3]),
            cpu_steal_seconds: Some(0.0),
            cpu_count: Some(CPU_COUNT),
            memory_total_bytes: Some(MEMORY_TOTAL_BYTES),
            memory_available_bytes: Some(
                ((1.0 - mem_used_frac) * MEMORY_TOTAL_BYTES as f64) as u64,
            ),
            load1: Some(round2(self.load)),
            load5: Some(round2(self.load * 0.95)),
            load15: Some(round2(self.load * 0.9)),
            disk_free_bytes: Some(DISK_TOTAL_BYTES / 100 * (60 - (self.key % 20))),
            disk_total_bytes: Some(DISK_TOTAL_BYTES),
            uptime_seconds: Some((now_ms - boot_ms).max(0) as f64 / 1000.0),
        }
    }
}

#[derive(Debug, Clone)]
struct SimNic {
    device: &'static str,
    key: u64,
    speed_mbps: u64,
    /// Share of line rate used at 100% GPU utilization.
    peak_share: f64,
    rx: [u64; 4], // bytes, packets, errors, drops
    tx: [u64; 4],
}

/// A simulated node's NICs: a management Ethernet port and an InfiniBand-class fabric port.
#[derive(Debug, Clone)]
pub struct SimNics {
    nics: Vec<SimNic>,
    last_ms: Option<i64>,
}

impl SimNics {
    pub fn new(node: &NodeId, seed: u64) -> Self {
        let nic = |n: u32, device, speed_mbps, peak_share| SimNic {
            device,
            key: device_key(seed, node, HOST_KEY + 1 + n),
            speed_mbps,
            peak_share,
            rx: [0; 4],
            tx: [0; 4],
        };
        Self {
            nics: vec![
                nic(0, "sim-eth0", 100_000, 0.02),
                nic(1, "sim-ib0", 400_000, 0.35),
            ],
            last_ms: None,
        }
    }

    /// One sample per simulated NIC; traffic follows `gpu_util_pct`.
    pub fn sample(&mut self, now_ms: i64, gpu_util_pct: f64) -> Vec<NicSample> {
        let dt = self
            .last_ms
            .map_or(0.0, |l| (now_ms - l).max(0) as f64 / 1000.0);
        self.last_ms = Some(now_ms.max(self.last_ms.unwrap_or(now_ms)));
        let second = now_ms.div_euclid(1000) as u64;
        self.nics
            .iter_mut()
            .map(|n| {
                let noise = unit(mix_all(&[n.key, second]));
                let bytes_per_s = n.speed_mbps as f64
                    * 125_000.0
                    * (0.001 + n.peak_share * gpu_util_pct / 100.0)
                    * (0.8 + 0.4 * noise);
                for (dir, counters) in [&mut n.rx, &mut n.tx].into_iter().enumerate() {
                    let bytes = (bytes_per_s * dt * if dir == 0 { 1.0 } else { 0.9 }) as u64;
                    counters[0] += bytes;
                    counters[1] += bytes / 4096;
                    // Rare errors and drops, so alert rules have something to fire on.
                    let h = mix_all(&[n.key, second, dir as u64]);
                    if dt > 0.0 && h.is_multiple_of(997) {
                        counters[2] += 1;
                    }
                    if dt > 0.0 && h.is_multiple_of(499) {
                        counters[3] += 1;
                    }
                }
                NicSample {
                    time_ms: now_ms,
                    device: n.device.to_string(),
                    simulated: true,
                    rx_bytes: Some(n.rx[0]),
                    rx_packets: Some(n.rx[1]),
                    rx_errors: Some(n.rx[2]),
                    rx_dropped: Some(n.rx[3]),
                    tx_bytes: Some(n.tx[0]),
                    tx_packets: Some(n.tx[1]),
                    tx_errors: Some(n.tx[2]),
                    tx_dropped: Some(n.tx[3]),
                    link_up: Some(true),
                    speed_mbps: Some(n.speed_mbps),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: i64 = 1_800_000_000_000;

    fn node() -> NodeId {
        NodeId::new("demo-3").expect("valid")
    }

    #[test]
    fn host_counters_rise_and_follow_gpu_load() {
        let mut host = SimHost::new(&node(), 9);
        let mut prev = host.sample(T0, 0.0);
        assert!(prev.simulated);
        let mut idle_busy = 0.0;
        let mut hot_busy = 0.0;
        for i in 1..=120 {
            let util = if i <= 60 { 0.0 } else { 100.0 };
            let s = host.sample(T0 + i * 1000, util);
            let busy = s.cpu_user_seconds.expect("user") - prev.cpu_user_seconds.expect("user");
            assert!(busy >= 0.0);
            assert!(s.cpu_idle_seconds >= prev.cpu_idle_seconds);
            if i <= 60 {
                idle_busy += busy
            } else {
                hot_busy += busy
            }
            prev = s;
        }
        assert!(hot_busy > 5.0 * idle_busy, "{idle_busy} vs {hot_busy}");
        let batch = perch_model::Batch {
            hosts: vec![prev],
            ..perch_model::Batch::new(node(), 1)
        };
        assert_eq!(batch.validate(T0 + 200_000), Ok(()));
    }

    #[test]
    fn nic_counters_are_monotone_and_deterministic() {
        let series = |seed| {
            let mut nics = SimNics::new(&node(), seed);
            (0..300)
                .map(|i| nics.sample(T0 + i * 1000, 80.0))
                .collect::<Vec<_>>()
        };
        let a = series(1);
        assert_eq!(a, series(1));
        for pair in a.windows(2) {
            for (x, y) in pair[0].iter().zip(&pair[1]) {
                assert!(
                    y.rx_bytes >= x.rx_bytes
                        && y.tx_packets >= x.tx_packets
                        && y.rx_errors >= x.rx_errors
                );
            }
        }
        let last = &a[a.len() - 1];
        assert!(
            last.iter()
                .all(|n| n.simulated && n.device.starts_with("sim-") && n.link_up == Some(true))
        );
        assert!(
            last[1].rx_bytes > last[0].rx_bytes,
            "the fabric carries the training traffic"
        );
    }
}
