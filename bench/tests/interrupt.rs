//! `perch bench web` stopped part way (Ctrl-C, SIGTERM) stops what it started: its `perch
//! demo`, chromedriver and the Chromium chromedriver started, and removes the demo's data.
//! Before, a signal ended the benchmark alone and left all three running.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Each process under `root` (children, their children...), with its command name.
fn descendants(root: u32) -> Vec<(u32, String)> {
    let mut parent_of = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let comm = head.split_once('(').map_or("", |(_, c)| c).to_owned();
        let ppid = rest
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parent_of.push((pid, ppid, comm));
        }
    }
    let mut found: Vec<(u32, String)> = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for (pid, ppid, comm) in &parent_of {
            if *ppid == p && !found.iter().any(|(f, _)| f == pid) {
                found.push((*pid, comm.clone()));
                frontier.push(*pid);
            }
        }
    }
    found
}

/// Whether `pid` is still the process `comm` and not a zombie.
fn alive(pid: u32, comm: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(head, rest)| head.ends_with(comm) && !rest.trim_start().starts_with('Z'))
    })
}

fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn sigterm_stops_the_demo_chromedriver_and_chromium() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut bench = Command::new(env!("CARGO_BIN_EXE_perch-bench"))
        .args([
            "web",
            "--nodes",
            "2",
            "--gpus-per-node",
            "1",
            "--loads",
            "1",
        ])
        .args(["--minutes", "30", "--dir"])
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run perch-bench web");
    // The first render is timed once the demo and the browser both run.
    let stdout = bench.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    loop {
        let line = lines
            .next()
            .expect("perch-bench web ended before its first render")
            .expect("read its output");
        if line.contains("first full render of the fleet view") {
            break;
        }
    }
    let started = descendants(bench.id());
    for name in ["perch", "chromedriver", "chromium"] {
        assert!(
            started.iter().any(|(_, comm)| comm.starts_with(name)),
            "no {name} among {started:?}"
        );
    }
    let status = Command::new("kill")
        .args(["-TERM", &bench.id().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(status.success());
    let mut exit = None;
    wait_until("perch-bench web to exit", Duration::from_secs(90), || {
        exit = bench.try_wait().expect("wait");
        exit.is_some()
    });
    assert_eq!(
        exit.and_then(|e| e.code()),
        Some(143),
        "it exits as SIGTERM would"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut left = started.clone();
    while !left.is_empty() && Instant::now() < deadline {
        left.retain(|(pid, comm)| alive(*pid, comm));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(left.is_empty(), "still running after it exited: {left:?}");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("read dir")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "the demo's data is removed: {left:?}");
}
