/* What the dashboard knows: the route, the connection, the user's options, and one object per page.
 *
 * Modules that fetch (live.js) change this state and call changed(); the page re-renders from it.
 * Nothing here does I/O, so the rules for merging what arrives (stream snapshots with polled
 * histories, new events with loaded ones, incremental progress samples) sit in one place.
 */

import { namePath } from "./api.js";
import { serverNow } from "./format.js";

export const EVENTS_PAGE = 50;
// Closed writers read with the history (every live writer is read too: the stream carries them all).
export const WRITERS_LIMIT = 100;
export const WRITERS_PAGE = 50; // writer rows per page of the table
export const WRITER_SORTS = [
  ["state", "state"],
  ["id", "writer id"],
  ["completed", "completed"],
  ["seen", "last seen"],
];
const MAX_SAMPLES = 200000;
export const RANGES = [
  ["15m", 900],
  ["1h", 3600],
  ["6h", 21600],
  ["24h", 86400],
  ["7d", 604800],
  ["all", 0],
];

// ------------------------------------------------------------------ options that survive a reload

function stored(key, fallback) {
  try {
    const v = localStorage.getItem("tally." + key);
    return v === null ? fallback : JSON.parse(v);
  } catch (_) {
    return fallback;
  }
}

/** The user's choices, kept in localStorage: the plot's time range, whether closed writers show, the
 *  list as cards or a table and the table's order. */
export const prefs = {
  range: stored("range", "1h"),
  showClosed: stored("showClosed", true),
  listView: stored("listView", "cards"),
  listSort: stored("listSort", "name"),
};

export function setPref(key, value) {
  prefs[key] = value;
  try {
    localStorage.setItem("tally." + key, JSON.stringify(value));
  } catch (_) {
    /* private mode: fine */
  }
}

export const rangeSeconds = () => (RANGES.find(([k]) => k === prefs.range) || RANGES[1])[1];

// ------------------------------------------------------------------ routes (hash routing: names contain "/")

export function parseRoute() {
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

export const checkpointHref = (name) => "#/checkpoint/" + namePath(name);

// ------------------------------------------------------------------ pages

export const isLive = (w) => w.state === "open" || w.state === "live";

/** The list of checkpoints, kept across navigations so going back to it shows the last list at once. */
export class ListPage {
  constructor() {
    this.checkpoints = null; // null until the first answer
    this.filter = "";
    // The coordinators serving a PostgreSQL store, from /v1/replicas: {replicas, epoch, answeredBy};
    // null when there is nothing to show (the LMDB store lists none, or the call failed or was refused).
    this.replicas = null;
  }

  set(reply) {
    this.checkpoints = Array.isArray(reply.checkpoints) ? reply.checkpoints : [];
  }

  setReplicas(reply) {
    const listed = reply && Array.isArray(reply.replicas) ? reply.replicas.filter((r) => r && typeof r.name === "string") : [];
    this.replicas = listed.length
      ? {
          replicas: listed.slice().sort((a, b) => Number(Boolean(b.owner)) - Number(Boolean(a.owner)) || a.name.localeCompare(b.name)),
          epoch: Number(reply.epoch) || 0,
          answeredBy: typeof reply.answered_by === "string" ? reply.answered_by : "",
        }
      : null;
  }
}

/** One checkpoint's page: its live status (streamed) and the histories read beside it. */
export class CheckpointPage {
  constructor(name) {
    this.name = name;
    this.ready = false; // the first status and histories (or "not found") are in: render the page
    this.missing = false;
    this.cp = null; // the live status, from the stream
    this.history = null; // every writer (closed ones too) from /v1/writers; null: not read
    this.writersNote = null;
    this.events = []; // newest first
    this.eventsNext = null; // before_id for "load older"; 0 = nothing older; null = not read yet
    this.eventsNote = null;
    this.eventsLoading = false;
    this.eventsArrived = new Map(); // id -> ms when first seen after the first page (for the highlight)
    this.samples = []; // persisted progress samples in the plot's window, oldest first
    this.samplesKey = "";
    this.provisional = null; // the server's live count at the last read, not cached
    this.progressNote = null;
    this.writerView = { sort: "state", filter: "", page: 0 }; // the writer table's controls
  }

  /** Takes a status from the stream. True when the histories should be read again now: a writer came
   *  or went, or a problem was counted (each makes an event). */
  setStatus(cp) {
    const before = this.cp;
    this.cp = cp;
    this.missing = false;
    if (!before) return true;
    const ids = (x) => (x.writers || []).map((w) => `${w.writer_id}\u0000${w.opened_at}`).sort().join("\n");
    return ids(before) !== ids(cp) || before.anomalies !== cp.anomalies || before.unreadable_files !== cp.unreadable_files;
  }

  setMissing() {
    this.cp = null;
    this.missing = true;
    this.ready = true;
  }

  /** Writers to show: the history, with each live writer as fresh as either source has it. */
  writerRows() {
    const live = ((this.cp && this.cp.writers) || []).map((w) => ({ state: "open", ...w }));
    if (!this.history) return live;
    // A writer id has at most one live session, so live rows match on the id alone.
    const streamed = new Map(live.map((w) => [w.writer_id, w]));
    const rows = this.history.map((w) => {
      const fresh = isLive(w) ? streamed.get(w.writer_id) : undefined;
      if (!fresh) return w;
      streamed.delete(w.writer_id);
      return (fresh.last_seen_at || 0) >= (w.last_seen_at || 0) ? fresh : w;
    });
    // Writers opened since the history was read (it holds every writer live then: see live.js).
    return rows.concat(Array.from(streamed.values()));
  }

  closedWriters() {
    return this.history ? this.history.filter((w) => !isLive(w)).length : 0;
  }

  mergeEvents(page) {
    const events = Array.isArray(page.events) ? page.events : [];
    if (this.eventsNext === null) {
      this.events = events.slice().sort((a, b) => b.id - a.id);
      this.eventsNext = page.next_before_id || 0;
      return;
    }
    const known = new Set(this.events.map((e) => e.id));
    const newest = this.events.length ? this.events[0].id : 0;
    const fresh = events.filter((e) => !known.has(e.id) && e.id > newest);
    if (!fresh.length) return;
    const now = Date.now();
    for (const e of fresh) this.eventsArrived.set(e.id, now);
    if (events.length >= EVENTS_PAGE && fresh.length === events.length) {
      // More arrived than one page holds: start over from this page rather than show a gap.
      this.events = events.slice().sort((a, b) => b.id - a.id);
      this.eventsNext = page.next_before_id || 0;
      return;
    }
    this.events = fresh.concat(this.events).sort((a, b) => b.id - a.id);
  }

  addOlderEvents(page) {
    const known = new Set(this.events.map((e) => e.id));
    const older = (Array.isArray(page.events) ? page.events : []).filter((e) => !known.has(e.id));
    this.events = this.events.concat(older).sort((a, b) => b.id - a.id);
    this.eventsNext = page.next_before_id || 0;
  }

  /** What to ask /v1/progress for: only samples newer than those cached for the current range. */
  samplesQuery() {
    const span = rangeSeconds();
    const key = `${this.name}\u0000${prefs.range}`;
    const windowStart = span ? serverNow() - span : 0;
    const cached = this.samplesKey === key && this.samples.length;
    const since = cached ? this.samples[this.samples.length - 1].at : Math.max(0, Math.floor(windowStart));
    return { key, since, windowStart };
  }

  /** Persisted samples are cached and fetched incrementally; the server ends each reply with the live
   *  count "now", which is kept aside (provisional) rather than cached. */
  mergeSamples(reply, { key, windowStart }) {
    const incoming = (Array.isArray(reply.samples) ? reply.samples : [])
      .filter((p) => Number.isFinite(p.at) && Number.isFinite(p.completed_count))
      .sort((a, b) => a.at - b.at);
    this.provisional = incoming.length ? incoming.pop() : null;
    let samples = this.samplesKey === key ? this.samples : [];
    const last = samples.length ? samples[samples.length - 1].at : -Infinity;
    samples = samples.concat(incoming.filter((p) => p.at > last));
    if (windowStart > 0) {
      const first = samples.findIndex((p) => p.at >= windowStart);
      samples = first < 0 ? [] : samples.slice(first);
    }
    if (samples.length > MAX_SAMPLES) samples = samples.slice(samples.length - MAX_SAMPLES);
    this.samples = samples;
    this.samplesKey = key;
  }
}

// ------------------------------------------------------------------ the whole

export const state = {
  route: { page: "" }, // set by navigate() at start
  // What the connection indicator and the banner say. streaming: a live stream is open right now.
  conn: { error: null, auth: null, lastOk: 0, streaming: false },
  list: new ListPage(),
  checkpoint: null, // a CheckpointPage while on a checkpoint's page
  hoverAt: null, // fraction of the plot's width under the mouse
  chartWidth: 0,
};

/** Follows a new route: a checkpoint's page starts empty; the list keeps what it had. */
export function navigate(route) {
  const prev = state.route;
  state.route = route;
  if (route.page === prev.page && route.name === prev.name) return false;
  state.checkpoint = route.page === "checkpoint" ? new CheckpointPage(route.name) : null;
  state.hoverAt = null;
  return true;
}

const listeners = [];

export function onChange(fn) {
  listeners.push(fn);
}

/** Says the state changed (the page re-renders at the next frame). */
export function changed() {
  for (const fn of listeners) fn();
}
