//! What a user of the CLI expects from habits learnt elsewhere (sbatch, Slurm's dependencies,
//! `kubectl logs`, PostgreSQL): a job file's `user =` is the job's user, a dependency on an
//! array waits for every task, the logs of a pending job say so, and SQL time mistakes are
//! answered with the right form.

mod common;

use common::{Perch, client, wait_for};
use serde_json::Value;
use std::process::Output;

fn text(out: &Output) -> (bool, String, String) {
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn wait_state(perch: &Perch, id: u64, state: &str) -> Value {
    wait_for(&format!("job {id} to be {state}"), || {
        let j = perch.job(id);
        (j["state"] == state).then_some(j)
    })
}

#[test]
fn a_job_files_user_is_the_jobs_user_and_only_operators_may_name_another() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("job.toml");
    std::fs::write(&file, "command = [\"true\"]\nuser = \"bob\"\n").expect("job file");
    let file = file.to_str().expect("utf-8");
    let perch = common::server_with_tokens(dir.path(), &common::role_tokens("gpu-a"));
    let submit = |token: &str, user_env: &str, extra: &[&str]| {
        text(
            &client()
                .args(["submit", "--server", &perch.url, "--token", token])
                .args(extra)
                .env("USER", user_env)
                .output()
                .expect("perch submit"),
        )
    };
    let get = |path: &str| -> Value {
        reqwest::blocking::Client::new()
            .get(format!("{}{path}", perch.url))
            .bearer_auth(common::OPERATOR)
            .send()
            .and_then(|r| r.json())
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    };
    let user_of = |id: u64| get(&format!("/v1/jobs/{id}"))["request"]["user"].clone();
    // An operator submitting a file for bob: the file's user, not $USER (was ops's $USER).
    let (ok, out, err) = submit(common::OPERATOR, "ops", &["--file", file]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "Submitted job 1");
    assert_eq!(user_of(1), "bob");
    // --user still wins over the file.
    let (ok, _, err) = submit(
        common::OPERATOR,
        "ops",
        &["--file", file, "--user", "carol"],
    );
    assert!(ok, "{err}");
    assert_eq!(user_of(2), "carol");
    // An ordinary user's token may not submit as bob: a clear refusal, nothing submitted.
    let (ok, _, err) = submit(common::ALICE, "alice", &["--file", file]);
    assert!(!ok);
    assert!(
        err.contains("you are alice; only operators submit jobs as another user (bob)"),
        "{err}"
    );
    let all = get("/v1/jobs?state=pending");
    assert_eq!(all["jobs"].as_array().map(Vec::len), Some(2), "{all}");
    // Without a user in the file, alice's own $USER (her own name) is fine.
    std::fs::write(dir.path().join("mine.toml"), "command = [\"true\"]\n").expect("job file");
    let mine = dir.path().join("mine.toml");
    let (ok, _, err) = submit(
        common::ALICE,
        "alice",
        &["--file", mine.to_str().expect("utf-8")],
    );
    assert!(ok, "{err}");
    assert_eq!(user_of(3), "alice");
    // The body of POST /v1/jobs, as JSON, is a job file too.
    let json = dir.path().join("mine.json");
    std::fs::write(&json, r#"{"command": ["true"], "name": "from-json"}"#).expect("job file");
    let (ok, _, err) = submit(
        common::ALICE,
        "alice",
        &["--file", json.to_str().expect("utf-8")],
    );
    assert!(ok, "{err}");
    assert_eq!(get("/v1/jobs/4")["request"]["name"], "from-json");
    // A file that is neither says which file, where, and what it may be.
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "command = \n").expect("job file");
    let (ok, _, err) = submit(
        common::ALICE,
        "alice",
        &["--file", bad.to_str().expect("utf-8")],
    );
    assert!(!ok);
    assert!(
        err.contains("bad.toml as TOML (or give the JSON object POST /v1/jobs takes)")
            && err.contains("line 1"),
        "{err}"
    );
}

#[test]
fn root_is_told_to_name_a_user_with_dash_dash_user() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(dir.path(), &["server"]);
    let (ok, _, err) = perch.cli_as("root", &["submit", "--", "true"]);
    assert!(!ok);
    assert!(
        err.contains("jobs never run as root") && err.contains("perch submit --user NAME"),
        "{err}"
    );
}

#[test]
fn a_dependency_on_an_array_waits_for_every_task() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        dir.path(),
        &["up", "--simulate-gpus", "3", "--interval-ms", "200"],
    );
    let cli = |args: &[&str]| perch.cli_as("alice", args);
    // Task 0 ends at once; task 1 waits for a marker, then succeeds (array 1: jobs 1-2).
    let marker = dir.path().join("go");
    let task = format!(
        "if [ \"$PERCH_ARRAY_TASK_ID\" = 1 ]; then while [ ! -e {} ]; do sleep 0.1; done; fi",
        marker.display()
    );
    let (ok, out, err) = cli(&[
        "submit", "--gpus", "1", "--array", "2", "--", "sh", "-c", &task,
    ]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "Submitted array job 1 (tasks 1-2)");
    let (ok, _, err) = cli(&["submit", "--gpus", "1", "--after-ok", "1", "--", "true"]); // 3
    assert!(ok, "{err}");
    let (ok, _, err) = cli(&["submit", "--gpus", "1", "--after-any", "1", "--", "true"]); // 4
    assert!(ok, "{err}");
    wait_state(&perch, 2, "running");
    wait_state(&perch, 1, "completed");
    // Task 0 ended: the control plane looked at the held jobs in that same step, and they
    // wait on, for task 1 (they started at once when only task 0 counted).
    for id in [3, 4] {
        let held = perch.job(id);
        assert_eq!(held["state"], "pending", "{held}");
        assert!(
            held["reason"]
                .as_str()
                .unwrap_or("")
                .contains("waiting for dependencies"),
            "{held}"
        );
    }
    std::fs::write(&marker, b"").expect("marker");
    wait_state(&perch, 2, "completed");
    wait_state(&perch, 3, "completed");
    wait_state(&perch, 4, "completed");

    // An array whose later task fails: after_ok can never be met, after_any still is.
    let (ok, out, err) = cli(&[
        "submit",
        "--gpus",
        "1",
        "--array",
        "2",
        "--",
        "sh",
        "-c",
        "exit $PERCH_ARRAY_TASK_ID",
    ]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "Submitted array job 5 (tasks 5-6)");
    cli(&["submit", "--gpus", "1", "--after-ok", "5", "--", "true"]); // 7
    cli(&["submit", "--gpus", "1", "--after-any", "5", "--", "true"]); // 8
    let never = wait_state(&perch, 7, "cancelled");
    assert!(
        never["reason"]
            .as_str()
            .unwrap_or("")
            .contains("task 1 (job 6) of array 5 ended failed"),
        "{never}"
    );
    wait_state(&perch, 8, "completed");

    // Slurm's afternotok: met when a task did not complete, never when every one did.
    let (ok, _, err) = cli(&["submit", "--gpus", "1", "--after-not-ok", "5", "--", "true"]); // 9
    assert!(ok, "{err}");
    let (ok, _, err) = cli(&["submit", "--gpus", "1", "--after-not-ok", "1", "--", "true"]); // 10
    assert!(ok, "{err}");
    wait_state(&perch, 9, "completed");
    let never = wait_state(&perch, 10, "cancelled");
    assert!(
        never["reason"]
            .as_str()
            .unwrap_or("")
            .contains("every task of array 1 completed (after_not_ok)"),
        "{never}"
    );
}

#[test]
fn the_logs_of_a_pending_job_say_it_is_pending_and_follow_waits_for_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        dir.path(),
        &["up", "--simulate-gpus", "1", "--interval-ms", "200"],
    );
    let cli = |args: &[&str]| perch.cli_as("alice", args);
    let marker = dir.path().join("go");
    let wait = format!("while [ ! -e {} ]; do sleep 0.1; done", marker.display());
    cli(&["submit", "--gpus", "1", "--", "sh", "-c", &wait]); // 1: holds the GPU
    let (ok, _, err) = cli(&["submit", "--gpus", "1", "--", "echo", "hello"]); // 2: waits
    assert!(ok, "{err}");
    wait_state(&perch, 1, "running");
    // It printed nothing and exited 0, as if the job had run and said nothing.
    let (ok, out, err) = cli(&["logs", "2"]);
    assert!(!ok, "a pending job has no output yet: {out}");
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains("job 2 is pending") && err.contains("perch logs -f 2"),
        "{err}"
    );
    // Followed, it is waited for, then shown.
    let stderr = dir.path().join("follower.err");
    let follower = client()
        .args(["logs", "-f", "2"])
        .env("PERCH_SERVER", &perch.url)
        .env("USER", "alice")
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&stderr).expect("stderr file"))
        .spawn()
        .expect("perch logs -f");
    wait_for("the follower to say the job is pending", || {
        std::fs::read_to_string(&stderr)
            .ok()
            .filter(|e| e.contains("job 2 is pending") && e.contains("waiting for it to start"))
    });
    std::fs::write(&marker, b"").expect("marker");
    let (ok, out, _) = text(&follower.wait_with_output().expect("wait"));
    let err = std::fs::read_to_string(&stderr).unwrap_or_default();
    assert!(ok, "{err}");
    assert_eq!(out, "hello\n");
}

#[test]
fn sql_time_mistakes_are_answered_with_the_interval_form() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(dir.path(), &["server"]);
    for (query, want) in [
        (
            "SELECT count(*) FROM gpu_samples WHERE time > now() - INTERVAL '5 minuts'",
            "INTERVAL '5 minutes'",
        ),
        (
            "SELECT count(*) FROM gpu_samples WHERE time > now() - '5 minutes'",
            "now() - INTERVAL '5 minutes'",
        ),
        (
            "SELECT count(*) FROM gpu_samples WHERE time > now() - 300",
            "now() - INTERVAL '300 seconds'",
        ),
        (
            "SELECT count(*) FROM gpu_samples WHERE time > 300",
            "time > now() - INTERVAL '5 minutes'",
        ),
    ] {
        let (ok, _, err) = text(&perch.sql_cli(query, &[]));
        assert!(!ok && err.contains(want), "{query}: {err}");
    }
    // The right form runs.
    let (ok, _, err) = text(&perch.sql_cli(
        "SELECT count(*) FROM gpu_samples WHERE time > now() - INTERVAL '5 minutes'",
        &[],
    ));
    assert!(ok, "{err}");
    // A refusal of what a statement does is not about who sent it: on an open server, no
    // token would change it (it said "no token: give --token, PERCH_TOKEN or [client] token").
    let (ok, _, err) = text(&perch.sql_cli("DELETE FROM jobs", &[]));
    assert!(!ok && err.contains("read-only"), "{err}");
    assert!(!err.contains("token"), "{err}");
}

#[test]
fn the_up_banner_names_the_user_for_root_and_says_what_scrapes_what() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(dir.path(), &["up", "--simulate-gpus", "1"]);
    let banner = wait_for("the banner", || {
        let log = perch.log();
        log.contains("  stop:").then_some(log)
    });
    let line = |label: &str| {
        banner
            .lines()
            .find(|l| l.trim_start().starts_with(label))
            .unwrap_or_else(|| panic!("no {label} line: {banner}"))
            .to_owned()
    };
    // Root's own `perch submit` was refused (jobs never run as root) without naming --user.
    let jobs = line("jobs:");
    let root = nix::unistd::geteuid().is_root();
    assert_eq!(jobs.contains(" --user NAME "), root, "{jobs}");
    // Prometheus scrapes /metrics; Grafana's Prometheus data source points at Prometheus.
    let dashboards = line("dashboards:");
    assert!(
        dashboards.contains("Prometheus scrapes") && !dashboards.contains("data source at http"),
        "{dashboards}"
    );
}
