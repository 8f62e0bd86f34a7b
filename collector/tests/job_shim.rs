//! Jobs under their real supervisor ([`shim`]), without cgroups: what a job leaves behind (a
//! chain of processes that each fork and exit at once, so that every one is an orphan) is gone
//! when the job is reported ended, whether it ended by itself or was cancelled.
//!
//! A test binary of its own (`harness = false`): started as `<this binary> __job-shim ...` it
//! is the supervisor, as the `perch` binary is for the agent.

use perch_collector::launcher::{Launcher, lease, shim};
use perch_model::control::{JobExit, JobLaunch, JobStop};
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const PATIENCE: Duration = Duration::from_secs(30);

/// Starts a copy of itself `$1` times, each in a session of its own (out of the job's process
/// group) and exiting at once; the last one writes its pid to `$2` and becomes `$3...`.
const CHAIN: &str = r#"n=$1; f=$2; shift 2
if [ "$n" -gt 0 ]; then setsid sh "$0" $((n - 1)) "$f" "$@" & exit 0; fi
echo $$ > "$f.tmp"; mv "$f.tmp" "$f"; exec "$@""#;

struct Node {
    dir: tempfile::TempDir,
    launcher: Launcher,
    /// Processes a test started, killed at the end whatever the test found.
    pids: Vec<i32>,
}

impl Node {
    fn new() -> Node {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut launcher = Launcher::new(&dir.path().join("jobs")).expect("launcher");
        launcher.set_supervisor(std::env::current_exe().expect("this test binary"));
        // No lease, and the supervisor stops its job at once.
        launcher.renew_lease(lease::boot_ms(), 600_000);
        std::fs::write(dir.path().join("chain.sh"), CHAIN).expect("chain.sh");
        Node {
            dir,
            launcher,
            pids: Vec::new(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `sh chain.sh <generations> <pid file> <command...>` as shell text.
    fn chain(&self, generations: u32, pid_file: &str, command: &str) -> String {
        format!(
            "sh {} {generations} {} {command}",
            self.path("chain.sh").display(),
            self.path(pid_file).display()
        )
    }

    fn launch(&mut self, job: u64, script: &str) {
        self.launcher.launch(&JobLaunch {
            job,
            attempt: 1,
            command: vec!["sh".into(), "-c".into(), script.into()],
            env: Default::default(),
            workdir: None,
            gpus: vec![0],
            user: "alice".into(),
            node_rank: 0,
            nodes: 1,
            time_limit_secs: 3600,
            checkpoint_signal: "SIGTERM".into(),
            grace_secs: 1,
            sim_profile: None,
            gpu_share: None,
            gpu_mig: None,
            cpus: None,
            memory_mb: None,
            pick_master_port: false,
            hosts: Vec::new(),
        });
    }

    /// The pid the chain wrote to `name`, once it did.
    fn pid(&mut self, name: &str) -> i32 {
        let path = self.path(name);
        let pid = until(&format!("a pid in {name}"), || {
            std::fs::read_to_string(&path).ok()?.trim().parse().ok()
        });
        self.pids.push(pid);
        pid
    }

    fn exit(&mut self, job: u64) -> JobExit {
        let launcher = &mut self.launcher;
        until(&format!("job {job} to be reported ended"), || {
            launcher.poll();
            launcher.exited().into_iter().find(|e| e.job == job)
        })
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for &pid in &self.pids {
            if let Some(pid) = rustix::process::Pid::from_raw(pid)
                && alive(pid.as_raw_nonzero().get())
            {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        self.launcher.stop_all(Duration::from_secs(5));
    }
}

/// Polls `f` until it returns something, for at most [`PATIENCE`].
fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "waited too long for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether `pid` runs (a zombie does not).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let state = s.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some(state != 'Z')
        })
        .unwrap_or(false)
}

fn a_fork_chain_is_gone_when_its_job_ends() {
    let mut node = Node::new();
    // The chain's last process is an orphan five times over; another orphan exits 7 before the
    // job's first process exits 3, which is the job's code.
    let script = format!(
        "{}; while [ ! -s {} ]; do sleep 0.01; done; ( (sleep 0.2; exit 7) & ); sleep 0.5; exit 3",
        node.chain(5, "pid", "sleep 600"),
        node.path("pid").display()
    );
    node.launch(1, &script);
    let escaped = node.pid("pid");
    assert!(alive(escaped), "the chain's end runs while the job does");
    let exit = node.exit(1);
    assert_eq!(exit.code, 3, "the job's own exit code: {exit:?}");
    assert!(
        !alive(escaped),
        "the orphan {escaped} outlived the job reported ended"
    );
}

fn a_fork_chain_is_gone_when_its_job_is_cancelled() {
    let mut node = Node::new();
    let script = format!("{}; exec sleep 600", node.chain(5, "pid", "sleep 600"));
    node.launch(2, &script);
    let escaped = node.pid("pid");
    node.launcher.stop(&JobStop {
        job: 2,
        attempt: 1,
        signal: "SIGTERM".into(),
        grace_secs: 1,
    });
    let exit = node.exit(2);
    assert!(exit.stopped, "{exit:?}");
    assert!(
        !alive(escaped),
        "the orphan {escaped} outlived the cancelled job"
    );
}

fn what_a_job_leaves_gets_sigterm_then_sigkill_after_the_grace() {
    let mut node = Node::new();
    let term = node.path("term");
    let polite = format!(
        "sh -c 'trap \"echo term > {}; exit 0\" TERM; while :; do sleep 0.05; done'",
        term.display()
    );
    let deaf = "sh -c 'trap \"\" TERM; while :; do sleep 0.05; done'";
    let script = format!(
        "{}; {}; while [ ! -s {} ] || [ ! -s {} ]; do sleep 0.01; done; exit 0",
        node.chain(3, "polite", &polite),
        node.chain(3, "deaf", deaf),
        node.path("polite").display(),
        node.path("deaf").display()
    );
    node.launch(3, &script);
    let (polite, deaf) = (node.pid("polite"), node.pid("deaf"));
    let exit = node.exit(3);
    assert_eq!(exit.code, 0, "{exit:?}");
    assert_eq!(
        std::fs::read_to_string(&term).unwrap_or_default().trim(),
        "term",
        "the leftover got SIGTERM first"
    );
    assert!(!alive(polite), "{polite} outlived the job");
    assert!(!alive(deaf), "{deaf}, deaf to SIGTERM, outlived the job");
}

/// The live descendants of this process (a child subreaper: what escapes a job's supervisor
/// comes here, not to init).
fn my_descendants() -> Vec<i32> {
    let mut parent = std::collections::HashMap::<i32, i32>::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let mut rest = stat
            .rsplit_once(')')
            .map_or("", |(_, r)| r)
            .split_whitespace();
        if let (Some(state), Some(ppid)) = (rest.next(), rest.next().and_then(|p| p.parse().ok()))
            && state != "Z"
        {
            parent.insert(pid, ppid);
        }
    }
    let me = i32::try_from(std::process::id()).expect("pid");
    parent
        .keys()
        .copied()
        .filter(|&p| {
            let mut p = p;
            for _ in 0..1000 {
                match parent.get(&p) {
                    Some(&pp) if pp == me => return true,
                    Some(&pp) => p = pp,
                    None => return false,
                }
            }
            false
        })
        .collect()
}

fn a_chain_that_never_stops_forking_is_gone_when_its_job_ends() {
    let mut node = Node::new();
    let script = format!(
        "{}; while [ ! -s {} ]; do sleep 0.01; done; exit 0",
        node.chain(1_000_000_000, "never", "true"),
        node.path("chain.sh").display()
    );
    node.launch(4, &script);
    let exit = node.exit(4);
    assert_eq!(exit.code, 0, "{exit:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut left = my_descendants();
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        left = my_descendants();
    }
    if !left.is_empty() {
        // Stopped here, or it would run on after the test.
        let stop = Instant::now() + PATIENCE;
        while !my_descendants().is_empty() && Instant::now() < stop {
            for pid in my_descendants() {
                if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            }
            while let Ok(Some(_)) = rustix::process::wait(rustix::process::WaitOptions::NOHANG) {}
        }
        panic!("processes of the ended job live on: {left:?}");
    }
}

fn main() {
    let args: Vec<OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == shim::SUBCOMMAND) {
        std::process::exit(shim::main(&args[2..]));
    }
    // What escapes a supervisor lands here, where the tests see it.
    rustix::process::set_child_subreaper(Some(rustix::process::getpid())).expect("subreaper");
    let tests: [(&str, fn()); 4] = [
        (
            "a_fork_chain_is_gone_when_its_job_ends",
            a_fork_chain_is_gone_when_its_job_ends,
        ),
        (
            "a_fork_chain_is_gone_when_its_job_is_cancelled",
            a_fork_chain_is_gone_when_its_job_is_cancelled,
        ),
        (
            "what_a_job_leaves_gets_sigterm_then_sigkill_after_the_grace",
            what_a_job_leaves_gets_sigterm_then_sigkill_after_the_grace,
        ),
        (
            "a_chain_that_never_stops_forking_is_gone_when_its_job_ends",
            a_chain_that_never_stops_forking_is_gone_when_its_job_ends,
        ),
    ];
    if args.iter().any(|a| a == "--list") {
        for (name, _) in tests {
            println!("{name}: test");
        }
        return;
    }
    let filter = args
        .iter()
        .skip(1)
        .filter_map(|a| a.to_str())
        .find(|a| !a.starts_with('-'));
    let mut failed = Vec::new();
    for (name, test) in tests {
        if filter.is_some_and(|f| !name.contains(f)) {
            continue;
        }
        let ok = std::panic::catch_unwind(test).is_ok();
        println!("test {name} ... {}", if ok { "ok" } else { "FAILED" });
        if !ok {
            failed.push(name);
        }
    }
    assert!(failed.is_empty(), "failed: {failed:?}");
}
