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
//!
//! Holes are not shipped: a job that seeks its stdout (or extends it) makes a file that looks
//! long and uses no disk, and its holes would reach the server as bytes of zeros. Where the
//! server's copy ends in a hole of the node's, the agent sends an empty chunk at that end (the
//! anchor: it says where it believes the copy ends) and then the next data at its real offset;
//! the server writes it there, leaving a hole in its copy too, and answers the new end. A hole
//! at the end of an ended job's stream is sent as an empty chunk at the stream's length. A
//! server that does not take a chunk past its copy's end answers its copy's end again; the
//! agent then sends that stream's holes as zeros, as before.

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
    /// Each stream opened again (through `/proc/self/fd`), for finding holes: `SEEK_DATA`
    /// moves the offset of the description it is asked on, and `files` share theirs with the
    /// job's stdout and stderr. `None`: holes are shipped as zeros.
    seekers: [Option<File>; 2],
    /// Whether each stream's holes are skipped: until a server does not take a skip.
    skip_holes: [bool; 2],
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
        let seekers = files.each_ref().map(seeker);
        self.by_job.insert(
            job,
            Output {
                attempt,
                files,
                skip_holes: seekers.each_ref().map(Option::is_some),
                seekers,
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
                let i = index(stream);
                let offset = o.sent[i];
                if offset >= cap {
                    continue;
                }
                let room = most.min(budget);
                let (from, upto) = match o.skip_holes[i].then(|| o.seekers[i].as_ref()).flatten() {
                    Some(seeker) => data_at(seeker, offset, final_),
                    None => (offset, u64::MAX),
                };
                if from > offset {
                    // A hole: the anchor, then the data after it (possibly none yet).
                    let from = from.min(cap);
                    let max = room.min(cap - from).min(upto.saturating_sub(from));
                    let buf = read_from(&o.files[i], from, max).unwrap_or_default();
                    budget -= buf.len() as u64;
                    let (data, _) = text_of(&buf, final_ && (buf.len() as u64) < max);
                    for (offset, data) in [(offset, String::new()), (from, data)] {
                        chunks.push(LogChunk {
                            job,
                            attempt: o.attempt,
                            stream,
                            offset,
                            data,
                        });
                    }
                    continue;
                }
                let max = room
                    .min(cap.saturating_sub(offset))
                    .min(upto.saturating_sub(offset));
                let Ok(buf) = read_from(&o.files[i], offset, max) else {
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
            let i = index(stream);
            // Its copy still ends in a hole of ours after we skipped it: a server that does
            // not take a chunk past its copy's end. Send the holes as they read (zeros).
            if offset == o.sent[i]
                && let Some(seeker) = o.seekers[i].as_ref().filter(|_| o.skip_holes[i])
                && data_at(seeker, offset, true).0 > offset
            {
                tracing::info!(
                    job,
                    stream = stream.as_str(),
                    offset,
                    "the server did not take output past a hole; sending the holes as zeros"
                );
                o.skip_holes[i] = false;
            }
            o.sent[i] = offset;
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

/// `f` opened again, as a description of its own, for `SEEK_DATA` and `SEEK_HOLE`.
fn seeker(f: &File) -> Option<File> {
    use rustix::fs::{Mode, OFlags};
    use std::os::fd::AsRawFd;
    let path = format!("/proc/self/fd/{}", f.as_raw_fd());
    let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).ok()?;
    let reopened = File::from(fd);
    let same = |m: std::fs::Metadata| {
        use std::os::unix::fs::MetadataExt;
        (m.dev(), m.ino())
    };
    (reopened.metadata().ok().map(same) == f.metadata().ok().map(same)).then_some(reopened)
}

/// Where the data at or after `offset` starts, and where it ends (the next hole): `(offset,
/// end)` when `offset` is in data. A hole that runs to the end of the file is skipped (to the
/// file's length) only when `to_end`, the job ended; a running job may still write there, so
/// until then there is nothing to send (`(offset, offset)`). Where the file system cannot
/// say, the bytes from `offset` count as data.
fn data_at(f: &File, offset: u64, to_end: bool) -> (u64, u64) {
    use rustix::fs::{SeekFrom, seek};
    let len = f.metadata().map_or(0, |m| m.len());
    if offset >= len {
        return (offset, u64::MAX);
    }
    let start = match seek(f, SeekFrom::Data(offset)) {
        Ok(start) => start,
        Err(rustix::io::Errno::NXIO) if to_end => return (len, len),
        Err(rustix::io::Errno::NXIO) => return (offset, offset),
        Err(_) => return (offset, u64::MAX),
    };
    match seek(f, SeekFrom::Hole(start)) {
        Ok(end) if end > start => (start, end),
        _ => (start, u64::MAX),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    const MIB: u64 = 1 << 20;

    fn summary(chunks: &[LogChunk]) -> Vec<(LogStream, u64, usize)> {
        chunks
            .iter()
            .map(|c| (c.stream, c.offset, c.data.len()))
            .collect()
    }

    /// A stdout of 4 KiB of data, a 600 MiB hole, `end`: the agent ships the data, then an
    /// anchor at the hole and `end` at its real offset, never the hole's zeros; a hole to the
    /// end of the file waits while the job runs and is sent as its length once it ended. A
    /// server that does not take the skip (it answers the same end again) gets zeros.
    #[test]
    fn holes_are_skipped_and_the_data_after_them_shipped_at_its_offset() {
        let dir = tempfile::tempdir().expect("tempdir");
        let open = |name: &str| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(dir.path().join(name))
                .expect("file")
        };
        let (out, err) = (open("stdout"), open("stderr"));
        out.write_all_at(&[b'a'; 4096], 0).expect("write");
        let hole_end = 600 * MIB;
        out.write_all_at(b"end\n", hole_end).expect("write");
        let mut o = Outputs::new(dir.path());
        o.insert(1, 1, [out.try_clone().expect("clone"), err]);
        let running = |_| true;
        let first = o.chunks(running, u64::MAX);
        assert_eq!(summary(&first), vec![(LogStream::Stdout, 0, 4096)]);
        o.sent(1, LogStream::Stdout, 4096);
        let next = o.chunks(running, u64::MAX);
        assert_eq!(
            summary(&next),
            vec![
                (LogStream::Stdout, 4096, 0),
                (LogStream::Stdout, hole_end, 4)
            ]
        );
        assert_eq!(next[1].data, "end\n");
        o.sent(1, LogStream::Stdout, hole_end + 4);
        assert!(o.chunks(running, u64::MAX).is_empty());
        // A hole to the end: nothing while the job runs, its length once it ended. (The rest
        // of the block `end` is in reads as data: holes are whole blocks.)
        out.set_len(hole_end + 8 * MIB).expect("extend");
        let block = o.chunks(running, u64::MAX);
        assert_eq!(
            summary(&block),
            vec![(LogStream::Stdout, hole_end + 4, 4092)]
        );
        o.sent(1, LogStream::Stdout, hole_end + 4096);
        assert!(o.chunks(running, u64::MAX).is_empty());
        let ended = o.chunks(|_| false, u64::MAX);
        assert_eq!(
            summary(&ended),
            vec![
                (LogStream::Stdout, hole_end + 4096, 0),
                (LogStream::Stdout, hole_end + 8 * MIB, 0)
            ]
        );
        // An older server answers its copy's end again: the holes go as zeros from then on.
        o.sent(1, LogStream::Stdout, hole_end + 4096);
        let zeros = o.chunks(|_| false, u64::MAX);
        assert_eq!(
            summary(&zeros),
            vec![(LogStream::Stdout, hole_end + 4096, CHUNK as usize)]
        );
        assert!(zeros[0].data.bytes().all(|b| b == 0));
    }
}
