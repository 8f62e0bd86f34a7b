//! The HTTP listener's own limits, so that idle or stalled clients cannot exhaust the server's
//! file descriptors (issue 16: 20,000 half-open connections left SQL unanswered, the built-in
//! agent unable to read `/proc` and the alert state unsaved):
//!
//! - at most `max_connections` connections are open at once; the next waits in the kernel's
//!   backlog until one closes (a descriptor is only taken once a slot is free);
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
    pub idle_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 4096,
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
                    let _ = stream.set_nodelay(true);
                    let stream = LimitedStream::new(stream, slot, self.idle);
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

/// A connection that holds one slot until it closes, and fails once idle too long.
pub struct LimitedStream {
    inner: TcpStream,
    _slot: OwnedSemaphorePermit,
    idle: Duration,
    /// When the connection last moved; the timer is only re-armed when a wait starts.
    last: Instant,
    deadline: Pin<Box<Sleep>>,
}

impl LimitedStream {
    fn new(inner: TcpStream, slot: OwnedSemaphorePermit, idle: Duration) -> LimitedStream {
        LimitedStream {
            inner,
            _slot: slot,
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
}
