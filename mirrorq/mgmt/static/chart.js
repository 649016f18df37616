// A line chart of time series on a <canvas>, drawn by hand (no charting library).
//
// drawChart(canvas, series, {windowMs, now, format}) draws each series
// ({label, color, points: [[t_ms, value], ...]}) over the last windowMs up to
// now, with a y axis from 0 to a round maximum and the window's ends as time
// labels.  The canvas is sized to its CSS box at the device's pixel ratio.

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

export function drawChart(canvas, series, {windowMs, now = Date.now(), format = v => String(v)}) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const left = 56, right = 8, top = 8, bottom = 20;
  const pw = Math.max(1, w - left - right), ph = Math.max(1, h - top - bottom);
  const t0 = now - windowMs;
  let max = 0;
  for (const s of series) for (const [t, v] of s.points) if (t >= t0 && v > max) max = v;
  const ymax = niceMax(max);
  const x = t => left + ((t - t0) / windowMs) * pw;
  const y = v => top + ph - (v / ymax) * ph;

  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#666";
  ctx.strokeStyle = "#e4e4e4";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const v = (ymax * i) / 4;
    const yy = Math.round(y(v)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(left, yy);
    ctx.lineTo(left + pw, yy);
    ctx.stroke();
    ctx.fillText(format(v), left - 6, yy);
  }
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  ctx.fillText(`-${Math.round(windowMs / 60000)} min`, left, top + ph + 4);
  ctx.textAlign = "right";
  ctx.fillText("now", left + pw, top + ph + 4);

  ctx.lineWidth = 2;
  ctx.lineJoin = "round";
  for (const s of series) {
    const pts = s.points.filter(([t]) => t >= t0);
    if (!pts.length) continue;
    ctx.strokeStyle = s.color;
    ctx.fillStyle = s.color;
    ctx.beginPath();
    pts.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
    ctx.stroke();
    const [lt, lv] = pts[pts.length - 1];
    ctx.beginPath();
    ctx.arc(x(lt), y(lv), 2.5, 0, 2 * Math.PI);
    ctx.fill();
  }
}
