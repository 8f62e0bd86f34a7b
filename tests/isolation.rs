//! Attacks on a node by the holder of an ordinary user token (issue 15), each run against the
//! real binary with the agent running as root and `run_as_user = required`, jobs running as a
//! user created with `useradd`. Each test asserts that the attack fails with a clear error and
//! that nothing else on the node was affected. They need root, as CI has; none skips.
//! `docs/security.md` lists the defences and the test that proves each.

mod common;

use common::Perch;
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;

/// The unprivileged user jobs run as (uid at least 1000), created once and kept.
const USER: &str = "perch-test-user";

fn require_root() {
    assert!(
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").expect("/proc")) == 0,
        "tests/isolation.rs runs the agent as root, as CI does: run it as root"
    );
}

/// A temporary directory the job's user can traverse (its job directory lies below).
fn open_tempdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
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
