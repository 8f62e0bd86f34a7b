//! Fleet series beyond the node's own: rogue processes, InfiniBand ports and jobs. Jobs are exported per job (bounded by the jobs
//! running now, and gone when they end); `perch_job_info` joins a job to its user and GPUs, so
//! no per-GPU series carries a job label.

use super::{Labels, Scrape, catalogued, flag};
use crate::latest::NodeLatest;
use perch_model::catalogue;

fn with(l: &Labels, extra: &[(&'static str, &str)]) -> Labels {
    let mut out = l.clone();
    out.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
    out
}

/// Each GPU's rogue processes: processes on it that are not its job's (the catalogued GPU
/// columns are written by [`super::catalogued`]).
pub(super) fn gpu(s: &mut Scrape, node: &str, latest: &NodeLatest) {
    for g in latest.gpus.values() {
        if g.processes.is_none() {
            continue;
        }
        let l: Labels = vec![
            ("node", node.to_owned()),
            ("gpu", g.gpu.to_string()),
            ("simulated", flag(g.simulated)),
        ];
        let rogue = latest
            .gpu_processes
            .iter()
            .filter(|p| p.gpu == g.gpu && p.rogue)
            .count();
        s.gauge(
            "perch_gpu_rogue_processes",
            "Processes on the GPU that are not its job's (the GPU is not allocated to their job)",
            &l,
            Some(rogue as f64),
        );
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
        catalogued(s, catalogue::IB_PORT, p, &l);
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
        catalogued(s, catalogue::JOB, j, &l);
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
    use std::collections::{BTreeMap, BTreeSet};

    /// A node with every optional value set exports every family above, and each is in
    /// docs/metrics.md.
    #[test]
    fn every_family_is_exported_and_documented() {
        let mut latest = NodeLatest::default();
        // Every catalogued value set: a fixture built from the catalogue.
        latest.gpus.insert(
            0,
            GpuSample {
                time_ms: 1,
                uuid: "GPU-1".into(),
                model: "X".into(),
                ..catalogue::every_value_set(catalogue::GPU)
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
        super::super::fleet(&mut s, &BTreeMap::from([("n1".to_owned(), latest)]));
        let mut text = String::new();
        s.encode(&mut text);
        let text = super::super::to_classic_text(&text);
        assert!(
            text.contains("perch_gpu_rogue_processes{node=\"n1\",gpu=\"0\",simulated=\"false\"} 1"),
            "{text}"
        );
        let doc = include_str!("../../../docs/metrics.md");
        let families: BTreeSet<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        fn series<R>(columns: &[catalogue::Column<R>]) -> impl Iterator<Item = &'static str> + '_ {
            columns
                .iter()
                .filter_map(|c| c.series.as_ref().map(|s| s.name))
        }
        let expected: BTreeSet<&str> = series(catalogue::GPU)
            .chain(series(catalogue::IB_PORT))
            .chain(series(catalogue::JOB))
            .chain([
                "perch_gpu_info",
                "perch_gpu_rogue_processes",
                "perch_job_info",
                "perch_node_gpus",
                "perch_node_last_seen_timestamp_seconds",
            ])
            .collect();
        assert_eq!(families, expected);
        for family in families {
            assert!(
                doc.contains(&format!("| `{family}` |")),
                "docs/metrics.md lacks {family}"
            );
        }
    }

    mod probe {
        perch_model::probe_gpu_catalogue!();
    }

    /// One line more in the GPU catalogue is exported as its line says, and every other line
    /// renders exactly as from the real catalogue: `/metrics` has no list of GPU series of its
    /// own (nor the agent's, which renders the same lines).
    #[test]
    fn a_gpu_line_alone_is_exported() {
        let labels: Labels = vec![
            ("node", "n1".to_owned()),
            ("gpu", "0".to_owned()),
            ("simulated", "false".to_owned()),
        ];
        let render = |write: &dyn Fn(&mut Scrape)| {
            let mut s = Scrape::default();
            write(&mut s);
            let mut text = String::new();
            s.encode(&mut text);
            text
        };
        let real: GpuSample = catalogue::every_value_set(catalogue::GPU);
        let probed = probe::GpuSample {
            probe_rollovers_total: Some(42),
            ..catalogue::every_value_set(probe::GPU)
        };
        let real = render(&|s| catalogued(s, catalogue::GPU, &real, &labels));
        let probed = render(&|s| catalogued(s, probe::GPU, &probed, &labels));
        let added = "# HELP perch_gpu_probe_rollovers PCIe replay counter rollovers (a test-only line).\n\
             # TYPE perch_gpu_probe_rollovers counter\n\
             perch_gpu_probe_rollovers_total{node=\"n1\",gpu=\"0\",simulated=\"false\"} 42.0\n";
        assert!(probed.contains(added), "{probed}");
        assert_eq!(probed.replace(added, ""), real);
    }
}
