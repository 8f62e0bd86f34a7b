//! A multi-node job trains together for real: two agents, each in its own network namespace
//! (its "node"), reach the server over a management link and each other over a separate data
//! link (a veth pair), as on a cluster with a management network and a training fabric. The
//! job is a `torch.distributed` all-reduce over gloo on CPU (Debian's `python3-torch`, which
//! `scripts/test.sh` installs), started with nothing but what perch puts in its environment.
//!
//! Needs root (network namespaces), `ip` and `/usr/bin/python3` with torch; it fails, never
//! skips, without them.

mod common;

use common::{Agent, PERCH, Perch, wait_for};
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const AGENT_TOKEN: &str = "agent-token-distributed-0123";
const ALICE_TOKEN: &str = "alice-token-distributed-0123";
const PYTHON: &str = "/usr/bin/python3";

fn ip(args: &[&str]) {
    let status = Command::new("ip").args(args).status().expect("ip");
    assert!(status.success(), "ip {args:?} (the test needs root)");
}

/// Two namespaces `a` and `b`: each with a management link to this namespace (the server's)
/// and one data link between them, named `data0` on both sides.
struct Nodes {
    names: [String; 2],
    host_ifs: [String; 2],
    /// The server's address on each node's management link.
    server_addrs: [String; 2],
    /// Each node's address on the data link.
    data_addrs: [String; 2],
}

impl Nodes {
    fn new() -> Nodes {
        let n = std::process::id() % 200 + 20;
        let names = [format!("perch-da-{n}"), format!("perch-db-{n}")];
        let host_ifs = [format!("pdst{n}a"), format!("pdst{n}b")];
        let server_addrs = [format!("10.233.{n}.1"), format!("10.234.{n}.1")];
        let data_addrs = [format!("10.235.{n}.1"), format!("10.235.{n}.2")];
        for (name, host_if) in names.iter().zip(&host_ifs) {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
            let _ = Command::new("ip").args(["link", "del", host_if]).status();
        }
        for i in 0..2 {
            let (name, host_if) = (&names[i], &host_ifs[i]);
            let node_if = format!("{host_if}n");
            ip(&["netns", "add", name]);
            ip(&[
                "link", "add", host_if, "type", "veth", "peer", "name", &node_if, "netns", name,
            ]);
            ip(&[
                "addr",
                "add",
                &format!("{}/30", server_addrs[i]),
                "dev",
                host_if,
            ]);
            ip(&["link", "set", host_if, "up"]);
            let node_addr = format!("10.{}.{n}.2", 233 + i);
            ip(&[
                "-n",
                name,
                "addr",
                "add",
                &format!("{node_addr}/30"),
                "dev",
                &node_if,
            ]);
            ip(&["-n", name, "link", "set", &node_if, "up"]);
            ip(&["-n", name, "link", "set", "lo", "up"]);
        }
        // The data link: created in a, its peer moved to b, both renamed data0.
        let (a_if, b_if) = (format!("pdst{n}x"), format!("pdst{n}y"));
        ip(&[
            "-n", &names[0], "link", "add", &a_if, "type", "veth", "peer", "name", &b_if, "netns",
            &names[1],
        ]);
        for (i, dev) in [(0, &a_if), (1, &b_if)] {
            ip(&["-n", &names[i], "link", "set", dev, "name", "data0"]);
            ip(&[
                "-n",
                &names[i],
                "addr",
                "add",
                &format!("{}/30", data_addrs[i]),
                "dev",
                "data0",
            ]);
            ip(&["-n", &names[i], "link", "set", "data0", "up"]);
        }
        Nodes {
            names,
            host_ifs,
            server_addrs,
            data_addrs,
        }
    }

    /// An agent for node `i` inside its namespace, advertising its data-link address.
    fn agent(&self, i: usize, port: u16, dir: &Path) -> Agent {
        let node = ["gpu-a", "gpu-b"][i];
        Agent(
            Command::new("ip")
                .args(["netns", "exec", &self.names[i], PERCH])
                .args(["agent", "--node", node, "--nvml", "off"])
                .args([
                    "--server",
                    &format!("http://{}:{port}", self.server_addrs[i]),
                ])
                .args(["--simulate-gpus", "1", "--interval-ms", "200"])
                .args(["--advertise-addr", &self.data_addrs[i], "--data-dir"])
                .arg(dir.join(node))
                .env("PERCH_TOKEN", AGENT_TOKEN)
                .env("PERCH_RUN_AS_USER", "never")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("agent in its namespace"),
        )
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for (name, host_if) in self.names.iter().zip(&self.host_ifs) {
            let _ = Command::new("ip").args(["link", "del", host_if]).status();
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}

/// The all-reduce every rank runs: each adds rank + 1, so two ranks must both print 3.
const ALL_REDUCE: &str = r#"
import datetime, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
fail = os.environ.get("FAIL_RANK")
if fail == str(rank):
    sys.exit(3)
if fail is not None:
    # A rank busy in its own work (not in a collective that would notice the failure): only
    # perch stopping it ends it.
    time.sleep(300)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"rank-{rank}"), "w") as f:
    f.write(f"{rank} {world} {t.item():g} {os.environ['MASTER_ADDR']}\n")
dist.destroy_process_group()
"#;

struct Cluster {
    perch: Perch,
    url: String,
    _agents: [Agent; 2],
    nodes: Nodes,
}

impl Cluster {
    fn submit(&self, script: &Path, out: &Path, env: Value) -> u64 {
        let mut env = env;
        env["GLOO_SOCKET_IFNAME"] = "data0".into();
        let r = reqwest::blocking::Client::new()
            .post(format!("{}/v1/jobs", self.url))
            .bearer_auth(ALICE_TOKEN)
            .json(&serde_json::json!({
                "command": [PYTHON, script.to_str().expect("utf-8"), out.to_str().expect("utf-8")],
                "nodes": 2,
                "gpus_per_node": 1,
                "time_limit_secs": 600,
                "env": env,
            }))
            .send()
            .expect("submit");
        assert_eq!(r.status().as_u16(), 201, "{}", r.text().unwrap_or_default());
        r.json::<Value>().expect("json")["id"].as_u64().expect("id")
    }

    fn job(&self, id: u64) -> Value {
        reqwest::blocking::Client::new()
            .get(format!("{}/v1/jobs/{id}", self.url))
            .bearer_auth(ALICE_TOKEN)
            .send()
            .and_then(|r| r.json())
            .expect("job")
    }

    fn wait_final(&self, id: u64) -> Value {
        wait_for(&format!("job {id} to end"), || {
            let j = self.job(id);
            (!matches!(j["state"].as_str(), Some("pending" | "running"))).then_some(j)
        })
    }
}

fn cluster(dir: &Path) -> Cluster {
    let python_has_torch = Command::new(PYTHON)
        .args([
            "-c",
            "import torch.distributed as d; assert d.is_gloo_available()",
        ])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        python_has_torch,
        "{PYTHON} has no torch with gloo: apt-get install python3-torch (scripts/test.sh does)"
    );
    let nodes = Nodes::new();
    let tokens = dir.join("tokens.toml");
    std::fs::write(
        &tokens,
        format!(
            "[[tokens]]\ntoken = \"{AGENT_TOKEN}\"\nuser = \"agent\"\nrole = \"agent\"\n\n\
             [[tokens]]\ntoken = \"{ALICE_TOKEN}\"\nuser = \"alice\"\nrole = \"user\"\n"
        ),
    )
    .expect("tokens");
    let port = common::free_port();
    let config = dir.join("perch.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\ntokens_file = \"{}\"\npg_listen = \"\"\n",
            tokens.display()
        ),
    )
    .expect("config");
    let listen = format!("0.0.0.0:{port}");
    let perch = Perch::start(
        &dir.join("server"),
        &[
            "server",
            "--config",
            config.to_str().expect("utf-8"),
            "--listen",
            &listen,
        ],
    );
    let url = format!("http://127.0.0.1:{port}");
    let agents = [nodes.agent(0, port, dir), nodes.agent(1, port, dir)];
    let c = Cluster {
        perch,
        url,
        _agents: agents,
        nodes,
    };
    wait_for("both nodes up", || {
        let nodes: Value = reqwest::blocking::Client::new()
            .get(format!("{}/v1/nodes", c.url))
            .bearer_auth(ALICE_TOKEN)
            .send()
            .and_then(|r| r.json())
            .ok()?;
        (common::nodes_up(&nodes) == 2).then_some(())
    });
    c
}

#[test]
fn a_two_node_gang_all_reduces_over_gloo_and_a_failing_rank_ends_both() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = cluster(dir.path());
    let script = dir.path().join("all_reduce.py");
    std::fs::write(&script, ALL_REDUCE).expect("script");
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).expect("mkdir");

    let id = c.submit(&script, &out, serde_json::json!({}));
    let j = c.wait_final(id);
    assert_eq!(j["state"], "completed", "{j}\n{}", c.perch.log());
    let rank0 = j["placement"][0]["node"].as_str().expect("node");
    let master = if rank0 == "gpu-a" {
        &c.nodes.data_addrs[0]
    } else {
        &c.nodes.data_addrs[1]
    };
    for rank in 0..2 {
        let line = std::fs::read_to_string(out.join(format!("rank-{rank}"))).expect("rank");
        assert_eq!(line, format!("{rank} 2 3 {master}\n"), "rank {rank}");
    }
    assert!(j["master_port"].as_u64().is_some(), "{j}");

    // Rank 1 fails after the rendezvous; rank 0 goes on with its own work until perch stops it.
    let started = Instant::now();
    let id = c.submit(&script, &out, serde_json::json!({ "FAIL_RANK": "1" }));
    let j = c.wait_final(id);
    assert_eq!(j["state"], "failed", "{j}");
    assert_eq!(j["exit_code"], 3);
    let failing = j["placement"][1]["node"].as_str().expect("node");
    let reason = j["reason"].as_str().expect("reason");
    assert!(
        reason.contains(&format!("rank 1 of 2 (on {failing}) exited with code 3")),
        "{reason}"
    );
    let stopped = j["placement"][0]["node"].as_str().expect("node").to_owned();
    wait_for("rank 0 stopped", || {
        c.job(id)["timeline"]
            .to_string()
            .contains(&format!("attempt 1 ended on {stopped}"))
            .then_some(())
    });
    // Seconds, not the all-reduce's 60 s timeout.
    assert!(
        started.elapsed() < Duration::from_secs(45),
        "{:?}",
        started.elapsed()
    );
}
