//! The node's lease, as the jobs' supervisors see it.
//!
//! Every answer to a sync renews the node's lease on the server ([`SyncResponse::lease_ms`]):
//! the server counts the node's jobs as running for that long after it received the request,
//! and requeues them only after that. The agent writes the lease's end into the root-only state
//! directory (`<jobs dir>/.state/lease`), measured from when it *sent* the request, so its
//! deadline is never later than the server's:
//!
//! ```text
//! perch-lease v1 <end, CLOCK_BOOTTIME ms> <lease length ms>
//! ```
//!
//! Each job's supervisor ([`super::shim`]) reads it once a second and stops its job before the
//! end, whether the agent is alive but cut off from the server or dead: the checkpoint signal
//! at [`Deadlines::signal_at`], SIGKILL to everything left at [`Deadlines::kill_at`]. A missing
//! or unreadable lease is an expired one: a supervisor that cannot prove its job may run stops
//! it. `CLOCK_BOOTTIME` keeps counting through suspend and ignores wall-clock changes; both
//! clocks (the server's and the node's) only measure lengths, so they need not agree.
//!
//! [`SyncResponse::lease_ms`]: perch_model::control::SyncResponse::lease_ms

use std::fs;
use std::path::Path;

const HEADER: &str = "perch-lease v1";
/// The file in the state directory.
pub const FILE: &str = "lease";

/// Milliseconds since boot, counting suspend (`CLOCK_BOOTTIME`), the same in every process.
pub fn boot_ms() -> i64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    t.tv_sec * 1000 + t.tv_nsec / 1_000_000
}

/// The node's lease: it ends at `end_ms` (boot time) and was granted for `length_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub end_ms: i64,
    pub length_ms: i64,
}

/// When a supervisor acts on a lease that is not renewed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// The job's checkpoint signal.
    pub signal_at: i64,
    /// SIGKILL to all of the job's processes.
    pub kill_at: i64,
}

impl Lease {
    /// How far ahead of the lease's end everything must be gone: a tenth of the lease, at least
    /// one second and at most thirty (the supervisor's polling and the server's tick).
    pub fn margin_ms(&self) -> i64 {
        (self.length_ms / 10).clamp(1_000, 30_000)
    }

    /// When a job with `grace_ms` of grace gets its signal and its SIGKILL: the grace before
    /// the kill, but never more than half the lease (a job whose grace is longer than its
    /// lease gets less).
    pub fn deadlines(&self, grace_ms: i64) -> Deadlines {
        let kill_at = self.end_ms - self.margin_ms();
        let grace = grace_ms.clamp(0, self.length_ms / 2);
        Deadlines {
            signal_at: kill_at - grace,
            kill_at,
        }
    }

    fn to_line(self) -> String {
        format!("{HEADER} {} {}\n", self.end_ms, self.length_ms)
    }

    fn parse(text: &str) -> Option<Lease> {
        let mut parts = text.trim().strip_prefix(HEADER)?.split_whitespace();
        let end_ms = parts.next()?.parse().ok()?;
        let length_ms = parts.next()?.parse().ok().filter(|&l: &i64| l > 0)?;
        parts
            .next()
            .is_none()
            .then_some(Lease { end_ms, length_ms })
    }

    /// The lease recorded in state directory `dir`; `None` when missing or unreadable.
    pub fn read(dir: &Path) -> Option<Lease> {
        Lease::parse(&fs::read_to_string(dir.join(FILE)).ok()?)
    }

    /// Records the lease in state directory `dir` (replaced atomically; not fsynced: it is
    /// rewritten twice a second and means nothing after a reboot).
    pub fn write(self, dir: &Path) -> std::io::Result<()> {
        super::groups::write_private(dir, FILE, self.to_line().as_bytes(), false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_leave_a_margin_and_the_grace_before_the_end() {
        let five_minutes = Lease {
            end_ms: 1_000_000,
            length_ms: 300_000,
        };
        assert_eq!(five_minutes.margin_ms(), 30_000);
        assert_eq!(
            five_minutes.deadlines(60_000),
            Deadlines {
                signal_at: 910_000,
                kill_at: 970_000
            }
        );
        // A grace longer than half the lease is cut to half of it.
        assert_eq!(five_minutes.deadlines(3_600_000).signal_at, 820_000);
        let short = Lease {
            end_ms: 10_000,
            length_ms: 4_000,
        };
        assert_eq!(short.margin_ms(), 1_000, "at least a second");
        assert_eq!(short.deadlines(0).signal_at, 9_000);
    }

    #[test]
    fn leases_round_trip_and_anything_else_reads_as_none() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(Lease::read(dir.path()), None, "no lease yet");
        let lease = Lease {
            end_ms: 123_456,
            length_ms: 300_000,
        };
        lease.write(dir.path()).expect("write");
        assert_eq!(Lease::read(dir.path()), Some(lease));
        for bad in [
            "",
            "perch-lease v1 5",
            "perch-lease v1 5 0",
            "perch-lease v2 5 5",
            "5 5",
        ] {
            assert_eq!(Lease::parse(bad), None, "{bad:?}");
        }
        assert!(boot_ms() > 0);
    }
}
