//! Job accounting end to end with the real binary: a busy and an idle job run on simulated
//! GPUs, end, and are accounted (used GPU-seconds, utilization, memory, energy, cost); their
//! lifecycle is in the events table; the usage views answer. Then DuckDB recomputes the same
//! numbers from the store's raw Parquet files and the exported allocations
//! (tests/accounting_duckdb.py), and the two must agree.

mod common;

use common::{Perch, wait_for};
use serde_json::Value;
use std::process::Command;

fn submit(perch: &Perch, args: &[&str]) -> u64 {
    let out = common::client()
        .arg("submit")
        .args(args)
        .env("PERCH_SERVER", &perch.url)
        .env("USER", "alice")
        .output()
        .expect("run perch submit");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.trim()
        .trim_start_matches("Submitted job ")
        .parse()
        .unwrap_or_else(|_| panic!("job id in {text:?}"))
}

fn f(row: &Value, key: &str) -> f64 {
    row[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {row}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1e-9)
}

#[test]
fn jobs_are_accounted_and_duckdb_agrees_from_the_raw_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("perch.toml");
    std::fs::write(
        &config,
        "[server]\npg_listen = \"\"\n[accounting]\nfold_interval_secs = 1\nsettle_secs = 1\n\
         gpu_price_per_hour = 2.0\nenergy_price_per_kwh = 0.5\n",
    )
    .expect("config");
    let data = dir.path().join("data");
    let mut perch = Perch::start(
        &data,
        &[
            "up",
            "--simulate-gpus",
            "2",
            "--interval-ms",
            "100",
            "--config",
            config.to_str().expect("utf-8"),
        ],
    );
    let busy = submit(
        &perch,
        &[
            "--gpus",
            "1",
            "--sim-profile",
            "steady",
            "-J",
            "busy",
            "--",
            "sleep",
            "3",
        ],
    );
    let idle = submit(
        &perch,
        &[
            "--gpus",
            "1",
            "--sim-profile",
            "idle",
            "-J",
            "idle",
            "--",
            "sleep",
            "3",
        ],
    );
    // Both end, and their accounting becomes complete once their last samples settled.
    let jobs = wait_for("both jobs ended and fully accounted", || {
        let rows = perch.sql(
            "SELECT * FROM jobs WHERE state = 'completed' AND accounted_until = end_time ORDER BY job",
        );
        (rows.len() == 2).then_some(rows)
    });
    let (b, i) = (&jobs[0], &jobs[1]);
    // Fully accounted: `perch show`'s usage has no note about figures still to come.
    let shown = perch.job(b["job"].as_u64().expect("id"));
    assert!(shown["usage"]["gpu_seconds_used"].is_number(), "{shown}");
    assert!(shown["usage"].get("note").is_none(), "{shown}");
    // Its efficiency and idle cost are the accounted window's, as the row's.
    let u = &shown["usage"];
    assert!(
        close(
            f(u, "efficiency"),
            f(u, "gpu_seconds_used") / f(u, "gpu_seconds_accounted")
        ),
        "{u}"
    );
    assert!(close(f(u, "idle_cost"), f(b, "idle_cost")), "{u} {b}");
    assert!(
        close(f(u, "cost_accounted"), f(b, "cost_accounted")),
        "{u} {b}"
    );
    assert_eq!(b["job"], busy);
    assert_eq!(i["job"], idle);
    for j in [b, i] {
        assert_eq!(j["user_name"], "alice");
        assert_eq!(j["simulated"], true, "{j}");
        assert!(f(j, "gpu_seconds_allocated") >= 3.0, "{j}");
        assert_eq!(
            j["gpu_seconds_accounted"], j["gpu_seconds_allocated"],
            "{j}"
        );
        assert!(f(j, "memory_peak_bytes") > 0.0, "{j}");
        assert!(f(j, "cost_allocated") > f(j, "gpu_seconds_allocated") / 3600.0 * 2.0 - 1e-12);
        // Complete: the accounted window is the whole allocation, so its cost is the
        // allocation's, and the idle cost is what was not used of it.
        assert!(close(f(j, "cost_accounted"), f(j, "cost_allocated")), "{j}");
        assert!(
            close(
                f(j, "idle_cost"),
                f(j, "cost_accounted") - f(j, "cost_used")
            ),
            "{j}"
        );
    }
    assert!(
        f(b, "gpu_seconds_used") > 0.5 * f(b, "gpu_seconds_allocated"),
        "the steady job used its GPU: {b}"
    );
    assert!(f(b, "utilization_peak_pct") >= 90.0, "{b}");
    // The idle job's GPU only moved in the instants between its allocation and its launch.
    assert!(
        f(i, "gpu_seconds_used") < 0.2 * f(i, "gpu_seconds_allocated"),
        "the idle job did next to nothing: {i}"
    );
    assert!(f(b, "energy_joules") > f(i, "energy_joules"), "{b} {i}");

    // Its lifecycle is in the audit trail.
    let kinds = perch.sql(&format!(
        "SELECT kind, actor, outcome FROM events WHERE job = {busy} ORDER BY kind"
    ));
    let kinds: Vec<String> = kinds
        .iter()
        .map(|e| {
            format!(
                "{}:{}",
                e["kind"].as_str().unwrap_or(""),
                e["outcome"].as_str().unwrap_or("")
            )
        })
        .collect();
    // (Submitted and started can share a millisecond: compared by kind, not by time.)
    assert_eq!(
        kinds,
        ["job_ended:completed", "job_started:", "job_submitted:"]
    );
    assert_eq!(
        perch.scalar("SELECT count(*) FROM events WHERE kind = 'node_joined'"),
        1
    );

    // sreport's and OpenCost's questions answer.
    let usage = perch.sql("SELECT * FROM account_usage");
    assert_eq!(usage.len(), 1, "{usage:?}");
    let u = &usage[0];
    assert_eq!(
        (
            u["account"].as_str(),
            u["user_name"].as_str(),
            u["jobs"].as_i64()
        ),
        (Some("alice"), Some("alice"), Some(2))
    );
    let used = f(b, "gpu_seconds_used") + f(i, "gpu_seconds_used");
    assert!(close(f(u, "gpu_hours_used"), used / 3600.0), "{u}");
    assert!(
        close(
            f(u, "idle_cost"),
            (f(u, "gpu_hours_allocated") - used / 3600.0) * 2.0
        ),
        "{u}"
    );
    let costs = perch.sql(&format!(
        "SELECT efficiency, idle_cost FROM job_costs WHERE job = {idle}"
    ));
    assert!(f(&costs[0], "efficiency") < 0.2, "{costs:?}");
    assert!(
        f(&costs[0], "idle_cost") > 0.0,
        "an idle allocation costs: {costs:?}"
    );
    let days = perch.sql("SELECT * FROM cluster_utilization_daily");
    assert!(!days.is_empty());
    let total = |k: &str| days.iter().map(|d| f(d, k)).sum::<f64>();
    assert!(total("allocated_gpu_hours") > 0.0);
    assert!(close(
        total("allocated_gpu_hours")
            + total("idle_gpu_hours")
            + total("drained_gpu_hours")
            + total("down_gpu_hours"),
        total("capacity_gpu_hours")
    ));
    let top = perch.sql("SELECT user_name FROM top_users");
    assert_eq!(top[0]["user_name"], "alice");

    // DuckDB on the raw files, from the allocations as users export them.
    let csv = perch.sql_cli(
        "SELECT * FROM job_allocations ORDER BY job, gpu",
        &["--format", "csv"],
    );
    assert!(
        csv.status.success(),
        "{}",
        String::from_utf8_lossy(&csv.stderr)
    );
    let per_gpu = perch.sql("SELECT * FROM job_allocations");
    let allocations = dir.path().join("allocations.csv");
    std::fs::write(&allocations, &csv.stdout).expect("write csv");
    let status = perch.terminate(); // flushes the buffer to Parquet
    assert!(status.success(), "{status}");
    let out = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/accounting_duckdb.py"
        ))
        .arg(&data)
        .arg(&allocations)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "DuckDB cross-check failed (is duckdb installed? scripts/test.sh installs it): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let duck: Value = serde_json::from_slice(&out.stdout).expect("JSON from the DuckDB script");
    let keys = [
        "gpu_seconds_used",
        "utilization_mean_pct",
        "utilization_peak_pct",
        "memory_peak_bytes",
        "energy_joules",
    ];
    for j in [b, i] {
        let d = &duck["jobs"][j["job"].to_string()];
        for key in keys {
            assert!(
                close(f(j, key), f(d, key)),
                "{key}: perch {j} vs DuckDB {d}"
            );
        }
    }
    assert_eq!(per_gpu.len(), 2);
    for a in &per_gpu {
        let name = format!(
            "{}/{}/{}",
            a["job"],
            a["node"].as_str().unwrap_or(""),
            a["gpu"]
        );
        let d = &duck["gpus"][&name];
        assert_eq!(
            a["samples"], d["samples"],
            "{name}: perch {a} vs DuckDB {d}"
        );
        assert!(f(a, "samples") > 10.0, "{a}");
        for key in keys {
            assert!(
                close(f(a, key), f(d, key)),
                "{name} {key}: perch {a} vs DuckDB {d}"
            );
        }
    }
}
