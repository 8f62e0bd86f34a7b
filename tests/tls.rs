//! There was no TLS on HTTP or on the PostgreSQL listener, whose password is the
//! token. With `server.tls_cert` and `server.tls_key` both listeners speak TLS; the CLI and
//! the agent trust an in-house CA through `PERCH_CA_FILE` (`[client]` and `[agent] ca_file`);
//! SIGHUP installs a renewed certificate without a restart; a stalled handshake holds up no
//! one; and a client that does not trust the certificate, or speaks plain HTTP, gets nothing.

mod common;

use common::{Agent, Perch, wait_for};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// A CA's certificate, and a certificate for localhost and 127.0.0.1 it signed with its key.
struct Pki {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn pki(dir: &Path, name: &str) -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // Not the leaf's default name: OpenSSL (psql) takes a leaf named like its issuer for
    // self-signed.
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("perch test CA {name}"));
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("server key");
    let cert = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
        .expect("server params")
        .signed_by(&key, &issuer)
        .expect("server certificate");
    let files = Pki {
        ca: dir.join(format!("{name}-ca.pem")),
        cert: dir.join(format!("{name}-server.pem")),
        key: dir.join(format!("{name}-server.key")),
    };
    std::fs::write(&files.ca, ca_cert.pem()).expect("write CA");
    std::fs::write(&files.cert, cert.pem()).expect("write cert");
    std::fs::write(&files.key, key.serialize_pem()).expect("write key");
    files
}

fn perch_sql(url: &str, ca: Option<&Path>, sql: &str) -> (bool, String) {
    let mut cmd = common::client();
    cmd.args(["sql", sql]).env("PERCH_SERVER", url);
    if let Some(ca) = ca {
        cmd.env("PERCH_CA_FILE", ca);
    }
    let out = cmd.output().expect("perch sql");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn both_listeners_speak_tls_and_a_renewed_certificate_is_served_after_sighup() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = pki(dir.path(), "first");
    let second = pki(dir.path(), "second");
    // The server reads the certificate from these paths; renewal replaces the files.
    let (cert, key) = (dir.path().join("server.pem"), dir.path().join("server.key"));
    std::fs::copy(&first.cert, &cert).expect("copy");
    std::fs::copy(&first.key, &key).expect("copy");
    let config = dir.path().join("perch.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\ntls_cert = \"{}\"\ntls_key = \"{}\"\npg_listen = \"127.0.0.1:0\"\n",
            cert.display(),
            key.display()
        ),
    )
    .expect("config");
    let ca_pem = std::fs::read_to_string(&first.ca).expect("CA");
    let server = Perch::start_tls(
        &dir.path().join("server"),
        &["server", "--config", config.to_str().expect("utf-8")],
        &ca_pem,
    );
    assert!(server.url.starts_with("https://"), "{}", server.url);

    // The CLI over TLS, trusting the CA.
    let (ok, out) = perch_sql(&server.url, Some(&first.ca), "SELECT 40 + 2 AS answer");
    assert!(ok && out.contains("42"), "{out}");
    // Without the CA the certificate is refused, and nothing is sent.
    let (ok, out) = perch_sql(&server.url, None, "SELECT 1");
    assert!(!ok, "{out}");
    // Plain HTTP to the TLS port gets no answer.
    let plain = server.url.replacen("https://", "http://", 1);
    let (ok, out) = perch_sql(&plain, None, "SELECT 1");
    assert!(!ok, "{out}");

    // An agent sends its telemetry over TLS.
    let _agent = Agent::start_with_env(
        &server.url,
        "gpu-a",
        &dir.path().join("agent"),
        1,
        None,
        &["--interval-ms", "200"],
        &[("PERCH_CA_FILE", first.ca.to_str().expect("utf-8"))],
    );
    wait_for("the agent's samples over TLS", || {
        let (ok, out) = perch_sql(
            &server.url,
            Some(&first.ca),
            "SELECT count(*) AS n FROM gpu_samples WHERE node = 'gpu-a'",
        );
        (ok && !out.contains(" 0\n") && out.contains('1')).then_some(())
    });

    // A client that opens a connection and never finishes the handshake holds up no one.
    let addr = server.url.trim_start_matches("https://").to_owned();
    let mut stalled = std::net::TcpStream::connect(&addr).expect("connect");
    stalled
        .write_all(&[0x16, 0x03, 0x01])
        .expect("a third of a record");
    let started = Instant::now();
    let (ok, out) = perch_sql(&server.url, Some(&first.ca), "SELECT 1");
    assert!(ok, "{out}");
    assert!(started.elapsed() < Duration::from_secs(5));

    // psql with sslmode=verify-full: the PostgreSQL listener speaks TLS with the same
    // certificate.
    let pg_addr = wait_for("pg.addr", || {
        std::fs::read_to_string(server.data_dir.join("pg.addr")).ok()
    });
    let port = pg_addr.trim().rsplit(':').next().expect("port").to_owned();
    let psql = |ca: &Path| {
        Command::new("psql")
            .args([
                &format!(
                    "host=127.0.0.1 port={port} user=alice dbname=perch sslmode=verify-full sslrootcert={}",
                    ca.display()
                ),
                "-XAtc",
                "SELECT 6 * 7",
            ])
            .output()
            .expect("psql")
    };
    // A client that does not ask for TLS is refused before it can send a password in clear.
    let plain = Command::new("psql")
        .args([
            &format!("host=127.0.0.1 port={port} user=alice dbname=perch sslmode=disable"),
            "-XAtc",
            "SELECT 1",
        ])
        .output()
        .expect("psql");
    let err = String::from_utf8_lossy(&plain.stderr);
    assert!(
        !plain.status.success() && err.contains("accepts TLS connections only"),
        "{err}"
    );
    let out = psql(&first.ca);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "42",
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // Renewal: new files, then SIGHUP. New connections get the new certificate.
    std::fs::copy(&second.cert, &cert).expect("copy");
    std::fs::copy(&second.key, &key).expect("copy");
    let hangup = || {
        assert!(
            Command::new("kill")
                .args(["-HUP", &server.child.id().to_string()])
                .status()
                .expect("kill")
                .success()
        );
    };
    hangup();
    wait_for("the renewed certificate served", || {
        perch_sql(&server.url, Some(&second.ca), "SELECT 1")
            .0
            .then_some(())
    });
    assert!(!perch_sql(&server.url, Some(&first.ca), "SELECT 1").0);
    assert!(psql(&second.ca).status.success());
    // A broken renewal (a key that is not the certificate's) changes nothing.
    std::fs::copy(&first.key, &key).expect("copy");
    hangup();
    std::thread::sleep(Duration::from_millis(500));
    assert!(perch_sql(&server.url, Some(&second.ca), "SELECT 1").0);
    assert!(
        server
            .log()
            .contains("the TLS certificate was not read again")
    );
    let mut buf = [0u8; 1];
    stalled
        .set_read_timeout(Some(Duration::from_millis(100)))
        .expect("timeout");
    let _ = stalled.read(&mut buf);
}

#[test]
fn bad_tls_settings_are_refused_at_startup_naming_the_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = pki(dir.path(), "a");
    let b = pki(dir.path(), "b");
    for (settings, want) in [
        (
            format!("tls_cert = \"{}\"", a.cert.display()),
            "server.tls_cert is set without server.tls_key",
        ),
        (
            format!(
                "tls_cert = \"{}\"\ntls_key = \"{}\"",
                a.cert.display(),
                b.key.display()
            ),
            "is not the key of server.tls_cert",
        ),
        (
            format!(
                "tls_cert = \"{}\"\ntls_key = \"{}\"",
                a.key.display(),
                a.key.display()
            ),
            "no PEM certificate",
        ),
    ] {
        let config = dir.path().join("perch.toml");
        std::fs::write(&config, format!("[server]\n{settings}\n")).expect("config");
        let out = common::client()
            .args(["server", "--config", config.to_str().expect("utf-8")])
            .args(["--listen", "127.0.0.1:0", "--data-dir"])
            .arg(dir.path().join("data"))
            .output()
            .expect("perch server");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{settings}: {err}"
        );
    }
}

/// `perch up` with TLS made its own agent speak HTTPS without trusting anything, so
/// no telemetry arrived until an operator also set `agent.ca_file`. With a self-signed
/// certificate and nothing else, the built-in agent trusts the server's own certificate.
#[test]
fn up_with_a_self_signed_certificate_needs_no_ca_file() {
    use rcgen::{CertificateParams, KeyPair};
    let dir = tempfile::tempdir().expect("tempdir");
    let key = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
        .expect("params")
        .self_signed(&key)
        .expect("self-signed");
    let (cert_file, key_file) = (dir.path().join("self.pem"), dir.path().join("self.key"));
    std::fs::write(&cert_file, cert.pem()).expect("cert");
    std::fs::write(&key_file, key.serialize_pem()).expect("key");
    let config = dir.path().join("perch.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\npg_listen = \"\"\ntls_cert = \"{}\"\ntls_key = \"{}\"\n",
            cert_file.display(),
            key_file.display()
        ),
    )
    .expect("config");
    let perch = Perch::start_tls(
        &dir.path().join("up"),
        &[
            "up",
            "--config",
            config.to_str().expect("utf-8"),
            "--simulate-gpus",
            "2",
            "--interval-ms",
            "200",
        ],
        &cert.pem(),
    );
    wait_for("the built-in agent's samples over TLS", || {
        let (ok, out) = perch_sql(
            &perch.url,
            Some(&cert_file),
            "SELECT count(*) > 0 AS arrived FROM gpu_samples",
        );
        (ok && out.contains("true")).then_some(())
    });
}
