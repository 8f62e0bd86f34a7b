//! A PostgreSQL server of the tests' own: Debian's `postgres` binaries (package
//! `postgresql`, installed by `scripts/test.sh`), a fresh cluster in a temporary directory,
//! listening on a Unix socket there only (no port to collide with), stopped on drop. As root
//! it runs as the `postgres` user, as PostgreSQL refuses to run as root.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running test database.
pub struct TempPostgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    child: Option<Child>,
}

/// The newest installed PostgreSQL's binaries (`/usr/lib/postgresql/<version>/bin`).
pub fn bin_dir() -> Result<PathBuf, String> {
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(root)
        .map_err(|e| {
            format!(
                "{}: {e}; install Debian's postgresql package (scripts/test.sh does)",
                root.display()
            )
        })?
        .filter_map(|d| d.ok())
        .filter_map(|d| {
            let v = d.file_name().to_str()?.parse().ok()?;
            let bin = d.path().join("bin");
            bin.join("postgres").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .ok_or_else(|| "no PostgreSQL server under /usr/lib/postgresql: install Debian's postgresql package (scripts/test.sh does)".into())
}

fn as_postgres(program: &Path) -> Command {
    if nix::unistd::geteuid().is_root() {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid=postgres",
            "--regid=postgres",
            "--clear-groups",
            "--",
        ])
        .arg(program);
        c
    } else {
        Command::new(program)
    }
}

impl TempPostgres {
    /// Creates a cluster and starts it; fails saying what is missing.
    pub fn start() -> Result<TempPostgres, String> {
        let bin = bin_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("perch-pg-")
            .tempdir()
            .map_err(|e| e.to_string())?;
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .map_err(|e| e.to_string())?;
        let data = dir.path().join("data");
        let out = as_postgres(&bin.join("initdb"))
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
                "-D",
            ])
            .arg(&data)
            .output()
            .map_err(|e| format!("initdb: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let mut pg = TempPostgres {
            dir,
            bin,
            child: None,
        };
        pg.resume()?;
        Ok(pg)
    }

    /// The connection string (`host=<socket dir> user=postgres dbname=postgres`).
    pub fn url(&self) -> String {
        format!(
            "host={} user=postgres dbname=postgres",
            self.dir.path().display()
        )
    }

    /// The directory holding the socket `.s.PGSQL.5432`.
    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Stops the server (fast shutdown: sessions are ended, commits kept).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SIGINT: PostgreSQL's fast shutdown.
            let _ = Command::new("kill")
                .args(["-INT", &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same cluster, once stopped; returns when it takes connections.
    pub fn resume(&mut self) -> Result<(), String> {
        let log = std::fs::File::create(self.dir.path().join("postgres.log"))
            .map_err(|e| e.to_string())?;
        let child = as_postgres(&self.bin.join("postgres"))
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .arg("-k")
            .arg(self.dir.path())
            .args(["-c", "listen_addresses=", "-c", "max_connections=200"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting postgres: {e}"))?;
        self.child = Some(child);
        let started = Instant::now();
        let config: postgres::Config = self.url().parse().map_err(|e| format!("{e}"))?;
        loop {
            match config.connect(postgres::NoTls) {
                Ok(_) => return Ok(()),
                Err(e) if started.elapsed() > Duration::from_secs(60) => {
                    let log = std::fs::read_to_string(self.dir.path().join("postgres.log"))
                        .unwrap_or_default();
                    return Err(format!(
                        "PostgreSQL did not start in 60 s: {e}; its log: {log}"
                    ));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

impl Drop for TempPostgres {
    fn drop(&mut self) {
        self.stop();
    }
}
