//! TLS for the HTTP and PostgreSQL listeners: one certificate and key (PEM files named by
//! `server.tls_cert` and `server.tls_key`), read again on SIGHUP so a renewed certificate is
//! served to new connections without a restart.

use rustls::crypto::ring;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

/// Where the certificate chain and its key are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The certificate every new connection gets; swapped whole by [`Certificates::reload`].
#[derive(Debug)]
pub struct Certificates {
    files: TlsFiles,
    current: RwLock<Arc<CertifiedKey>>,
}

impl Certificates {
    /// Reads the files; an error says which file and what is wrong with it.
    pub fn load(files: TlsFiles) -> Result<Arc<Certificates>, String> {
        let key = read(&files)?;
        Ok(Arc::new(Certificates {
            files,
            current: RwLock::new(Arc::new(key)),
        }))
    }

    /// Reads the files again; on an error the certificate served so far stays.
    pub fn reload(&self) -> Result<(), String> {
        let key = read(&self.files)?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(key);
        Ok(())
    }

    /// The acceptor for a listener: TLS 1.2 and 1.3, no client certificates, HTTP/1.1 (the
    /// server speaks nothing else).
    pub fn acceptor(self: &Arc<Self>, alpn: &[&[u8]]) -> Result<tokio_rustls::TlsAcceptor, String> {
        let mut config =
            rustls::ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("TLS: {e}"))?
                .with_no_client_auth()
                .with_cert_resolver(self.clone());
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }
}

fn read(files: &TlsFiles) -> Result<CertifiedKey, String> {
    let chain = certificates(&files.cert)?;
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| {
        format!(
            "server.tls_key {}: no PEM private key could be read ({e}); give the key of server.tls_cert, unencrypted, in PEM",
            files.key.display()
        )
    })?;
    let signing = ring::sign::any_supported_type(&key).map_err(|e| {
        format!(
            "server.tls_key {}: the key cannot sign ({e})",
            files.key.display()
        )
    })?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match().map_err(|e| {
        format!(
            "server.tls_key {} is not the key of server.tls_cert {}: {e}",
            files.key.display(),
            files.cert.display()
        )
    })?;
    Ok(certified)
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let chain = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("server.tls_cert {}: {e}", path.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "server.tls_cert {}: no PEM certificate in it; give the server's certificate first, then its intermediates",
            path.display()
        ));
    }
    Ok(chain)
}
