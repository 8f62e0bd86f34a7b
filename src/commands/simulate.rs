//! `perch simulate`: replays a job trace through the scheduler core in virtual time and prints
//! JCT, waiting, allocation, useful utilization, fairness and preemptions per policy, with an
//! optional SVG plot of queue length and utilization over time.
//!
//! All the work is in `perch_scheduler::sim`; this file only turns flags into its options.

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
    #[arg(long, default_value = "all")]
    pub policy: String,
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
    /// Minutes a job must stay idle before perch acts on it.
    #[arg(long, default_value_t = 30)]
    pub idle_window_min: i64,
    /// Write queue length and utilization over time to this SVG file.
    #[arg(long)]
    pub plot: Option<String>,
}

/// Runs the replays and prints the table.
pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
    let format = match args.format.as_str() {
        "philly" => Some(TraceFormat::Philly),
        "generic" => Some(TraceFormat::Generic),
        _ => None,
    };
    let policies: Vec<SimPolicy> = if args.policy == "all" {
        SimPolicy::ALL.to_vec()
    } else {
        args.policy
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
    let count = policies.len();
    for (i, p) in policies.into_iter().enumerate() {
        // Progress on stderr (the table on stdout stays clean): a large trace takes minutes.
        eprintln!(
            "[{}/{count}] replaying {} jobs under {} on {gpus} GPUs...",
            i + 1,
            jobs.len(),
            p.name()
        );
        let started = std::time::Instant::now();
        let report = sim::simulate(&jobs, p, &opts)?;
        eprintln!(
            "[{}/{count}] {} done in {:.1} s",
            i + 1,
            p.name(),
            started.elapsed().as_secs_f64()
        );
        rows.push(report.summary);
        series.push((p.name().to_string(), gpus, report.series));
    }
    print!("{}", sim::format_table(&rows));
    if let Some(path) = &args.plot {
        let title = format!("{} on {} GPUs", args.trace, gpus);
        sim::write_svg(path, &title, &series)?;
        println!("plot written to {path}");
    }
    Ok(())
}
