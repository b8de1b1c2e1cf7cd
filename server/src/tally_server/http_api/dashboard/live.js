/* Keeping the current page's state current.
 *
 * A checkpoint's page follows its live status over the watch stream (GET /v1/watch, Server-Sent
 * Events): a change on the server shows within about a second, and nothing is asked while nothing
 * changes. What has no stream (the list of checkpoints, a checkpoint's writer history, event log and
 * progress samples) is polled every POLL_MS, and a checkpoint's histories are also read again as soon
 * as the stream says a writer came or went or a problem was counted.
 */

import { ApiError, getJson, getPages, getToken, watch } from "./api.js";
import { EVENTS_PAGE, WRITERS_LIMIT, changed, prefs, state } from "./state.js";

const POLL_MS = 5000;
export const RETRY_MS = 2000; // after a failure: the banner says so
const WATCH_INTERVAL_MS = 1000; // how often the server looks for a change to send
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

/** A panel's note when its history could not be read; null when the failure is the connection's (the
 *  banner or the sign-in form says so, and the panel keeps what it showed). */
function panelNote(what, err) {
  if (err.status === 0 || err.status === 401 || err.status === 403) return undefined;
  return err.status === 404 || err.status === 405
    ? `${what} is not available from this server (${err.message})`
    : `${what} could not be loaded: ${err.message}`;
}

// The token /v1/replicas refused (403: scoped to a checkpoint prefix) or any token when the server has
// no such route (404, 405: older than replicas), so the list stops asking until the token changes.
let replicasRefusedFor = null;

/** The checkpoint list, polled; beside it the store's replicas (a panel that is there or not). */
class ListSession {
  constructor() {
    this.ctrl = new AbortController();
    this.timer = 0;
    this.generation = 0;
    this.replicasBusy = false;
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
    let wait = POLL_MS;
    this.readReplicas(); // on its own: a slow database read never holds the list back
    try {
      // Counts only: the list shows no writer, and with them a page carries every live writer.
      const reply = await getPages("v1/checkpoints?writers=false", "checkpoints", this.ctrl.signal);
      if (stale()) return;
      state.list.set(reply);
      succeeded();
    } catch (err) {
      if (stale()) return;
      failed(err);
      wait = RETRY_MS;
    }
    changed();
    this.timer = setTimeout(() => this.poll(), wait);
  }

  /** The replicas panel's data. Any failure only hides the panel: the list and the banner say how the
   *  connection is, and a token scoped to some checkpoints may read them but not the replicas. */
  async readReplicas() {
    if (this.replicasBusy) return;
    const stale = () => this.ctrl.signal.aborted;
    const token = getToken();
    if (replicasRefusedFor !== null && replicasRefusedFor === token) {
      state.list.replicas = null;
      return;
    }
    this.replicasBusy = true;
    try {
      const reply = await getJson("v1/replicas", this.ctrl.signal);
      if (stale()) return;
      state.list.setReplicas(reply);
    } catch (err) {
      if (stale()) return;
      state.list.replicas = null;
      if (err.status === 403 || err.status === 404 || err.status === 405) replicasRefusedFor = token;
    } finally {
      this.replicasBusy = false;
    }
    changed();
  }
}

/** One checkpoint: its status streamed, its histories polled. */
class CheckpointSession {
  constructor(page) {
    this.page = page;
    this.ctrl = new AbortController();
    this.streamTimer = 0;
    this.watching = false;
    this.sideTimer = 0;
    this.sideBusy = false;
    this.sideAgain = false;
  }

  get stopped() {
    return this.ctrl.signal.aborted;
  }

  start() {
    this.connect();
  }

  stop() {
    this.ctrl.abort();
    clearTimeout(this.streamTimer);
    clearTimeout(this.sideTimer);
    state.conn.streaming = false;
  }

  refresh() {
    if (!this.watching) this.connect();
    this.readHistories();
  }

  async connect() {
    clearTimeout(this.streamTimer);
    this.watching = true;
    const page = this.page;
    const started = Date.now();
    let wait = RETRY_MS;
    try {
      await watch(`v1/watch?checkpoint=${q(page.name)}&interval_ms=${WATCH_INTERVAL_MS}`, {
        signal: this.ctrl.signal,
        onOpen: () => {
          if (!this.stopped) state.conn.streaming = true;
        },
        onMessage: (cp) => {
          if (this.stopped) return;
          if (page.setStatus(cp)) this.readHistories();
          succeeded();
          if (page.ready) changed(); // the first status shows with its histories
        },
      });
      // The server ended the stream (it is stopping, or a proxy cut a long response): reconnect, at
      // once unless that keeps happening.
      if (Date.now() - started > RETRY_MS) wait = 0;
      if (!this.stopped) state.conn.lastOk = Date.now();
    } catch (err) {
      if (this.stopped) return;
      if (err.status === 404) {
        page.setMissing(); // "appears as soon as a writer opens it": keep asking
        succeeded();
      } else {
        if (state.conn.streaming) state.conn.lastOk = Date.now(); // live until this moment
        failed(err);
        // Asking again does not help a refused token; a sign-in reconnects at once.
        if (state.conn.auth) wait = POLL_MS;
      }
      changed();
    } finally {
      this.watching = false;
      if (!this.stopped) state.conn.streaming = false; // a stopped session's flag is its successor's now
    }
    if (!this.stopped) this.streamTimer = setTimeout(() => this.connect(), wait);
  }

  /** Writers (closed ones too), the newest events and new progress samples, in parallel. */
  async readHistories() {
    if (this.sideBusy) {
      this.sideAgain = true;
      return;
    }
    clearTimeout(this.sideTimer);
    const page = this.page;
    if (!page.cp) return; // nothing to show them with yet: the first status reads them
    this.sideBusy = true;
    const enc = q(page.name);
    const liveCount = (page.cp.writers || []).length;
    const samples = page.samplesQuery();
    const signal = this.ctrl.signal;
    try {
      const [writers, events, progress] = await Promise.allSettled([
        // Every live writer (the stream has them all, so does the table) and the latest closed ones.
        getPages(`v1/writers?checkpoint=${enc}&include_closed=${prefs.showClosed}`, "writers", signal, {
          want: liveCount + WRITERS_LIMIT,
          identity: (w) => `${w.writer_id} ${w.opened_at}`,
        }),
        getJson(`v1/events?checkpoint=${enc}&limit=${EVENTS_PAGE}`, signal),
        getJson(`v1/progress?checkpoint=${enc}&since=${samples.since}`, signal),
      ]);
      if (this.stopped) return;
      if (writers.status === "fulfilled") {
        page.history = Array.isArray(writers.value.writers) ? writers.value.writers : [];
        page.writersNote = null;
      } else if (panelNote("The writer history", writers.reason) !== undefined) {
        page.history = null; // fall back to the live writers in the status
        page.writersNote = panelNote("The writer history", writers.reason);
      }
      if (events.status === "fulfilled") {
        page.mergeEvents(events.value);
        page.eventsNote = null;
      } else {
        page.eventsNote = panelNote("The event log", events.reason) ?? page.eventsNote;
      }
      if (progress.status === "fulfilled") {
        page.mergeSamples(progress.value, samples);
        page.progressNote = null;
      } else {
        page.progressNote = panelNote("Progress history", progress.reason) ?? page.progressNote;
      }
      page.ready = true;
      changed();
    } finally {
      this.sideBusy = false;
      if (!this.stopped) {
        if (this.sideAgain) {
          this.sideAgain = false;
          this.readHistories();
        } else {
          this.sideTimer = setTimeout(() => this.readHistories(), POLL_MS);
        }
      }
    }
  }

  async loadOlderEvents() {
    const page = this.page;
    if (!page.eventsNext || page.eventsLoading) return;
    page.eventsLoading = true;
    changed();
    try {
      const reply = await getJson(
        `v1/events?checkpoint=${q(page.name)}&limit=${EVENTS_PAGE}&before_id=${page.eventsNext}`,
        this.ctrl.signal,
      );
      if (this.stopped) return;
      page.addOlderEvents(reply);
      page.eventsNote = null;
    } catch (err) {
      if (this.stopped) return;
      page.eventsNote = panelNote("Older events", err) ?? `Older events could not be loaded: ${err.message}`;
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
  session = state.checkpoint ? new CheckpointSession(state.checkpoint) : new ListSession();
  session.start();
}

/** Reads now rather than at the next tick: after a sign-in, a changed option, a tab shown again. */
export function refresh() {
  if (session) session.refresh();
}

export function loadOlderEvents() {
  if (session instanceof CheckpointSession) session.loadOlderEvents();
}
