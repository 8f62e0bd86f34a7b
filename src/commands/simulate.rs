//! `perch simulate`: replays a job trace through the scheduler core in virtual time and prints
//! JCT, waiting, allocation, useful utilization, fairness and preemptions per policy, with an
//! optional SVG plot of queue length and utilization over time.
//!
//! With `--config`, the file's `[scheduler]` (the policy the server runs) is replayed too, as
//! the row `config`: an operator replays last month under a proposed policy before switching.
//!
//! With `--suite`, the scorecard: every policy on the built-in matrix of traces, sizes and seeds
//! (`perch_scheduler::sim::suite`). With `--generate KIND`, a synthetic trace on stdout.
//!
//! All the work is in `perch_scheduler::sim`; this file only turns flags into its options.

use crate::config::{ConfigFile, SchedulerSection};
use anyhow::{Context, bail};

/// The most nodes `--nodes` builds: 800,000 GPUs at 8 a node, far past any cluster a replay
/// models, and a bound on the memory one flag can ask for.
const MAX_SIM_NODES: i64 = 100_000;
use perch_scheduler::sim::{
    self, PreemptionCost, SimCluster, SimOptions, SimPolicy, SynthKind, TraceFormat,
};

/// Flags of `perch simulate`.
#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// The trace file (Philly CSV, or the generic CSV described in scheduler/README.md). With
    /// `--suite`, the Philly trace to include (default `../shared/traces/philly.csv` when it
    /// exists).
    #[arg(long, required_unless_present_any = ["suite", "generate"])]
    pub trace: Option<String>,
    /// `philly`, `generic`, or `auto` (from the header).
    #[arg(long, default_value = "auto", value_parser = ["auto", "philly", "generic"])]
    pub format: String,
    /// A cluster file (`name,gpus,model,rack[,gpu_memory_gb,sharing]`, one node per line) for a
    /// heterogeneous fleet, instead of `--nodes` identical nodes.
    #[arg(long, conflicts_with_all = ["nodes", "gpus_per_node", "nodes_per_rack"])]
    pub cluster: Option<String>,
    /// Nodes in the simulated cluster (1 to 100,000).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=MAX_SIM_NODES))]
    pub nodes: u32,
    /// GPUs per node (1 to 64).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=i64::from(perch_scheduler::MAX_GPUS_PER_NODE)))]
    pub gpus_per_node: u32,
    /// Nodes per rack label.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=MAX_SIM_NODES))]
    pub nodes_per_rack: u32,
    /// `fifo`, `backfill`, `srtf`, `srtf-once` (the oracle preempting each job at most once),
    /// `las`, `gittins`, `themis`, `perch`, `perch-noquota`,
    /// `perch+idle-reclaim`, `perch-limits` (no quotas, the finish factor reading the declared
    /// limits alone), or `all`; several with commas.
    /// Default: `all`, or with `--config` only the file's `[scheduler]`.
    #[arg(long)]
    pub policy: Option<String>,
    /// Seed of the per-job time-limit factors and of the idle-tail choice.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Declared time limit = true duration x a factor uniform in [LOW, HIGH].
    #[arg(long, default_value_t = 1.5)]
    pub limit_factor_low: f64,
    /// See `--limit-factor-low`.
    #[arg(long, default_value_t = 5.0)]
    pub limit_factor_high: f64,
    /// How users declare limits: `uniform` (each job's run times the factor, to the minute)
    /// or `habits` (30% of users always declare 7 days; the others round the factor's limit
    /// up to 15 or 30 minutes, 1, 2, 4, 8, 12, 24, 48 or 72 hours).
    #[arg(long, default_value = "uniform", value_parser = parse_limits)]
    pub limits: sim::LimitModel,
    /// Give jobs idle tails until this share of GPU-time sits at 0% utilization (0 to 0.9).
    #[arg(long, default_value_t = 0.0)]
    pub idle_share: f64,
    /// Minutes a job must stay idle before perch acts on it (the built-in policies; the
    /// `config` row takes `[scheduler.idle] after` from the file).
    #[arg(long, default_value_t = 30)]
    pub idle_window_min: i64,
    /// Minutes of progress between two checkpoints of every job: a preempted job loses what
    /// it did since its last one. 0: jobs save when stopped and lose nothing.
    #[arg(long, default_value_t = 30)]
    pub checkpoint_every_min: i64,
    /// Seconds a preempted job spends restarting (holding its GPUs, making no progress).
    #[arg(long, default_value_t = 60)]
    pub restart_delay_s: i64,
    /// Run the scorecard: fifo, backfill, srtf, las, gittins, themis and perch (with and without trace
    /// quotas) on the built-in matrix of traces, cluster sizes and seeds; a table per perch
    /// variant, the targets listed in scheduler/README.md checked per case.
    #[arg(long, conflicts_with_all = ["policy", "plot", "show_config", "cluster"])]
    pub suite: bool,
    /// With `--suite`: the first tuning seed and the first held-out seed of the synthetic
    /// traces only, no Philly (seconds, not minutes).
    #[arg(long, requires = "suite")]
    pub quick: bool,
    /// With `--suite`: the tuning seeds only, the held-out ones not even replayed: what to run
    /// while changing a policy (the held-out seeds are only ever scored).
    #[arg(long, requires = "suite")]
    pub tuning: bool,
    /// Print a synthetic trace (`small`, `fractional`, `gangs`, `heavy-tail`, `testbed`,
    /// `overloaded`, `small-nodes`, `bursts`) or the cluster file the fractional one is meant
    /// for (`mixed-cluster`) to stdout, from `--seed`.
    #[arg(long, conflicts_with = "suite")]
    pub generate: Option<String>,
    /// Write queue length and utilization over time to this SVG file.
    #[arg(long)]
    pub plot: Option<String>,
    /// After the table, print each replayed policy as a `[scheduler]` section (perch's with
    /// the quotas it derived from the trace): a config to start from, and to replay again
    /// with `--config`.
    #[arg(long)]
    pub show_config: bool,
}

/// Runs the replays and prints the table.
pub fn run(args: SimulateArgs, file: Option<&ConfigFile>) -> anyhow::Result<()> {
    let preemption = preemption_cost(&args)?;
    if let Some(kind) = &args.generate {
        return generate(kind, args.seed);
    }
    if args.suite {
        return suite(args.trace.as_deref(), args.quick, args.tuning, preemption);
    }
    let Some(trace) = args.trace.as_deref() else {
        bail!("--trace FILE is needed (or --suite, or --generate KIND)");
    };
    let (policies, configured) = policies(args.policy.as_deref(), file)?;
    if !(0.0..=0.9).contains(&args.idle_share) {
        bail!(
            "--idle-share must be between 0 and 0.9, got {}",
            args.idle_share
        );
    }
    let jobs = load_jobs(trace, &args)?;
    let cluster = cluster(&args)?;
    println!("cluster: {}", cluster.describe());
    let opts = SimOptions {
        cluster,
        preemption,
        seed: args.seed,
        limit_factor: (args.limit_factor_low, args.limit_factor_high),
        limits: args.limits,
        idle_window: args.idle_window_min * perch_scheduler::MINUTE,
        ..SimOptions::default()
    };
    let gpus = opts.cluster.total_gpus();
    let mut runs: Vec<(String, perch_scheduler::Config)> = policies
        .into_iter()
        .map(|p| (p.name().to_owned(), sim::policy_config(p, &jobs, &opts)))
        .collect();
    if let Some(config) = configured {
        runs.push(("config".to_owned(), config));
    }
    let replayed = replay(&jobs, runs, &opts, args.show_config)?;
    print!("{}", sim::format_table(&replayed.rows));
    print_sections(replayed.shown)?;
    if let Some(path) = &args.plot {
        let title = format!("{trace} on {gpus} GPUs");
        sim::write_svg(path, &title, &replayed.series)?;
        println!("plot written to {path}");
    }
    Ok(())
}

/// What a preempted job loses (`--checkpoint-every-min`, `--restart-delay-s`), each at most a
/// year (which also keeps the milliseconds far from overflowing).
fn preemption_cost(args: &SimulateArgs) -> anyhow::Result<PreemptionCost> {
    if !(0..=525_600).contains(&args.checkpoint_every_min) {
        bail!(
            "--checkpoint-every-min must be 0 (jobs save when stopped) to 525600 (a year), got {}",
            args.checkpoint_every_min
        );
    }
    if !(0..=31_536_000).contains(&args.restart_delay_s) {
        bail!(
            "--restart-delay-s must be 0 to 31536000 (a year), got {}",
            args.restart_delay_s
        );
    }
    Ok(PreemptionCost {
        checkpoint_every: args.checkpoint_every_min * perch_scheduler::MINUTE,
        restart_delay: args.restart_delay_s * 1000,
    })
}

/// `--generate KIND`: a synthetic trace (or the cluster file of the fractional one) on stdout.
fn generate(kind: &str, seed: u64) -> anyhow::Result<()> {
    if kind == "mixed-cluster" {
        print!("{}", sim::MIXED_CLUSTER);
        return Ok(());
    }
    let k = SynthKind::parse(kind).with_context(|| {
        let names: Vec<&str> = SynthKind::ALL.iter().map(|k| k.name()).collect();
        format!(
            "--generate `{kind}`: expected one of {} or mixed-cluster",
            names.join(", ")
        )
    })?;
    print!("{}", sim::synth::generate(k, seed));
    Ok(())
}

/// The policies to replay: those `--policy` names (default `all`, or none beside a config
/// file), and the config file's `[scheduler]`, when one is given.
fn policies(
    named: Option<&str>,
    file: Option<&ConfigFile>,
) -> anyhow::Result<(Vec<SimPolicy>, Option<perch_scheduler::Config>)> {
    let configured = file
        .map(|f| {
            f.config
                .scheduler
                .policy()
                .with_context(|| format!("in config file {}", f.path.display()))
        })
        .transpose()?;
    let named = match (named, &configured) {
        (Some(p), _) => p,
        (None, Some(_)) => "",
        (None, None) => "all",
    };
    let policies: Vec<SimPolicy> = if named == "all" {
        SimPolicy::ALL.to_vec()
    } else if named.is_empty() {
        Vec::new()
    } else {
        named
            .split(',')
            .map(|p| {
                SimPolicy::parse(p.trim()).with_context(|| {
                    let names: Vec<&str> = SimPolicy::ALL.iter().map(|p| p.name()).collect();
                    format!(
                        "--policy `{p}`: expected one of {} or all",
                        names.join(", ")
                    )
                })
            })
            .collect::<anyhow::Result<_>>()?
    };
    Ok((policies, configured))
}

/// The trace's jobs (`--format`), with idle tails added when `--idle-share` asks; its
/// warnings go to stderr.
fn load_jobs(trace: &str, args: &SimulateArgs) -> anyhow::Result<Vec<sim::TraceJob>> {
    let format = match args.format.as_str() {
        "philly" => Some(TraceFormat::Philly),
        "generic" => Some(TraceFormat::Generic),
        _ => None,
    };
    let loaded = sim::trace::load(trace, format)?;
    for w in &loaded.warnings {
        eprintln!("warning: {w}");
    }
    let mut jobs = loaded.jobs;
    println!("{trace}: {} jobs", jobs.len());
    if args.idle_share > 0.0 {
        let got = sim::trace::add_idle_tails(&mut jobs, args.idle_share, args.seed);
        println!(
            "idle tails: {:.1}% of GPU-time at 0% utilization",
            got * 100.0
        );
    }
    Ok(jobs)
}

/// The simulated cluster: `--cluster`'s file (its warnings to stderr), else `--nodes`
/// identical nodes.
fn cluster(args: &SimulateArgs) -> anyhow::Result<SimCluster> {
    Ok(match &args.cluster {
        Some(path) => {
            let (cluster, warnings) = SimCluster::load(path)?;
            for w in &warnings {
                eprintln!("warning: {w}");
            }
            cluster
        }
        None => SimCluster::uniform(args.nodes, args.gpus_per_node, args.nodes_per_rack),
    })
}

/// What the replays gave: a table row and a time series per run, and (with `--show-config`)
/// each run's policy as a `[scheduler]` section, `None` for the simulator's reference
/// policies.
struct Replayed {
    rows: Vec<sim::Summary>,
    series: Vec<(String, u32, Vec<sim::Sample>)>,
    shown: Vec<(String, Option<SchedulerSection>)>,
}

/// Replays `jobs` under each of `runs` in turn, with progress on stderr (the table on stdout
/// stays clean: a large trace takes minutes).
fn replay(
    jobs: &[sim::TraceJob],
    runs: Vec<(String, perch_scheduler::Config)>,
    opts: &SimOptions,
    show_config: bool,
) -> anyhow::Result<Replayed> {
    let gpus = opts.cluster.total_gpus();
    let count = runs.len();
    let mut replayed = Replayed {
        rows: Vec::new(),
        series: Vec::new(),
        shown: Vec::new(),
    };
    for (i, (name, config)) in runs.into_iter().enumerate() {
        if show_config {
            replayed
                .shown
                .push((name.clone(), SchedulerSection::from_policy(&config)));
        }
        eprintln!(
            "[{}/{count}] replaying {} jobs under {name} on {gpus} GPUs...",
            i + 1,
            jobs.len(),
        );
        let started = std::time::Instant::now();
        let report = sim::simulate_with(jobs, config, &name, opts)?;
        eprintln!(
            "[{}/{count}] {name} done in {:.1} s",
            i + 1,
            started.elapsed().as_secs_f64()
        );
        if report.made_preemptible > 0 {
            eprintln!(
                "note: {name}: {} job(s) the trace marks not preemptible ask for more than their \
                 account's quota on their own; a server refuses them (they could only ever run \
                 on borrowed GPUs, which their owners take back), so they were replayed \
                 preemptible, as their users would resubmit them",
                report.made_preemptible
            );
        }
        replayed.rows.push(report.summary);
        replayed.series.push((name, gpus, report.series));
    }
    Ok(replayed)
}

/// `--show-config`: each replayed policy as a config file's `[scheduler]` section, or why a
/// reference policy has none.
fn print_sections(shown: Vec<(String, Option<SchedulerSection>)>) -> anyhow::Result<()> {
    for (name, section) in shown {
        println!();
        match section {
            Some(section) => {
                #[derive(serde::Serialize)]
                struct File {
                    scheduler: SchedulerSection,
                }
                println!("# {name}, as a config file section (perch --config FILE simulate ...)");
                print!(
                    "{}",
                    toml::to_string(&File { scheduler: section })
                        .context("writing the policy as TOML")?
                );
            }
            None => println!(
                "# {name}: a reference policy of the simulator (srtf needs true job durations, las and gittins are the duration-free anchors, themis the finish-time-fairness anchor); no server runs it"
            ),
        }
    }
    Ok(())
}

/// `--suite`: the scorecard, with progress on stderr.
fn suite(
    philly: Option<&str>,
    quick: bool,
    tuning: bool,
    preemption: PreemptionCost,
) -> anyhow::Result<()> {
    let default = "../shared/traces/philly.csv";
    let path = philly.or((!quick && std::path::Path::new(default).exists()).then_some(default));
    let philly = match path {
        Some(p) if !quick => Some(sim::trace::load(p, None)?),
        _ => None,
    };
    if philly.is_none() && !quick {
        eprintln!(
            "no Philly trace ({default} not found; give one with --trace): the synthetic traces only"
        );
    }
    let mut cases = sim::suite::builtin(philly.as_ref(), quick)?;
    if tuning {
        cases.retain(|c| c.set == sim::suite::SeedSet::Tuning);
    }
    for c in &mut cases {
        c.opts.preemption = preemption;
    }
    let mut results = Vec::new();
    let started = std::time::Instant::now();
    for (i, case) in cases.iter().enumerate() {
        eprintln!(
            "[{}/{}] {} seed {} ({}) on {} ({} jobs, {} limits), {} policies...",
            i + 1,
            cases.len(),
            case.trace,
            case.opts.seed,
            case.set.name(),
            case.opts.cluster.describe(),
            case.jobs.len(),
            case.opts.limits.name(),
            sim::suite::POLICIES.len()
        );
        results.push(sim::suite::run_case(case)?);
    }
    println!(
        "perch simulate --suite{}: {} cases, preemption cost: checkpoint every {} min, restart {} s ({:.0} s)",
        if quick { " --quick" } else { "" },
        results.len(),
        preemption.checkpoint_every / perch_scheduler::MINUTE,
        preemption.restart_delay / 1000,
        started.elapsed().as_secs_f64()
    );
    print!("{}", sim::suite::scorecards(&results));
    Ok(())
}

fn parse_limits(s: &str) -> std::result::Result<sim::LimitModel, String> {
    sim::LimitModel::parse(s).ok_or_else(|| format!("`{s}`: expected uniform or habits"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// The scorecard's targets are for perch as a server runs it: a server with no
    /// `[scheduler]` at all runs exactly the policy the scorecard scores and whose figures the
    /// regression test keeps (`sim::suite::TARGETED`).
    #[test]
    fn the_servers_default_policy_is_the_one_the_scorecard_scores() {
        let jobs = vec![sim::TraceJob::new(0, 60_000, 1, "a", "a")];
        let opts = SimOptions::uniform(4, 8);
        let scored = sim::policy_config(sim::suite::TARGETED, &jobs, &opts);
        let default = Config::parse("")
            .expect("an empty config")
            .scheduler
            .policy()
            .expect("the default policy");
        assert_eq!(default, scored);
        assert_eq!(sim::suite::TARGETED, SimPolicy::PerchNoQuotas);
    }

    /// One policy, two entry points: a `[scheduler]` written to equal the built-in `perch`
    /// replay (its trace-derived quotas included) is the same core configuration and gives the
    /// same numbers, row for row.
    #[test]
    fn a_config_equal_to_the_built_in_policy_replays_the_same() {
        let trace = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scheduler/tests/data/philly-300.csv"
        );
        let jobs = sim::trace::load(trace, None).expect("trace").jobs;
        let opts = SimOptions::uniform(4, 8);
        let built_in = sim::policy_config(SimPolicy::Perch, &jobs, &opts);
        assert!(
            built_in.quotas.iter().any(|(_, q)| *q > 0),
            "the sample's quotas bind"
        );
        let quotas: String = built_in
            .quotas
            .iter()
            .map(|(a, q)| format!("{:?} = {q}\n", a.0))
            .collect();
        let file = Config::parse(&format!("[scheduler.quotas]\n{quotas}")).expect("config");
        let configured = file.scheduler.policy().expect("policy");
        assert_eq!(configured, built_in);
        // What --show-config prints reads back as the same policy, for every built-in a
        // server can run.
        for p in [
            SimPolicy::Perch,
            SimPolicy::PerchIdleReclaim,
            SimPolicy::Backfill,
            SimPolicy::Fifo,
        ] {
            let c = sim::policy_config(p, &jobs, &opts);
            let section = SchedulerSection::from_policy(&c).expect("expressible");
            #[derive(serde::Serialize)]
            struct File {
                scheduler: SchedulerSection,
            }
            let text = toml::to_string(&File { scheduler: section }).expect("toml");
            let back = Config::parse(&text).expect("parses").scheduler.policy();
            assert_eq!(back.expect("policy"), c, "{}: {text}", p.name());
        }
        for reference in [
            SimPolicy::Srtf,
            SimPolicy::Las,
            SimPolicy::Gittins,
            SimPolicy::Themis,
        ] {
            let c = sim::policy_config(reference, &jobs, &opts);
            assert!(SchedulerSection::from_policy(&c).is_none());
        }
        let a = sim::simulate(&jobs, SimPolicy::Perch, &opts).expect("built-in");
        let b = sim::simulate_with(&jobs, configured, "perch", &opts).expect("config");
        assert!(a.summary.finished > 0);
        assert_eq!(a.summary, b.summary);
        // And a different policy in the file is a different replay.
        let fifo = Config::parse("[scheduler]\npolicy = \"fifo\"\n")
            .expect("config")
            .scheduler
            .policy()
            .expect("policy");
        let c = sim::simulate_with(&jobs, fifo, "perch", &opts).expect("fifo");
        assert_ne!(a.summary, c.summary);
    }
}
