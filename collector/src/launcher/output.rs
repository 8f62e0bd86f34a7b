//! Each job's stdout and stderr on this node, from its start until the server holds all of it.
//!
//! The agent ships at most [`CHUNK`] bytes of each stream per sync, so a job that prints fast
//! ends with output not yet sent. That output is still the job's: the agent keeps the files and
//! goes on shipping after the exit is acknowledged, and removes them from the node only once the
//! server's copy is whole. The exit carries each stream's final length
//! ([`perch_model::JobExit::output_bytes`]) so the server can tell readers that more is coming.
//!
//! The files are read through the descriptors the agent created, never reopened by path (the
//! job's user owns the directory); removing them unlinks names in that directory, which never
//! follows a link the user may have put there.

use perch_model::control::{LogChunk, LogStream};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Most bytes of one stream of a running job sent per sync.
pub(super) const CHUNK: u64 = 256 << 10;
/// Most bytes of one stream of an ended job sent per sync: its backlog goes faster.
const ENDED_CHUNK: u64 = 4 << 20;
/// Most bytes of output of all jobs together in one sync: JSON may escape a byte into six, and
/// the server takes syncs of 64 MiB whatever its body limit (`perch_server::SYNC_BODY_MIN`).
const SYNC_BUDGET: u64 = 8 << 20;

const STREAMS: [LogStream; 2] = [LogStream::Stdout, LogStream::Stderr];

fn index(stream: LogStream) -> usize {
    match stream {
        LogStream::Stdout => 0,
        LogStream::Stderr => 1,
    }
}

/// One attempt's output on this node.
struct Output {
    attempt: u32,
    files: [File; 2],
    /// Where each stream continues from, as the server last said.
    sent: [u64; 2],
    /// The attempt ended here and the server recorded its exit: the files go once all is sent.
    acknowledged: bool,
}

/// The output of every job of this node that the server does not hold all of yet.
pub(super) struct Outputs {
    /// The jobs directory (`<dir>/<job>/{stdout,stderr}`).
    dir: PathBuf,
    by_job: HashMap<u64, Output>,
}

impl Output {
    /// Its streams' lengths now, each at most `cap`: what the server is to get of them.
    fn ends(&self, cap: u64) -> [u64; 2] {
        self.files
            .each_ref()
            .map(|f| f.metadata().map_or(0, |m| m.len()).min(cap))
    }
}

impl Outputs {
    pub(super) fn new(dir: &Path) -> Outputs {
        Outputs {
            dir: dir.to_path_buf(),
            by_job: HashMap::new(),
        }
    }

    /// Starts following attempt `attempt`'s files (a new attempt replaces the job's earlier
    /// one), shipping from offset 0: a taken-over job's server copy may hold more, and the
    /// server's answer to the first chunk says where it ends.
    pub(super) fn insert(&mut self, job: u64, attempt: u32, files: [File; 2]) {
        self.by_job.insert(
            job,
            Output {
                attempt,
                files,
                sent: [0, 0],
                acknowledged: false,
            },
        );
    }

    /// The lengths of a job's stdout and stderr, each at most `cap` (pass `u64::MAX` for the
    /// whole): a job can make its file look terabytes long without using the disk (a write after
    /// a seek), and no more than `cap` of a stream is ever shipped.
    pub(super) fn lengths(&self, job: u64, cap: u64) -> Option<[u64; 2]> {
        self.by_job.get(&job).map(|o| o.ends(cap))
    }

    /// The next chunk of every stream with unsent output below `cap`. `running(job)` says
    /// whether the job still writes: a character split at the end of a running job's output
    /// waits for its rest.
    pub(super) fn chunks(&self, running: impl Fn(u64) -> bool, cap: u64) -> Vec<LogChunk> {
        // Running jobs first: an ended job's backlog never holds up live output.
        let mut jobs: Vec<u64> = self.by_job.keys().copied().collect();
        jobs.sort_unstable_by_key(|job| (self.by_job[job].acknowledged, *job));
        let mut chunks = Vec::new();
        let mut budget = SYNC_BUDGET;
        for job in jobs {
            let o = &self.by_job[&job];
            let final_ = !running(job);
            let most = if o.acknowledged { ENDED_CHUNK } else { CHUNK };
            for stream in STREAMS {
                let offset = o.sent[index(stream)];
                let max = most.min(budget).min(cap.saturating_sub(offset));
                let Ok(buf) = read_from(&o.files[index(stream)], offset, max) else {
                    continue;
                };
                if buf.is_empty() {
                    continue;
                }
                budget -= buf.len() as u64;
                let (data, used) = text_of(&buf, final_ && (buf.len() as u64) < max);
                if used > 0 {
                    chunks.push(LogChunk {
                        job,
                        attempt: o.attempt,
                        stream,
                        offset,
                        data,
                    });
                }
            }
        }
        chunks
    }

    /// The server's copy of `job`'s `stream` now ends at `offset`.
    pub(super) fn sent(&mut self, job: u64, stream: LogStream, offset: u64) {
        if let Some(o) = self.by_job.get_mut(&job) {
            o.sent[index(stream)] = offset;
        }
    }

    /// The server recorded the exit of attempt `attempt` of `job`: its output goes once sent.
    pub(super) fn acknowledged(&mut self, job: u64, attempt: u32) {
        if let Some(o) = self.by_job.get_mut(&job)
            && o.attempt == attempt
        {
            o.acknowledged = true;
        }
    }

    /// Whether some of `job`'s output is still to be sent.
    pub(super) fn holds(&self, job: u64) -> bool {
        self.by_job.contains_key(&job)
    }

    /// Forgets and removes from the node the output of every acknowledged exit that the
    /// server now holds whole (up to `cap` a stream); returns those jobs.
    pub(super) fn remove_shipped(&mut self, cap: u64) -> Vec<u64> {
        let done: Vec<u64> = self
            .by_job
            .iter()
            .filter(|(_, o)| {
                let ends = o.ends(cap);
                o.acknowledged && ends[0] <= o.sent[0] && ends[1] <= o.sent[1]
            })
            .map(|(&job, _)| job)
            .collect();
        for &job in &done {
            if let Some(o) = self.by_job.remove(&job) {
                self.remove_files(job, &o);
            }
        }
        done
    }

    /// Removes the output files the agent created for `job` (the server holds them now), each
    /// only while its name still points at that very file, and the job's directory if nothing
    /// else is left in it: a job without a working directory runs there, and what it wrote
    /// beside its output is its user's.
    fn remove_files(&self, job: u64, o: &Output) {
        use std::os::unix::fs::MetadataExt;
        let dir = self.dir.join(job.to_string());
        for (name, file) in [("stdout", &o.files[0]), ("stderr", &o.files[1])] {
            let path = dir.join(name);
            let Ok(named) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            if (named.dev(), named.ino()) == super::file_id(file)
                && let Err(e) = std::fs::remove_file(&path)
            {
                tracing::warn!(job, path = %path.display(), error = %e, "cannot remove a job's output after it was sent");
            }
        }
        // Only if empty: never what the job left there (nor its hostfile).
        let _ = std::fs::remove_dir(&dir);
    }
}

/// Up to `max` bytes of `f` from `offset`, without moving the offset the job writes at.
fn read_from(f: &File, offset: u64, max: u64) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let len = f.metadata()?.len();
    let want = usize::try_from(len.saturating_sub(offset).min(max)).unwrap_or(0);
    let mut buf = vec![0; want];
    let mut got = 0;
    while got < want {
        let n = f.read_at(&mut buf[got..], offset + got as u64)?;
        if n == 0 {
            break;
        }
        got += n;
    }
    buf.truncate(got);
    Ok(buf)
}

/// Text that keeps every byte's place: invalid UTF-8 becomes one '?' per byte, so the server's
/// copy has the same length and offsets stay aligned. An incomplete character at the very end
/// is held back (returns fewer bytes) unless `final_` is set.
pub(super) fn text_of(bytes: &[u8], final_: bool) -> (String, usize) {
    let mut out = String::with_capacity(bytes.len());
    let mut used = 0;
    let chunks: Vec<_> = bytes.utf8_chunks().collect();
    for (i, chunk) in chunks.iter().enumerate() {
        out.push_str(chunk.valid());
        used += chunk.valid().len();
        let invalid = chunk.invalid();
        let last = i + 1 == chunks.len();
        if last
            && !final_
            && !invalid.is_empty()
            && used + invalid.len() == bytes.len()
            && invalid.len() < 4
        {
            break;
        }
        out.extend(std::iter::repeat_n('?', invalid.len()));
        used += invalid.len();
    }
    (out, used)
}
