//! `perch simulate`: replays a job trace through the scheduler core in virtual time and prints
//! JCT, waiting, allocation, useful utilization, fairness and preemptions per policy, with an
//! optional SVG plot of queue length and utilization over time.
//!
//! With `--config`, the file's `[scheduler]` (the policy the server runs) is replayed too, as
//! the row `config`: an operator replays last month under a proposed policy before switching.
//!
//! All the work is in `perch_scheduler::sim`; this file only turns flags into its options.

use crate::config::{ConfigFile, SchedulerSection};
use anyhow::{Context, bail};
use perch_scheduler::sim::{self, SimOptions, SimPolicy, TraceFormat};

/// Flags of `perch simulate`.
#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// The trace file (Philly CSV, or the generic CSV described in scheduler/README.md).
    #[arg(long)]
    pub trace: String,
    /// `philly`, `generic`, or `auto` (from the header).
    #[arg(long, default_value = "auto", value_parser = ["auto", "philly", "generic"])]
    pub format: String,
    /// Nodes in the simulated cluster.
    #[arg(long, default_value_t = 64)]
    pub nodes: u32,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: u32,
    /// Nodes per rack label.
    #[arg(long, default_value_t = 8)]
    pub nodes_per_rack: u32,
    /// `fifo`, `backfill`, `srtf`, `perch`, `perch+idle-reclaim`, or `all`; several with commas.
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
    /// Give jobs idle tails until this share of GPU-time sits at 0% utilization (0 to 0.9).
    #[arg(long, default_value_t = 0.0)]
    pub idle_share: f64,
    /// Minutes a job must stay idle before perch acts on it (the built-in policies; the
    /// `config` row takes `[scheduler.idle] after` from the file).
    #[arg(long, default_value_t = 30)]
    pub idle_window_min: i64,
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
    let format = match args.format.as_str() {
        "philly" => Some(TraceFormat::Philly),
        "generic" => Some(TraceFormat::Generic),
        _ => None,
    };
    let configured = file
        .map(|f| {
            f.config
                .scheduler
                .policy()
                .with_context(|| format!("in config file {}", f.path.display()))
        })
        .transpose()?;
    let named = match (&args.policy, &configured) {
        (Some(p), _) => p.as_str(),
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
    if !(0.0..=0.9).contains(&args.idle_share) {
        bail!(
            "--idle-share must be between 0 and 0.9, got {}",
            args.idle_share
        );
    }
    let mut jobs = sim::trace::load(&args.trace, format)?;
    println!("{}: {} jobs", args.trace, jobs.len());
    if args.idle_share > 0.0 {
        let got = sim::trace::add_idle_tails(&mut jobs, args.idle_share, args.seed);
        println!(
            "idle tails: {:.1}% of GPU-time at 0% utilization",
            got * 100.0
        );
    }
    let opts = SimOptions {
        nodes: args.nodes,
        gpus_per_node: args.gpus_per_node,
        nodes_per_rack: args.nodes_per_rack,
        seed: args.seed,
        limit_factor: (args.limit_factor_low, args.limit_factor_high),
        idle_window: args.idle_window_min * perch_scheduler::MINUTE,
        ..SimOptions::default()
    };
    let gpus = args.nodes * args.gpus_per_node;
    let mut rows = Vec::new();
    let mut series = Vec::new();
    let mut runs: Vec<(String, perch_scheduler::Config)> = policies
        .into_iter()
        .map(|p| (p.name().to_owned(), sim::policy_config(p, &jobs, &opts)))
        .collect();
    if let Some(config) = configured {
        runs.push(("config".to_owned(), config));
    }
    let count = runs.len();
    let mut shown = Vec::new();
    for (i, (name, config)) in runs.into_iter().enumerate() {
        if args.show_config {
            shown.push((name.clone(), SchedulerSection::from_policy(&config)));
        }
        // Progress on stderr (the table on stdout stays clean): a large trace takes minutes.
        eprintln!(
            "[{}/{count}] replaying {} jobs under {name} on {gpus} GPUs...",
            i + 1,
            jobs.len(),
        );
        let started = std::time::Instant::now();
        let report = sim::simulate_with(&jobs, config, &name, &opts)?;
        eprintln!(
            "[{}/{count}] {name} done in {:.1} s",
            i + 1,
            started.elapsed().as_secs_f64()
        );
        rows.push(report.summary);
        series.push((name, gpus, report.series));
    }
    print!("{}", sim::format_table(&rows));
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
            None => println!("# {name}: needs true job durations; no server runs it"),
        }
    }
    if let Some(path) = &args.plot {
        let title = format!("{} on {} GPUs", args.trace, gpus);
        sim::write_svg(path, &title, &series)?;
        println!("plot written to {path}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// One policy, two entry points: a `[scheduler]` written to equal the built-in `perch`
    /// replay (its trace-derived quotas included) is the same core configuration and gives the
    /// same numbers, row for row.
    #[test]
    fn a_config_equal_to_the_built_in_policy_replays_the_same() {
        let trace = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scheduler/tests/data/philly-300.csv"
        );
        let jobs = sim::trace::load(trace, None).expect("trace");
        let opts = SimOptions {
            nodes: 4,
            gpus_per_node: 8,
            ..SimOptions::default()
        };
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
        let srtf = sim::policy_config(SimPolicy::Srtf, &jobs, &opts);
        assert!(SchedulerSection::from_policy(&srtf).is_none());
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
