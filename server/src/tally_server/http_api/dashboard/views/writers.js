/* The writer table of a checkpoint's page, readable at SLURM scale (hundreds of array tasks):
 *
 *   - labels every writer shares (the job's name, the pipeline stage…) show once above the table;
 *   - rows group by array job (the slurm_array_job_id label) when writers come from several, else by
 *     host when they run on several and there are many;
 *   - a sort (state, writer id, completed, last seen) and a text filter (writer id, host, labels);
 *   - pages of WRITERS_PAGE rows. The live status stream carries every live writer, and the history
 *     read asks for all of them plus the most recent closed ones, so paging is done here.
 */

import { h } from "../dom.js";
import { fmtAgo, fmtDuration, fmtInt, fmtStamp, plural, serverNow } from "../format.js";
import { WRITERS_LIMIT, WRITERS_PAGE, WRITER_SORTS, isLive, prefs } from "../state.js";

const STALE_HEARTBEAT_S = 30;
const COLUMNS = ["Writer", "Host", "PID", "Labels", "State", "Opened", "Heartbeat", "Pending", "Applied", "Completions", "Anomalies"];
const JOB_LABEL = "slurm_array_job_id";
const HOST_GROUPING_MIN_ROWS = 20; // fewer rows read fine ungrouped
const byId = new Intl.Collator("en", { numeric: true }).compare;

function stateClass(st) {
  if (st === "open" || st === "live") return "ok";
  if (st === "closed") return "";
  return "warn"; // expired, lost, reset
}

function chip(k, v) {
  return h("span", { class: "chip", "data-testid": "label", title: `${k}=${v}` }, h("span", { class: "k" }, k + " "), h("span", { class: "v" }, v));
}

function labelChips(labels, hidden) {
  const entries = Object.entries(labels || {})
    .filter(([k]) => !hidden.has(k))
    .sort(([a], [b]) => a.localeCompare(b));
  if (!entries.length) return h("span", { class: "sub" }, "—");
  return entries.map(([k, v]) => chip(k, v));
}

/** Labels with the same value on every row (at least two rows: one writer's labels are all its own). */
export function sharedLabels(rows) {
  if (rows.length < 2) return [];
  const first = rows[0].labels || {};
  return Object.entries(first)
    .filter(([k, v]) => rows.every((w) => (w.labels || {})[k] === v))
    .sort(([a], [b]) => a.localeCompare(b));
}

/** How rows group: {key(w), title(key), hide: label name or null}, or null for no grouping. */
function grouping(rows) {
  const jobs = new Set(rows.map((w) => (w.labels || {})[JOB_LABEL]).filter((v) => v !== undefined));
  if (jobs.size > 1) {
    return { key: (w) => (w.labels || {})[JOB_LABEL] ?? "", title: (k) => (k ? `array job ${k}` : "no array job"), hide: JOB_LABEL };
  }
  const hosts = new Set(rows.map((w) => w.host || ""));
  if (hosts.size > 1 && rows.length >= HOST_GROUPING_MIN_ROWS) {
    return { key: (w) => w.host || "", title: (k) => (k ? `host ${k}` : "no host"), hide: null };
  }
  return null;
}

const SORTERS = {
  state: (a, b) => isLive(b) - isLive(a) || (b.opened_at || 0) - (a.opened_at || 0),
  id: (a, b) => byId(a.writer_id, b.writer_id) || (b.opened_at || 0) - (a.opened_at || 0),
  completed: (a, b) => ((b.counts || {}).completed || 0) - ((a.counts || {}).completed || 0) || byId(a.writer_id, b.writer_id),
  seen: (a, b) => (b.last_seen_at || 0) - (a.last_seen_at || 0) || byId(a.writer_id, b.writer_id),
};

function matches(w, needle) {
  if (!needle) return true;
  const text = [w.writer_id, w.host || "", ...Object.entries(w.labels || {}).map(([k, v]) => `${k}=${v}`)].join(" ").toLowerCase();
  return needle.split(/\s+/).every((word) => text.includes(word));
}

function writerRow(w, hidden) {
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
    h("td", {}, labelChips(w.labels, hidden)),
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

function groupRow(key, title, members) {
  const live = members.filter(isLive).length;
  const done = members.reduce((acc, w) => acc + ((w.counts || {}).completed || 0), 0);
  return h(
    "tr",
    { class: "group", "data-key": "g:" + key, "data-testid": "writer-group", "data-group": key },
    h(
      "th",
      { colspan: COLUMNS.length, scope: "colgroup" },
      h("span", { class: "group-title" }, title),
      h("span", { class: "sub" }, ` · ${plural(members.length, "writer")} · ${fmtInt(live)} live · ${plural(done, "completion")}`),
    ),
  );
}

function controls(view, total, shown) {
  const pages = Math.max(1, Math.ceil(shown / WRITERS_PAGE));
  const first = shown ? view.page * WRITERS_PAGE + 1 : 0;
  const last = Math.min(shown, (view.page + 1) * WRITERS_PAGE);
  return h(
    "div",
    { class: "panel-body wcontrols" },
    total > 6
      ? h("input", {
          class: "btn",
          type: "search",
          placeholder: "Filter: writer id, host, label=value",
          "aria-label": "Filter writers by id, host or label",
          "data-action": "writer-filter",
          "data-testid": "writer-filter",
          value: view.filter,
        })
      : null,
    h(
      "div",
      { class: "seg", role: "group", "aria-label": "Sort writers by", "data-testid": "writer-sort" },
      WRITER_SORTS.map(([k, label]) =>
        h("button", { type: "button", "data-action": "writer-sort", "data-sort": k, "aria-pressed": String(view.sort === k) }, label),
      ),
    ),
    pages > 1
      ? h(
          "div",
          { class: "pager" },
          h("button", { class: "btn", type: "button", "data-action": "writer-page", "data-step": "-1", "data-testid": "writer-prev", disabled: view.page === 0 }, "‹ Prev"),
          h("span", { class: "sub", "data-testid": "writer-range" }, `${fmtInt(first)}–${fmtInt(last)} of ${fmtInt(shown)}`),
          h("button", { class: "btn", type: "button", "data-action": "writer-page", "data-step": "1", "data-testid": "writer-next", disabled: view.page >= pages - 1 }, "Next ›"),
        )
      : null,
  );
}

/** The panel for a CheckpointPage's writers. */
export function writersPanel(page) {
  const view = page.writerView;
  const rows = page.writerRows();
  const live = rows.filter(isLive).length;
  const shared = sharedLabels(rows);
  const groups = grouping(rows);
  const hidden = new Set(shared.map(([k]) => k));
  if (groups && groups.hide) hidden.add(groups.hide);

  const needle = view.filter.trim().toLowerCase();
  const shown = rows.filter((w) => matches(w, needle));
  const sorter = SORTERS[view.sort] || SORTERS.state;
  let ordered;
  const members = new Map();
  if (groups) {
    for (const w of shown) {
      const k = groups.key(w);
      if (!members.has(k)) members.set(k, []);
      members.get(k).push(w);
    }
    const keys = Array.from(members.keys()).sort(byId);
    ordered = keys.flatMap((k) => members.get(k).sort(sorter));
  } else {
    ordered = shown.sort(sorter);
  }
  const pages = Math.max(1, Math.ceil(ordered.length / WRITERS_PAGE));
  if (view.page >= pages) view.page = pages - 1;
  const slice = ordered.slice(view.page * WRITERS_PAGE, (view.page + 1) * WRITERS_PAGE);
  const body = [];
  let current = null;
  for (const w of slice) {
    if (groups) {
      const k = groups.key(w);
      if (k !== current) {
        current = k;
        body.push(groupRow(k, groups.title(k), members.get(k)));
      }
    }
    body.push(writerRow(w, hidden));
  }
  const closed = rows.length - live;

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
        h("span", { class: "panel-note" }, `${fmtInt(live)} live` + (closed ? ` · ${fmtInt(closed)} closed` : "")),
        h("label", { class: "toggle" }, h("input", { type: "checkbox", "data-action": "closed", checked: prefs.showClosed }), "show closed"),
      ),
    ),
    page.writersNote ? h("div", { class: "panel-body sub" }, page.writersNote + " — showing live writers only.") : null,
    shared.length
      ? h(
          "div",
          { class: "panel-body shared", "data-testid": "shared-labels" },
          h("span", { class: "sub" }, `Every writer has `),
          shared.map(([k, v]) => chip(k, v)),
        )
      : null,
    rows.length ? controls(view, rows.length, ordered.length) : null,
    rows.length
      ? ordered.length
        ? h(
            "div",
            { class: "tablewrap" },
            h(
              "table",
              {},
              h("thead", {}, h("tr", {}, COLUMNS.map((t, i) => h("th", { class: i === 2 || i >= 6 ? "num" : "" }, t)))),
              h("tbody", {}, body),
            ),
          )
        : h("div", { class: "empty", "data-testid": "writers-none" }, `No writer matches “${view.filter}”.`)
      : h("div", { class: "empty" }, prefs.showClosed ? "No writer has opened this checkpoint yet." : "No live writers."),
    closed >= WRITERS_LIMIT ? h("div", { class: "more sub" }, `Showing the ${WRITERS_LIMIT} most recently closed writers.`) : null,
  );
}
