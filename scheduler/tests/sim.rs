//! Simulator tests on a 300-job sample of the Philly trace: every policy finishes every job,
//! replays are deterministic, GPU-time is conserved, and the orderings the policies promise
//! show up.

use perch_scheduler::sim::{self, PreemptionCost, SimOptions, SimPolicy};

fn sample() -> Vec<sim::TraceJob> {
    match sim::trace::load(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/philly-300.csv"),
        None,
    ) {
        Ok(t) => t.jobs,
        Err(e) => panic!("sample trace: {e}"),
    }
}

fn run(jobs: &[sim::TraceJob], p: SimPolicy, gpus: u32) -> sim::SimReport {
    let opts = SimOptions::uniform(gpus / 8, 8);
    match sim::simulate(jobs, p, &opts) {
        Ok(r) => r,
        Err(e) => panic!("{}: {e}", p.name()),
    }
}

#[test]
fn every_policy_finishes_every_job_and_conserves_gpu_time() {
    let jobs = sample();
    assert_eq!(jobs.len(), 300);
    let work: f64 = jobs
        .iter()
        .map(|j| j.duration as f64 / 1000.0 * j.gpus as f64)
        .sum();
    for p in [
        SimPolicy::Fifo,
        SimPolicy::Backfill,
        SimPolicy::Srtf,
        SimPolicy::Perch,
        SimPolicy::Las,
        SimPolicy::Gittins,
        SimPolicy::Themis,
    ] {
        // Allocated GPU-time is the work plus what preemptions wasted, to the GPU-second;
        // with preemption free, the work alone.
        for cost in [PreemptionCost::DEFAULT, PreemptionCost::FREE] {
            let opts = SimOptions {
                preemption: cost,
                ..SimOptions::uniform(4, 8)
            };
            let s = sim::simulate(&jobs, p, &opts).expect("replays").summary;
            assert_eq!(
                (s.finished, s.unfinished, s.incomplete),
                (300, 0, 0),
                "{}",
                p.name()
            );
            let allocated = s.alloc_pct / 100.0 * 32.0 * s.makespan_s;
            let wasted = s.wasted_gpu_h * 3600.0;
            assert!(
                (allocated - wasted - work).abs() / work < 1e-6,
                "{}: allocated {allocated} - wasted {wasted} vs work {work}",
                p.name()
            );
            assert!(cost != PreemptionCost::FREE || wasted == 0.0);
            assert!(s.preemptions == 0 || cost == PreemptionCost::FREE || wasted > 0.0);
        }
        let s = run(&jobs, p, 32).summary;
        assert!(
            s.avg_wait_s >= 0.0 && s.p99_jct_s >= s.median_jct_s && s.jain > 0.0 && s.jain <= 1.0
        );
    }
}

#[test]
fn replays_are_deterministic() {
    let jobs = sample();
    for p in SimPolicy::ALL {
        let (a, b) = (run(&jobs, p, 16), run(&jobs, p, 16));
        assert_eq!(a.summary, b.summary, "{}", p.name());
        assert_eq!(a.series, b.series, "{}", p.name());
    }
}

#[test]
fn policies_order_as_promised_on_a_busy_cluster() {
    let jobs = sample();
    let jct = |p| run(&jobs, p, 16).summary.avg_jct_s;
    let (fifo, backfill, perch, srtf) = (
        jct(SimPolicy::Fifo),
        jct(SimPolicy::Backfill),
        jct(SimPolicy::Perch),
        jct(SimPolicy::Srtf),
    );
    assert!(backfill <= fifo, "backfill {backfill} vs fifo {fifo}");
    assert!(perch <= backfill, "perch {perch} vs backfill {backfill}");
    assert!(srtf <= fifo, "srtf {srtf} vs fifo {fifo}");
}

#[test]
fn idle_reclaim_raises_useful_utilization() {
    let mut jobs = sample();
    let share = sim::trace::add_idle_tails(&mut jobs, 0.33, 1);
    assert!(share >= 0.33, "{share}");
    let report = run(&jobs, SimPolicy::Perch, 16).summary;
    let reclaim = run(&jobs, SimPolicy::PerchIdleReclaim, 16).summary;
    assert!(reclaim.idle_reclaims > 0);
    assert!(
        reclaim.avg_jct_s < report.avg_jct_s,
        "{} vs {}",
        reclaim.avg_jct_s,
        report.avg_jct_s
    );
    assert!(
        reclaim.useful_pct > report.useful_pct,
        "{} vs {}",
        reclaim.useful_pct,
        report.useful_pct
    );
    assert_eq!(report.idle_reclaims, 0);
}

#[test]
fn the_plot_is_an_svg_with_both_panels() {
    let jobs = sample();
    let r = run(&jobs, SimPolicy::Backfill, 16);
    let dir = std::env::temp_dir().join(format!("perch-sim-plot-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        panic!("{e}");
    }
    let path = dir.join("plot.svg");
    let path = path.to_string_lossy().to_string();
    if let Err(e) = sim::write_svg(&path, "sample", &[("backfill".into(), 16, r.series)]) {
        panic!("{e}");
    }
    let svg = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        svg.starts_with("<svg") && svg.contains("jobs waiting") && svg.contains("<polyline"),
        "{}",
        &svg[..svg.len().min(300)]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_table_has_a_header_cell_per_value() {
    let s = run(&sample(), SimPolicy::Fifo, 16).summary;
    let table = sim::format_table(&[s]);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 2);
    let header = lines[0]
        .replace(" JCT s", "_JCT")
        .replace(" wait s", "_wait")
        .replace("makespan h", "makespan");
    assert_eq!(
        header.split_whitespace().count(),
        lines[1].split_whitespace().count(),
        "{table}"
    );
}

/// A trace job larger than the cluster is refused before the replay, with the count, the
/// first such job and the number of nodes that would fit them all; the replay never ran with
/// them pending forever.
#[test]
fn a_job_larger_than_the_cluster_is_refused_naming_it() {
    let mut jobs = sample();
    jobs[7].gpus = 40;
    jobs[9].gpus = 64;
    let opts = SimOptions::uniform(4, 8);
    let err = match sim::simulate(&jobs, SimPolicy::Fifo, &opts) {
        Ok(r) => panic!("a 64-GPU job on 32 GPUs replayed: {:?}", r.summary),
        Err(e) => e.to_string(),
    };
    for part in [
        "2 job(s)",
        "4 x 8 GPUs, 32 GPUs",
        "job 7",
        "40",
        "largest asks for 64",
        "at least 8 nodes",
    ] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
}

/// A job the trace marks not preemptible that asks for more than its account's quota on its
/// own could only ever run on borrowed GPUs: a server refuses it, so the replay runs it
/// preemptible (as its user would resubmit it) and counts it, and it finishes. With borrowing
/// off it could never start: the replay refuses the trace, naming the job.
#[test]
fn a_job_that_could_only_borrow_is_replayed_preemptible_or_refused_without_borrowing() {
    use perch_scheduler::{Account, Config};
    let trace = "submit,duration,gpus,account,preemptible\n\
                 0,3600,8,a,false\n\
                 0,600,4,b,false\n\
                 60,600,4,b,true\n\
                 120,600,8,a,false\n";
    let jobs = sim::trace::parse("t.csv", trace, None).expect("trace").jobs;
    let opts = SimOptions::uniform(2, 8);
    let config = Config::perch(vec![(Account("a".into()), 8), (Account("b".into()), 2)]);
    let r = sim::simulate_with(&jobs, config.clone(), "perch", &opts).expect("replays");
    assert_eq!(r.made_preemptible, 1, "job 1 asks 4 GPUs, b's quota is 2");
    assert_eq!((r.summary.finished, r.summary.unfinished), (4, 0));
    // a's second 8-GPU job, no larger than a's quota but a at it, waits for a's first: it
    // may not be preempted, so it does not borrow the GPUs b left idle at 660 s.
    assert_eq!(r.jobs[3].first_start, Some(3_600_000), "{:?}", r.jobs);
    let mut off = config;
    off.borrowing = false;
    let err = match sim::simulate_with(&jobs, off, "perch", &opts) {
        Ok(r) => panic!(
            "replayed with a job that could never start: {:?}",
            r.summary
        ),
        Err(e) => e.to_string(),
    };
    for part in [
        "job 1",
        "asks for 4 GPU(s)",
        "quota of 2",
        "borrowing is off",
    ] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
}

/// When no job ever waits there is no allocation-while-waiting to speak of: the table says
/// `-`, not 0.0%.
#[test]
fn allocation_while_waiting_is_absent_when_nothing_waited() {
    let jobs: Vec<sim::TraceJob> = sample().into_iter().take(1).collect();
    let r = run(&jobs, SimPolicy::Fifo, 64);
    assert_eq!(r.summary.alloc_queued_pct, None, "{:?}", r.summary);
    let table = sim::format_table(std::slice::from_ref(&r.summary));
    let row = table.lines().nth(1).expect("a row");
    assert!(row.split_whitespace().nth(8) == Some("-"), "{table}");
    let busy = run(&sample(), SimPolicy::Fifo, 16);
    assert!(busy.summary.alloc_queued_pct.is_some_and(|p| p > 0.0));
}

/// The synthetic traces in `scheduler/traces/` are their generator's output at seed 1 (so a
/// change to the generator regenerates them, and nobody edits them by hand).
#[test]
fn the_committed_synthetic_traces_are_their_generators_output() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/traces");
    for kind in sim::SynthKind::ALL {
        let path = format!("{dir}/{}.csv", kind.name());
        let committed = std::fs::read_to_string(&path).expect("committed trace");
        assert!(
            committed == sim::synth::generate(kind, 1),
            "{path} differs from `perch simulate --generate {} --seed 1`",
            kind.name()
        );
    }
    let cluster = std::fs::read_to_string(format!("{dir}/mixed-cluster.csv")).expect("cluster");
    assert_eq!(cluster, sim::MIXED_CLUSTER);
}

/// The fractional trace on its mixed fleet: every job ends with its work done, GPU-time is
/// conserved in hundredths of a GPU, and jobs pinned to A100 fit only the A100 nodes (the
/// replay refuses the trace on a fleet without them).
#[test]
fn the_fractional_trace_replays_on_the_mixed_fleet() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/traces");
    let jobs = sim::trace::load(&format!("{dir}/fractional.csv"), None)
        .expect("trace")
        .jobs;
    let (cluster, warnings) =
        sim::SimCluster::load(&format!("{dir}/mixed-cluster.csv")).expect("cluster");
    assert!(warnings.is_empty());
    let opts = SimOptions {
        cluster,
        ..SimOptions::default()
    };
    let work: f64 = jobs
        .iter()
        .map(|j| j.duration as f64 / 1000.0 * j.gpu_amount())
        .sum();
    for p in [SimPolicy::Backfill, SimPolicy::Perch] {
        let s = sim::simulate(&jobs, p, &opts).expect("replays").summary;
        assert_eq!((s.finished, s.unfinished, s.incomplete), (2000, 0, 0));
        let allocated = s.alloc_pct / 100.0 * 56.0 * s.makespan_s;
        let wasted = s.wasted_gpu_h * 3600.0;
        assert!(
            (allocated - wasted - work).abs() / work < 1e-6,
            "{}: allocated {allocated} - wasted {wasted} vs work {work}",
            p.name()
        );
    }
    let (no_a100, _) = sim::SimCluster::parse(
        "c.csv",
        "name,gpus,model,rack\nt4-01,2,T4,r1\na10-01,4,A10,r1\n",
    )
    .expect("cluster");
    let err = sim::simulate(
        &jobs,
        SimPolicy::Backfill,
        &SimOptions {
            cluster: no_a100,
            ..SimOptions::default()
        },
    )
    .expect_err("A100 jobs cannot run");
    assert!(err.to_string().contains("`A100`"), "{err}");
}

/// The scorecard on the quick matrix: one row per case, every policy replayed, and the
/// targets line counts only the cases where queues formed.
#[test]
fn the_quick_scorecard_scores_every_case() {
    let cases = sim::suite::builtin(None, true).expect("matrix");
    // Seven cases with uniform time limits, the same seven with users' habits.
    assert_eq!(cases.len(), 14);
    let habits = cases
        .iter()
        .filter(|c| c.opts.limits == sim::LimitModel::Habits && c.trace.ends_with("/h"))
        .count();
    assert_eq!(habits, 7);
    let results: Vec<_> = cases
        .iter()
        .map(|c| sim::suite::run_case(c).expect("replays"))
        .collect();
    for r in &results {
        assert_eq!(r.rows.len(), sim::suite::POLICIES.len());
        assert!(r.rows.iter().all(|s| s.unfinished == 0), "{}", r.trace);
    }
    let queued = results.iter().filter(|r| r.queued()).count();
    // The closing table: one line per compared policy, the oracle at exactly 1x itself and
    // meeting its own JCT bar everywhere, each line's counts the tally's.
    let table = sim::suite::comparison(&results);
    for p in sim::suite::COMPARED {
        let t = sim::suite::tally(&results, p);
        assert_eq!(t.cases, queued);
        let line = table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(p.name()))
            .unwrap_or_else(|| panic!("no line for {} in\n{table}", p.name()));
        let numbers: Vec<&str> = line.split_whitespace().skip(2).take(5).collect();
        let met: Vec<String> = t.met.iter().map(|n| n.to_string()).collect();
        assert_eq!(numbers, met, "{line}");
        let within_once: Vec<&str> = line.split_whitespace().skip(9).take(1).collect();
        assert_eq!(within_once, [t.within_srtf_once.to_string()], "{line}");
        // The last column: the cases it meets every target in at once.
        let all = results
            .iter()
            .filter(|r| r.queued() && r.meets_all(p))
            .count();
        assert_eq!(t.all_met, all);
        assert_eq!(
            line.split_whitespace().last(),
            Some(all.to_string().as_str())
        );
        assert!(all <= t.met.into_iter().min().unwrap_or(0), "{line}");
    }
    // Some policy meets every target at once in as many cases as the line says: at least as
    // many as any one policy, at most the cases with a queue.
    let reachable = sim::suite::reachable(&results);
    let best = sim::suite::POLICIES
        .iter()
        .map(|&p| {
            results
                .iter()
                .filter(|r| r.queued() && r.meets_all(p))
                .count()
        })
        .max()
        .unwrap_or(0);
    assert!(
        best <= reachable && reachable <= queued,
        "{best} {reachable} {queued}"
    );
    assert!(
        table.contains(&format!("in {reachable} of {queued} cases")),
        "{table}"
    );
    for r in &results {
        for p in sim::suite::POLICIES {
            assert_eq!(r.all_met_by().contains(&p), r.meets_all(p), "{}", r.trace);
        }
    }
    let oracle = sim::suite::tally(&results, SimPolicy::Srtf);
    assert_eq!(oracle.jct_over_srtf, 1.0);
    assert_eq!(oracle.met[0], queued, "SRTF is within 1.25x of itself");
    // The bounded oracle: within 1.25x of itself, and within the preemption bound everywhere.
    let once = sim::suite::tally(&results, SimPolicy::SrtfOnce);
    assert_eq!(once.jct_over_srtf_once, 1.0);
    assert_eq!((once.within_srtf_once, once.met[4]), (queued, queued));
    for scored in sim::suite::SCORED {
        let card = sim::suite::scorecard(&results, scored);
        assert_eq!(card.lines().count(), 2 + 14 + 5, "{card}");
        assert!(
            card.contains(&format!(
                "{} meets, of {queued} cases where queues form",
                scored.name()
            )),
            "{card}"
        );
    }
    // The full output: each way of declaring limits in its own section.
    let all = sim::suite::scorecards(&results);
    assert!(all.contains("== time limits: uniform") && all.contains("== time limits: habits"));
}

/// Limits declared absurdly far past the run: refused naming the option, where a factor of
/// 1e308 (or infinity) overflowed the replay's millisecond clock and panicked.
#[test]
fn an_absurd_limit_factor_is_refused_naming_the_option() {
    let jobs = vec![sim::TraceJob::new(0, 10_000, 1, "a", "a")];
    for high in [1e308, f64::INFINITY, 1000.5] {
        let err = sim::simulate(
            &jobs,
            SimPolicy::Perch,
            &SimOptions {
                limit_factor: (1.5, high),
                ..SimOptions::uniform(1, 8)
            },
        )
        .expect_err("refused");
        assert!(
            err.to_string().contains("limit_factor") && err.to_string().contains("<= 1000"),
            "{err}"
        );
    }
    let r = sim::simulate(
        &jobs,
        SimPolicy::Perch,
        &SimOptions {
            limit_factor: (1000.0, 1000.0),
            ..SimOptions::uniform(1, 8)
        },
    )
    .expect("replays at the bound");
    assert_eq!(r.summary.finished, 1);
}
