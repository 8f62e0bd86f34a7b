//! Keeping the files few and bounded in age: compaction merges the small files of a partition
//! into one sorted file (for a rollup, merging the partial rows of each key and bucket into
//! one), and retention drops whole partitions (days; months for hourly rollups) older than a
//! table's retention. Both change the manifest in one atomic step; the files they take out
//! go to the graveyard and are deleted only once no query's snapshot holds them.

use crate::files::{compact_rows, decode, encode_table, samples_in};
use crate::manifest::FileEntry;
use crate::schema::Table;
use crate::store::Store;
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// What one maintenance round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MaintenanceStats {
    pub files_compacted: u64,
    pub files_written: u64,
    pub files_expired: u64,
    pub rows_expired: u64,
}

/// A pinned file list (see [`Store::snapshot_for_test`]).
#[derive(Debug)]
pub struct PinnedFiles(Arc<Vec<FileEntry>>);

impl std::ops::Index<usize> for PinnedFiles {
    type Output = str;
    fn index(&self, i: usize) -> &str {
        &self.0[i].path
    }
}

fn partition(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(dir, _)| dir)
}

impl Store {
    /// Runs retention (as of `now_ms`) and compaction once.
    #[tracing::instrument(name = "store.maintain", skip_all)]
    pub async fn maintain(&self, now_ms: i64) -> Result<MaintenanceStats> {
        let _one = self.manifest_lock.lock().await;
        let mut manifest = self.lock().manifest.clone();
        let mut removed: BTreeMap<Table, Vec<String>> = BTreeMap::new();
        let mut stats = MaintenanceStats::default();

        for (table, keep) in &self.config.retention {
            let cutoff = now_ms - i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
            if let Some(files) = manifest.files.get_mut(table.name()) {
                // Whole partitions: a day goes once its newest row is past the cutoff.
                let mut newest: BTreeMap<String, i64> = BTreeMap::new();
                for f in files.iter() {
                    let n = newest
                        .entry(partition(&f.path).to_owned())
                        .or_insert(i64::MIN);
                    *n = (*n).max(f.max_time_ms);
                }
                files.retain(|f| {
                    let keep = newest.get(partition(&f.path)).is_none_or(|&n| n >= cutoff);
                    if !keep {
                        stats.files_expired += 1;
                        stats.rows_expired += f.rows;
                        removed.entry(*table).or_default().push(f.path.clone());
                    }
                    keep
                });
            }
        }

        let mut next_file_id = manifest.next_file_id;
        for table in Table::ALL {
            let Some(files) = manifest.files.get(table.name()) else {
                continue;
            };
            let mut groups: BTreeMap<&str, Vec<FileEntry>> = BTreeMap::new();
            for f in files
                .iter()
                .filter(|f| f.bytes < self.config.compact_below_bytes)
            {
                groups
                    .entry(partition(&f.path))
                    .or_default()
                    .push(f.clone());
            }
            let groups: Vec<Vec<FileEntry>> = groups
                .into_values()
                .filter(|g| g.len() >= self.config.compact_min_files.max(2))
                .collect();
            for group in groups {
                let mut inputs = Vec::with_capacity(group.len());
                for f in &group {
                    inputs.push(self.storage.get(&f.path).await?);
                }
                let mut next = next_file_id;
                let (written, next_after) = tokio::task::spawn_blocking(move || {
                    let schema = table.schema();
                    let mut batches = Vec::new();
                    for data in inputs {
                        batches.extend(decode(data, &schema)?);
                    }
                    let samples_before = samples_in(table, &batches)?;
                    let merged = compact_rows(table, batches)?;
                    let samples_after = samples_in(table, &merged)?;
                    if samples_before != samples_after {
                        return Err(Error::Corrupt {
                            what: "compaction",
                            message: format!(
                                "{}: read {samples_before} samples but would write {samples_after}; kept the original files",
                                table.name()
                            ),
                        });
                    }
                    let written = encode_table(table, &merged, &mut next)?;
                    Ok::<_, Error>((written, next))
                })
                .await
                .map_err(|e| Error::Execution(format!("compaction task failed: {e}")))??;
                next_file_id = next_after;
                let written = self.put_files(written).await?;
                let entries = manifest.files.entry(table.name().to_owned()).or_default();
                entries.retain(|f| !group.iter().any(|g| g.path == f.path));
                entries.extend(written.iter().map(|(_, e)| e.clone()));
                stats.files_compacted += group.len() as u64;
                stats.files_written += written.len() as u64;
                removed
                    .entry(table)
                    .or_default()
                    .extend(group.into_iter().map(|f| f.path));
            }
        }
        if removed.is_empty() {
            return Ok(stats);
        }
        manifest.next_file_id = next_file_id;
        self.commit(manifest, removed, |_| {}).await?;
        self.stats
            .files_written
            .fetch_add(stats.files_written, Ordering::Relaxed);
        if stats.files_compacted + stats.files_expired > 0 {
            tracing::info!(
                compacted = stats.files_compacted,
                written = stats.files_written,
                expired = stats.files_expired,
                "store maintenance"
            );
        }
        self.reap().await;
        Ok(stats)
    }

    /// Deletes graveyard files no query can still be reading.
    pub async fn reap(&self) {
        let ready: Vec<String> = {
            let mut inner = self.lock();
            let mut ready = Vec::new();
            let grace = self.config.delete_grace;
            inner.graveyard.retain(|grave| {
                if Arc::strong_count(&grave.pinned) > 1 || grave.buried.elapsed() < grace {
                    return true;
                }
                ready.extend(grave.paths.iter().cloned());
                false
            });
            ready
        };
        for path in ready {
            if let Err(e) = self.storage.delete(&path).await {
                tracing::warn!(file = %path, error = %e, "could not delete a replaced parquet file; it is removed at the next start");
            }
        }
    }

    /// Pins the current file list of `table` as a query would, returning its paths; the files
    /// are kept until the returned value is dropped. For tests of the graveyard.
    pub fn snapshot_for_test(&self, table: Table) -> PinnedFiles {
        let files = self
            .lock()
            .tables
            .get(&table)
            .map(|t| t.files.clone())
            .unwrap_or_default();
        PinnedFiles(files)
    }

    /// Files waiting in the graveyard (for tests and metrics).
    pub fn graveyard_files(&self) -> usize {
        self.lock().graveyard.iter().map(|g| g.paths.len()).sum()
    }
}
