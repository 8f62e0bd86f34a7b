//! The order of precedence of the client's settings, and its messages.

use super::*;

const PRIVATE: u32 = 0o100600;

fn no_env(_: &str) -> Option<String> {
    None
}

fn config_layer(text: &str, mode: u32) -> FileLayer {
    let file = ConfigFile::parse(Path::new("/etc/perch.toml"), text).expect(text);
    FileLayer::from_config(&file, mode)
}

fn user_layer(text: &str, mode: u32) -> FileLayer {
    let path = Path::new("/home/u/.config/perch/config.toml");
    FileLayer::from_user_file(path, text, mode).expect(text)
}

fn config_source(key: &'static str) -> Source {
    Source::ConfigFile {
        path: "/etc/perch.toml".into(),
        key,
    }
}

fn user_source(key: &'static str) -> Source {
    Source::UserFile {
        path: "/home/u/.config/perch/config.toml".into(),
        key,
    }
}

/// One row of the precedence table: the inputs, then the server and token expected.
struct Case<'a> {
    server_flag: Option<&'a str>,
    token_flag: Option<&'a str>,
    env: &'a [(&'a str, &'a str)],
    config: Option<&'a str>,
    user: Option<&'a str>,
}

const NONE: Case<'static> = Case {
    server_flag: None,
    token_flag: None,
    env: &[],
    config: None,
    user: None,
};

fn check(case: Case<'_>, server: (&str, Source), token: Option<(&str, Source)>) {
    let env = |name: &str| {
        case.env
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| (*v).to_owned())
    };
    let config = case.config.map(|t| config_layer(t, PRIVATE));
    let user = case.user.map(|t| user_layer(t, PRIVATE));
    let got = resolve(
        case.server_flag,
        case.token_flag,
        &env,
        config.as_ref(),
        user.as_ref(),
    )
    .expect("resolves");
    assert_eq!(
        (got.server.as_str(), &got.server_source),
        (server.0, &server.1),
        "server"
    );
    let got_token = got.token.as_deref().zip(got.token_source.as_ref());
    assert_eq!(got_token, token.as_ref().map(|(t, s)| (*t, s)), "token");
}

const FULL_CONFIG: &str =
    "[server]\nlisten = \"127.0.0.1:7310\"\n[client]\ntoken = \"config-token\"\n";
const FULL_USER: &str = "[client]\nserver = \"http://user-server:7300\"\ntoken = \"user-token\"\n";

#[test]
fn server_and_token_precedence() {
    // Nothing: the default server, no token.
    check(NONE, (DEFAULT_SERVER, Source::Default), None);
    // The per-user file over the default.
    check(
        Case {
            user: Some(FULL_USER),
            ..NONE
        },
        ("http://user-server:7300", user_source("client.server")),
        Some(("user-token", user_source("client.token"))),
    );
    // The --config file over the per-user file.
    check(
        Case {
            config: Some(FULL_CONFIG),
            user: Some(FULL_USER),
            ..NONE
        },
        ("http://127.0.0.1:7310", config_source("server.listen")),
        Some(("config-token", config_source("client.token"))),
    );
    // The environment over the files.
    check(
        Case {
            env: &[
                ("PERCH_SERVER", "http://env:1/"),
                ("PERCH_TOKEN", "env-token"),
            ],
            config: Some(FULL_CONFIG),
            user: Some(FULL_USER),
            ..NONE
        },
        ("http://env:1", Source::Env("PERCH_SERVER")),
        Some(("env-token", Source::Env("PERCH_TOKEN"))),
    );
    // Flags over everything.
    check(
        Case {
            server_flag: Some("https://flag:2"),
            token_flag: Some("flag-token"),
            env: &[
                ("PERCH_SERVER", "http://env:1"),
                ("PERCH_TOKEN", "env-token"),
            ],
            config: Some(FULL_CONFIG),
            user: Some(FULL_USER),
        },
        ("https://flag:2", Source::Flag("--server")),
        Some(("flag-token", Source::Flag("--token"))),
    );
    // Empty variables count as unset; server and token fall through independently.
    check(
        Case {
            env: &[("PERCH_SERVER", ""), ("PERCH_TOKEN", "env-token")],
            user: Some(FULL_USER),
            ..NONE
        },
        ("http://user-server:7300", user_source("client.server")),
        Some(("env-token", Source::Env("PERCH_TOKEN"))),
    );
    // A config file that names no server leaves it to the per-user file, and its token
    // still wins.
    check(
        Case {
            config: Some("[client]\ntoken = \"config-token\"\n[query]\nmax_rows = 5\n"),
            user: Some(FULL_USER),
            ..NONE
        },
        ("http://user-server:7300", user_source("client.server")),
        Some(("config-token", config_source("client.token"))),
    );
    // `--token ""` sends no token even when a file has one.
    check(
        Case {
            token_flag: Some(""),
            user: Some(FULL_USER),
            ..NONE
        },
        ("http://user-server:7300", user_source("client.server")),
        None,
    );
}

#[test]
fn the_config_file_server_comes_from_client_then_listen_then_agent() {
    let server_of = |text: &str| {
        let got = resolve(
            None,
            None,
            &no_env,
            Some(&config_layer(text, PRIVATE)),
            None,
        )
        .expect(text);
        (got.server, got.server_source)
    };
    let tokens = "tokens_file = \"tokens.toml\"\n";
    for (text, url, key) in [
        (
            "[server]\nlisten = \"127.0.0.1:7310\"\n[client]\nserver = \"http://perch.example:80\"\n[agent]\nserver = \"http://a:1\"\n",
            "http://perch.example:80",
            "client.server",
        ),
        (
            "[server]\nlisten = \"127.0.0.1:7310\"\n[agent]\nserver = \"http://a:1\"\n",
            "http://127.0.0.1:7310",
            "server.listen",
        ),
        (
            &format!("[server]\nlisten = \"0.0.0.0:7310\"\n{tokens}"),
            "http://127.0.0.1:7310",
            "server.listen",
        ),
        (
            &format!("[server]\nlisten = \"[::]:7310\"\n{tokens}"),
            "http://[::1]:7310",
            "server.listen",
        ),
        (
            "[agent]\nserver = \"http://a:1/\"\n",
            "http://a:1",
            "agent.server",
        ),
    ] {
        assert_eq!(
            server_of(text),
            (url.to_owned(), config_source(key)),
            "{text}"
        );
    }
    // A file that sets nothing about the server: the default.
    assert_eq!(
        server_of("[query]\nmax_rows = 5\n"),
        (DEFAULT_SERVER.to_owned(), Source::Default)
    );
}

/// A token kept in a file is not sent to the default address nothing named: on a shared host
/// 127.0.0.1:7300 may be another user's server. A flag or variable's token is the user's
/// explicit choice and goes where the rest of the command goes.
#[test]
fn a_token_from_a_file_never_goes_to_the_default_server() {
    let user = user_layer("[client]\ntoken = \"t\"\n", 0o100600);
    let err = resolve(None, None, &no_env, None, Some(&user)).expect_err("refused");
    let text = format!("{err:#}");
    assert!(text.contains("not sent to http://127.0.0.1:7300"), "{text}");
    assert!(text.contains("[client] server"), "{text}");
    let config = config_layer("[client]\ntoken = \"t\"\n", 0o100600);
    resolve(None, None, &no_env, Some(&config), None).expect_err("refused too");
    // Named anywhere, it goes.
    let got = resolve(Some("http://mine:1"), None, &no_env, None, Some(&user)).expect("named");
    assert_eq!(got.token.as_deref(), Some("t"));
    let both = user_layer(
        "[client]\nserver = \"http://s:1\"\ntoken = \"t\"\n",
        0o100600,
    );
    resolve(None, None, &no_env, None, Some(&both)).expect("same file");
    let got = resolve(None, Some("mine"), &no_env, None, None).expect("a flag's token");
    assert_eq!(got.server, DEFAULT_SERVER);
}

#[test]
fn a_token_in_a_file_others_can_read_is_refused() {
    for (config, user, mode) in [
        (Some("[client]\ntoken = \"t\"\n"), None, 0o100644),
        (None, Some("[client]\ntoken = \"t\"\n"), 0o100640),
        (None, Some("[client]\ntoken = \"t\"\n"), 0o100604),
    ] {
        let config = config.map(|t| config_layer(t, mode));
        let user = user.map(|t| user_layer(t, mode));
        let err =
            resolve(None, None, &no_env, config.as_ref(), user.as_ref()).expect_err("refused");
        let text = format!("{err:#}");
        assert!(text.contains("chmod 600 /"), "{text}");
        assert!(text.contains("client.token"), "{text}");
        assert!(text.contains(&format!("{:03o}", mode & 0o777)), "{text}");
    }
    // Readable by others but holding only the server: fine. So is a readable file whose
    // token is overridden.
    let readable = user_layer("[client]\nserver = \"http://s:1\"\n", 0o100644);
    resolve(None, None, &no_env, None, Some(&readable)).expect("no token, no secret");
    let readable = user_layer("[client]\ntoken = \"t\"\n", 0o100644);
    let got = resolve(None, Some("mine"), &no_env, None, Some(&readable)).expect("overridden");
    assert_eq!(got.token.as_deref(), Some("mine"));
}

#[test]
fn bad_input_names_the_file_or_source_and_the_key() {
    let path = Path::new("/home/u/.config/perch/config.toml");
    for (text, want) in [
        (
            "[client]\nsever = \"http://s:1\"\n",
            "unknown field `sever`",
        ),
        ("server = \"http://s:1\"\n", "unknown field `server`"),
        (
            "[server]\nlisten = \"127.0.0.1:1\"\n",
            "unknown field `server`",
        ),
        ("[client]\nserver = 7300\n", "2 | server = 7300"),
        ("[client\n", "config.toml"),
    ] {
        let err = format!(
            "{:#}",
            FileLayer::from_user_file(path, text, PRIVATE).expect_err(text)
        );
        assert!(err.contains(want), "{text:?}: {err}");
        assert!(err.contains(&path.display().to_string()), "{text:?}: {err}");
    }
    let bad_url = |env: &[(&str, &str)], flag: Option<&str>, user: Option<&str>| {
        let env = |name: &str| {
            env.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        };
        let user = user.map(|t| user_layer(t, PRIVATE));
        format!(
            "{:#}",
            resolve(flag, None, &env, None, user.as_ref()).expect_err("not a URL")
        )
    };
    let err = bad_url(&[("PERCH_SERVER", "perch:7300")], None, None);
    assert!(err.starts_with("PERCH_SERVER: \"perch:7300\""), "{err}");
    let err = bad_url(&[], Some(""), None);
    assert!(err.starts_with("--server: \"\" is not a URL"), "{err}");
    let err = bad_url(&[], None, Some("[client]\nserver = \"s:1\"\n"));
    assert!(
        err.starts_with("client.server in per-user config file /home/u/.config/perch/config.toml"),
        "{err}"
    );
    // A listen address of port 0 cannot tell a client where the server is.
    let zero = config_layer("[server]\nlisten = \"127.0.0.1:0\"\n", PRIVATE);
    let err = format!(
        "{:#}",
        resolve(None, None, &no_env, Some(&zero), None).expect_err("port 0")
    );
    assert!(
        err.contains("server.listen in config file /etc/perch.toml is 127.0.0.1:0"),
        "{err}"
    );
    // ... unless something above it names the server.
    resolve(Some("http://s:1"), None, &no_env, Some(&zero), None).expect("flag wins");
}

#[test]
fn messages_say_where_the_address_came_from() {
    let got = resolve(None, None, &no_env, None, None).expect("default");
    let text = got.unreachable();
    assert!(
        text.contains("at http://127.0.0.1:7300 (from the default, as no --server"),
        "{text}"
    );
    let refused = got.refused_by(&got.server, false);
    assert!(refused.contains("no token: give --token"), "{refused}");
    // A 403 without a token comes from an open server: no token would help there.
    let refused = got.refused_by(&got.server, true);
    assert!(
        refused.contains("runs open") && !refused.contains("give --token"),
        "{refused}"
    );
    let env = |name: &str| (name == "PERCH_SERVER").then(|| "http://gpu-head:7300".to_owned());
    let got = resolve(None, Some("t"), &env, None, None).expect("env");
    assert!(
        got.unreachable()
            .contains("at http://gpu-head:7300 (from PERCH_SERVER)"),
        "{}",
        got.unreachable()
    );
    assert_eq!(
        got.refused_by(&got.server, true),
        "server http://gpu-head:7300 from PERCH_SERVER; token from --token"
    );
}

#[test]
fn the_per_user_file_follows_xdg() {
    let path = |vars: &[(&str, &str)]| {
        user_file_path(&|name: &str| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        })
    };
    assert_eq!(
        path(&[("XDG_CONFIG_HOME", "/x"), ("HOME", "/home/u")]),
        Some(PathBuf::from("/x/perch/config.toml"))
    );
    // A relative XDG_CONFIG_HOME is ignored, as the spec says.
    assert_eq!(
        path(&[("XDG_CONFIG_HOME", "rel"), ("HOME", "/home/u")]),
        Some(PathBuf::from("/home/u/.config/perch/config.toml"))
    );
    assert_eq!(path(&[]), None);
}
