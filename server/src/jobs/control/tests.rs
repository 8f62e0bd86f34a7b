//! The control plane's job-safety invariants in virtual time (issue 15): an exit is charged
//! only to the attempt that ran, a report of any other attempt gets a stop for that attempt,
//! and a silent node's jobs are requeued only once its lease has run out.

use crate::jobs::record::JobRecord;
use crate::jobs::{JobService, JobsConfig};
use perch_model::control::{JobAttempt, SyncRequest, SyncResponse};
use serde_json::json;
use std::time::Duration;

const T0: i64 = 1_800_000_000_000;
const SECOND: i64 = 1000;

fn service(dir: &std::path::Path) -> JobService {
    let (tx, _rx) = JobService::event_channel();
    let config = JobsConfig {
        heartbeat_timeout: Duration::from_secs(30),
        lease: Duration::from_secs(300),
        ..JobsConfig::default()
    };
    JobService::open(dir, config, tx).expect("jobs")
}

async fn sync(
    jobs: &JobService,
    node: &str,
    at: i64,
    running: &[(u64, u32)],
    exited: &[(u64, u32, i32)],
) -> SyncResponse {
    let req: SyncRequest = serde_json::from_value(json!({
        "node": node, "gpus": 1, "gpu_model": "Test H100",
        "running": running.iter().map(|(j, a)| json!({"job": j, "attempt": a})).collect::<Vec<_>>(),
        "exited": exited.iter().map(|(j, a, c)| json!({"job": j, "attempt": a, "code": c})).collect::<Vec<_>>(),
    }))
    .expect("sync request");
    jobs.run(move |c, _| c.sync(req, at)).await.expect("sync")
}

async fn job(jobs: &JobService, id: u64) -> JobRecord {
    jobs.run(move |c, _| Ok(c.view(id)))
        .await
        .expect("view")
        .expect("job")
}

/// Submits one job (a `JobRequest` as JSON) at `at`; returns its id.
async fn submit(jobs: &JobService, request: serde_json::Value, at: i64) -> u64 {
    let request: crate::jobs::spec::JobRequest = serde_json::from_value(request).expect("request");
    jobs.run(move |c, _| c.submit(request, at))
        .await
        .expect("submit")[0]
        .id
}

async fn tick(jobs: &JobService, at: i64) {
    jobs.run(move |c, _| c.tick(at)).await.expect("tick");
}

#[tokio::test]
async fn attempts_and_the_lease_decide_what_runs_where() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    sync(&jobs, "a", T0, &[], &[]).await;
    let id = submit(
        &jobs,
        json!({ "command": ["train"], "user": "bob", "max_requeues": 2, "gpus_per_node": 1 }),
        T0 + SECOND,
    )
    .await;
    let r = sync(&jobs, "a", T0 + 2 * SECOND, &[], &[]).await;
    assert_eq!(
        r.start
            .iter()
            .map(|l| (l.job, l.attempt))
            .collect::<Vec<_>>(),
        vec![(id, 1)]
    );
    assert_eq!(r.lease_ms, 300_000, "each answer renews the lease");
    sync(&jobs, "a", T0 + 3 * SECOND, &[(id, 1)], &[]).await;
    // Node b joins; node a goes silent. Past the heartbeat timeout it is down, but its job
    // counts as running there until the lease has run out.
    sync(&jobs, "b", T0 + 10 * SECOND, &[], &[]).await;
    sync(&jobs, "b", T0 + 40 * SECOND, &[], &[]).await;
    tick(&jobs, T0 + 40 * SECOND).await;
    let j = job(&jobs, id).await;
    assert_eq!((j.state.as_str(), j.attempts), ("running", 1));
    for at in (60..=300).step_by(30) {
        sync(&jobs, "b", T0 + at * SECOND, &[], &[]).await;
        tick(&jobs, T0 + at * SECOND).await;
    }
    assert_eq!(
        job(&jobs, id).await.state.as_str(),
        "running",
        "lease ends at +303 s"
    );
    sync(&jobs, "b", T0 + 304 * SECOND, &[], &[]).await;
    tick(&jobs, T0 + 304 * SECOND).await;
    let j = job(&jobs, id).await;
    assert_eq!(
        (j.state.as_str(), j.attempts, j.requeues),
        ("running", 2, 1),
        "requeued and started on b"
    );
    assert_eq!(j.placement[0].node, "b");
    let r = sync(&jobs, "b", T0 + 305 * SECOND, &[], &[]).await;
    assert_eq!(
        r.start
            .iter()
            .map(|l| (l.job, l.attempt))
            .collect::<Vec<_>>(),
        vec![(id, 2)]
    );
    // Node a comes back still running attempt 1: it is told to stop that attempt.
    let r = sync(&jobs, "a", T0 + 306 * SECOND, &[(id, 1)], &[]).await;
    assert_eq!(
        r.stop
            .iter()
            .map(|s| (s.job, s.attempt))
            .collect::<Vec<_>>(),
        vec![(id, 1)]
    );
    // Its exit is acknowledged and noted, and ends nothing.
    let r = sync(&jobs, "a", T0 + 307 * SECOND, &[], &[(id, 1, 0)]).await;
    assert_eq!(
        r.acknowledged,
        vec![JobAttempt {
            job: id,
            attempt: 1
        }]
    );
    let j = job(&jobs, id).await;
    assert_eq!((j.state.as_str(), j.attempts), ("running", 2));
    assert!(
        j.timeline
            .iter()
            .any(|e| e.event == "attempt 1 ended on a with code 0"),
        "{:?}",
        j.timeline
    );
    // b reporting attempt 1 beside attempt 2 is told to stop attempt 1 only.
    let r = sync(&jobs, "b", T0 + 308 * SECOND, &[(id, 2), (id, 1)], &[]).await;
    assert_eq!(
        r.stop
            .iter()
            .map(|s| (s.job, s.attempt))
            .collect::<Vec<_>>(),
        vec![(id, 1)]
    );
    // b's attempt 2 runs, then exits: that ends the job.
    sync(&jobs, "b", T0 + 309 * SECOND, &[(id, 2)], &[]).await;
    sync(&jobs, "b", T0 + 310 * SECOND, &[], &[(id, 2, 3)]).await;
    let j = job(&jobs, id).await;
    assert_eq!((j.state.as_str(), j.exit_code), ("failed", Some(3)));
}

/// Issue 16: a log-store error failed the whole sync, so the node went down and its jobs were
/// requeued. Now the sync is answered, without log offsets, and the agent sends again.
#[tokio::test]
async fn a_sync_is_answered_when_job_output_cannot_be_stored() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    // A file where the logs directory should be: every write of job output fails.
    std::fs::write(dir.path().join("logs"), "not a directory").expect("file");
    sync(&jobs, "a", T0, &[], &[]).await;
    let id = submit(
        &jobs,
        json!({ "command": ["train"], "user": "bob", "gpus_per_node": 1 }),
        T0 + SECOND,
    )
    .await;
    sync(&jobs, "a", T0 + 2 * SECOND, &[], &[]).await;
    let req: SyncRequest = serde_json::from_value(json!({
        "node": "a", "gpus": 1, "gpu_model": "Test H100",
        "running": [{"job": id, "attempt": 1}],
        "logs": [{"job": id, "stream": "stdout", "offset": 0, "data": "hello\n"}],
    }))
    .expect("sync request");
    let r = jobs
        .run(move |c, _| c.sync(req, T0 + 3 * SECOND))
        .await
        .expect("the sync is answered");
    assert!(
        r.log_offsets.is_empty(),
        "nothing stored, nothing acknowledged"
    );
    assert_eq!(r.lease_ms, 300_000);
    assert_eq!(job(&jobs, id).await.state.as_str(), "running");
}

/// Issue 16: one user's arrays filled the queue and the job database. Past
/// `max_pending_per_user` a submission is refused whole, with what to do; other users are not
/// affected, and room comes back as jobs start.
#[tokio::test]
async fn a_user_cannot_queue_past_the_pending_cap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (tx, _rx) = JobService::event_channel();
    let config = JobsConfig {
        max_pending_per_user: 3,
        ..JobsConfig::default()
    };
    let jobs = JobService::open(dir.path(), config, tx).expect("jobs");
    let submit = |user: &str, array: Option<u32>| {
        let request: crate::jobs::spec::JobRequest = serde_json::from_value(json!({
            "command": ["train"], "user": user, "gpus_per_node": 1, "array": array
        }))
        .expect("request");
        jobs.run(move |c, _| c.submit(request, T0))
    };
    let first = submit("bob", Some(2)).await.expect("two pending")[0].id;
    let e = submit("bob", Some(2))
        .await
        .expect_err("four would be past three");
    assert_eq!(e.status, axum::http::StatusCode::TOO_MANY_REQUESTS);
    assert!(
        e.message.contains("bob has 2 pending jobs and this submission adds 2: at most 3 per user (server.max_pending_jobs_per_user)"),
        "{}",
        e.message
    );
    submit("bob", None).await.expect("three is the cap");
    submit("carol", Some(3)).await.expect("another user");
    // Cancelling one makes room for one more.
    jobs.run(move |c, _| c.cancel(first, "bob", T0 + SECOND))
        .await
        .expect("cancel");
    submit("bob", None).await.expect("room again");
    // The count is rebuilt from the job database after a restart.
    drop(jobs);
    let (tx, _rx) = JobService::event_channel();
    let config = JobsConfig {
        max_pending_per_user: 3,
        ..JobsConfig::default()
    };
    let jobs = JobService::open(dir.path(), config, tx).expect("jobs");
    let request: crate::jobs::spec::JobRequest =
        serde_json::from_value(json!({"command": ["train"], "user": "bob"})).expect("request");
    let e = jobs
        .run(move |c, _| c.submit(request, T0 + 2 * SECOND))
        .await
        .expect_err("still three pending after the restart");
    assert_eq!(e.status, axum::http::StatusCode::TOO_MANY_REQUESTS);
}

/// Found against the release binary: `perch up` (server and agent) killed past the lease. The
/// supervisor stopped the job; the restarted server, whose lease had started afresh, took its
/// exit (code 0 from the job's signal handler) as the job completing. A fenced exit is a lost
/// node for that job: it is requeued.
#[tokio::test]
async fn a_job_fenced_by_its_supervisor_is_requeued_not_completed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    sync(&jobs, "a", T0, &[], &[]).await;
    let id = submit(
        &jobs,
        json!({ "command": ["train"], "user": "bob", "gpus_per_node": 1, "max_requeues": 1 }),
        T0 + SECOND,
    )
    .await;
    sync(&jobs, "a", T0 + 2 * SECOND, &[], &[]).await;
    let req: SyncRequest = serde_json::from_value(json!({
        "node": "a", "gpus": 1, "gpu_model": "Test H100",
        "exited": [{"job": id, "attempt": 1, "code": 0, "stopped": true, "fenced": true}],
    }))
    .expect("sync request");
    let r = jobs
        .run(move |c, _| c.sync(req, T0 + 3 * SECOND))
        .await
        .expect("sync");
    assert_eq!(
        r.acknowledged,
        vec![JobAttempt {
            job: id,
            attempt: 1
        }]
    );
    let j = job(&jobs, id).await;
    assert_eq!(
        (j.state.as_str(), j.requeues),
        ("running", 1),
        "requeued and started again"
    );
    assert_eq!(j.attempts, 2);
    assert_eq!(j.exit_code, None);
}

/// Issue 17: the agent's rack label (`agent.rack`) reaches the node record and the scheduler's
/// topology, and a changed label is followed at the next sync, with an event.
#[tokio::test]
async fn the_rack_an_agent_reports_reaches_the_scheduler_and_follows_changes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    let sync_in = |rack: serde_json::Value, at: i64| {
        let jobs = jobs.clone();
        async move {
            let req: SyncRequest = serde_json::from_value(json!({
                "node": "gpu-a", "gpus": 2, "gpu_model": "Test H100", "rack": rack,
            }))
            .expect("sync request");
            jobs.run(move |c, _| c.sync(req, at)).await.expect("sync");
        }
    };
    let rack_of = || {
        jobs.read(|c| {
            let idx = c.node_index["gpu-a"];
            let spec = c
                .scheduler
                .cluster()
                .spec(perch_scheduler::NodeId(idx as u32))
                .expect("node")
                .rack
                .clone();
            (c.nodes[idx].record.rack.clone(), spec)
        })
    };
    sync_in(json!("r1"), T0).await;
    assert_eq!(rack_of(), ("r1".to_owned(), "r1".to_owned()));
    sync_in(json!("r2"), T0 + SECOND).await;
    assert_eq!(rack_of(), ("r2".to_owned(), "r2".to_owned()));
    // No label, or one that is not a name: "default".
    sync_in(json!("no such rack!"), T0 + 2 * SECOND).await;
    assert_eq!(rack_of(), ("default".to_owned(), "default".to_owned()));
    // The node's record is durable with its rack.
    drop(jobs);
    let jobs = service(dir.path());
    let rack = jobs.read(|c| c.nodes[c.node_index["gpu-a"]].record.rack.clone());
    assert_eq!(rack, "default");
}

/// Review of issue 16: an array is added in steps, and the pending cap was checked against
/// jobs already added only, so two large arrays sent at once could each pass it. The tasks
/// an array will add count from the moment it is accepted.
#[tokio::test]
async fn arrays_sent_at_once_cannot_together_pass_the_pending_cap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (tx, _rx) = JobService::event_channel();
    let config = JobsConfig {
        max_pending_per_user: 3000,
        ..JobsConfig::default()
    };
    let jobs = JobService::open(dir.path(), config, tx).expect("jobs");
    let array = |n: u32| -> crate::jobs::spec::JobRequest {
        serde_json::from_value(json!({
            "command": ["train"], "user": "bob", "gpus_per_node": 1, "array": n
        }))
        .expect("request")
    };
    let (a, b) = tokio::join!(
        jobs.submit(array(2000), false),
        jobs.submit(array(2000), false)
    );
    let (ok, refused): (Vec<_>, Vec<_>) = [a, b].into_iter().partition(Result::is_ok);
    assert_eq!(
        (ok.len(), refused.len()),
        (1, 1),
        "exactly one fits under 3,000"
    );
    let e = refused
        .into_iter()
        .next()
        .expect("refused")
        .expect_err("refused");
    assert_eq!(e.status, axum::http::StatusCode::TOO_MANY_REQUESTS);
    // Once the first is in, the reservation is gone: 1,000 more fit, not 1,001.
    jobs.submit(array(1000), false)
        .await
        .expect("room for 1,000");
    jobs.submit(array(1), false)
        .await
        .expect_err("the cap is reached");
}
