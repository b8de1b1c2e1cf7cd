/* Keeping the current page's state current: every POLL_MS its data is read again from the /v1 API (a
 * checkpoint's status, writers, newest events and new progress samples in parallel).
 */

import { ApiError, getJson, namePath } from "./api.js";
import { EVENTS_PAGE, WRITERS_LIMIT, changed, prefs, state } from "./state.js";

export const POLL_MS = 2000;
const q = encodeURIComponent;

function succeeded() {
  state.conn.error = null;
  state.conn.auth = null;
  state.conn.lastOk = Date.now();
}

function failed(err) {
  const error = err instanceof Error ? err : new ApiError(0, String(err));
  const denied = error.status === 401 || error.status === 403;
  state.conn.auth = denied ? error : null;
  state.conn.error = denied ? null : error;
}

/** A panel's note when its history could not be read. */
const panelNote = (what, err) =>
  err.status === 404 || err.status === 405
    ? `${what} is not available from this server (${err.message})`
    : `${what} could not be loaded: ${err.message}`;

async function readList(signal) {
  const reply = await getJson("v1/checkpoints", signal);
  return () => state.list.set(reply);
}

async function readCheckpoint(page, signal) {
  const enc = q(page.name);
  const samples = page.samplesQuery();
  const [cp, writers, events, progress] = await Promise.allSettled([
    getJson("v1/checkpoints/" + namePath(page.name), signal),
    getJson(`v1/writers?checkpoint=${enc}&include_closed=${prefs.showClosed}&limit=${WRITERS_LIMIT}`, signal),
    getJson(`v1/events?checkpoint=${enc}&limit=${EVENTS_PAGE}`, signal),
    getJson(`v1/progress?checkpoint=${enc}&since=${samples.since}`, signal),
  ]);
  if (cp.status === "rejected" && cp.reason.status !== 404) throw cp.reason;
  return () => {
    if (cp.status === "rejected") {
      page.setMissing();
      return;
    }
    page.setStatus(cp.value);
    page.ready = true;
    if (writers.status === "fulfilled") {
      page.history = Array.isArray(writers.value.writers) ? writers.value.writers : [];
      page.writersNote = null;
    } else {
      page.history = null; // fall back to the live writers in the status
      page.writersNote = panelNote("The writer history", writers.reason);
    }
    if (events.status === "fulfilled") {
      page.mergeEvents(events.value);
      page.eventsNote = null;
    } else {
      page.eventsNote = panelNote("The event log", events.reason);
    }
    if (progress.status === "fulfilled") {
      page.mergeSamples(progress.value, samples);
      page.progressNote = null;
    } else {
      page.progressNote = panelNote("Progress history", progress.reason);
    }
  };
}

/** Reads the current page's data every POLL_MS. */
class Session {
  constructor(page) {
    this.page = page; // a CheckpointPage, or null for the list
    this.ctrl = new AbortController();
    this.timer = 0;
    this.generation = 0;
  }

  start() {
    this.poll();
  }

  stop() {
    this.ctrl.abort();
    clearTimeout(this.timer);
  }

  refresh() {
    this.poll();
  }

  async poll() {
    clearTimeout(this.timer);
    const gen = ++this.generation;
    const stale = () => this.ctrl.signal.aborted || gen !== this.generation;
    try {
      const apply = this.page ? await readCheckpoint(this.page, this.ctrl.signal) : await readList(this.ctrl.signal);
      if (stale()) return;
      apply();
      succeeded();
    } catch (err) {
      if (stale()) return;
      failed(err);
    }
    changed();
    this.timer = setTimeout(() => this.poll(), POLL_MS);
  }

  async loadOlderEvents() {
    const page = this.page;
    if (!page || !page.eventsNext || page.eventsLoading) return;
    page.eventsLoading = true;
    changed();
    try {
      const reply = await getJson(
        `v1/events?checkpoint=${q(page.name)}&limit=${EVENTS_PAGE}&before_id=${page.eventsNext}`,
        this.ctrl.signal,
      );
      if (this.ctrl.signal.aborted) return;
      page.addOlderEvents(reply);
      page.eventsNote = null;
    } catch (err) {
      if (this.ctrl.signal.aborted) return;
      page.eventsNote = panelNote("Older events", err);
    } finally {
      page.eventsLoading = false;
      changed();
    }
  }
}

let session = null;

/** Follows the current route (and stops following the previous one). */
export function follow() {
  if (session) session.stop();
  session = new Session(state.checkpoint);
  session.start();
}

/** Reads now rather than at the next tick: after a sign-in, a changed option, a tab shown again. */
export function refresh() {
  if (session) session.refresh();
}

export function loadOlderEvents() {
  if (session) session.loadOlderEvents();
}
