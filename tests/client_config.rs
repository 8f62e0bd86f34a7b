//! The client commands find their server as the server's own config says: `perch
//! submit`, `jobs` and `sql` with `--config` or `PERCH_CONFIG` reach the server that file makes
//! listen, not the default 127.0.0.1:7300 (on a shared host, someone else's); the per-user file
//! `$XDG_CONFIG_HOME/perch/config.toml` gives server and token, a `--config` file wins over it,
//! and a token file others can read is refused. Every client here runs through
//! `common::client()`: no PERCH_SERVER, PERCH_TOKEN or PERCH_CONFIG, no real ~/.config.

mod common;

use common::{Perch, client, free_port};
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;

/// Runs a client command: (success, stdout, stderr).
fn run(cmd: &mut Command) -> (bool, String, String) {
    let out = cmd.env("USER", "alice").output().expect("run perch");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The names of the server's jobs, as seen over HTTP with `token`.
fn job_names(server: &Perch, token: Option<&str>) -> Vec<String> {
    let mut request = reqwest::blocking::Client::new().get(format!("{}/v1/jobs", server.url));
    if let Some(t) = token {
        request = request.bearer_auth(t);
    }
    let jobs: serde_json::Value = request
        .send()
        .and_then(|r| r.error_for_status())
        .and_then(|r| r.json())
        .expect("GET /v1/jobs");
    let mut names: Vec<String> = jobs["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .map(|j| j["request"]["name"].as_str().unwrap_or("-").to_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn clients_reach_the_server_their_config_file_makes_listen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let addr = format!("127.0.0.1:{}", free_port());
    let config = dir.path().join("perch.toml");
    std::fs::write(
        &config,
        format!("[server]\nlisten = \"{addr}\"\npg_listen = \"\"\n"),
    )
    .expect("write config");
    let config = config.to_str().expect("utf-8 path");
    // The test helper adds `--listen 127.0.0.1:0` unless told an address: tell it the file's.
    let server = Perch::start(
        &dir.path().join("data"),
        &["server", "--config", config, "--listen", &addr],
    );
    assert_eq!(server.url, format!("http://{addr}"));

    // --config on the client commands.
    let (ok, out, err) =
        run(client().args(["submit", "--config", config, "-J", "via-flag", "--", "true"]));
    assert!(ok && out.contains("Submitted job"), "{out}{err}");
    // PERCH_CONFIG, and --config given before the subcommand.
    let (ok, out, err) = run(client()
        .env("PERCH_CONFIG", config)
        .args(["submit", "-J", "via-env", "--", "true"]));
    assert!(ok && out.contains("Submitted job"), "{out}{err}");
    let (ok, out, err) = run(client().args([
        "--config",
        config,
        "submit",
        "-J",
        "flag-first",
        "--",
        "true",
    ]));
    assert!(ok && out.contains("Submitted job"), "{out}{err}");
    assert_eq!(
        job_names(&server, None),
        ["flag-first", "via-env", "via-flag"]
    );

    let (ok, out, err) = run(client().args(["jobs", "--config", config]));
    assert!(ok, "{err}");
    for name in ["via-flag", "via-env", "flag-first"] {
        assert!(out.contains(name), "{name} not listed:\n{out}");
    }
    let (ok, out, err) = run(client().env("PERCH_CONFIG", config).args([
        "sql",
        "--format",
        "csv",
        "SELECT 41 + 1 AS answer",
    ]));
    assert!(ok && out.contains("42"), "{out}{err}");
    let (ok, out, err) = run(client().args(["queue", "--config", config]));
    assert!(ok && out.contains("POS"), "{out}{err}");

    // PERCH_SERVER still wins over the file; the error says which address and why.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let (ok, _, err) = run(client()
        .env("PERCH_CONFIG", config)
        .env("PERCH_SERVER", &dead)
        .args(["jobs"]));
    assert!(!ok, "a dead server answered");
    assert!(
        err.contains(&format!(
            "cannot reach the perch server at {dead} (from PERCH_SERVER)"
        )),
        "{err}"
    );
}

fn write_private(path: &Path, text: &str, mode: u32) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, text).expect("write");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

#[test]
fn the_per_user_file_gives_server_and_token_and_must_be_private() {
    const ALICE: &str = "alice-token-0123456789";
    let dir = tempfile::tempdir().expect("tempdir");
    let tokens = dir.path().join("tokens.toml");
    std::fs::write(
        &tokens,
        format!("[[tokens]]\ntoken = \"{ALICE}\"\nuser = \"alice\"\nrole = \"user\"\n"),
    )
    .expect("tokens file");
    let server_config = dir.path().join("server.toml");
    std::fs::write(
        &server_config,
        format!(
            "[server]\ntokens_file = {:?}\npg_listen = \"\"\n",
            tokens.display().to_string()
        ),
    )
    .expect("write config");
    let server = Perch::start(
        &dir.path().join("data"),
        &["server", "--config", server_config.to_str().expect("utf-8")],
    );

    let xdg = dir.path().join("xdg");
    let user_file = xdg.join("perch").join("config.toml");
    let user = || {
        let mut cmd = client();
        cmd.env("XDG_CONFIG_HOME", &xdg);
        cmd
    };
    write_private(
        &user_file,
        &format!(
            "[client]\nserver = \"{}\"\ntoken = \"{ALICE}\"\n",
            server.url
        ),
        0o600,
    );
    let (ok, out, err) = run(user().args(["submit", "-J", "from-user-file", "--", "true"]));
    assert!(ok && out.contains("Submitted job"), "{out}{err}");
    assert_eq!(job_names(&server, Some(ALICE)), ["from-user-file"]);
    let (ok, out, err) = run(user().args(["sql", "--format", "csv", "SELECT 7 * 6 AS answer"]));
    assert!(ok && out.contains("42"), "{out}{err}");

    // A token others may read is refused, with the fix.
    std::fs::set_permissions(&user_file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let (ok, _, err) = run(user().args(["jobs"]));
    assert!(!ok, "a readable token was used");
    let fix = format!("chmod 600 {}", user_file.display());
    assert!(err.contains(&fix) && err.contains("client.token"), "{err}");
    // ... unless the token comes from elsewhere.
    let (ok, out, err) = run(user().env("PERCH_TOKEN", ALICE).args(["jobs"]));
    assert!(ok && out.contains("from-user-file"), "{out}{err}");
    std::fs::set_permissions(&user_file, std::fs::Permissions::from_mode(0o600)).expect("chmod");

    // A --config file's address wins over the per-user file's; the error names that file.
    let dead = format!("127.0.0.1:{}", free_port());
    let other = dir.path().join("other.toml");
    std::fs::write(&other, format!("[server]\nlisten = \"{dead}\"\n")).expect("write");
    let (ok, _, err) = run(user().args(["jobs", "--config", other.to_str().expect("utf-8")]));
    assert!(!ok, "a dead server answered");
    assert!(
        err.contains(&format!(
            "cannot reach the perch server at http://{dead} (from server.listen in config file {})",
            other.display()
        )),
        "{err}"
    );

    // A malformed per-user file names itself and the key.
    write_private(&user_file, "[client]\nsever = \"http://x:1\"\n", 0o600);
    let (ok, _, err) = run(user().args(["jobs"]));
    assert!(!ok, "a malformed per-user file was accepted");
    assert!(
        err.contains(&user_file.display().to_string()) && err.contains("unknown field `sever`"),
        "{err}"
    );

    // Without any of it, a refused request says where server and token came from.
    let (ok, _, err) = run(client().args(["jobs", "--server", &server.url]));
    assert!(!ok, "no token, yet listed");
    assert!(
        err.contains(&format!("server {} from --server; no token", server.url)),
        "{err}"
    );
}

/// A shell without `USER` (root in a container, cron, a systemd unit) submits as the user it
/// runs as, not as the server's fallback `nobody`: a job run as `nobody` cannot read the files
/// its submitter can, and failed with its reason only in its standard error. As root (CI), that
/// submission is refused, saying so, as `USER=root` always was.
#[test]
fn without_user_in_the_environment_a_job_is_submitted_as_the_uid_running_perch() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Perch::start(&dir.path().join("data"), &["server"]);
    let me = nix::unistd::User::from_uid(nix::unistd::geteuid())
        .expect("passwd")
        .expect("this uid has a name")
        .name;
    for user_env in [None, Some("")] {
        let mut cmd = client();
        match user_env {
            None => cmd.env_remove("USER"),
            Some(v) => cmd.env("USER", v),
        };
        let out = cmd
            .args([
                "submit",
                "--server",
                &server.url,
                "-J",
                "no-user",
                "--",
                "true",
            ])
            .output()
            .expect("run perch");
        let stderr = String::from_utf8_lossy(&out.stderr);
        if me == "root" {
            assert!(!out.status.success(), "{out:?}");
            assert!(
                stderr.contains("field `user`: jobs never run as root"),
                "{stderr}"
            );
        } else {
            assert!(out.status.success(), "{out:?}");
        }
    }
    let jobs: serde_json::Value = reqwest::blocking::get(format!("{}/v1/jobs", server.url))
        .and_then(|r| r.json())
        .expect("GET /v1/jobs");
    let users: Vec<_> = jobs["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .map(|j| j["request"]["user"].as_str().unwrap_or("-").to_owned())
        .collect();
    let expected: Vec<String> = if me == "root" {
        vec![]
    } else {
        vec![me.clone(), me]
    };
    assert_eq!(users, expected, "{jobs}");
}
