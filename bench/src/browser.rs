//! A headless Chromium driven over WebDriver (`chromedriver`, plain JSON over HTTP): what the
//! web view's browser tests (`tests/web.rs`) and `perch bench web` use. Debian's `chromium` and
//! `chromium-driver` packages provide both programs; `scripts/test.sh` installs them.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One Chromium session through a chromedriver of its own; both end when dropped.
/// chromedriver runs in a process group of its own, which the Chromium it starts (and that
/// browser's helper processes) join: dropping the browser kills the whole group, so none is
/// left behind when the session could not be closed (a chromedriver killed alone orphaned
/// its Chromium).
pub struct Browser {
    driver: Child,
    http: reqwest::blocking::Client,
    session: String,
    endpoint: String,
}

impl Browser {
    /// Starts chromedriver on a free loopback port and opens a headless session with a
    /// `width` x `height` window.
    pub fn start(width: u32, height: u32) -> Result<Browser> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting chromedriver (Debian: apt install chromium chromium-driver)")?;
        perch_model::tls::use_ring();
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()?;
        let mut browser = Browser {
            driver,
            http,
            session: String::new(),
            endpoint: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = browser
                .http
                .get(format!("{}/status", browser.endpoint))
                .send()
                .ok()
                .and_then(|r| r.json::<Value>().ok())
                .is_some_and(|v| v["value"]["ready"] == true);
            if ready {
                break;
            }
            if Instant::now() > deadline {
                bail!("chromedriver did not answer within 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium(),
                // --no-sandbox: tests and benchmarks run as root, where Chromium's sandbox
                // cannot start.
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", format!("--window-size={width},{height}")],
            },
            "goog:loggingPrefs": {"browser": "ALL"},
        }}});
        let created = browser.call("POST", "/session", Some(caps))?;
        browser.session = created["sessionId"]
            .as_str()
            .context("chromedriver gave no session id")?
            .to_owned();
        Ok(browser)
    }

    /// One WebDriver command on this session (`path` after `/session/{id}`), or on the
    /// driver when `path` starts with `/session` and no session exists yet.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
        let url = if self.session.is_empty() {
            format!("{}{path}", self.endpoint)
        } else {
            format!("{}/session/{}{path}", self.endpoint, self.session)
        };
        let request = match method {
            "GET" => self.http.get(&url),
            "DELETE" => self.http.delete(&url),
            _ => self.http.post(&url).json(&body.unwrap_or(json!({}))),
        };
        let response = request.send().with_context(|| format!("{method} {url}"))?;
        let status = response.status();
        let value: Value = response.json().context("chromedriver answered no JSON")?;
        if !status.is_success() {
            bail!("{method} {path}: {status} {}", value["value"]["message"]);
        }
        Ok(value["value"].clone())
    }

    /// Navigates to `url`.
    pub fn go(&self, url: &str) -> Result<()> {
        self.call("POST", "/url", Some(json!({ "url": url })))
            .map(|_| ())
    }

    /// Runs `script` (a function body; `arguments` holds `args`) in the page.
    pub fn js(&self, script: &str, args: Value) -> Result<Value> {
        self.call(
            "POST",
            "/execute/sync",
            Some(json!({ "script": script, "args": args })),
        )
    }

    /// Runs `script` asynchronously: it calls `arguments[arguments.length - 1]` with its result.
    pub fn js_async(&self, script: &str, args: Value) -> Result<Value> {
        self.call(
            "POST",
            "/execute/async",
            Some(json!({ "script": script, "args": args })),
        )
    }

    /// A Chrome DevTools Protocol command (`Performance.getMetrics`, ...).
    pub fn cdp(&self, cmd: &str, params: Value) -> Result<Value> {
        self.call(
            "POST",
            "/goog/cdp/execute",
            Some(json!({ "cmd": cmd, "params": params })),
        )
    }

    /// The browser console's entries since the last call (chromedriver hands each out once).
    pub fn console(&self) -> Result<Vec<Value>> {
        Ok(self
            .call("POST", "/se/log", Some(json!({"type": "browser"})))?
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// A PNG of the window.
    pub fn screenshot(&self) -> Result<Vec<u8>> {
        use base64::Engine;
        let data = self.call("GET", "/screenshot", None)?;
        Ok(base64::engine::general_purpose::STANDARD
            .decode(data.as_str().context("a screenshot as base64")?)?)
    }
}

impl Browser {
    /// The process group of chromedriver and its Chromium (chromedriver's pid).
    pub fn process_group(&self) -> u32 {
        self.driver.id()
    }
}

/// SIGKILLs process group `group` (chromedriver and the Chromium it started).
pub fn kill_group(group: u32) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{group}")])
        .stderr(Stdio::null())
        .status();
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = self.call("DELETE", "", None);
        }
        kill_group(self.driver.id());
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// Debian names the browser `chromium`; `PERCH_CHROMIUM` picks another.
fn chromium() -> String {
    std::env::var("PERCH_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into())
}
