//! Jobs end to end: submitted through the CLI, placed by the server's scheduler, run by the
//! agent with the right `CUDA_VISIBLE_DEVICES`, their output and final state visible; and
//! jobs and running processes surviving a `kill -9` of the server.

mod common;

use common::{Perch, wait_for};
use serde_json::Value;

fn cli(perch: &Perch, args: &[&str]) -> (bool, String, String) {
    perch.cli_as("alice", args)
}

fn job(perch: &Perch, id: u64) -> Value {
    perch.job(id)
}

fn wait_state(perch: &Perch, id: u64, state: &str) -> Value {
    wait_for(&format!("job {id} to be {state}"), || {
        let j = job(perch, id);
        (j["state"] == state).then_some(j)
    })
}

#[test]
fn a_submitted_job_runs_on_its_gpus_and_its_output_and_state_are_visible() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        dir.path(),
        &["up", "--simulate-gpus", "4", "--interval-ms", "200"],
    );
    let (ok, out, err) = cli(
        &perch,
        &[
            "submit",
            "--gpus",
            "2",
            "-J",
            "hello",
            "--",
            "sh",
            "-c",
            "echo gpus=$CUDA_VISIBLE_DEVICES job=$PERCH_JOB_ID; echo warn >&2; exit 3",
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "Submitted job 1");
    let j = wait_state(&perch, 1, "failed");
    assert_eq!(j["exit_code"], 3);
    assert_eq!(j["request"]["user"], "alice");
    assert_eq!(j["placement"][0]["gpus"], serde_json::json!([0, 1]));
    let logs = wait_for("stdout to arrive", || {
        let (_, out, _) = cli(&perch, &["logs", "1"]);
        (!out.is_empty()).then_some(out)
    });
    assert_eq!(logs, "gpus=0,1 job=1\n");
    let (_, err_log, _) = cli(&perch, &["logs", "1", "--stderr"]);
    assert_eq!(err_log, "warn\n");
    // Costs to the cent, not to the dime (a short job's read 0.0).
    let (_, shown, _) = cli(&perch, &["show", "1"]);
    let cost = shown
        .split_whitespace()
        .find_map(|w| w.strip_prefix("CostAllocated="))
        .unwrap_or_default()
        .to_owned();
    assert!(
        cost.len() >= 4 && cost.as_bytes()[cost.len() - 3] == b'.',
        "CostAllocated={cost} in:\n{shown}"
    );
    // A job that failed saying why on standard error only: `perch logs` points there.
    let (ok, _, err) = cli(
        &perch,
        &["submit", "--", "sh", "-c", "echo no such file >&2; exit 2"],
    );
    assert!(ok, "{err}");
    wait_state(&perch, 2, "failed");
    let hint = wait_for("the pointer to standard error", || {
        let (_, out, err) = cli(&perch, &["logs", "2"]);
        assert_eq!(out, "", "nothing on standard output");
        err.contains(
            "job 2 wrote nothing to standard output; its standard error: perch logs 2 --stderr",
        )
        .then_some(err)
    });
    assert!(!hint.contains("no such file"), "{hint}");
    let (_, err_log, _) = cli(&perch, &["logs", "2", "--stderr"]);
    assert_eq!(err_log, "no such file\n");
    let (_, listing, _) = cli(&perch, &["jobs", "--all"]);
    assert!(
        listing.contains("hello") && listing.contains("failed"),
        "{listing}"
    );
    // Its accounting: two GPUs held from start to end, one allocation row per GPU, and its
    // lifecycle in the audit trail.
    let acct = perch.sql(
        "SELECT j.gpu_seconds_allocated, j.elapsed_seconds, j.exit_code, count(a.gpu) AS gpus
         FROM jobs j JOIN job_allocations a ON a.job = j.job WHERE j.job = 1
         GROUP BY j.gpu_seconds_allocated, j.elapsed_seconds, j.exit_code",
    );
    let a = &acct[0];
    assert_eq!(a["gpus"], 2, "{a}");
    assert_eq!(a["exit_code"], 3, "{a}");
    let held = a["gpu_seconds_allocated"].as_f64().unwrap_or(-1.0);
    let elapsed = a["elapsed_seconds"].as_f64().unwrap_or(-1.0);
    assert!(held > 0.0 && (held - 2.0 * elapsed).abs() < 1e-9, "{a}");
    assert_eq!(
        perch.scalar(
            "SELECT count(*) FROM events WHERE job = 1 AND kind IN ('job_submitted', 'job_started', 'job_ended')"
        ),
        3
    );
}

#[test]
fn a_waiting_job_says_why_and_starts_when_a_cancel_frees_its_gpus() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        dir.path(),
        &["up", "--simulate-gpus", "2", "--interval-ms", "200"],
    );
    // A job that ignores SIGTERM: the cancel must escalate to SIGKILL after the grace period.
    let script = "trap 'echo got TERM' TERM; echo ready; while true; do sleep 0.1; done";
    let (ok, _, err) = cli(
        &perch,
        &[
            "submit", "--gpus", "2", "--grace", "2", "--", "sh", "-c", script,
        ],
    );
    assert!(ok, "{err}");
    wait_for("job 1 to run on the agent", || {
        let (_, out, _) = cli(&perch, &["logs", "1"]);
        out.contains("ready").then_some(())
    });
    cli(&perch, &["submit", "--gpus", "2", "--", "true"]);
    let waiting = wait_for("job 2 pending with a reason", || {
        let j = job(&perch, 2);
        (j["state"] == "pending" && j["reason"].is_string()).then_some(j)
    });
    assert!(
        waiting["reason"]
            .as_str()
            .unwrap_or("")
            .contains("reserved"),
        "{waiting}"
    );
    let (_, queue, _) = cli(&perch, &["queue"]);
    assert!(queue.contains("reserved"), "{queue}");
    let (ok, out, err) = cli(&perch, &["cancel", "1"]);
    assert!(ok && out.contains("cancelled"), "{out}{err}");
    wait_state(&perch, 2, "completed");
    let j = job(&perch, 1);
    assert_eq!(j["state"], "cancelled");
    let (_, out, _) = cli(&perch, &["logs", "1"]);
    assert!(
        out.contains("got TERM"),
        "the checkpoint signal reached the job: {out:?}"
    );
    // Bad requests name the field.
    let r = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", perch.url))
        .json(&serde_json::json!({"command": ["x"], "gpus_per_node": 100}))
        .send()
        .expect("post");
    assert_eq!(r.status().as_u16(), 400);
    let body: Value = r.json().expect("json");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("gpus_per_node"),
        "{body}"
    );
    let (ok, _, err) = cli(&perch, &["cancel", "99"]);
    assert!(!ok && err.contains("no job 99"), "{err}");
    // A gang wider than the cluster was accepted in silence and waited forever; then it was
    // accepted with a warning and still waited forever: now it is refused, saying what fits.
    let r = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", perch.url))
        .json(&serde_json::json!({"command": ["true"], "nodes": 3, "gpus_per_node": 2}))
        .send()
        .expect("post");
    assert_eq!(r.status().as_u16(), 400);
    let body: Value = r.json().expect("json");
    let refusal = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        refusal.contains("3 node(s) x 2")
            && refusal.contains("1 node(s) have 2 or more")
            && refusal.contains("ask for at most 1 node(s) x 2 GPUs")
            && refusal.contains("--hold-until-fits"),
        "{body}"
    );
    // Asked to, it waits for nodes that could run it to join.
    let r = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", perch.url))
        .json(&serde_json::json!({"command": ["true"], "nodes": 3, "gpus_per_node": 2, "hold_until_fits": true}))
        .send()
        .expect("post");
    assert_eq!(r.status().as_u16(), 201);
    let body: Value = r.json().expect("json");
    let warning = body["warning"].as_str().unwrap_or_default();
    assert!(
        warning.contains("3 node(s) x 2") && warning.contains("held until"),
        "{body}"
    );
    let held = body["id"].as_u64().expect("id");
    assert_eq!(job(&perch, held)["state"], "pending");
    let fits = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", perch.url))
        .json(&serde_json::json!({"command": ["true"], "nodes": 1, "gpus_per_node": 2}))
        .send()
        .expect("post")
        .json::<Value>()
        .expect("json");
    assert!(fits.get("warning").is_none(), "{fits}");
    // A job wider than any node: the hint said "ask for at most 0 node(s) x 16 GPUs".
    let (ok, _, err) = cli(&perch, &["submit", "--gpus", "16", "--", "true"]);
    assert!(!ok, "refused: no node seen has 16 GPUs");
    assert!(
        err.contains("the largest has 2 GPUs: ask for at most 2 GPUs per node")
            && !err.contains("0 node(s)"),
        "{err}"
    );
    let (ok, _, err) = cli(
        &perch,
        &[
            "submit",
            "-N",
            "3",
            "--gpus",
            "2",
            "--hold-until-fits",
            "--",
            "true",
        ],
    );
    assert!(ok, "accepted when asked to wait: {err}");
    assert!(
        err.starts_with("warning: ") && err.contains("largest has 2"),
        "{err}"
    );
    // Errors in a --file request spoke of a "JSON body" the user never wrote.
    let file = perch.data_dir.join("job.toml");
    std::fs::write(&file, "command = [\"true\"]\ngpus_per_node = \"two\"\n").expect("write");
    let (ok, _, err) = cli(&perch, &["submit", "--file", file.to_str().expect("utf-8")]);
    assert!(!ok);
    assert!(
        err.contains("job.toml: gpus_per_node: invalid type") && !err.contains("JSON"),
        "{err}"
    );
}

#[test]
fn jobs_survive_a_server_kill_9_and_keep_running_through_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = common::free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut server = Perch::start(&dir.path().join("server"), &["server", "--listen", &listen]);
    let agent_dir = dir.path().join("agent");
    let _agent = common::Agent::start(&server.url, "gpu-a", &agent_dir, 2, None, &[]);
    let marker = dir.path().join("marker");
    let script = format!(
        "echo started; while [ ! -e {} ]; do sleep 0.1; done; echo finished",
        marker.display()
    );
    let (ok, _, err) = cli(
        &server,
        &["submit", "--gpus", "1", "--", "sh", "-c", &script],
    );
    assert!(ok, "{err}");
    cli(&server, &["submit", "--gpus", "2", "--", "true"]);
    wait_state(&server, 1, "running");
    server.kill();
    server = Perch::start(&dir.path().join("server"), &["server", "--listen", &listen]);
    // Both jobs are known exactly as before; the first still runs (its process never stopped).
    assert_eq!(job(&server, 1)["state"], "running");
    assert_eq!(job(&server, 1)["attempts"], 1);
    assert_eq!(job(&server, 2)["state"], "pending");
    std::fs::write(&marker, b"").expect("marker");
    let j = wait_state(&server, 1, "completed");
    assert_eq!(j["attempts"], 1, "it ran once, through the restart");
    wait_state(&server, 2, "completed");
    let out = wait_for("the output of the whole run", || {
        let (_, out, _) = cli(&server, &["logs", "1"]);
        out.contains("finished").then_some(out)
    });
    assert_eq!(out, "started\nfinished\n");
    let (_, nodes, _) = cli(&server, &["nodes"]);
    assert!(nodes.contains("gpu-a") && nodes.contains("0/2"), "{nodes}");
}

#[test]
fn simulated_gpus_follow_the_jobs_placed_on_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        dir.path(),
        &["up", "--simulate-gpus", "2", "--interval-ms", "200"],
    );
    let (ok, _, err) = cli(
        &perch,
        &[
            "submit",
            "--gpus",
            "1",
            "--sim-profile",
            "steady",
            "--",
            "sleep",
            "30",
        ],
    );
    assert!(ok, "{err}");
    cli(
        &perch,
        &[
            "submit",
            "--gpus",
            "1",
            "--sim-profile",
            "idle",
            "--",
            "sleep",
            "30",
        ],
    );
    let (_, _, err) = cli(
        &perch,
        &[
            "submit",
            "--gpus",
            "1",
            "--sim-profile",
            "flat",
            "--",
            "true",
        ],
    );
    assert!(
        err.contains("sim_profile") && err.contains("idle, steady, bursty"),
        "{err}"
    );
    // Poll the live view until both jobs' GPUs show their profile. A free GPU also reads 0%
    // and no memory, so the idle job's profile shows only once its GPU holds memory: an
    // allocated-but-idle job keeps its model loaded.
    let gpu_now = |id: u64| -> Option<Value> {
        let g = job(&perch, id)["gpus_now"].as_array()?.first()?.clone();
        assert_eq!(g["simulated"], true);
        Some(g)
    };
    wait_for(
        "a steady job's GPU busy and an idle job's GPU at 0% holding memory",
        || {
            let (busy, idle) = (gpu_now(1)?, gpu_now(2)?);
            let busy = busy["utilization_gpu_pct"].as_f64()?;
            let (util, mem) = (
                idle["utilization_gpu_pct"].as_f64()?,
                idle["memory_used_bytes"].as_f64()?,
            );
            (busy >= 90.0 && util == 0.0 && mem > 0.0).then_some(())
        },
    );
}

#[test]
fn dependencies_and_arrays() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        dir.path(),
        &["up", "--simulate-gpus", "2", "--interval-ms", "200"],
    );
    let marker = dir.path().join("go");
    let wait = format!("while [ ! -e {} ]; do sleep 0.1; done", marker.display());
    cli(&perch, &["submit", "--gpus", "1", "--", "sh", "-c", &wait]); // 1
    cli(&perch, &["submit", "--gpus", "1", "--", "false"]); // 2: fails
    let (ok, _, err) = cli(
        &perch,
        &["submit", "--gpus", "1", "--after-ok", "1", "--", "true"],
    ); // 3
    assert!(ok, "{err}");
    cli(
        &perch,
        &["submit", "--gpus", "1", "--after-ok", "2", "--", "true"],
    ); // 4: never
    cli(
        &perch,
        &["submit", "--gpus", "1", "--after-any", "2", "--", "true"],
    ); // 5
    let (ok, _, err) = cli(&perch, &["submit", "--after-ok", "99", "--", "true"]);
    assert!(
        !ok && err.contains("after_ok") && err.contains("no job 99"),
        "{err}"
    );
    let held = job(&perch, 3);
    assert_eq!(held["state"], "pending");
    assert!(
        held["reason"]
            .as_str()
            .unwrap_or("")
            .contains("waiting for dependencies"),
        "{held}"
    );
    // `perch queue` left out jobs held for a dependency that `perch jobs` shows.
    let queue = perch.get("/v1/queue");
    let entry = queue["queue"]
        .as_array()
        .and_then(|q| q.iter().find(|e| e["job"]["id"] == 3))
        .unwrap_or_else(|| panic!("job 3 missing from the queue: {queue}"));
    assert_eq!(entry["position"], serde_json::Value::Null, "{entry}");
    let (ok, listed, err) = cli(&perch, &["queue"]);
    assert!(ok, "{err}");
    assert!(
        listed
            .lines()
            .any(|l| l.split_whitespace().nth(1) == Some("3")
                && l.contains("waiting for dependencies")),
        "{listed}"
    );
    // A running job's accounting columns were empty for minutes with no word why.
    wait_state(&perch, 1, "running");
    let (ok, shown, err) = cli(&perch, &["show", "1"]);
    assert!(ok, "{err}");
    assert!(
        shown.contains("Usage: GPUHoursAllocated=")
            && shown.contains("Note: telemetry figures")
            && shown.contains("within 420 s"),
        "{shown}"
    );
    wait_state(&perch, 5, "completed"); // job 2 failed: after_any is satisfied
    let never = wait_state(&perch, 4, "cancelled");
    assert!(
        never["reason"]
            .as_str()
            .unwrap_or("")
            .contains("can never be met"),
        "{never}"
    );
    assert_eq!(job(&perch, 3)["state"], "pending", "job 1 still runs");
    std::fs::write(&marker, b"").expect("marker");
    wait_state(&perch, 3, "completed");

    let (ok, out, err) = cli(
        &perch,
        &[
            "submit",
            "--gpus",
            "1",
            "--array",
            "3",
            "-J",
            "sweep",
            "--",
            "sh",
            "-c",
            "echo task=$PERCH_ARRAY_TASK_ID of $PERCH_ARRAY_JOB_ID",
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "Submitted array job 6 (tasks 6-8)");
    for (id, task) in [(6, 0), (7, 1), (8, 2)] {
        wait_state(&perch, id, "completed");
        let out = wait_for("array output", || {
            let (_, out, _) = cli(&perch, &["logs", &id.to_string()]);
            (!out.is_empty()).then_some(out)
        });
        assert_eq!(out, format!("task={task} of 6\n"));
        assert_eq!(job(&perch, id)["request"]["name"], format!("sweep[{task}]"));
    }
}

#[test]
fn the_scheduler_avoids_a_gpu_whose_telemetry_reports_an_xid() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        dir.path(),
        &["up", "--simulate-gpus", "2", "--interval-ms", "200"],
    );
    let node = wait_for("the local node to join", || {
        let nodes: Value = reqwest::blocking::get(format!("{}/v1/nodes", perch.url))
            .ok()?
            .json()
            .ok()?;
        nodes["nodes"][0]["name"].as_str().map(str::to_owned)
    });
    // The agent's telemetry reports XID 79 (fallen off the bus) on GPU 0.
    let event = |kind: &str, seq: u64| {
        serde_json::json!({"node": node, "seq": seq, "gpu_events": [{
            "time_ms": common::now_ms(), "gpu": 0, "uuid": "GPU-SIM-0", "simulated": true,
            "kind": kind, "xid": if kind == "xid" { Value::from(79) } else { Value::Null }
        }]})
    };
    let client = reqwest::blocking::Client::new();
    let r = client
        .post(format!("{}/v1/ingest", perch.url))
        .json(&event("xid", u64::MAX / 2))
        .send()
        .expect("ingest");
    assert!(r.status().is_success(), "{:?}", r.text());
    // A two-GPU job cannot start; a one-GPU job goes to the healthy GPU 1.
    wait_for("the XID to reach the scheduler", || {
        cli(&perch, &["submit", "--gpus", "2", "--", "true"]);
        std::thread::sleep(std::time::Duration::from_millis(300));
        let last: Value = reqwest::blocking::get(format!("{}/v1/jobs?limit=1", perch.url))
            .ok()?
            .json()
            .ok()?;
        (last["jobs"][0]["state"] == "pending").then_some(())
    });
    let (_, out, _) = cli(&perch, &["submit", "--gpus", "1", "--", "true"]);
    let id: u64 = out
        .trim()
        .trim_start_matches("Submitted job ")
        .parse()
        .expect("job id");
    let j = wait_state(&perch, id, "completed");
    assert_eq!(j["placement"][0]["gpus"], serde_json::json!([1]));
    // Once the GPU recovers, the waiting two-GPU job runs.
    client
        .post(format!("{}/v1/ingest", perch.url))
        .json(&event("gpu_recovered", u64::MAX / 2 + 1))
        .send()
        .expect("ingest");
    wait_for("no job left pending", || {
        let pending: Value = reqwest::blocking::get(format!("{}/v1/jobs?state=pending", perch.url))
            .ok()?
            .json()
            .ok()?;
        pending["jobs"].as_array()?.is_empty().then_some(())
    });
}

#[test]
fn a_silent_node_is_marked_down_its_job_requeued_and_the_orphan_killed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = common::server_with_config(
        dir.path(),
        "[server]\nnode_stale_after_secs = 2\nnode_lease_secs = 5\npg_listen = \"\"\n",
        &[],
    );
    let agent_dir = dir.path().join("agent");
    let start_agent = || common::Agent::start(&server.url, "gpu-a", &agent_dir, 1, None, &[]);
    let mut agent = start_agent();
    let pid_file = dir.path().join("pids");
    let script = format!("echo $$ >> {}; sleep 60", pid_file.display());
    let (ok, _, err) = cli(
        &server,
        &[
            "submit",
            "--gpus",
            "1",
            "--max-requeues",
            "1",
            "--",
            "sh",
            "-c",
            &script,
        ],
    );
    assert!(ok, "{err}");
    wait_for("the job's process", || {
        std::fs::read_to_string(&pid_file)
            .ok()
            .filter(|s| !s.is_empty())
    });
    agent.kill(); // its job lives on under its supervisor, until the lease runs out
    let requeued = wait_state(&server, 1, "pending");
    assert_eq!(requeued["requeues"], 1, "{requeued}");
    let (_, nodes, _) = cli(&server, &["nodes"]);
    assert!(nodes.contains("down"), "{nodes}");
    // The agent comes back: the node is up, the job runs again, once (the first run was
    // stopped by its supervisor as the lease ran out).
    let _agent = start_agent();
    let j = wait_for("the job's second attempt", || {
        let j = job(&server, 1);
        (j["state"] == "running" && j["attempts"] == 2).then_some(j)
    });
    assert_eq!(j["placement"][0]["node"], "gpu-a");
    let pids = wait_for("the second process", || {
        let text = std::fs::read_to_string(&pid_file).ok()?;
        let pids: Vec<u32> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        (pids.len() == 2).then_some(pids)
    });
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.split(' ').nth(2) != Some("Z"))
    };
    wait_for("the orphaned first run to be killed", || {
        (!alive(pids[0])).then_some(())
    });
    assert!(alive(pids[1]), "the second run is the one running");
    let (ok, _, _) = cli(&server, &["cancel", "1"]);
    assert!(ok);
}

/// Submits a job that records its shell's pid in `dir/pid` and sleeps, no requeues; waits
/// until it runs and returns the pid.
fn start_sleeper(perch: &Perch, dir: &std::path::Path) -> u32 {
    let pid_file = dir.join("pid");
    let script = format!("echo $$ > {}; sleep 600", pid_file.display());
    let (ok, _, err) = cli(
        perch,
        &[
            "submit",
            "--gpus",
            "1",
            "--time",
            "1h",
            "--max-requeues",
            "0",
            "--",
            "sh",
            "-c",
            &script,
        ],
    );
    assert!(ok, "{err}");
    wait_state(perch, 1, "running");
    wait_for("the job's process", || {
        std::fs::read_to_string(&pid_file).ok()?.trim().parse().ok()
    })
}

/// `kill -9 pid`: the job dies as an OOM kill or a user would end it.
fn kill_9(pid: u32) {
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(killed.success(), "could not kill the job's process {pid}");
}

/// Waits for job 1 to leave `running` and checks it ended `state` within 10 s.
fn ends_at_once(perch: &Perch, state: &str) {
    let started = std::time::Instant::now();
    let j = wait_for("the job to end", || {
        let j = job(perch, 1);
        (j["state"] != "running").then_some(j)
    });
    assert_eq!(j["state"], state, "{j}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "it took {:?} after perch came back",
        started.elapsed()
    );
}

/// A job whose processes died while perch (server and agent) was down showed
/// `running` for minutes and then ended `timeout`, a limit it never reached. Its supervisor saw
/// it die: when the agent comes back it reports the exit, and the job ends at once, `failed`
/// with the code it died with (SIGKILL: 137).
#[test]
fn a_job_that_died_while_perch_was_down_ends_at_once_when_its_agent_returns() {
    let dir = tempfile::tempdir().expect("tempdir");
    let listen = format!("127.0.0.1:{}", common::free_port());
    let start_server =
        || Perch::start(&dir.path().join("server"), &["server", "--listen", &listen]);
    let mut server = start_server();
    let agent_dir = dir.path().join("agent");
    let mut agent = common::Agent::start(&server.url, "gpu-a", &agent_dir, 1, None, &[]);
    let pid = start_sleeper(&server, dir.path());
    agent.kill();
    server.kill();
    kill_9(pid);
    let server = start_server();
    assert_eq!(
        job(&server, 1)["state"],
        "running",
        "the server cannot know yet"
    );
    let _agent = common::Agent::start(&server.url, "gpu-a", &agent_dir, 1, None, &[]);
    ends_at_once(&server, "failed");
    assert_eq!(job(&server, 1)["exit_code"], 137);
}

/// The same with `perch up` (server and agent in one process), as the README starts it.
#[test]
fn a_job_that_died_while_perch_up_was_down_ends_at_once_when_it_restarts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let up = ["up", "--simulate-gpus", "1"];
    let mut perch = Perch::start(&data, &up);
    let pid = start_sleeper(&perch, dir.path());
    perch.kill();
    kill_9(pid);
    let perch = Perch::start(&data, &up);
    ends_at_once(&perch, "failed");
    assert_eq!(job(&perch, 1)["exit_code"], 137);
}

/// The server alone was down: the agent saw the job die and reports its exit once the server
/// is back, so the job ends at once with the code it died with.
#[test]
fn a_job_that_died_while_the_server_was_down_ends_at_once_when_it_returns() {
    let dir = tempfile::tempdir().expect("tempdir");
    let listen = format!("127.0.0.1:{}", common::free_port());
    let start_server =
        || Perch::start(&dir.path().join("server"), &["server", "--listen", &listen]);
    let mut server = start_server();
    let _agent = common::Agent::start(
        &server.url,
        "gpu-a",
        &dir.path().join("agent"),
        1,
        None,
        &[],
    );
    let pid = start_sleeper(&server, dir.path());
    server.kill();
    kill_9(pid);
    std::thread::sleep(std::time::Duration::from_secs(2));
    let server = start_server();
    ends_at_once(&server, "failed");
}

/// A gang on several nodes gets what `torch.distributed`, `torchrun`, DeepSpeed and
/// Horovod read, without a wrapper: rank 0's advertised address and one port, the world size
/// in GPUs, each node's rank and first global rank, its GPU count, the node list, and
/// torchrun's `PET_*` defaults. Two agents on this machine, each advertising its own loopback
/// address.
#[test]
fn a_multi_node_job_gets_its_peers_and_a_rendezvous() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_config(dir.path(), "[server]\npg_listen = \"\"\n", &[]);
    let _a = common::Agent::start(
        &perch.url,
        "gpu-a",
        &dir.path().join("agent-a"),
        2,
        None,
        &["--interval-ms", "200", "--advertise-addr", "127.0.0.1"],
    );
    let _b = common::Agent::start(
        &perch.url,
        "gpu-b",
        &dir.path().join("agent-b"),
        2,
        None,
        &["--interval-ms", "200", "--advertise-addr", "127.0.0.2"],
    );
    perch.wait_nodes_up(2);
    let out = dir.path().join("ranks");
    std::fs::create_dir_all(&out).expect("mkdir");
    let script = format!(
        "env | grep -E '^(MASTER_ADDR|MASTER_PORT|WORLD_SIZE|NODE_RANK|RANK|LOCAL_WORLD_SIZE|PERCH_NODELIST|PERCH_NODE_ADDRS|PET_[A-Z_]+)=' | sort > {0}/rank-$NODE_RANK; cp \"$PERCH_HOSTFILE\" {0}/hosts-$NODE_RANK; echo rank $NODE_RANK here",
        out.display()
    );
    let submitted = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", perch.url))
        .json(&serde_json::json!({
            "command": ["sh", "-c", script],
            "nodes": 2,
            "gpus_per_node": 2,
        }))
        .send()
        .expect("submit");
    assert_eq!(submitted.status().as_u16(), 201);
    let j = wait_state(&perch, 1, "completed");
    let rank0_node = j["placement"][0]["node"].as_str().expect("node").to_owned();
    let rank1_node = j["placement"][1]["node"].as_str().expect("node").to_owned();
    let addr = |node: &str| {
        if node == "gpu-a" {
            "127.0.0.1"
        } else {
            "127.0.0.2"
        }
    };
    let read = |rank: u32| -> std::collections::BTreeMap<String, String> {
        std::fs::read_to_string(out.join(format!("rank-{rank}")))
            .expect("rank output")
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    };
    let (r0, r1) = (read(0), read(1));
    for (rank, env) in [(0, &r0), (1, &r1)] {
        assert_eq!(env["MASTER_ADDR"], addr(&rank0_node), "{env:?}");
        assert_eq!(env["PET_MASTER_ADDR"], addr(&rank0_node));
        assert_eq!(env["WORLD_SIZE"], "4");
        assert_eq!(env["NODE_RANK"], rank.to_string());
        assert_eq!(env["PET_NODE_RANK"], rank.to_string());
        assert_eq!(env["RANK"], (rank * 2).to_string());
        assert_eq!(env["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(env["PET_NPROC_PER_NODE"], "2");
        assert_eq!(env["PET_NNODES"], "2");
        assert_eq!(env["PERCH_NODELIST"], format!("{rank0_node},{rank1_node}"));
        assert_eq!(
            env["PERCH_NODE_ADDRS"],
            format!("{},{}", addr(&rank0_node), addr(&rank1_node))
        );
    }
    assert_eq!(r0["MASTER_PORT"], r1["MASTER_PORT"], "one rendezvous port");
    let port: u16 = r0["MASTER_PORT"].parse().expect("port");
    assert!((29500..31500).contains(&port), "{port}");
    assert_eq!(r0["PET_MASTER_PORT"], r0["MASTER_PORT"]);
    assert_eq!(j["master_port"], port, "the port rank 0's agent picked");
    let hosts = format!(
        "{} slots=2\n{} slots=2\n",
        addr(&rank0_node),
        addr(&rank1_node)
    );
    for rank in 0..2 {
        let file = std::fs::read_to_string(out.join(format!("hosts-{rank}"))).expect("hostfile");
        assert_eq!(file, hosts);
    }

    // Each rank's output is kept apart (the second rank's used to be dropped).
    for rank in 0..2 {
        let (ok, out, err) = cli(&perch, &["logs", "--rank", &rank.to_string(), "1"]);
        assert!(ok, "{err}");
        assert_eq!(out, format!("rank {rank} here\n"));
    }
    let (ok, _, err) = cli(&perch, &["logs", "--rank", "2", "1"]);
    assert!(!ok && err.contains("ranks 0 to 1"), "{err}");

    // A gang whose rank 1 fails: both ranks end within seconds, the failing one is named.
    let submitted = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", perch.url))
        .json(&serde_json::json!({
            "command": ["sh", "-c", "if [ \"$NODE_RANK\" = 1 ]; then sleep 1; exit 3; fi; sleep 300"],
            "nodes": 2,
            "gpus_per_node": 2,
        }))
        .send()
        .expect("submit");
    assert_eq!(submitted.status().as_u16(), 201);
    let started = std::time::Instant::now();
    let j = wait_state(&perch, 2, "failed");
    let failing = j["placement"][1]["node"].as_str().expect("node");
    assert_eq!(j["exit_code"], 3);
    assert_eq!(j["placement"][1]["exit_code"], 3, "{j}");
    let reason = j["reason"].as_str().expect("reason");
    assert!(
        reason.contains(&format!("rank 1 of 2 (on {failing}) exited with code 3")),
        "{reason}"
    );
    let (ok, shown, err) = cli(&perch, &["show", "2"]);
    assert!(ok, "{err}");
    assert!(shown.contains(&format!("1:{failing}=exited 3")), "{shown}");
    // Rank 0 is stopped, not left running for its five minutes.
    let rank0 = j["placement"][0]["node"].as_str().expect("node").to_owned();
    wait_for("rank 0 stopped", || {
        let j = job(&perch, 2);
        let timeline = j["timeline"].to_string();
        timeline
            .contains(&format!("attempt 1 ended on {rank0}"))
            .then_some(())
    });
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
}

/// A sync carries up to 8 MiB of output, which JSON makes six times larger when it is control
/// bytes (`\u0001`): with `server.max_body_mb = 1`, a job printing such bytes had every sync of
/// its node refused as too large, so the node could report nothing (not even the job's exit) and
/// its lease ran out. The sync route takes 64 MiB whatever the limit; other routes keep it.
#[test]
fn binary_output_never_makes_a_nodes_syncs_too_large() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("perch.toml");
    std::fs::write(&config, "[server]\nmax_body_mb = 1\n").expect("config");
    let perch = Perch::start(
        &dir.path().join("perch"),
        &[
            "--config",
            config.to_str().expect("utf-8"),
            "up",
            "--simulate-gpus",
            "1",
            "--interval-ms",
            "200",
        ],
    );
    let (ok, _, err) = cli(
        &perch,
        &[
            "submit",
            "--",
            "sh",
            "-c",
            "head -c 3000000 /dev/zero | tr '\\0' '\\1'",
        ],
    );
    assert!(ok, "{err}");
    wait_state(&perch, 1, "completed");
    let (ok, out, err) = cli(&perch, &["logs", "-f", "1"]);
    assert!(ok, "{err}");
    assert!(
        out.len() == 3_000_000 && out.bytes().all(|b| b == 1),
        "{} bytes",
        out.len()
    );
    // Elsewhere the operator's limit holds.
    let big = format!("{{\"command\": [\"{}\"]}}", "x".repeat(2 << 20));
    let answer = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", perch.url))
        .header("content-type", "application/json")
        .body(big)
        .send()
        .expect("post");
    // It was 400 "not a valid job request".
    assert_eq!(answer.status().as_u16(), 413);
    let text = answer.text().expect("body");
    assert!(text.contains("server.max_body_mb"), "{text}");
}

/// A job's output is the job's, whatever its pace (both found on the binary):
/// - a job that printed 6.9 MB and exited kept 512 KiB on the server, cut mid-line, and
///   `perch logs` said nothing: the agent dropped what it had not sent when the exit was
///   acknowledged. Now it ships the rest after the exit, `perch logs` says how much is still to
///   come, `perch logs -f` waits for it, and the server answers in pages, not the whole file;
/// - `yes` filled the node's disk at about 375 MB/s (7.5 GB in 20 s) and its output stayed on
///   the node for ever. Past `agent.max_job_output_mb` it is stopped and fails naming the key,
///   and the node's copy of a job's output goes once the server holds all of it.
#[test]
fn a_jobs_output_arrives_whole_and_a_flood_is_stopped_at_the_nodes_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("perch.toml");
    std::fs::write(&config, "[agent]\nmax_job_output_mb = 8\n").expect("config");
    let data = dir.path().join("perch");
    let perch = Perch::start(
        &data,
        &[
            "--config",
            config.to_str().expect("utf-8"),
            "up",
            "--simulate-gpus",
            "2",
            "--interval-ms",
            "200",
        ],
    );
    let expected: String = (1..=1_000_000).map(|i| format!("{i}\n")).collect();
    let (ok, _, err) = cli(&perch, &["submit", "--", "seq", "1", "1000000"]);
    assert!(ok, "{err}");
    wait_state(&perch, 1, "completed");
    // At once: what the server holds, and a word on what is still to come.
    let (ok, out, err) = cli(&perch, &["logs", "1"]);
    assert!(ok, "{err}");
    assert!(expected.starts_with(&out), "a prefix of the output");
    if out.len() < expected.len() {
        assert!(
            err.contains("more bytes of job 1's output are still to come from its node; `perch logs -f 1` waits for them"),
            "{} of {} bytes, and: {err}",
            out.len(),
            expected.len()
        );
    }
    let (ok, out, err) = cli(&perch, &["logs", "-f", "1"]);
    assert!(ok, "{err}");
    assert!(
        out == expected,
        "the whole output: {} of {} bytes",
        out.len(),
        expected.len()
    );
    let (_, again, err) = cli(&perch, &["logs", "1"]);
    assert!(again == expected && err.is_empty(), "{err}");

    let (ok, _, err) = cli(&perch, &["submit", "--", "yes", "perch-flood"]);
    assert!(ok, "{err}");
    let j = wait_state(&perch, 2, "failed");
    let reason = j["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("its output (stdout and stderr) passed 8 MiB")
            && reason.contains("agent.max_job_output_mb"),
        "{j}"
    );
    // The node ships what it kept, then keeps no copy.
    let (ok, flood, err) = cli(&perch, &["logs", "-f", "2"]);
    assert!(ok, "{err}");
    // Every line whole but the last, which the stop may have cut.
    let mut lines: Vec<&str> = flood.lines().collect();
    let last = lines.pop().unwrap_or_default();
    assert!(
        flood.len() > 8 << 20
            && lines.iter().all(|l| *l == "perch-flood")
            && "perch-flood".starts_with(last),
        "{} bytes, ending {last:?}",
        flood.len()
    );
    let jobs = data.join("jobs");
    let nodes: Vec<_> = std::fs::read_dir(&jobs)
        .expect("the agent's jobs directory")
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(!nodes.is_empty(), "{}", jobs.display());
    wait_for("the node's copies to go", || {
        nodes
            .iter()
            .flat_map(|n| [n.join("1"), n.join("2")])
            .all(|job| !job.join("stdout").exists() && !job.join("stderr").exists())
            .then_some(())
    });
}

/// A careless user's submissions, each found on the release binary: `-D project` (relative)
/// ran the job in the agent's own directory's `project`, or failed as "cannot run \"pwd\": No
/// such file or directory"; a working directory missing on the node failed with that same
/// misleading error; `--gpu-fraction nan` reached the server as `null`; an empty `--gpu-model`
/// (an unset shell variable) waited for ever for a model no node has.
#[test]
fn careless_submissions_are_fixed_or_refused_naming_what_to_change() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        &dir.path().join("perch"),
        &["up", "--simulate-gpus", "2", "--interval-ms", "200"],
    );
    let project = dir.path().join("project");
    std::fs::create_dir(&project).expect("mkdir");
    let submit = |args: &[&str]| {
        let out = common::client()
            .arg("submit")
            .args(args)
            .current_dir(dir.path())
            .env("PERCH_SERVER", &perch.url)
            .env("USER", "alice")
            .output()
            .expect("run perch submit");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // As sbatch --chdir: relative to where the user submits.
    let (ok, _, err) = submit(&["-D", "project", "--", "pwd"]);
    assert!(ok, "{err}");
    let j = wait_state(&perch, 1, "completed");
    assert_eq!(j["request"]["workdir"], project.to_str().expect("utf-8"));
    let logs = wait_for("its output", || {
        let (_, out, _) = cli(&perch, &["logs", "1"]);
        (!out.is_empty()).then_some(out)
    });
    assert_eq!(logs.trim(), project.to_str().expect("utf-8"));
    // Missing on the node: the reason names the directory, not the program.
    let (ok, _, err) = submit(&["-D", "/nonexistent/perch-dir", "--", "pwd"]);
    assert!(ok, "{err}");
    let j = wait_state(&perch, 2, "failed");
    let reason = j["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("working directory \"/nonexistent/perch-dir\" is not a directory"),
        "{j}"
    );
    // Refused before anything is kept, naming the flag or the field.
    let (ok, _, err) = submit(&[
        "--gpu-fraction",
        "nan",
        "--gpu-memory-gb",
        "1",
        "--",
        "true",
    ]);
    assert!(
        !ok && err.contains("'--gpu-fraction <GPU_FRACTION>': must be a finite number"),
        "{err}"
    );
    let (ok, _, err) = submit(&["--gpu-model", "", "--", "true"]);
    assert!(!ok && err.contains("field `gpu_model`: is empty"), "{err}");
    let (ok, _, err) = submit(&["--mem", "18446744073709551615", "--", "true"]);
    assert!(
        !ok && err.contains("field `memory_mb`: must be 1 to 67108864"),
        "{err}"
    );
    let (_, listed, _) = cli(&perch, &["jobs", "--all"]);
    assert_eq!(
        listed.lines().count(),
        3,
        "two jobs kept, none of the refused: {listed}"
    );
    // A node name that is no node's goes into no URL: `../jobs/1/cancel` would have posted
    // to another endpoint.
    let (ok, _, err) = cli(&perch, &["drain", "../jobs/1/cancel"]);
    assert!(
        !ok && err.contains("node name") && err.contains("perch nodes"),
        "{err}"
    );
    let (ok, _, err) = cli(&perch, &["resume", ".."]);
    assert!(!ok && err.contains("cannot address the node"), "{err}");
    // Attempts count from 1: attempt 0 printed nothing and succeeded.
    let (ok, _, err) = cli(&perch, &["logs", "1", "--attempt", "0"]);
    assert!(!ok && err.contains("attempts count from 1"), "{err}");
    // The same for a silence id; and a missing one points at the command that lists them.
    let (ok, _, err) = cli(&perch, &["alerts", "silence", "expire", "../../v1/jobs/1"]);
    assert!(!ok && err.contains("is no silence id"), "{err}");
    let (ok, _, err) = cli(&perch, &["alerts", "silence", "expire", "s-999"]);
    assert!(
        !ok && err.contains("no silence with id `s-999`") && err.contains("`perch alerts silence`"),
        "{err}"
    );
}

/// A running job stays in `perch jobs` however many jobs ended after it (the CLI asked for the
/// newest 100 of any state and kept the pending and running ones, so 100 jobs cancelled
/// after a training run hid it), and listings come in pages: a page larger than 10,000 jobs
/// is refused naming how to page, each job is on exactly one page.
#[test]
fn listings_page_and_perch_jobs_shows_a_running_job_behind_any_history() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        dir.path(),
        &["up", "--simulate-gpus", "2", "--interval-ms", "200"],
    );
    cli(&perch, &["submit", "--gpus", "1", "--", "sleep", "600"]); // 1
    wait_state(&perch, 1, "running");
    let (ok, _, err) = cli(
        &perch,
        &["submit", "--gpus", "2", "--array", "150", "--", "true"],
    ); // 2-151
    assert!(ok, "{err}");
    let (ok, _, err) = cli(&perch, &["cancel", "--array", "2"]);
    assert!(ok, "{err}");
    cli(
        &perch,
        &["submit", "--gpus", "2", "--array", "20", "--", "true"],
    ); // 152-171, pending behind job 1
    let (ok, listing, err) = cli(&perch, &["jobs"]);
    assert!(ok, "{err}");
    let ids: Vec<&str> = listing
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(ids.len(), 21, "{listing}");
    assert_eq!(
        ids.last(),
        Some(&"1"),
        "the running job is listed:\n{listing}"
    );
    assert!(!listing.contains("cancelled"), "{listing}");
    // More than one page's worth through the CLI, with a word on what is left.
    let (ok, listing, err) = cli(&perch, &["jobs", "--all", "--limit", "120"]);
    assert!(ok, "{err}");
    assert_eq!(listing.lines().count(), 121, "{listing}");
    assert!(
        err.contains("the newest 120 shown; more with --limit"),
        "{err}"
    );
    let (ok, queue, err) = cli(&perch, &["queue", "--limit", "5"]);
    assert!(ok, "{err}");
    assert_eq!(queue.lines().count(), 6, "{queue}");
    assert!(
        err.contains("the first 5 of 20 pending jobs shown"),
        "{err}"
    );
    // The API: pages of 60 cover the 171 jobs once each, newest first.
    let (mut seen, mut before) = (Vec::new(), String::new());
    loop {
        let page = perch.get(&format!("/v1/jobs?limit=60{before}"));
        let jobs = page["jobs"].as_array().expect("jobs");
        assert!(jobs.len() <= 60);
        seen.extend(jobs.iter().map(|j| j["id"].as_u64().expect("id")));
        match page["next_before"].as_u64() {
            Some(next) => before = format!("&before={next}"),
            None => break,
        }
    }
    assert_eq!(seen, (1..=171).rev().collect::<Vec<u64>>());
    let states = perch.get("/v1/jobs?state=running,pending&limit=10000");
    assert_eq!(states["jobs"].as_array().map(Vec::len), Some(21));
    assert_eq!(states["next_before"], Value::Null);
    // A careless or hostile page size, and a state that does not exist, are refused with
    // what to change.
    for (query, says) in [
        (
            "/v1/jobs?limit=100000",
            "limit 100000 is above 10000: ask for pages of at most that many, each with before=",
        ),
        ("/v1/jobs?limit=0", "limit must be at least 1"),
        (
            "/v1/jobs?state=running,sleeping",
            "\"sleeping\" is not one of",
        ),
        ("/v1/queue?limit=20000", "the queue is shown from its head"),
        ("/v1/jobs?before=-1", "before"),
    ] {
        let r = reqwest::blocking::get(format!("{}{query}", perch.url)).expect("GET");
        assert_eq!(r.status(), 400, "{query}");
        let body: Value = r.json().expect("JSON");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{query}: {message}");
        assert_eq!(body["error"]["code"], "bad_parameters", "{query}");
    }
}

/// An agent token's batch with the largest sequence number and no agent-id header
/// went past the node's claim (checked only when the header was there), and every later batch
/// of the node's own agent was a duplicate: its telemetry stopped. Now such a batch is refused
/// (400, saying to send the header), and the node's samples keep arriving.
#[test]
fn an_agent_token_without_its_agent_id_cannot_stop_its_nodes_telemetry() {
    use common::{AGENT, OPERATOR};
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_tokens(dir.path(), &common::role_tokens("gpu-a"));
    let _agent = common::Agent::start(
        &perch.url,
        "gpu-a",
        &dir.path().join("agent"),
        1,
        Some(AGENT),
        &["--interval-ms", "200"],
    );
    let client = reqwest::blocking::Client::new();
    let samples = || -> i64 {
        let r: Value = client
            .post(format!("{}/v1/sql", perch.url))
            .bearer_auth(OPERATOR)
            .json(&serde_json::json!({"sql": "SELECT count(*) AS n FROM gpu_samples WHERE node = 'gpu-a'"}))
            .send()
            .expect("sql")
            .json()
            .expect("json");
        r["rows"][0]["n"].as_i64().unwrap_or(0)
    };
    wait_for("the agent's first samples", || {
        (samples() > 0).then_some(())
    });
    let mut last = common::marked_batch("gpu-a", 1);
    last["seq"] = u64::MAX.into();
    let r = client
        .post(format!("{}/v1/ingest", perch.url))
        .bearer_auth(AGENT)
        .json(&last)
        .send()
        .expect("ingest");
    let status = r.status().as_u16();
    let body = r.text().expect("text");
    let before = samples();
    wait_for("the agent's samples to keep arriving", || {
        (samples() >= before + 5).then_some(())
    });
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("x-perch-agent"), "{body}");
}
