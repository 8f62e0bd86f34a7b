//! Attacks on a node by the holder of an ordinary user token, each run against the
//! real binary with the agent running as root and `run_as_user = required`, jobs running as a
//! user created with `useradd`. Each test asserts that the attack fails with a clear error and
//! that nothing else on the node was affected. They need root, as CI has; none skips.
//! `docs/security.md` lists the defences and the test that proves each.

mod common;

use common::{Agent, Perch, wait_for};
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;

/// The unprivileged user jobs run as (uid at least 1000), created once and kept.
const USER: &str = "perch-test-user";

fn require_root() {
    assert!(
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").expect("/proc")) == 0,
        "tests/isolation.rs runs the agent as root, as CI does: run it as root"
    );
}

/// Creates [`USER`] unless it exists; returns its uid.
fn test_user() -> u32 {
    require_root();
    let out = std::process::Command::new("useradd")
        .args(["-m", "-s", "/bin/sh", USER])
        .output()
        .expect("useradd");
    // 9: the user exists already (another test, or an earlier run).
    assert!(
        out.status.success() || out.status.code() == Some(9),
        "useradd {USER}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = std::process::Command::new("id")
        .args(["-u", USER])
        .output()
        .expect("id");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a uid")
}

/// A temporary directory the job's user can traverse (its job directory lies below).
fn open_tempdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
}

/// A server, and an agent on node `gpu-a` running jobs as their users, with `env` added to
/// the agent's environment.
fn cluster(dir: &Path, env: &[(&str, &str)]) -> (Perch, Agent) {
    let server = Perch::start(&dir.join("server"), &["server"]);
    let mut agent_env = vec![("PERCH_RUN_AS_USER", "required")];
    agent_env.extend_from_slice(env);
    let agent = Agent::start_with_env(
        &server.url,
        "gpu-a",
        &dir.join("agent"),
        1,
        None,
        &["--interval-ms", "200"],
        &agent_env,
    );
    (server, agent)
}

fn submit(perch: &Perch, args: &[&str]) -> u64 {
    let mut all = vec!["submit", "--gpus", "1", "--time", "5m"];
    all.extend_from_slice(args);
    let (ok, out, err) = perch.cli_as(USER, &all);
    assert!(ok, "{err}");
    out.trim()
        .strip_prefix("Submitted job ")
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("{out}"))
}

fn wait_ended(perch: &Perch, id: u64) -> Value {
    wait_for(&format!("job {id} to end"), || {
        let j = perch.job(id);
        let state = j["state"].as_str().unwrap_or("").to_owned();
        (!["pending", "running", "stopping"].contains(&state.as_str())).then_some(j)
    })
}

fn logs(perch: &Perch, id: u64) -> String {
    let (ok, out, err) = perch.cli_as(USER, &["logs", &id.to_string()]);
    assert!(ok, "{err}");
    out
}

#[test]
fn loader_variables_are_refused_at_submission_with_the_reason() {
    require_root();
    let dir = open_tempdir();
    let server = Perch::start(&dir.path().join("server"), &["server"]);
    let (ok, _, err) = server.cli_as(
        USER,
        &["submit", "--env", "LD_PRELOAD=/tmp/euid.so", "--", "true"],
    );
    assert!(!ok, "submitted");
    assert!(err.contains("LD_PRELOAD is refused on every node"), "{err}");
    let response = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", server.url))
        .json(
            &serde_json::json!({"command": ["true"], "user": USER, "env": {"GCONV_PATH": "/tmp"}}),
        )
        .send()
        .expect("POST /v1/jobs");
    assert_eq!(response.status(), 400);
    let body: Value = response.json().expect("JSON");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("GCONV_PATH is refused"), "{body}");
    assert_eq!(
        server.get("/v1/jobs")["jobs"],
        serde_json::json!([]),
        "nothing queued"
    );
}

#[test]
fn a_job_sees_nothing_of_the_agents_environment() {
    let uid = test_user();
    let dir = open_tempdir();
    let (server, _agent) = cluster(
        dir.path(),
        &[
            ("PERCH_TOKEN", "secret-agent-token"),
            ("SOME_AGENT_VAR", "agent-only"),
            ("LANG", "C.UTF-8"),
        ],
    );
    let id = submit(
        &server,
        &[
            "--env",
            "MINE=mine",
            "--",
            "sh",
            "-c",
            "echo uid=$(id -u); env",
        ],
    );
    let j = wait_ended(&server, id);
    assert_eq!(j["state"], "completed", "{j}");
    let env = wait_for("the job's output", || {
        let out = logs(&server, id);
        out.contains("MINE=").then_some(out)
    });
    assert!(
        env.starts_with(&format!("uid={uid}\n")),
        "runs as {USER}:\n{env}"
    );
    let vars: Vec<&str> = env
        .lines()
        .skip(1)
        .filter_map(|l| l.split('=').next())
        .collect();
    for leaked in [
        "PERCH_TOKEN",
        "SOME_AGENT_VAR",
        "PERCH_RUN_AS_USER",
        "PERCH_LOG",
    ] {
        assert!(!vars.contains(&leaked), "{leaked} reached the job:\n{env}");
    }
    assert!(!env.contains("secret-agent-token"), "{env}");
    for (k, v) in [
        ("MINE", "mine".to_owned()),
        ("PERCH_JOB_ID", id.to_string()),
        ("CUDA_VISIBLE_DEVICES", "0".to_owned()),
        ("CUDA_DEVICE_ORDER", "PCI_BUS_ID".to_owned()),
        ("USER", USER.to_owned()),
        ("LANG", "C.UTF-8".to_owned()),
    ] {
        assert!(
            env.lines().any(|l| l == format!("{k}={v}")),
            "{k}={v} missing:\n{env}"
        );
    }
    assert!(vars.contains(&"PATH"), "{env}");
    // Every variable is one the job set, perch's, or an allowed one.
    let allowed = |k: &str| {
        [
            "MINE",
            "PATH",
            "LANG",
            "HOME",
            "USER",
            "LOGNAME",
            "PWD",
            "CUDA_VISIBLE_DEVICES",
            "CUDA_DEVICE_ORDER",
            // perch's distributed-training variables
            "MASTER_ADDR",
            "MASTER_PORT",
            "WORLD_SIZE",
            "RANK",
            "NODE_RANK",
            "LOCAL_WORLD_SIZE",
        ]
        .contains(&k)
            || k.starts_with("PET_")
            || k.starts_with("PERCH_")
            || k.starts_with("OTEL_")
            || k.starts_with("LC_")
    };
    let unexpected: Vec<&&str> = vars.iter().filter(|k| !allowed(k)).collect();
    assert!(unexpected.is_empty(), "{unexpected:?} in\n{env}");
}

#[test]
fn root_and_system_users_cannot_run_jobs() {
    test_user();
    let dir = open_tempdir();
    let (server, _agent) = cluster(dir.path(), &[]);
    // root by name: refused at submission, naming the setting.
    let (ok, _, err) = server.cli_as("root", &["submit", "--", "id", "-u"]);
    assert!(!ok, "submitted as root");
    assert!(err.contains("agent.min_uid"), "{err}");
    // A system account (daemon, uid 1): the server cannot know its uid; the agent refuses it.
    let (ok, out, err) = server.cli_as("daemon", &["submit", "--gpus", "1", "--", "id", "-u"]);
    assert!(ok, "{err}");
    let id: u64 = out
        .trim()
        .strip_prefix("Submitted job ")
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    let j = wait_ended(&server, id);
    assert_eq!(j["state"], "failed", "{j}");
    let record = j.to_string();
    assert!(
        record.contains("below agent.min_uid = 1000"),
        "the record says why: {record}"
    );
    let out = {
        let (_, out, _) = server.cli_as("daemon", &["logs", &id.to_string()]);
        out
    };
    assert_eq!(out, "", "the job's command never ran");
    // The same agent still runs an ordinary user's job.
    let ok_id = submit(&server, &["--", "id", "-u"]);
    assert_eq!(wait_ended(&server, ok_id)["state"], "completed");
}

/// Whether process `pid` is alive (a zombie is dead: killed, not yet reaped).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

#[test]
fn a_forged_pgid_file_does_not_make_a_restarted_agent_kill_another_group() {
    test_user();
    let dir = open_tempdir();
    // Someone else's process, in a group of its own.
    let mut victim = std::process::Command::new("sleep")
        .arg("600")
        .process_group(0)
        .spawn()
        .expect("sleep");
    let victim_pid = victim.id();
    let server = Perch::start(&dir.path().join("server"), &["server"]);
    let start_agent = || {
        Agent::start_with_env(
            &server.url,
            "gpu-a",
            &dir.path().join("agent"),
            1,
            None,
            &["--interval-ms", "200"],
            &[("PERCH_RUN_AS_USER", "required")],
        )
    };
    let mut agent = start_agent();
    // The job keeps writing the victim's group into its `pgid` file, as a user could.
    let script = "echo $$ > mypid; while :; do echo $VICTIM > pgid; sleep 0.1; done";
    let victim_env = format!("VICTIM={victim_pid}");
    let id = submit(&server, &["--env", &victim_env, "--", "sh", "-c", script]);
    let job_dir = dir.path().join(format!("agent/jobs/gpu-a/{id}"));
    let job_pid: u32 = wait_for("the job to write its pid and the forged pgid", || {
        let forged = std::fs::read_to_string(job_dir.join("pgid")).ok()?;
        (forged.trim() == victim_pid.to_string()).then_some(())?;
        std::fs::read_to_string(job_dir.join("mypid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    });
    agent.kill();
    assert!(
        alive(job_pid),
        "the job outlives its agent (its supervisor watches it)"
    );
    let _agent = start_agent();
    // The new agent takes the job over (it runs on, the same attempt); cancelling it kills
    // the job's own group...
    std::thread::sleep(std::time::Duration::from_secs(2));
    let j = server.job(id);
    assert_eq!(
        (j["state"].as_str(), j["attempts"].as_u64()),
        (Some("running"), Some(1)),
        "{j}"
    );
    assert!(alive(job_pid), "taken over, not killed");
    let (ok, _, err) = server.cli_as(USER, &["cancel", &id.to_string()]);
    assert!(ok, "{err}");
    wait_for("the cancelled job to die", || {
        (!alive(job_pid)).then_some(())
    });
    // ...and only that: the group the job named is untouched.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        alive(victim_pid),
        "the agent killed the group named in a job's pgid file"
    );
    let state = dir.path().join("agent/jobs/gpu-a/.state");
    let mode = std::fs::metadata(&state)
        .expect("state dir")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "the state directory is root's only");
    let _ = victim.kill();
    let _ = victim.wait();
}

#[test]
fn a_job_cannot_read_a_root_only_file_through_its_logs() {
    test_user();
    let dir = open_tempdir();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "TOP-SECRET-root-only\n").expect("secret");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let (server, _agent) = cluster(dir.path(), &[]);
    // The job swaps both its logs for links to the secret, then keeps writing to the files it
    // was given.
    let script = format!(
        "echo before; cat {0} || echo cannot-read >&2; rm -f stdout stderr; \
         ln -s {0} stdout; ln -s {0} stderr; sleep 1; echo after",
        secret.display()
    );
    let id = submit(&server, &["--", "sh", "-c", &script]);
    let j = wait_ended(&server, id);
    assert_eq!(j["state"], "completed", "{j}");
    let out = wait_for("the job's output", || {
        let out = logs(&server, id);
        (out.contains("after") || out.contains("TOP-SECRET")).then_some(out)
    });
    assert!(
        !out.contains("TOP-SECRET"),
        "the logs showed a root-only file: {out}"
    );
    assert_eq!(out, "before\nafter\n");
    let (ok, err_log, err) = server.cli_as(USER, &["logs", &id.to_string(), "--stderr"]);
    assert!(ok, "{err}");
    assert!(
        err_log.contains("Permission denied"),
        "the job itself cannot read it: {err_log}"
    );
    let mut everything = format!("{out}{err_log}");
    for stream in ["stdout", "stderr"] {
        let url = format!("{}/v1/jobs/{id}/logs?stream={stream}", server.url);
        everything.push_str(
            &reqwest::blocking::get(&url)
                .and_then(|r| r.text())
                .unwrap_or_else(|e| panic!("GET {url}: {e}")),
        );
    }
    assert!(!everything.contains("TOP-SECRET"), "{everything}");
    // The secret is untouched: still root's, still private.
    let meta = std::fs::metadata(&secret).expect("secret");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), 0);
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(
        std::fs::read_to_string(&secret).expect("secret"),
        "TOP-SECRET-root-only\n"
    );
}
