//! The control plane's job-safety invariants in virtual time: an exit is charged
//! only to the attempt that ran, a report of any other attempt gets a stop for that attempt,
//! and a silent node's jobs are requeued only once its lease has run out.

use crate::ControlError;
use crate::control::LOG_PAGE;
use crate::record::{JobRecord, JobState};
use crate::{JobService, JobsConfig};
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
    JobService::open_embedded(dir, config, tx).expect("jobs")
}

/// A service whose every "now" is `clock`'s (virtual time).
fn service_on(dir: &std::path::Path, clock: &perch_model::clock::Clock) -> JobService {
    let (tx, _rx) = JobService::event_channel();
    let config = JobsConfig {
        clock: clock.clone(),
        ..JobsConfig::default()
    };
    JobService::open_embedded(dir, config, tx).expect("jobs")
}

async fn sync(
    jobs: &JobService,
    node: &str,
    at: i64,
    running: &[(u64, u32)],
    exited: &[(u64, u32, i32)],
) -> SyncResponse {
    sync_with(jobs, node, at, running, exited, json!({})).await
}

/// [`sync`] with more of the request's fields (`extra`, a JSON object).
async fn sync_with(
    jobs: &JobService,
    node: &str,
    at: i64,
    running: &[(u64, u32)],
    exited: &[(u64, u32, i32)],
    extra: serde_json::Value,
) -> SyncResponse {
    let mut req = json!({
        "node": node, "gpus": 1, "gpu_model": "Test H100",
        "running": running.iter().map(|(j, a)| json!({"job": j, "attempt": a})).collect::<Vec<_>>(),
        "exited": exited.iter().map(|(j, a, c)| json!({"job": j, "attempt": a, "code": c})).collect::<Vec<_>>(),
    });
    if let (Some(req), Some(extra)) = (req.as_object_mut(), extra.as_object()) {
        req.extend(extra.clone());
    }
    let req: SyncRequest = serde_json::from_value(req).expect("sync request");
    jobs.run(move |c, _| c.sync(req, at)).await.expect("sync")
}

/// Starts a 2-node gang submitted just before `at`: rank 0's node gets its launch and
/// reports the port it picked, then rank 1's gets its own. Returns (rank 0's node, rank
/// 1's) and the time after.
async fn start_gang(jobs: &JobService, id: u64, mut at: i64) -> (String, String, i64) {
    for node in ["a", "b"] {
        sync(jobs, node, at, &[], &[]).await;
    }
    let placed = job(jobs, id).await.placement;
    let (first, second) = (placed[0].node.clone(), placed[1].node.clone());
    at += SECOND;
    let ports = json!({ "master_ports": [{ "job": id, "attempt": 1, "port": 29611 }] });
    sync_with(jobs, &first, at, &[(id, 1)], &[], ports).await;
    let r = sync(jobs, &second, at, &[], &[]).await;
    assert_eq!(r.start.len(), 1, "rank 1 starts once the port is known");
    assert_eq!(r.start[0].env["MASTER_PORT"], "29611");
    (first, second, at + SECOND)
}

async fn job(jobs: &JobService, id: u64) -> JobRecord {
    jobs.run(move |c, _| c.view(id))
        .await
        .expect("view")
        .expect("job")
}

/// Submits one job (a `JobRequest` as JSON) at `at`; returns its id.
async fn submit(jobs: &JobService, request: serde_json::Value, at: i64) -> u64 {
    let request: crate::spec::JobRequest = serde_json::from_value(request).expect("request");
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

/// An earlier attempt's exit never ends the attempt placed after it on the same node: node a
/// comes back after its lease with the fenced exit of attempt 1, and the sync that brings it
/// back also places attempt 2 there. The exit is noted; attempt 2 is launched, not requeued.
#[tokio::test]
async fn an_old_attempts_exit_does_not_end_the_attempt_placed_after_it_on_the_same_node() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    sync(&jobs, "a", T0, &[], &[]).await;
    let id = submit(
        &jobs,
        json!({ "command": ["train"], "user": "bob", "max_requeues": 2, "gpus_per_node": 1 }),
        T0 + SECOND,
    )
    .await;
    sync(&jobs, "a", T0 + 2 * SECOND, &[], &[]).await;
    sync(&jobs, "a", T0 + 3 * SECOND, &[(id, 1)], &[]).await;
    tick(&jobs, T0 + 400 * SECOND).await;
    let j = job(&jobs, id).await;
    assert_eq!(
        (j.state.as_str(), j.requeues),
        ("pending", 1),
        "requeued past the lease"
    );
    let fenced = json!({ "exited": [{ "job": id, "attempt": 1, "code": 137, "fenced": true }] });
    let r = sync_with(&jobs, "a", T0 + 401 * SECOND, &[], &[], fenced).await;
    let j = job(&jobs, id).await;
    assert_eq!(
        (j.state.as_str(), j.attempts, j.requeues),
        ("running", 2, 1),
        "{:?}",
        j.timeline
    );
    assert_eq!(
        r.start
            .iter()
            .map(|l| (l.job, l.attempt))
            .collect::<Vec<_>>(),
        vec![(id, 2)]
    );
}

/// A log-store error failed the whole sync, so the node went down and its jobs were
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

/// One user's arrays filled the queue and the job database. Past
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
    let jobs = JobService::open_embedded(dir.path(), config, tx).expect("jobs");
    let submit = |user: &str, array: Option<u32>| {
        let request: crate::spec::JobRequest = serde_json::from_value(json!({
            "command": ["train"], "user": user, "gpus_per_node": 1, "array": array
        }))
        .expect("request");
        jobs.run(move |c, _| c.submit(request, T0))
    };
    let first = submit("bob", Some(2)).await.expect("two pending")[0].id;
    let e = submit("bob", Some(2))
        .await
        .expect_err("four would be past three");
    assert!(matches!(e, ControlError::TooManyPending { .. }), "{e:?}");
    assert!(
        e.to_string().contains("bob has 2 pending jobs and this submission adds 2: at most 3 per user (server.max_pending_jobs_per_user)"),
        "{e}"
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
    let jobs = JobService::open_embedded(dir.path(), config, tx).expect("jobs");
    let request: crate::spec::JobRequest =
        serde_json::from_value(json!({"command": ["train"], "user": "bob"})).expect("request");
    let e = jobs
        .run(move |c, _| c.submit(request, T0 + 2 * SECOND))
        .await
        .expect_err("still three pending after the restart");
    assert!(matches!(e, ControlError::TooManyPending { .. }), "{e:?}");
}

/// The pending cap also counts bytes: 10,000 pending jobs of 320 KiB of command and
/// environment each (both within their own limits) were 3.2 GB of one user's in memory. An
/// array is counted whole before its first step, and a cancel or a start makes room.
#[tokio::test]
async fn a_user_cannot_queue_past_the_pending_bytes_cap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (tx, _rx) = JobService::event_channel();
    let config = JobsConfig {
        max_pending_bytes_per_user: 1 << 20,
        ..JobsConfig::default()
    };
    let jobs = JobService::open_embedded(dir.path(), config, tx).expect("jobs");
    let value = "v".repeat(60 << 10);
    let submit = |user: &str, array: Option<u32>| {
        let request: crate::spec::JobRequest = serde_json::from_value(json!({
            "command": ["train"], "user": user, "array": array, "env": { "A": value }
        }))
        .expect("request");
        jobs.run(move |c, _| c.submit(request, T0))
    };
    // 60 KiB and some bytes a job: 17 fit in 1 MiB, not 18. A task adds its array
    // variables (39 bytes here), counted as 64 until it is added.
    let first = submit("bob", Some(10)).await.expect("ten")[0].id;
    let e = submit("bob", Some(8)).await.expect_err("past 1 MiB");
    assert!(
        matches!(e, ControlError::TooManyPendingBytes { .. }),
        "{e:?}"
    );
    let each = 5 + 1 + (60 << 10);
    let (held, adding) = (10 * (each + 39), 8 * (each + 64));
    assert!(
        e.to_string().contains(&format!("bob's pending jobs hold {held} bytes of command and environment and this submission adds {adding}: at most 1048576 per user (server.max_pending_job_mb_per_user)")),
        "{e}"
    );
    submit("bob", Some(7)).await.expect("seventeen fit");
    submit("carol", Some(10)).await.expect("another user");
    jobs.run(move |c, _| c.cancel(first, "bob", T0 + SECOND))
        .await
        .expect("cancel");
    submit("bob", None).await.expect("room again");
    let held = jobs
        .run(|c, _| Ok(c.pending.of("bob")))
        .await
        .expect("held");
    let (bobs, _) = jobs
        .list_jobs(u64::MAX, 100, |j| {
            j.user == "bob" && j.state == JobState::Pending
        })
        .expect("list");
    assert_eq!(held.jobs, 17);
    assert_eq!(held.jobs, bobs.len());
    let kept: usize = bobs.iter().map(|j| j.request.kept_bytes()).sum();
    assert_eq!(held.bytes, kept);
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

/// The agent's rack label (`agent.rack`) reaches the node record and the scheduler's
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

/// An array is added in steps, and the pending cap was checked against
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
    let jobs = JobService::open_embedded(dir.path(), config, tx).expect("jobs");
    let array = |n: u32| -> crate::spec::JobRequest {
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
    assert!(matches!(e, ControlError::TooManyPending { .. }), "{e:?}");
    // Once the first is in, the reservation is gone: 1,000 more fit, not 1,001.
    jobs.submit(array(1000), false)
        .await
        .expect("room for 1,000");
    jobs.submit(array(1), false)
        .await
        .expect_err("the cap is reached");
}

/// A job on several nodes runs until every rank has ended: a rank that finishes first is
/// neither the job's end nor "lost"; one that fails ends the job at once, stops the others
/// and is named in the reason.
#[tokio::test]
async fn a_gang_ends_when_all_ranks_succeed_or_one_fails() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    sync(&jobs, "a", T0, &[], &[]).await;
    sync(&jobs, "b", T0, &[], &[]).await;
    let gang = json!({ "command": ["train"], "user": "bob", "nodes": 2, "gpus_per_node": 1 });
    let ok = submit(&jobs, gang.clone(), T0 + SECOND).await;
    let (first, second, mut at) = start_gang(&jobs, ok, T0 + 2 * SECOND).await;
    // Rank 0 finishes; rank 1 still runs (and the next syncs must not call rank 0 lost).
    sync(&jobs, &first, at, &[], &[(ok, 1, 0)]).await;
    sync(&jobs, &second, at, &[(ok, 1)], &[]).await;
    at += SECOND;
    let r = sync(&jobs, &first, at, &[], &[]).await;
    assert!(r.stop.is_empty(), "nothing to stop: {:?}", r.stop);
    let j = job(&jobs, ok).await;
    assert_eq!(j.state, JobState::Running, "{:?}", j.timeline);
    assert_eq!(j.placement[0].exit_code, Some(0));
    at += SECOND;
    sync(&jobs, &second, at, &[], &[(ok, 1, 0)]).await;
    let j = job(&jobs, ok).await;
    assert_eq!(j.state, JobState::Completed, "{:?}", j.timeline);
    assert_eq!(j.exit_code, Some(0));

    let bad = submit(&jobs, gang, at).await;
    let (first, second, at) = start_gang(&jobs, bad, at + SECOND).await;
    sync(&jobs, &second, at, &[], &[(bad, 1, 3)]).await;
    let j = job(&jobs, bad).await;
    assert_eq!(j.state, JobState::Failed);
    assert_eq!(j.exit_code, Some(3));
    let reason = j.reason.expect("reason");
    assert!(
        reason.contains(&format!("rank 1 of 2 (on {second}) exited with code 3")),
        "{reason}"
    );
    let r = sync(&jobs, &first, at + SECOND, &[(bad, 1)], &[]).await;
    assert_eq!(
        r.stop
            .iter()
            .map(|s| (s.job, s.attempt))
            .collect::<Vec<_>>(),
        vec![(bad, 1)],
        "rank 0 is stopped"
    );
    // Rank 0's exit after the stop changes nothing.
    sync(&jobs, &first, at + 2 * SECOND, &[], &[(bad, 1, 143)]).await;
    let j = job(&jobs, bad).await;
    assert_eq!((j.state, j.exit_code), (JobState::Failed, Some(3)));
}

/// Rank 0's agent picks the rendezvous port; the other ranks wait for it, get it, and every
/// rank gets the hostfile. A job that sets its own `MASTER_PORT` starts all ranks at once.
#[tokio::test]
async fn rank_zero_picks_the_port_before_the_other_ranks_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    sync(&jobs, "a", T0, &[], &[]).await;
    sync(&jobs, "b", T0, &[], &[]).await;
    let gang = json!({ "command": ["train"], "user": "bob", "nodes": 2, "gpus_per_node": 1 });
    let id = submit(&jobs, gang.clone(), T0 + SECOND).await;
    let at = T0 + 2 * SECOND;
    let placed = job(&jobs, id).await.placement;
    let (first, second) = (placed[0].node.clone(), placed[1].node.clone());
    let r = sync(&jobs, &second, at, &[], &[]).await;
    assert!(r.start.is_empty(), "rank 1 waits for the port");
    let r = sync(&jobs, &first, at, &[], &[]).await;
    let launch = &r.start[0];
    assert!(launch.pick_master_port);
    assert!(!launch.env.contains_key("MASTER_PORT"), "{:?}", launch.env);
    assert_eq!(launch.hosts.len(), 2);
    assert_eq!(
        launch.hosts[0].addr, first,
        "without an address, the node's name"
    );
    assert_eq!(launch.hosts[1].slots, 1);
    // Another node cannot set the port; a report for another attempt is ignored.
    let forged = json!({ "master_ports": [{ "job": id, "attempt": 1, "port": 1 }] });
    sync_with(&jobs, &second, at + SECOND, &[], &[], forged).await;
    let stale = json!({ "master_ports": [{ "job": id, "attempt": 9, "port": 2 }] });
    sync_with(&jobs, &first, at + SECOND, &[(id, 1)], &[], stale).await;
    assert_eq!(job(&jobs, id).await.master_port, None);
    let ports = json!({ "master_ports": [{ "job": id, "attempt": 1, "port": 30001 }] });
    sync_with(
        &jobs,
        &first,
        at + 2 * SECOND,
        &[(id, 1)],
        &[],
        ports.clone(),
    )
    .await;
    // Reported again with every sync: the first one counts, nothing is launched twice.
    sync_with(&jobs, &first, at + 3 * SECOND, &[(id, 1)], &[], ports).await;
    let r = sync(&jobs, &second, at + 3 * SECOND, &[], &[]).await;
    assert_eq!(r.start.len(), 1);
    assert!(!r.start[0].pick_master_port);
    assert_eq!(r.start[0].env["MASTER_PORT"], "30001");
    assert_eq!(r.start[0].env["PET_MASTER_PORT"], "30001");
    assert_eq!(job(&jobs, id).await.master_port, Some(30001));

    let cancel_at = at + 4 * SECOND;
    jobs.run(move |c, _| c.cancel(id, "bob", cancel_at))
        .await
        .expect("cancel");
    let mut own = gang;
    own["env"] = json!({ "MASTER_PORT": "not-a-port-but-the-job's-own" });
    let id = submit(&jobs, own, at + 4 * SECOND).await;
    for node in ["a", "b"] {
        let r = sync(&jobs, node, at + 5 * SECOND, &[], &[]).await;
        let launch = r
            .start
            .iter()
            .find(|l| l.job == id)
            .expect("both ranks at once");
        assert!(!launch.pick_master_port);
        assert_eq!(launch.env["MASTER_PORT"], "not-a-port-but-the-job's-own");
        assert_eq!(
            launch.env["PET_MASTER_PORT"],
            "not-a-port-but-the-job's-own"
        );
    }
}

/// A job stopped by perch (cancelled, preempted) gets its own checkpoint signal, even though
/// the agent still reports it running in the same sync that carries the stop (that report
/// alone would earn it a plain SIGTERM).
#[tokio::test]
async fn a_stopped_job_gets_its_checkpoint_signal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    sync(&jobs, "a", T0, &[], &[]).await;
    let id = submit(
        &jobs,
        json!({ "command": ["train"], "user": "bob", "checkpoint_signal": "SIGUSR1", "grace_secs": 90 }),
        T0 + SECOND,
    )
    .await;
    sync(&jobs, "a", T0 + 2 * SECOND, &[], &[]).await;
    sync(&jobs, "a", T0 + 3 * SECOND, &[(id, 1)], &[]).await;
    let at = T0 + 4 * SECOND;
    jobs.run(move |c, _| c.cancel(id, "bob", at))
        .await
        .expect("cancel");
    let r = sync(&jobs, "a", T0 + 5 * SECOND, &[(id, 1)], &[]).await;
    assert_eq!(r.stop.len(), 1, "{:?}", r.stop);
    assert_eq!(
        (r.stop[0].signal.as_str(), r.stop[0].grace_secs),
        ("SIGUSR1", 90)
    );
    // Reported again later (the job is slow to stop): the same signal, not SIGTERM.
    let r = sync(&jobs, "a", T0 + 6 * SECOND, &[(id, 1)], &[]).await;
    assert_eq!(r.stop[0].signal, "SIGUSR1");
}

/// A server restarted between rank 0's launch and the other ranks' keeps the gang going:
/// the port it had is kept, and one it never got is taken from rank 0's next sync (agents
/// report it with every sync).
#[tokio::test]
async fn a_restart_between_rank_zero_and_the_others_loses_no_rendezvous() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gang = json!({ "command": ["train"], "user": "bob", "nodes": 2, "gpus_per_node": 1 });
    for port_before_restart in [true, false] {
        let sub = dir.path().join(port_before_restart.to_string());
        let jobs = service(&sub);
        sync(&jobs, "a", T0, &[], &[]).await;
        sync(&jobs, "b", T0, &[], &[]).await;
        let id = submit(&jobs, gang.clone(), T0 + SECOND).await;
        let placed = job(&jobs, id).await.placement;
        let (first, second) = (placed[0].node.clone(), placed[1].node.clone());
        let r = sync(&jobs, &first, T0 + 2 * SECOND, &[], &[]).await;
        assert!(r.start[0].pick_master_port);
        let ports = json!({ "master_ports": [{ "job": id, "attempt": 1, "port": 30123 }] });
        if port_before_restart {
            sync_with(
                &jobs,
                &first,
                T0 + 3 * SECOND,
                &[(id, 1)],
                &[],
                ports.clone(),
            )
            .await;
        }
        drop(jobs);
        let jobs = service(&sub);
        let r = sync(&jobs, &second, T0 + 4 * SECOND, &[], &[]).await;
        let r = if port_before_restart {
            r
        } else {
            assert!(r.start.is_empty(), "rank 1 still waits for the port");
            let r0 = sync_with(&jobs, &first, T0 + 5 * SECOND, &[(id, 1)], &[], ports).await;
            assert!(
                r0.start.is_empty(),
                "rank 0 is not launched twice: {:?}",
                r0.start
            );
            sync(&jobs, &second, T0 + 6 * SECOND, &[], &[]).await
        };
        assert_eq!(r.start.len(), 1, "rank 1 launched after the restart");
        assert_eq!(r.start[0].env["MASTER_PORT"], "30123");
    }
}

/// Output is kept per attempt and node: a requeued job's new output starts at offset 0 and is
/// stored whole (it used to be dropped up to the length of the earlier attempt's), the ranks
/// of a gang do not write over each other, and a node cannot write a job it does not run.
#[tokio::test]
async fn output_is_kept_per_attempt_and_rank() {
    use perch_model::control::LogStream;
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    let logs = |job: u64, attempt: u32, data: &str| json!({ "logs": [{ "job": job, "attempt": attempt, "stream": "stdout", "offset": 0, "data": data }] });
    sync(&jobs, "a", T0, &[], &[]).await;
    sync(&jobs, "b", T0, &[], &[]).await;
    let id = submit(
        &jobs,
        json!({ "command": ["train"], "user": "bob", "max_requeues": 2 }),
        T0 + SECOND,
    )
    .await;
    let node = job(&jobs, id).await.placement[0].node.clone();
    let other = if node == "a" { "b" } else { "a" };
    sync(&jobs, &node, T0 + 2 * SECOND, &[], &[]).await;
    let long = "attempt one wrote a long line\n";
    sync_with(
        &jobs,
        &node,
        T0 + 3 * SECOND,
        &[(id, 1)],
        &[],
        logs(id, 1, long),
    )
    .await;
    // The other node claims output of this job: not stored.
    sync_with(
        &jobs,
        other,
        T0 + 3 * SECOND,
        &[],
        &[],
        logs(id, 1, "forged\n"),
    )
    .await;
    // The node is lost: the job is requeued and runs again, somewhere.
    jobs.run(move |c, _| {
        let actions = c.scheduler.step(
            T0 + 4 * SECOND,
            perch_scheduler::Event::JobLost(perch_scheduler::JobId(id)),
        )?;
        c.apply(T0 + 4 * SECOND, actions);
        Ok(())
    })
    .await
    .expect("lost");
    let second = job(&jobs, id).await;
    assert_eq!(second.attempts, 2, "{:?}", second.timeline);
    let node2 = second.placement[0].node.clone();
    sync(&jobs, &node2, T0 + 5 * SECOND, &[], &[]).await;
    sync_with(
        &jobs,
        &node2,
        T0 + 6 * SECOND,
        &[(id, 2)],
        &[],
        logs(id, 2, "two\n"),
    )
    .await;
    let read = |attempt: Option<u32>, rank: Option<usize>| {
        let jobs = jobs.clone();
        async move {
            let source = jobs
                .run(move |c, _| c.log_source(id, LogStream::Stdout, attempt, rank))
                .await?;
            Ok::<_, ControlError>(source.read(0, LOG_PAGE).expect("read"))
        }
    };
    let latest = read(None, None).await.expect("latest");
    assert_eq!(
        (
            String::from_utf8_lossy(&latest.data).as_ref(),
            latest.attempt
        ),
        ("two\n", 2)
    );
    let first = read(Some(1), None).await.expect("first");
    assert_eq!(String::from_utf8_lossy(&first.data), long);
    let err = read(None, Some(1)).await.expect_err("one node only");
    assert!(format!("{err:?}").contains("ranks 0 to 0"), "{err:?}");
    let err = read(Some(7), None).await.expect_err("no such attempt");
    assert!(format!("{err:?}").contains("no attempt 7"), "{err:?}");
}

/// An agent ships a job's output on after its exit: the exit says how long each stream is, so
/// a reader learns what is still to come; a page never holds more than [`LOG_PAGE`]; a reason
/// the agent gives for stopping the job becomes its reason; and a chunk the server does not keep
/// (a job it does not know) is answered with its end, so the agent moves on rather than sending
/// it for ever.
#[tokio::test]
async fn output_after_the_exit_is_paged_and_counted_until_whole() {
    use perch_model::control::LogStream;
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    sync(&jobs, "a", T0, &[], &[]).await;
    let id = submit(
        &jobs,
        json!({ "command": ["train"], "user": "bob" }),
        T0 + SECOND,
    )
    .await;
    sync(&jobs, "a", T0 + 2 * SECOND, &[], &[]).await;
    let big = "x".repeat(usize::try_from(LOG_PAGE).expect("page") + 10);
    let chunk = |offset: usize, data: &str| json!({ "job": id, "attempt": 1, "stream": "stdout", "offset": offset, "data": data });
    let total = big.len() + 5;
    let r = sync_with(
        &jobs,
        "a",
        T0 + 3 * SECOND,
        &[],
        &[],
        json!({
            "exited": [{ "job": id, "attempt": 1, "code": 143, "stopped": true,
                         "reason": "its output passed 1 MiB", "output_bytes": [total, 0] }],
            "logs": [chunk(0, &big), { "job": 999, "attempt": 1, "stream": "stdout", "offset": 7, "data": "abc" }],
        }),
    )
    .await;
    assert_eq!(
        r.log_offsets,
        vec![
            (id, LogStream::Stdout, big.len() as u64),
            (999, LogStream::Stdout, 10)
        ],
        "the unknown job's chunk is answered with its end"
    );
    let record = job(&jobs, id).await;
    assert_eq!(record.state, JobState::Failed);
    assert_eq!(
        record.reason.as_deref(),
        Some("stopped on a: its output passed 1 MiB")
    );
    let read = |offset: u64| {
        let jobs = jobs.clone();
        async move {
            let source = jobs
                .run(move |c, _| c.log_source(id, LogStream::Stdout, None, None))
                .await
                .expect("source");
            source.read(offset, LOG_PAGE).expect("read")
        }
    };
    let first = read(0).await;
    assert_eq!(first.data.len() as u64, LOG_PAGE);
    assert!(first.more);
    assert_eq!(first.pending, Some(5));
    let second = read(LOG_PAGE).await;
    assert_eq!((second.data.len(), second.more), (10, false));
    // The rest arrives after the exit: the copy is whole.
    sync_with(
        &jobs,
        "a",
        T0 + 4 * SECOND,
        &[],
        &[],
        json!({ "logs": [chunk(big.len(), "tail\n")] }),
    )
    .await;
    let last = read(LOG_PAGE).await;
    assert_eq!(
        (
            String::from_utf8_lossy(&last.data).as_ref(),
            last.pending,
            last.stored
        ),
        ("xxxxxxxxxxtail\n", Some(0), total as u64)
    );
}

/// The scheduler takes a GPU out on the XIDs NVIDIA's catalog resolves by a reset or a reboot,
/// as the alert rules class them: not on informational or application XIDs (it used to on
/// 61, 63, 69, 92 and 94), and on the reboot and reset classes it used to miss.
#[test]
fn the_xids_that_quarantine_a_gpu_are_the_alerts_reset_and_reboot_classes() {
    use super::observe::xid_needs_reset;
    for ignored_or_app in [13, 31, 43, 45, 63, 69, 92, 94] {
        assert!(!xid_needs_reset(ignored_or_app), "{ignored_or_app}");
    }
    for reset_or_reboot in [46, 48, 64, 74, 79, 95, 109, 110, 119, 144, 149, 151, 160] {
        assert!(xid_needs_reset(reset_or_reboot), "{reset_or_reboot}");
    }
}

/// The server read the wall clock in some twenty places, so its ticker could not be
/// tested in virtual time. With a manual [`perch_model::clock::Clock`] every operation and the real
/// ticker (`run_ticker`, on tokio's paused time) take "now" from it: a job is ended at its time
/// limit when the clock says so, and not a moment before.
#[tokio::test(start_paused = true)]
async fn the_ticker_keeps_the_servers_clock_so_time_limits_run_in_virtual_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = perch_model::clock::Clock::manual(T0);
    let jobs = service_on(dir.path(), &clock);
    let sync_now = |running: Vec<(u64, u32)>| {
        let jobs = jobs.clone();
        async move {
            let req: SyncRequest = serde_json::from_value(json!({
                "node": "a", "gpus": 1, "gpu_model": "Test H100",
                "running": running.iter().map(|(j, a)| json!({"job": j, "attempt": a})).collect::<Vec<_>>(),
            }))
            .expect("sync request");
            jobs.run(move |c, now| c.sync(req, now))
                .await
                .expect("sync")
        }
    };
    sync_now(vec![]).await;
    let request: crate::spec::JobRequest = serde_json::from_value(json!({
        "command": ["train"], "user": "bob", "gpus_per_node": 1, "time_limit_secs": 60
    }))
    .expect("request");
    let id = jobs
        .run(move |c, now| c.submit(request, now))
        .await
        .expect("submit")[0]
        .id;
    assert_eq!(sync_now(vec![]).await.start.len(), 1);
    let record = job(&jobs, id).await;
    assert_eq!(record.start_ms, Some(T0), "started at the clock's time");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let ticker = tokio::spawn(jobs.clone().run_ticker(async {
        let _ = stopped.await;
    }));
    // 59 s on the server's clock: the ticker runs (tokio's time moves too), the job stays.
    clock.advance(59 * SECOND);
    sync_now(vec![(id, 1)]).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(job(&jobs, id).await.state.as_str(), "running");
    // Past its limit by the clock: the next tick ends it, stamped with the clock's time.
    clock.advance(2 * SECOND);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ended = job(&jobs, id).await;
    assert_eq!(ended.state.as_str(), "timeout", "{:?}", ended.timeline);
    assert_eq!(ended.end_ms, Some(T0 + 61 * SECOND));
    let _ = stop.send(());
    ticker.await.expect("ticker");
}

/// What `GET /v1/nodes` (and the web view's fleet) shows per GPU: who holds it, with user and
/// account, and its health with the reason; a freed GPU has no holder.
#[tokio::test]
async fn each_gpu_shows_its_holder_and_health() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    let two_gpus = json!({"gpus": 2});
    sync_with(&jobs, "a", T0, &[], &[], two_gpus.clone()).await;
    let id = submit(
        &jobs,
        json!({ "command": ["train"], "user": "bob", "account": "nlp", "gpus_per_node": 1 }),
        T0 + SECOND,
    )
    .await;
    sync_with(&jobs, "a", T0 + 2 * SECOND, &[], &[], two_gpus.clone()).await;
    let gpus = |jobs: &JobService| jobs.read(|c| c.nodes()[0].gpu_detail.clone());
    let held = gpus(&jobs);
    assert_eq!(held.len(), 2);
    let placed = job(&jobs, id).await.placement[0].gpus[0] as usize;
    assert_eq!(
        held[placed].holders,
        vec![crate::control::views::GpuHolder {
            job: id,
            user: "bob".into(),
            account: "nlp".into(),
            share_percent: None,
        }]
    );
    assert!(held[1 - placed].holders.is_empty());
    jobs.run(move |c, now| {
        c.scheduler
            .step(
                now,
                perch_scheduler::Event::GpuHealth {
                    node: perch_scheduler::NodeId(0),
                    gpu: (1 - placed) as u32,
                    health: perch_scheduler::GpuHealth::Xid(48),
                },
            )
            .map(|_| ())
            .map_err(super::ControlError::Scheduler)
    })
    .await
    .expect("health event");
    let after = gpus(&jobs);
    assert_eq!(
        after[1 - placed].health,
        perch_scheduler::GpuHealth::Xid(48)
    );
    assert_eq!(after[placed].health, perch_scheduler::GpuHealth::Healthy);
    // The job ends: its GPU has no holder any more.
    sync_with(&jobs, "a", T0 + 3 * SECOND, &[], &[(id, 1, 0)], two_gpus).await;
    assert!(gpus(&jobs)[placed].holders.is_empty());
}

/// Starvation reclaim stops a job at most once, across a server restart too: the restarted
/// server resubmits the job with the runs it had, the core's only memory of them.
#[tokio::test]
async fn starvation_reclaim_stops_a_job_once_across_a_restart() {
    // The node syncs every 10 s while `x` runs there, from `from` to `to`; the last answer.
    async fn run_until(jobs: &JobService, x: (u64, u32), from: i64, to: i64) -> SyncResponse {
        let mut at = from;
        loop {
            tick(jobs, at).await;
            let r = sync(jobs, "a", at, &[x], &[]).await;
            if at >= to || !r.stop.is_empty() {
                return r;
            }
            at += 10 * SECOND;
        }
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut jobs = service(dir.path());
    sync(&jobs, "a", T0, &[], &[]).await;
    let long = json!({ "command": ["train"], "user": "bob", "time_limit_secs": 36000,
                       "max_requeues": 3, "preemptible": true });
    let x = submit(&jobs, long, T0 + SECOND).await;
    assert_eq!(
        sync(&jobs, "a", T0 + 2 * SECOND, &[], &[])
            .await
            .start
            .len(),
        1
    );
    let short = json!({ "command": ["eval"], "user": "bob", "time_limit_secs": 60 });

    // S1 waits past 4 x its 60 s: X is stopped for it, and runs again once S1 is done.
    let s1 = submit(&jobs, short.clone(), T0 + 4 * SECOND).await;
    let r = run_until(&jobs, (x, 1), T0 + 10 * SECOND, T0 + 300 * SECOND).await;
    assert_eq!(r.stop.len(), 1, "X is stopped for the starved job: {r:?}");
    // S1's launch comes with X's stop (the agent holds it until X's GPUs are free).
    assert_eq!(r.start.iter().map(|l| l.job).collect::<Vec<_>>(), vec![s1]);
    let mut at = T0 + 300 * SECOND;
    sync(&jobs, "a", at, &[(s1, 1)], &[(x, 1, 143)]).await;
    at += 10 * SECOND;
    let r = sync(&jobs, "a", at, &[], &[(s1, 1, 0)]).await;
    assert_eq!(
        (r.start.len(), job(&jobs, x).await.attempts),
        (1, 2),
        "X runs again"
    );

    // The server restarts; S2 then waits past its bound, and X is not stopped a second time.
    drop(jobs);
    jobs = service(dir.path());
    at += SECOND;
    sync(&jobs, "a", at, &[(x, 2)], &[]).await;
    submit(&jobs, short, at).await;
    let r = run_until(&jobs, (x, 2), at + 10 * SECOND, at + 400 * SECOND).await;
    assert!(r.stop.is_empty(), "X was stopped once already: {r:?}");
    assert_eq!(job(&jobs, x).await.state, JobState::Running);
}

/// A process outside the job that holds a GPU keeps new jobs off that GPU only while it is
/// there: once the node's latest sample of the GPU lists no rogue process, the GPU is placed on
/// again. Before, one stray process took its GPU out of scheduling until the server restarted.
/// An XID says more than a rogue process, and survives one leaving.
#[tokio::test]
async fn a_rogue_process_keeps_jobs_off_its_gpu_only_while_it_is_there() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    let two_gpus = json!({"gpus": 2});
    sync_with(&jobs, "a", T0, &[], &[], two_gpus.clone()).await;
    let id = submit(
        &jobs,
        json!({ "command": ["train"], "user": "bob", "gpus_per_node": 1 }),
        T0 + SECOND,
    )
    .await;
    sync_with(&jobs, "a", T0 + 2 * SECOND, &[], &[], two_gpus.clone()).await;
    let held = job(&jobs, id).await.placement[0].gpus[0];
    let other = 1 - held;
    // Rounds of the node: both GPUs list their processes; `rogue` puts one outside the job on
    // the held GPU; `xid` reports an XID 48 on the other.
    let observe = |at: i64, rogue: bool, listed: bool, xid: bool| {
        let gpu = |g: u32| {
            json!({"time_ms": at, "gpu": g, "uuid": format!("GPU-{g}"), "model": "Test H100",
                   "simulated": false, "processes": if listed { json!(u32::from(rogue)) } else { json!(null) }})
        };
        let mut processes = vec![];
        if rogue {
            processes.push(
                json!({"time_ms": at, "gpu": held, "uuid": format!("GPU-{held}"),
                "simulated": false, "pid": 4242, "used_memory_bytes": null,
                "sm_utilization_pct": null, "memory_utilization_pct": null, "job": null,
                "rogue": true}),
            );
            // A rogue process on the other GPU too, in the round its XID arrives.
            if xid {
                processes.push(
                    json!({"time_ms": at, "gpu": other, "uuid": format!("GPU-{other}"),
                    "simulated": false, "pid": 4343, "used_memory_bytes": null,
                    "sm_utilization_pct": null, "memory_utilization_pct": null, "job": null,
                    "rogue": true}),
                );
            }
        }
        let events = if xid {
            vec![
                json!({"time_ms": at, "gpu": other, "uuid": format!("GPU-{other}"),
                        "simulated": false, "kind": "xid", "xid": 48}),
            ]
        } else {
            vec![]
        };
        let batch: perch_model::Batch = serde_json::from_value(json!({
            "node": "a", "seq": at, "gpus": [gpu(0), gpu(1)],
            "gpu_processes": processes, "gpu_events": events,
        }))
        .expect("batch");
        let jobs = jobs.clone();
        async move {
            jobs.run(move |c, now| c.observe(&batch, now))
                .await
                .expect("observe");
        }
    };
    let health = |jobs: &JobService| {
        jobs.read(|c| {
            c.nodes()[0]
                .gpu_detail
                .iter()
                .map(|d| d.health)
                .collect::<Vec<_>>()
        })
    };
    use perch_scheduler::GpuHealth::{Healthy, RogueProcess, Xid};
    let at = |gpus: [perch_scheduler::GpuHealth; 2]| {
        let mut v = vec![Healthy; 2];
        v[held as usize] = gpus[0];
        v[other as usize] = gpus[1];
        v
    };
    observe(T0 + 3 * SECOND, true, true, true).await;
    assert_eq!(health(&jobs), at([RogueProcess, Xid(48)]));
    // A round whose processes are unknown changes nothing.
    observe(T0 + 4 * SECOND, false, false, false).await;
    assert_eq!(health(&jobs), at([RogueProcess, Xid(48)]));
    // The rogue process left: the GPU is healthy again; the XID stays.
    observe(T0 + 5 * SECOND, false, true, false).await;
    assert_eq!(health(&jobs), at([Healthy, Xid(48)]));
    // The job ends; a new one can have the GPU the rogue process left.
    sync_with(
        &jobs,
        "a",
        T0 + 6 * SECOND,
        &[],
        &[(id, 1, 0)],
        two_gpus.clone(),
    )
    .await;
    let next = submit(
        &jobs,
        json!({ "command": ["train"], "user": "bob", "gpus_per_node": 1 }),
        T0 + 7 * SECOND,
    )
    .await;
    sync_with(&jobs, "a", T0 + 8 * SECOND, &[], &[], two_gpus).await;
    assert_eq!(job(&jobs, next).await.placement[0].gpus, vec![held]);
}

/// History prediction survives a restart: the server gives the core the jobs of its database
/// that finished. Alice's three jobs ran 3 s of their week-long limits; after a restart her
/// next week-long job goes before bob's two-hour one when the blocker ends. Without the
/// prediction, bob's shorter limit goes first.
#[tokio::test]
async fn a_users_history_survives_a_restart() {
    async fn first_after_the_blocker(predict: bool) -> &'static str {
        let dir = tempfile::tempdir().expect("tempdir");
        let open = || {
            let (tx, _rx) = JobService::event_channel();
            let mut config = JobsConfig {
                heartbeat_timeout: Duration::from_secs(30),
                lease: Duration::from_secs(300),
                ..JobsConfig::default()
            };
            config.policy.predict_from_history = predict;
            JobService::open_embedded(dir.path(), config, tx).expect("jobs")
        };
        let week = json!({ "command": ["train"], "user": "alice", "time_limit_secs": 604800 });
        let jobs = open();
        let mut at = T0;
        sync(&jobs, "a", at, &[], &[]).await;
        for _ in 0..3 {
            let id = submit(&jobs, week.clone(), at + SECOND).await;
            at += 2 * SECOND;
            assert_eq!(sync(&jobs, "a", at, &[], &[]).await.start.len(), 1);
            at += 3 * SECOND;
            sync(&jobs, "a", at, &[(id, 1)], &[]).await;
            sync(&jobs, "a", at, &[], &[(id, 1, 0)]).await;
            assert_eq!(job(&jobs, id).await.state, JobState::Completed);
        }
        drop(jobs);
        let jobs = open();
        at += SECOND;
        sync(&jobs, "a", at, &[], &[]).await;
        let carol = json!({ "command": ["x"], "user": "carol", "time_limit_secs": 3600 });
        let blocker = submit(&jobs, carol, at).await;
        at += SECOND;
        assert_eq!(sync(&jobs, "a", at, &[], &[]).await.start.len(), 1);
        let two_hours = json!({ "command": ["y"], "user": "bob", "time_limit_secs": 7200 });
        let bob = submit(&jobs, two_hours, at).await;
        let alice = submit(&jobs, week, at).await;
        // Past a priority refresh: the finish factor ranks the two as they wait (both came
        // at a ratio of 1), alice's against the seconds her history predicts.
        at += 6 * 60 * SECOND;
        sync(&jobs, "a", at, &[(blocker, 1)], &[]).await;
        let r = sync(&jobs, "a", at + SECOND, &[], &[(blocker, 1, 0)]).await;
        let started: Vec<u64> = r.start.iter().map(|l| l.job).collect();
        match started.as_slice() {
            [j] if *j == alice => "alice",
            [j] if *j == bob => "bob",
            other => panic!("one job starts: {other:?}"),
        }
    }
    assert_eq!(first_after_the_blocker(true).await, "alice");
    assert_eq!(first_after_the_blocker(false).await, "bob");
}

/// A job that asks, on its own, for more than its account's quota could only ever run on
/// borrowed GPUs: the submission is refused, naming the field to change, unless the job is
/// preemptible and borrowing is on (an array of them too, reserving no ids). Accepted, a job
/// that may not be preempted held another account's guaranteed GPUs until its time limit.
#[tokio::test]
async fn a_job_that_could_only_borrow_is_refused_unless_it_may_be_preempted() {
    use perch_scheduler::Account;
    for borrowing in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (tx, _rx) = JobService::event_channel();
        let mut config = JobsConfig::default();
        config.policy.quotas = vec![(Account("alice".into()), 2)];
        config.policy.borrowing = borrowing;
        let jobs = JobService::open_embedded(dir.path(), config, tx).expect("jobs");
        sync(&jobs, "a", T0, &[], &[]).await;
        let attempt = |request: serde_json::Value| async {
            let request: crate::spec::JobRequest =
                serde_json::from_value(request).expect("request");
            jobs.run(move |c, _| Ok(c.submit(request, T0 + SECOND)))
                .await
                .expect("run")
        };
        let asks = |gpus: u32, preemptible: bool, array: Option<u32>| {
            json!({ "command": ["train"], "user": "alice", "gpus_per_node": gpus,
                    "preemptible": preemptible, "array": array })
        };
        for array in [None, Some(3)] {
            let refused = attempt(asks(4, false, array)).await;
            let Err(e) = refused else {
                panic!("accepted: {refused:?}")
            };
            let text = e.to_string();
            let field = if borrowing {
                "field `preemptible`"
            } else {
                "field `gpus_per_node`"
            };
            assert!(
                text.contains(field) && text.contains("asks for 4 GPU(s)"),
                "{text}"
            );
            assert!(text.contains("quota of 2 GPU(s)"), "{text}");
        }
        // Preemptible, it is accepted where it can borrow; within the quota, always.
        let borrower = attempt(asks(4, true, None)).await;
        assert_eq!(borrower.is_ok(), borrowing, "{borrower:?}");
        let own = attempt(asks(2, false, None))
            .await
            .expect("within the quota");
        // Ids are handed out in order: nothing was reserved for the refused ones.
        assert_eq!(own[0].id, if borrowing { 2 } else { 1 });
    }
}

/// A borrower that declares an hour's grace would hold the GPUs of the account reclaiming
/// them for that hour (the agent starts the new job once the old one is gone): stopped for
/// another job's sake it gets at most `preemption_grace_max`, and its timeline says so; a
/// cancel keeps its own grace.
#[tokio::test]
async fn a_job_stopped_for_another_gets_at_most_the_preemption_grace() {
    use perch_scheduler::Account;
    let dir = tempfile::tempdir().expect("tempdir");
    let (tx, _rx) = JobService::event_channel();
    let mut config = JobsConfig::default();
    config.policy.quotas = vec![(Account("alice".into()), 1)];
    config.policy.preemption_grace_max = 120 * SECOND;
    let jobs = JobService::open_embedded(dir.path(), config, tx).expect("jobs");
    let mut at = T0;
    sync(&jobs, "a", at, &[], &[]).await;
    let hour = |user: &str| {
        json!({ "command": ["train"], "user": user, "gpus_per_node": 1, "preemptible": true,
                "grace_secs": 3600, "max_requeues": 3 })
    };
    // bob (no quota) borrows the node's one GPU.
    let borrower = submit(&jobs, hour("bob"), at).await;
    at += SECOND;
    assert_eq!(sync(&jobs, "a", at, &[], &[]).await.start.len(), 1);
    at += SECOND;
    sync(&jobs, "a", at, &[(borrower, 1)], &[]).await;
    // alice, within her quota, takes it back: bob's run is stopped with 120 s, not 3600.
    let own = submit(&jobs, hour("alice"), at).await;
    at += SECOND;
    let r = sync(&jobs, "a", at, &[(borrower, 1)], &[]).await;
    let grace: Vec<(u64, u64)> = r.stop.iter().map(|s| (s.job, s.grace_secs)).collect();
    assert_eq!(grace, vec![(borrower, 120)]);
    // alice's launch comes with it: the agent starts it once bob's processes are gone.
    assert_eq!(r.start.iter().map(|l| l.job).collect::<Vec<_>>(), vec![own]);
    let notes = format!("{:?}", job(&jobs, borrower).await.timeline);
    assert!(notes.contains("grace 120 s, not its own 3600 s"), "{notes}");
    // Cancelled, alice's job keeps its own hour.
    at += SECOND;
    sync(&jobs, "a", at, &[(own, 1)], &[(borrower, 1, 143)]).await;
    jobs.run(move |c, _| c.cancel(own, "alice", at))
        .await
        .expect("cancel");
    at += SECOND;
    let r = sync(&jobs, "a", at, &[(own, 1)], &[]).await;
    let grace: Vec<(u64, u32, u64)> = r
        .stop
        .iter()
        .map(|s| (s.job, s.attempt, s.grace_secs))
        .collect();
    assert_eq!(grace, vec![(own, 1, 3600)]);
}

/// Job output is kept `server.job_output_days` after the job ended, then deleted by the
/// server's own ticker (virtual time): the directory goes, the record stays and says so on its
/// timeline, `perch logs` is answered "deleted" (not an empty log), a restarted server still
/// knows, and output an agent ships for the job afterwards is not stored again. A job still
/// running, however old, and one that ended within the retention keep theirs.
#[tokio::test(start_paused = true)]
async fn output_is_deleted_after_the_retention_and_the_record_says_so() {
    use perch_model::control::LogStream;
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = perch_model::clock::Clock::manual(T0);
    let open = || {
        let (tx, _rx) = JobService::event_channel();
        let config = JobsConfig {
            clock: clock.clone(),
            output_retention: Some(Duration::from_secs(30 * 86_400)),
            ..JobsConfig::default()
        };
        JobService::open_embedded(dir.path(), config, tx).expect("jobs")
    };
    let jobs = open();
    let sync_now = |jobs: &JobService, extra: serde_json::Value| {
        let jobs = jobs.clone();
        async move {
            let mut req = json!({ "node": "a", "gpus": 2, "gpu_model": "Test H100" });
            if let (Some(r), Some(e)) = (req.as_object_mut(), extra.as_object()) {
                r.extend(e.clone());
            }
            let req: SyncRequest = serde_json::from_value(req).expect("sync request");
            jobs.run(move |c, now| c.sync(req, now))
                .await
                .expect("sync")
        }
    };
    let submit_now = |jobs: &JobService| {
        let jobs = jobs.clone();
        async move {
            let request: crate::spec::JobRequest = serde_json::from_value(
                json!({ "command": ["train"], "user": "bob", "gpus_per_node": 1 }),
            )
            .expect("request");
            jobs.run(move |c, now| c.submit(request, now))
                .await
                .expect("submit")[0]
                .id
        }
    };
    let chunk = |id: u64, data: &str| json!({ "job": id, "attempt": 1, "stream": "stdout", "offset": 0, "data": data });
    sync_now(&jobs, json!({})).await;
    let (old, running) = (submit_now(&jobs).await, submit_now(&jobs).await);
    assert_eq!(sync_now(&jobs, json!({})).await.start.len(), 2);
    clock.advance(SECOND);
    sync_now(
        &jobs,
        json!({
            "running": [{ "job": running, "attempt": 1 }],
            "exited": [{ "job": old, "attempt": 1, "code": 0, "output_bytes": [6, 0] }],
            "logs": [chunk(old, "hello\n"), chunk(running, "still\n")],
        }),
    )
    .await;
    let read = |jobs: &JobService, id: u64| {
        let jobs = jobs.clone();
        async move {
            jobs.run(move |c, _| c.log_source(id, LogStream::Stdout, None, None))
                .await
                .map(|s| s.read(0, LOG_PAGE).expect("read").data)
        }
    };
    assert_eq!(read(&jobs, old).await.expect("kept"), b"hello\n");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let ticker = tokio::spawn(jobs.clone().run_ticker(async {
        let _ = stopped.await;
    }));
    // 29 days on: within the retention, the output stays.
    let keep_running = |jobs: &JobService| {
        sync_now(
            jobs,
            json!({ "running": [{ "job": running, "attempt": 1 }] }),
        )
    };
    clock.advance(29 * 86_400 * SECOND);
    keep_running(&jobs).await;
    let recent = submit_now(&jobs).await;
    tokio::time::sleep(crate::OUTPUT_EXPIRY_PERIOD + Duration::from_secs(1)).await;
    assert_eq!(read(&jobs, old).await.expect("kept"), b"hello\n");
    // The third job runs and ends now, with output of its own.
    assert_eq!(sync_now(&jobs, json!({})).await.start.len(), 1);
    sync_now(
        &jobs,
        json!({
            "running": [{ "job": running, "attempt": 1 }],
            "exited": [{ "job": recent, "attempt": 1, "code": 0 }],
            "logs": [chunk(recent, "fresh\n")],
        }),
    )
    .await;
    // Past 30 days after the first job ended: its output is deleted at the next check.
    clock.advance(2 * 86_400 * SECOND);
    keep_running(&jobs).await;
    tokio::time::sleep(crate::OUTPUT_EXPIRY_PERIOD + Duration::from_secs(1)).await;
    let logs = dir.path().join("logs");
    assert!(
        !logs.join(old.to_string()).exists(),
        "the directory is gone"
    );
    match read(&jobs, old).await {
        Err(e @ ControlError::OutputDeleted { days: 31, .. }) => {
            let says = e.to_string();
            assert!(says.contains("server.job_output_days"), "{says}");
        }
        other => panic!("expected output_deleted, got {other:?}"),
    }
    let record = job(&jobs, old).await;
    assert_eq!(record.state, JobState::Completed, "the record stays");
    assert!(record.output_deleted_ms.is_some());
    assert!(
        record
            .timeline
            .iter()
            .any(|t| t.event.contains("output was deleted, 31 days after")),
        "{:?}",
        record.timeline
    );
    assert_eq!(read(&jobs, running).await.expect("running"), b"still\n");
    assert_eq!(read(&jobs, recent).await.expect("recent"), b"fresh\n");
    // Output the agent ships for it now is answered (it may free its disk) and not stored.
    let late = sync_now(&jobs, json!({ "logs": [chunk(old, "late!!\n")] })).await;
    assert_eq!(late.log_offsets, vec![(old, LogStream::Stdout, 7)]);
    assert!(!logs.join(old.to_string()).exists(), "not stored again");
    let _ = stop.send(());
    ticker.await.expect("ticker");
    // A restarted server knows it was deleted.
    drop(jobs);
    let jobs = open();
    assert!(matches!(
        read(&jobs, old).await,
        Err(ControlError::OutputDeleted { .. })
    ));
    assert_eq!(read(&jobs, recent).await.expect("recent"), b"fresh\n");
}

/// A cancel runs no scheduling pass of its own (a pass reaches every pending job, so
/// cancelling 100,000 pending tasks one by one cost minutes of the control plane): the
/// ticker's next pass, within a second, gives a cancelled job's GPU to the next job. And the
/// tasks of an array held on another job's success are handed to the scheduler together when
/// it succeeds, and start in one pass.
#[tokio::test]
async fn a_cancelled_jobs_gpu_goes_to_the_next_job_at_the_next_tick() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    sync(&jobs, "a", T0, &[], &[]).await;
    let first = submit(&jobs, json!({ "command": ["train"], "user": "bob" }), T0).await;
    let array = json!({ "command": ["eval"], "user": "bob", "array": 3, "after_ok": [first] });
    let held = submit(&jobs, array, T0).await;
    let second = submit(&jobs, json!({ "command": ["train"], "user": "bob" }), T0).await;
    assert_eq!(sync(&jobs, "a", T0 + SECOND, &[], &[]).await.start.len(), 1);
    jobs.run(move |c, _| c.cancel(second, "bob", T0 + 2 * SECOND))
        .await
        .expect("cancel the pending one");
    assert_eq!(job(&jobs, second).await.state, JobState::Cancelled);
    // The running one: cancelled at once, its GPU handed on by the next tick's pass.
    jobs.run(move |c, _| c.cancel(first, "bob", T0 + 3 * SECOND))
        .await
        .expect("cancel the running one");
    assert_eq!(job(&jobs, first).await.state, JobState::Cancelled);
    // Its array, held on its success, can never run now.
    for task in held..held + 3 {
        assert_eq!(job(&jobs, task).await.state, JobState::Cancelled);
    }
    let again = submit(
        &jobs,
        json!({ "command": ["train"], "user": "bob" }),
        T0 + 4 * SECOND,
    )
    .await;
    let r = sync(&jobs, "a", T0 + 4 * SECOND, &[], &[(first, 1, 143)]).await;
    assert_eq!(
        r.start.iter().map(|s| s.job).collect::<Vec<_>>(),
        vec![again],
        "the submission's own pass starts it"
    );
    // Three tasks held on a job that succeeds start together on a node of three GPUs.
    sync_with(&jobs, "b", T0 + 5 * SECOND, &[], &[], json!({ "gpus": 3 })).await;
    let gate = submit(
        &jobs,
        json!({ "command": ["prep"], "user": "bob" }),
        T0 + 5 * SECOND,
    )
    .await;
    let array = json!({ "command": ["eval"], "user": "bob", "array": 3, "after_ok": [gate] });
    let tasks = submit(&jobs, array, T0 + 5 * SECOND).await;
    let on_b = sync_with(&jobs, "b", T0 + 6 * SECOND, &[], &[], json!({ "gpus": 3 })).await;
    assert_eq!(
        on_b.start.iter().map(|s| s.job).collect::<Vec<_>>(),
        vec![gate]
    );
    sync_with(
        &jobs,
        "b",
        T0 + 7 * SECOND,
        &[],
        &[(gate, 1, 0)],
        json!({ "gpus": 3 }),
    )
    .await;
    let on_b = sync_with(&jobs, "b", T0 + 8 * SECOND, &[], &[], json!({ "gpus": 3 })).await;
    assert_eq!(
        on_b.start.iter().map(|s| s.job).collect::<Vec<_>>(),
        (tasks..tasks + 3).collect::<Vec<_>>()
    );
    // A running job cancelled with a pending one behind it: the tick hands its GPU on.
    let waiting = submit(
        &jobs,
        json!({ "command": ["train"], "user": "bob" }),
        T0 + 9 * SECOND,
    )
    .await;
    assert_eq!(job(&jobs, waiting).await.state, JobState::Pending);
    jobs.run(move |c, _| c.cancel(again, "bob", T0 + 10 * SECOND))
        .await
        .expect("cancel");
    sync(&jobs, "a", T0 + 10 * SECOND, &[], &[(again, 1, 143)]).await;
    assert_eq!(job(&jobs, waiting).await.state, JobState::Pending);
    tick(&jobs, T0 + 11 * SECOND).await;
    let r = sync(&jobs, "a", T0 + 11 * SECOND, &[], &[]).await;
    assert_eq!(
        r.start.iter().map(|s| s.job).collect::<Vec<_>>(),
        vec![waiting]
    );
}

/// A backlog of expired output (a server upgraded with years of it) is worked off at most
/// `EXPIRED_PER_CHECK` jobs a check, so no check holds the control lock for all of it; a job
/// marked before whose directory is still there is removed again without counting.
#[tokio::test]
async fn expired_output_is_worked_off_a_bounded_number_of_jobs_a_check() {
    use super::logs::EXPIRED_PER_CHECK;
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    let count = EXPIRED_PER_CHECK as u64 + 1;
    let first = submit(
        &jobs,
        json!({ "command": ["train"], "user": "bob", "array": count }),
        T0,
    )
    .await;
    let ids: Vec<u64> = (first..first + count).collect();
    for &id in &ids {
        jobs.run(move |c, _| c.cancel(id, "bob", T0 + SECOND))
            .await
            .expect("cancel");
    }
    let later = T0 + 31 * 86_400 * SECOND;
    let check = |ids: Vec<u64>| {
        let jobs = jobs.clone();
        async move {
            jobs.run(move |c, _| Ok(c.expire_output(later, &ids)))
                .await
                .expect("expire")
        }
    };
    assert_eq!(check(ids.clone()).await.len(), EXPIRED_PER_CHECK);
    assert!(job(&jobs, ids[0]).await.output_deleted_ms.is_some());
    assert!(
        job(&jobs, ids[ids.len() - 1])
            .await
            .output_deleted_ms
            .is_none()
    );
    // The first check's directories still there (say their removal failed): removed again,
    // and the last job is marked now.
    assert_eq!(check(ids.clone()).await.len(), ids.len());
    assert!(
        job(&jobs, ids[ids.len() - 1])
            .await
            .output_deleted_ms
            .is_some()
    );
}

fn identity(user: &str, role: perch_model::identity::Role) -> perch_model::identity::Identity {
    perch_model::identity::Identity {
        user: user.into(),
        role,
        nodes: None,
        job: None,
    }
}

fn selection(value: serde_json::Value) -> crate::CancelSelection {
    let state = value["state"]
        .as_str()
        .map(|s| JobState::parse(s).expect("state"));
    crate::CancelSelection {
        ids: serde_json::from_value(value["ids"].clone()).unwrap_or_default(),
        array: value["array"].as_u64(),
        user: value["user"].as_str().map(str::to_owned),
        account: value["account"].as_str().map(str::to_owned),
        name: value["name"].as_str().map(str::to_owned),
        state,
    }
}

/// A batch cancel (`POST /v1/jobs/cancel`): a whole array in one request by its owner, with
/// its pending tasks cancelled before its running ones; another user's ids reported, not
/// cancelled; filters that name nothing, or everyone's jobs, refused.
#[tokio::test]
async fn a_whole_array_is_cancelled_at_once_by_its_owner_and_by_no_one_else() {
    use perch_model::identity::Role;
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = perch_model::clock::Clock::manual(T0);
    let jobs = service_on(dir.path(), &clock);
    sync_with(&jobs, "a", T0, &[], &[], json!({ "gpus": 2 })).await;
    let sweep = json!({ "command": ["eval"], "user": "bob", "array": 5, "name": "sweep" });
    let first = submit(&jobs, sweep, T0).await;
    let mine = submit(&jobs, json!({ "command": ["x"], "user": "alice" }), T0).await;
    let lone = json!({ "command": ["x"], "user": "bob", "name": "sweep[7]" });
    let lone = submit(&jobs, lone, T0).await;
    let r = sync_with(&jobs, "a", T0 + SECOND, &[], &[], json!({ "gpus": 2 })).await;
    let running: Vec<u64> = r.start.iter().map(|s| s.job).collect();
    assert_eq!(running, vec![first, first + 1]);
    clock.set(T0 + 2 * SECOND);
    let (alice, bob) = (identity("alice", Role::User), identity("bob", Role::User));
    let ops = identity("ops", Role::Operator);
    let cancel = |sel: serde_json::Value, who: &perch_model::identity::Identity| {
        jobs.cancel_many(selection(sel), who.clone())
    };

    // Alice names bob's array, then some of its tasks among her own job and a missing one.
    let refused = cancel(json!({ "array": first }), &alice)
        .await
        .expect_err("alice may not cancel bob's array");
    assert!(matches!(refused, ControlError::Forbidden(_)), "{refused:?}");
    let out = cancel(json!({ "ids": [9999, first + 1, mine, first] }), &alice)
        .await
        .expect("ids");
    assert_eq!(out.cancelled, vec![mine]);
    let forbidden: Vec<(u64, &str)> = out
        .forbidden
        .iter()
        .map(|f| (f.id, f.user.as_str()))
        .collect();
    assert_eq!(forbidden, vec![(first, "bob"), (first + 1, "bob")]);
    assert_eq!(out.not_found, vec![9999]);
    let again = cancel(json!({ "ids": [mine, mine] }), &alice)
        .await
        .expect("ids");
    assert_eq!(again.already_ended.len(), 1, "{again:?}");
    assert_eq!(again.already_ended[0].state, "cancelled");
    assert_eq!(job(&jobs, first).await.state, JobState::Running);

    // Selections that name nothing, or every user's jobs, or mix ids and filters.
    for (sel, who) in [
        (json!({}), &bob),
        (json!({ "state": "pending" }), &ops),
        (json!({ "name": "sweep" }), &ops),
        (json!({ "ids": [first], "name": "sweep" }), &bob),
        (json!({ "state": "completed" }), &bob),
        (json!({ "user": "bob" }), &alice),
        (json!({ "array": mine }), &alice),
        (json!({ "array": first + 1 }), &bob),
    ] {
        let e = cancel(sel.clone(), who).await.expect_err("refused");
        // The caller's to change (an answer in 4xx), not the server failing.
        assert!(
            matches!(
                e,
                ControlError::BadRequest(_)
                    | ControlError::Forbidden(_)
                    | ControlError::NoSuchJob(_)
                    | ControlError::NoSuchArray(_)
                    | ControlError::AlreadyEnded { .. }
            ),
            "{sel} by {}: {e:?}",
            who.user
        );
    }
    assert_eq!(job(&jobs, first + 2).await.state, JobState::Pending);

    // Bob's array: pending tasks first, so no pass between two steps starts one of them on
    // the GPUs its running tasks just gave up.
    let sel = selection(json!({ "array": first }));
    let order = jobs
        .run(move |c, _| c.cancel_targets(&sel, &identity("bob", Role::User)))
        .await
        .expect("targets");
    assert_eq!(
        order,
        vec![first + 2, first + 3, first + 4, first, first + 1]
    );
    let out = cancel(json!({ "array": first }), &bob)
        .await
        .expect("array");
    assert_eq!(out.cancelled, (first..first + 5).collect::<Vec<_>>());
    assert!(out.forbidden.is_empty() && out.not_found.is_empty());
    for id in first..first + 5 {
        let j = job(&jobs, id).await;
        assert_eq!(j.state, JobState::Cancelled);
        assert_eq!(j.end_ms, Some(T0 + 2 * SECOND));
    }
    assert_eq!(
        job(&jobs, lone).await.state,
        JobState::Pending,
        "not a task"
    );
    let r = sync_with(
        &jobs,
        "a",
        T0 + 3 * SECOND,
        &[(first, 1), (first + 1, 1)],
        &[],
        json!({ "gpus": 2 }),
    )
    .await;
    let mut stopped: Vec<u64> = r.stop.iter().map(|s| s.job).collect();
    stopped.sort_unstable();
    assert_eq!(stopped, vec![first, first + 1]);
    assert!(r.start.is_empty(), "{:?}", r.start);
    // At the next tick the lone job gets a GPU they gave up; no task of the array does.
    tick(&jobs, T0 + 3 * SECOND).await;
    let r = sync_with(&jobs, "a", T0 + 4 * SECOND, &[], &[], json!({ "gpus": 2 })).await;
    assert_eq!(
        r.start.iter().map(|s| s.job).collect::<Vec<_>>(),
        vec![lone]
    );

    // By name: an array's tasks answer to their array's name, a lone job to its own.
    let more = json!({ "command": ["eval"], "user": "bob", "array": 2, "name": "sweep" });
    let more = submit(&jobs, more, T0 + 3 * SECOND).await;
    let out = cancel(json!({ "name": "sweep" }), &bob)
        .await
        .expect("name");
    assert_eq!(out.cancelled, vec![more, more + 1]);
    let out = cancel(json!({ "name": "sweep[7]", "state": "running" }), &bob)
        .await
        .expect("name and state");
    assert_eq!(out.cancelled, vec![lone]);
    // An operator cancels another user's jobs by naming the user.
    let theirs = submit(&jobs, json!({ "command": ["x"], "user": "carol" }), T0).await;
    let out = cancel(json!({ "user": "carol" }), &ops)
        .await
        .expect("operator");
    assert_eq!(out.cancelled, vec![theirs]);
}

/// A batch cancel larger than a step ([`crate::CANCEL_STEP`]) is worked through step by
/// step and cancels every task, and the user's pending count comes back to zero.
#[tokio::test]
async fn an_array_larger_than_a_step_is_cancelled_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    let n = crate::CANCEL_STEP as u64 * 2 + 500;
    let array = json!({ "command": ["eval"], "user": "bob", "array": n });
    let first = submit(&jobs, array, T0).await;
    let bob = identity("bob", perch_model::identity::Role::User);
    let out = jobs
        .cancel_many(selection(json!({ "array": first })), bob)
        .await
        .expect("cancel");
    assert_eq!(out.cancelled, (first..first + n).collect::<Vec<_>>());
    let left = jobs
        .list_jobs(u64::MAX, usize::MAX, |j| j.state == JobState::Pending)
        .expect("list")
        .0
        .len();
    assert_eq!(left, 0);
    let pending = jobs
        .run(|c, _| Ok(c.pending.of("bob")))
        .await
        .expect("count");
    assert_eq!(pending, super::Held::default());
}

/// A job store that keeps, for each commit, the weight of the job records it writes
/// ([`JobRecord::weight`]).
struct Weighing {
    inner: crate::db::RedbStore,
    commits: std::sync::Mutex<Vec<usize>>,
}

impl crate::JobStore for Weighing {
    fn load(&self) -> Result<crate::db::Loaded, crate::db::DbError> {
        self.inner.load()
    }
    fn for_each_job(&self, visit: &mut dyn FnMut(JobRecord)) -> Result<(), crate::db::DbError> {
        self.inner.for_each_job(visit)
    }
    fn get(&self, ids: &[u64]) -> Result<Vec<JobRecord>, crate::db::DbError> {
        self.inner.get(ids)
    }
    fn save(&self, dirty: &crate::db::Dirty) -> Result<(), crate::db::DbError> {
        let weight = dirty.jobs.iter().map(JobRecord::weight).sum();
        self.commits.lock().expect("commits").push(weight);
        self.inner.save(dirty)
    }
    fn reopen(&self) -> Result<(), crate::db::DbError> {
        self.inner.reopen()
    }
    fn provenance(
        &self,
        id: u64,
    ) -> Result<Option<crate::provenance::ProvenanceRecord>, crate::db::DbError> {
        self.inner.provenance(id)
    }
    fn for_each_provenance(
        &self,
        ids: std::ops::RangeInclusive<u64>,
        visit: &mut dyn FnMut(crate::provenance::ProvenanceRecord) -> bool,
    ) -> Result<(), crate::db::DbError> {
        self.inner.for_each_provenance(ids, visit)
    }
}

/// An agent's sync waits for at most one step of an array or a batch cancel, so no step may
/// write more than [`crate::STEP_BYTES`] of job records, however large each job is: a
/// submission of the most bytes one may make (256 tasks with 64,000 bytes of environment
/// each), and its cancel, were one commit of 16 MiB each, and held syncs for 1.5 s in a
/// debug build. Every task is still added, and cancelled.
#[tokio::test]
async fn no_step_of_a_large_array_or_its_cancel_commits_more_than_step_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = std::sync::Arc::new(Weighing {
        inner: crate::db::RedbStore::open(&dir.path().join("jobs.redb")).expect("store"),
        commits: Default::default(),
    });
    let (tx, _rx) = JobService::event_channel();
    let jobs = JobService::open(
        dir.path(),
        JobsConfig::default(),
        tx,
        store.clone(),
        std::sync::Arc::new(crate::store::NoSettledRecords),
        Vec::new(),
    )
    .expect("jobs");
    let heaviest = |store: &Weighing| {
        let mut commits = store.commits.lock().expect("commits");
        let heaviest = commits.iter().copied().max().unwrap_or(0);
        let count = commits.len();
        commits.clear();
        (heaviest, count)
    };
    let n = 256;
    let array = json!({
        "command": ["eval"], "user": "bob", "array": n, "hold_until_fits": true,
        "env": { "PAYLOAD": "x".repeat(65_000) },
    });
    let request: crate::spec::JobRequest = serde_json::from_value(array).expect("request");
    let (first, ids, _) = jobs.submit(request, false).await.expect("submit");
    assert_eq!(ids.len(), n);
    let first = first.id;
    let (weight, commits) = heaviest(&store);
    assert!(
        weight <= crate::STEP_BYTES,
        "a step of the array committed {weight} bytes of jobs"
    );
    assert!(commits > 1, "{commits} commits");
    let all = jobs
        .list_jobs(u64::MAX, usize::MAX, |j| j.state == JobState::Pending)
        .expect("list")
        .0;
    assert_eq!(all.len(), n);
    let bob = identity("bob", perch_model::identity::Role::User);
    let out = jobs
        .cancel_many(selection(json!({ "array": first })), bob)
        .await
        .expect("cancel");
    assert_eq!(out.cancelled.len(), n);
    let (weight, _) = heaviest(&store);
    assert!(
        weight <= crate::STEP_BYTES,
        "a step of the cancel committed {weight} bytes of jobs"
    );
}

/// An exit sent again (its acknowledgement lost, or the agent restarted before it came) is
/// acknowledged again and taken once: one note in the job's timeline, whether the exit ended
/// the job or came after a cancel had.
#[tokio::test]
async fn an_exit_sent_again_is_acknowledged_and_noted_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    sync_with(&jobs, "a", T0, &[], &[], json!({ "gpus": 2 })).await;
    let done = submit(&jobs, json!({ "command": ["x"], "user": "bob" }), T0).await;
    let cancelled = submit(&jobs, json!({ "command": ["x"], "user": "bob" }), T0).await;
    let r = sync_with(&jobs, "a", T0 + SECOND, &[], &[], json!({ "gpus": 2 })).await;
    assert_eq!(r.start.len(), 2);
    jobs.run(move |c, _| c.cancel(cancelled, "bob", T0 + 2 * SECOND))
        .await
        .expect("cancel");
    let exits = [(done, 1, 0), (cancelled, 1, 143)];
    for at in [3, 4, 5] {
        let r = sync_with(
            &jobs,
            "a",
            T0 + at * SECOND,
            &[],
            &exits,
            json!({ "gpus": 2 }),
        )
        .await;
        assert_eq!(r.acknowledged.len(), 2, "acknowledged every time");
    }
    let exit_notes = |j: &JobRecord| {
        j.timeline
            .iter()
            .filter(|e| e.event.contains("with code"))
            .map(|e| e.event.clone())
            .collect::<Vec<_>>()
    };
    let j = job(&jobs, done).await;
    assert_eq!(j.state, JobState::Completed);
    assert_eq!(exit_notes(&j), vec!["exited with code 0 on a"]);
    let j = job(&jobs, cancelled).await;
    assert_eq!(j.state, JobState::Cancelled);
    assert_eq!(exit_notes(&j), vec!["attempt 1 ended on a with code 143"]);
}

/// An operation that changes nothing, a view or an agent's sync, can read another
/// operation's changes after they are queued and before they are committed (that one's
/// thread between the control lock and the commit). Its answer waits until they are durable:
/// a job shown to a user, or a launch handed to an agent, is never lost by a crash after.
#[tokio::test]
async fn no_answer_shows_a_change_a_crash_could_still_lose() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A submission whose thread has queued its changes and not yet waited for their commit.
    let queued_not_waited = |jobs: &JobService, at: i64| {
        let request: crate::spec::JobRequest =
            serde_json::from_value(json!({ "command": ["x"], "user": "bob" })).expect("request");
        let mut c = jobs.control.lock();
        let id = c.submit(request, at).expect("submit")[0].id;
        jobs.commits.queue(c.take_dirty());
        id
    };
    let shown = {
        let jobs = service(dir.path());
        sync(&jobs, "a", T0, &[], &[]).await;
        let id = queued_not_waited(&jobs, T0);
        assert_eq!(job(&jobs, id).await.id, id, "a view shows the job");
        id
    };
    // The server dies now, with no commit after the answer: reopened, the job database has
    // the job the answer showed.
    let jobs = service(dir.path());
    assert_eq!(job(&jobs, shown).await.id, shown);
    // The submission's pass placed the next job: the agent's sync hands out its launch.
    let launched = {
        let id = queued_not_waited(&jobs, T0 + SECOND);
        let r = sync(&jobs, "a", T0 + 2 * SECOND, &[], &[]).await;
        assert_eq!(r.start.len(), 1);
        assert_eq!((r.start[0].job, r.start[0].attempt), (shown, 1));
        id
    };
    drop(jobs);
    let jobs = service(dir.path());
    let j = job(&jobs, shown).await;
    assert_eq!((j.state, j.attempts), (JobState::Running, 1), "{j:?}");
    assert_eq!(job(&jobs, launched).await.state, JobState::Pending);
}

/// `GET /v1/jobs` pages: the newest first, at most `limit` a page, read a chunk of the
/// history at a time, each job on exactly one page, and a filter few jobs match still finds
/// them across chunks.
#[tokio::test]
async fn a_listing_pages_through_the_history_newest_first() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    let alice_first = submit(&jobs, json!({ "command": ["x"], "user": "alice" }), T0).await;
    let n = crate::SCAN_CHUNK as u64 * 2 + 700;
    let array = json!({ "command": ["x"], "user": "bob", "array": n });
    let first = submit(&jobs, array, T0).await;
    let alice_last = submit(&jobs, json!({ "command": ["x"], "user": "alice" }), T0).await;
    let (mut seen, mut before, mut pages) = (Vec::new(), u64::MAX, 0);
    loop {
        let (page, next) = jobs.list_jobs(before, 1_500, |_| true).expect("list");
        assert!(page.len() <= 1_500);
        seen.extend(page.iter().map(|j| j.id));
        pages += 1;
        match next {
            Some(next) => before = next,
            None => break,
        }
    }
    let all: Vec<u64> = (alice_first..=alice_last).rev().collect();
    assert_eq!(seen, all, "every job once, newest first");
    assert_eq!(pages, all.len().div_ceil(1_500));
    assert_eq!(all.len() as u64, n + 2);
    let (alice, next) = jobs
        .list_jobs(u64::MAX, 1_000, |j| j.user == "alice")
        .expect("list");
    let ids: Vec<u64> = alice.iter().map(|j| j.id).collect();
    assert_eq!((ids, next), (vec![alice_last, alice_first], None));
    let (one, next) = jobs
        .list_jobs(u64::MAX, 1, |j| j.user == "bob")
        .expect("list");
    assert_eq!(one[0].id, first + n - 1);
    assert_eq!(next, Some(first + n - 1));
    // A pending job's reason is filled in, as `perch show` has it.
    assert!(one[0].reason.is_some(), "{:?}", one[0].reason);
}

/// A page also ends at [`crate::MAX_PAGE_BYTES`] of jobs: 10,000 jobs with a 64 KiB
/// environment each would be 640 MB in one answer.
#[tokio::test]
async fn a_page_of_large_jobs_ends_at_the_byte_limit_and_the_next_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    let value = "v".repeat(60 << 10);
    for at in 0..3 {
        let array = json!({ "command": ["x"], "user": "bob", "array": 250, "env": { "A": value } });
        submit(&jobs, array, T0 + at).await;
    }
    let (first, next) = jobs.list_jobs(u64::MAX, 10_000, |_| true).expect("list");
    let bytes: usize = first.iter().map(JobRecord::weight).sum();
    assert!(first.len() < 750, "{}", first.len());
    assert!((crate::MAX_PAGE_BYTES..crate::MAX_PAGE_BYTES + (62 << 10)).contains(&bytes));
    let next = next.expect("a next page");
    assert_eq!(next, first.last().expect("a job").id);
    let (rest, end) = jobs.list_jobs(next, 10_000, |_| true).expect("list");
    assert_eq!((first.len() + rest.len(), end), (750, None));
    let (queue, total) = jobs.queue_page(10_000).expect("queue");
    assert_eq!((queue.len(), total), (first.len(), 750));
}

/// Pages made and not yet read hold their memory until their clients have read them: a client
/// reading slowly on each of many connections held a page on each. Past a user's share
/// ([`crate::USER_PAGES_IN_FLIGHT_BYTES`]) that user's listings wait, then are refused
/// with 503 saying why, and other users' are not; past the whole
/// ([`crate::PAGES_IN_FLIGHT_BYTES`]) everyone's are. A page read to its end, or whose
/// client went away, gives its room back.
#[tokio::test(start_paused = true)]
async fn pages_not_yet_read_hold_their_room_until_read_or_dropped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = service(dir.path());
    let page = 20 << 20;
    // A page is made only where the largest page fits beside those in flight.
    let fit = |limit: usize| (limit - crate::PAGE_RESERVE) / page + 1;
    let list = |user: &str| {
        let user = user.to_owned();
        let jobs = jobs.clone();
        async move {
            jobs.listing(&user, move |_| Ok::<_, ControlError>(vec![b' '; page]))
                .await
        }
    };
    let share = fit(crate::USER_PAGES_IN_FLIGHT_BYTES);
    let mut held = Vec::new();
    for _ in 0..share {
        held.push(list("mallory").await.expect("room in mallory's share"));
    }
    let refused = list("mallory").await.expect_err("mallory's share is full");
    assert!(
        matches!(refused, ControlError::ListingBusy(_)),
        "{refused:?}"
    );
    assert!(
        refused
            .to_string()
            .contains("your job listings not yet read by their clients hold 64 MiB"),
        "{refused}"
    );
    // Others still list, until the whole is taken.
    let users = ["a", "b", "c", "d", "e", "f", "g"];
    let whole = fit(crate::PAGES_IN_FLIGHT_BYTES);
    for user in users.iter().cycle().take(whole - share) {
        held.push(list(user).await.expect("room in the whole"));
    }
    let refused = list("h").await.expect_err("the whole is full");
    assert!(
        refused
            .to_string()
            .starts_with("job listings not yet read by their clients hold 256 MiB"),
        "{refused}"
    );
    // A client that reads its page to the end gives its room back.
    let pieces: Vec<_> =
        futures::StreamExt::collect(held.pop().expect("a page").into_stream()).await;
    let read: usize = pieces
        .iter()
        .map(|p| p.as_ref().map_or(0, |b| b.len()))
        .sum();
    assert_eq!(read, page);
    held.push(list("h").await.expect("room after a page was read"));
    // So do clients that go away: mallory's two.
    held.drain(..share);
    held.push(
        list("mallory")
            .await
            .expect("room after the clients went away"),
    );
}

/// Ten minutes after its end a settled job's record leaves memory ([`ARCHIVE_AFTER_MS`]):
/// a server kept every record whole for ever (about 7 KB a job). Everything that reads jobs
/// sees the same after as before (views, pages, scans for SQL, usage on `/metrics`, fair share,
/// job counts, logs), late output is still stored, ownership, cancels, arrays and dependencies
/// still know the job, and output expiry and a restart keep it all so.
///
/// [`ARCHIVE_AFTER_MS`]: crate::record::ARCHIVE_AFTER_MS
#[tokio::test]
async fn settled_jobs_leave_memory_and_read_back_as_they_were() {
    use crate::CancelSelection;
    use crate::usage::GpuUsage;
    use perch_model::control::LogStream;
    use perch_model::identity::Role;
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = perch_model::clock::Clock::manual(T0);
    let jobs = service_on(dir.path(), &clock);
    let at = |s: i64| T0 + s * SECOND;
    let req = |user: &str| json!({ "command": ["train"], "user": user, "gpus_per_node": 1 });
    sync(&jobs, "a", at(0), &[], &[]).await;
    let done = submit(&jobs, req("bob"), at(1)).await;
    let failed = submit(&jobs, req("alice"), at(1)).await;
    let mut array = req("alice");
    array["array"] = json!(2);
    array["name"] = json!("sweep");
    let first_task = submit(&jobs, array, at(1)).await;
    let ended = [done, failed, first_task, first_task + 1];
    // One GPU: each job starts at one sync and exits, with its output, at the next.
    let mut running: Vec<(u64, u32)> = Vec::new();
    for s in 2..12 {
        let exited: Vec<(u64, u32, i32)> = running
            .iter()
            .map(|&(j, a)| (j, a, i32::from(j == failed)))
            .collect();
        let logs: Vec<_> = running
            .iter()
            .map(|&(j, a)| json!({ "job": j, "attempt": a, "stream": "stdout", "offset": 0, "data": format!("out {j}\n") }))
            .collect();
        let r = sync_with(&jobs, "a", at(s), &[], &exited, json!({ "logs": logs })).await;
        running = r.start.iter().map(|l| (l.job, l.attempt)).collect();
        tick(&jobs, at(s)).await;
    }
    for id in ended {
        assert!(job(&jobs, id).await.state.is_final(), "job {id} ended");
    }
    // Accounting folds every allocation to its end: nothing is left to change.
    let usage = GpuUsage {
        samples: 5,
        util_samples: 5,
        util_sum: 400.0,
        util_max: Some(90.0),
        memory_max_bytes: Some(1 << 30),
        energy_min_joules: Some(10.0),
        energy_max_joules: Some(510.0),
        power_samples: 5,
        power_sum_watts: 1000.0,
        ..GpuUsage::default()
    };
    jobs.fold_all(at(60), usage).await;
    let prices = crate::cost::Prices {
        energy_per_kwh: 0.3,
        ..Default::default()
    };
    // Everything that reads jobs, as it reads them.
    let seen = |jobs: &JobService| {
        let (jobs, prices) = (jobs.clone(), prices.clone());
        async move {
            let mut views = Vec::new();
            for id in ended {
                views.push(job(&jobs, id).await);
            }
            let (page, next) = jobs.list_jobs(u64::MAX, 3, |_| true).expect("page");
            let (rest, _) = jobs
                .list_jobs(next.expect("more"), 10, |_| true)
                .expect("page");
            let mut scanned = Vec::new();
            jobs.scan_jobs(|j| scanned.push(j.clone())).expect("scan");
            let mut usage = jobs.usage(&prices);
            usage.sort_by(|a, b| (&a.account, &a.user).cmp(&(&b.account, &b.user)));
            let (fair, counts) = jobs
                .run(|c, now| Ok((c.decayed_usage(now), c.snapshot(now).jobs_by_state)))
                .await
                .expect("read");
            (views, page, rest, scanned, usage, fair, counts)
        }
    };
    let later = at(12) + 11 * 60 * SECOND;
    clock.set(later);
    let before = seen(&jobs).await;
    assert_eq!(jobs.read(|c| c.settled_count()), 0);
    // Found settled at one tick, out of memory at the next (once durable).
    jobs.tick().await.expect("tick");
    assert_eq!(jobs.read(|c| c.settled_count()), 0, "marked, not yet moved");
    jobs.tick().await.expect("tick");
    assert_eq!(jobs.read(|c| c.settled_count()), ended.len());
    let after = seen(&jobs).await;
    assert_eq!(before.0, after.0, "views");
    assert_eq!((&before.1, &before.2), (&after.1, &after.2), "pages");
    assert_eq!(before.3, after.3, "scans");
    assert_eq!(before.6, after.6, "counts by state");
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
    assert_eq!(before.4.len(), after.4.len());
    for (b, a) in before.4.iter().zip(&after.4) {
        assert_eq!((&b.account, &b.user), (&a.account, &a.user));
        assert!(
            close(b.gpu_seconds_allocated, a.gpu_seconds_allocated),
            "{b:?} {a:?}"
        );
        assert!(close(b.gpu_seconds_used, a.gpu_seconds_used), "{b:?} {a:?}");
        assert!(close(b.cost_allocated, a.cost_allocated), "{b:?} {a:?}");
        assert!(close(b.cost_used, a.cost_used), "{b:?} {a:?}");
        assert!(
            close(b.gpu_seconds_accounted, a.gpu_seconds_accounted),
            "{b:?} {a:?}"
        );
        assert!(close(b.cost_accounted, a.cost_accounted), "{b:?} {a:?}");
        assert!(close(b.cost_idle(), a.cost_idle()), "{b:?} {a:?}");
        assert!(b.gpu_seconds_used > 0.0 && b.cost_used > 0.0);
    }
    assert_eq!(
        before.5.keys().collect::<Vec<_>>(),
        after.5.keys().collect::<Vec<_>>()
    );
    for (account, v) in &before.5 {
        assert!(close(*v, after.5[account]), "fair share of {account}");
    }
    // Ownership, cancels and arrays know a settled job.
    let (bob, alice) = (identity("bob", Role::User), identity("alice", Role::User));
    let refused = jobs
        .run(move |c, now| c.cancel(done, "bob", now).map(|_| ()))
        .await;
    assert!(
        matches!(refused, Err(ControlError::AlreadyEnded { .. })),
        "{refused:?}"
    );
    let a = alice.clone();
    let forbidden = jobs.run(move |c, _| c.check_owner(done, &a)).await;
    assert!(matches!(forbidden, Err(ControlError::Forbidden(_))));
    let (b, a) = (bob.clone(), alice.clone());
    let (mine, theirs) = jobs
        .run(move |c, now| {
            Ok((
                c.cancel_many(&[done], &b, now)?,
                c.cancel_many(&[done], &a, now)?,
            ))
        })
        .await
        .expect("cancel");
    assert_eq!((mine.already_ended.len(), theirs.forbidden.len()), (1, 1));
    let sweep = CancelSelection {
        array: Some(first_task),
        ..CancelSelection::default()
    };
    let targets = jobs
        .run(move |c, _| c.cancel_targets(&sweep, &alice))
        .await
        .expect("a settled first task still names its array");
    assert!(targets.is_empty());
    // Dependencies on settled jobs.
    let mut after_ok = req("bob");
    after_ok["after_ok"] = json!([done]);
    let waits = submit(&jobs, after_ok, later).await;
    let mut never = req("bob");
    never["after_ok"] = json!([failed]);
    let never = submit(&jobs, never, later).await;
    let w = job(&jobs, waits).await;
    assert_eq!(w.state, JobState::Pending);
    assert!(!w.reason.unwrap_or_default().contains("dependencies"));
    let n = job(&jobs, never).await;
    assert_eq!(n.state, JobState::Cancelled);
    assert!(
        n.reason
            .unwrap_or_default()
            .contains(&format!("job {failed} ended failed"))
    );
    // Logs of a settled job, and output that comes late.
    let read = |jobs: &JobService, id: u64| {
        let jobs = jobs.clone();
        async move {
            jobs.run(move |c, _| c.log_source(id, LogStream::Stdout, None, None))
                .await
                .map(|s| s.read(0, LOG_PAGE).expect("read").data)
        }
    };
    let out = format!("out {done}\n");
    assert_eq!(read(&jobs, done).await.expect("logs"), out.as_bytes());
    let late = json!({ "logs": [{ "job": done, "attempt": 1, "stream": "stdout", "offset": out.len(), "data": "late\n" }] });
    sync_with(&jobs, "a", later, &[], &[], late).await;
    assert_eq!(
        read(&jobs, done).await.expect("logs"),
        format!("{out}late\n").as_bytes()
    );
    // Thirty-one days on, its output is deleted; the record says so, after a restart too.
    clock.set(later + 31 * 86_400 * SECOND);
    assert!(jobs.expire_output().await.expect("expiry") >= ended.len());
    let deleted = read(&jobs, done).await;
    assert!(
        matches!(deleted, Err(ControlError::OutputDeleted { .. })),
        "{deleted:?}"
    );
    let mut views = Vec::new();
    for id in ended {
        views.push(job(&jobs, id).await);
    }
    assert!(views.iter().all(|j| {
        j.output_deleted_ms.is_some()
            && j.timeline
                .last()
                .is_some_and(|e| e.event.contains("stored output was deleted"))
    }));
    drop(jobs);
    let jobs = service_on(dir.path(), &clock);
    // The dependent job that could never run has settled too.
    assert_eq!(jobs.read(|c| c.settled_count()), ended.len() + 1);
    for (id, was) in ended.into_iter().zip(views) {
        assert_eq!(job(&jobs, id).await, was, "job {id} after a restart");
    }
    let reopened = seen(&jobs).await;
    assert_eq!(reopened.6, {
        let mut counts = before.6.clone();
        // The job after `done` started at the late sync.
        *counts.get_mut("running").expect("running") += 1;
        *counts.get_mut("cancelled").expect("cancelled") += 1;
        counts
    });
    // alice's jobs have all ended (bob's latest has run for 31 days).
    assert!(reopened.5.contains_key("alice"));
    for (account, v) in reopened.5.iter().filter(|(a, _)| *a == "alice") {
        let expect =
            before.5[account] * (-((31 * 86_400 * SECOND) as f64) / (7.0 * 86_400_000.0)).exp2();
        assert!(
            (v - expect).abs() <= 1e-6 * expect,
            "fair share of {account} decays: {v} {expect}"
        );
    }
}

/// A sync stores the output of at most 64 settled jobs (each record is read back from the job
/// database under the control lock): an agent sending tiny chunks for thousands of old jobs
/// cannot hold the control plane for seconds. What is not acknowledged comes again with the
/// next sync, and is stored then.
#[tokio::test]
async fn a_sync_reads_back_a_bounded_number_of_settled_jobs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = perch_model::clock::Clock::manual(T0);
    let jobs = service_on(dir.path(), &clock);
    let at = |s: i64| T0 + s * SECOND;
    let eight = json!({ "gpus": 8 });
    sync_with(&jobs, "a", at(0), &[], &[], eight.clone()).await;
    let first = submit(
        &jobs,
        json!({ "command": ["x"], "user": "bob", "gpus_per_node": 1, "array": 70 }),
        at(1),
    )
    .await;
    let mut running: Vec<(u64, u32)> = Vec::new();
    for s in 2..40 {
        let exited: Vec<(u64, u32, i32)> = running.iter().map(|&(j, a)| (j, a, 0)).collect();
        let r = sync_with(&jobs, "a", at(s), &[], &exited, eight.clone()).await;
        running = r.start.iter().map(|l| (l.job, l.attempt)).collect();
        tick(&jobs, at(s)).await;
    }
    jobs.fold_all(at(60), Default::default()).await;
    clock.set(at(60) + 11 * 60 * SECOND);
    jobs.tick().await.expect("marked");
    jobs.tick().await.expect("moved");
    assert_eq!(jobs.read(|c| c.settled_count()), 70);
    let chunks = |ids: &[u64]| {
        let logs: Vec<_> = ids
            .iter()
            .map(|j| json!({ "job": j, "attempt": 1, "stream": "stdout", "offset": 0, "data": "late\n" }))
            .collect();
        json!({ "gpus": 8, "logs": logs })
    };
    let all: Vec<u64> = (first..first + 70).collect();
    let r = sync_with(&jobs, "a", clock.now_ms(), &[], &[], chunks(&all)).await;
    let acked: Vec<u64> = r.log_offsets.iter().map(|&(j, _, _)| j).collect();
    assert_eq!(acked.len(), 64);
    assert!(r.log_offsets.iter().all(|&(_, _, offset)| offset == 5));
    let rest: Vec<u64> = all.iter().copied().filter(|j| !acked.contains(j)).collect();
    let r = sync_with(&jobs, "a", clock.now_ms(), &[], &[], chunks(&rest)).await;
    assert_eq!(
        r.log_offsets.len(),
        6,
        "the rest are stored with the next sync"
    );
}
