//! Alerts and self-healing end to end, with real components: agents read their GPUs through
//! the stand-in NVML library (nvml-wrapper's real code path), mail goes to a real SMTP server
//! (aiosmtpd), and the audit trail is read back over SQL.
//!
//! 1. The stand-in NVML reports XID 79 on one GPU of the node running a job: the built-in
//!    `XidReboot` rule fires, perch drains that node, the job is requeued and runs on another
//!    node, exactly one email says what happened and what perch did, and the actions are in
//!    the `events` table.
//! 2. An XID storm across the other nodes: perch drains until `max_fraction_out` of the nodes
//!    are out, then its circuit breaker opens and no further node is drained.
//! 3. A process outside the job holding a GPU: the `GpuRogueProcess` alert names the job and
//!    its user, and no job is placed on that GPU until the process is gone.

mod common;

use common::{PERCH, Perch, free_port, wait_for};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const NODES: usize = 6;

/// A real SMTP server delivering into a Maildir; killed when dropped.
struct Smtp {
    child: Child,
    maildir: PathBuf,
    port: u16,
}

impl Smtp {
    fn start(dir: &Path) -> Smtp {
        let maildir = dir.join("maildir");
        let port = free_port();
        let child = Command::new("python3")
            .args(["-m", "aiosmtpd", "-n", "-l", &format!("127.0.0.1:{port}")])
            .args(["-c", "aiosmtpd.handlers.Mailbox"])
            .arg(&maildir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 -m aiosmtpd (scripts/test.sh installs aiosmtpd)");
        let mut smtp = Smtp {
            child,
            maildir,
            port,
        };
        wait_for("aiosmtpd to listen", || {
            assert!(
                smtp.child.try_wait().expect("status").is_none(),
                "aiosmtpd exited: is it installed? run scripts/test.sh"
            );
            std::net::TcpStream::connect(("127.0.0.1", port)).ok()
        });
        smtp
    }

    /// Every message received so far: (subject, decoded body).
    fn messages(&self) -> Vec<(String, String)> {
        let script = r#"
import email, email.policy, glob, json, sys
out = []
for path in sorted(glob.glob(sys.argv[1] + "/new/*")):
    with open(path, "rb") as f:
        m = email.message_from_binary_file(f, policy=email.policy.default)
    body = m.get_body(preferencelist=("plain",))
    out.append([str(m["Subject"]), body.get_content() if body else ""])
print(json.dumps(out))
"#;
        let out = Command::new("python3")
            .args(["-c", script])
            .arg(&self.maildir)
            .output()
            .expect("python3 reads the Maildir");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("json")
    }
}

impl Drop for Smtp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Builds the stand-in NVML library once per test binary and returns its path.
fn standin_library() -> PathBuf {
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nvml-standin");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--quiet", "-p", "nvml-standin", "--manifest-path"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .status()
        .expect("cargo build -p nvml-standin");
    assert!(status.success(), "building nvml-standin failed");
    target.join("debug/libnvml_standin.so")
}

/// Two busy H100s; GPU 0 reports XID 79 (fallen off the bus) `xid_at` seconds after the
/// agent opens NVML.
fn scenario(node: usize, xid_at: f64) -> Value {
    let gpu = |i: usize| {
        json!({
            "uuid": format!("GPU-STANDIN-{node}-{i}"),
            "name": "NVIDIA H100 80GB HBM3",
            "timeline": [{"at": 0, "set": {
                "util_gpu": 60, "util_memory": 20,
                "memory_used_bytes": 8_589_934_592_u64, "memory_total_bytes": 85_520_809_984_u64,
                "power_mw": 350_000, "temperature_c": 55, "sm_clock_mhz": 1980
            }}],
            "events": if i == 0 { json!([{"at": xid_at, "kind": "xid", "xid": 79}]) } else { json!([]) },
        })
    };
    json!({"clock": "seconds", "gpus": [gpu(0), gpu(1)]})
}

struct StandinAgent(Child);

impl StandinAgent {
    fn start(dir: &Path, server: &str, node: usize, lib: &Path, xid_at: f64) -> StandinAgent {
        Self::with_scenario(dir, server, node, lib, &scenario(node, xid_at))
    }

    /// Agent `gpu-<node>` reading its GPUs from the stand-in playing `scenario`.
    fn with_scenario(
        dir: &Path,
        server: &str,
        node: usize,
        lib: &Path,
        scenario: &Value,
    ) -> StandinAgent {
        let data = dir.join(format!("agent-{node}"));
        std::fs::create_dir_all(&data).expect("agent dir");
        let file = data.join("scenario.json");
        std::fs::write(&file, scenario.to_string()).expect("scenario");
        let child = Command::new(PERCH)
            .args([
                "agent",
                "--server",
                server,
                "--node",
                &format!("gpu-{node}"),
            ])
            .arg("--nvml")
            .arg(lib)
            .args(["--interval-ms", "500", "--data-dir"])
            .arg(&data)
            .env("PERCH_NVML_STANDIN_SCENARIO", &file)
            .env("PERCH_RUN_AS_USER", "never")
            .env_remove("PERCH_TOKEN")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(data.join("agent.log")).expect("log"))
            .spawn()
            .expect("spawn perch agent");
        StandinAgent(child)
    }
}

impl Drop for StandinAgent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn get(perch: &Perch, path: &str) -> Value {
    perch.get(path)
}

fn node_states(perch: &Perch) -> Vec<(String, String)> {
    get(perch, "/v1/nodes")["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|n| {
            (
                n["name"].as_str().unwrap_or_default().to_owned(),
                n["state"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

fn drained(perch: &Perch) -> Vec<String> {
    node_states(perch)
        .into_iter()
        .filter(|(_, s)| s == "drained")
        .map(|(n, _)| n)
        .collect()
}

#[test]
fn xid_79_drains_the_node_moves_its_job_mails_once_and_a_storm_trips_the_breaker() {
    let dir = tempfile::tempdir().expect("tempdir");
    let smtp = Smtp::start(dir.path());
    let config = dir.path().join("perch.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[alerts]
evaluation_interval = "1s"

# This test's machine is not under test: its disk may well be nearly full.
[alerts.builtin]
disable = ["StoreDiskFull"]

[[alerts.receivers]]
name = "ops"
[[alerts.receivers.email]]
smtp_host = "127.0.0.1"
smtp_port = {port}
tls = "none"
from = "perch <perch@cluster.test>"
to = ["oncall@cluster.test"]

[alerts.route]
receiver = "ops"
group_by = ["alertname", "node"]
group_wait = "1s"
group_interval = "5m"
repeat_interval = "4h"

[alerts.remediation]
max_concurrent_drains = 10
max_fraction_out = 0.5
breaker_window = "10m"
cooldown = "30m"
"#,
            port = smtp.port
        ),
    )
    .expect("config");
    let perch = Perch::start_with_env(
        &dir.path().join("server"),
        &["server"],
        &[("PERCH_CONFIG", config.to_str().expect("utf-8 path"))],
    );
    let lib = standin_library();

    // gpu-0 alone first, so the job lands there; its GPU 0 reports XID 79 at 12 s.
    let _bad = StandinAgent::start(dir.path(), &perch.url, 0, &lib, 12.0);
    wait_for("gpu-0 to register", || {
        (node_states(&perch).len() == 1).then_some(())
    });
    let submitted: Value = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", perch.url))
        .json(
            &json!({"name": "train", "command": ["sleep", "600"], "gpus_per_node": 2,
                      "user": "alice", "time_limit_secs": 3600}),
        )
        .send()
        .expect("submit")
        .json()
        .expect("json");
    let id = submitted["id"].as_u64().expect("job id");
    let job = |perch: &Perch| get(perch, &format!("/v1/jobs/{id}"));
    wait_for("the job to run on gpu-0", || {
        let j = job(&perch);
        (j["state"] == "running" && j["placement"][0]["node"] == "gpu-0").then_some(())
    });
    // The others: their GPU 0 reports XID 79 much later (the storm).
    let _others: Vec<StandinAgent> = (1..NODES)
        .map(|n| StandinAgent::start(dir.path(), &perch.url, n, &lib, 45.0))
        .collect();
    wait_for("every node to register", || {
        (node_states(&perch).len() == NODES).then_some(())
    });

    // 1. XID 79 on gpu-0: drained, the job moves, one email, the actions in SQL.
    wait_for("gpu-0 to be drained", || {
        (drained(&perch) == ["gpu-0"]).then_some(())
    });
    let moved = wait_for("the job to run elsewhere", || {
        let j = job(&perch);
        let node = j["placement"][0]["node"].as_str().unwrap_or("").to_owned();
        (j["state"] == "running" && !node.is_empty() && node != "gpu-0").then_some(j)
    });
    assert!(
        moved["timeline"].to_string().contains("gpu-0"),
        "the job's timeline says why it moved: {moved}"
    );
    // What the web view's fleet marks: GPU 0 unhealthy with its XID, GPU 1 healthy.
    let nodes = get(&perch, "/v1/nodes");
    let gpu0 = nodes["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["name"] == "gpu-0")
        .map(|n| n["gpu_status"].clone())
        .expect("gpu-0");
    assert_eq!(gpu0[0]["health"], "xid", "{gpu0}");
    assert_eq!(gpu0[0]["xid"], 79, "{gpu0}");
    assert_eq!(gpu0[1]["health"], "healthy", "{gpu0}");
    assert_eq!(gpu0[0]["uuid"], "GPU-STANDIN-0-0", "{gpu0}");
    let mail = wait_for("the email", || {
        let m = smtp.messages();
        (!m.is_empty()).then_some(m)
    });
    let (subject, body) = &mail[0];
    assert!(
        subject.contains("FIRING") && subject.contains("XidReboot") && subject.contains("gpu-0"),
        "subject: {subject}"
    );
    for needle in ["79", "gpu-0", "Drained", "equeued"] {
        assert!(
            body.contains(needle),
            "the email says what happened and what perch did ({needle}):\n{body}"
        );
    }
    let audit = perch.sql(
        "SELECT action, outcome FROM events WHERE kind = 'remediation' AND node = 'gpu-0' \
         AND rule = 'XidReboot' ORDER BY time",
    );
    let actions: Vec<String> = audit
        .iter()
        .map(|r| {
            format!(
                "{}:{}",
                r["action"].as_str().unwrap_or(""),
                r["outcome"].as_str().unwrap_or("")
            )
        })
        .collect();
    assert!(
        actions.iter().any(|a| a.starts_with("drain_node:done"))
            && actions.iter().any(|a| a.starts_with("requeue_jobs:done")),
        "the drain and the requeue are audited: {actions:?}"
    );
    assert_eq!(
        perch.scalar("SELECT count(*) FROM events WHERE kind = 'alert_firing' AND node = 'gpu-0' AND rule = 'XidReboot'"),
        1,
        "the alert's firing is audited once"
    );
    // Nothing more is sent for it: group_interval is 5 minutes and the XID is one event.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        smtp.messages().len(),
        1,
        "exactly one email: {:?}",
        smtp.messages()
    );

    // 2. The storm: 5 more nodes report XID 79; 0.5 of 6 nodes may be out, so perch drains
    //    two more and then stops everything.
    let breaker = wait_for("the circuit breaker to open", || {
        let a = get(&perch, "/v1/alerts");
        let trip = a["remediation"]["circuit_breaker"].clone();
        (!trip.is_null()).then_some(trip)
    });
    assert!(
        breaker["reason"]
            .as_str()
            .is_some_and(|r| r.contains("max_fraction_out")),
        "{breaker}"
    );
    assert_eq!(drained(&perch).len(), 3, "{:?}", node_states(&perch));
    // It stays that way while the alerts keep firing.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(
        drained(&perch).len(),
        3,
        "no further node drained: {:?}",
        node_states(&perch)
    );
    assert_eq!(
        perch.scalar("SELECT count(*) FROM events WHERE kind = 'circuit_breaker_open'"),
        1
    );
    assert!(
        perch.scalar(
            "SELECT count(*) FROM events WHERE kind = 'remediation' AND action = 'drain_node' \
             AND outcome LIKE 'refused%'"
        ) >= 1,
        "the refused drain is audited"
    );
    let metrics = reqwest::blocking::get(format!("{}/metrics", perch.url))
        .expect("metrics")
        .text()
        .expect("text");
    assert!(
        metrics.contains("perch_remediation_circuit_breaker_open 1"),
        "breaker state on /metrics"
    );
    assert!(
        metrics.contains(
            "perch_alerts{alertname=\"XidReboot\",state=\"firing\",severity=\"critical\"}"
        ),
        "alert counts on /metrics"
    );
    // The breaker's own alert is mailed to the operators.
    wait_for("the breaker email", || {
        smtp.messages()
            .iter()
            .any(|(s, _)| s.contains("RemediationCircuitOpen"))
            .then_some(())
    });
}

/// A process the job did not start appears on one of its GPUs (the stand-in lists pid 1, init,
/// there for the first 25 s): `GpuRogueProcess` fires naming the job and its user, the GPU's
/// health is `rogue_process` (no job is placed on it), and once the process is gone the GPU is
/// healthy again and a new job can have it.
#[test]
fn a_rogue_process_raises_its_alert_and_keeps_jobs_off_its_gpu_while_it_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_config(
        dir.path(),
        r#"
[alerts]
evaluation_interval = "1s"
[alerts.builtin]
disable = ["StoreDiskFull"]
rogue_for = "2s"
"#,
        &[],
    );
    let lib = standin_library();
    let gpu = |i: usize, processes: Value| {
        json!({
            "uuid": format!("GPU-STANDIN-ROGUE-{i}"),
            "name": "NVIDIA H100 80GB HBM3",
            "timeline": [
                {"at": 0, "set": {"util_gpu": 60, "memory_used_bytes": 1_073_741_824_u64,
                                  "memory_total_bytes": 85_520_809_984_u64, "processes": processes}},
                {"at": 25, "set": {"processes": []}}
            ],
        })
    };
    // A PID the agent can see (one it cannot is unknown, not rogue), and no job's.
    let rogue = json!([{"pid": 1, "used_memory_bytes": 1_073_741_824_u64}]);
    let scenario = json!({"clock": "seconds", "gpus": [gpu(0, rogue), gpu(1, json!([]))]});
    let _agent = StandinAgent::with_scenario(dir.path(), &perch.url, 0, &lib, &scenario);
    wait_for("gpu-0 to register", || {
        (node_states(&perch).len() == 1).then_some(())
    });
    let submit = |name: &str, gpus: u32| {
        let submitted: Value = reqwest::blocking::Client::new()
            .post(format!("{}/v1/jobs", perch.url))
            .json(
                &json!({"name": name, "command": ["sleep", "600"], "gpus_per_node": gpus,
                          "user": "alice", "time_limit_secs": 3600}),
            )
            .send()
            .expect("submit")
            .json()
            .expect("json");
        submitted["id"].as_u64().expect("job id")
    };
    // The job holds both GPUs; the stand-in's pid 1 on GPU 0 is not the job's.
    let first = submit("train", 2);
    let health = |perch: &Perch| {
        get(perch, "/v1/nodes")["nodes"][0]["gpu_status"]
            .as_array()
            .expect("gpu_status")
            .iter()
            .map(|g| g["health"].as_str().unwrap_or("?").to_owned())
            .collect::<Vec<_>>()
    };
    wait_for("GPU 0 marked rogue_process", || {
        (health(&perch) == ["rogue_process", "healthy"]).then_some(())
    });
    let alert = wait_for("GpuRogueProcess firing", || {
        get(&perch, "/v1/alerts")["alerts"]
            .as_array()
            .and_then(|a| {
                a.iter()
                    .find(|a| {
                        a["labels"]["alertname"] == "GpuRogueProcess" && a["state"] == "firing"
                    })
                    .cloned()
            })
    });
    assert_eq!(alert["labels"]["node"], "gpu-0", "{alert}");
    assert_eq!(alert["labels"]["gpu"], "0", "{alert}");
    assert_eq!(alert["labels"]["job"], first.to_string(), "{alert}");
    assert_eq!(alert["labels"]["user"], "alice", "{alert}");
    assert!(
        alert["description"]
            .as_str()
            .unwrap_or_default()
            .contains("pid 1 "),
        "{alert}"
    );
    // The process leaves at 25 s: GPU 0 is healthy again. The job ends; the next one that
    // needs both GPUs starts (it could not while GPU 0 was out).
    wait_for("GPU 0 healthy again", || {
        (health(&perch) == ["healthy", "healthy"]).then_some(())
    });
    reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs/{first}/cancel", perch.url))
        .send()
        .and_then(|r| r.error_for_status())
        .expect("cancel");
    let second = submit("next", 2);
    wait_for("the next job to run on both GPUs", || {
        let j = get(&perch, &format!("/v1/jobs/{second}"));
        (j["state"] == "running").then_some(())
    });
}

/// `[alerts]` as a config file holds it: built-ins on (bar the disk rule: this test's machine
/// is not under test) and the SQL rules `rules` (name, query).
fn alerts_config(rules: &[(&str, &str)]) -> String {
    let mut text = String::from(
        "[alerts]\nevaluation_interval = \"1s\"\n[alerts.builtin]\ndisable = [\"StoreDiskFull\"]\n",
    );
    for (name, sql) in rules {
        text.push_str(&format!(
            "[[alerts.rules]]\nname = \"{name}\"\nsql = \"{sql}\"\nseverity = \"info\"\n"
        ));
    }
    text
}

/// `perch alerts rules` as its rows: rule name -> the rest of its line.
fn rules_listed(perch: &Perch) -> Vec<(String, String)> {
    let (ok, out, err) = perch.cli_as("root", &["alerts", "rules"]);
    assert!(ok, "{err}");
    out.lines()
        .skip(1)
        .filter_map(|l| l.split_once(' '))
        .map(|(name, rest)| (name.to_owned(), rest.trim().to_owned()))
        .collect()
}

#[test]
fn sighup_applies_changed_alert_rules_and_every_rule_is_listed_from_the_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let quiet = ("Quiet", "SELECT 'n1' AS node WHERE 1 = 0");
    let mut perch = common::server_with_config(dir.path(), &alerts_config(&[quiet]), &[]);
    // Every configured rule is listed before any fires (the list was empty until one did).
    let listed = wait_for("the quiet rule to be evaluated", || {
        let rules = rules_listed(&perch);
        rules
            .iter()
            .any(|(name, rest)| name == "Quiet" && rest.starts_with("ok "))
            .then_some(rules)
    });
    assert!(
        listed.iter().any(|(name, _)| name == "NodeHeartbeatLost"),
        "built-in rules too: {listed:?}"
    );
    // A rule added to the file applies on SIGHUP, without a restart (which failed the jobs of
    // a `perch up`); a rule taken out goes.
    let always = ("Always", "SELECT 'n1' AS node");
    std::fs::write(dir.path().join("perch.toml"), alerts_config(&[always])).expect("config");
    let pid = perch.child.id().to_string();
    let hup = Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .expect("kill -HUP");
    assert!(hup.success());
    let rules = wait_for("the new rule to fire", || {
        let rules = rules_listed(&perch);
        rules
            .iter()
            .any(|(name, rest)| name == "Always" && rest.starts_with("firing "))
            .then_some(rules)
    });
    assert!(!rules.iter().any(|(name, _)| name == "Quiet"), "{rules:?}");
    let alerts = get(&perch, "/v1/alerts");
    assert!(
        alerts["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|a| a["labels"]["alertname"] == "Always" && a["state"] == "firing"),
        "{alerts}"
    );
    // A file that does not validate changes nothing and says why in the log.
    std::fs::write(
        dir.path().join("perch.toml"),
        "[alerts]\nevaluation_interval = \"soon\"\n",
    )
    .expect("config");
    Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .expect("kill -HUP");
    wait_for("the refusal in the log", || {
        perch
            .log()
            .contains("SIGHUP: [alerts] was not read again")
            .then_some(())
    });
    assert!(
        rules_listed(&perch)
            .iter()
            .any(|(name, _)| name == "Always")
    );
    perch.assert_running();
}
