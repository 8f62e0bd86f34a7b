//! Loss-free delivery across a server outage: a real agent samples at 10 Hz while the server is
//! stopped for 60 s; after the server returns, every round the agent took is in the store
//! exactly once (one simulated GPU row and one host row per sample time), matching the round
//! count the agent reports when it stops.

mod common;

use common::{PATIENCE, Perch, wait_for};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const NODE: &str = "outage-agent";
const OUTAGE: Duration = Duration::from_secs(60);

/// The number after `key: ` in the agent's final stats line.
fn stat(log: &str, key: &str) -> u64 {
    let line = log
        .lines()
        .rev()
        .find(|l| l.contains("agent stopped") && l.contains(key))
        .unwrap_or_else(|| panic!("no final stats in the agent log:\n{log}"));
    let at = line.find(&format!("{key}: ")).expect("key") + key.len() + 2;
    line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap_or_else(|_| panic!("no number for {key} in {line}"))
}

#[test]
fn a_minute_long_outage_loses_and_duplicates_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let listen = format!("127.0.0.1:{port}");
    let server_args = ["server", "--listen", &listen, "--flush-interval-secs", "5"];
    let mut server = Perch::start(dir.path(), &server_args);

    let agent_dir = tempfile::tempdir().expect("tempdir");
    let agent_log = agent_dir.path().join("agent.log");
    let log_file = std::fs::File::create(&agent_log).expect("log");
    let mut agent = Command::new(common::PERCH)
        .args(["agent", "--server", &server.url, "--node", NODE])
        .args([
            "--interval-ms",
            "100",
            "--nvml",
            "off",
            "--simulate-gpus",
            "1",
        ])
        .arg("--data-dir")
        .arg(agent_dir.path())
        .env("PERCH_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(log_file)
        .spawn()
        .expect("spawn agent");
    let count = format!("SELECT count(*) FROM gpu_samples WHERE node = '{NODE}'");
    wait_for("the agent's first samples", || {
        (server.scalar(&count) > 10).then_some(())
    });

    server.terminate();
    let down = Instant::now();
    while down.elapsed() < OUTAGE {
        assert!(
            agent.try_wait().expect("agent status").is_none(),
            "the agent exited during the outage"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let server = Perch::start(dir.path(), &server_args);
    let back_ms = common::now_ms();
    // The queue is delivered in order, so a sample taken after the restart arriving means the
    // backlog has arrived too.
    let newer = format!(
        "SELECT count(*) FROM gpu_samples WHERE node = '{NODE}' AND CAST(time AS BIGINT) > {back_ms}"
    );
    wait_for("samples taken after the restart", || {
        (server.scalar(&newer) > 0).then_some(())
    });

    let pid = agent.id().to_string();
    Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("SIGTERM");
    let start = Instant::now();
    while agent.try_wait().expect("agent status").is_none() {
        assert!(start.elapsed() < PATIENCE, "the agent did not stop");
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = std::fs::read_to_string(&agent_log).expect("agent log");
    let rounds = stat(&log, "rounds_sampled");
    assert_eq!(stat(&log, "batches_dropped"), 0, "{log}");
    assert_eq!(stat(&log, "batches_rejected"), 0, "{log}");
    assert!(
        rounds >= 600,
        "10 Hz over a 60 s outage is at least 600 rounds, the agent took {rounds}"
    );

    let rows = |table: &str| {
        server.sql(&format!(
            "SELECT count(*) AS n, count(DISTINCT time) AS times FROM {table} WHERE node = '{NODE}'"
        ))
    };
    for table in ["gpu_samples", "host_samples"] {
        let r = rows(table);
        let (n, times) = (r[0]["n"].as_u64(), r[0]["times"].as_u64());
        assert_eq!(
            (n, times),
            (Some(rounds), Some(rounds)),
            "{table}: every round exactly once"
        );
    }
}
