//! Fleet series beyond the basics: GPU health and interconnect counters, XID/ECC event counters,
//! rogue processes, InfiniBand ports and jobs. Jobs are exported per job (bounded by the jobs
//! running now, and gone when they end); `perch_job_info` joins a job to its user and GPUs, so
//! no per-GPU series carries a job label.

use super::{Labels, Scrape, flag};
use crate::latest::NodeLatest;

fn n(v: Option<u64>) -> Option<f64> {
    v.map(|v| v as f64)
}

fn with(l: &Labels, extra: &[(&'static str, &str)]) -> Labels {
    let mut out = l.clone();
    out.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
    out
}

/// GPU series beyond utilization, memory, power, temperature and clocks.
pub(super) fn gpu(s: &mut Scrape, node: &str, latest: &NodeLatest) {
    for g in latest.gpus.values() {
        let l: Labels = vec![
            ("node", node.to_owned()),
            ("gpu", g.gpu.to_string()),
            ("simulated", flag(g.simulated)),
        ];
        s.gauge(
            "perch_gpu_clock_throttle_reasons",
            "Clock throttle reasons bitmask, nvmlClocksThrottleReason* (dcgm CLOCK_THROTTLE_REASONS)",
            &l,
            n(g.throttle_reasons),
        );
        for (kind, scope, v) in [
            ("corrected", "volatile", g.ecc_corrected_volatile),
            ("uncorrected", "volatile", g.ecc_uncorrected_volatile),
            ("corrected", "aggregate", g.ecc_corrected_aggregate),
            ("uncorrected", "aggregate", g.ecc_uncorrected_aggregate),
        ] {
            s.counter(
                "perch_gpu_ecc_errors",
                "ECC errors by kind and scope (dcgm ECC_SBE/DBE_VOL/AGG_TOTAL)",
                &with(&l, &[("kind", kind), ("scope", scope)]),
                n(v),
            );
        }
        for (cause, v) in [
            ("single_bit", g.retired_pages_single_bit),
            ("double_bit", g.retired_pages_double_bit),
        ] {
            s.gauge(
                "perch_gpu_retired_pages",
                "Retired memory pages by cause (dcgm RETIRED_SBE / RETIRED_DBE)",
                &with(&l, &[("cause", cause)]),
                v.map(f64::from),
            );
        }
        s.gauge(
            "perch_gpu_retired_pages_pending",
            "1 if pages wait for a reboot to be retired (dcgm RETIRED_PENDING)",
            &l,
            g.retired_pages_pending.map(|p| f64::from(u8::from(p))),
        );
        for (dir, v) in [
            ("transmit", g.pcie_tx_bytes_per_second),
            ("receive", g.pcie_rx_bytes_per_second),
        ] {
            s.gauge(
                "perch_gpu_pcie_throughput_bytes_per_second",
                "PCIe throughput over NVML's 20 ms window (dcgm PCIE_TX/RX_THROUGHPUT, in bytes)",
                &with(&l, &[("direction", dir)]),
                v,
            );
        }
        s.counter(
            "perch_gpu_pcie_replays",
            "PCIe replays (dcgm PCIE_REPLAY_COUNTER)",
            &l,
            n(g.pcie_replay_total),
        );
        s.gauge(
            "perch_gpu_nvlink_links",
            "NVLinks the GPU has",
            &l,
            g.nvlink_links.map(f64::from),
        );
        s.gauge(
            "perch_gpu_nvlink_links_up",
            "NVLinks that are active",
            &l,
            g.nvlink_links_up.map(f64::from),
        );
        s.counter(
            "perch_gpu_nvlink_errors",
            "NVLink replay, recovery and CRC errors over all links (dcgm NVLINK_*_ERROR_COUNT_TOTAL)",
            &l,
            n(g.nvlink_errors_total),
        );
        for (dir, v) in [
            ("receive", g.nvlink_rx_bytes),
            ("transmit", g.nvlink_tx_bytes),
        ] {
            s.counter(
                "perch_gpu_nvlink_bytes",
                "NVLink bytes over all links (dcgm NVLINK_BANDWIDTH_TOTAL, PROF_NVLINK_RX/TX_BYTES)",
                &with(&l, &[("direction", dir)]),
                n(v),
            );
        }
        s.gauge(
            "perch_gpu_processes",
            "Compute processes on the GPU",
            &l,
            g.processes.map(f64::from),
        );
        s.gauge(
            "perch_gpu_mig_enabled",
            "1 if MIG mode is on",
            &l,
            g.mig_enabled.map(|m| f64::from(u8::from(m))),
        );
        s.gauge(
            "perch_gpu_mig_instances",
            "MIG devices configured",
            &l,
            g.mig_instances.map(f64::from),
        );
        s.counter(
            "perch_gpu_xid_errors",
            "XID errors seen since the agent started (dcgm XID_ERRORS is only the last code)",
            &l,
            n(g.xid_errors_total),
        );
        s.counter(
            "perch_gpu_ecc_error_events",
            "ECC error events (single- and double-bit) seen since the agent started",
            &l,
            n(g.ecc_error_events_total),
        );
        let rogue = latest
            .gpu_processes
            .iter()
            .filter(|p| p.gpu == g.gpu && p.rogue)
            .count();
        if g.processes.is_some() {
            s.gauge(
                "perch_gpu_rogue_processes",
                "Processes on the GPU that are not its job's (the GPU is not allocated to their job)",
                &l,
                Some(rogue as f64),
            );
        }
    }
}

/// InfiniBand ports and jobs.
pub(super) fn ib_and_jobs(s: &mut Scrape, node: &str, latest: &NodeLatest) {
    for p in latest.ib_ports.values() {
        let l: Labels = vec![
            ("node", node.to_owned()),
            ("device", p.device.clone()),
            ("port", p.port.to_string()),
            ("simulated", flag(p.simulated)),
        ];
        for (name, help, v) in [
            (
                "perch_infiniband_receive_bytes",
                "Bytes received (port_rcv_data x 4)",
                p.rx_bytes,
            ),
            (
                "perch_infiniband_transmit_bytes",
                "Bytes sent (port_xmit_data x 4)",
                p.tx_bytes,
            ),
            (
                "perch_infiniband_receive_packets",
                "Packets received",
                p.rx_packets,
            ),
            (
                "perch_infiniband_transmit_packets",
                "Packets sent",
                p.tx_packets,
            ),
            (
                "perch_infiniband_symbol_errors",
                "Symbol errors",
                p.symbol_errors,
            ),
            (
                "perch_infiniband_link_downed",
                "Times the link went down",
                p.link_downed,
            ),
            (
                "perch_infiniband_receive_errors",
                "Receive errors",
                p.rx_errors,
            ),
            (
                "perch_infiniband_transmit_wait",
                "Ticks with data to send and no credits",
                p.tx_wait,
            ),
        ] {
            s.counter(name, help, &l, n(v));
        }
        s.gauge(
            "perch_infiniband_up",
            "1 if the port state is ACTIVE",
            &l,
            p.state
                .as_ref()
                .map(|st| f64::from(u8::from(st == "ACTIVE"))),
        );
        s.gauge(
            "perch_infiniband_rate_bytes_per_second",
            "Port signalling rate in bytes per second",
            &l,
            p.rate_gbps.map(|g| g * 1.25e8),
        );
    }
    for j in latest.jobs.values() {
        let l: Labels = vec![
            ("node", node.to_owned()),
            ("job_id", j.job.clone()),
            ("simulated", flag(j.simulated)),
        ];
        let gpus: Vec<String> = j.gpus.iter().map(|g| g.0.to_string()).collect();
        let info = with(
            &l,
            &[
                ("user", j.user.as_deref().unwrap_or("")),
                ("gpus", &gpus.join(",")),
                ("source", &j.source),
            ],
        );
        s.gauge(
            "perch_job_info",
            "One series per job on a node joining it to its user and GPUs (value 1)",
            &info,
            Some(1.0),
        );
        s.counter(
            "perch_job_cpu_seconds",
            "CPU time of the job",
            &l,
            j.cpu_seconds,
        );
        s.gauge(
            "perch_job_memory_bytes",
            "Memory of the job now",
            &l,
            n(j.memory_bytes),
        );
        s.gauge(
            "perch_job_memory_peak_bytes",
            "Peak memory of the job",
            &l,
            n(j.memory_peak_bytes),
        );
        s.gauge(
            "perch_job_processes",
            "Processes in the job",
            &l,
            j.processes.map(f64::from),
        );
        s.gauge(
            "perch_job_gpu_memory_bytes",
            "GPU memory held by the job's processes",
            &l,
            n(j.gpu_memory_bytes),
        );
    }
}

/// The metrics jobs push over OpenTelemetry, latest data point each (the full history is in
/// the `job_metrics` table). Histograms export their mean.
pub(super) fn pushed(s: &mut Scrape, metrics: &[perch_model::JobMetricSample]) {
    for m in metrics {
        let l: Labels = vec![
            ("job_id", m.job.clone()),
            ("user", m.user.clone()),
            ("metric", m.metric.clone()),
            ("kind", m.kind.clone()),
            ("unit", m.unit.clone()),
            ("attributes", m.attributes.clone()),
            ("simulated", flag(m.simulated)),
        ];
        s.gauge(
            "perch_job_metric",
            "Latest value of a metric a job pushed over OpenTelemetry (histograms: the mean)",
            &l,
            m.value,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use perch_model::{GpuIndex, GpuProcessSample, GpuSample, IbPortSample, JobSample};

    /// A node with every optional value set exports every family above, and each is in
    /// docs/metrics.md.
    #[test]
    fn every_family_is_exported_and_documented() {
        let mut latest = NodeLatest::default();
        latest.gpus.insert(
            0,
            GpuSample {
                time_ms: 1,
                uuid: "GPU-1".into(),
                model: "X".into(),
                throttle_reasons: Some(4),
                ecc_corrected_volatile: Some(1),
                ecc_uncorrected_volatile: Some(1),
                ecc_corrected_aggregate: Some(1),
                ecc_uncorrected_aggregate: Some(1),
                retired_pages_single_bit: Some(1),
                retired_pages_double_bit: Some(1),
                retired_pages_pending: Some(false),
                pcie_tx_bytes_per_second: Some(1.0),
                pcie_rx_bytes_per_second: Some(1.0),
                pcie_replay_total: Some(1),
                nvlink_links: Some(2),
                nvlink_links_up: Some(2),
                nvlink_errors_total: Some(1),
                nvlink_rx_bytes: Some(1),
                nvlink_tx_bytes: Some(1),
                processes: Some(1),
                mig_enabled: Some(false),
                mig_instances: Some(0),
                xid_errors_total: Some(1),
                ecc_error_events_total: Some(1),
                ..GpuSample::default()
            },
        );
        latest.gpu_processes.push(GpuProcessSample {
            gpu: GpuIndex(0),
            rogue: true,
            ..GpuProcessSample::default()
        });
        latest.ib_ports.insert(
            ("mlx5_0".into(), 1),
            IbPortSample {
                device: "mlx5_0".into(),
                port: 1,
                state: Some("ACTIVE".into()),
                rate_gbps: Some(400.0),
                rx_bytes: Some(1),
                tx_bytes: Some(1),
                rx_packets: Some(1),
                tx_packets: Some(1),
                symbol_errors: Some(1),
                link_downed: Some(1),
                rx_errors: Some(1),
                tx_wait: Some(1),
                ..IbPortSample::default()
            },
        );
        latest.jobs.insert(
            "j".into(),
            JobSample {
                job: "j".into(),
                source: "proc".into(),
                cpu_seconds: Some(1.0),
                memory_bytes: Some(1),
                memory_peak_bytes: Some(1),
                processes: Some(1),
                gpu_memory_bytes: Some(1),
                ..JobSample::default()
            },
        );
        let mut s = Scrape::default();
        gpu(&mut s, "n1", &latest);
        ib_and_jobs(&mut s, "n1", &latest);
        let mut text = String::new();
        s.encode(&mut text);
        let text = super::super::to_classic_text(&text);
        assert!(
            text.contains("perch_gpu_rogue_processes{node=\"n1\",gpu=\"0\",simulated=\"false\"} 1"),
            "{text}"
        );
        let doc = include_str!("../../../docs/metrics.md");
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        assert_eq!(families.len(), 32, "{families:?}");
        for family in families {
            assert!(
                doc.contains(&format!("| `{family}` |")),
                "docs/metrics.md lacks {family}"
            );
        }
    }
}
