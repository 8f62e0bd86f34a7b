//! Identity end to end: bearer tokens map to users and roles; users act on their own jobs only,
//! operators on everything, agents only deliver telemetry and sync; open mode stays on loopback.

mod common;

use common::{AGENT, ALICE, BOB, OPERATOR, PERCH, wait_for};
use std::process::Command;

fn cli(url: &str, token: Option<&str>, args: &[&str]) -> (bool, String, String) {
    let mut cmd = common::client();
    cmd.args(args).env("PERCH_SERVER", url);
    if let Some(t) = token {
        cmd.env("PERCH_TOKEN", t);
    }
    let out = cmd.output().expect("run perch");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn tokens_decide_who_may_do_what() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = common::server_with_tokens(dir.path(), &common::role_tokens("gpu-a"));
    let url = server.url.clone();
    let _agent = common::Agent::start(
        &url,
        "gpu-a",
        &dir.path().join("agent"),
        2,
        Some(AGENT),
        &[],
    );

    // No token: refused, with what to do; health and metrics stay open.
    let r = reqwest::blocking::get(format!("{url}/v1/jobs")).expect("get");
    assert_eq!(r.status().as_u16(), 401);
    assert!(r.text().expect("text").contains("Authorization: Bearer"));
    assert!(
        reqwest::blocking::get(format!("{url}/metrics"))
            .expect("metrics")
            .status()
            .is_success()
    );
    let (ok, _, err) = cli(&url, Some("wrong-token-0123456789"), &["jobs"]);
    assert!(!ok && err.contains("not known"), "{err}");

    // Alice submits as herself; she cannot submit as Bob.
    let (ok, out, err) = cli(
        &url,
        Some(ALICE),
        &[
            "submit",
            "--gpus",
            "1",
            "--env",
            "WANDB_API_KEY=s3cret-key",
            "--",
            "sh",
            "-c",
            "sleep 30",
            "--password=hunter2",
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "Submitted job 1");
    let (ok, _, err) = cli(
        &url,
        Some(ALICE),
        &["submit", "--user", "bob", "--", "true"],
    );
    assert!(
        !ok && err.contains("only operators submit jobs as another user"),
        "{err}"
    );

    // The agent, with its own token, runs it.
    wait_for("job 1 running on the agent", || {
        let (_, out, _) = cli(&url, Some(ALICE), &["show", "1"]);
        out.contains("State=running").then_some(())
    });

    // Bob may list and show, but not cancel or read Alice's job.
    let (ok, out, _) = cli(&url, Some(BOB), &["jobs"]);
    assert!(ok && out.contains("alice"), "{out}");
    // Nor see her environment or command line (an API key, a password argument),
    // through any listing; she and the operators still do.
    let body = |token: &str, path: &str| {
        reqwest::blocking::Client::new()
            .get(format!("{url}{path}"))
            .bearer_auth(token)
            .send()
            .expect("get")
            .text()
            .expect("text")
    };
    for path in [
        "/v1/jobs",
        "/v1/jobs/1",
        "/v1/queue",
        "/v1/jobs?state=running",
    ] {
        let seen = body(BOB, path);
        assert!(
            !seen.contains("s3cret-key") && !seen.contains("hunter2"),
            "{path} shows bob alice's secrets: {seen}"
        );
    }
    assert!(body(BOB, "/v1/jobs/1").contains("hidden: not your job"));
    for token in [ALICE, OPERATOR] {
        let seen = body(token, "/v1/jobs/1");
        assert!(
            seen.contains("s3cret-key") && seen.contains("hunter2"),
            "{seen}"
        );
    }
    let (ok, _, err) = cli(&url, Some(BOB), &["cancel", "1"]);
    assert!(!ok && err.contains("belongs to alice"), "{err}");
    let (ok, _, err) = cli(&url, Some(BOB), &["logs", "1"]);
    assert!(!ok && err.contains("403"), "{err}");

    // Gpu-a's token cannot report or sync as another node.
    let client = reqwest::blocking::Client::new();
    let forged = client
        .post(format!("{url}/v1/ingest"))
        .bearer_auth(AGENT)
        .json(&common::marked_batch("gpu-b", 1))
        .send()
        .expect("ingest");
    assert_eq!(forged.status().as_u16(), 403);
    assert!(
        forged
            .text()
            .expect("text")
            .contains("bound to node(s) gpu-a")
    );
    let sync = client
        .post(format!("{url}/v1/agent/sync"))
        .bearer_auth(AGENT)
        .json(&serde_json::json!({"node": "gpu-b", "gpus": 8, "gpu_model": "forged"}))
        .send()
        .expect("sync");
    assert_eq!(sync.status().as_u16(), 403);
    let (_, nodes, _) = cli(&url, Some(OPERATOR), &["nodes"]);
    assert!(!nodes.contains("gpu-b"), "{nodes}");

    // Only operators drain; agents cannot act as users.
    let (ok, _, err) = cli(&url, Some(ALICE), &["drain", "gpu-a"]);
    assert!(!ok && err.contains("may not call"), "{err}");
    let (ok, _, err) = cli(&url, Some(AGENT), &["submit", "--", "true"]);
    assert!(!ok && err.contains("may not call"), "{err}");
    let (ok, out, err) = cli(&url, Some(OPERATOR), &["drain", "gpu-a"]);
    assert!(ok && out.contains("drained"), "{out}{err}");
    cli(&url, Some(OPERATOR), &["resume", "gpu-a"]);

    // Alice cancels her own job; the agent's telemetry arrived through its token too.
    let (ok, out, err) = cli(&url, Some(ALICE), &["cancel", "1"]);
    assert!(ok && out.contains("cancelled"), "{out}{err}");
    let (ok, out, err) = cli(
        &url,
        Some(ALICE),
        &[
            "sql",
            "--format",
            "csv",
            "SELECT count(*) > 0 AS seen FROM host_samples WHERE node = 'gpu-a'",
        ],
    );
    assert!(ok, "{err}");
    assert!(
        out.contains("true")
            || wait_for("agent telemetry", || {
                let (_, out, _) = cli(
                    &url,
                    Some(ALICE),
                    &[
                        "sql",
                        "--format",
                        "csv",
                        "SELECT count(*) > 0 AS seen FROM host_samples WHERE node = 'gpu-a'",
                    ],
                );
                out.contains("true").then_some(true)
            })
    );
}

/// A batch cancel (`perch cancel` with several ids or filters) as a hostile user and a
/// careless one: another user's array or ids are never cancelled, whatever the filters say;
/// an operator's filters that would reach every user are refused; each refusal says what to
/// change.
#[test]
fn a_batch_cancel_reaches_only_the_callers_jobs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = common::server_with_tokens(dir.path(), &common::role_tokens("gpu-a"));
    let url = server.url.clone();
    let (ok, out, err) = cli(&url, Some(ALICE), &["submit", "--array", "4", "--", "true"]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "Submitted array job 1 (tasks 1-4)");
    let (ok, out, err) = cli(&url, Some(BOB), &["submit", "--", "true"]);
    assert!(ok && out.trim() == "Submitted job 5", "{out}{err}");
    let state = |id: u64| -> String {
        let (_, out, _) = cli(&url, Some(OPERATOR), &["show", &id.to_string()]);
        out.lines()
            .find_map(|l| l.trim().strip_prefix("State="))
            .and_then(|l| l.split_whitespace().next())
            .unwrap_or_default()
            .to_owned()
    };

    // Bob names Alice's array, her user, her ids among his own and a missing one.
    let (ok, _, err) = cli(&url, Some(BOB), &["cancel", "--array", "1"]);
    assert!(!ok && err.contains("array 1 belongs to alice"), "{err}");
    let (ok, _, err) = cli(&url, Some(BOB), &["cancel", "--user", "alice"]);
    assert!(
        !ok && err.contains("bob may cancel only their own jobs"),
        "{err}"
    );
    let (ok, out, err) = cli(&url, Some(BOB), &["cancel", "1", "2", "5", "999"]);
    assert!(!ok, "{out}");
    assert_eq!(out.trim(), "job 5: cancelled");
    for said in [
        "job 1: belongs to alice",
        "job 2: belongs to alice",
        "job 999: no job 999",
        "3 of 4 jobs not cancelled",
    ] {
        assert!(err.contains(said), "{said:?} in {err}");
    }
    assert_eq!(
        (state(1), state(2), state(5)),
        ("pending".into(), "pending".into(), "cancelled".into())
    );
    // His filters reach his own jobs only: none are left.
    let (ok, out, err) = cli(&url, Some(BOB), &["cancel", "--state", "pending"]);
    assert!(
        ok && out.is_empty() && err.contains("no unfinished job matched"),
        "{out}{err}"
    );
    assert_eq!(state(3), "pending");

    // Careless: an operator's filters that would reach everyone, a finished state, nothing
    // named, ids with filters, a body the server cannot read.
    let (ok, _, err) = cli(&url, Some(OPERATOR), &["cancel", "--state", "pending"]);
    assert!(
        !ok && err.contains("would cancel every user's jobs"),
        "{err}"
    );
    let (ok, _, err) = cli(&url, Some(ALICE), &["cancel", "--state", "completed"]);
    assert!(!ok && err.contains("only pending or running jobs"), "{err}");
    let (ok, _, err) = cli(&url, Some(ALICE), &["cancel"]);
    assert!(!ok && err.contains("required"), "{err}");
    let (ok, _, err) = cli(&url, Some(ALICE), &["cancel", "2", "--array", "1"]);
    assert!(!ok && err.contains("cannot be used with"), "{err}");
    let (ok, _, err) = cli(&url, Some(ALICE), &["cancel", "--array", "2"]);
    assert!(!ok && err.contains("job 2 is not an array"), "{err}");
    let post = |body: &str| {
        let r = reqwest::blocking::Client::new()
            .post(format!("{url}/v1/jobs/cancel"))
            .bearer_auth(ALICE)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .expect("post");
        (r.status().as_u16(), r.text().expect("text"))
    };
    for (body, said) in [
        (r#"{"idz": [1]}"#, "unknown field `idz`"),
        (r#"{"ids": "1"}"#, "ids"),
        (r#"{"ids": [1], "user": "alice"}"#, "not both"),
        (r#"{"state": "asleep"}"#, "unknown variant"),
    ] {
        let (status, text) = post(body);
        assert!(
            status == 400 && text.contains(said),
            "{body}: {status} {text}"
        );
    }
    // 100,000 ids no job has: each reported, none cancelled, nothing else touched.
    let many: Vec<u64> = (1_000_000..1_100_000).collect();
    let (status, text) = post(&serde_json::json!({ "ids": many }).to_string());
    assert_eq!(status, 200, "{text}");
    let out: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(out["not_found"].as_array().map(Vec::len), Some(100_000));
    assert_eq!(out["cancelled"], serde_json::json!([]));
    // One more is refused, saying how to cancel more (a 64 MiB body holds millions).
    let too_many: Vec<u64> = (1_000_000..1_100_001).collect();
    let (status, text) = post(&serde_json::json!({ "ids": too_many }).to_string());
    assert!(
        status == 400 && text.contains("at most 100000"),
        "{status} {text}"
    );

    // Alice cancels her whole array in one command; a task names its array.
    let (ok, shown, _) = cli(&url, Some(ALICE), &["show", "3"]);
    assert!(
        ok && shown.contains("ArrayJobId=1 ArrayTaskId=2"),
        "{shown}"
    );
    let (ok, out, err) = cli(&url, Some(ALICE), &["cancel", "--array", "1"]);
    assert!(ok, "{err}");
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "job 1: cancelled",
            "job 2: cancelled",
            "job 3: cancelled",
            "job 4: cancelled"
        ]
    );
    for id in 1..=4 {
        assert_eq!(state(id), "cancelled");
    }
}

#[test]
fn open_mode_refuses_to_listen_beyond_loopback() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(PERCH)
        .args(["server", "--listen", "0.0.0.0:0", "--data-dir"])
        .arg(dir.path())
        .output()
        .expect("run perch");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not a loopback address") && err.contains("tokens_file"),
        "{err}"
    );
}

/// A user token submitted with another user's `account` and `qos = high`, and the
/// usage was charged there. Now accounts and QOS levels are granted in `[accounts]`; anything
/// else is refused with 403 naming the section to change. The agent, with a token the server
/// does not know yet, keeps its telemetry until the operator adds it (a token rotation).
#[test]
fn accounts_and_qos_are_granted_not_claimed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tokens = dir.path().join("tokens.toml");
    let entries = format!(
        "[[tokens]]\ntoken = \"{ALICE}\"\nuser = \"alice\"\nrole = \"user\"\n\
         [[tokens]]\ntoken = \"{BOB}\"\nuser = \"bob\"\nrole = \"user\"\n\
         [[tokens]]\ntoken = \"{OPERATOR}\"\nuser = \"ops\"\nrole = \"operator\"\n"
    );
    std::fs::write(&tokens, &entries).expect("tokens");
    let config = dir.path().join("perch.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\ntokens_file = \"{}\"\npg_listen = \"\"\n\
             [accounts.vision]\nusers = [\"alice\"]\nqos = [\"low\", \"normal\", \"high\"]\n",
            tokens.display(),
        ),
    )
    .expect("config");
    let listen = format!("127.0.0.1:{}", common::free_port());
    let start = || {
        common::Perch::start(
            &dir.path().join("server"),
            &[
                "server",
                "--config",
                config.to_str().expect("utf-8"),
                "--listen",
                &listen,
            ],
        )
    };
    let mut server = start();
    let url = server.url.clone();
    // The agent's token is not in the tokens file yet.
    let agent_metrics = format!("127.0.0.1:{}", common::free_port());
    let _agent = common::Agent::start(
        &url,
        "gpu-a",
        &dir.path().join("agent"),
        1,
        Some(AGENT),
        &["--interval-ms", "200", "--metrics-listen", &agent_metrics],
    );
    let submit = |token: &str, extra: &[&str]| {
        let mut args = vec!["submit", "--gpus", "1"];
        args.extend_from_slice(extra);
        args.extend(["--", "true"]);
        cli(&url, Some(token), &args)
    };
    let (ok, _, err) = submit(BOB, &["--account", "alice"]);
    assert!(
        !ok && err.contains("may not charge account \"alice\""),
        "{err}"
    );
    let (ok, _, err) = submit(BOB, &["--account", "vision"]);
    assert!(!ok && err.contains("[accounts.vision]"), "{err}");
    let (ok, _, err) = submit(BOB, &["--qos", "high"]);
    assert!(!ok && err.contains("may not use qos high"), "{err}");
    let (ok, _, err) = submit(BOB, &["--qos", "low"]);
    assert!(ok, "own account, a granted QOS: {err}");
    let (ok, _, err) = submit(ALICE, &["--account", "vision", "--qos", "high"]);
    assert!(ok, "granted in [accounts.vision]: {err}");
    let (ok, _, err) = submit(OPERATOR, &["--account", "vision", "--qos", "high"]);
    assert!(ok, "operators may: {err}");
    // The agent measures while the server refuses it: five rounds taken, none delivered.
    wait_for("five rounds measured while the token is refused", || {
        let text = reqwest::blocking::get(format!("http://{agent_metrics}/metrics"))
            .ok()?
            .text()
            .ok()?;
        let counter = |name: &str| common::metric(&text, name);
        assert_eq!(
            counter("perch_agent_batches_sent_total"),
            Some(0.0),
            "{text}"
        );
        (counter("perch_agent_rounds_total")? >= 5.0
            && counter("perch_agent_send_errors_total")? >= 1.0)
            .then_some(())
    });
    // The operator adds the agent's token and restarts the server: what the agent measured
    // while it was refused arrives.
    server.kill();
    std::fs::write(
        &tokens,
        format!(
            "{entries}[[tokens]]\ntoken = \"{AGENT}\"\nuser = \"node-agent\"\nrole = \"agent\"\nnodes = [\"gpu-a\"]\n"
        ),
    )
    .expect("tokens");
    let restarted_at = common::now_ms();
    let server = start();
    let samples = |query: &str| -> i64 {
        let (ok, out, err) = cli(
            &server.url,
            Some(OPERATOR),
            &["sql", "--format", "csv", query],
        );
        assert!(ok, "{err}");
        out.lines()
            .nth(1)
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or(0)
    };
    wait_for("samples measured while the token was refused", || {
        let n = samples(&format!(
            "SELECT count(*) FROM gpu_samples WHERE node = 'gpu-a' AND time < to_timestamp_millis({restarted_at})"
        ));
        (n >= 5).then_some(())
    });
}

/// Tokens were stored in plain text and read at startup only. `perch token create`
/// prints a new token once and files only its hash; SIGHUP makes the server read the file
/// again, so a token is granted or revoked without a restart, and a broken file changes
/// nothing.
#[test]
fn tokens_are_created_hashed_and_granted_or_revoked_on_sighup() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("tokens.toml");
    let create = |user: &str, role: &str| {
        let out = common::client()
            .args([
                "token", "create", "--user", user, "--role", role, "--append",
            ])
            .arg(&file)
            .output()
            .expect("perch token create");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let token = String::from_utf8(out.stdout)
            .expect("utf-8")
            .trim()
            .to_owned();
        assert!(token.starts_with("perch_") && token.len() == 70, "{token}");
        token
    };
    let operator = create("ops", "operator");
    let text = std::fs::read_to_string(&file).expect("tokens file");
    assert!(
        !text.contains(&operator),
        "the file holds the token itself:\n{text}"
    );
    assert!(text.contains("token_hash = \"blake3:"), "{text}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&file).expect("meta").permissions().mode() & 0o777,
        0o600
    );
    // A role it does not know, or --node on a user token: refused, the file untouched.
    let refused = common::client()
        .args([
            "token", "create", "--user", "x", "--role", "user", "--node", "gpu-a", "--append",
        ])
        .arg(&file)
        .output()
        .expect("run");
    assert!(!refused.status.success());
    assert_eq!(std::fs::read_to_string(&file).expect("file"), text);

    let server = common::server_with_tokens_file(dir.path(), &file);
    let url = server.url.clone();
    let (ok, out, err) = cli(&url, Some(&operator), &["nodes"]);
    assert!(ok, "{out}{err}");
    let alice = create("alice", "user");
    let (ok, _, err) = cli(&url, Some(&alice), &["jobs"]);
    assert!(!ok && err.contains("not known"), "before SIGHUP: {err}");
    let hangup = || {
        let status = Command::new("kill")
            .args(["-HUP", &server.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    };
    hangup();
    wait_for("alice's new token accepted", || {
        cli(&url, Some(&alice), &["jobs"]).0.then_some(())
    });
    // A broken file on SIGHUP: the server keeps the tokens it had, and keeps running.
    std::fs::write(&file, format!("{text}[[tokens]]\nuser = \"broken\"\n")).expect("write");
    hangup();
    wait_for("the server to read the broken file and refuse it", || {
        server
            .log()
            .contains("the tokens file was not read again")
            .then_some(())
    });
    assert!(
        cli(&url, Some(&alice), &["jobs"]).0,
        "a broken file revoked a token"
    );
    // Revoked: the file without alice's entry.
    std::fs::write(&file, &text).expect("write");
    hangup();
    wait_for("alice's token revoked", || {
        let (ok, _, err) = cli(&url, Some(&alice), &["jobs"]);
        (!ok && err.contains("not known")).then_some(())
    });
    assert!(cli(&url, Some(&operator), &["nodes"]).0);
    assert!(
        server.log().contains("was not read again"),
        "{}",
        server.log()
    );
}

/// Tokens had no end, and two `perch token create --append` at once could each
/// read the file before the other wrote (no lock). Eight at once all land; a token made with
/// `--expires` works until then and is refused after, saying when it expired and what to do.
#[test]
fn tokens_expire_and_concurrent_appends_all_land() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("tokens.toml");
    let create = |user: &str, extra: &[&str]| {
        let out = common::client()
            .args(["token", "create", "--user", user, "--role", "user"])
            .args(extra)
            .arg("--append")
            .arg(&file)
            .output()
            .expect("perch token create");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).trim().to_owned(),
            err,
        )
    };
    let tokens: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| s.spawn(move || create(&format!("user{i}"), &[])))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                let (ok, token, err) = h.join().expect("thread");
                assert!(ok, "{err}");
                token
            })
            .collect()
    });
    let text = std::fs::read_to_string(&file).expect("file");
    assert_eq!(text.matches("[[tokens]]").count(), 8, "{text}");
    for (bad, want) in [
        ("yesterday", "give a duration"),
        ("2020-01-01", "not in the future"),
        ("0s", "not in the future"),
        ("2030-01-01T00:00:00", "no UTC offset"),
    ] {
        let (ok, _, err) = create("late", &["--expires", bad]);
        assert!(!ok && err.contains(want), "{bad}: {err}");
    }
    assert_eq!(
        std::fs::read_to_string(&file).expect("file"),
        text,
        "refusals write nothing"
    );
    let (ok, short, err) = create("brief", &["--expires", "4s"]);
    assert!(ok, "{err}");
    assert!(
        std::fs::read_to_string(&file)
            .expect("file")
            .contains("expires = 20")
    );

    let server = common::server_with_tokens_file(dir.path(), &file);
    assert!(
        server.log().contains("expires within a week"),
        "{}",
        server.log()
    );
    for token in &tokens {
        assert!(cli(&server.url, Some(token), &["jobs"]).0);
    }
    assert!(
        cli(&server.url, Some(&short), &["jobs"]).0,
        "before it expires"
    );
    let err = wait_for("the short token to expire", || {
        let (ok, _, err) = cli(&server.url, Some(&short), &["jobs"]);
        (!ok).then_some(err)
    });
    assert!(
        err.contains("expired at") && err.contains("perch token create"),
        "{err}"
    );
}

/// A token of each role against each route, as `docs/security.md` ("Who may call
/// what") gives them. A call the role may make is answered anything but 401 or 403 (a missing
/// job is 404, an empty body 400); one it may not is 401 without a token and 403 with one.
#[test]
fn every_role_reaches_exactly_the_routes_the_table_gives() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = common::server_with_tokens(
        dir.path(),
        &format!(
            "[[tokens]]\ntoken = \"{ALICE}\"\nuser = \"alice\"\nrole = \"user\"\n\
             [[tokens]]\ntoken = \"{OPERATOR}\"\nuser = \"ops\"\nrole = \"operator\"\n\
             [[tokens]]\ntoken = \"{AGENT}\"\nuser = \"node-agent\"\nrole = \"agent\"\nnodes = [\"gpu-a\"]\n"
        ),
    );
    let client = reqwest::blocking::Client::new();
    let sync = r#"{"node": "gpu-a", "gpus": 0, "gpu_model": "none"}"#;
    // (method, path, body, who may: [none, user, operator, agent])
    let routes: &[(&str, &str, &str, [bool; 4])] = &[
        ("GET", "/", "", [true, true, true, true]),
        ("GET", "/healthz", "", [true, true, true, true]),
        ("GET", "/readyz", "", [true, true, true, true]),
        ("GET", "/metrics", "", [true, true, true, true]),
        ("GET", "/v1/openapi.json", "", [true, true, true, true]),
        ("GET", "/ui/app.js", "", [true, true, true, true]),
        ("GET", "/v1/whoami", "", [false, true, true, false]),
        ("POST", "/v1/metrics", "{}", [false, true, true, false]),
        ("POST", "/v1/ingest", "{}", [false, false, true, true]),
        ("POST", "/v1/agent/sync", sync, [false, false, true, true]),
        // An ingest server's push: operators, or an agent token bound to no node (this one
        // is bound to gpu-a); this server is no control server, so those it takes get 409.
        (
            "POST",
            "/v1/cluster/latest",
            "{}",
            [false, false, true, false],
        ),
        (
            "POST",
            "/v1/sql",
            r#"{"sql": "SELECT 1"}"#,
            [false, true, true, false],
        ),
        ("POST", "/v1/jobs", "{}", [false, true, true, false]),
        ("GET", "/v1/jobs", "", [false, true, true, false]),
        ("GET", "/v1/jobs/999", "", [false, true, true, false]),
        (
            "POST",
            "/v1/jobs/999/cancel",
            "",
            [false, true, true, false],
        ),
        ("GET", "/v1/jobs/999/logs", "", [false, true, true, false]),
        (
            "GET",
            "/v1/jobs/999/provenance",
            "",
            [false, true, true, false],
        ),
        (
            "POST",
            "/v1/jobs/cancel",
            r#"{"ids": [999]}"#,
            [false, true, true, false],
        ),
        ("GET", "/v1/queue", "", [false, true, true, false]),
        ("GET", "/v1/nodes", "", [false, true, true, false]),
        (
            "POST",
            "/v1/nodes/nowhere/drain",
            "",
            [false, false, true, false],
        ),
        (
            "POST",
            "/v1/nodes/nowhere/resume",
            "",
            [false, false, true, false],
        ),
        ("GET", "/v1/alerts", "", [false, true, true, false]),
        (
            "POST",
            "/v1/alerts/breaker/reset",
            "",
            [false, false, true, false],
        ),
        ("GET", "/v1/silences", "", [false, true, true, false]),
        ("POST", "/v1/silences", "{}", [false, false, true, false]),
        (
            "DELETE",
            "/v1/silences/999",
            "",
            [false, false, true, false],
        ),
    ];
    let tokens = [None, Some(ALICE), Some(OPERATOR), Some(AGENT)];
    let mut wrong = Vec::new();
    for (method, path, body, may) in routes {
        for (who, token) in tokens.iter().enumerate() {
            let mut request = client
                .request(
                    method.parse().expect("method"),
                    format!("{}{path}", server.url),
                )
                .header("content-type", "application/json")
                .body(body.to_string());
            if let Some(t) = token {
                request = request.bearer_auth(t);
            }
            let status = request.send().expect("send").status().as_u16();
            let refused = status == 401 || status == 403;
            let expected_refusal = if token.is_none() { 401 } else { 403 };
            if may[who] == refused || (refused && status != expected_refusal) {
                wrong.push(format!(
                    "{method} {path} as {}: {status}",
                    ["no token", "user", "operator", "agent"][who]
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "not as docs/security.md says:\n{}",
        wrong.join("\n")
    );
}

/// An agent token's sync without its agent's id skipped the node's claim check, so
/// a second sender could report the node's jobs as gone and have them killed. It is refused,
/// saying what to send; with the id it is served.
#[test]
fn an_agent_tokens_sync_must_carry_its_agent_id() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = common::server_with_tokens(dir.path(), &common::role_tokens("gpu-a"));
    let client = reqwest::blocking::Client::new();
    let sync = |body: &str| {
        client
            .post(format!("{}/v1/agent/sync", server.url))
            .bearer_auth(AGENT)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .expect("sync")
    };
    let refused = sync(r#"{"node": "gpu-a", "gpus": 1, "gpu_model": "T"}"#);
    assert_eq!(refused.status().as_u16(), 400);
    let body: serde_json::Value = refused.json().expect("JSON");
    assert_eq!(body["error"]["code"], "invalid_sync", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("agent_id")
    );
    let served =
        sync(r#"{"node": "gpu-a", "gpus": 1, "gpu_model": "T", "agent_id": "0123456789abcdef"}"#);
    assert!(served.status().is_success(), "{:?}", served.text());
}
