//! Issue 16: a full disk must not lose acknowledged telemetry, and perch must recover by itself
//! once there is room again. The server's data directory is a small tmpfs (a real filesystem
//! that fills up); the test fills it while an agent streams samples, then frees it.

mod common;

use common::{Agent, wait_for};
use std::process::Command;
use std::time::Duration;

/// Unmounts the tmpfs however the test ends.
struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_loses_no_acknowledged_sample_and_perch_recovers_by_itself() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("server");
    std::fs::create_dir_all(&data).expect("mkdir");
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=24m", "tmpfs"])
        .arg(&data)
        .status()
        .expect("mount");
    assert!(
        mounted.success(),
        "mounting a tmpfs needs root (CI runs as root)"
    );
    let _mount = Mount(data.clone());
    let mut perch = common::server_with_config(
        dir.path(),
        "[server]\npg_listen = \"\"\nflush_interval_secs = 2\n[alerts]\nevaluation_interval = \"2s\"\n",
        &[],
    );
    let _agent = Agent::start(
        &perch.url,
        "gpu-a",
        &dir.path().join("agent"),
        2,
        None,
        &["--interval-ms", "200"],
    );
    let count = |perch: &common::Perch, from: i64, to: i64| {
        perch.scalar(&format!(
            "SELECT count(*) FROM gpu_samples WHERE node = 'gpu-a' \
             AND to_unixtime(time) * 1000 >= {from} AND to_unixtime(time) * 1000 < {to}"
        ))
    };
    wait_for("samples before the disk fills", || {
        (count(&perch, 0, i64::MAX / 2) > 20).then_some(())
    });

    // Fill the disk to the last byte.
    let full_from = common::now_ms();
    let filler = data.join("filler");
    let written = Command::new("dd")
        .args(["if=/dev/zero", "bs=64k"])
        .arg(format!("of={}", filler.display()))
        .output()
        .expect("dd");
    assert!(
        String::from_utf8_lossy(&written.stderr).contains("No space left"),
        "{}",
        String::from_utf8_lossy(&written.stderr)
    );
    // Ingest is refused (the write-ahead log cannot grow), flushes fail, and perch says so.
    wait_for("StoreFlushFailing firing", || {
        let alerts = perch.get("/v1/alerts");
        alerts["alerts"]
            .as_array()?
            .iter()
            .any(|a| a["labels"]["alertname"] == "StoreFlushFailing" && a["state"] == "firing")
            .then_some(())
    });
    let before = count(&perch, 0, i64::MAX / 2);
    std::thread::sleep(Duration::from_secs(2));
    let full_to = common::now_ms();

    // Room again: nothing to do but wait.
    std::fs::remove_file(&filler).expect("free the disk");
    wait_for("the samples taken while the disk was full", || {
        (count(&perch, full_from + 1000, full_to) > 0).then_some(())
    });
    wait_for("flushes working again", || {
        let metrics = reqwest::blocking::get(format!("{}/metrics", perch.url))
            .ok()?
            .text()
            .ok()?;
        metrics
            .lines()
            .filter(|l| l.starts_with("perch_store_flush_failures_in_a_row"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .any(|v| v == 0.0)
            .then_some(())
    });
    let after = count(&perch, 0, i64::MAX / 2);
    assert!(after > before, "{after} <= {before}");

    // Every acknowledged sample is still there after a kill -9.
    let acknowledged = count(&perch, 0, full_to);
    perch.kill();
    let perch = common::server_with_config(
        dir.path(),
        "[server]\npg_listen = \"\"\nflush_interval_secs = 2\n",
        &[],
    );
    assert!(count(&perch, 0, full_to) >= acknowledged);
}
