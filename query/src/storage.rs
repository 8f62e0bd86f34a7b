//! Where the Parquet files and the manifest live: a local directory (the default) or an
//! S3-compatible bucket through `object_store`.
//!
//! The write-ahead log is not here: it always stays on local disk under the data directory,
//! because an ingest is acknowledged only after its record is fsynced, and an object PUT per
//! burst of requests would cost tens of milliseconds each. Files are immutable once written
//! and are written before the manifest that lists them; the manifest is the commit point
//! (an atomic rename locally, a single PUT, which S3 makes visible whole or not at all,
//! remotely). No local copy of remote files is kept: queries read them through DataFusion's
//! object store registry, where the same client is registered.
//!
//! One server owns one data directory and one bucket prefix: the lock file in the local
//! directory keeps a second server off the directory, but nothing stops two servers from being
//! pointed at the same prefix, so do not.

use crate::manifest::FILE_NAME as MANIFEST;
use crate::{Error, Result};
use bytes::Bytes;
use datafusion::execution::object_store::ObjectStoreUrl;
use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Which storage holds the files and the manifest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum StorageConfig {
    /// Under `<data_dir>/tables` and `<data_dir>/manifest.json`.
    #[default]
    Local,
    /// In an S3-compatible bucket, under `prefix`.
    S3(S3Config),
}

/// An S3-compatible bucket. Unset values come from the usual `AWS_*` environment variables
/// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_DEFAULT_REGION`,
/// `AWS_ENDPOINT`, `AWS_ALLOW_HTTP`), then from the instance's metadata service.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct S3Config {
    pub bucket: String,
    /// Key prefix for everything perch writes, without leading or trailing `/`; empty for the
    /// bucket's root.
    pub prefix: String,
    /// For servers other than AWS (MinIO, Ceph, moto), e.g. `http://127.0.0.1:9000`.
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    /// Allow `http://` endpoints (local test servers); otherwise only HTTPS.
    pub allow_http: bool,
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field(
                "secret_access_key",
                &self.secret_access_key.as_ref().map(|_| "<redacted>"),
            )
            .field("allow_http", &self.allow_http)
            .finish()
    }
}

pub(crate) enum Storage {
    Local(PathBuf),
    Object {
        store: Arc<dyn ObjectStore>,
        /// `s3://bucket`, under which `store` is registered with DataFusion.
        url: ObjectStoreUrl,
        /// Key prefix with a trailing `/`, or empty.
        prefix: String,
    },
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

fn config_error(message: String) -> Error {
    Error::Io {
        what: "configuring object storage",
        path: PathBuf::from("[server.storage]"),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, message),
    }
}

impl Storage {
    /// Storage for `config`; `data_dir` is the local directory (used by `Local`).
    pub(crate) fn new(config: &StorageConfig, data_dir: &Path) -> Result<Storage> {
        let s3 = match config {
            StorageConfig::Local => return Ok(Storage::Local(data_dir.to_owned())),
            StorageConfig::S3(s3) => s3,
        };
        if s3.bucket.is_empty() {
            return Err(config_error(
                "storage kind s3 needs a bucket: set [server.storage] bucket".into(),
            ));
        }
        let prefix = s3.prefix.trim_matches('/');
        if !prefix.is_empty() {
            ObjectPath::parse(prefix).map_err(|e| {
                config_error(format!(
                    "storage prefix {prefix:?} is not a valid object key prefix: {e}"
                ))
            })?;
        }
        let mut builder = AmazonS3Builder::from_env().with_bucket_name(&s3.bucket);
        if let Some(endpoint) = &s3.endpoint {
            builder = builder.with_endpoint(endpoint);
        }
        if let Some(region) = &s3.region {
            builder = builder.with_region(region);
        }
        if let Some(key) = &s3.access_key_id {
            builder = builder.with_access_key_id(key);
        }
        if let Some(secret) = &s3.secret_access_key {
            builder = builder.with_secret_access_key(secret);
        }
        if s3.allow_http {
            builder = builder.with_allow_http(true);
        }
        let store = builder
            .build()
            .map_err(|e| config_error(format!("bucket {}: {e}", s3.bucket)))?;
        let url = ObjectStoreUrl::parse(format!("s3://{}", s3.bucket))
            .map_err(|e| config_error(format!("bucket name {:?}: {e}", s3.bucket)))?;
        Ok(Storage::Object {
            store: Arc::new(store),
            url,
            prefix: if prefix.is_empty() {
                String::new()
            } else {
                format!("{prefix}/")
            },
        })
    }

    /// For messages: the directory or `s3://bucket/prefix`.
    pub(crate) fn describe(&self) -> String {
        match self {
            Storage::Local(dir) => dir.display().to_string(),
            Storage::Object { url, prefix, .. } => format!("{}{prefix}", url.as_str()),
        }
    }

    /// The URL DataFusion reads the file at `rel` (relative to the storage root) by. A path
    /// already absolute (a peer's file, [`crate::peers`]) is its own URL.
    pub(crate) fn file_url(&self, rel: &str) -> String {
        if rel.starts_with('/') || rel.contains("://") {
            return rel.to_owned();
        }
        match self {
            Storage::Local(dir) => dir.join(rel).to_string_lossy().into_owned(),
            Storage::Object { url, prefix, .. } => format!("{}{prefix}{rel}", url.as_str()),
        }
    }

    /// The object store to register on a query's runtime, if the files are remote.
    pub(crate) fn object_store(&self) -> Option<(&ObjectStoreUrl, &Arc<dyn ObjectStore>)> {
        match self {
            Storage::Local(_) => None,
            Storage::Object { store, url, .. } => Some((url, store)),
        }
    }

    fn key(prefix: &str, rel: &str) -> Result<ObjectPath> {
        let key = format!("{prefix}{rel}");
        ObjectPath::parse(&key).map_err(|e| Error::Corrupt {
            what: "object key",
            message: format!("{key:?}: {e}"),
        })
    }

    fn remote_error(&self, what: &'static str, rel: &str, e: object_store::Error) -> Error {
        Error::Io {
            what,
            path: PathBuf::from(self.file_url(rel)),
            source: std::io::Error::other(e),
        }
    }

    /// Writes a new immutable file. Locally it is fsynced with its directory before this
    /// returns, so a manifest written after it never lists a file a crash could lose.
    pub(crate) async fn put(&self, rel: &str, data: Bytes) -> Result<()> {
        match self {
            Storage::Local(dir) => {
                let path = dir.join(rel);
                blocking(move || write_synced(&path, &data)).await
            }
            Storage::Object { store, prefix, .. } => {
                let key = Self::key(prefix, rel)?;
                store
                    .put(&key, PutPayload::from_bytes(data))
                    .await
                    .map_err(|e| self.remote_error("writing", rel, e))?;
                Ok(())
            }
        }
    }

    pub(crate) async fn get(&self, rel: &str) -> Result<Bytes> {
        match self.get_opt(rel).await? {
            Some(data) => Ok(data),
            None => Err(Error::Io {
                what: "reading",
                path: PathBuf::from(self.file_url(rel)),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            }),
        }
    }

    async fn get_opt(&self, rel: &str) -> Result<Option<Bytes>> {
        match self {
            Storage::Local(dir) => {
                let path = dir.join(rel);
                blocking(move || match fs::read(&path) {
                    Ok(data) => Ok(Some(Bytes::from(data))),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(Error::io("reading", &path)(e)),
                })
                .await
            }
            Storage::Object { store, prefix, .. } => {
                let key = Self::key(prefix, rel)?;
                match store.get(&key).await {
                    Ok(got) => got
                        .bytes()
                        .await
                        .map(Some)
                        .map_err(|e| self.remote_error("reading", rel, e)),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(self.remote_error("reading", rel, e)),
                }
            }
        }
    }

    /// Deletes a file; one already gone is not an error.
    pub(crate) async fn delete(&self, rel: &str) -> Result<()> {
        match self {
            Storage::Local(dir) => {
                let path = dir.join(rel);
                blocking(move || match fs::remove_file(&path) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        Err(Error::io("removing", &path)(e))
                    }
                    _ => Ok(()),
                })
                .await
            }
            Storage::Object { store, prefix, .. } => {
                let key = Self::key(prefix, rel)?;
                match store.delete(&key).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                    Err(e) => Err(self.remote_error("deleting", rel, e)),
                }
            }
        }
    }

    /// Every file under the folder `under` (relative, without a trailing `/`), as relative
    /// paths.
    pub(crate) async fn list(&self, under: &str) -> Result<Vec<String>> {
        match self {
            Storage::Local(dir) => {
                let dir = dir.clone();
                let under = under.to_owned();
                blocking(move || {
                    let mut out = Vec::new();
                    let mut stack = vec![dir.join(&under)];
                    while let Some(d) = stack.pop() {
                        let entries = match fs::read_dir(&d) {
                            Ok(entries) => entries,
                            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                            Err(e) => return Err(Error::io("listing", &d)(e)),
                        };
                        for entry in entries {
                            let path = entry.map_err(Error::io("listing", &d))?.path();
                            if path.is_dir() {
                                stack.push(path);
                            } else if let Ok(rel) = path.strip_prefix(&dir) {
                                out.push(rel.to_string_lossy().into_owned());
                            }
                        }
                    }
                    Ok(out)
                })
                .await
            }
            Storage::Object { store, prefix, .. } => {
                let folder = Self::key(prefix, under)?;
                let metas: Vec<_> = store
                    .list(Some(&folder))
                    .try_collect()
                    .await
                    .map_err(|e| self.remote_error("listing", under, e))?;
                Ok(metas
                    .into_iter()
                    .filter_map(|m| {
                        m.location
                            .as_ref()
                            .strip_prefix(prefix.as_str())
                            .map(str::to_owned)
                    })
                    .collect())
            }
        }
    }

    /// The manifest, or `None` when there is none yet.
    pub(crate) async fn read_manifest(&self) -> Result<Option<Bytes>> {
        self.get_opt(MANIFEST).await
    }

    /// Replaces the manifest in one step: locally a synced temporary file renamed over it (and
    /// the directory synced); remotely one PUT, which readers see whole or not at all.
    pub(crate) async fn write_manifest(&self, data: Bytes) -> Result<()> {
        match self {
            Storage::Local(dir) => {
                let dir = dir.clone();
                blocking(move || {
                    let tmp = dir.join(format!("{MANIFEST}.tmp"));
                    let path = dir.join(MANIFEST);
                    let mut f = File::create(&tmp).map_err(Error::io("creating", &tmp))?;
                    f.write_all(&data)
                        .and_then(|()| f.sync_all())
                        .map_err(Error::io("writing", &tmp))?;
                    fs::rename(&tmp, &path).map_err(Error::io("renaming", &tmp))?;
                    File::open(&dir)
                        .and_then(|d| d.sync_all())
                        .map_err(Error::io("syncing directory", &dir))
                })
                .await
            }
            Storage::Object { .. } => self.put(MANIFEST, data).await,
        }
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Execution(format!("storage task failed: {e}")))?
}

fn write_synced(path: &Path, data: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(Error::io("creating directory", dir))?;
    let mut file = File::create(path).map_err(Error::io("creating", path))?;
    file.write_all(data)
        .and_then(|()| file.sync_all())
        .map_err(Error::io("writing", path))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(Error::io("syncing directory", dir))
}

/// Runs the start-up work `f` (reading the manifest, removing leftovers) on a private runtime
/// on a helper thread, so that [`crate::Store::open`] stays synchronous whether or not its
/// caller is inside a runtime. `f` gets its own [`Storage`], with its own connections, which
/// die with that runtime; the store keeps another for everything after.
pub(crate) fn at_startup<T: Send>(
    config: &StorageConfig,
    data_dir: &Path,
    f: impl AsyncFnOnce(Storage) -> Result<T> + Send,
) -> Result<T> {
    let storage = Storage::new(config, data_dir)?;
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(Error::io("starting the store's start-up runtime", data_dir))?;
                runtime.block_on(f(storage))
            })
            .join()
            .map_err(|_| Error::Execution("the store's start-up task panicked".into()))?
    })
}
