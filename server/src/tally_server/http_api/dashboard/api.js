/* The /v1 API as the dashboard reads it: JSON GETs, and the live status stream (Server-Sent Events).
 *
 * The stream is read with fetch() and a stream reader rather than EventSource, because EventSource
 * cannot send the Authorization header a server with tokens asks for (and a token in the URL would end
 * up in proxy logs). Paths are relative, so the page works behind a path prefix.
 */

import { noteServerDate } from "./format.js";

const FETCH_TIMEOUT_MS = 10000;
// The server re-sends an unchanged status every ~15 s, so a stream quiet for longer than this is dead
// (a half-open connection after a network cut never errors by itself).
const STREAM_IDLE_MS = 35000;

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// A bearer token, when the server has authentication on (any role may read). Kept in this tab only.
let token = "";
try {
  token = sessionStorage.getItem("tally.token") || "";
} catch (_) {
  token = "";
}

export const getToken = () => token;

export function setToken(value) {
  token = value;
  try {
    if (value) sessionStorage.setItem("tally.token", value);
    else sessionStorage.removeItem("tally.token");
  } catch (_) {
    /* storage disabled: keep it in memory */
  }
}

/** Checkpoint names go into paths segment by segment, keeping their "/". */
export const namePath = (name) => name.split("/").map(encodeURIComponent).join("/");

/** A deadline on a request, and the caller's signal (leaving the page) folded into one. */
function deadline(signal) {
  const ctrl = new AbortController();
  let why = "";
  let timer = 0;
  const arm = (ms, reason) => {
    clearTimeout(timer);
    timer = setTimeout(() => {
      why = reason;
      ctrl.abort();
    }, ms);
  };
  const cancel = () => ctrl.abort();
  if (signal) signal.addEventListener("abort", cancel);
  return {
    signal: ctrl.signal,
    arm,
    why: () => why,
    done() {
      clearTimeout(timer);
      if (signal) signal.removeEventListener("abort", cancel);
      ctrl.abort(); // lets go of a stream's connection; a no-op once a body was read whole
    },
  };
}

async function send(path, accept, limit) {
  const headers = { Accept: accept };
  if (token) headers.Authorization = "Bearer " + token;
  let response;
  try {
    response = await fetch(path, { headers, cache: "no-store", signal: limit.signal });
  } catch (err) {
    throw new ApiError(0, `${limit.why() || "network error"} (GET /${path})`);
  }
  noteServerDate(response.headers.get("date"));
  if (!response.ok) {
    let body = null;
    try {
      body = await response.json();
    } catch (_) {
      body = null;
    }
    const detail = body && body.error && body.error.message ? body.error.message : response.statusText;
    throw new ApiError(response.status, `HTTP ${response.status}: ${detail}`);
  }
  return response;
}

/** GET a JSON document. Rejects with an ApiError (status 0: no answer). */
export async function getJson(path, signal) {
  const limit = deadline(signal);
  limit.arm(FETCH_TIMEOUT_MS, `no answer within ${FETCH_TIMEOUT_MS / 1000} s`);
  try {
    const response = await send(path, "application/json", limit);
    try {
      return await response.json();
    } catch (_) {
      throw new ApiError(0, `${limit.why() || "unreadable answer"} (GET /${path})`);
    }
  } finally {
    limit.done();
  }
}

// Items asked for per page of a list that pages with after / limit / next_after (the server's default).
const PAGE_SIZE = 1000;

/** GET a list route page by page, following next_after: resolves to { [key]: every item }.
 *
 * Stops once `want` items are in (the route's order decides which). `identity(item)` drops an item
 * listed twice (a writer that ended between two pages comes again among the ended ones).
 */
export async function getPages(path, key, signal, { want = Infinity, identity = null } = {}) {
  const items = [];
  const seen = new Set();
  const joiner = path.includes("?") ? "&" : "?";
  let after = "";
  for (;;) {
    const limit = Math.max(1, Math.min(PAGE_SIZE, want - items.length));
    const cursor = after ? `&after=${encodeURIComponent(after)}` : "";
    const reply = await getJson(`${path}${joiner}limit=${limit}${cursor}`, signal);
    for (const item of reply && Array.isArray(reply[key]) ? reply[key] : []) {
      const id = identity ? identity(item) : null;
      if (id !== null && seen.has(id)) continue;
      if (id !== null) seen.add(id);
      items.push(item);
    }
    const next = reply && typeof reply.next_after === "string" ? reply.next_after : "";
    if (!next || next === after || items.length >= want) return { [key]: items.slice(0, want) };
    after = next;
  }
}

/** Splits Server-Sent Events text into the data of each event (the only field /v1/watch sends).
 *  Exported for the browser test, which feeds it every chunking of a tricky stream. */
export class SseParser {
  constructor() {
    this.buffer = "";
    this.data = [];
  }

  /** Feeds a chunk of text; returns the events it completed. */
  push(text) {
    this.buffer += text;
    // A "\r" at the very end may be the first half of a "\r\n" split across chunks: keep it for later.
    const lines = this.buffer.split(/\r\n|\n|\r(?!$)/);
    this.buffer = lines.pop();
    const events = [];
    for (const line of lines) {
      if (line === "") {
        if (this.data.length) events.push(this.data.join("\n"));
        this.data = [];
      } else if (line.startsWith("data:")) {
        this.data.push(line.slice(line[5] === " " ? 6 : 5));
      } // comments (":…") and other fields (event, id, retry) carry nothing for us
    }
    return events;
  }
}

/** Reads an event stream, calling onMessage(json) for each event, until it ends or signal aborts.
 *
 * onOpen() is called once the server accepted the request. Resolves when the server ended the stream;
 * rejects with an ApiError when it refused it (e.g. 404, 401), could not be reached, or went quiet.
 */
export async function watch(path, { onOpen, onMessage, signal }) {
  const limit = deadline(signal);
  limit.arm(FETCH_TIMEOUT_MS, `no answer within ${FETCH_TIMEOUT_MS / 1000} s`);
  try {
    const response = await send(path, "text/event-stream", limit);
    const quiet = `the live stream was silent for ${STREAM_IDLE_MS / 1000} s`;
    limit.arm(STREAM_IDLE_MS, quiet);
    onOpen();
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    const parser = new SseParser();
    for (;;) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch (_) {
        throw new ApiError(0, `${limit.why() || "the live stream was cut"} (GET /${path})`);
      }
      if (chunk.done) return;
      limit.arm(STREAM_IDLE_MS, quiet);
      for (const data of parser.push(chunk.value)) {
        let message;
        try {
          message = JSON.parse(data);
        } catch (_) {
          throw new ApiError(0, `the live stream sent something that is not JSON (GET /${path})`);
        }
        onMessage(message);
      }
    }
  } finally {
    limit.done();
  }
}
