//! One full scheduling pass on 4,000 nodes x 8 GPUs with 20,000 pending jobs: priorities
//! recomputed and sorted, EASY reservation, and backfill over the whole queue. The cluster is
//! ~97% allocated with fragmented free GPUs, so many candidates are tried and some start.
//! `perch+topology` is the same on nodes with two NVLink islands of 4 GPUs that take shared
//! jobs, with one pending job in 20 asking for part of a GPU. `perch+64-accounts` spreads the
//! work over 64 accounts, each with a quota of 500 GPUs (the whole cluster between them), as
//! an operator's `[scheduler.quotas]` would; `perch+model-quotas` is that on nodes half H100
//! and half A100, each account also capped at 250 H100s (`[scheduler.model_quotas]`), so
//! unconstrained jobs are steered between models. `start_plan` estimates the start of the first
//! 1,000 pending jobs (`perch queue --start`) on the loaded perch cluster.
//!
//! `cargo bench -p perch-scheduler --bench pass`

use perch_scheduler::{
    Account, Cluster, Config, Event, GpuModel, GpuShare, JobId, JobSpec, MINUTE, NodeId, NodeSpec,
    Qos, Scheduler, Shape, User,
};

fn main() {
    divan::main();
}

struct Lcg(u64);
impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

fn job(id: u64, shape: Shape, account: u64, limit_min: i64, submit: i64) -> JobSpec {
    JobSpec {
        id: JobId(id),
        user: User(format!("user{}", account * 7 % 200)),
        account: Account(format!("team{account}")),
        shape,
        gpu_model: None,
        time_limit: limit_min * MINUTE,
        qos: Qos::Normal,
        preemptible: true,
        max_requeues: 1,
        submit,
        oracle_duration: Some(limit_min * MINUTE / 2),
        share: None,
        earlier_runs: 0,
        gpu_profile: None,
    }
}

/// A loaded 4,000 x 8 cluster with 20,000 jobs pending, and the time of the pass. With
/// `topology`, nodes have NVLink islands {0-3},{4-7}, take shared jobs, and report memory, and
/// 5% of the pending jobs are shares.
fn loaded(config: Config, topology: bool, accounts: u64, two_models: bool) -> (Scheduler, i64) {
    let mut cluster = Cluster::new();
    for i in 0..4_000u32 {
        let mut spec = NodeSpec::new(
            &format!("node{:04}", i + 1),
            8,
            if two_models && i % 2 == 1 {
                "A100"
            } else {
                "H100"
            },
            &format!("rack{:03}", i / 32),
        );
        if topology {
            spec.nvlink_islands = vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]];
            spec.sharing = true;
        }
        let _ = cluster.add_node(spec);
    }
    let mut s = Scheduler::new(cluster, config);
    if topology {
        for n in 0..4_000 {
            for gpu in 0..8 {
                let _ = s.handle(
                    0,
                    Event::GpuUtilization {
                        node: NodeId(n),
                        gpu,
                        percent: 0.0,
                        memory_used_mb: Some(0),
                        memory_total_mb: Some(81_559),
                    },
                );
            }
        }
    }
    let mut rng = Lcg(42);
    let mut id = 0;
    // Running work: about 97% of 32,000 GPUs, in 1-, 2-, 4- and 8-GPU jobs.
    let mut placed = 0;
    while placed < 31_000 {
        let g = [1, 2, 4, 8, 8][rng.next(5) as usize];
        id += 1;
        let _ = s.handle(
            0,
            Event::Submit(job(
                id,
                Shape {
                    nodes: 1,
                    gpus_per_node: g,
                },
                rng.next(accounts),
                30 + rng.next(2000) as i64,
                0,
            )),
        );
        placed += g;
    }
    let _ = s.schedule(0);
    // 20,000 pending jobs of every size, up to 16-node gangs.
    for i in 0..20_000u64 {
        let shape = match rng.next(20) {
            0 => Shape {
                nodes: 1 + rng.next(16) as u32,
                gpus_per_node: 8,
            },
            1..=4 => Shape {
                nodes: 1,
                gpus_per_node: 8,
            },
            5..=8 => Shape {
                nodes: 1,
                gpus_per_node: 4,
            },
            9..=12 => Shape {
                nodes: 1,
                gpus_per_node: 2,
            },
            _ => Shape {
                nodes: 1,
                gpus_per_node: 1,
            },
        };
        id += 1;
        let mut j = job(
            id,
            shape,
            rng.next(accounts),
            10 + rng.next(3000) as i64,
            MINUTE + i as i64,
        );
        if topology && rng.next(20) == 0 {
            j.shape = Shape {
                nodes: 1,
                gpus_per_node: 1,
            };
            j.share = Some(GpuShare {
                percent: 10 + rng.next(41) as u32,
                memory_mb: 4_096 + rng.next(16_384),
            });
        }
        let _ = s.handle(MINUTE + i as i64, Event::Submit(j));
    }
    (s, 60 * MINUTE)
}

fn quotas(accounts: u64, each: u32) -> Vec<(Account, u32)> {
    (0..accounts)
        .map(|a| (Account(format!("team{a}")), each))
        .collect()
}

#[divan::bench(
    args = ["backfill", "perch", "perch+topology", "perch+64-accounts", "perch+model-quotas"],
    sample_count = 20
)]
fn full_pass(bencher: divan::Bencher, policy: &str) {
    let (config, accounts) = match policy {
        "perch" | "perch+topology" => (Config::perch(quotas(40, 800)), 40),
        "perch+64-accounts" => (Config::perch(quotas(64, 500)), 64),
        "perch+model-quotas" => {
            let mut c = Config::perch(quotas(64, 500));
            c.model_quotas = (0..64)
                .map(|a| (Account(format!("team{a}")), GpuModel("H100".into()), 250))
                .collect();
            (c, 64)
        }
        _ => (Config::backfill(), 40),
    };
    let two_models = policy == "perch+model-quotas";
    let (s, now) = loaded(config, policy == "perch+topology", accounts, two_models);
    assert!(s.pending_len() >= 20_000, "pending {}", s.pending_len());
    time_pass(bencher, policy, &s, now);
}

/// Prints what a pass over `s` at `now` does, then times it, each sample on a fresh clone.
fn time_pass(bencher: divan::Bencher, label: &str, s: &Scheduler, now: i64) {
    let started = s
        .clone()
        .schedule(now)
        .iter()
        .filter(|a| matches!(a, perch_scheduler::Action::Start { .. }))
        .count();
    println!(
        "{label}: {} running, {} pending, {} free GPUs; the pass starts {started} jobs",
        s.running_len(),
        s.pending_len(),
        s.cluster().free_gpus()
    );
    bencher
        .with_inputs(|| s.clone())
        .bench_local_values(|mut s| {
            let actions = s.schedule(now);
            divan::black_box(actions.len());
            s
        });
}

#[divan::bench(sample_count = 10)]
fn start_plan(bencher: divan::Bencher) {
    let (mut s, now) = loaded(Config::perch(quotas(40, 800)), false, 40, false);
    let _ = s.schedule(now);
    let estimated = s
        .start_plan(now, 1_000, None)
        .estimate()
        .iter()
        .filter(|(_, at)| at.is_some())
        .count();
    println!("start_plan: {estimated} of the first 1,000 pending jobs get an estimate");
    bencher.bench_local(|| divan::black_box(s.start_plan(now, 1_000, None).estimate().len()));
}

/// A pass over a queue no node can serve: 20,000 pending jobs asking 16 GPUs of one node on
/// the 4,000 nodes of 8 (an array submitted with a typo), beside half the cluster's GPUs free.
/// No reservation forms, so the pass reaches every one of them.
#[divan::bench(sample_count = 20)]
fn unsatisfiable_queue(bencher: divan::Bencher) {
    let mut cluster = Cluster::new();
    for i in 0..4_000u32 {
        let _ = cluster.add_node(NodeSpec::new(
            &format!("node{:04}", i + 1),
            8,
            "H100",
            &format!("rack{:03}", i / 32),
        ));
    }
    let mut s = Scheduler::new(cluster, Config::perch(Vec::new()));
    let one_node = |gpus_per_node| Shape {
        nodes: 1,
        gpus_per_node,
    };
    for id in 1..=4_000u64 {
        let _ = s.handle(0, Event::Submit(job(id, one_node(4), id % 40, 600, 0)));
    }
    let _ = s.schedule(0);
    for id in 4_001..=24_000u64 {
        let _ = s.handle(
            MINUTE,
            Event::Submit(job(id, one_node(16), id % 40, 600, MINUTE)),
        );
    }
    let now = 2 * MINUTE;
    let _ = s.schedule(now);
    time_pass(bencher, "unsatisfiable_queue", &s, now + MINUTE);
}
