//! perch's PostgreSQL front end: SQL over the PostgreSQL wire protocol (pgwire), for `psql`,
//! Grafana's PostgreSQL data source and any other Postgres client.
//!
//! The server starts it with [`start`], handing it what it does not own ([`Services`]): the SQL
//! engine, an [`Authenticator`] (tokens, and the local user owning a connection in open mode),
//! the clock and the TLS acceptor. It depends on `perch-model` and `perch-query` only.
//!
//! Every statement, simple or extended protocol, goes through the same [`SqlEngine`] as
//! `POST /v1/sql`: a fresh DataFusion session per statement (so the store snapshot a query
//! pins is released when it ends and compaction can delete replaced files), the same
//! read-only check, timeout, memory limit and row cap. A connection holds no session state.
//!
//! Clients wrap queries in transactions and set session options (psycopg, JDBC and DBeaver do
//! `BEGIN`, `SET extra_float_digits = 3`...): transaction control is answered as done and
//! changes nothing, since there is nothing to commit and every statement gets a fresh session
//! anyway. So are `SET` and `RESET` of the display settings clients send on their own
//! ([`CLIENT_SETTINGS`]); any other `SET` (`statement_timeout`, a DataFusion option...) is
//! refused, as on HTTP, since perch would silently ignore it. Everything else must pass the
//! read-only check.
//!
//! Authentication follows the HTTP server's. With a tokens file, a client logs in with
//! cleartext password authentication whose password is a perch bearer token (`PGPASSWORD`,
//! Grafana's password field); the token, not the user name the client sends, says who it is,
//! so any user name works. User and operator tokens may run SQL; agent tokens may not, as on
//! `POST /v1/sql`. A wrong token is refused with SQLSTATE 28P01. Every statement checks the
//! login token again: one revoked (SIGHUP) or expired since ends the connection (FATAL 28000). Cleartext passwords are
//! what every client supports; keep the listener on a trusted network or tunnel it, as with
//! HTTP. Without a tokens file the listener takes no password, config refuses to bind it
//! anywhere but loopback, and a client is the local user owning its connection
//! ([`Authenticator::local_identity`], as on HTTP), whatever name it claims: root and the
//! server's user are operators.
//!
//! Catalog questions (`information_schema`, `pg_catalog`, `version()`, `SHOW ...`) are
//! rewritten into SQL DataFusion can answer; see [`catalog`]. Parameters (`$1`) are not
//! supported; results past `max_rows` are cut, as on HTTP.

mod catalog;
pub mod connection;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Float64Type, Int64Type, Schema, TimeUnit};
use async_trait::async_trait;
use futures::future::BoxFuture;
use futures::sink::{Sink, SinkExt};
use futures::stream;
use perch_model::clock::Clock;
use perch_model::identity::{Identity, Role};
use perch_query::SqlEngine;
use pgwire::api::auth::{
    DefaultServerParameterProvider, StartupHandler, finish_authentication, protocol_negotiation,
    save_startup_parameters_to_metadata,
};
use pgwire::api::portal::{Format, Portal};
use pgwire::api::query::{ExtendedQueryHandler, SimpleQueryHandler};
use pgwire::api::results::{DataRowEncoder, FieldInfo, QueryResponse, Response, Tag};
use pgwire::api::stmt::QueryParser;
use pgwire::api::{
    ClientInfo, METADATA_DATABASE, METADATA_USER, PgWireConnectionState, PgWireServerHandlers,
    PidSecretKeyGenerator, RandomPidSecretKeyGenerator, Type,
};
use pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use pgwire::messages::data::DataRow;
use pgwire::messages::startup::Authentication;
use pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::net::TcpListener;

/// Who a client is, as the server decides it: the front end speaks the protocol, the server
/// owns the tokens and knows whom a local connection belongs to.
pub trait Authenticator: Send + Sync {
    /// The server runs without tokens (open mode): clients send no password and are the local
    /// user owning their connection ([`Authenticator::local_identity`]).
    fn is_open(&self) -> bool;

    /// Who `token` (a client's password) belongs to at `now_ms`: `Err` with the reason, which
    /// the client is shown, when the server does not know it or it has expired; `Ok(None)` in
    /// open mode.
    fn identify(&self, token: &str, now_ms: i64) -> Result<Option<Identity>, String>;

    /// In open mode, the local user owning the connection from `client` to the listener at
    /// `server`, whatever name it claims (root and the server's user as operators): `Err` with
    /// the reason, which the client is shown, when it cannot be found.
    fn local_identity(
        &self,
        client: SocketAddr,
        server: SocketAddr,
    ) -> BoxFuture<'static, Result<Identity, String>>;
}

/// What the server hands the front end when it starts it.
#[derive(Clone)]
pub struct Services {
    /// Runs every statement: the engine `POST /v1/sql` uses.
    pub sql: Arc<SqlEngine>,
    /// Checks the password (a token) a client logs in with, again before each statement, and
    /// names the caller in open mode.
    pub auth: Arc<dyn Authenticator>,
    /// The server's clock: token expiry is read by it.
    pub clock: Clock,
    /// TLS, when the server has a certificate: a client that did not ask for it is then refused
    /// before it can send a password (a token) in clear text.
    pub tls: Option<pgwire::tokio::TlsAcceptor>,
    /// Connections served at once (`server.pg_max_connections`); the next waits in the kernel's
    /// backlog until one closes.
    pub max_connections: usize,
}

impl std::fmt::Debug for Services {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Services")
            .field("open", &self.auth.is_open())
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

/// Answers every connection; cheap to clone.
#[derive(Clone)]
struct PgHandler {
    sql: Arc<SqlEngine>,
    auth: Arc<dyn Authenticator>,
    /// The server's clock (token expiry).
    clock: Clock,
    /// The listener has a certificate: a client that did not ask for TLS is refused before it
    /// can send a password (a token) in clear text.
    require_tls: bool,
    pids: Arc<RandomPidSecretKeyGenerator>,
    /// The listener's address: in open mode a client is identified by the uid owning its
    /// connection to it ([`Authenticator::local_identity`]).
    local: Option<SocketAddr>,
}

/// In open mode, whether the connection's owner is an operator (root or the server's user).
const METADATA_PERCH_ROLE: &str = "perch.role";

/// Where a connection's perch identity is kept (client metadata), once its token is checked.
const METADATA_PERCH_USER: &str = "perch.user";
/// The token a connection logged in with (kept in memory only): every statement checks it
/// again, so a token that expires or is revoked (SIGHUP) ends the sessions opened with it.
const METADATA_PERCH_TOKEN: &str = "perch.token";

impl std::fmt::Debug for PgHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgHandler").finish()
    }
}

/// Binds `addr`, writes the bound address to `<data_dir>/pg.addr` (tests bind port 0) and
/// serves until `shutdown` resolves. A listener that cannot start is logged and left off:
/// HTTP (SQL included) keeps working, so a taken port does not take the server down.
pub async fn start(
    addr: &str,
    data_dir: &Path,
    services: Services,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Option<tokio::task::JoinHandle<()>> {
    let bound = async {
        let listener = TcpListener::bind(addr).await?;
        let bound = listener.local_addr()?;
        std::fs::write(data_dir.join("pg.addr"), format!("{bound}\n"))?;
        std::io::Result::Ok((listener, bound))
    };
    match bound.await {
        Ok((listener, bound)) => {
            if services.auth.is_open() {
                tracing::info!(listen = %bound, "PostgreSQL protocol (read-only SQL) listening without tokens: no password, each client is the local user owning its connection (set server.tokens_file to require a token as password)");
            } else {
                tracing::info!(listen = %bound, "PostgreSQL protocol (read-only SQL) listening: clients log in with a perch token as password");
            }
            if services.tls.is_some() {
                tracing::info!(listen = %bound, "PostgreSQL protocol offers TLS (sslmode=require or verify-full)");
            }
            Some(tokio::spawn(serve(listener, services, shutdown)))
        }
        Err(e) => {
            tracing::error!(listen = addr, error = %e, "the PostgreSQL listener could not start; SQL over HTTP still works (set [server] pg_listen to another address, or \"\" for none)");
            None
        }
    }
}

/// Serves the PostgreSQL protocol on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    services: Services,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let Services {
        sql,
        auth,
        clock,
        tls,
        max_connections,
    } = services;
    let max_statement = sql.limits().max_statement_bytes;
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections.max(1)));
    let handler = Arc::new(PgHandler {
        sql,
        auth,
        clock,
        require_tls: tls.is_some(),
        pids: Arc::new(RandomPidSecretKeyGenerator::default()),
        local: listener.local_addr().ok(),
    });
    tokio::pin!(shutdown);
    loop {
        // A slot first, then a descriptor: past the cap, clients wait in the backlog.
        let slot = tokio::select! {
            _ = &mut shutdown => return,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => return,
            },
        };
        tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((socket, _)) => {
                    let (handler, tls) = (handler.clone(), tls.clone());
                    tokio::spawn(async move {
                        let _slot = slot;
                        if let Err(e) = connection::serve(socket, tls, handler, max_statement).await {
                            tracing::debug!(error = %e, "PostgreSQL connection ended with an error");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "PostgreSQL listener could not accept; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

impl PgWireServerHandlers for PgHandler {
    fn simple_query_handler(&self) -> Arc<impl SimpleQueryHandler> {
        Arc::new(self.clone())
    }

    fn extended_query_handler(&self) -> Arc<impl ExtendedQueryHandler> {
        Arc::new(self.clone())
    }

    fn startup_handler(&self) -> Arc<impl pgwire::api::auth::StartupHandler> {
        Arc::new(self.clone())
    }
}

/// A FATAL error during login; the client shows `message`.
fn login_error(code: &str, message: String) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "FATAL".to_owned(),
        code.to_owned(),
        message,
    )))
}

/// What perch tells clients about itself once they are in.
fn server_parameters() -> DefaultServerParameterProvider {
    let mut p = DefaultServerParameterProvider::default();
    p.server_version = catalog::SERVER_VERSION.to_owned();
    p.is_superuser = false;
    p.default_transaction_read_only = true;
    p
}

impl PgHandler {
    /// Checks the password a client sent: a token the server knows, of a role that may run SQL.
    /// Returns the perch user it belongs to.
    fn check_token(&self, token: &str, claimed: &str) -> PgWireResult<String> {
        let identity = match self.auth.identify(token, self.clock.now_ms()) {
            Ok(Some(identity)) => identity,
            Ok(None) => {
                return Err(login_error(
                    "28P01",
                    format!(
                        "password authentication failed for user \"{claimed}\": the server runs without tokens"
                    ),
                ));
            }
            Err(why) => {
                return Err(login_error(
                    "28P01",
                    format!(
                        "password authentication failed for user \"{claimed}\": {why}. perch expects a token from the server's tokens file as the password (PGPASSWORD=<token>, or the data source's password field); any user name works"
                    ),
                ));
            }
        };
        if identity.role == Role::Agent {
            return Err(login_error(
                "28000",
                format!(
                    "the token of {} has role agent, which may not run SQL (as on POST /v1/sql); log in with a user or operator token",
                    identity.user
                ),
            ));
        }
        Ok(identity.user.clone())
    }

    /// Lets the client in: the identity (and the token, with a tokens file) to remember, then
    /// the server's parameters.
    async fn admit<C>(
        &self,
        client: &mut C,
        user: String,
        token: Option<String>,
    ) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send,
        C::Error: std::fmt::Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let metadata = client.metadata_mut();
        metadata.insert(METADATA_PERCH_USER.to_owned(), user);
        if let Some(token) = token {
            metadata.insert(METADATA_PERCH_TOKEN.to_owned(), token);
        }
        let (pid, secret) = self.pids.generate(client);
        client.set_pid_and_secret_key(pid, secret);
        finish_authentication(client, &server_parameters()).await
    }
}

#[async_trait]
impl StartupHandler for PgHandler {
    async fn on_startup<C>(
        &self,
        client: &mut C,
        message: PgWireFrontendMessage,
    ) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: std::fmt::Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        match message {
            PgWireFrontendMessage::Startup(ref startup) => {
                if self.require_tls && !client.is_secure() {
                    return Err(login_error(
                        "28000",
                        "this server accepts TLS connections only: connect with sslmode=verify-full (sslrootcert=<the server's CA>) or sslmode=require".to_owned(),
                    ));
                }
                protocol_negotiation(client, startup).await?;
                save_startup_parameters_to_metadata(client, startup);
                if self.auth.is_open() {
                    // Open mode: the caller is the local user owning the connection, whatever
                    // name it claims, as on HTTP.
                    let identity = match self.local {
                        Some(server) => {
                            self.auth.local_identity(client.socket_addr(), server).await
                        }
                        None => Err("the listener's own address is unknown".to_owned()),
                    }
                    .map_err(|why| login_error("28000", why))?;
                    let role = if identity.role == Role::Operator {
                        "operator"
                    } else {
                        "user"
                    };
                    client
                        .metadata_mut()
                        .insert(METADATA_PERCH_ROLE.to_owned(), role.to_owned());
                    return self.admit(client, identity.user, None).await;
                }
                client.set_state(PgWireConnectionState::AuthenticationInProgress);
                client
                    .send(PgWireBackendMessage::Authentication(
                        Authentication::CleartextPassword,
                    ))
                    .await?;
            }
            PgWireFrontendMessage::PasswordMessageFamily(password) => {
                let password = password.into_password()?;
                let claimed = client
                    .metadata()
                    .get(METADATA_USER)
                    .cloned()
                    .unwrap_or_default();
                let user = self.check_token(&password.password, &claimed)?;
                tracing::debug!(user, claimed, client = %client.socket_addr(), "PostgreSQL client logged in");
                self.admit(client, user, Some(password.password)).await?;
            }
            _ => {}
        }
        Ok(())
    }
}

impl PgHandler {
    /// The catalog's view of the connection: who it is and which database it named. With a
    /// tokens file, the token the connection logged in with is checked again first: one that
    /// has expired or been revoked since ends the connection (FATAL), as a new login would be
    /// refused.
    ///
    /// Whether the token is an operator's is read then too, so a role changed since login
    /// (SIGHUP) holds from the next statement. In open mode the connection's owner decided it
    /// at login: root and the server's user are operators.
    fn session<C: ClientInfo>(&self, client: &C) -> PgWireResult<Caller> {
        let meta = client.metadata();
        let mut operator = meta
            .get(METADATA_PERCH_ROLE)
            .is_some_and(|role| role == "operator");
        if !self.auth.is_open() {
            let checked = match meta.get(METADATA_PERCH_TOKEN) {
                Some(token) => match self.auth.identify(token, self.clock.now_ms()) {
                    Ok(Some(identity)) if identity.role == Role::Agent => Err(format!(
                        "the token of {} now has role agent, which may not run SQL",
                        identity.user
                    )),
                    Ok(identity) => {
                        operator = identity.is_some_and(|i| i.role == Role::Operator);
                        Ok(())
                    }
                    Err(why) => Err(why),
                },
                None => Err("the connection logged in without a token".to_owned()),
            };
            if let Err(why) = checked {
                return Err(login_error(
                    "28000",
                    format!("the session ends: {why}. Log in again with a valid token"),
                ));
            }
        }
        let session = catalog::Session {
            user: meta
                .get(METADATA_PERCH_USER)
                .cloned()
                .unwrap_or_else(|| "perch".to_owned()),
            database: meta
                .get(METADATA_DATABASE)
                .cloned()
                .unwrap_or_else(|| "perch".to_owned()),
        };
        Ok(Caller { session, operator })
    }
}

/// Who runs a statement: the catalog's view of the connection, and whether its token is an
/// operator's. The engine shares its SQL slots by user and keeps one for operators.
struct Caller {
    session: catalog::Session,
    operator: bool,
}

fn user_error(e: perch_query::Error) -> PgWireError {
    use perch_query::Error as E;
    let code = match &e {
        E::ReadOnly(_) => "25006",
        E::BadQuery(_) => "42000",
        // statement_too_complex, as Postgres answers a statement past its stack depth.
        E::TooComplex(_) => "54001",
        E::Timeout { .. } => "57014",
        E::ResourcesExhausted { .. } => "53200",
        E::Busy(_) => "53000",
        _ => "XX000",
    };
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "ERROR".to_owned(),
        code.to_owned(),
        e.to_string(),
    )))
}

/// The Postgres type a column is sent as, and how its values are converted first.
fn pg_type(data_type: &DataType) -> Type {
    match data_type {
        DataType::Boolean => Type::BOOL,
        DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => Type::INT8,
        DataType::UInt8 | DataType::UInt16 | DataType::UInt32 | DataType::UInt64 => Type::INT8,
        DataType::Float16 | DataType::Float32 | DataType::Float64 => Type::FLOAT8,
        DataType::Timestamp(_, Some(_)) => Type::TIMESTAMPTZ,
        DataType::Timestamp(_, None) => Type::TIMESTAMP,
        _ => Type::TEXT,
    }
}

fn fields(schema: &Schema, format: &Format) -> Vec<FieldInfo> {
    schema
        .fields()
        .iter()
        .enumerate()
        .map(|(i, f)| {
            FieldInfo::new(
                f.name().clone(),
                None,
                None,
                pg_type(f.data_type()),
                format.format_for(i),
            )
        })
        .collect()
}

fn arrow_error(e: arrow::error::ArrowError) -> PgWireError {
    PgWireError::ApiError(Box::new(e))
}

/// Encodes every row of `batch` for the client.
fn encode(batch: &RecordBatch, fields: &Arc<Vec<FieldInfo>>) -> PgWireResult<Vec<DataRow>> {
    let mut columns = Vec::with_capacity(batch.num_columns());
    for (column, field) in batch.columns().iter().zip(fields.iter()) {
        let target = match *field.datatype() {
            Type::BOOL => DataType::Boolean,
            Type::INT8 => DataType::Int64,
            Type::FLOAT8 => DataType::Float64,
            Type::TIMESTAMPTZ => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            Type::TIMESTAMP => DataType::Timestamp(TimeUnit::Microsecond, None),
            _ => DataType::Utf8,
        };
        columns.push(cast(column, &target).map_err(arrow_error)?);
    }
    let mut encoder = DataRowEncoder::new(fields.clone());
    let mut rows = Vec::with_capacity(batch.num_rows());
    for row in 0..batch.num_rows() {
        for column in &columns {
            let null = column.is_null(row);
            match column.data_type() {
                DataType::Boolean => {
                    let v = column.as_boolean().value(row);
                    encoder.encode_field(&(!null).then_some(v))?;
                }
                DataType::Int64 => {
                    let v = column.as_primitive::<Int64Type>().value(row);
                    encoder.encode_field(&(!null).then_some(v))?;
                }
                DataType::Float64 => {
                    let v = column.as_primitive::<Float64Type>().value(row);
                    encoder.encode_field(&(!null).then_some(v))?;
                }
                DataType::Timestamp(..) => {
                    let micros = column
                        .as_primitive::<arrow::datatypes::TimestampMicrosecondType>()
                        .value(row);
                    let time = (!null).then(|| system_time(micros));
                    encoder.encode_field(&time)?;
                }
                _ => {
                    let v = column.as_string::<i32>().value(row);
                    encoder.encode_field(&(!null).then_some(v))?;
                }
            }
        }
        rows.push(encoder.take_row());
    }
    Ok(rows)
}

fn system_time(micros: i64) -> SystemTime {
    let magnitude = Duration::from_micros(micros.unsigned_abs());
    if micros >= 0 {
        SystemTime::UNIX_EPOCH + magnitude
    } else {
        SystemTime::UNIX_EPOCH - magnitude
    }
}

/// `sql` after any leading whitespace, semicolons and comments.
fn skip_comments(mut sql: &str) -> &str {
    loop {
        sql = sql.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
        if let Some(rest) = sql.strip_prefix("--") {
            sql = rest.split_once('\n').map_or("", |(_, after)| after);
        } else if let Some(rest) = sql.strip_prefix("/*") {
            sql = rest.split_once("*/").map_or("", |(_, after)| after);
        } else {
            return sql;
        }
    }
}

/// Session settings clients send by themselves, acknowledged and ignored: they only steer how
/// a client shows results (perch always answers in UTF-8, ISO dates and UTC).
const CLIENT_SETTINGS: &[&str] = &[
    "application_name",
    "bytea_output",
    "client_encoding",
    "client_min_messages",
    "datestyle",
    "extra_float_digits",
    "intervalstyle",
    "lc_messages",
    "lc_monetary",
    "lc_numeric",
    "lc_time",
    "search_path",
    "standard_conforming_strings",
    "time zone",
    "timezone",
];

/// The setting a `SET`/`RESET` statement names (`SET SESSION x TO 1`, `SET LOCAL x = 1`,
/// `RESET ALL`), lower case.
fn setting_named(sql: &str) -> String {
    let words: Vec<String> = sql
        .trim()
        .trim_end_matches(';')
        .split(|c: char| c.is_whitespace() || c == '=')
        .filter(|w| !w.is_empty())
        .skip(1)
        // Three words at most, each cut short: the statement may be as long as a message.
        .take(3)
        .map(|w| w[..w.floor_char_boundary(64)].to_ascii_lowercase())
        .collect();
    let mut words = words.iter().map(String::as_str).peekable();
    if matches!(words.peek(), Some(&"session" | &"local")) {
        words.next();
    }
    match (words.next(), words.next()) {
        (Some("time"), Some("zone")) => "time zone".into(),
        (Some(name), _) => name.trim_matches('"').to_owned(),
        (None, _) => String::new(),
    }
}

/// The answer to a statement that only steers the client's session (see the module docs),
/// or to one with nothing but comments (drivers ping with `-- ping`).
fn client_command(sql: &str) -> Option<Response> {
    let sql = skip_comments(sql);
    if sql.is_empty() {
        return Some(Response::EmptyQuery);
    }
    let words: Vec<String> = sql
        .trim()
        .trim_end_matches(';')
        .split_whitespace()
        .take(2)
        .map(|w| w[..w.floor_char_boundary(16)].to_ascii_uppercase())
        .collect();
    let first = words.first()?.as_str();
    let second = words.get(1).map(String::as_str);
    match (first, second) {
        ("BEGIN", _) | ("START", Some("TRANSACTION")) => {
            Some(Response::TransactionStart(Tag::new("BEGIN")))
        }
        ("COMMIT" | "END", _) => Some(Response::TransactionEnd(Tag::new("COMMIT"))),
        ("ROLLBACK" | "ABORT", _) => Some(Response::TransactionEnd(Tag::new("ROLLBACK"))),
        ("SET" | "RESET", _) => {
            let name = setting_named(sql);
            if CLIENT_SETTINGS.contains(&name.as_str()) || (first == "RESET" && name == "all") {
                Some(Response::Execution(Tag::new(first)))
            } else {
                Some(Response::Error(Box::new(ErrorInfo::new(
                    "ERROR".to_owned(),
                    "0A000".to_owned(),
                    format!(
                        "{first} {name} is not supported: perch's SQL is read-only and its limits (timeout, memory, rows) are the server's (config [query]); only display settings clients send themselves ({}) are accepted, and ignored",
                        CLIENT_SETTINGS.join(", ")
                    ),
                ))))
            }
        }
        _ => None,
    }
}

impl PgHandler {
    /// [`catalog::rewrite`] of a statement the engine's limits take, on the SQL runtime:
    /// parsing, visiting, printing and dropping a syntax tree recurse as deep as the statement
    /// nests, which the limits bound and the SQL threads' stacks are sized for, and this
    /// connection's task is not.
    async fn rewrite(&self, sql: &str, session: &catalog::Session) -> PgWireResult<Option<String>> {
        self.sql.check(sql).map_err(user_error)?;
        let (sql, session) = (sql.to_owned(), session.clone());
        perch_query::sql_runtime()
            .spawn(async move { catalog::rewrite(&sql, &session) })
            .await
            .map_err(|e| PgWireError::ApiError(Box::new(e)))
    }

    async fn run(&self, sql: &str, caller: &Caller, format: &Format) -> PgWireResult<Response> {
        if let Some(response) = client_command(sql) {
            return Ok(response);
        }
        let rewritten = self.rewrite(sql, &caller.session).await?;
        if let Some(rewritten) = &rewritten {
            tracing::debug!(sql, rewritten, "PostgreSQL catalog query rewritten");
        }
        let sql = rewritten.as_deref().unwrap_or(sql);
        let out = self
            .sql
            .query_as(sql, &caller.session.user, caller.operator)
            .await
            .map_err(user_error)?;
        let fields = Arc::new(fields(&out.schema, format));
        let mut rows = Vec::with_capacity(out.rows);
        for batch in &out.batches {
            rows.extend(encode(batch, &fields)?);
        }
        Ok(Response::Query(QueryResponse::new(
            fields,
            stream::iter(rows.into_iter().map(Ok)),
        )))
    }
}

#[async_trait]
impl SimpleQueryHandler for PgHandler {
    async fn do_query<C>(&self, client: &mut C, query: &str) -> PgWireResult<Vec<Response>>
    where
        C: ClientInfo + pgwire::api::ClientPortalStore + Unpin + Send + Sync,
        C::PortalStore: pgwire::api::store::PortalStore,
    {
        let caller = self.session(client)?;
        Ok(vec![self.run(query, &caller, &Format::UnifiedText).await?])
    }
}

/// A parsed statement: its text and the columns it returns.
#[derive(Debug, Clone)]
struct PgStatement {
    sql: String,
    schema: Arc<Schema>,
}

impl PgHandler {
    /// The columns `sql` returns, planned like [`PgHandler::run`] would run it.
    async fn describe(&self, sql: &str, caller: &Caller) -> PgWireResult<Arc<Schema>> {
        if client_command(sql).is_some() {
            return Ok(Arc::new(Schema::empty()));
        }
        let rewritten = self.rewrite(sql, &caller.session).await?;
        let sql = rewritten.as_deref().unwrap_or(sql);
        self.sql
            .describe_as(sql, &caller.session.user, caller.operator)
            .await
            .map_err(user_error)
    }
}

#[async_trait]
impl QueryParser for PgHandler {
    type Statement = PgStatement;

    async fn parse_sql<C>(
        &self,
        client: &C,
        sql: &str,
        _types: &[Option<Type>],
    ) -> PgWireResult<Option<PgStatement>>
    where
        C: ClientInfo + Unpin + Send + Sync,
    {
        let schema = self.describe(sql, &self.session(client)?).await?;
        Ok(Some(PgStatement {
            sql: sql.to_owned(),
            schema,
        }))
    }

    fn get_parameter_types(&self, _stmt: &PgStatement) -> PgWireResult<Vec<Type>> {
        Ok(vec![])
    }

    fn get_result_schema(
        &self,
        stmt: &PgStatement,
        column_format: Option<&Format>,
    ) -> PgWireResult<Vec<FieldInfo>> {
        Ok(fields(
            &stmt.schema,
            column_format.unwrap_or(&Format::UnifiedText),
        ))
    }
}

#[async_trait]
impl ExtendedQueryHandler for PgHandler {
    type Statement = PgStatement;
    type QueryParser = PgHandler;

    fn query_parser(&self) -> Arc<PgHandler> {
        Arc::new(self.clone())
    }

    async fn do_query<C>(
        &self,
        client: &mut C,
        portal: &Portal<PgStatement>,
        _max_rows: usize,
    ) -> PgWireResult<Response>
    where
        C: ClientInfo
            + pgwire::api::ClientPortalStore
            + futures::Sink<pgwire::messages::PgWireBackendMessage>
            + Unpin
            + Send
            + Sync,
        C::PortalStore: pgwire::api::store::PortalStore<Statement = PgStatement>,
        C::Error: std::fmt::Debug,
        PgWireError: From<<C as futures::Sink<pgwire::messages::PgWireBackendMessage>>::Error>,
    {
        let caller = self.session(client)?;
        self.run(
            &portal.statement.statement.sql,
            &caller,
            &portal.result_column_format,
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{ArrayRef, Float64Array, StringArray, TimestampMillisecondArray};
    use arrow::datatypes::Field;

    #[test]
    fn session_commands_are_acknowledged_and_nothing_else() {
        let tag = |sql: &str| match client_command(sql) {
            Some(Response::TransactionStart(_)) => "begin",
            Some(Response::TransactionEnd(_)) => "end",
            Some(Response::Execution(_)) => "set",
            Some(Response::EmptyQuery) => "empty",
            Some(_) => "other",
            None => "query",
        };
        assert_eq!(tag("begin;"), "begin");
        assert_eq!(tag("START TRANSACTION READ ONLY"), "begin");
        assert_eq!(tag(" commit "), "end");
        assert_eq!(tag("ROLLBACK"), "end");
        assert_eq!(tag("SET extra_float_digits = 3"), "set");
        assert_eq!(tag("set SESSION application_name TO 'psql'"), "set");
        assert_eq!(tag("SET TIME ZONE 'UTC'"), "set");
        assert_eq!(tag("SET DateStyle=ISO"), "set");
        assert_eq!(tag("RESET ALL"), "set");
        // Settings perch would silently ignore are refused.
        assert_eq!(tag("SET statement_timeout = 0"), "other");
        assert_eq!(
            tag("SET datafusion.execution.target_partitions = 64"),
            "other"
        );
        assert_eq!(tag("set local work_mem to '64GB'"), "other");
        assert_eq!(tag("SELECT 1"), "query");
        assert_eq!(tag("INSERT INTO t VALUES (1)"), "query");
        assert_eq!(tag("-- ping"), "empty");
        assert_eq!(tag(" /* a */ ;"), "empty");
        assert_eq!(tag("-- why\nBEGIN"), "begin");
        assert_eq!(tag("/* x */ SELECT 1"), "query");
    }

    #[test]
    fn encodes_nulls_numbers_text_and_times() {
        let schema = Arc::new(Schema::new(vec![
            Field::new(
                "time",
                DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
                false,
            ),
            Field::new("v", DataType::Float64, true),
            Field::new("s", DataType::Utf8, true),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(
                    TimestampMillisecondArray::from(vec![1_800_000_000_000]).with_timezone("UTC"),
                ) as ArrayRef,
                Arc::new(Float64Array::from(vec![None])),
                Arc::new(StringArray::from(vec![Some("x")])),
            ],
        )
        .expect("batch");
        let fields = Arc::new(fields(&schema, &Format::UnifiedText));
        assert_eq!(
            fields
                .iter()
                .map(|f| f.datatype().clone())
                .collect::<Vec<_>>(),
            vec![Type::TIMESTAMPTZ, Type::FLOAT8, Type::TEXT]
        );
        let rows = encode(&batch, &fields).expect("encodes");
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].field_count, 3);
    }
}
