//! The HTTP listener's own limits, so that idle or stalled clients cannot exhaust the server's
//! file descriptors (20,000 half-open connections left SQL unanswered, the built-in agent
//! unable to read `/proc` and the alert state unsaved):
//!
//! - at most `max_connections` connections are open at once; the next waits in the kernel's
//!   backlog until one closes (a descriptor is only taken once a slot is free);
//! - at most `max_per_ip` of them from one address; more from it are closed at once, so one
//!   host cannot take every slot and keep the nodes' agents out (their syncs would wait in
//!   the backlog until the nodes were marked down);
//! - a connection on which nothing is read or written for `idle_timeout` is closed: a client
//!   that connects and sends nothing, stops mid-request, or keeps an idle keep-alive
//!   connection. A request being served is not idle while it writes, and the server reads
//!   nothing from a client while it computes an answer.
//!
//! - a request's head and body must arrive within `request_timeout` of its first byte, however
//!   steadily they trickle in (a request sent a byte a second stayed open for minutes);
//! - at either cap, a new connection is not left waiting behind idle ones: the connection that
//!   has done nothing for longest, serving no request, is closed to make room ([`Registry`]).
//!   A connection that has carried an agent's sync is never closed so, and beyond an address's
//!   cap up to [`PROBATION_PER_IP`] more are taken on probation, served only for agents' syncs
//!   and telemetry: processes on a node (its jobs) share its agent's address, and a reconnect
//!   loop among them must not lock the agent out.
//!
//! With TLS (`server.tls_cert`), each connection's handshake runs on the connection's own task
//! (on its first read or write), never in the accept loop, so a client that stalls mid-handshake
//! holds up no one, and is closed by the idle timeout like any other.

use axum::response::IntoResponse;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// The listener's limits (`server.max_connections`, `server.idle_timeout_secs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    /// Connections open at once from one IP address (`server.max_connections_per_ip`).
    pub max_per_ip: usize,
    pub idle_timeout: Duration,
    /// The most a request's head and body may take from their first byte
    /// (`server.request_timeout_secs`).
    pub request_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 4096,
            max_per_ip: 256,
            idle_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
        }
    }
}

/// Connections an address may open past `max_per_ip`, on probation: each is served only for
/// agents' routes ([`crate::routes::for_agents`]).
pub const PROBATION_PER_IP: usize = 16;

/// "None" in the millisecond fields of [`Conn`].
const NEVER: u64 = u64::MAX;

/// What the server knows of one open connection, shared by its stream, the listener (to pick
/// one to close) and the requests it carries ([`Peer`]).
#[derive(Debug)]
pub struct Conn {
    ip: std::net::IpAddr,
    /// Accepted beyond its address's cap: served for agents' routes only.
    probation: bool,
    /// The registry's epoch, and the listener's request timeout.
    epoch: Instant,
    request_timeout: Duration,
    /// Milliseconds since the registry's epoch: of the last byte moved, and of the first byte
    /// of a request head not yet handed to a handler ([`NEVER`]: none).
    last_ms: AtomicU64,
    head_ms: AtomicU64,
    /// Requests in handlers now.
    active: AtomicUsize,
    /// It carried an agent's sync or telemetry, accepted: never closed to make room.
    kept: AtomicBool,
    /// Closed to make room: its next read or write fails.
    evicted: AtomicBool,
    waker: futures::task::AtomicWaker,
    /// In open mode, the local user owning the connection, found once for all its requests
    /// ([`crate::auth::peer`]): a socket's owner does not change.
    pub owner: tokio::sync::OnceCell<Result<crate::auth::Identity, String>>,
}

impl Conn {
    /// Whether it may be closed to make room: no request in a handler, no agent's.
    fn idle(&self) -> bool {
        self.active.load(Ordering::Acquire) == 0
            && !self.kept.load(Ordering::Relaxed)
            && !self.evicted.load(Ordering::Relaxed)
    }

    fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Whether it was taken beyond its address's cap ([`PROBATION_PER_IP`]).
    pub fn on_probation(&self) -> bool {
        self.probation
    }

    /// A request reached its handler: its head is in, and the connection is busy until the
    /// returned guard is dropped.
    pub fn begin_request(self: &Arc<Conn>) -> RequestGuard {
        self.active.fetch_add(1, Ordering::AcqRel);
        self.head_ms.store(NEVER, Ordering::Release);
        RequestGuard(self.clone())
    }

    /// The connection carried an agent's sync or telemetry: it is never closed to make room.
    pub fn keep(&self) {
        self.kept.store(true, Ordering::Relaxed);
    }

    /// When the request whose head is arriving must be in, body and all; `None` when no
    /// head is arriving (call before [`Conn::begin_request`]).
    pub fn request_deadline(&self) -> Option<Instant> {
        let head = self.head_ms.load(Ordering::Acquire);
        (head != NEVER).then(|| self.epoch + Duration::from_millis(head) + self.request_timeout)
    }
}

/// A request in a handler ([`Conn::begin_request`]).
pub struct RequestGuard(Arc<Conn>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The open connections, and how many each address holds.
#[derive(Debug)]
pub struct Registry {
    epoch: Instant,
    request_timeout: Duration,
    next: AtomicU64,
    conns: std::sync::Mutex<std::collections::HashMap<u64, Arc<Conn>>>,
}

impl Registry {
    fn new(request_timeout: Duration) -> Registry {
        Registry {
            epoch: Instant::now(),
            request_timeout,
            next: AtomicU64::new(0),
            conns: std::sync::Mutex::default(),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(NEVER - 1)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, Arc<Conn>>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a connection from `ip`: within its cap, or (that full) after closing the
    /// longest idle of its own to make room, or on probation; `None` when even its probation
    /// places are taken.
    fn open(
        self: &Arc<Registry>,
        ip: std::net::IpAddr,
        max_per_ip: usize,
    ) -> Option<(u64, Arc<Conn>)> {
        let mut conns = self.lock();
        let (mut held, mut on_probation) = (0, 0);
        for c in conns
            .values()
            .filter(|c| c.ip == ip && !c.evicted.load(Ordering::Relaxed))
        {
            if c.probation {
                on_probation += 1;
            } else {
                held += 1;
            }
        }
        let probation = if held < max_per_ip {
            false
        } else if let Some(victim) = Self::longest_idle(conns.iter(), Some(ip)) {
            victim.evict();
            false
        } else if on_probation < PROBATION_PER_IP {
            true
        } else {
            return None;
        };
        let now = self.now_ms();
        let conn = Arc::new(Conn {
            ip,
            probation,
            epoch: self.epoch,
            request_timeout: self.request_timeout,
            last_ms: AtomicU64::new(now),
            head_ms: AtomicU64::new(NEVER),
            active: AtomicUsize::new(0),
            kept: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            waker: futures::task::AtomicWaker::new(),
            owner: tokio::sync::OnceCell::new(),
        });
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        conns.insert(id, conn.clone());
        Some((id, conn))
    }

    /// Closes the connection idle longest (of `ip`'s, if given); false when none may be.
    fn evict_one(&self, ip: Option<std::net::IpAddr>) -> bool {
        let conns = self.lock();
        match Self::longest_idle(conns.iter(), ip) {
            Some(victim) => {
                victim.evict();
                true
            }
            None => false,
        }
    }

    /// The connection idle longest (of `ip`'s, if given), the oldest of those idle as long.
    fn longest_idle<'a>(
        conns: impl Iterator<Item = (&'a u64, &'a Arc<Conn>)>,
        ip: Option<std::net::IpAddr>,
    ) -> Option<&'a Arc<Conn>> {
        conns
            .filter(|(_, c)| ip.is_none_or(|ip| c.ip == ip) && c.idle())
            .min_by_key(|(id, c)| (c.last_ms.load(Ordering::Relaxed), **id))
            .map(|(_, c)| c)
    }

    fn close(&self, id: u64) {
        self.lock().remove(&id);
    }
}

/// The peer of a request ([`axum::extract::ConnectInfo`]): its address and its connection.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The server's end of the connection (open mode identifies callers by both ends).
    pub local: Option<SocketAddr>,
    pub conn: Option<Arc<Conn>>,
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, LimitedListener>>
    for Peer
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, LimitedListener>) -> Peer {
        Peer {
            addr: *stream.remote_addr(),
            local: stream.io().local_addr().ok(),
            conn: Some(stream.io().conn().clone()),
        }
    }
}

/// Descriptors kept for everything but HTTP connections: the store's files, the log, pgwire,
/// the built-in agent's `/proc` reads.
const RESERVED_FDS: u64 = 1024;

/// Raises the process's descriptor limit so that `limits.max_connections` connections fit
/// beside [`RESERVED_FDS`], as far as the process may ([`raise_descriptor_limit`]); lowers the cap (with a warning)
/// where it does not. Returns the limits to serve with.
pub fn fit_descriptor_limit(limits: ConnectionLimits) -> ConnectionLimits {
    let want = limits.max_connections as u64 + RESERVED_FDS;
    let current = raise_descriptor_limit(want);
    if current >= want {
        return limits;
    }
    let fit = usize::try_from(current.saturating_sub(RESERVED_FDS).max(16)).unwrap_or(16);
    tracing::warn!(
        descriptors = current,
        max_connections = fit,
        "the descriptor limit (ulimit -n) is too low for server.max_connections; serving fewer connections at once (raise LimitNOFILE)"
    );
    ConnectionLimits {
        max_connections: fit,
        ..limits
    }
}

/// Raises the process's descriptor limit to at least `want` where it may: the soft limit up
/// to the hard one, and the hard one too for a process allowed to (root, up to the kernel's
/// `fs.nr_open`). Returns the soft limit in force afterwards.
pub fn raise_descriptor_limit(want: u64) -> u64 {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let now = getrlimit(Resource::Nofile);
    let current = now.current.unwrap_or(u64::MAX);
    if current >= want {
        return current;
    }
    let hard = now.maximum.unwrap_or(u64::MAX);
    if hard < want
        && setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(want),
                maximum: Some(want),
            },
        )
        .is_ok()
    {
        return want;
    }
    let raised = hard.min(want);
    match setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(raised),
            maximum: now.maximum,
        },
    ) {
        Ok(()) => raised,
        Err(_) => current,
    }
}

/// A TCP listener that applies [`ConnectionLimits`], and TLS when it has an acceptor.
pub struct LimitedListener {
    inner: TcpListener,
    slots: Arc<Semaphore>,
    registry: Arc<Registry>,
    max_per_ip: usize,
    idle: Duration,
    request_timeout: Duration,
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// A connection accepted and waiting for a place, kept if the call waiting is cancelled.
    waiting: Option<Waiting>,
}

struct Waiting {
    stream: TcpStream,
    addr: SocketAddr,
    place: Registered,
    conn: Arc<Conn>,
    /// A connection idle longest was closed for it already.
    made_room: bool,
}

impl LimitedListener {
    pub fn new(
        inner: TcpListener,
        limits: ConnectionLimits,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> LimitedListener {
        LimitedListener {
            inner,
            slots: Arc::new(Semaphore::new(limits.max_connections.max(1))),
            registry: Arc::new(Registry::new(limits.request_timeout)),
            max_per_ip: limits.max_per_ip.max(1),
            idle: limits.idle_timeout,
            request_timeout: limits.request_timeout,
            tls,
            waiting: None,
        }
    }
}

impl axum::serve::Listener for LimitedListener {
    type Io = ServerStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let mut next = match self.waiting.take() {
                Some(waiting) => waiting,
                None => match self.inner.accept().await {
                    Ok((stream, addr)) => {
                        let Some((id, conn)) = self.registry.open(addr.ip(), self.max_per_ip)
                        else {
                            // Closed at once (dropped).
                            tracing::debug!(client = %addr.ip(), max = self.max_per_ip, "connection refused: too many from this address");
                            continue;
                        };
                        let place = Registered {
                            registry: self.registry.clone(),
                            id,
                        };
                        Waiting {
                            stream,
                            addr,
                            place,
                            conn,
                            made_room: false,
                        }
                    }
                    Err(e) => {
                        // Out of descriptors or a connection reset before it was accepted:
                        // wait a little rather than spin, as axum's own listener does.
                        tracing::warn!(error = %e, "cannot accept a connection");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            // At the cap, the connection idle longest makes room; with none idle, the new one
            // waits for a place (kept across a cancelled call), and no other is accepted.
            let slot = match self.slots.clone().try_acquire_owned() {
                Ok(slot) => slot,
                Err(_) => {
                    if !next.made_room {
                        next.made_room = self.registry.evict_one(None);
                    }
                    self.waiting = Some(next);
                    let slot = match self.slots.clone().acquire_owned().await {
                        Ok(slot) => slot,
                        Err(_) => unreachable!("the semaphore is never closed"),
                    };
                    next = match self.waiting.take() {
                        Some(waiting) => waiting,
                        None => continue,
                    };
                    slot
                }
            };
            let Waiting {
                stream,
                addr,
                place,
                conn,
                ..
            } = next;
            let _ = stream.set_nodelay(true);
            let stream =
                LimitedStream::new(stream, slot, place, conn, self.idle, self.request_timeout);
            let io = match &self.tls {
                Some(tls) => ServerStream::Handshake(Box::new(tls.accept(stream))),
                None => ServerStream::Plain(stream),
            };
            return (io, addr);
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// A connection as the HTTP server sees it: plain, or TLS (handshaking until its first read or
/// write completes the handshake).
pub enum ServerStream {
    Plain(LimitedStream),
    Handshake(Box<tokio_rustls::Accept<LimitedStream>>),
    Tls(Box<tokio_rustls::server::TlsStream<LimitedStream>>),
    /// The handshake failed; every read and write fails.
    Failed,
}

impl ServerStream {
    /// The connection it is.
    pub fn conn(&self) -> &Arc<Conn> {
        static CLOSED: std::sync::OnceLock<Arc<Conn>> = std::sync::OnceLock::new();
        match self {
            ServerStream::Plain(s) => &s.conn,
            ServerStream::Handshake(accept) => match accept.get_ref() {
                Some(s) => &s.conn,
                None => CLOSED.get_or_init(closed_conn),
            },
            ServerStream::Tls(s) => &s.get_ref().0.conn,
            ServerStream::Failed => CLOSED.get_or_init(closed_conn),
        }
    }

    /// The server's end of the connection.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match self {
            ServerStream::Plain(s) => s.inner.local_addr(),
            ServerStream::Handshake(accept) => match accept.get_ref() {
                Some(s) => s.inner.local_addr(),
                None => Err(Self::failed()),
            },
            ServerStream::Tls(s) => s.get_ref().0.inner.local_addr(),
            ServerStream::Failed => Err(Self::failed()),
        }
    }

    /// Drives the handshake, if one is under way, to its end.
    fn poll_handshake(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let ServerStream::Handshake(accept) = self {
            match std::future::Future::poll(Pin::new(accept.as_mut()), cx) {
                Poll::Ready(Ok(tls)) => *self = ServerStream::Tls(Box::new(tls)),
                Poll::Ready(Err(e)) => {
                    *self = ServerStream::Failed;
                    return Poll::Ready(Err(e));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }

    fn failed() -> io::Error {
        io::Error::new(io::ErrorKind::NotConnected, "the TLS handshake failed")
    }
}

impl AsyncRead for ServerStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_handshake(cx))?;
        match this {
            ServerStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            ServerStream::Handshake(_) | ServerStream::Failed => Poll::Ready(Err(Self::failed())),
        }
    }
}

impl AsyncWrite for ServerStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_handshake(cx))?;
        match this {
            ServerStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            ServerStream::Handshake(_) | ServerStream::Failed => Poll::Ready(Err(Self::failed())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_handshake(cx))?;
        match this {
            ServerStream::Plain(s) => Pin::new(s).poll_flush(cx),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            ServerStream::Handshake(_) | ServerStream::Failed => Poll::Ready(Err(Self::failed())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServerStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            // Nothing was said over TLS yet: closing is dropping.
            ServerStream::Handshake(_) | ServerStream::Failed => Poll::Ready(Ok(())),
        }
    }
}

/// A connection's place in the [`Registry`], given back when dropped.
pub struct Registered {
    registry: Arc<Registry>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.registry.close(self.id);
    }
}

/// The [`Conn`] of a stream that has none (a TLS handshake that failed).
fn closed_conn() -> Arc<Conn> {
    Arc::new(Conn {
        ip: std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        probation: false,
        epoch: Instant::now(),
        request_timeout: Duration::ZERO,
        last_ms: AtomicU64::new(0),
        head_ms: AtomicU64::new(NEVER),
        active: AtomicUsize::new(0),
        kept: AtomicBool::new(false),
        evicted: AtomicBool::new(true),
        waker: futures::task::AtomicWaker::new(),
        owner: tokio::sync::OnceCell::new(),
    })
}

/// A connection that holds one slot until it closes, and fails once idle too long.
pub struct LimitedStream {
    inner: TcpStream,
    _slot: OwnedSemaphorePermit,
    _place: Registered,
    conn: Arc<Conn>,
    epoch: Instant,
    idle: Duration,
    request_timeout: Duration,
    /// When the connection last moved; the timer is only re-armed when a wait starts.
    last: Instant,
    deadline: Pin<Box<Sleep>>,
}

impl LimitedStream {
    fn new(
        inner: TcpStream,
        slot: OwnedSemaphorePermit,
        place: Registered,
        conn: Arc<Conn>,
        idle: Duration,
        request_timeout: Duration,
    ) -> LimitedStream {
        let epoch = place.registry.epoch;
        LimitedStream {
            inner,
            _slot: slot,
            _place: place,
            conn,
            epoch,
            idle,
            request_timeout,
            last: Instant::now(),
            deadline: Box::pin(tokio::time::sleep(idle)),
        }
    }

    /// Follows one poll of the connection: progress (`moved`) pushes the idle deadline back;
    /// waiting past it, or past the request timeout of a head still coming in, fails with
    /// `TimedOut` (the wait registers the timer otherwise); a connection closed to make room
    /// fails at once.
    fn track<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: Poll<io::Result<T>>,
        read: bool,
        moved: impl FnOnce(&T) -> bool,
    ) -> Poll<io::Result<T>> {
        self.conn.waker.register(cx.waker());
        if self.conn.evicted.load(Ordering::Acquire) {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to make room for a new connection (server.max_connections)",
            )));
        }
        match poll {
            Poll::Ready(Ok(v)) => {
                if moved(&v) {
                    self.last = Instant::now();
                    let now = u64::try_from(self.last.duration_since(self.epoch).as_millis())
                        .unwrap_or(NEVER - 1);
                    self.conn.last_ms.store(now, Ordering::Relaxed);
                    // The first byte of a request no handler has taken yet starts its clock.
                    if read && self.conn.active.load(Ordering::Acquire) == 0 {
                        let _ = self.conn.head_ms.compare_exchange(
                            NEVER,
                            now,
                            Ordering::AcqRel,
                            Ordering::Relaxed,
                        );
                    }
                }
                Poll::Ready(Ok(v))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                let mut due = self.last + self.idle;
                let mut why = "idle connection closed (server.idle_timeout_secs)";
                let head = self.conn.head_ms.load(Ordering::Acquire);
                if head != NEVER && self.conn.active.load(Ordering::Acquire) == 0 {
                    let head_due = self.epoch + Duration::from_millis(head) + self.request_timeout;
                    if head_due < due {
                        due = head_due;
                        why = "a request's head took too long to arrive (server.request_timeout_secs)";
                    }
                }
                if self.deadline.deadline() != due {
                    self.deadline.as_mut().reset(due);
                }
                if self.deadline.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, why)));
                }
                Poll::Pending
            }
        }
    }
}

impl AsyncRead for LimitedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let poll = Pin::new(&mut this.inner).poll_read(cx, buf);
        let grew = buf.filled().len() > before;
        this.track(cx, poll, true, |_| grew)
    }
}

impl AsyncWrite for LimitedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write(cx, data);
        this.track(cx, poll, false, |&n| n > 0)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.track(cx, poll, false, |&n| n > 0)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The first layer of every request: marks its connection busy while a handler has it (so it
/// is not closed to make room), holds its body to the request timeout counted from its head's
/// first byte, serves a connection on probation only for agents' routes, and keeps a
/// connection that carried an agent's sync or telemetry (accepted, so with an agent's token
/// where there are tokens) from being closed to make room: a flood of new connections from
/// its node must not delay its telemetry until the node looks silent.
pub async fn track_requests(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let conn = request
        .extensions()
        .get::<axum::extract::ConnectInfo<Peer>>()
        .and_then(|peer| peer.0.conn.clone());
    let Some(conn) = conn else {
        return next.run(request).await;
    };
    let deadline = conn.request_deadline();
    let _busy = conn.begin_request();
    let path = request.uri().path().to_owned();
    if conn.on_probation() && !crate::routes::for_agents(&path) {
        let mut refused = crate::ApiError::new(
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            crate::ErrorCode::TooManyConnections,
            format!(
                "this address holds server.max_connections_per_ip connections already; beyond them only agents' syncs and telemetry ({}) are served: close idle connections, or reuse one",
                crate::routes::agent_paths().join(", ")
            ),
        )
        .retry_after(1)
        .into_response();
        refused.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
        return refused;
    }
    let request = match deadline {
        Some(deadline) => request.map(|body| deadline_body(body, deadline)),
        None => request,
    };
    let response = next.run(request).await;
    if crate::routes::for_agents(&path) && response.status().is_success() {
        conn.keep();
    }
    response
}

/// `body`, failing once `deadline` passes before it has all come in.
fn deadline_body(body: axum::body::Body, deadline: Instant) -> axum::body::Body {
    use futures::StreamExt;
    if axum::body::HttpBody::is_end_stream(&body) {
        return body;
    }
    let chunks = body.into_data_stream();
    let timed = futures::stream::unfold(Some(chunks), move |chunks| async move {
        let mut chunks = chunks?;
        match tokio::time::timeout_at(deadline, chunks.next()).await {
            Ok(Some(chunk)) => Some((chunk, Some(chunks))),
            Ok(None) => None,
            Err(_) => Some((
                Err(axum::Error::new(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the request's body took too long to arrive (server.request_timeout_secs)",
                ))),
                None,
            )),
        }
    });
    // Fused: a body is polled again after its end (an unfold would panic).
    axum::body::Body::from_stream(timed.fuse())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The soft descriptor limit is raised to what is wanted, past the hard limit where the
    /// process may raise that too (root with CAP_SYS_RESOURCE), else to the hard limit; never
    /// lowered. `perch demo` fits its in-process agents' sockets and job files this way.
    #[test]
    fn the_descriptor_limit_is_raised_as_far_as_allowed() {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let before = getrlimit(Resource::Nofile);
        let Some(hard) = before.maximum else {
            return; // unlimited already: nothing to raise
        };
        // A soft limit below the hard one first (half of it: the other tests keep room).
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some((hard / 2).max(4096).min(hard)),
                maximum: Some(hard),
            },
        )
        .expect("lower the soft limit");
        let want = hard + 1000;
        let got = raise_descriptor_limit(want);
        assert!(got == want || got == hard, "{got} of {want} (hard {hard})");
        let now = getrlimit(Resource::Nofile);
        assert_eq!(
            now.current,
            Some(got),
            "the limit in force is the one returned"
        );
        assert_eq!(raise_descriptor_limit(16), got, "never lowered");
    }

    #[tokio::test]
    async fn connections_past_the_cap_wait_and_idle_ones_are_closed() {
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = tcp.local_addr().expect("addr");
        let mut listener = LimitedListener::new(
            tcp,
            ConnectionLimits {
                max_connections: 2,
                max_per_ip: 2,
                idle_timeout: Duration::from_millis(300),
                request_timeout: Duration::from_secs(30),
            },
            None,
        );
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(TcpStream::connect(addr).await.expect("connect"));
        }
        let (mut first, _) = listener.accept().await;
        let (second, _) = listener.accept().await;
        // Both serve a request: the third waits for a slot.
        let busy = (first.conn().begin_request(), second.conn().begin_request());
        let third = tokio::time::timeout(Duration::from_millis(100), listener.accept()).await;
        assert!(third.is_err(), "a third connection past a cap of two");
        drop(busy);
        // The first one talks: it is not idle. Then it goes quiet and is closed.
        clients[0].write_all(b"ping").await.expect("write");
        let mut buf = [0u8; 4];
        first.read_exact(&mut buf).await.expect("read");
        let started = Instant::now();
        let err = first.read(&mut buf).await.expect_err("idle");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(250));
        drop(first);
        // Its slot goes to the waiting connection.
        let third = tokio::time::timeout(Duration::from_secs(5), listener.accept()).await;
        assert!(third.is_ok(), "the slot was freed");
    }

    /// One address holds at most its cap and its places on probation; another address still
    /// gets in, and a place it gives back may be taken again.
    #[tokio::test]
    async fn one_address_cannot_take_every_slot() {
        let tcp = TcpListener::bind("0.0.0.0:0").await.expect("bind");
        let port = tcp.local_addr().expect("addr").port();
        let mut listener = LimitedListener::new(tcp, limits(100, 2), None);
        let (mut clients, mut served, mut busy) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..2 + PROBATION_PER_IP {
            clients.push(
                TcpStream::connect(("127.0.0.1", port))
                    .await
                    .expect("connect"),
            );
            let (s, from) = listener.accept().await;
            assert_eq!(from.ip().to_string(), "127.0.0.1");
            busy.push(s.conn().begin_request());
            served.push(s);
        }
        // One more from it is closed at once (while the listener accepts).
        let mut greedy = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        let none = tokio::time::timeout(Duration::from_millis(300), listener.accept()).await;
        assert!(none.is_err(), "an address took more than its places");
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), greedy.read(&mut buf))
            .await
            .expect("closed, not left hanging");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        // Another address (all of 127/8 is loopback) still gets in.
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind("127.0.0.2:0".parse().expect("addr"))
            .expect("bind 127.0.0.2");
        let _other = socket
            .connect(format!("127.0.0.1:{port}").parse().expect("addr"))
            .await
            .expect("connect");
        let (_c, from_c) = tokio::time::timeout(Duration::from_secs(5), listener.accept())
            .await
            .expect("another address is served");
        assert_eq!(from_c.ip().to_string(), "127.0.0.2");
        // When one of its connections closes, the address may open another.
        drop(busy.remove(0));
        drop(served.remove(0));
        let _again = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        let (_d, _) = tokio::time::timeout(Duration::from_secs(5), listener.accept())
            .await
            .expect("a freed place is used");
    }

    /// A body that comes in whole in time is read whole, and may be polled past its end; one
    /// still coming in at the deadline fails saying why.
    #[tokio::test]
    async fn a_body_is_held_to_its_deadline() {
        use axum::body::HttpBody;
        let body = deadline_body(
            axum::body::Body::from("whole"),
            Instant::now() + Duration::from_secs(30),
        );
        let mut body = std::pin::pin!(body);
        let mut read = Vec::new();
        while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
            read.extend_from_slice(frame.expect("frame").data_ref().expect("data"));
        }
        assert_eq!(read, b"whole");
        assert!(
            std::future::poll_fn(|cx| body.as_mut().poll_frame(cx))
                .await
                .is_none()
        );
        let (tx, rx) = futures::channel::mpsc::channel::<Result<bytes::Bytes, io::Error>>(1);
        let slow = deadline_body(
            axum::body::Body::from_stream(rx),
            Instant::now() + Duration::from_millis(200),
        );
        let err = axum::body::to_bytes(slow, usize::MAX)
            .await
            .expect_err("late");
        assert!(
            format!("{err:?}").contains("request_timeout_secs"),
            "{err:?}"
        );
        drop(tx);
    }

    /// Served through axum: a connection on probation gets 429 `too_many_connections` on any
    /// route but an agent's, which it is served.
    #[tokio::test]
    async fn on_probation_only_agents_routes_are_served() {
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = tcp.local_addr().expect("addr");
        let listener = LimitedListener::new(tcp, limits(100, 1), None);
        let registry = listener.registry.clone();
        let release = Arc::new(tokio::sync::Notify::new());
        let held = release.clone();
        let app = axum::Router::new()
            .route(
                "/slow",
                axum::routing::get(move || {
                    let held = held.clone();
                    async move { held.notified().await }
                }),
            )
            .route("/healthz", axum::routing::get(|| async { "ok" }))
            .route("/v1/ingest", axum::routing::post(|| async { "taken" }))
            .layer(axum::middleware::from_fn(track_requests));
        let server = tokio::spawn(async move {
            axum::serve(listener, app.into_make_service_with_connect_info::<Peer>()).await
        });
        let ask = |request: &'static str| async move {
            let mut c = TcpStream::connect(addr).await.expect("connect");
            c.write_all(request.as_bytes()).await.expect("write");
            c
        };
        // The address's one place serves a request that takes its time.
        let _slow = ask("GET /slow HTTP/1.1\r\nHost: x\r\n\r\n").await;
        let answer = |mut c: TcpStream| async move {
            let mut text = String::new();
            let _ =
                tokio::time::timeout(Duration::from_secs(10), c.read_to_string(&mut text)).await;
            text
        };
        // Once the slow request is in its handler (busy) and alone, go past the cap.
        loop {
            let busy = {
                let conns = registry.lock();
                conns.len() == 1 && conns.values().all(|c| c.active.load(Ordering::Acquire) > 0)
            };
            if busy {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let refused =
            answer(ask("GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await)
                .await;
        assert!(refused.contains("429"), "{refused}");
        assert!(refused.contains("too_many_connections"), "{refused}");
        let agent = answer(
            ask("POST /v1/ingest HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}").await,
        )
        .await;
        assert!(
            agent.contains("200 OK") && agent.contains("taken"),
            "{agent}"
        );
        release.notify_waiters();
        server.abort();
    }

    fn limits(max_connections: usize, max_per_ip: usize) -> ConnectionLimits {
        ConnectionLimits {
            max_connections,
            max_per_ip,
            idle_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(30),
        }
    }

    /// A request sent a byte at a time is never idle; its head still has to be in within the
    /// request timeout.
    #[tokio::test]
    async fn a_request_trickled_in_is_closed_at_the_request_timeout() {
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = tcp.local_addr().expect("addr");
        let mut listener = LimitedListener::new(
            tcp,
            ConnectionLimits {
                request_timeout: Duration::from_millis(300),
                ..limits(4, 4)
            },
            None,
        );
        let mut client = TcpStream::connect(addr).await.expect("connect");
        let (mut server, _) = listener.accept().await;
        let trickle = tokio::spawn(async move {
            for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ".iter().cycle() {
                if client.write_all(&[*byte]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        let started = Instant::now();
        let mut buf = [0u8; 64];
        let err = loop {
            match server.read(&mut buf).await {
                Ok(n) => assert!(n > 0, "the client never closes"),
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(err.to_string().contains("request_timeout_secs"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10));
        trickle.abort();
    }

    /// At the cap a new connection does not wait behind idle ones: the one idle longest is
    /// closed; one serving a request, or one that carried an agent's sync, never is.
    #[tokio::test]
    async fn at_the_cap_the_connection_idle_longest_makes_room() {
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = tcp.local_addr().expect("addr");
        let mut listener = LimitedListener::new(tcp, limits(3, 10), None);
        let mut clients = Vec::new();
        let mut served = Vec::new();
        for _ in 0..3 {
            clients.push(TcpStream::connect(addr).await.expect("connect"));
            served.push(listener.accept().await.0);
        }
        // The first serves a request, the second is an agent's: the third is closed.
        let busy = served[0].conn().begin_request();
        served[1].conn().keep();
        clients.push(TcpStream::connect(addr).await.expect("connect"));
        let mut idle = served.pop().expect("the third");
        // The closed one's task sees it and lets go of its place, as hyper's does.
        let (fourth, err) = tokio::join!(
            tokio::time::timeout(Duration::from_secs(5), listener.accept()),
            async move {
                let mut buf = [0u8; 1];
                idle.read(&mut buf).await.expect_err("closed")
            }
        );
        let (fourth, _) = fourth.expect("the new connection is served at once");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted, "{err}");
        let _busy_too = fourth.conn().begin_request();
        // Nothing idle is left: the next one waits for a place.
        clients.push(TcpStream::connect(addr).await.expect("connect"));
        let next = tokio::time::timeout(Duration::from_millis(200), listener.accept()).await;
        assert!(next.is_err(), "a busy or an agent's connection was closed");
        drop(busy);
    }

    /// Past its cap an address gets a few places on probation (an agent behind its node's
    /// jobs), and an idle connection of its own makes room first.
    #[tokio::test]
    async fn past_its_cap_an_address_gets_places_on_probation() {
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = tcp.local_addr().expect("addr");
        let mut listener = LimitedListener::new(tcp, limits(100, 2), None);
        let mut clients = Vec::new();
        let mut served = Vec::new();
        for _ in 0..2 {
            clients.push(TcpStream::connect(addr).await.expect("connect"));
            served.push(listener.accept().await.0);
        }
        // An idle one of its own makes room.
        clients.push(TcpStream::connect(addr).await.expect("connect"));
        served.push(listener.accept().await.0);
        assert!(!served[2].conn().on_probation());
        let mut buf = [0u8; 1];
        assert!(
            served[0].read(&mut buf).await.is_err(),
            "the idle one was closed"
        );
        drop(served.remove(0));
        // Both busy: the next ones are on probation, up to the bound.
        let mut busy: Vec<_> = served.iter().map(|s| s.conn().begin_request()).collect();
        for _ in 0..PROBATION_PER_IP {
            clients.push(TcpStream::connect(addr).await.expect("connect"));
            let (s, _) = tokio::time::timeout(Duration::from_secs(5), listener.accept())
                .await
                .expect("served on probation");
            assert!(s.conn().on_probation());
            busy.push(s.conn().begin_request());
            served.push(s);
        }
        // Past that, closed at once (while the listener accepts).
        let mut late = TcpStream::connect(addr).await.expect("connect");
        let none = tokio::time::timeout(Duration::from_millis(300), listener.accept()).await;
        assert!(
            none.is_err(),
            "a connection past the probation places was served"
        );
        let read = tokio::time::timeout(Duration::from_secs(5), late.read(&mut buf))
            .await
            .expect("closed, not left hanging");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
}
