//! The telemetry an agent sends: one [`Batch`] holds every sample a node took in one or more
//! sampling rounds.
//!
//! Every measured value is an `Option`: a metric the hardware does not support is absent (`null`
//! in SQL), never a made-up zero. Counters (`*_total`, energy, CPU seconds) are cumulative as the
//! kernel or NVML reports them; rates are computed at query time.
//!
//! Every sample carries `simulated`: true when the value came from perch's GPU or cluster
//! simulator rather than from hardware, so simulated data can never pass for real data.

pub use crate::catalogue::GpuSample;
use crate::{
    GpuEvent, GpuProcessSample, IbPortSample, JobMetricSample, JobSample, NodeId, catalogue,
};
use serde::{Deserialize, Serialize};

/// The largest number of samples (of all kinds) one batch may hold.
pub const MAX_SAMPLES_PER_BATCH: usize = 100_000;

/// How far in the future (by the server's clock) a sample's time may be before the batch is
/// refused: a node whose clock runs ahead this much would corrupt time-ordered queries.
pub const MAX_TIME_SKEW_MS: i64 = 5 * 60 * 1000;

/// Earliest sample time accepted: 2000-01-01T00:00:00Z. Anything older is a unit mistake
/// (seconds sent as milliseconds, say).
const MIN_TIME_MS: i64 = 946_684_800_000;

/// What an agent sends to `POST /v1/ingest`.
///
/// `(node, seq)` identifies a batch: the server acknowledges a batch once it is durable and
/// ignores any batch whose `seq` is not above the last one it accepted from that node, so an
/// agent may resend after a timeout without anything being counted twice. Agents start their
/// sequence at the current Unix time in microseconds, so it keeps rising across agent restarts
/// without any state on disk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Batch {
    pub node: NodeId,
    pub seq: u64,
    #[serde(default)]
    pub hosts: Vec<HostSample>,
    #[serde(default)]
    pub gpus: Vec<GpuSample>,
    #[serde(default)]
    pub nics: Vec<NicSample>,
    /// XID, ECC and lost-GPU events seen since the previous round.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_events: Vec<GpuEvent>,
    /// Processes on each GPU, with the job they belong to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_processes: Vec<GpuProcessSample>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ib_ports: Vec<IbPortSample>,
    /// Resource use of each job running on the node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub jobs: Vec<JobSample>,
    /// Metrics jobs pushed over OpenTelemetry (the server's OTLP receiver fills this; agents
    /// leave it empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub job_metrics: Vec<JobMetricSample>,
}

/// The host (CPU, memory, disk) at one instant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSample {
    pub time_ms: i64,
    pub simulated: bool,
    /// Cumulative CPU seconds over all cores, by mode, as `/proc/stat` counts them.
    #[serde(default)]
    pub cpu_user_seconds: Option<f64>,
    #[serde(default)]
    pub cpu_nice_seconds: Option<f64>,
    #[serde(default)]
    pub cpu_system_seconds: Option<f64>,
    #[serde(default)]
    pub cpu_idle_seconds: Option<f64>,
    #[serde(default)]
    pub cpu_iowait_seconds: Option<f64>,
    #[serde(default)]
    pub cpu_irq_seconds: Option<f64>,
    #[serde(default)]
    pub cpu_softirq_seconds: Option<f64>,
    #[serde(default)]
    pub cpu_steal_seconds: Option<f64>,
    #[serde(default)]
    pub cpu_count: Option<u32>,
    #[serde(default)]
    pub memory_total_bytes: Option<u64>,
    #[serde(default)]
    pub memory_available_bytes: Option<u64>,
    #[serde(default)]
    pub load1: Option<f64>,
    #[serde(default)]
    pub load5: Option<f64>,
    #[serde(default)]
    pub load15: Option<f64>,
    /// Free and total bytes of the filesystem holding the agent's data directory.
    #[serde(default)]
    pub disk_free_bytes: Option<u64>,
    #[serde(default)]
    pub disk_total_bytes: Option<u64>,
    #[serde(default)]
    pub uptime_seconds: Option<f64>,
}

/// One network interface at one instant. Counters are cumulative since boot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicSample {
    pub time_ms: i64,
    pub device: String,
    pub simulated: bool,
    #[serde(default)]
    pub rx_bytes: Option<u64>,
    #[serde(default)]
    pub rx_packets: Option<u64>,
    #[serde(default)]
    pub rx_errors: Option<u64>,
    #[serde(default)]
    pub rx_dropped: Option<u64>,
    #[serde(default)]
    pub tx_bytes: Option<u64>,
    #[serde(default)]
    pub tx_packets: Option<u64>,
    #[serde(default)]
    pub tx_errors: Option<u64>,
    #[serde(default)]
    pub tx_dropped: Option<u64>,
    /// Operational state is up (`/sys/class/net/<dev>/operstate`).
    #[serde(default)]
    pub link_up: Option<bool>,
    #[serde(default)]
    pub speed_mbps: Option<u64>,
}

/// Why a batch was refused. The message names the field and says what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BatchError {
    #[error("field `node`: {0}")]
    Node(String),
    #[error(
        "batch holds {count} samples; the limit is {MAX_SAMPLES_PER_BATCH}: send smaller batches"
    )]
    TooLarge { count: usize },
    #[error(
        "batch holds no samples: send at least one of `hosts`, `gpus`, `nics`, `gpu_events`, `gpu_processes`, `ib_ports`, `jobs`, `job_metrics`"
    )]
    Empty,
    #[error("{field}: {message}")]
    Field { field: String, message: String },
}

pub(crate) fn field_error(field: impl Into<String>, message: impl Into<String>) -> BatchError {
    BatchError::Field {
        field: field.into(),
        message: message.into(),
    }
}

// The checks take the field's name as a closure, called only for an error: building every
// sample's names (`gpus[17].uuid`) for every batch was a tenth of the server's ingest CPU.

pub(crate) fn check_time(
    field: impl FnOnce() -> String,
    time_ms: i64,
    now_ms: i64,
) -> Result<(), BatchError> {
    if time_ms < MIN_TIME_MS {
        return Err(field_error(
            field(),
            format!("{time_ms} is before 2000-01-01; send Unix time in milliseconds"),
        ));
    }
    if time_ms > now_ms + MAX_TIME_SKEW_MS {
        return Err(field_error(
            field(),
            format!(
                "{time_ms} is {} s ahead of the server's clock; fix the node's clock (NTP)",
                (time_ms - now_ms) / 1000
            ),
        ));
    }
    Ok(())
}

pub(crate) fn check_pct(
    field: impl FnOnce() -> String,
    value: Option<f64>,
) -> Result<(), BatchError> {
    match value {
        Some(v) if !(0.0..=100.0).contains(&v) => Err(field_error(
            field(),
            format!("{v} is outside 0..=100 percent"),
        )),
        _ => Ok(()),
    }
}

pub(crate) fn check_label(field: impl FnOnce() -> String, value: &str) -> Result<(), BatchError> {
    if value.is_empty() || value.len() > 256 || value.chars().any(char::is_control) {
        return Err(field_error(
            field(),
            format!("{value:?} must be 1 to 256 characters without control characters"),
        ));
    }
    Ok(())
}

impl Batch {
    /// A batch from `node` numbered `seq`, with nothing in it yet.
    pub fn new(node: NodeId, seq: u64) -> Batch {
        Batch {
            node,
            seq,
            hosts: vec![],
            gpus: vec![],
            nics: vec![],
            gpu_events: vec![],
            gpu_processes: vec![],
            ib_ports: vec![],
            jobs: vec![],
            job_metrics: vec![],
        }
    }

    /// Number of samples of every kind.
    pub fn sample_count(&self) -> usize {
        self.hosts.len()
            + self.gpus.len()
            + self.nics.len()
            + self.gpu_events.len()
            + self.gpu_processes.len()
            + self.ib_ports.len()
            + self.jobs.len()
            + self.job_metrics.len()
    }

    /// Checks everything the server relies on. `now_ms` is the server's clock, injected so the
    /// check is deterministic in tests.
    pub fn validate(&self, now_ms: i64) -> Result<(), BatchError> {
        self.node.validate().map_err(BatchError::Node)?;
        let count = self.sample_count();
        if count == 0 {
            return Err(BatchError::Empty);
        }
        if count > MAX_SAMPLES_PER_BATCH {
            return Err(BatchError::TooLarge { count });
        }
        for (i, g) in self.gpus.iter().enumerate() {
            let f = |name: &str| format!("gpus[{i}].{name}");
            check_time(|| f("time_ms"), g.time_ms, now_ms)?;
            check_label(|| f("uuid"), &g.uuid)?;
            check_label(|| f("model"), &g.model)?;
            for c in catalogue::GPU {
                c.validate(g, f)?;
            }
            if let Some(t) = g
                .temperature_celsius
                .filter(|t| !(-50.0..=200.0).contains(t))
            {
                return Err(field_error(
                    f("temperature_celsius"),
                    format!("{t} is outside -50..=200"),
                ));
            }
            if let (Some(used), Some(total)) = (g.memory_used_bytes, g.memory_total_bytes)
                && used > total
            {
                return Err(field_error(
                    f("memory_used_bytes"),
                    format!("{used} exceeds memory_total_bytes {total}"),
                ));
            }
        }
        for (i, h) in self.hosts.iter().enumerate() {
            let f = |name: &str| format!("hosts[{i}].{name}");
            check_time(|| f("time_ms"), h.time_ms, now_ms)?;
            for c in catalogue::HOST {
                c.validate(h, f)?;
            }
        }
        for (i, n) in self.nics.iter().enumerate() {
            check_time(|| format!("nics[{i}].time_ms"), n.time_ms, now_ms)?;
            check_label(|| format!("nics[{i}].device"), &n.device)?;
            for c in catalogue::NIC {
                c.validate(n, |name| format!("nics[{i}].{name}"))?;
            }
        }
        crate::events::validate(&self.gpu_events, now_ms)?;
        crate::jobs::validate(&self.gpu_processes, &self.jobs, now_ms)?;
        crate::infiniband::validate(&self.ib_ports, now_ms)?;
        crate::job_metrics::validate(&self.job_metrics, now_ms)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GpuIndex;

    const NOW: i64 = 1_800_000_000_000;

    fn gpu() -> GpuSample {
        GpuSample {
            time_ms: NOW,
            gpu: GpuIndex(0),
            uuid: "GPU-1".into(),
            model: "NVIDIA H100".into(),
            simulated: true,
            utilization_gpu_pct: Some(50.0),
            utilization_memory_pct: None,
            memory_used_bytes: Some(1),
            memory_total_bytes: Some(2),
            power_watts: Some(300.0),
            energy_joules: None,
            temperature_celsius: Some(60.0),
            sm_clock_mhz: None,
            memory_clock_mhz: None,
            ..GpuSample::default()
        }
    }

    fn batch(gpus: Vec<GpuSample>) -> Batch {
        Batch {
            gpus,
            ..Batch::new(NodeId::new("n1").expect("valid"), 1)
        }
    }

    fn check(g: GpuSample, expected: Option<&str>) {
        let got = batch(vec![g]).validate(NOW).err().map(|e| e.to_string());
        match (got, expected) {
            (None, None) => {}
            (Some(msg), Some(want)) => assert!(msg.contains(want), "{msg:?} lacks {want:?}"),
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn validation_names_the_field() {
        check(gpu(), None);
        check(
            GpuSample {
                utilization_gpu_pct: Some(101.0),
                ..gpu()
            },
            Some("gpus[0].utilization_gpu_pct"),
        );
        check(
            GpuSample {
                time_ms: 1_700_000_000,
                ..gpu()
            },
            Some("milliseconds"),
        );
        check(
            GpuSample {
                time_ms: NOW + 3_600_000,
                ..gpu()
            },
            Some("ahead of the server's clock"),
        );
        check(
            GpuSample {
                power_watts: Some(-1.0),
                ..gpu()
            },
            Some("gpus[0].power_watts"),
        );
        check(
            GpuSample {
                memory_used_bytes: Some(3),
                ..gpu()
            },
            Some("exceeds memory_total_bytes"),
        );
        check(
            GpuSample {
                uuid: String::new(),
                ..gpu()
            },
            Some("gpus[0].uuid"),
        );
        assert_eq!(batch(vec![]).validate(NOW), Err(BatchError::Empty));
    }

    #[test]
    fn unknown_fields_and_bad_names_are_refused() {
        let err = serde_json::from_str::<Batch>(r#"{"node":"n","seq":1,"gpuz":[]}"#)
            .expect_err("unknown field");
        assert!(err.to_string().contains("gpuz"), "{err}");
        let b: Batch = serde_json::from_str(
            r#"{"node":"bad name","seq":1,"hosts":[{"time_ms":1800000000000,"simulated":false}]}"#,
        )
        .expect("parses");
        assert!(matches!(b.validate(NOW), Err(BatchError::Node(_))));
    }

    #[test]
    fn roundtrip_keeps_absent_values_absent() {
        let b = batch(vec![gpu()]);
        let json = serde_json::to_string(&b).expect("serializes");
        let back: Batch = serde_json::from_str(&json).expect("parses");
        assert_eq!(back, b);
        assert_eq!(back.gpus[0].energy_joules, None);
    }

    /// The sample the catalogue declares is on the wire exactly as before it did: the basic
    /// fields as `null` when absent, the others left out, in the catalogue's order.
    #[test]
    fn the_wire_format_of_a_gpu_sample_is_unchanged() {
        let empty = r#"{"time_ms":0,"gpu":0,"uuid":"","model":"","simulated":false,"utilization_gpu_pct":null,"utilization_memory_pct":null,"memory_used_bytes":null,"memory_total_bytes":null,"power_watts":null,"energy_joules":null,"temperature_celsius":null,"sm_clock_mhz":null,"memory_clock_mhz":null}"#;
        let full = r#"{"time_ms":1,"gpu":2,"uuid":"u","model":"m","simulated":true,"utilization_gpu_pct":1.5,"utilization_memory_pct":2.5,"memory_used_bytes":3,"memory_total_bytes":4,"power_watts":5.5,"energy_joules":6.5,"temperature_celsius":7.5,"sm_clock_mhz":8,"memory_clock_mhz":9,"throttle_reasons":10,"ecc_corrected_volatile":11,"ecc_uncorrected_volatile":12,"ecc_corrected_aggregate":13,"ecc_uncorrected_aggregate":14,"retired_pages_single_bit":15,"retired_pages_double_bit":16,"retired_pages_pending":true,"pcie_tx_bytes_per_second":17.5,"pcie_rx_bytes_per_second":18.5,"pcie_replay_total":19,"nvlink_links":20,"nvlink_links_up":21,"nvlink_errors_total":22,"nvlink_rx_bytes":23,"nvlink_tx_bytes":24,"processes":25,"mig_enabled":false,"mig_instances":26,"xid_errors_total":27,"ecc_error_events_total":28}"#;
        for json in [empty, full] {
            let sample: GpuSample = serde_json::from_str(json).expect("parses");
            assert_eq!(serde_json::to_string(&sample).expect("serializes"), json);
        }
    }
}
