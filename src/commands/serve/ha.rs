//! `perch server` with `[ha]`: a standby until it takes the leader lease, then the leader
//! until it stops or loses the lease (docs/ha.md).
//!
//! As a standby it answers on its listener what `perch_server::ha::serve_standby` says (its
//! status; redirects to the leader) and tries to take the lease every second. Once it holds
//! it, it opens the job store on PostgreSQL writing as its new epoch, waits for the deposed
//! leader's lock on the shared data directory, replays the write-ahead log there, and serves
//! as `perch server` does, on the same listening socket. A leader that loses the lease exits
//! at once (status 3), as Kubernetes' controllers do: nothing it started can act on after
//! that, and its supervisor starts it again as a standby.

use super::{runtime, terminate};
use crate::config::Config;
use anyhow::{Context, Result};
use perch_control::ha::{Holder, Lease, Status};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

/// The exit status of a leader that lost the lease.
pub const LOST_LEASE_EXIT: i32 = 3;

/// How often a standby that cannot reach the database tries to connect.
const CONNECT_RETRY: Duration = Duration::from_secs(1);

pub fn server(config: Config) -> Result<()> {
    runtime()?.block_on(async move {
        let listen = &config.server.listen;
        let listener = TcpListener::bind(listen).await.with_context(|| {
            format!("listening on {listen} (is another perch running? choose another with --listen)")
        })?;
        let local = listener.local_addr()?;
        let name = match config.ha.name.as_str() {
            "" => crate::config::hostname(),
            name => name.to_owned(),
        };
        let db = perch_control::pg::parse_config(&config.ha.database)?;
        let mut server_config = config.server_config()?;
        let address = match config.ha.advertise.as_str() {
            "" => advertised(local, server_config.tls.is_some()),
            url => url.trim_end_matches('/').to_owned(),
        };
        let data_dir = config.server.data_dir.clone();
        // Scripts and tests that listen on port 0 read the bound address from here: one file
        // per server, as the data directory is shared.
        let addr_dir = data_dir.join("ha");
        std::fs::create_dir_all(&addr_dir)
            .with_context(|| format!("creating {}", addr_dir.display()))?;
        let addr_file = addr_dir.join(format!("{name}.addr"));
        std::fs::write(&addr_file, format!("{local}\n"))
            .with_context(|| format!("writing {}", addr_file.display()))?;

        let status = Status::default();
        let ha = perch_server::ha::Ha {
            name: name.clone(),
            address: address.clone(),
            status: status.clone(),
        };
        let stopping = Arc::new(AtomicBool::new(false));
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn({
            let stopping = stopping.clone();
            async move {
                terminate().await;
                stopping.store(true, Ordering::Release);
                let _ = stop_tx.send(true);
            }
        });

        // Wait for the lease on a thread of its own, answering as a standby meanwhile.
        let (led_tx, led_rx) = tokio::sync::oneshot::channel::<(Lease, Holder, Instant)>();
        {
            let (db, lease_config, status, stopping, data_dir) = (
                db.clone(),
                config.ha.lease_config(name.clone(), address.clone()),
                status.clone(),
                stopping.clone(),
                data_dir.clone(),
            );
            std::thread::Builder::new()
                .name("perch-lease".into())
                .spawn(move || {
                    let stop = || stopping.load(Ordering::Acquire);
                    let mut warned = false;
                    let mut lease = loop {
                        if stop() {
                            return;
                        }
                        match Lease::connect(&db, lease_config.clone(), status.clone()) {
                            Ok(lease) => break lease,
                            Err(e) => {
                                if !warned {
                                    tracing::warn!(error = %e, "standby: the job database cannot be reached; trying every second");
                                }
                                warned = true;
                                std::thread::sleep(CONNECT_RETRY);
                            }
                        }
                    };
                    if let Err(e) = lease.check_data_dir(&data_dir) {
                        tracing::error!(error = %e, "refusing to join the deployment");
                        eprintln!("perch server: {e}");
                        std::process::exit(2);
                    }
                    if let Some((holder, sent)) = lease.acquire(&stop) {
                        let _ = led_tx.send((lease, holder, sent));
                    }
                })
                .context("starting the lease thread")?;
        }
        tracing::info!(listen = %local, %name, %address, "perch server ready as a standby; it leads once the lease is free");
        let std_listener = listener.into_std()?;
        let standby_listener = TcpListener::from_std(std_listener.try_clone()?)?;
        let led = Arc::new(std::sync::Mutex::new(None));
        let until = {
            let led = led.clone();
            let mut stop = stop_rx.clone();
            async move {
                tokio::select! {
                    got = led_rx => {
                        if let Ok(got) = got {
                            *led.lock().unwrap_or_else(|p| p.into_inner()) = Some(got);
                        }
                    }
                    _ = stop.wait_for(|s| *s) => {}
                }
            }
        };
        perch_server::ha::serve_standby(standby_listener, ha.clone(), &server_config, until)
            .await
            .context("serving HTTP as a standby")?;
        let Some((lease, holder, sent)) = led.lock().unwrap_or_else(|p| p.into_inner()).take()
        else {
            return Ok(());
        };
        let epoch = holder.epoch;
        tracing::info!(epoch, %name, "this server took the lease; opening the shared data directory to lead");

        // Hold the lease from now on; losing it ends the process.
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let holding = std::thread::Builder::new()
            .name("perch-lease".into())
            .spawn(move || {
                lease.hold(
                    holder,
                    sent,
                    release_rx,
                    Arc::new(|why: String| {
                        tracing::error!(%why, "this server lost the leader lease; exiting so that nothing it started acts on (start it again to rejoin as a standby)");
                        eprintln!("perch server: lost the leader lease: {why}; exiting");
                        std::process::exit(LOST_LEASE_EXIT);
                    }),
                )
            })
            .context("starting the lease thread")?;

        let job_store = {
            let db = db.clone();
            tokio::task::spawn_blocking(move || perch_control::pg::PgStore::open(&db, epoch))
                .await
                .context("opening the job database")?
                .context("opening the job database on PostgreSQL")?
        };
        let job_store: Arc<dyn perch_control::JobStore> = Arc::new(job_store);
        server_config.ha = Some(ha);
        // The deposed leader let go of the data directory before the lease could be taken
        // (it stops at its own deadline, earlier than the database's); a leader that was
        // cleanly stopped may still be flushing. Wait for its lock, as long as we lead.
        let started = Instant::now();
        let state = loop {
            match perch_server::AppState::open_with(server_config.clone(), Some(job_store.clone())) {
                Ok(state) => break state,
                Err(e)
                    if e.to_string().contains("locking data directory")
                        && started.elapsed() < crate::config::HA_STARTUP_ALLOWANCE =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!("opening the data directory {}", data_dir.display())
                    });
                }
            }
        };
        crate::telemetry::observe_server(&state);
        tracing::info!(listen = %local, epoch, took_ms = started.elapsed().as_millis() as u64, "perch server leads");
        let listener = TcpListener::from_std(std_listener)?;
        let mut stop = stop_rx.clone();
        let result = perch_server::serve(listener, state, async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await
        .context("serving HTTP");
        // Flushed: hand the lease over at once rather than when it would run out.
        let _ = release_tx.send(());
        let _ = holding.join();
        result
    })
}

/// `http://<listen address>` (`https` with TLS), naming this host when it listens on every
/// address.
fn advertised(local: std::net::SocketAddr, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    if local.ip().is_unspecified() {
        format!("{scheme}://{}:{}", crate::config::hostname(), local.port())
    } else {
        format!("{scheme}://{local}")
    }
}
