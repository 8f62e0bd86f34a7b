//! Other writers' stores, read beside this one: a deployment whose telemetry is taken by
//! several ingest servers (docs/scale.md) has each of them write its own store (its own data
//! directory, or its own prefix of the bucket), and the control server's SQL reads them all.
//!
//! A peer is read only through its manifest, the commit point of every one of its changes
//! ([`crate::manifest`]): [`Store::refresh_peers`] reads each peer's manifest (every
//! [`PEER_REFRESH`] in the server) and keeps its file list, with each path made absolute (a
//! local path, or the `s3://` URL in the same bucket). A query's scan of a table is then this
//! store's files and buffer, and every peer's files as of the last refresh. Rows a peer has
//! not flushed yet are in its buffer and not seen here: a peer's rows reach this store's SQL
//! within its flush interval and one refresh.
//!
//! Writers never coordinate: each one is the only writer of its location, and a file it
//! replaces (compaction, retention) is deleted only [`StoreConfig::delete_grace`] after it left
//! the manifest, long past the refresh and any query of a reader that still lists it.
//!
//! [`StoreConfig::delete_grace`]: crate::StoreConfig::delete_grace

use crate::manifest::{self, FileEntry, Manifest};
use crate::schema::Table;
use crate::storage::{Storage, StorageConfig};
use crate::store::Store;
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the server reads its peers' manifests.
pub const PEER_REFRESH: Duration = Duration::from_secs(2);

/// Another writer's store: its name (for messages and `/metrics`) and its location, in the
/// same kind of storage as this store's: a directory when this store is local, a key prefix
/// of the same bucket when it is in object storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerConfig {
    pub name: String,
    pub location: String,
}

/// What is known of one peer.
#[derive(Debug, Clone, Default)]
pub struct PeerStatus {
    pub name: String,
    pub location: String,
    /// Files per table as of the last manifest read.
    pub files: usize,
    pub bytes: u64,
    /// When the manifest was last read whole (Unix ms, the caller's clock).
    pub read_ms: Option<i64>,
    /// Why the last read failed, if it did (the files of the read before stay in use).
    pub error: Option<String>,
}

pub(crate) struct Peer {
    config: PeerConfig,
    storage: Storage,
    state: Mutex<PeerState>,
}

#[derive(Default)]
struct PeerState {
    /// The manifest as last read whole: one that has not changed is not parsed again.
    manifest: Option<bytes::Bytes>,
    /// Per table, with absolute paths.
    files: BTreeMap<Table, Vec<FileEntry>>,
    read_ms: Option<i64>,
    error: Option<String>,
}

/// The peers of a store, and each table's files across all of them (rebuilt at each refresh
/// that changed something, so a query's scan shares one list and one listing table).
#[derive(Default)]
pub(crate) struct Peers {
    list: Vec<Peer>,
    pub(crate) files: Mutex<BTreeMap<Table, Arc<Vec<FileEntry>>>>,
    /// Per table, this store's files and the peers' as one list, kept while neither changes
    /// (one list and so one cached listing table for every query between two changes).
    together: Mutex<BTreeMap<Table, Together>>,
}

struct Together {
    own: std::sync::Weak<Vec<FileEntry>>,
    peers: std::sync::Weak<Vec<FileEntry>>,
    files: Arc<Vec<FileEntry>>,
}

impl Peers {
    /// The peers of `configs`, in the storage kind of `own`. Refused: a peer at this store's
    /// own location, two peers at one location or with one name.
    pub(crate) fn new(
        configs: &[PeerConfig],
        own: &StorageConfig,
        own_dir: &Path,
    ) -> Result<Peers> {
        let refuse = |message: String| Error::Io {
            what: "configuring the stores read beside this one",
            path: own_dir.to_owned(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, message),
        };
        let mut list: Vec<Peer> = Vec::with_capacity(configs.len());
        for config in configs {
            let location = config.location.trim_end_matches('/');
            if location.is_empty() {
                return Err(refuse(format!("peer {:?} has no location", config.name)));
            }
            if list
                .iter()
                .any(|p| p.config.name == config.name || p.config.location == location)
            {
                return Err(refuse(format!(
                    "peer {:?} at {location:?} is named twice: give each ingest server its own name and store",
                    config.name
                )));
            }
            let storage = match own {
                StorageConfig::Local => {
                    let dir = Path::new(location);
                    if !dir.is_absolute() {
                        return Err(refuse(format!(
                            "peer {:?}: store {location:?} must be an absolute directory",
                            config.name
                        )));
                    }
                    if same_dir(dir, own_dir) {
                        return Err(refuse(format!(
                            "peer {:?}: store {location:?} is this server's own data directory; each server writes its own",
                            config.name
                        )));
                    }
                    Storage::new(&StorageConfig::Local, dir)?
                }
                StorageConfig::S3(s3) => {
                    let prefix = location.trim_matches('/');
                    if prefix == s3.prefix.trim_matches('/') {
                        return Err(refuse(format!(
                            "peer {:?}: prefix {prefix:?} is this server's own; each server writes its own",
                            config.name
                        )));
                    }
                    let mut s3 = s3.clone();
                    s3.prefix = prefix.to_owned();
                    Storage::new(&StorageConfig::S3(s3), own_dir)?
                }
            };
            list.push(Peer {
                config: PeerConfig {
                    name: config.name.clone(),
                    location: location.to_owned(),
                },
                storage,
                state: Mutex::default(),
            });
        }
        Ok(Peers {
            list,
            files: Mutex::default(),
            together: Mutex::default(),
        })
    }

    /// `own` and `peers` (the files of `table`) as one list.
    pub(crate) fn with_own(
        &self,
        table: Table,
        own: &Arc<Vec<FileEntry>>,
        peers: &Arc<Vec<FileEntry>>,
    ) -> Arc<Vec<FileEntry>> {
        let mut together = self.together.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = together.get(&table)
            && std::ptr::eq(t.own.as_ptr(), Arc::as_ptr(own))
            && std::ptr::eq(t.peers.as_ptr(), Arc::as_ptr(peers))
        {
            return t.files.clone();
        }
        let files: Arc<Vec<FileEntry>> =
            Arc::new(own.iter().chain(peers.iter()).cloned().collect());
        together.insert(
            table,
            Together {
                own: Arc::downgrade(own),
                peers: Arc::downgrade(peers),
                files: files.clone(),
            },
        );
        files
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// A peer's manifest as its files: paths made absolute. A manifest of another format version
/// is refused: its files' columns may not be this binary's (an older writer upgrades its own
/// store when it is upgraded, and a newer one writes what this one cannot read).
fn files_of(peer: &Peer, data: &[u8]) -> Result<BTreeMap<Table, Vec<FileEntry>>> {
    let url = peer.storage.file_url(manifest::FILE_NAME);
    let manifest = Manifest::parse(data, &url)?;
    if manifest.version != manifest::CURRENT_VERSION {
        return Err(Error::Corrupt {
            what: "peer manifest",
            message: format!(
                "{url} is of store format version {}, this perch reads its peers at version {} only: run the same perch release on every server",
                manifest.version,
                manifest::CURRENT_VERSION
            ),
        });
    }
    let mut files = BTreeMap::new();
    for (name, entries) in manifest.files {
        let Some(table) = Table::from_name(&name) else {
            return Err(Error::Corrupt {
                what: "peer manifest",
                message: format!("{url}: unknown table {name:?}"),
            });
        };
        let entries = entries
            .into_iter()
            .map(|mut f| {
                f.path = peer.storage.file_url(&f.path);
                f
            })
            .collect();
        files.insert(table, entries);
    }
    Ok(files)
}

impl Store {
    /// Reads every peer's manifest once, as of `now_ms`; returns how many were read. A peer
    /// that cannot be read keeps the files of its last good read, and says why in
    /// [`Store::peer_status`].
    pub async fn refresh_peers(&self, now_ms: i64) -> usize {
        let peers = &self.peers;
        if peers.is_empty() {
            return 0;
        }
        let mut read = 0;
        let mut changed = false;
        for peer in &peers.list {
            let read_now = peer.storage.read_manifest().await;
            let mut state = peer.state.lock().unwrap_or_else(|p| p.into_inner());
            let got = match read_now {
                Ok(data) if data.is_some() && data == state.manifest => Ok(None),
                Ok(Some(data)) => files_of(peer, &data).map(|files| Some((Some(data), files))),
                // A peer that has not started yet has written nothing.
                Ok(None) => Ok(Some((None, BTreeMap::new()))),
                Err(e) => Err(e),
            };
            match got {
                Ok(new) => {
                    read += 1;
                    if let Some((manifest, files)) = new {
                        state.manifest = manifest;
                        if state.files != files {
                            state.files = files;
                            changed = true;
                        }
                    }
                    state.read_ms = Some(now_ms);
                    state.error = None;
                }
                Err(e) => {
                    if state.error.is_none() {
                        tracing::warn!(peer = %peer.config.name, error = %e, "cannot read a peer store's manifest; its files as last read stay in use");
                    }
                    state.error = Some(e.to_string());
                }
            }
        }
        if changed {
            let mut all: BTreeMap<Table, Vec<FileEntry>> = BTreeMap::new();
            for peer in &peers.list {
                let state = peer.state.lock().unwrap_or_else(|p| p.into_inner());
                for (table, files) in &state.files {
                    all.entry(*table).or_default().extend(files.iter().cloned());
                }
            }
            *peers.files.lock().unwrap_or_else(|p| p.into_inner()) =
                all.into_iter().map(|(t, f)| (t, Arc::new(f))).collect();
        }
        read
    }

    /// Reads the peers' manifests every [`PEER_REFRESH`] until `shutdown` resolves.
    pub async fn run_peer_refresh(
        self: Arc<Self>,
        now_ms: impl Fn() -> i64,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        if self.peers.is_empty() {
            return;
        }
        tokio::pin!(shutdown);
        loop {
            self.refresh_peers(now_ms()).await;
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(PEER_REFRESH) => {}
            }
        }
    }

    /// Each peer as last read.
    pub fn peer_status(&self) -> Vec<PeerStatus> {
        self.peers
            .list
            .iter()
            .map(|peer| {
                let state = peer.state.lock().unwrap_or_else(|p| p.into_inner());
                let all = state.files.values().flatten();
                PeerStatus {
                    name: peer.config.name.clone(),
                    location: peer.config.location.clone(),
                    files: all.clone().count(),
                    bytes: all.map(|f| f.bytes).sum(),
                    read_ms: state.read_ms,
                    error: state.error.clone(),
                }
            })
            .collect()
    }

    /// The peers' files of `table` as of the last refresh, if there are peers.
    pub(crate) fn peer_files(&self, table: Table) -> Option<Arc<Vec<FileEntry>>> {
        if self.peers.is_empty() {
            return None;
        }
        Some(
            self.peers
                .files
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&table)
                .cloned()
                .unwrap_or_default(),
        )
    }
}
