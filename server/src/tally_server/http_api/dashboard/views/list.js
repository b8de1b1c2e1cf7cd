/* The list of checkpoints (#/): cards or a table (sorted by name or by last activity), grouped by name
 * prefix ("team/…") once there are several, totals on top, a name filter once there are many. */

import { h } from "../dom.js";
import { fmtAgo, fmtInt, fmtPercent, fmtStamp, plural, totalOf } from "../format.js";
import { checkpointHref, prefs } from "../state.js";
import { activityPill, severity } from "./common.js";
import { replicasPanel } from "./replicas.js";

function cardFact(value, label, level, testid) {
  return h(
    "div",
    { class: "fact" + (value > 0 && level ? " " + level : ""), "data-testid": testid },
    h("div", { class: "fv" }, fmtInt(value)),
    h("div", { class: "fl" }, label),
  );
}

function checkpointCard(cp) {
  const total = totalOf(cp); // declared sources: a percent, nothing otherwise
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
      total
        ? h("span", { class: "unit pct", "data-testid": "percent", title: `${fmtInt(cp.completed_count)} of ${plural(cp.total, "declared source")}` }, `${fmtPercent(total.percent)} of ${fmtInt(cp.total)}`)
        : null,
    ),
    total ? h("progress", { class: "total-bar", max: cp.total, value: Math.min(cp.completed_count, cp.total) }) : null,
    h(
      "div",
      { class: "card-facts" },
      cardFact(cp.pending_sources, "pending", "", "pending"),
      cardFact(cp.live_writers, "live writers", "", "live-writers"),
      cardFact(cp.anomalies, "anomalies", "warn", "anomalies"),
      cardFact(cp.unreadable_files, "unreadable", "bad", "unreadable"),
      cp.failed_sources > 0 ? cardFact(cp.failed_sources, "failed", "bad", "failed") : null,
    ),
    h(
      "div",
      { class: "card-foot" },
      h("span", { title: fmtStamp(cp.last_activity_at) }, "last activity ", h("b", {}, fmtAgo(cp.last_activity_at))),
      h("span", { title: fmtStamp(cp.created_at) }, "created " + fmtAgo(cp.created_at)),
    ),
  );
}

const LIST_VIEWS = [
  ["cards", "Cards"],
  ["table", "Table"],
];
const byName = (a, b) => a.name.localeCompare(b.name);
const SORTS = {
  name: byName,
  activity: (a, b) => (b.last_activity_at || 0) - (a.last_activity_at || 0) || byName(a, b),
};

/** "team/run-1" → "team"; a name without "/" has no prefix. */
export const prefixOf = (name) => (name.includes("/") ? name.slice(0, name.indexOf("/")) : "");

/** [[prefix, checkpoints]] in prefix order, each sorted by the list's sort; one group (key null) when
 *  every checkpoint has the same prefix. */
function groupsOf(shown) {
  const sorter = SORTS[prefs.listSort] || byName;
  const groups = new Map();
  for (const cp of shown) {
    const p = prefixOf(cp.name);
    if (!groups.has(p)) groups.set(p, []);
    groups.get(p).push(cp);
  }
  if (groups.size < 2) return [[null, shown.slice().sort(sorter)]];
  return Array.from(groups.keys())
    .sort((a, b) => (a === "") - (b === "") || a.localeCompare(b))
    .map((p) => [p, groups.get(p).sort(sorter)]);
}

function groupTitle(prefix, members) {
  const live = members.reduce((acc, cp) => acc + (cp.live_writers || 0), 0);
  return [
    h("span", { class: "group-title" }, prefix ? prefix + "/" : "no prefix"),
    h("span", { class: "sub" }, ` · ${plural(members.length, "checkpoint")} · ${fmtInt(live)} live writers`),
  ];
}

function cardsView(groups) {
  return h(
    "div",
    { "data-testid": "checkpoint-list" },
    groups.map(([prefix, members]) =>
      h(
        "section",
        { class: "cp-group", "data-key": "cg:" + prefix },
        prefix === null ? null : h("h2", { class: "group-head", "data-testid": "checkpoint-group", "data-prefix": prefix }, groupTitle(prefix, members)),
        h("div", { class: "cards" }, members.map(checkpointCard)),
      ),
    ),
  );
}

function sortHead(key, label, cls) {
  const on = prefs.listSort === key;
  return h(
    "th",
    { class: cls, "aria-sort": on ? (key === "name" ? "ascending" : "descending") : null },
    h("button", { class: "th-sort", type: "button", "data-action": "list-sort", "data-value": key, "data-testid": "sort-" + key, "aria-pressed": String(on) }, label + (on ? (key === "name" ? " ↑" : " ↓") : "")),
  );
}

function checkpointRow(cp) {
  const total = totalOf(cp);
  return h(
    "tr",
    { class: severity(cp), "data-key": "cr:" + cp.name, "data-testid": "checkpoint-row", "data-name": cp.name },
    h("td", { class: "mono" }, h("a", { href: checkpointHref(cp.name) }, cp.name)),
    h("td", {}, activityPill(cp)),
    h("td", { class: "num" }, fmtInt(cp.completed_count)),
    h("td", { class: "num" }, total ? fmtPercent(total.percent) : "—"),
    h("td", { class: "num" }, fmtInt(cp.pending_sources)),
    h("td", { class: "num" }, fmtInt(cp.live_writers)),
    h("td", { class: "num" + (cp.anomalies > 0 ? " warn" : "") }, fmtInt(cp.anomalies)),
    h("td", { class: "num" + (cp.unreadable_files > 0 ? " bad" : "") }, fmtInt(cp.unreadable_files)),
    h("td", { class: "num", title: fmtStamp(cp.last_activity_at) }, fmtAgo(cp.last_activity_at)),
  );
}

function tableView(groups) {
  const n = 9;
  return h(
    "section",
    { class: "panel", "data-testid": "checkpoint-list" },
    h(
      "div",
      { class: "tablewrap" },
      h(
        "table",
        { "data-testid": "checkpoint-table" },
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            sortHead("name", "Name", ""),
            ["Status", "Completed", "Declared", "Pending", "Live writers", "Anomalies", "Unreadable"].map((t, i) => h("th", { class: i ? "num" : "" }, t)),
            sortHead("activity", "Last activity", "num"),
          ),
        ),
        groups.map(([prefix, members]) =>
          h(
            "tbody",
            { "data-key": "tg:" + prefix },
            prefix === null
              ? null
              : h("tr", { class: "group" }, h("th", { colspan: n, scope: "colgroup", "data-testid": "checkpoint-group", "data-prefix": prefix }, groupTitle(prefix, members))),
            members.map(checkpointRow),
          ),
        ),
      ),
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

/** The page for a ListPage. */
export function listView(list) {
  document.title = "Tally · checkpoints";
  if (list.checkpoints === null) return [h("div", { class: "empty" }, "Connecting to Tally…")];
  const all = list.checkpoints.slice().sort(byName);
  if (!all.length) return [replicasPanel(list.replicas), emptyState()];
  const needle = list.filter.trim().toLowerCase();
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
      h(
        "div",
        { class: "legend" },
        h(
          "div",
          { class: "seg", role: "group", "aria-label": "Show checkpoints as", "data-testid": "list-view" },
          LIST_VIEWS.map(([k, label]) =>
            h("button", { type: "button", "data-action": "list-view", "data-value": k, "aria-pressed": String(prefs.listView === k) }, label),
          ),
        ),
        prefs.listView === "table"
          ? null
          : h(
              "div",
              { class: "seg", role: "group", "aria-label": "Sort checkpoints by" },
              [
                ["name", "by name"],
                ["activity", "by activity"],
              ].map(([k, label]) =>
                h("button", { type: "button", "data-action": "list-sort", "data-value": k, "aria-pressed": String(prefs.listSort === k) }, label),
              ),
            ),
        all.length > 6
          ? h("input", {
              class: "btn",
              type: "search",
              placeholder: "Filter by name",
              "aria-label": "Filter checkpoints by name",
              "data-action": "filter",
              value: list.filter,
            })
          : null,
      ),
    ),
    replicasPanel(list.replicas),
    shown.length
      ? (prefs.listView === "table" ? tableView : cardsView)(groupsOf(shown))
      : h("div", { class: "panel empty" }, `No checkpoint matches “${list.filter}”.`),
  ];
}
