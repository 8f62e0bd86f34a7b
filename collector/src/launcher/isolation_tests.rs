//! Jobs as their users, in their cgroups, and sharing a GPU, on this machine for real.
//!
//! The tests that switch users or make cgroups need root, as CI has, and fail without it rather
//! than check less. The cgroup test delegates a cgroup to the agent itself; what the kernel
//! offers to cgroup v2 (the `memory` and `cpu` controllers, or neither on a hybrid node) decides
//! what perch must do, and the test says which. A few tests still run without root, checking
//! the agent's documented fallback (jobs run as the agent's user).

use super::*;
use perch_model::control::LaunchShare;

fn launch(job: u64, user: &str, script: &str) -> JobLaunch {
    JobLaunch {
        job,
        attempt: 1,
        command: vec!["sh".into(), "-c".into(), script.into()],
        env: Default::default(),
        workdir: None,
        gpus: vec![0],
        user: user.into(),
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
    }
}

fn wait_exit(l: &mut Launcher, job: u64) -> JobExit {
    for _ in 0..600 {
        l.poll();
        if let Some(e) = l.exited().into_iter().find(|e| e.job == job) {
            return e;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("job {job} did not exit");
}

fn output(dir: &Path, job: u64, stream: &str) -> String {
    fs::read_to_string(dir.join(job.to_string()).join(stream)).unwrap_or_default()
}

fn is_root() -> bool {
    rustix::process::getuid().is_root()
}

/// A user (with a supplementary group) created for one test and deleted after it.
struct TestUser {
    name: String,
    group: String,
}

impl TestUser {
    fn create(tag: &str) -> TestUser {
        let name = format!("perch{tag}{}", std::process::id() % 100_000);
        let group = format!("{name}g");
        let run = |program: &str, args: &[&str]| {
            let status = std::process::Command::new(program)
                .args(args)
                .status()
                .unwrap_or_else(|e| panic!("root, but {program} cannot run: {e}"));
            assert!(status.success(), "{program} {args:?}: {status}");
        };
        run("groupadd", &[&group]);
        run("useradd", &["-m", "-G", &group, &name]);
        TestUser { name, group }
    }
}

impl Drop for TestUser {
    fn drop(&mut self) {
        let _ = std::process::Command::new("userdel")
            .args(["-f", "-r", &self.name])
            .output();
        let _ = std::process::Command::new("groupdel")
            .arg(&self.group)
            .output();
    }
}

#[test]
fn a_job_runs_as_its_user_when_the_agent_is_root() {
    assert!(
        is_root(),
        "this test needs root, as CI has: it creates a user and switches to it"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    // The job directory's parents must be traversable by the user, as a data dir is.
    fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    let mut l = Launcher::new(dir.path()).expect("launcher");
    l.set_isolation(&Isolation {
        run_as_user: RunAsUser::IfPossible,
        cgroups: CgroupMode::Off,
        root: PathBuf::new(),
        uids: UidPolicy::default(),
    });
    // The job holds on until the test has seen its uid: it reads a line from this pipe, which
    // the test writes once it has looked.
    let gate = dir.path().join("gate");
    let made = std::process::Command::new("mkfifo")
        .args(["-m", "666"])
        .arg(&gate)
        .status()
        .expect("mkfifo");
    assert!(made.success(), "mkfifo: {made}");
    let script = format!(
        "id -u; id -G; echo $HOME $USER; touch here; read _ < {}",
        gate.display()
    );
    let user = TestUser::create("u");
    let id = identity::lookup(&user.name)
        .expect("lookup")
        .expect("created user exists");
    let group = nix::unistd::Group::from_name(&user.group)
        .expect("lookup")
        .expect("created group exists");
    l.launch(&launch(1, &user.name, &script));
    // While it runs, its process has the user's uid (once the switch is done: with setpriv
    // the same process starts as root and switches before the job's program runs).
    let pid = l
        .running
        .get(&1)
        .map(|r| r.pgid.as_raw_nonzero().get() as u32)
        .expect("started");
    let uid_of = || {
        let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1).map(str::to_owned))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut seen = uid_of();
    while seen.as_deref() != Some(id.uid.to_string().as_str())
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(10));
        seen = uid_of();
    }
    assert_eq!(seen, Some(id.uid.to_string()), "the running job's uid");
    // Opening the pipe waits for the job to reach its `read`.
    fs::write(&gate, "go\n").expect("open the gate");
    let exit = wait_exit(&mut l, 1);
    assert_eq!(exit.code, 0, "{}", output(dir.path(), 1, "stderr"));
    let out = output(dir.path(), 1, "stdout");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first(), Some(&id.uid.to_string().as_str()), "{out}");
    let groups: Vec<u32> = lines
        .get(1)
        .map(|g| {
            g.split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    assert!(groups.contains(&id.gid), "primary group in {groups:?}");
    assert!(
        l.setpriv.is_some(),
        "setpriv (util-linux) is installed here, as scripts/test.sh makes sure"
    );
    assert!(
        groups.contains(&group.gid.as_raw()),
        "supplementary group {} in {groups:?}",
        group.gid
    );
    assert_eq!(
        lines.get(2).copied(),
        Some(format!("{} {}", id.home.display(), user.name).as_str())
    );
    // Its directory and logs are its own: it could write its working directory.
    let meta = fs::metadata(dir.path().join("1/stdout")).expect("stdout");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), id.uid);
    assert!(dir.path().join("1/here").exists());
    assert!(
        l.take_notes()
            .iter()
            .all(|n| n.job != 1 || !n.text.contains("not root")),
        "no fallback to the agent's user"
    );
}

#[test]
fn a_user_the_node_does_not_know_fails_the_job_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut l = Launcher::new(dir.path()).expect("launcher");
    l.set_isolation(&Isolation {
        run_as_user: RunAsUser::Required,
        cgroups: CgroupMode::Off,
        root: PathBuf::new(),
        uids: UidPolicy::default(),
    });
    l.launch(&launch(2, "no-such-user-perch", "echo ran"));
    let exit = wait_exit(&mut l, 2);
    assert_eq!(exit.code, 126);
    let why = exit.error.expect("a reason");
    if is_root() {
        assert!(why.contains("does not exist on this node"), "{why}");
    } else {
        assert!(why.contains("not root"), "{why}");
    }
    assert!(output(dir.path(), 2, "stderr").starts_with("perch: job not started: "));
    assert_eq!(output(dir.path(), 2, "stdout"), "");
}

/// The mount point of the cgroup v2 hierarchy, from `/proc/self/mountinfo`.
fn cgroup2_mount() -> Option<PathBuf> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        (right.split_whitespace().next() == Some("cgroup2"))
            .then(|| left.split_whitespace().nth(4).map(PathBuf::from))
            .flatten()
    })
}

/// A cgroup v2 directory made for one test under the hierarchy's root, with the `memory`
/// and `cpu` controllers delegated to it where the kernel offers them to cgroup v2: what an
/// operator sets up for `agent.cgroups = "/path"`. Removed (with what perch left in it) when
/// dropped.
struct DelegatedCgroup {
    path: PathBuf,
}

impl DelegatedCgroup {
    fn create(mount: &Path, offered: &[&str]) -> DelegatedCgroup {
        // The root may hold processes and still hand controllers down.
        for c in offered {
            fs::write(mount.join("cgroup.subtree_control"), format!("+{c}")).unwrap_or_else(|e| {
                panic!("root, but cannot enable {c} in {}: {e}", mount.display())
            });
        }
        let path = mount.join(format!("perch-test-{}", std::process::id()));
        let _ = fs::remove_dir(&path);
        fs::create_dir(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        DelegatedCgroup { path }
    }
}

impl Drop for DelegatedCgroup {
    fn drop(&mut self) {
        // Deepest first: a cgroup directory goes with rmdir once it has no children.
        let mut dirs = vec![self.path.clone()];
        let mut i = 0;
        while i < dirs.len() {
            for entry in fs::read_dir(&dirs[i]).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(entry.path());
                }
            }
            i += 1;
        }
        for dir in dirs.iter().rev() {
            let _ = fs::remove_dir(dir);
        }
    }
}

/// The job runs in a cgroup of its own from its first instruction, and that cgroup holds its
/// memory and CPU request as limits, read back from inside the job. The test delegates a
/// cgroup to the agent itself (it is root), so the only thing that decides the outcome is the
/// kernel: where it offers `memory` and `cpu` to cgroup v2, both limits must be set; where it
/// binds them to cgroup v1 (a hybrid node, such as this project's VM), no limit can be, and the
/// job's log and record must say so, naming each controller.
#[test]
fn a_job_runs_in_its_cgroup_with_its_memory_and_cpu_limits() {
    assert!(
        is_root(),
        "this test needs root, as CI has: it creates cgroups"
    );
    let mount = cgroup2_mount().expect("a cgroup v2 hierarchy is mounted (unified or hybrid)");
    let kernel = fs::read_to_string(mount.join("cgroup.controllers")).expect("controllers");
    let offered: Vec<&str> = ["memory", "cpu"]
        .into_iter()
        .filter(|c| kernel.split_whitespace().any(|k| k == *c))
        .collect();
    let base = DelegatedCgroup::create(&mount, &offered);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut l = Launcher::new(dir.path()).expect("launcher");
    l.set_isolation(&Isolation {
        run_as_user: RunAsUser::Never,
        cgroups: CgroupMode::Path(base.path.clone()),
        root: PathBuf::new(),
        uids: UidPolicy::default(),
    });
    let parent = match &l.cgroups {
        Ok(c) => c.parent().to_path_buf(),
        Err(why) => panic!("a delegated cgroup is refused: {why}"),
    };
    // The job reports its own cgroup and the limits the kernel holds for it.
    let script = format!(
        "cg=$(sed -n 's/^0:://p' /proc/self/cgroup); echo \"cgroup $cg\"; \
         for f in memory.max cpu.max; do \
           if [ -e \"{m}$cg/$f\" ]; then echo \"$f $(cat \"{m}$cg/$f\")\"; else echo \"$f absent\"; fi; \
         done",
        m = mount.display()
    );
    let mut job = launch(3, "any", &script);
    job.memory_mb = Some(256);
    job.cpus = Some(1);
    l.launch(&job);
    let exit = wait_exit(&mut l, 3);
    let stdout = output(dir.path(), 3, "stdout");
    let stderr = output(dir.path(), 3, "stderr");
    assert_eq!(exit.code, 0, "{stderr}");
    let notes: Vec<String> = l
        .take_notes()
        .into_iter()
        .filter(|n| n.job == 3)
        .map(|n| n.text)
        .collect();
    let job_cgroup = parent.join("job-3");
    let rel = job_cgroup.strip_prefix(&mount).expect("under the mount");
    let mut lines = stdout.lines();
    assert_eq!(
        lines.next(),
        Some(format!("cgroup /{}", rel.display()).as_str()),
        "the job's first process ran in its own cgroup: {stdout}"
    );
    let limits: Vec<&str> = lines.collect();
    if offered == ["memory", "cpu"] {
        eprintln!("the kernel offers memory and cpu to cgroup v2: both limits must hold");
        assert_eq!(
            limits,
            ["memory.max 268435456", "cpu.max 100000 100000"],
            "the limits the job runs under; perch said: {notes:?} {stderr}"
        );
        assert!(
            notes
                .iter()
                .any(|n| n.contains("memory.max 268435456") && n.contains("cpu.max 100000 100000")),
            "{notes:?}"
        );
        assert!(!stderr.contains("not enforced"), "{stderr}");
    } else {
        eprintln!(
            "the kernel offers only {kernel:?} to cgroup v2 (memory and cpu are bound to v1): no limit can hold, perch must say so"
        );
        assert_eq!(limits, ["memory.max absent", "cpu.max absent"], "{stdout}");
        for (controller, limit) in [("memory", "memory 256 MiB"), ("cpu", "1 CPUs")] {
            if offered.contains(&controller) {
                continue;
            }
            let why = format!(
                "{limit} (the {controller} controller is not available in {}",
                base.path.display()
            );
            assert!(
                stderr.starts_with("perch: cgroup ") && stderr.contains(&why),
                "the job's log names {controller}: {stderr}"
            );
            assert!(
                notes
                    .iter()
                    .any(|n| n.contains("limits not enforced") && n.contains(&why)),
                "the record names {controller}: {notes:?}"
            );
        }
    }
    // Removed once the job ended, and the agent's directory at shutdown.
    assert!(!job_cgroup.exists(), "{} left behind", job_cgroup.display());
    l.stop_all(Duration::from_secs(1));
    assert!(!parent.exists(), "{} left behind", parent.display());
}

#[test]
fn shared_jobs_run_side_by_side_and_a_whole_gpu_job_waits_for_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut l = Launcher::new(dir.path()).expect("launcher");
    let share = |job: u64| {
        let mut s = launch(
            job,
            "any",
            "echo $CUDA_VISIBLE_DEVICES $PERCH_GPU_FRACTION $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; sleep 0.4",
        );
        s.gpu_share = Some(LaunchShare {
            percent: 25,
            memory_mb: 1024,
        });
        s
    };
    l.launch(&share(4));
    l.launch(&share(5));
    assert!(
        l.running.contains_key(&4) && l.running.contains_key(&5),
        "two shares of GPU 0 run together"
    );
    l.launch(&launch(6, "any", "true"));
    assert!(
        !l.running.contains_key(&6),
        "a whole-GPU job waits for them"
    );
    assert_eq!(wait_exit(&mut l, 6).code, 0);
    for job in [4, 5] {
        assert_eq!(output(dir.path(), job, "stdout"), "0 0.25 25\n");
    }
}

/// Builds a harmless preload library that appends "<euid> <program>" to `log` whenever a
/// program loads it.
fn euid_recorder(dir: &Path, log: &Path) -> PathBuf {
    let src = dir.join("euid.c");
    fs::write(
        &src,
        format!(
            r#"#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
__attribute__((constructor)) static void record(void) {{
    char exe[256] = {{0}}, line[320];
    if (readlink("/proc/self/exe", exe, sizeof exe - 1) < 0) strcpy(exe, "?");
    int fd = open("{}", O_WRONLY | O_APPEND | O_CREAT, 0666);
    if (fd < 0) return;
    int n = snprintf(line, sizeof line, "%u %s\n", (unsigned)geteuid(), exe);
    if (n > 0) (void)!write(fd, line, (size_t)n);
    close(fd);
}}
"#,
            log.display()
        ),
    )
    .expect("write euid.c");
    let lib = dir.join("libeuid.so");
    let status = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
        .expect("cc (the preload library needs a C compiler, as CI has)");
    assert!(status.success(), "cc: {status}");
    lib
}

#[test]
fn the_jobs_env_reaches_no_program_that_runs_as_root() {
    assert!(
        is_root(),
        "this test needs root, as CI has: it switches users"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    let log = dir.path().join("euids");
    fs::write(&log, "").expect("log");
    fs::set_permissions(&log, std::os::unix::fs::PermissionsExt::from_mode(0o666)).expect("chmod");
    let lib = euid_recorder(dir.path(), &log);
    let user = TestUser::create("p");
    let id = identity::lookup(&user.name)
        .expect("lookup")
        .expect("created user exists");
    let mut l = Launcher::new(&dir.path().join("jobs")).expect("launcher");
    fs::set_permissions(
        dir.path().join("jobs"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    // A cgroup when the machine allows one: the root `sh` that waits for it runs first then.
    l.set_isolation(&Isolation {
        run_as_user: RunAsUser::Required,
        cgroups: CgroupMode::Auto,
        root: PathBuf::new(),
        uids: UidPolicy::default(),
    });
    assert!(
        l.setpriv.is_some(),
        "setpriv (util-linux) is installed here"
    );
    let mut job = launch(1, &user.name, "echo $GREETING");
    // What the server refuses, sent straight to the launcher: the mechanism must hold anyway.
    job.env = [
        ("LD_PRELOAD".to_owned(), lib.display().to_string()),
        ("GREETING".to_owned(), "hi".to_owned()),
    ]
    .into();
    l.launch(&job);
    let exit = wait_exit(&mut l, 1);
    assert_eq!(
        exit.code,
        0,
        "{}",
        output(&dir.path().join("jobs"), 1, "stderr")
    );
    assert_eq!(output(&dir.path().join("jobs"), 1, "stdout"), "hi\n");
    let seen = fs::read_to_string(&log).expect("log");
    let lines: Vec<&str> = seen.lines().collect();
    assert!(
        !lines.is_empty(),
        "the job itself loads the library, as its user"
    );
    for line in &lines {
        assert!(
            line.starts_with(&format!("{} ", id.uid)),
            "a program ran with the job's LD_PRELOAD as another user: {seen}"
        );
    }
}

/// The hostfile is written by the (root) agent into the job's own directory: a link the job
/// left there in an earlier attempt is replaced, never followed, and the new file is the
/// job's user's. (Not root: the job runs as the agent's user, whose files the link could
/// still reach.)
#[test]
fn a_link_left_where_the_hostfile_goes_is_not_followed() {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    let victim = dir.path().join("victim");
    fs::write(&victim, "root's\n").expect("victim");
    let mut l = Launcher::new(dir.path()).expect("launcher");
    l.set_isolation(&Isolation {
        run_as_user: RunAsUser::IfPossible,
        cgroups: CgroupMode::Off,
        root: PathBuf::new(),
        uids: UidPolicy::default(),
    });
    let user = is_root().then(|| TestUser::create("h"));
    let name = user.as_ref().map_or("somebody", |u| u.name.as_str());
    let uid = match &user {
        Some(u) => {
            identity::lookup(&u.name)
                .expect("lookup")
                .expect("exists")
                .uid
        }
        None => rustix::process::getuid().as_raw(),
    };
    let plant = format!("ln -s {} hostfile", victim.display());
    l.launch(&launch(1, name, &plant));
    assert_eq!(wait_exit(&mut l, 1).code, 0);
    l.apply(&SyncResponse {
        acknowledged: vec![JobAttempt { job: 1, attempt: 1 }],
        ..Default::default()
    });
    let mut second = launch(1, name, "cat \"$PERCH_HOSTFILE\"");
    second.attempt = 2;
    second.hosts = vec![perch_model::control::LaunchHost {
        addr: "10.9.9.9".into(),
        slots: 4,
    }];
    l.launch(&second);
    let exit = wait_exit(&mut l, 1);
    assert_eq!(exit.code, 0, "{}", output(dir.path(), 1, "stderr"));
    assert_eq!(output(dir.path(), 1, "stdout"), "10.9.9.9 slots=4\n");
    assert_eq!(fs::read_to_string(&victim).expect("victim"), "root's\n");
    let meta = fs::symlink_metadata(dir.path().join("1/hostfile")).expect("hostfile");
    assert!(meta.is_file());
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), uid);
}

#[test]
fn a_workdir_the_user_cannot_enter_fails_alike_whether_it_exists_or_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    let mut l = Launcher::new(&dir.path().join("jobs")).expect("launcher");
    l.set_isolation(&Isolation {
        run_as_user: RunAsUser::IfPossible,
        cgroups: CgroupMode::Off,
        root: PathBuf::new(),
        uids: UidPolicy::default(),
    });
    // A directory of root's (the agent's, when not root) that only its owner may enter.
    let secret = dir.path().join("secret");
    fs::create_dir_all(secret.join("inner")).expect("mkdir");
    fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .expect("chmod");
    let user = is_root().then(|| TestUser::create("wd"));
    let name = user.as_ref().map_or("somebody", |u| u.name.as_str());
    let mut run = |job: u64, workdir: &Path| {
        let mut launch = launch(job, name, "pwd");
        launch.workdir = Some(workdir.display().to_string());
        l.launch(&launch);
        let exit = wait_exit(&mut l, job);
        let why = exit.error.unwrap_or_default();
        (
            exit.code,
            why.replace(&workdir.display().to_string(), "<dir>"),
        )
    };
    let missing = run(1, &secret.join("missing"));
    assert_eq!(missing.0, 127);
    assert!(
        missing
            .1
            .contains("working directory \"<dir>\" is not a directory"),
        "{missing:?}"
    );
    if user.is_none() {
        // The agent's own user can enter its own directory: nothing is hidden from it.
        eprintln!("not root: the check runs as the agent's user");
        let entered = run(2, &secret.join("inner"));
        assert_eq!(entered.0, 0, "{entered:?}");
        return;
    }
    // Inside the root-only directory, existing or not, and the directory itself.
    assert_eq!(run(2, &secret.join("inner")), missing);
    assert_eq!(run(3, &secret), missing);
    // A directory the user may enter still works.
    fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let entered = run(4, &secret.join("inner"));
    assert_eq!(entered.0, 0, "{entered:?}");
}
