//! Every benchmark in a tiny mode, so that none can silently stop working (`perch
//! bench jobs` had failed after its submission half, unseen, since the probe job began to run
//! as `nobody`). Each runs the real benchmark with the smallest sizes its flags allow, must end
//! well, and must print figures that can be true: finite (no NaN, no inf), above zero where a
//! zero means nothing was measured, below bounds no run on any machine reaches, consistent with
//! each other (a rate with its count and time, a median below its maximum, a ratio with its
//! parts, a verdict with its figures). How fast they are is BENCHMARKS.md's business. The
//! scheduler's divan benchmarks run once each in scripts/test.sh; `tests/bench.rs` at the root
//! checks that `perch bench` hands over to this binary.

use std::ops::RangeInclusive;

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

/// The numbers of `line` in order, `NaN` and `inf` among them (as Rust prints them), so that
/// the range checks fail on them. A `-` between digits separates (`47.7-47.7` is two).
fn numbers(line: &str) -> Vec<f64> {
    let mut out = Vec::new();
    let chars: Vec<char> = line.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let word_start = i == 0 || !chars[i - 1].is_alphanumeric();
        let word_end = chars.get(i + 3).is_none_or(|c| !c.is_alphanumeric());
        let rest: String = chars[i..].iter().take(3).collect();
        if word_start && word_end && (rest == "NaN" || rest == "inf") {
            out.push(if rest == "NaN" {
                f64::NAN
            } else {
                f64::INFINITY
            });
            i += 3;
        } else if chars[i].is_ascii_digit() {
            let start = i;
            let mut point = false;
            while i < chars.len()
                && (chars[i].is_ascii_digit()
                    || (chars[i] == '.'
                        && !point
                        && chars.get(i + 1).is_some_and(char::is_ascii_digit)))
            {
                point |= chars[i] == '.';
                i += 1;
            }
            let text: String = chars[start..i].iter().collect();
            out.push(text.parse().unwrap_or(f64::NAN));
        } else {
            i += 1;
        }
    }
    out
}

/// The first line of `out` holding `label`, and its numbers after the label.
fn figures(out: &str, label: &str) -> Vec<f64> {
    let line = out
        .lines()
        .find(|l| l.contains(label))
        .unwrap_or_else(|| panic!("no line with {label:?} in:\n{out}"));
    let after = &line[line.find(label).unwrap_or(0) + label.len()..];
    numbers(after)
}

/// Asserts that `value` is finite and in `range`.
#[track_caller]
fn sane(what: &str, value: f64, range: RangeInclusive<f64>, out: &str) {
    assert!(
        value.is_finite() && range.contains(&value),
        "{what} = {value}, not in {range:?}:\n{out}"
    );
}

/// Asserts that `a` is `b` within `rel` of either: as far as the printed digits of the
/// figures they come from tell (a time of `1.0 s` is any of 0.95 to 1.05 s).
#[track_caller]
fn about(what: &str, a: f64, b: f64, rel: f64, out: &str) {
    let tolerance = rel * a.abs().max(b.abs()) + 1e-9;
    assert!(
        (a - b).abs() <= tolerance,
        "{what}: {a} against {b} from the figures it is made of:\n{out}"
    );
}

/// No `NaN` or `inf` anywhere in what a benchmark printed.
#[track_caller]
fn no_nan(out: &str) {
    for line in out.lines() {
        assert!(
            numbers(line).iter().all(|n| n.is_finite()),
            "a figure that is not a number: {line}\n{out}"
        );
    }
}

/// The `median a ms, p99 b ms, max c ms (n rounds)` of a summary line: each sane, in order.
#[track_caller]
fn ordered_latencies(what: &str, values: &[f64], most_ms: f64, out: &str) {
    assert!(values.len() >= 3, "{what}: {values:?}\n{out}");
    for (name, v) in ["median", "next", "slowest"].iter().zip(values) {
        sane(&format!("{what} {name}"), *v, 0.0..=most_ms, out);
    }
    assert!(
        values[0] <= values[1] && values[1] <= values[2] && values[2] > 0.0,
        "{what}: {values:?} out of order or all zero:\n{out}"
    );
}

#[test]
fn the_checks_refuse_what_cannot_be_true() {
    assert_eq!(numbers("median 47.7 (47.7-48.1) ms"), [47.7, 47.7, 48.1]);
    assert!(
        numbers("values per server CPU-s  NaN")
            .iter()
            .any(|n| n.is_nan())
    );
    assert!(numbers("perch/D inf").iter().any(|n| n.is_infinite()));
    assert!(numbers("NaNa and info are words").is_empty());
    for bad in [f64::NAN, f64::INFINITY, 0.0, 2e10] {
        let caught = std::panic::catch_unwind(|| sane("x", bad, 1e-9..=1e10, ""));
        assert!(caught.is_err(), "{bad} passed");
    }
    assert!(std::panic::catch_unwind(|| no_nan("a NaN here")).is_err());
    assert_eq!(numbers("DuckDB 2.0.1 (Python)"), [2.0, 1.0]);
    assert!(std::panic::catch_unwind(|| about("r", 2.0, 1.0, 0.1, "")).is_err());
    about("r", 15.42, 18514.0 / 1201.0, 0.01, "");
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

/// The lines of `out` from the one that starts with `header` to the next that starts at the
/// left margin.
fn block(out: &str, header: &str) -> String {
    let mut lines = out.lines().skip_while(|l| !l.starts_with(header));
    let first = lines
        .next()
        .unwrap_or_else(|| panic!("no block {header:?} in:\n{out}"));
    std::iter::once(first)
        .chain(lines.take_while(|l| l.starts_with(' ')))
        .collect::<Vec<_>>()
        .join("\n")
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
        no_nan(&out);
        // 2 rounds x 2 GPUs, 9 values each.
        let per_batch = figures(&out, "clients, ");
        assert_eq!(per_batch[..2], [4.0, 9.0], "{out}");
        // Both encodings in the same run, taking turns: 2 turns each of 0.5 s.
        let phases = figures(&out, "alternating JSON and MessagePack,");
        assert_eq!(phases, [4.0, 0.5], "{out}");
        // "values per second 1201 (11 KiB of Parquet per batch)": the peer's rate.
        let direct = figures(&out, "values per second        ");
        sane("arrow-rs values per second", direct[0], 1.0..=1e10, &out);
        let mut per_cpus = Vec::new();
        for (name, media_type) in [
            ("json", "application/json"),
            ("msgpack", "application/vnd.perch.batch+msgpack"),
        ] {
            let b = block(&out, &format!("{name} ({media_type})"));
            let acked = figures(&b, "batches acknowledged");
            let (batches, wall) = (acked[0], acked[1]);
            sane("batches acknowledged", batches, 1.0..=1e8, &b);
            sane("wall seconds", wall, 0.5..=60.0, &b);
            let per_wall = figures(&b, "values per second (wall)")[0];
            sane("values per second (wall)", per_wall, 1.0..=1e10, &b);
            about(
                "values per second (wall)",
                per_wall * wall,
                batches * 36.0,
                0.05 / wall + 0.01,
                &b,
            );
            let cpu = figures(&b, "server CPU  ")[0];
            sane("server CPU seconds", cpu, 0.01..=120.0, &b);
            let per_cpu = figures(&b, "values per server CPU-s")[0];
            sane("values per server CPU-s", per_cpu, 1.0..=1e10, &b);
            about(
                "values per server CPU-s",
                per_cpu * cpu,
                batches * 36.0,
                0.005 / cpu + 0.01,
                &b,
            );
            let ratio = figures(
                &out,
                &format!("perch per core ({name}) / arrow-rs direct ="),
            )[0];
            sane("per core / direct", ratio, 1e-4..=1e5, &out);
            about(
                "per core / direct",
                ratio,
                per_cpu / direct[0],
                0.005 / ratio + 0.01,
                &out,
            );
            per_cpus.push(per_cpu);
        }
        // "verdict: binary ingest 0.12 M values per server CPU-s, 1.50x JSON's 0.08 M: below
        // the target of 3 M", made of the two blocks' figures.
        let verdict = figures(&out, "verdict: binary ingest");
        let (binary, json) = (per_cpus[1] / 1e6, per_cpus[0] / 1e6);
        about("binary M", verdict[0], binary, 0.006 / binary + 0.01, &out);
        about(
            "x JSON",
            verdict[1],
            binary / json,
            0.006 / verdict[1] + 0.01,
            &out,
        );
        about("JSON M", verdict[2], json, 0.006 / json + 0.01, &out);
        assert_eq!(verdict[3], 3.0, "{out}");
        let says = if binary >= 3.0 { ": meets" } else { ": below" };
        assert!(out.contains(says), "{says:?} not in:\n{out}");
        // The agent's encoding of one round (2 GPU samples), in each encoding.
        let json_us = figures(&out, "samples as json");
        let msgpack_us = figures(&out, "samples as msgpack");
        for (what, f) in [("json", &json_us), ("msgpack", &msgpack_us)] {
            sane(what, f[0], 0.01..=1e5, &out);
            sane(what, f[1], 10.0..=1e5, &out);
        }
        let agent = figures(&out, "agent encoding msgpack / json =")[0];
        about(
            "agent msgpack / json",
            agent,
            msgpack_us[0] / json_us[0],
            0.05 / json_us[0].min(msgpack_us[0]) + 0.006 / agent + 0.01,
            &out,
        );
    }
}

/// The fleet benchmark with 20 nodes against the `perch` built beside this binary
/// (`cargo test --workspace` builds it): every node up throughout, every acknowledged sample
/// in SQL, syncs and batches counted, jobs placed and reported, the server's passes and alert
/// rounds read from its `/metrics`.
/// `perch bench fleet` of 20 nodes of 2 GPUs at 200 ms with `extra`, against the `perch`
/// beside the bench binary: its output and its JSON line.
fn tiny_fleet(extra: &[&str]) -> (String, serde_json::Value) {
    let perch = std::path::Path::new(env!("CARGO_BIN_EXE_perch-bench")).with_file_name("perch");
    assert!(
        perch.exists(),
        "{} missing: build the workspace (cargo test --workspace)",
        perch.display()
    );
    let perch = perch.to_string_lossy().into_owned();
    let mut args = vec![
        "fleet",
        "--nodes",
        "20",
        "--gpus",
        "2",
        "--interval-ms",
        "200",
        "--sync-ms",
        "200",
        "--ramp-seconds",
        "1",
        "--json",
        "--perch",
        &perch,
    ];
    args.extend_from_slice(extra);
    let out = bench(&args);
    no_nan(&out);
    let json: serde_json::Value = out
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON line:\n{out}"));
    (out, json)
}

#[test]
fn fleet_in_a_tiny_mode() {
    // The bench measures once the server has ended its first alert round, which plans every
    // built-in SQL rule (JobStraggler's statement takes 2-5 s to plan in a debug build; with
    // the other smoke tests on the same two cores a round could outlast the window, and none
    // ended in it). Later rounds take about a second here, so 10 s sees several.
    let (out, json) = tiny_fleet(&["--seconds", "10", "--jobs-per-second", "5"]);
    let n = |k: &str| {
        json[k]
            .as_f64()
            .unwrap_or_else(|| panic!("{k} missing:\n{out}"))
    };
    assert_eq!(n("lost"), 0.0, "{out}");
    assert_eq!(n("not_up_worst"), 0.0, "{out}");
    assert_eq!(n("marked_down"), 0.0, "{out}");
    sane(
        "acknowledged samples",
        n("acked_samples"),
        100.0..=1e7,
        &out,
    );
    assert!(n("in_sql") >= n("acked_samples"), "{out}");
    // "p50 4.5 ms  p99 12.6 ms  max 19.9 ms  (600 syncs)": 50, 4.5, 99, 12.6, 19.9, 600.
    let syncs = figures(&out, "sync round trip");
    ordered_latencies("sync", &[syncs[1], syncs[3], syncs[4]], 60_000.0, &out);
    sane("syncs", syncs[5], 20.0..=1e7, &out);
    let batches = figures(&out, "ingest round trip");
    ordered_latencies(
        "ingest",
        &[batches[1], batches[3], batches[4]],
        60_000.0,
        &out,
    );
    sane("batches", batches[5], 20.0..=1e7, &out);
    let passes = figures(&out, "scheduling pass");
    sane("scheduling passes", passes[2], 1.0..=1e7, &out);
    let rounds = figures(&out, "alert round");
    sane("alert rounds", rounds[2], 1.0..=1e5, &out);
    sane("server cores", n("server_cores"), 1e-4..=64.0, &out);
    sane("server RSS MiB", n("rss_mib"), 1.0..=1e5, &out);
    // The verdict follows from the figures (how fast is BENCHMARKS.md's business).
    let follows = n("sync_p99_ms") < 1000.0
        && n("lag_p99_ms") < 2000.0
        && n("not_up_worst") == 0.0
        && n("marked_down") == 0.0
        && n("lost") == 0.0;
    assert_eq!(json["held"], follows, "{out}");
}

/// The same fleet spread over two ingest servers: every node follows its sync answer to one,
/// both take a share, and every acknowledged sample is in the control server's SQL once they
/// have flushed.
#[test]
fn fleet_with_ingest_servers_in_a_tiny_mode() {
    let (out, json) = tiny_fleet(&["--seconds", "5", "--ingest-servers", "2"]);
    assert_eq!(json["ingest_servers"], 2, "{out}");
    assert_eq!(json["lost"], 0, "{out}");
    assert_eq!(json["marked_down"], 0, "{out}");
    let acked = json["acked_samples"].as_f64().unwrap_or(0.0);
    sane("acknowledged samples", acked, 100.0..=1e7, &out);
    // Each took a share, and together most of it (a node's batches before its first sync
    // answer go to the control server).
    let took: Vec<f64> = json["ingest_samples"]
        .as_array()
        .expect("ingest_samples")
        .iter()
        .map(|c| c.as_f64().unwrap_or(0.0))
        .collect();
    assert!(took.iter().all(|&t| t > 0.0), "{out}");
    assert!(took.iter().sum::<f64>() >= acked / 2.0, "{out}");
    assert!(out.contains("ingest servers      2 on CPUs"), "{out}");
}

#[test]
fn metrics_in_a_tiny_mode() {
    let out = bench(&["metrics", "--nodes", "3", "--gpus", "2", "--scrapes", "2"]);
    no_nan(&out);
    // "/metrics for 3 nodes x 2 GPUs (303 series, 28 KiB), 2 scrapes over HTTP"
    let shape = figures(&out, "/metrics for ");
    assert_eq!((shape[0], shape[1], shape[4]), (3.0, 2.0, 2.0), "{out}");
    sane("series", shape[2], 6.0..=1e7, &out);
    sane("KiB", shape[3], 1.0..=1e6, &out);
    let times = figures(&out, "median");
    assert!(times.len() == 2, "{out}");
    sane("median ms", times[0], 0.0..=60_000.0, &out);
    sane("slowest ms", times[1], 0.05..=60_000.0, &out);
    assert!(times[0] <= times[1], "median above slowest:\n{out}");
}

#[test]
fn jobs_in_a_tiny_mode() {
    let out = bench(&["jobs", "--seconds", "1", "--clients", "2", "--starts", "2"]);
    no_nan(&out);
    // "65 jobs in 1.0 s = 63 jobs/s"
    let rate = numbers(
        out.lines()
            .find(|l| l.contains("jobs/s"))
            .unwrap_or_else(|| panic!("{out}")),
    );
    sane("jobs submitted", rate[0], 1.0..=1e8, &out);
    sane("seconds", rate[1], 0.5..=60.0, &out);
    sane("jobs/s", rate[2], 0.01..=1e8, &out);
    about(
        "jobs/s",
        rate[2],
        rate[0] / rate[1],
        0.05 / rate[1] + 0.5 / rate[2] + 0.01,
        &out,
    );
    // "median 493 ms, p95 493 ms, slowest 493 ms": each start is waited for 30 s at most.
    let starts = figures(&out, "submit-to-start on an idle node");
    assert_eq!(starts.first(), Some(&2.0), "{out}");
    let latencies: Vec<f64> = numbers(
        out.lines()
            .skip_while(|l| !l.contains("submit-to-start"))
            .nth(1)
            .unwrap_or_default(),
    )
    .into_iter()
    .filter(|&n| n != 95.0)
    .collect();
    ordered_latencies("submit-to-start", &latencies, 30_000.0, &out);
}

#[test]
fn freshness_in_a_tiny_mode() {
    let out = bench(&["freshness", "--rounds", "3", "--gpus", "2"]);
    no_nan(&out);
    let mut worst = 0.0;
    for label in [
        "sample taken -> visible to SQL",
        "request sent -> visible to SQL",
    ] {
        // "median 117.6 ms, p99 145.8 ms, max 145.8 ms (3 rounds)"; p99 is a label.
        let values: Vec<f64> = figures(&out, label)
            .into_iter()
            .filter(|&n| n != 99.0)
            .collect();
        assert_eq!(values.len(), 4, "{label}: {values:?}\n{out}");
        ordered_latencies(label, &values[..3], 60_000.0, &out);
        sane(&format!("{label} rounds"), values[3], 1.0..=3.0, &out);
        if label.starts_with("sample") {
            worst = values[2];
        }
    }
    let verdict = if worst <= 2000.0 { "met" } else { "missed" };
    assert!(
        out.contains(&format!(
            "target: visible at most 2000 ms after sending: {verdict}"
        )),
        "the verdict does not follow from the slowest round ({worst} ms):\n{out}"
    );
}

/// The `(x)` rows of the query benchmark's table under the line holding `header` (warm: with
/// a row count first): (name, perch median, DuckDB median, printed ratio).
fn query_rows(out: &str, header: &str, warm: bool) -> Vec<(String, f64, f64, f64)> {
    out.lines()
        .skip_while(|l| !l.contains(header))
        .skip(1)
        .skip_while(|l| !l.starts_with('('))
        .take_while(|l| l.starts_with('('))
        .map(|l| {
            let (name, rest) = l.split_once(' ').unwrap_or((l, ""));
            let n = numbers(rest);
            // Warm: rows, perch median (min-max), DuckDB median (min-max), ratio, checksum.
            let at = if warm { 1 } else { 0 };
            assert!(n.len() > at + 6, "a row without its figures: {l}\n{out}");
            (name.to_owned(), n[at], n[at + 3], n[at + 6])
        })
        .collect()
}

/// Checks a table of timings against DuckDB's and the verdict printed under it.
fn check_against_duckdb(out: &str, rows: &[(String, f64, f64, f64)], verdict_label: &str) {
    assert!(!rows.is_empty(), "no rows for {verdict_label}:\n{out}");
    for (name, perch, duckdb, ratio) in rows {
        sane(&format!("{name} perch ms"), *perch, 0.01..=600_000.0, out);
        sane(&format!("{name} DuckDB ms"), *duckdb, 0.01..=600_000.0, out);
        sane(&format!("{name} perch/DuckDB"), *ratio, 1e-4..=1e5, out);
        about(
            &format!("{name} perch/DuckDB"),
            *ratio,
            perch / duckdb,
            0.05 / perch + 0.05 / duckdb + 0.005 / ratio + 0.001,
            out,
        );
    }
    // "met", or "missed on a, c": the queries whose median is above DuckDB's. Medians printed
    // equal may have gone either way.
    let said = out
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{verdict_label}: ")))
        .unwrap_or_else(|| panic!("no verdict line {verdict_label:?}:\n{out}"));
    let listed: Vec<&str> = match said.strip_prefix("missed on ") {
        Some(names) => names.split(", ").collect(),
        None => {
            assert_eq!(said, "met", "{verdict_label}:\n{out}");
            Vec::new()
        }
    };
    for (name, perch, duckdb, _) in rows {
        let name = name.trim_matches(|c| c == '(' || c == ')');
        let is_listed = listed.contains(&name);
        assert!(
            perch == duckdb || is_listed == (perch > duckdb),
            "{verdict_label}: ({name}) at {perch} ms against {duckdb} ms, yet {}listed in {said:?}:\n{out}",
            if is_listed { "" } else { "not " }
        );
    }
    assert!(
        listed
            .iter()
            .all(|n| rows.iter().any(|r| r.0 == format!("({n})"))),
        "{verdict_label}: {said:?} names a query with no row:\n{out}"
    );
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
    no_nan(&out);
    assert!(out.contains("both engines agree"), "{out}");
    let warm = query_rows(&out, "timed runs per query and engine", true);
    check_against_duckdb(&out, &warm, "target: no query slower than DuckDB");
    let cold_rows = query_rows(&out, "starts per engine, alternating", false);
    assert_eq!(
        cold_rows.len(),
        warm.len(),
        "a cold time for each query:\n{out}"
    );
    check_against_duckdb(&out, &cold_rows, "cold: no query slower than DuckDB");
    // "  perch 1028.4 (1028.4-1028.4)   DuckDB 133.8 (133.8-133.8)   perch/D 7.69"
    let dashboard = numbers(
        out.lines()
            .skip_while(|l| !l.starts_with("dashboard: "))
            .nth(1)
            .unwrap_or_else(|| panic!("no dashboard figures:\n{out}")),
    );
    assert_eq!(dashboard.len(), 7, "{out}");
    let (perch, duckdb, ratio) = (dashboard[0], dashboard[3], dashboard[6]);
    sane("dashboard perch ms", perch, 0.01..=600_000.0, &out);
    sane("dashboard DuckDB ms", duckdb, 0.01..=600_000.0, &out);
    about(
        "dashboard perch/DuckDB",
        ratio,
        perch / duckdb,
        0.05 / perch + 0.05 / duckdb + 0.005 / ratio + 0.001,
        &out,
    );
    let verdict = if perch <= duckdb { "met" } else { "missed" };
    assert!(
        perch == duckdb
            || out.contains(&format!(
                "dashboard: refresh no slower than DuckDB's: {verdict}"
            )),
        "the dashboard's verdict does not follow ({verdict}):\n{out}"
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
    no_nan(&out);
    // "first full render of the fleet view (navigation to painted, 1 loads): median 875 ms (min
    // 679, max 1726)"
    let render = figures(&out, "first full render of the fleet view");
    assert_eq!(render.len(), 4, "{out}");
    ordered_latencies(
        "first render",
        &[render[2], render[1], render[3]],
        600_000.0,
        &out,
    );
    sane("first render ms", render[1], 1.0..=600_000.0, &out);
    // "JS heap: 3.3 MB at the start, 3.7 MB at the end, 3.7 MB at most; DOM nodes 44363 -> 44333"
    let heap = figures(&out, "JS heap:");
    assert_eq!(heap.len(), 5, "{out}");
    for (what, v) in ["heap at the start", "heap at the end", "heap at most"]
        .iter()
        .zip(&heap[..3])
    {
        sane(what, *v, 0.01..=100_000.0, &out);
    }
    assert!(heap[0] <= heap[2] && heap[1] <= heap[2], "{out}");
    // 2 nodes x 2 GPUs: at least a cell each.
    sane("DOM nodes at the start", heap[3], 4.0..=1e8, &out);
    sane("DOM nodes at the end", heap[4], 4.0..=1e8, &out);
    // The demo it ran was stopped with its jobs: none of them (they start in the demo's data
    // directory, under `dir`) is left. Other processes on the machine do not count.
    let left = processes_under(dir.path());
    assert!(left.is_empty(), "the demo's jobs outlived it: {left:?}");
}
