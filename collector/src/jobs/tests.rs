//! Per-job sampling on real processes this test spawns (process-tree mode), on the cgroup
//! fixture tree, and attribution of GPU processes to jobs.

use super::*;
use std::process::{Child, Command};

const T: i64 = 1_800_000_000_000;

/// A shell with two sleeping children, killed (the whole group) when dropped.
struct Tree(Child);

impl Drop for Tree {
    fn drop(&mut self) {
        let kids: Vec<String> = usage::read_processes(Path::new("/"))
            .into_iter()
            .filter(|p| p.ppid == self.0.id())
            .map(|p| p.pid.to_string())
            .collect();
        if !kids.is_empty() {
            let _ = Command::new("kill").arg("-KILL").args(&kids).status();
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn gpu_proc(gpu: u32, pid: u32) -> GpuProcessSample {
    GpuProcessSample {
        time_ms: T,
        gpu: GpuIndex(gpu),
        uuid: format!("GPU-{gpu}"),
        pid,
        used_memory_bytes: Some(1000),
        ..GpuProcessSample::default()
    }
}

#[test]
fn process_tree_job_and_attribution() {
    let tree = Tree(
        Command::new("sh")
            .args(["-c", "sleep 600 & sleep 600 & wait"])
            .spawn()
            .expect("spawn sh"),
    );
    let root_pid = tree.0.id();
    let spec = JobSpec {
        job: "job-1".into(),
        user: Some("alice".into()),
        gpus: vec![0],
        target: JobTarget::Pid(root_pid),
        sim_profile: None,
    };
    let registry = JobRegistry::default();
    registry.register(spec.clone());
    let mut sampler = JobSampler::new(Path::new("/"));
    // Wait (bounded) until the shell has forked both children.
    let mut samples = Vec::new();
    for _ in 0..2000 {
        samples = sampler.sample(&registry.list(), &mut [], false, T);
        if samples.first().and_then(|s| s.processes) == Some(3) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let s = samples.first().expect("job sampled");
    assert_eq!(
        (s.job.as_str(), s.source.as_str(), s.processes),
        ("job-1", "proc", Some(3))
    );
    assert!(s.memory_bytes.is_some_and(|m| m > 0), "{s:?}");
    assert!(s.memory_peak_bytes >= s.memory_bytes && s.cpu_seconds.is_some());
    assert_eq!(s.gpus, vec![GpuIndex(0)]);

    let kids: Vec<u32> = usage::read_processes(Path::new("/"))
        .into_iter()
        .filter(|p| p.ppid == root_pid)
        .map(|p| p.pid)
        .collect();
    assert_eq!(kids.len(), 2);
    // This test's own process is in no job; a PID nothing has is not in /proc.
    let stranger = std::process::id();
    let invisible = u32::MAX - 1;
    let mut procs = vec![
        gpu_proc(0, kids[0]),
        gpu_proc(1, kids[1]),
        gpu_proc(0, stranger),
        gpu_proc(5, stranger),
        gpu_proc(0, invisible),
    ];
    let jobs = sampler.sample(&registry.list(), &mut procs, false, T);
    let got: Vec<_> = procs
        .iter()
        .map(|p| (p.gpu.0, p.job.as_deref(), p.rogue))
        .collect();
    assert_eq!(
        got,
        vec![
            (0, Some("job-1"), false),
            (1, Some("job-1"), true),
            (0, None, true),
            (5, None, false),
            (0, None, false),
        ]
    );
    assert_eq!(jobs[0].gpu_memory_bytes, Some(2000));

    assert!(registry.unregister("job-1") && !registry.unregister("job-1"));
    assert!(
        sampler
            .sample(&registry.list(), &mut procs, false, T)
            .is_empty()
    );
}

#[test]
fn cgroup_job_from_the_fixture_tree() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/node1");
    let spec = JobSpec {
        job: "job-7".into(),
        user: None,
        gpus: vec![2],
        target: JobTarget::Cgroup("/perch/job-7".into()),
        sim_profile: None,
    };
    let gone = JobSpec {
        job: "gone".into(),
        target: JobTarget::Cgroup("/perch/none".into()),
        ..spec.clone()
    };
    let mut procs = vec![gpu_proc(2, 503)];
    let out = JobSampler::new(&root).sample(&[spec, gone], &mut procs, false, T);
    assert_eq!(out.len(), 1, "a job whose cgroup is gone is skipped");
    let s = &out[0];
    assert_eq!(
        (
            s.source.as_str(),
            s.cpu_seconds,
            s.memory_bytes,
            s.memory_peak_bytes,
            s.processes
        ),
        (
            "cgroup_v2",
            Some(12.5),
            Some(1_048_576),
            Some(4_194_304),
            Some(3)
        )
    );
    assert_eq!(
        (procs[0].job.as_deref(), procs[0].rogue),
        (Some("job-7"), false)
    );
}
