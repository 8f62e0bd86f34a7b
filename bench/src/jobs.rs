//! `perch bench jobs`: job submission throughput over HTTP, and submit-to-start latency on an
//! idle node with a real agent.

use super::{postgres_store, start_server, start_server_on};
use anyhow::Result;
use clap::Args;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub(super) struct JobsArgs {
    /// Seconds of sustained submission.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    clients: u32,
    /// Jobs submitted one at a time to an idle node, to time submit-to-start.
    #[arg(long, default_value_t = 20)]
    starts: u32,
    /// Directory to put the temporary data directories in.
    #[arg(long, default_value = ".")]
    dir: std::path::PathBuf,
    /// Also measure submission with the job store on this PostgreSQL database (a connection
    /// string; the deployment with a standby, docs/ha.md), after the embedded store, in the
    /// same run. Its perch tables are used as they are: give it a database of its own.
    #[arg(long)]
    postgres: Option<String>,
}

pub(super) fn jobs(args: JobsArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        // 1. Sustained submission: every acknowledgement means the job is in the job database.
        submissions(&args, None).await?;
        if let Some(url) = &args.postgres {
            submissions(&args, Some(url)).await?;
        }

        // 2. Submit-to-start on an idle node: from sending the request to the job's process
        // running on the agent (it creates a file).
        let dir = tempfile::Builder::new().prefix("perch-bench-").tempdir_in(&args.dir)?;
        // Absolute: the job runs in its own directory and touches a file named from here.
        let root = dir.path().canonicalize()?;
        let (addr, stop, server) = start_server(&root).await?;
        let node = perch_model::NodeId::new("bench-node").map_err(anyhow::Error::msg)?;
        let mut agent = perch_collector::AgentConfig::new(format!("http://{addr}"), node);
        agent.simulate_gpus = 8;
        agent.nvml = perch_collector::NvmlMode::Off;
        agent.data_dir = root.join("agent");
        // As `perch agent` runs them: each job under its supervisor.
        agent.supervisor = Some(std::env::current_exe()?);
        // The job touches a file in this (private) directory: it runs as the agent's user.
        agent.run_as_user = perch_collector::launcher::RunAsUser::Never;
        let (agent_stop, agent_stopped) = tokio::sync::oneshot::channel::<()>();
        let agent = perch_collector::spawn_agent(agent, async move {
            let _ = agent_stopped.await;
        });
        perch_model::tls::use_ring();
        let client = reqwest::Client::new();
        // Wait until the node has joined.
        loop {
            let nodes: serde_json::Value = client.get(format!("http://{addr}/v1/nodes")).send().await?.json().await?;
            if nodes["nodes"].as_array().is_some_and(|n| !n.is_empty()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut latencies = Vec::new();
        for i in 0..args.starts {
            let marker = root.join(format!("started-{i}"));
            let body = serde_json::json!({"command": ["touch", marker.to_string_lossy()], "gpus_per_node": 1});
            let sent = Instant::now();
            let r = client.post(format!("http://{addr}/v1/jobs")).json(&body).send().await?;
            anyhow::ensure!(r.status().is_success(), "submit answered {}", r.status());
            while !marker.exists() {
                anyhow::ensure!(sent.elapsed() < Duration::from_secs(30), "job {i} did not start within 30 s");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            latencies.push(sent.elapsed());
            // Let it finish so the next one finds the node idle.
            tokio::time::sleep(Duration::from_millis(700)).await;
        }
        latencies.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!("submit-to-start on an idle node ({} jobs, agent syncs every 500 ms)", args.starts);
        println!(
            "  median {:.0} ms, p95 {:.0} ms, slowest {:.0} ms",
            ms(latencies[latencies.len() / 2]),
            ms(latencies[(latencies.len() * 95 / 100).min(latencies.len() - 1)]),
            ms(latencies[latencies.len() - 1])
        );
        let _ = agent_stop.send(());
        agent.join().await?;
        let _ = stop.send(());
        server.await??;
        Ok(())
    })
}

/// Submits 1-GPU jobs from `args.clients` clients for `args.seconds` to a server whose job
/// store is PostgreSQL at `postgres`, or the embedded one; prints the rate.
async fn submissions(args: &JobsArgs, postgres: Option<&String>) -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("perch-bench-")
        .tempdir_in(&args.dir)?;
    let job_store = match postgres {
        Some(url) => Some(postgres_store(url).await?),
        None => None,
    };
    let (addr, stop, server) = start_server_on(dir.path(), job_store).await?;
    let submitted = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let mut tasks = Vec::new();
    for c in 0..args.clients {
        let submitted = submitted.clone();
        tasks.push(tokio::spawn(async move {
                perch_model::tls::use_ring();
                perch_model::tls::use_ring();
        let client = reqwest::Client::new();
                let body = serde_json::json!({"command": ["true"], "gpus_per_node": 1, "user": format!("u{c}"), "time_limit_secs": 600});
                while Instant::now() < deadline {
                    let r = client.post(format!("http://{addr}/v1/jobs")).json(&body).send().await?;
                    anyhow::ensure!(r.status().is_success(), "submit answered {}", r.status());
                    submitted.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, anyhow::Error>(())
            }));
    }
    let started = Instant::now();
    for t in tasks {
        t.await??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let n = submitted.load(Ordering::Relaxed);
    let store = if postgres.is_some() {
        "PostgreSQL"
    } else {
        "the embedded redb"
    };
    println!(
        "job submission over HTTP ({} clients, each job durable in the job database before its answer; job store: {store})",
        args.clients
    );
    println!(
        "  {n} jobs in {elapsed:.1} s = {:.0} jobs/s",
        n as f64 / elapsed
    );
    let _ = stop.send(());
    server.await??;

    Ok(())
}
