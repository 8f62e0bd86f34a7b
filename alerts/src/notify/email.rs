//! Email through lettre over SMTP: plain, STARTTLS (required, not opportunistic) or TLS from
//! the first byte, with optional AUTH. rustls does the TLS; the system's trust store plus an
//! optional `ca_file` decide which servers are trusted.

use super::message::{subject, text};
use crate::config::{EmailConfig, TlsMode};
use crate::dispatch::Notification;
use crate::error::{Error, Result};
use lettre::message::{Mailbox, header::ContentType};
use lettre::transport::smtp::authentication::Credentials;
use lettre::transport::smtp::client::{Certificate, Tls, TlsParameters};
use lettre::{AsyncSmtpTransport, AsyncTransport, Message, Tokio1Executor};
use std::time::Duration;

/// One email integration, ready to send.
pub struct EmailSender {
    transport: AsyncSmtpTransport<Tokio1Executor>,
    from: Mailbox,
    to: Vec<Mailbox>,
    send_resolved: bool,
    timeout: Duration,
    describe: String,
}

impl std::fmt::Debug for EmailSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmailSender")
            .field("to", &self.describe)
            .finish_non_exhaustive()
    }
}

/// Why one delivery attempt failed, and whether trying again can help.
#[derive(Debug)]
pub(crate) struct AttemptError {
    pub(crate) message: String,
    pub(crate) retry: bool,
}

impl EmailSender {
    /// Builds the integration; `field` is its config path, for errors. Reads `password_env`
    /// and `ca_file` now, so a missing secret or file stops startup instead of the first page.
    pub fn new(field: &str, cfg: &EmailConfig) -> Result<Self> {
        let from: Mailbox = cfg.from.parse().map_err(|e| {
            Error::config(
                format!("{field}.from"),
                format!("{:?} is not an address: {e}", cfg.from),
            )
        })?;
        let to = cfg
            .to
            .iter()
            .map(|t| {
                t.parse::<Mailbox>().map_err(|e| {
                    Error::config(
                        format!("{field}.to"),
                        format!("{t:?} is not an address: {e}"),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let timeout = Duration::from_millis(u64::try_from(cfg.timeout.as_ms()).unwrap_or(30_000));
        let mut builder = AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous(&cfg.smtp_host)
            .port(cfg.port())
            .timeout(Some(timeout));
        if cfg.tls != TlsMode::None {
            let mut params = TlsParameters::builder(cfg.smtp_host.clone());
            if let Some(path) = &cfg.ca_file {
                let pem = std::fs::read(path).map_err(|e| {
                    Error::config(
                        format!("{field}.ca_file"),
                        format!("cannot read {}: {e}", path.display()),
                    )
                })?;
                let cert = Certificate::from_pem(&pem).map_err(|e| {
                    Error::config(
                        format!("{field}.ca_file"),
                        format!("{} is not a PEM certificate: {e}", path.display()),
                    )
                })?;
                params = params.add_root_certificate(cert);
            }
            let params = params.build_rustls().map_err(|e| {
                Error::config(format!("{field}.tls"), format!("cannot set up TLS: {e}"))
            })?;
            builder = builder.tls(match cfg.tls {
                TlsMode::Tls => Tls::Wrapper(params),
                _ => Tls::Required(params),
            });
        }
        if let Some(user) = &cfg.username {
            let password = match (&cfg.password, &cfg.password_env) {
                (Some(p), _) => p.clone(),
                (None, Some(var)) => std::env::var(var).map_err(|_| {
                    Error::config(
                        format!("{field}.password_env"),
                        format!("names {var}, which is not set in perch's environment"),
                    )
                })?,
                (None, None) => {
                    return Err(Error::config(
                        format!("{field}.username"),
                        "is set without password or password_env",
                    ));
                }
            };
            builder = builder.credentials(Credentials::new(user.clone(), password));
        }
        Ok(Self {
            transport: builder.build(),
            from,
            describe: format!("email to {}", cfg.to.join(", ")),
            to,
            send_resolved: cfg.send_resolved,
            timeout,
        })
    }

    /// What this integration is, for delivery reports ("email to ops@example.com").
    pub fn describe(&self) -> &str {
        &self.describe
    }

    /// The message this integration would send, or `None` when there is nothing for it
    /// (only resolved alerts, and it does not want resolved notices).
    pub fn message(&self, n: &Notification) -> Result<Option<Message>, String> {
        let owned;
        let n = if self.send_resolved {
            n
        } else {
            match n.without_resolved() {
                Some(firing_only) => {
                    owned = firing_only;
                    &owned
                }
                None => return Ok(None),
            }
        };
        let mut builder = Message::builder()
            .from(self.from.clone())
            .subject(subject(n))
            .header(ContentType::TEXT_PLAIN);
        for to in &self.to {
            builder = builder.to(to.clone());
        }
        builder
            .body(text(n))
            .map(Some)
            .map_err(|e| format!("cannot build the message: {e}"))
    }

    /// One delivery attempt. `Ok(false)`: nothing to send for this integration.
    pub(crate) async fn attempt(&self, n: &Notification) -> Result<bool, AttemptError> {
        let message = match self.message(n) {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(false),
            Err(message) => {
                return Err(AttemptError {
                    message,
                    retry: false,
                });
            }
        };
        // lettre's timeout bounds connecting, not a server that stops answering mid-session;
        // this bounds the whole attempt.
        match tokio::time::timeout(self.timeout, self.transport.send(message)).await {
            Ok(Ok(_)) => Ok(true),
            Ok(Err(e)) => Err(AttemptError {
                // A 5xx reply (bad recipient, auth refused) does not heal by retrying.
                retry: !e.is_permanent(),
                message: format!("SMTP: {e}"),
            }),
            Err(_) => Err(AttemptError {
                retry: true,
                message: format!("SMTP: no answer within {} s", self.timeout.as_secs_f64()),
            }),
        }
    }
}
