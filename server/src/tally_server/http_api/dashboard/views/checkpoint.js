/* A checkpoint's page (#/checkpoint/<name>): headline tiles, the progress plot, writers, event log. */

import { chartView, currentRate, progressPoints } from "../chart.js";
import { h } from "../dom.js";
import { fmtAgo, fmtEta, fmtInt, fmtPercent, fmtRate, fmtStamp, plural, totalOf } from "../format.js";
import { RANGES, prefs, rangeSeconds } from "../state.js";
import { activityPill } from "./common.js";
import { eventsPanel } from "./events.js";
import { writersPanel } from "./writers.js";

function tile(label, value, sub, level, testid, extraClass) {
  return h(
    "div",
    { class: ["tile", level || "", extraClass || ""].join(" ").trim(), "data-testid": testid },
    h("div", { class: "tl" }, label),
    h("div", { class: "tv", "data-testid": testid + "-value" }, value),
    h("div", { class: "ts" }, sub || ""),
  );
}

function pageHead(cp, crumbs) {
  const fingerprint = Object.entries(cp.fingerprint || {});
  return h(
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
        // On a PostgreSQL store: the replica applying this checkpoint's deltas (the store's owner).
        cp.owner
          ? [" · ", h("span", { "data-testid": "owner", title: "the replica applying this checkpoint's deltas" }, "Owner: ", h("b", { "data-testid": "owner-name" }, cp.owner))]
          : null,
        fingerprint.length
          ? [" · fingerprint ", fingerprint.map(([k, v]) => h("span", { class: "chip" }, h("span", { class: "k" }, k + " "), h("span", { class: "v" }, v)))]
          : null,
      ),
    ),
    h(
      "div",
      { class: "page-sub", title: fmtStamp(cp.last_activity_at) },
      "Last activity ",
      h("b", { "data-testid": "last-activity" }, fmtAgo(cp.last_activity_at)),
    ),
  );
}

/** "N of TOTAL (P %)" and a bar, once the checkpoint's sources were declared. */
function ofTotal(cp, total) {
  return [
    h("span", { "data-testid": "of-total" }, `${fmtInt(cp.completed_count)} of ${fmtInt(cp.total)} (${fmtPercent(total.percent)})`),
    h("progress", { class: "total-bar", max: cp.total, value: Math.min(cp.completed_count, cp.total), "data-testid": "total-bar" }),
  ];
}

function etaTile(total, rate) {
  const sub = total.left === 0 ? "every declared source completed" : `${fmtInt(total.left)} remaining` + (rate > 0 ? " at the current rate" : "");
  return tile("ETA", fmtEta(total.left, rate), sub, "", "eta");
}

function tiles(cp, rate, closed) {
  // Declared totals: a percent and an ETA only when the pipeline declared its sources.
  const total = totalOf(cp);
  return h(
    "div",
    { class: "tiles" },
    tile("Completed sources", fmtInt(cp.completed_count), total ? ofTotal(cp, total) : "durable, across all writers", "", "completed", "hero"),
    tile("Rate", rate === null ? "—" : fmtRate(rate), rate === null ? "waiting for samples" : "over the last minute", "", "rate"),
    total ? etaTile(total, rate) : null,
    tile(
      "Pending sources",
      fmtInt(cp.pending_sources),
      cp.settling_sources > 0 ? `${fmtInt(cp.settling_sources)} settling` : "in flight in live writers",
      "",
      "pending",
    ),
    tile(
      "Live writers",
      fmtInt(cp.live_writers),
      [closed ? `${fmtInt(closed)} closed` : "", cp.claimed_sources > 0 ? `${plural(cp.claimed_sources, "source")} claimed` : ""]
        .filter(Boolean)
        .join(" · "),
      "",
      "live-writers",
    ),
    tile("Anomalies", fmtInt(cp.anomalies), cp.anomalies > 0 ? "sources un-completed, replaying" : "none", cp.anomalies > 0 ? "warn" : "", "anomalies"),
    tile(
      "Unreadable files",
      fmtInt(cp.unreadable_files),
      cp.unreadable_files > 0 ? "completion files skipped — check the log" : "none",
      cp.unreadable_files > 0 ? "bad" : "",
      "unreadable",
    ),
    // Failure budgets: shown once the checkpoint has a budget or a failed source.
    cp.max_attempts > 0 || cp.failed_sources > 0
      ? tile(
          "Failed sources",
          fmtInt(cp.failed_sources || 0),
          `${plural(cp.max_attempts, "failed attempt")} each; skipped until tally retry`,
          cp.failed_sources > 0 ? "bad" : "",
          "failed",
        )
      : null,
  );
}

function progressPanel(page, chart) {
  return h(
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
            h("button", { type: "button", "data-action": "range", "data-range": key, "aria-pressed": String(prefs.range === key) }, key),
          ),
        ),
      ),
    ),
    page.progressNote ? h("div", { class: "panel-body sub" }, page.progressNote) : null,
    h("div", { class: "chart-wrap", id: "chart-box" }, chartView(page, { span: rangeSeconds(), ...chart })),
  );
}

/** The page for a CheckpointPage; chart: {width, hoverAt} of the plot. */
export function checkpointView(page, chart) {
  document.title = `Tally · ${page.name}`;
  const crumbs = h("div", { class: "crumbs" }, h("a", { href: "#/" }, "← All checkpoints"));
  if (!page.ready) return [crumbs, h("div", { class: "empty" }, "Loading ", h("b", {}, page.name), "…")];
  if (page.missing || !page.cp) {
    return [
      crumbs,
      h(
        "div",
        { class: "panel empty empty-big", "data-testid": "not-found" },
        h("div", { class: "empty-title" }, `No checkpoint named “${page.name}”`),
        h("div", {}, "It will appear here as soon as a writer opens it. This page keeps checking."),
      ),
    ];
  }
  const cp = page.cp;
  return [
    pageHead(cp, crumbs),
    tiles(cp, currentRate(progressPoints(page)), page.closedWriters()),
    progressPanel(page, chart),
    writersPanel(page),
    eventsPanel(page),
  ];
}
