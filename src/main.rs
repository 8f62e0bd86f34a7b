//! The `perch` command: parses arguments and hands over to the libraries. See ARCHITECTURE.md.

mod client;
mod commands;
mod config;
mod memory;
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
    // The built-in validation check, run by the agent on the server's request.
    if args
        .get(1)
        .is_some_and(|a| a == perch_collector::validation::SUBCOMMAND)
    {
        return std::process::ExitCode::from(commands::validate::builtin(&args[2..]));
    }
    let cli = commands::Cli::parse();
    // Before any HTTP client (the CLI's, the agent's, the OTLP exporter's) is built.
    perch_model::tls::use_ring();
    // `run` starts logging once it knows the config: the long-running commands may also
    // export their spans over OTLP (see telemetry.rs), and flush them before returning.
    match commands::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", report(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// `e` and its causes, each said once: many errors print their cause in their own message
/// and also hand it on as their source, which `{:#}` printed again ("locking ... LOCK:
/// already locked: locking ... LOCK: already locked: already locked").
fn report(e: &anyhow::Error) -> String {
    let mut said: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !said.last().is_some_and(|last| last.contains(&text)) {
            said.push(text);
        }
    }
    said.join(": ")
}

#[cfg(test)]
mod tests {
    use super::report;

    #[test]
    fn a_cause_its_error_already_names_is_said_once() {
        /// An error that names its cause and hands it on too.
        #[derive(Debug)]
        struct Locking(std::io::Error);
        impl std::fmt::Display for Locking {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "locking data directory /d/LOCK: {}", self.0)
            }
        }
        impl std::error::Error for Locking {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = anyhow::Error::new(Locking(std::io::Error::other("already locked")))
            .context("opening the data directory /d");
        assert_eq!(
            report(&e),
            "opening the data directory /d: locking data directory /d/LOCK: already locked"
        );
        let plain = anyhow::anyhow!("no such job").context("cancelling job 7");
        assert_eq!(report(&plain), "cancelling job 7: no such job");
    }
}
