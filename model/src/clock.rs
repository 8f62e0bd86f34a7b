//! The one clock of the server and its control plane. Every "now" the server takes (the control plane's operations and
//! ticks, token expiry, the alert and accounting loops, what `/metrics` and SQL's live tables
//! report, ingest's receive time) comes from the [`Clock`] in `perch_server::ServerConfig`: the
//! system's by default, a [`Clock::manual`] one in tests, which then run in virtual time.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

/// Milliseconds since the Unix epoch, from the system or set by hand. Clones share the time.
#[derive(Clone, Debug, Default)]
pub struct Clock(Option<Arc<AtomicI64>>);

impl Clock {
    /// The system's wall clock.
    pub fn system() -> Clock {
        Clock(None)
    }

    /// A clock that stands at `ms` until [`Clock::set`] or [`Clock::advance`] moves it.
    pub fn manual(ms: i64) -> Clock {
        Clock(Some(Arc::new(AtomicI64::new(ms))))
    }

    /// Now, in milliseconds since the Unix epoch.
    pub fn now_ms(&self) -> i64 {
        match &self.0 {
            Some(ms) => ms.load(Ordering::Relaxed),
            None => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64),
        }
    }

    /// Now, in microseconds since the Unix epoch (a manual clock: its milliseconds).
    pub fn now_micros(&self) -> i64 {
        match &self.0 {
            Some(ms) => ms.load(Ordering::Relaxed).saturating_mul(1000),
            None => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as i64),
        }
    }

    /// Sets a manual clock to `ms` (a system clock ignores it).
    pub fn set(&self, ms: i64) {
        if let Some(at) = &self.0 {
            at.store(ms, Ordering::Relaxed);
        }
    }

    /// Moves a manual clock `ms` forward (a system clock ignores it).
    pub fn advance(&self, ms: i64) {
        if let Some(at) = &self.0 {
            at.fetch_add(ms, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Clock;

    #[test]
    fn a_manual_clock_moves_only_when_told_and_its_clones_follow() {
        let c = Clock::manual(1_000);
        let shared = c.clone();
        assert_eq!((c.now_ms(), c.now_micros()), (1_000, 1_000_000));
        c.advance(500);
        assert_eq!(shared.now_ms(), 1_500);
        shared.set(42);
        assert_eq!(c.now_ms(), 42);
        let system = Clock::system();
        let before = system.now_ms();
        system.set(0);
        assert!(system.now_ms() >= before && before > 1_700_000_000_000);
    }
}
