//! The `perch` command: parses arguments and hands over to the libraries. See ARCHITECTURE.md.

mod client;
mod commands;
mod config;
mod telemetry;

use clap::Parser;

fn main() -> std::process::ExitCode {
    // A job's supervisor, started by the agent (not a command for people): it must not parse
    // a config or start a runtime, only watch its job.
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args
        .get(1)
        .is_some_and(|a| a == perch_collector::launcher::shim::SUBCOMMAND)
    {
        let code = perch_collector::launcher::shim::main(&args[2..]);
        return std::process::ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let cli = commands::Cli::parse();
    // Before any HTTP client (the CLI's, the agent's, the OTLP exporter's) is built.
    perch_model::tls::use_ring();
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
