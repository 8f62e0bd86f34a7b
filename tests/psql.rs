//! SQL over the PostgreSQL protocol with the real `psql`: perch up with simulated GPUs, a
//! count over `gpu_samples` that matches HTTP SQL, typed columns, and DDL and DML refused
//! with the same read-only message as `POST /v1/sql`. Then psycopg (Python), which uses the
//! extended protocol (Parse, Describe, Bind, Execute), binary results and `BEGIN` like many
//! drivers and Grafana's pgx-based data source do.

mod common;

use common::{Perch, wait_for};
use std::process::{Command, Output};

/// Runs `psql -c <sql>` against perch's PostgreSQL listener, unaligned and tuples only.
fn psql(addr: &str, sql: &str) -> Output {
    let (host, port) = addr.rsplit_once(':').expect("host:port");
    Command::new("psql")
        .args(["-h", host, "-p", port, "-U", "perch", "-d", "perch"])
        .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .env("PGCONNECT_TIMEOUT", "10")
        .env_remove("PGPASSWORD")
        .output()
        .expect("run psql (Debian package postgresql-client)")
}

/// Extended protocol, binary and text results, an implicit transaction, a prepared statement
/// and a refused write, through psycopg 3. Prints one line per check.
const PSYCOPG: &str = r#"
import sys, psycopg
host, port = sys.argv[1].rsplit(":", 1)
with psycopg.connect(host=host, port=int(port), user="grafana", dbname="perch", sslmode="disable") as conn:
    row = conn.execute("SELECT count(*) AS n, max(time) AS t FROM gpu_samples").fetchone()
    print("count", row[0] > 0, row[1].tzinfo is not None)
    cur = conn.cursor(binary=True)
    row = cur.execute("SELECT gpu, simulated, utilization_gpu_pct FROM gpu_samples LIMIT 1").fetchone()
    print("binary", row[0], row[1], isinstance(row[2], float))
    print("prepared", conn.execute("SELECT 40 + 2", prepare=True).fetchone()[0])
    conn.execute("-- ping")
    conn.commit()
    try:
        conn.execute("CREATE TABLE x (a INT)")
        print("write accepted")
    except psycopg.Error as e:
        print("refused", "read-only" in str(e))
"#;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim().to_owned()
}

#[test]
fn psql_queries_and_cannot_write() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("perch.toml");
    std::fs::write(&config, "[server]\npg_listen = \"127.0.0.1:0\"\n").expect("write config");
    let data = dir.path().join("data");
    let config = config.to_string_lossy().into_owned();
    let perch = Perch::start(
        &data,
        &[
            "up",
            "--config",
            &config,
            "--simulate-gpus",
            "1",
            "--interval-ms",
            "100",
        ],
    );
    let addr = wait_for("pg.addr", || {
        std::fs::read_to_string(data.join("pg.addr"))
            .ok()
            .filter(|s| s.ends_with('\n'))
    });
    let addr = addr.trim();
    wait_for("a few GPU samples", || {
        (perch.scalar("SELECT count(*) FROM gpu_samples") >= 3).then_some(())
    });

    // Telemetry only grows, so the count psql sees lies between two HTTP counts.
    let before = perch.scalar("SELECT count(*) FROM gpu_samples");
    let out = psql(addr, "SELECT count(*) FROM gpu_samples");
    let after = perch.scalar("SELECT count(*) FROM gpu_samples");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let count: i64 = text(&out.stdout).parse().expect("a number");
    assert!(
        (before..=after).contains(&count),
        "{before} <= {count} <= {after}"
    );

    let out = psql(
        addr,
        "SELECT gpu, simulated, utilization_gpu_pct >= 0, time > now() - INTERVAL '1 hour' \
         FROM gpu_samples ORDER BY time DESC LIMIT 1",
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "0|t|t|t");

    for sql in [
        "CREATE TABLE x (a INT)",
        "INSERT INTO gpu_samples (node) VALUES ('n')",
    ] {
        let out = psql(addr, sql);
        assert!(!out.status.success(), "{sql} was accepted");
        let err = text(&out.stderr);
        assert!(err.contains("perch's SQL is read-only"), "{sql}: {err}");
    }

    // Each -c is its own query: a transaction around a query, as drivers send it.
    let (host, port) = addr.rsplit_once(':').expect("host:port");
    let out = Command::new("psql")
        .args(["-h", host, "-p", port, "-U", "perch", "-X", "-A", "-t"])
        .args([
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            "BEGIN",
            "-c",
            "SELECT 1 + 1",
            "-c",
            "COMMIT",
        ])
        .output()
        .expect("run psql");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "BEGIN\n2\nCOMMIT");

    let out = Command::new("python3")
        .args(["-c", PSYCOPG, addr])
        .output()
        .expect("run python3");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "count True True\nbinary 0 True True\nprepared 42\nrefused True"
    );

    let out = psql(addr, "SELECT * FROM no_such_table");
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("gpu_samples"),
        "the error lists the tables: {}",
        text(&out.stderr)
    );
}
