//! `perch sql`: sends one query to a server's `POST /v1/sql` and prints the answer as an
//! aligned table (decoded from Arrow IPC), CSV or JSON.

use super::jobs::{Refused, ServerArg};
use crate::client::{ClientConfig, Connection};
use crate::config::ConfigFile;
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum OutputFormat {
    Table,
    Csv,
    Json,
}

#[derive(Debug, Args)]
pub struct SqlArgs {
    /// The query, e.g. "SELECT count(*) FROM gpu_samples".
    query: String,
    #[command(flatten)]
    server: ServerArg,
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    format: OutputFormat,
    /// Show the query plan instead of running the query.
    #[arg(long)]
    explain: bool,
}

pub fn run(args: SqlArgs, config_file: Option<&ConfigFile>) -> Result<()> {
    let client = args.server.resolve(config_file)?;
    query(args, client)
}

fn query(args: SqlArgs, client: ClientConfig) -> Result<()> {
    let sql = if args.explain {
        format!("EXPLAIN {}", args.query)
    } else {
        args.query
    };
    let wire = match args.format {
        OutputFormat::Table => "arrow",
        OutputFormat::Csv => "csv",
        OutputFormat::Json => "json",
    };
    // No time limit: the server bounds a query's time itself (query.timeout_secs).
    let connection = Connection::new(client, None)?;
    let body = serde_json::json!({"sql": sql, "format": wire});
    let response =
        connection.send(|http, server| http.post(format!("{server}/v1/sql")).json(&body))?;
    let status = response.status();
    let truncated = response
        .headers()
        .get("x-perch-truncated")
        .is_some_and(|v| v == "true");
    let body = response.bytes().context("reading the answer")?;
    if !status.is_success() {
        return Err(Refused::new(status, &body, &connection).into());
    }
    match args.format {
        OutputFormat::Table => {
            let reader =
                arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(body), None)?;
            let batches = reader.collect::<Result<Vec<_>, _>>()?;
            let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
            if batches.is_empty() || rows == 0 {
                println!("(no rows)");
            } else {
                println!("{}", arrow::util::pretty::pretty_format_batches(&batches)?);
                println!("({rows} row{})", if rows == 1 { "" } else { "s" });
            }
        }
        OutputFormat::Csv | OutputFormat::Json => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            out.write_all(&body)?;
            if !body.ends_with(b"\n") {
                out.write_all(b"\n")?;
            }
        }
    }
    if truncated {
        eprintln!(
            "note: the result was cut at the server's row limit; add a LIMIT, aggregate, or narrow the time range"
        );
    }
    Ok(())
}
