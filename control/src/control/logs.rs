//! Job output: stored per attempt, node and stream as agents ship it, read back for
//! `perch logs`.

use super::*;

impl Control {
    /// Where node `node`'s output of attempt `attempt` of job `job` is kept: one file per
    /// attempt, node and stream, so the ranks of a multi-node job and the attempts of a
    /// requeued one never write over each other.
    pub(super) fn log_path(
        &self,
        job: u64,
        attempt: u32,
        node: &str,
        stream: LogStream,
    ) -> PathBuf {
        self.logs_dir
            .join(job.to_string())
            .join(format!("a{attempt}"))
            .join(format!("{node}.{}", stream.as_str()))
    }

    /// Stores the output chunks node `node` sent, each at its offset (a chunk sent twice is
    /// stored once), and tells it where each stream now ends.
    ///
    /// A chunk that starts past the stored copy's end is the data after a hole of the node's
    /// file (the agent skips holes, `collector/src/launcher/output.rs`): it is written at its offset, leaving
    /// a hole here too, but only when the chunk before it in this sync, of the same stream,
    /// ended exactly at the copy's end (the agent's anchor, an empty chunk). Without one the
    /// copy lost its tail (a crash before the disk had it) or the agent is an older one: the
    /// answer is the copy's end, and the agent sends from there again. An empty chunk past the
    /// end (a hole to the end of the node's file) makes the copy that long.
    ///
    /// Output that would take a user's or the server's stored output past its bound
    /// ([`JobsConfig::max_output_bytes_per_user`], [`JobsConfig::max_output_bytes_total`]) is not
    /// written: the copy is made as long (a hole, which reads as zero bytes and uses no disk),
    /// the agent is told it was taken, and the job's timeline says why, once.
    pub(super) fn store_logs(
        &mut self,
        node: &str,
        chunks: &[LogChunk],
        response: &mut SyncResponse,
    ) -> Result<(), ControlError> {
        use std::os::unix::fs::FileExt;
        let mut offsets: BTreeMap<(u64, LogStream), u64> = BTreeMap::new();
        // Where the previous chunk of each stream in this sync left the copy, when it ended
        // exactly there: a chunk past the end is taken only after one.
        let mut anchored: HashMap<(u64, LogStream), u64> = HashMap::new();
        // Settled jobs' records, read back from the job database: output may come long after
        // an exit. At most SETTLED_PER_SYNC of them a sync; the rest wait for the next.
        let mut settled: HashMap<u64, Option<JobRecord>> = HashMap::new();
        for c in chunks {
            let key = (c.job, c.stream);
            let end = c.offset.saturating_add(c.data.len() as u64);
            let target = {
                let job = match self.find(c.job) {
                    Some(Found::Live(job)) => Some(job),
                    Some(Found::Settled(..)) => {
                        if !settled.contains_key(&c.job) {
                            if settled.len() == SETTLED_PER_SYNC {
                                continue;
                            }
                            let read = self.record(c.job)?.map(|j| j.into_owned());
                            settled.insert(c.job, read);
                        }
                        settled[&c.job].as_ref()
                    }
                    None => None,
                };
                // Nothing to keep it for (no such job, or its output was deleted after the
                // retention): the agent may move on and free its disk.
                job.filter(|j| j.output_deleted_ms.is_none())
                    .and_then(|job| {
                        let attempt = if c.attempt == 0 {
                            job.attempts
                        } else {
                            c.attempt
                        };
                        // Only attempts that ran here: an agent cannot write another node's output.
                        job.allocations
                            .iter()
                            .any(|a| a.attempt == attempt && a.node == node)
                            .then(|| (attempt, job.request.user().to_owned()))
                    })
            };
            let Some((attempt, user)) = target else {
                offsets.insert(key, end);
                continue;
            };
            let path = self.log_path(c.job, attempt, node, c.stream);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(ControlError::Logs)?;
            }
            let (have, before) =
                std::fs::metadata(&path).map_or((0, 0), |m| (m.len(), output_usage::occupied(&m)));
            let data = c.data.as_bytes();
            // What to write, and where: the part past the copy's end, or all of a chunk after
            // a hole.
            let write = if c.offset > have {
                if anchored.get(&key) != Some(&have) {
                    anchored.remove(&key);
                    offsets.insert(key, have);
                    continue;
                }
                Some((c.offset, data))
            } else if end > have {
                let skip = usize::try_from(have - c.offset).unwrap_or(usize::MAX);
                Some((have, data.get(skip..).unwrap_or_default()))
            } else {
                None
            };
            if let Some((at, mut bytes)) = write {
                let refused = (!bytes.is_empty())
                    .then(|| {
                        self.output_usage.check(
                            &user,
                            bytes.len() as u64,
                            self.config.max_output_bytes_per_user,
                            self.config.max_output_bytes_total,
                        )
                    })
                    .flatten();
                if let Some(bound) = refused {
                    self.refused_output(c.job, &user, node, c.stream, at, bound);
                    bytes = &[];
                }
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .truncate(false)
                    .open(&path)
                    .map_err(ControlError::Logs)?;
                if bytes.is_empty() {
                    // A hole to `end` (the node's, or output not kept): no disk.
                    if end > have {
                        f.set_len(end).map_err(ControlError::Logs)?;
                    }
                } else {
                    f.write_all_at(bytes, at).map_err(ControlError::Logs)?;
                }
                let after = f.metadata().map_or(before, |m| output_usage::occupied(&m));
                self.output_usage.changed(c.job, &user, before, after);
            }
            let len = std::fs::metadata(&path).map_or(0, |m| m.len());
            if end == len {
                anchored.insert(key, len);
            } else {
                anchored.remove(&key);
            }
            offsets.insert(key, len);
        }
        response.log_offsets = offsets.into_iter().map(|((j, s), o)| (j, s, o)).collect();
        Ok(())
    }

    /// Output of `job` from `at` was not stored because of `bound`: its timeline says so, once
    /// (a settled job's record is no longer changed; the server's log says it).
    fn refused_output(
        &mut self,
        job: u64,
        user: &str,
        node: &str,
        stream: LogStream,
        at: u64,
        bound: output_usage::Bound,
    ) {
        if !self.output_usage.first_refusal(job) {
            return;
        }
        let why = bound.why(user);
        tracing::warn!(job, user, node, stream = stream.as_str(), at, %why, "job output not stored");
        let text = format!(
            "its output on {node} from byte {at} of its {} on was not stored: {why}. The part not stored reads as zero bytes in `perch logs`; output is kept until server.job_output_days after each job ended. Raise the key, or have the job write large output to files of its own",
            stream.as_str()
        );
        let now = self.now;
        if let Some(j) = self.jobs.get_mut(&job) {
            j.note(now, text);
            self.dirty_jobs.insert(job);
        }
    }

    /// Measures the stored output (at start): each job's files charged to its user.
    pub(super) fn measure_output(&mut self) {
        let usage = output_usage::OutputUsage::scan(&self.logs_dir, |job| {
            self.find(job).map(|f| f.user().to_owned())
        });
        tracing::info!(
            bytes = usage.total(),
            "stored job output measured for its bounds"
        );
        self.output_usage = usage;
    }

    /// Where rank `rank` (default 0) of attempt `attempt` (default the latest) of a job's
    /// stream is stored, found under the control lock; [`LogSource::read`] reads it outside.
    pub fn log_source(
        &self,
        job: u64,
        stream: LogStream,
        attempt: Option<u32>,
        rank: Option<usize>,
    ) -> Result<LogSource, ControlError> {
        let record = self.record(job)?.ok_or(ControlError::NoSuchJob(job))?;
        if let Some(deleted) = record.output_deleted_ms {
            let ended = record.end_ms.unwrap_or(deleted);
            return Err(ControlError::OutputDeleted {
                job,
                days: (deleted - ended).max(0) / DAY_MS,
            });
        }
        if attempt == Some(0) && record.attempts > 0 {
            return Err(ControlError::BadRequest(format!(
                "attempts count from 1; job {job} has run {} attempt(s)",
                record.attempts
            )));
        }
        let attempt = attempt.unwrap_or(record.attempts);
        let rank = rank.unwrap_or(0);
        if attempt > record.attempts {
            return Err(ControlError::BadRequest(format!(
                "job {job} has run {} attempt(s); there is no attempt {attempt}",
                record.attempts
            )));
        }
        let ran: Vec<&super::super::record::Allocation> = record
            .allocations
            .iter()
            .filter(|a| a.attempt == attempt)
            .collect();
        let Some(alloc) = ran.get(rank) else {
            if attempt == 0 {
                return Ok(LogSource {
                    paths: Vec::new(),
                    attempt: 0,
                    expected: None,
                });
            }
            return Err(ControlError::BadRequest(format!(
                "attempt {attempt} of job {job} ran on {} node(s): ranks 0 to {}",
                ran.len(),
                ran.len().saturating_sub(1)
            )));
        };
        let mut paths = vec![self.log_path(job, attempt, &alloc.node, stream)];
        if rank == 0 && attempt == record.attempts {
            // Output stored before logs were kept per attempt and node: one file per stream.
            paths.push(self.logs_dir.join(job.to_string()).join(stream.as_str()));
        }
        let expected = alloc.output_bytes.map(|b| match stream {
            LogStream::Stdout => b[0],
            LogStream::Stderr => b[1],
        });
        Ok(LogSource {
            paths,
            attempt,
            expected,
        })
    }
}

impl Control {
    /// Retention of job output: of the jobs in `present` (those with a directory of stored
    /// output), marks those that ended longer than [`JobsConfig::output_retention`] ago as
    /// deleted, with a note on their timeline, and returns the directories to remove: theirs,
    /// and those of jobs marked before (a server stopped between marking and removing).
    /// The caller removes them outside the control lock; the records stay. It marks at most
    /// [`EXPIRED_PER_CHECK`] a call, so a backlog (a server upgraded with years of output) is
    /// worked off over several checks instead of in one lock hold and one commit.
    pub fn expire_output(&mut self, now: i64, present: &[u64]) -> Vec<PathBuf> {
        let Some(keep) = self.config.output_retention else {
            return Vec::new();
        };
        let cutoff = now.saturating_sub(millis(keep));
        let mut remove = Vec::new();
        let mut marked = 0;
        for &id in present {
            let (ended, deleted) = match self.find(id) {
                Some(Found::Live(job)) => (
                    job.end_ms.filter(|_| job.state.is_final()),
                    job.output_deleted_ms,
                ),
                Some(Found::Settled(..)) => match self.settled_times(id) {
                    Some((end, deleted)) => (Some(end), deleted),
                    None => continue,
                },
                None => continue,
            };
            if deleted.is_none() {
                if ended.is_none_or(|e| e >= cutoff) || marked == EXPIRED_PER_CHECK {
                    continue;
                }
                marked += 1;
                if let Some(job) = self.jobs.get_mut(&id) {
                    job.delete_output(now);
                    self.dirty_jobs.insert(id);
                } else {
                    self.delete_settled_output(id, now);
                }
            }
            self.output_usage.forget(id);
            remove.push(self.logs_dir.join(id.to_string()));
        }
        remove
    }

    /// Where job output is stored: one directory per job, named by its id.
    pub fn logs_dir(&self) -> PathBuf {
        self.logs_dir.clone()
    }
}

const DAY_MS: i64 = 86_400_000;

/// Settled jobs whose output one sync may store ([`Control::store_logs`]): each is read back
/// from the job database under the control lock, and a sync of a million tiny chunks, each
/// for another old job, would hold it for seconds. An agent sends what was not acknowledged
/// again.
const SETTLED_PER_SYNC: usize = 64;

/// Most jobs whose output one check deletes ([`Control::expire_output`]).
pub const EXPIRED_PER_CHECK: usize = 1_000;

/// Most bytes of output one `GET /v1/jobs/{id}/logs` answers; readers page with `offset`.
pub const LOG_PAGE: u64 = 4 << 20;

/// Where one stream of one rank of one attempt of a job is stored ([`Control::log_source`]).
#[derive(Debug, Clone)]
pub struct LogSource {
    /// The file, then where older servers kept it; the first that exists is read.
    paths: Vec<PathBuf>,
    /// The attempt the output is from.
    pub attempt: u32,
    /// The stream's final length on its node, once the attempt ended there and its agent said.
    expected: Option<u64>,
}

/// One page of stored output.
#[derive(Debug, Clone, PartialEq)]
pub struct LogPage {
    pub data: Vec<u8>,
    /// The attempt it is from.
    pub attempt: u32,
    /// The server holds more after this page.
    pub more: bool,
    /// Bytes of the stream the server holds.
    pub stored: u64,
    /// Bytes the node has yet to send, once it said how much there is (0: the copy is whole).
    pub pending: Option<u64>,
}

impl LogSource {
    /// At most `max` bytes from `offset`: a page, never the whole of a large file in memory.
    pub fn read(&self, offset: u64, max: u64) -> std::io::Result<LogPage> {
        use std::io::{Read, Seek, SeekFrom};
        let mut data = Vec::new();
        let mut stored = 0;
        for path in &self.paths {
            let mut f = match std::fs::File::open(path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            stored = f.metadata()?.len();
            if offset < stored {
                f.seek(SeekFrom::Start(offset))?;
                f.take(max).read_to_end(&mut data)?;
            }
            break;
        }
        Ok(LogPage {
            more: offset.saturating_add(data.len() as u64) < stored,
            data,
            attempt: self.attempt,
            stored,
            pending: self.expected.map(|e| e.saturating_sub(stored)),
        })
    }
}
