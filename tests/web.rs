//! The web view in a real browser: Debian's headless Chromium driven through WebDriver
//! (`chromedriver`), against `perch demo` (open mode) and a server with tokens. Each view must
//! load without a console error and show what the API and SQL say for the same data; a job is
//! followed from submission to its end; a user token sees only what the API lets it see; a job
//! whose command carries markup stays text. Screenshots go to the test's temporary directory,
//! and to `docs/screenshots/` (what the README shows) with `PERCH_UPDATE_SCREENSHOTS=1`.

mod common;

use common::{AGENT, ALICE, BOB, OPERATOR, Perch, wait_for};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The benchmarks' headless Chromium with what these tests ask of it; a failed WebDriver
/// command fails the test.
struct Browser {
    inner: perch_bench::browser::Browser,
    shots: PathBuf,
}

impl Browser {
    fn start() -> Browser {
        let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("screenshots");
        std::fs::create_dir_all(&shots).expect("screenshot dir");
        let inner = perch_bench::browser::Browser::start(1400, 1000)
            .expect("headless Chromium (Debian's chromium and chromium-driver; scripts/test.sh installs them)");
        // The page follows the system's theme; the tests (and the screenshots) see the dark
        // one unless they ask for the light one.
        inner
            .cdp(
                "Emulation.setEmulatedMedia",
                json!({"features": [{"name": "prefers-color-scheme", "value": "dark"}]}),
            )
            .expect("emulate the dark theme");
        Browser { inner, shots }
    }

    fn go(&self, url: &str) {
        self.inner.go(url).expect("navigate");
    }

    /// Runs `script` (a function body; `arguments` holds `args`) in the page.
    fn js(&self, script: &str, args: Value) -> Value {
        self.inner
            .js(script, args)
            .unwrap_or_else(|e| panic!("{script}: {e:#}"))
    }

    /// Opens `url` (a deep link) and waits until its view has drawn its data; the view
    /// already shown is drawn again.
    fn open(&self, url: &str) {
        let same = self.js(
            "const v = document.getElementById('view'); if (v) v.dataset.ready = '';
             return location.href === arguments[0]",
            json!([url]),
        );
        if same == true {
            self.js(
                "window.dispatchEvent(new HashChangeEvent('hashchange'))",
                json!([]),
            );
        } else {
            self.go(url);
        }
        self.wait_ready(url);
    }

    fn wait_ready(&self, what: &str) {
        wait_for(&format!("the view at {what} to be ready"), || {
            (self.js(
                "return document.getElementById('view')?.dataset.ready ?? null",
                json!([]),
            ) == "1")
                .then_some(())
        });
    }

    /// Errors the page met: its own record (uncaught errors, rejected promises) and the
    /// browser console's SEVERE entries (a file that failed to load, a CSP violation).
    fn errors(&self) -> Vec<String> {
        let mut errors: Vec<String> = self
            .js("return window.__perchErrors || []", json!([]))
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .map(|e| e.to_string())
            .collect();
        for entry in self.inner.console().expect("console") {
            if entry["level"] == "SEVERE" {
                errors.push(entry["message"].to_string());
            }
        }
        errors
    }

    fn assert_no_errors(&self, what: &str) {
        self.assert_only_expected_errors(what, &[]);
    }

    /// Like [`Browser::assert_no_errors`], but the answers the test provoked on purpose (a
    /// refused token, a refused cancel, an unknown job) are logged by the browser as failed
    /// loads: each entry must name one of `expected`'s URL paths and a 401, 403 or 404.
    fn assert_only_expected_errors(&self, what: &str, expected: &[&str]) {
        let unexpected: Vec<String> = self
            .errors()
            .into_iter()
            .filter(|e| {
                !(expected.iter().any(|path| e.contains(path))
                    && (e.contains("status of 401")
                        || e.contains("status of 403")
                        || e.contains("status of 404")))
            })
            .collect();
        assert!(
            unexpected.is_empty(),
            "{what}: the page met errors: {unexpected:#?}"
        );
    }

    fn text(&self, selector: &str) -> String {
        self.js(
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : null",
            json!([selector]),
        )
        .as_str()
        .unwrap_or_default()
        .to_owned()
    }

    fn click(&self, selector: &str) {
        let clicked = self.js(
            "const e = document.querySelector(arguments[0]); if (e) e.click(); return !!e",
            json!([selector]),
        );
        assert_eq!(clicked, true, "nothing to click at {selector}");
    }

    fn screenshot(&self, name: &str) {
        let png = self.inner.screenshot().expect("screenshot");
        std::fs::write(self.shots.join(format!("{name}.png")), &png).expect("write screenshot");
        if std::env::var_os("PERCH_UPDATE_SCREENSHOTS").is_some() {
            let docs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/screenshots");
            std::fs::create_dir_all(&docs).expect("docs/screenshots");
            std::fs::write(docs.join(format!("{name}.png")), &png).expect("write screenshot");
        }
    }
}

fn demo(dir: &std::path::Path) -> Perch {
    let perch = Perch::start(
        dir,
        &[
            "demo",
            "--nodes",
            "4",
            "--gpus-per-node",
            "8",
            "--interval-ms",
            "500",
        ],
    );
    perch.wait_nodes_up(4);
    perch
}

/// SQL over HTTP, as the page sends it.
fn sql_rows(url: &str, token: Option<&str>, query: &str) -> Vec<Value> {
    let mut request = reqwest::blocking::Client::new()
        .post(format!("{url}/v1/sql"))
        .json(&json!({"sql": query, "format": "json"}));
    if let Some(t) = token {
        request = request.bearer_auth(t);
    }
    let answer: Value = request.send().expect("sql").json().expect("json");
    answer["rows"]
        .as_array()
        .unwrap_or_else(|| panic!("{query}: {answer}"))
        .clone()
}

#[test]
fn every_view_loads_and_shows_what_the_api_and_sql_say() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = demo(dir.path());
    let url = perch.url.clone();
    let http = reqwest::blocking::Client::new();

    // `/` is the page for a browser and the JSON index for everyone else.
    let page = http
        .get(format!("{url}/"))
        .header("accept", "text/html,application/xhtml+xml,*/*;q=0.8")
        .send()
        .expect("get /");
    assert!(
        page.headers()["content-security-policy"]
            .to_str()
            .expect("ascii")
            .contains("script-src 'self'")
    );
    assert!(page.text().expect("html").contains("/ui/app.js"));
    let index: Value = http
        .get(format!("{url}/"))
        .send()
        .expect("get /")
        .json()
        .expect("curl still gets JSON");
    assert!(index["endpoints"]["GET /v1/nodes"].is_string());
    let missing = http.get(format!("{url}/ui/nope.js")).send().expect("get");
    assert_eq!(missing.status().as_u16(), 404);
    assert!(missing.text().expect("text").contains("app.js"));

    // Another site cannot act through the user's browser: a cross-site form post to cancel a
    // job is refused, and so is a page that rebinds its own name to the open server.
    wait_for("the demo's job 1 to run", || {
        (perch.job(1)["state"] == "running").then_some(())
    });
    let port = url.rsplit(':').next().expect("port").to_owned();
    let cross_site = http
        .post(format!("{url}/v1/jobs/1/cancel"))
        .header("origin", "http://evil.example")
        .send()
        .expect("post");
    assert_eq!(cross_site.status().as_u16(), 403);
    assert!(cross_site.text().expect("text").contains("evil.example"));
    let rebound = http
        .post(format!("{url}/v1/jobs"))
        .header("host", format!("evil.example:{port}"))
        .header("origin", format!("http://evil.example:{port}"))
        .json(&json!({"command": ["true"]}))
        .send()
        .expect("post");
    assert_eq!(rebound.status().as_u16(), 403);
    assert!(rebound.text().expect("text").contains("loopback"));
    assert_eq!(perch.job(1)["state"], "running", "job 1 was not cancelled");

    let browser = Browser::start();

    // Fleet: a cell per GPU, each showing the utilization of the very sample SQL has for it.
    browser.open(&format!("{url}/"));
    browser.assert_no_errors("fleet");
    let checked = wait_for("the fleet's cells to equal SQL", || {
        let cells = browser.js(
            "return [...document.querySelectorAll('.node')].flatMap(n => [...n.querySelectorAll('.gpu')]
               .map(c => ({node: n.dataset.node, gpu: +c.dataset.gpu, util: c.dataset.util,
                           ms: c.dataset.sampleMs, job: c.dataset.job})))",
            json!([]),
        );
        let cells = cells.as_array().expect("cells").clone();
        assert_eq!(cells.len(), 32, "4 nodes x 8 GPUs: {cells:?}");
        let wanted: Vec<String> = cells
            .iter()
            .filter(|c| c["ms"] != "")
            .map(|c| {
                format!(
                    "(node = '{}' AND gpu = {} AND time = to_timestamp_millis({}))",
                    c["node"].as_str().expect("node"),
                    c["gpu"],
                    c["ms"].as_str().expect("ms")
                )
            })
            .collect();
        if wanted.len() < 32 {
            return None;
        }
        let rows = sql_rows(
            &url,
            None,
            &format!(
                "SELECT node, gpu, utilization_gpu_pct AS u FROM gpu_samples WHERE {}",
                wanted.join(" OR ")
            ),
        );
        let running = sql_rows(
            &url,
            None,
            "SELECT node, gpu, job FROM job_allocations WHERE end_time IS NULL",
        );
        let all_equal = cells.iter().all(|c| {
            let sample = rows
                .iter()
                .find(|r| r["node"] == c["node"] && r["gpu"] == c["gpu"]);
            let util_equal = sample.is_some_and(|r| {
                r["u"].as_f64() == c["util"].as_str().and_then(|u| u.parse::<f64>().ok())
            });
            let holder = running
                .iter()
                .find(|r| r["node"] == c["node"] && r["gpu"] == c["gpu"])
                .map(|r| r["job"].to_string())
                .unwrap_or_default();
            util_equal && holder == c["job"].as_str().unwrap_or_default()
        });
        all_equal.then_some(cells.len())
    });
    assert_eq!(checked, 32);
    let held = browser.js(
        "return document.querySelector('#sum-held .v').textContent",
        json!([]),
    );
    let allocated: usize = perch.get("/v1/nodes")["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|n| n["allocated_gpus"].as_u64().unwrap_or(0) as usize)
        .sum();
    assert_eq!(held, format!("{allocated} / 32"));
    assert!(
        browser.text("#banner").contains("simulated"),
        "the demo's GPUs are labelled simulated"
    );
    // A drained node is marked on its card and every one of its cells.
    let drained = http
        .post(format!("{url}/v1/nodes/sim-node-003/drain"))
        .send()
        .expect("drain");
    assert!(drained.status().is_success());
    wait_for("the fleet to show sim-node-003 drained", || {
        let marked = browser.js(
            "const n = document.querySelector('.node[data-node=\"sim-node-003\"]');
             return n.dataset.state === 'drained'
               && [...n.querySelectorAll('.gpu')].every(c => c.classList.contains('drained'))",
            json!([]),
        );
        (marked == true).then_some(())
    });
    assert_eq!(browser.text("#sum-drained .v"), "1");
    browser.screenshot("fleet");
    let resumed = http
        .post(format!("{url}/v1/nodes/sim-node-003/resume"))
        .send()
        .expect("resume");
    assert!(resumed.status().is_success());

    // Filtering by user dims the other users' GPUs and keeps the link in the address.
    browser.js(
        "const s = document.querySelector('select[data-f=user]'); s.value = 'alice';
         s.dispatchEvent(new Event('input', {bubbles: true}))",
        json!([]),
    );
    let (lit, dimmed) = {
        let v = browser.js(
            "const c = [...document.querySelectorAll('.node .gpu')];
             return [c.filter(x => !x.classList.contains('dim') && !x.closest('.node').hidden)
                       .map(x => x.dataset.user), c.filter(x => x.classList.contains('dim')).length]",
            json!([]),
        );
        (v[0].as_array().expect("lit").clone(), v[1].clone())
    };
    assert!(!lit.is_empty(), "alice has GPUs in the demo");
    assert!(
        lit.iter().all(|u| u
            .as_str()
            .unwrap_or_default()
            .split(' ')
            .any(|u| u == "alice")),
        "{lit:?}"
    );
    assert!(dimmed.as_u64().unwrap_or(0) > 0);
    // The cards count alice's GPUs only.
    let alices = perch.get("/v1/nodes")["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .flat_map(|n| n["gpu_status"].as_array().cloned().unwrap_or_default())
        .filter(|g| {
            g["jobs"]
                .as_array()
                .is_some_and(|j| j.iter().any(|j| j["user"] == "alice"))
        })
        .count();
    let held = browser.text("#sum-held .v");
    assert_eq!(
        held,
        format!("{alices} / {alices}"),
        "alice's GPUs are all held"
    );
    assert!(
        browser
            .js("return location.hash", json!([]))
            .as_str()
            .unwrap_or_default()
            .contains("user=alice")
    );
    browser.screenshot("fleet-filtered");

    // The compact drawing a large fleet gets (forced here on four nodes): every GPU still
    // a cell, its details on hover.
    browser.open(&format!("{url}/#/fleet?cells=compact"));
    assert_eq!(
        browser.js(
            "return [document.getElementById('fleet').classList.contains('compact'),
                     document.querySelectorAll('.node .gpu[title]').length]",
            json!([])
        ),
        json!([true, 32])
    );

    // Every other view, by its deep link.
    let node = "sim-node-000";
    for (name, link) in [
        ("queue", "#/queue".to_owned()),
        ("jobs", "#/jobs".to_owned()),
        ("job", "#/jobs/1".to_owned()),
        ("node", format!("#/nodes/{node}")),
        ("occupancy", "#/occupancy?hours=0.25".to_owned()),
        ("accounts", "#/accounts?days=all".to_owned()),
        ("alerts", "#/alerts".to_owned()),
        (
            "sql",
            "#/sql?q=SELECT%2040%20%2B%202%20AS%20answer".to_owned(),
        ),
    ] {
        browser.open(&format!("{url}/{link}"));
        browser.assert_no_errors(name);
        browser.screenshot(name);
    }
    assert_eq!(browser.text("#sql-rows tbody td"), "42");
    // Its CSV download is the server's CSV of the same query.
    let downloads = dir.path().join("downloads");
    std::fs::create_dir_all(&downloads).expect("downloads dir");
    browser
        .inner
        .cdp(
            "Browser.setDownloadBehavior",
            json!({"behavior": "allow", "downloadPath": downloads.to_str().expect("utf-8")}),
        )
        .expect("allow downloads");
    browser.click("#csv");
    let csv = wait_for("the CSV download", || {
        std::fs::read_to_string(downloads.join("perch-query.csv")).ok()
    });
    assert_eq!(csv.trim(), "answer\n42", "{csv}");
    // A query the server refuses shows its message, not an empty table.
    browser.open(&format!("{url}/#/sql?q=DROP%20TABLE%20gpu_samples"));
    let refusal = browser.text("#sql-error");
    assert!(refusal.contains("read-only"), "{refusal}");
    browser.assert_only_expected_errors("the refused SQL", &["/v1/sql"]);

    // The queue lists what the API's queue lists, in its order.
    browser.open(&format!("{url}/#/queue"));
    let shown: Vec<Value> = browser
        .js(
            "return [...document.querySelectorAll('#queue tbody tr')].map(r => r.cells[1].textContent)",
            json!([]),
        )
        .as_array()
        .expect("rows")
        .clone();
    let queued: Vec<String> = perch.get("/v1/queue")["queue"]
        .as_array()
        .expect("queue")
        .iter()
        .map(|e| e["job"]["id"].to_string())
        .collect();
    assert!(!queued.is_empty(), "the demo keeps gangs waiting");
    assert_eq!(
        shown
            .iter()
            .map(|s| s.as_str().unwrap_or_default())
            .collect::<Vec<_>>(),
        queued
    );

    // Occupancy: a band per running allocation, listed with its job.
    browser.open(&format!("{url}/#/occupancy?hours=0.25"));
    let listed = browser.js(
        "return [...document.querySelectorAll('#occ-allocs tbody tr')].map(r => r.cells[0].textContent)",
        json!([]),
    );
    let listed: Vec<String> = listed
        .as_array()
        .expect("rows")
        .iter()
        .map(|v| v.as_str().unwrap_or_default().to_owned())
        .collect();
    for row in sql_rows(
        &url,
        None,
        "SELECT DISTINCT job FROM job_allocations WHERE end_time IS NULL",
    ) {
        assert!(
            listed.contains(&row["job"].to_string()),
            "{row} in {listed:?}"
        );
    }

    // A band is a link: clicking a running allocation's band opens its job.
    let clicked = browser.js(
        "const c = document.getElementById('occ'); const l = c.__layout;
         const a = l.allocs.find(a => a.e >= l.t1);
         if (!a) return null;
         const i = l.gpus.findIndex(([n, g]) => n === a.node && g === a.gpu);
         const r = c.getBoundingClientRect();
         c.dispatchEvent(new MouseEvent('click', {bubbles: true,
           clientX: r.left + l.width - 2, clientY: r.top + i * l.row + l.row / 2}));
         return a.job",
        json!([]),
    );
    let clicked = clicked.as_u64().expect("a running allocation to click");
    wait_for("the click to open the band's job", || {
        (browser.js("return location.hash", json!([])) == format!("#/jobs/{clicked}").as_str())
            .then_some(())
    });
    browser.wait_ready("the clicked job");

    // The job page charts the job's own OpenTelemetry metrics (the demo's trainers push a
    // simulated loss and throughput), labelled simulated.
    let pushed = wait_for("a job's pushed metrics in SQL", || {
        sql_rows(&url, None, "SELECT job FROM job_metrics LIMIT 1")
            .first()
            .and_then(|r| r["job"].as_str().map(str::to_owned))
    });
    browser.open(&format!("{url}/#/jobs/{pushed}"));
    let charted = browser.text("#c-otel");
    assert!(
        charted.contains("loss") && charted.contains("samples_per_second"),
        "{charted}"
    );
    assert!(charted.contains("simulated"), "{charted}");
    assert_eq!(
        browser.js(
            "return document.querySelectorAll('#c-otel .uplot, #c-util .uplot').length >= 3",
            json!([])
        ),
        true
    );

    // Accounts: the page's figures lie between SQL's before and after it read them (running
    // jobs keep adding GPU-hours), and it names exactly SQL's accounts and users.
    let accounts_sql = |days: &str| {
        browser.open(&format!("{url}/#/accounts?days={days}"));
        let href = browser.js(
            "return document.querySelector('#acc-sql a').getAttribute('href')",
            json!([]),
        );
        let href = href.as_str().expect("a link to the SQL").to_owned();
        let q = href.split_once("?q=").expect("?q=").1.to_owned();
        url_decode(&q)
    };
    let query = accounts_sql("all");
    let before = sql_rows(&url, None, &query);
    browser.open(&format!("{url}/#/accounts?days=all"));
    let page = browser.js(
        "return [...document.querySelectorAll('#accounts tbody tr')].map(r => [...r.cells].map(c => c.textContent))",
        json!([]),
    );
    let after = sql_rows(&url, None, &query);
    let page = page.as_array().expect("rows").clone();
    assert_eq!(page.len(), after.len(), "{page:?} against {after:?}");
    for row in &page {
        let cell = |i: usize| row[i].as_str().unwrap_or_default().to_owned();
        let matching = |rows: &[Value]| {
            rows.iter()
                .find(|r| r["account"] == cell(0).as_str() && r["user_name"] == cell(1).as_str())
                .cloned()
                .unwrap_or_else(|| panic!("{row:?} is not in SQL's answer"))
        };
        let (b, a) = (matching(&before), matching(&after));
        let shown: f64 = cell(3).parse().expect("GPU-hours");
        let low = (b["gpu_hours_allocated"].as_f64().expect("f64") * 100.0).floor() / 100.0;
        let high = (a["gpu_hours_allocated"].as_f64().expect("f64") * 100.0).ceil() / 100.0;
        assert!(
            low <= shown && shown <= high,
            "{row:?}: {shown} not within [{low}, {high}]"
        );
        assert_eq!(cell(2), a["jobs"].to_string(), "{row:?}");
    }

    // A job from submission to its end: its page follows the state and the output live.
    let submitted: Value = http
        .post(format!("{url}/v1/jobs"))
        .json(
            &json!({"command": ["sh", "-c", "echo web-hello; sleep 4; echo web-bye"],
                      "user": "carol", "name": "followed", "time_limit_secs": 120}),
        )
        .send()
        .expect("submit")
        .json()
        .expect("json");
    let id = submitted["id"].as_u64().expect("id");
    browser.open(&format!("{url}/#/jobs/{id}"));
    let seen_running = wait_for("the job page to show it running or done", || {
        let state = browser.text("#job-title .badge");
        (state == "running" || state == "completed").then_some(state)
    });
    wait_for("the API to say the job completed", || {
        let job: Value = http
            .get(format!("{url}/v1/jobs/{id}"))
            .send()
            .ok()?
            .json()
            .ok()?;
        (job["state"] == "completed").then_some(())
    });
    // The job page polls every 3 s: it follows the job if it shows the end within a few polls
    // of the API saying so, not merely before the test gives up.
    let ended = Instant::now();
    wait_for(
        "the page to show the job completed with its whole output",
        || {
            let log = browser.text("#log");
            (browser.text("#job-title .badge") == "completed" && log.contains("web-bye"))
                .then_some(())
        },
    );
    let lag = ended.elapsed();
    assert!(
        lag < Duration::from_secs(12),
        "the job page showed the end {lag:?} after the API did (it polls every 3 s)"
    );
    assert!(browser.text("#log").contains("web-hello"), "{seen_running}");
    assert!(browser.text("#timeline").contains("started on"));
    assert!(
        browser.text("#job-actions").is_empty(),
        "an ended job has no cancel button"
    );
    browser.assert_no_errors("job page");
}

/// `%XX` and `+` decoding for the SQL link the accounts view carries.
fn url_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).expect("ascii");
                out.push(u8::from_str_radix(hex, 16).expect("hex"));
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).expect("utf-8")
}

#[test]
fn a_user_token_sees_what_the_api_lets_it_see_and_markup_stays_text() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = common::server_with_tokens(dir.path(), &common::role_tokens("web-a"));
    let url = server.url.clone();
    let _agent = common::Agent::start(
        &url,
        "web-a",
        &dir.path().join("agent"),
        2,
        Some(AGENT),
        &["--interval-ms", "500"],
    );
    wait_for("the agent's node", || {
        let nodes: Value = reqwest::blocking::Client::new()
            .get(format!("{url}/v1/nodes"))
            .bearer_auth(OPERATOR)
            .send()
            .ok()?
            .json()
            .ok()?;
        (common::nodes_up(&nodes) == 1).then_some(())
    });
    let submit = |token: &str, body: Value| -> u64 {
        let answer: Value = reqwest::blocking::Client::new()
            .post(format!("{url}/v1/jobs"))
            .bearer_auth(token)
            .json(&body)
            .send()
            .expect("submit")
            .json()
            .expect("json");
        answer["id"].as_u64().unwrap_or_else(|| panic!("{answer}"))
    };
    // Bob's job carries a secret and markup in its command; alice's is her own.
    let bobs = submit(
        BOB,
        json!({"command": ["sh", "-c", "sleep 60 # <img src=x onerror=\"window.__pwned=1\"><script>window.__pwned=2</script>"],
               "env": {"API_KEY": "bob-secret-value"}, "name": "bobs", "time_limit_secs": 120}),
    );
    let alices = submit(
        ALICE,
        json!({"command": ["sh", "-c", "echo alice-out; sleep 60"], "name": "alices", "time_limit_secs": 120}),
    );

    let browser = Browser::start();
    // No token: the page asks for one, and refuses a wrong one and an agent's.
    browser.go(&format!("{url}/#/jobs/{alices}"));
    browser.wait_ready("sign-in");
    assert!(
        browser
            .js("return location.hash", json!([]))
            .as_str()
            .unwrap_or_default()
            .starts_with("#/signin")
    );
    browser.screenshot("signin");
    let sign_in = |token: &str| {
        browser.js(
            "document.getElementById('token').value = arguments[0];
             document.getElementById('signin').requestSubmit()",
            json!([token]),
        );
    };
    sign_in("wrong-token-0123456789");
    wait_for("the refusal", || {
        (!browser.text("#signin-msg").is_empty()).then_some(())
    });
    sign_in(AGENT);
    wait_for("the agent token refused", || {
        browser.text("#signin-msg").contains("agent").then_some(())
    });
    // Alice lands on the page she asked for. The sign-in view was ready already, so wait for
    // her name first: the view's ready mark alone could still be the sign-in view's, before the
    // token is checked (a test that read the name at once failed under load).
    sign_in(ALICE);
    wait_for("alice signed in", || {
        browser.text("#who").contains("alice (user)").then_some(())
    });
    browser.wait_ready("alice's job");
    assert!(
        browser
            .js("return location.hash", json!([]))
            .as_str()
            .unwrap_or_default()
            .ends_with(&format!("/jobs/{alices}"))
    );
    wait_for("alice's output", || {
        browser.text("#log").contains("alice-out").then_some(())
    });
    assert!(
        browser.text("#job-actions").contains("Cancel"),
        "her own job"
    );
    assert_eq!(
        browser.js("return localStorage.length", json!([])),
        0,
        "the token is kept for the tab only"
    );

    // Bob's job: no command, no environment, no output, no cancel button for alice.
    browser.open(&format!("{url}/#/jobs/{bobs}"));
    let body = browser.text("main");
    assert!(body.contains("not yours"), "{body}");
    assert!(!body.contains("bob-secret-value"), "{body}");
    assert!(!body.contains("API_KEY"), "{body}");
    assert!(browser.text("#job-actions").is_empty());
    // Nor may she cancel it from the page's own API access.
    let cancel_status = browser
        .inner
        .js_async(
            "const done = arguments[arguments.length - 1];
             fetch(arguments[0], {method: 'POST', headers: {Authorization: 'Bearer ' + sessionStorage.getItem('perch.token')}})
               .then(r => done(r.status))",
            json!([format!("/v1/jobs/{bobs}/cancel")]),
        )
        .expect("fetch from the page");
    assert_eq!(cancel_status, 403);
    browser.screenshot("job-not-yours");

    // Her job list is her own jobs first, everyone's one choice away.
    browser.open(&format!("{url}/#/jobs"));
    let users = |b: &Browser| -> Vec<String> {
        table_rows(b, "#jobs tbody tr")
            .iter()
            .map(|r| r[2].clone())
            .collect()
    };
    let mine = users(&browser);
    assert!(
        !mine.is_empty() && mine.iter().all(|u| u == "alice"),
        "{mine:?}"
    );
    assert_eq!(
        browser.js(
            "return document.getElementById('jobs-scope').value",
            json!([])
        ),
        "mine"
    );
    browser.js(
        "const s = document.getElementById('jobs-scope'); s.value = 'all';
         s.dispatchEvent(new Event('change', {bubbles: true}))",
        json!([]),
    );
    wait_for("everyone's jobs", || {
        users(&browser).iter().any(|u| u == "bob").then_some(())
    });
    browser.assert_only_expected_errors(
        "alice's views",
        &["/v1/whoami", &format!("/v1/jobs/{bobs}/cancel")],
    );

    // The operator sees bob's command, as text: the markup in it runs nothing.
    browser.click("#signout");
    browser.wait_ready("sign-in after sign-out");
    assert_eq!(
        browser.js("return sessionStorage.getItem('perch.token')", json!([])),
        Value::Null
    );
    sign_in(OPERATOR);
    wait_for("the operator signed in", || {
        browser
            .text("#who")
            .contains("ops (operator)")
            .then_some(())
    });
    browser.open(&format!("{url}/#/jobs/{bobs}"));
    let command = browser.text("#job-kv dd.mono");
    assert!(command.contains("<img src=x"), "{command}");
    assert!(browser.text("main").contains("bob-secret-value"));
    assert_eq!(
        browser.js(
            "return [window.__pwned ?? null, document.querySelectorAll('main img, main script').length]",
            json!([])
        ),
        json!([null, 0])
    );
    // And may cancel it, in two clicks.
    wait_for("the cancel button", || {
        browser
            .text("#job-actions")
            .contains("Cancel")
            .then_some(())
    });
    browser.click("#cancel");
    browser.click("#cancel");
    wait_for("bob's job cancelled", || {
        let job: Value = reqwest::blocking::Client::new()
            .get(format!("{url}/v1/jobs/{bobs}"))
            .bearer_auth(BOB)
            .send()
            .ok()?
            .json()
            .ok()?;
        (job["state"] == "cancelled").then_some(())
    });
    browser.assert_no_errors("the operator's views");
}

/// Posts `body` to `url` + `path` on an open server and returns the answer's JSON.
fn post_json(url: &str, path: &str, body: &Value) -> Value {
    let r = reqwest::blocking::Client::new()
        .post(format!("{url}{path}"))
        .json(body)
        .send()
        .expect("post");
    let status = r.status();
    let answer: Value = r.json().unwrap_or(Value::Null);
    assert!(status.is_success(), "{path}: {status} {answer}");
    answer
}

/// Reports XID 79 on `node`'s GPU `gpu` through the ingest API, as its agent would.
fn report_xid(url: &str, node: &str, gpu: u32) {
    post_json(
        url,
        "/v1/ingest",
        &json!({"node": node, "seq": u64::MAX / 2, "gpu_events": [{
            "time_ms": common::now_ms(), "gpu": gpu, "uuid": format!("GPU-SIM-{gpu}"),
            "simulated": true, "kind": "xid", "xid": 79
        }]}),
    );
}

/// The fleet leads from a symptom to its GPUs: problem cards that list them (node, GPU, job,
/// user, since), problems first in the compact drawing and named above it, a shape for every
/// state as well as a colour, one tab stop with arrow keys and spoken labels, a light theme;
/// a node is drained with a reason after a confirmation, and an alert links to its node and
/// is silenced from the page.
#[test]
fn the_fleet_leads_from_a_problem_to_its_gpus() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = demo(dir.path());
    let url = perch.url.clone();
    report_xid(&url, "sim-node-001", 2);
    // Drained from the CLI with a reason, which the page shows.
    let (ok, out, err) = perch.cli_as(
        "root",
        &["drain", "sim-node-003", "--reason", "fan noise, ticket 77"],
    );
    assert!(ok, "{out}{err}");
    let browser = Browser::start();

    browser.open(&format!("{url}/#/fleet"));
    wait_for("the unhealthy GPU counted", || {
        (browser.text("#sum-bad .v") == "1").then_some(())
    });
    // The count is a button: it lists the GPU, and the grid shows only its node.
    browser.click("#sum-bad");
    let listed = wait_for("the unhealthy GPU listed", || {
        let rows = browser.js(
            "return [...document.querySelectorAll('#problem-list tbody tr')].map(r => [...r.cells].map(c => c.textContent))",
            json!([]),
        );
        let rows = rows.as_array().cloned().unwrap_or_default();
        (rows.len() == 1 && rows[0][5] != "–").then_some(rows)
    });
    let row: Vec<&str> = listed[0]
        .as_array()
        .expect("cells")
        .iter()
        .map(|c| c.as_str().unwrap_or_default())
        .collect();
    assert_eq!(row[0], "sim-node-001", "{row:?}");
    assert_eq!(row[1], "2", "{row:?}");
    assert!(row[2].contains("xid 79"), "{row:?}");
    assert!(row[5].contains(':'), "since when: {row:?}");
    assert_eq!(
        browser.js(
            "return [...document.querySelectorAll('.node:not([hidden])')].map(n => n.dataset.node)",
            json!([])
        ),
        json!(["sim-node-001"])
    );
    assert!(
        browser
            .js("return location.hash", json!([]))
            .as_str()
            .unwrap_or_default()
            .contains("show=bad")
    );
    // Drained GPUs, with the reason and since when.
    browser.click("#sum-drained");
    let drained = wait_for("the drained GPUs listed", || {
        let rows = browser.js(
            "return [...document.querySelectorAll('#problem-list tbody tr')].map(r => [...r.cells].map(c => c.textContent))",
            json!([]),
        );
        let rows = rows.as_array().cloned().unwrap_or_default();
        (rows.len() == 8 && rows[0][5] != "–").then_some(rows)
    });
    assert!(
        drained
            .iter()
            .all(|r| r[0] == "sim-node-003" && r[2] == "fan noise, ticket 77"),
        "{drained:?}"
    );
    // Allocated and idle: as many listed as counted, each with its job and user.
    browser.click("#sum-idle");
    wait_for("the idle GPUs listed", || {
        let got = browser.js(
            "const n = +document.querySelector('#sum-idle .v').textContent;
             const rows = [...document.querySelectorAll('#problem-list tbody tr')]
               .filter(r => !r.querySelector('td.muted'));
             return document.querySelector('#problem-title') !== null
               && rows.length === n && rows.every(r => r.cells[3].querySelector('a') && r.cells[4].textContent)",
            json!([]),
        );
        (got == true).then_some(())
    });
    browser.screenshot("fleet-problems");
    browser.assert_no_errors("the problem lists");

    // Compact: the problem node drawn first, the fault named in words above the grid.
    browser.open(&format!("{url}/#/fleet?cells=compact"));
    wait_for("problem nodes first", || {
        let order = browser.js(
            "return [...document.querySelectorAll('#fleet .node')].map(n => n.dataset.node)",
            json!([]),
        );
        (order[0] == "sim-node-001" && order[1] == "sim-node-003").then_some(())
    });
    let strip = browser.text("#problems");
    assert!(
        strip.contains("sim-node-001 GPU 2") && strip.contains("xid 79"),
        "{strip}"
    );

    // One tab stop for the whole grid; arrows move; each cell says what it is in words.
    let keys = browser.js(
        "const f = document.getElementById('fleet');
         const stops = [...f.querySelectorAll('a, button, [tabindex]')].filter(e => e.tabIndex >= 0);
         const first = stops[0]; first.focus();
         const key = (k) => document.activeElement.dispatchEvent(new KeyboardEvent('keydown', {key: k, bubbles: true}));
         key('ArrowRight');
         const right = [document.activeElement.closest('.node').dataset.node, document.activeElement.dataset.gpu];
         key('ArrowDown');
         const down = [document.activeElement.closest('.node').dataset.node, document.activeElement.dataset.gpu];
         return {stops: stops.length, first: [first.closest('.node').dataset.node, first.dataset.gpu],
                 right, down, label: first.getAttribute('aria-label'),
                 after: [...f.querySelectorAll('[tabindex=\"0\"]')].length}",
        json!([]),
    );
    assert_eq!(keys["stops"], 1, "{keys}");
    assert_eq!(keys["first"], json!(["sim-node-001", "0"]), "{keys}");
    assert_eq!(keys["right"], json!(["sim-node-001", "1"]), "{keys}");
    assert_eq!(keys["down"], json!(["sim-node-003", "1"]), "{keys}");
    assert_eq!(keys["after"], 1, "{keys}");
    let label = keys["label"].as_str().unwrap_or_default();
    assert!(
        label.starts_with("sim-node-001 GPU 0: ") && label.contains("utilization"),
        "{label}"
    );
    let bad_label = browser.js(
        "return document.querySelector('.node[data-node=\"sim-node-001\"] .gpu[data-gpu=\"2\"]').getAttribute('aria-label')",
        json!([]),
    );
    assert!(
        bad_label
            .as_str()
            .unwrap_or_default()
            .contains("unhealthy (xid 79)"),
        "{bad_label}"
    );

    // N opens the focused cell's node.
    let node_link = browser.js(
        "const c = document.querySelector('#fleet .gpu[tabindex=\"0\"]'); c.focus();
         c.dispatchEvent(new KeyboardEvent('keydown', {key: 'n', bubbles: true}));
         return [c.closest('.node').dataset.node, location.hash]",
        json!([]),
    );
    assert_eq!(
        node_link[1],
        format!("#/nodes/{}", node_link[0].as_str().unwrap_or_default()),
        "{node_link}"
    );

    // Colour-blind safe: each state's cell differs from every other's in a property that is
    // not a colour (border style, the pattern drawn on it), in both drawings.
    for compact in [false, true] {
        let looks = browser.js(
            "const box = document.createElement('div');
             box.className = 'fleet' + (arguments[0] ? ' compact' : '');
             document.body.appendChild(box);
             const out = {};
             for (const state of ['free', 'busy', 'idle', 'shared', 'bad', 'drained', 'off']) {
               const c = document.createElement('a');
               c.className = 'gpu ' + (state === 'busy' ? '' : state);
               box.appendChild(c);
               const s = getComputedStyle(c);
               out[state] = [s.borderTopStyle, s.outlineStyle,
                 s.backgroundImage.replace(/(rgba?|hsla?)\\([^)]*\\)|#[0-9a-f]+|\\b(transparent|white|black)\\b/gi, 'C')].join(' | ');
             }
             box.remove();
             return out",
            json!([compact]),
        );
        let looks = looks.as_object().expect("styles");
        // Busy and free differ by their fill (utilization), not by a problem pattern.
        let states = ["free", "idle", "shared", "bad", "drained", "off"];
        for (i, a) in states.iter().enumerate() {
            for b in &states[i + 1..] {
                if (*a, *b) == ("free", "busy") {
                    continue;
                }
                assert_ne!(
                    looks[*a], looks[*b],
                    "compact={compact}: {a} and {b} differ only in colour: {looks:?}"
                );
            }
        }
    }

    // A light theme when the system asks for one, with readable contrast (dark otherwise).
    browser.open(&format!("{url}/#/fleet"));
    let dark = browser.js(
        "return getComputedStyle(document.body).backgroundColor",
        json!([]),
    );
    assert_eq!(dark, "rgb(18, 22, 31)", "the dark theme by default");
    browser
        .inner
        .cdp(
            "Emulation.setEmulatedMedia",
            json!({"features": [{"name": "prefers-color-scheme", "value": "light"}]}),
        )
        .expect("emulate light");
    let contrast = browser.js(
        "const rgb = (c) => c.match(/\\d+(\\.\\d+)?/g).slice(0, 3).map(Number);
         const lum = (c) => { const [r, g, b] = rgb(c).map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
           return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
         const body = getComputedStyle(document.body);
         const muted = getComputedStyle(document.querySelector('.legend') || document.body).color;
         const ratio = (a, b) => (Math.max(lum(a), lum(b)) + 0.05) / (Math.min(lum(a), lum(b)) + 0.05);
         return {bg: lum(body.backgroundColor), text: ratio(body.color, body.backgroundColor), muted: ratio(muted, body.backgroundColor)}",
        json!([]),
    );
    assert!(contrast["bg"].as_f64().unwrap_or(0.0) > 0.8, "{contrast}");
    assert!(
        contrast["text"].as_f64().unwrap_or(0.0) >= 7.0,
        "{contrast}"
    );
    assert!(
        contrast["muted"].as_f64().unwrap_or(0.0) >= 4.5,
        "{contrast}"
    );
    browser.screenshot("fleet-light");
    browser
        .inner
        .cdp(
            "Emulation.setEmulatedMedia",
            json!({"features": [{"name": "prefers-color-scheme", "value": "dark"}]}),
        )
        .expect("emulate dark");

    // Drain asks why and for a confirmation; then only Resume is offered.
    let node_state = |name: &str| {
        perch.get("/v1/nodes")["nodes"]
            .as_array()
            .expect("nodes")
            .iter()
            .find(|n| n["name"] == name)
            .map(|n| n["state"].as_str().unwrap_or_default().to_owned())
            .unwrap_or_default()
    };
    browser.open(&format!("{url}/#/nodes/sim-node-002"));
    wait_for("the drain button", || {
        browser
            .text("#node-actions")
            .contains("Drain")
            .then_some(())
    });
    assert_eq!(
        browser.js("return document.getElementById('resume')", json!([])),
        Value::Null,
        "an up node offers no Resume"
    );
    browser.click("#drain");
    assert_eq!(node_state("sim-node-002"), "up", "one click drains nothing");
    browser.js(
        "document.getElementById('drain-reason').value = 'memory errors';
         document.getElementById('drain-form').requestSubmit()",
        json!([]),
    );
    wait_for("sim-node-002 drained", || {
        (node_state("sim-node-002") == "drained").then_some(())
    });
    let reason = sql_rows(
        &url,
        None,
        "SELECT reason FROM nodes WHERE node = 'sim-node-002'",
    );
    assert_eq!(reason[0]["reason"], "memory errors");
    wait_for("only Resume shown", || {
        (browser.js(
            "return [!!document.getElementById('resume'), !!document.getElementById('drain')]",
            json!([]),
        ) == json!([true, false])
            && browser.text("#node-why").contains("memory errors"))
        .then_some(())
    });
    browser.click("#resume");
    wait_for("sim-node-002 up again", || {
        (node_state("sim-node-002") == "up").then_some(())
    });

    // The XID fires an alert: counted in the navigation, red, linked to its node, silenced
    // from the page.
    let firing_now = || {
        let alerts = perch.get("/v1/alerts");
        let list = alerts["alerts"].as_array().cloned().unwrap_or_default();
        let n = list
            .iter()
            .filter(|a| a["state"] == "firing" && a["muted_by"].is_null())
            .count();
        let on_node = list
            .iter()
            .any(|a| a["state"] == "firing" && a["labels"]["node"] == "sim-node-001");
        (n, on_node)
    };
    wait_for("an alert firing on sim-node-001", || {
        firing_now().1.then_some(())
    });
    wait_for("the firing count in the navigation", || {
        let shown = browser.text("#nav-firing");
        (shown == firing_now().0.to_string()).then_some(())
    });
    browser.open(&format!("{url}/#/alerts"));
    let look = browser.js(
        "const b = [...document.querySelectorAll('#alerts .badge.firing')][0];
         const row = b.closest('tr');
         const c = getComputedStyle(b).backgroundColor.match(/\\d+/g).map(Number);
         return {bg: c, link: row.querySelector('a.alert-node')?.getAttribute('href') ?? null}",
        json!([]),
    );
    let bg: Vec<u64> = look["bg"]
        .as_array()
        .expect("rgb")
        .iter()
        .map(|v| v.as_u64().unwrap_or(0))
        .collect();
    assert!(
        bg[0] > 150 && bg[1] < 80 && bg[2] < 80,
        "firing is red: {look}"
    );
    let row_link = browser.js(
        "return [...document.querySelectorAll('#alerts tbody tr')]
           .map(r => r.querySelector('a.alert-node')?.getAttribute('href'))
           .filter(Boolean)",
        json!([]),
    );
    assert!(
        row_link
            .as_array()
            .expect("links")
            .iter()
            .any(|h| h == "#/nodes/sim-node-001"),
        "{row_link}"
    );
    let silenced = browser.js(
        "const r = [...document.querySelectorAll('#alerts tbody tr')]
           .find(r => r.querySelector('a.alert-node[href=\"#/nodes/sim-node-001\"]') && r.querySelector('button.silence'));
         if (!r) return false;
         r.querySelector('button.silence').click();
         document.getElementById('silence-comment').value = 'replacing the card';
         document.getElementById('silence-form').requestSubmit();
         return true",
        json!([]),
    );
    assert_eq!(silenced, true);
    wait_for("the silence made", || {
        let s = perch.get("/v1/silences");
        s["silences"]
            .as_array()?
            .iter()
            .any(|x| {
                x["comment"] == "replacing the card"
                    && x["matchers"].to_string().contains("sim-node-001")
            })
            .then_some(())
    });
    browser.screenshot("alerts-firing");
    browser.assert_no_errors("the fleet's problems, drain and alerts");
}

/// Texts of the cells of `selector`'s rows.
fn table_rows(browser: &Browser, selector: &str) -> Vec<Vec<String>> {
    let rows = browser.js(
        "return [...document.querySelectorAll(arguments[0])].map(r => [...r.cells].map(c => c.textContent))",
        json!([selector]),
    );
    rows.as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|r| {
            r.as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|c| c.as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .collect()
}

/// The job page says where a job stands (status, place in the queue, a relative estimate, a
/// link to its output at the top), draws no empty chart for a pending job, fixed axes for a
/// running one with a time range, and "no such job" once for an unknown one; the job list
/// pages, searches and sorts; accounts have totals, a ranking and a chart; the SQL console
/// rounds floats; and every jobs view says its GPUs are simulated.
#[test]
fn the_job_pages_say_where_a_job_stands() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = demo(dir.path());
    let url = perch.url.clone();
    let browser = Browser::start();

    // An unknown job: said, and not asked for again.
    browser.open(&format!("{url}/#/jobs/999999"));
    assert!(
        browser.text("#no-such-job").contains("no job 999999"),
        "{}",
        browser.text("main")
    );
    let asked = "return performance.getEntriesByType('resource').filter(e => e.name.endsWith('/v1/jobs/999999')).length";
    // The page polls every 3 s: after 7 s a page that kept polling would have asked 3 times.
    std::thread::sleep(Duration::from_secs(7));
    assert_eq!(browser.js(asked, json!([])), 1, "asked once only");
    browser.assert_only_expected_errors("the unknown job", &["/v1/jobs/999999"]);

    // A pending job: its place in line, when it should start, no empty chart frames.
    let pending = wait_for("a pending job at the queue's head", || {
        let q = perch.get("/v1/queue");
        q["queue"]
            .as_array()?
            .iter()
            .find(|e| e["position"] == 1)
            .and_then(|e| e["job"]["id"].as_u64())
    });
    browser.open(&format!("{url}/#/jobs/{pending}"));
    wait_for("its place in the queue", || {
        browser
            .text("#queue-place")
            .starts_with("1st of ")
            .then_some(())
    });
    let head = browser.text("#job-queue");
    assert!(
        head.contains("starts in ") || head.contains("start time not known"),
        "{head}"
    );
    assert!(
        !head.contains("1440 min"),
        "hours, not thousands of minutes: {head}"
    );
    assert_eq!(
        browser.js(
            "return [document.getElementById('job-charts').hidden, document.getElementById('charts-empty').hidden,
                     document.querySelectorAll('.uplot').length]",
            json!([])
        ),
        json!([true, false, 0])
    );
    assert!(browser.text("#charts-empty").contains("not started"));
    assert!(
        browser.text("#sim-label").contains("simulated"),
        "the job page"
    );

    // A running multi-GPU job: the left column keeps its height, the output is a click away, the
    // axes are 24-hour, unclipped and their labels apart.
    let running = wait_for("a running multi-GPU job", || {
        let jobs = perch.get("/v1/jobs?state=running");
        jobs["jobs"].as_array()?.iter().find_map(|j| {
            let gpus: usize = j["placement"]
                .as_array()?
                .iter()
                .map(|p| p["gpus"].as_array().map_or(0, Vec::len))
                .sum();
            (gpus >= 2).then(|| j["id"].as_u64()).flatten()
        })
    });
    browser.open(&format!("{url}/#/jobs/{running}"));
    wait_for("the utilization chart", || {
        (browser.js(
            "return !!document.getElementById('c-util').__uplot",
            json!([]),
        ) == true)
            .then_some(())
    });
    let layout = browser.js(
        "const kv = document.getElementById('job-kv'), kids = kv.children;
         const content = kids[kids.length - 1].getBoundingClientRect().bottom - kids[0].getBoundingClientRect().top;
         const u = document.getElementById('c-util').__uplot;
         const ctx = document.createElement('canvas').getContext('2d');
         ctx.font = '11px system-ui, sans-serif';
         const x = u.axes[0], y = u.axes[1];
         const xs = x._splits.map(s => u.valToPos(s, 'x'));
         const widths = x._values.map(v => ctx.measureText(v).width);
         let apart = true;
         for (let i = 1; i < xs.length; i++) if (xs[i] - xs[i - 1] < (widths[i] + widths[i - 1]) / 2 + 4) apart = false;
         return {stretch: kv.getBoundingClientRect().height - content, usage: document.getElementById('job-usage').getBoundingClientRect().height,
                 xvals: x._values, yvals: y._values, ysize: y._size,
                 ywidest: Math.max(...y._values.map(v => ctx.measureText(v).width)), apart}",
        json!([]),
    );
    assert!(
        layout["stretch"].as_f64().unwrap_or(99.0) < 8.0,
        "the left column is as tall as its content: {layout}"
    );
    let xvals = layout["xvals"].as_array().expect("x labels");
    assert!(!xvals.is_empty(), "{layout}");
    for v in xvals {
        let v = v.as_str().unwrap_or_default();
        assert!(
            !v.to_lowercase().contains("am") && !v.to_lowercase().contains("pm") && v.contains(':'),
            "24-hour time labels: {layout}"
        );
    }
    assert_eq!(layout["apart"], true, "x labels overlap: {layout}");
    let yvals = layout["yvals"].as_array().expect("y labels");
    assert!(
        yvals
            .iter()
            .all(|v| v.as_str().unwrap_or_default().ends_with('%')),
        "{layout}"
    );
    let distinct: std::collections::BTreeSet<&str> =
        yvals.iter().filter_map(Value::as_str).collect();
    assert_eq!(distinct.len(), yvals.len(), "no label twice: {layout}");
    // Every chart of the page (its own metrics too): y labels apart and not clipped.
    let every = browser.js(
        "const ctx = document.createElement('canvas').getContext('2d');
         ctx.font = '11px system-ui, sans-serif';
         return [...document.querySelectorAll('#job-charts div')].filter(d => d.__uplot).map(d => {
           const y = d.__uplot.axes[1];
           return {id: d.id, vals: y._values, size: y._size,
                   widest: Math.max(...y._values.map(v => ctx.measureText(v).width))};
         })",
        json!([]),
    );
    let every = every.as_array().expect("charts");
    assert!(every.len() >= 3, "{every:?}");
    for c in every {
        let vals = c["vals"].as_array().expect("labels");
        let distinct: std::collections::BTreeSet<String> =
            vals.iter().map(Value::to_string).collect();
        assert_eq!(distinct.len(), vals.len(), "a label twice: {c}");
        assert!(
            c["size"].as_f64().unwrap_or(0.0) >= c["widest"].as_f64().unwrap_or(99.0) + 8.0,
            "{c}"
        );
    }
    assert!(
        layout["ysize"].as_f64().unwrap_or(0.0) >= layout["ywidest"].as_f64().unwrap_or(99.0) + 8.0,
        "the y axis is wider than its widest label: {layout}"
    );
    browser.screenshot("job-running");
    // The time range narrows the charts and is kept in the address.
    browser.js(
        "const s = document.getElementById('job-range'); s.value = '900';
         s.dispatchEvent(new Event('change', {bubbles: true}))",
        json!([]),
    );
    assert!(
        browser
            .js("return location.hash", json!([]))
            .as_str()
            .unwrap_or_default()
            .ends_with("range=900")
    );
    browser.js("window.scrollTo(0, 0)", json!([]));
    browser.click("#to-log");
    let seen = browser.js(
        "const r = document.getElementById('output').getBoundingClientRect();
         return [r.top, window.innerHeight, window.scrollY]",
        json!([]),
    );
    let (top, height) = (
        seen[0].as_f64().unwrap_or(-1.0),
        seen[1].as_f64().unwrap_or(0.0),
    );
    assert!(
        top >= 0.0 && top + 60.0 <= height,
        "the output's heading is scrolled into view: {seen}"
    );
    browser.assert_no_errors("the running job");

    // The job list: a page at a time, more on request, searched and sorted.
    browser.open(&format!("{url}/#/jobs?page=5"));
    let ids = |b: &Browser| -> Vec<u64> {
        table_rows(b, "#jobs tbody tr")
            .iter()
            .filter_map(|r| r[0].parse().ok())
            .collect()
    };
    let first = ids(&browser);
    assert_eq!(first.len(), 5, "{first:?}");
    browser.click("#jobs-more");
    let more = wait_for("the next page", || {
        let got = ids(&browser);
        (got.len() == 10).then_some(got)
    });
    assert_eq!(&more[..5], &first[..], "{more:?}");
    assert!(
        more.windows(2).all(|w| w[0] > w[1]),
        "newest first: {more:?}"
    );
    browser.click("#jobs th[data-sort=job]");
    let ascending = ids(&browser);
    assert!(ascending.windows(2).all(|w| w[0] < w[1]), "{ascending:?}");
    let name = table_rows(&browser, "#jobs tbody tr")[0][1].clone();
    browser.js(
        "const s = document.getElementById('jobs-search'); s.value = arguments[0];
         s.dispatchEvent(new Event('input', {bubbles: true}))",
        json!([name]),
    );
    let found = table_rows(&browser, "#jobs tbody tr");
    assert!(
        !found.is_empty() && found.iter().all(|r| r[1].contains(&name)),
        "{name}: {found:?}"
    );
    assert!(browser.text("#sim-label").contains("simulated"), "jobs");
    browser.open(&format!("{url}/#/queue"));
    wait_for("the queue's simulated label", || {
        browser
            .text("#sim-label")
            .contains("simulated")
            .then_some(())
    });

    // Accounts: totals ranked largest first, each its users' sum; a chart over time; the
    // window of the telemetry figures named.
    browser.open(&format!("{url}/#/accounts?days=all"));
    wait_for("the accounts' simulated label", || {
        browser
            .text("#sim-label")
            .contains("simulated")
            .then_some(())
    });
    let totals = table_rows(&browser, "#account-totals tbody tr");
    let users = table_rows(&browser, "#accounts tbody tr");
    assert!(!totals.is_empty(), "the demo's accounts");
    let hours = |s: &str| s.parse::<f64>().unwrap_or(f64::NAN);
    for w in totals.windows(2) {
        assert!(hours(&w[0][4]) >= hours(&w[1][4]), "{totals:?}");
    }
    for t in &totals {
        let sum: f64 = users
            .iter()
            .filter(|u| u[0] == t[1])
            .map(|u| hours(&u[3]))
            .sum();
        assert!(
            (sum - hours(&t[4])).abs() < 0.02 + 0.005 * users.len() as f64,
            "{t:?} against {users:?}"
        );
    }
    assert!(
        browser.js(
            "return !!document.getElementById('acc-chart').__uplot",
            json!([])
        ) == true,
        "GPU-hours over time"
    );
    assert_ne!(browser.text("#acc-until"), "–");
    browser.screenshot("accounts-ranked");

    // The SQL console rounds floats for reading; the CSV keeps them whole.
    browser.open(&format!("{url}/#/sql?q=SELECT%201.0%2F3%20AS%20third"));
    assert_eq!(browser.text("#sql-rows tbody td"), "0.3333");
    browser.assert_no_errors("the job pages, lists and accounts");
}

/// With the server stopped the page says it is reconnecting and that what it shows is old
/// (not "Failed to fetch" beside live-looking figures); when the server is back, it is live
/// again by itself. (Its server cuts SQL results at 5 rows: the console says the CSV is cut
/// there too, as it is.)
#[test]
fn a_stopped_server_is_shown_as_reconnecting_until_it_is_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let listen = format!("127.0.0.1:{}", common::free_port());
    let config = "[query]\nmax_rows = 5\n";
    let mut perch = common::server_with_config(dir.path(), config, &["--listen", &listen]);
    let url = perch.url.clone();
    let browser = Browser::start();

    let query = "SELECT * FROM (VALUES (1), (2), (3), (4), (5), (6), (7)) AS t(x)";
    browser.open(&format!("{url}/#/sql?q={}", query.replace(' ', "%20")));
    let note = browser.text("#sql-note");
    assert!(
        note.contains("cut at the server's limit of 5 rows")
            && note.contains("the CSV is cut there too"),
        "{note}"
    );
    assert!(!note.contains("has them all"), "{note}");
    let csv = reqwest::blocking::Client::new()
        .post(format!("{url}/v1/sql"))
        .json(&json!({"sql": query, "format": "csv"}))
        .send()
        .expect("csv");
    assert_eq!(csv.headers()["x-perch-truncated"], "true");
    assert_eq!(
        csv.text().expect("text").lines().count(),
        6,
        "a header and 5 rows"
    );

    browser.open(&format!("{url}/#/jobs"));
    wait_for("updated N s ago", || {
        browser.text("#live").starts_with("updated").then_some(())
    });
    perch.terminate();
    let shown = wait_for("the page to say it is reconnecting", || {
        let s = browser.js(
            "return [document.getElementById('live').dataset.state, document.getElementById('live').textContent,
                     document.getElementById('banner').textContent, document.body.classList.contains('stale')]",
            json!([]),
        );
        (s[0] == "reconnecting").then_some(s)
    });
    assert!(
        shown[1]
            .as_str()
            .unwrap_or_default()
            .contains("reconnecting"),
        "{shown}"
    );
    let banner = shown[2].as_str().unwrap_or_default();
    assert!(
        banner.contains("reconnecting") && banner.contains("out of date"),
        "{shown}"
    );
    assert!(!banner.contains("Failed to fetch"), "{shown}");
    assert_eq!(shown[3], true, "the view is marked stale: {shown}");
    browser.screenshot("reconnecting");

    let _back = common::server_with_config(dir.path(), config, &["--listen", &listen]);
    wait_for("the page live again", || {
        let s = browser.js(
            "return [document.getElementById('live').dataset.state, document.getElementById('banner').textContent,
                     document.body.classList.contains('stale')]",
            json!([]),
        );
        (s == json!(["live", "", false])).then_some(())
    });
    assert!(browser.text("#live").starts_with("updated"));
    // The failed loads while it was down are the browser's, nothing else.
    let other: Vec<String> = browser
        .errors()
        .into_iter()
        .filter(|e| !e.contains("ERR_CONNECTION_REFUSED"))
        .collect();
    assert!(other.is_empty(), "{other:#?}");
}

/// A two-node gang whose GPU 1 on gpu-1 the stand-in NVML throttles: the job's page lists that
/// rank under "Slow ranks" with its evidence (the SM clock against the gang's median, the
/// throttle reasons) and marks its series in the charts' legends; the other ranks are not
/// marked.
#[test]
fn the_job_page_marks_its_slow_rank() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(&dir.path().join("server"), &["server"]);
    let url = perch.url.clone();
    let lib = common::standin::library();
    let _agents: Vec<common::standin::Agent> = (0..2)
        .map(|n| {
            let scenario = common::standin::busy_pair(n, n == 1);
            common::standin::Agent::start(dir.path(), &url, n, &lib, &scenario)
        })
        .collect();
    perch.wait_nodes_up(2);
    let id = post_json(
        &url,
        "/v1/jobs",
        &json!({"name": "train", "command": ["sleep", "600"], "nodes": 2, "gpus_per_node": 2,
                "user": "alice", "time_limit_secs": 3600}),
    )["id"]
        .as_u64()
        .expect("job id");
    wait_for("the gang to run", || {
        (perch.job(id)["state"] == "running").then_some(())
    });
    let rank = common::standin::rank_of(&perch.job(id), "gpu-1", 1).expect("its rank");
    wait_for("job_stragglers to list the rank", || {
        let q = format!("SELECT rank FROM job_stragglers WHERE job = {id}");
        (!sql_rows(&url, None, &q).is_empty()).then_some(())
    });
    let browser = Browser::start();
    browser.open(&format!("{url}/#/jobs/{id}"));
    let listed = browser.js(
        "return [...document.querySelectorAll('#straggler-list tbody tr')]
           .map((r) => [r.dataset.node, r.dataset.gpu, r.dataset.rank, r.textContent])",
        json!([]),
    );
    let listed = listed.as_array().expect("rows");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0][0], "gpu-1");
    assert_eq!(listed[0][1], "1");
    assert_eq!(listed[0][2], rank.to_string());
    let text = listed[0][3].as_str().unwrap_or_default();
    assert!(
        text.contains("sm_clock_mhz 1100 vs 1980") && text.contains("hw_slowdown"),
        "{text}"
    );
    let legend = browser.js(
        "return [...document.querySelectorAll('#c-util .u-legend .u-label')].map((e) => e.textContent)",
        json!([]),
    );
    let legend: Vec<&str> = legend
        .as_array()
        .expect("legend")
        .iter()
        .filter_map(Value::as_str)
        .filter(|l| l.starts_with("gpu-"))
        .collect();
    let marked: Vec<&&str> = legend.iter().filter(|l| l.contains("slow rank")).collect();
    assert_eq!(
        marked,
        [&format!("gpu-1/1 ⚠ slow rank {rank}").as_str()],
        "{legend:?}"
    );
    assert_eq!(legend.len(), 4, "{legend:?}");
    browser.screenshot("job-slow-rank");
    browser.assert_no_errors("the job page of a gang with a slow rank");
}

/// The job page's Provenance section: a job submitted from a git repository with an
/// uncommitted change shows its commit, that it was dirty, and its node's driver and CUDA
/// versions as the stand-in NVML reports them (docs/provenance.md).
#[test]
fn the_job_page_shows_what_the_job_ran() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(&dir.path().join("server"), &["server"]);
    let url = perch.url.clone();
    let lib = common::standin::library();
    let _agent = common::standin::Agent::start(
        dir.path(),
        &url,
        0,
        &lib,
        &common::standin::busy_pair(0, false),
    );
    perch.wait_nodes_up(1);
    let repo = dir.path().join("repo");
    std::fs::create_dir_all(&repo).expect("repo");
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
            .args(args)
            .current_dir(&repo)
            .output()
            .expect("git");
        assert!(out.status.success(), "git {args:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    git(&["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("train.py"), "print(1)\n").expect("file");
    git(&["add", "train.py"]);
    git(&["commit", "-q", "-m", "first"]);
    let commit = git(&["rev-parse", "HEAD"]);
    std::fs::write(repo.join("train.py"), "print(2)\n").expect("edit");
    let out = common::client()
        .args(["submit", "--server", &url, "--user", "alice", "--", "true"])
        .current_dir(&repo)
        .output()
        .expect("perch submit");
    assert!(out.status.success(), "{out:?}");
    let id: u64 = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .nth(2)
        .and_then(|w| w.parse().ok())
        .expect("job id");
    wait_for("the node's start report", || {
        let p = perch.get(&format!("/v1/jobs/{id}/provenance"));
        (p["runs"].as_array().is_some_and(|r| !r.is_empty())).then_some(())
    });
    let browser = Browser::start();
    browser.open(&format!("{url}/#/jobs/{id}"));
    wait_for("the Provenance section", || {
        (browser.text("#prov-commit") == commit).then_some(())
    });
    assert!(
        browser.text("#prov-dirty").starts_with("yes"),
        "{}",
        browser.text("#prov-kv")
    );
    let run = browser.text("#prov-kv .prov-run");
    assert!(
        run.contains("driver 560.35.03-standin") && run.contains("CUDA 12.6"),
        "{run}"
    );
    browser.screenshot("job-provenance");
    browser.assert_no_errors("the job page's provenance");
}

/// The node page's Validation section: a validation that failed on a GPU with uncorrected ECC
/// errors shows its result, who asked and the failing GPU; the node says why it is drained;
/// an operator's Validate button runs another (docs/validation.md).
#[test]
fn the_node_page_shows_its_last_validation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(&dir.path().join("server"), &["server"]);
    let url = perch.url.clone();
    let lib = common::standin::library();
    let mut scenario = common::standin::busy_pair(0, false);
    scenario["gpus"][1]["timeline"]
        .as_array_mut()
        .expect("timeline")
        .push(json!({"at": 0, "set": {"ecc_uncorrected_volatile": 2}}));
    let _agent = common::standin::Agent::start(dir.path(), &url, 0, &lib, &scenario);
    perch.wait_nodes_up(1);
    let started = post_json(&url, "/v1/nodes/gpu-0/validate", &json!(null));
    assert_eq!(started["validation"]["trigger"], "operator", "{started}");
    let runs = |url: &str| {
        sql_rows(
            url,
            None,
            "SELECT result FROM node_validations WHERE node = 'gpu-0' AND result IS NOT NULL",
        )
    };
    wait_for("the validation's result", || {
        (runs(&url).len() == 1).then_some(())
    });

    let browser = Browser::start();
    browser.open(&format!("{url}/#/nodes/gpu-0"));
    let last = browser.text("#validation-last");
    assert!(
        last.contains("Last validation: failed (operator, asked by ")
            && last.contains("exit code 1"),
        "{last}"
    );
    let output = browser.text("#validation-output");
    assert!(
        output.contains("GPU 1 (NVIDIA H100 80GB HBM3): 2 uncorrected ECC errors"),
        "{output}"
    );
    let why = browser.text("#node-why");
    assert!(
        why.starts_with("drained by perch: validation failed: exit code 1: GPU 1"),
        "{why}"
    );
    browser.screenshot("node-validation");
    browser.click("#validate");
    wait_for("a second validation", || {
        (runs(&url).len() == 2).then_some(())
    });
    browser.assert_no_errors("the node page's validation");
}

/// The node page of a node whose GPU 0 is in MIG mode (a 3g.40gb and a 4g.40gb instance, the
/// stand-in NVML) and whose GPU 1 takes MPS shares: its MIG instances are listed with their
/// profile, UUID, memory and job (a link) or free, GPU 1's sharers with their percents; a MIG
/// job's page says which profile it asked for and which instance it holds, a shared job's page
/// its share (docs/mig.md).
#[test]
fn the_node_page_shows_mig_instances_and_mps_sharers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(&dir.path().join("server"), &["server"]);
    let url = perch.url.clone();
    let lib = common::standin::library();
    let _agent = common::standin::Agent::start_with(
        dir.path(),
        &url,
        0,
        &lib,
        &common::standin::mig_pair(),
        &[("PERCH_GPU_SHARING", "true")],
    );
    perch.wait_nodes_up(1);
    let submit = |extra: Value| {
        let mut body =
            json!({"command": ["sleep", "600"], "user": "alice", "time_limit_secs": 3600});
        for (k, v) in extra.as_object().expect("fields") {
            body[k] = v.clone();
        }
        post_json(&url, "/v1/jobs", &body)["id"]
            .as_u64()
            .expect("job id")
    };
    let on_mig = submit(json!({"gpu_profile": "3g.40gb"}));
    let share = json!({"gpu_share": {"fraction": 0.25, "memory_gb": 4.0}});
    let shared = [submit(share.clone()), submit(share)];
    for id in [on_mig, shared[0], shared[1]] {
        wait_for(&format!("job {id} to run"), || {
            (perch.job(id)["state"] == "running").then_some(())
        });
    }
    for id in shared {
        assert_eq!(perch.job(id)["placement"][0]["gpus"], json!([1]));
    }

    let browser = Browser::start();
    browser.open(&format!("{url}/#/nodes/gpu-0"));
    let hidden = browser.js(
        "return document.getElementById('node-mig-section').hidden",
        json!([]),
    );
    assert_eq!(hidden, false, "the MIG section is shown");
    let mig = table_rows(&browser, "#mig-instances tbody tr");
    assert_eq!(
        mig,
        [
            vec![
                "0".to_owned(),
                "3g.40gb".to_owned(),
                common::standin::mig_uuid(0),
                "40.0 GiB".to_owned(),
                format!("{on_mig} alice"),
            ],
            vec![
                "0".to_owned(),
                "4g.40gb".to_owned(),
                common::standin::mig_uuid(1),
                "40.0 GiB".to_owned(),
                "free".to_owned(),
            ],
        ],
    );
    let gpus = table_rows(&browser, "#node-gpus tbody tr");
    assert_eq!(gpus[0][1], "MIG mode: 2 instances, 1 held", "{gpus:?}");
    assert_eq!(
        gpus[1][1],
        format!(
            "shared (MPS): {} alice (25%), {} alice (25%), 50% granted",
            shared[0], shared[1]
        ),
        "{gpus:?}"
    );
    browser.screenshot("node-mig");
    browser.assert_no_errors("the node page of a MIG node");

    // The instance's job link opens the job, which names its profile and instance.
    browser.js(
        "document.querySelector('#mig-instances tbody tr a').click()",
        json!([]),
    );
    browser.wait_ready("the MIG job's page");
    wait_for("the job page's MIG instance", || {
        (browser.text("#job-mig-uuid") == common::standin::mig_uuid(0)).then_some(())
    });
    assert_eq!(browser.text("#job-gpu-profile"), "one 3g.40gb MIG instance");
    browser.open(&format!("{url}/#/jobs/{}", shared[0]));
    assert_eq!(
        browser.text("#job-gpu-share"),
        "0.25 of a GPU (MPS share, 4 GiB of its memory)"
    );
    browser.assert_no_errors("the pages of a MIG job and a shared job");
}
