/* The progress plot: completed sources over time (top) and completions per unit of time (bottom), as
 * inline SVG, with the maths behind it and the rate tile. A step function: the count holds from one
 * sample to the next.
 */

import { h, s } from "./dom.js";
import { fmtClock, fmtCompact, fmtDay, fmtInt, fmtRate, rateUnit, serverNow } from "./format.js";

/** The count at time t: the value of the last sample at or before t (samples are written when the count
 *  changed). */
function valueAt(pts, t) {
  if (t < pts[0].at) return pts[0].completed_count;
  let lo = 0;
  let hi = pts.length - 1;
  if (t >= pts[hi].at) return pts[hi].completed_count;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (pts[mid].at <= t) lo = mid;
    else hi = mid;
  }
  return pts[lo].completed_count;
}

/** Persisted samples in the window, then the server's live sample, then "now" from the live status. */
export function progressPoints(page) {
  const pts = page.samples.slice();
  const prov = page.provisional;
  if (prov && (!pts.length || prov.at > pts[pts.length - 1].at)) pts.push({ ...prov, live: true });
  const cp = page.cp;
  const now = serverNow();
  if (cp && (!pts.length || now > pts[pts.length - 1].at + 0.5)) {
    pts.push({ at: now, completed_count: cp.completed_count, live: true });
  }
  return pts;
}

/** Completions per second over the last minute; null without enough history. */
export function currentRate(pts) {
  if (pts.length < 2) return null;
  const t1 = pts[pts.length - 1].at;
  const t0 = Math.max(pts[0].at, t1 - 60);
  if (t1 - t0 < 1) return null;
  return Math.max(0, (valueAt(pts, t1) - valueAt(pts, t0)) / (t1 - t0));
}

function niceTicks(lo, hi, count, integer) {
  if (!(hi > lo)) hi = lo + 1;
  const raw = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const norm = raw / mag;
  let step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
  if (integer) step = Math.max(1, Math.round(step));
  const start = Math.floor(lo / step) * step;
  const end = Math.ceil(hi / step) * step;
  const ticks = [];
  for (let v = start; v <= end + step / 2; v += step) ticks.push(Number(v.toFixed(10)));
  return { lo: start, hi: end, ticks };
}

const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800];

function timeTicks(t0, t1, maxTicks) {
  const span = t1 - t0;
  const step = TIME_STEPS.find((st) => span / st <= maxTicks) || 604800;
  const off = new Date(t0 * 1000).getTimezoneOffset() * 60; // align ticks to local wall time
  const ticks = [];
  for (let t = Math.ceil((t0 - off) / step) * step + off; t <= t1; t += step) ticks.push(t);
  let prevDay = null;
  return ticks.map((t) => {
    const day = fmtDay(t);
    let label;
    if (step >= 86400) label = day;
    else if (prevDay !== null && day !== prevDay) label = `${day} ${fmtClock(t, false)}`;
    else label = fmtClock(t, step < 60);
    prevDay = day;
    return { t, label };
  });
}

/** The plot of `page` over the last `span` seconds (0: since the checkpoint began), `width` pixels wide;
 *  hoverAt (a fraction of the plot's width, or null) places the cursor and its tooltip. */
export function chartView(page, { span, width, hoverAt }) {
  const pts = progressPoints(page);
  const W = Math.max(280, width || 900);
  const ml = 56;
  const mr = 18;
  const top1 = 22;
  const h1 = 170;
  const top2 = top1 + h1 + 44;
  const h2 = 74;
  const H = top2 + h2 + 24;
  const pw = W - ml - mr;

  if (pts.length < 2) {
    return h(
      "div",
      { class: "empty", "data-testid": "chart-empty" },
      "No progress samples yet — the coordinator records the completed count every few seconds when it changes.",
    );
  }

  const now = pts[pts.length - 1].at;
  const born = page.cp && page.cp.created_at > 0 ? Math.min(page.cp.created_at, pts[0].at) : pts[0].at;
  const x0 = span ? Math.max(born, now - span) : born;
  const x1 = Math.max(now, x0 + 1);
  if (pts.every((p) => p.live) && pts[0].at > x0) {
    // No sample in the window: the count has not changed in it.
    pts.unshift({ at: x0, completed_count: pts[0].completed_count, live: true });
  }
  const X = (t) => ml + ((t - x0) / (x1 - x0)) * pw;

  // completed, top panel
  let vmin = Infinity;
  let vmax = -Infinity;
  for (const p of pts) {
    vmin = Math.min(vmin, p.completed_count);
    vmax = Math.max(vmax, p.completed_count);
  }
  if (vmin <= vmax * 0.5) vmin = 0;
  const yt = niceTicks(vmin, Math.max(vmax, vmin + 1), 4, true);
  const Y1 = (v) => top1 + h1 - ((v - yt.lo) / (yt.hi - yt.lo)) * h1;

  // thin the line to ~2 points per pixel column
  const step = Math.max(1, Math.floor(pts.length / (pw * 2)));
  const line = [];
  for (let i = 0; i < pts.length; i += step) line.push(pts[i]);
  if (line[line.length - 1] !== pts[pts.length - 1]) line.push(pts[pts.length - 1]);
  const path = line
    .map((p, i) => {
      const x = X(Math.max(p.at, x0)).toFixed(1);
      const y = Y1(p.completed_count).toFixed(1);
      return i ? `H${x}V${y}` : `M${x},${y}`; // step: the count holds until the next sample
    })
    .join("");
  const area = `${path}L${X(line[line.length - 1].at).toFixed(1)},${top1 + h1}L${X(line[0].at).toFixed(1)},${top1 + h1}Z`;

  // rate, bottom panel: buckets at least one sample interval wide
  let interval = Infinity; // the sampling interval: the shortest gap between persisted samples
  for (let i = 1; i < pts.length; i++) {
    if (!pts[i].live) interval = Math.min(interval, pts[i].at - pts[i - 1].at);
  }
  interval = Number.isFinite(interval) ? Math.max(1, interval) : 5;
  const buckets = Math.max(1, Math.min(60, Math.floor(pw / 10), Math.floor((x1 - x0) / interval)));
  const bw = (x1 - x0) / buckets;
  const rates = [];
  for (let i = 0; i < buckets; i++) {
    const a = x0 + i * bw;
    const b = a + bw;
    rates.push({ a, b, r: Math.max(0, (valueAt(pts, b) - valueAt(pts, a)) / bw) });
  }
  const rmax = Math.max(...rates.map((r) => r.r));
  const unit = rateUnit(rmax);
  const rt = niceTicks(0, Math.max(rmax * unit.mul, 1e-9), 2, false);
  if (rmax === 0) rt.hi = 1;
  const Y2 = (v) => top2 + h2 - ((v * unit.mul) / rt.hi) * h2;

  const xt = timeTicks(x0, x1, Math.max(2, Math.floor(pw / 110)));

  const kids = [];
  kids.push(s("text", { class: "ptitle", x: ml, y: top1 - 8 }, "Completed sources"));
  for (const v of yt.ticks) {
    kids.push(s("line", { class: "grid", x1: ml, x2: ml + pw, y1: Y1(v), y2: Y1(v) }));
    kids.push(s("text", { x: ml - 8, y: Y1(v) + 4, "text-anchor": "end" }, fmtCompact(v)));
  }
  kids.push(s("path", { class: "area", d: area }));
  kids.push(s("path", { class: "line", d: path, "data-testid": "chart-line" }));

  kids.push(s("text", { class: "ptitle", x: ml, y: top2 - 8 }, `Completions ${unit.long}`));
  for (const v of rt.ticks.filter((v) => v <= rt.hi)) {
    const y = top2 + h2 - (v / rt.hi) * h2;
    kids.push(s("line", { class: "grid", x1: ml, x2: ml + pw, y1: y, y2: y }));
    kids.push(s("text", { x: ml - 8, y: y + 4, "text-anchor": "end" }, fmtCompact(v)));
  }
  for (const r of rates) {
    const xa = X(r.a) + 1;
    const width = Math.max(1, X(r.b) - X(r.a) - 2);
    const y = Y2(r.r);
    if (r.r > 0) kids.push(s("rect", { class: "bar", x: xa, y, width, height: Math.max(1, top2 + h2 - y), rx: 1.5 }));
  }
  kids.push(s("line", { class: "axis", x1: ml, x2: ml + pw, y1: top2 + h2, y2: top2 + h2 }));
  kids.push(s("line", { class: "axis", x1: ml, x2: ml + pw, y1: top1 + h1, y2: top1 + h1 }));
  for (const { t, label } of xt) {
    kids.push(s("line", { class: "axis", x1: X(t), x2: X(t), y1: top2 + h2, y2: top2 + h2 + 4 }));
    kids.push(s("text", { x: X(t), y: top2 + h2 + 17, "text-anchor": "middle" }, label));
  }

  let tip = null;
  if (hoverAt !== null) {
    const t = x0 + hoverAt * (x1 - x0); // the mouse stays put while the axis moves on
    const v = valueAt(pts, t);
    const bucket = rates[Math.min(rates.length - 1, Math.floor((t - x0) / bw))];
    const hx = X(t);
    kids.push(s("line", { class: "hover-line", x1: hx, x2: hx, y1: top1, y2: top2 + h2 }));
    kids.push(s("circle", { class: "hover-dot", cx: hx, cy: Y1(v), r: 4 }));
    tip = h(
      "div",
      { class: "chart-tip", style: null, "data-x": hx, "data-y": Y1(v) },
      `${fmtClock(t)} · ${fmtInt(v)} completed · ${fmtRate(bucket ? bucket.r : 0)}`,
    );
  }
  kids.push(s("rect", { class: "hit", x: ml, y: top1, width: pw, height: top2 + h2 - top1, fill: "transparent" }));

  const svg = s(
    "svg",
    {
      class: "chart",
      id: "chart",
      viewBox: `0 0 ${W} ${H}`,
      width: W,
      height: H,
      role: "img",
      "aria-label": "Completed sources over time and completion rate",
      "data-ml": ml,
      "data-pw": pw,
      "data-testid": "progress-chart",
    },
    kids,
  );
  return [svg, tip];
}

/** Places the hover tooltip over the plot (after a render: it needs the plot's size on screen). */
export function placeTip(root) {
  const tip = root.querySelector(".chart-tip");
  const svg = document.getElementById("chart");
  if (!tip || !svg) return;
  const width = Number(svg.getAttribute("width"));
  const box = svg.getBoundingClientRect();
  const wrap = tip.offsetParent ? tip.offsetParent.getBoundingClientRect() : box;
  const scale = box.width / width;
  const x = Number(tip.dataset.x);
  tip.style.left = `${box.left - wrap.left + x * scale}px`;
  tip.style.top = `${box.top - wrap.top + Number(tip.dataset.y) * scale - 10}px`;
  // Keep it inside the panel near either edge.
  tip.style.transform = x < width * 0.2 ? "translate(-10%, -100%)" : x > width * 0.8 ? "translate(-90%, -100%)" : "";
}

/** Where the mouse is over the plot, as a fraction of its width; null when outside it. */
export function hoverFraction(ev) {
  const svg = document.getElementById("chart");
  if (!svg || !svg.contains(ev.target)) return null;
  const rect = svg.getBoundingClientRect();
  const px = ((ev.clientX - rect.left) * Number(svg.getAttribute("width"))) / rect.width;
  const ml = Number(svg.dataset.ml);
  const pw = Number(svg.dataset.pw);
  return px >= ml && px <= ml + pw ? (px - ml) / pw : null;
}
