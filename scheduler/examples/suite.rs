//! The scorecard of `perch simulate --suite` without building the server: for iterating on a
//! policy. `cargo run --release -p perch-scheduler --example suite -- [PHILLY.csv|quick|synthetic]`
//! (`synthetic`: every seed of the synthetic traces, no Philly).

use perch_scheduler::sim;

fn main() -> anyhow::Result<()> {
    let arg = std::env::args().nth(1);
    let quick = arg.as_deref() == Some("quick");
    let philly = match arg.as_deref() {
        Some("quick" | "synthetic") => None,
        Some(path) => Some(sim::trace::load(path, None)?),
        None => sim::trace::load("../shared/traces/philly.csv", None).ok(),
    };
    let cases = sim::suite::builtin(philly.as_ref(), quick)?;
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
    print!("{}", sim::suite::scorecards(&results));
    Ok(())
}
