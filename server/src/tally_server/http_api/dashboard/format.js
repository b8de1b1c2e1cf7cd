/* Numbers, durations, clocks and rates as the dashboard shows them; "now" on the server's clock. */

let skew = 0; // server clock minus browser clock, seconds (from the Date header)

/** Takes the server's clock from a response's Date header (ignored within 2 s: header resolution). */
export function noteServerDate(header) {
  if (!header) return;
  const offset = Date.parse(header) / 1000 - Date.now() / 1000;
  skew = Number.isFinite(offset) && Math.abs(offset) > 2 ? offset : 0;
}

/** Seconds since the epoch on the server's clock, which stamped every time the API returns. */
export const serverNow = () => Date.now() / 1000 + skew;

// One formatter, made once: toLocaleString() builds a new one per call, a hot spot with hundreds of cells.
const GROUPED = new Intl.NumberFormat("en-US");

export const fmtInt = (n) => (Number.isFinite(n) ? GROUPED.format(Math.round(n)) : "—");

export function fmtCompact(v) {
  const a = Math.abs(v);
  const strip = (x) => x.replace(/\.0$/, "");
  if (a >= 1e9) return strip((v / 1e9).toFixed(1)) + "G";
  if (a >= 1e6) return strip((v / 1e6).toFixed(a >= 1e7 ? 0 : 1)) + "M";
  if (a >= 1e4) return strip((v / 1e3).toFixed(a >= 1e5 ? 0 : 1)) + "k";
  if (Number.isInteger(v)) return GROUPED.format(v);
  return strip(v.toFixed(a >= 10 ? 1 : 2));
}

export function fmtDuration(sec) {
  sec = Math.max(0, sec);
  if (sec < 60) return `${Math.floor(sec)} s`;
  if (sec < 3600) return `${Math.floor(sec / 60)} min`;
  if (sec < 86400) {
    const m = Math.floor((sec % 3600) / 60);
    return `${Math.floor(sec / 3600)} h` + (m ? ` ${m} min` : "");
  }
  const hrs = Math.floor((sec % 86400) / 3600);
  return `${Math.floor(sec / 86400)} d` + (hrs ? ` ${hrs} h` : "");
}

export function fmtAgo(t) {
  if (!t || t <= 0) return "never";
  const d = serverNow() - t;
  if (d < 1.5) return "just now";
  return fmtDuration(d) + " ago";
}

const pad = (n) => String(n).padStart(2, "0");
const MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];

export function fmtClock(t, withSeconds = true) {
  const d = new Date(t * 1000);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}` + (withSeconds ? `:${pad(d.getSeconds())}` : "");
}

export function fmtDay(t) {
  const d = new Date(t * 1000);
  return `${MONTHS[d.getMonth()]} ${d.getDate()}`;
}

export function fmtStamp(t) {
  if (!t || t <= 0) return "";
  const d = new Date(t * 1000);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${fmtClock(t)}`;
}

/** The unit that keeps a rate readable: per second when fast, per minute or hour when slow. */
export function rateUnit(perSec) {
  if (perSec >= 1) return { mul: 1, label: "/s", long: "per second" };
  if (perSec * 60 >= 1) return { mul: 60, label: "/min", long: "per minute" };
  return { mul: 3600, label: "/h", long: "per hour" };
}

function fmtRateValue(v) {
  if (v === 0) return "0";
  if (v >= 100) return fmtInt(v);
  if (v >= 10) return v.toFixed(1).replace(/\.0$/, "");
  return v.toFixed(2).replace(/0$/, "").replace(/\.0$/, "");
}

export function fmtRate(perSec) {
  if (!(perSec > 0)) return "0 /min";
  const u = rateUnit(perSec);
  return `${fmtRateValue(perSec * u.mul)} ${u.label}`;
}

export const plural = (n, one, many) => `${fmtInt(n)} ${n === 1 ? one : many || one + "s"}`;

/** A checkpoint's declared sources: {percent, left} once a total was declared, else null (no bar, no ETA:
 * without a total, completed + pending is not one). */
export function totalOf(cp) {
  if (!(cp.total > 0)) return null;
  const done = cp.completed_count || 0;
  const left = cp.remaining >= 0 ? cp.remaining : Math.max(0, cp.total - done);
  return { percent: Math.min(100, (100 * done) / cp.total), left };
}

/** One decimal; never "100.0 %" before the last source completes. */
export const fmtPercent = (p) => (p >= 99.95 && p < 100 ? "99.9" : p.toFixed(1)) + " %";

/** Time left for `left` sources at `perSec`: "done", "—" without a rate, else a duration. */
export function fmtEta(left, perSec) {
  if (left === 0) return "done";
  if (!(perSec > 0)) return "—";
  return fmtDuration(left / perSec);
}
