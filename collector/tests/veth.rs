//! The NIC reader on real traffic: two network namespaces joined by a veth pair, UDP datagrams
//! sent from one to the other, and the counters read through the agent's `NicReader` from each
//! namespace's `/proc/<pid>/net/dev` (a process parked in the namespace lends its view).
//!
//! Needs root and `ip` (iproute2) and bash (for `/dev/udp`); `scripts/test.sh` installs
//! iproute2. It never skips: a missing tool fails the test with what to install.

use perch_collector::nic::NicReader;
use perch_model::NicSample;
use std::path::Path;
use std::process::{Child, Command};

const DATAGRAMS: u64 = 200;
const PAYLOAD: usize = 1000;

fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {args:?} ({e}); install iproute2 and bash"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two namespaces and a process parked in each; all removed when dropped.
struct Pair {
    names: [String; 2],
    parked: Vec<Child>,
}

impl Drop for Pair {
    fn drop(&mut self) {
        for c in &mut self.parked {
            let _ = c.kill();
            let _ = c.wait();
        }
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// The counters of `device` as seen from inside the namespace of process `pid`.
fn counters(pid: u32, device: &str) -> NicSample {
    let root = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(root.path().join("proc")).expect("mkdir");
    std::os::unix::fs::symlink(
        Path::new("/proc").join(pid.to_string()).join("net"),
        root.path().join("proc/net"),
    )
    .expect("symlink");
    NicReader::new(root.path())
        .sample(1_800_000_000_000)
        .into_iter()
        .find(|n| n.device == device)
        .unwrap_or_else(|| panic!("{device} not in the namespace's /proc/net/dev"))
}

#[test]
fn veth_traffic_shows_up_in_the_counters() {
    let tag = std::process::id();
    let (a, b) = (format!("perch-a-{tag}"), format!("perch-b-{tag}"));
    let (va, vb) = (format!("pa{tag}"), format!("pb{tag}"));
    // Interface names are at most 15 bytes.
    let (va, vb) = (&va[..va.len().min(15)], &vb[..vb.len().min(15)]);
    let mut pair = Pair {
        names: [a.clone(), b.clone()],
        parked: Vec::new(),
    };
    run(&["ip", "netns", "add", &a]);
    run(&["ip", "netns", "add", &b]);
    run(&[
        "ip", "link", "add", va, "netns", &a, "type", "veth", "peer", "name", vb, "netns", &b,
    ]);
    run(&["ip", "-n", &a, "addr", "add", "10.231.0.1/24", "dev", va]);
    run(&["ip", "-n", &b, "addr", "add", "10.231.0.2/24", "dev", vb]);
    for (ns, dev) in [(&a, va), (&b, vb)] {
        run(&["ip", "-n", ns, "link", "set", dev, "up"]);
        run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        pair.parked.push(
            Command::new("ip")
                .args(["netns", "exec", ns, "sleep", "600"])
                .spawn()
                .expect("park a process in the namespace"),
        );
    }
    let (pid_a, pid_b) = (pair.parked[0].id(), pair.parked[1].id());
    // `ip netns exec` enters the namespace before exec'ing sleep; wait (bounded) until it has.
    for pid in [pid_a, pid_b] {
        let mut ok = false;
        for _ in 0..2000 {
            let dev = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).unwrap_or_default();
            if dev.contains(va) || dev.contains(vb) {
                ok = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(ok, "process {pid} never entered its namespace");
    }
    let before_a = counters(pid_a, va);
    let before_b = counters(pid_b, vb);

    let payload = "x".repeat(PAYLOAD);
    let script = format!(
        "for i in $(seq {DATAGRAMS}); do printf %s {payload} > /dev/udp/10.231.0.2/9; done"
    );
    run(&["ip", "netns", "exec", &a, "bash", "-c", &script]);

    let after_a = counters(pid_a, va);
    let after_b = counters(pid_b, vb);
    let delta = |after: Option<u64>, before: Option<u64>| {
        after.expect("counter present") - before.expect("counter present")
    };
    // Each datagram is PAYLOAD bytes plus UDP, IP and Ethernet headers; ARP adds a little.
    let min_bytes = DATAGRAMS * PAYLOAD as u64;
    let sent = delta(after_a.tx_bytes, before_a.tx_bytes);
    let received = delta(after_b.rx_bytes, before_b.rx_bytes);
    assert!(
        sent >= min_bytes,
        "sent {sent} bytes, expected at least {min_bytes}"
    );
    assert!(
        received >= min_bytes,
        "received {received} bytes, expected at least {min_bytes}"
    );
    assert!(delta(after_b.rx_packets, before_b.rx_packets) >= DATAGRAMS);
    assert!(delta(after_a.tx_packets, before_a.tx_packets) >= DATAGRAMS);
    assert_eq!(after_b.rx_errors, before_b.rx_errors);
}
