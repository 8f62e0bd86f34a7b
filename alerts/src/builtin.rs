//! The built-in rule pack, on by default and documented rule by rule in `alerts/README.md`
//! (a test keeps the two in step).
//!
//! Most built-ins are SQL over perch's tables, written here so they are reviewed like code and
//! thresholds come from `[alerts.builtin]`. Three are typed ([`BuiltinKind`]): a lost node
//! heartbeat, a node whose telemetry stopped while its agent syncs, and the store's own disk, which the server knows first-hand (control plane,
//! filesystem) and must be able to report even when the store cannot answer SQL. Every SQL
//! rule carries the rows' `simulated` flag as a label, so an alert built on simulated data
//! says so.

use crate::config::BuiltinConfig;
use crate::rules::{ActionSpec, BuiltinKind, DEFAULT_LABEL_COLUMNS, Rule, RuleSource, Severity};
use crate::xid::{XidClass, xid_class_sql};
use std::collections::BTreeMap;

mod typed;

pub use typed::{
    IdleJob, NodeHeartbeat, NodeTelemetry, StoreFlush, disk_instances, flush_instances,
    heartbeat_instances, idle_job_instances, job_db_instances, telemetry_instances,
};

/// Every built-in rule's name, in the order [`builtin_rules`] returns them.
pub const BUILTIN_RULE_NAMES: &[&str] = &[
    "NodeHeartbeatLost",
    "NodeTelemetryStopped",
    "XidRestartApp",
    "XidResetGpu",
    "XidReboot",
    "XidContactSupport",
    "XidUnclassified",
    "GpuEccUncorrectable",
    "GpuLost",
    "GpuThrottled",
    "GpuRogueProcess",
    "GpuAllocatedIdle",
    "JobNoProgress",
    "NicLinkDown",
    "NicErrorsRising",
    "IbPortDown",
    "IbErrorsRising",
    "StoreDiskFull",
    "StoreFlushFailing",
    "JobDatabaseFailing",
    "JobIdle",
    "JobStraggler",
];

/// `INTERVAL 'N seconds'` for a duration (at least one second).
fn interval(ms: i64) -> String {
    format!("INTERVAL '{} seconds'", (ms / 1000).max(1))
}

struct Spec {
    name: &'static str,
    source: RuleSource,
    for_ms: i64,
    severity: Severity,
    labels: &'static [(&'static str, &'static str)],
    summary: &'static str,
    description: &'static str,
    actions: Vec<ActionSpec>,
}

/// The built-in pack as configured: disabled rules left out, action overrides applied.
pub fn builtin_rules(cfg: &BuiltinConfig, interval_ms: i64) -> Vec<Rule> {
    specs(cfg)
        .into_iter()
        .filter(|s| !cfg.disable.iter().any(|d| d == s.name))
        .map(|s| Rule {
            name: s.name.to_owned(),
            source: s.source,
            for_ms: s.for_ms,
            keep_firing_for_ms: 0,
            severity: s.severity,
            labels: s
                .labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            summary: s.summary.to_owned(),
            description: s.description.to_owned(),
            interval_ms,
            actions: cfg.actions.get(s.name).cloned().unwrap_or(s.actions),
            label_columns: DEFAULT_LABEL_COLUMNS
                .iter()
                .map(|c| (*c).to_owned())
                .collect(),
            builtin: true,
        })
        .collect()
}

fn xid_rule(cfg: &BuiltinConfig, class: XidClass) -> String {
    format!(
        "SELECT node, gpu, xid, max(uuid) AS uuid, count(*) AS events, bool_or(simulated) AS simulated \
         FROM gpu_events \
         WHERE kind = 'xid' AND time > now() - {window} AND ({case}) = '{class}' \
         GROUP BY node, gpu, xid",
        window = interval(cfg.event_window.as_ms()),
        case = xid_class_sql("xid"),
        class = class.as_str(),
    )
}

fn specs(cfg: &BuiltinConfig) -> Vec<Spec> {
    use ActionSpec::{DrainNode, GpuOut, RequeueJobs};
    let window = interval(cfg.event_window.as_ms());
    let nic = &cfg.nic_devices;
    let recent = interval(5 * 60_000);
    let day = interval(86_400_000);
    let xid_summary = "XID {{ labels.xid }} on {{ labels.node }} GPU {{ labels.gpu }}";
    vec![
        Spec {
            name: "NodeHeartbeatLost",
            source: RuleSource::Builtin(BuiltinKind::NodeHeartbeatLost {
                timeout_ms: cfg.heartbeat_timeout.as_ms(),
            }),
            for_ms: 0,
            severity: Severity::Critical,
            labels: &[],
            summary: "{{ labels.node }} has not been heard from for {{ values.seconds_since_heartbeat }} s",
            description: "The agent on {{ labels.node }} stopped syncing with the server. The node may be down, \
                          partitioned or its agent stopped; its jobs are requeued by the scheduler. \
                          Other alerts of this node are muted while this one fires.",
            actions: Vec::new(),
        },
        Spec {
            name: "NodeTelemetryStopped",
            source: RuleSource::Builtin(BuiltinKind::NodeTelemetryStopped),
            for_ms: 0,
            severity: Severity::Critical,
            labels: &[],
            summary: "{{ labels.node }} syncs but has sent no telemetry for {{ values.seconds_since_sample }} s",
            description: "The agent on {{ labels.node }} keeps syncing with the server, yet no GPU, host or NIC \
                          sample from it has been stored for longer than server.node_stale_after_secs: its \
                          monitoring and accounting are blind while its jobs run. Look for warnings about \
                          duplicate batches in the server's and the agent's logs (a second agent under the \
                          same node name) and for send errors in the agent's log.",
            actions: Vec::new(),
        },
        Spec {
            name: "XidRestartApp",
            source: RuleSource::Sql(xid_rule(cfg, XidClass::RestartApp)),
            for_ms: 0,
            severity: Severity::Warning,
            labels: &[("xid_class", "restart_app")],
            summary: xid_summary,
            description: "NVIDIA classes XID {{ labels.xid }} as an application fault: restarting the \
                          application is enough. Repeated occurrences on one GPU point at the hardware.",
            actions: Vec::new(),
        },
        Spec {
            name: "XidResetGpu",
            source: RuleSource::Sql(xid_rule(cfg, XidClass::ResetGpu)),
            for_ms: 0,
            severity: Severity::Critical,
            labels: &[("xid_class", "reset_gpu")],
            summary: xid_summary,
            description: "NVIDIA classes XID {{ labels.xid }} as needing a GPU reset: the GPU cannot be \
                          trusted until it is reset. perch drains the node and requeues its jobs.",
            actions: vec![DrainNode, RequeueJobs],
        },
        Spec {
            name: "XidReboot",
            source: RuleSource::Sql(xid_rule(cfg, XidClass::Reboot)),
            for_ms: 0,
            severity: Severity::Critical,
            labels: &[("xid_class", "reboot")],
            summary: xid_summary,
            description: "NVIDIA classes XID {{ labels.xid }} as needing a reboot of the node (79: the GPU \
                          has fallen off the bus). perch drains the node and requeues its jobs.",
            actions: vec![DrainNode, RequeueJobs],
        },
        Spec {
            name: "XidContactSupport",
            source: RuleSource::Sql(xid_rule(cfg, XidClass::ContactSupport)),
            for_ms: 0,
            severity: Severity::Critical,
            labels: &[("xid_class", "contact_support")],
            summary: xid_summary,
            description: "NVIDIA lists XID {{ labels.xid }} as unexpected on this hardware: collect \
                          nvidia-bug-report.sh output and contact support.",
            actions: Vec::new(),
        },
        Spec {
            name: "XidUnclassified",
            source: RuleSource::Sql(xid_rule(cfg, XidClass::Unknown)),
            for_ms: 0,
            severity: Severity::Warning,
            labels: &[("xid_class", "unknown")],
            summary: xid_summary,
            description: "XID {{ labels.xid }} is not in NVIDIA's catalog as perch knows it (a newer \
                          driver?). Look it up in NVIDIA's XID catalog.",
            actions: Vec::new(),
        },
        Spec {
            name: "GpuEccUncorrectable",
            source: RuleSource::Sql(format!(
                "SELECT node, gpu, reason, count(*) AS events, bool_or(simulated) AS simulated FROM ( \
                   SELECT node, gpu, 'double_bit_ecc' AS reason, simulated FROM gpu_events \
                     WHERE kind = 'ecc_double_bit' AND time > now() - {window} \
                   UNION ALL \
                   SELECT node, gpu, 'row_remap_failure' AS reason, simulated FROM gpu_events \
                     WHERE kind = 'xid' AND xid = 64 AND time > now() - {window} \
                   UNION ALL \
                   SELECT node, gpu, 'retirement_pending' AS reason, simulated FROM gpu_samples \
                     WHERE retired_pages_pending AND time > now() - {recent} \
                 ) AS e GROUP BY node, gpu, reason"
            )),
            for_ms: 0,
            severity: Severity::Critical,
            labels: &[],
            summary: "Uncorrectable memory error on {{ labels.node }} GPU {{ labels.gpu }} ({{ labels.reason }})",
            description: "GPU {{ labels.gpu }} of {{ labels.node }} reported an uncorrectable ECC error, a \
                          failed row remap or page retirement, or retired pages waiting for a reset. \
                          perch takes the GPU out of scheduling; reset it to retire the pages.",
            actions: vec![GpuOut],
        },
        Spec {
            name: "GpuLost",
            source: RuleSource::Sql(format!(
                "SELECT node, gpu, reason, bool_or(simulated) AS simulated FROM ( \
                   SELECT node, gpu, 'lost' AS reason, simulated FROM ( \
                     SELECT node, gpu, bool_or(simulated) AS simulated, \
                            max(CASE WHEN kind = 'gpu_lost' THEN time END) AS lost_at, \
                            max(CASE WHEN kind = 'gpu_recovered' THEN time END) AS recovered_at \
                     FROM gpu_events \
                     WHERE kind IN ('gpu_lost', 'gpu_recovered') AND time > now() - {day} \
                     GROUP BY node, gpu \
                   ) AS ev WHERE lost_at IS NOT NULL AND (recovered_at IS NULL OR recovered_at < lost_at) \
                   UNION ALL \
                   SELECT g.node, g.gpu, 'not_reporting' AS reason, g.simulated FROM ( \
                     SELECT node, gpu, max(time) AS last_time, bool_or(simulated) AS simulated \
                     FROM gpu_samples WHERE time > now() - INTERVAL '3600 seconds' GROUP BY node, gpu \
                   ) AS g JOIN ( \
                     SELECT node FROM host_samples WHERE time > now() - INTERVAL '120 seconds' GROUP BY node \
                   ) AS h ON g.node = h.node \
                   WHERE g.last_time < now() - {recent} \
                 ) AS l GROUP BY node, gpu, reason"
            )),
            for_ms: 0,
            severity: Severity::Critical,
            labels: &[],
            summary: "{{ labels.node }} GPU {{ labels.gpu }} disappeared ({{ labels.reason }})",
            description: "GPU {{ labels.gpu }} of {{ labels.node }} fell off the bus or stopped reporting \
                          while its node still reports. perch drains the node and requeues its jobs; the \
                          node usually needs a reboot.",
            actions: vec![DrainNode, RequeueJobs],
        },
        Spec {
            name: "GpuThrottled",
            source: RuleSource::Sql(format!(
                "SELECT node, gpu, \
                   avg(CASE WHEN {throttled} THEN 100.0 ELSE 0.0 END) AS throttled_percent, \
                   max(temperature_celsius) AS temperature_celsius, max(power_watts) AS power_watts, \
                   bool_or(simulated) AS simulated \
                 FROM gpu_samples WHERE time > now() - INTERVAL '120 seconds' \
                 GROUP BY node, gpu \
                 HAVING avg(CASE WHEN {throttled} THEN 100.0 ELSE 0.0 END) >= 80",
                throttled = "(throttle_reason_names LIKE '%thermal%' OR throttle_reason_names LIKE '%hw_slowdown%' \
                             OR throttle_reason_names LIKE '%power_brake%')"
            )),
            for_ms: cfg.throttle_for.as_ms(),
            severity: Severity::Warning,
            labels: &[],
            summary: "{{ labels.node }} GPU {{ labels.gpu }} throttled (thermal or power) for {{ values.throttled_percent }}% of the last 2 minutes",
            description: "GPU {{ labels.gpu }} of {{ labels.node }} has been slowed by thermal or hardware \
                          power limits (not the normal software power cap) for a sustained time; \
                          temperature {{ values.temperature_celsius }} °C, power {{ values.power_watts }} W. \
                          Check cooling and power delivery.",
            actions: Vec::new(),
        },
        Spec {
            name: "GpuRogueProcess",
            source: RuleSource::Sql(
                "SELECT p.node, p.gpu, a.job, a.user_name AS \"user\", \
                   count(DISTINCT p.pid) AS processes, min(p.pid) AS first_pid, \
                   max(p.used_memory_bytes) AS used_memory_bytes, bool_or(p.simulated) AS simulated \
                 FROM gpu_processes p \
                 LEFT JOIN job_allocations a \
                   ON a.node = p.node AND a.gpu = p.gpu AND a.end_time IS NULL \
                 WHERE p.rogue AND p.time > now() - INTERVAL '30 seconds' \
                 GROUP BY p.node, p.gpu, a.job, a.user_name"
                    .to_owned(),
            ),
            for_ms: cfg.rogue_for.as_ms(),
            severity: Severity::Warning,
            labels: &[],
            summary: "{{ labels.node }} GPU {{ labels.gpu }}: a process outside job {{ labels.job }} runs on it",
            description: "{{ values.processes }} process(es) (pid {{ values.first_pid }} first) that job \
                          {{ labels.job }} of {{ labels.user }} did not start use GPU {{ labels.gpu }} of \
                          {{ labels.node }}, which the job holds: another job's process, or one started \
                          outside perch. It slows the job and holds GPU memory. perch places no new job \
                          on this GPU while it runs. Find it: SELECT * FROM gpu_processes WHERE rogue \
                          ORDER BY time DESC LIMIT 10.",
            actions: Vec::new(),
        },
        Spec {
            name: "GpuAllocatedIdle",
            source: RuleSource::Sql(format!(
                "SELECT a.node, a.gpu, a.job, a.user_name AS \"user\", a.account AS account, \
                   avg(s.utilization_gpu_pct) AS utilization_percent, bool_or(s.simulated) AS simulated \
                 FROM job_allocations a \
                 JOIN gpu_samples s ON s.node = a.node AND s.gpu = a.gpu \
                 WHERE a.end_time IS NULL AND a.start_time < now() - {recent} AND s.time > now() - {recent} \
                 GROUP BY a.node, a.gpu, a.job, a.user_name, a.account \
                 HAVING avg(s.utilization_gpu_pct) < {idle}",
                idle = cfg.idle_utilization_percent,
            )),
            for_ms: cfg.idle_for.as_ms(),
            severity: Severity::Info,
            labels: &[],
            summary: "Job {{ labels.job }} ({{ labels.user }}) holds {{ labels.node }} GPU {{ labels.gpu }} idle",
            description: "GPU {{ labels.gpu }} of {{ labels.node }} is allocated to job {{ labels.job }} of \
                          {{ labels.user }} (account {{ labels.account }}) but has averaged \
                          {{ values.utilization_percent }}% utilization for a long time.",
            actions: Vec::new(),
        },
        Spec {
            name: "JobNoProgress",
            source: RuleSource::Sql(format!(
                "SELECT node, job, reason, max(user_name) AS \"user\", bool_or(simulated) AS simulated FROM ( \
                   SELECT node, job, 'cpu_idle' AS reason, max(user_name) AS user_name, bool_or(simulated) AS simulated \
                   FROM job_samples WHERE time > now() - {window} \
                   GROUP BY node, job \
                   HAVING min(time) < now() - {covered} AND max(time) > now() - INTERVAL '120 seconds' \
                     AND max(cpu_seconds) - min(cpu_seconds) < 1 \
                   UNION ALL \
                   SELECT s.node, s.job, 'metrics_stalled' AS reason, max(s.user_name) AS user_name, bool_or(s.simulated) AS simulated \
                   FROM job_samples s JOIN ( \
                     SELECT job, max(time) AS last_metric FROM job_metrics \
                     WHERE time > now() - INTERVAL '21600 seconds' GROUP BY job \
                   ) AS m ON m.job = s.job \
                   WHERE s.time > now() - INTERVAL '120 seconds' AND m.last_metric < now() - {window} \
                   GROUP BY s.node, s.job \
                 ) AS p GROUP BY node, job, reason",
                window = interval(cfg.no_progress_for.as_ms()),
                covered = interval(cfg.no_progress_for.as_ms() * 4 / 5),
            )),
            for_ms: 0,
            severity: Severity::Warning,
            labels: &[],
            summary: "Job {{ labels.job }} on {{ labels.node }} shows no progress ({{ labels.reason }})",
            description: "Job {{ labels.job }} of {{ labels.user }} still runs on {{ labels.node }} but has \
                          used no CPU (cpu_idle) or pushed no metrics (metrics_stalled) for a long time. \
                          It may be hung on a collective or waiting on a dead peer.",
            actions: Vec::new(),
        },
        Spec {
            name: "NicLinkDown",
            source: RuleSource::Sql(format!(
                "SELECT n.node, n.device, bool_or(n.simulated) AS simulated FROM nic_samples n \
                 JOIN (SELECT node, device, max(time) AS last_time FROM nic_samples \
                       WHERE time > now() - {recent} GROUP BY node, device) AS l \
                   ON n.node = l.node AND n.device = l.device AND n.time = l.last_time \
                 JOIN (SELECT node, device FROM nic_samples \
                       WHERE link_up AND time > now() - {day} GROUP BY node, device) AS u \
                   ON n.node = u.node AND n.device = u.device \
                 WHERE NOT n.link_up AND n.device ~ '{nic}' \
                 GROUP BY n.node, n.device"
            )),
            for_ms: 60_000,
            severity: Severity::Warning,
            labels: &[],
            summary: "{{ labels.node }} link {{ labels.device }} is down",
            description: "Interface {{ labels.device }} of {{ labels.node }} was up within the last day and \
                          is down now. Multi-node jobs on this node will stall or fail.",
            actions: Vec::new(),
        },
        Spec {
            name: "NicErrorsRising",
            source: RuleSource::Sql(format!(
                "SELECT node, device, \
                   (max(rx_errors) - min(rx_errors)) + (max(tx_errors) - min(tx_errors)) AS errors, \
                   bool_or(simulated) AS simulated \
                 FROM nic_samples WHERE time > now() - {recent} AND device ~ '{nic}' \
                 GROUP BY node, device \
                 HAVING (max(rx_errors) - min(rx_errors)) + (max(tx_errors) - min(tx_errors)) >= {errors}",
                errors = cfg.link_errors,
            )),
            for_ms: 0,
            severity: Severity::Warning,
            labels: &[],
            summary: "{{ labels.node }} link {{ labels.device }}: {{ values.errors }} errors in 5 minutes",
            description: "Receive and transmit errors on {{ labels.device }} of {{ labels.node }} are rising \
                          ({{ values.errors }} in the last 5 minutes). Check the cable, transceiver and \
                          switch port.",
            actions: Vec::new(),
        },
        Spec {
            name: "IbPortDown",
            source: RuleSource::Sql(format!(
                "SELECT p.node, p.device, p.port, max(p.state) AS state, bool_or(p.simulated) AS simulated \
                 FROM ib_port_samples p \
                 JOIN (SELECT node, device, port, max(time) AS last_time FROM ib_port_samples \
                       WHERE time > now() - {recent} GROUP BY node, device, port) AS l \
                   ON p.node = l.node AND p.device = l.device AND p.port = l.port AND p.time = l.last_time \
                 JOIN (SELECT node, device, port FROM ib_port_samples \
                       WHERE state = 'ACTIVE' AND time > now() - {day} GROUP BY node, device, port) AS u \
                   ON p.node = u.node AND p.device = u.device AND p.port = u.port \
                 WHERE p.state <> 'ACTIVE' \
                 GROUP BY p.node, p.device, p.port"
            )),
            for_ms: 60_000,
            severity: Severity::Warning,
            labels: &[],
            summary: "{{ labels.node }} InfiniBand {{ labels.device }} port {{ labels.port }} is {{ labels.state }}",
            description: "InfiniBand port {{ labels.port }} of {{ labels.device }} on {{ labels.node }} was \
                          ACTIVE within the last day and is {{ labels.state }} now.",
            actions: Vec::new(),
        },
        Spec {
            name: "IbErrorsRising",
            source: RuleSource::Sql(format!(
                "SELECT node, device, port, \
                   (max(symbol_errors) - min(symbol_errors)) + (max(link_downed) - min(link_downed)) \
                     + (max(rx_errors) - min(rx_errors)) AS errors, \
                   bool_or(simulated) AS simulated \
                 FROM ib_port_samples WHERE time > now() - {recent} \
                 GROUP BY node, device, port \
                 HAVING (max(symbol_errors) - min(symbol_errors)) + (max(link_downed) - min(link_downed)) \
                     + (max(rx_errors) - min(rx_errors)) >= {errors}",
                errors = cfg.link_errors,
            )),
            for_ms: 0,
            severity: Severity::Warning,
            labels: &[],
            summary: "{{ labels.node }} InfiniBand {{ labels.device }} port {{ labels.port }}: {{ values.errors }} errors in 5 minutes",
            description: "Symbol errors, link-down events and receive errors on InfiniBand port \
                          {{ labels.port }} of {{ labels.device }} ({{ labels.node }}) are rising. Check the \
                          cable and the switch port.",
            actions: Vec::new(),
        },
        Spec {
            name: "StoreDiskFull",
            source: RuleSource::Builtin(BuiltinKind::StoreDiskFull {
                free_percent: cfg.disk_free_percent,
            }),
            for_ms: 0,
            severity: Severity::Critical,
            labels: &[],
            summary: "perch's store disk {{ labels.path }} is {{ values.free_percent }}% free",
            description: "The filesystem holding perch's data directory ({{ labels.path }}) has \
                          {{ values.free_bytes }} bytes free. When it fills, ingest fails and agents spool. \
                          Shorten retention or add space.",
            actions: Vec::new(),
        },
        Spec {
            name: "StoreFlushFailing",
            source: RuleSource::Builtin(BuiltinKind::StoreFlushFailing),
            for_ms: 0,
            severity: Severity::Critical,
            labels: &[],
            summary: "perch cannot write its data to Parquet: {{ values.failures }} flushes failed in a row",
            description: "The store's last {{ values.failures }} flushes failed ({{ labels.error }}). \
                          {{ values.held_rows }} rows wait in memory; at {{ values.limit_rows }} \
                          (server.max_buffered_rows) ingest is answered 503 and agents keep their data \
                          until a flush works. Free disk space or fix the bucket; flushes are retried \
                          with backoff up to every 5 minutes.",
            actions: Vec::new(),
        },
        Spec {
            name: "JobDatabaseFailing",
            source: RuleSource::Builtin(BuiltinKind::JobDatabaseFailing),
            for_ms: 0,
            severity: Severity::Critical,
            labels: &[],
            summary: "perch's job database cannot commit: job operations are refused",
            description: "A commit to the job database failed ({{ labels.error }}). Submissions, \
                          cancels and listings are answered 503 job_db_unavailable and /readyz is \
                          not ready; agents' leases are still renewed, so running jobs go on. perch \
                          reopens the database by itself once its disk has room: free space on the \
                          data directory's filesystem.",
            actions: Vec::new(),
        },
        Spec {
            name: "JobIdle",
            source: RuleSource::Builtin(BuiltinKind::JobIdle),
            for_ms: 0,
            severity: Severity::Warning,
            labels: &[],
            summary: "Job {{ labels.job }} of {{ labels.user }} has held its GPUs idle for {{ values.minutes_idle }} min",
            description: "Every GPU of job {{ labels.job }} (user {{ labels.user }}, account {{ labels.account }}, \
                          on {{ labels.nodes }}) has stayed under the [scheduler.idle] threshold since \
                          {{ labels.idle_since }}. {{ labels.consequence }} Route this alert to the job's owner \
                          by its user label.",
            actions: Vec::new(),
        },
        Spec {
            name: "JobStraggler",
            source: RuleSource::Sql(
                "SELECT job, node, gpu, rank, max(user_name) AS \"user\", count(*) AS measures_behind, \
                   round(100 * min(ratio)) AS worst_percent, \
                   round(100 * coalesce(max(slowdown_share), 0)) AS slowdown_percent, \
                   max(gang_size) AS gang_size, \
                   min(CASE WHEN metric = 'sm_clock_mhz' THEN ratio END) AS sm_clock_ratio, \
                   min(CASE WHEN metric = 'power_watts' THEN ratio END) AS power_ratio, \
                   min(CASE WHEN metric = 'utilization_gpu_pct' THEN ratio END) AS utilization_ratio, \
                   bool_or(simulated) AS simulated \
                 FROM ( \
                   SELECT job, node, coalesce(CAST(gpu AS VARCHAR), 'all') AS gpu, \
                     coalesce(CAST(rank AS VARCHAR), 'node ' || CAST(node_rank AS VARCHAR)) AS rank, \
                     user_name, metric, ratio, slowdown_share, gang_size, simulated \
                   FROM job_stragglers \
                 ) AS s GROUP BY job, node, gpu, rank"
                    .to_owned(),
            ),
            for_ms: 0,
            severity: Severity::Warning,
            labels: &[],
            summary: "Job {{ labels.job }}: rank {{ labels.rank }} ({{ labels.node }} GPU {{ labels.gpu }}) is behind its gang",
            description: "Rank {{ labels.rank }} of job {{ labels.job }} ({{ labels.user }}), GPU {{ labels.gpu }} of \
                          {{ labels.node }}, has run below 85% of its gang's median for the last minute on \
                          {{ values.measures_behind }} measure(s), at worst {{ values.worst_percent }}% of it; \
                          slowdown throttling (thermal, hardware slowdown, power brake) in \
                          {{ values.slowdown_percent }}% of its samples. A gang moves at its slowest rank's \
                          pace. The evidence, measure by measure: SELECT * FROM job_stragglers WHERE job = \
                          {{ labels.job }}. To drain the node (its jobs finish), or drain it and requeue the \
                          job elsewhere, set [alerts.builtin.actions] JobStraggler = [\"drain_node\"] or \
                          [\"drain_node\", \"requeue_jobs\"].",
            actions: Vec::new(),
        },
    ]
}

/// The label set of a built-in rule's alerts, by name, for documentation checks.
pub fn builtin_summary(cfg: &BuiltinConfig) -> BTreeMap<&'static str, (Severity, Vec<ActionSpec>)> {
    specs(cfg)
        .into_iter()
        .map(|s| (s.name, (s.severity, s.actions)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_list_matches_the_pack() {
        let names: Vec<String> = builtin_rules(&BuiltinConfig::default(), 30_000)
            .into_iter()
            .map(|r| r.name)
            .collect();
        assert_eq!(names, BUILTIN_RULE_NAMES);
    }

    #[test]
    fn disable_and_action_overrides_apply() {
        let cfg = BuiltinConfig {
            disable: vec!["GpuAllocatedIdle".into()],
            actions: BTreeMap::from([("XidReboot".to_string(), vec![ActionSpec::DrainNode])]),
            ..BuiltinConfig::default()
        };
        let rules = builtin_rules(&cfg, 30_000);
        assert!(rules.iter().all(|r| r.name != "GpuAllocatedIdle"));
        let reboot = rules
            .iter()
            .find(|r| r.name == "XidReboot")
            .expect("XidReboot");
        assert_eq!(reboot.actions, vec![ActionSpec::DrainNode]);
        let reset = rules
            .iter()
            .find(|r| r.name == "XidResetGpu")
            .expect("XidResetGpu");
        assert_eq!(
            reset.actions,
            vec![ActionSpec::DrainNode, ActionSpec::RequeueJobs]
        );
    }

    #[test]
    fn xid_rules_filter_on_their_class_with_the_generated_case() {
        let rules = builtin_rules(&BuiltinConfig::default(), 30_000);
        let reboot = rules
            .iter()
            .find(|r| r.name == "XidReboot")
            .expect("XidReboot");
        let RuleSource::Sql(sql) = &reboot.source else {
            panic!("XidReboot is SQL")
        };
        assert!(sql.contains(&xid_class_sql("xid")), "{sql}");
        assert!(sql.contains("= 'reboot'"), "{sql}");
        assert!(sql.contains("INTERVAL '600 seconds'"), "{sql}");
    }

    #[test]
    fn heartbeat_lost_after_the_timeout_only() {
        let kind = BuiltinKind::NodeHeartbeatLost { timeout_ms: 60_000 };
        let nodes = [
            NodeHeartbeat {
                node: "fresh",
                last_seen_ms: Some(100_000),
            },
            NodeHeartbeat {
                node: "edge",
                last_seen_ms: Some(40_000),
            },
            NodeHeartbeat {
                node: "silent",
                last_seen_ms: Some(10_000),
            },
            NodeHeartbeat {
                node: "never",
                last_seen_ms: None,
            },
        ];
        let got = heartbeat_instances(&kind, &nodes, 100_000);
        let names: Vec<&str> = got.iter().map(|i| i.labels["node"].as_str()).collect();
        assert_eq!(names, ["silent", "never"]);
        assert_eq!(got[0].values["seconds_since_heartbeat"], 90.0);
        assert!(got[1].values.is_empty());
    }

    #[test]
    fn disk_full_below_the_threshold() {
        let kind = BuiltinKind::StoreDiskFull { free_percent: 10.0 };
        assert!(disk_instances(&kind, "/data", 200, 1000).is_empty());
        assert!(disk_instances(&kind, "/data", 100, 1000).is_empty());
        let got = disk_instances(&kind, "/data", 55, 1000);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].labels["path"], "/data");
        assert_eq!(got[0].values["free_percent"], 5.5);
        assert!(disk_instances(&kind, "/data", 0, 0).is_empty());
    }
}
