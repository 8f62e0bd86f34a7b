//! The `perch` command: parses arguments and hands over to the libraries. See ARCHITECTURE.md.

mod client;
mod commands;
mod config;
mod telemetry;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = commands::Cli::parse();
    // `run` starts logging once it knows the config: the long-running commands may also
    // export their spans over OTLP (see telemetry.rs), and flush them before returning.
    match commands::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
