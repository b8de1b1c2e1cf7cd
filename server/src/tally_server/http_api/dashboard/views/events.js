/* The event log of a checkpoint's page: newest first, new arrivals highlighted, older pages on demand. */

import { h } from "../dom.js";
import { fmtAgo, fmtStamp, plural } from "../format.js";

const HIGHLIGHT_MS = 4000;

/** The style of an event's severity (set by the server from the kind; info has none). */
const SEVERITY_CLASS = new Map([["error", "bad"], ["warning", "warn"]]);

function eventData(data) {
  const entries = Object.entries(data || {});
  if (!entries.length) return null;
  const text = entries.map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`).join("  ");
  return h("div", { class: "sub mono" }, text.length > 240 ? text.slice(0, 239) + "…" : text);
}

/** The panel for a CheckpointPage's events. */
export function eventsPanel(page) {
  const now = Date.now();
  const rows = page.events.map((e) => {
    const arrived = page.eventsArrived.get(e.id);
    return h(
      "tr",
      { "data-key": "e:" + e.id, "data-testid": "event-row", class: arrived && now - arrived < HIGHLIGHT_MS ? "ev-new" : "" },
      h("td", { class: "nowrap", title: fmtStamp(e.at) }, fmtAgo(e.at), h("div", { class: "sub" }, fmtStamp(e.at))),
      h("td", {}, h("span", { class: "ev-kind " + (SEVERITY_CLASS.get(e.severity) || ""), "data-testid": "event-kind" }, (e.kind || "").replace(/_/g, " "))),
      h("td", { class: "mono sub" }, e.writer_id || ""),
      h("td", { class: "ev-msg" }, e.message || "", eventData(e.data)),
    );
  });
  let more;
  if (page.eventsNext) {
    more = h(
      "button",
      { class: "btn", type: "button", "data-action": "older", "data-testid": "load-older", disabled: page.eventsLoading },
      page.eventsLoading ? "Loading…" : "Load older events",
    );
  } else if (page.events.length) {
    more = h("span", { class: "sub" }, "Beginning of the log");
  }
  return h(
    "section",
    { class: "panel", "data-testid": "events" },
    h(
      "div",
      { class: "panel-head" },
      h("h2", { class: "panel-title" }, "Event log"),
      h("span", { class: "panel-note" }, page.events.length ? `newest first · ${plural(page.events.length, "event")} loaded` : ""),
    ),
    page.eventsNote ? h("div", { class: "panel-body sub" }, page.eventsNote) : null,
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
      : page.eventsNote
        ? null
        : h("div", { class: "empty" }, "No events yet."),
    more ? h("div", { class: "more" }, more) : null,
  );
}
