/* Tally dashboard: a dependency-free single-page app served by the coordinator (air-gapped clusters).
 * Native ES modules, no build step:
 *
 *   app.js         this file: rendering, the connection indicator, user input, routing
 *   state.js       what the page knows and the rules for merging what arrives (no I/O)
 *   live.js        keeps it current: the watch stream for a checkpoint's status, polling for the rest
 *   api.js         the /v1 API: JSON GETs and Server-Sent Events over fetch (with the bearer token)
 *   dom.js         h()/s() to build detached trees, morphChildren() to patch them into the page
 *   format.js      numbers, durations, rates, the server's clock
 *   chart.js       the progress plot (inline SVG) and the rate
 *   views/*.js     one module per page or panel: list, checkpoint, writers, events, auth
 *
 * Pages (hash routing, checkpoint names contain "/"):
 *   #/                      every checkpoint as a card or a table row, grouped by name prefix
 *   #/checkpoint/<name>     one checkpoint: tiles, progress plot, writers, event log
 *
 * When the state changes the view is rebuilt as a detached DOM tree at the next animation frame, then
 * morphed into the page (unchanged nodes, focus and scroll stay put). All text goes in through text
 * nodes, never innerHTML.
 */

import { setToken, getToken } from "./api.js";
import { hoverFraction, placeTip } from "./chart.js";
import { add, morphChildren } from "./dom.js";
import { fmtClock, fmtDuration } from "./format.js";
import { RETRY_MS, follow, loadOlderEvents, refresh } from "./live.js";
import { navigate, onChange, parseRoute, setPref, state } from "./state.js";
import { authView } from "./views/auth.js";
import { checkpointView } from "./views/checkpoint.js";
import { listView } from "./views/list.js";

// Relative times ("5 s ago", heartbeat ages) move on even while no data changes.
const TICK_MS = 2000;
// Updates that come by themselves (the stream, polls, the clock) may keep the main thread busy this
// share of the time at most: a big page on a slow machine then updates less often instead of answering
// clicks late. What the user does renders at the next frame regardless.
const BUSY_SHARE = 0.2;

const view = document.getElementById("view");
const banner = document.getElementById("banner");
const conn = document.getElementById("conn");
const connText = document.getElementById("conn-text");
const signOut = document.getElementById("signout");

function renderStatus() {
  const c = state.conn;
  signOut.hidden = !getToken();
  if (c.auth) {
    conn.dataset.state = "error";
    connText.textContent = "token needed";
    banner.hidden = true;
  } else if (c.error) {
    conn.dataset.state = "error";
    connText.textContent = "offline · retrying";
    const since = c.lastOk ? ` Showing data from ${fmtDuration((Date.now() - c.lastOk) / 1000)} ago.` : "";
    banner.textContent = `Can't reach the Tally server — ${c.error.message}. Retrying every ${RETRY_MS / 1000} s.${since}`;
    banner.hidden = false;
  } else {
    banner.hidden = true;
    banner.textContent = "";
    if (c.lastOk) {
      conn.dataset.state = "live";
      // An open stream would have said if anything changed: what is shown is current now.
      connText.textContent = `live · updated ${fmtClock((c.streaming ? Date.now() : c.lastOk) / 1000)}`;
    }
  }
}

let lastRender = 0;
let lastCost = 0;

function render() {
  const started = performance.now();
  lastRender = started;
  renderStatus();
  const fresh = document.createElement("main");
  if (state.conn.auth) add(fresh, authView(getToken() ? state.conn.auth : null));
  else if (state.checkpoint) add(fresh, checkpointView(state.checkpoint, { width: state.chartWidth, hoverAt: state.hoverAt }));
  else add(fresh, listView(state.list));
  morphChildren(view, fresh);
  placeTip(view);
  const box = document.getElementById("chart-box");
  if (box) {
    const width = Math.floor(box.clientWidth - 24);
    if (width > 0 && Math.abs(width - state.chartWidth) > 1) {
      state.chartWidth = width;
      scheduleRender();
    }
  }
  lastCost = performance.now() - started;
  // For DevTools' performance panel and bench/dashboard.py (only the last is kept).
  performance.clearMeasures("tally:render");
  performance.measure("tally:render", { start: started });
}

// At most one render per frame, and none while the tab is hidden (frames stop; the stream goes on).
let frame = 0;
let deferred = 0;
function scheduleRender() {
  clearTimeout(deferred);
  deferred = 0;
  if (frame) return;
  frame = requestAnimationFrame(() => {
    frame = 0;
    render();
  });
}

/** A render for new data: as soon as the busy share allows. */
function scheduleUpdate() {
  if (frame || deferred) return;
  const wait = lastRender + lastCost / BUSY_SHARE - performance.now();
  if (wait <= 0) scheduleRender();
  else deferred = setTimeout(scheduleRender, wait);
}

onChange(scheduleUpdate);

// ------------------------------------------------------------------ interaction (delegated: survives morphs)

document.addEventListener("click", (ev) => {
  const target = ev.target.closest("[data-action]");
  if (!target) return;
  const action = target.dataset.action;
  if (action === "older") {
    loadOlderEvents();
  } else if (action === "signout") {
    setToken("");
    follow(); // an open stream still carries the old token
  } else if (action === "writer-sort" && state.checkpoint) {
    state.checkpoint.writerView.sort = target.dataset.sort;
    state.checkpoint.writerView.page = 0;
    scheduleRender();
  } else if (action === "writer-page" && state.checkpoint) {
    state.checkpoint.writerView.page = Math.max(0, state.checkpoint.writerView.page + Number(target.dataset.step));
    scheduleRender();
  } else if (action === "list-view" || action === "list-sort") {
    setPref(action === "list-view" ? "listView" : "listSort", target.dataset.value);
    scheduleRender();
  } else if (action === "range") {
    setPref("range", target.dataset.range);
    state.hoverAt = null;
    scheduleRender();
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
  follow();
});

document.addEventListener("change", (ev) => {
  const target = ev.target.closest("[data-action='closed']");
  if (!target) return;
  setPref("showClosed", target.checked);
  refresh();
});

document.addEventListener("input", (ev) => {
  const target = ev.target.closest("[data-action='filter'], [data-action='writer-filter']");
  if (!target) return;
  if (target.dataset.action === "filter") {
    state.list.filter = target.value;
  } else if (state.checkpoint) {
    state.checkpoint.writerView.filter = target.value;
    state.checkpoint.writerView.page = 0;
  }
  scheduleRender();
});

document.addEventListener("mousemove", (ev) => {
  const at = hoverFraction(ev);
  if (at === state.hoverAt) return;
  state.hoverAt = at;
  scheduleRender();
});

window.addEventListener("resize", scheduleRender);

// Background tabs get their timers throttled: catch up as soon as the tab is looked at again.
document.addEventListener("visibilitychange", () => {
  if (!document.hidden) refresh();
});

window.addEventListener("hashchange", () => {
  if (navigate(parseRoute())) {
    window.scrollTo(0, 0);
    follow();
  }
  scheduleRender();
});

setInterval(() => {
  if (performance.now() - lastRender > TICK_MS / 2) scheduleUpdate(); // unless data just rendered
}, TICK_MS);
navigate(parseRoute());
follow();
render();
