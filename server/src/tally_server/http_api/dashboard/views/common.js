/* Pieces the list and a checkpoint's page share. */

import { h } from "../dom.js";

export function activityPill(cp) {
  return cp.live_writers > 0
    ? h("span", { class: "pill ok", "data-testid": "status" }, "running")
    : h("span", { class: "pill", "data-testid": "status" }, "idle");
}

/** How a checkpoint is marked: red for unreadable files, amber for anomalies. */
export const severity = (cp) => (cp.unreadable_files > 0 ? "bad" : cp.anomalies > 0 ? "warn" : "");
