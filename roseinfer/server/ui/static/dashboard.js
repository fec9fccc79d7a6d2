// The dashboard view: polls GET /ui/api/snapshot (one small JSON document, taken on
// the engine thread) several times a second while the view is shown, and draws it.

import { apiFetch, errorMessage } from "./api.js";
import { drawBlockMap, drawLineChart } from "./charts.js";

const POLL_MS = 250;
const HIDDEN_POLL_MS = 2000; // the tab is in the background
const MAX_ROWS = 100;

export class DashboardView {
  constructor(root) {
    this.el = (id) => root.querySelector(`#${id}`);
    this.active = false;
    this.timer = null;
    this.inFlight = false;
    this.last = null;
    this.needsKey = false;
    document.addEventListener("roseinfer:auth-changed", () => {
      this.needsKey = false;
      this.poll();
    });
    window.addEventListener("resize", () => this.last && this.draw(this.last));
  }

  setActive(active) {
    this.active = active;
    if (active) this.poll();
    else clearTimeout(this.timer);
  }

  async poll() {
    clearTimeout(this.timer);
    if (!this.active || this.inFlight || this.needsKey) return;
    this.inFlight = true;
    try {
      const response = await apiFetch("/ui/api/snapshot", { cache: "no-store" });
      if (response.status === 401) {
        this.needsKey = true;
        this.status("an API key is needed to watch the engine");
      } else if (!response.ok) {
        this.status(`snapshot failed: ${await errorMessage(response)}`);
      } else {
        const snap = await response.json();
        this.last = snap;
        this.draw(snap);
      }
    } catch (err) {
      this.status(`server unreachable (${err.message || err})`);
    } finally {
      this.inFlight = false;
      if (this.active && !this.needsKey) {
        const delay = document.visibilityState === "hidden" ? HIDDEN_POLL_MS : POLL_MS;
        this.timer = setTimeout(() => this.poll(), delay);
      }
    }
  }

  status(text) {
    this.el("dash-status").textContent = text;
  }

  draw(s) {
    const set = (id, text) => {
      this.el(id).textContent = text;
    };
    const health = s.healthy ? "live" : "engine NOT healthy";
    this.status(`${health} · ${s.model} (weights ${s.limits.quantization}) · ` +
      `updated ${new Date().toLocaleTimeString()}`);
    set("stat-running", s.requests.running);
    set("stat-waiting", s.requests.waiting);
    set("stat-preempted", s.requests.preempted);
    set("stat-kv", percent(s.kv.usage));
    set("stat-decode", rate(s.throughput.decode_now));
    set("stat-prefill", rate(s.throughput.prefill_now));
    set("stat-hit", s.prefix_cache.queries ? percent(s.prefix_cache.hit_rate) : "–");
    set("stat-generated", s.tokens.generation_total.toLocaleString());

    const kv = s.kv;
    const perCell = kv.blocks_per_cell > 1 ? ` (one square = ${kv.blocks_per_cell} blocks)` : "";
    const summary = `${kv.used} in use · ${kv.cached} cached · ${kv.free} free of ${kv.total} ` +
      `blocks × ${s.limits.block_size} tokens, ${s.limits.kv_cache_dtype}${perCell}`;
    set("kv-summary", summary);
    const map = this.el("kv-map");
    map.setAttribute("aria-label", `KV block map: ${summary}`);
    drawBlockMap(map, kv.map);

    const tp = s.throughput;
    drawLineChart(this.el("tp-chart"), [
      { values: tp.decode_tok_s, color: "--decode" },
      { values: tp.prefill_tok_s, color: "--prefill" },
    ], { xLabel: `-${Math.round(tp.decode_tok_s.length / 60)} min` });
    this.el("tp-chart").setAttribute("aria-label",
      `Throughput now: ${rate(tp.decode_now)} decode, ${rate(tp.prefill_now)} prefill tokens/s`);

    latencyRow(this.el("lat-ttft"), s.latency.ttft);
    latencyRow(this.el("lat-itl"), s.latency.itl);
    const finished = Object.entries(s.requests.finished)
      .map(([reason, count]) => `${reason} ${count}`).join(" · ");
    set("finish-summary", finished ? `finished: ${finished}` : "");

    this.drawRequests(s);
  }

  drawRequests(s) {
    const body = this.el("req-body");
    const rows = s.in_flight.slice(0, MAX_ROWS).map((r) => {
      const tr = document.createElement("tr");
      tr.dataset.requestId = r.id;
      const cells = [r.id, r.state, r.prompt_tokens, `${r.output_tokens} / ${r.max_tokens}`,
        r.cached_tokens, r.blocks, `${r.age_s.toFixed(1)} s`];
      cells.forEach((value, i) => {
        const td = document.createElement("td");
        if (i === 1) {
          const badge = document.createElement("span");
          badge.className = `state ${value}`;
          badge.textContent = value;
          td.append(badge);
        } else {
          td.textContent = String(value);
        }
        if (i === 0) td.title = r.group_id === r.id ? r.id : `${r.id} (request ${r.group_id})`;
        tr.append(td);
      });
      return tr;
    });
    body.replaceChildren(...rows);
    const total = s.in_flight_total;
    this.el("req-count").textContent = total > rows.length ? `(${rows.length} of ${total})` :
      `(${total})`;
    this.el("req-empty").hidden = total > 0;
  }
}

function latencyRow(tr, stats) {
  const cells = tr.querySelectorAll("td");
  [stats.p50, stats.p90, stats.p99].forEach((v, i) => {
    cells[i].textContent = seconds(v);
  });
  cells[3].textContent = String(stats.count);
}

function seconds(v) {
  if (v === null || v === undefined) return "–";
  return v < 1 ? `${(v * 1000).toFixed(v < 0.01 ? 1 : 0)} ms` : `${v.toFixed(2)} s`;
}

function percent(f) {
  return `${(100 * f).toFixed(1)}%`;
}

function rate(v) {
  return v >= 100 ? v.toFixed(0) : v.toFixed(1);
}
