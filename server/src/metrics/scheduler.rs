//! Series of the scheduler and its queue: GPU capacity by state, node states, jobs by state,
//! what waits and why, and which job holds which GPU (`perch_job_gpu_info`, the series to join
//! GPU telemetry with jobs, users and accounts instead of a job label on every GPU series).

use super::{Labels, Scrape};
use perch_control::ControlSnapshot;
use std::collections::BTreeMap;

pub(super) fn scheduler(s: &mut Scrape, snap: &ControlSnapshot) {
    let none: Labels = Vec::new();
    s.counter(
        "perch_scheduling_passes",
        "Scheduling passes over the queue run (after a submission, a sync's report, a tick)",
        &none,
        Some(snap.passes.count as f64),
    );
    s.counter(
        "perch_scheduling_pass_seconds",
        "Time in scheduling passes, in all (with perch_scheduling_passes_total: the mean)",
        &none,
        Some(snap.passes.total.as_secs_f64()),
    );
    s.gauge(
        "perch_scheduling_pass_seconds_max",
        "The slowest scheduling pass since the server started",
        &none,
        Some(snap.passes.max.as_secs_f64()),
    );
    let mut capacity: BTreeMap<&str, u32> = ["allocated", "idle", "drained", "down"]
        .into_iter()
        .map(|k| (k, 0))
        .collect();
    for n in &snap.nodes {
        let node: Labels = vec![("node", n.name.clone())];
        s.gauge(
            "perch_node_gpus_allocated",
            "GPUs of the node held by running jobs",
            &node,
            Some(f64::from(n.allocated)),
        );
        *capacity.entry("allocated").or_default() += n.allocated;
        let free = n.gpus.saturating_sub(n.allocated);
        let bucket = if n.liveness.down {
            "down"
        } else if n.liveness.drained {
            "drained"
        } else {
            "idle"
        };
        *capacity.entry(bucket).or_default() += free;
    }
    for (state, gpus) in capacity {
        s.gauge(
            "perch_cluster_gpus",
            "GPUs of the cluster by state: allocated, idle (up and free), drained (free on a drained node), down",
            &vec![("state", state.to_owned())],
            Some(f64::from(gpus)),
        );
    }
    for (state, count) in &snap.jobs_by_state {
        s.gauge(
            "perch_jobs",
            "jobs the server knows, by state",
            &vec![("state", (*state).to_owned())],
            Some(*count as f64),
        );
    }
    // The queue, per account and reason: counts, requested GPUs and the longest wait.
    let mut queue: BTreeMap<(&str, &str), (u64, u64, f64)> = BTreeMap::new();
    for p in &snap.pending {
        let e = queue.entry((&p.account, p.reason)).or_default();
        e.0 += 1;
        e.1 += u64::from(p.gpus);
        e.2 = e.2.max(p.wait_secs);
    }
    for ((account, reason), (jobs, gpus, wait)) in queue {
        let l: Labels = vec![
            ("account", account.to_owned()),
            ("reason", reason.to_owned()),
        ];
        s.gauge(
            "perch_queue_jobs",
            "pending jobs by account and the reason they wait",
            &l,
            Some(jobs as f64),
        );
        s.gauge(
            "perch_queue_gpus",
            "GPUs requested by pending jobs, by account and reason",
            &l,
            Some(gpus as f64),
        );
        s.gauge(
            "perch_queue_wait_seconds_max",
            "longest time a pending job of the account has waited, by reason",
            &l,
            Some(wait),
        );
    }
    for a in &snap.allocations {
        s.gauge(
            "perch_job_gpu_info",
            "1 for each GPU a running job holds: joins GPU series (on node, gpu) to the job, its user and account",
            &vec![
                ("node", a.node.clone()),
                ("gpu", a.gpu.to_string()),
                ("job_id", a.job.to_string()),
                ("job_name", a.name.clone()),
                ("user", a.user.clone()),
                ("account", a.account.clone()),
            ],
            Some(1.0),
        );
    }
}

/// GPU-seconds and cost per account and user: counters over every job so far (running jobs
/// add as they run), the same accounting as the `jobs` and `account_usage` tables.
pub(super) fn usage(s: &mut Scrape, usage: &[perch_control::UsageView]) {
    for u in usage {
        let l = |basis: &str| -> Labels {
            vec![
                ("account", u.account.clone()),
                ("user", u.user.clone()),
                ("basis", basis.to_owned()),
            ]
        };
        for (basis, seconds) in [
            ("allocated", u.gpu_seconds_allocated),
            ("accounted", u.gpu_seconds_accounted),
            ("used", u.gpu_seconds_used),
        ] {
            s.counter(
                "perch_account_gpu_seconds",
                "GPU-seconds by account and user: allocated (to now), accounted (allocated, within the telemetry folded so far), or used (accounted x measured utilization); efficiency is used / accounted",
                &l(basis),
                Some(seconds),
            );
        }
        for (basis, cost) in [
            ("allocation", u.cost_allocated),
            ("accounted", u.cost_accounted),
            ("use", u.cost_used),
            ("idle", u.cost_idle()),
        ] {
            s.counter(
                "perch_account_cost",
                "Cost by account and user, in the configured currency: by allocation (to now), accounted (by allocation within the telemetry folded so far), by use, and idle (accounted minus used)",
                &l(basis),
                Some(cost),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use perch_control::{AllocationView, NodeView, PendingView};

    #[test]
    fn capacity_adds_up_and_every_family_is_documented() {
        let snap = ControlSnapshot {
            nodes: vec![
                NodeView {
                    name: "a".into(),
                    liveness: perch_model::AgentLiveness {
                        down: false,
                        drained: false,
                        reporting_since_ms: 0,
                    },
                    gpus: 8,
                    allocated: 3,
                    running_jobs: 1,
                    last_sync_ms: 0,
                },
                NodeView {
                    name: "b".into(),
                    liveness: perch_model::AgentLiveness {
                        down: false,
                        drained: true,
                        reporting_since_ms: 0,
                    },
                    gpus: 8,
                    allocated: 2,
                    running_jobs: 1,
                    last_sync_ms: 0,
                },
                NodeView {
                    name: "c".into(),
                    liveness: perch_model::AgentLiveness {
                        down: true,
                        drained: false,
                        reporting_since_ms: 0,
                    },
                    gpus: 4,
                    allocated: 0,
                    running_jobs: 1,
                    last_sync_ms: 0,
                },
            ],
            jobs_by_state: [("pending", 2), ("running", 1)].into_iter().collect(),
            pending: vec![
                PendingView {
                    account: "nlp".into(),
                    reason: "resources",
                    gpus: 8,
                    wait_secs: 30.0,
                },
                PendingView {
                    account: "nlp".into(),
                    reason: "resources",
                    gpus: 4,
                    wait_secs: 90.0,
                },
            ],
            allocations: vec![AllocationView {
                job: 7,
                name: "train".into(),
                user: "ana".into(),
                account: "nlp".into(),
                node: "a".into(),
                gpu: 0,
            }],
            passes: perch_control::PassStats {
                count: 3,
                total: std::time::Duration::from_millis(6),
                max: std::time::Duration::from_millis(4),
            },
        };
        let mut s = Scrape::default();
        scheduler(&mut s, &snap);
        let mut text = String::new();
        s.encode(&mut text);
        let text = super::super::to_classic_text(&text);
        for line in [
            "perch_scheduling_passes_total 3",
            "perch_scheduling_pass_seconds_total 0.006",
            "perch_scheduling_pass_seconds_max 0.004",
            "perch_cluster_gpus{state=\"allocated\"} 5",
            "perch_cluster_gpus{state=\"idle\"} 5",
            "perch_cluster_gpus{state=\"drained\"} 6",
            "perch_cluster_gpus{state=\"down\"} 4",
            "perch_queue_jobs{account=\"nlp\",reason=\"resources\"} 2",
            "perch_queue_gpus{account=\"nlp\",reason=\"resources\"} 12",
            "perch_queue_wait_seconds_max{account=\"nlp\",reason=\"resources\"} 90",
            "perch_job_gpu_info{node=\"a\",gpu=\"0\",job_id=\"7\",job_name=\"train\",user=\"ana\",account=\"nlp\"} 1",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
        let doc = include_str!("../../../docs/metrics.md");
        for family in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let family = family.split(' ').next().unwrap_or_default();
            assert!(
                doc.contains(&format!("| `{family}` |")),
                "docs/metrics.md lacks {family}"
            );
        }
    }
}
