//! Host parsers on fixture text, and the reader on the fixture tree in `tests/fixtures/node1`.

use super::*;

const STAT: &str = "cpu  200 100 50 1000 10 0 5 2 0 0\ncpu0 100 50 25 500 5 0 3 1 0 0\ncpu1 100 50 25 500 5 0 2 1 0 0\nintr 1 2\n";

fn check_stat(text: &str, expected: std::result::Result<ProcStat, &str>) {
    match (parse_proc_stat(text, 100), expected) {
        (Ok(got), Ok(want)) => assert_eq!(got, want, "{text:?}"),
        (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{e} lacks {want:?}"),
        (got, want) => panic!("{text:?}: got {got:?}, want {want:?}"),
    }
}

#[test]
fn proc_stat() {
    let full = CpuTimes {
        user: 2.0,
        nice: 1.0,
        system: 0.5,
        idle: 10.0,
        iowait: Some(0.1),
        irq: Some(0.0),
        softirq: Some(0.05),
        steal: Some(0.02),
    };
    check_stat(
        STAT,
        Ok(ProcStat {
            cpu: full,
            cpu_count: 2,
        }),
    );
    // An old kernel with only the first four modes: the others are absent, not zero.
    let old = CpuTimes {
        user: 1.0,
        nice: 0.0,
        system: 2.0,
        idle: 3.0,
        ..CpuTimes::default()
    };
    check_stat(
        "cpu 100 0 200 300\ncpu0 100 0 200 300\n",
        Ok(ProcStat {
            cpu: old,
            cpu_count: 1,
        }),
    );
    check_stat("cpu0 1 2 3 4\n", Err("no aggregate `cpu` line"));
    check_stat("cpu 1 2\n", Err("expected at least 4"));
    check_stat("cpu 1 x 3 4\n", Err("invalid digit"));
    check_stat("", Err("no aggregate"));
}

fn check_mem(text: &str, expected: Option<MemInfo>) {
    assert_eq!(parse_meminfo(text).ok(), expected, "{text:?}");
}

#[test]
fn meminfo() {
    check_mem(
        "MemTotal: 1000 kB\nMemFree: 10 kB\nMemAvailable: 500 kB\n",
        Some(MemInfo {
            total_bytes: 1_024_000,
            available_bytes: Some(512_000),
        }),
    );
    check_mem(
        "MemTotal:  2 kB\n",
        Some(MemInfo {
            total_bytes: 2048,
            available_bytes: None,
        }),
    );
    check_mem("MemFree: 10 kB\n", None);
    check_mem("MemTotal: lots kB\n", None);
    check_mem("MemTotal: 1 MB\n", None);
}

#[test]
fn loadavg_and_uptime() {
    assert_eq!(
        parse_loadavg("0.52 0.58 0.59 1/389 12345\n").ok(),
        Some((0.52, 0.58, 0.59))
    );
    assert!(parse_loadavg("0.52 0.58").is_err());
    assert!(parse_loadavg("a b c").is_err());
    assert_eq!(parse_uptime("350735.47 234388.90\n").ok(), Some(350_735.47));
    assert!(parse_uptime("").is_err());
    assert!(parse_uptime("soon").is_err());
}

fn fixture_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/node1")
}

#[test]
fn reader_on_fixture_tree() {
    let data = tempfile::tempdir().expect("temp dir");
    let mut r = HostReader::new(fixture_root(), data.path()).with_ticks_per_second(100);
    let s = r.sample(1_800_000_000_000);
    assert_eq!(s.time_ms, 1_800_000_000_000);
    assert!(!s.simulated);
    assert_eq!(s.cpu_user_seconds, Some(101_321.53));
    assert_eq!(s.cpu_steal_seconds, Some(0.0));
    assert_eq!(s.cpu_count, Some(4));
    assert_eq!(s.memory_total_bytes, Some(16_314_104 * 1024));
    assert_eq!(s.memory_available_bytes, Some(8_123_456 * 1024));
    assert_eq!(
        (s.load1, s.load5, s.load15),
        (Some(0.52), Some(0.58), Some(0.59))
    );
    assert_eq!(s.uptime_seconds, Some(350_735.47));
    let (free, total) = (
        s.disk_free_bytes.expect("free"),
        s.disk_total_bytes.expect("total"),
    );
    assert!(total > 0 && free <= total, "free {free} total {total}");
}

#[test]
fn missing_files_leave_fields_absent() {
    let empty = tempfile::tempdir().expect("temp dir");
    let mut r = HostReader::new(empty.path(), empty.path().join("no-such-dir"));
    let s = r.sample(1_800_000_000_000);
    assert_eq!(s.cpu_user_seconds, None);
    assert_eq!(s.memory_total_bytes, None);
    assert_eq!(s.load1, None);
    assert_eq!(s.disk_free_bytes, None);
    assert_eq!(s.uptime_seconds, None);
    // A second sample does not warn again (it would only be noise) and still works.
    assert_eq!(r.sample(1_800_000_001_000).cpu_count, None);
}

#[test]
fn real_proc_parses_on_linux() {
    let mut r = HostReader::new("/", std::env::temp_dir());
    let s = r.sample(1_800_000_000_000);
    assert!(
        s.cpu_user_seconds.is_some() && s.memory_total_bytes.is_some(),
        "{s:?}"
    );
}
