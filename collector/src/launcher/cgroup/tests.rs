//! Job cgroups on fixture directories standing in for a cgroup v2 hierarchy (the kernel's
//! files are plain files here, so what perch writes can be read back), and the discovery of
//! the agent's own cgroup from fixture `/proc` files.

use super::*;

/// A fixture cgroup directory offering `controllers`.
fn fixture(controllers: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(dir.path().join("cgroup.controllers"), controllers).expect("write");
    fs::write(dir.path().join("cgroup.subtree_control"), "").expect("write");
    fs::write(dir.path().join("cgroup.procs"), "").expect("write");
    dir
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn a_job_gets_its_memory_and_cpus_as_limits() {
    let base = fixture("cpuset cpu io memory pids");
    let cgroups = JobCgroups::open(base.path(), "n1-0").expect("usable");
    assert_eq!(
        read(&base.path().join("perch-jobs/n1-0/cgroup.subtree_control")),
        "+cpu",
        "controllers enabled down to the agent's directory (the fixture keeps the last write)"
    );
    let job = cgroups.create(7, Some(2048), Some(3)).expect("created");
    assert_eq!(job.path, base.path().join("perch-jobs/n1-0/job-7"));
    assert_eq!(
        read(&job.path.join("memory.max")),
        (2048u64 << 20).to_string()
    );
    assert_eq!(read(&job.path.join("cpu.max")), "300000 100000");
    assert!(job.enforced, "{}", job.note);
    assert!(job.note.contains("memory.max 2147483648"), "{}", job.note);
    job.add(4242).expect("add");
    assert_eq!(read(&job.path.join("cgroup.procs")), "4242");
}

/// A limit in MiB too large for bytes (a server before the 64 TiB bound took any u64):
/// `(2^44 + 1) << 20` wrapped to a 1 MiB limit that killed the job at once; it saturates to
/// no limit now.
#[test]
fn a_huge_memory_limit_saturates_instead_of_wrapping() {
    let base = fixture("cpu memory");
    let cgroups = JobCgroups::open(base.path(), "n1-0").expect("usable");
    let job = cgroups
        .create(8, Some((1 << 44) + 1), None)
        .expect("created");
    assert_eq!(read(&job.path.join("memory.max")), u64::MAX.to_string());
}

#[test]
fn no_request_sets_no_limit() {
    let base = fixture("cpu memory");
    let job = JobCgroups::open(base.path(), "n1-0")
        .expect("usable")
        .create(1, None, None)
        .expect("created");
    assert!(job.enforced);
    assert!(!job.path.join("memory.max").exists());
    assert!(
        job.note.contains("no memory or CPU limit requested"),
        "{}",
        job.note
    );
}

#[test]
fn a_missing_controller_is_named_in_one_line() {
    // What a hybrid node shows: memory and cpu are bound to cgroup v1 hierarchies.
    let base = fixture("hugetlb");
    let job = JobCgroups::open(base.path(), "n1-0")
        .expect("the directory is usable")
        .create(3, Some(512), Some(1))
        .expect("created");
    assert!(!job.enforced);
    assert!(!job.path.join("memory.max").exists());
    assert!(
        job.note.contains(
            "limits not enforced: memory 512 MiB (the memory controller is not available in"
        ) && job.note.contains("(it lists: hugetlb)"),
        "{}",
        job.note
    );
    assert_eq!(job.note.lines().count(), 1);
}

#[test]
fn unusable_directories_say_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = JobCgroups::open(dir.path(), "n1-0").expect_err("no cgroup.controllers");
    assert!(err.contains("is not a cgroup v2 directory"), "{err}");
    // perch-jobs cannot be created: a file is in its way.
    let base = fixture("cpu memory");
    fs::write(base.path().join("perch-jobs"), "").expect("write");
    let err = JobCgroups::open(base.path(), "n1-0").expect_err("cannot create");
    assert!(
        err.contains("cannot create") && err.contains("perch-jobs"),
        "{err}"
    );
}

#[test]
fn the_agents_own_cgroup_comes_from_mountinfo_and_proc_self_cgroup() {
    let root = tempfile::tempdir().expect("tempdir");
    fs::create_dir_all(root.path().join("proc/self")).expect("mkdir");
    let mountinfo = "\
25 30 0:23 / /sys rw,nosuid shared:7 - sysfs sysfs rw
31 25 0:26 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw
32 25 0:27 / /sys/fs/cgroup/memory rw,nosuid shared:10 - cgroup cgroup rw,memory
";
    fs::write(root.path().join("proc/self/mountinfo"), mountinfo).expect("write");
    fs::write(
        root.path().join("proc/self/cgroup"),
        "4:memory:/x\n0::/system.slice/perch-agent.service\n",
    )
    .expect("write");
    assert_eq!(
        own_cgroup(root.path()),
        Ok(root
            .path()
            .join("sys/fs/cgroup/unified/system.slice/perch-agent.service"))
    );
    fs::write(
        root.path().join("proc/self/mountinfo"),
        "32 25 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
    )
    .expect("write");
    let err = own_cgroup(root.path()).expect_err("v1 only");
    assert!(err.contains("cgroup v1 only"), "{err}");
}

#[test]
fn every_agent_has_its_own_directory() {
    let a = scope_of(Path::new("/var/lib/perch/jobs/gpu01"));
    assert!(
        a.starts_with("gpu01-") && a.len() == "gpu01-".len() + 8,
        "{a}"
    );
    assert_eq!(
        a,
        scope_of(Path::new("/var/lib/perch/jobs/gpu01")),
        "stable"
    );
    assert_ne!(a, scope_of(Path::new("/tmp/other/jobs/gpu01")));
}

#[test]
fn modes_parse() {
    assert_eq!(CgroupMode::parse("auto"), Ok(CgroupMode::Auto));
    assert_eq!(CgroupMode::parse("off"), Ok(CgroupMode::Off));
    assert_eq!(
        CgroupMode::parse("/sys/fs/cgroup/perch"),
        Ok(CgroupMode::Path("/sys/fs/cgroup/perch".into()))
    );
    assert!(CgroupMode::parse("yes").is_err());
}
