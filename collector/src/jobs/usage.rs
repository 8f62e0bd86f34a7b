//! Reading one job's resource use: from its cgroup (v2 `cpu.stat`, `memory.current`,
//! `memory.peak`, `pids.current`; v1 `cpuacct.usage`, `memory.usage_in_bytes`,
//! `memory.max_usage_in_bytes`, `pids.current`) or, for a job known only by its root PID, by
//! summing its process tree in `/proc`. Parsers are pure; readers take an injectable root.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What one read found; absent values could not be read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    pub source: &'static str,
    pub cpu_seconds: Option<f64>,
    pub memory_bytes: Option<u64>,
    pub memory_peak_bytes: Option<u64>,
    pub processes: Option<u32>,
    /// The job's PIDs, for attributing GPU processes.
    pub pids: BTreeSet<u32>,
}

/// One process from `/proc/<pid>/stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: u32,
    pub ppid: u32,
    /// utime + stime + cutime + cstime, in clock ticks.
    pub cpu_ticks: u64,
    pub rss_pages: u64,
}

/// Parses `/proc/<pid>/stat`. The command name may hold spaces and parentheses, so fields are
/// counted from the last `)`.
pub fn parse_proc_stat(text: &str) -> Option<ProcStat> {
    let (head, tail) = text.rsplit_once(')')?;
    let pid = head.split_once('(')?.0.trim().parse().ok()?;
    let f: Vec<&str> = tail.split_ascii_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    Some(ProcStat {
        pid,
        ppid: f.get(1)?.parse().ok()?,
        cpu_ticks: num(11)? + num(12)? + num(13)? + num(14)?,
        rss_pages: num(21)?,
    })
}

/// Every process under `<root>/proc`.
pub fn read_processes(root: &Path) -> Vec<ProcStat> {
    std::fs::read_dir(root.join("proc"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|t| parse_proc_stat(&t))
        .collect()
}

/// Every process with its children indexed, built once per scan of `/proc` so that each job's
/// tree costs only its own size.
#[derive(Debug, Default)]
pub struct ProcessTable {
    procs: Vec<ProcStat>,
    index: HashMap<u32, usize>,
    children: HashMap<u32, Vec<usize>>,
}

impl ProcessTable {
    pub fn new(procs: Vec<ProcStat>) -> Self {
        let mut index = HashMap::with_capacity(procs.len());
        let mut children: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, p) in procs.iter().enumerate() {
            index.insert(p.pid, i);
            children.entry(p.ppid).or_default().push(i);
        }
        ProcessTable {
            procs,
            index,
            children,
        }
    }

    /// The processes, as read.
    pub fn processes(&self) -> &[ProcStat] {
        &self.procs
    }
}

/// How old a scan of `/proc` [`shared_processes`] hands out again.
pub const SHARED_SCAN_MAX_AGE: Duration = Duration::from_millis(250);

/// One scan of `/proc`, numbered.
type Scan = (Instant, u64, Arc<ProcessTable>);

/// The processes under `<root>/proc`, from a scan made for someone else in this process less
/// than [`SHARED_SCAN_MAX_AGE`] ago, or a fresh one. `seen` is the number of the scan the
/// caller got last time: a caller never gets the same scan twice, so one agent always sees
/// the processes as they are at each sample, however short its interval. What is shared is
/// `perch demo`'s thousand agents in one process, which would otherwise each read every
/// `/proc/<pid>/stat` of the machine every second (a thousand times ten thousand reads) and
/// starve the server beside them.
pub fn shared_processes(root: &Path, seen: &mut u64) -> Arc<ProcessTable> {
    static LAST: Mutex<BTreeMap<PathBuf, Scan>> = Mutex::new(BTreeMap::new());
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((at, id, table)) = last.get(root)
        && *id != *seen
        && at.elapsed() < SHARED_SCAN_MAX_AGE
    {
        *seen = *id;
        return table.clone();
    }
    // Scanned under the lock: agents asking meanwhile wait for this scan instead of making
    // their own.
    let id = last.get(root).map_or(1, |(_, id, _)| id + 1);
    let table = Arc::new(ProcessTable::new(read_processes(root)));
    last.insert(root.to_path_buf(), (Instant::now(), id, table.clone()));
    *seen = id;
    table
}

/// The process tree rooted at `pid`: CPU and resident memory summed, PIDs listed. `None` when
/// the root process is gone.
pub fn tree_usage(table: &ProcessTable, pid: u32, tick_hz: f64, page: u64) -> Option<Usage> {
    let root = *table.index.get(&pid)?;
    let mut members = vec![root];
    let mut pids = BTreeSet::from([pid]);
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        for &c in table.children.get(&p).into_iter().flatten() {
            let child = table.procs[c].pid;
            if pids.insert(child) {
                members.push(c);
                todo.push(child);
            }
        }
    }
    let (ticks, pages) = members.iter().fold((0u64, 0u64), |(t, r), &i| {
        (t + table.procs[i].cpu_ticks, r + table.procs[i].rss_pages)
    });
    Some(Usage {
        source: "proc",
        cpu_seconds: Some(ticks as f64 / tick_hz),
        memory_bytes: Some(pages * page),
        memory_peak_bytes: None,
        processes: Some(pids.len() as u32),
        pids,
    })
}

/// Reads a key from a `key value` file such as `cpu.stat`.
pub fn parse_keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// PIDs listed in `cgroup.procs` (or v1 `tasks`) of `dir` and its descendants.
fn cgroup_pids(dir: &Path, file: &str, out: &mut BTreeSet<u32>) {
    if let Ok(text) = std::fs::read_to_string(dir.join(file)) {
        out.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
    }
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            cgroup_pids(&e.path(), file, out);
        }
    }
}

/// A job's cgroup, `path` as `/proc/<pid>/cgroup` names it (e.g. `/perch/job-1`), under
/// `<root>/sys/fs/cgroup`: the unified (v2) hierarchy when the directory has `cpu.stat`, else
/// the v1 `cpuacct`, `memory` and `pids` hierarchies. `None` when neither exists.
pub fn cgroup_usage(root: &Path, path: &Path) -> Option<Usage> {
    let base = root.join("sys/fs/cgroup");
    let rel = path.strip_prefix("/").unwrap_or(path);
    let v2 = base.join(rel);
    if let Ok(stat) = std::fs::read_to_string(v2.join("cpu.stat")) {
        let mut pids = BTreeSet::new();
        cgroup_pids(&v2, "cgroup.procs", &mut pids);
        return Some(Usage {
            source: "cgroup_v2",
            cpu_seconds: parse_keyed(&stat, "usage_usec").map(|us| us as f64 / 1e6),
            memory_bytes: read_u64(&v2.join("memory.current")),
            memory_peak_bytes: read_u64(&v2.join("memory.peak")),
            processes: read_u64(&v2.join("pids.current")).map(|n| n as u32),
            pids,
        });
    }
    let (cpu, mem, pid_dir) = (
        base.join("cpuacct").join(rel),
        base.join("memory").join(rel),
        base.join("pids").join(rel),
    );
    if !cpu.is_dir() && !mem.is_dir() {
        return None;
    }
    let mut pids = BTreeSet::new();
    cgroup_pids(&cpu, "cgroup.procs", &mut pids);
    Some(Usage {
        source: "cgroup_v1",
        cpu_seconds: read_u64(&cpu.join("cpuacct.usage")).map(|ns| ns as f64 / 1e9),
        memory_bytes: read_u64(&mem.join("memory.usage_in_bytes")),
        memory_peak_bytes: read_u64(&mem.join("memory.max_usage_in_bytes")),
        processes: read_u64(&pid_dir.join("pids.current"))
            .map(|n| n as u32)
            .or(Some(pids.len() as u32)),
        pids,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_with_awkward_names() {
        let line = "4242 (python3 (worker) x) S 4000 4242 4000 0 -1 4194560 100 0 0 0 250 50 7 3 20 0 4 0 100 123456789 2048 18446744073709551615";
        assert_eq!(
            parse_proc_stat(line),
            Some(ProcStat {
                pid: 4242,
                ppid: 4000,
                cpu_ticks: 310,
                rss_pages: 2048
            })
        );
        assert_eq!(parse_proc_stat("garbage"), None);
    }

    #[test]
    fn tree_sums_descendants_only() {
        let p = |pid, ppid, cpu_ticks, rss_pages| ProcStat {
            pid,
            ppid,
            cpu_ticks,
            rss_pages,
        };
        let procs = [
            p(1, 0, 1000, 10),
            p(10, 1, 100, 1),
            p(11, 10, 50, 2),
            p(12, 11, 25, 3),
            p(20, 1, 999, 99),
        ];
        let procs = ProcessTable::new(procs.to_vec());
        let u = tree_usage(&procs, 10, 100.0, 4096).expect("root exists");
        assert_eq!(u.cpu_seconds, Some(1.75));
        assert_eq!(u.memory_bytes, Some(6 * 4096));
        assert_eq!(u.processes, Some(3));
        assert_eq!(u.pids, BTreeSet::from([10, 11, 12]));
        assert_eq!(tree_usage(&procs, 99, 100.0, 4096), None);
    }

    /// Agents in one process (`perch demo`) share a fresh scan; the same agent never gets the
    /// same scan twice, and nobody gets a stale one.
    #[test]
    fn a_scan_of_proc_is_shared_while_fresh_but_never_twice_with_one_caller() {
        // A /proc of its own, so no other test's scans mix in.
        let dir = tempfile::tempdir().expect("tempdir");
        let stat = |pid: u32, ppid: u32| {
            let d = dir.path().join(format!("proc/{pid}"));
            std::fs::create_dir_all(&d).expect("dir");
            let line = format!("{pid} (x) S {ppid} 0 0 0 0 0 0 0 0 0 5 5 0 0 0 0 1 0 0 0 7 0");
            std::fs::write(d.join("stat"), line).expect("stat");
        };
        stat(10, 1);
        let root = dir.path();
        let (mut first, mut second) = (0, 0);
        let a = shared_processes(root, &mut first);
        let b = shared_processes(root, &mut second);
        assert!(Arc::ptr_eq(&a, &b), "two agents at once: one scan");
        stat(11, 10);
        let again = shared_processes(root, &mut first);
        assert!(!Arc::ptr_eq(&a, &again), "the same agent again: a new scan");
        assert_eq!(
            tree_usage(&a, 10, 100.0, 4096).and_then(|u| u.processes),
            Some(1)
        );
        assert_eq!(
            tree_usage(&again, 10, 100.0, 4096).and_then(|u| u.processes),
            Some(2)
        );
        std::thread::sleep(SHARED_SCAN_MAX_AGE + Duration::from_millis(50));
        let mut third = 0;
        assert!(
            !Arc::ptr_eq(&again, &shared_processes(root, &mut third)),
            "stale: scanned again"
        );
    }

    /// (source, CPU seconds, memory, peak, processes, PIDs)
    type Row<'a> = (&'a str, f64, u64, u64, u32, Vec<u32>);

    #[test]
    fn cgroup_fixtures_v2_and_v1() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/node1");
        let check = |path: &str, want: Option<Row>| {
            let got = cgroup_usage(&root, Path::new(path)).map(|u| {
                (
                    u.source,
                    u.cpu_seconds.unwrap_or(-1.0),
                    u.memory_bytes.unwrap_or(0),
                    u.memory_peak_bytes.unwrap_or(0),
                    u.processes.unwrap_or(0),
                    u.pids.into_iter().collect::<Vec<_>>(),
                )
            });
            assert_eq!(got, want, "{path}");
        };
        check(
            "/perch/job-7",
            Some((
                "cgroup_v2",
                12.5,
                1_048_576,
                4_194_304,
                3,
                vec![501, 502, 503],
            )),
        );
        check(
            "/slurm/job_9",
            Some(("cgroup_v1", 2.0, 2048, 8192, 2, vec![601, 602])),
        );
        check("/nope", None);
    }
}
