/* The list of checkpoints (#/): one card each, totals on top, a name filter once there are many. */

import { h } from "../dom.js";
import { fmtAgo, fmtInt, fmtPercent, fmtStamp, plural, totalOf } from "../format.js";
import { checkpointHref } from "../state.js";
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
        ? h("span", { class: "unit pct", "data-testid": "percent", title: `${fmtInt(cp.completed_count)} of ${fmtInt(cp.total)} declared sources` }, `${fmtPercent(total.percent)} of ${fmtInt(cp.total)}`)
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
  const all = list.checkpoints.slice().sort((a, b) => a.name.localeCompare(b.name));
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
    replicasPanel(list.replicas),
    shown.length
      ? h("div", { class: "cards", "data-testid": "checkpoint-list" }, shown.map(checkpointCard))
      : h("div", { class: "panel empty" }, `No checkpoint matches “${list.filter}”.`),
  ];
}
