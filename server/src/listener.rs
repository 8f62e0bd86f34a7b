//! The HTTP listener's own limits, so that idle or stalled clients cannot exhaust the server's
//! file descriptors (issue 16: 20,000 half-open connections left SQL unanswered, the built-in
//! agent unable to read `/proc` and the alert state unsaved):
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
//! With TLS (`server.tls_cert`), each connection's handshake runs on the connection's own task
//! (on its first read or write), never in the accept loop, so a client that stalls mid-handshake
//! holds up no one, and is closed by the idle timeout like any other.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
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
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 4096,
            max_per_ip: 256,
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// Descriptors kept for everything but HTTP connections: the store's files, the log, pgwire,
/// the built-in agent's `/proc` reads.
const RESERVED_FDS: u64 = 1024;

/// Raises the process's descriptor limit so that `limits.max_connections` connections fit
/// beside [`RESERVED_FDS`], as far as the hard limit allows; lowers the cap (with a warning)
/// where it does not. Returns the limits to serve with.
pub fn fit_descriptor_limit(limits: ConnectionLimits) -> ConnectionLimits {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let want = limits.max_connections as u64 + RESERVED_FDS;
    let now = getrlimit(Resource::Nofile);
    let current = now.current.unwrap_or(u64::MAX);
    if current >= want {
        return limits;
    }
    let raised = now.maximum.unwrap_or(u64::MAX).min(want);
    let current = match setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(raised),
            maximum: now.maximum,
        },
    ) {
        Ok(()) => raised,
        Err(_) => current,
    };
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

/// A TCP listener that applies [`ConnectionLimits`], and TLS when it has an acceptor.
pub struct LimitedListener {
    inner: TcpListener,
    slots: Arc<Semaphore>,
    /// Open connections per client address.
    per_ip: Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
    max_per_ip: usize,
    idle: Duration,
    tls: Option<tokio_rustls::TlsAcceptor>,
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
            per_ip: Arc::default(),
            max_per_ip: limits.max_per_ip.max(1),
            idle: limits.idle_timeout,
            tls,
        }
    }
}

impl axum::serve::Listener for LimitedListener {
    type Io = ServerStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let slot = match self.slots.clone().acquire_owned().await {
            Ok(slot) => slot,
            Err(_) => unreachable!("the semaphore is never closed"),
        };
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => {
                    let Some(from) = IpSlot::take(&self.per_ip, addr.ip(), self.max_per_ip) else {
                        // Closed at once (dropped); the slot waits for the next connection.
                        tracing::debug!(client = %addr.ip(), max = self.max_per_ip, "connection refused: too many from this address");
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let stream = LimitedStream::new(stream, slot, from, self.idle);
                    let io = match &self.tls {
                        Some(tls) => ServerStream::Handshake(Box::new(tls.accept(stream))),
                        None => ServerStream::Plain(stream),
                    };
                    return (io, addr);
                }
                Err(e) => {
                    // Out of descriptors or a connection reset before it was accepted: wait a
                    // little rather than spin, as axum's own listener does.
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
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

/// One of an address's connections, counted until dropped.
pub struct IpSlot {
    counts: Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
    ip: std::net::IpAddr,
}

impl IpSlot {
    fn take(
        counts: &Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
        ip: std::net::IpAddr,
        max: usize,
    ) -> Option<IpSlot> {
        let mut map = counts.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(IpSlot {
            counts: counts.clone(),
            ip,
        })
    }
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut map = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

/// A connection that holds one slot until it closes, and fails once idle too long.
pub struct LimitedStream {
    inner: TcpStream,
    _slot: OwnedSemaphorePermit,
    _from: IpSlot,
    idle: Duration,
    /// When the connection last moved; the timer is only re-armed when a wait starts.
    last: Instant,
    deadline: Pin<Box<Sleep>>,
}

impl LimitedStream {
    fn new(
        inner: TcpStream,
        slot: OwnedSemaphorePermit,
        from: IpSlot,
        idle: Duration,
    ) -> LimitedStream {
        LimitedStream {
            inner,
            _slot: slot,
            _from: from,
            idle,
            last: Instant::now(),
            deadline: Box::pin(tokio::time::sleep(idle)),
        }
    }

    /// Follows one poll of the connection: progress (`moved`) pushes the idle deadline back,
    /// and waiting past it fails with `TimedOut` (the wait registers the timer otherwise).
    fn track<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: Poll<io::Result<T>>,
        moved: impl FnOnce(&T) -> bool,
    ) -> Poll<io::Result<T>> {
        match poll {
            Poll::Ready(Ok(v)) => {
                if moved(&v) {
                    self.last = Instant::now();
                }
                Poll::Ready(Ok(v))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                let due = self.last + self.idle;
                if self.deadline.deadline() != due {
                    self.deadline.as_mut().reset(due);
                }
                if self.deadline.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "idle connection closed (server.idle_timeout_secs)",
                    )));
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
        this.track(cx, poll, |_| grew)
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
        this.track(cx, poll, |&n| n > 0)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.track(cx, poll, |&n| n > 0)
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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
            },
            None,
        );
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(TcpStream::connect(addr).await.expect("connect"));
        }
        let (mut first, _) = listener.accept().await;
        let (_second, _) = listener.accept().await;
        // The third waits for a slot.
        let third = tokio::time::timeout(Duration::from_millis(100), listener.accept()).await;
        assert!(third.is_err(), "a third connection past a cap of two");
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

    #[tokio::test]
    async fn one_address_cannot_take_every_slot() {
        let tcp = TcpListener::bind("0.0.0.0:0").await.expect("bind");
        let port = tcp.local_addr().expect("addr").port();
        let mut listener = LimitedListener::new(
            tcp,
            ConnectionLimits {
                max_connections: 10,
                max_per_ip: 2,
                idle_timeout: Duration::from_secs(30),
            },
            None,
        );
        // Three from 127.0.0.1: two are served, the third is closed at once.
        let mut greedy = Vec::new();
        for _ in 0..3 {
            greedy.push(
                TcpStream::connect(("127.0.0.1", port))
                    .await
                    .expect("connect"),
            );
        }
        let (_a, from_a) = listener.accept().await;
        let (_b, _) = listener.accept().await;
        assert_eq!(from_a.ip().to_string(), "127.0.0.1");
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
        // The third from 127.0.0.1 was closed by the server.
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), greedy[2].read(&mut buf))
            .await
            .expect("closed, not left hanging");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        // When one of its connections closes, the address may open another.
        drop(_a);
        let _again = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        let (_d, _) = tokio::time::timeout(Duration::from_secs(5), listener.accept())
            .await
            .expect("a freed place is used");
    }
}
