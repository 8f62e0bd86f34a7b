//! Property tests: random event sequences under every policy must never double-book a GPU,
//! never place part of a gang, never place on a down, drained or unhealthy GPU, and (with
//! borrowing off) never let an account exceed its quota. The core's own books must agree with
//! the actions it emitted.

mod common;

use common::spec;
use perch_scheduler::{
    Account, Action, Cluster, Config, Event, GpuHealth, IdleAction, JobId, MINUTE, NodeId,
    NodeState, Placement, Scheduler,
};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

#[derive(Clone, Debug)]
enum Op {
    Submit {
        nodes: u32,
        gpn: u32,
        account: u8,
        limit_min: i64,
    },
    Exit(usize),
    Cancel(usize),
    NodeDown(u32),
    NodeSilent(u32),
    NodeUp(u32),
    Drain(u32),
    Health {
        node: u32,
        gpu: u32,
        bad: bool,
    },
    Util {
        job: usize,
        pct: f32,
    },
    Wait(i64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u32..=3, prop_oneof![Just(1u32), Just(2), Just(4), Just(8)], 0u8..3, 1i64..240)
            .prop_map(|(nodes, gpn, account, limit_min)| Op::Submit { nodes, gpn, account, limit_min }),
        2 => any::<usize>().prop_map(Op::Exit),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => (0u32..6).prop_map(Op::NodeDown),
        1 => (0u32..6).prop_map(Op::NodeSilent),
        1 => (0u32..6).prop_map(Op::NodeUp),
        1 => (0u32..6).prop_map(Op::Drain),
        1 => (0u32..6, 0u32..8, any::<bool>()).prop_map(|(node, gpu, bad)| Op::Health { node, gpu, bad }),
        1 => (any::<usize>(), prop_oneof![Just(0.0f32), Just(90.0)]).prop_map(|(job, pct)| Op::Util { job, pct }),
        2 => (1i64..120).prop_map(Op::Wait),
    ]
}

fn configs() -> impl Strategy<Value = Config> {
    let quotas = vec![
        (Account("a0".into()), 16),
        (Account("a1".into()), 16),
        (Account("a2".into()), 8),
    ];
    prop_oneof![
        Just(Config::fifo()),
        Just(Config::backfill()),
        Just(Config::srtf()),
        Just(Config::las()),
        Just(Config::gittins()),
        Just(Config::themis()),
        Just(Config::perch(vec![])),
        Just({
            let mut c = Config::perch(vec![]);
            c.predict_from_history = false;
            c
        }),
        Just(Config::perch(quotas.clone())),
        Just({
            let mut c = Config::perch(quotas.clone());
            c.borrowing = false;
            c
        }),
        Just({
            let mut c = Config::perch(quotas);
            c.idle.action = IdleAction::Reclaim { requeue: true };
            c.idle.window = 10 * MINUTE;
            c
        }),
    ]
}

struct Model {
    running: HashMap<JobId, Placement>,
    shapes: HashMap<JobId, (u32, u32, String)>,
}

fn check_invariants(s: &Scheduler, m: &Model, config: &Config) -> Result<(), TestCaseError> {
    let mut seen = HashSet::new();
    let mut per_account: HashMap<&str, u32> = HashMap::new();
    for (job, p) in &m.running {
        let (nodes, gpn, account) = &m.shapes[job];
        prop_assert_eq!(
            p.len() as u32,
            *nodes,
            "gang {:?} placed on {} nodes, wants {}",
            job,
            p.len(),
            nodes
        );
        let distinct: HashSet<NodeId> = p.iter().map(|a| a.node).collect();
        prop_assert_eq!(distinct.len(), p.len(), "gang {:?} twice on a node", job);
        for a in p {
            prop_assert_eq!(
                a.mask.count_ones(),
                *gpn,
                "gang {:?} partly placed on {:?}",
                job,
                a.node
            );
            for g in a.gpu_indices() {
                prop_assert!(
                    seen.insert((a.node, g)),
                    "GPU {:?}/{} double-booked",
                    a.node,
                    g
                );
                prop_assert_eq!(s.cluster().owner(a.node, g), Some(*job));
            }
        }
        prop_assert_eq!(s.placement(*job), Some(p));
        *per_account.entry(account.as_str()).or_default() += nodes * gpn;
    }
    let held: usize = (0..s.cluster().len() as u32)
        .map(|n| {
            (0..8)
                .filter(|&g| s.cluster().owner(NodeId(n), g).is_some())
                .count()
        })
        .sum();
    prop_assert_eq!(
        held,
        seen.len(),
        "the core holds GPUs for jobs it never started"
    );
    if !config.quotas.is_empty() && !config.borrowing {
        for (a, q) in &config.quotas {
            let used = per_account.get(a.0.as_str()).copied().unwrap_or(0);
            prop_assert!(
                used <= *q,
                "account {} holds {} GPUs over quota {}",
                a,
                used,
                q
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn placements_stay_sound(config in configs(), ops in proptest::collection::vec(op(), 1..80)) {
        let cluster = Cluster::uniform(6, 8, "H100", 2).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut s = Scheduler::new(cluster, config.clone());
        let mut m = Model { running: HashMap::new(), shapes: HashMap::new() };
        let mut bad_gpus: HashSet<(u32, u32)> = HashSet::new();
        let mut now = 0i64;
        let mut next_id = 0u64;
        for op in ops {
            let running: Vec<JobId> = { let mut v: Vec<JobId> = m.running.keys().copied().collect(); v.sort(); v };
            let known: Vec<JobId> = { let mut v: Vec<JobId> = m.shapes.keys().copied().collect(); v.sort(); v };
            let ev = match op {
                Op::Submit { nodes, gpn, account, limit_min } => {
                    next_id += 1;
                    let mut j = spec(next_id, nodes, gpn, &format!("a{account}"), limit_min * MINUTE, now);
                    j.oracle_duration = Some(limit_min * MINUTE / 2);
                    m.shapes.insert(j.id, (nodes, gpn, j.account.0.clone()));
                    Event::Submit(j)
                }
                Op::Exit(i) if !running.is_empty() => Event::JobExited { job: running[i % running.len()], code: 0 },
                Op::Cancel(i) if !known.is_empty() => Event::Cancel(known[i % known.len()]),
                Op::Util { job, pct } if !running.is_empty() => Event::JobUtilization { job: running[job % running.len()], percent: pct },
                Op::Exit(_) | Op::Cancel(_) | Op::Util { .. } => Event::Tick,
                Op::NodeDown(n) => Event::NodeDown(NodeId(n)),
                Op::NodeSilent(n) => Event::NodeSilent(NodeId(n)),
                Op::NodeUp(n) => Event::NodeUp(NodeId(n)),
                Op::Drain(n) => Event::Drain(NodeId(n)),
                Op::Health { node, gpu, bad } => {
                    if bad { bad_gpus.insert((node, gpu)); } else { bad_gpus.remove(&(node, gpu)); }
                    let health = if bad { GpuHealth::UncorrectableEcc } else { GpuHealth::Healthy };
                    Event::GpuHealth { node: NodeId(node), gpu, health }
                }
                Op::Wait(min) => { now += min * MINUTE; Event::Tick }
            };
            let actions = match s.step(now, ev.clone()) {
                Ok(a) => a,
                // Cancelling a job that already ended is the caller's error, reported as such.
                Err(perch_scheduler::Error::UnknownJob(_)) if matches!(ev, Event::Cancel(_)) => continue,
                Err(e) => return Err(TestCaseError::fail(format!("{ev:?}: {e}"))),
            };
            for a in actions {
                match a {
                    Action::Start { job, placement } => {
                        for alloc in &placement {
                            prop_assert_eq!(s.cluster().state(alloc.node), Some(NodeState::Up), "placed on a node not up");
                            for g in alloc.gpu_indices() {
                                prop_assert!(!bad_gpus.contains(&(alloc.node.0, g)), "placed on unhealthy GPU");
                            }
                        }
                        prop_assert!(m.running.insert(job, placement).is_none(), "{:?} started twice", job);
                    }
                    Action::Preempt { job, .. } | Action::Requeue { job, .. } | Action::End { job, .. } => {
                        m.running.remove(&job);
                    }
                    Action::IdleReport { job, .. } => prop_assert!(m.running.contains_key(&job)),
                }
            }
            check_invariants(&s, &m, &config)?;
        }
    }
}

#[derive(Clone, Debug)]
enum BfOp {
    Submit {
        nodes: u32,
        gpn: u32,
        limit_min: i64,
    },
    Exit(usize),
    Wait(i64),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// EASY backfill: once a job holds a reservation for time `at`, it is running by the first
    /// pass at or after `at`, whatever was backfilled meanwhile.
    #[test]
    fn backfill_keeps_reservations(ops in proptest::collection::vec(prop_oneof![
        4 => (1u32..=2, prop_oneof![Just(1u32), Just(2), Just(4), Just(8)], 1i64..120)
            .prop_map(|(nodes, gpn, limit_min)| BfOp::Submit { nodes, gpn, limit_min }),
        2 => any::<usize>().prop_map(BfOp::Exit),
        2 => (1i64..60).prop_map(BfOp::Wait),
    ], 1..80)) {
        let cluster = Cluster::uniform(3, 8, "H100", 3).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut s = Scheduler::new(cluster, Config::backfill());
        let mut running: HashSet<JobId> = HashSet::new();
        let mut reserved: HashMap<JobId, i64> = HashMap::new();
        let mut now = 0;
        let mut next_id = 0;
        for op in ops {
            let ev = match op {
                BfOp::Submit { nodes, gpn, limit_min } => {
                    next_id += 1;
                    Event::Submit(spec(next_id, nodes, gpn, "a", limit_min * MINUTE, now))
                }
                BfOp::Exit(i) if !running.is_empty() => {
                    let mut v: Vec<JobId> = running.iter().copied().collect();
                    v.sort();
                    Event::JobExited { job: v[i % v.len()], code: 0 }
                }
                BfOp::Exit(_) => Event::Tick,
                BfOp::Wait(m) => {
                    // Stop at the earliest reservation so "the first pass at or after" is exact.
                    let target = now + m * MINUTE;
                    now = reserved.values().copied().filter(|&t| t > now).min().map_or(target, |t| t.min(target));
                    Event::Tick
                }
            };
            let actions = s.step(now, ev).map_err(|e| TestCaseError::fail(e.to_string()))?;
            for a in actions {
                match a {
                    Action::Start { job, .. } => { running.insert(job); reserved.remove(&job); }
                    Action::End { job, .. } => { running.remove(&job); }
                    other => prop_assert!(false, "unexpected {:?}", other),
                }
            }
            for (job, at) in &reserved {
                prop_assert!(now < *at, "{:?} reserved for {} still waits at {}", job, at, now);
            }
            for e in s.queue() {
                if let perch_scheduler::PendingReason::Reserved { at } = e.reason {
                    let earlier = reserved.insert(e.job, at);
                    prop_assert!(earlier.is_none_or(|t| at <= t), "{:?} reservation moved later: {:?} -> {}", e.job, earlier, at);
                }
            }
        }
    }
}
