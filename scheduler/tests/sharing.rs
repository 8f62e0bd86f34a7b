//! Fractional GPU sharing and NVLink-aware GPU choice, driven through `Scheduler::step`:
//! scenarios on virtual time, and a property test that shares never overbook a GPU and never
//! mix with whole-GPU jobs.

mod common;

use common::{one, spec, started};
use perch_scheduler::{
    Account, Action, Cluster, Config, Event, GpuShare, JobId, JobSpec, MINUTE, NodeAlloc, NodeId,
    NodeSpec, PendingReason, Placement, Scheduler,
};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

fn step(s: &mut Scheduler, now: i64, ev: Event) -> Vec<Action> {
    match s.step(now, ev) {
        Ok(a) => a,
        Err(e) => panic!("step at {now}: {e}"),
    }
}

fn shared(id: u64, percent: u32, memory_mb: u64, account: &str) -> JobSpec {
    let mut j = one(id, 1, account, 60, 0);
    j.share = Some(GpuShare { percent, memory_mb });
    j
}

/// GPU memory and load as an agent reports them: `used` MiB of 80 GB, `percent` busy.
fn telemetry(node: u32, gpu: u32, percent: f32, used: u64) -> Event {
    Event::GpuUtilization {
        node: NodeId(node),
        gpu,
        percent,
        memory_used_mb: Some(used),
        memory_total_mb: Some(80_000),
    }
}

/// Nodes of 8 GPUs; `sharing` says which take shared jobs. Every GPU reports 0% and 500 MiB.
fn cluster(sharing: &[bool], islands: Vec<Vec<u32>>, config: Config) -> Scheduler {
    let mut c = Cluster::new();
    for (i, &share) in sharing.iter().enumerate() {
        let mut spec = NodeSpec::new(&format!("n{i}"), 8, "H100", "r1");
        spec.sharing = share;
        spec.nvlink_islands = islands.clone();
        if let Err(e) = c.add_node(spec) {
            panic!("node: {e}");
        }
    }
    let mut s = Scheduler::new(c, config);
    for n in 0..sharing.len() as u32 {
        for g in 0..8 {
            step(&mut s, 0, telemetry(n, g, 0.0, 500));
        }
    }
    s
}

fn placement_of(actions: &[Action], job: u64) -> Option<Placement> {
    actions.iter().find_map(|a| match a {
        Action::Start { job: j, placement } if j.0 == job => Some(placement.clone()),
        _ => None,
    })
}

#[test]
fn a_4_gpu_job_stays_inside_one_nvlink_island() {
    let mut s = cluster(
        &[false],
        vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]],
        Config::perch(vec![]),
    );
    // GPUs 1 and 2 are busy with a job already running.
    step(
        &mut s,
        0,
        Event::Restore {
            spec: one(1, 2, "a", 600, 0),
            placement: vec![NodeAlloc {
                node: NodeId(0),
                mask: 0b0110,
            }],
            start: 0,
            requeues: 0,
        },
    );
    let a = step(&mut s, 1, Event::Submit(one(2, 4, "a", 60, 1)));
    let p = placement_of(&a, 2).expect("job 2 starts");
    assert_eq!(p[0].gpu_indices(), vec![4, 5, 6, 7], "not 0,3,4,5");
    // Without islands the lowest free GPUs are taken, as before.
    let mut flat = cluster(&[false], vec![], Config::perch(vec![]));
    step(
        &mut flat,
        0,
        Event::Restore {
            spec: one(1, 2, "a", 600, 0),
            placement: vec![NodeAlloc {
                node: NodeId(0),
                mask: 0b0110,
            }],
            start: 0,
            requeues: 0,
        },
    );
    let a = step(&mut flat, 1, Event::Submit(one(2, 4, "a", 60, 1)));
    assert_eq!(
        placement_of(&a, 2).expect("starts")[0].gpu_indices(),
        vec![0, 3, 4, 5]
    );
}

#[test]
fn islands_reported_later_steer_later_placements() {
    let mut s = cluster(&[false], vec![], Config::perch(vec![]));
    step(
        &mut s,
        0,
        Event::UpdateNode {
            node: NodeId(0),
            nvlink_islands: vec![vec![0, 1], vec![2, 3, 4, 5, 6, 7]],
            sharing: false,
            rack: None,
        },
    );
    assert_eq!(
        s.cluster().nvlink_islands(NodeId(0)),
        vec![vec![0, 1], vec![2, 3, 4, 5, 6, 7]]
    );
    let a = step(&mut s, 1, Event::Submit(one(1, 3, "a", 60, 1)));
    assert_eq!(
        placement_of(&a, 1).expect("starts")[0].gpu_indices(),
        vec![2, 3, 4]
    );
    let bad = s.step(
        2,
        Event::UpdateNode {
            node: NodeId(0),
            nvlink_islands: vec![vec![0, 1], vec![1, 2]],
            sharing: false,
            rack: None,
        },
    );
    let err = bad.expect_err("GPU 1 in two islands").to_string();
    assert!(err.contains("GPU 1 is in two islands"), "{err}");
}

#[test]
fn shares_pack_onto_one_gpu_and_never_meet_whole_gpu_jobs() {
    let mut s = cluster(&[true], vec![], Config::perch(vec![]));
    // Four quarter-GPU jobs share GPU 0; a fifth goes to GPU 1.
    let mut gpus = Vec::new();
    for id in 1..=5 {
        let a = step(
            &mut s,
            id as i64,
            Event::Submit(shared(id, 25, 10_000, "a")),
        );
        gpus.push(placement_of(&a, id).expect("shares start")[0].gpu_indices());
    }
    assert_eq!(gpus, vec![vec![0], vec![0], vec![0], vec![0], vec![1]]);
    assert_eq!(
        s.cluster()
            .sharers(NodeId(0), 0)
            .iter()
            .map(|(_, sh)| sh.percent)
            .sum::<u32>(),
        100
    );
    // An 8-GPU job cannot start while GPUs 0 and 1 hold shares; a 6-GPU job takes 2..8.
    let a = step(&mut s, 10, Event::Submit(one(10, 8, "b", 60, 10)));
    assert!(started(&a).is_empty());
    let a = step(&mut s, 11, Event::Submit(one(11, 6, "a", 60, 11)));
    assert_eq!(
        placement_of(&a, 11).expect("starts")[0].gpu_indices(),
        vec![2, 3, 4, 5, 6, 7]
    );
    // No GPU left for a share that does not fit on GPU 1 next to its 25%.
    let a = step(&mut s, 12, Event::Submit(shared(12, 80, 1_000, "a")));
    assert!(started(&a).is_empty());
    assert_eq!(s.pending_reason(JobId(12)), Some(PendingReason::Resources));
    // The last share leaves GPU 1: the 80% share takes it.
    let a = step(
        &mut s,
        13,
        Event::JobExited {
            job: JobId(5),
            code: 0,
        },
    );
    assert_eq!(started(&a), vec![12]);
}

#[test]
fn measured_load_and_free_memory_decide_where_a_share_fits() {
    let mut s = cluster(&[true], vec![], Config::perch(vec![]));
    let a = step(&mut s, 1, Event::Submit(shared(1, 30, 30_000, "a")));
    assert_eq!(
        placement_of(&a, 1).expect("starts")[0].gpu_indices(),
        vec![0]
    );
    // Job 1 turns out to use 75% of GPU 0 and 60 GB, more than it asked for.
    step(&mut s, 2, telemetry(0, 0, 75.0, 60_000));
    // 30% more would pass the books (60%) but not the measured load: GPU 1 instead.
    let a = step(&mut s, 3, Event::Submit(shared(2, 30, 1_000, "a")));
    assert_eq!(
        placement_of(&a, 2).expect("starts")[0].gpu_indices(),
        vec![1]
    );
    // 20% fits GPU 0's load, but 25 GB does not fit its 20 GB free: GPU 1 again.
    let a = step(&mut s, 4, Event::Submit(shared(3, 20, 25_000, "a")));
    assert_eq!(
        placement_of(&a, 3).expect("starts")[0].gpu_indices(),
        vec![1]
    );
    // 20% and 10 GB fit both: GPU 1, the one with the most granted (50% against 30%).
    let a = step(&mut s, 5, Event::Submit(shared(4, 20, 10_000, "a")));
    assert_eq!(
        placement_of(&a, 4).expect("starts")[0].gpu_indices(),
        vec![1]
    );
    // 35% fits neither GPU 1's grants (70% + 35%) nor GPU 0's measured load (75% + 35%),
    // though GPU 0's grants would allow it: a fresh GPU.
    let a = step(&mut s, 6, Event::Submit(shared(5, 35, 1_000, "a")));
    assert_eq!(
        placement_of(&a, 5).expect("starts")[0].gpu_indices(),
        vec![2]
    );
}

#[test]
fn a_share_needs_a_node_that_shares_and_measured_memory() {
    // No node allows sharing: unsatisfiable, and it blocks nothing.
    let mut s = cluster(&[false, false], vec![], Config::perch(vec![]));
    step(&mut s, 0, Event::Submit(shared(1, 50, 1_000, "a")));
    assert_eq!(
        s.pending_reason(JobId(1)),
        Some(PendingReason::Unsatisfiable)
    );
    assert_eq!(
        started(&step(&mut s, 1, Event::Submit(one(2, 1, "a", 60, 1)))),
        vec![2]
    );
    // More memory than any GPU has: unsatisfiable too.
    let mut s = cluster(&[true], vec![], Config::perch(vec![]));
    step(&mut s, 0, Event::Submit(shared(1, 50, 100_000, "a")));
    assert_eq!(
        s.pending_reason(JobId(1)),
        Some(PendingReason::Unsatisfiable)
    );
    // A sharing node whose GPUs never reported memory: the share waits for telemetry.
    let mut c = Cluster::new();
    let mut spec = NodeSpec::new("quiet", 8, "H100", "r1");
    spec.sharing = true;
    c.add_node(spec).expect("node");
    let mut s = Scheduler::new(c, Config::perch(vec![]));
    step(&mut s, 0, Event::Submit(shared(1, 50, 1_000, "a")));
    assert_eq!(s.pending_reason(JobId(1)), Some(PendingReason::Resources));
    let a = step(&mut s, 1, telemetry(0, 3, 0.0, 0));
    assert_eq!(
        placement_of(&a, 1).expect("starts")[0].gpu_indices(),
        vec![3]
    );
}

#[test]
fn a_share_counts_its_fraction_against_the_quota() {
    let quotas = vec![(Account("a".into()), 1), (Account("b".into()), 7)];
    let mut config = Config::perch(quotas);
    config.borrowing = false;
    let mut s = cluster(&[true], vec![], config);
    // Quota 1 GPU: two half-GPU shares fit it, a third waits.
    for id in 1..=2 {
        assert_eq!(
            started(&step(
                &mut s,
                id,
                Event::Submit(shared(id as u64, 50, 1_000, "a"))
            )),
            vec![id as u64]
        );
    }
    step(&mut s, 3, Event::Submit(shared(3, 10, 1_000, "a")));
    assert_eq!(
        s.pending_reason(JobId(3)),
        Some(PendingReason::QuotaExceeded)
    );
    assert_eq!(s.account_alloc(&Account("a".into())), 1);
}

#[test]
fn a_running_share_is_restored_beside_the_others_after_a_restart() {
    let mut s = cluster(&[true], vec![], Config::perch(vec![]));
    let restore = |id: u64, percent: u32| Event::Restore {
        spec: shared(id, percent, 1_000, "a"),
        placement: vec![NodeAlloc {
            node: NodeId(0),
            mask: 0b100,
        }],
        start: 0,
        requeues: 0,
    };
    step(&mut s, 0, restore(1, 60));
    step(&mut s, 0, restore(2, 40));
    let err = s.step(0, restore(3, 10)).expect_err("GPU 2 is full");
    assert!(err.to_string().contains("taken"), "{err}");
    assert_eq!(s.cluster().holders(NodeId(0), 2), vec![JobId(1), JobId(2)]);
}

#[test]
fn quota_reclaim_frees_a_shared_gpu_only_by_taking_all_its_sharers() {
    // "b" borrows the whole 1-node cluster: 7 whole GPUs and two shares on GPU 7. "a" (quota
    // 8) wants 8 GPUs: every job of "b" must go, shares included.
    let quotas = vec![(Account("a".into()), 8), (Account("b".into()), 0)];
    let mut s = cluster(&[true], vec![], Config::perch(quotas));
    step(&mut s, 0, Event::Submit(one(1, 7, "b", 600, 0)));
    step(&mut s, 1, Event::Submit(shared(2, 50, 1_000, "b")));
    step(&mut s, 2, Event::Submit(shared(3, 50, 1_000, "b")));
    assert_eq!(s.running_len(), 3);
    let a = step(&mut s, MINUTE, Event::Submit(one(4, 8, "a", 60, MINUTE)));
    let mut preempted = common::preempted(&a);
    preempted.sort_unstable();
    assert_eq!(preempted, vec![1, 2, 3]);
    assert_eq!(started(&a), vec![4]);
}

#[derive(Clone, Debug)]
enum Op {
    Whole {
        gpus: u32,
        limit_min: i64,
    },
    Share {
        percent: u32,
        memory_gb: u64,
    },
    Exit(usize),
    Load {
        node: u32,
        gpu: u32,
        pct: f32,
        used_gb: u64,
    },
    Wait(i64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (prop_oneof![Just(1u32), Just(2), Just(4), Just(8)], 1i64..120)
            .prop_map(|(gpus, limit_min)| Op::Whole { gpus, limit_min }),
        4 => (1u32..=99, 1u64..40).prop_map(|(percent, memory_gb)| Op::Share { percent, memory_gb }),
        3 => any::<usize>().prop_map(Op::Exit),
        2 => (0u32..3, 0u32..8, 0.0f32..100.0, 0u64..80)
            .prop_map(|(node, gpu, pct, used_gb)| Op::Load { node, gpu, pct, used_gb }),
        1 => (1i64..60).prop_map(Op::Wait),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// On any sequence of whole and shared jobs, exits and telemetry: the shares granted on a
    /// GPU never add up to more than 100%, a GPU never holds a whole-GPU job and shares at
    /// once, and shares only go to nodes that allow sharing.
    #[test]
    fn shares_never_overbook_or_mix_with_whole_gpus(
        config in prop_oneof![Just(Config::perch(vec![])), Just(Config::backfill()), Just(Config::fifo())],
        ops in proptest::collection::vec(op(), 1..100),
    ) {
        // Nodes 0 and 1 share (node 1 with two NVLink islands); node 2 does not.
        let mut c = Cluster::new();
        for (name, sharing, islands) in [
            ("s0", true, vec![]),
            ("s1", true, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]),
            ("w2", false, vec![]),
        ] {
            let mut spec = NodeSpec::new(name, 8, "H100", "r1");
            spec.sharing = sharing;
            spec.nvlink_islands = islands;
            c.add_node(spec).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        let mut s = Scheduler::new(c, config);
        for n in 0..3 {
            for g in 0..8 {
                s.step(0, telemetry(n, g, 0.0, 0)).map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
        }
        let mut running: HashMap<JobId, (Placement, Option<GpuShare>)> = HashMap::new();
        let mut shares: HashMap<JobId, GpuShare> = HashMap::new();
        let mut now = 0;
        let mut next = 0u64;
        for op in ops {
            let ev = match op {
                Op::Whole { gpus, limit_min } => {
                    next += 1;
                    Event::Submit(spec(next, 1, gpus, "a", limit_min * MINUTE, now))
                }
                Op::Share { percent, memory_gb } => {
                    next += 1;
                    let mut j = spec(next, 1, 1, "a", 30 * MINUTE, now);
                    let share = GpuShare { percent, memory_mb: memory_gb * 1000 };
                    j.share = Some(share);
                    shares.insert(j.id, share);
                    Event::Submit(j)
                }
                Op::Exit(i) if !running.is_empty() => {
                    let mut ids: Vec<JobId> = running.keys().copied().collect();
                    ids.sort();
                    Event::JobExited { job: ids[i % ids.len()], code: 0 }
                }
                Op::Exit(_) => Event::Tick,
                Op::Load { node, gpu, pct, used_gb } => telemetry(node, gpu, pct, used_gb * 1000),
                Op::Wait(m) => {
                    now += m * MINUTE;
                    Event::Tick
                }
            };
            let actions = s.step(now, ev.clone()).map_err(|e| TestCaseError::fail(format!("{ev:?}: {e}")))?;
            for a in actions {
                match a {
                    Action::Start { job, placement } => {
                        let share = shares.get(&job).copied();
                        if share.is_some() {
                            prop_assert_eq!(placement.len(), 1);
                            prop_assert_eq!(placement[0].mask.count_ones(), 1, "a share gets one GPU");
                            prop_assert!(placement[0].node != NodeId(2), "a share on a node that does not share");
                        }
                        prop_assert!(running.insert(job, (placement, share)).is_none());
                    }
                    Action::Preempt { job, .. } | Action::Requeue { job, .. } | Action::End { job, .. } => {
                        running.remove(&job);
                    }
                    Action::IdleReport { .. } => {}
                }
            }
            // Replay the books from the actions alone.
            let mut whole: HashSet<(NodeId, u32)> = HashSet::new();
            let mut percent: HashMap<(NodeId, u32), u32> = HashMap::new();
            for (placement, share) in running.values() {
                for a in placement {
                    for g in a.gpu_indices() {
                        match share {
                            None => prop_assert!(whole.insert((a.node, g)), "GPU {:?}/{} double-booked", a.node, g),
                            Some(sh) => *percent.entry((a.node, g)).or_default() += sh.percent,
                        }
                    }
                }
            }
            for (gpu, pct) in &percent {
                prop_assert!(*pct <= 100, "GPU {:?} shares add up to {}%", gpu, pct);
                prop_assert!(!whole.contains(gpu), "GPU {:?} holds a whole-GPU job and shares", gpu);
                let booked: u32 = s.cluster().sharers(gpu.0, gpu.1).iter().map(|(_, sh)| sh.percent).sum();
                prop_assert_eq!(booked, *pct, "the core's books disagree with its actions");
            }
        }
    }
}
