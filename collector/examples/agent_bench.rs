//! The agent as `perch agent` runs it, for footprint benchmarks in a release build without
//! compiling the server: samples the host, every NIC and InfiniBand port, and the GPUs of an NVML
//! library (the stand-in, or a real driver) once per interval, and sends to a perch server.
//!
//! `agent_bench SERVER_URL NVML_LIBRARY_PATH SECONDS [INTERVAL_MS] [NVML_SLOW_INTERVAL_MS]`;
//! prints the final counters. Its node is `bench-node`, or `bench-slow-<ms>` when the slow
//! interval is given (so two can send to one server).
//! `collector/scripts/bench_footprint.sh` drives it next to node_exporter.

use perch_collector::{AgentConfig, NvmlMode, run_agent};
use perch_model::NodeId;
use std::time::Duration;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [server, nvml, seconds, rest @ ..] = args.as_slice() else {
        return Err("usage: agent_bench SERVER_URL NVML_LIBRARY_PATH SECONDS [INTERVAL_MS]".into());
    };
    let interval_ms: u64 = rest.first().map(|s| s.parse()).transpose()?.unwrap_or(1000);
    let slow_ms: Option<u64> = rest.get(1).map(|s| s.parse()).transpose()?;
    let seconds: u64 = seconds.parse()?;
    let node = slow_ms.map_or("bench-node".to_owned(), |ms| format!("bench-slow-{ms}"));
    let mut config = AgentConfig::new(server.clone(), NodeId::new(node)?);
    config.interval = Duration::from_millis(interval_ms);
    if let Some(ms) = slow_ms {
        config.nvml_slow_interval = Duration::from_millis(ms);
    }
    config.nvml = NvmlMode::Path(nvml.into());
    config.data_dir = std::env::temp_dir();
    // One worker thread, as a node agent needs no more.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let stats = runtime.block_on(async {
        run_agent(config, tokio::time::sleep(Duration::from_secs(seconds))).await
    })?;
    println!("{stats:?}");
    Ok(())
}
