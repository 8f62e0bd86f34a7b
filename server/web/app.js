// perch's web view: plain JavaScript, no build step. It reads the same HTTP API and SQL
// endpoint as the CLI with the token the user signs in with (kept for this tab only, in
// sessionStorage), so it shows exactly what that token may see.
//
// Every value that comes from the server goes through esc() before it becomes markup: job
// names, commands and labels are user input. The server's Content-Security-Policy forbids
// inline scripts as a second fence.
'use strict';
(() => {
  const TOKEN_KEY = 'perch.token';
  const IDLE_PCT = 5; // an allocated GPU under this utilization is shown as idle
  const main = document.getElementById('view');
  const banner = document.getElementById('banner');

  // Errors the page met, for people (the banner) and for the browser tests.
  window.__perchErrors = [];
  window.addEventListener('error', (e) => window.__perchErrors.push(String(e.message)));
  window.addEventListener('unhandledrejection', (e) => window.__perchErrors.push(String(e.reason)));

  // --- small helpers ---------------------------------------------------------------------
  const ESC = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
  const esc = (s) => String(s ?? '').replace(/[&<>"']/g, (c) => ESC[c]);
  const sqlStr = (s) => `'${String(s).replace(/'/g, "''")}'`;
  const num = (x, d = 1) => (x == null || Number.isNaN(x) ? '–' : Number(x).toFixed(d));
  const pct = (x) => (x == null ? '–' : `${Math.round(x)}%`);
  const gib = (b) => (b == null ? '–' : `${(b / 2 ** 30).toFixed(1)} GiB`);
  const hours = (s) => (s == null ? '–' : `${(s / 3600).toFixed(2)}`);
  const money = (x) => (x == null ? '–' : Number(x).toFixed(2));
  const when = (ms) => (ms == null ? '–' : new Date(ms).toLocaleString(undefined, { hour12: false }));
  const clock = (ms) => new Date(ms).toLocaleTimeString(undefined, { hour12: false });
  // Today's times as a clock, other days' with their date.
  const clockOrDay = (ms) => (new Date(ms).toDateString() === new Date().toDateString() ? clock(ms) : when(ms));
  const span = (secs) => {
    if (secs == null) return '–';
    secs = Math.max(0, Math.round(secs));
    const d = Math.floor(secs / 86400), h = Math.floor((secs % 86400) / 3600), m = Math.floor((secs % 3600) / 60);
    if (d) return `${d}d ${h}h`;
    if (h) return `${h}h ${m}m`;
    if (m) return `${m}m ${secs % 60}s`;
    return `${secs}s`;
  };
  // A time ahead or behind as people say it: "in about 3 h", "5 min ago", never "in 1440 min".
  const rel = (ms) => {
    if (ms == null) return '–';
    const d = ms - Date.now(), a = Math.abs(d) / 1000;
    let t;
    if (a < 60) return d >= 0 ? 'in under a minute' : 'just now';
    if (a < 90 * 60) t = `${Math.round(a / 60)} min`;
    else if (a < 36 * 3600) t = `${Math.round(a / 3600)} h`;
    else t = `${Math.round(a / 86400)} days`;
    return d >= 0 ? `in about ${t}` : `${t} ago`;
  };
  // The scheduler's reasons count minutes ("at the latest in 1440 min"): said in hours or
  // days past an hour and a half.
  const humanReason = (text) => String(text ?? '').replace(/\b(\d+) min\b/g, (m, n) => {
    const mins = Number(n);
    if (mins < 90) return m;
    return mins < 36 * 60 ? `about ${Math.round(mins / 60)} h` : `about ${Math.round(mins / 1440)} days`;
  });
  const pad2 = (n) => String(n).padStart(2, '0');
  // A chart's time label, 24-hour: "14:05", "14:05:30" when seconds matter, with the day when
  // the axis spans days.
  const axisTime = (ms, withSecs, withDay) => {
    const d = new Date(ms);
    const t = `${pad2(d.getHours())}:${pad2(d.getMinutes())}${withSecs ? `:${pad2(d.getSeconds())}` : ''}`;
    return withDay ? `${pad2(d.getMonth() + 1)}-${pad2(d.getDate())} ${t}` : t;
  };
  const jobColor = (id, alpha = 1) => `hsla(${(id * 137.508) % 360}, 65%, 58%, ${alpha})`;
  // Utilization as a colour: dark at 0%, bright green at 100%.
  const utilColor = (u) => (u == null ? '#3a4050' : `hsl(145, ${35 + u * 0.3}%, ${16 + u * 0.34}%)`);
  const badge = (text, cls = text) => `<span class="badge ${esc(cls)}">${esc(text)}</span>`;
  const qs = (params) => {
    const p = new URLSearchParams();
    for (const [k, v] of Object.entries(params)) if (v != null && v !== '') p.set(k, v);
    const s = p.toString();
    return s ? `?${s}` : '';
  };

  // --- the API ---------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  async function call(path, opts = {}) {
    const headers = Object.assign({}, opts.headers);
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    let res;
    try {
      res = await fetch(path, Object.assign({}, opts, { headers }));
    } catch (err) {
      // No answer at all: the server is down or unreachable.
      liveness.lost();
      throw new ApiError(0, 'unreachable', 'the server does not answer');
    }
    liveness.answered();
    if (!res.ok) {
      let message = `${res.status} ${res.statusText}`, code = null;
      try {
        const body = await res.json();
        if (body && body.error) ({ message, code } = body.error);
      } catch (_) { /* not JSON */ }
      if (res.status === 401 && !opts.noSignIn) {
        sessionStorage.removeItem(TOKEN_KEY);
        goSignIn(message);
      }
      throw new ApiError(res.status, code, message);
    }
    return res;
  }
  const api = async (path, opts) => (await call(path, opts)).json();
  const post = (path, body) => api(path, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body ?? {}),
  });
  const sql = (query, format = 'json') => call('/v1/sql', {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ sql: query, format }),
  });
  const rows = async (query) => (await (await sql(query)).json()).rows;

  // --- liveness: when the page last heard from the server ---------------------------------
  // Every answer counts; a request that gets none marks the page stale: the header says
  // "reconnecting", the view is dimmed, and the views keep polling until the server answers.
  const liveness = {
    lastOk: null,
    down: false,
    answered() {
      this.lastOk = Date.now();
      if (this.down) {
        this.down = false;
        document.body.classList.remove('stale');
        if (banner.querySelector('.reconnecting')) banner.innerHTML = '';
      }
      this.show();
    },
    lost() {
      if (!this.down) {
        this.down = true;
        document.body.classList.add('stale');
      }
      banner.innerHTML = `<span class="reconnecting" id="reconnecting">The server does not answer: reconnecting…
        What is shown is from ${esc(this.lastOk ? `${span((Date.now() - this.lastOk) / 1000)} ago` : 'before it stopped')} and may be out of date.</span>`;
      this.show();
    },
    show() {
      const el = document.getElementById('live');
      if (!el) return;
      const ago = this.lastOk == null ? null : Math.round((Date.now() - this.lastOk) / 1000);
      const text = this.down
        ? `reconnecting… (last answer ${ago == null ? 'never' : `${span(ago)} ago`})`
        : ago == null ? '' : `updated ${ago < 2 ? 'just now' : `${span(ago)} ago`}`;
      if (el.textContent !== text) el.textContent = text;
      el.className = this.down ? 'bad' : 'muted';
      el.dataset.state = this.down ? 'reconnecting' : 'live';
    },
  };
  setInterval(() => liveness.show(), 1000);

  // --- who is signed in ------------------------------------------------------------------
  let who = null;
  const mayActOn = (owner) => who && (who.role === 'operator' || who.user === owner);

  function showWho() {
    const el = document.getElementById('who');
    if (!who) { el.textContent = ''; return; }
    el.innerHTML = who.open
      ? `open server (no tokens) · ${esc(who.user)}, ${esc(who.role)}`
      : `${esc(who.user)} (${esc(who.role)}) <button id="signout">Sign out</button>`;
    const out = document.getElementById('signout');
    if (out) out.onclick = () => { sessionStorage.removeItem(TOKEN_KEY); who = null; goSignIn('Signed out.'); };
  }

  let afterSignIn = '#/fleet';
  function goSignIn(message) {
    if (!location.hash.startsWith('#/signin')) afterSignIn = location.hash || '#/fleet';
    signInMessage = message;
    if (location.hash.startsWith('#/signin')) route(); else location.hash = '#/signin';
  }
  let signInMessage = '';

  function signInView(v) {
    main.innerHTML = `<form class="signin" id="signin">
      <h1>Sign in to perch</h1>
      <p class="muted">Paste your perch token (the one the CLI reads from <code>PERCH_TOKEN</code>).
        It stays in this tab only and is sent to this server alone.</p>
      <p class="bad" id="signin-msg">${esc(signInMessage)}</p>
      <label for="token">Token</label>
      <input id="token" type="password" autocomplete="off" required>
      <button type="submit">Sign in</button></form>`;
    v.ready();
    document.getElementById('signin').onsubmit = async (e) => {
      e.preventDefault();
      const token = document.getElementById('token').value.trim();
      sessionStorage.setItem(TOKEN_KEY, token);
      try {
        who = await api('/v1/whoami', { noSignIn: true });
        showWho();
        heartbeat();
        location.hash = afterSignIn.startsWith('#/signin') ? '#/fleet' : afterSignIn;
      } catch (err) {
        sessionStorage.removeItem(TOKEN_KEY);
        document.getElementById('signin-msg').textContent = err.status === 403
          ? 'This token may not use the web view (an agent token?): sign in with a user or operator token.'
          : err.message;
      }
    };
  }

  // --- views and their lifetime ----------------------------------------------------------
  // A view polls with v.every(); navigating away stops its timers and destroys its charts, so
  // a tab left open for days holds one view's worth of memory.
  let current = null;
  function newView() {
    const v = {
      alive: true,
      timers: [],
      charts: [],
      every(ms, fn) {
        const tick = async () => {
          if (!v.alive) return;
          try {
            await fn();
            clearProblem();
          } catch (err) {
            problem(err);
          }
          if (v.alive && !document.hidden) v.timers.push(setTimeout(tick, ms));
          else if (v.alive) v.timers.push(setTimeout(tick, ms * 4));
        };
        return tick();
      },
      ready() { main.dataset.ready = '1'; },
      stop() {
        v.alive = false;
        v.timers.forEach(clearTimeout);
        v.charts.forEach((c) => c.destroy());
        v.charts = [];
      },
    };
    return v;
  }

  function problem(err) {
    if (err instanceof ApiError && err.status === 401) return;
    if (err instanceof ApiError && err.status === 0) return; // the liveness banner says it
    banner.innerHTML = `<span class="error">${esc(err.message || err)}</span>`;
  }
  function clearProblem() {
    if (banner.querySelector('.error, .reconnecting')) banner.innerHTML = '';
  }

  const routes = [
    [/^\/fleet$/, 'fleet', fleetView],
    [/^\/occupancy$/, 'occupancy', occupancyView],
    [/^\/queue$/, 'queue', queueView],
    [/^\/jobs$/, 'jobs', jobsView],
    [/^\/jobs\/(\d+)$/, 'jobs', jobView],
    [/^\/nodes\/([^/]+)$/, 'fleet', nodeView],
    [/^\/accounts$/, 'accounts', accountsView],
    [/^\/alerts$/, 'alerts', alertsView],
    [/^\/sql$/, 'sql', sqlView],
    [/^\/signin$/, '', signInView],
  ];

  function route() {
    const hash = location.hash.replace(/^#/, '') || '/fleet';
    const [path, query] = hash.split('?');
    const params = new URLSearchParams(query || '');
    if (current) current.stop();
    delete main.dataset.ready;
    banner.innerHTML = '';
    current = newView();
    const found = routes.find(([re]) => re.test(path));
    if (!found) {
      main.innerHTML = `<p>No view at <code>${esc(path)}</code>. <a href="#/fleet">Fleet</a></p>`;
      current.ready();
      return;
    }
    const [re, nav, view] = found;
    for (const a of document.querySelectorAll('#nav a')) a.classList.toggle('active', a.dataset.view === nav);
    const m = path.match(re);
    Promise.resolve(view(current, params, ...m.slice(1).map(decodeURIComponent))).catch(problem);
  }

  // Changes the view's query string without reloading the view (filters).
  function setParams(params) {
    const path = (location.hash.replace(/^#/, '') || '/fleet').split('?')[0];
    history.replaceState(null, '', `#${path}${qs(params)}`);
  }

  function table(columns, data, opts = {}) {
    const head = columns.map((c) => {
      if (!c.sort) return `<th class="${c.num ? 'num' : ''}">${esc(c.title)}</th>`;
      const on = opts.sorted && opts.sorted[0] === c.sort;
      const dir = on ? (opts.sorted[1] === 'asc' ? 'ascending' : 'descending') : 'none';
      return `<th class="sortable ${c.num ? 'num' : ''}" data-sort="${esc(c.sort)}" aria-sort="${dir}" tabindex="0" title="sort by ${esc(c.title)}">${esc(c.title)}${on ? (dir === 'ascending' ? ' ▲' : ' ▼') : ''}</th>`;
    }).join('');
    const body = data.map((r) => `<tr>${columns.map((c) => {
      const html = c.html ? c.html(r) : esc(c.text ? c.text(r) : r[c.key]);
      return `<td class="${c.num ? 'num' : ''}">${html}</td>`;
    }).join('')}</tr>`).join('');
    const empty = data.length ? '' : `<tr><td colspan="${columns.length}" class="muted">${esc(opts.empty || 'Nothing here.')}</td></tr>`;
    return `<div class="scroll"><table${opts.id ? ` id="${opts.id}"` : ''}><thead><tr>${head}</tr></thead><tbody>${body}${empty}</tbody></table></div>`;
  }

  const sqlLink = (query) => `<a class="muted" href="#/sql${qs({ q: query })}">the SQL behind this</a>`;

  // --- fleet -----------------------------------------------------------------------------
  // The problems a GPU can have, worst first: each has a card that lists them, a filter, and a
  // pattern of its own on the cell (not only a colour: red and amber look alike to many).
  const PROBLEMS = [
    { key: 'bad', title: 'unhealthy GPUs', what: 'unhealthy' },
    { key: 'down', title: 'GPUs on nodes down or silent', what: 'node down' },
    { key: 'idle', title: `allocated, under ${IDLE_PCT}% busy`, what: 'allocated, idle' },
    { key: 'drained', title: 'GPUs on drained nodes', what: 'node drained' },
  ];
  const nodeDown = (node) => node.state === 'down' || node.state === 'no_telemetry';
  // The problems of one GPU, as PROBLEMS keys.
  function gpuProblems(node, g) {
    const out = [];
    const down = nodeDown(node);
    if (g.health !== 'healthy') out.push('bad');
    if (down) out.push('down');
    if (g.jobs.length && !down && (g.utilization_gpu_pct == null || g.utilization_gpu_pct < IDLE_PCT)) out.push('idle');
    if (node.state === 'drained') out.push('drained');
    return out;
  }
  const healthText = (g) => (g.health === 'healthy' ? 'healthy' : `${g.health.replace(/_/g, ' ')}${g.xid != null ? ` ${g.xid}` : ''}`);

  function gpuClass(node, g) {
    const cls = ['gpu'];
    const down = nodeDown(node);
    if (down) cls.push('off');
    if (g.health !== 'healthy') cls.push('bad');
    if (node.state === 'drained') cls.push('drained');
    if (!g.jobs.length) cls.push('free');
    else if (g.jobs.some((j) => j.share_percent != null)) cls.push('shared');
    if (g.jobs.length && !down && (g.utilization_gpu_pct == null || g.utilization_gpu_pct < IDLE_PCT)) cls.push('idle');
    return cls.join(' ');
  }

  function gpuTitle(node, g) {
    const lines = [`${node.name} GPU ${g.index}${g.simulated ? ' (simulated)' : ''}`];
    for (const j of g.jobs) {
      lines.push(`job ${j.job}: ${j.user} / ${j.account}${j.share_percent != null ? `, ${j.share_percent}% share` : ''}`);
    }
    for (const m of g.mig_instances || []) {
      lines.push(`MIG ${m.profile}: ${m.job != null ? `job ${m.job} (${m.user})` : 'free'}`);
    }
    if (!g.jobs.length && !(g.mig_instances || []).length) lines.push('free');
    lines.push(`utilization ${pct(g.utilization_gpu_pct)}, memory ${gib(g.memory_used_bytes)} of ${gib(g.memory_total_bytes)}, ${num(g.power_watts, 0)} W, ${num(g.temperature_celsius, 0)} °C`);
    if (g.health !== 'healthy') lines.push(`health: ${healthText(g)}`);
    if (node.state !== 'up') lines.push(`node ${node.state}`);
    return lines.join('\n');
  }

  // What a screen reader says of a cell: node, GPU, state, job, utilization, in words.
  function gpuLabel(node, g) {
    const probs = gpuProblems(node, g).map((k) => PROBLEMS.find((p) => p.key === k).what);
    const state = g.health !== 'healthy' ? `unhealthy (${healthText(g)})` : probs.length ? probs.join(', ') : g.jobs.length ? 'busy' : 'free';
    const jobs = g.jobs.map((j) => `job ${j.job} of ${j.user}`).join(', ');
    return `${node.name} GPU ${g.index}: ${state}${jobs ? `, ${jobs}` : ''}, utilization ${g.utilization_gpu_pct == null ? 'unknown' : `${Math.round(g.utilization_gpu_pct)} percent`}`;
  }

  // A GPU cell's attributes and text, from which both the first render and the in-place
  // updates are made.
  function gpuCellParts(node, g) {
    const first = g.jobs[0];
    const util = g.utilization_gpu_pct;
    return {
      attrs: {
        class: gpuClass(node, g),
        href: first ? `#/jobs/${first.job}` : `#/nodes/${encodeURIComponent(node.name)}`,
        style: `background-color:${utilColor(util)};color:${util != null && util > 55 ? '#0b1a10' : '#e8edf5'}`,
        'data-gpu': String(g.index),
        'data-util': util == null ? '' : String(util),
        'data-sample-ms': g.sample_ms == null ? '' : String(g.sample_ms),
        'data-job': first ? String(first.job) : '',
        'data-user': g.jobs.map((j) => j.user).join(' '),
        'data-account': g.jobs.map((j) => j.account).join(' '),
        'data-health': g.health,
        'data-problems': gpuProblems(node, g).join(' '),
        'aria-label': gpuLabel(node, g),
        title: gpuTitle(node, g),
      },
      label: g.health !== 'healthy' ? (g.xid != null ? `X${g.xid}` : '!') : (util == null ? '–' : String(Math.round(util))),
      job: first ? String(first.job) : '',
    };
  }

  // Cells are not tab stops one by one: the fleet is one stop, the arrow keys move inside it.
  function gpuCell(node, g) {
    const c = gpuCellParts(node, g);
    const attrs = Object.entries(c.attrs).map(([k, x]) => `${k}="${esc(x)}"`).join(' ');
    return `<a tabindex="-1" ${attrs}><b>${esc(c.label)}</b><i>${esc(c.job)}</i></a>`;
  }

  function updateGpuCell(el, node, g) {
    const c = gpuCellParts(node, g);
    for (const [k, x] of Object.entries(c.attrs)) if (el.getAttribute(k) !== x) el.setAttribute(k, x);
    const [b, i] = el.children;
    if (b.textContent !== c.label) b.textContent = c.label;
    if (i.textContent !== c.job) i.textContent = c.job;
  }

  function nodeCard(node) {
    const cols = Math.min(8, Math.max(1, node.gpu_status.length));
    return `<div class="node s-${esc(node.state)}" data-node="${esc(node.name)}" data-rack="${esc(node.rack)}" data-model="${esc(node.gpu_model)}" data-state="${esc(node.state)}" title="${esc(`${node.name} (${node.state}, rack ${node.rack})`)}">`
      + `<div class="nh"><a tabindex="-1" href="#/nodes/${encodeURIComponent(node.name)}">${esc(node.name)}</a><span class="st">${esc(node.state === 'up' ? '' : node.state)}</span></div>`
      + `<div class="gpus" style="--cols:${cols}">${node.gpu_status.map((g) => gpuCell(node, g)).join('')}</div></div>`;
  }

  // The summary of the nodes shown, counting only the GPUs `gpuMatch` keeps (an account or
  // user filter). The problem cards are buttons: each lists its GPUs and filters the grid.
  function fleetSummary(nodes, gpuMatch = () => true, showing = '') {
    let gpus = 0, held = 0, sim = false, utilSum = 0, utilN = 0;
    const states = {};
    const count = { bad: 0, down: 0, idle: 0, drained: 0 };
    for (const n of nodes) {
      states[n.state] = (states[n.state] || 0) + 1;
      for (const g of n.gpu_status) {
        if (!gpuMatch(g)) continue;
        gpus++;
        if (g.simulated) sim = true;
        for (const k of gpuProblems(n, g)) count[k]++;
        if (g.jobs.length) {
          held++;
          if (g.utilization_gpu_pct != null) { utilSum += g.utilization_gpu_pct; utilN++; }
        }
      }
    }
    const card = (k, v, id) => `<div class="card" id="${id}"><div class="v">${esc(v)}</div><div class="k">${esc(k)}</div></div>`;
    const button = (k, v, id, show, sub) => `<button type="button" class="card pick p-${show}${showing === show ? ' on' : ''}${v ? ' some' : ''}" id="${id}" data-show="${show}"
        aria-pressed="${showing === show}" title="list them and show only their nodes"><div class="v"><span class="glyph" aria-hidden="true"></span>${esc(v)}</div><div class="k">${esc(k)}${sub ? ` <span class="muted">(${esc(sub)})</span>` : ''}</div></button>`;
    return {
      sim,
      count,
      html: card('nodes up', `${states.up || 0} / ${nodes.length}`, 'sum-up')
        + button('drained', states.drained || 0, 'sum-drained', 'drained', count.drained ? `${count.drained} GPUs` : '')
        + button('down or silent', (states.down || 0) + (states.no_telemetry || 0), 'sum-down', 'down', count.down ? `${count.down} GPUs` : '')
        + card('GPUs allocated', `${held} / ${gpus}`, 'sum-held')
        + button(`allocated, under ${IDLE_PCT}% busy`, count.idle, 'sum-idle', 'idle')
        + button('unhealthy GPUs', count.bad, 'sum-bad', 'bad')
        + card('mean use of allocated GPUs', utilN ? pct(utilSum / utilN) : '–', 'sum-util'),
    };
  }

  const LEGEND = `<div class="legend" aria-hidden="true">
    <span><i style="background:${utilColor(0)}"></i>0%</span><span><i style="background:${utilColor(50)}"></i>50%</span>
    <span><i style="background:${utilColor(100)}"></i>100% utilization</span>
    <span><i class="sw gpu free"></i>free</span>
    <span><i class="sw gpu idle"></i>allocated, idle (dotted, centre dot)</span>
    <span><i class="sw gpu shared"></i>shared (dashed)</span>
    <span><i class="sw gpu bad"></i>unhealthy (cross-hatched: XID, ECC, taken out)</span>
    <span><i class="sw gpu drained"></i>drained (stripes)</span>
    <span><i class="sw gpu off"></i>node down (a bar)</span>
    <span>cell: utilization % over job ID</span></div>`;

  // The GPUs with one problem, for the list under the cards: node, GPU, what, job, user and
  // since when (from SQL: the node's state history, the GPU's last fault event, its last busy
  // sample).
  async function problemRows(nodes, show, gpuMatch) {
    const list = [];
    for (const n of nodes) {
      for (const g of n.gpu_status) {
        if (gpuMatch(g) && gpuProblems(n, g).includes(show)) list.push({ n, g });
      }
    }
    const LIMIT = 500;
    const shown = list.slice(0, LIMIT);
    const names = [...new Set(shown.map((x) => x.n.name))];
    const since = new Map();
    const sinceKey = (node, gpu) => `${node}/${gpu}`;
    if (names.length) {
      const inNodes = `node IN (${names.map(sqlStr).join(',')})`;
      if (show === 'drained' || show === 'down') {
        const r = await rows(`SELECT node, max(start_time) AS t FROM node_states WHERE end_time IS NULL AND ${inNodes} GROUP BY node`);
        for (const x of r) since.set(x.node, { t: Date.parse(x.t) });
        // A node whose agent syncs but whose telemetry stopped: silent since its last sample.
        for (const { n } of shown) {
          if (n.state === 'no_telemetry' && n.last_sample_secs_ago != null) since.set(n.name, { t: Date.now() - n.last_sample_secs_ago * 1000 });
        }
        if (show === 'drained') {
          const why = await rows(`SELECT node, reason, drained_by FROM nodes WHERE ${inNodes}`);
          for (const x of why) since.set(`${x.node}/why`, x.reason || (x.drained_by ? `by ${x.drained_by}` : ''));
        }
      } else if (show === 'bad') {
        const r = await rows(`SELECT node, gpu, max(time) AS t FROM gpu_events WHERE kind <> 'gpu_recovered' AND ${inNodes} GROUP BY node, gpu`);
        for (const x of r) since.set(sinceKey(x.node, x.gpu), { t: Date.parse(x.t) });
      } else if (show === 'idle') {
        const [busy, held] = await Promise.all([
          rows(`SELECT node, gpu, max(time) AS t FROM gpu_samples WHERE ${inNodes} AND time > now() - INTERVAL '1 hour'
            AND utilization_gpu_pct >= ${IDLE_PCT} GROUP BY node, gpu`),
          rows(`SELECT node, gpu, max(start_time) AS t FROM job_allocations WHERE end_time IS NULL AND ${inNodes} GROUP BY node, gpu`),
        ]);
        const hourAgo = Date.now() - 3600e3;
        const lastBusy = new Map(busy.map((x) => [sinceKey(x.node, x.gpu), Date.parse(x.t)]));
        for (const x of held) {
          const start = Date.parse(x.t);
          const b = lastBusy.get(sinceKey(x.node, x.gpu));
          // Idle since its last busy sample, or since it was allocated; no busy sample in the
          // hour SQL looked at: at least that long.
          if (b != null) since.set(sinceKey(x.node, x.gpu), { t: Math.max(b, start) });
          else if (start >= hourAgo) since.set(sinceKey(x.node, x.gpu), { t: start });
          else since.set(sinceKey(x.node, x.gpu), { t: hourAgo, atLeast: true });
        }
      }
    }
    for (const x of shown) {
      x.since = since.get(sinceKey(x.n.name, x.g.index)) || since.get(x.n.name) || null;
      x.why = since.get(`${x.n.name}/why`) || '';
    }
    return { shown, total: list.length };
  }

  function problemTable(show, { shown, total }) {
    const p = PROBLEMS.find((x) => x.key === show);
    const what = (x) => {
      if (show === 'bad') return healthText(x.g);
      if (show === 'idle') return `utilization ${pct(x.g.utilization_gpu_pct)}`;
      if (show === 'drained') return x.why || 'drained';
      return x.n.state.replace(/_/g, ' ');
    };
    const sinceText = (x) => (x.since ? `${x.since.atLeast ? 'over ' : ''}${rel(x.since.t)} (${x.since.atLeast ? 'before ' : ''}${when(x.since.t)})` : '–');
    return `<h2 id="problem-title">${esc(p.title)}: ${total} <button type="button" id="problem-close">show all GPUs</button></h2>`
      + table([
        { title: 'node', html: (x) => `<a href="#/nodes/${encodeURIComponent(x.n.name)}">${esc(x.n.name)}</a>` },
        { title: 'GPU', num: true, text: (x) => x.g.index },
        { title: 'what', text: what },
        { title: 'job', html: (x) => x.g.jobs.map((j) => `<a href="#/jobs/${j.job}">${j.job}</a>`).join(', ') || '<span class="muted">none</span>' },
        { title: 'user', text: (x) => x.g.jobs.map((j) => j.user).join(', ') },
        { title: 'since', text: sinceText },
      ], shown, { id: 'problem-list', empty: `No ${p.title} now.` })
      + (total > shown.length ? `<p class="muted">the first ${shown.length} of ${total}</p>` : '');
  }

  // The strip above the grid: every unhealthy GPU and down node named, whatever the fleet's
  // size, so a fault is never only one small cell among thousands.
  function problemStrip(nodes, count) {
    const items = [];
    for (const n of nodes) {
      if (nodeDown(n)) items.push(`<a class="pb down" href="#/nodes/${encodeURIComponent(n.name)}">${esc(n.name)} ${esc(n.state.replace(/_/g, ' '))}</a>`);
      for (const g of n.gpu_status) {
        if (g.health !== 'healthy') {
          items.push(`<a class="pb bad" href="#/nodes/${encodeURIComponent(n.name)}">${esc(n.name)} GPU ${esc(g.index)}: ${esc(healthText(g))}${g.jobs.length ? `, job ${esc(g.jobs.map((j) => j.job).join(','))}` : ''}</a>`);
        }
      }
    }
    if (!items.length) return '';
    const MAX = 12;
    return `<span class="k">${count.bad} unhealthy, ${items.length - count.bad} nodes down:</span> ${items.slice(0, MAX).join(' ')}`
      + (items.length > MAX ? ` <button type="button" data-show="bad">and ${items.length - MAX} more</button>` : '');
  }

  // Problem nodes first (unhealthy, down, drained) in the compact drawing; the order is the
  // API's otherwise. Idle is not a reason to move: it changes every few seconds.
  function nodeRank(n) {
    if (n.gpu_status.some((g) => g.health !== 'healthy')) return 0;
    if (nodeDown(n)) return 1;
    if (n.state === 'drained') return 2;
    return 3;
  }

  async function fleetView(v, params) {
    const filters = ['rack', 'model', 'state', 'account', 'user'];
    const f = Object.fromEntries(filters.map((k) => [k, params.get(k) || '']));
    f.q = params.get('q') || '';
    f.cells = params.get('cells') || '';
    f.show = PROBLEMS.some((p) => p.key === params.get('show')) ? params.get('show') : '';
    main.innerHTML = `<div class="toolbar" id="filters">
        ${filters.map((k) => `<label>${k} <select data-f="${k}"><option value="">all</option></select></label>`).join('')}
        <label>node <input data-f="q" size="14" placeholder="name contains" value="${esc(f.q)}"></label>
        <label>cells <select data-f="cells"><option value="">auto</option><option value="detailed">detailed</option><option value="compact">compact</option></select></label>
        <span class="muted" id="fleet-count"></span></div>
      <div class="cards" id="summary"></div><div id="problems" class="problems" role="region" aria-label="problems"></div>
      <div id="problem-box"></div>${LEGEND}
      <div class="fleet" id="fleet" role="group" aria-label="GPUs by node: arrow keys move between GPUs, Enter opens a GPU's job, N its node"></div>`;
    const fleet = document.getElementById('fleet');
    let shape = '';
    let cells = [];
    let nodes = [];
    let roving = null; // [node, gpu] of the cell that is the fleet's tab stop
    let listed = '';

    const gpuMatch = (g) => (!f.account || g.jobs.some((j) => j.account === f.account))
      && (!f.user || g.jobs.some((j) => j.user === f.user));
    const compact = () => f.cells === 'compact' || (f.cells === '' && nodes.length > 200);

    // The one cell of the fleet that Tab reaches: the last one focused, or the first shown.
    const setRoving = (cell) => {
      const old = fleet.querySelector('.gpu[tabindex="0"]');
      if (old && old !== cell) old.setAttribute('tabindex', '-1');
      if (cell) {
        cell.setAttribute('tabindex', '0');
        roving = [cell.closest('.node').dataset.node, cell.dataset.gpu];
      }
    };
    const visibleCells = () => [...fleet.querySelectorAll('.node:not([hidden]) .gpu')];
    const restoreRoving = () => {
      const sel = roving && `.node[data-node="${CSS.escape(roving[0])}"]:not([hidden]) .gpu[data-gpu="${roving[1]}"]`;
      const cell = (sel && fleet.querySelector(sel)) || visibleCells()[0];
      if (cell) setRoving(cell);
    };
    fleet.addEventListener('keydown', (e) => {
      const cell = e.target.closest('.gpu');
      if (!cell) return;
      let next = null;
      if (e.key === 'ArrowRight' || e.key === 'ArrowLeft') {
        const all = visibleCells();
        next = all[all.indexOf(cell) + (e.key === 'ArrowRight' ? 1 : -1)];
      } else if (e.key === 'ArrowDown' || e.key === 'ArrowUp') {
        const cards = [...fleet.querySelectorAll('.node:not([hidden])')];
        const card = cards[cards.indexOf(cell.closest('.node')) + (e.key === 'ArrowDown' ? 1 : -1)];
        if (card) {
          const gpus = card.querySelectorAll('.gpu');
          next = card.querySelector(`.gpu[data-gpu="${cell.dataset.gpu}"]`) || gpus[gpus.length - 1];
        }
      } else if (e.key === 'n' || e.key === 'N') {
        // The cell's node page (Enter opens its job).
        location.hash = `#/nodes/${encodeURIComponent(cell.closest('.node').dataset.node)}`;
        return;
      } else if (e.key === 'Home' || e.key === 'End') {
        const all = visibleCells();
        next = e.key === 'Home' ? all[0] : all[all.length - 1];
      } else {
        return;
      }
      e.preventDefault();
      if (next) { setRoving(next); next.focus(); }
    });
    fleet.addEventListener('focusin', (e) => { if (e.target.classList.contains('gpu')) setRoving(e.target); });

    const drawProblems = async () => {
      const box = document.getElementById('problem-box');
      if (!f.show) { if (listed) { box.innerHTML = ''; listed = ''; } return; }
      const shown = nodes.filter((n, i) => fleet.children[i] && !fleet.children[i].hidden);
      const data = await problemRows(shown, f.show, gpuMatch);
      box.innerHTML = problemTable(f.show, data);
      listed = f.show;
      document.getElementById('problem-close').onclick = () => pick('');
    };
    const pick = (show) => {
      f.show = f.show === show ? '' : show;
      setParams(f);
      applyFilters();
      drawProblems().catch(problem);
    };
    document.getElementById('summary').addEventListener('click', (e) => {
      const b = e.target.closest('[data-show]');
      if (b) pick(b.dataset.show);
    });
    document.getElementById('problems').addEventListener('click', (e) => {
      const b = e.target.closest('button[data-show]');
      if (b) pick(b.dataset.show);
    });

    const applyFilters = () => {
      // A large fleet is drawn compact (small cells, no text: hover, focus or the problems
      // strip for details) so that a thousand nodes fit on a screen or two.
      fleet.classList.toggle('compact', compact());
      let shown = 0;
      for (const card of fleet.children) {
        const d = card.dataset;
        let visible = (!f.rack || d.rack === f.rack) && (!f.model || d.model === f.model)
          && (!f.state || d.state === f.state) && (!f.q || d.node.includes(f.q));
        if (visible && (f.account || f.user || f.show)) {
          let any = false;
          for (const cell of card.querySelectorAll('.gpu')) {
            const match = (!f.account || cell.dataset.account.split(' ').includes(f.account))
              && (!f.user || cell.dataset.user.split(' ').includes(f.user))
              && (!f.show || cell.dataset.problems.split(' ').includes(f.show));
            cell.classList.toggle('dim', !match);
            any = any || match;
          }
          visible = any;
        } else {
          for (const cell of card.querySelectorAll('.gpu.dim')) cell.classList.remove('dim');
        }
        card.hidden = !visible;
        if (visible) shown++;
      }
      document.getElementById('fleet-count').textContent = `${shown} of ${fleet.children.length} nodes shown`;
      // The cards count what is shown: the filtered nodes, and of them the filtered GPUs.
      const visible = nodes.filter((n, i) => fleet.children[i] && !fleet.children[i].hidden);
      const sum = fleetSummary(f.show ? nodes : visible, gpuMatch, f.show);
      document.getElementById('summary').innerHTML = sum.html;
      document.getElementById('problems').innerHTML = problemStrip(nodes, fleetSummary(nodes).count);
      const focused = fleet.contains(document.activeElement);
      if (!focused) restoreRoving();
    };

    const fillSelects = () => {
      const values = { rack: new Set(), model: new Set(), state: new Set(), account: new Set(), user: new Set() };
      for (const n of nodes) {
        values.rack.add(n.rack); values.model.add(n.gpu_model); values.state.add(n.state);
        for (const g of n.gpu_status) for (const j of g.jobs) { values.account.add(j.account); values.user.add(j.user); }
      }
      for (const sel of document.querySelectorAll('#filters select')) {
        const k = sel.dataset.f;
        if (k === 'cells') { sel.value = f.cells; continue; }
        const want = [...values[k]].filter(Boolean).sort();
        if (f[k] && !want.includes(f[k])) want.push(f[k]);
        const have = [...sel.options].slice(1).map((o) => o.value);
        if (have.join('\n') !== want.join('\n')) {
          sel.innerHTML = `<option value="">all</option>${want.map((x) => `<option>${esc(x)}</option>`).join('')}`;
        }
        sel.value = f[k];
      }
    };

    document.getElementById('filters').addEventListener('input', (e) => {
      const k = e.target.dataset.f;
      if (!k) return;
      f[k] = e.target.value;
      setParams(f);
      if (k === 'cells') shape = ''; // the order may change: drawn again on the next poll
      applyFilters();
    });

    await v.every(5000, async () => {
      const t0 = performance.now();
      nodes = (await api('/v1/nodes')).nodes;
      if (compact()) {
        const rank = new Map(nodes.map((n) => [n, nodeRank(n)]));
        nodes = nodes.map((n, i) => [n, i]).sort((a, b) => rank.get(a[0]) - rank.get(b[0]) || a[1] - b[1]).map((x) => x[0]);
      }
      const newShape = nodes.map((n) => `${n.name}:${n.gpu_status.length}:${n.state}`).join('|');
      if (newShape !== shape) {
        fleet.innerHTML = nodes.map(nodeCard).join('');
        cells = nodes.map((n, i) => [...fleet.children[i].querySelectorAll('.gpu')]);
        shape = newShape;
      } else {
        // Same nodes: touch only the attributes that changed.
        nodes.forEach((n, i) => n.gpu_status.forEach((g, j) => updateGpuCell(cells[i][j], n, g)));
      }
      simulatedBanner(fleetSummary(nodes).sim);
      fillSelects();
      applyFilters();
      main.dataset.renderMs = String(Math.round(performance.now() - t0));
      if (window.__perchFleetPainted === undefined) {
        // After the frame that shows the fleet (perch bench web times page loads to here).
        window.__perchFleetPainted = null;
        requestAnimationFrame(() => setTimeout(() => { window.__perchFleetPainted = performance.now(); }, 0));
      }
      await drawProblems();
      v.ready();
    });
  }

  function simulatedBanner(sim) {
    if (sim && !banner.querySelector('.error')) {
      banner.innerHTML = `${badge('simulated')} Some GPUs here are simulated (perch demo or --simulate-gpus): their numbers are made up, not measured.`;
    }
  }

  // --- node ------------------------------------------------------------------------------
  async function nodeView(v, params, name) {
    main.innerHTML = `<h1>Node ${esc(name)} <span id="node-state"></span> <span class="muted" id="node-why"></span></h1>
      <div id="node-actions" class="toolbar"></div>
      <dl class="kv" id="node-kv"></dl>
      <h2>GPUs now</h2><div id="node-gpus"></div>
      <section id="node-mig-section" hidden><h2>MIG instances</h2>
        <p class="muted">GPUs in MIG mode are placed only as these instances (<code>perch submit --gpu-profile</code>), never whole; perch does not create or remove them (docs/mig.md).</p>
        <div id="node-mig"></div></section>
      <h2>Utilization, last hour</h2><div class="chart" id="node-chart"></div>
      <h2>Validation</h2><div id="node-validation"></div>
      <h2>Events</h2><div id="node-events"></div>`;
    let chart = null;
    await v.every(5000, async () => {
      const node = (await api('/v1/nodes')).nodes.find((n) => n.name === name);
      if (!node) {
        main.innerHTML = `<p>perch knows no node ${esc(name)}. <a href="#/fleet">Fleet</a></p>`;
        v.ready();
        v.stop();
        return;
      }
      document.getElementById('node-state').innerHTML = badge(node.state);
      document.getElementById('node-kv').innerHTML = `<dt>GPUs</dt><dd>${node.gpus} × ${esc(node.gpu_model)}</dd>
        <dt>rack</dt><dd>${esc(node.rack)}</dd><dt>allocated</dt><dd>${node.allocated_gpus}</dd>
        <dt>GPU sharing</dt><dd>${node.gpu_sharing ? 'on' : 'off'}</dd>
        <dt>NVLink islands</dt><dd>${esc(JSON.stringify(node.nvlink_islands))}</dd>
        <dt>last sample</dt><dd>${node.last_sample_secs_ago == null ? 'never' : `${num(node.last_sample_secs_ago)} s ago`}</dd>
        <dt>last agent sync</dt><dd>${node.last_sync_secs_ago == null ? '–' : `${num(node.last_sync_secs_ago)} s ago`}</dd>`;
      document.getElementById('node-gpus').innerHTML = table([
        { title: 'GPU', key: 'index' },
        { title: 'jobs', html: gpuJobs },
        { title: 'utilization', num: true, text: (g) => pct(g.utilization_gpu_pct) },
        { title: 'memory', num: true, text: (g) => `${gib(g.memory_used_bytes)} / ${gib(g.memory_total_bytes)}` },
        { title: 'power', num: true, text: (g) => `${num(g.power_watts, 0)} W` },
        { title: 'temperature', num: true, text: (g) => `${num(g.temperature_celsius, 0)} °C` },
        { title: 'health', html: (g) => (g.health === 'healthy' ? 'healthy' : `<span class="bad">${esc(g.health)}${g.xid != null ? ` ${g.xid}` : ''}</span>`) },
        { title: '', html: (g) => (g.simulated ? badge('simulated') : '') },
      ], node.gpu_status);
      nodeMig(node);
      nodeActions(name, node.state);
      await nodeValidation(name);
      const why = node.state === 'drained' ? await rows(`SELECT reason, drained_by FROM nodes WHERE node = ${sqlStr(name)}`) : [];
      document.getElementById('node-why').textContent = why.length
        ? `drained${why[0].drained_by ? ` by ${why[0].drained_by}` : ''}${why[0].reason ? `: ${why[0].reason}` : ''}` : '';
      const series = await rows(`SELECT gpu, date_bin(INTERVAL '30 seconds', time, TIMESTAMP '1970-01-01') AS t,
        avg(utilization_gpu_pct) AS u FROM gpu_samples WHERE node = ${sqlStr(name)} AND time > now() - INTERVAL '1 hour'
        GROUP BY 1, 2 ORDER BY 2`);
      chart = drawLines(v, chart, document.getElementById('node-chart'), series, (r) => `GPU ${r.gpu}`, 'u', '%');
      const events = await rows(`SELECT time, kind, actor, gpu, job, message FROM events WHERE node = ${sqlStr(name)} ORDER BY time DESC LIMIT 50`);
      document.getElementById('node-events').innerHTML = table([
        { title: 'time', text: (r) => when(Date.parse(r.time)) }, { title: 'kind', key: 'kind' }, { title: 'by', key: 'actor' },
        { title: 'GPU', key: 'gpu' }, { title: 'job', html: (r) => (r.job != null ? `<a href="#/jobs/${r.job}">${r.job}</a>` : '') },
        { title: 'what', key: 'message' }], events, { empty: 'No events for this node.' });
      v.ready();
    });
  }

  // A GPU's jobs on the node page: its whole owner, its MPS sharers with the percent of the
  // GPU each was granted, or, in MIG mode, how many of its instances are held.
  function gpuJobs(g) {
    const mig = g.mig_instances || [];
    if (mig.length) {
      const held = mig.filter((m) => m.job != null).length;
      return `<span class="mig-summary">MIG mode: ${mig.length} instance${mig.length === 1 ? '' : 's'}, ${held} held</span>`;
    }
    const shared = g.jobs.some((j) => j.share_percent != null);
    const jobs = g.jobs.map((j) => `<a href="#/jobs/${j.job}">${j.job}</a> ${esc(j.user)}${j.share_percent != null ? ` (${j.share_percent}%)` : ''}`).join(', ');
    if (!jobs) return '<span class="muted">free</span>';
    return shared ? `<span class="mps-sharers">shared (MPS): ${jobs}, ${g.jobs.reduce((a, j) => a + (j.share_percent || 0), 0)}% granted</span>` : jobs;
  }

  // The node's MIG instances (GET /v1/nodes' mig_instances): GPU, profile, UUID, memory and
  // the job on each, or free. Hidden for a node with none.
  function nodeMig(node) {
    const mig = node.gpu_status.flatMap((g) => (g.mig_instances || []).map((m) => ({ gpu: g.index, ...m })));
    document.getElementById('node-mig-section').hidden = !mig.length;
    document.getElementById('node-mig').innerHTML = mig.length ? table([
      { title: 'GPU', key: 'gpu' },
      { title: 'profile', key: 'profile' },
      { title: 'UUID', html: (m) => `<span class="mono">${esc(m.uuid)}</span>` },
      { title: 'memory', num: true, text: (m) => (m.memory_mb == null ? '–' : `${num(m.memory_mb / 1024, 1)} GiB`) },
      { title: 'job', html: (m) => (m.job != null ? `<a href="#/jobs/${m.job}">${m.job}</a> ${esc(m.user || '')}` : '<span class="muted">free</span>') },
    ], mig, { id: 'mig-instances' }) : '';
  }

  // Drain or Resume, whichever the node's state allows (operators only). Drain asks for a
  // reason and a confirmation first: it stops new jobs on the node.
  function nodeActions(name, state) {
    const el = document.getElementById('node-actions');
    if (!who || who.role !== 'operator') { el.innerHTML = ''; return; }
    const want = state === 'drained' ? 'resume' : 'drain';
    if (el.dataset.shows === want) return;
    el.dataset.shows = want;
    const url = (verb) => `/v1/nodes/${encodeURIComponent(name)}/${verb}`;
    if (want === 'resume') {
      el.innerHTML = '<button id="resume">Resume: place jobs here again</button>';
      document.getElementById('resume').onclick = () => post(url('resume')).then(route, problem);
      return;
    }
    el.innerHTML = '<button class="danger" id="drain">Drain…</button>';
    document.getElementById('drain').onclick = () => {
      el.innerHTML = `<form class="inline-form" id="drain-form">
          <label for="drain-reason">Drain ${esc(name)}: no new jobs start on it; running jobs go on. Why?</label>
          <input type="text" id="drain-reason" required maxlength="200" placeholder="e.g. fan noise, ticket 1234">
          <button type="submit" class="danger" id="drain-confirm">Drain ${esc(name)}</button>
          <button type="button" id="drain-cancel">Cancel</button></form>`;
      document.getElementById('drain-reason').focus();
      document.getElementById('drain-cancel').onclick = () => { delete el.dataset.shows; nodeActions(name, state); };
      document.getElementById('drain-form').onsubmit = (e) => {
        e.preventDefault();
        const reason = document.getElementById('drain-reason').value.trim();
        if (!reason) return;
        post(url('drain'), { reason }).then(route, problem);
      };
    };
  }

  // The node's validation runs (node_validations): the latest with its result and the end
  // of its output, the ones before it in a table, and, for operators, a button to run one
  // (docs/validation.md).
  const VALIDATION_BADGE = { passed: 'up', failed: 'failed', timed_out: 'failed', no_answer: 'failed' };
  async function nodeValidation(name) {
    const el = document.getElementById('node-validation');
    if (!el) return;
    const runs = await rows(`SELECT id, "trigger", requested_by, started, finished, result, exit_code, output
      FROM node_validations WHERE node = ${sqlStr(name)} ORDER BY id DESC LIMIT 10`);
    const last = runs[0];
    const button = who && who.role === 'operator' && !(last && last.result == null)
      ? '<button id="validate">Validate: drain, check the GPUs, resume if they pass</button>' : '';
    if (!last) {
      el.innerHTML = `<p class="muted" id="validation-last">Never validated since the server started.</p>${button}`;
    } else {
      const result = last.result == null ? badge('validating', 'pending') : badge(last.result.replace(/_/g, ' '), VALIDATION_BADGE[last.result] || 'failed');
      const tail = (last.output || '').trim().split('\n').slice(-6).join('\n');
      el.innerHTML = `<p id="validation-last">Last validation: ${result} (${esc(last.trigger.replace(/_/g, ' '))}, asked by ${esc(last.requested_by)}),
        started ${esc(when(Date.parse(last.started)))}${last.finished ? `, finished ${esc(when(Date.parse(last.finished)))}` : ''}${last.exit_code != null ? `, exit code ${esc(last.exit_code)}` : ''}</p>
        ${tail ? `<pre class="log" id="validation-output">${esc(tail)}</pre>` : ''}${button}
        ${runs.length > 1 ? table([
          { title: 'started', text: (r) => when(Date.parse(r.started)) }, { title: 'why', text: (r) => r.trigger.replace(/_/g, ' ') },
          { title: 'by', key: 'requested_by' }, { title: 'result', html: (r) => (r.result == null ? badge('validating', 'pending') : badge(r.result.replace(/_/g, ' '), VALIDATION_BADGE[r.result] || 'failed')) },
          { title: 'exit code', key: 'exit_code' }], runs.slice(1)) : ''}`;
    }
    const b = document.getElementById('validate');
    if (b) b.onclick = () => post(`/v1/nodes/${encodeURIComponent(name)}/validate`).then(route, problem);
  }

  // Time series from SQL rows (`t` a timestamp) as one uPlot line per key. The axes are
  // fixed: 24-hour times spaced so that labels never overlap, and a y axis as wide as its
  // widest label ("97.5%" is never cut to "7.5%").
  const AXIS_FONT = '11px system-ui, sans-serif';
  let measureCtx = null;
  const textWidth = (t) => {
    measureCtx = measureCtx || document.createElement('canvas').getContext('2d');
    measureCtx.font = AXIS_FONT;
    return measureCtx.measureText(t).width;
  };
  // `xRange` ([from, to], Unix seconds) fixes the x axis (a chart of one bucket would
  // otherwise span years).
  function drawLines(v, chart, el, data, keyOf, field, unit, xRange) {
    const keys = [...new Set(data.map(keyOf))].sort();
    const times = [...new Set(data.map((r) => Date.parse(r.t) / 1000))].sort((a, b) => a - b);
    const at = new Map(times.map((t, i) => [t, i]));
    const cols = keys.map(() => new Array(times.length).fill(null));
    for (const r of data) cols[keys.indexOf(keyOf(r))][at.get(Date.parse(r.t) / 1000)] = r[field];
    const shape = keys.join('|');
    if (chart && chart.__shape === shape) {
      chart.__xRange = xRange;
      chart.setData([times, ...cols]);
      return chart;
    }
    if (chart) chart.destroy();
    el.innerHTML = keys.length ? '' : '<p class="muted empty">No samples in this window.</p>';
    if (!keys.length) return null;
    const css = getComputedStyle(document.documentElement);
    const muted = css.getPropertyValue('--muted').trim() || '#8b95a8';
    const line = css.getPropertyValue('--line').trim() || '#2c3446';
    // Ticks are round steps: as many decimals as they have (0.705 and 0.7, never 0.7 twice).
    const fmtY = (x) => `${Number(x.toFixed(6))}${unit}`;
    const width = Math.max(320, el.clientWidth - 14);
    const made = new uPlot({
      width,
      height: el.closest('.metric') ? 150 : 220,
      scales: { x: xRange ? { time: true, range: (u) => u.__xRange || xRange } : { time: true } },
      series: [{ value: (u, ts) => (ts == null ? '–' : axisTime(ts * 1000, true, false)) },
        ...keys.map((k) => ({ label: k, stroke: jobColor(keys.indexOf(k) * 7 + 3), width: 1.5,
          value: (u, x) => (x == null ? '–' : `${x.toFixed(1)}${unit}`) }))],
      axes: [{
        stroke: muted, grid: { stroke: line }, font: AXIS_FONT, space: 90,
        values: (u, splits) => {
          const span = splits.length > 1 ? splits[splits.length - 1] - splits[0] : 0;
          const step = splits.length > 1 ? splits[1] - splits[0] : 60;
          return splits.map((x) => axisTime(x * 1000, step < 60, span >= 86400));
        },
      }, {
        stroke: muted, grid: { stroke: line }, font: AXIS_FONT,
        values: (u, vals) => vals.map(fmtY),
        size: (u, values) => Math.ceil(Math.max(40, ...(values || []).map(textWidth))) + 18,
      }],
    }, [times, ...cols], el);
    made.__shape = shape;
    made.__xRange = xRange;
    el.__uplot = made; // for the browser tests: the axes as drawn
    v.charts = v.charts.filter((c) => c !== chart);
    v.charts.push(made);
    return made;
  }

  // --- jobs ------------------------------------------------------------------------------
  const jobCols = [
    { title: 'job', html: (j) => `<a href="#/jobs/${j.id}">${j.id}</a>` },
    { title: 'name', text: (j) => j.request.name || '' },
    { title: 'user', text: (j) => j.request.user },
    { title: 'account', text: (j) => j.request.account || j.request.user },
    { title: 'state', html: (j) => badge(j.state) },
    { title: 'GPUs', num: true, text: (j) => gpusOf(j.request) },
    { title: 'submitted', text: (j) => when(j.submit_ms) },
    // A requeued job keeps its last run's start and placement: pending, it runs nowhere.
    { title: 'ran', num: true, text: (j) => (j.start_ms && j.state !== 'pending' ? span(((j.end_ms || Date.now()) - j.start_ms) / 1000) : '–') },
    { title: 'where / why', html: (j) => (j.placement.length && j.state !== 'pending'
      ? j.placement.map((p) => `<a href="#/nodes/${encodeURIComponent(p.node)}">${esc(p.node)}</a>[${esc(p.gpus.join(','))}]`).join(' ')
      : esc(humanReason(j.reason))) },
  ];
  const gpusOf = (r) => (r.gpu_profile ? `MIG ${r.gpu_profile}` : r.gpu_share ? `${r.gpu_share.fraction}` : `${(r.nodes || 1) * (r.gpus_per_node || 1)}`);
  // What a job asked for, in words: a MIG instance of a profile, a share of one GPU (its MPS
  // compute fraction and memory), or whole GPUs.
  const askedFor = (r) => {
    if (r.gpu_profile) return `<span id="job-gpu-profile">one ${esc(r.gpu_profile)} MIG instance</span>`;
    if (r.gpu_share) return `<span id="job-gpu-share">${esc(r.gpu_share.fraction)} of a GPU (MPS share${r.gpu_share.memory_gb != null ? `, ${esc(r.gpu_share.memory_gb)} GiB of its memory` : ''})</span>`;
    return `${esc(r.nodes || 1)} node(s) × ${esc(r.gpus_per_node || 1)} GPU(s)`;
  };

  // The MIG instance job `job` holds on its node, from GET /v1/nodes; null when none is listed.
  async function migOf(job) {
    const node = (await api('/v1/nodes')).nodes.find((n) => n.name === job.placement[0].node);
    for (const g of (node && node.gpu_status) || []) {
      const m = (g.mig_instances || []).find((i) => i.job === job.id);
      if (m) return { gpu: g.index, ...m };
    }
    return null;
  }

  // The "simulated" label of views whose figures come from simulated GPUs.
  let simKnown = null;
  const fleetIsSimulated = () => {
    if (simKnown === null) {
      simKnown = rows('SELECT count(*) FILTER (WHERE simulated) AS sim FROM nodes')
        .then((r) => Number(r[0] && r[0].sim) > 0, () => false);
    }
    return simKnown;
  };
  async function simLabel(what) {
    const el = document.getElementById('sim-label');
    if (el && await fleetIsSimulated()) {
      el.innerHTML = `${badge('simulated')} <span class="muted">${esc(what)}</span>`;
    }
  }

  // Sortable columns of the job list: the key each sorts by.
  const JOB_SORT = {
    job: (j) => j.id, name: (j) => j.request.name || '', user: (j) => j.request.user,
    account: (j) => j.request.account || j.request.user, state: (j) => j.state,
    GPUs: (j) => Number(gpusOf(j.request)), submitted: (j) => j.submit_ms,
    ran: (j) => (j.start_ms && j.state !== 'pending' ? (j.end_ms || Date.now()) - j.start_ms : -1),
  };

  async function jobsView(v, params) {
    // Signed in as a user (not an operator, not an open server): their own jobs first.
    const mineDefault = who && !who.open && who.role !== 'operator';
    const p = {
      state: params.get('state') || '', user: params.get('user') || '', account: params.get('account') || '',
      scope: params.get('scope') || (mineDefault ? 'mine' : 'all'), q: params.get('q') || '',
      sort: params.get('sort') || 'job', dir: params.get('dir') || 'desc', page: params.get('page') || '',
    };
    const pageSize = Math.min(1000, Math.max(1, Number(p.page) || 200));
    const scopeUser = () => (p.scope === 'mine' && who ? who.user : p.user);
    main.innerHTML = `<h1>Jobs <span id="sim-label"></span></h1><div class="toolbar" id="jobs-filters">
      ${who && !who.open ? `<label>show <select data-f="scope" id="jobs-scope"><option value="mine"${p.scope === 'mine' ? ' selected' : ''}>my jobs (${esc(who.user)})</option>
        <option value="all"${p.scope === 'all' ? ' selected' : ''}>everyone's jobs</option></select></label>` : ''}
      <label>state <select data-f="state">${['', 'pending', 'running', 'completed', 'failed', 'cancelled', 'timeout', 'preempted', 'node_fail']
        .map((s) => `<option value="${s}"${s === p.state ? ' selected' : ''}>${s || 'all'}</option>`).join('')}</select></label>
      <label>user <input data-f="user" size="10" value="${esc(p.user)}"${p.scope === 'mine' ? ' disabled' : ''}></label>
      <label>account <input data-f="account" size="10" value="${esc(p.account)}"></label>
      <label>search <input type="search" id="jobs-search" data-f="q" size="18" placeholder="id, name, command, node" value="${esc(p.q)}"></label>
      <span class="muted" id="jobs-count"></span></div><div id="jobs-table"></div>
      <div class="toolbar"><button type="button" id="jobs-more" hidden>Load ${pageSize} more</button></div>`;
    let pages = 1;
    let list = [];
    let next = null;
    const matches = (j) => {
      if (!p.q) return true;
      const q = p.q.toLowerCase();
      return [String(j.id), j.request.name, j.request.user, j.request.account, (j.request.command || []).join(' '),
        j.state, ...(j.placement || []).map((x) => x.node)].some((x) => String(x || '').toLowerCase().includes(q));
    };
    const draw = () => {
      const key = JOB_SORT[p.sort] || JOB_SORT.job;
      const sign = p.dir === 'asc' ? 1 : -1;
      const shown = list.filter(matches).sort((a, b) => {
        const x = key(a), y = key(b);
        return (x < y ? -1 : x > y ? 1 : 0) * sign || (b.id - a.id);
      });
      const cols = jobCols.map((c) => Object.assign({}, c, JOB_SORT[c.title] ? { sort: c.title } : {}));
      document.getElementById('jobs-table').innerHTML = table(cols, shown, { id: 'jobs', empty: 'No jobs match.', sorted: [p.sort, p.dir] });
      document.getElementById('jobs-count').textContent = `${shown.length} shown of ${list.length} loaded${next ? ' (more on the server)' : ', all there are'}`;
      document.getElementById('jobs-more').hidden = !next;
    };
    const load = async () => {
      const base = { state: p.state, user: scopeUser(), account: p.account, limit: pageSize };
      let got = [], before = null;
      for (let i = 0; i < pages; i++) {
        const page = await api(`/v1/jobs${qs(Object.assign({ before }, base))}`);
        got = got.concat(page.jobs);
        before = page.next_before;
        if (before == null) break;
      }
      list = got;
      next = before;
      draw();
    };
    document.getElementById('jobs-filters').addEventListener('change', (e) => {
      if (!e.target.dataset.f || e.target.dataset.f === 'q') return;
      p[e.target.dataset.f] = e.target.value.trim();
      location.hash = `#/jobs${qs(p)}`;
    });
    document.getElementById('jobs-search').addEventListener('input', (e) => {
      p.q = e.target.value.trim();
      setParams(p);
      draw();
    });
    document.getElementById('jobs-table').addEventListener('click', (e) => {
      const th = e.target.closest('th[data-sort]');
      if (!th) return;
      const k = th.dataset.sort;
      p.dir = p.sort === k && p.dir === 'desc' ? 'asc' : 'desc';
      p.sort = k;
      setParams(p);
      draw();
    });
    document.getElementById('jobs-table').addEventListener('keydown', (e) => {
      if ((e.key === 'Enter' || e.key === ' ') && e.target.matches('th[data-sort]')) { e.preventDefault(); e.target.click(); }
    });
    document.getElementById('jobs-more').onclick = () => { pages++; load().catch(problem); };
    simLabel('these jobs ran on simulated GPUs: their use and energy are made up').catch(() => {});
    await v.every(10000, async () => {
      await load();
      v.ready();
    });
  }

  async function queueView(v) {
    main.innerHTML = `<h1>Queue <span id="sim-label"></span></h1><p class="muted">Pending jobs in the order the scheduler considers them, why each waits and when it should start.</p><div id="queue-table"></div>`;
    simLabel('the jobs run on simulated GPUs').catch(() => {});
    await v.every(10000, async () => {
      const r = await api('/v1/queue?start=true');
      const q = r.queue;
      document.getElementById('queue-table').innerHTML = table([
        { title: '#', num: true, text: (e) => q.indexOf(e) + 1 },
        { title: 'job', html: (e) => `<a href="#/jobs/${e.job.id}">${e.job.id}</a>` },
        { title: 'name', text: (e) => e.job.request.name || '' },
        { title: 'user', text: (e) => e.job.request.user },
        { title: 'account', text: (e) => e.job.request.account || e.job.request.user },
        { title: 'GPUs', num: true, text: (e) => gpusOf(e.job.request) },
        { title: 'waited', num: true, text: (e) => span((Date.now() - e.job.submit_ms) / 1000) },
        { title: 'estimated start', html: (e) => (e.estimated_start_ms
          ? `${esc(rel(e.estimated_start_ms))} <span class="muted">${esc(when(e.estimated_start_ms))}</span>` : 'unknown') },
        { title: 'why it waits', text: (e) => humanReason(e.job.reason) },
      ], q, { id: 'queue', empty: 'Nothing waits.' })
        + (r.total > q.length ? `<p class="muted">the first ${q.length} of ${r.total} pending jobs</p>` : '');
      v.ready();
    });
  }

  // The job's slow ranks (the job_stragglers view: the last minute, against the gang's
  // median), listed above its charts with the evidence; returns `node/gpu` → rank for the
  // charts' legends.
  async function slowRanks(id) {
    const box = document.getElementById('job-stragglers');
    const found = await rows(`SELECT rank, node_rank, node, gpu, metric, value, gang_median, ratio, throttle_reasons,
      temperature_celsius, simulated FROM job_stragglers WHERE job = ${Number(id)} ORDER BY rank, node, metric`);
    const byRank = new Map();
    for (const r of found) {
      const k = `${r.node}/${r.gpu ?? 'all'}`;
      if (!byRank.has(k)) byRank.set(k, []);
      byRank.get(k).push(r);
    }
    box.hidden = !found.length;
    box.innerHTML = found.length ? `<h2>Slow ranks <span class="muted">behind the gang's median for most of the last minute (${sqlLink(`SELECT * FROM job_stragglers WHERE job = ${Number(id)}`)})</span></h2>
      <div class="scroll"><table id="straggler-list"><thead><tr><th>rank</th><th>node</th><th>GPU</th><th>behind on</th><th>throttle reasons</th><th>temperature</th></tr></thead><tbody>
      ${[...byRank.values()].map((rs) => {
        const r = rs[0];
        return `<tr class="warn" data-rank="${esc(r.rank ?? '')}" data-node="${esc(r.node)}" data-gpu="${esc(r.gpu ?? '')}">
          <td>${r.rank == null ? `node ${esc(r.node_rank)}` : esc(r.rank)}</td><td><a href="#/nodes/${encodeURIComponent(r.node)}">${esc(r.node)}</a></td><td>${esc(r.gpu ?? 'all')}</td>
          <td>${rs.map((x) => `${esc(x.metric)} ${esc(num(x.value, 0))} vs ${esc(num(x.gang_median, 0))} (${esc(pct(100 * x.ratio))})`).join('<br>')}</td>
          <td>${esc(r.throttle_reasons || '–')}</td><td>${r.temperature_celsius == null ? '–' : `${esc(num(r.temperature_celsius, 0))} °C`}</td></tr>`;
      }).join('')}</tbody></table></div>` : '';
    return new Map([...byRank.values()].filter((rs) => rs[0].gpu != null).map((rs) => [`${rs[0].node}/${rs[0].gpu}`, rs[0].rank]));
  }

  // What a job ran (docs/provenance.md), for its owner and operators: the commit, branch and
  // whether it had uncommitted changes, the container image, and each attempt's node with its
  // driver and CUDA versions. Asked for again until every attempt's node has reported.
  async function jobProvenance(id, job, seen) {
    const box = document.getElementById('job-provenance');
    if (job.private) { box.hidden = true; return; }
    if (seen.done && seen.attempts === job.attempts) return;
    // A job with nothing recorded answers an empty record, so the page meets no error.
    const p = await api(`/v1/jobs/${id}/provenance`);
    const runs = (p && p.runs) || [];
    seen.attempts = job.attempts;
    seen.done = runs.length > 0 ? Math.max(...runs.map((r) => r.attempt)) >= job.attempts : job.attempts === 0;
    const s = p && p.submit;
    const g = s && s.git;
    const c = s && s.container;
    const row = (k, x) => `<dt>${k}</dt><dd>${x}</dd>`;
    box.hidden = false;
    box.innerHTML = `<h2>Provenance <span class="muted">what it ran (perch show ${esc(id)} --provenance; perch rerun ${esc(id)})</span></h2>
      <dl class="kv" id="prov-kv">${!s ? row('submitted from', '<span class="muted">not recorded</span>') : `
        ${row('submitted from', `<span class="mono">${esc(s.submit_dir || '–')}</span>${s.submit_host ? ` on ${esc(s.submit_host)}` : ''}`)}
        ${g ? `${row('commit', `<span class="mono" id="prov-commit">${esc(g.commit)}</span>`)}
          ${row('branch', esc(g.branch || '(detached HEAD)'))}
          ${row('uncommitted changes', `<span id="prov-dirty">${g.dirty ? `yes, ${esc(g.diff_bytes)} bytes${g.diff_truncated ? ' (cut: cannot be applied again)' : ''}` : 'none'}</span>${g.untracked.length ? `; ${esc(g.untracked.length)} untracked files (names only)` : ''}`)}`
          : row('git', `<span class="muted">${esc(s.git_note || 'none')}</span>`)}
        ${c ? row('container', `<span class="mono">${esc(c.image)}</span> (${esc(c.runtime)}) ${c.digest ? `<span class="mono">${esc(c.digest)}</span>` : `<span class="muted">no digest: ${esc(c.digest_note || 'unknown')}</span>`}`) : ''}
        ${s.python ? row('Python', `${esc(s.python.version || '–')}, ${esc(s.python.packages.split('\n').filter((l) => l.trim()).length)} packages`) : ''}
        ${s.rerun_of != null ? row('rerun of', `<a href="#/jobs/${esc(s.rerun_of)}">job ${esc(s.rerun_of)}</a>`) : ''}`}
        ${runs.map((r) => row(`attempt ${esc(r.attempt)} on ${esc(r.node)}`, `<span class="prov-run">driver ${esc(r.driver_version || '–')}, CUDA ${esc(r.cuda_version || '–')}${r.simulated ? ` ${badge('simulated')}` : ''}, ${esc(Object.keys(r.env).length)} variables</span>`)).join('')}
        ${!runs.length && job.attempts === 0 ? row('runs', '<span class="muted">none yet: its node reports when it starts</span>') : ''}</dl>`;
  }

  async function jobView(v, params, idText) {
    const id = Number(idText);
    const RANGES = [['', 'the whole run'], ['900', 'last 15 minutes'], ['3600', 'last hour'], ['21600', 'last 6 hours'], ['86400', 'last 24 hours']];
    let range = RANGES.some(([r]) => r === params.get('range')) ? params.get('range') : '';
    main.innerHTML = `<h1>Job ${id} <span id="job-title"></span> <span id="sim-label"></span></h1>
      <div class="jobhead" id="job-head"><span class="big" id="job-status"></span><span id="job-queue"></span>
        <a href="#/jobs/${id}" id="to-log">Output ↓</a><a href="#/jobs/${id}" id="to-charts">Charts ↓</a>
        <span class="toolbar" id="job-actions"></span></div>
      <div class="grid2"><dl class="kv" id="job-kv"></dl><dl class="kv" id="job-usage"></dl></div>
      <div id="job-stragglers" hidden></div>
      <div id="job-provenance" hidden></div>
      <h2 id="charts-title">GPUs <label class="muted">time range <select id="job-range">${RANGES.map(([r, t]) => `<option value="${r}"${r === range ? ' selected' : ''}>${t}</option>`).join('')}</select></label></h2>
      <p class="empty" id="charts-empty" hidden></p>
      <div class="grid2" id="job-charts">
        <div class="chart"><h3>utilization (%)</h3><div id="c-util"></div></div>
        <div class="chart"><h3>memory used (GiB)</h3><div id="c-mem"></div></div>
        <div class="chart"><h3>power (W)</h3><div id="c-power"></div></div>
        <div class="chart"><h3>the job's own metrics (OpenTelemetry)</h3><div id="c-otel"></div></div></div>
      <h2 id="output">Output <span class="muted" id="log-note"></span></h2><pre class="log" id="log"></pre>
      <h2>Timeline</h2><ul class="timeline" id="timeline"></ul>`;
    const charts = {};
    const log = { offset: 0, attempt: null, decoder: new TextDecoder(), done: false };
    const LOG_TAIL_BYTES = 1 << 20;
    let job = null;

    const followLog = async () => {
      if (!job || log.done || job.private || job.attempts === 0) return;
      let res;
      try {
        res = await call(`/v1/jobs/${id}/logs?offset=${log.offset}`);
      } catch (err) {
        document.getElementById('log-note').textContent = err.message;
        log.done = true;
        return;
      }
      const attempt = res.headers.get('x-perch-attempt');
      if (log.attempt !== null && attempt !== log.attempt) {
        document.getElementById('log').textContent += `\n--- attempt ${attempt} ---\n`;
        log.offset = 0;
        log.attempt = attempt;
        return followLog();
      }
      log.attempt = attempt;
      const size = Number(res.headers.get('x-perch-log-size') || 0);
      if (log.offset === 0 && size > LOG_TAIL_BYTES) {
        // A large log: show its tail (the whole of it: perch logs).
        document.getElementById('log').textContent = `… ${size - LOG_TAIL_BYTES} earlier bytes: perch logs ${id}\n`;
        log.offset = size - LOG_TAIL_BYTES;
        log.decoder = new TextDecoder();
        return followLog();
      }
      const bytes = new Uint8Array(await res.arrayBuffer());
      log.offset += bytes.length;
      const pre = document.getElementById('log');
      if (bytes.length) {
        const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
        let text = pre.textContent + log.decoder.decode(bytes, { stream: true });
        if (text.length > 200000) text = `…\n${text.slice(-150000)}`; // a tail, not the whole log
        pre.textContent = text;
        if (atEnd) pre.scrollTop = pre.scrollHeight;
      }
      const finished = res.headers.get('x-perch-job-finished') === 'true';
      const pending = Number(res.headers.get('x-perch-log-pending') || 0);
      document.getElementById('log-note').textContent = `attempt ${attempt || '–'}, ${
        finished && pending ? `finished, ${pending} bytes still to come from its node` : finished ? 'finished' : 'following'}`;
      if (res.headers.get('x-perch-log-more') === 'true') return followLog();
      if (finished && !bytes.length && !pending) log.done = true;
    };

    // Links within the page: the route stays the job's, the view scrolls.
    const jump = (link, target) => {
      document.getElementById(link).onclick = (e) => {
        e.preventDefault();
        document.getElementById(target).scrollIntoView({ block: 'start' });
      };
    };
    jump('to-log', 'output');
    jump('to-charts', 'charts-title');
    document.getElementById('job-range').onchange = (e) => {
      range = e.target.value;
      const q = new URLSearchParams((location.hash.split('?')[1]) || '');
      if (range) q.set('range', range); else q.delete('range');
      history.replaceState(null, '', `#/jobs/${id}${q.toString() ? `?${q}` : ''}`);
      drawCharts().catch(problem);
    };

    const drawCharts = async () => {
      const allocs = job.allocations || [];
      const empty = document.getElementById('charts-empty');
      document.getElementById('job-charts').hidden = !allocs.length;
      empty.hidden = !!allocs.length;
      if (!allocs.length) {
        empty.textContent = job.state === 'pending'
          ? 'No charts yet: the job has not started. Its GPUs are charted here once it runs.'
          : 'No charts: the job never held a GPU.';
        return;
      }
      const end = Math.max(...allocs.map((a) => a.end_ms || Date.now()));
      const start = Math.max(Math.min(...allocs.map((a) => a.start_ms)), range ? end - Number(range) * 1000 : 0);
      const bucket = Math.max(1, Math.round((end - start) / 1000 / 300));
      // The samples of the job's GPUs while it held them: a join on its allocations, one
      // statement however many it has (a term per allocation made thousands-deep statements).
      const data = await rows(`SELECT s.node, s.gpu, date_bin(INTERVAL '${bucket} seconds', s.time, TIMESTAMP '1970-01-01') AS t,
        avg(s.utilization_gpu_pct) AS u, max(s.memory_used_bytes) / 1073741824.0 AS m, avg(s.power_watts) AS p
        FROM gpu_samples s JOIN job_allocations a
          ON s.node = a.node AND s.gpu = a.gpu AND s.time >= a.start_time AND s.time <= coalesce(a.end_time, now())
        WHERE a.job = ${Number(id)} AND s.time >= to_timestamp_millis(${Math.floor(start)})
          AND s.time <= to_timestamp_millis(${Math.floor(end)}) GROUP BY 1, 2, 3 ORDER BY 3`);
      const slow = job.state === 'running' ? await slowRanks(id) : new Map();
      const key = (r) => `${r.node}/${r.gpu}${slow.has(`${r.node}/${r.gpu}`) ? ` ⚠ slow rank ${slow.get(`${r.node}/${r.gpu}`)}` : ''}`;
      charts.u = drawLines(v, charts.u, document.getElementById('c-util'), data, key, 'u', '%');
      charts.m = drawLines(v, charts.m, document.getElementById('c-mem'), data, key, 'm', '');
      charts.p = drawLines(v, charts.p, document.getElementById('c-power'), data, key, 'p', '');
      const metrics = await rows(`SELECT metric, date_bin(INTERVAL '${bucket} seconds', time, TIMESTAMP '1970-01-01') AS t,
        avg(value) AS x, bool_or(simulated) AS sim FROM job_metrics WHERE job = ${sqlStr(String(id))} GROUP BY 1, 2 ORDER BY 2`);
      // One chart per metric: a loss near 1 and a throughput near 1,000 share no axis.
      const names = [...new Set(metrics.map((r) => r.metric))].sort().slice(0, 8);
      const box = document.getElementById('c-otel');
      if (box.dataset.names !== names.join('\n')) {
        for (const c of Object.values(charts.o || {})) if (c) { c.destroy(); v.charts = v.charts.filter((x) => x !== c); }
        charts.o = {};
        box.dataset.names = names.join('\n');
        box.innerHTML = names.length
          ? names.map((n, i) => `<div class="metric"><h4>${esc(n)}${metrics.some((r) => r.metric === n && r.sim) ? ` ${badge('simulated')}` : ''}</h4><div id="otel-${i}"></div></div>`).join('')
          : '<p class="muted">The job pushed no metrics (an OpenTelemetry SDK in the job reports here with no setup).</p>';
      }
      names.forEach((n, i) => {
        charts.o[n] = drawLines(v, charts.o[n], document.getElementById(`otel-${i}`), metrics.filter((r) => r.metric === n), (r) => r.metric, 'x', '');
      });
    };

    const actions = () => {
      const el = document.getElementById('job-actions');
      const live = job.state === 'pending' || job.state === 'running';
      if (!live || !mayActOn(job.request.user)) { el.innerHTML = ''; return; }
      if (el.querySelector('#cancel')) return;
      el.innerHTML = '<button class="danger" id="cancel">Cancel job</button>';
      document.getElementById('cancel').onclick = (e) => {
        if (e.target.dataset.armed !== '1') {
          e.target.dataset.armed = '1';
          e.target.textContent = 'Really cancel? Click again';
          return;
        }
        post(`/v1/jobs/${id}/cancel`).then(() => { el.innerHTML = '<span class="muted">cancel sent</span>'; }, problem);
      };
    };

    // Where a pending job stands in line, from the queue's head (10,000 places at most).
    const queuePlace = async () => {
      const q = await api('/v1/queue?limit=10000');
      const e = q.queue.find((x) => x.job.id === id);
      if (!e) return q.total > q.queue.length ? `beyond place ${q.queue.length} of ${q.total} in the queue` : 'held: not in line yet';
      if (e.position == null) return 'held: waits for its dependencies, not in line yet';
      return `${e.position}${['th', 'st', 'nd', 'rd'][(e.position % 100 > 10 && e.position % 100 < 14) || e.position % 10 > 3 ? 0 : e.position % 10]} of ${q.total} in the queue${e.priority != null ? `, priority ${Number(e.priority).toFixed(3)}` : ''}`;
    };

    let chartTick = 0;
    let queueTick = 0;
    let place = '';
    const provenanceSeen = {};
    await v.every(3000, async () => {
      try {
        job = await api(`/v1/jobs/${id}`);
      } catch (err) {
        if (err.status !== 404) throw err;
        // An unknown job: said once, and not asked for again every 3 s.
        main.innerHTML = `<h1>No such job ${id}</h1><p id="no-such-job">perch has no job ${id}: ${esc(err.message)}.
          <a href="#/jobs">All jobs</a></p>`;
        v.ready();
        v.stop();
        return;
      }
      const r = job.request;
      if (job.state === 'pending') {
        if (queueTick++ % 3 === 0) place = await queuePlace();
      } else {
        place = '';
      }
      document.getElementById('job-status').innerHTML = `${badge(job.state)}${job.state === 'running' && job.start_ms ? ` for ${esc(span((Date.now() - job.start_ms) / 1000))}` : ''}${job.end_ms ? ` ${esc(rel(job.end_ms))}` : ''}${job.exit_code != null ? `, exit ${esc(job.exit_code)}` : ''}`;
      document.getElementById('job-queue').innerHTML = job.state === 'pending'
        ? `<span id="queue-place">${esc(place)}</span>${job.estimated_start_ms ? ` · starts <span id="job-eta" title="${esc(when(job.estimated_start_ms))}">${esc(rel(job.estimated_start_ms))}</span> <span class="muted">(${esc(when(job.estimated_start_ms))})</span>` : ' · start time not known yet'}${job.reason ? ` · <span class="muted">${esc(humanReason(job.reason))}</span>` : ''}`
        : '';
      // The MIG instance a running job holds: GET /v1/nodes names each instance's job.
      const mig = r.gpu_profile && job.state === 'running' && job.placement.length ? await migOf(job) : null;
      document.getElementById('job-title').innerHTML = `${esc(r.name || '')} ${badge(job.state)}${job.private ? ' <span class="muted">(not yours: command and environment hidden)</span>' : ''}`;
      document.getElementById('job-kv').innerHTML = `
        <dt>user / account</dt><dd>${esc(r.user)} / ${esc(r.account || r.user)}</dd>
        <dt>asked for</dt><dd>${askedFor(r)}${r.gpu_model ? ` of ${esc(r.gpu_model)}` : ''}, time limit ${span(r.time_limit_secs)}</dd>
        <dt>command</dt><dd class="mono">${esc((r.command || []).join(' '))}</dd>
        ${Object.keys(r.env || {}).length ? `<dt>environment</dt><dd class="mono">${Object.entries(r.env).map(([k, x]) => `${esc(k)}=${esc(x)}`).join('<br>')}</dd>` : ''}
        <dt>state</dt><dd>${badge(job.state)}${job.exit_code != null ? ` exit ${esc(job.exit_code)}` : ''}</dd>
        ${job.reason ? `<dt>reason</dt><dd>${esc(humanReason(job.reason))}</dd>` : ''}
        ${job.estimated_start_ms ? `<dt>estimated start</dt><dd>${esc(rel(job.estimated_start_ms))} (${when(job.estimated_start_ms)})</dd>` : ''}
        <dt>${job.state === 'pending' && job.placement.length ? 'last run on' : 'placement'}</dt><dd>${job.placement.map((p) => `<a href="#/nodes/${encodeURIComponent(p.node)}">${esc(p.node)}</a> GPUs ${esc(p.gpus.join(', '))}`).join('<br>') || '–'}</dd>
        ${mig ? `<dt>MIG instance</dt><dd><span class="mono" id="job-mig-uuid">${esc(mig.uuid)}</span> (${esc(mig.profile)}, GPU ${esc(mig.gpu)})</dd>` : ''}
        <dt>submitted</dt><dd>${when(job.submit_ms)}</dd><dt>started</dt><dd>${when(job.start_ms)}</dd><dt>ended</dt><dd>${when(job.end_ms)}</dd>
        <dt>attempts</dt><dd>${job.attempts} (preempted ${job.preemptions}, requeued ${job.requeues})</dd>`;
      const u = job.usage;
      // Two windows, each named: allocation runs to now; what telemetry says (use, efficiency,
      // idle cost, energy) counts up to accounted_until, against the GPU-hours allocated up to
      // the same moment.
      const until = u && u.accounted_until ? Date.parse(u.accounted_until) : null;
      const eff = u && (u.efficiency != null ? u.efficiency * 100 : u.utilization_mean_pct);
      document.getElementById('job-usage').innerHTML = u ? `
        <dt>GPU-hours allocated (to now)</dt><dd id="u-alloc">${hours(u.gpu_seconds_allocated)}</dd>
        <dt>cost allocated (to now)</dt><dd>${money(u.cost_allocated)}</dd>
        <dt>from telemetry</dt><dd id="u-until">${until ? `accounted until ${esc(clockOrDay(until))}${job.state === 'running' ? ` (${esc(rel(until))}: telemetry is folded every few minutes)` : ''}` : '<span class="muted">nothing folded yet</span>'}</dd>
        <dt>GPU-hours accounted</dt><dd id="u-accounted">${hours(u.gpu_seconds_accounted)}</dd>
        <dt>GPU-hours used</dt><dd id="u-used">${hours(u.gpu_seconds_used)}</dd>
        <dt>efficiency</dt><dd id="u-eff">${pct(eff)}</dd>
        <dt>cost accounted / used / idle</dt><dd id="u-cost">${money(u.cost_accounted)} / ${money(u.cost_used)} / ${money(u.idle_cost)}</dd>
        <dt>energy</dt><dd>${u.energy_joules == null ? '–' : `${(u.energy_joules / 3.6e6).toFixed(3)} kWh`}</dd>
        ${u.note ? `<dt></dt><dd class="muted">${esc(u.note)}</dd>` : ''}
        ${(job.gpus_now || []).map((g) => `<dt>${esc(g.node)} GPU ${esc(g.gpu)} now</dt><dd>${pct(g.utilization_gpu_pct)}, ${gib(g.memory_used_bytes)}, ${num(g.power_watts, 0)} W${g.simulated ? ` ${badge('simulated')}` : ''}</dd>`).join('')}`
        : '<dt>usage</dt><dd class="muted">none yet: the job has not run</dd>';
      document.getElementById('timeline').innerHTML = job.timeline.map((e) => `<li><time>${esc(when(e.time_ms))}</time>${esc(e.event)}</li>`).join('');
      actions();
      if (job.private) document.getElementById('log-note').textContent = 'only its owner and operators read its output';
      await followLog();
      await jobProvenance(id, job, provenanceSeen);
      if (chartTick++ % 5 === 0 || job.state !== 'running') await drawCharts();
      if (chartTick === 1) simLabel('its GPUs are simulated: their figures are made up').catch(() => {});
      v.ready();
    });
  }

  // --- occupancy over time ---------------------------------------------------------------
  async function occupancyView(v, params) {
    const p = { hours: params.get('hours') || '1', rack: params.get('rack') || '', node: params.get('node') || '' };
    const MAX_ROWS = 256, ROW = 12, LEFT = 130;
    main.innerHTML = `<h1>Occupancy</h1><div class="toolbar" id="occ-filters">
      <label>window <select data-f="hours">${[['0.25', 'last 15 minutes'], ['1', 'last hour'], ['6', '6 hours'], ['24', '24 hours'], ['168', '7 days']]
        .map(([h, t]) => `<option value="${h}"${h === p.hours ? ' selected' : ''}>${t}</option>`).join('')}</select></label>
      <label>rack <input data-f="rack" size="10" value="${esc(p.rack)}"></label>
      <label>node <input data-f="node" size="14" placeholder="name contains" value="${esc(p.node)}"></label>
      <span class="muted" id="occ-note"></span></div>
      <p class="muted">One row per GPU; a coloured band per job (one colour per job), its height the GPU's measured utilization in each bucket. Grey: no job. Click a band to open its job.</p>
      <div class="occupancy"><canvas id="occ"></canvas></div>
      <details><summary>Allocations in this window (<span id="occ-count">0</span>)</summary><div id="occ-list"></div></details>`;
    document.getElementById('occ-filters').addEventListener('change', (e) => {
      p[e.target.dataset.f] = e.target.value.trim();
      location.hash = `#/occupancy${qs(p)}`;
    });
    const tip = document.createElement('div');
    tip.className = 'tip';
    tip.hidden = true;
    document.body.appendChild(tip);
    v.charts.push({ destroy: () => tip.remove() });
    const canvas = document.getElementById('occ');
    let layout = null;

    const hitTest = (e) => {
      if (!layout) return null;
      const r = canvas.getBoundingClientRect();
      const x = e.clientX - r.left, y = e.clientY - r.top;
      const row = Math.floor(y / ROW);
      if (row < 0 || row >= layout.gpus.length || x < LEFT) return null;
      const t = layout.t0 + ((x - LEFT) / (layout.width - LEFT)) * (layout.t1 - layout.t0);
      const [node, gpu] = layout.gpus[row];
      const a = layout.allocs.find((b) => b.node === node && b.gpu === gpu && b.s <= t && t <= b.e);
      return { node, gpu, t, a };
    };
    canvas.onmousemove = (e) => {
      const h = hitTest(e);
      if (!h) { tip.hidden = true; return; }
      tip.hidden = false;
      tip.style.left = `${e.clientX + 12}px`;
      tip.style.top = `${e.clientY + 12}px`;
      tip.textContent = `${h.node} GPU ${h.gpu}, ${when(h.t)}\n${h.a ? `job ${h.a.job} (${h.a.user})` : 'no job'}`;
    };
    canvas.onmouseleave = () => { tip.hidden = true; };
    canvas.onclick = (e) => {
      const h = hitTest(e);
      if (h && h.a) location.hash = `#/jobs/${h.a.job}`;
    };

    await v.every(30000, async () => {
      const hoursN = Math.max(0.25, Number(p.hours) || 1);
      const t1 = Date.now(), t0 = t1 - hoursN * 3600e3;
      const nodes = (await api('/v1/nodes')).nodes.filter((n) => (!p.rack || n.rack === p.rack) && (!p.node || n.name.includes(p.node)));
      let gpus = [];
      for (const n of nodes) for (const g of n.gpu_status) gpus.push([n.name, g.index]);
      const total = gpus.length;
      gpus = gpus.slice(0, MAX_ROWS);
      const shownNodes = [...new Set(gpus.map((g) => g[0]))];
      document.getElementById('occ-note').textContent = total > MAX_ROWS
        ? `showing ${MAX_ROWS} of ${total} GPUs: filter by rack or node to see the others` : `${total} GPUs`;
      const inNodes = shownNodes.length ? `node IN (${shownNodes.map(sqlStr).join(',')})` : 'false';
      const buckets = 240;
      const bucket = Math.max(1, Math.round((t1 - t0) / 1000 / buckets));
      const long = hoursN > 6;
      const utilSql = long
        ? `SELECT node, gpu, date_bin(INTERVAL '${bucket} seconds', time, TIMESTAMP '1970-01-01') AS t,
             sum(utilization_gpu_pct_sum) / sum(utilization_gpu_pct_count) AS u FROM gpu_samples_1m
             WHERE ${inNodes} AND time >= to_timestamp_millis(${t0}) GROUP BY 1, 2, 3`
        : `SELECT node, gpu, date_bin(INTERVAL '${bucket} seconds', time, TIMESTAMP '1970-01-01') AS t,
             avg(utilization_gpu_pct) AS u FROM gpu_samples WHERE ${inNodes} AND time >= to_timestamp_millis(${t0}) GROUP BY 1, 2, 3`;
      const allocSql = `SELECT job, attempt, user_name, account, node, gpu, start_time, end_time FROM job_allocations
        WHERE ${inNodes} AND start_time < to_timestamp_millis(${t1}) AND (end_time IS NULL OR end_time > to_timestamp_millis(${t0}))
        ORDER BY start_time`;
      const [util, allocRows] = await Promise.all([rows(utilSql), rows(allocSql)]);
      const allocs = allocRows.map((a) => ({ job: a.job, user: a.user_name, account: a.account, node: a.node, gpu: a.gpu,
        s: Date.parse(a.start_time), e: a.end_time ? Date.parse(a.end_time) : t1, attempt: a.attempt }));
      const width = Math.max(600, canvas.parentElement.clientWidth);
      const dpr = window.devicePixelRatio || 1;
      canvas.width = width * dpr;
      canvas.height = Math.max(1, gpus.length) * ROW * dpr;
      canvas.style.width = `${width}px`;
      canvas.style.height = `${Math.max(1, gpus.length) * ROW}px`;
      const ctx = canvas.getContext('2d');
      ctx.scale(dpr, dpr);
      ctx.clearRect(0, 0, width, gpus.length * ROW);
      const xOf = (t) => LEFT + ((t - t0) / (t1 - t0)) * (width - LEFT);
      const rowOf = new Map(gpus.map(([n, g], i) => [`${n}/${g}`, i]));
      // Each GPU's allocations, so a bucket finds its job without a pass over all of them.
      const byGpu = new Map();
      for (const b of allocs) {
        const k = `${b.node}/${b.gpu}`;
        if (!byGpu.has(k)) byGpu.set(k, []);
        byGpu.get(k).push(b);
      }
      ctx.font = '10px system-ui, sans-serif';
      ctx.textBaseline = 'middle';
      const css = getComputedStyle(document.documentElement);
      const [panel, bg, muted] = ['--panel', '--bg', '--muted'].map((k) => css.getPropertyValue(k).trim());
      gpus.forEach(([n, g], i) => {
        ctx.fillStyle = i % 2 ? panel : bg;
        ctx.fillRect(0, i * ROW, width, ROW);
        ctx.fillStyle = muted;
        ctx.fillText(`${n} ${g}`, 2, i * ROW + ROW / 2);
      });
      // Measured utilization, grey where no job holds the GPU, the job's colour inside its band.
      const bw = Math.max(1, ((bucket * 1000) / (t1 - t0)) * (width - LEFT));
      for (const r of util) {
        const i = rowOf.get(`${r.node}/${r.gpu}`);
        if (i === undefined || r.u == null) continue;
        const t = Date.parse(r.t);
        const mid = t + bucket * 500;
        const a = (byGpu.get(`${r.node}/${r.gpu}`) || []).find((b) => b.s <= mid && mid <= b.e);
        const h = Math.max(1, (Math.min(100, r.u) / 100) * (ROW - 2));
        ctx.fillStyle = a ? jobColor(a.job, 0.95) : 'rgba(150,150,150,0.45)';
        ctx.fillRect(Math.max(LEFT, xOf(t)), i * ROW + ROW - 1 - h, bw, h);
      }
      for (const a of allocs) {
        const i = rowOf.get(`${a.node}/${a.gpu}`);
        if (i === undefined) continue;
        const x0 = Math.max(LEFT, xOf(a.s)), x1 = Math.min(width, xOf(a.e));
        ctx.fillStyle = jobColor(a.job, 0.18);
        ctx.fillRect(x0, i * ROW + 1, Math.max(1, x1 - x0), ROW - 2);
        ctx.strokeStyle = jobColor(a.job, 0.9);
        ctx.strokeRect(x0 + 0.5, i * ROW + 1.5, Math.max(1, x1 - x0 - 1), ROW - 3);
      }
      layout = { t0, t1, width, gpus, allocs, row: ROW, left: LEFT };
      canvas.__layout = layout; // for the browser tests: where each band is
      const byJob = new Map();
      for (const a of allocs) {
        const k = `${a.job}/${a.attempt}`;
        if (!byJob.has(k)) byJob.set(k, { job: a.job, attempt: a.attempt, user: a.user, account: a.account, s: a.s, e: a.e, gpus: [] });
        byJob.get(k).gpus.push(`${a.node}:${a.gpu}`);
      }
      document.getElementById('occ-count').textContent = byJob.size;
      document.getElementById('occ-list').innerHTML = table([
        { title: 'job', html: (b) => `<a href="#/jobs/${b.job}">${b.job}</a>` }, { title: 'attempt', key: 'attempt' },
        { title: 'user', key: 'user' }, { title: 'account', key: 'account' },
        { title: 'from', text: (b) => when(b.s) }, { title: 'to', text: (b) => (b.e >= t1 ? 'running' : when(b.e)) },
        { title: 'GPUs', text: (b) => b.gpus.join(' ') }], [...byJob.values()], { id: 'occ-allocs' });
      v.ready();
    });
  }

  // --- accounts and users ----------------------------------------------------------------
  async function accountsView(v, params) {
    const days = params.get('days') || '7';
    main.innerHTML = `<h1>Accounts and users <span id="sim-label"></span></h1><div class="toolbar" id="acc-filters">
      <label>period <select id="days">${[['1', 'last day'], ['7', 'last 7 days'], ['30', 'last 30 days'], ['all', 'all time']]
        .map(([d, t]) => `<option value="${d}"${d === days ? ' selected' : ''}>${t}</option>`).join('')}</select></label>
      <span id="acc-sql"></span></div>
      <p class="muted">A period counts the allocations that overlap it, whole. Allocated GPU-hours and their cost run to now;
        what comes from telemetry (GPU-hours used, efficiency, idle cost) is folded every few minutes and counts up to
        <b id="acc-until">–</b>, against the GPU-hours allocated up to the same moment (the "accounted" column), so each
        efficiency and idle cost is of one window.</p>
      <h2>Accounts, largest first</h2><div id="acc-totals"></div>
      <h2>GPU-hours allocated over time <span class="muted" id="acc-chart-note"></span></h2><div class="chart" id="acc-chart"></div>
      <h2>Accounts by user</h2><div id="acc-table"></div>`;
    document.getElementById('days').onchange = (e) => { location.hash = `#/accounts?days=${e.target.value}`; };
    const period = days === 'all' ? '' : `WHERE end_time IS NULL OR end_time >= now() - INTERVAL '${Number(days)} days'`;
    const sums = `count(DISTINCT job) AS jobs,
  sum(gpu_seconds_allocated) / 3600 AS gpu_hours_allocated, sum(gpu_seconds_accounted) / 3600 AS gpu_hours_accounted,
  sum(gpu_seconds_used) / 3600 AS gpu_hours_used,
  sum(gpu_seconds_used) / sum(gpu_seconds_accounted) AS efficiency,
  sum(cost_allocated) AS cost_allocated, sum(cost_accounted) AS cost_accounted, sum(cost_used) AS cost_used,
  sum(idle_cost) AS idle_cost,
  min(accounted_until) FILTER (WHERE end_time IS NULL OR accounted_until < end_time) AS accounted_until`;
    const query = `SELECT account, user_name, ${sums}
FROM job_allocations ${period}
GROUP BY account, user_name ORDER BY gpu_hours_allocated DESC, account, user_name`;
    const totalsQuery = `SELECT account, count(DISTINCT user_name) AS users, ${sums}
FROM job_allocations ${period}
GROUP BY account ORDER BY gpu_hours_allocated DESC, account`;
    document.getElementById('acc-sql').innerHTML = sqlLink(query);
    const chartQuery = `SELECT account, job, attempt, min(start_time) AS s, max(coalesce(end_time, now())) AS e, count(*) AS gpus
FROM job_allocations ${period} GROUP BY account, job, attempt LIMIT 20000`;
    const windowCols = [
      { title: 'GPU-hours accounted', num: true, text: (r) => num(r.gpu_hours_accounted, 2) },
      { title: 'GPU-hours used', num: true, text: (r) => num(r.gpu_hours_used, 2) },
      { title: 'efficiency', num: true, text: (r) => (r.efficiency == null ? '–' : pct(r.efficiency * 100)) },
      { title: 'cost accounted', num: true, text: (r) => money(r.cost_accounted) },
      { title: 'cost used', num: true, text: (r) => money(r.cost_used) },
      { title: 'idle cost', num: true, text: (r) => money(r.idle_cost) },
      { title: 'accounted until', text: (r) => (r.accounted_until ? clockOrDay(Date.parse(r.accounted_until)) : 'complete') },
    ];
    let chart = null;
    simLabel('accounts of jobs on simulated GPUs: use and energy are made up').catch(() => {});
    await v.every(60000, async () => {
      const [data, totals, allocs] = await Promise.all([rows(query), rows(totalsQuery), rows(chartQuery)]);
      const all = totals.reduce((x, r) => x + (r.gpu_hours_allocated || 0), 0);
      const until = totals.map((r) => r.accounted_until).filter(Boolean).map(Date.parse);
      document.getElementById('acc-until').textContent = until.length
        ? `${when(Math.min(...until))} (${rel(Math.min(...until))})` : 'the end of every allocation (nothing lags)';
      document.getElementById('acc-totals').innerHTML = table([
        { title: '#', num: true, text: (r) => totals.indexOf(r) + 1 },
        { title: 'account', key: 'account' }, { title: 'users', num: true, key: 'users' }, { title: 'jobs', num: true, key: 'jobs' },
        { title: 'GPU-hours allocated (to now)', num: true, text: (r) => num(r.gpu_hours_allocated, 2) },
        { title: 'share', html: (r) => `<span class="share"><span style="width:${all ? Math.round((100 * r.gpu_hours_allocated) / all) : 0}%"></span></span> ${all ? pct((100 * r.gpu_hours_allocated) / all) : '–'}` },
        { title: 'cost allocated (to now)', num: true, text: (r) => money(r.cost_allocated) },
        ...windowCols,
      ], totals, { id: 'account-totals', empty: 'No allocations in this period.' });
      // Users under their account, accounts in the order of their totals.
      const rank = new Map(totals.map((r, i) => [r.account, i]));
      data.sort((a, b) => (rank.get(a.account) ?? 1e9) - (rank.get(b.account) ?? 1e9) || b.gpu_hours_allocated - a.gpu_hours_allocated);
      document.getElementById('acc-table').innerHTML = table([
        { title: 'account', key: 'account' }, { title: 'user', key: 'user_name' }, { title: 'jobs', num: true, key: 'jobs' },
        { title: 'GPU-hours allocated (to now)', num: true, text: (r) => num(r.gpu_hours_allocated, 2) },
        { title: 'cost allocated (to now)', num: true, text: (r) => money(r.cost_allocated) },
        ...windowCols,
      ], data, { id: 'accounts', empty: 'No allocations in this period.' });
      // GPU-hours allocated per bucket and account: each allocation's GPUs × its time in it.
      const byKey = new Map();
      const t1 = Date.now();
      const t0 = days === 'all' ? Math.min(t1 - 3600e3, ...allocs.map((a) => Date.parse(a.s))) : t1 - Number(days) * 86400e3;
      // The chart's buckets: an hour up to two days, six hours up to two weeks, a day beyond.
      const bucketS = t1 - t0 <= 2 * 86400e3 ? 3600 : t1 - t0 <= 14 * 86400e3 ? 6 * 3600 : 86400;
      const first = Math.floor(t0 / 1000 / bucketS) * bucketS;
      for (const a of allocs) {
        const s = Math.max(Date.parse(a.s) / 1000, t0 / 1000), e = Math.min(Date.parse(a.e) / 1000, t1 / 1000);
        for (let b = Math.floor(s / bucketS) * bucketS; b < e; b += bucketS) {
          const secs = Math.min(e, b + bucketS) - Math.max(s, b);
          if (secs <= 0) continue;
          const k = `${a.account}\n${b}`;
          byKey.set(k, (byKey.get(k) || 0) + (secs * a.gpus) / 3600);
        }
      }
      const accounts = [...new Set(allocs.map((a) => a.account))];
      const series = [];
      for (let b = first; b < t1 / 1000; b += bucketS) {
        for (const acc of accounts) series.push({ t: new Date(b * 1000).toISOString(), k: acc, x: byKey.get(`${acc}\n${b}`) || 0 });
      }
      document.getElementById('acc-chart-note').textContent = `per ${bucketS === 3600 ? 'hour' : bucketS === 86400 ? 'day' : '6 hours'}, by account${allocs.length >= 20000 ? ' (the first 20,000 allocations)' : ''}`;
      chart = drawLines(v, chart, document.getElementById('acc-chart'), series, (r) => r.k, 'x', ' h',
        [first, Math.max(t1 / 1000, first + bucketS)]);
      v.ready();
    });
  }

  // --- alerts ----------------------------------------------------------------------------
  async function alertsView(v) {
    main.innerHTML = `<h1>Alerts</h1><div class="cards" id="breaker"></div>
      <h2>Alerts now</h2><div id="alerts-now"></div>
      <h2>Silences</h2><div id="silences"></div>
      <h2>Remediation and alert history</h2><div id="history"></div>
      <h2>Rules</h2><div id="rules"></div>`;
    await v.every(10000, async () => {
      const [a, s] = await Promise.all([api('/v1/alerts'), api('/v1/silences')]);
      const r = a.remediation;
      const b = r.circuit_breaker;
      document.getElementById('breaker').innerHTML = `<div class="card" id="breaker-state"><div class="v ${b ? 'bad' : 'ok'}">${b ? 'open' : 'closed'}</div>
        <div class="k">remediation circuit breaker${b ? `: since ${esc(when(b.opened_at_ms))}, ${esc(b.reason)}` : ''}</div>
        ${b && who && who.role === 'operator' ? '<button id="reset-breaker">Close it</button>' : ''}</div>
        <div class="card"><div class="v">${r.dry_run ? 'dry run' : 'acting'}</div><div class="k">remediation mode</div></div>
        <div class="card"><div class="v">${r.nodes_drained_by_perch.length}</div><div class="k">nodes drained by perch${r.nodes_drained_by_perch.length ? `: ${esc(r.nodes_drained_by_perch.join(', '))}` : ''}</div></div>`;
      const reset = document.getElementById('reset-breaker');
      if (reset) reset.onclick = () => post('/v1/alerts/breaker/reset').then(route, problem);
      const live = a.alerts.filter((x) => x.state === 'firing' || x.state === 'pending');
      const operator = who && who.role === 'operator';
      // Where an alert points: its node (and GPU), or its job.
      const where = (x) => {
        const l = x.labels;
        const out = [];
        if (l.node) out.push(`<a class="alert-node" href="#/nodes/${encodeURIComponent(l.node)}">${esc(l.node)}${l.gpu != null && l.gpu !== '' ? ` GPU ${esc(l.gpu)}` : ''}</a>`);
        if (l.job) out.push(`<a href="#/jobs/${encodeURIComponent(l.job)}">job ${esc(l.job)}</a>`);
        return out.join(' ') || '<span class="muted">cluster</span>';
      };
      const open = document.getElementById('silence-form');
      if (!open) {
        document.getElementById('alerts-now').innerHTML = table([
          { title: 'alert', text: (x) => x.labels.alertname || x.rule }, { title: 'state', html: (x) => badge(x.state, `${x.state} alert`) },
          { title: 'severity', html: (x) => badge(x.severity) }, { title: 'on', html: where },
          { title: 'summary', text: (x) => x.summary }, { title: 'labels', text: (x) => Object.entries(x.labels).map(([k, y]) => `${k}=${y}`).join(' ') },
          { title: 'since', text: (x) => `${rel(x.fired_at_ms || x.active_at_ms)} (${when(x.fired_at_ms || x.active_at_ms)})` },
          { title: 'muted', html: (x) => (x.muted_by ? esc(x.muted_by) : operator ? `<button type="button" class="silence" data-i="${live.indexOf(x)}">Silence…</button>` : '') },
        ], live, { id: 'alerts', empty: 'Nothing is firing.' });
        for (const b of document.querySelectorAll('#alerts button.silence')) {
          b.onclick = () => silenceForm(live[Number(b.dataset.i)]);
        }
      }
      document.getElementById('silences').innerHTML = table([
        { title: 'id', key: 'id' }, { title: 'matchers', text: (x) => JSON.stringify(x.matchers) }, { title: 'state', key: 'state' },
        { title: 'until', text: (x) => x.ends_at || when(x.ends_at_ms) }, { title: 'by', key: 'created_by' }, { title: 'comment', key: 'comment' },
      ], s.silences, { empty: 'No silences.' });
      document.getElementById('rules').innerHTML = table([
        { title: 'rule', key: 'name' }, { title: 'severity', html: (x) => badge(x.severity) },
        { title: 'firing', num: true, key: 'firing' }, { title: 'pending', num: true, key: 'pending' },
        { title: 'last evaluated', text: (x) => when(x.last_evaluation_ms) },
        { title: 'error', html: (x) => (x.last_error ? `<span class="bad">${esc(x.last_error)}</span>` : '') },
      ], a.rules);
      const history = await rows(`SELECT time, kind, actor, node, gpu, job, rule, action, outcome, dry_run, message FROM events
        WHERE kind IN ('alert_firing', 'alert_resolved', 'remediation', 'circuit_breaker_open') ORDER BY time DESC LIMIT 100`);
      document.getElementById('history').innerHTML = table([
        { title: 'time', text: (x) => when(Date.parse(x.time)) }, { title: 'kind', key: 'kind' }, { title: 'rule', key: 'rule' },
        { title: 'node', html: (x) => (x.node ? `<a href="#/nodes/${encodeURIComponent(x.node)}">${esc(x.node)}</a>` : '') },
        { title: 'action', key: 'action' }, { title: 'outcome', key: 'outcome' }, { title: 'what', key: 'message' },
      ], history, { empty: 'No alert or remediation events yet.' });
      v.ready();
    });
  }

  // A silence for one alert: its name and where it is (node, GPU, job), for a while, with a
  // reason; confirmed in the form it opens below the alert.
  function silenceForm(alert) {
    const keep = ['alertname', 'node', 'gpu', 'job'];
    const labels = Object.assign({ alertname: alert.labels.alertname || alert.rule }, alert.labels);
    const matchers = keep.filter((k) => labels[k] != null && labels[k] !== '').map((k) => `${k}=${JSON.stringify(String(labels[k]))}`);
    const box = document.createElement('form');
    box.className = 'inline-form';
    box.id = 'silence-form';
    box.innerHTML = `<span>Silence <code>${esc(matchers.join(', '))}</code> for</span>
      <select id="silence-for">${['1h', '4h', '24h', '7d'].map((d) => `<option>${d}</option>`).join('')}</select>
      <input type="text" id="silence-comment" required maxlength="200" placeholder="why (shown to everyone)">
      <button type="submit" id="silence-confirm">Silence</button><button type="button" id="silence-cancel">Cancel</button>`;
    document.getElementById('alerts-now').after(box);
    document.getElementById('silence-comment').focus();
    document.getElementById('silence-cancel').onclick = () => { box.remove(); route(); };
    box.onsubmit = (e) => {
      e.preventDefault();
      const comment = document.getElementById('silence-comment').value.trim();
      if (!comment) return;
      post('/v1/silences', { matchers, duration: document.getElementById('silence-for').value, comment })
        .then(() => { box.remove(); route(); }, problem);
    };
  }

  // --- SQL console -----------------------------------------------------------------------
  const SQL_EXAMPLE = 'SELECT node, gpu, avg(utilization_gpu_pct) AS util\nFROM gpu_samples\nWHERE time > now() - INTERVAL \'15 minutes\'\nGROUP BY node, gpu\nORDER BY util DESC\nLIMIT 20';
  async function sqlView(v, params) {
    main.innerHTML = `<h1>SQL</h1><p class="muted">Read-only SQL over telemetry and accounting (<code>SHOW TABLES</code> lists the tables).
      Ctrl+Enter runs it.</p>
      <textarea class="sql" id="sql" spellcheck="false"></textarea>
      <div class="toolbar"><button id="run">Run</button><button id="csv">Download CSV</button><span class="muted" id="sql-note"></span></div>
      <div id="sql-result"></div>`;
    const box = document.getElementById('sql');
    box.value = params.get('q') || SQL_EXAMPLE;
    const note = document.getElementById('sql-note');
    const run = async () => {
      setParams({ q: box.value });
      note.textContent = 'running…';
      const t0 = performance.now();
      try {
        const res = await (await sql(box.value)).json();
        const shown = res.rows.slice(0, 2000);
        // The server cuts a result at its max_rows, the CSV too (same limit); the page shows
        // at most 2,000 of the rows it got.
        const cut = res.truncated
          ? `; cut at the server's limit of ${res.row_count} rows, and the CSV is cut there too: add a LIMIT, aggregate or narrow the time range for the rest`
          : '';
        const more = shown.length < res.rows.length ? `; the first ${shown.length} shown, the CSV has all ${res.rows.length}` : '';
        note.textContent = `${res.row_count} rows in ${Math.round(performance.now() - t0)} ms${more}${cut}`;
        note.dataset.truncated = res.truncated ? '1' : '';
        // Floats rounded for reading (the full value on hover and in the CSV).
        const cell = (x, float) => {
          if (x === null) return 'NULL';
          if (typeof x === 'object') return esc(JSON.stringify(x));
          if (float && typeof x === 'number' && !Number.isInteger(x)) {
            const a = Math.abs(x);
            const shown = a >= 1000 ? x.toFixed(1) : a >= 1 ? x.toFixed(3) : Number(x.toPrecision(4)).toString();
            return `<span title="${esc(String(x))}">${esc(shown)}</span>`;
          }
          return esc(x);
        };
        document.getElementById('sql-result').innerHTML = table(res.columns.map((c) => ({
          title: c.name, key: c.name, num: /Int|Float|Decimal/.test(c.type),
          html: (r) => cell(r[c.name], /Float|Decimal/.test(c.type)),
        })), shown, { id: 'sql-rows', empty: 'No rows.' });
      } catch (err) {
        note.textContent = '';
        document.getElementById('sql-result').innerHTML = `<p class="bad" id="sql-error">${esc(err.message)}</p>`;
      }
      v.ready();
    };
    document.getElementById('run').onclick = run;
    box.onkeydown = (e) => { if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) run(); };
    document.getElementById('csv').onclick = async () => {
      try {
        const blob = await (await sql(box.value, 'csv')).blob();
        const a = document.createElement('a');
        a.href = URL.createObjectURL(blob);
        a.download = 'perch-query.csv';
        document.body.appendChild(a);
        a.click();
        a.remove();
        setTimeout(() => URL.revokeObjectURL(a.href), 10000);
      } catch (err) {
        problem(err);
      }
    };
    if (params.get('q')) await run(); else v.ready();
  }

  // --- what every view needs: the firing count in the navigation, whether GPUs are simulated
  // One poll for the whole page, whatever view is open; it also keeps "updated N s ago" true
  // on a view that polls rarely.
  let heartbeatStarted = false;
  function heartbeat() {
    if (heartbeatStarted) return;
    heartbeatStarted = true;
    const beat = async () => {
      try {
        const a = await api('/v1/alerts');
        const firing = a.alerts.filter((x) => x.state === 'firing' && !x.muted_by).length;
        const el = document.getElementById('nav-firing');
        el.hidden = firing === 0;
        el.textContent = String(firing);
        el.title = `${firing} alert(s) firing`;
        el.setAttribute('aria-label', `${firing} firing`);
      } catch (_) { /* the views report problems; liveness is already marked */ }
      setTimeout(beat, document.hidden ? 40000 : 10000);
    };
    beat();
  }

  // --- start -----------------------------------------------------------------------------
  async function start() {
    try {
      who = await api('/v1/whoami', { noSignIn: true });
    } catch (err) {
      if (err.status === 401) {
        sessionStorage.removeItem(TOKEN_KEY);
        afterSignIn = location.hash || '#/fleet';
        if (!location.hash.startsWith('#/signin')) { location.hash = '#/signin'; return; }
      } else {
        problem(err);
      }
    }
    showWho();
    if (who) heartbeat();
    route();
  }
  window.addEventListener('hashchange', () => {
    if (!who && !location.hash.startsWith('#/signin')) { start(); return; }
    route();
  });
  start();
})();
