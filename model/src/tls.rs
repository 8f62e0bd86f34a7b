//! The process's one TLS provider.
//!
//! perch builds rustls with ring only (DataFusion's object store needs ring anyway). reqwest
//! 0.13 has no ring feature: built with `rustls-no-provider`, it takes the process's default
//! provider when a client is built, and panics when there is none. Every place that builds a
//! client calls [`use_ring`] first.

use std::sync::Once;

/// Installs ring as the process's default rustls provider, once; a provider installed before
/// (by a test, or an embedding program) stays.
pub fn use_ring() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if rustls::crypto::CryptoProvider::get_default().is_none() {
            // Losing a race to another installer is fine: there is a provider either way.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn ring_is_the_default_after_use_ring() {
        super::use_ring();
        super::use_ring();
        let p = rustls::crypto::CryptoProvider::get_default();
        assert!(p.is_some_and(|p| !p.cipher_suites.is_empty()));
    }
}
