/* The coordinators serving a PostgreSQL store (GET /v1/replicas), as a strip on the list page: which one
 * owns the store (applies every writer's deltas; on a store of several shards, which shards each owns),
 * which are replicas forwarding to it, and whether each
 * still renews its row. Not shown on the LMDB store (none listed) nor when the call failed or was refused. */

import { h } from "../dom.js";
import { fmtDuration, fmtInt, fmtStamp } from "../format.js";

// The server's own test: a replica that renewed its row within this many seconds is alive.
export const ALIVE_S = 5;

// On a store of several shards a coordinator owns the shards it holds: "owner of 0, 2".
function ownerOf(shards) {
  return Array.isArray(shards) && shards.length ? "owner of " + shards.join(", ") : "owner";
}

function replicaItem(r, answeredBy) {
  const silent = Number(r.silent_s);
  const alive = Number.isFinite(silent) && silent < ALIVE_S;
  const started = Number(r.started_at) || 0;
  return h(
    "li",
    {
      class: "replica" + (r.owner ? " owner" : "") + (alive ? "" : " stale"),
      "data-key": "replica:" + r.name,
      "data-testid": "replica",
      "data-name": r.name,
      "data-role": r.owner ? "owner" : "replica",
      "data-alive": String(alive),
      title: [r.http_address ? `HTTP ${r.http_address}` : "", started > 0 ? `started ${fmtStamp(started)}` : ""].filter(Boolean).join(" · "),
    },
    h("span", { class: "replica-name", "data-testid": "replica-name" }, r.name),
    r.owner
      ? h("span", { class: "pill ok", "data-testid": "replica-role" }, ownerOf(r.shards))
      : h("span", { class: "pill", "data-testid": "replica-role" }, "replica"),
    h("span", { class: "mono replica-addr", "data-testid": "replica-grpc" }, r.grpc_address || "—"),
    r.name === answeredBy ? h("span", { class: "sub" }, "this page’s server") : null,
    h(
      "span",
      { class: "replica-seen" + (alive ? "" : " bad"), "data-testid": "replica-seen" },
      Number.isFinite(silent) ? `last seen ${fmtDuration(silent)} ago` : "last seen —",
      alive ? null : " · not alive",
    ),
  );
}

/** The strip for ListPage.replicas, or null when there is nothing to show. */
export function replicasPanel(info) {
  if (!info || !info.replicas.length) return null;
  return h(
    "section",
    { class: "panel replicas", "data-testid": "replicas" },
    h(
      "div",
      { class: "panel-head" },
      h("h2", { class: "panel-title" }, "Replicas"),
      h(
        "div",
        { class: "panel-note" },
        h("span", { "data-testid": "replicas-epoch" }, `epoch ${fmtInt(info.epoch)}`),
        info.answeredBy ? [" · answered by ", h("b", { "data-testid": "replicas-answered-by" }, info.answeredBy)] : null,
      ),
    ),
    h("ul", { class: "replica-list" }, info.replicas.map((r) => replicaItem(r, info.answeredBy))),
  );
}
