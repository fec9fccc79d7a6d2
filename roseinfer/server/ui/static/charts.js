// Canvas drawings of the dashboard: the KV block map and a line chart. Colours come
// from the page's CSS variables, so light and dark themes both apply.

function cssColor(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// Size the canvas's backing store to its CSS box (height given), for sharp lines.
function prepare(canvas, height) {
  const dpr = window.devicePixelRatio || 1;
  const width = Math.max(1, canvas.clientWidth);
  if (height !== undefined) canvas.style.height = `${height}px`;
  const h = Math.max(1, height !== undefined ? height : canvas.clientHeight);
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(h * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, h);
  return { ctx, width, height: h };
}

// One square per cell of `map` ("u" in use, "c" cached, "." free), row by row,
// sized so the map takes about 160 px of height.
export function drawBlockMap(canvas, map) {
  const n = map.length;
  const width = Math.max(1, canvas.clientWidth);
  const size = Math.max(2, Math.min(14, Math.floor(Math.sqrt((width * 160) / Math.max(1, n)))));
  const cols = Math.max(1, Math.floor(width / size));
  const rows = Math.ceil(n / cols);
  const { ctx } = prepare(canvas, Math.max(size, rows * size));
  const colors = { u: cssColor("--used"), c: cssColor("--cached"), ".": cssColor("--free") };
  const gap = size >= 4 ? 1 : 0;
  for (const state of ["u", "c", "."]) {
    ctx.fillStyle = colors[state];
    for (let i = 0; i < n; i++) {
      if (map[i] !== state) continue;
      ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - gap, size - gap);
    }
  }
}

// Lines of equal length over a shared y axis from 0; the last point is "now".
export function drawLineChart(canvas, series, { xLabel = "", unit = "" } = {}) {
  const { ctx, width, height } = prepare(canvas);
  const text = cssColor("--muted");
  const grid = cssColor("--border");
  const left = 44;
  const bottom = 18;
  const plotW = Math.max(1, width - left - 4);
  const plotH = Math.max(1, height - bottom - 6);
  const max = niceMax(Math.max(1, ...series.flatMap((s) => s.values)));
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = text;
  ctx.strokeStyle = grid;
  ctx.lineWidth = 1;
  for (const f of [0, 0.5, 1]) {
    const y = 6 + plotH * (1 - f);
    ctx.beginPath();
    ctx.moveTo(left, y + 0.5);
    ctx.lineTo(left + plotW, y + 0.5);
    ctx.stroke();
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    ctx.fillText(`${formatTick(max * f)}${unit}`, left - 6, y);
  }
  ctx.textBaseline = "alphabetic";
  ctx.textAlign = "left";
  ctx.fillText(xLabel, left, height - 4);
  ctx.textAlign = "right";
  ctx.fillText("now", left + plotW, height - 4);
  for (const s of series) {
    const n = s.values.length;
    if (n < 2) continue;
    ctx.strokeStyle = cssColor(s.color);
    ctx.lineWidth = 1.6;
    ctx.beginPath();
    s.values.forEach((v, i) => {
      const x = left + (plotW * i) / (n - 1);
      const y = 6 + plotH * (1 - v / max);
      if (i === 0) ctx.moveTo(x, y);
      else ctx.lineTo(x, y);
    });
    ctx.stroke();
  }
}

function niceMax(value) {
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) {
    if (step * power >= value) return step * power;
  }
  return 10 * power;
}

function formatTick(value) {
  if (value >= 1000) return `${(value / 1000).toFixed(value >= 10000 ? 0 : 1)}k`;
  return value % 1 === 0 ? String(value) : value.toFixed(1);
}
