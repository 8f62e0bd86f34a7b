//! Every job reproducible, end to end against the real binary: `perch submit` in a git
//! repository with an uncommitted change records the commit, branch, diff and untracked
//! files; the node (an agent on the stand-in NVML) adds the job's environment after perch's
//! additions, secrets redacted, and its driver and CUDA versions; `perch show --provenance`,
//! `GET /v1/jobs/{id}/provenance` and the `job_provenance` table show it to the job's user and
//! operators only; `perch rerun` runs the recorded commit with its changes again, and refuses
//! with the reason once the commit is gone. Oversize provenance is refused naming the limit.

mod common;

use common::standin::{self, Agent};
use common::{ALICE, BOB, OPERATOR, Perch, wait_for};
use serde_json::{Value, json};
use std::path::Path;
use std::process::Command;

/// `perch agent` for node `gpu-a` on the stand-in NVML (one H100, driver 550.54.15, CUDA
/// 12.4), with the agent's token; killed when dropped.
fn standin_agent(dir: &Path, server: &str) -> Agent {
    let scenario = json!({
        "clock": "seconds",
        "driver_version": "550.54.15",
        "cuda_version": 12040,
        "gpus": [{
            "uuid": "GPU-PROVENANCE-0",
            "name": "NVIDIA H100 80GB HBM3",
            "timeline": [{"at": 0, "set": {"util_gpu": 50, "memory_total_bytes": 85_520_809_984_u64}}],
        }],
    });
    Agent::start_named(
        dir,
        server,
        "gpu-a",
        &standin::library(),
        &scenario,
        &[("PERCH_TOKEN", common::AGENT)],
    )
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
        .args(args)
        .current_dir(dir)
        .output()
        .expect("git");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A repository at `dir` with `train.sh` committed on branch `main`; returns the commit.
fn repository(dir: &Path, script: &str) -> String {
    std::fs::create_dir_all(dir).expect("repo dir");
    git(dir, &["init", "-q", "-b", "main"]);
    std::fs::write(dir.join("train.sh"), script).expect("train.sh");
    git(dir, &["add", "train.sh"]);
    git(dir, &["commit", "-q", "-m", "first"]);
    git(dir, &["rev-parse", "HEAD"])
}

/// The `perch` CLI in `dir` against `server` with `token`: (success, stdout, stderr).
fn perch_in(dir: &Path, server: &Perch, token: &str, args: &[&str]) -> (bool, String, String) {
    let out = common::client()
        .args(args)
        .current_dir(dir)
        .env("PERCH_SERVER", &server.url)
        .env("PERCH_TOKEN", token)
        .output()
        .expect("run perch");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn submitted_id(stdout: &str) -> u64 {
    stdout
        .split_whitespace()
        .nth(2)
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no job id in {stdout:?}"))
}

fn get_as(server: &Perch, token: &str, path: &str) -> (u16, Value) {
    let r = reqwest::blocking::Client::new()
        .get(format!("{}{path}", server.url))
        .bearer_auth(token)
        .send()
        .expect("GET");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

fn sql_as(server: &Perch, token: &str, query: &str) -> Vec<Value> {
    let r = reqwest::blocking::Client::new()
        .post(format!("{}/v1/sql", server.url))
        .bearer_auth(token)
        .json(&json!({"sql": query}))
        .send()
        .expect("POST /v1/sql");
    let status = r.status();
    let body: Value = r.json().expect("JSON");
    assert!(status.is_success(), "{query}: {status} {body}");
    body["rows"].as_array().expect("rows").clone()
}

fn wait_state(server: &Perch, id: u64, state: &str) {
    wait_for(&format!("job {id} {state}"), || {
        let (_, j) = get_as(server, ALICE, &format!("/v1/jobs/{id}"));
        (j["state"] == state).then_some(())
    });
}

/// The provenance record once its node's start report is in.
fn provenance_with_run(server: &Perch, id: u64) -> Value {
    wait_for(&format!("job {id}'s start report"), || {
        let (status, p) = get_as(server, ALICE, &format!("/v1/jobs/{id}/provenance"));
        (status == 200 && p["runs"].as_array().is_some_and(|r| !r.is_empty())).then_some(p)
    })
}

fn stdout_of(server: &Perch, id: u64) -> String {
    let r = reqwest::blocking::Client::new()
        .get(format!("{}/v1/jobs/{id}/logs", server.url))
        .bearer_auth(ALICE)
        .send()
        .expect("logs");
    r.text().unwrap_or_default()
}

#[test]
fn a_job_records_what_it_ran_and_runs_it_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = common::server_with_tokens(dir.path(), &common::role_tokens("gpu-a"));
    let _agent = standin_agent(dir.path(), &server.url);
    wait_for("gpu-a up", || {
        (common::nodes_up(&get_as(&server, ALICE, "/v1/nodes").1) == 1).then_some(())
    });

    let repo = dir.path().join("model");
    let commit = repository(&repo, "echo v1\n");
    // Uncommitted: the script changed, and a file git does not track.
    std::fs::write(repo.join("train.sh"), "echo v2\n").expect("edit");
    std::fs::write(repo.join("notes.txt"), "scratch").expect("untracked");
    let (ok, out, err) = perch_in(
        &repo,
        &server,
        ALICE,
        &[
            "submit",
            "--gpus",
            "1",
            "-D",
            ".",
            "-e",
            "HF_TOKEN=hf_secret",
            "-e",
            "MODE=fast",
            "--",
            "sh",
            "train.sh",
        ],
    );
    assert!(ok, "{out}{err}");
    let id = submitted_id(&out);
    wait_state(&server, id, "completed");
    assert_eq!(stdout_of(&server, id), "v2\n");

    // The record: submit side and the node's report.
    let p = provenance_with_run(&server, id);
    let g = &p["submit"]["git"];
    assert_eq!(g["commit"], commit.as_str(), "{p}");
    assert_eq!(g["branch"], "main");
    assert_eq!(g["dirty"], true);
    assert!(
        g["diff"].as_str().is_some_and(|d| d.contains("+echo v2")),
        "{g}"
    );
    assert_eq!(g["untracked"], json!(["notes.txt"]));
    let run = &p["runs"][0];
    assert_eq!(run["node"], "gpu-a");
    assert_eq!(run["driver_version"], "550.54.15");
    assert_eq!(run["cuda_version"], "12.4");
    assert_eq!(
        run["env"]["HF_TOKEN"], "<redacted>",
        "secrets' values are not kept"
    );
    assert_eq!(run["env"]["MODE"], "fast");
    assert_eq!(
        run["env"]["CUDA_VISIBLE_DEVICES"], "0",
        "perch's additions are"
    );
    assert!(!p.to_string().contains("hf_secret"), "{p}");
    // The job's own metrics token (perch's addition) is a credential too.
    assert_eq!(
        run["env"]["OTEL_EXPORTER_OTLP_HEADERS"], "<redacted>",
        "{p}"
    );
    assert!(!p.to_string().contains("perch-job."), "{p}");

    let (ok, shown, err) = perch_in(
        &repo,
        &server,
        ALICE,
        &["show", &id.to_string(), "--provenance"],
    );
    assert!(ok, "{err}");
    for want in [
        format!("Commit={commit}"),
        "Branch=main Dirty=yes".to_owned(),
        "notes.txt".to_owned(),
        "Driver=550.54.15 CUDA=12.4".to_owned(),
        "HF_TOKEN=<redacted>".to_owned(),
        "+echo v2".to_owned(),
    ] {
        assert!(shown.contains(&want), "{want:?} not in:\n{shown}");
    }

    // SQL: the owner's row, nobody else's.
    let rows = sql_as(
        &server,
        ALICE,
        &format!(
            "SELECT git_commit, git_branch, git_dirty, driver_version, cuda_version, untracked_files FROM job_provenance WHERE job = {id}"
        ),
    );
    assert_eq!(
        rows,
        vec![
            json!({"git_commit": commit, "git_branch": "main", "git_dirty": true,
            "driver_version": "550.54.15", "cuda_version": "12.4", "untracked_files": 1})
        ]
    );
    let count =
        |token| sql_as(&server, token, "SELECT count(*) AS n FROM job_provenance")[0]["n"].clone();
    assert_eq!(
        count(BOB),
        json!(0),
        "another user sees none of alice's rows"
    );
    assert_eq!(count(OPERATOR), json!(1), "an operator sees every row");

    // Another user: refused, as for the job's output.
    let (status, body) = get_as(&server, BOB, &format!("/v1/jobs/{id}/provenance"));
    assert_eq!(status, 403, "{body}");
    let (ok, _, err) = perch_in(
        &repo,
        &server,
        BOB,
        &["show", &id.to_string(), "--provenance"],
    );
    assert!(!ok && err.contains("belongs to alice"), "{err}");
    let (ok, _, err) = perch_in(&repo, &server, BOB, &["rerun", &id.to_string()]);
    assert!(!ok && err.contains("belongs to alice"), "{err}");

    // The repository moves on; the rerun runs the recorded commit with the recorded change.
    std::fs::write(repo.join("train.sh"), "echo v3\n").expect("edit");
    git(&repo, &["commit", "-q", "-am", "v3"]);
    let (ok, out, err) = perch_in(dir.path(), &server, ALICE, &["rerun", &id.to_string()]);
    assert!(ok, "{out}{err}");
    assert!(out.contains(&format!("rerun of {id}")), "{out}");
    let again = submitted_id(&out);
    wait_state(&server, again, "completed");
    assert_eq!(
        stdout_of(&server, again),
        "v2\n",
        "the recorded code ran, not v3"
    );
    let p2 = provenance_with_run(&server, again);
    assert_eq!(p2["submit"]["rerun_of"], id);
    assert_eq!(p2["submit"]["git"]["commit"], commit.as_str());
    assert_eq!(p2["submit"]["git"]["diff"], g["diff"]);
    assert_eq!(p2["runs"][0]["env"]["MODE"], "fast", "the same environment");

    // The commit gone: a fresh repository where the old one was.
    std::fs::remove_dir_all(&repo).expect("remove repo");
    repository(&repo, "echo other\n");
    let (ok, out, err) = perch_in(dir.path(), &server, ALICE, &["rerun", &id.to_string()]);
    assert!(!ok, "{out}");
    assert!(
        err.contains(&format!("commit {commit} is gone from the repository")),
        "{err}"
    );
}

#[test]
fn provenance_past_its_bounds_is_refused_or_cut_and_then_not_rerun() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = common::server_with_tokens(dir.path(), &common::role_tokens("gpu-a"));
    // Through the API: refused, naming the field and the limit.
    let r = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", server.url))
        .bearer_auth(ALICE)
        .json(&json!({
            "command": ["true"],
            "hold_until_fits": true,
            "provenance": {"git": {
                "root": "/src", "commit": "0123456789abcdef0123456789abcdef01234567",
                "dirty": true, "diff": "x".repeat(256 * 1024 + 1)
            }}
        }))
        .send()
        .expect("POST /v1/jobs");
    let status = r.status().as_u16();
    let body: Value = r.json().expect("JSON");
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("provenance.git.diff") && message.contains("262144"),
        "{message}"
    );

    // Through the CLI: a larger diff is cut, said so, and such a job is not rerun.
    let repo = dir.path().join("big");
    repository(&repo, "echo v1\n");
    let line = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcde\n";
    std::fs::write(repo.join("train.sh"), line.repeat(5000)).expect("big change");
    let (ok, out, err) = perch_in(
        &repo,
        &server,
        ALICE,
        &["submit", "--hold-until-fits", "--", "sh", "train.sh"],
    );
    assert!(ok, "{out}{err}");
    let id = submitted_id(&out);
    let (status, p) = get_as(&server, ALICE, &format!("/v1/jobs/{id}/provenance"));
    assert_eq!(status, 200, "{p}");
    let g = &p["submit"]["git"];
    assert_eq!(g["diff_truncated"], true, "{g}");
    assert_eq!(g["diff"].as_str().map(str::len), Some(256 * 1024));
    assert!(
        g["diff_bytes"].as_u64().is_some_and(|n| n > 256 * 1024),
        "{g}"
    );
    let (ok, out, err) = perch_in(&repo, &server, ALICE, &["rerun", &id.to_string()]);
    assert!(!ok, "{out}");
    assert!(err.contains("cannot be applied again"), "{err}");
    // `--here` runs the repository as it stands.
    let (ok, out, err) = perch_in(&repo, &server, ALICE, &["rerun", &id.to_string(), "--here"]);
    assert!(ok && out.contains("--here"), "{out}{err}");
}
