//! `perch bench` hands over to the `perch-bench` binary (crate `bench/`, built beside perch by
//! `cargo build --workspace`; its own tests run every benchmark in a tiny mode), and says how to
//! build it when it is missing.

mod common;

#[test]
fn perch_bench_runs_perch_bench_beside_it_or_says_how_to_build_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = common::client()
        .args([
            "bench",
            "metrics",
            "--nodes",
            "2",
            "--gpus",
            "1",
            "--scrapes",
            "1",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .expect("perch bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("/metrics for 2 nodes"),
        "{stdout}{} (perch-bench is built by `cargo test --workspace`)",
        String::from_utf8_lossy(&out.stderr)
    );
    // What came back is the benchmark's own figures, and they can be true: "median 1.2 ms,
    // slowest 1.4 ms", finite, the one scrape timed above zero and under a minute.
    let times: Vec<f64> = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("median "))
        .map(|l| {
            l.split(|c: char| c.is_whitespace() || c == ',')
                .filter_map(|w| w.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        times.len() == 2
            && times.iter().all(|t| t.is_finite())
            && times[0] <= times[1]
            && times[1] > 0.0
            && times[1] < 60_000.0,
        "figures that cannot be true: {times:?}\n{stdout}"
    );

    // A perch with no perch-bench beside it or on PATH (a hard link elsewhere: current_exe
    // names the link).
    let alone = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let perch = alone.path().join("perch");
    std::fs::hard_link(common::PERCH, &perch).expect("hard link perch");
    let out = std::process::Command::new(&perch)
        .args(["bench", "metrics"])
        .env("PATH", "/usr/bin:/bin")
        .output()
        .expect("perch bench alone");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("cargo build --release -p perch-bench"),
        "{stderr}"
    );
}
