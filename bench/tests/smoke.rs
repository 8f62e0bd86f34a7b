//! Every benchmark in a tiny mode, so that none can silently stop working (issue 21: `perch
//! bench jobs` had failed after its submission half, unseen, since the probe job began to run
//! as `nobody`). Each runs the real benchmark with the smallest sizes its flags allow and must
//! end well and print its table; the figures themselves are BENCHMARKS.md's business. The
//! scheduler's divan benchmarks run once each in scripts/test.sh; `tests/bench.rs` at the root
//! checks that `perch bench` hands over to this binary.

/// Runs `perch-bench <args>` with a fresh directory for its data; returns what it printed.
fn bench(args: &[&str]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    bench_in(dir.path(), args)
}

fn bench_in(dir: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_perch-bench"))
        .args(args)
        .arg("--dir")
        .arg(dir)
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

/// Processes whose working directory lies under `dir`: the jobs of a demo whose data
/// directory is there (a job starts in its directory under the agent's state), and no other
/// process on the machine.
fn processes_under(dir: &std::path::Path) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(cwd) = std::fs::read_link(entry.path().join("cwd")) else {
            continue;
        };
        if cwd.starts_with(dir) {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            found.push(format!(
                "{pid}: {}",
                String::from_utf8_lossy(&cmdline).replace('\0', " ")
            ));
        }
    }
    found
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
    let dir = tempfile::tempdir().expect("tempdir");
    let out = bench_in(
        dir.path(),
        &[
            "web",
            "--nodes",
            "2",
            "--gpus-per-node",
            "2",
            "--loads",
            "1",
            "--minutes",
            "0.05",
        ],
    );
    assert!(
        out.contains("first full render of the fleet view") && out.contains("JS heap"),
        "{out}"
    );
    // The demo it ran was stopped with its jobs: none of them (they start in the demo's data
    // directory, under `dir`) is left. Other processes on the machine do not count.
    let left = processes_under(dir.path());
    assert!(left.is_empty(), "the demo's jobs outlived it: {left:?}");
}
