/* The writer table of a checkpoint's page: live writers first, then the most recent closed ones. */

import { h } from "../dom.js";
import { fmtAgo, fmtDuration, fmtInt, fmtStamp, serverNow } from "../format.js";
import { WRITERS_LIMIT, isLive, prefs } from "../state.js";

const STALE_HEARTBEAT_S = 30;
const COLUMNS = ["Writer", "Host", "PID", "Labels", "State", "Opened", "Heartbeat", "Pending", "Applied", "Completions", "Anomalies"];

function stateClass(st) {
  if (st === "open" || st === "live") return "ok";
  if (st === "closed") return "";
  return "warn"; // expired, lost, reset
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

/** The panel for a CheckpointPage's writers. */
export function writersPanel(page) {
  const rows = page.writerRows();
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
        h("label", { class: "toggle" }, h("input", { type: "checkbox", "data-action": "closed", checked: prefs.showClosed }), "show closed"),
      ),
    ),
    page.writersNote ? h("div", { class: "panel-body sub" }, page.writersNote + " — showing live writers only.") : null,
    rows.length
      ? h(
          "div",
          { class: "tablewrap" },
          h(
            "table",
            {},
            h("thead", {}, h("tr", {}, COLUMNS.map((t, i) => h("th", { class: i === 2 || i >= 6 ? "num" : "" }, t)))),
            h("tbody", {}, rows.map(writerRow)),
          ),
        )
      : h("div", { class: "empty" }, prefs.showClosed ? "No writer has opened this checkpoint yet." : "No live writers."),
    rows.length >= WRITERS_LIMIT ? h("div", { class: "more sub" }, `Showing the ${WRITERS_LIMIT} most recent writers.`) : null,
  );
}
