//! Handing memory the process freed back to the system.
//!
//! glibc's allocator keeps what a burst of work freed in its arenas (one for each thread that
//! allocated, and the server has many), so a long-running command's resident memory stays at
//! the burst's peak: a server upgraded onto 30,000 settled jobs held 361 MB after writing
//! their rows, 211 MB once trimmed; after a few queries over the history read from the job
//! database, 445 MB and 278 MB (BENCHMARKS.md, "Memory handed back"). An operator watching
//! the server's RSS cannot tell that from a leak, and the kernel counts it against the
//! server's cgroup. So the long-running commands ask the allocator every [`TRIM_PERIOD`] to
//! return the free pages of every arena (`malloc_trim`); memory in use is not touched.

use std::time::Duration;

/// How often freed memory is handed back.
const TRIM_PERIOD: Duration = Duration::from_secs(30);

/// Starts handing freed memory back every [`TRIM_PERIOD`], on a thread of its own, for as
/// long as the process runs (once, however often it is called).
pub(crate) fn start_trimming() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("perch-trim".into())
            .spawn(|| {
                loop {
                    std::thread::sleep(TRIM_PERIOD);
                    if !tracing::enabled!(tracing::Level::DEBUG) {
                        trim();
                        continue;
                    }
                    let (before, started) = (resident_bytes(), std::time::Instant::now());
                    trim();
                    let took_ms = started.elapsed().as_secs_f64() * 1e3;
                    tracing::debug!(
                        before_mb = before >> 20,
                        after_mb = resident_bytes() >> 20,
                        took_ms,
                        "handed freed memory back"
                    );
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the thread that hands freed memory back; resident memory stays at its peak");
        }
    });
}

/// Asks the allocator to return every arena's free pages.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub(crate) fn trim() {
    // SAFETY: malloc_trim takes no pointers and locks each arena itself; it may be called
    // from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Other allocators (musl's) give freed memory back on their own.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(crate) fn trim() {}

/// The process's resident memory, in bytes (0 where `/proc` cannot tell): `VmRSS`, in KiB
/// whatever the machine's page size.
pub(crate) fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmRSS:")?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
        })
        .map_or(0, |kib| kib << 10)
}

#[cfg(test)]
mod tests {
    /// Memory freed in a burst, spread over threads as the server's work is, is handed back:
    /// resident memory falls once trimmed.
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn freed_memory_is_handed_back() {
        // Many small blocks on several threads (each gets an arena), all freed: glibc keeps
        // them, as it kept the server's records and rows.
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    let blocks: Vec<Vec<u8>> = (0..200_000).map(|i| vec![i as u8; 512]).collect();
                    // Keep one block in a thousand so the arena's top is not all free: only
                    // malloc_trim's release of pages inside the heap gives these back.
                    blocks.into_iter().step_by(1000).collect::<Vec<_>>()
                })
            })
            .collect();
        let kept: Vec<_> = threads
            .into_iter()
            .map(|t| t.join().expect("thread"))
            .collect();
        let before = super::resident_bytes();
        super::trim();
        let after = super::resident_bytes();
        assert!(before > 0);
        assert!(
            after + (100 << 20) < before,
            "resident {} MB before, {} MB after",
            before >> 20,
            after >> 20
        );
        drop(kept);
    }
}
