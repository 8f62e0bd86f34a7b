//! Who calls an open server (one with no tokens file): the local user that owns the caller's
//! end of the TCP connection, as identd answers it, read from the kernel's socket tables
//! (`/proc/net/tcp` and `/proc/net/tcp6`).
//!
//! An open server listens on loopback only, so every caller is a process on this machine and
//! its socket is in this network namespace's tables: the row whose local address is the
//! caller's and whose remote address is the server's names the uid that created the socket.
//! Root and the server's own user are operators (they can run anything as anyone already);
//! every other user is an ordinary user under their login name, who submits, cancels and reads
//! only their own jobs, exactly as the holder of a user token does. A caller that cannot be
//! identified (a remote address, a socket not in the tables, a uid with no login name) is
//! refused: remote and unidentifiable clients need a tokens file.
//!
//! A socket whose process has closed it lives on for a while with no owner: the kernel prints
//! inode 0 and uid 0 for it. Such rows are never taken, or a user could send a request, close
//! at once and be read as root. As with identd, the uid is the socket's creator's: a process
//! that hands its connection to another lends it its identity.
//!
//! Nothing is kept: each request is looked up afresh (one read of the socket tables, off the
//! async threads), so no answer outlives its connection to be taken for a later one on the
//! same ports.

use super::{Identity, Role};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

/// Where the kernel lists this network namespace's TCP sockets.
const PROC_NET: &str = "/proc/net";

/// The most read from one socket table: about 400,000 sockets' rows. A row past it is not
/// looked at, and a caller found nowhere is refused.
const MAX_TABLE_BYTES: u64 = 64 << 20;

/// What a refused caller is told to do instead.
const USE_TOKENS: &str = "remote clients, and local ones that cannot be identified, need a tokens file (server.tokens_file, `perch token create`)";

/// The local user behind a request's connection (`None`: the server could not say where it
/// came from). `Err` says why the caller is refused.
pub async fn of_request(peer: Option<&crate::listener::Peer>) -> Result<Identity, String> {
    let (client, server, conn) = match peer {
        Some(crate::listener::Peer {
            addr,
            local: Some(local),
            conn,
        }) => (*addr, *local, conn),
        _ => {
            return Err(format!(
                "this server runs open (no tokens file) and cannot tell where this request came from; {USE_TOKENS}"
            ));
        }
    };
    match conn {
        // Read from /proc once per connection, not once per request.
        Some(conn) => conn
            .owner
            .get_or_init(|| local_identity(client, server))
            .await
            .clone(),
        None => local_identity(client, server).await,
    }
}

/// The local user behind a TCP connection from `client` to the server's `server` address
/// (for the PostgreSQL listener too): see the module's description.
pub async fn local_identity(client: SocketAddr, server: SocketAddr) -> Result<Identity, String> {
    tokio::task::spawn_blocking(move || {
        identify(
            client,
            server,
            Path::new(PROC_NET),
            rustix::process::geteuid().as_raw(),
            &login_name,
        )
    })
    .await
    .map_err(|e| format!("identifying the caller: {e}"))?
}

/// The login name of `uid` from the system's user database (NSS, so LDAP users too); `None`
/// without one, or with one that perch does not take as a user name.
fn login_name(uid: u32) -> Option<String> {
    nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .map(|u| u.name)
        .filter(|name| perch_model::NodeId::new(name.clone()).is_ok())
}

fn identify(
    client: SocketAddr,
    server: SocketAddr,
    proc_net: &Path,
    server_uid: u32,
    name_of: &dyn Fn(u32) -> Option<String>,
) -> Result<Identity, String> {
    if !loopback(client.ip()) {
        return Err(format!(
            "this server runs open (no tokens file) and serves only users of its own machine, identified by their uid; {} is not a loopback address: {USE_TOKENS}",
            client.ip()
        ));
    }
    let uids = owners(client, server, proc_net)?;
    let uid = match uids.len() {
        1 => uids.into_iter().next().unwrap_or_default(),
        0 => {
            return Err(format!(
                "this server runs open (no tokens file) and identifies local callers by the uid that owns their connection, but no process owns {client}'s end of it (closed, or in another network namespace); {USE_TOKENS}"
            ));
        }
        _ => {
            return Err(format!(
                "this server runs open (no tokens file) and identifies local callers by the uid that owns their connection, but {client}'s end is listed for several uids; {USE_TOKENS}"
            ));
        }
    };
    identity_of(uid, server_uid, name_of)
}

/// Root and the server's own user are operators; any other uid is an ordinary user, by its
/// login name. An operator uid with no name is `local`; any other is refused.
fn identity_of(
    uid: u32,
    server_uid: u32,
    name_of: &dyn Fn(u32) -> Option<String>,
) -> Result<Identity, String> {
    let operator = uid == 0 || uid == server_uid;
    let user = match name_of(uid) {
        Some(name) => name,
        None if operator => "local".to_owned(),
        None => {
            return Err(format!(
                "uid {uid}, which owns this connection, has no user name perch can use (letters, digits, '.', '_', '-') on this machine; {USE_TOKENS}"
            ));
        }
    };
    Ok(Identity {
        user,
        role: if operator { Role::Operator } else { Role::User },
        nodes: None,
        job: None,
    })
}

fn loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// An address and port as the socket tables compare them (no flow or scope).
type End = (IpAddr, u16);

/// The uids owning a live socket from `client` to `server`, from both tables: an IPv4 socket
/// is in `tcp`, an IPv6 one (with IPv4-mapped addresses, for an IPv4 client of a dual-stack
/// listener) in `tcp6`.
fn owners(
    client: SocketAddr,
    server: SocketAddr,
    proc_net: &Path,
) -> Result<BTreeSet<u32>, String> {
    let v4 = |a: SocketAddr| -> Option<End> {
        let ip = match a.ip() {
            IpAddr::V4(v4) => v4,
            IpAddr::V6(v6) => v6.to_ipv4_mapped()?,
        };
        Some((IpAddr::V4(ip), a.port()))
    };
    let v6 = |a: SocketAddr| -> End {
        let ip = match a.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        (IpAddr::V6(ip), a.port())
    };
    let mut tables = vec![("tcp6", v6(client), v6(server))];
    if let (Some(c), Some(s)) = (v4(client), v4(server)) {
        tables.push(("tcp", c, s));
    }
    let mut uids = BTreeSet::new();
    for (name, client, server) in tables {
        let path = proc_net.join(name);
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            // No IPv6 in this kernel.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("reading {}: {e}", path.display())),
        };
        uids.extend(
            scan(BufReader::new(file.take(MAX_TABLE_BYTES)), client, server)
                .map_err(|e| format!("reading {}: {e}", path.display()))?,
        );
    }
    Ok(uids)
}

/// The uids of the rows of one socket table whose local end is `client` and remote end
/// `server`, skipping rows no process owns (inode 0: closed, or in TIME_WAIT).
fn scan(mut table: impl BufRead, client: End, server: End) -> std::io::Result<BTreeSet<u32>> {
    let mut uids = BTreeSet::new();
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        if table.read_until(b'\n', &mut line)? == 0 {
            return Ok(uids);
        }
        let Some(row) = std::str::from_utf8(&line).ok().and_then(Row::parse) else {
            continue;
        };
        if row.local == client && row.remote == server && row.inode != 0 {
            uids.insert(row.uid);
        }
    }
}

/// One socket's row: `sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt
/// uid timeout inode ...`.
#[derive(Debug, PartialEq, Eq)]
struct Row {
    local: End,
    remote: End,
    uid: u32,
    inode: u64,
}

impl Row {
    /// `None` for the header and anything else that is not a socket's row.
    fn parse(line: &str) -> Option<Row> {
        let mut fields = line.split_ascii_whitespace();
        fields.next()?.strip_suffix(':')?;
        let local = end(fields.next()?)?;
        let remote = end(fields.next()?)?;
        // st, tx_queue:rx_queue, tr:tm->when, retrnsmt
        let mut fields = fields.skip(4);
        let uid = fields.next()?.parse().ok()?;
        let _timeout = fields.next()?;
        let inode = fields.next()?.parse().ok()?;
        Some(Row {
            local,
            remote,
            uid,
            inode,
        })
    }
}

/// An address as the tables print it: the address's 32-bit words as the machine holds them
/// (so byte-swapped on little-endian machines), in hex, then `:` and the port in hex.
fn end(text: &str) -> Option<End> {
    let (ip, port) = text.split_once(':')?;
    if port.len() != 4 || !ip.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |hex: &str| u32::from_str_radix(hex, 16).ok().map(u32::to_ne_bytes);
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(ip)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word(&ip[8 * i..8 * i + 8])?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some((ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How the kernel prints `addr` on this machine.
    fn printed(addr: SocketAddr) -> String {
        let words: Vec<String> = match addr.ip() {
            IpAddr::V4(v4) => vec![format!("{:08X}", u32::from_ne_bytes(v4.octets()))],
            IpAddr::V6(v6) => v6
                .octets()
                .chunks_exact(4)
                .map(|c| format!("{:08X}", u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
        };
        format!("{}:{:04X}", words.concat(), addr.port())
    }

    fn row(local: &str, remote: &str, uid: u32, inode: u64) -> String {
        let (l, r) = (
            printed(local.parse().expect("addr")),
            printed(remote.parse().expect("addr")),
        );
        format!(
            "   3: {l} {r} 01 00000000:00000000 00:00000000 00000000 {uid:>5}        0 {inode} 1 0000000000000000 20 4 30 10 -1\n"
        )
    }

    const HEADER: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n";

    fn ends(client: &str, server: &str) -> (End, End) {
        let (c, s): (SocketAddr, SocketAddr) =
            (client.parse().expect("addr"), server.parse().expect("addr"));
        ((c.ip(), c.port()), (s.ip(), s.port()))
    }

    #[test]
    fn rows_parse_as_the_kernel_prints_them() {
        // A row from a little-endian machine's /proc/net/tcp.
        #[cfg(target_endian = "little")]
        assert_eq!(
            Row::parse(
                "   0: 0100007F:1C84 0100007F:B0A2 01 00000000:00000000 00:00000000 00000000  1000        0 12345 1 0000000000000000 20 4 30 10 -1"
            ),
            Some(Row {
                local: (IpAddr::V4(Ipv4Addr::LOCALHOST), 0x1C84),
                remote: (IpAddr::V4(Ipv4Addr::LOCALHOST), 0xB0A2),
                uid: 1000,
                inode: 12345,
            })
        );
        let v6 = row("[::1]:40000", "[::1]:7300", 1001, 77);
        assert_eq!(
            Row::parse(&v6).map(|r| (r.local, r.remote, r.uid, r.inode)),
            Some((
                (IpAddr::V6(Ipv6Addr::LOCALHOST), 40000),
                (IpAddr::V6(Ipv6Addr::LOCALHOST), 7300),
                1001,
                77
            ))
        );
        for bad in [
            HEADER,
            "",
            "   0: 0100007F 0100007F:B0A2 01 x x x 0 0 1",
            "   0: 0100007G:1C84 0100007F:B0A2 01 x x x 0 0 1",
            "   0: 0100007F:1C84 0100007F:B0A2 01 x x x -1 0 1",
            "   0: 0100007F:1C84 0100007F:B0A2 01 x x x 0 0",
            "   0: 01éé007F:1C84 0100007F:B0A2 01 x x x 0 0 1",
            "   0: 0100007F0:1C84 0100007F:B0A2 01 x x x 0 0 1",
        ] {
            assert_eq!(Row::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_callers_own_live_socket_names_its_uid() {
        let (client, server) = ends("127.0.0.1:40000", "127.0.0.1:7300");
        let check = |table: String, want: &[u32]| {
            let got = scan(table.as_bytes(), client, server).expect("scan");
            assert_eq!(got.into_iter().collect::<Vec<_>>(), want, "{table}");
        };
        // The server's own end (reversed), a listener, another client: not the caller.
        let others = [
            row("127.0.0.1:7300", "127.0.0.1:40000", 0, 10),
            row("127.0.0.1:7300", "0.0.0.0:0", 0, 11),
            row("127.0.0.1:40001", "127.0.0.1:7300", 1002, 12),
        ]
        .concat();
        check(format!("{HEADER}{others}"), &[]);
        check(
            format!(
                "{HEADER}{others}{}",
                row("127.0.0.1:40000", "127.0.0.1:7300", 1001, 13)
            ),
            &[1001],
        );
        // Closed by its process (or in TIME_WAIT): printed as uid 0, inode 0, never root.
        check(
            format!("{HEADER}{}", row("127.0.0.1:40000", "127.0.0.1:7300", 0, 0)),
            &[],
        );
        // Garbage lines and invalid UTF-8 are skipped.
        let mut bytes = b"\xff\xfe garbage\n".to_vec();
        bytes.extend(row("127.0.0.1:40000", "127.0.0.1:7300", 1001, 13).as_bytes());
        let got = scan(&bytes[..], client, server).expect("scan");
        assert_eq!(got.into_iter().collect::<Vec<_>>(), [1001]);
    }

    #[test]
    fn both_tables_are_read_and_mapped_addresses_match_either() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("tcp"),
            format!(
                "{HEADER}{}",
                row("127.0.0.1:40000", "127.0.0.1:7300", 1001, 5)
            ),
        )
        .expect("tcp");
        std::fs::write(
            dir.path().join("tcp6"),
            format!(
                "{HEADER}{}{}",
                row("[::1]:40002", "[::1]:7300", 1002, 6),
                row(
                    "[::ffff:127.0.0.1]:40003",
                    "[::ffff:127.0.0.1]:7300",
                    1003,
                    7
                )
            ),
        )
        .expect("tcp6");
        let owners = |c: &str, s: &str| -> Vec<u32> {
            owners(
                c.parse().expect("addr"),
                s.parse().expect("addr"),
                dir.path(),
            )
            .expect("read")
            .into_iter()
            .collect()
        };
        assert_eq!(owners("127.0.0.1:40000", "127.0.0.1:7300"), [1001]);
        assert_eq!(owners("[::1]:40002", "[::1]:7300"), [1002]);
        // A dual-stack listener sees IPv4 clients as mapped addresses.
        assert_eq!(
            owners("[::ffff:127.0.0.1]:40000", "[::ffff:127.0.0.1]:7300"),
            [1001]
        );
        assert_eq!(owners("127.0.0.1:40003", "127.0.0.1:7300"), [1003]);
        assert!(owners("127.0.0.1:40009", "127.0.0.1:7300").is_empty());
        // Without IPv6 there is no tcp6.
        std::fs::remove_file(dir.path().join("tcp6")).expect("rm");
        assert_eq!(owners("127.0.0.1:40000", "127.0.0.1:7300"), [1001]);
    }

    #[test]
    fn root_and_the_servers_user_are_operators_and_everyone_else_is_themselves() {
        let names = |uid: u32| match uid {
            0 => Some("root".to_owned()),
            500 => Some("perch".to_owned()),
            1001 => Some("alice".to_owned()),
            _ => None,
        };
        let check = |uid: u32, want: Result<(&str, Role), &str>| {
            let got = identity_of(uid, 500, &names);
            match (got, want) {
                (Ok(i), Ok((user, role))) => assert_eq!((i.user.as_str(), i.role), (user, role)),
                (Err(e), Err(part)) => {
                    assert!(e.contains(part) && e.contains("tokens file"), "{e}")
                }
                (got, want) => panic!("uid {uid}: {got:?}, want {want:?}"),
            }
        };
        check(0, Ok(("root", Role::Operator)));
        check(500, Ok(("perch", Role::Operator)));
        check(1001, Ok(("alice", Role::User)));
        check(1002, Err("uid 1002"));
        // The server's user with no name keeps the old name.
        assert_eq!(
            identity_of(600, 600, &names).map(|i| (i.user, i.role)),
            Ok(("local".to_owned(), Role::Operator))
        );
    }

    #[test]
    fn remote_callers_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        for client in [
            "10.0.0.5:40000",
            "[2001:db8::1]:40000",
            "[::ffff:10.0.0.5]:1",
        ] {
            let err = identify(
                client.parse().expect("addr"),
                "127.0.0.1:7300".parse().expect("addr"),
                dir.path(),
                0,
                &|_| Some("root".to_owned()),
            )
            .expect_err(client);
            assert!(
                err.contains("not a loopback address") && err.contains("tokens file"),
                "{err}"
            );
        }
    }

    /// The real tables: a connection made here is owned by this process's user; after its
    /// owner closes it, it is nobody's.
    #[tokio::test]
    async fn a_real_loopback_connection_is_identified_by_its_owner() {
        let me = rustix::process::geteuid().as_raw();
        for bind in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(listener) = tokio::net::TcpListener::bind(bind).await else {
                continue; // no IPv6 here
            };
            let server = listener.local_addr().expect("addr");
            let client = tokio::net::TcpStream::connect(server)
                .await
                .expect("connect");
            let (accepted, peer) = listener.accept().await.expect("accept");
            assert_eq!(client.local_addr().expect("addr"), peer);
            let who = local_identity(peer, accepted.local_addr().expect("addr"))
                .await
                .expect("identified");
            assert_eq!(who.role, Role::Operator, "{bind}: {who:?}");
            let uids = owners(peer, server, Path::new(PROC_NET)).expect("read");
            assert_eq!(uids.into_iter().collect::<Vec<_>>(), [me], "{bind}");
            drop(client);
            let err = local_identity(peer, server).await.expect_err("closed");
            assert!(err.contains("no process owns"), "{err}");
        }
    }
}
