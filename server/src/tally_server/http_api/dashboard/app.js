/* Tally dashboard: a dependency-free single-page app served by the coordinator (air-gapped clusters).
 *
 * Pages (hash routing, checkpoint names contain "/"):
 *   #/                      every checkpoint as a card
 *   #/checkpoint/<name>     one checkpoint: tiles, progress plot (inline SVG), writers, event log
 *
 * Every 2 s the current page's data is fetched from the /v1 JSON API and the view is rebuilt as a detached
 * DOM tree, then morphed into the page (unchanged nodes, focus and scroll stay put). All text goes in
 * through text nodes, never innerHTML.
 */
"use strict";

(() => {
  const POLL_MS = 2000;
  const FETCH_TIMEOUT_MS = 10000;
  const EVENTS_PAGE = 50;
  const WRITERS_LIMIT = 100;
  const STALE_HEARTBEAT_S = 30;
  const RANGES = [
    ["15m", 900],
    ["1h", 3600],
    ["6h", 21600],
    ["24h", 86400],
    ["7d", 604800],
    ["all", 0],
  ];
  const MAX_SAMPLES = 200000;

  // ------------------------------------------------------------------ DOM building

  function add(el, kids) {
    for (const kid of kids) {
      if (kid === null || kid === undefined || kid === false || kid === true) continue;
      if (Array.isArray(kid)) add(el, kid);
      else el.appendChild(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return el;
  }

  function setAttrs(el, attrs) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      el.setAttribute(k, v === true ? "" : String(v));
    }
  }

  /** h("div", {class: "x"}, child, [children], "text") */
  function h(tag, attrs, ...kids) {
    const el = document.createElement(tag);
    setAttrs(el, attrs);
    return add(el, kids);
  }

  const SVG_NS = "http://www.w3.org/2000/svg";
  function s(tag, attrs, ...kids) {
    const el = document.createElementNS(SVG_NS, tag);
    setAttrs(el, attrs);
    return add(el, kids);
  }

  // ------------------------------------------------------------------ morph (keyed by data-key)

  function keyOf(node) {
    return node.nodeType === 1 ? node.getAttribute("data-key") : null;
  }

  function patch(old, fresh) {
    if (old.nodeType !== 1) {
      if (old.nodeValue !== fresh.nodeValue) old.nodeValue = fresh.nodeValue;
      return;
    }
    for (const { name } of Array.from(old.attributes)) {
      if (!fresh.hasAttribute(name)) old.removeAttribute(name);
    }
    for (const { name, value } of Array.from(fresh.attributes)) {
      if (old.getAttribute(name) !== value) old.setAttribute(name, value);
    }
    if (old.tagName === "INPUT") {
      if (old.type === "checkbox") old.checked = fresh.hasAttribute("checked");
      else if (fresh.hasAttribute("value") && document.activeElement !== old && old.value !== fresh.getAttribute("value")) {
        old.value = fresh.getAttribute("value");
      }
    }
    if (old.tagName === "BUTTON") old.disabled = fresh.hasAttribute("disabled");
    morphChildren(old, fresh);
  }

  function morphChildren(parent, freshParent) {
    const fresh = Array.from(freshParent.childNodes);
    const keyed = new Map();
    for (const child of parent.childNodes) {
      const key = keyOf(child);
      if (key !== null) keyed.set(key, child);
    }
    const used = new Set();
    let i = 0;
    for (const node of fresh) {
      const current = parent.childNodes[i] || null;
      const key = keyOf(node);
      if (key !== null) {
        const match = keyed.get(key);
        if (match && !used.has(match) && match.nodeName === node.nodeName) {
          used.add(match);
          if (match !== current) parent.insertBefore(match, current);
          patch(match, node);
        } else {
          parent.insertBefore(node, current);
        }
      } else if (!current) {
        parent.appendChild(node);
      } else if (current.nodeType === node.nodeType && current.nodeName === node.nodeName && keyOf(current) === null) {
        patch(current, node);
      } else {
        parent.insertBefore(node, current);
      }
      i++;
    }
    while (parent.childNodes.length > i) parent.removeChild(parent.lastChild);
  }

  // ------------------------------------------------------------------ formatting

  let skew = 0; // server clock minus browser clock, seconds (from the Date header)
  const serverNow = () => Date.now() / 1000 + skew;

  const fmtInt = (n) => (Number.isFinite(n) ? Math.round(n).toLocaleString("en-US") : "—");

  function fmtCompact(v) {
    const a = Math.abs(v);
    const strip = (x) => x.replace(/\.0$/, "");
    if (a >= 1e9) return strip((v / 1e9).toFixed(1)) + "G";
    if (a >= 1e6) return strip((v / 1e6).toFixed(a >= 1e7 ? 0 : 1)) + "M";
    if (a >= 1e4) return strip((v / 1e3).toFixed(a >= 1e5 ? 0 : 1)) + "k";
    if (Number.isInteger(v)) return v.toLocaleString("en-US");
    return strip(v.toFixed(a >= 10 ? 1 : 2));
  }

  function fmtDuration(sec) {
    sec = Math.max(0, sec);
    if (sec < 60) return `${Math.floor(sec)} s`;
    if (sec < 3600) return `${Math.floor(sec / 60)} min`;
    if (sec < 86400) {
      const m = Math.floor((sec % 3600) / 60);
      return `${Math.floor(sec / 3600)} h` + (m ? ` ${m} min` : "");
    }
    const hrs = Math.floor((sec % 86400) / 3600);
    return `${Math.floor(sec / 86400)} d` + (hrs ? ` ${hrs} h` : "");
  }

  function fmtAgo(t) {
    if (!t || t <= 0) return "never";
    const d = serverNow() - t;
    if (d < 1.5) return "just now";
    return fmtDuration(d) + " ago";
  }

  const pad = (n) => String(n).padStart(2, "0");
  const MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];

  function fmtClock(t, withSeconds = true) {
    const d = new Date(t * 1000);
    return `${pad(d.getHours())}:${pad(d.getMinutes())}` + (withSeconds ? `:${pad(d.getSeconds())}` : "");
  }

  function fmtDay(t) {
    const d = new Date(t * 1000);
    return `${MONTHS[d.getMonth()]} ${d.getDate()}`;
  }

  function fmtStamp(t) {
    if (!t || t <= 0) return "";
    const d = new Date(t * 1000);
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${fmtClock(t)}`;
  }

  function rateUnit(perSec) {
    if (perSec >= 1) return { mul: 1, label: "/s", long: "per second" };
    if (perSec * 60 >= 1) return { mul: 60, label: "/min", long: "per minute" };
    return { mul: 3600, label: "/h", long: "per hour" };
  }

  function fmtRateValue(v) {
    if (v === 0) return "0";
    if (v >= 100) return fmtInt(v);
    if (v >= 10) return v.toFixed(1).replace(/\.0$/, "");
    return v.toFixed(2).replace(/0$/, "").replace(/\.0$/, "");
  }

  function fmtRate(perSec) {
    if (!(perSec > 0)) return "0 /min";
    const u = rateUnit(perSec);
    return `${fmtRateValue(perSec * u.mul)} ${u.label}`;
  }

  const plural = (n, one, many) => `${fmtInt(n)} ${n === 1 ? one : many || one + "s"}`;

  // ------------------------------------------------------------------ API

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // A bearer token, when the server has authentication on (any role may read). Kept in this tab only.
  let token = "";
  try {
    token = sessionStorage.getItem("tally.token") || "";
  } catch (_) {
    token = "";
  }
  function setToken(value) {
    token = value;
    try {
      if (value) sessionStorage.setItem("tally.token", value);
      else sessionStorage.removeItem("tally.token");
    } catch (_) {
      /* storage disabled: keep it in memory */
    }
  }

  async function api(path) {
    const ctrl = new AbortController();
    const timer = setTimeout(() => ctrl.abort(), FETCH_TIMEOUT_MS);
    const headers = { Accept: "application/json" };
    if (token) headers.Authorization = "Bearer " + token;
    let response;
    try {
      response = await fetch(path, { headers, cache: "no-store", signal: ctrl.signal });
    } catch (err) {
      const why = err && err.name === "AbortError" ? `no answer within ${FETCH_TIMEOUT_MS / 1000} s` : "network error";
      throw new ApiError(0, `${why} (GET /${path})`);
    } finally {
      clearTimeout(timer);
    }
    const date = response.headers.get("date");
    if (date) {
      const offset = Date.parse(date) / 1000 - Date.now() / 1000;
      skew = Number.isFinite(offset) && Math.abs(offset) > 2 ? offset : 0;
    }
    let body = null;
    try {
      body = await response.json();
    } catch (_) {
      body = null;
    }
    if (!response.ok) {
      const detail = body && body.error && body.error.message ? body.error.message : response.statusText;
      throw new ApiError(response.status, `HTTP ${response.status}: ${detail}`);
    }
    return body;
  }

  /** Checkpoint names go into paths segment by segment, keeping their "/". */
  const namePath = (name) => name.split("/").map(encodeURIComponent).join("/");
  const q = encodeURIComponent;
  const checkpointHref = (name) => "#/checkpoint/" + namePath(name);

  // ------------------------------------------------------------------ state

  function stored(key, fallback) {
    try {
      const v = localStorage.getItem("tally." + key);
      return v === null ? fallback : JSON.parse(v);
    } catch (_) {
      return fallback;
    }
  }
  function store(key, value) {
    try {
      localStorage.setItem("tally." + key, JSON.stringify(value));
    } catch (_) {
      /* private mode: fine */
    }
  }

  const state = {
    route: { page: "list" },
    list: null, // [checkpoint]
    filter: "",
    cp: null, // the checkpoint on its page
    cpMissing: false,
    writers: null,
    writersNote: null,
    events: [],
    eventsNext: null, // before_id for "load older"; 0 = nothing older
    eventsNote: null,
    eventsLoading: false,
    eventsArrived: new Map(), // id -> ms when first seen after the first page (for the highlight)
    samples: [],
    samplesKey: "",
    provisional: null,
    progressNote: null,
    range: stored("range", "1h"),
    showClosed: stored("showClosed", true),
    hoverAt: null,
    chartWidth: 0,
    error: null,
    auth: null, // the 401/403 error while the server wants a (better) token
    lastOk: 0,
    loaded: false,
  };

  function resetCheckpointState() {
    Object.assign(state, {
      cp: null,
      cpMissing: false,
      writers: null,
      writersNote: null,
      events: [],
      eventsNext: null,
      eventsNote: null,
      eventsLoading: false,
      eventsArrived: new Map(),
      samples: [],
      samplesKey: "",
      provisional: null,
      progressNote: null,
      hoverAt: null,
      loaded: false,
    });
  }

  function parseRoute() {
    const raw = location.hash.replace(/^#\/?/, "");
    if (raw.startsWith("checkpoint/")) {
      try {
        const name = raw.slice("checkpoint/".length).split("/").map(decodeURIComponent).join("/");
        if (name) return { page: "checkpoint", name };
      } catch (_) {
        /* malformed escape: fall through to the list */
      }
    }
    return { page: "list" };
  }

  // ------------------------------------------------------------------ loading

  const rangeSeconds = () => (RANGES.find(([k]) => k === state.range) || RANGES[1])[1];
  const note = (what, err) =>
    err.status === 404 || err.status === 405
      ? `${what} is not available from this server (${err.message})`
      : `${what} could not be loaded: ${err.message}`;

  async function loadList() {
    const reply = await api("v1/checkpoints");
    return () => {
      state.list = Array.isArray(reply.checkpoints) ? reply.checkpoints : [];
      state.loaded = true;
    };
  }

  function mergeEvents(page) {
    const events = Array.isArray(page.events) ? page.events : [];
    if (state.eventsNext === null) {
      state.events = events.slice().sort((a, b) => b.id - a.id);
      state.eventsNext = page.next_before_id || 0;
      return;
    }
    const known = new Set(state.events.map((e) => e.id));
    const newest = state.events.length ? state.events[0].id : 0;
    const fresh = events.filter((e) => !known.has(e.id) && e.id > newest);
    if (!fresh.length) return;
    const now = Date.now();
    for (const e of fresh) state.eventsArrived.set(e.id, now);
    if (events.length >= EVENTS_PAGE && fresh.length === events.length) {
      // More arrived than one page holds: start over from this page rather than show a gap.
      state.events = events.slice().sort((a, b) => b.id - a.id);
      state.eventsNext = page.next_before_id || 0;
      return;
    }
    state.events = fresh.concat(state.events).sort((a, b) => b.id - a.id);
  }

  /** Persisted samples are cached and fetched incrementally; the server ends each reply with the live
   *  count "now", which is kept aside (provisional) rather than cached. */
  function mergeSamples(reply, key, windowStart) {
    const incoming = (Array.isArray(reply.samples) ? reply.samples : [])
      .filter((p) => Number.isFinite(p.at) && Number.isFinite(p.completed_count))
      .sort((a, b) => a.at - b.at);
    state.provisional = incoming.length ? incoming.pop() : null;
    let samples = state.samplesKey === key ? state.samples : [];
    const last = samples.length ? samples[samples.length - 1].at : -Infinity;
    samples = samples.concat(incoming.filter((p) => p.at > last));
    if (windowStart > 0) {
      const first = samples.findIndex((p) => p.at >= windowStart);
      samples = first < 0 ? [] : samples.slice(first);
    }
    if (samples.length > MAX_SAMPLES) samples = samples.slice(samples.length - MAX_SAMPLES);
    state.samples = samples;
    state.samplesKey = key;
  }

  async function loadCheckpoint(name) {
    const enc = q(name);
    const span = rangeSeconds();
    const key = `${name}\u0000${state.range}`;
    const windowStart = span ? serverNow() - span : 0;
    const cached = state.samplesKey === key && state.samples.length;
    const since = cached ? state.samples[state.samples.length - 1].at : Math.max(0, Math.floor(windowStart));
    const [cp, writers, events, progress] = await Promise.allSettled([
      api("v1/checkpoints/" + namePath(name)),
      api(`v1/writers?checkpoint=${enc}&include_closed=${state.showClosed}&limit=${WRITERS_LIMIT}`),
      api(`v1/events?checkpoint=${enc}&limit=${EVENTS_PAGE}`),
      api(`v1/progress?checkpoint=${enc}&since=${since}`),
    ]);
    if (cp.status === "rejected" && cp.reason.status !== 404) throw cp.reason;
    return () => {
      state.loaded = true;
      if (cp.status === "rejected") {
        state.cpMissing = true;
        state.cp = null;
        return;
      }
      state.cpMissing = false;
      state.cp = cp.value;
      if (writers.status === "fulfilled") {
        state.writers = Array.isArray(writers.value.writers) ? writers.value.writers : [];
        state.writersNote = null;
      } else {
        state.writers = null; // fall back to the live writers in the checkpoint status
        state.writersNote = note("The writer history", writers.reason);
      }
      if (events.status === "fulfilled") {
        mergeEvents(events.value);
        state.eventsNote = null;
      } else {
        state.eventsNote = note("The event log", events.reason);
      }
      if (progress.status === "fulfilled") {
        mergeSamples(progress.value, key, windowStart);
        state.progressNote = null;
      } else {
        state.progressNote = note("Progress history", progress.reason);
      }
    };
  }

  async function loadOlderEvents() {
    const route = state.route;
    if (route.page !== "checkpoint" || !state.eventsNext || state.eventsLoading) return;
    state.eventsLoading = true;
    render();
    try {
      const page = await api(`v1/events?checkpoint=${q(route.name)}&limit=${EVENTS_PAGE}&before_id=${state.eventsNext}`);
      if (state.route !== route) return;
      const known = new Set(state.events.map((e) => e.id));
      const older = (Array.isArray(page.events) ? page.events : []).filter((e) => !known.has(e.id));
      state.events = state.events.concat(older).sort((a, b) => b.id - a.id);
      state.eventsNext = page.next_before_id || 0;
      state.eventsNote = null;
    } catch (err) {
      state.eventsNote = note("Older events", err);
    } finally {
      state.eventsLoading = false;
      render();
    }
  }

  let timer = null;
  let generation = 0;

  async function refresh() {
    clearTimeout(timer);
    const gen = ++generation;
    const route = state.route;
    try {
      const apply = route.page === "checkpoint" ? await loadCheckpoint(route.name) : await loadList();
      if (gen !== generation) return;
      apply();
      state.error = null;
      state.auth = null;
      state.lastOk = Date.now();
    } catch (err) {
      if (gen !== generation) return;
      const error = err instanceof Error ? err : new Error(String(err));
      const denied = error.status === 401 || error.status === 403;
      state.auth = denied ? error : null;
      state.error = denied ? null : error;
    }
    render();
    timer = setTimeout(refresh, POLL_MS);
  }

  // ------------------------------------------------------------------ common view pieces

  function activityPill(cp) {
    return cp.live_writers > 0
      ? h("span", { class: "pill ok", "data-testid": "status" }, "running")
      : h("span", { class: "pill", "data-testid": "status" }, "idle");
  }

  const severity = (cp) => (cp.unreadable_files > 0 ? "bad" : cp.anomalies > 0 ? "warn" : "");

  const isLive = (w) => w.state === "open" || w.state === "live";

  function stateClass(st) {
    if (st === "open" || st === "live") return "ok";
    if (st === "closed") return "";
    return "warn"; // expired, lost, reset
  }

  // ------------------------------------------------------------------ list page

  function cardFact(value, label, level, testid) {
    return h(
      "div",
      { class: "fact" + (value > 0 && level ? " " + level : ""), "data-testid": testid },
      h("div", { class: "fv" }, fmtInt(value)),
      h("div", { class: "fl" }, label),
    );
  }

  function checkpointCard(cp) {
    return h(
      "a",
      {
        class: "card " + severity(cp),
        href: checkpointHref(cp.name),
        "data-key": "cp:" + cp.name,
        "data-testid": "checkpoint-card",
        "data-name": cp.name,
      },
      h("div", { class: "card-top" }, h("div", { class: "card-name", "data-testid": "name" }, cp.name), activityPill(cp)),
      h(
        "div",
        { class: "card-count" },
        h("span", { class: "num", "data-testid": "completed-count" }, fmtInt(cp.completed_count)),
        h("span", { class: "unit" }, "completed"),
      ),
      h(
        "div",
        { class: "card-facts" },
        cardFact(cp.pending_sources, "pending", "", "pending"),
        cardFact(cp.live_writers, "live writers", "", "live-writers"),
        cardFact(cp.anomalies, "anomalies", "warn", "anomalies"),
        cardFact(cp.unreadable_files, "unreadable", "bad", "unreadable"),
      ),
      h(
        "div",
        { class: "card-foot" },
        h("span", { title: fmtStamp(cp.last_activity_at) }, "last activity ", h("b", {}, fmtAgo(cp.last_activity_at))),
        h("span", { title: fmtStamp(cp.created_at) }, "created " + fmtAgo(cp.created_at)),
      ),
    );
  }

  function emptyState() {
    return h(
      "div",
      { class: "panel empty empty-big", "data-testid": "empty" },
      h("div", { class: "empty-title" }, "No checkpoints yet — start a writer"),
      h("div", {}, "A checkpoint appears here as soon as a pipeline opens a writer on it. This page refreshes by itself."),
      h(
        "pre",
        {},
        "import tally\n\n" +
          'with tally.Client() as client, client.writer("demo/run-1") as w:  # $TALLY_ADDRESS\n' +
          "    w.apply_deltas([...])\n" +
          "    w.flush()",
      ),
    );
  }

  function listView() {
    const all = (state.list || []).slice().sort((a, b) => a.name.localeCompare(b.name));
    document.title = "Tally · checkpoints";
    if (!state.loaded) return [h("div", { class: "empty" }, "Connecting to Tally…")];
    if (!all.length) return [emptyState()];
    const needle = state.filter.trim().toLowerCase();
    const shown = needle ? all.filter((cp) => cp.name.toLowerCase().includes(needle)) : all;
    const sum = (f) => all.reduce((acc, cp) => acc + (Number(cp[f]) || 0), 0);
    const running = all.filter((cp) => cp.live_writers > 0).length;
    const troubled = all.filter((cp) => severity(cp)).length;
    return [
      h(
        "div",
        { class: "page-head" },
        h(
          "div",
          {},
          h("h1", { class: "page-title" }, "Checkpoints"),
          h(
            "div",
            { class: "totals", "data-testid": "totals" },
            h("span", {}, h("b", {}, fmtInt(all.length)), all.length === 1 ? "checkpoint" : "checkpoints"),
            h("span", {}, h("b", {}, fmtInt(running)), "running"),
            h("span", {}, h("b", {}, fmtInt(sum("completed_count"))), "sources completed"),
            h("span", {}, h("b", {}, fmtInt(sum("live_writers"))), "live writers"),
            troubled ? h("span", { class: "pill warn" }, plural(troubled, "checkpoint") + " need attention") : null,
          ),
        ),
        all.length > 6
          ? h("input", {
              class: "btn",
              type: "search",
              placeholder: "Filter by name",
              "aria-label": "Filter checkpoints by name",
              "data-action": "filter",
              value: state.filter,
            })
          : null,
      ),
      shown.length
        ? h("div", { class: "cards", "data-testid": "checkpoint-list" }, shown.map(checkpointCard))
        : h("div", { class: "panel empty" }, `No checkpoint matches “${state.filter}”.`),
    ];
  }

  // ------------------------------------------------------------------ progress maths

  /** The count at time t. Samples are written when the count changed, so it is a step function: the
   *  value of the last sample at or before t. */
  function valueAt(pts, t) {
    if (t < pts[0].at) return pts[0].completed_count;
    let lo = 0;
    let hi = pts.length - 1;
    if (t >= pts[hi].at) return pts[hi].completed_count;
    while (hi - lo > 1) {
      const mid = (lo + hi) >> 1;
      if (pts[mid].at <= t) lo = mid;
      else hi = mid;
    }
    return pts[lo].completed_count;
  }

  /** Persisted samples in the window, then the server's live sample, then "now" from the status. */
  function progressPoints() {
    const pts = state.samples.slice();
    const prov = state.provisional;
    if (prov && (!pts.length || prov.at > pts[pts.length - 1].at)) pts.push({ ...prov, live: true });
    const cp = state.cp;
    const now = serverNow();
    if (cp && (!pts.length || now > pts[pts.length - 1].at + 0.5)) {
      pts.push({ at: now, completed_count: cp.completed_count, live: true });
    }
    return pts;
  }

  function currentRate(pts) {
    if (pts.length < 2) return null;
    const t1 = pts[pts.length - 1].at;
    const t0 = Math.max(pts[0].at, t1 - 60);
    if (t1 - t0 < 1) return null;
    return Math.max(0, (valueAt(pts, t1) - valueAt(pts, t0)) / (t1 - t0));
  }

  function niceTicks(lo, hi, count, integer) {
    if (!(hi > lo)) hi = lo + 1;
    const raw = (hi - lo) / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const norm = raw / mag;
    let step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
    if (integer) step = Math.max(1, Math.round(step));
    const start = Math.floor(lo / step) * step;
    const end = Math.ceil(hi / step) * step;
    const ticks = [];
    for (let v = start; v <= end + step / 2; v += step) ticks.push(Number(v.toFixed(10)));
    return { lo: start, hi: end, ticks };
  }

  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800];

  function timeTicks(t0, t1, maxTicks) {
    const span = t1 - t0;
    const step = TIME_STEPS.find((st) => span / st <= maxTicks) || 604800;
    const off = new Date(t0 * 1000).getTimezoneOffset() * 60; // align ticks to local wall time
    const ticks = [];
    for (let t = Math.ceil((t0 - off) / step) * step + off; t <= t1; t += step) ticks.push(t);
    let prevDay = null;
    return ticks.map((t) => {
      const day = fmtDay(t);
      let label;
      if (step >= 86400) label = day;
      else if (prevDay !== null && day !== prevDay) label = `${day} ${fmtClock(t, false)}`;
      else label = fmtClock(t, step < 60);
      prevDay = day;
      return { t, label };
    });
  }

  // ------------------------------------------------------------------ progress chart (inline SVG)

  function chartView() {
    const pts = progressPoints();
    const W = Math.max(280, state.chartWidth || 900);
    const ml = 56;
    const mr = 18;
    const top1 = 22;
    const h1 = 170;
    const top2 = top1 + h1 + 44;
    const h2 = 74;
    const H = top2 + h2 + 24;
    const pw = W - ml - mr;

    if (pts.length < 2) {
      return h(
        "div",
        { class: "empty", "data-testid": "chart-empty" },
        "No progress samples yet — the coordinator records the completed count every few seconds when it changes.",
      );
    }

    const now = pts[pts.length - 1].at;
    const span = rangeSeconds();
    const born = state.cp && state.cp.created_at > 0 ? Math.min(state.cp.created_at, pts[0].at) : pts[0].at;
    const x0 = span ? Math.max(born, now - span) : born;
    const x1 = Math.max(now, x0 + 1);
    if (pts.every((p) => p.live) && pts[0].at > x0) {
      // No sample in the window: the count has not changed in it.
      pts.unshift({ at: x0, completed_count: pts[0].completed_count, live: true });
    }
    const X = (t) => ml + ((t - x0) / (x1 - x0)) * pw;

    // completed, top panel
    let vmin = Infinity;
    let vmax = -Infinity;
    for (const p of pts) {
      vmin = Math.min(vmin, p.completed_count);
      vmax = Math.max(vmax, p.completed_count);
    }
    if (vmin <= vmax * 0.5) vmin = 0;
    const yt = niceTicks(vmin, Math.max(vmax, vmin + 1), 4, true);
    const Y1 = (v) => top1 + h1 - ((v - yt.lo) / (yt.hi - yt.lo)) * h1;

    // thin the line to ~2 points per pixel column
    const step = Math.max(1, Math.floor(pts.length / (pw * 2)));
    const line = [];
    for (let i = 0; i < pts.length; i += step) line.push(pts[i]);
    if (line[line.length - 1] !== pts[pts.length - 1]) line.push(pts[pts.length - 1]);
    const path = line
      .map((p, i) => {
        const x = X(Math.max(p.at, x0)).toFixed(1);
        const y = Y1(p.completed_count).toFixed(1);
        return i ? `H${x}V${y}` : `M${x},${y}`; // step: the count holds until the next sample
      })
      .join("");
    const area = `${path}L${X(line[line.length - 1].at).toFixed(1)},${top1 + h1}L${X(line[0].at).toFixed(1)},${top1 + h1}Z`;

    // rate, bottom panel: buckets at least one sample interval wide
    let interval = Infinity; // the sampling interval: the shortest gap between persisted samples
    for (let i = 1; i < pts.length; i++) {
      if (!pts[i].live) interval = Math.min(interval, pts[i].at - pts[i - 1].at);
    }
    interval = Number.isFinite(interval) ? Math.max(1, interval) : 5;
    const buckets = Math.max(1, Math.min(60, Math.floor(pw / 10), Math.floor((x1 - x0) / interval)));
    const bw = (x1 - x0) / buckets;
    const rates = [];
    for (let i = 0; i < buckets; i++) {
      const a = x0 + i * bw;
      const b = a + bw;
      rates.push({ a, b, r: Math.max(0, (valueAt(pts, b) - valueAt(pts, a)) / bw) });
    }
    const rmax = Math.max(...rates.map((r) => r.r));
    const unit = rateUnit(rmax);
    const rt = niceTicks(0, Math.max(rmax * unit.mul, 1e-9), 2, false);
    if (rmax === 0) rt.hi = 1;
    const Y2 = (v) => top2 + h2 - ((v * unit.mul) / rt.hi) * h2;

    const xt = timeTicks(x0, x1, Math.max(2, Math.floor(pw / 110)));

    const kids = [];
    kids.push(s("text", { class: "ptitle", x: ml, y: top1 - 8 }, "Completed sources"));
    for (const v of yt.ticks) {
      kids.push(s("line", { class: "grid", x1: ml, x2: ml + pw, y1: Y1(v), y2: Y1(v) }));
      kids.push(s("text", { x: ml - 8, y: Y1(v) + 4, "text-anchor": "end" }, fmtCompact(v)));
    }
    kids.push(s("path", { class: "area", d: area }));
    kids.push(s("path", { class: "line", d: path, "data-testid": "chart-line" }));

    kids.push(s("text", { class: "ptitle", x: ml, y: top2 - 8 }, `Completions ${unit.long}`));
    for (const v of rt.ticks.filter((v) => v <= rt.hi)) {
      const y = top2 + h2 - (v / rt.hi) * h2;
      kids.push(s("line", { class: "grid", x1: ml, x2: ml + pw, y1: y, y2: y }));
      kids.push(s("text", { x: ml - 8, y: y + 4, "text-anchor": "end" }, fmtCompact(v)));
    }
    for (const r of rates) {
      const xa = X(r.a) + 1;
      const width = Math.max(1, X(r.b) - X(r.a) - 2);
      const y = Y2(r.r);
      if (r.r > 0) kids.push(s("rect", { class: "bar", x: xa, y, width, height: Math.max(1, top2 + h2 - y), rx: 1.5 }));
    }
    kids.push(s("line", { class: "axis", x1: ml, x2: ml + pw, y1: top2 + h2, y2: top2 + h2 }));
    kids.push(s("line", { class: "axis", x1: ml, x2: ml + pw, y1: top1 + h1, y2: top1 + h1 }));
    for (const { t, label } of xt) {
      kids.push(s("line", { class: "axis", x1: X(t), x2: X(t), y1: top2 + h2, y2: top2 + h2 + 4 }));
      kids.push(s("text", { x: X(t), y: top2 + h2 + 17, "text-anchor": "middle" }, label));
    }

    let tip = null;
    if (state.hoverAt !== null) {
      const t = x0 + state.hoverAt * (x1 - x0); // the mouse stays put while the axis moves on
      const v = valueAt(pts, t);
      const bucket = rates[Math.min(rates.length - 1, Math.floor((t - x0) / bw))];
      const hx = X(t);
      kids.push(s("line", { class: "hover-line", x1: hx, x2: hx, y1: top1, y2: top2 + h2 }));
      kids.push(s("circle", { class: "hover-dot", cx: hx, cy: Y1(v), r: 4 }));
      tip = h(
        "div",
        { class: "chart-tip", style: null, "data-x": hx, "data-y": Y1(v) },
        `${fmtClock(t)} · ${fmtInt(v)} completed · ${fmtRate(bucket ? bucket.r : 0)}`,
      );
    }
    kids.push(s("rect", { class: "hit", x: ml, y: top1, width: pw, height: top2 + h2 - top1, fill: "transparent" }));

    const svg = s(
      "svg",
      {
        class: "chart",
        id: "chart",
        viewBox: `0 0 ${W} ${H}`,
        width: W,
        height: H,
        role: "img",
        "aria-label": "Completed sources over time and completion rate",
        "data-ml": ml,
        "data-pw": pw,
        "data-testid": "progress-chart",
      },
      kids,
    );
    return [svg, tip];
  }

  // ------------------------------------------------------------------ checkpoint page

  function tile(label, value, sub, level, testid, extraClass) {
    return h(
      "div",
      { class: ["tile", level || "", extraClass || ""].join(" ").trim(), "data-testid": testid },
      h("div", { class: "tl" }, label),
      h("div", { class: "tv", "data-testid": testid + "-value" }, value),
      h("div", { class: "ts" }, sub || ""),
    );
  }

  function labelChips(labels) {
    const entries = Object.entries(labels || {}).sort(([a], [b]) => a.localeCompare(b));
    if (!entries.length) return h("span", { class: "sub" }, "—");
    return entries.map(([k, v]) =>
      h("span", { class: "chip", "data-testid": "label", title: `${k}=${v}` }, h("span", { class: "k" }, k + " "), h("span", { class: "v" }, v)),
    );
  }

  function writerRow(w) {
    const counts = w.counts || {};
    const live = isLive(w);
    const beat = serverNow() - (w.last_seen_at || 0);
    const closedAt = w.closed_at || 0;
    return h(
      "tr",
      {
        "data-key": `w:${w.writer_id}:${w.opened_at}`,
        "data-testid": "writer-row",
        "data-writer": w.writer_id,
        class: live ? "live" : "closed",
      },
      h("td", { class: "mono" }, w.writer_id),
      h("td", {}, w.host || "—"),
      h("td", { class: "num" }, w.pid ? String(w.pid) : "—"),
      h("td", {}, labelChips(w.labels)),
      h(
        "td",
        { class: "nowrap" },
        h("span", { class: "pill " + stateClass(w.state), "data-testid": "writer-state" }, live ? "live" : w.state || "?"),
        !live && closedAt > 0 ? h("div", { class: "sub", title: fmtStamp(closedAt) }, fmtAgo(closedAt)) : null,
      ),
      h("td", { class: "nowrap", title: fmtStamp(w.opened_at) }, fmtAgo(w.opened_at)),
      h(
        "td",
        { class: "num" + (live && beat > STALE_HEARTBEAT_S ? " warn" : ""), title: fmtStamp(w.last_seen_at) },
        live ? fmtDuration(beat) : "—",
      ),
      h("td", { class: "num" }, fmtInt(w.pending_sources || 0)),
      h("td", { class: "num" }, fmtInt(counts.applied || 0)),
      h("td", { class: "num", "data-testid": "writer-completed" }, fmtInt(counts.completed || 0)),
      h("td", { class: "num" + (counts.anomalies > 0 ? " warn" : "") }, fmtInt(counts.anomalies || 0)),
    );
  }

  function writersPanel(cp) {
    const rows = (state.writers || (cp.writers || []).map((w) => ({ state: "open", ...w }))).slice();
    rows.sort((a, b) => isLive(b) - isLive(a) || (b.opened_at || 0) - (a.opened_at || 0));
    const live = rows.filter(isLive).length;
    return h(
      "section",
      { class: "panel", "data-testid": "writers" },
      h(
        "div",
        { class: "panel-head" },
        h("h2", { class: "panel-title" }, "Writers"),
        h(
          "div",
          { class: "legend" },
          h("span", { class: "panel-note" }, `${fmtInt(live)} live` + (rows.length > live ? ` · ${fmtInt(rows.length - live)} closed` : "")),
          h(
            "label",
            { class: "toggle" },
            h("input", { type: "checkbox", "data-action": "closed", checked: state.showClosed }),
            "show closed",
          ),
        ),
      ),
      state.writersNote ? h("div", { class: "panel-body sub" }, state.writersNote + " — showing live writers only.") : null,
      rows.length
        ? h(
            "div",
            { class: "tablewrap" },
            h(
              "table",
              {},
              h(
                "thead",
                {},
                h(
                  "tr",
                  {},
                  ["Writer", "Host", "PID", "Labels", "State", "Opened", "Heartbeat", "Pending", "Applied", "Completions", "Anomalies"].map(
                    (t, i) => h("th", { class: i === 2 || i >= 6 ? "num" : "" }, t),
                  ),
                ),
              ),
              h("tbody", {}, rows.map(writerRow)),
            ),
          )
        : h("div", { class: "empty" }, state.showClosed ? "No writer has opened this checkpoint yet." : "No live writers."),
      rows.length >= WRITERS_LIMIT ? h("div", { class: "more sub" }, `Showing the ${WRITERS_LIMIT} most recent writers.`) : null,
    );
  }

  function eventClass(kind) {
    if (/unreadable|error|fail/.test(kind)) return "bad";
    if (/anomal|expired|lost|reset/.test(kind)) return "warn";
    if (/opened|created/.test(kind)) return "ok";
    return "";
  }

  function eventData(data) {
    const entries = Object.entries(data || {});
    if (!entries.length) return null;
    const text = entries.map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`).join("  ");
    return h("div", { class: "sub mono" }, text.length > 240 ? text.slice(0, 239) + "…" : text);
  }

  function eventsPanel() {
    const now = Date.now();
    const rows = state.events.map((e) => {
      const arrived = state.eventsArrived.get(e.id);
      return h(
        "tr",
        { "data-key": "e:" + e.id, "data-testid": "event-row", class: arrived && now - arrived < 4000 ? "ev-new" : "" },
        h("td", { class: "nowrap", title: fmtStamp(e.at) }, fmtAgo(e.at), h("div", { class: "sub" }, fmtStamp(e.at))),
        h("td", {}, h("span", { class: "ev-kind " + eventClass(e.kind || ""), "data-testid": "event-kind" }, (e.kind || "").replace(/_/g, " "))),
        h("td", { class: "mono sub" }, e.writer_id || ""),
        h("td", { class: "ev-msg" }, e.message || "", eventData(e.data)),
      );
    });
    let more;
    if (state.eventsNext) {
      more = h(
        "button",
        { class: "btn", type: "button", "data-action": "older", "data-testid": "load-older", disabled: state.eventsLoading },
        state.eventsLoading ? "Loading…" : "Load older events",
      );
    } else if (state.events.length) {
      more = h("span", { class: "sub" }, "Beginning of the log");
    }
    return h(
      "section",
      { class: "panel", "data-testid": "events" },
      h(
        "div",
        { class: "panel-head" },
        h("h2", { class: "panel-title" }, "Event log"),
        h("span", { class: "panel-note" }, state.events.length ? `newest first · ${plural(state.events.length, "event")} loaded` : ""),
      ),
      state.eventsNote ? h("div", { class: "panel-body sub" }, state.eventsNote) : null,
      rows.length
        ? h(
            "div",
            { class: "tablewrap" },
            h(
              "table",
              {},
              h("thead", {}, h("tr", {}, h("th", {}, "When"), h("th", {}, "Kind"), h("th", {}, "Writer"), h("th", {}, "Message"))),
              h("tbody", {}, rows),
            ),
          )
        : state.eventsNote
          ? null
          : h("div", { class: "empty" }, "No events yet."),
      more ? h("div", { class: "more" }, more) : null,
    );
  }

  function checkpointView(name) {
    document.title = `Tally · ${name}`;
    const crumbs = h("div", { class: "crumbs" }, h("a", { href: "#/" }, "← All checkpoints"));
    if (!state.loaded) return [crumbs, h("div", { class: "empty" }, "Loading ", h("b", {}, name), "…")];
    if (state.cpMissing || !state.cp) {
      return [
        crumbs,
        h(
          "div",
          { class: "panel empty empty-big", "data-testid": "not-found" },
          h("div", { class: "empty-title" }, `No checkpoint named “${name}”`),
          h("div", {}, "It will appear here as soon as a writer opens it. This page keeps checking."),
        ),
      ];
    }
    const cp = state.cp;
    const pts = progressPoints();
    const rate = currentRate(pts);
    const closed = state.writers ? state.writers.filter((w) => !isLive(w)).length : 0;
    return [
      h(
        "div",
        { class: "page-head" },
        h(
          "div",
          {},
          crumbs,
          h("h1", { class: "page-title", "data-testid": "checkpoint-name" }, cp.name, " ", activityPill(cp)),
          h(
            "div",
            { class: "page-sub" },
            h("span", { title: fmtStamp(cp.created_at) }, `created ${fmtAgo(cp.created_at)}`),
            Object.keys(cp.fingerprint || {}).length
              ? [" · fingerprint ", Object.entries(cp.fingerprint).map(([k, v]) => h("span", { class: "chip" }, h("span", { class: "k" }, k + " "), h("span", { class: "v" }, v)))]
              : null,
          ),
        ),
        h(
          "div",
          { class: "page-sub", title: fmtStamp(cp.last_activity_at) },
          "Last activity ",
          h("b", { "data-testid": "last-activity" }, fmtAgo(cp.last_activity_at)),
        ),
      ),
      h(
        "div",
        { class: "tiles" },
        tile("Completed sources", fmtInt(cp.completed_count), "durable, across all writers", "", "completed", "hero"),
        tile("Rate", rate === null ? "—" : fmtRate(rate), rate === null ? "waiting for samples" : "over the last minute", "", "rate"),
        tile(
          "Pending sources",
          fmtInt(cp.pending_sources),
          cp.settling_sources > 0 ? `${fmtInt(cp.settling_sources)} settling` : "in flight in live writers",
          "",
          "pending",
        ),
        tile("Live writers", fmtInt(cp.live_writers), closed ? `${fmtInt(closed)} closed` : "", "", "live-writers"),
        tile("Anomalies", fmtInt(cp.anomalies), cp.anomalies > 0 ? "sources un-completed, replaying" : "none", cp.anomalies > 0 ? "warn" : "", "anomalies"),
        tile(
          "Unreadable files",
          fmtInt(cp.unreadable_files),
          cp.unreadable_files > 0 ? "completion files skipped — check the log" : "none",
          cp.unreadable_files > 0 ? "bad" : "",
          "unreadable",
        ),
      ),
      h(
        "section",
        { class: "panel", "data-testid": "progress" },
        h(
          "div",
          { class: "panel-head" },
          h("h2", { class: "panel-title" }, "Progress"),
          h(
            "div",
            { class: "legend" },
            h("span", {}, h("i", { class: "l-done" }), "completed"),
            h("span", {}, h("i", { class: "l-rate" }), "rate"),
            h(
              "div",
              { class: "seg", role: "group", "aria-label": "Time range" },
              RANGES.map(([key]) =>
                h("button", { type: "button", "data-action": "range", "data-range": key, "aria-pressed": String(state.range === key) }, key),
              ),
            ),
          ),
        ),
        state.progressNote ? h("div", { class: "panel-body sub" }, state.progressNote) : null,
        h("div", { class: "chart-wrap", id: "chart-box" }, chartView()),
      ),
      writersPanel(cp),
      eventsPanel(),
    ];
  }

  function authView() {
    document.title = "Tally · sign in";
    const refused = token
      ? h("div", { class: "auth-error", "data-testid": "auth-error" }, `The token was not accepted: ${state.auth.message}`)
      : null;
    return [
      h(
        "form",
        { class: "panel empty empty-big auth", "data-action": "signin", "data-testid": "signin" },
        h("div", { class: "empty-title" }, "This Tally server needs a token"),
        h("div", {}, "Enter a bearer token (any role can read the dashboard). It is kept in this browser tab only."),
        refused,
        h(
          "div",
          { class: "auth-row" },
          h("input", {
            class: "btn auth-input",
            type: "password",
            name: "token",
            autocomplete: "current-password",
            placeholder: "token",
            "aria-label": "Bearer token",
          }),
          h("button", { class: "btn", type: "submit" }, "Sign in"),
        ),
      ),
    ];
  }

  // ------------------------------------------------------------------ render

  const view = document.getElementById("view");
  const banner = document.getElementById("banner");
  const conn = document.getElementById("conn");
  const connText = document.getElementById("conn-text");
  const signOut = document.getElementById("signout");

  function renderStatus() {
    signOut.hidden = !token;
    if (state.auth) {
      conn.dataset.state = "error";
      connText.textContent = "token needed";
      banner.hidden = true;
    } else if (state.error) {
      conn.dataset.state = "error";
      connText.textContent = "offline · retrying";
      const since = state.lastOk ? ` Showing data from ${fmtDuration((Date.now() - state.lastOk) / 1000)} ago.` : "";
      banner.textContent = `Can't reach the Tally server — ${state.error.message}. Retrying every ${POLL_MS / 1000} s.${since}`;
      banner.hidden = false;
    } else {
      banner.hidden = true;
      banner.textContent = "";
      if (state.lastOk) {
        conn.dataset.state = "live";
        connText.textContent = `live · updated ${fmtClock(Date.now() / 1000)}`;
      }
    }
  }

  function render() {
    renderStatus();
    const fresh = document.createElement("main");
    if (state.auth) add(fresh, authView());
    else add(fresh, state.route.page === "checkpoint" ? checkpointView(state.route.name) : listView());
    morphChildren(view, fresh);
    placeTip();
    const box = document.getElementById("chart-box");
    if (box) {
      const width = Math.floor(box.clientWidth - 24);
      if (width > 0 && Math.abs(width - state.chartWidth) > 1) {
        state.chartWidth = width;
        requestAnimationFrame(render);
      }
    }
  }

  function placeTip() {
    const tip = view.querySelector(".chart-tip");
    const svg = document.getElementById("chart");
    if (!tip || !svg) return;
    const width = Number(svg.getAttribute("width"));
    const box = svg.getBoundingClientRect();
    const wrap = tip.offsetParent ? tip.offsetParent.getBoundingClientRect() : box;
    const scale = box.width / width;
    const x = Number(tip.dataset.x);
    tip.style.left = `${box.left - wrap.left + x * scale}px`;
    tip.style.top = `${box.top - wrap.top + Number(tip.dataset.y) * scale - 10}px`;
    // Keep it inside the panel near either edge.
    tip.style.transform = x < width * 0.2 ? "translate(-10%, -100%)" : x > width * 0.8 ? "translate(-90%, -100%)" : "";
  }

  // ------------------------------------------------------------------ interaction (delegated: survives morphs)

  document.addEventListener("click", (ev) => {
    const target = ev.target.closest("[data-action]");
    if (!target) return;
    const action = target.dataset.action;
    if (action === "older") {
      loadOlderEvents();
    } else if (action === "signout") {
      setToken("");
      refresh();
    } else if (action === "range") {
      state.range = target.dataset.range;
      store("range", state.range);
      state.hoverAt = null;
      render();
      refresh();
    }
  });

  document.addEventListener("submit", (ev) => {
    const form = ev.target.closest("[data-action='signin']");
    if (!form) return;
    ev.preventDefault();
    const value = form.querySelector("input[name='token']").value.trim();
    if (!value) return;
    setToken(value);
    refresh();
  });

  document.addEventListener("change", (ev) => {
    const target = ev.target.closest("[data-action='closed']");
    if (!target) return;
    state.showClosed = target.checked;
    store("showClosed", state.showClosed);
    refresh();
  });

  document.addEventListener("input", (ev) => {
    const target = ev.target.closest("[data-action='filter']");
    if (!target) return;
    state.filter = target.value;
    render();
  });

  let hoverFrame = 0;
  document.addEventListener("mousemove", (ev) => {
    const svg = document.getElementById("chart");
    let at = null; // fraction of the plot's width under the mouse
    if (svg && svg.contains(ev.target)) {
      const rect = svg.getBoundingClientRect();
      const px = ((ev.clientX - rect.left) * Number(svg.getAttribute("width"))) / rect.width;
      const ml = Number(svg.dataset.ml);
      const pw = Number(svg.dataset.pw);
      if (px >= ml && px <= ml + pw) at = (px - ml) / pw;
    }
    if (at === state.hoverAt) return;
    state.hoverAt = at;
    if (!hoverFrame) {
      hoverFrame = requestAnimationFrame(() => {
        hoverFrame = 0;
        render();
      });
    }
  });

  window.addEventListener("resize", () => render());

  // Background tabs get their timers throttled: catch up as soon as the tab is looked at again.
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) refresh();
  });

  window.addEventListener("hashchange", () => {
    const next = parseRoute();
    const prev = state.route;
    state.route = next;
    if (next.page !== prev.page || next.name !== prev.name) {
      resetCheckpointState();
      if (next.page === "list") state.loaded = state.list !== null;
      window.scrollTo(0, 0);
    }
    render();
    refresh();
  });

  state.route = parseRoute();
  render();
  refresh();
})();
