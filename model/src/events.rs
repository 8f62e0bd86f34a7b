//! GPU events: XIDs and ECC errors from NVML's event set, and GPUs that fell off the bus. Each
//! is one row with its time and GPU, so nothing that happens between two samples is lost; the
//! agent also counts them per GPU (`GpuSample::xid_errors_total`).

use crate::GpuIndex;
use crate::telemetry::{BatchError, check_label, check_time, field_error};
use serde::{Deserialize, Serialize};

/// What happened to a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuEventKind {
    /// An XID error (`xid` holds the code).
    Xid,
    /// A single-bit (corrected) ECC error.
    EccSingleBit,
    /// A double-bit (uncorrected) ECC error.
    EccDoubleBit,
    /// The GPU stopped answering (NVML `GPU_IS_LOST`, or it cannot be opened).
    GpuLost,
    /// A lost GPU answers again.
    GpuRecovered,
}

impl GpuEventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            GpuEventKind::Xid => "xid",
            GpuEventKind::EccSingleBit => "ecc_single_bit",
            GpuEventKind::EccDoubleBit => "ecc_double_bit",
            GpuEventKind::GpuLost => "gpu_lost",
            GpuEventKind::GpuRecovered => "gpu_recovered",
        }
    }
}

/// One GPU event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuEvent {
    /// When the agent saw it, Unix ms.
    pub time_ms: i64,
    pub gpu: GpuIndex,
    pub uuid: String,
    pub simulated: bool,
    pub kind: GpuEventKind,
    /// The XID code, for `kind: xid` (absent when NVML does not know it).
    #[serde(default)]
    pub xid: Option<u64>,
    /// Detail for people (the NVML error, say).
    #[serde(default)]
    pub message: Option<String>,
}

pub(crate) fn validate(events: &[GpuEvent], now_ms: i64) -> Result<(), BatchError> {
    for (i, e) in events.iter().enumerate() {
        let f = |name: &str| format!("gpu_events[{i}].{name}");
        check_time(|| f("time_ms"), e.time_ms, now_ms)?;
        check_label(|| f("uuid"), &e.uuid)?;
        // NVML may not know an XID's code (`xid` absent); a code on another kind is a mistake.
        if e.kind != GpuEventKind::Xid && e.xid.is_some() {
            return Err(field_error(
                f("xid"),
                format!(
                    "only `kind: xid` events carry a code, this one is {}",
                    e.kind.as_str()
                ),
            ));
        }
        if e.message.as_ref().is_some_and(|m| m.len() > 4096) {
            return Err(field_error(
                f("message"),
                "longer than 4096 bytes; shorten it",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::{Batch, GpuEvent, GpuEventKind, GpuIndex, GpuProcessSample, IbPortSample};
    use crate::{JobSample, NodeId};

    const NOW: i64 = 1_800_000_000_000;

    fn check(mutate: impl FnOnce(&mut Batch), want: Option<&str>) {
        let mut b = Batch {
            gpu_events: vec![GpuEvent {
                time_ms: NOW,
                gpu: GpuIndex(0),
                uuid: "GPU-1".into(),
                simulated: false,
                kind: GpuEventKind::Xid,
                xid: Some(79),
                message: None,
            }],
            gpu_processes: vec![GpuProcessSample {
                time_ms: NOW,
                uuid: "GPU-1".into(),
                pid: 7,
                ..GpuProcessSample::default()
            }],
            ib_ports: vec![IbPortSample {
                time_ms: NOW,
                device: "mlx5_0".into(),
                port: 1,
                ..IbPortSample::default()
            }],
            jobs: vec![JobSample {
                time_ms: NOW,
                job: "j1".into(),
                source: "proc".into(),
                ..JobSample::default()
            }],
            ..Batch::new(NodeId::new("n1").expect("valid"), 1)
        };
        mutate(&mut b);
        let got = b.validate(NOW).err().map(|e| e.to_string());
        match (got, want) {
            (None, None) => {}
            (Some(msg), Some(w)) => assert!(msg.contains(w), "{msg:?} lacks {w:?}"),
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn new_rows_are_validated_by_field() {
        check(|_| {}, None);
        check(|b| b.gpu_events[0].xid = None, None);
        check(
            |b| b.gpu_events[0].kind = GpuEventKind::GpuLost,
            Some("gpu_events[0].xid"),
        );
        check(
            |b| b.gpu_events[0].time_ms = 5,
            Some("gpu_events[0].time_ms"),
        );
        check(
            |b| b.gpu_processes[0].sm_utilization_pct = Some(300.0),
            Some("gpu_processes[0].sm_utilization_pct"),
        );
        check(|b| b.ib_ports[0].device.clear(), Some("ib_ports[0].device"));
        check(|b| b.jobs[0].job.clear(), Some("jobs[0].job"));
        check(
            |b| b.jobs[0].cpu_seconds = Some(f64::NAN),
            Some("jobs[0].cpu_seconds"),
        );
        check(
            |b| {
                b.gpu_events.clear();
                b.gpu_processes.clear();
                b.ib_ports.clear();
                b.jobs.clear();
            },
            Some("holds no samples"),
        );
    }

    #[test]
    fn absent_extras_stay_out_of_the_json() {
        let b = Batch {
            gpus: vec![crate::GpuSample {
                time_ms: NOW,
                uuid: "GPU-1".into(),
                model: "X".into(),
                ..crate::GpuSample::default()
            }],
            ..Batch::new(NodeId::new("n1").expect("valid"), 1)
        };
        let json = serde_json::to_string(&b).expect("serializes");
        assert!(
            !json.contains("gpu_events") && !json.contains("throttle_reasons"),
            "{json}"
        );
        let back: Batch = serde_json::from_str(&json).expect("parses");
        assert_eq!(back, b);
    }
}
