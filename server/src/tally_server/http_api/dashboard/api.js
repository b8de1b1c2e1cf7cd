/* The /v1 API as the dashboard reads it: JSON GETs with the bearer token, if any.
 *
 * Paths are relative, so the page works behind a path prefix.
 */

import { noteServerDate } from "./format.js";

const FETCH_TIMEOUT_MS = 10000;

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
      ctrl.abort(); // a no-op once the body was read whole
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
