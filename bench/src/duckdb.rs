//! DuckDB, the engine `perch bench query` compares with, driven through its Python package.
//!
//! `scripts/bench_duckdb.py` is embedded in the binary and run with `python3 -c`, one process
//! for the whole benchmark, so DuckDB keeps its caches between runs as perch does. Requests
//! and answers are JSON lines on the child's stdin and stdout; the script times each query
//! itself, so process and pipe overheads are not counted against DuckDB.

use super::results::Cell;
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

const SCRIPT: &str = include_str!("../../scripts/bench_duckdb.py");

pub(super) struct DuckDb {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    pub(super) version: String,
}

impl DuckDb {
    /// Starts DuckDB with `threads` threads and a `memory_mb` memory limit, with a view per
    /// `(name, source)`, `source` being a table function such as `read_parquet('...')`.
    pub(super) fn start(
        python: &str,
        threads: usize,
        memory_mb: usize,
        views: &[(&str, String)],
    ) -> Result<DuckDb> {
        let mut child = Command::new(python)
            .arg("-c")
            .arg(SCRIPT)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| {
                format!("starting {python} (give another interpreter with --python)")
            })?;
        let stdin = child.stdin.take().context("the DuckDB helper's stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("the DuckDB helper's stdout")?);
        let mut db = DuckDb {
            child,
            stdin: Some(stdin),
            stdout,
            version: String::new(),
        };
        let views: serde_json::Map<String, Value> = views
            .iter()
            .map(|(name, source)| ((*name).to_owned(), Value::String(source.clone())))
            .collect();
        let answer = db.call(&serde_json::json!({
            "threads": threads,
            "memory_mb": memory_mb,
            "views": views,
        }))?;
        db.version = answer["version"].as_str().unwrap_or("?").to_owned();
        Ok(db)
    }

    /// Runs `sql` once: DuckDB's own timing and the result rows.
    pub(super) fn run(&mut self, sql: &str) -> Result<(Duration, Vec<Vec<Cell>>)> {
        let answer = self.call(&serde_json::json!({ "sql": sql }))?;
        let seconds = answer["seconds"]
            .as_f64()
            .context("the DuckDB helper's answer lacks seconds")?;
        Ok((
            Duration::from_secs_f64(seconds.max(0.0)),
            rows(&answer["rows"])?,
        ))
    }

    /// Closes DuckDB's database and opens a new one with the same settings and views, so the
    /// next query runs as the first after a start.
    pub(super) fn reconnect(&mut self) -> Result<()> {
        self.call(&serde_json::json!({ "reconnect": true }))?;
        Ok(())
    }

    /// Runs every statement of `sqls` at once, one cursor each on DuckDB's threads: the time
    /// until the last one answered, and each one's rows.
    pub(super) fn run_together(
        &mut self,
        sqls: &[String],
    ) -> Result<(Duration, Vec<Vec<Vec<Cell>>>)> {
        let answer = self.call(&serde_json::json!({ "together": sqls }))?;
        let seconds = answer["seconds"]
            .as_f64()
            .context("the DuckDB helper's answer lacks seconds")?;
        let results = answer["results"]
            .as_array()
            .context("the DuckDB helper's answer lacks results")?
            .iter()
            .map(rows)
            .collect::<Result<_>>()?;
        Ok((Duration::from_secs_f64(seconds.max(0.0)), results))
    }

    /// DuckDB's EXPLAIN ANALYZE of `sql`.
    pub(super) fn explain(&mut self, sql: &str) -> Result<String> {
        let answer = self.call(&serde_json::json!({ "sql": sql, "explain": true }))?;
        Ok(answer["plan"].as_str().unwrap_or_default().to_owned())
    }

    fn call(&mut self, request: &Value) -> Result<Value> {
        let stdin = self.stdin.as_mut().context("the DuckDB helper is closed")?;
        writeln!(stdin, "{request}")
            .and_then(|()| stdin.flush())
            .context("writing to the DuckDB helper (did it exit? see its messages above)")?;
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .context("reading from the DuckDB helper")?;
        if n == 0 {
            bail!("the DuckDB helper exited; see its messages above");
        }
        let answer: Value = serde_json::from_str(&line)
            .with_context(|| format!("the DuckDB helper answered {line:?}"))?;
        if let Some(error) = answer["error"].as_str() {
            bail!("DuckDB: {error}");
        }
        Ok(answer)
    }
}

/// A result's rows as the helper sends them: an array of arrays of JSON values.
fn rows(value: &Value) -> Result<Vec<Vec<Cell>>> {
    value
        .as_array()
        .context("the DuckDB helper's answer lacks rows")?
        .iter()
        .map(|row| {
            row.as_array()
                .map(|cells| cells.iter().map(Cell::from_json).collect())
                .context("a DuckDB row is not an array")
        })
        .collect()
}

impl Drop for DuckDb {
    fn drop(&mut self) {
        // Closing stdin ends the helper's read loop; then reap it.
        self.stdin.take();
        let _ = self.child.wait();
    }
}
