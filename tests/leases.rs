//! A job never runs twice at once, whatever dies or is cut off.
//!
//! Each test runs a job that appends `start`, then a `tick` every 100 ms (and `end` on its
//! signal), each line with its attempt, the time in nanoseconds and the job shell's pid, to a
//! file, then attacks
//! the cluster: `kill -9` of the agent (restarted within the lease, or never), the node cut
//! from the server by a network namespace, the server killed and restarted. Every test checks
//! that the attempts' lines never interleave: attempt n+1 starts only after attempt n's last
//! sign of life. The last test checks that a job cannot escape its stop with `setsid`.

mod common;

use common::{Agent, Perch, assert_one_at_a_time, attempt_script as script, attempts, wait_for};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// A server with `node_stale_after_secs = 2` and the given lease, plus extra `[server]` lines
/// and flags.
fn server(dir: &Path, lease_secs: u64, extra: &str, args: &[&str]) -> Perch {
    common::server_with_config(
        dir,
        &format!(
            "[server]\nnode_stale_after_secs = 2\nnode_lease_secs = {lease_secs}\npg_listen = \"\"\n{extra}"
        ),
        args,
    )
}

fn agent(url: &str, node: &str, dir: &Path, token: Option<&str>) -> Agent {
    Agent::start(
        url,
        node,
        &dir.join(node),
        1,
        token,
        &["--interval-ms", "200"],
    )
}

fn submit(perch: &Perch, file: &Path, extra: &[&str]) -> u64 {
    let script = script(file);
    let mut args = vec![
        "submit",
        "--gpus",
        "1",
        "--grace",
        "1",
        "--max-requeues",
        "3",
    ];
    args.extend_from_slice(extra);
    args.extend(["--", "sh", "-c", &script]);
    let (ok, out, err) = perch.cli_as("alice", &args);
    assert!(ok, "{err}");
    out.trim()
        .strip_prefix("Submitted job ")
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("{out}"))
}

/// The pids of the shells that ran `attempt` (one, unless it ran twice).
fn shells(file: &Path, attempt: u64) -> Vec<u32> {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let mut pids: Vec<u32> = text
        .lines()
        .filter_map(|l| {
            let parts: Vec<&str> = l.split_whitespace().collect();
            (parts.get(1)?.parse::<u64>().ok()? == attempt).then_some(parts.get(3)?.parse().ok()?)
        })
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// How many `tick` lines `file` has from after `since_ns` (Unix time in nanoseconds).
fn ticks_since(file: &Path, since_ns: u128) -> usize {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("tick "))
        .filter_map(|l| l.split_whitespace().nth(2)?.parse::<u128>().ok())
        .filter(|&t| t > since_ns)
        .count()
}

fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos()
}

/// The most recent line's age.
fn last_line_age(file: &Path) -> Duration {
    let last = attempts(file).iter().map(|r| r.2).max().unwrap_or(0);
    Duration::from_nanos(u64::try_from(now_ns().saturating_sub(last)).unwrap_or(u64::MAX))
}

fn job(perch: &Perch, id: u64) -> Value {
    perch.job(id)
}

fn running_attempt(perch: &Perch, id: u64, attempt: u64) -> Value {
    wait_for(&format!("job {id} running its attempt {attempt}"), || {
        let j = job(perch, id);
        (j["state"] == "running" && j["attempts"] == attempt).then_some(j)
    })
}

fn pids_of(file_dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(file_dir.join("pids"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next())
            != Some("Z")
    })
}

/// Waits until `attempt` has written a few lines to `file`.
fn ticking(file: &Path, attempt: u64) {
    wait_for(&format!("attempt {attempt}'s ticks"), || {
        (attempts(file).iter().find(|r| r.0 == attempt)?.3 > 3).then_some(())
    });
}

/// A new agent for gpu-a: the node comes back up and the job, still attempt 1, runs on. A
/// takeover gone wrong shows on the new agent's syncs (it reports the job missing, the server
/// orders a stop or requeues it), so the check comes after two of them.
fn take_over(perch: &Perch, dir: &Path, id: u64, file: &Path) -> Agent {
    let a = agent(&perch.url, "gpu-a", dir, None);
    wait_for("the node up again", || {
        let nodes = perch.get("/v1/nodes");
        (nodes["nodes"][0]["state"] == "up").then_some(())
    });
    common::wait_syncs("gpu-a", 2, || perch.get("/v1/nodes"));
    let j = job(perch, id);
    assert_eq!(
        (j["state"].as_str(), j["attempts"].as_u64()),
        (Some("running"), Some(1)),
        "{j}"
    );
    assert_eq!(attempts(file).len(), 1, "one attempt only");
    assert!(
        !std::fs::read_to_string(file)
            .expect("runs")
            .contains("end 1 "),
        "the job got no stop signal"
    );
    a
}

/// Waits until the shell that ran `attempt` is gone, then checks that its `end` line is the
/// last it wrote: nothing of it ran on after its stop.
fn gone_after_its_end(file: &Path, attempt: u64) {
    let pids = shells(file, attempt);
    assert_eq!(pids.len(), 1, "one shell for attempt {attempt}: {pids:?}");
    wait_for(&format!("attempt {attempt}'s shell to exit"), || {
        (!alive(pids[0])).then_some(())
    });
    let text = std::fs::read_to_string(file).expect("runs");
    let last = text
        .lines()
        .rfind(|l| l.split_whitespace().nth(1) == Some(&attempt.to_string()))
        .unwrap_or_default();
    assert!(last.starts_with("end "), "it stopped: {text}");
}

/// alice cancels the job; its checkpoint signal reaches it (an `end` line).
fn cancel_and_see_it_end(perch: &Perch, id: u64, file: &Path) {
    let (ok, _, err) = perch.cli_as("alice", &["cancel", &id.to_string()]);
    assert!(ok, "{err}");
    wait_for("the cancelled job's end line", || {
        std::fs::read_to_string(file)
            .ok()?
            .contains("end 1 ")
            .then_some(())
    });
}

/// The job is still running its first attempt, and ticking: `why` says what it survived.
fn runs_on_as_attempt_1(perch: &Perch, id: u64, file: &Path, why: &str) {
    let j = job(perch, id);
    assert_eq!(
        (j["state"].as_str(), j["attempts"].as_u64()),
        (Some("running"), Some(1)),
        "{j}"
    );
    assert!(last_line_age(file) < Duration::from_secs(1), "{why}");
}

fn start_job(perch: &Perch, file: &Path) -> (u64, Value) {
    let id = submit(perch, file, &[]);
    let j = running_attempt(perch, id, 1);
    ticking(file, 1);
    (id, j)
}

/// `kill -9` of the agent, restarted well within the lease: the job runs on, untouched, the
/// same attempt, and the new agent can still stop it.
#[test]
fn an_agent_killed_and_restarted_within_the_lease_takes_its_job_over() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = server(dir.path(), 30, "", &[]);
    let mut a = agent(&perch.url, "gpu-a", dir.path(), None);
    let file = dir.path().join("runs");
    let (id, _) = start_job(&perch, &file);
    a.kill();
    // Down (no new jobs, an alert), but its job counts as running: the lease has not run out.
    wait_for("the node marked down", || {
        let (_, out, _) = perch.cli_as("alice", &["nodes"]);
        out.contains("down").then_some(())
    });
    runs_on_as_attempt_1(&perch, id, &file, "the job runs on without its agent");
    let _a = take_over(&perch, dir.path(), id, &file);
    assert!(
        last_line_age(&file) < Duration::from_secs(1),
        "still running"
    );
    // The new agent stops it on cancel: its checkpoint signal reaches it (an `end` line).
    cancel_and_see_it_end(&perch, id, &file);
    gone_after_its_end(&file, 1);
}

/// An agent killed while it still ships an ended job's output (that goes on after the exit, 4
/// MiB a sync) lost the rest, and the node kept the files for ever: the records that let a
/// restarted agent find the job went when the exit was acknowledged. They now stay until the
/// server holds all of the output: the restarted agent reports the exit again, ships the rest
/// and removes the node's copy.
#[test]
fn an_agent_killed_while_shipping_an_ended_jobs_output_ships_the_rest_when_restarted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = server(dir.path(), 30, "", &[]);
    let mut a = agent(&perch.url, "gpu-a", dir.path(), None);
    // 60 MB: seconds of shipping after the exit.
    let (ok, out, err) = perch.cli_as(
        "alice",
        &[
            "submit",
            "--gpus",
            "1",
            "--",
            "sh",
            "-c",
            "yes perch-line | head -c 60000000",
        ],
    );
    assert!(ok, "{err}");
    let id = out.trim().strip_prefix("Submitted job ").expect("an id");
    wait_for("the job to complete", || {
        (job(&perch, id.parse().expect("id"))["state"] == "completed").then_some(())
    });
    a.kill();
    let (_, partial, err) = perch.cli_as("alice", &["logs", id]);
    assert!(
        partial.len() < 60_000_000 && err.contains("still to come from its node"),
        "{} bytes when the agent died; {err}",
        partial.len()
    );
    let _a = agent(&perch.url, "gpu-a", dir.path(), None);
    let (ok, whole, err) = perch.cli_as("alice", &["logs", "-f", id]);
    assert!(ok, "{err}");
    assert!(
        whole.len() == 60_000_000 && whole.lines().take(1000).all(|l| l == "perch-line"),
        "{} bytes",
        whole.len()
    );
    let job_dir = dir.path().join("gpu-a/jobs/gpu-a").join(id);
    wait_for("the node's copy to go", || {
        (!job_dir.join("stdout").exists()).then_some(())
    });
}

/// A second agent claiming a node that its own agent serves: one started by mistake with
/// another data directory (or a machine cloned with the same hostname), and one started on the
/// same data directory. The first reported the node running nothing, and the server took the
/// job for lost and had it killed (found by trying it on `perch up`: "processes lost on vm",
/// node_fail, exit 143). Now its syncs are refused with 409 `node_claimed`, the second on the
/// same directory does not start, and the job runs on, the same attempt; the node's own agent,
/// restarted after `kill -9`, is still taken at once.
#[test]
fn a_second_agent_claiming_a_node_kills_no_job() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = server(dir.path(), 30, "", &[]);
    let mut a = agent(&perch.url, "gpu-a", dir.path(), None);
    let file = dir.path().join("runs");
    let (id, _) = start_job(&perch, &file);

    // Another machine, or another data directory, under the same name.
    let impostor_dir = dir.path().join("impostor");
    let log = dir.path().join("impostor.log");
    let mut impostor = Command::new(common::PERCH)
        .args([
            "agent", "--server", &perch.url, "--node", "gpu-a", "--nvml", "off",
        ])
        .args(["--simulate-gpus", "3", "--interval-ms", "200", "--data-dir"])
        .arg(&impostor_dir)
        .env("PERCH_RUN_AS_USER", "never")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("spawn the second agent");
    wait_for("the second agent refused", || {
        let text = std::fs::read_to_string(&log).ok()?;
        text.contains("refused this node's sync").then_some(text)
    });
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        text.contains("node_claimed")
            && text.contains("telemetry is kept")
            && !text.contains("dropping it")
            && text.contains("served by another agent")
            && text.contains("agent.node"),
        "{text}"
    );
    // A direct sync under the name, with another id: refused, naming the node.
    let sync = reqwest::blocking::Client::new()
        .post(format!("{}/v1/agent/sync", perch.url))
        .json(&serde_json::json!({"node": "gpu-a", "gpus": 1, "gpu_model": "sim", "agent_id": "00112233445566778899aabbccddeeff"}))
        .send()
        .expect("sync");
    assert_eq!(sync.status().as_u16(), 409);
    // A stop the impostor's reports caused would reach the job on its own agent's syncs.
    common::wait_syncs("gpu-a", 3, || perch.get("/v1/nodes"));
    runs_on_as_attempt_1(&perch, id, &file, "the job runs on");
    assert!(
        !std::fs::read_to_string(&file)
            .expect("runs")
            .contains("end 1 "),
        "the job got no stop signal"
    );
    let _ = impostor.kill();
    let _ = impostor.wait();
    // Its telemetry is refused as well: one batch of it, numbered from its later start, made
    // every later batch of the node's own agent a duplicate, dropped (the node's samples
    // stopped for good). None of its GPU 2 is stored, and the node's own samples go on.
    let samples = || perch.scalar("SELECT count(*) FROM gpu_samples WHERE node = 'gpu-a'");
    assert_eq!(
        perch.scalar("SELECT count(*) FROM gpu_samples WHERE node = 'gpu-a' AND gpu = 2"),
        0
    );
    let before = samples();
    wait_for("the node's own samples to go on", || {
        (samples() > before + 3).then_some(())
    });

    // The same data directory: that agent does not start.
    let out = Command::new(common::PERCH)
        .args([
            "agent", "--server", &perch.url, "--node", "gpu-a", "--nvml", "off",
        ])
        .args(["--simulate-gpus", "1", "--data-dir"])
        .arg(dir.path().join("gpu-a"))
        .env("PERCH_RUN_AS_USER", "never")
        .output()
        .expect("run a second agent on the same data directory");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("another perch agent runs node gpu-a's jobs"),
        "{err}"
    );

    // The node's own agent, killed and restarted: the same id, taken at once.
    a.kill();
    let _a = take_over(&perch, dir.path(), id, &file);
    assert!(
        last_line_age(&file) < Duration::from_secs(1),
        "still running"
    );
    cancel_and_see_it_end(&perch, id, &file);
}

/// A graceful stop of the agent (SIGTERM: `systemctl restart` for an upgrade) stops no job:
/// the job runs on while no agent runs, and the next agent takes it over, same attempt.
#[test]
fn an_agent_restarted_gracefully_leaves_its_job_running_for_the_next() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = server(dir.path(), 30, "", &[]);
    let mut a = agent(&perch.url, "gpu-a", dir.path(), None);
    let file = dir.path().join("runs");
    let (id, _) = start_job(&perch, &file);
    let status = Command::new("kill")
        .args(["-TERM", &a.0.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    wait_for("the agent to exit", || (!a.is_running()).then_some(()));
    let exited = now_ns();
    wait_for("the job to tick on without its agent", || {
        (ticks_since(&file, exited) >= 3).then_some(())
    });
    assert!(
        !std::fs::read_to_string(&file)
            .expect("runs")
            .contains("end 1 "),
        "it got no stop signal"
    );
    let _a = take_over(&perch, dir.path(), id, &file);
    cancel_and_see_it_end(&perch, id, &file);
}

/// `kill -9` of the agent, never restarted: its job's supervisor stops the job before the
/// lease runs out, and only then does the server start attempt 2 on the other node.
#[test]
fn a_dead_agents_job_is_stopped_before_it_runs_again_elsewhere() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = server(dir.path(), 6, "", &[]);
    let mut agents = [
        ("gpu-a", agent(&perch.url, "gpu-a", dir.path(), None)),
        ("gpu-b", agent(&perch.url, "gpu-b", dir.path(), None)),
    ];
    wait_for("both nodes", || {
        (perch.get("/v1/nodes")["nodes"].as_array()?.len() == 2).then_some(())
    });
    let file = dir.path().join("runs");
    let (id, j) = start_job(&perch, &file);
    let node = j["placement"][0]["node"].as_str().expect("node").to_owned();
    let killed_at = Instant::now();
    agents
        .iter_mut()
        .find(|(n, _)| *n == node)
        .expect("agent")
        .1
        .kill();
    let j = running_attempt(&perch, id, 2);
    assert!(
        killed_at.elapsed() >= Duration::from_secs(5),
        "requeued only once the lease ran out ({:?})",
        killed_at.elapsed()
    );
    assert_ne!(j["placement"][0]["node"].as_str(), Some(node.as_str()));
    ticking(&file, 2);
    assert_one_at_a_time(&file);
    let runs = attempts(&file);
    let first = runs.iter().find(|r| r.0 == 1).expect("attempt 1");
    assert!(
        std::fs::read_to_string(&file)
            .expect("file")
            .contains("end 1 "),
        "attempt 1 got its checkpoint signal before the lease ran out: {runs:?}"
    );
    assert!(first.3 > 10, "{runs:?}");
    let (ok, _, err) = perch.cli_as("alice", &["cancel", &id.to_string()]);
    assert!(ok, "{err}");
}

/// The node is cut from the server (its agent in a network namespace whose link goes down),
/// its agent alive: the supervisor stops the job as the lease runs out, attempt 2 runs on the
/// other node, and when the link comes back the old attempt's exit ends nothing.
#[test]
fn a_node_cut_from_the_server_stops_its_job_before_it_runs_elsewhere() {
    let dir = tempfile::tempdir().expect("tempdir");
    let net = Netns::new();
    let port = common::free_port();
    let tokens = "[[tokens]]\ntoken = \"agent-token-0123456789\"\nuser = \"agent\"\nrole = \"agent\"\n\n\
                  [[tokens]]\ntoken = \"alice-token-0123456789\"\nuser = \"alice\"\nrole = \"user\"\n";
    let tokens_file = dir.path().join("tokens.toml");
    std::fs::write(&tokens_file, tokens).expect("tokens");
    let listen = format!("{}:{port}", net.host_addr);
    let _perch = server(
        dir.path(),
        6,
        &format!("tokens_file = \"{}\"\n", tokens_file.display()),
        &["--listen", &listen],
    );
    let url = format!("http://{}:{port}", net.host_addr);
    // gpu-a lives behind the namespace's link; gpu-b reaches the server directly.
    let _a = Agent(
        Command::new("ip")
            .args(["netns", "exec", &net.name, common::PERCH])
            .args([
                "agent", "--server", &url, "--node", "gpu-a", "--nvml", "off",
            ])
            .args(["--simulate-gpus", "1", "--interval-ms", "200", "--data-dir"])
            .arg(dir.path().join("gpu-a"))
            .env("PERCH_TOKEN", "agent-token-0123456789")
            .env("PERCH_RUN_AS_USER", "never")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("agent in the namespace"),
    );
    let as_alice = |args: &[&str]| {
        let out = common::client()
            .args(args)
            .env("PERCH_SERVER", &url)
            .env("PERCH_TOKEN", "alice-token-0123456789")
            .output()
            .expect("perch");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let get = |path: &str| -> Value {
        reqwest::blocking::Client::new()
            .get(format!("{url}{path}"))
            .bearer_auth("alice-token-0123456789")
            .send()
            .and_then(|r| r.json())
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    };
    let get_job = |id: u64| get(&format!("/v1/jobs/{id}"));
    wait_for("gpu-a to join", || {
        as_alice(&["nodes"]).contains("gpu-a").then_some(())
    });
    let file = dir.path().join("runs");
    let script = script(&file);
    let out = as_alice(&[
        "submit",
        "--gpus",
        "1",
        "--grace",
        "1",
        "--max-requeues",
        "3",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let id: u64 = out
        .trim()
        .trim_start_matches("Submitted job ")
        .parse()
        .expect("id");
    wait_for("attempt 1 on gpu-a", || {
        let j = get_job(id);
        (j["state"] == "running" && j["placement"][0]["node"] == "gpu-a").then_some(())
    });
    ticking(&file, 1);
    // gpu-b joins now, so attempt 2 has somewhere to go.
    let _b = agent(&url, "gpu-b", dir.path(), Some("agent-token-0123456789"));
    let cut_at = Instant::now();
    net.link(false);
    wait_for("attempt 2 on gpu-b", || {
        let j = get_job(id);
        (j["state"] == "running" && j["attempts"] == 2).then_some(())
    });
    assert!(
        cut_at.elapsed() >= Duration::from_secs(5),
        "{:?}",
        cut_at.elapsed()
    );
    ticking(&file, 2);
    assert_one_at_a_time(&file);
    // The link comes back: gpu-a reports attempt 1's exit, which ends nothing.
    net.link(true);
    let j = wait_for("gpu-a to report attempt 1's exit", || {
        let j = get_job(id);
        j["timeline"]
            .as_array()?
            .iter()
            .any(|e| {
                e["event"]
                    .as_str()
                    .is_some_and(|t| t.starts_with("attempt 1 ended on gpu-a"))
            })
            .then_some(j)
    });
    assert_eq!(
        get("/v1/nodes")["nodes"]
            .as_array()
            .and_then(|n| n.iter().find(|n| n["name"] == "gpu-a"))
            .map(|n| n["state"] != "down"),
        Some(true),
        "{j}"
    );
    // A stop that exit wrongly ordered would reach attempt 2 on gpu-b's next syncs.
    common::wait_syncs("gpu-b", 2, || get("/v1/nodes"));
    let j = get_job(id);
    assert_eq!(
        (j["state"].as_str(), j["attempts"].as_u64()),
        (Some("running"), Some(2)),
        "{j}"
    );
    assert!(
        last_line_age(&file) < Duration::from_secs(1),
        "attempt 2 runs on"
    );
    assert!(
        !std::fs::read_to_string(&file)
            .expect("runs")
            .contains("end 2 "),
        "attempt 2 got no stop signal"
    );
    assert_one_at_a_time(&file);
    as_alice(&["cancel", &id.to_string()]);
}

/// The server is killed and restarted within the lease: no job stops.
#[test]
fn a_server_restart_within_the_lease_stops_no_job() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = common::free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut perch = server(dir.path(), 30, "", &["--listen", &listen]);
    let _a = agent(&perch.url, "gpu-a", dir.path(), None);
    let file = dir.path().join("runs");
    let (id, _) = start_job(&perch, &file);
    perch.kill();
    // Away longer than the node timeout (2 s), shorter than the lease (30 s): the job ticks on
    // 4 s after the server went. The time is the point of the test; the wait ends on the tick.
    let killed = now_ns();
    wait_for("a tick 4 s after the server went away", || {
        (ticks_since(&file, killed + 4_000_000_000) > 0).then_some(())
    });
    let perch = server(dir.path(), 30, "", &["--listen", &listen]);
    // A stop or a requeue would follow from the agent's first syncs with the new server.
    common::wait_syncs("gpu-a", 3, || perch.get("/v1/nodes"));
    let j = job(&perch, id);
    assert_eq!(
        (j["state"].as_str(), j["attempts"].as_u64()),
        (Some("running"), Some(1)),
        "{j}"
    );
    let runs = attempts(&file);
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert!(
        last_line_age(&file) < Duration::from_secs(1),
        "still running"
    );
    assert!(
        !std::fs::read_to_string(&file)
            .expect("file")
            .contains("end "),
        "never signalled"
    );
    let (ok, _, err) = perch.cli_as("alice", &["cancel", &id.to_string()]);
    assert!(ok, "{err}");
}

/// `perch up` (server and agent in one process) killed, and back only after the lease ran out:
/// the supervisor stopped the job meanwhile; the restarted server must requeue it, not take
/// the stopped run's exit (code 0, from its signal handler) as the job completing. Found
/// against the release binary.
#[test]
fn perch_up_back_after_the_lease_requeues_the_job_its_supervisor_stopped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("perch.toml");
    std::fs::write(
        &config,
        "[server]\nnode_stale_after_secs = 2\nnode_lease_secs = 5\npg_listen = \"\"\n",
    )
    .expect("config");
    let listen = format!("127.0.0.1:{}", common::free_port());
    let up = [
        "up",
        "--config",
        config.to_str().expect("utf-8"),
        "--simulate-gpus",
        "1",
        "--listen",
        &listen,
    ];
    let data = dir.path().join("data");
    let mut perch = Perch::start(&data, &up);
    let file = dir.path().join("runs");
    let (id, _) = start_job(&perch, &file);
    perch.kill();
    wait_for("the supervisor to stop the job", || {
        std::fs::read_to_string(&file)
            .ok()?
            .contains("end 1 ")
            .then_some(())
    });
    let perch = Perch::start(&data, &up);
    let j = running_attempt(&perch, id, 2);
    assert_eq!(j["requeues"], 1, "{j}");
    ticking(&file, 2);
    assert_one_at_a_time(&file);
    let (ok, _, err) = perch.cli_as("alice", &["cancel", &id.to_string()]);
    assert!(ok, "{err}");
}

/// Found following the README as a newcomer: `perch up` with its default `./perch-data`, a
/// relative path, failed every job ("its supervisor did not start it"): the supervisor runs in
/// the job's directory, where the relative state directory named another place.
#[test]
fn jobs_run_when_the_agents_data_dir_is_relative() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = server(dir.path(), 30, "", &[]);
    let _agent = Agent(
        Command::new(common::PERCH)
            .args([
                "agent", "--server", &perch.url, "--node", "gpu-a", "--nvml", "off",
            ])
            .args(["--simulate-gpus", "1", "--interval-ms", "200"])
            .args(["--data-dir", "relative-data"])
            .current_dir(dir.path())
            .env("PERCH_RUN_AS_USER", "never")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("agent"),
    );
    let file = dir.path().join("runs");
    let (id, _) = start_job(&perch, &file);
    let (ok, _, err) = perch.cli_as("alice", &["cancel", &id.to_string()]);
    assert!(ok, "{err}");
    assert!(dir.path().join("relative-data/jobs/gpu-a/.state").is_dir());
}

/// Without cgroups, a process that leaves the job's group and session (`setsid`) is still
/// stopped: when the job is cancelled and when the job's first process simply exits.
#[test]
fn setsid_does_not_escape_cancel_or_the_end_of_the_job() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = server(dir.path(), 30, "", &[]);
    let _a = Agent::start(
        &perch.url,
        "gpu-a",
        &dir.path().join("gpu-a"),
        1,
        None,
        &["--interval-ms", "200", "--cgroups", "off"],
    );
    let run = |name: &str, tail: &str| -> (u64, PathBuf) {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).expect("dir");
        let script = format!(
            "setsid sh -c 'echo $$ >> {p}; exec sleep 600' </dev/null >/dev/null 2>&1 & \
             setsid sh -c 'sleep 600 & echo $! >> {p}; wait' </dev/null >/dev/null 2>&1 & {tail}",
            p = d.join("pids").display()
        );
        let (ok, out, err) = perch.cli_as(
            "alice",
            &["submit", "--gpus", "1", "--", "sh", "-c", &script],
        );
        assert!(ok, "{err}");
        let id = out
            .trim()
            .trim_start_matches("Submitted job ")
            .parse()
            .expect("id");
        (id, d)
    };
    // Cancelled while its escaped processes run.
    let (cancelled, d1) = run("cancelled", "sleep 600");
    wait_for("both escaped processes", || {
        (pids_of(&d1).len() == 2).then_some(())
    });
    let escaped = pids_of(&d1);
    assert!(escaped.iter().all(|&p| alive(p)));
    let (ok, _, err) = perch.cli_as("alice", &["cancel", &cancelled.to_string()]);
    assert!(ok, "{err}");
    wait_for("the escaped processes of the cancelled job to die", || {
        escaped.iter().all(|&p| !alive(p)).then_some(())
    });
    // Ends by itself, leaving its daemons behind.
    let (ended, d2) = run("ended", "sleep 1; exit 0");
    wait_for("both escaped processes", || {
        (pids_of(&d2).len() == 2).then_some(())
    });
    let escaped = pids_of(&d2);
    wait_for("the job to complete", || {
        (job(&perch, ended)["state"] == "completed").then_some(())
    });
    wait_for(
        &format!("the ended job's daemons {escaped:?} to die"),
        || escaped.iter().all(|&p| !alive(p)).then_some(()),
    );
}

/// A network namespace joined to the host by a veth pair: the server listens on the host's
/// end, an agent inside reaches it through the link, which [`Netns::link`] takes down and up.
struct Netns {
    name: String,
    host_if: String,
    host_addr: String,
}

fn ip(args: &[&str]) {
    let status = Command::new("ip").args(args).status().expect("ip");
    assert!(status.success(), "ip {args:?}");
}

impl Netns {
    fn new() -> Netns {
        let n = std::process::id() % 200 + 20;
        let name = format!("perch-cut-{n}");
        let (host_if, ns_if) = (format!("pcut{n}h"), format!("pcut{n}n"));
        let _ = Command::new("ip").args(["netns", "del", &name]).status();
        let _ = Command::new("ip").args(["link", "del", &host_if]).status();
        ip(&["netns", "add", &name]);
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if, "netns", &name,
        ]);
        let host_addr = format!("10.231.{n}.1");
        ip(&["addr", "add", &format!("{host_addr}/30"), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        ip(&[
            "netns",
            "exec",
            &name,
            "ip",
            "addr",
            "add",
            &format!("10.231.{n}.2/30"),
            "dev",
            &ns_if,
        ]);
        ip(&["netns", "exec", &name, "ip", "link", "set", &ns_if, "up"]);
        ip(&["netns", "exec", &name, "ip", "link", "set", "lo", "up"]);
        Netns {
            name,
            host_if,
            host_addr,
        }
    }

    fn link(&self, up: bool) {
        ip(&["link", "set", &self.host_if, if up { "up" } else { "down" }]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .status();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}
