//! The live server schedules by its `[scheduler]` section, as `perch simulate` replays it:
//! quotas with borrowing and reclaim (with the job's checkpoint signal), the idle policy
//! (warned through the JobIdle alert, then requeued after its grace), rack-aware placement,
//! and a policy changed by SIGHUP without losing a queued or running job. Simulated GPUs, the
//! real server and agents.

mod common;

use common::{Agent, Perch, wait_for};
use serde_json::{Value, json};
use std::path::Path;

fn post_job(perch: &Perch, job: Value) -> u64 {
    let r = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", perch.url))
        .json(&job)
        .send()
        .expect("submit");
    assert_eq!(r.status().as_u16(), 201, "{}", r.text().unwrap_or_default());
    r.json::<Value>().expect("json")["id"].as_u64().expect("id")
}

fn wait_state(perch: &Perch, id: u64, state: &str) -> Value {
    wait_for(&format!("job {id} to be {state}"), || {
        let j = perch.job(id);
        (j["state"] == state).then_some(j)
    })
}

/// A server with `[server] pg_listen = ""` and `config`, and one agent `gpu-a` with `gpus`
/// simulated GPUs on rack `r1`, up.
fn one_node(dir: &Path, config: &str, gpus: u32) -> (Perch, Agent) {
    let perch =
        common::server_with_config(dir, &format!("[server]\npg_listen = \"\"\n{config}"), &[]);
    let a = agent(&perch, dir, "gpu-a", gpus, "r1");
    perch.wait_nodes_up(1);
    (perch, a)
}

fn agent(perch: &Perch, dir: &Path, node: &str, gpus: u32, rack: &str) -> Agent {
    agent_with(perch, dir, node, gpus, &["--rack", rack])
}

fn agent_with(perch: &Perch, dir: &Path, node: &str, gpus: u32, extra: &[&str]) -> Agent {
    let mut args = vec!["--interval-ms", "200"];
    args.extend_from_slice(extra);
    Agent::start(&perch.url, node, &dir.join(node), gpus, None, &args)
}

/// A shell job that records its checkpoint signal in `file` and otherwise runs for minutes.
/// A job that writes `started` to `file` once its handler is in place, and `checkpointed`
/// when it gets SIGUSR1, then exits.
fn checkpointing(file: &Path) -> Vec<String> {
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "trap 'echo checkpointed >> {0}; exit 0' USR1; echo started >> {0}; while true; do sleep 0.1; done",
            file.display()
        ),
    ]
}

#[test]
fn an_account_over_its_quota_borrows_idle_gpus_and_gives_them_back_with_a_checkpoint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (perch, _a) = one_node(dir.path(), "[scheduler.quotas]\nalice = 2\nbob = 2\n", 4);
    let marks = dir.path().join("marks");
    let job = |user: &str, file: &Path| {
        json!({
            "command": checkpointing(file), "user": user, "gpus_per_node": 2,
            "preemptible": true, "checkpoint_signal": "SIGUSR1", "grace_secs": 5,
            "max_requeues": 3,
        })
    };
    std::fs::create_dir_all(&marks).expect("mkdir");
    let own = post_job(&perch, job("alice", &marks.join("own")));
    wait_state(&perch, own, "running");
    // bob's GPUs are idle: alice borrows them.
    let borrowed = post_job(&perch, job("alice", &marks.join("borrowed")));
    wait_state(&perch, borrowed, "running");
    // Running in the control plane is not running on the node yet: a job preempted before
    // its launch reached the agent is requeued without ever starting (and so without a
    // checkpoint), which is right, but not what this test is about.
    wait_for("the borrowed job's process", || {
        std::fs::read_to_string(marks.join("borrowed"))
            .ok()
            .filter(|s| s.contains("started"))
    });
    // bob wants his quota back: the borrowed job gets its checkpoint signal and is requeued.
    let bobs = post_job(&perch, job("bob", &marks.join("bob")));
    wait_state(&perch, bobs, "running");
    let j = perch.job(borrowed);
    assert_eq!(j["preemptions"], 1, "{j}");
    assert!(
        j["timeline"].to_string().contains("quota reclaim for job"),
        "{}",
        j["timeline"]
    );
    wait_for("the borrowed job's checkpoint", || {
        std::fs::read_to_string(marks.join("borrowed"))
            .ok()
            .filter(|s| s.contains("checkpointed"))
    });
    // alice's job within her quota was never touched; the borrowed one waits for room.
    assert_eq!(perch.job(own)["state"], "running");
    let own_marks = std::fs::read_to_string(marks.join("own")).unwrap_or_default();
    assert!(!own_marks.contains("checkpointed"), "{own_marks}");
    assert_eq!(perch.job(borrowed)["state"], "pending");
}

/// Found running the release binary, whose CLI submits jobs not preemptible unless told: an
/// account with no quota borrowed every GPU with jobs that may not be preempted, and the
/// account whose quota they were waited until their time limits. A job that can only ever run
/// on borrowed GPUs is refused unless it is preemptible, and a job that may not be preempted
/// never borrows (it waits for its account's quota, and says how to borrow).
#[test]
fn a_job_that_may_not_be_preempted_never_holds_another_accounts_quota() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (perch, _a) = one_node(dir.path(), "[scheduler.quotas]\nalice = 2\nbob = 2\n", 4);
    let client = reqwest::blocking::Client::new();
    let job = |user: &str, preemptible: bool| {
        json!({
            "command": ["sleep", "600"], "user": user, "gpus_per_node": 2,
            "preemptible": preemptible, "grace_secs": 1, "max_requeues": 3,
        })
    };
    // carol's account is not listed, so its quota is 0: a job of hers that may not be
    // preempted could only ever run on borrowed GPUs, and is refused with what to change.
    let r = client
        .post(format!("{}/v1/jobs", perch.url))
        .json(&job("carol", false))
        .send()
        .expect("submit");
    let status = r.status().as_u16();
    let text = r.text().unwrap_or_default();
    assert_eq!(status, 400, "{text}");
    assert!(
        text.contains("quota of 0") && text.contains("--preemptible"),
        "{text}"
    );
    // The CLI (whose jobs are not preemptible unless told) says the same and fails.
    let (ok, _, err) = perch.cli_as("carol", &["submit", "-g", "2", "--", "sleep", "60"]);
    assert!(!ok && err.contains("--preemptible"), "{err}");
    // alice within her quota runs; past it, a job that may not be preempted waits although
    // two GPUs are idle, and says how it could borrow them.
    let own = post_job(&perch, job("alice", false));
    wait_state(&perch, own, "running");
    let fixed = post_job(&perch, job("alice", false));
    let j = wait_for("the quota reason", || {
        let j = perch.job(fixed);
        j["reason"]
            .as_str()
            .is_some_and(|r| r.contains("quota"))
            .then_some(j)
    });
    let reason = j["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("holds 2 of its quota of 2") && reason.contains("--preemptible"),
        "{reason}"
    );
    // The same job preemptible borrows bob's idle GPUs...
    let borrower = post_job(&perch, job("alice", true));
    wait_state(&perch, borrower, "running");
    assert_eq!(perch.job(fixed)["state"], "pending");
    // ...and bob, within his quota, takes them back at once with a job of his that may not
    // be preempted.
    let bobs = post_job(&perch, job("bob", false));
    wait_state(&perch, bobs, "running");
    assert_eq!(perch.job(borrower)["state"], "pending");
    assert_eq!(perch.job(own)["state"], "running");
    assert_eq!(perch.job(fixed)["state"], "pending");
    // `perch jobs` shows the requeued borrower running nowhere and for no time (it showed its
    // last run's GPUs and a clock still ticking), and `perch queue` lists it once.
    let (ok, out, err) = perch.cli_as("alice", &["jobs"]);
    assert!(ok, "{err}");
    let row = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&borrower.to_string()))
        .unwrap_or_default();
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        cells.get(4..8),
        Some(&["pending", "2", "-", "-"][..]),
        "{out}"
    );
    let (ok, out, err) = perch.cli_as("alice", &["queue"]);
    assert!(ok, "{err}");
    let listed = out
        .lines()
        .filter(|l| l.split_whitespace().nth(1) == Some(&borrower.to_string()))
        .count();
    assert_eq!(listed, 1, "{out}");
}

/// A borrower that declares an hour's grace and ignores its checkpoint signal would hold the
/// reclaiming account's GPUs for that hour (the agent starts the new job only once the old
/// one's processes are gone): stopped for another job it gets `preemption_grace_max`, and the
/// account's job runs seconds later.
#[test]
fn a_borrower_cannot_hold_a_reclaimed_quota_for_its_own_long_grace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (perch, _a) = one_node(
        dir.path(),
        "[scheduler]\npreemption_grace_max = \"2s\"\n[scheduler.quotas]\nalice = 2\n",
        2,
    );
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks).expect("mkdir");
    let stubborn = format!(
        "trap '' TERM; echo started > {}; while true; do sleep 0.1; done",
        marks.join("bob").display()
    );
    let borrower = post_job(
        &perch,
        json!({
            "command": ["sh", "-c", stubborn], "user": "bob", "gpus_per_node": 2,
            "preemptible": true, "grace_secs": 3600, "max_requeues": 3,
        }),
    );
    wait_state(&perch, borrower, "running");
    wait_for("bob's process", || {
        std::fs::read_to_string(marks.join("bob")).ok()
    });
    let started = std::time::Instant::now();
    let own = post_job(
        &perch,
        json!({
            "command": ["sh", "-c", format!("touch {}; sleep 600", marks.join("alice").display())],
            "user": "alice", "gpus_per_node": 2,
        }),
    );
    wait_for("alice's process, once bob's is killed", || {
        marks.join("alice").exists().then_some(())
    });
    let waited = started.elapsed();
    assert!(waited < std::time::Duration::from_secs(30), "{waited:?}");
    assert_eq!(perch.job(own)["state"], "running");
    let timeline = perch.job(borrower)["timeline"].to_string();
    assert!(
        timeline.contains("grace 2 s, not its own 3600 s"),
        "{timeline}"
    );
}

#[test]
fn an_idle_job_is_warned_then_requeued_after_its_grace_and_the_waiting_job_starts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (perch, _a) = one_node(
        dir.path(),
        "[alerts]\nevaluation_interval = \"1s\"\n\
         [scheduler.idle]\naction = \"requeue\"\nbelow_percent = 5.0\nafter = \"10s\"\ngrace = \"4s\"\n",
        2,
    );
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks).expect("mkdir");
    let idle = post_job(
        &perch,
        json!({
            "command": checkpointing(&marks.join("idle")), "user": "alice", "gpus_per_node": 2,
            "preemptible": true, "checkpoint_signal": "SIGUSR1", "sim_profile": "idle",
            "max_requeues": 3,
        }),
    );
    wait_state(&perch, idle, "running");
    let waiting = post_job(
        &perch,
        json!({ "command": ["sleep", "300"], "user": "bob", "gpus_per_node": 2 }),
    );
    // The warning: a JobIdle alert naming alice, before anything is stopped.
    let idle_label = idle.to_string();
    let alert = wait_for("JobIdle firing for alice's job", || {
        let alerts = perch.get("/v1/alerts");
        alerts["alerts"].as_array()?.iter().find_map(|a| {
            (a["labels"]["alertname"] == "JobIdle"
                && a["labels"]["job"] == idle_label.as_str()
                && a["state"] == "firing")
                .then(|| a.clone())
        })
    });
    assert_eq!(alert["labels"]["user"], "alice", "{alert}");
    assert!(
        alert["labels"]["consequence"]
            .as_str()
            .is_some_and(|c| c.contains("requeues it")),
        "{alert}"
    );
    let warned = perch.job(idle);
    assert_eq!(warned["state"], "running", "warned first, not stopped");
    assert!(warned["timeline"].to_string().contains("idle since"));
    // After the grace: requeued with its checkpoint signal, and bob's job starts.
    wait_state(&perch, waiting, "running");
    let j = perch.job(idle);
    assert_eq!(j["state"], "pending", "{j}");
    assert_eq!(j["preemptions"], 1);
    assert!(
        j["timeline"]
            .to_string()
            .contains("idle while other jobs waited"),
        "{}",
        j["timeline"]
    );
    wait_for("the idle job's checkpoint", || {
        std::fs::read_to_string(marks.join("idle"))
            .ok()
            .filter(|s| s.contains("checkpointed"))
    });
}

#[test]
fn a_two_node_gang_lands_on_one_rack_when_it_can() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_config(dir.path(), "[server]\npg_listen = \"\"\n", &[]);
    // Racks interleaved with the names, so that name order alone would split the gang; from
    // one topology file in Slurm's format shared by every agent.
    let topology = dir.path().join("topology.conf");
    std::fs::write(
        &topology,
        "SwitchName=rack-x Nodes=node-[1,3]\nSwitchName=rack-y Nodes=node-[2,4]\n\
         SwitchName=spine Switches=rack-[x,y]\n",
    )
    .expect("topology");
    let file = topology.to_str().expect("utf-8");
    let _agents = ["node-1", "node-2", "node-3", "node-4"]
        .map(|n| agent_with(&perch, dir.path(), n, 2, &["--topology-file", file]));
    perch.wait_nodes_up(4);
    let rack_of = |node: &str| {
        if node == "node-1" || node == "node-3" {
            "rack-x"
        } else {
            "rack-y"
        }
    };
    // Two gangs: each fits in a rack, so each gets one.
    let mut racks = Vec::new();
    for _ in 0..2 {
        let id = post_job(
            &perch,
            json!({ "command": ["sleep", "300"], "user": "alice", "nodes": 2, "gpus_per_node": 2 }),
        );
        let j = wait_state(&perch, id, "running");
        let placed: Vec<&str> = j["placement"]
            .as_array()
            .expect("placement")
            .iter()
            .map(|p| p["node"].as_str().expect("node"))
            .collect();
        assert_eq!(placed.len(), 2);
        assert_eq!(rack_of(placed[0]), rack_of(placed[1]), "{placed:?}");
        racks.push(rack_of(placed[0]));
    }
    assert_ne!(racks[0], racks[1]);
    let (ok, nodes, err) = perch.cli_as("alice", &["nodes"]);
    assert!(ok, "{err}");
    assert!(
        nodes.contains("rack-x") && nodes.contains("rack-y"),
        "{nodes}"
    );
}

#[test]
fn sighup_puts_a_new_policy_in_force_and_keeps_every_job() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (perch, _a) = one_node(dir.path(), "", 2);
    let sleep = json!({ "command": ["sleep", "300"], "user": "alice", "gpus_per_node": 2 });
    let running = post_job(&perch, sleep.clone());
    wait_state(&perch, running, "running");
    let queued = post_job(&perch, sleep);
    let reason = |id: u64| perch.job(id)["reason"].as_str().unwrap_or("").to_owned();
    wait_for("the second job to wait for resources", || {
        reason(queued).contains("GPUs").then_some(())
    });
    let hangup = || {
        let status = std::process::Command::new("kill")
            .args(["-HUP", &perch.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    };
    let config = dir.path().join("perch.toml");
    // A broken section is refused whole: the policy stays, the log says why.
    std::fs::write(
        &config,
        "[server]\npg_listen = \"\"\n[scheduler]\npolicy = \"sjf\"\n",
    )
    .expect("config");
    hangup();
    wait_for("the refusal in the log", || {
        perch
            .log()
            .contains("\"sjf\" is not a policy")
            .then_some(())
    });
    // alice gets a quota of 1 GPU, no borrowing: her running job stays, the queued one now
    // waits for her quota.
    std::fs::write(
        &config,
        "[server]\npg_listen = \"\"\n[scheduler]\nborrowing = false\n[scheduler.quotas]\nalice = 1\n",
    )
    .expect("config");
    hangup();
    wait_for("the queued job to wait for its quota", || {
        reason(queued).contains("quota").then_some(())
    });
    assert!(perch.log().contains("scheduling policy read again"));
    assert_eq!(perch.job(running)["state"], "running");
    assert_eq!(perch.job(queued)["state"], "pending");
}

#[test]
fn a_waiting_job_says_when_it_should_start_and_why_it_waits_in_words() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (perch, _a) = one_node(dir.path(), "", 2);
    let running = post_job(
        &perch,
        json!({ "command": ["sleep", "300"], "user": "alice", "gpus_per_node": 2, "time_limit_secs": 600 }),
    );
    let started_ms = wait_state(&perch, running, "running")["start_ms"]
        .as_i64()
        .expect("start");
    let waiting = post_job(
        &perch,
        json!({ "command": ["true"], "user": "bob", "gpus_per_node": 2, "time_limit_secs": 60 }),
    );
    let j = wait_for("an estimate", || {
        let j = perch.job(waiting);
        j["estimated_start_ms"].as_i64().map(|_| j)
    });
    // When the running job reaches its time limit (the reservation's shadow time).
    let at = j["estimated_start_ms"].as_i64().expect("estimate");
    assert!(
        (at - (started_ms + 600_000)).abs() < 2_000,
        "{at} vs {started_ms}"
    );
    let reason = j["reason"].as_str().expect("reason");
    assert!(
        reason.contains("needs 2 GPUs on one node; 0 nodes have 2 free now, 0 GPUs free in all"),
        "{reason}"
    );
    let (ok, shown, err) = perch.cli_as("bob", &["show", &waiting.to_string()]);
    assert!(ok, "{err}");
    let estimate = j["estimated_start"].as_str().expect("estimate text");
    assert!(shown.contains(&format!("StartTime={estimate}")), "{shown}");
    let (ok, queue, err) = perch.cli_as("bob", &["queue", "--start"]);
    assert!(ok, "{err}");
    assert!(
        queue.contains("START") && queue.contains(estimate),
        "{queue}"
    );
    let q = perch.get("/v1/queue");
    assert!(
        q["queue"][0].get("estimated_start").is_none(),
        "only when asked: {q}"
    );
}

#[test]
fn a_per_model_quota_holds_an_account_at_its_cap_and_says_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (perch, _a) = one_node(
        dir.path(),
        "[scheduler]\nborrowing = false\n\
         [scheduler.model_quotas.alice]\n\"Simulated H100 80GB\" = 2\n",
        4,
    );
    let job = |user: &str| json!({ "command": ["sleep", "300"], "user": user, "gpus_per_node": 2 });
    let first = post_job(&perch, job("alice"));
    wait_state(&perch, first, "running");
    // alice is at her cap on the node's model: her second job waits though 2 GPUs are free...
    let second = post_job(&perch, job("alice"));
    let waiting = wait_for("alice's second job to wait at her cap", || {
        let j = perch.job(second);
        (j["reason"].as_str()?.contains("quota")).then_some(j)
    });
    assert_eq!(waiting["state"], "pending", "{waiting}");
    assert!(
        waiting["reason"]
            .as_str()
            .is_some_and(|r| r.contains("holds 2 of its 2 Simulated H100 80GB GPUs")),
        "{waiting}"
    );
    // ...and bob, with no cap, takes them.
    let bobs = post_job(&perch, job("bob"));
    wait_state(&perch, bobs, "running");
    assert_eq!(perch.job(second)["state"], "pending");
}
