//! `perch bench`: runs the benchmarks, which live in their own binary (`perch-bench`, crate
//! `bench/`) so that their code (datasets, DuckDB comparisons, load generators) is not built
//! into every perch. `perch bench <args>` runs `perch-bench <args>` from beside this binary,
//! else from `PATH`.

use anyhow::{Context, Result, bail};
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Args)]
#[command(disable_help_flag = true)]
pub struct BenchArgs {
    /// What to measure and how (`perch bench --help` lists the benchmarks).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

/// Where `perch-bench` is: beside this executable (cargo builds both into one directory),
/// else on `PATH`.
fn locate() -> Option<PathBuf> {
    let beside = std::env::current_exe().ok()?.parent()?.join("perch-bench");
    if beside.is_file() {
        return Some(beside);
    }
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("perch-bench"))
            .find(|p| p.is_file())
    })
}

pub fn run(args: BenchArgs) -> Result<()> {
    let Some(bench) = locate() else {
        bail!(
            "perch-bench is not built: the benchmarks are their own binary. Build it beside perch with `cargo build --release -p perch-bench` (or `cargo build --release --workspace`), then run `perch bench` again"
        );
    };
    let status = std::process::Command::new(&bench)
        .args(&args.args)
        .status()
        .with_context(|| format!("running {}", bench.display()))?;
    if !status.success() {
        std::process::exit(status.code().unwrap_or(1));
    }
    Ok(())
}
