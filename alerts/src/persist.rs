//! Saving state so a restart does not page again: JSON written to a temporary file in the
//! same directory, fsynced, renamed over the old file, and the directory fsynced, so a crash
//! at any point leaves either the old snapshot or the new one, never a torn file.

use crate::error::{Error, Result};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::Path;

/// Writes `value` as JSON to `path` atomically (temp file, fsync, rename, fsync directory).
pub fn save_json_atomic<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let io = |source| Error::Io {
        path: path.to_owned(),
        source,
    };
    let bytes = serde_json::to_vec(value).map_err(|e| io(std::io::Error::other(e)))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => Path::new(".").to_owned(),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "state".into());
    let tmp = dir.join(format!(".{name}.tmp"));
    {
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(io)?;
        file.write_all(&bytes).map_err(io)?;
        file.sync_all().map_err(io)?;
    }
    fs::rename(&tmp, path).map_err(io)?;
    // Make the rename itself durable.
    File::open(&dir).and_then(|d| d.sync_all()).map_err(io)?;
    Ok(())
}

/// Reads JSON from `path`; `Ok(None)` when the file does not exist.
pub fn load_json<T: DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(Error::Io {
                path: path.to_owned(),
                source,
            });
        }
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| Error::Snapshot {
            path: path.to_owned(),
            message: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_replaces_and_reports_garbage() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("alerts.json");
        assert_eq!(load_json::<Vec<u32>>(&path).expect("missing is fine"), None);
        save_json_atomic(&path, &vec![1u32, 2]).expect("save");
        save_json_atomic(&path, &vec![3u32]).expect("save again");
        assert_eq!(load_json::<Vec<u32>>(&path).expect("load"), Some(vec![3]));
        let leftovers: Vec<_> = fs::read_dir(dir.path())
            .expect("list")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        assert_eq!(leftovers.len(), 1, "no temp file left: {leftovers:?}");
        fs::write(&path, b"{not json").expect("write");
        let err = load_json::<Vec<u32>>(&path)
            .expect_err("garbage")
            .to_string();
        assert!(err.contains("move it away"), "{err}");
    }
}
