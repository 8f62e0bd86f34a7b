//! Issue 16: idle half-open connections stayed open forever; at 20,000 of them the server ran
//! out of descriptors and stopped answering. Here a few hundred connections that send nothing
//! neither slow SQL and agent syncs nor outlive `server.idle_timeout_secs`.

mod common;

use common::{Agent, wait_for};
use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

#[test]
fn half_open_connections_neither_starve_the_server_nor_stay_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_config(
        dir.path(),
        "[server]\npg_listen = \"\"\nidle_timeout_secs = 3\nmax_connections_per_ip = 1000\n[query]\ntimeout_secs = 2\n",
        &[],
    );
    let _agent = Agent::start(
        &perch.url,
        "gpu-a",
        &dir.path().join("agent"),
        1,
        None,
        &["--interval-ms", "200"],
    );
    wait_for("the node up", || {
        (perch.get("/v1/nodes")["nodes"][0]["state"] == "up").then_some(())
    });
    let addr = perch.url.trim_start_matches("http://").to_owned();
    let idle: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(&addr).expect("connect"))
        .collect();
    let opened = Instant::now();
    // SQL answers at once, again and again, while they sit there.
    for _ in 0..5 {
        let started = Instant::now();
        let rows = perch.sql("SELECT count(*) AS n FROM gpu_samples");
        assert!(!rows.is_empty());
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "SQL took {:?}",
            started.elapsed()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    // The server closes every one of them after the idle timeout.
    for mut c in idle {
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut buf = [0u8; 16];
        match c.read(&mut buf) {
            Ok(0) => {}
            Ok(n) => panic!("the server sent {n} bytes to a silent client"),
            Err(e) => assert!(
                e.kind() == std::io::ErrorKind::ConnectionReset,
                "not closed by the server: {e}"
            ),
        }
    }
    let closed_after = opened.elapsed();
    assert!(
        closed_after >= Duration::from_secs(3) && closed_after < Duration::from_secs(10),
        "closed after {closed_after:?}"
    );
    // The agent's syncs went on: the node never went down.
    assert_eq!(perch.get("/v1/nodes")["nodes"][0]["state"], "up");
}
