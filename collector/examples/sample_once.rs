//! Prints one sampling round of this machine as JSON, plus what NVML detection says: a quick
//! way to see what the agent would report on a node (real GPUs included) without a server.
//!
//! `cargo run -p perch-collector --example sample_once -- [SIMULATED_GPUS] [NVML_LIBRARY_PATH]`

use perch_collector::gpu::NvmlMode;
use perch_collector::sampler::{Sampler, SamplerConfig};
use perch_model::NodeId;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let simulate_gpus = args.next().map(|a| a.parse()).transpose()?.unwrap_or(0);
    let nvml = args
        .next()
        .map_or(NvmlMode::Auto, |p| NvmlMode::Path(p.into()));
    let detection = perch_collector::detect_gpus(&nvml);
    eprintln!("{}", detection.message);
    let mut sampler = Sampler::new(&SamplerConfig {
        node: NodeId::new("sample-once")?,
        root: "/".into(),
        data_dir: std::env::current_dir()?,
        nvml,
        // One round: every field is read.
        nvml_slow_interval: std::time::Duration::ZERO,
        simulate_gpus,
        simulate_host: false,
        seed: 0,
        jobs: Default::default(),
    });
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis();
    let round = sampler.sample(i64::try_from(now_ms)?);
    let out = serde_json::json!({
        "hosts": round.hosts, "gpus": round.gpus, "nics": round.nics, "ib_ports": round.ib_ports,
        "gpu_events": round.gpu_events, "gpu_processes": round.gpu_processes,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
