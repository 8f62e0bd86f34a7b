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

    /// Stores the output chunks node `node` sent (at the offsets it says, so a chunk sent
    /// twice is stored once) and tells it where each stream now ends.
    pub(super) fn store_logs(
        &self,
        node: &str,
        chunks: &[LogChunk],
        response: &mut SyncResponse,
    ) -> Result<(), ControlError> {
        let mut offsets: BTreeMap<(u64, LogStream), u64> = BTreeMap::new();
        for c in chunks {
            let Some(job) = self.jobs.get(&c.job) else {
                continue;
            };
            let attempt = if c.attempt == 0 {
                job.attempts
            } else {
                c.attempt
            };
            // Only attempts that ran here: an agent cannot write another node's output.
            let ran_here = job
                .allocations
                .iter()
                .any(|a| a.attempt == attempt && a.node == node);
            if !ran_here {
                continue;
            }
            let path = self.log_path(c.job, attempt, node, c.stream);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(ControlError::Logs)?;
            }
            let have = std::fs::metadata(&path).map_or(0, |m| m.len());
            let data = c.data.as_bytes();
            let end = c.offset + data.len() as u64;
            if c.offset <= have && end > have {
                let skip = usize::try_from(have - c.offset).unwrap_or(0);
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map_err(ControlError::Logs)?;
                f.write_all(&data[skip.min(data.len())..])
                    .map_err(ControlError::Logs)?;
            }
            let len = std::fs::metadata(&path).map_or(0, |m| m.len());
            offsets.insert((c.job, c.stream), len);
        }
        response.log_offsets = offsets.into_iter().map(|((j, s), o)| (j, s, o)).collect();
        Ok(())
    }

    /// `offset..` of a job's stream as stored on the server: rank `rank` (default 0) of attempt
    /// `attempt` (default the latest). Returns the bytes and the attempt they are from.
    pub(crate) fn read_log(
        &self,
        job: u64,
        stream: LogStream,
        offset: u64,
        attempt: Option<u32>,
        rank: Option<usize>,
    ) -> Result<(Vec<u8>, u32), ControlError> {
        let record = self.jobs.get(&job).ok_or(ControlError::NoSuchJob(job))?;
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
        let nodes: Vec<&str> = record
            .allocations
            .iter()
            .filter(|a| a.attempt == attempt)
            .map(|a| a.node.as_str())
            .collect();
        let path = match nodes.get(rank) {
            Some(node) => self.log_path(job, attempt, node, stream),
            None if attempt == 0 => return Ok((Vec::new(), 0)),
            None => {
                return Err(ControlError::BadRequest(format!(
                    "attempt {attempt} of job {job} ran on {} node(s): ranks 0 to {}",
                    nodes.len(),
                    nodes.len().saturating_sub(1)
                )));
            }
        };
        // Output stored before logs were kept per attempt and node: one file per stream.
        let legacy = self.logs_dir.join(job.to_string()).join(stream.as_str());
        let data = match std::fs::read(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match std::fs::read(&legacy) {
                Ok(d) if rank == 0 && attempt == record.attempts => d,
                _ => Vec::new(),
            },
            Err(e) => return Err(ControlError::Logs(e)),
        };
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(data.len());
        Ok((data[start..].to_vec(), attempt))
    }
}
