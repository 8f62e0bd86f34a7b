//! The catalogues hold together: names and families follow the conventions, rollup slots are
//! numbered without gaps, values convert exactly, and one GPU line more (the probe) is a field,
//! a column and a fixture value without any other edit.

use super::*;
use crate::IbPortSample;
use std::collections::{BTreeMap, BTreeSet};

mod probe {
    crate::probe_gpu_catalogue!();
}

fn families<R>(columns: &[Column<R>], out: &mut BTreeMap<&'static str, Vec<&'static str>>) {
    let mut names = BTreeSet::new();
    for c in columns {
        assert!(names.insert(c.name), "column {} declared twice", c.name);
        if let Some(s) = &c.series {
            assert!(
                s.name.starts_with("perch_"),
                "{}: series names start with perch_",
                s.name
            );
            assert_eq!(
                s.kind == Kind::Counter,
                s.name.ends_with("_total"),
                "{}: a counter's name, and only a counter's, ends in _total",
                s.name
            );
            if matches!(c.read, Read::Text(_)) {
                assert!(
                    matches!(s.value, Value::From(_)),
                    "{}: a text column needs its own reading to be exported",
                    c.name
                );
            }
            out.entry(s.name).or_default().push(s.help);
        }
    }
}

/// Columns are declared once per table, series names follow the conventions, and every
/// column of one family agrees on its help (Prometheus takes one per family).
#[test]
fn each_column_once_and_each_family_one_help() {
    let mut all = BTreeMap::new();
    families(GPU, &mut all);
    families(HOST, &mut all);
    families(NIC, &mut all);
    families(IB_PORT, &mut all);
    families(JOB, &mut all);
    for (name, helps) in all {
        assert!(
            helps.windows(2).all(|w| w[0] == w[1]),
            "{name}: columns of one family give different helps: {helps:?}"
        );
    }
}

/// The rolled-up columns of a table are numbered 0, 1, 2... in the order of the stored
/// rollup files; a line with a taken or skipped slot is named with the slot it should take.
fn check_slots<R>(table: &str, columns: &[Column<R>]) {
    let taken: Vec<(u16, &str)> = rolled_up(columns)
        .iter()
        .map(|(c, r)| (r.slot, c.name))
        .collect();
    for (next, (slot, name)) in taken.iter().enumerate() {
        assert_eq!(
            usize::from(*slot),
            next,
            "{table}: {name} has rollup slot {slot} where {next} comes: slots run 0, 1, 2... \
             without gaps or repeats (a new rolled-up column takes the one after the last, {})",
            taken.len()
        );
    }
}

#[test]
fn rollup_slots_run_without_gaps() {
    check_slots("gpu_samples", GPU);
    check_slots("host_samples", HOST);
    check_slots("gpu_samples with the probe line", probe::GPU);
    // Only GPU and host samples have rollups.
    assert!(NIC.iter().all(|c| c.rollup.is_none()));
    assert!(IB_PORT.iter().all(|c| c.rollup.is_none()));
    assert!(JOB.iter().all(|c| c.rollup.is_none()));
}

/// Every GPU column but a computed one has a field to write.
#[test]
fn every_gpu_line_with_a_field_writes_it() {
    for c in GPU {
        assert_eq!(
            c.write.is_none(),
            c.name == "throttle_reason_names",
            "{}: a line declares its field",
            c.name
        );
    }
}

#[test]
fn exported_values_are_scaled_as_declared() {
    let g = GpuSample {
        utilization_gpu_pct: Some(50.0),
        sm_clock_mhz: Some(1980),
        mig_enabled: Some(true),
        ..GpuSample::default()
    };
    let value = |name: &str| {
        let c = GPU.iter().find(|c| c.name == name).expect("column");
        c.series.as_ref().expect("exported").value(c, &g)
    };
    assert_eq!(value("utilization_gpu_pct"), Some(0.5));
    let g37 = GpuSample {
        utilization_gpu_pct: Some(37.0),
        ..GpuSample::default()
    };
    let util = &GPU[0];
    assert_eq!(
        util.series.as_ref().expect("exported").value(util, &g37),
        Some(0.37),
        "a percent divided, not multiplied by 0.01"
    );
    assert_eq!(value("sm_clock_mhz"), Some(1.98e9));
    assert_eq!(value("mig_enabled"), Some(1.0));
    assert_eq!(value("power_watts"), None, "absent stays absent, never 0");
    let port = IbPortSample {
        state: Some("DOWN".into()),
        ..IbPortSample::default()
    };
    let up = &IB_PORT[0];
    assert_eq!(
        up.series.as_ref().expect("exported").value(up, &port),
        Some(0.0)
    );
}

/// A value is stored exactly in its column's type, or absent: never wrapped, rounded or
/// truncated.
#[test]
fn values_are_stored_exactly_or_not_at_all() {
    let column = |name: &str| GPU.iter().find(|c| c.name == name).expect("column");
    let check = |name: &str, value: Number, expected: Option<f64>| {
        let mut g = GpuSample {
            power_watts: Some(1.0),
            nvlink_rx_bytes: Some(1),
            nvlink_links: Some(1),
            mig_enabled: Some(false),
            ..GpuSample::default()
        };
        let c = column(name);
        c.set(&mut g, Some(value));
        assert_eq!(c.read.number(&g), expected, "{name} from {value:?}");
    };
    check("power_watts", Number::U64(700), Some(700.0));
    check("power_watts", Number::F64(1.5), Some(1.5));
    check("nvlink_rx_bytes", Number::I64(-1), None);
    check("nvlink_rx_bytes", Number::F64(2.5), None);
    check("nvlink_rx_bytes", Number::F64(f64::NAN), None);
    check("nvlink_links", Number::U64(1 << 40), None);
    check("nvlink_links", Number::I64(18), Some(18.0));
    check("mig_enabled", Number::U64(1), Some(1.0));
    check("mig_enabled", Number::F64(0.0), Some(0.0));
    // A counter past 2^53 is stored as it is, not through a float.
    let mut g = GpuSample::default();
    column("nvlink_rx_bytes").set(&mut g, Some(Number::U64((1 << 60) + 1)));
    assert_eq!(g.nvlink_rx_bytes, Some((1 << 60) + 1));
    let mut copy = GpuSample::default();
    column("nvlink_rx_bytes").copy(&g, &mut copy);
    assert_eq!(copy.nvlink_rx_bytes, Some((1 << 60) + 1));
    // Absent clears; a computed column has nothing to write.
    column("nvlink_rx_bytes").set(&mut g, None);
    assert_eq!(g.nvlink_rx_bytes, None);
    column("throttle_reason_names").set(&mut g, Some(Number::U64(1)));
    assert_eq!(g, GpuSample::default());
}

/// One line more in the GPU catalogue is a field of the sample (on the wire by its name), a
/// column after every other with its attributes, and set in the fixtures built from the
/// catalogue: nothing else was written for it.
#[test]
fn a_gpu_line_alone_makes_a_field_and_a_column() {
    assert_eq!(probe::GPU.len(), GPU.len() + 1);
    for (real, probed) in GPU.iter().zip(probe::GPU) {
        assert_eq!(
            (real.name, real.unit, real.read.type_name(), real.rollup),
            (
                probed.name,
                probed.unit,
                probed.read.type_name(),
                probed.rollup
            )
        );
        assert_eq!(
            real.series.as_ref().map(|s| (s.name, s.help, s.labels)),
            probed.series.as_ref().map(|s| (s.name, s.help, s.labels))
        );
    }
    let line = probe::GPU.last().expect("the probe line");
    assert_eq!(
        (line.name, line.read.type_name(), line.unit),
        ("probe_rollovers_total", "uint64", "events")
    );
    assert_eq!(
        (line.rollup, line.cadence, line.nvml_field, line.simulated),
        (
            Some(Rollup {
                summary: Summary::Range,
                slot: 12
            }),
            Cadence::Slow,
            Some(95),
            Some(0.0)
        )
    );
    let row: probe::GpuSample = every_value_set(probe::GPU);
    assert_eq!(row.probe_rollovers_total, Some(1));
    assert_eq!(row.pcie_replay_total, Some(1));
    let json = serde_json::to_value(&row).expect("serializes");
    assert_eq!(json["probe_rollovers_total"], 1);
    let back: probe::GpuSample = serde_json::from_value(json).expect("parses");
    assert_eq!(back, row);
    // The real sample has no such field: an agent cannot send it to a server without it.
    let real: Result<GpuSample, _> = serde_json::from_str(
        r#"{"time_ms":1,"gpu":0,"uuid":"u","model":"m","simulated":false,"probe_rollovers_total":1}"#,
    );
    assert!(real.is_err());
}
