//! Every benchmark in a tiny mode, so that none can silently stop working (issue 21: `perch
//! bench jobs` had failed after its submission half, unseen, since the probe job began to run
//! as `nobody`). Each runs the real benchmark with the smallest sizes its flags allow and must
//! end well and print its table; the figures themselves are BENCHMARKS.md's business. The
//! scheduler's divan benchmarks run once each in scripts/test.sh; `tests/bench.rs` at the root
//! checks that `perch bench` hands over to this binary.

/// Runs `perch-bench <args>` with a fresh directory for its data; returns what it printed.
fn bench(args: &[&str]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_perch-bench"))
        .args(args)
        .arg("--dir")
        .arg(dir.path())
        .output()
        .expect("run perch bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "perch bench {args:?} failed:\n{stdout}\n{stderr}"
    );
    stdout
}

#[test]
fn ingest_in_a_tiny_mode() {
    for tls in [false, true] {
        let mut args = vec![
            "ingest",
            "--seconds",
            "1",
            "--clients",
            "2",
            "--rounds",
            "2",
            "--gpus",
            "2",
        ];
        if tls {
            args.push("--tls");
        }
        let out = bench(&args);
        assert!(out.contains("values per server CPU-s"), "{out}");
    }
}

#[test]
fn metrics_in_a_tiny_mode() {
    let out = bench(&["metrics", "--nodes", "3", "--gpus", "2", "--scrapes", "2"]);
    assert!(
        out.contains("/metrics for 3 nodes") && out.contains("median"),
        "{out}"
    );
}

#[test]
fn jobs_in_a_tiny_mode() {
    let out = bench(&["jobs", "--seconds", "1", "--clients", "2", "--starts", "2"]);
    assert!(
        out.contains("jobs/s") && out.contains("submit-to-start"),
        "{out}"
    );
}

#[test]
fn freshness_in_a_tiny_mode() {
    let out = bench(&["freshness", "--rounds", "3", "--gpus", "2"]);
    assert!(out.contains("sample taken -> visible to SQL"), "{out}");
}

#[test]
fn query_against_duckdb_in_a_tiny_mode() {
    let out = bench(&[
        "query",
        "--nodes",
        "2",
        "--gpus",
        "2",
        "--days",
        "1",
        "--interval-secs",
        "600",
        "--runs",
        "1",
    ]);
    assert!(
        out.contains("target: no query slower than DuckDB")
            && out.contains("both engines agree")
            && out.contains("cold: no query slower than DuckDB")
            && out.contains("dashboard: refresh no slower than DuckDB's"),
        "{out}"
    );
}

#[test]
fn web_in_a_tiny_mode() {
    let out = bench(&[
        "web",
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--loads",
        "1",
        "--minutes",
        "0.05",
    ]);
    assert!(
        out.contains("first full render of the fleet view") && out.contains("JS heap"),
        "{out}"
    );
    // The demo it ran was stopped with its jobs: none of its `sleep 86400` is left.
    let left = std::process::Command::new("pgrep")
        .args(["-f", "sleep 86400"])
        .output()
        .expect("pgrep");
    assert!(
        left.stdout.is_empty(),
        "the demo's jobs outlived it: {}",
        String::from_utf8_lossy(&left.stdout)
    );
}
