//! How much of the server's disk stored job output uses, per job, per user and in all, so
//! that `server.max_job_output_mb_per_user` and `server.max_job_output_total_mb` can bound it.
//!
//! Usage is what the files occupy (`st_blocks` × 512), not their length: a sparse copy of a
//! job's output (its holes skipped by the agent, or output refused at a bound) counts only its
//! data. It is found at start by a walk of the logs directory, each job's files charged to the
//! job's user as the control plane knows it (a directory of a job it does not know counts in
//! the total only), then kept up to date by [`Control::store_logs`] as each chunk is written
//! (the files' blocks before and after) and by [`Control::expire_output`] as directories go.
//! Nothing here reads a clock.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// One job's stored output and whose it is.
#[derive(Debug, Clone)]
struct JobUsage {
    user: String,
    bytes: u64,
}

/// Which bound a write would pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// The user's jobs' stored output is at `server.max_job_output_mb_per_user`.
    User { used: u64, limit: u64 },
    /// All stored output is at `server.max_job_output_total_mb`.
    Total { used: u64, limit: u64 },
}

impl Bound {
    /// Why output of `user`'s job was not stored, naming the key to change.
    pub fn why(self, user: &str) -> String {
        let mib = |b: u64| b.div_ceil(1 << 20);
        match self {
            Bound::User { used, limit } => format!(
                "{user}'s jobs' stored output uses {} MiB of the server's disk, and at most {} MiB is kept per user (server.max_job_output_mb_per_user)",
                mib(used),
                mib(limit)
            ),
            Bound::Total { used, limit } => format!(
                "all jobs' stored output uses {} MiB of the server's disk, and at most {} MiB is kept (server.max_job_output_total_mb)",
                mib(used),
                mib(limit)
            ),
        }
    }
}

/// Disk used by stored job output.
#[derive(Debug, Default)]
pub struct OutputUsage {
    jobs: HashMap<u64, JobUsage>,
    users: HashMap<String, u64>,
    total: u64,
    /// Jobs whose output a bound refused and whose timeline says so (once a job, per start).
    noted: HashSet<u64>,
}

/// Bytes a file occupies on disk.
pub fn occupied(m: &std::fs::Metadata) -> u64 {
    m.blocks().saturating_mul(512)
}

impl OutputUsage {
    /// The usage of every job directory under `dir` (`<dir>/<job>/...`), each charged to
    /// `user_of(job)` (`None`: counted in the total only). Links are not followed; what cannot
    /// be read is skipped with a warning.
    pub fn scan(dir: &Path, user_of: impl Fn(u64) -> Option<String>) -> OutputUsage {
        let mut usage = OutputUsage::default();
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return usage,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot measure stored job output; its bounds count from what is stored from now on");
                return usage;
            }
        };
        for entry in entries.flatten() {
            let Some(job) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            let bytes = tree_bytes(&entry.path(), 0);
            let user = user_of(job).unwrap_or_default();
            usage.add(job, &user, bytes);
        }
        usage
    }

    /// Charges `bytes` more to `job` of `user`.
    pub fn add(&mut self, job: u64, user: &str, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let entry = self.jobs.entry(job).or_insert_with(|| JobUsage {
            user: user.to_owned(),
            bytes: 0,
        });
        entry.bytes = entry.bytes.saturating_add(bytes);
        if !entry.user.is_empty() {
            let u = self.users.entry(entry.user.clone()).or_default();
            *u = u.saturating_add(bytes);
        }
        self.total = self.total.saturating_add(bytes);
    }

    /// A file of `job` of `user` went from occupying `before` bytes to `after`.
    pub fn changed(&mut self, job: u64, user: &str, before: u64, after: u64) {
        if after >= before {
            self.add(job, user, after - before);
        } else {
            self.take(job, before - after);
        }
    }

    /// Takes up to `bytes` off `job`'s charge.
    fn take(&mut self, job: u64, bytes: u64) {
        let Some(entry) = self.jobs.get_mut(&job) else {
            return;
        };
        let bytes = bytes.min(entry.bytes);
        entry.bytes -= bytes;
        let user = entry.user.clone();
        if entry.bytes == 0 {
            self.jobs.remove(&job);
        }
        if let Some(u) = self.users.get_mut(&user) {
            *u = u.saturating_sub(bytes);
            if *u == 0 {
                self.users.remove(&user);
            }
        }
        self.total = self.total.saturating_sub(bytes);
    }

    /// `job`'s stored output is being deleted: it counts no more.
    pub fn forget(&mut self, job: u64) {
        self.take(job, u64::MAX);
        self.noted.remove(&job);
    }

    /// Bytes `user`'s jobs' stored output occupies.
    pub fn of_user(&self, user: &str) -> u64 {
        self.users.get(user).copied().unwrap_or(0)
    }

    /// Bytes all stored output occupies.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The bound that `bytes` more of `user`'s output would pass, if any: the total first
    /// (it holds everyone's), then the user's. `None` limits are no bound.
    pub fn check(
        &self,
        user: &str,
        bytes: u64,
        per_user: Option<u64>,
        total: Option<u64>,
    ) -> Option<Bound> {
        if let Some(limit) = total
            && self.total.saturating_add(bytes) > limit
        {
            return Some(Bound::Total {
                used: self.total,
                limit,
            });
        }
        let used = self.of_user(user);
        match per_user {
            Some(limit) if used.saturating_add(bytes) > limit => Some(Bound::User { used, limit }),
            _ => None,
        }
    }

    /// Whether `job`'s timeline is yet to say that its output was refused (true once).
    pub fn first_refusal(&mut self, job: u64) -> bool {
        self.noted.insert(job)
    }
}

/// Bytes the files under `path` occupy (links not followed, at most a few levels deep: a job
/// directory holds attempt directories of files, and older servers' files directly).
fn tree_bytes(path: &Path, depth: usize) -> u64 {
    let Ok(m) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if m.is_file() {
        return occupied(&m);
    }
    if !m.is_dir() || depth > 2 {
        return 0;
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| tree_bytes(&e.path(), depth + 1))
        .fold(0u64, u64::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::LOG_PAGE;
    use crate::record::JobRecord;
    use crate::{JobService, JobsConfig};
    use perch_model::control::{LogStream, SyncRequest, SyncResponse};
    use serde_json::{Value, json};

    const T0: i64 = 1_800_000_000_000;
    const SECOND: i64 = 1000;
    const MIB: u64 = 1 << 20;

    fn service(dir: &Path, per_user: Option<u64>) -> JobService {
        let (tx, _rx) = JobService::event_channel();
        let config = JobsConfig {
            max_output_bytes_per_user: per_user,
            ..JobsConfig::default()
        };
        JobService::open_embedded(dir, config, tx).expect("jobs")
    }

    async fn sync(jobs: &JobService, node: &str, at: i64, extra: Value) -> SyncResponse {
        let mut req = json!({ "node": node, "gpus": 1, "gpu_model": "Test H100" });
        if let (Some(req), Some(extra)) = (req.as_object_mut(), extra.as_object()) {
            req.extend(extra.clone());
        }
        let req: SyncRequest = serde_json::from_value(req).expect("sync request");
        jobs.run(move |c, _| c.sync(req, at)).await.expect("sync")
    }

    async fn job(jobs: &JobService, id: u64) -> JobRecord {
        jobs.run(move |c, _| c.view(id))
            .await
            .expect("view")
            .expect("job")
    }

    /// Submits a one-GPU job of `user` and has it run on node `node` (which has one GPU).
    async fn running_job(jobs: &JobService, user: &str, node: &str, at: i64) -> u64 {
        sync(jobs, node, at, json!({})).await;
        let request: crate::spec::JobRequest = serde_json::from_value(
            json!({ "command": ["train"], "user": user, "gpus_per_node": 1 }),
        )
        .expect("request");
        let id = jobs
            .run(move |c, _| c.submit(request, at))
            .await
            .expect("submit")[0]
            .id;
        sync(jobs, node, at + 1, json!({})).await;
        assert_eq!(job(jobs, id).await.placement[0].node, node);
        sync(
            jobs,
            node,
            at + 2,
            json!({ "running": [{"job": id, "attempt": 1}] }),
        )
        .await;
        id
    }

    fn chunk(job: u64, offset: u64, data: &str) -> Value {
        json!({ "job": job, "attempt": 1, "stream": "stdout", "offset": offset, "data": data })
    }

    fn stored(dir: &Path, job: u64, node: &str) -> std::fs::Metadata {
        std::fs::metadata(dir.join(format!("logs/{job}/a1/{node}.stdout"))).expect("stored")
    }

    async fn read(jobs: &JobService, id: u64, offset: u64) -> Vec<u8> {
        let source = jobs
            .run(move |c, _| c.log_source(id, LogStream::Stdout, None, None))
            .await
            .expect("source");
        source.read(offset, LOG_PAGE).expect("read").data
    }

    /// The accounting on its own: charges per job and user, the total, what a bound lets
    /// through, and a job's output forgotten whole.
    #[test]
    fn usage_is_charged_per_job_and_user_and_bounds_what_passes() {
        let mut u = OutputUsage::default();
        u.changed(1, "alice", 0, 4096);
        u.changed(1, "alice", 4096, 12_288);
        u.add(2, "bob", 1000);
        u.add(3, "", 500);
        assert_eq!(
            (u.of_user("alice"), u.of_user("bob"), u.total()),
            (12_288, 1000, 13_788)
        );
        let check = |u: &OutputUsage, user: &str, bytes: u64| {
            u.check(user, bytes, Some(12_288), Some(20_000))
        };
        assert_eq!(
            check(&u, "alice", 1),
            Some(Bound::User {
                used: 12_288,
                limit: 12_288
            })
        );
        assert_eq!(check(&u, "bob", 5000), None);
        assert_eq!(
            check(&u, "bob", 7000),
            Some(Bound::Total {
                used: 13_788,
                limit: 20_000
            })
        );
        assert_eq!(u.check("alice", u64::MAX, None, None), None, "no bounds");
        u.forget(1);
        assert_eq!((u.of_user("alice"), u.total()), (0, 1500));
        assert_eq!(check(&u, "alice", 12_288), None);
        u.changed(2, "bob", 1000, 0);
        assert_eq!((u.of_user("bob"), u.total()), (0, 500));
        assert!(
            Bound::User {
                used: 3 * MIB,
                limit: MIB
            }
            .why("alice")
            .contains("server.max_job_output_mb_per_user")
        );
    }

    /// A 600 MiB hole in a job's stdout, the agent's anchor then `end` at its real offset:
    /// the server's copy is 600 MiB long and uses a few kilobytes, and its tail reads `end`.
    /// A chunk past the copy's end without an anchor (a copy that lost its tail) is answered
    /// with the copy's end, so the agent sends from there again.
    #[tokio::test]
    async fn output_after_a_hole_is_stored_at_its_offset_leaving_a_hole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let jobs = service(dir.path(), None);
        let id = running_job(&jobs, "alice", "a", T0).await;
        let at = 600 * MIB;
        let r = sync(
            &jobs,
            "a",
            T0 + SECOND,
            json!({ "running": [{"job": id, "attempt": 1}],
                    "logs": [chunk(id, 0, "start\n"), chunk(id, 6, ""), chunk(id, at, "end\n")] }),
        )
        .await;
        assert_eq!(r.log_offsets, vec![(id, LogStream::Stdout, at + 4)]);
        let m = stored(dir.path(), id, "a");
        assert_eq!(m.len(), at + 4);
        assert!(occupied(&m) < MIB, "{} bytes on disk", occupied(&m));
        assert_eq!(read(&jobs, id, at).await, b"end\n");
        assert_eq!(read(&jobs, id, 0).await[..7], *b"start\n\0");
        // Past the end without an anchor: not stored, the copy's end answered.
        let r = sync(
            &jobs,
            "a",
            T0 + 2 * SECOND,
            json!({ "running": [{"job": id, "attempt": 1}],
                    "logs": [chunk(id, at + 100, "lost\n")] }),
        )
        .await;
        assert_eq!(r.log_offsets, vec![(id, LogStream::Stdout, at + 4)]);
        // A hole to the end of an ended job's stream: the copy is made as long.
        let r = sync(
            &jobs,
            "a",
            T0 + 3 * SECOND,
            json!({ "exited": [{"job": id, "attempt": 1, "code": 0, "output_bytes": [at + 4096, 0]}],
                    "logs": [chunk(id, at + 4, ""), chunk(id, at + 4096, "")] }),
        )
        .await;
        assert_eq!(r.log_offsets, vec![(id, LogStream::Stdout, at + 4096)]);
        assert!(occupied(&stored(dir.path(), id, "a")) < MIB);
    }

    /// With 1 MiB a user, a job of alice's shipping 3 MiB stores at most the bound; the agent
    /// is told all of it was taken; the job's timeline says why, naming the key; bob's output
    /// is stored all the same. A restart measures what is stored and keeps refusing; once
    /// alice's output expires, hers is stored again.
    #[tokio::test]
    async fn output_past_a_users_bound_is_not_stored_and_the_job_says_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        let jobs = service(dir.path(), Some(MIB));
        let alice = running_job(&jobs, "alice", "a", T0).await;
        let piece = "x".repeat(256 << 10);
        let mut at = T0 + SECOND;
        for i in 0..12u64 {
            let r = sync(
                &jobs,
                "a",
                at,
                json!({ "running": [{"job": alice, "attempt": 1}],
                        "logs": [chunk(alice, i * (256 << 10), &piece)] }),
            )
            .await;
            assert_eq!(
                r.log_offsets,
                vec![(alice, LogStream::Stdout, (i + 1) * (256 << 10))],
                "taken, stored or not"
            );
            at += SECOND;
        }
        let m = stored(dir.path(), alice, "a");
        assert_eq!(m.len(), 3 * MIB);
        assert!(
            occupied(&m) <= MIB && occupied(&m) >= MIB / 2,
            "{} bytes on disk",
            occupied(&m)
        );
        let notes: Vec<String> = job(&jobs, alice)
            .await
            .timeline
            .into_iter()
            .map(|t| t.event)
            .filter(|e| e.contains("was not stored"))
            .collect();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("server.max_job_output_mb_per_user")
                && notes[0].contains("alice's jobs' stored output"),
            "{notes:?}"
        );
        // Another user's output is stored.
        let bob = running_job(&jobs, "bob", "b", at).await;
        sync(
            &jobs,
            "b",
            at + SECOND,
            json!({ "running": [{"job": bob, "attempt": 1}], "logs": [chunk(bob, 0, &piece)] }),
        )
        .await;
        assert!(occupied(&stored(dir.path(), bob, "b")) >= 256 << 10);
        // alice's job ends; a restart measures her output and still refuses more of it.
        sync(
            &jobs,
            "a",
            at + 2 * SECOND,
            json!({ "exited": [{"job": alice, "attempt": 1, "code": 0}] }),
        )
        .await;
        drop(jobs);
        let jobs = service(dir.path(), Some(MIB));
        let again = running_job(&jobs, "alice", "a", at + 3 * SECOND).await;
        sync(
            &jobs,
            "a",
            at + 4 * SECOND,
            json!({ "running": [{"job": again, "attempt": 1}], "logs": [chunk(again, 0, &piece)] }),
        )
        .await;
        assert_eq!(occupied(&stored(dir.path(), again, "a")), 0);
        // Her first job's output expires: what it used counts no more.
        let later = at + 31 * 86_400 * SECOND;
        let gone = jobs
            .run(move |c, _| Ok(c.expire_output(later, &[alice])))
            .await
            .expect("expiry");
        assert_eq!(gone.len(), 1);
        for path in gone {
            std::fs::remove_dir_all(path).expect("remove");
        }
        sync(
            &jobs,
            "a",
            later,
            json!({ "running": [{"job": again, "attempt": 1}],
                    "logs": [chunk(again, 256 << 10, &piece)] }),
        )
        .await;
        assert!(occupied(&stored(dir.path(), again, "a")) >= 256 << 10);
    }
}
