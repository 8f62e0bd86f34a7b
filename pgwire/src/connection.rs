//! One client connection, served as `pgwire::tokio::process_socket` serves it (TLS negotiated
//! first, then each message handed to the crate's `process_message`), with perch's bounds:
//!
//! - a message longer than a statement may be ([`MESSAGE_ROOM`] more) is refused as soon as
//!   its 5-byte header is read, with SQLSTATE 54000 naming `query.max_statement_kb`, and the
//!   connection closed. The crate takes messages of up to 1 GiB and buffers each whole before
//!   anyone looks at it, so a few clients sending gigabyte statements took the server's memory;
//! - a client must finish logging in within [`STARTUP_TIMEOUT`] (the crate's own is a
//!   minute), so clients that connect and stall hold a slot ([`crate::serve`]) briefly.

use futures::{SinkExt, StreamExt};
use pgwire::api::{ClientInfo, PgWireConnectionState, PgWireServerHandlers};
use pgwire::error::ErrorInfo;
use pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use pgwire::tokio::server::{negotiate_tls, process_error, process_message};
use std::task::Poll;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a client has to log in, from its connection.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(10);

/// After refusing a message, how long the rest of it is read and dropped (at most as many
/// bytes as the bound again), so that the client reads the refusal before it sees the
/// connection close: closing a socket with unread data resets it, and a reset can discard
/// the answer on its way.
const LINGER: Duration = Duration::from_secs(2);

/// Room past the statement bound for a Parse message's name and types or a Bind's parameters.
const MESSAGE_ROOM: usize = 64 << 10;

/// Serves one connection until the client leaves, the login times out or a message is refused.
/// A message may hold a statement of up to `max_statement` bytes ([`MESSAGE_ROOM`] more).
pub async fn serve<H: PgWireServerHandlers>(
    socket: TcpStream,
    tls: Option<pgwire::tokio::TlsAcceptor>,
    handlers: H,
    max_statement: usize,
) -> std::io::Result<()> {
    let max_message = max_statement.saturating_add(MESSAGE_ROOM);
    let startup = tokio::time::sleep(STARTUP_TIMEOUT);
    tokio::pin!(startup);
    let negotiated = tokio::select! {
        _ = &mut startup => return Ok(()),
        socket = negotiate_tls(socket, tls) => socket?,
    };
    // A client that asked for TLS directly where the server has none.
    let Some(mut socket) = negotiated else {
        return Ok(());
    };
    let startup_handler = handlers.startup_handler();
    let simple = handlers.simple_query_handler();
    let extended = handlers.extended_query_handler();
    let copy = handlers.copy_handler();
    let cancel = handlers.cancel_handler();
    let errors = handlers.error_handler();
    loop {
        let logging_in = matches!(
            socket.state(),
            PgWireConnectionState::AwaitingStartup
                | PgWireConnectionState::AuthenticationInProgress
        );
        let next = next_message(&mut socket, max_message);
        let message = if logging_in {
            tokio::select! {
                _ = &mut startup => return Ok(()),
                message = next => message,
            }
        } else {
            next.await
        };
        let message = match message {
            Some(Ok(message)) => message,
            Some(Err(Refused(len))) => {
                return refuse(socket, len, max_statement, max_message).await;
            }
            None => return Ok(()),
        };
        // The client is leaving; some (asyncpg) wait for the server to close.
        if matches!(message, PgWireFrontendMessage::Terminate(_)) {
            return Ok(());
        }
        let extended_protocol = match socket.state() {
            PgWireConnectionState::CopyInProgress(extended) => extended,
            _ => message.is_extended_query(),
        };
        if let Err(mut e) = process_message(
            message,
            &mut socket,
            startup_handler.clone(),
            simple.clone(),
            extended.clone(),
            copy.clone(),
            cancel.clone(),
        )
        .await
        {
            pgwire::api::ErrorHandler::on_error(&*errors, &socket, &mut e);
            process_error(&mut socket, e, extended_protocol).await?;
        }
    }
}

type Socket<S> = tokio_util::codec::Framed<
    pgwire::tokio::server::MaybeTls,
    pgwire::tokio::server::PgWireMessageServerCodec<S>,
>;

/// A message whose header declares this many bytes, past the bound.
struct Refused(usize);

/// The next message, `None` when the connection ended or cannot be read; refused as soon as
/// the header of one past `max` has arrived, before its body is read.
async fn next_message<S>(
    socket: &mut Socket<S>,
    max: usize,
) -> Option<Result<PgWireFrontendMessage, Refused>> {
    std::future::poll_fn(|cx| match socket.poll_next_unpin(cx) {
        Poll::Ready(Some(Ok(message))) => Poll::Ready(Some(Ok(message))),
        Poll::Ready(Some(Err(e))) => {
            tracing::debug!(error = %e, "PostgreSQL client sent what cannot be read");
            Poll::Ready(None)
        }
        Poll::Ready(None) => Poll::Ready(None),
        // Waiting for more of a message: its header may already say it is too long.
        Poll::Pending => match declared_length(socket) {
            Some(len) if len > max => Poll::Ready(Some(Err(Refused(len)))),
            _ => Poll::Pending,
        },
    })
    .await
}

/// The length the message at the front of the read buffer declares (its type byte and
/// length field included), once its header is in. Messages before login (the startup packet,
/// which has no type byte) are bounded by the crate itself, to 10,000 bytes.
fn declared_length<S>(socket: &Socket<S>) -> Option<usize> {
    if matches!(socket.state(), PgWireConnectionState::AwaitingStartup) {
        return None;
    }
    let header = socket.read_buffer().get(..5)?;
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
    Some(1 + len as usize)
}

/// Answers a message past the bound with an error that says what to change, and closes.
async fn refuse<S>(
    mut socket: Socket<S>,
    len: usize,
    max_statement: usize,
    max_message: usize,
) -> std::io::Result<()> {
    let message = format!(
        "the message is {} KiB long; perch takes statements of at most {} KiB (query.max_statement_kb): filter with a join or a subquery instead of a long literal list, or split the statement",
        len.div_ceil(1024),
        max_statement / 1024
    );
    tracing::info!(
        client = %socket.socket_addr(),
        bytes = len,
        "PostgreSQL client sent a message past the bound; refused and closed"
    );
    let error = ErrorInfo::new("FATAL".to_owned(), "54000".to_owned(), message);
    socket
        .send(PgWireBackendMessage::ErrorResponse(error.into()))
        .await?;
    let mut io = socket.into_inner();
    io.shutdown().await?;
    let mut scratch = vec![0u8; 64 << 10];
    let mut dropped = 0usize;
    let drain = async {
        while dropped < max_message {
            match io.read(&mut scratch).await {
                Ok(0) | Err(_) => break,
                Ok(n) => dropped += n,
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
    Ok(())
}
