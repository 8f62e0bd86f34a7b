//! Starts the PostgreSQL front end (crate `perch-pgwire`) with what it takes from the server:
//! the SQL engine, the clock, the TLS acceptor and the [`Tokens`] as its
//! [`perch_pgwire::Authenticator`] (open mode names a local caller through [`auth::peer`], as
//! on HTTP).

use crate::auth::{self, Identity, Tokens};
use crate::{AppState, tls_acceptor};
use futures::future::BoxFuture;
use std::net::SocketAddr;

impl perch_pgwire::Authenticator for Tokens {
    fn is_open(&self) -> bool {
        Tokens::is_open(self)
    }

    fn identify(&self, token: &str, now_ms: i64) -> Result<Option<Identity>, String> {
        Tokens::identify(self, token, now_ms)
    }

    fn local_identity(
        &self,
        client: SocketAddr,
        server: SocketAddr,
    ) -> BoxFuture<'static, Result<Identity, String>> {
        Box::pin(auth::peer::local_identity(client, server))
    }
}

/// Starts the PostgreSQL listener on `addr` until `shutdown` resolves ([`perch_pgwire::start`]:
/// one that cannot bind is logged and left off). `Err` when the TLS certificate cannot be used.
pub(crate) async fn start(
    state: &AppState,
    addr: &str,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<Option<tokio::task::JoinHandle<()>>> {
    let services = perch_pgwire::Services {
        sql: state.sql.clone(),
        auth: state.tokens.clone(),
        clock: state.config.clock.clone(),
        tls: tls_acceptor(state, &[])?,
        max_connections: state.config.pg_max_connections,
    };
    Ok(perch_pgwire::start(addr, &state.config.store.data_dir, services, shutdown).await)
}
