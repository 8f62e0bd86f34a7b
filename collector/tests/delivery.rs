//! Delivery against a real HTTP server in the test: an axum app that decodes the zstd body
//! (MessagePack or JSON, by its Content-Type, or only JSON as older servers took it),
//! validates and deduplicates batches by `(node, seq)` like the perch server does, and can be
//! scripted to fail. Backoff is shortened so retries do not slow the suite; nothing here asserts
//! on timing.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use perch_collector::agent::{AgentCounters, run_agent_with};
use perch_collector::queue::SendQueue;
use perch_collector::sampler::Round;
use perch_collector::sender::{Backoff, SendOutcome, Sender, SenderShared, run_sender};
use perch_collector::{AgentConfig, NvmlMode, spawn_agent};
use perch_model::wire::{Encoding, MSGPACK_MEDIA_TYPE};
use perch_model::{Batch, HostSample, NodeId};
use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// What the scripted server does with the next request.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// Answer this status without storing.
    Status(u16),
    /// Store the batch, then answer 503 as if the reply got lost.
    StoreThenFail,
}

/// Which bodies the scripted server takes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
enum Takes {
    /// JSON or MessagePack, by Content-Type, as today's perch server.
    #[default]
    Both,
    /// JSON only, and 415 for any other Content-Type.
    JsonRefusingOthers,
    /// Every body read as JSON, whatever its Content-Type, and 400 `malformed_batch` when it
    /// is not: the perch server before the binary encoding.
    JsonWhatever,
}

#[derive(Default)]
struct Ingest {
    takes: Takes,
    /// The Content-Type of every request, in order.
    content_types: Mutex<Vec<String>>,
    faults: Mutex<VecDeque<Fault>>,
    reject: HashSet<u64>,
    stored: Mutex<Vec<Batch>>,
    posts: Mutex<HashMap<u64, usize>>,
    last_seq: Mutex<Option<u64>>,
    stored_tx: Option<watch::Sender<usize>>,
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as i64
}

async fn ingest(
    State(s): State<Arc<Ingest>>,
    headers: HeaderMap,
    body: bytes::Bytes,
) -> (StatusCode, String) {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let content_type = header("content-type");
    s.content_types
        .lock()
        .expect("lock")
        .push(content_type.clone());
    let encoding = match (s.takes, Encoding::from_content_type(Some(&content_type))) {
        (Takes::JsonWhatever, _) => Encoding::Json,
        (Takes::JsonRefusingOthers, Ok(Encoding::Json)) | (Takes::Both, Ok(_)) => {
            Encoding::from_content_type(Some(&content_type)).expect("known")
        }
        _ => return (StatusCode::UNSUPPORTED_MEDIA_TYPE, "want JSON".into()),
    };
    if header("content-encoding") != "zstd" {
        return (StatusCode::UNSUPPORTED_MEDIA_TYPE, "want zstd".into());
    }
    let raw = match zstd::stream::decode_all(&body[..]) {
        Ok(j) => j,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("bad zstd: {e}")),
    };
    let batch: Batch = match encoding.decode(&raw) {
        Ok(b) => b,
        // As the perch server answers it (before the binary encoding, without naming one).
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!(
                    r#"{{"error":{{"code":"malformed_batch","message":"the body is not a valid telemetry batch: {}"}}}}"#,
                    e.to_string().replace('"', "'")
                ),
            );
        }
    };
    if let Err(e) = batch.validate(now_ms()) {
        return (StatusCode::BAD_REQUEST, e.to_string());
    }
    *s.posts.lock().expect("lock").entry(batch.seq).or_default() += 1;
    let fault = s.faults.lock().expect("lock").pop_front();
    if let Some(Fault::Status(code)) = fault {
        return (
            StatusCode::from_u16(code).expect("valid status"),
            "scripted failure".into(),
        );
    }
    if s.reject.contains(&batch.seq) {
        return (
            StatusCode::BAD_REQUEST,
            format!("gpus[0].uuid: batch {} is bad", batch.seq),
        );
    }
    let duplicate = {
        let mut last = s.last_seq.lock().expect("lock");
        let duplicate = last.is_some_and(|l| batch.seq <= l);
        if !duplicate {
            *last = Some(batch.seq);
            let mut stored = s.stored.lock().expect("lock");
            stored.push(batch);
            if let Some(tx) = &s.stored_tx {
                tx.send_replace(stored.len());
            }
        }
        duplicate
    };
    if let Some(Fault::StoreThenFail) = fault {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "stored, but the reply is lost".into(),
        );
    }
    (
        StatusCode::OK,
        format!(r#"{{"accepted":{},"duplicate":{duplicate}}}"#, !duplicate),
    )
}

/// Starts the server on `127.0.0.1:0`; the first `refuse` connections are closed unanswered.
async fn start(state: Arc<Ingest>, refuse: usize) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let app = axum::Router::new()
        .route("/v1/ingest", post(ingest))
        .with_state(state);
    tokio::spawn(async move {
        for _ in 0..refuse {
            let (conn, _) = listener.accept().await.expect("accept");
            drop(conn);
        }
        axum::serve(listener, app).await.expect("serve");
    });
    url
}

fn node() -> NodeId {
    NodeId::new("test-node").expect("valid")
}

fn round(i: i64) -> Round {
    let host = HostSample {
        time_ms: now_ms() - 1000 + i,
        simulated: true,
        cpu_user_seconds: Some(i as f64),
        cpu_nice_seconds: None,
        cpu_system_seconds: None,
        cpu_idle_seconds: None,
        cpu_iowait_seconds: None,
        cpu_irq_seconds: None,
        cpu_softirq_seconds: None,
        cpu_steal_seconds: None,
        cpu_count: None,
        memory_total_bytes: None,
        memory_available_bytes: None,
        load1: None,
        load5: None,
        load15: None,
        disk_free_bytes: None,
        disk_total_bytes: None,
        uptime_seconds: None,
    };
    Round {
        hosts: vec![host],
        gpus: vec![],
        nics: vec![],
        ..Round::default()
    }
}

const FAST: Backoff = Backoff {
    initial: Duration::from_millis(1),
    max: Duration::from_millis(4),
};

/// Guards against a hang only; no test depends on how long anything takes.
async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(120), f)
        .await
        .expect("test hung")
}

/// Queues `n` one-round batches with seqs 100.. and runs the sender until the queue is empty.
async fn deliver(url: &str, n: i64) -> Arc<AgentCounters> {
    let mut queue = SendQueue::new(node(), 100, 1, 1000);
    for i in 0..n {
        queue.push(round(i));
    }
    let counters = Arc::new(AgentCounters::default());
    let shared = SenderShared {
        queue: Arc::new(Mutex::new(queue)),
        spool: None,
        wake: Arc::new(Notify::new()),
        draining: Arc::new(AtomicBool::new(true)),
        counters: counters.clone(),
    };
    let sender = Sender::new(url, Duration::from_secs(10), None).expect("client");
    bounded(run_sender(sender, shared.clone(), FAST)).await;
    assert!(shared.queue.lock().expect("lock").is_empty());
    counters
}

fn stored_seqs(state: &Ingest) -> Vec<u64> {
    state
        .stored
        .lock()
        .expect("lock")
        .iter()
        .map(|b| b.seq)
        .collect()
}

#[tokio::test]
async fn a_server_that_fails_then_recovers_gets_every_batch_once_in_order() {
    let faults = [
        Fault::Status(503),
        Fault::Status(500),
        Fault::Status(502),
        Fault::Status(429),
    ];
    let state = Arc::new(Ingest {
        faults: Mutex::new(faults.into()),
        ..Ingest::default()
    });
    let url = start(state.clone(), 2).await;
    let counters = deliver(&url, 10).await;
    assert_eq!(stored_seqs(&state), (100..110).collect::<Vec<_>>());
    let stats = counters.snapshot();
    assert_eq!((stats.batches_sent, stats.samples_sent), (10, 10));
    assert_eq!(
        stats.send_errors, 6,
        "2 closed connections and 4 error replies"
    );
    assert_eq!(
        (
            stats.batches_dropped,
            stats.samples_dropped,
            stats.batches_rejected
        ),
        (0, 0, 0)
    );
}

#[tokio::test]
async fn a_retry_after_a_lost_reply_is_not_counted_twice() {
    let faults = [Fault::StoreThenFail];
    let state = Arc::new(Ingest {
        faults: Mutex::new(faults.into()),
        ..Ingest::default()
    });
    let url = start(state.clone(), 0).await;
    let counters = deliver(&url, 3).await;
    assert_eq!(stored_seqs(&state), [100, 101, 102]);
    assert_eq!(
        state.posts.lock().expect("lock").get(&100),
        Some(&2),
        "batch 100 was resent"
    );
    let stats = counters.snapshot();
    assert_eq!(
        (
            stats.batches_sent,
            stats.batches_duplicate,
            stats.send_errors
        ),
        (3, 1, 1)
    );
}

#[tokio::test]
async fn a_rejected_batch_is_dropped_once_and_delivery_moves_on() {
    let state = Arc::new(Ingest {
        reject: [102].into(),
        ..Ingest::default()
    });
    let url = start(state.clone(), 0).await;
    let counters = deliver(&url, 5).await;
    assert_eq!(stored_seqs(&state), [100, 101, 103, 104]);
    assert_eq!(
        state.posts.lock().expect("lock").get(&102),
        Some(&1),
        "never retried"
    );
    let stats = counters.snapshot();
    assert_eq!(
        (
            stats.batches_sent,
            stats.batches_rejected,
            stats.samples_dropped
        ),
        (4, 1, 1)
    );
    assert_eq!(stats.send_errors, 0);
}

fn agent_config(url: String) -> AgentConfig {
    let mut c = AgentConfig::new(url, node());
    c.interval = Duration::from_millis(2);
    c.nvml = NvmlMode::Off;
    c.simulate_gpus = 2;
    c.simulate_host = true;
    c.seed = 9;
    c.data_dir = std::env::temp_dir();
    c.backoff = FAST;
    c.spool_max_bytes = 0;
    c
}

#[tokio::test]
async fn the_agent_delivers_every_round_of_a_simulated_node() {
    let (tx, mut rx) = watch::channel(0);
    let state = Arc::new(Ingest {
        stored_tx: Some(tx),
        ..Ingest::default()
    });
    let url = start(state.clone(), 0).await;
    let shutdown = async move {
        // Stop once the server holds 8 batches.
        let _ = rx.wait_for(|n| *n >= 8).await;
    };
    let counters = Arc::new(AgentCounters::default());
    let stats = bounded(run_agent_with(agent_config(url), shutdown, counters))
        .await
        .expect("agent ran");
    let stored = state.stored.lock().expect("lock").clone();
    assert!(stored.len() >= 8);
    assert!(
        stored[0].seq > 1_700_000_000_000_000,
        "seq starts at Unix microseconds: {}",
        stored[0].seq
    );
    assert!(stored.windows(2).all(|w| w[1].seq > w[0].seq), "seqs rise");
    let samples: usize = stored.iter().map(Batch::sample_count).sum();
    assert_eq!(stats.samples_sent, samples as u64);
    // Each round holds 1 host, 2 GPUs and 2 NICs, all simulated; none was lost.
    assert_eq!(samples as u64, stats.rounds_sampled * 5);
    assert_eq!(
        (
            stats.batches_dropped,
            stats.samples_dropped,
            stats.send_errors
        ),
        (0, 0, 0)
    );
    for b in &stored {
        assert_eq!(b.node, node());
        assert!(b.hosts.iter().all(|h| h.simulated) && b.gpus.iter().all(|g| g.simulated));
        assert!(b.nics.iter().all(|n| n.simulated));
    }
}

#[tokio::test]
async fn a_spawned_agent_reports_stats_while_running() {
    let (tx, mut rx) = watch::channel(0);
    let state = Arc::new(Ingest {
        stored_tx: Some(tx),
        ..Ingest::default()
    });
    let url = start(state.clone(), 0).await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handle = spawn_agent(agent_config(url), async move {
        let _ = stopped.await;
    });
    bounded(rx.wait_for(|n| *n >= 3))
        .await
        .expect("server alive");
    // Batches go one at a time, so the third one stored means two replies were counted.
    let live = handle.stats();
    assert!(
        live.batches_sent >= 2 && live.rounds_sampled >= 3,
        "{live:?}"
    );
    stop.send(()).expect("agent still waiting");
    let last = bounded(handle.join()).await.expect("agent ran");
    assert!(last.batches_sent >= live.batches_sent);
    assert_eq!(
        last.batches_sent as usize,
        state.stored.lock().expect("lock").len()
    );
}

#[tokio::test]
async fn with_the_server_down_every_round_is_accounted_as_dropped() {
    // Everything fails: the queue bound drops batches while running, shutdown drops the rest.
    let faults = vec![Fault::Status(503); 100_000];
    let (tx, mut rx) = watch::channel(0usize);
    let state = Arc::new(Ingest {
        faults: Mutex::new(faults.into()),
        ..Ingest::default()
    });
    let url = start(state.clone(), 0).await;
    let mut config = agent_config(url);
    config.max_batch_rounds = 1;
    config.max_queue_batches = 3;
    assert_eq!(
        config.spool_max_bytes, 0,
        "no spool: batches past the bound are dropped"
    );
    config.drain_timeout = Duration::from_millis(20);
    let counters = Arc::new(AgentCounters::default());
    let watched = counters.clone();
    let shutdown = async move {
        // Wait until the bound has dropped at least 5 batches.
        while watched.snapshot().batches_dropped < 5 {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tx.send_replace(1);
    };
    let stats = bounded(run_agent_with(config, shutdown, counters))
        .await
        .expect("agent ran");
    assert_eq!(*rx.borrow_and_update(), 1);
    assert!(stored_seqs(&state).is_empty());
    assert_eq!(stats.batches_sent, 0);
    assert_eq!(
        stats.batches_dropped, stats.rounds_sampled,
        "one round per batch, every one dropped"
    );
    assert_eq!(stats.samples_dropped, stats.rounds_sampled * 5);
    assert!(stats.send_errors > 0);
}

/// Waits until `f` holds for the counters, yielding to the agent in between.
async fn until(counters: Arc<AgentCounters>, f: impl Fn(&perch_collector::AgentStats) -> bool) {
    while !f(&counters.snapshot()) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test]
async fn batches_spooled_while_the_server_is_down_are_replayed_in_order_after_a_restart() {
    let data = tempfile::tempdir().expect("temp dir");
    let spool_dir = data.path().join("agent-spool").join("test-node");

    // Run 1: the server answers 503 to everything; memory holds 2 batches, the rest spill.
    let down = Arc::new(Ingest {
        faults: Mutex::new(vec![Fault::Status(503); 100_000].into()),
        ..Ingest::default()
    });
    let mut config = agent_config(start(down.clone(), 0).await);
    config.data_dir = data.path().to_path_buf();
    config.spool_max_bytes = 10 << 20;
    config.max_batch_rounds = 1;
    config.max_queue_batches = 2;
    config.drain_timeout = Duration::from_millis(20);
    let counters = Arc::new(AgentCounters::default());
    let shutdown = until(counters.clone(), |s| s.batches_spooled >= 5);
    let first = bounded(run_agent_with(config.clone(), shutdown, counters))
        .await
        .expect("run 1");
    assert!(stored_seqs(&down).is_empty());
    assert_eq!(
        (first.batches_sent, first.batches_dropped),
        (0, 0),
        "nothing lost: {first:?}"
    );
    assert_eq!(
        first.batches_spooled, first.rounds_sampled,
        "every batch reached the spool"
    );
    let files = std::fs::read_dir(&spool_dir).expect("spool dir").count() as u64;
    assert_eq!(files, first.rounds_sampled);
    assert!(first.spool_bytes > 0);

    // Run 2: a healthy server; the spool is replayed first, then new rounds follow.
    let (tx, mut rx) = watch::channel(0);
    let up = Arc::new(Ingest {
        stored_tx: Some(tx),
        ..Ingest::default()
    });
    config.server = start(up.clone(), 0).await;
    let want = first.rounds_sampled as usize + 3;
    let shutdown = async move {
        let _ = rx.wait_for(|n| *n >= want).await;
    };
    let counters = Arc::new(AgentCounters::default());
    let second = bounded(run_agent_with(config, shutdown, counters))
        .await
        .expect("run 2");
    let stored = up.stored.lock().expect("lock").clone();
    assert!(
        stored.windows(2).all(|w| w[1].seq > w[0].seq),
        "in seq order"
    );
    let samples: u64 = stored.iter().map(|b| b.sample_count() as u64).sum();
    assert_eq!(
        samples,
        (first.rounds_sampled + second.rounds_sampled) * 5,
        "every sample, once"
    );
    assert_eq!((second.batches_dropped, second.spool_bytes), (0, 0));
    assert_eq!(
        std::fs::read_dir(&spool_dir).expect("spool dir").count(),
        0,
        "spool emptied"
    );
}

/// A server that is busy (SQL slots, back-pressure) says when to come back with
/// `Retry-After`; the agent waits at least that long (at most a minute) before it retries,
/// whatever its own backoff says, and keeps the batch meanwhile.
#[tokio::test]
async fn a_busy_answer_says_when_to_retry_and_the_sender_hears_it() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let app = axum::Router::new().route(
        "/v1/ingest",
        post(|| async {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                [("retry-after", "7")],
                r#"{"error":{"code":"store_busy","message":"keep the data and retry later"}}"#,
            )
        }),
    );
    let app_long = axum::Router::new().route(
        "/v1/ingest",
        post(|| async {
            (
                StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", "86400")],
                "later",
            )
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    let long = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let long_url = format!("http://{}", long.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(long, app_long).await.expect("serve") });
    let mut queue = SendQueue::new(node(), 100, 1, 1000);
    queue.push(round(0));
    let batch = queue.next_to_send().expect("a batch");
    let sender = Sender::new(&url, Duration::from_secs(10), None).expect("client");
    match sender.post(&batch).await {
        SendOutcome::Retry { after, reason } => {
            assert_eq!(after, Some(Duration::from_secs(7)), "{reason}");
            assert!(reason.contains("503"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let sender = Sender::new(&long_url, Duration::from_secs(10), None).expect("client");
    match sender.post(&batch).await {
        SendOutcome::Retry { after, .. } => {
            assert_eq!(after, Some(Duration::from_secs(60)), "capped at a minute")
        }
        other => panic!("{other:?}"),
    }
}

/// The agent sends MessagePack to a server that takes it, and nothing else.
#[tokio::test]
async fn batches_go_as_messagepack_to_a_server_that_takes_it() {
    let state = Arc::new(Ingest::default());
    let url = start(state.clone(), 0).await;
    let counters = deliver(&url, 4).await;
    assert_eq!(stored_seqs(&state), [100, 101, 102, 103]);
    assert_eq!(
        *state.content_types.lock().expect("lock"),
        vec![MSGPACK_MEDIA_TYPE; 4]
    );
    let stats = counters.snapshot();
    assert_eq!((stats.batches_sent, stats.batches_rejected), (4, 0));
}

/// A server that takes only JSON, answering 415 or (as every perch server before the binary
/// encoding did) reading the MessagePack as JSON and answering 400 `malformed_batch`: the
/// refused batch is sent again as JSON at once, nothing is dropped or counted as an error, and
/// every later batch goes as JSON without trying MessagePack again.
#[tokio::test]
async fn a_server_that_takes_only_json_gets_json_from_the_first_refusal_on() {
    for takes in [Takes::JsonRefusingOthers, Takes::JsonWhatever] {
        let state = Arc::new(Ingest {
            takes,
            ..Ingest::default()
        });
        let url = start(state.clone(), 0).await;
        let mut queue = SendQueue::new(node(), 100, 1, 1000);
        for i in 0..5 {
            queue.push(round(i));
        }
        let counters = Arc::new(AgentCounters::default());
        let shared = SenderShared {
            queue: Arc::new(Mutex::new(queue)),
            spool: None,
            wake: Arc::new(Notify::new()),
            draining: Arc::new(AtomicBool::new(true)),
            counters: counters.clone(),
        };
        let sender = Sender::new(&url, Duration::from_secs(10), None).expect("client");
        assert_eq!(sender.encoding(), Encoding::Msgpack);
        bounded(run_sender(sender.clone(), shared, FAST)).await;
        assert_eq!(stored_seqs(&state), [100, 101, 102, 103, 104], "{takes:?}");
        let mut expected = vec![MSGPACK_MEDIA_TYPE];
        expected.extend(["application/json"; 5]);
        assert_eq!(
            *state.content_types.lock().expect("lock"),
            expected,
            "{takes:?}"
        );
        assert_eq!(sender.encoding(), Encoding::Json, "remembered");
        let stats = counters.snapshot();
        assert_eq!(
            (
                stats.batches_sent,
                stats.batches_rejected,
                stats.samples_dropped,
                stats.send_errors
            ),
            (5, 0, 0, 0),
            "{takes:?}"
        );
    }
}

/// A MessagePack batch refused for what it holds (400 `invalid_batch`, not a body the server
/// could not read) is a bad batch, not a server that takes only JSON: dropped once, and the
/// next batch is MessagePack.
#[tokio::test]
async fn a_messagepack_batch_refused_by_a_server_that_reads_it_stays_refused() {
    let state = Arc::new(Ingest {
        reject: [101].into(),
        ..Ingest::default()
    });
    let url = start(state.clone(), 0).await;
    let counters = deliver(&url, 3).await;
    assert_eq!(stored_seqs(&state), [100, 102]);
    assert_eq!(
        *state.content_types.lock().expect("lock"),
        vec![MSGPACK_MEDIA_TYPE; 3]
    );
    assert_eq!(counters.snapshot().batches_rejected, 1);
}
