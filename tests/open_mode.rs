//! An open `perch up` (no tokens file) on a shared host, run as root: every local user could
//! reach it, and each must act only as themselves. Callers are identified by the uid that owns
//! their end of the connection; root and the server's own user are operators, every other
//! user an ordinary user. The calls as another user go through `curl` run under that user's
//! uid, as on a shared machine. Needs root (to create the user and switch to it), as CI has.
//!
//! Also here: a `perch up` restarted while its predecessor is still stopping comes up with its
//! agent, or says at once why it cannot.

mod common;

use common::{PATIENCE, Perch, wait_for};
use serde_json::{Value, json};
use std::os::unix::process::CommandExt;
use std::process::Command;

/// The ordinary local user, created once and kept.
const ALICE: &str = "perchalice";

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/open_mode.rs creates a user and runs curl as it: run it as root, as CI does"
    );
}

/// Creates [`ALICE`] unless it exists; returns its uid and gid.
fn alice() -> (u32, u32) {
    require_root();
    let out = Command::new("useradd")
        .args(["-M", "-s", "/bin/sh", ALICE])
        .output()
        .expect("useradd");
    // 9: the user exists already (another test, or an earlier run).
    assert!(
        out.status.success() || out.status.code() == Some(9),
        "useradd {ALICE}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let user = nix::unistd::User::from_name(ALICE)
        .expect("look the user up")
        .expect("the user exists");
    (user.uid.as_raw(), user.gid.as_raw())
}

/// `curl` as the OS user `uid`/`gid` (no supplementary groups): (status, JSON body).
fn curl_as((uid, gid): (u32, u32), method: &str, url: &str, body: Option<&Value>) -> (u16, Value) {
    let mut cmd = Command::new("curl");
    cmd.args([
        "-sS",
        "--noproxy",
        "*",
        "-X",
        method,
        "-w",
        "\n%{http_code}",
    ]);
    if let Some(body) = body {
        cmd.args(["-H", "content-type: application/json", "--data-binary"])
            .arg(body.to_string());
    }
    let out = cmd
        .arg(url)
        .uid(uid)
        .gid(gid)
        .current_dir("/")
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text
        .rsplit_once('\n')
        .unwrap_or_else(|| panic!("curl: {text} {}", String::from_utf8_lossy(&out.stderr)));
    let code = code
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("curl: {text}"));
    (code, serde_json::from_str(body).unwrap_or(Value::Null))
}

fn root() -> (u32, u32) {
    (0, 0)
}

fn submit(perch: &Perch, who: (u32, u32), body: Value) -> (u16, Value) {
    curl_as(who, "POST", &format!("{}/v1/jobs", perch.url), Some(&body))
}

#[test]
fn an_open_server_lets_each_local_user_act_only_as_themselves() {
    let alice_ids = alice();
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(&dir.path().join("up"), &["up"]);
    // Root is an operator, under its login name: it submits a job for bob.
    let (code, me) = curl_as(root(), "GET", &format!("{}/v1/whoami", perch.url), None);
    assert_eq!(code, 200, "{me}");
    assert_eq!(
        (me["user"].as_str(), me["role"].as_str()),
        (Some("root"), Some("operator")),
        "{me}"
    );
    let (code, bobs) = submit(
        &perch,
        root(),
        json!({"command": ["sleep", "300"], "user": "bob", "name": "bobs-job"}),
    );
    assert_eq!(code, 201, "{bobs}");
    let bobs_job = bobs["id"].as_u64().expect("job id");

    // Alice may not submit as another user: the finding was a job run as bob.
    let (code, refused) = submit(
        &perch,
        alice_ids,
        json!({"command": ["true"], "user": "bob"}),
    );
    assert_eq!(code, 403, "alice submitted a job as bob: {refused}");
    let why = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        why.contains(&format!("you are {ALICE}")) && why.contains("only operators"),
        "{why}"
    );

    // She is an ordinary user, named by her login.
    let (code, me) = curl_as(alice_ids, "GET", &format!("{}/v1/whoami", perch.url), None);
    assert_eq!(code, 200, "{me}");
    assert_eq!(
        (me["user"].as_str(), me["role"].as_str()),
        (Some(ALICE), Some("user")),
        "{me}"
    );

    // As herself it works, with or without naming herself, and the job is hers.
    for body in [
        json!({"command": ["true"]}),
        json!({"command": ["true"], "user": ALICE}),
    ] {
        let (code, job) = submit(&perch, alice_ids, body);
        assert_eq!(code, 201, "{job}");
        let id = job["id"].as_u64().expect("job id");
        assert_eq!(perch.job(id)["request"]["user"], ALICE, "{job}");
    }

    // Bob's job is not hers to cancel, and the nodes are not hers to drain.
    let (code, refused) = curl_as(
        alice_ids,
        "POST",
        &format!("{}/v1/jobs/{bobs_job}/cancel", perch.url),
        None,
    );
    assert_eq!(code, 403, "alice cancelled bob's job: {refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("belongs to bob")),
        "{refused}"
    );
    assert_ne!(perch.job(bobs_job)["state"], "cancelled");
    let node = wait_for("the node", || {
        perch.get("/v1/nodes")["nodes"][0]["name"]
            .as_str()
            .map(str::to_owned)
    });
    let (code, refused) = curl_as(
        alice_ids,
        "POST",
        &format!("{}/v1/nodes/{node}/drain", perch.url),
        None,
    );
    assert_eq!(code, 403, "alice drained {node}: {refused}");
    // Root, an operator, may cancel it.
    let (code, cancelled) = curl_as(
        root(),
        "POST",
        &format!("{}/v1/jobs/{bobs_job}/cancel", perch.url),
        None,
    );
    assert_eq!(code, 200, "{cancelled}");
    wait_for("the banner", || {
        perch.log().contains("perch is up").then_some(())
    });
    let banner = perch.log();
    assert!(
        banner.contains("identified by their uid") && banner.contains("tokens file"),
        "the banner says who may do what in open mode:\n{banner}"
    );
}

#[test]
fn a_restarted_up_waits_for_its_predecessor_and_comes_up_with_its_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("up");
    let mut first = Perch::start(&data, &["up"]);
    first.wait_nodes_up(1);
    // A job that takes a while to stop keeps the old agent busy after SIGTERM.
    let stubborn = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", first.url))
        .json(&json!({
            "command": ["sh", "-c", "trap '' TERM; sleep 300"],
            "grace_secs": 4,
        }))
        .send()
        .expect("submit");
    assert_eq!(stubborn.status().as_u16(), 201);
    let id = stubborn.json::<Value>().expect("json")["id"]
        .as_u64()
        .expect("job id");
    wait_for("the job to run", || {
        (first.job(id)["state"] == "running").then_some(())
    });
    Command::new("kill")
        .args(["-TERM", &first.child.id().to_string()])
        .status()
        .expect("send SIGTERM");
    // At once, on the same data directory: it must come up with its agent, or fail saying why.
    let started = std::time::Instant::now();
    let log = data.join("perch-up.log");
    let before = std::fs::read_to_string(&log).unwrap_or_default().len();
    let mut second = Command::new(common::PERCH);
    second
        .args(["up", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .env("PERCH_RUN_AS_USER", "never")
        .env("PERCH_LOG", "info")
        .stdout(
            std::fs::OpenOptions::new()
                .append(true)
                .open(&log)
                .expect("log"),
        )
        .stderr(
            std::fs::OpenOptions::new()
                .append(true)
                .open(&log)
                .expect("log"),
        );
    // The old one is still stopping: its server may already be gone.
    let _ = std::fs::remove_file(data.join("server.addr"));
    let mut second = second.spawn().expect("start the second perch up");
    let url = wait_for("the second perch up to come up or fail", || {
        if let Ok(Some(status)) = second.try_wait() {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            panic!(
                "the second perch up exited ({status}) instead of waiting:\n{}",
                &text[before..]
            );
        }
        std::fs::read_to_string(data.join("server.addr"))
            .ok()
            .filter(|s| s.ends_with('\n'))
            .map(|s| format!("http://{}", s.trim()))
    });
    assert!(started.elapsed() < PATIENCE);
    // Its agent syncs: the node is up under the new server.
    wait_for("the new agent to sync", || {
        if let Ok(Some(status)) = second.try_wait() {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            panic!(
                "the second perch up exited ({status}):\n{}",
                &text[before..]
            );
        }
        let nodes: Value = reqwest::blocking::get(format!("{url}/v1/nodes"))
            .ok()?
            .json()
            .ok()?;
        (common::nodes_up(&nodes) == 1).then_some(())
    });
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !text[before..].contains("another perch agent runs node"),
        "the new agent was refused its node:\n{}",
        &text[before..]
    );
    first.child.wait().expect("the first one exits");
    let _ = second.kill();
    let _ = second.wait();
}

/// Over psql too, an open server takes each local caller as the user owning its connection,
/// whatever name it claims.
#[test]
fn an_open_servers_psql_callers_are_the_local_users_they_are() {
    let alice_ids = alice();
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("up");
    let config = dir.path().join("perch.toml");
    std::fs::write(&config, "[server]\npg_listen = \"127.0.0.1:0\"\n").expect("config");
    let perch = Perch::start(&data, &["up", "--config", &config.to_string_lossy()]);
    let addr = common::wait_for("pg.addr", || {
        std::fs::read_to_string(data.join("pg.addr"))
            .ok()
            .filter(|s| s.ends_with('\n'))
    });
    let (host, port) = addr.trim().rsplit_once(':').expect("host:port");
    // The banner's psql command names the port bound, not the 0 asked for.
    wait_for("the banner", || {
        perch.log().contains("perch is up").then_some(())
    });
    let banner = perch.log();
    assert!(
        banner.contains(&format!("psql -h {host} -p {port} -U perch"))
            && banner.contains(&format!("PostgreSQL data source at {host}:{port}")),
        "{banner}"
    );
    let who = |(uid, gid): (u32, u32)| {
        let out = Command::new("psql")
            .args([
                "-h",
                host,
                "-p",
                port,
                "-U",
                "someone_else",
                "-d",
                "perch",
                "-w",
            ])
            .args(["-X", "-A", "-t", "-c", "SELECT current_user"])
            .env("PGCONNECT_TIMEOUT", "10")
            .uid(uid)
            .gid(gid)
            .current_dir("/")
            .output()
            .expect("run psql");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    assert_eq!(who(root()), "root");
    assert_eq!(who(alice_ids), ALICE);
}
