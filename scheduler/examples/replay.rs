//! Replays a trace under several policies and cluster sizes and prints the table, with the
//! wall time of each replay: the numbers in `BENCHMARKS.md` come from here.
//!
//! `cargo run --release -p perch-scheduler --example replay -- TRACE [GPUS,GPUS..] [POLICY,..] [IDLE_SHARE] [SVG]`

use perch_scheduler::sim::{self, SimOptions, SimPolicy};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let trace = args
        .get(1)
        .map_or("../shared/traces/philly.csv", String::as_str);
    let sizes: Vec<u32> = args
        .get(2)
        .map_or("512", String::as_str)
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let policies: Vec<SimPolicy> = match args.get(3).map(String::as_str) {
        None | Some("all") => SimPolicy::ALL.to_vec(),
        Some(list) => list
            .split(',')
            .map(|p| SimPolicy::parse(p).ok_or_else(|| anyhow::anyhow!("unknown policy {p}")))
            .collect::<Result<_, _>>()?,
    };
    let idle_share: f64 = args.get(4).map_or(Ok(0.0), |s| s.parse())?;
    let t = Instant::now();
    let mut jobs = sim::trace::load(trace, None)?.jobs;
    if idle_share > 0.0 {
        let got = sim::trace::add_idle_tails(&mut jobs, idle_share, 1);
        println!("idle tails: {:.1}% of GPU-time at 0%", got * 100.0);
    }
    println!(
        "loaded {} jobs in {:.2} s",
        jobs.len(),
        t.elapsed().as_secs_f64()
    );
    let mut rows = Vec::new();
    let mut runs = Vec::new();
    for &gpus in &sizes {
        let opts = SimOptions::uniform(gpus / 8, 8);
        for &p in &policies {
            let t = Instant::now();
            let r = sim::simulate(&jobs, p, &opts)?;
            println!(
                "{} at {} GPUs: replay {:.2} s",
                p.name(),
                gpus,
                t.elapsed().as_secs_f64()
            );
            rows.push(r.summary.clone());
            runs.push((format!("{} {}", p.name(), gpus), gpus, r.series));
        }
    }
    print!("{}", sim::format_table(&rows));
    if let Some(path) = args.get(5) {
        let title = format!(
            "{} (idle share {idle_share})",
            trace.rsplit('/').next().unwrap_or(trace)
        );
        sim::write_svg(path, &title, &runs)?;
    }
    Ok(())
}
