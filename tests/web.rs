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
    /// refused token, a refused cancel) are logged by the browser as failed loads: each entry
    /// must name one of `expected`'s URL paths and a 401 or 403.
    fn assert_only_expected_errors(&self, what: &str, expected: &[&str]) {
        let unexpected: Vec<String> = self
            .errors()
            .into_iter()
            .filter(|e| {
                !(expected.iter().any(|path| e.contains(path))
                    && (e.contains("status of 401") || e.contains("status of 403")))
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
