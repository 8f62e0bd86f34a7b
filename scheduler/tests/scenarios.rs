//! Scenario tests on virtual time: each drives the core with events at chosen instants and
//! checks the actions (priority order, backfill that keeps the head's reservation, quota
//! reclaim, node failure and requeue, idle reclaim, health, time limits).

mod common;

use common::{exit, one, preempted, spec, started};
use perch_scheduler::{
    Account, Action, Cluster, Config, EndState, Event, GpuHealth, GpuModel, IdleAction, JobId,
    MINUTE, NodeId, NodeSpec, PendingReason, PreemptReason, RequeueReason, Scheduler,
};

fn sched(nodes: u32, config: Config) -> Scheduler {
    match Cluster::uniform(nodes, 8, "H100", 2) {
        Ok(c) => Scheduler::new(c, config),
        Err(e) => panic!("cluster: {e}"),
    }
}

/// Job `job`'s GPUs measured at `percent` at `now`.
fn utilization(s: &mut Scheduler, now: i64, job: u64, percent: f32) {
    step(
        s,
        now,
        Event::JobUtilization {
            job: JobId(job),
            percent,
        },
    );
}

fn step(s: &mut Scheduler, now: i64, ev: Event) -> Vec<Action> {
    match s.step(now, ev) {
        Ok(a) => a,
        Err(e) => panic!("step at {now}: {e}"),
    }
}

#[test]
fn priority_order_per_policy() {
    // On a full 1x8 node, three 8-GPU jobs wait: a long one first, a short one, a medium one.
    // When the node frees, which one starts?
    let check = |config: Config, expected: u64| {
        let mut s = sched(1, config.clone());
        step(&mut s, 0, Event::Submit(one(1, 8, "a", 60, 0)));
        step(&mut s, 1, Event::Submit(one(2, 8, "b", 24 * 60, 1)));
        step(&mut s, 2, Event::Submit(one(3, 8, "c", 10, 2)));
        step(&mut s, 3, Event::Submit(one(4, 8, "d", 120, 3)));
        let a = step(
            &mut s,
            10 * MINUTE,
            Event::JobExited {
                job: JobId(1),
                code: 0,
            },
        );
        assert_eq!(started(&a), vec![expected], "{:?}", config.kind);
    };
    check(Config::fifo(), 2);
    check(Config::backfill(), 2);
    check(Config::perch(vec![]), 3); // smallest declared GPU-time first
}

#[test]
fn fair_share_lowers_heavy_users() {
    let mut s = sched(1, Config::perch(vec![]));
    // Account "heavy" used the node for 10 hours; "light" never ran.
    step(&mut s, 0, Event::Submit(one(1, 8, "heavy", 11 * 60, 0)));
    step(
        &mut s,
        10 * 60 * MINUTE,
        Event::Submit(one(2, 8, "heavy", 60, 10 * 60 * MINUTE)),
    );
    step(
        &mut s,
        10 * 60 * MINUTE + 1,
        Event::Submit(one(3, 8, "light", 60, 10 * 60 * MINUTE + 1)),
    );
    let a = step(
        &mut s,
        10 * 60 * MINUTE + 20 * MINUTE,
        Event::JobExited {
            job: JobId(1),
            code: 0,
        },
    );
    assert_eq!(started(&a), vec![3]);
}

#[test]
fn backfill_never_delays_the_head_job() {
    let mut s = sched(1, Config::backfill());
    step(&mut s, 0, Event::Submit(one(1, 4, "a", 60, 0)));
    // Head: needs the whole node; reserved for t = 60 min.
    let a = step(&mut s, 1, Event::Submit(one(2, 8, "a", 60, 1)));
    assert!(started(&a).is_empty());
    assert_eq!(
        s.pending_reason(JobId(2)),
        Some(PendingReason::Reserved { at: 60 * MINUTE })
    );
    // A 4-GPU job of 2 hours would hold GPUs the head needs at 60 min: it must wait.
    let a = step(&mut s, 2, Event::Submit(one(3, 4, "a", 120, 2)));
    assert!(started(&a).is_empty());
    assert_eq!(s.pending_reason(JobId(3)), Some(PendingReason::Priority));
    // A 4-GPU job of 30 minutes ends before: it backfills.
    let a = step(&mut s, 3, Event::Submit(one(4, 4, "a", 30, 3)));
    assert_eq!(started(&a), vec![4]);
    // When job 1 ends at its limit, the head starts (job 4 has ended by then).
    step(
        &mut s,
        30 * MINUTE,
        Event::JobExited {
            job: JobId(4),
            code: 0,
        },
    );
    let a = step(&mut s, 60 * MINUTE, Event::Tick);
    assert!(
        a.contains(&Action::End {
            job: JobId(1),
            state: EndState::Timeout
        }),
        "{a:?}"
    );
    assert_eq!(started(&a), vec![2]);
}

#[test]
fn fifo_blocks_behind_the_head() {
    let mut s = sched(1, Config::fifo());
    step(&mut s, 0, Event::Submit(one(1, 4, "a", 60, 0)));
    step(&mut s, 1, Event::Submit(one(2, 8, "a", 60, 1)));
    let a = step(&mut s, 2, Event::Submit(one(3, 1, "a", 5, 2)));
    assert!(started(&a).is_empty());
    assert_eq!(s.pending_reason(JobId(3)), Some(PendingReason::FifoBlocked));
}

#[test]
fn reclaim_takes_back_borrowed_gpus_preferring_idle_victims() {
    let quotas = vec![(Account("a".into()), 8), (Account("b".into()), 8)];
    let mut s = sched(2, Config::perch(quotas));
    // b borrows a's idle node: two 8-GPU jobs.
    let a = step(&mut s, 0, Event::Submit(one(1, 8, "b", 600, 0)));
    assert_eq!(started(&a), vec![1]);
    let a = step(&mut s, MINUTE, Event::Submit(one(2, 8, "b", 600, MINUTE)));
    assert_eq!(started(&a), vec![2]);
    // Job 1 (the costlier one: it ran longer) has been measured idle for the idle window, so
    // it is the victim.
    utilization(&mut s, 2 * MINUTE, 1, 0.0);
    utilization(&mut s, 2 * MINUTE, 2, 95.0);
    let a = step(
        &mut s,
        33 * MINUTE,
        Event::Submit(one(3, 8, "a", 60, 33 * MINUTE)),
    );
    assert_eq!(preempted(&a), vec![1]);
    assert!(
        a.iter().any(|x| matches!(
            x,
            Action::Preempt {
                reason: PreemptReason::QuotaReclaim { for_job: JobId(3) },
                requeued: true,
                ..
            }
        )),
        "{a:?}"
    );
    assert_eq!(started(&a), vec![3]);
    assert_eq!(s.account_alloc(&Account("b".into())), 8);
    // b is at its quota now: a's next job may not take more from b.
    let a = step(
        &mut s,
        34 * MINUTE,
        Event::Submit(one(4, 8, "a", 60, 34 * MINUTE)),
    );
    assert!(preempted(&a).is_empty() && started(&a).is_empty());
}

#[test]
fn one_low_reading_does_not_make_a_busy_job_the_reclaim_victim() {
    // Found live: a utilization sample taken before the agent launched a job (or while it loads
    // its data) marked the older job idle for a moment, and quota reclaim took it instead of
    // the younger borrowed one.
    let quotas = vec![(Account("a".into()), 8), (Account("b".into()), 8)];
    let mut s = sched(2, Config::perch(quotas));
    step(&mut s, 0, Event::Submit(one(1, 8, "b", 600, 0)));
    step(&mut s, MINUTE, Event::Submit(one(2, 8, "b", 600, MINUTE)));
    utilization(&mut s, MINUTE, 1, 0.0);
    let a = step(
        &mut s,
        2 * MINUTE,
        Event::Submit(one(3, 8, "a", 60, 2 * MINUTE)),
    );
    assert_eq!(
        preempted(&a),
        vec![2],
        "the younger job loses the least work"
    );
    assert_eq!(started(&a), vec![3]);
}

/// Found running the release binary (jobs the CLI submits are not preemptible by default): a
/// job of an account past its quota that may not be preempted borrowed idle GPUs, and the
/// account whose quota they were could not take them back until its time limit. Only
/// preemptible jobs borrow.
#[test]
fn a_job_that_may_not_be_preempted_does_not_borrow() {
    let quotas = vec![(Account("a".into()), 8), (Account("b".into()), 0)];
    let mut s = sched(1, Config::perch(quotas));
    let mut fixed = one(1, 4, "b", 600, 0);
    fixed.preemptible = false;
    let a = step(&mut s, 0, Event::Submit(fixed));
    assert!(started(&a).is_empty(), "{a:?}");
    assert_eq!(
        s.pending_reason(JobId(1)),
        Some(PendingReason::QuotaExceeded)
    );
    // The same request, preemptible, borrows the idle GPUs...
    let a = step(&mut s, MINUTE, Event::Submit(one(2, 4, "b", 600, MINUTE)));
    assert_eq!(started(&a), vec![2]);
    // ...and the account whose quota they are takes them back at once.
    let a = step(
        &mut s,
        2 * MINUTE,
        Event::Submit(one(3, 8, "a", 60, 2 * MINUTE)),
    );
    assert_eq!((preempted(&a), started(&a)), (vec![2], vec![3]));
    assert_eq!(
        s.pending_reason(JobId(1)),
        Some(PendingReason::QuotaExceeded)
    );
}

/// A job that asks, on its own, for more than its account may hold can only ever borrow: the
/// core names the quota it asks past (in all, on its model, or on every model it could take),
/// so a server refuses it unless it is preemptible; without quotas nothing is past one.
#[test]
fn the_core_names_the_quota_a_job_asks_past_on_its_own() {
    use perch_scheduler::{BeyondQuota, GpuModel, NodeSpec, QuotaLimit};
    let h100 = GpuModel("H100".into());
    let with = |gpus: u32, account: &str, model: Option<&GpuModel>| {
        let mut j = one(1, gpus, account, 60, 0);
        j.gpu_model = model.cloned();
        j
    };
    let s = sched(2, Config::perch(vec![]));
    assert_eq!(s.beyond_quota(&with(16, "b", None)), None, "no quotas");

    let mut config = Config::perch(vec![(Account("a".into()), 8)]);
    config.model_quotas = vec![
        (Account("a".into()), h100.clone(), 4),
        (Account("c".into()), h100.clone(), 2),
        (Account("c".into()), GpuModel("A100".into()), 6),
    ];
    let mut s = Scheduler::new(Cluster::new(), config);
    for (name, model) in [("h1", "H100"), ("a1", "A100")] {
        step(
            &mut s,
            0,
            Event::AddNode(NodeSpec::new(name, 8, model, "r1")),
        );
    }
    let past = |account: &str, asks: u32, limit| BeyondQuota {
        account: Account(account.into()),
        asks: asks * 100,
        limit,
    };
    assert_eq!(s.beyond_quota(&with(8, "a", None)), None, "at its quota");
    assert_eq!(
        s.beyond_quota(&with(9, "a", None)),
        Some(past("a", 9, QuotaLimit::Total(8)))
    );
    // An unlisted account's quota is 0 once quotas are in force.
    let got = s.beyond_quota(&with(1, "b", None));
    assert_eq!(got, Some(past("b", 1, QuotaLimit::Total(0))));
    assert_eq!(
        got.map(|b| b.to_string()).unwrap_or_default(),
        "asks for 1 GPU(s), more than account b's quota of 0 GPU(s)"
    );
    // Constrained to H100, account a may hold 4 of them; unconstrained, it may take A100s.
    assert_eq!(
        s.beyond_quota(&with(5, "a", Some(&h100))),
        Some(past("a", 5, QuotaLimit::Model(h100.clone(), 4)))
    );
    assert_eq!(s.beyond_quota(&with(5, "a", None)), None);
    // c is not listed among the quotas in all, so its quota is 0: named before its caps.
    assert_eq!(
        s.beyond_quota(&with(1, "c", None)).map(|b| b.limit),
        Some(QuotaLimit::Total(0))
    );
    // Caps alone: a job free to take any model asks past the largest.
    let mut config = Config::perch(vec![]);
    config.model_quotas = vec![
        (Account("c".into()), h100.clone(), 2),
        (Account("c".into()), GpuModel("A100".into()), 6),
    ];
    s.reconfigure(config);
    assert_eq!(s.beyond_quota(&with(6, "c", None)), None);
    assert_eq!(
        s.beyond_quota(&with(7, "c", None)),
        Some(past("c", 7, QuotaLimit::EveryModel(6)))
    );
    assert_eq!(s.beyond_quota(&with(7, "d", None)), None, "d has no cap");
}

/// Found running the release binary: a job that started keeps its queue entry until the queue
/// is next cleaned, so borrowers reclaimed before then were listed twice by `perch queue`
/// (and reached twice by a pass, once at their old place). Each pending job is in line once.
#[test]
fn a_requeued_job_is_in_line_once() {
    let quotas = vec![(Account("a".into()), 8), (Account("b".into()), 0)];
    let mut s = sched(1, Config::perch(quotas));
    step(&mut s, 0, Event::Submit(one(1, 4, "b", 600, 0)));
    let a = step(&mut s, 1, Event::Submit(one(2, 4, "b", 600, 1)));
    assert_eq!(started(&a), vec![2]);
    let a = step(&mut s, 2, Event::Submit(one(3, 8, "a", 60, 2)));
    assert_eq!((preempted(&a).len(), started(&a)), (2, vec![3]), "{a:?}");
    let mut line: Vec<u64> = s.queue().iter().map(|q| q.job.0).collect();
    line.sort_unstable();
    assert_eq!(line, vec![1, 2]);
    // The same after a pass with nothing to start.
    step(&mut s, 3, Event::Tick);
    assert_eq!(s.queue().len(), 2, "{:?}", s.queue());
}

/// Found on the scorecard (Philly at 384 GPUs, trace quotas): by work at stake alone, the
/// borrower that just restarted is always the cheapest victim, so quota reclaim stopped one job
/// 240 times while others it could have stopped ran on. The job stopped least often goes
/// first: here the two borrowers take turns.
#[test]
fn quota_reclaim_does_not_stop_the_same_borrower_over_and_over() {
    let quotas = vec![(Account("a".into()), 8), (Account("b".into()), 0)];
    let mut s = sched(1, Config::perch(quotas));
    assert_eq!(
        started(&step(&mut s, 0, Event::Submit(one(1, 4, "b", 600, 0)))),
        vec![1]
    );
    let a = step(&mut s, MINUTE, Event::Submit(one(2, 4, "b", 600, MINUTE)));
    assert_eq!(started(&a), vec![2]);
    // Six rounds: a's 4-GPU job of five minutes takes back half the node, ends, and the
    // borrower it stopped comes back.
    let mut stops = [0u32; 2];
    for round in 0..6 {
        let t = (10 + 10 * round) * MINUTE;
        let id = 10 + round as u64;
        let a = step(&mut s, t, Event::Submit(one(id, 4, "a", 5, t)));
        let victims = preempted(&a);
        assert_eq!(victims.len(), 1, "round {round}: {a:?}");
        stops[victims[0] as usize - 1] += 1;
        assert_eq!(started(&a), vec![id], "round {round}");
        let back = step(&mut s, t + 5 * MINUTE, exit(id));
        assert_eq!(
            started(&back),
            victims,
            "round {round}: the borrower restarts"
        );
    }
    assert_eq!(stops, [3, 3], "each borrower stopped as often as the other");
}

#[test]
fn reclaim_preempts_whole_gangs_cheapest_first() {
    let quotas = vec![(Account("a".into()), 16), (Account("b".into()), 0)];
    let mut s = sched(2, Config::perch(quotas));
    // b holds both nodes: a 2-node gang (started first) and nothing else.
    let a = step(
        &mut s,
        0,
        Event::Submit(spec(1, 2, 4, "b", 600 * MINUTE, 0)),
    );
    assert_eq!(started(&a), vec![1]);
    let a = step(
        &mut s,
        MINUTE,
        Event::Submit(spec(2, 2, 4, "b", 600 * MINUTE, MINUTE)),
    );
    assert_eq!(started(&a), vec![2]);
    // a needs 4 GPUs on one node: one gang must go, the one with less work at stake (job 2).
    let a = step(
        &mut s,
        2 * MINUTE,
        Event::Submit(one(3, 4, "a", 60, 2 * MINUTE)),
    );
    assert_eq!(preempted(&a), vec![2]);
    assert_eq!(started(&a), vec![3]);
    assert!(s.placement(JobId(2)).is_none());
}

#[test]
fn node_failure_requeues_then_fails() {
    let mut s = sched(2, Config::backfill());
    let a = step(&mut s, 0, Event::Submit(one(1, 8, "a", 60, 0)));
    assert_eq!(started(&a), vec![1]);
    let node = s.placement(JobId(1)).map(|p| p[0].node);
    let Some(node) = node else {
        panic!("job 1 has no placement")
    };
    let a = step(&mut s, MINUTE, Event::NodeDown(node));
    assert_eq!(
        a[0],
        Action::Requeue {
            job: JobId(1),
            reason: RequeueReason::NodeFail
        }
    );
    assert_eq!(started(&a), vec![1], "restarts on the other node");
    let other = s.placement(JobId(1)).map(|p| p[0].node);
    assert_ne!(other, Some(node));
    let Some(other) = other else {
        panic!("job 1 has no placement")
    };
    // max_requeues = 1: the second failure ends it.
    let a = step(&mut s, 2 * MINUTE, Event::NodeDown(other));
    assert_eq!(
        a,
        vec![Action::End {
            job: JobId(1),
            state: EndState::NodeFail
        }]
    );
}

#[test]
fn idle_jobs_are_reported_then_reclaimed_when_others_wait() {
    let mut config = Config::perch(vec![]);
    config.idle.window = 30 * MINUTE;
    config.idle.grace = 0;
    config.idle.action = IdleAction::Reclaim { requeue: false };
    let mut s = sched(1, config);
    step(&mut s, 0, Event::Submit(one(1, 8, "a", 600, 0)));
    utilization(&mut s, MINUTE, 1, 0.0);
    assert_eq!(s.next_wakeup(), Some(31 * MINUTE));
    // Idle past the window but nobody waits: only a report.
    let a = step(&mut s, 31 * MINUTE, Event::Tick);
    assert_eq!(
        a,
        vec![Action::IdleReport {
            job: JobId(1),
            since: MINUTE
        }]
    );
    // Someone waits: the idle job is reclaimed and the waiter starts.
    let a = step(
        &mut s,
        32 * MINUTE,
        Event::Submit(one(2, 8, "b", 60, 32 * MINUTE)),
    );
    assert_eq!(
        a[0],
        Action::Preempt {
            job: JobId(1),
            reason: PreemptReason::Idle,
            requeued: false
        }
    );
    assert_eq!(started(&a), vec![2]);
}

#[test]
fn busy_again_resets_the_idle_spell() {
    let mut config = Config::perch(vec![]);
    config.idle.action = IdleAction::Reclaim { requeue: true };
    let mut s = sched(1, config);
    step(&mut s, 0, Event::Submit(one(1, 8, "a", 600, 0)));
    step(
        &mut s,
        MINUTE,
        Event::GpuUtilization {
            node: NodeId(0),
            gpu: 0,
            percent: 0.0,
            memory_used_mb: None,
            memory_total_mb: None,
        },
    );
    step(
        &mut s,
        20 * MINUTE,
        Event::GpuUtilization {
            node: NodeId(0),
            gpu: 0,
            percent: 80.0,
            memory_used_mb: None,
            memory_total_mb: None,
        },
    );
    let a = step(
        &mut s,
        40 * MINUTE,
        Event::Submit(one(2, 8, "b", 60, 40 * MINUTE)),
    );
    assert!(preempted(&a).is_empty(), "{a:?}");
}

#[test]
fn unhealthy_gpus_and_drained_nodes_get_no_work() {
    let mut s = sched(2, Config::backfill());
    step(&mut s, 0, Event::Drain(NodeId(1)));
    step(
        &mut s,
        0,
        Event::GpuHealth {
            node: NodeId(0),
            gpu: 3,
            health: GpuHealth::Xid(79),
        },
    );
    assert_eq!(
        s.cluster().gpu_health(NodeId(0), 3),
        Some(GpuHealth::Xid(79)),
        "the reason is kept for the fleet view"
    );
    assert_eq!(
        s.cluster().gpu_health(NodeId(0), 2),
        Some(GpuHealth::Healthy)
    );
    assert_eq!(s.cluster().gpu_health(NodeId(0), 8), None);
    let a = step(&mut s, 1, Event::Submit(one(1, 8, "a", 60, 1)));
    assert!(started(&a).is_empty());
    let a = step(&mut s, 2, Event::Submit(one(2, 7, "a", 60, 2)));
    assert_eq!(started(&a), vec![2]);
    let gpus: Vec<u32> = s
        .placement(JobId(2))
        .map(|p| p[0].gpu_indices())
        .unwrap_or_default();
    assert_eq!(gpus, vec![0, 1, 2, 4, 5, 6, 7]);
    let a = step(&mut s, 3, Event::Resume(NodeId(1)));
    assert_eq!(started(&a), vec![1]);
}

/// A drained node that went down and came back took jobs again (the drain was
/// lost), and resuming a node that was down marked it up while its agent was silent.
#[test]
fn a_drain_outlives_the_node_going_down_and_resume_does_not_revive_a_down_node() {
    let mut s = sched(1, Config::backfill());
    step(&mut s, 0, Event::Drain(NodeId(0)));
    step(&mut s, 1, Event::NodeDown(NodeId(0)));
    step(&mut s, 2, Event::NodeUp(NodeId(0)));
    let a = step(&mut s, 3, Event::Submit(one(1, 1, "a", 60, 3)));
    assert!(started(&a).is_empty(), "the node is still drained: {a:?}");
    let a = step(&mut s, 4, Event::Resume(NodeId(0)));
    assert_eq!(started(&a), vec![1]);
    // Drained while down: it comes back drained too.
    step(&mut s, 6, Event::NodeDown(NodeId(0)));
    step(&mut s, 7, Event::Drain(NodeId(0)));
    step(&mut s, 8, Event::NodeUp(NodeId(0)));
    let a = step(&mut s, 9, Event::Submit(one(2, 1, "a", 60, 9)));
    assert!(started(&a).is_empty(), "drained while down: {a:?}");
    // Resuming a down node leaves it down until its agent reports.
    step(&mut s, 10, Event::NodeDown(NodeId(0)));
    step(&mut s, 11, Event::Resume(NodeId(0)));
    let a = step(&mut s, 12, Event::Tick);
    assert!(started(&a).is_empty(), "resumed but still down: {a:?}");
    let a = step(&mut s, 13, Event::NodeUp(NodeId(0)));
    let mut both = started(&a);
    both.sort_unstable();
    assert!(both.contains(&2), "{a:?}");
}

/// A node that stops reporting keeps its jobs until its lease runs out (they may
/// still run there; requeueing them at once could run them twice) but takes no new ones.
#[test]
fn a_silent_node_keeps_its_jobs_takes_no_new_ones_and_fails_them_only_when_down() {
    let mut s = sched(2, Config::backfill());
    let a = step(&mut s, 0, Event::Submit(one(1, 8, "a", 60, 0)));
    assert_eq!(started(&a), vec![1]);
    let node = s.placement(JobId(1)).map(|p| p[0].node).expect("placed");
    let other = NodeId(1 - node.0);
    step(&mut s, 1, Event::Drain(other));
    let a = step(&mut s, 2, Event::NodeSilent(node));
    assert!(a.is_empty(), "nothing requeued while the lease runs: {a:?}");
    assert_eq!(
        s.cluster().state(node),
        Some(perch_scheduler::NodeState::Unreachable)
    );
    // A silent drained node stays drained when it comes back.
    step(&mut s, 3, Event::NodeSilent(other));
    step(&mut s, 4, Event::NodeUp(other));
    assert_eq!(
        s.cluster().state(other),
        Some(perch_scheduler::NodeState::Drained)
    );
    step(&mut s, 5, Event::Resume(other));
    // Job 1 still holds its GPUs; job 2 goes to the other node, not the silent one.
    let a = step(&mut s, 6, Event::Submit(one(2, 8, "a", 60, 6)));
    assert_eq!(started(&a), vec![2]);
    assert_eq!(s.placement(JobId(2)).map(|p| p[0].node), Some(other));
    let a = step(&mut s, 7, Event::Submit(one(3, 8, "a", 60, 7)));
    assert!(started(&a).is_empty(), "not on the silent node: {a:?}");
    // It reports again: job 1 ran all along, job 3 starts once job 1 ends.
    step(&mut s, 8, Event::NodeUp(node));
    let a = step(
        &mut s,
        9,
        Event::JobExited {
            job: JobId(1),
            code: 0,
        },
    );
    assert_eq!(started(&a), vec![3]);
    // Silent, then down (the lease ran out): now its job is requeued.
    step(&mut s, 10, Event::NodeSilent(node));
    let a = step(&mut s, 11, Event::NodeDown(node));
    assert!(
        a.iter()
            .any(|a| matches!(a, Action::Requeue { job, .. } if *job == JobId(3))),
        "{a:?}"
    );
}

#[test]
fn impossible_gangs_do_not_block_fifo() {
    let mut s = sched(1, Config::fifo());
    step(&mut s, 0, Event::Submit(spec(1, 4, 8, "a", 60 * MINUTE, 0)));
    let a = step(&mut s, 1, Event::Submit(one(2, 8, "a", 60, 1)));
    assert_eq!(started(&a), vec![2]);
    assert_eq!(
        s.pending_reason(JobId(1)),
        Some(PendingReason::Unsatisfiable)
    );
}

/// Whether any node could ever run a job is worked out once per pass for each kind of request
/// (its gang, its model, its share's memory), and requests that differ in any of them get
/// their own answer: on a full cluster, hundreds of 16-GPU tasks on 8-GPU nodes and a job
/// for a model the fleet lacks can never run, while the same gang on the fleet's model waits
/// for GPUs with a reservation; a node of 16 GPUs joining makes the first kind runnable.
#[test]
fn what_no_node_can_run_is_known_per_kind_of_request() {
    let mut s = sched(2, Config::backfill());
    let a = step(&mut s, 0, Event::Submit(one(1, 8, "a", 60, 0)));
    let b = step(&mut s, 0, Event::Submit(one(2, 8, "a", 60, 0)));
    assert_eq!([started(&a), started(&b)], [vec![1], vec![2]]);
    let too_big = 3..203;
    for id in too_big.clone() {
        step(&mut s, 1, Event::Submit(one(id, 16, "a", 60, 1)));
    }
    let on_model = |id, model: &str| {
        let mut j = one(id, 8, "a", 60, 2);
        j.gpu_model = Some(GpuModel(model.into()));
        j
    };
    step(&mut s, 2, Event::Submit(on_model(203, "A100")));
    step(&mut s, 2, Event::Submit(on_model(204, "H100")));
    for job in [too_big.start, too_big.end - 1, 203] {
        assert_eq!(
            s.pending_reason(JobId(job)),
            Some(PendingReason::Unsatisfiable),
            "job {job}"
        );
    }
    assert!(
        matches!(
            s.pending_reason(JobId(204)),
            Some(PendingReason::Reserved { .. })
        ),
        "{:?}",
        s.pending_reason(JobId(204))
    );
    let a = step(
        &mut s,
        3,
        Event::AddNode(NodeSpec::new("big", 16, "H100", "r9")),
    );
    assert_eq!(started(&a), vec![too_big.start]);
    assert_eq!(
        s.pending_reason(JobId(203)),
        Some(PendingReason::Unsatisfiable)
    );
}

#[test]
fn srtf_preempts_longer_jobs() {
    let mut s = sched(1, Config::srtf());
    let mut long = one(1, 8, "a", 600, 0);
    long.oracle_duration = Some(500 * MINUTE);
    step(&mut s, 0, Event::Submit(long));
    let mut short = one(2, 8, "a", 60, MINUTE);
    short.oracle_duration = Some(10 * MINUTE);
    let a = step(&mut s, MINUTE, Event::Submit(short));
    assert_eq!(preempted(&a), vec![1]);
    assert_eq!(started(&a), vec![2]);
}

/// LAS knows no duration: a job that has run past the threshold (8 GPUs x 10 min = 4,800
/// GPU-seconds, over the 3,600 set here) gives way to a new one, once; the second time it runs
/// to its end however many newcomers wait.
#[test]
fn las_preempts_the_most_served_once() {
    let mut config = Config::las();
    config.las_threshold_gpu_seconds = 3600.0;
    let mut s = sched(1, config);
    step(&mut s, 0, Event::Submit(one(1, 8, "a", 600, 0)));
    // Under the threshold (8 GPUs x 5 min = 2,400 GPU-s): the newcomer waits.
    let a = step(
        &mut s,
        5 * MINUTE,
        Event::Submit(one(2, 8, "b", 600, 5 * MINUTE)),
    );
    assert!(preempted(&a).is_empty() && started(&a).is_empty(), "{a:?}");
    // Past it: the next pass gives the GPUs to the waiting job, and the served one waits.
    let a = step(&mut s, 10 * MINUTE, Event::Tick);
    assert_eq!((preempted(&a), started(&a)), (vec![1], vec![2]));
    assert!(matches!(
        a.iter().find(|x| matches!(x, Action::Preempt { .. })),
        Some(Action::Preempt {
            reason: PreemptReason::LessServed { for_job: JobId(2) },
            requeued: true,
            ..
        })
    ));
    // Job 2 passes the threshold; job 1 (under its own 4,800 already) waits behind it as
    // the more served: nothing moves.
    let a = step(&mut s, 20 * MINUTE, Event::Tick);
    assert!(preempted(&a).is_empty(), "{a:?}");
    // Job 2 ends; job 1 runs again and is past the threshold, but was preempted once already:
    // a newcomer waits for it.
    let a = step(
        &mut s,
        30 * MINUTE,
        Event::JobExited {
            job: JobId(2),
            code: 0,
        },
    );
    assert_eq!(started(&a), vec![1]);
    let a = step(
        &mut s,
        31 * MINUTE,
        Event::Submit(one(3, 8, "c", 60, 31 * MINUTE)),
    );
    assert!(preempted(&a).is_empty() && started(&a).is_empty(), "{a:?}");
}

/// 2D-Gittins runs as LAS until 20 jobs have finished (a job past LAS's threshold gives way to
/// a newcomer); after, the queue is ordered by index and a higher index does not preempt: once
/// 20 one-GPU jobs of a minute have ended, a newcomer waits for the end of an 8-GPU job that
/// has run far past them.
#[test]
fn gittins_runs_as_las_until_it_has_an_index() {
    let mut config = Config::gittins();
    config.las_threshold_gpu_seconds = 3600.0;
    let mut s = sched(1, config);
    step(&mut s, 0, Event::Submit(one(900, 8, "x", 3_600, 0)));
    step(&mut s, 0, Event::Submit(one(901, 8, "y", 3_600, 0)));
    // 8 GPUs x 10 min is past the threshold: as LAS, job 900 gives way.
    let a = step(&mut s, 10 * MINUTE, Event::Tick);
    assert_eq!(
        (preempted(&a), started(&a)),
        (vec![900], vec![901]),
        "{a:?}"
    );
    step(
        &mut s,
        11 * MINUTE,
        Event::JobExited {
            job: JobId(901),
            code: 0,
        },
    );
    step(
        &mut s,
        12 * MINUTE,
        Event::JobExited {
            job: JobId(900),
            code: 0,
        },
    );
    let mut t = 12 * MINUTE;
    for k in 1..=20u64 {
        step(&mut s, t, Event::Submit(one(k, 1, "a", 600, t)));
        t += MINUTE;
        step(
            &mut s,
            t,
            Event::JobExited {
                job: JobId(k),
                code: 0,
            },
        );
    }
    let a = step(&mut s, t, Event::Submit(one(100, 8, "b", 3_600, t)));
    assert_eq!(started(&a), vec![100]);
    step(
        &mut s,
        t + MINUTE,
        Event::Submit(one(102, 8, "d", 3_600, t + MINUTE)),
    );
    // Past the threshold and far past what finished jobs used: it keeps its GPUs.
    let a = step(&mut s, t + 20 * MINUTE, Event::Tick);
    assert!(preempted(&a).is_empty(), "{a:?}");
    let a = step(
        &mut s,
        t + 30 * MINUTE,
        Event::JobExited {
            job: JobId(100),
            code: 0,
        },
    );
    assert_eq!(started(&a), vec![102], "{a:?}");
}

#[test]
fn bad_input_is_an_error() {
    let mut s = sched(1, Config::fifo());
    assert!(s.step(0, Event::Submit(one(1, 0, "a", 60, 0))).is_err());
    assert!(s.step(0, Event::Submit(one(1, 1, "", 60, 0))).is_err());
    assert!(
        s.step(
            0,
            Event::JobExited {
                job: JobId(9),
                code: 0
            }
        )
        .is_err()
    );
    assert!(s.step(0, Event::NodeDown(NodeId(5))).is_err());
    assert!(
        s.step(
            0,
            Event::GpuHealth {
                node: NodeId(0),
                gpu: 8,
                health: GpuHealth::Healthy
            }
        )
        .is_err()
    );
    assert!(s.step(0, Event::Submit(one(1, 1, "a", 60, 0))).is_ok());
    assert!(s.step(0, Event::Submit(one(1, 1, "a", 60, 0))).is_err());
}

#[test]
fn nodes_join_a_live_cluster_and_running_jobs_are_restored_after_a_restart() {
    use perch_scheduler::{GpuModel, NodeAlloc, NodeSpec};
    let node = |name: &str, model: &str| NodeSpec::new(name, 8, model, "r1");
    let mut s = Scheduler::new(Cluster::new(), Config::perch(vec![]));
    // A job for a model no node has yet waits; it starts once such a node joins.
    let mut h200 = one(1, 4, "a", 60, 0);
    h200.gpu_model = Some(GpuModel("H200".into()));
    assert!(started(&step(&mut s, 0, Event::Submit(h200))).is_empty());
    assert!(started(&step(&mut s, 1, Event::AddNode(node("n1", "H100")))).is_empty());
    assert_eq!(
        started(&step(&mut s, 2, Event::AddNode(node("n2", "H200")))),
        vec![1]
    );

    // After a restart: the same nodes, the running job put back on its GPUs without a Start,
    // and those GPUs not given to anyone else.
    let mut r = Scheduler::new(Cluster::new(), Config::perch(vec![]));
    step(&mut r, 10, Event::AddNode(node("n1", "H100")));
    let placement = vec![NodeAlloc {
        node: NodeId(0),
        mask: 0b1111_1111,
    }];
    let restored = step(
        &mut r,
        10,
        Event::Restore {
            spec: one(7, 8, "a", 60, 0),
            placement: placement.clone(),
            start: 5,
            requeues: 0,
        },
    );
    assert!(started(&restored).is_empty(), "{restored:?}");
    assert_eq!(r.placement(JobId(7)), Some(&placement));
    assert!(started(&step(&mut r, 11, Event::Submit(one(8, 1, "b", 60, 11)))).is_empty());
    // Restoring onto GPUs already taken is refused.
    let clash = r.step(
        12,
        Event::Restore {
            spec: one(9, 1, "a", 60, 0),
            placement,
            start: 5,
            requeues: 0,
        },
    );
    assert!(clash.is_err());
    // Its exit frees the node for the waiting job.
    assert_eq!(
        started(&step(
            &mut r,
            20,
            Event::JobExited {
                job: JobId(7),
                code: 0
            }
        )),
        vec![8]
    );
}

#[test]
fn a_lost_job_is_requeued_while_requeues_last() {
    let mut s = sched(1, Config::perch(vec![]));
    let mut spec = one(1, 8, "a", 60, 0);
    spec.max_requeues = 1;
    assert_eq!(started(&step(&mut s, 0, Event::Submit(spec))), vec![1]);
    let a = step(&mut s, 10, Event::JobLost(JobId(1)));
    assert!(
        a.contains(&Action::Requeue {
            job: JobId(1),
            reason: RequeueReason::NodeFail
        }),
        "{a:?}"
    );
    assert_eq!(started(&a), vec![1], "restarted at once on the freed GPUs");
    let a = step(&mut s, 20, Event::JobLost(JobId(1)));
    assert!(
        a.contains(&Action::End {
            job: JobId(1),
            state: EndState::NodeFail
        }),
        "{a:?}"
    );
    assert!(
        s.step(30, Event::JobLost(JobId(1))).is_err(),
        "no longer running"
    );
}

#[test]
fn an_evicted_job_moves_to_another_node_without_using_its_requeue_budget() {
    let mut s = sched(2, Config::perch(vec![]));
    let spec = one(1, 8, "a", 600, 0); // max_requeues 0: a failure would end it
    assert_eq!(started(&step(&mut s, 0, Event::Submit(spec))), vec![1]);
    let holds =
        |s: &Scheduler, n: u32| (0..8).any(|g| s.cluster().owner(NodeId(n), g) == Some(JobId(1)));
    // The node it runs on is drained for repair; then the job is evicted.
    let bad = NodeId(if holds(&s, 0) { 0 } else { 1 });
    step(&mut s, 5, Event::Drain(bad));
    let a = step(&mut s, 10, Event::Evict(JobId(1)));
    assert!(
        a.contains(&Action::Preempt {
            job: JobId(1),
            reason: PreemptReason::Evicted,
            requeued: true
        }),
        "{a:?}"
    );
    assert_eq!(started(&a), vec![1], "restarted at once on the other node");
    assert!(!holds(&s, bad.0), "not back on the drained node");
    assert!(holds(&s, 1 - bad.0));
    assert!(
        s.step(20, Event::Evict(JobId(99))).is_err(),
        "an unknown job is an error"
    );
}

#[test]
fn an_idle_job_is_warned_and_reclaimed_only_after_its_grace() {
    let mut config = Config::perch(vec![]);
    config.idle.window = 30 * MINUTE;
    config.idle.grace = 10 * MINUTE;
    config.idle.action = IdleAction::Reclaim { requeue: true };
    let mut s = sched(1, config);
    step(&mut s, 0, Event::Submit(one(1, 8, "a", 600, 0)));
    utilization(&mut s, MINUTE, 1, 0.0);
    step(
        &mut s,
        2 * MINUTE,
        Event::Submit(one(2, 8, "b", 60, 2 * MINUTE)),
    );
    // The window ends: the warning (report), not yet the preemption, though someone waits.
    let a = step(&mut s, 31 * MINUTE, Event::Tick);
    assert_eq!(
        a,
        vec![Action::IdleReport {
            job: JobId(1),
            since: MINUTE
        }]
    );
    assert_eq!(s.idle_jobs(), vec![(JobId(1), MINUTE, true)]);
    assert_eq!(s.next_wakeup(), Some(41 * MINUTE), "the grace's end");
    let a = step(&mut s, 40 * MINUTE, Event::Tick);
    assert!(preempted(&a).is_empty(), "{a:?}");
    let a = step(&mut s, 41 * MINUTE, Event::Tick);
    assert_eq!(
        a[0],
        Action::Preempt {
            job: JobId(1),
            reason: PreemptReason::Idle,
            requeued: true
        }
    );
    assert_eq!(started(&a), vec![2]);
}

#[test]
fn a_new_policy_applies_to_queued_and_running_jobs_without_stopping_them() {
    let mut s = sched(2, Config::perch(vec![]));
    let a = step(&mut s, 0, Event::Submit(one(1, 8, "b", 600, 0)));
    assert_eq!(started(&a), vec![1]);
    let a = step(&mut s, MINUTE, Event::Submit(one(2, 8, "b", 600, MINUTE)));
    assert_eq!(started(&a), vec![2]);
    // Quotas arrive: b is now over its quota of 8, a (unknown to the core so far) gets 8.
    let quotas = vec![(Account("a".into()), 8), (Account("b".into()), 8)];
    s.reconfigure(Config::perch(quotas));
    assert_eq!(s.account_alloc(&Account("b".into())), 16, "nothing stopped");
    let a = step(&mut s, 2 * MINUTE, Event::Tick);
    assert!(
        preempted(&a).is_empty(),
        "the change alone stops nothing: {a:?}"
    );
    // a submits within its quota: one of b's borrowed jobs is reclaimed.
    let a = step(
        &mut s,
        3 * MINUTE,
        Event::Submit(one(3, 8, "a", 60, 3 * MINUTE)),
    );
    assert_eq!(preempted(&a).len(), 1, "{a:?}");
    assert_eq!(started(&a), vec![3]);
    // Back to no quotas: every account is unlimited again.
    s.reconfigure(Config::perch(vec![]));
    let a = step(
        &mut s,
        4 * MINUTE,
        Event::Submit(one(4, 8, "c", 60, 4 * MINUTE)),
    );
    assert!(preempted(&a).is_empty(), "no quotas, no reclaim: {a:?}");
}

/// The GPUs an idle job gives up go to the job that waited for them, never back to the idle
/// job (requeued, it is older and might rank first); and an idle job nobody waiting could
/// use is left alone.
#[test]
fn idle_reclaim_frees_gpus_for_a_waiting_job_only() {
    let mut config = Config::perch(vec![]);
    config.idle.window = 30 * MINUTE;
    config.idle.grace = 0;
    config.idle.action = IdleAction::Reclaim { requeue: true };
    let mut s = sched(1, config);
    step(&mut s, 0, Event::Submit(one(1, 8, "a", 600, 0)));
    utilization(&mut s, MINUTE, 1, 0.0);
    // A job no node can ever run waits: nothing to free the idle GPUs for.
    let mut huge = one(2, 8, "b", 60, 2 * MINUTE);
    huge.shape.nodes = 2;
    step(&mut s, 2 * MINUTE, Event::Submit(huge));
    let a = step(&mut s, 40 * MINUTE, Event::Tick);
    assert!(preempted(&a).is_empty(), "{a:?}");
    // One that fits on the idle job's GPUs: it gets them, the idle job waits.
    let a = step(
        &mut s,
        41 * MINUTE,
        Event::Submit(one(3, 8, "b", 60, 41 * MINUTE)),
    );
    assert_eq!(preempted(&a), vec![1]);
    assert_eq!(started(&a), vec![3]);
    let a = step(&mut s, 42 * MINUTE, Event::Tick);
    assert!(started(&a).is_empty(), "{a:?}");
}

/// `squeue --start`: the job backfill reserved for (the small one: it ranks first) keeps the
/// reservation's time; the next one starts once that one's time limit has passed (running
/// jobs assumed to run to their limits); a job over its quota gets no estimate.
#[test]
fn pending_jobs_get_the_start_the_plan_promises() {
    let quotas = vec![(Account("a".into()), 16), (Account("q".into()), 0)];
    let mut config = Config::perch(quotas);
    config.borrowing = false;
    let mut s = sched(1, config);
    let a = step(&mut s, 0, Event::Submit(one(1, 8, "a", 60, 0)));
    assert_eq!(started(&a), vec![1]);
    step(&mut s, MINUTE, Event::Submit(one(2, 8, "a", 30, MINUTE)));
    step(
        &mut s,
        2 * MINUTE,
        Event::Submit(one(3, 4, "a", 10, 2 * MINUTE)),
    );
    step(
        &mut s,
        3 * MINUTE,
        Event::Submit(one(4, 1, "q", 10, 3 * MINUTE)),
    );
    let plan = s.start_plan(3 * MINUTE, 100, None).estimate();
    let at = |id: u64| plan.iter().find(|(j, _)| j.0 == id).map(|(_, t)| *t);
    assert_eq!(
        s.pending_reason(JobId(3)),
        Some(PendingReason::Reserved { at: 60 * MINUTE })
    );
    assert_eq!(at(3), Some(Some(60 * MINUTE)), "{plan:?}");
    assert_eq!(at(2), Some(Some(70 * MINUTE)), "{plan:?}");
    assert_eq!(at(4), Some(None), "over its quota: {plan:?}");
    // As far as one job: the jobs ahead of it, and it.
    let upto = s.start_plan(3 * MINUTE, 100, Some(JobId(3))).estimate();
    assert_eq!(
        upto.last(),
        Some(&(JobId(3), Some(60 * MINUTE))),
        "{upto:?}"
    );
    assert!(
        upto.iter().all(|(j, _)| j.0 != 2),
        "the job behind it: {upto:?}"
    );
}

/// A long queue of small jobs: every one of the first 1,000 gets an estimate, in queue order
/// of time, eight at a time on eight GPUs (the plan's work grows with the queue, not its
/// square: 417 of them used to run out of the plan's budget).
#[test]
fn a_long_queue_is_estimated_to_its_end() {
    let mut s = sched(1, Config::backfill());
    for id in 1..=2_000 {
        step(&mut s, 0, Event::Submit(one(id, 1, "a", 15, 0)));
    }
    let plan = s.start_plan(0, 1_000, None).estimate();
    assert_eq!(plan.len(), 1_000);
    let times: Vec<i64> = plan.iter().map(|(_, t)| t.expect("estimated")).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    // Jobs 9-16 wait for the first eight to reach their 15 minutes, and so on.
    assert_eq!(times[0], 15 * MINUTE);
    assert_eq!(times[999], (999 / 8 + 1) * 15 * MINUTE);
}

/// Quota reclaim for a gang takes the victims where the gang needs them: an account over its
/// quota with 1-GPU jobs, all as cheap as each other, gives up two on each node for a 2-node
/// gang of 2 GPUs a node (it used to offer only its first eight, all on one node, and the gang
/// waited behind a reservation instead).
#[test]
fn quota_reclaim_frees_gpus_where_the_gang_needs_them() {
    let quotas = vec![(Account("a".into()), 8), (Account("b".into()), 8)];
    let mut s = sched(2, Config::perch(quotas));
    // a fills both nodes with 1-GPU jobs (16 of 16 GPUs: 8 of them borrowed).
    for id in 1..=16 {
        step(&mut s, 0, Event::Submit(one(id, 1, "a", 600, 0)));
    }
    assert_eq!(s.account_alloc(&Account("a".into())), 16);
    let a = step(
        &mut s,
        MINUTE,
        Event::Submit(spec(100, 2, 2, "b", 60 * MINUTE, MINUTE)),
    );
    assert_eq!(started(&a), vec![100], "{a:?}");
    let freed = preempted(&a);
    assert_eq!(freed.len(), 4, "the fewest: {a:?}");
    assert_eq!(
        freed.iter().filter(|&&j| j <= 8).count(),
        2,
        "two on each node: {freed:?}"
    );
    assert_eq!(
        s.account_alloc(&Account("a".into())),
        12,
        "still above its quota"
    );
}

#[test]
fn per_model_quotas_steer_unconstrained_jobs_cap_constrained_ones_and_are_reclaimed() {
    use perch_scheduler::{GpuModel, NodeSpec};
    let h100 = GpuModel("H100".into());
    let mut config = Config::perch(vec![]);
    // vision may hold at most 8 H100s (no cap on A100s, no quota in all); nlp at most 8.
    config.model_quotas = vec![
        (Account("vision".into()), h100.clone(), 8),
        (Account("nlp".into()), h100.clone(), 8),
    ];
    config.borrowing = false;
    let mut s = Scheduler::new(Cluster::new(), config.clone());
    for (name, model) in [("h1", "H100"), ("h2", "H100"), ("a1", "A100")] {
        step(
            &mut s,
            0,
            Event::AddNode(NodeSpec::new(name, 8, model, "r1")),
        );
    }
    let on = |s: &Scheduler, id: u64| s.placement(JobId(id)).map(|p| p[0].node.0);
    let wants = |mut j: perch_scheduler::JobSpec| {
        j.gpu_model = Some(h100.clone());
        j
    };
    // vision's first 8-GPU job lands on an H100 node (its cap has room).
    step(&mut s, 1, Event::Submit(one(1, 8, "vision", 600, 1)));
    assert!(matches!(on(&s, 1), Some(0 | 1)));
    // Its second, unconstrained, is steered to the A100 node though an H100 node is free.
    step(&mut s, 2, Event::Submit(one(2, 8, "vision", 600, 2)));
    assert_eq!(on(&s, 2), Some(2));
    // A third that insists on H100 waits at its cap, with the quota as its reason.
    step(&mut s, 3, Event::Submit(wants(one(3, 8, "vision", 600, 3))));
    assert_eq!(
        s.pending_reason(JobId(3)),
        Some(PendingReason::QuotaExceeded)
    );
    assert_eq!(
        s.model_quota_use(&Account("vision".into())),
        vec![(h100.clone(), 8, 8)]
    );
    // nlp (its own cap) takes the free H100 node.
    step(&mut s, 4, Event::Submit(wants(one(4, 8, "nlp", 600, 4))));
    assert!(matches!(on(&s, 4), Some(0 | 1)));

    // With borrowing, vision runs past its H100 cap on idle H100s; nlp reclaims them within
    // its own cap, and only the borrowed job is taken.
    config.borrowing = true;
    let mut s = Scheduler::new(Cluster::new(), config);
    for (name, model) in [("h1", "H100"), ("h2", "H100")] {
        step(
            &mut s,
            0,
            Event::AddNode(NodeSpec::new(name, 8, model, "r1")),
        );
    }
    step(&mut s, 1, Event::Submit(wants(one(1, 8, "vision", 600, 1))));
    step(&mut s, 2, Event::Submit(wants(one(2, 8, "vision", 600, 2))));
    assert!(
        on(&s, 1).is_some() && on(&s, 2).is_some(),
        "vision borrows the second H100 node"
    );
    let a = step(&mut s, 3, Event::Submit(wants(one(3, 8, "nlp", 600, 3))));
    assert_eq!(preempted(&a), vec![2], "{a:?}");
    assert_eq!(started(&a), vec![3]);
    assert_eq!(
        s.model_quota_use(&Account("vision".into())),
        vec![(h100.clone(), 8, 8)]
    );
    // vision is at its cap now: nlp's next H100 job may not take more from it.
    let a = step(&mut s, 4, Event::Submit(wants(one(4, 8, "nlp", 600, 4))));
    assert!(preempted(&a).is_empty() && started(&a).is_empty(), "{a:?}");
}

/// A requeued job gets its whole time limit again on its next run, as Slurm's requeue and as
/// the agent enforces it on each launch: a job stopped 50 minutes into a 60-minute limit
/// restarts (from its last checkpoint, say) and is not killed 10 minutes later.
#[test]
fn a_requeued_job_gets_its_whole_time_limit_on_the_next_run() {
    let mut s = sched(2, Config::backfill());
    let a = step(&mut s, 0, Event::Submit(one(1, 8, "a", 60, 0)));
    assert_eq!(started(&a), vec![1]);
    let Some(node) = s.placement(JobId(1)).map(|p| p[0].node) else {
        panic!("job 1 has no placement")
    };
    let a = step(&mut s, 50 * MINUTE, Event::NodeDown(node));
    assert_eq!(started(&a), vec![1], "restarts on the other node");
    let a = step(&mut s, 100 * MINUTE, Event::Tick);
    assert!(a.is_empty(), "59 minutes into its second run: {a:?}");
    let a = step(&mut s, 110 * MINUTE, Event::Tick);
    assert_eq!(
        a,
        vec![Action::End {
            job: JobId(1),
            state: EndState::Timeout
        }],
        "60 minutes into the second run"
    );
}

/// The starvation bound: an 8-GPU job that has waited more than four times its time limit
/// goes before a one-GPU job that the size factor favours (weighted as an operator may set it);
/// with the bound off (0) the small job goes first, and a Low-QOS job is promoted only after
/// twice the bound. With the default weights finish-time fairness has already raised the big
/// job by then.
#[test]
fn a_job_waiting_past_four_time_limits_goes_first() {
    use perch_scheduler::{Qos, Weights};
    let size_order = Weights {
        age: 1000.0,
        fairshare: 1000.0,
        qos: 1000.0,
        size: 3000.0,
        finish: 0.0,
    };
    let run_with = |weights: Weights, starved_after_limits: f64, qos: Qos| {
        let mut config = Config::perch(vec![]);
        config.weights = weights;
        config.starved_after_limits = starved_after_limits;
        // The order alone: B must not take the node from X before X ends.
        config.starved_reclaim = false;
        let mut s = sched(1, config);
        // X holds the node for 260 minutes; B (8 GPUs, 60-minute limit) waits behind it.
        assert_eq!(
            started(&step(&mut s, 0, Event::Submit(one(1, 8, "a", 300, 0)))),
            vec![1]
        );
        let mut big = one(2, 8, "b", 60, MINUTE);
        big.qos = qos;
        step(&mut s, MINUTE, Event::Submit(big));
        step(
            &mut s,
            250 * MINUTE,
            Event::Submit(one(3, 1, "c", 10, 250 * MINUTE)),
        );
        let exited = Event::JobExited {
            job: JobId(1),
            code: 0,
        };
        started(&step(&mut s, 260 * MINUTE, exited))
    };
    let run = |starved_after_limits: f64, qos: Qos| run_with(size_order, starved_after_limits, qos);
    assert_eq!(run(4.0, Qos::Normal), vec![2], "B waited 259 min > 4 x 60");
    assert_eq!(
        run(0.0, Qos::Normal),
        vec![3],
        "no bound: the small job first"
    );
    assert_eq!(
        run(4.0, Qos::Low),
        vec![3],
        "scavenger work is not promoted at 4 limits (259 min < 2 x 4 x 60)"
    );
    assert_eq!(
        run(2.0, Qos::Low),
        vec![2],
        "scavenger work is promoted after twice the bound (259 min > 2 x 2 x 60)"
    );
    // A job that has not waited that long is not promoted either.
    assert_eq!(run(5.0, Qos::Normal), vec![3]);
    let finish = Config::perch(vec![]).weights;
    assert_eq!(
        run_with(finish, 0.0, Qos::Normal),
        vec![2],
        "no bound, default weights: B's finish-time ratio (319 / 120 min) is above C's (20 / 10)"
    );
}

/// The job a pass reserved GPUs for, overtaken by a higher-priority job in a later pass that
/// stops before reaching it, shows that it waits for priority, not that GPUs are reserved to it
/// (`perch queue` said "next in line" for both).
#[test]
fn an_overtaken_job_no_longer_shows_a_reservation() {
    let mut s = sched(1, Config::perch(vec![]));
    step(&mut s, 0, Event::Submit(one(1, 8, "c", 60, 0)));
    step(&mut s, MINUTE, Event::Submit(one(2, 8, "b", 120, MINUTE)));
    let reason = |s: &Scheduler, id: u64| {
        s.queue()
            .into_iter()
            .find(|e| e.job == JobId(id))
            .map(|e| e.reason)
    };
    assert!(
        matches!(reason(&s, 2), Some(PendingReason::Reserved { .. })),
        "{:?}",
        reason(&s, 2)
    );
    let mut urgent = one(3, 8, "a", 120, 2 * MINUTE);
    urgent.qos = perch_scheduler::Qos::High;
    step(&mut s, 2 * MINUTE, Event::Submit(urgent));
    assert!(
        matches!(reason(&s, 3), Some(PendingReason::Reserved { .. })),
        "{:?}",
        reason(&s, 3)
    );
    assert_eq!(reason(&s, 2), Some(PendingReason::Priority));
}

/// History prediction: user a's last three 8-GPU jobs ran 1 minute of their 600-minute limits,
/// so a's next 8-GPU job of a 600-minute limit counts as 1 minute for the finish factor and goes
/// before b's 8-GPU job of 120 minutes (no history); without prediction, b's first. Jobs that
/// failed are not history. (Runs of the same request: runs of another vouch only for the
/// GPU-time they used, `history.rs`.)
#[test]
fn a_users_history_shortens_what_their_limit_says() {
    let run = |predict: bool, exit_code: i32| {
        let mut config = Config::perch(vec![]);
        config.predict_from_history = predict;
        let mut s = sched(1, config);
        for k in 0..3u64 {
            let t = k as i64 * 20 * MINUTE;
            assert_eq!(
                started(&step(&mut s, t, Event::Submit(one(10 + k, 8, "a", 600, t)))),
                vec![10 + k]
            );
            let exited = Event::JobExited {
                job: JobId(10 + k),
                code: exit_code,
            };
            step(&mut s, t + MINUTE, exited);
        }
        // The blocker holds the node; a's and b's jobs wait behind it.
        let t = 60 * MINUTE;
        step(&mut s, t, Event::Submit(one(1, 8, "c", 60, t)));
        step(
            &mut s,
            t + MINUTE,
            Event::Submit(one(2, 8, "b", 120, t + MINUTE)),
        );
        step(
            &mut s,
            t + MINUTE,
            Event::Submit(one(3, 8, "a", 600, t + MINUTE)),
        );
        let exited = Event::JobExited {
            job: JobId(1),
            code: 0,
        };
        started(&step(&mut s, t + 30 * MINUTE, exited))
    };
    assert_eq!(
        run(true, 0),
        vec![3],
        "a's jobs run a six-hundredth of their limits"
    );
    assert_eq!(
        run(false, 0),
        vec![2],
        "limits alone: b's shorter limit first"
    );
    assert_eq!(
        run(true, 1),
        vec![2],
        "failed runs say nothing of a run's length"
    );
}

/// Starvation reclaim: a one-node job past its starvation bound that cannot fit preempts
/// running jobs that declared a longer time limit than its own, the least work at stake
/// first; when it would need the GPUs of a job that declared a shorter one, it waits.
#[test]
fn a_starved_job_preempts_jobs_that_declared_longer_limits() {
    // One node. X1 (4 GPUs, 300 min) and X0 (4 GPUs, 200 min) start at 0; B (8 GPUs, 60 min)
    // waits from minute 1. X0 exits at 200 and X2 (4 GPUs, limit `x2` minutes) backfills its
    // GPUs (it ends before B's reservation at 300). At 245 B has waited past 4 x 60 minutes.
    let run = |starved_reclaim: bool, x2: i64| {
        let mut config = Config::perch(vec![]);
        config.starved_reclaim = starved_reclaim;
        let mut s = sched(1, config);
        step(&mut s, 0, Event::Submit(one(1, 4, "a", 300, 0)));
        step(&mut s, 0, Event::Submit(one(10, 4, "a", 200, 0)));
        step(&mut s, MINUTE, Event::Submit(one(2, 8, "b", 60, MINUTE)));
        step(
            &mut s,
            199 * MINUTE,
            Event::Submit(one(3, 4, "c", x2, 199 * MINUTE)),
        );
        let exited = Event::JobExited {
            job: JobId(10),
            code: 0,
        };
        assert_eq!(started(&step(&mut s, 200 * MINUTE, exited)), vec![3]);
        let a = step(&mut s, 245 * MINUTE, Event::Tick);
        (preempted(&a), started(&a), a)
    };
    let (victims, starts, actions) = run(true, 70);
    assert_eq!(
        victims,
        vec![3, 1],
        "least work at stake first: {actions:?}"
    );
    assert_eq!(starts, vec![2]);
    assert!(actions.contains(&Action::Preempt {
        job: JobId(1),
        reason: PreemptReason::Starved { for_job: JobId(2) },
        requeued: true,
    }));
    let (victims, starts, _) = run(true, 50);
    assert!(
        victims.is_empty() && starts.is_empty(),
        "X2 declared 50 minutes, less than B's 60: B waits"
    );
    let (victims, starts, _) = run(false, 70);
    assert!(
        victims.is_empty() && starts.is_empty(),
        "reclaim off: B waits"
    );
}

/// Starvation reclaim takes a job at most once, and never for a gang: a job stopped before
/// (it has run already) is not a victim, and a starved two-node gang waits for its nodes.
#[test]
fn starvation_reclaim_spares_gangs_and_jobs_stopped_before() {
    // Two nodes, each held by an 8-GPU job of 300 minutes; G (2 x 8 GPUs, 60 minutes) waits
    // from minute 1 and is starved at 245.
    let mut s = sched(2, Config::perch(vec![]));
    step(&mut s, 0, Event::Submit(one(1, 8, "a", 300, 0)));
    step(&mut s, 0, Event::Submit(one(2, 8, "a", 300, 0)));
    step(
        &mut s,
        MINUTE,
        Event::Submit(spec(3, 2, 8, "b", 60 * MINUTE, MINUTE)),
    );
    let a = step(&mut s, 245 * MINUTE, Event::Tick);
    assert!(a.is_empty(), "a gang waits: {a:?}");

    // One node: X (300 minutes) is stopped for S1, starved at 245, and runs again when S1
    // ends; S2, starved in turn at 500, cannot stop it a second time.
    let mut s = sched(1, Config::perch(vec![]));
    step(&mut s, 0, Event::Submit(one(1, 8, "a", 300, 0)));
    step(&mut s, MINUTE, Event::Submit(one(2, 8, "b", 60, MINUTE)));
    let a = step(&mut s, 245 * MINUTE, Event::Tick);
    assert_eq!((preempted(&a), started(&a)), (vec![1], vec![2]));
    let exited = Event::JobExited {
        job: JobId(2),
        code: 0,
    };
    assert_eq!(started(&step(&mut s, 250 * MINUTE, exited)), vec![1]);
    step(
        &mut s,
        251 * MINUTE,
        Event::Submit(one(3, 8, "b", 60, 251 * MINUTE)),
    );
    let a = step(&mut s, 500 * MINUTE, Event::Tick);
    assert!(a.is_empty(), "X was stopped once already: {a:?}");

    // A restarted server resubmits X with its earlier run in the spec: the core has no other
    // memory of it, and X is not stopped a second time.
    let mut s = sched(1, Config::perch(vec![]));
    let mut x = one(1, 8, "a", 300, 0);
    x.earlier_runs = 1;
    step(&mut s, 0, Event::Submit(x));
    step(&mut s, MINUTE, Event::Submit(one(2, 8, "b", 60, MINUTE)));
    let a = step(&mut s, 245 * MINUTE, Event::Tick);
    assert!(a.is_empty(), "X ran before the restart: {a:?}");
}

/// Starvation does not buy an account GPUs past its quota: on one node whose 8 GPUs are all
/// account a's quota, b's starved job (b has no quota, so it may only borrow) does not stop
/// a's job; with a quota of its own on a second node's worth, it does.
#[test]
fn starvation_reclaim_respects_quotas() {
    let run = |b_quota: u32| {
        let quotas = vec![(Account("a".into()), 8), (Account("b".into()), b_quota)];
        let mut s = sched(1, Config::perch(quotas));
        step(&mut s, 0, Event::Submit(one(1, 8, "a", 300, 0)));
        step(&mut s, MINUTE, Event::Submit(one(2, 8, "b", 60, MINUTE)));
        preempted(&step(&mut s, 245 * MINUTE, Event::Tick))
    };
    assert!(run(0).is_empty(), "b is past its quota of 0");
    assert_eq!(run(8), vec![1], "within its quota, b's starved job stops X");
}

/// The chaining attack: a user submits many short jobs that all starve together, so that each
/// stops someone else's job. Starvation reclaim begins one run per user at a time: the user's
/// other starved jobs wait for it (another user's starved job does not), and the next one may
/// reclaim once it ends.
#[test]
fn a_user_cannot_chain_starved_jobs_to_stop_many_jobs_at_once() {
    // Two nodes, four 4-GPU jobs of 900 minutes (account a). User b submits three 4-GPU jobs of
    // 60 minutes at minute 1; all three are past 4 x 60 minutes at 245.
    let mut s = sched(2, Config::perch(vec![]));
    for id in 1..=4 {
        step(&mut s, 0, Event::Submit(one(id, 4, "a", 900, 0)));
    }
    for id in 11..=13 {
        step(&mut s, MINUTE, Event::Submit(one(id, 4, "b", 60, MINUTE)));
    }
    let a = step(&mut s, 245 * MINUTE, Event::Tick);
    assert_eq!(preempted(&a).len(), 1, "one victim for b, not three: {a:?}");
    assert_eq!(started(&a), vec![11]);

    // Another user's starved job is not held back by b's.
    step(
        &mut s,
        246 * MINUTE,
        Event::Submit(one(21, 4, "c", 10, 246 * MINUTE)),
    );
    let a = step(&mut s, 290 * MINUTE, Event::Tick);
    assert_eq!((preempted(&a).len(), started(&a)), (1, vec![21]), "{a:?}");

    // b's rescued run ends: 12 takes its GPUs, and 13, still starved, may now reclaim (one
    // more victim, not two).
    let exited = Event::JobExited {
        job: JobId(11),
        code: 0,
    };
    let a = step(&mut s, 295 * MINUTE, exited);
    assert_eq!(started(&a), vec![12, 13], "{a:?}");
    assert_eq!(preempted(&a).len(), 1, "{a:?}");
}

/// Themis' finish-time fairness runs first the job furthest behind the finish an equal part of
/// the cluster would give it: a 10-minute job that has waited 30 minutes goes before a
/// 5-hour job that has waited an hour (ratios 4 and 1.2), but a 10-minute job that has just
/// come waits behind it (1.1 against 1.2), where a size factor (perch's order before its
/// finish factor) would start the short job whatever the waits. perch's default weights lean
/// on the same ratio and agree.
#[test]
fn themis_runs_the_job_furthest_behind_its_fair_finish_first() {
    let first = |short_submit: i64, config: Config| {
        let mut s = sched(1, config);
        step(&mut s, 0, Event::Submit(one(1, 8, "a", 60, 0)));
        step(&mut s, 1, Event::Submit(one(2, 8, "b", 300, 1)));
        step(
            &mut s,
            short_submit,
            Event::Submit(one(3, 8, "c", 10, short_submit)),
        );
        let a = step(&mut s, 60 * MINUTE, exit(1));
        started(&a)
    };
    assert_eq!(first(30 * MINUTE, Config::themis()), vec![3]);
    assert_eq!(first(59 * MINUTE, Config::themis()), vec![2]);
    let mut by_size = Config::perch(vec![]);
    by_size.weights.finish = 0.0;
    by_size.weights.size = 3000.0;
    assert_eq!(first(59 * MINUTE, by_size), vec![3]);
    assert_eq!(first(59 * MINUTE, Config::perch(vec![])), vec![2]);
    assert_eq!(first(30 * MINUTE, Config::perch(vec![])), vec![3]);
}

/// A job asking for more than an equal part of the cluster is stretched by how far it exceeds
/// that part: on 16 GPUs held by one job, a 16-GPU gang and a one-GPU job, both of an hour and
/// the gang submitted first, the one-GPU job starts first (its ideal finish is an hour, the
/// gang's three: 16 GPUs over three accounts is 5.3 each).
#[test]
fn themis_stretches_a_job_bigger_than_an_equal_part() {
    let mut s = sched(2, Config::themis());
    step(&mut s, 0, Event::Submit(spec(1, 2, 8, "a", 60 * MINUTE, 0)));
    step(&mut s, 1, Event::Submit(spec(2, 2, 8, "b", 60 * MINUTE, 1)));
    step(&mut s, 2, Event::Submit(one(3, 1, "c", 60, 2)));
    let a = step(&mut s, 60 * MINUTE, exit(1));
    assert_eq!(started(&a), vec![3], "{a:?}");
}

/// A user keeps a node full with one-GPU jobs of 10 minutes (11 declared), eight more every 10
/// minutes; when does another user's 8-GPU job of an hour, submitted just after the first
/// eight, start? Each short job's finish-time ratio climbs fast, and the big job's slowly when
/// its 8 GPUs are far above an equal part of the node. The part divides the GPUs among the
/// accounts with jobs pending or running, so a stream from one account leaves the big job half
/// the node: it starts at the first pass after the first eight end (10 minutes), with fair
/// share weighted 0 too (70 minutes), and with the starvation bound off as well (70). Dividing
/// among jobs instead (perch's first finish-time factor), the stream shrank its part to a GPU
/// or less: 150 minutes, 250 without fair share (the bound), 430 without either. A stream
/// from as many accounts as jobs (accounts an operator made) shrinks the part again: fair
/// share and the bound then start it, as they did for perch's old size and age factors.
#[test]
fn a_stream_of_small_jobs_does_not_hold_a_big_one_back() {
    let big_starts = |config: Config, accounts_per_job: bool| -> Option<i64> {
        let mut s = sched(1, config);
        let mut running: Vec<(i64, u64)> = Vec::new();
        let mut next = 100;
        for tick in 0..144 {
            let now = tick * 10 * MINUTE;
            let mut actions = Vec::new();
            for _ in 0..8 {
                let account = match accounts_per_job {
                    true => format!("flood{next}"),
                    false => "flood".to_string(),
                };
                actions.extend(step(
                    &mut s,
                    now,
                    Event::Submit(one(next, 1, &account, 11, now)),
                ));
                next += 1;
            }
            // The stream's next eight are queued before the last ones end.
            let (done, rest) = running.into_iter().partition(|&(end, _)| end <= now);
            running = rest;
            let done: Vec<(i64, u64)> = done;
            for (_, id) in done {
                actions.extend(step(&mut s, now, exit(id)));
            }
            if tick == 0 {
                actions.extend(step(
                    &mut s,
                    now + 1,
                    Event::Submit(one(1, 8, "big", 60, now + 1)),
                ));
            }
            for id in started(&actions) {
                if id == 1 {
                    return Some(now);
                }
                running.push((now + 10 * MINUTE, id));
            }
        }
        None
    };
    let with = |finish: bool, fairshare: f64, bound: f64, accounts_per_job: bool| {
        let mut c = Config::perch(vec![]);
        if !finish {
            // perch's order before its finish factor: size and age.
            (c.weights.finish, c.weights.size, c.weights.age) = (0.0, 3000.0, 1000.0);
        }
        c.weights.fairshare = fairshare;
        c.starved_after_limits = bound;
        big_starts(c, accounts_per_job).map(|t| t / MINUTE)
    };
    // (finish factor, fair share weight, bound, an account per stream job): when the big
    // job starts, in minutes.
    let cases = [
        (true, 1000.0, 4.0, false, Some(10), "the defaults"),
        (false, 1000.0, 4.0, false, Some(10), "size and age"),
        (true, 0.0, 4.0, false, Some(70), "without fair share"),
        (false, 0.0, 4.0, false, Some(250), "the bound, size and age"),
        (
            true,
            0.0,
            0.0,
            false,
            Some(70),
            "finish-time fairness alone",
        ),
        (false, 0.0, 0.0, false, None, "size alone: never, in a day"),
        // A stream from as many accounts as jobs: the bound starts it, under either order.
        (true, 1000.0, 4.0, true, Some(250), "accounts per job"),
        (
            false,
            1000.0,
            4.0,
            true,
            Some(250),
            "accounts per job, size and age",
        ),
        (
            true,
            0.0,
            0.0,
            true,
            Some(430),
            "accounts per job, finish-time fairness alone",
        ),
    ];
    for (finish, fairshare, bound, per_job, want, what) in cases {
        assert_eq!(with(finish, fairshare, bound, per_job), want, "{what}");
    }
}

/// A server starts before its agents: a one-GPU job queued while no node was known must not
/// rank below a two-GPU job queued after the node came (its finish-time ratio was worked out
/// against a cluster of no GPUs). Found by `jobs_survive_a_server_kill_9_and_keep_running_through_it`
/// (tests/jobs.rs), where the two-GPU job took the node first.
#[test]
fn a_job_queued_before_any_node_is_ranked_against_the_cluster_that_came() {
    use perch_scheduler::NodeSpec;
    let mut s = Scheduler::new(Cluster::new(), Config::perch(vec![]));
    step(&mut s, 1_000, Event::Submit(one(1, 1, "a", 60, 1_000)));
    // As a server batches events: the node comes without a pass of its own.
    let added = s.handle(
        2_000,
        Event::AddNode(NodeSpec::new("gpu-a", 2, "H100", "r1")),
    );
    assert!(added.is_ok(), "{added:?}");
    let a = step(&mut s, 2_100, Event::Submit(one(2, 2, "a", 60, 2_100)));
    assert_eq!(started(&a), vec![1], "{a:?}");
}

/// A pass remembers placement lookups that found nothing, until it changes the cluster: a job
/// behind one that preempted to start must see the GPUs that preemption freed. Under SRTF, two
/// 4-GPU jobs of an hour wait behind an 8-GPU job of ten; the first preempts it and the second
/// takes the other four GPUs in the same pass (with the lookup remembered past the preemption,
/// it waited for the next).
#[test]
fn a_pass_sees_the_gpus_a_preemption_freed() {
    let mut s = sched(1, Config::srtf());
    let a = step(&mut s, 0, Event::Submit(one(1, 8, "a", 600, 0)));
    assert_eq!(started(&a), vec![1]);
    for id in [2, 3] {
        s.handle(MINUTE, Event::Submit(one(id, 4, "b", 60, MINUTE)))
            .expect("submits");
    }
    let a = s.schedule(MINUTE);
    assert_eq!(preempted(&a), vec![1], "{a:?}");
    assert_eq!(started(&a), vec![2, 3], "{a:?}");
}

/// Jobs of one account submitted together tie on every factor (a fresh job that fits its
/// account's equal part has a finish-time ratio of 1, and waiting raises equal runs equally):
/// the smaller request goes first. Four GPUs free up; a 4-GPU job and a one-GPU job of the
/// same length wait, the bigger one submitted first: the one-GPU job starts, and the 4-GPU job
/// no longer fits beside it (in submission order, the 4-GPU job took the four).
#[test]
fn among_equal_priorities_the_smaller_request_goes_first() {
    let mut s = sched(1, Config::perch(vec![]));
    let a = step(&mut s, 0, Event::Submit(one(1, 4, "x", 600, 0)));
    let b = step(&mut s, 0, Event::Submit(one(2, 4, "x", 600, 0)));
    assert_eq!([started(&a), started(&b)].concat(), vec![1, 2]);
    step(&mut s, MINUTE, Event::Submit(one(3, 4, "a", 1000, MINUTE)));
    step(&mut s, MINUTE, Event::Submit(one(4, 1, "a", 1000, MINUTE)));
    let a = step(&mut s, 10 * MINUTE, exit(1));
    assert_eq!(started(&a), vec![4], "{a:?}");
}

/// A user who fills the cluster and queues more does not keep another user's job behind his
/// queue once GPUs free up. On a fresh cluster (no usage yet) bob's eight 10-minute jobs hold
/// the node and sixteen more wait; alice's one-GPU job comes after them and ties with his at
/// submission (usage is charged at a priority refresh; until then no account has any), so the
/// tie-break puts it behind his shorter ones. The refresh at the first pass past 5 minutes
/// charges bob's running jobs, and when they end alice's job is among the eight that start.
/// (Seen running the release binary as a newcomer: `perch queue` lists alice's job behind
/// bob's for the first minutes.)
#[test]
fn a_user_who_fills_the_cluster_does_not_keep_anothers_job_behind_his_queue() {
    let mut s = sched(1, Config::perch(vec![]));
    let mut first = Vec::new();
    for id in 1..=24 {
        first.extend(started(&step(
            &mut s,
            0,
            Event::Submit(one(id, 1, "bob", 11, 0)),
        )));
    }
    assert_eq!(first, (1..=8).collect::<Vec<_>>());
    step(
        &mut s,
        MINUTE,
        Event::Submit(one(100, 1, "alice", 60, MINUTE)),
    );
    let mut next = Vec::new();
    for id in 1..=8 {
        next.extend(started(&step(&mut s, 10 * MINUTE, exit(id))));
    }
    assert!(
        next.contains(&100),
        "alice's job waits behind bob's: {next:?}"
    );
    assert_eq!(next.len(), 8);
}

/// A pass stops where nothing more can start (the cluster full and the reservation taken), so
/// it never reaches the jobs behind: they are shown waiting behind higher-priority jobs, not
/// "waiting for the next scheduling pass", which is only true until a pass runs. (Seen running
/// the release binary: `perch queue` said so of every job behind the reserved one, for good.)
#[test]
fn a_job_a_pass_did_not_reach_waits_behind_higher_priority_ones() {
    let mut s = sched(1, Config::perch(vec![]));
    step(&mut s, 0, Event::Submit(one(1, 8, "a", 600, 0)));
    step(&mut s, 1, Event::Submit(one(2, 8, "b", 60, 1)));
    assert!(matches!(
        s.pending_reason(JobId(2)),
        Some(PendingReason::Reserved { .. })
    ));
    // Queued with no pass since: not yet considered.
    s.handle(2, Event::Submit(one(3, 8, "b", 600, 2)))
        .expect("submits");
    assert_eq!(s.pending_reason(JobId(3)), Some(PendingReason::New));
    // A pass that stops at the reserved job before reaching it.
    s.schedule(3);
    assert_eq!(s.pending_reason(JobId(3)), Some(PendingReason::Priority));
    let shown: Vec<(u64, PendingReason)> = s.queue().iter().map(|e| (e.job.0, e.reason)).collect();
    assert_eq!(shown.len(), 2, "{shown:?}");
    assert!(shown.contains(&(3, PendingReason::Priority)), "{shown:?}");
}
