//! The last sample of every GPU, host, NIC and InfiniBand port, and the jobs and GPU processes
//! of each node's latest round, kept for the Prometheus endpoint so a scrape never has to query
//! the store. Jobs and processes older than the node's latest host sample are dropped, so a job
//! that ended stops being exported.

use perch_model::{
    Batch, GpuProcessSample, GpuSample, HostSample, IbPortSample, JobMetricSample, JobSample,
    NicSample,
};
use std::collections::BTreeMap;
use std::sync::RwLock;

/// Latest values of one node.
#[derive(Debug, Clone, Default)]
pub struct NodeLatest {
    /// Server time (Unix ms) the node's last batch arrived.
    pub last_seen_ms: i64,
    pub host: Option<HostSample>,
    pub gpus: BTreeMap<u32, GpuSample>,
    pub nics: BTreeMap<String, NicSample>,
    pub ib_ports: BTreeMap<(String, u32), IbPortSample>,
    pub jobs: BTreeMap<String, JobSample>,
    /// The processes on the node's GPUs in its latest round.
    pub gpu_processes: Vec<GpuProcessSample>,
}

/// A metric a job pushed over OpenTelemetry, identified by job, metric and attributes.
pub type JobMetricKey = (String, String, String);

/// How long a pushed metric stays exported without a new data point: a job that ended (or
/// stopped exporting) drops out instead of leaving a stale value behind.
pub const JOB_METRIC_STALE_MS: i64 = 5 * 60_000;

/// Most series (metric and attributes) one job exports on `/metrics`. Points of more are
/// still stored (the `job_metrics` table has them all) but not exported, and counted: one job
/// pushing a new attribute value each step would otherwise grow every scrape without bound.
pub const MAX_SERIES_PER_JOB: usize = 200;

#[derive(Debug, Default)]
pub struct Latest {
    nodes: RwLock<BTreeMap<String, NodeLatest>>,
    /// The newest data point of every metric jobs push, with the server time it arrived.
    job_metrics: RwLock<BTreeMap<JobMetricKey, (JobMetricSample, i64)>>,
    /// Points not exported because their job already had [`MAX_SERIES_PER_JOB`] series.
    pub job_series_dropped: std::sync::atomic::AtomicU64,
}

impl Latest {
    /// Records the newest sample of each GPU, host and NIC in `batch`.
    pub fn update(&self, batch: &Batch, now_ms: i64) {
        let mut nodes = self.nodes.write().unwrap_or_else(|p| p.into_inner());
        let node = nodes.entry(batch.node.as_str().to_owned()).or_default();
        node.last_seen_ms = now_ms;
        for h in &batch.hosts {
            if node
                .host
                .as_ref()
                .is_none_or(|old| old.time_ms <= h.time_ms)
            {
                node.host = Some(h.clone());
            }
        }
        for g in &batch.gpus {
            let slot = node.gpus.entry(g.gpu.0);
            match slot {
                std::collections::btree_map::Entry::Occupied(mut o)
                    if o.get().time_ms <= g.time_ms =>
                {
                    o.insert(g.clone());
                }
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(g.clone());
                }
                std::collections::btree_map::Entry::Occupied(_) => {}
            }
        }
        for n in &batch.nics {
            let newer = node
                .nics
                .get(&n.device)
                .is_none_or(|old| old.time_ms <= n.time_ms);
            if newer {
                node.nics.insert(n.device.clone(), n.clone());
            }
        }
        for p in &batch.ib_ports {
            let key = (p.device.clone(), p.port);
            if node
                .ib_ports
                .get(&key)
                .is_none_or(|old| old.time_ms <= p.time_ms)
            {
                node.ib_ports.insert(key, p.clone());
            }
        }
        for j in &batch.jobs {
            if node
                .jobs
                .get(&j.job)
                .is_none_or(|old| old.time_ms <= j.time_ms)
            {
                node.jobs.insert(j.job.clone(), j.clone());
            }
        }
        node.gpu_processes
            .extend(batch.gpu_processes.iter().cloned());
        // Keep only the latest round's jobs and processes: a round always has a host sample.
        let round = node
            .host
            .as_ref()
            .map(|h| h.time_ms)
            .into_iter()
            .chain(node.gpu_processes.iter().map(|p| p.time_ms))
            .max()
            .unwrap_or(i64::MIN);
        node.jobs.retain(|_, j| j.time_ms >= round);
        node.gpu_processes.retain(|p| p.time_ms >= round);
    }

    /// Records the newest data point of each pushed job metric in `samples`.
    pub fn update_job_metrics(&self, samples: &[JobMetricSample], now_ms: i64) {
        let mut metrics = self.job_metrics.write().unwrap_or_else(|p| p.into_inner());
        for m in samples {
            let key = (m.job.clone(), m.metric.clone(), m.attributes.clone());
            match metrics.get(&key) {
                Some((old, _)) if old.time_ms > m.time_ms => {}
                Some(_) => {
                    metrics.insert(key, (m.clone(), now_ms));
                }
                None => {
                    let series = metrics
                        .range((m.job.clone(), String::new(), String::new())..)
                        .take_while(|((job, _, _), _)| *job == m.job)
                        .count();
                    if series >= MAX_SERIES_PER_JOB {
                        self.job_series_dropped
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    } else {
                        metrics.insert(key, (m.clone(), now_ms));
                    }
                }
            }
        }
        metrics.retain(|_, (_, seen)| now_ms - *seen <= JOB_METRIC_STALE_MS);
    }

    /// The pushed job metrics that are not stale as of `now_ms`.
    pub fn job_metrics(&self, now_ms: i64) -> Vec<JobMetricSample> {
        self.job_metrics
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|(_, seen)| now_ms - *seen <= JOB_METRIC_STALE_MS)
            .map(|(m, _)| m.clone())
            .collect()
    }

    /// A copy of every node's latest values.
    /// When each node's last telemetry batch arrived (server clock, Unix ms).
    pub fn last_seen(&self) -> BTreeMap<String, i64> {
        let nodes = self.nodes.read().unwrap_or_else(|p| p.into_inner());
        nodes
            .iter()
            .map(|(k, v)| (k.clone(), v.last_seen_ms))
            .collect()
    }

    /// `f` over every node's latest values, under the read lock: for a reader that needs a
    /// few fields of a thousand nodes without copying them all.
    pub fn read<R>(&self, f: impl FnOnce(&BTreeMap<String, NodeLatest>) -> R) -> R {
        f(&self.nodes.read().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn snapshot(&self) -> BTreeMap<String, NodeLatest> {
        self.nodes.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_job_exports_at_most_its_share_of_series() {
        let latest = Latest::default();
        let point = |job: &str, step: usize| JobMetricSample {
            job: job.into(),
            metric: "loss".into(),
            attributes: format!("{{\"step\":{step}}}"),
            time_ms: 1,
            value: Some(0.5),
            ..JobMetricSample::default()
        };
        let flood: Vec<_> = (0..MAX_SERIES_PER_JOB + 50)
            .map(|i| point("7", i))
            .collect();
        latest.update_job_metrics(&flood, 1_000);
        latest.update_job_metrics(&[point("8", 0)], 1_000);
        let exported = latest.job_metrics(1_000);
        assert_eq!(
            exported.iter().filter(|m| m.job == "7").count(),
            MAX_SERIES_PER_JOB
        );
        assert_eq!(
            exported.iter().filter(|m| m.job == "8").count(),
            1,
            "others unaffected"
        );
        assert_eq!(
            latest
                .job_series_dropped
                .load(std::sync::atomic::Ordering::Relaxed),
            50
        );
        // A series already exported keeps updating.
        let mut newer = point("7", 0);
        newer.time_ms = 2;
        newer.value = Some(0.25);
        latest.update_job_metrics(&[newer], 1_000);
        assert!(
            latest
                .job_metrics(1_000)
                .iter()
                .any(|m| m.job == "7" && m.value == Some(0.25))
        );
    }
}
