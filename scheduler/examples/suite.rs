//! The scorecard of `perch simulate --suite` without building the server: for iterating on a
//! policy.
//!
//! `cargo run --release -p perch-scheduler --example suite -- [PHILLY.csv|quick|synthetic] [--tuning] [--figures]`
//!
//! `synthetic`: every seed of the synthetic traces, no Philly. `--tuning`: the tuning seeds
//! only, the held-out ones not even replayed: what to run while changing a policy.
//! `--figures`: print the figures file the CI test compares with
//! (`scheduler/tests/data/scorecard-quick.csv` is this on `quick`) instead of the tables.

use perch_scheduler::sim;
use perch_scheduler::sim::suite::SeedSet;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    let arg = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map(String::as_str);
    let quick = arg == Some("quick");
    let philly = match arg {
        Some("quick" | "synthetic") => None,
        Some(path) => Some(sim::trace::load(path, None)?),
        None => sim::trace::load("../shared/traces/philly.csv", None).ok(),
    };
    let mut cases = sim::suite::builtin(philly.as_ref(), quick)?;
    if flag("--tuning") {
        cases.retain(|c| c.set == SeedSet::Tuning);
    }
    let started = std::time::Instant::now();
    let results = cases
        .iter()
        .map(sim::suite::run_case)
        .collect::<Result<Vec<_>, _>>()?;
    eprintln!(
        "{} cases in {:.1} s",
        results.len(),
        started.elapsed().as_secs_f64()
    );
    if flag("--figures") {
        print!("{}", sim::suite::figures(&results));
    } else {
        print!("{}", sim::suite::scorecards(&results));
    }
    Ok(())
}
