//! The agent's side of job control: every `interval` it reaps and polices its jobs
//! ([`Launcher`]), reports to the server's `POST /v1/agent/sync` what runs and what ended,
//! ships new job output, and carries out the server's start and stop orders. While the server
//! is unreachable, jobs keep running and exits wait to be reported.

use crate::jobs::JobRegistry;
use crate::launcher::{Isolation, Launcher, OtelTarget};
use crate::servers::{Route, Servers};
use perch_model::NodeId;
use perch_model::control::{CommandResult, SyncRequest, SyncResponse};
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct ControlConfig {
    /// The servers, shared with the rest of the agent: syncs go to the one in use and follow
    /// the leader ([`crate::servers`]).
    pub servers: Arc<Servers>,
    pub node: NodeId,
    /// GPUs jobs may use here, and their model.
    pub gpus: u32,
    pub gpu_model: String,
    pub rack: Option<String>,
    /// NVLink islands of the node's GPUs, reported to the scheduler (`None`: unknown).
    pub nvlink_islands: Option<Vec<Vec<u32>>>,
    /// The node takes jobs asking for a part of a GPU.
    pub gpu_sharing: bool,
    /// The MIG instances of its GPUs in MIG mode, as NVML listed them at the agent's start.
    pub mig_instances: Vec<perch_model::control::MigInstance>,
    /// Whose identity jobs run under, and their cgroups.
    pub isolation: Isolation,
    /// Where jobs' directories and output go.
    pub jobs_dir: PathBuf,
    pub interval: Duration,
    pub request_timeout: Duration,
    /// Grace given to running jobs when the agent shuts down.
    pub shutdown_grace: Duration,
    pub registry: JobRegistry,
    /// Bearer token (role `agent`) for servers that require authentication.
    pub token: Option<String>,
    /// PEM certificates of a CA to trust for an `https://` server, besides the system's.
    pub ca_file: Option<std::path::PathBuf>,
    /// The address other nodes reach this one at; `None`: [`route_address`].
    pub advertise_addr: Option<String>,
    /// The program that supervises each job (the `perch` binary, run as `perch __job-shim`);
    /// `None` runs jobs as the agent's own children, with no supervisor to stop them when the
    /// agent dies (see [`crate::launcher`]).
    pub supervisor: Option<PathBuf>,
    /// The node claimed for this agent ([`crate::agent_claim`]), before it sampled anything.
    pub claim: Arc<crate::agent_claim::AgentClaim>,
    /// Leave supervised jobs running on a graceful stop ([`crate::AgentConfig::keep_jobs_on_exit`]).
    pub keep_jobs_on_exit: bool,
    /// Most output a job may write on this node ([`crate::AgentConfig::max_job_output_bytes`]).
    pub max_job_output_bytes: u64,
    /// The node's driver and CUDA versions, for each job's start report (provenance).
    pub versions: crate::launcher::NodeVersions,
    /// What the built-in validation check needs, filled into the server's request for it
    /// ([`crate::validation::Builtin::argv`]).
    pub validation: crate::validation::Builtin,
}

/// How often the agent checks its jobs' output against the node's limit between syncs.
const OUTPUT_CHECK: Duration = Duration::from_millis(100);

/// The longest pace a server's answer may set (`SyncResponse::next_sync_ms`); servers ask for
/// at most a quarter of their heartbeat timeout, a minute by default.
const MAX_PACE_MS: u64 = 60_000;

fn lock(l: &Mutex<Launcher>) -> std::sync::MutexGuard<'_, Launcher> {
    l.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs job control until `shutdown`, then stops the node's jobs, or leaves supervised ones
/// running for the next agent ([`ControlConfig::keep_jobs_on_exit`]).
pub async fn run_control(
    config: ControlConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> crate::Result<()> {
    let mut launcher =
        Launcher::with_registry(&config.jobs_dir, config.registry.clone()).map_err(|e| {
            crate::CollectorError::Io {
                path: config.jobs_dir.clone(),
                source: e,
            }
        })?;
    // Jobs send their OTLP data to the server in use when they start.
    let otel = |endpoint: &str| OtelTarget {
        endpoint: endpoint.to_owned(),
        ca_file: config
            .ca_file
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned()),
        node: config.node.as_str().to_owned(),
    };
    let servers = config.servers.clone();
    let mut otel_endpoint = servers.current_url().to_owned();
    launcher.set_otel(otel(&otel_endpoint));
    launcher.set_isolation(&config.isolation);
    launcher.set_output_limit(config.max_job_output_bytes);
    launcher.set_node_versions(config.versions.clone());
    if let Some(program) = &config.supervisor {
        launcher.set_supervisor(program.clone());
    }
    let launcher = Arc::new(Mutex::new(launcher));
    perch_model::tls::use_ring();
    let client = crate::sender::trust(
        reqwest::Client::builder()
            .timeout(config.request_timeout)
            .redirect(servers.redirect_policy()),
        config.ca_file.as_deref(),
    )?
    .build()
    .map_err(|e| crate::CollectorError::Config(format!("HTTP client: {e}")))?;
    // Finding the route may resolve the server's name: not on the async workers.
    let advertise = match config.advertise_addr.clone() {
        Some(a) => Some(a),
        None => {
            let server = servers.current_url().to_owned();
            tokio::task::spawn_blocking(move || route_address(&server))
                .await
                .ok()
                .flatten()
        }
    };
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Output limits between syncs: a job printing in a loop writes hundreds of MB a second.
    let mut limits = tokio::time::interval(OUTPUT_CHECK);
    limits.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut unreachable = false;
    // The server's pace (`SyncResponse::next_sync_ms`): no sync before this unless a job
    // exited or a new rendezvous port is to be told.
    let mut paced_until = tokio::time::Instant::now();
    let mut ports_told: Vec<perch_model::control::MasterPort> = Vec::new();
    // Results of the server's node commands, waiting for the next sync.
    let results: Arc<Mutex<Vec<CommandResult>>> = Arc::default();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            _ = tick.tick() => {}
            _ = limits.tick() => {
                lock(&launcher).limit_outputs();
                continue;
            }
        }
        let request = {
            let mut l = lock(&launcher);
            l.poll();
            let news = !l.exited().is_empty() || l.master_ports() != ports_told;
            if tokio::time::Instant::now() < paced_until && !news {
                continue;
            }
            SyncRequest {
                node: config.node.clone(),
                gpus: config.gpus,
                gpu_model: config.gpu_model.clone(),
                rack: config.rack.clone(),
                advertise_addr: advertise.clone(),
                nvlink_islands: config.nvlink_islands.clone(),
                gpu_sharing: config.gpu_sharing,
                mig_instances: config.mig_instances.clone(),
                agent_id: Some(config.claim.id.clone()),
                running: l.running(),
                master_ports: l.master_ports(),
                exited: l.exited(),
                logs: l.logs(),
                notes: l.take_notes(),
                started: l.take_start_reports(),
                command_results: std::mem::take(
                    &mut *results.lock().unwrap_or_else(|p| p.into_inner()),
                ),
            }
        };
        let sent_boot_ms = crate::launcher::lease::boot_ms();
        let sent_at = tokio::time::Instant::now();
        let answer = async {
            // Bounds the redirects followed at once: standbys naming each other cannot spin.
            let mut redirects = servers.len();
            let r = loop {
                let (from, base) = servers.current();
                let mut post = client.post(format!("{base}/v1/agent/sync")).json(&request);
                if let Some(token) = config.token.as_deref().filter(|t| !t.is_empty()) {
                    post = post.bearer_auth(token);
                }
                let r = match post.send().await {
                    Ok(r) => r,
                    Err(e) => {
                        servers.failed(from, &e.to_string());
                        return Err((false, e.to_string()));
                    }
                };
                match servers.route(from, r.status(), r.headers()) {
                    Route::Answered => break r,
                    Route::Next(reason) => return Err((false, reason)),
                    Route::Again if redirects > 0 => redirects -= 1,
                    Route::Again => {
                        return Err((
                            false,
                            "the standby servers keep redirecting to each other".to_owned(),
                        ));
                    }
                }
            };
            let status = r.status();
            if !status.is_success() {
                let text = r.text().await.unwrap_or_default();
                return Err((status.is_client_error(), format!("{status}: {text}")));
            }
            r.json::<SyncResponse>()
                .await
                .map_err(|e| (false, e.to_string()))
        }
        .await;
        match answer {
            Ok(response) => {
                ports_told.clone_from(&request.master_ports);
                // A server's pace past a minute is not taken: the node's lease needs syncs.
                // Half a tick early, so the tick due at the pace syncs (ticks fall just before
                // `sent_at` plus whole intervals); a pace of one interval changes nothing.
                let pace =
                    Duration::from_millis(response.next_sync_ms.unwrap_or(0).min(MAX_PACE_MS));
                paced_until = sent_at + pace.saturating_sub(config.interval / 2);
                if unreachable {
                    tracing::info!("job control reaches the server again");
                    unreachable = false;
                }
                if !response.start.is_empty() || !response.stop.is_empty() {
                    tracing::debug!(start = ?response.start.iter().map(|l| l.job).collect::<Vec<_>>(), stop = ?response.stop.iter().map(|s| s.job).collect::<Vec<_>>(), "orders from the server");
                }
                let mut l = lock(&launcher);
                // The orders came from the server in use: jobs started now report to it.
                if servers.current_url() != otel_endpoint {
                    otel_endpoint = servers.current_url().to_owned();
                    l.set_otel(otel(&otel_endpoint));
                }
                servers.set_ingest(response.ingest_url.as_deref());
                // The lease first: the supervisors of the jobs started now must see it.
                l.renew_lease(sent_boot_ms, response.lease_ms);
                l.apply(&response);
                drop(l);
                for mut cmd in response.commands {
                    cmd.argv = config.validation.argv(cmd.argv);
                    tracing::info!(id = cmd.id, argv = ?cmd.argv, "running a command the server asked for");
                    let results = results.clone();
                    tokio::spawn(async move {
                        let result = crate::node_command::run(cmd).await;
                        results
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(result);
                    });
                }
            }
            Err((refused, e)) => {
                // The notes were not delivered: send them with the next sync.
                lock(&launcher).restore_notes(request.notes);
                lock(&launcher).restore_start_reports(request.started);
                results
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .extend(request.command_results);
                if !unreachable {
                    if refused {
                        // Not the network: the server read the sync and said what to change.
                        tracing::error!(error = %e, "the server refused this node's sync (the error says what to change in the agent's configuration); jobs keep running, exits wait to be reported");
                    } else {
                        tracing::warn!(error = %e, "job control cannot reach the server; jobs keep running, exits wait to be reported");
                    }
                    unreachable = true;
                }
            }
        }
    }
    if config.keep_jobs_on_exit && config.supervisor.is_some() {
        let running = lock(&launcher).running().len();
        if running > 0 {
            tracing::info!(
                jobs = running,
                "leaving the node's jobs running under their supervisors: an agent started again within the node's lease (server.node_lease_secs) takes them over; after it they stop themselves. Drain the node first to end them"
            );
        }
        return Ok(());
    }
    let grace = config.shutdown_grace;
    let l = launcher.clone();
    tokio::task::spawn_blocking(move || lock(&l).stop_all(grace))
        .await
        .map_err(|e| crate::CollectorError::Task(format!("stopping jobs: {e}")))?;
    Ok(())
}
/// The local address of this machine's route to `server` (a URL): what peers on the same
/// network most likely reach it at. Found by "connecting" a UDP socket, which sends nothing.
pub fn route_address(server: &str) -> Option<String> {
    let rest = server.split_once("://").map_or(server, |(_, r)| r);
    let host_port = rest.split('/').next()?;
    let with_port = if host_port
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        && !host_port.ends_with(']')
    {
        host_port.to_owned()
    } else {
        format!("{host_port}:80")
    };
    let target = std::net::ToSocketAddrs::to_socket_addrs(&with_port)
        .ok()?
        .next()?;
    let bind = if target.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    let socket = std::net::UdpSocket::bind(bind).ok()?;
    socket.connect(target).ok()?;
    Some(socket.local_addr().ok()?.ip().to_string())
}

#[cfg(test)]
mod route_tests {
    use super::route_address;

    #[test]
    fn the_advertised_default_is_the_local_end_of_the_route_to_the_server() {
        assert_eq!(
            route_address("http://127.0.0.1:7300").as_deref(),
            Some("127.0.0.1")
        );
        assert_eq!(
            route_address("https://127.0.0.1/base").as_deref(),
            Some("127.0.0.1")
        );
        assert_eq!(route_address("not a url"), None);
    }
}
