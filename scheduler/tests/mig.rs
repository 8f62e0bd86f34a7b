//! MIG instances as schedulable resources, driven through `Scheduler::step`: a job asking for
//! a profile lands only on a free instance of it, waits while all are held, is unsatisfiable
//! where no node has the profile, and no whole-GPU or shared job lands on a GPU in MIG mode;
//! a property test that no instance is ever held by two jobs.

mod common;

use common::{spec, started};
use perch_scheduler::{
    Action, Cluster, Config, Event, GpuShare, JobId, JobSpec, MINUTE, MigInstance, NodeAlloc,
    NodeId, NodeSpec, PendingReason, Placement, Scheduler,
};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

fn step(s: &mut Scheduler, now: i64, ev: Event) -> Vec<Action> {
    match s.step(now, ev) {
        Ok(a) => a,
        Err(e) => panic!("step at {now}: {e}"),
    }
}

fn mig(gpu: u32, profile: &str, uuid: &str) -> MigInstance {
    MigInstance {
        gpu,
        profile: profile.into(),
        uuid: uuid.into(),
    }
}

fn profiled(id: u64, profile: &str, account: &str) -> JobSpec {
    let mut j = spec(id, 1, 1, account, 60 * MINUTE, 0);
    j.gpu_profile = Some(profile.into());
    j
}

/// One node of 2 GPUs, sharing on: GPU 0 in MIG mode as 3g.40gb + 4g.40gb, GPU 1 whole.
fn node_with_mig() -> Scheduler {
    let mut c = Cluster::new();
    let mut n = NodeSpec::new("n0", 2, "A100", "r1");
    n.sharing = true;
    n.mig = vec![mig(0, "3g.40gb", "MIG-a"), mig(0, "4g.40gb", "MIG-b")];
    if let Err(e) = c.add_node(n) {
        panic!("node: {e}");
    }
    let mut s = Scheduler::new(c, Config::perch(vec![]));
    for g in 0..2 {
        step(
            &mut s,
            0,
            Event::GpuUtilization {
                node: NodeId(0),
                gpu: g,
                percent: 0.0,
                memory_used_mb: Some(0),
                memory_total_mb: Some(80_000),
            },
        );
    }
    s
}

fn placement_of(actions: &[Action], job: u64) -> Option<Placement> {
    actions.iter().find_map(|a| match a {
        Action::Start { job: j, placement } if j.0 == job => Some(placement.clone()),
        _ => None,
    })
}

fn holder(s: &Scheduler, uuid: &str) -> Option<JobId> {
    s.cluster()
        .mig_instances(NodeId(0))
        .into_iter()
        .find(|(m, _)| m.uuid == uuid)
        .and_then(|(_, h)| h)
}

fn reason(s: &Scheduler, job: u64) -> Option<PendingReason> {
    s.queue()
        .into_iter()
        .find(|e| e.job == JobId(job))
        .map(|e| e.reason)
}

#[test]
fn a_profile_job_lands_on_a_free_instance_of_its_profile_and_the_next_waits() {
    let mut s = node_with_mig();
    let a = step(&mut s, 1, Event::Submit(profiled(1, "3g.40gb", "a")));
    let p = placement_of(&a, 1).expect("job 1 starts");
    assert_eq!(p[0].mask, 0b01, "on GPU 0, the MIG GPU");
    assert_eq!(holder(&s, "MIG-a"), Some(JobId(1)));
    assert_eq!(
        s.cluster()
            .mig_instance_of(NodeId(0), JobId(1))
            .map(|m| m.uuid.as_str()),
        Some("MIG-a")
    );
    assert_eq!(holder(&s, "MIG-b"), None);
    // The only 3g instance is held: job 2 waits for resources, then starts on it.
    let a = step(&mut s, 2, Event::Submit(profiled(2, "3g.40gb", "a")));
    assert!(started(&a).is_empty());
    assert_eq!(reason(&s, 2), Some(PendingReason::Resources));
    let a = step(
        &mut s,
        3,
        Event::JobExited {
            job: JobId(1),
            code: 0,
        },
    );
    assert_eq!(started(&a), vec![2]);
    assert_eq!(holder(&s, "MIG-a"), Some(JobId(2)));
}

#[test]
fn no_whole_or_shared_job_goes_on_a_mig_gpu() {
    let mut s = node_with_mig();
    let a = step(&mut s, 1, Event::Submit(spec(1, 1, 1, "a", MINUTE, 1)));
    assert_eq!(placement_of(&a, 1).map(|p| p[0].mask), Some(0b10));
    // GPU 1 is taken whole; GPU 0 is in MIG mode: a second whole-GPU job and a share wait.
    let a = step(&mut s, 2, Event::Submit(spec(2, 1, 1, "a", MINUTE, 2)));
    assert!(started(&a).is_empty());
    let mut shared = spec(3, 1, 1, "a", MINUTE, 3);
    shared.share = Some(GpuShare {
        percent: 10,
        memory_mb: 100,
    });
    let a = step(&mut s, 3, Event::Submit(shared));
    assert!(started(&a).is_empty());
    // Job 2 waits for GPU 1 (reserved at job 1's time limit), never for the MIG GPU.
    assert!(matches!(
        reason(&s, 2),
        Some(PendingReason::Reserved { .. })
    ));
    // But the profile jobs start beside them.
    let a = step(&mut s, 4, Event::Submit(profiled(4, "4g.40gb", "a")));
    assert_eq!(started(&a), vec![4]);
}

#[test]
fn a_profile_no_node_has_is_unsatisfiable_until_a_node_reports_it() {
    let mut s = node_with_mig();
    step(&mut s, 1, Event::Submit(profiled(1, "1g.10gb", "a")));
    assert_eq!(reason(&s, 1), Some(PendingReason::Unsatisfiable));
    // The operator repartitions GPU 0; the agent reports the new instances.
    let reported = vec![mig(0, "1g.10gb", "MIG-c"), mig(0, "3g.40gb", "MIG-a")];
    if let Err(e) = s.set_mig(NodeId(0), reported) {
        panic!("set_mig: {e}");
    }
    let a = step(&mut s, 2, Event::Tick);
    assert_eq!(started(&a), vec![1]);
    assert_eq!(holder(&s, "MIG-c"), Some(JobId(1)));
}

#[test]
fn a_profile_job_is_charged_its_slices_of_seven() {
    let j = profiled(1, "3g.40gb", "a");
    assert_eq!(j.gpu_hundredths(), 43);
    assert_eq!(profiled(1, "1g.10gb", "a").gpu_hundredths(), 14);
    assert_eq!(profiled(1, "7g.80gb", "a").gpu_hundredths(), 100);
    for bad in [
        "3g", "3g.40", "8g.80gb", "0g.5gb", "g.40gb", "3g.0gb", "3G.40GB",
    ] {
        let Err(err) = profiled(1, bad, "a").validate() else {
            panic!("{bad} was accepted");
        };
        assert!(err.to_string().contains("<n>g.<m>gb"), "{bad}: {err}");
    }
    let mut two = profiled(1, "3g.40gb", "a");
    two.shape.gpus_per_node = 2;
    assert!(two.validate().is_err());
}

#[test]
fn a_restored_profile_job_keeps_an_instance() {
    let mut s = node_with_mig();
    step(
        &mut s,
        0,
        Event::Restore {
            spec: profiled(1, "4g.40gb", "a"),
            placement: vec![NodeAlloc {
                node: NodeId(0),
                mask: 1,
            }],
            start: 0,
            requeues: 0,
        },
    );
    assert_eq!(holder(&s, "MIG-b"), Some(JobId(1)));
    // A second restore of the same profile on that GPU has no instance left.
    let again = s.step(
        0,
        Event::Restore {
            spec: profiled(2, "4g.40gb", "a"),
            placement: vec![NodeAlloc {
                node: NodeId(0),
                mask: 1,
            }],
            start: 0,
            requeues: 0,
        },
    );
    assert!(again.is_err());
}

#[derive(Clone, Debug)]
enum Op {
    Profile(u8),
    Whole(u32),
    Exit(usize),
    Repartition(bool),
    Wait(i64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3).prop_map(Op::Profile),
        2 => (1u32..3).prop_map(Op::Whole),
        3 => (0usize..16).prop_map(Op::Exit),
        1 => any::<bool>().prop_map(Op::Repartition),
        1 => (1i64..90).prop_map(Op::Wait),
    ]
}

const PROFILES: [&str; 3] = ["1g.10gb", "3g.40gb", "2g.20gb"];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// On any sequence of profile and whole-GPU jobs, exits, time limits and repartitions: no
    /// MIG instance is held by two jobs, a profile job holds exactly one instance of its
    /// profile on the GPU it was placed on, and no whole-GPU job is placed on a MIG GPU (one
    /// already running when its GPU is repartitioned keeps running: NVIDIA refuses that).
    #[test]
    fn no_mig_instance_is_double_booked(
        config in prop_oneof![Just(Config::perch(vec![])), Just(Config::backfill()), Just(Config::fifo())],
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let mut c = Cluster::new();
        let mut n0 = NodeSpec::new("m0", 2, "A100", "r1");
        n0.mig = vec![mig(0, "1g.10gb", "a0"), mig(0, "1g.10gb", "a1"), mig(0, "3g.40gb", "a2")];
        let mut n1 = NodeSpec::new("m1", 2, "A100", "r1");
        n1.mig = vec![mig(0, "3g.40gb", "b0"), mig(1, "1g.10gb", "b1")];
        for n in [n0, n1] {
            c.add_node(n).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        let mut s = Scheduler::new(c, config);
        let mut running: HashMap<JobId, Placement> = HashMap::new();
        let mut profiles: HashMap<JobId, String> = HashMap::new();
        let mut now = 0;
        let mut next = 0u64;
        for op in ops {
            let ev = match op {
                Op::Profile(p) => {
                    next += 1;
                    let j = profiled(next, PROFILES[p as usize], "a");
                    profiles.insert(j.id, PROFILES[p as usize].to_string());
                    Event::Submit(j)
                }
                Op::Whole(g) => {
                    next += 1;
                    Event::Submit(spec(next, 1, g, "a", 30 * MINUTE, now))
                }
                Op::Exit(i) if !running.is_empty() => {
                    let mut ids: Vec<JobId> = running.keys().copied().collect();
                    ids.sort();
                    Event::JobExited { job: ids[i % ids.len()], code: 0 }
                }
                Op::Exit(_) | Op::Repartition(_) => Event::Tick,
                Op::Wait(m) => {
                    now += m * MINUTE;
                    Event::Tick
                }
            };
            if let Op::Repartition(more) = op {
                let list = if more {
                    vec![mig(0, "3g.40gb", "b0"), mig(1, "1g.10gb", "b1"), mig(1, "2g.20gb", "b2")]
                } else {
                    vec![mig(1, "2g.20gb", "b2")]
                };
                s.set_mig(NodeId(1), list).map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            let actions = s.step(now, ev.clone()).map_err(|e| TestCaseError::fail(format!("{ev:?}: {e}")))?;
            for a in actions {
                match a {
                    Action::Start { job, placement } => {
                        if !profiles.contains_key(&job) {
                            for a in &placement {
                                for (m, _) in s.cluster().mig_instances(a.node) {
                                    prop_assert_eq!(a.mask & (1 << m.gpu), 0, "whole job {} on MIG GPU {}", job, m.gpu);
                                }
                            }
                        }
                        running.insert(job, placement);
                    }
                    Action::Preempt { job, .. } | Action::Requeue { job, .. } | Action::End { job, .. } => {
                        running.remove(&job);
                    }
                    Action::IdleReport { .. } => {}
                }
            }
            let mut seen: HashSet<JobId> = HashSet::new();
            for node in [NodeId(0), NodeId(1)] {
                let instances = s.cluster().mig_instances(node);
                for (m, h) in &instances {
                    let Some(job) = h else { continue };
                    prop_assert!(seen.insert(*job), "job {job} holds two instances");
                    prop_assert!(running.contains_key(job), "instance {} held by job {job}, not running", m.uuid);
                    prop_assert_eq!(profiles.get(job), Some(&m.profile));
                    let p = &running[job];
                    prop_assert_eq!(p.len(), 1);
                    prop_assert_eq!(p[0].node, node);
                    prop_assert_eq!(p[0].mask, 1u64 << m.gpu);
                }
            }
            for job in running.keys().filter(|j| profiles.contains_key(j)) {
                prop_assert!(seen.contains(job), "profile job {job} runs without an instance");
            }
        }
    }
}
