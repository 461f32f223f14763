// The status page: reads /metrics (Prometheus text) every `interval` ms and draws it.
// No libraries, no build step: the page must work with the boxes offline.
"use strict";
const params = new URLSearchParams(location.search);
const interval = Number(params.get("interval") || 2000);
if (params.get("key")) localStorage.setItem("k3dist-key", params.get("key"));
const key = localStorage.getItem("k3dist-key");
const headers = key ? { Authorization: "Bearer " + key } : {};
const RANK_COLORS = ["#4c7dd9", "#d9774c", "#4cb39a", "#a64cd9", "#d9c84c", "#d94c8a"];
const history = []; // [seconds, tokens/s], the last hour
let prev = null, polls = 0, placement = null;

// Prometheus text format: {name: [{labels, value}]}
function parse(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const l of (m[3] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    (out[m[1]] = out[m[1]] || []).push({ labels, value: Number(m[4]) });
  }
  return out;
}
const one = (mt, name) => (mt[name] && mt[name].length ? mt[name][0].value : null);
const sum = (mt, name) => (mt[name] || []).reduce((a, s) => a + s.value, 0);
const byRank = (mt, name) => {
  const o = {};
  for (const s of mt[name] || []) o[s.labels.rank] = s.value;
  return o;
};
function bytes(n) {
  if (n === null || n === undefined) return "-";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return n.toFixed(i ? 1 : 0) + " " + u[i];
}
function set(id, value, text) {
  const el = document.getElementById(id);
  el.dataset.value = value === null || value === undefined ? "" : String(value);
  el.textContent = text !== undefined ? text : value === null ? "-" : String(value);
}

function drawRanks(mt) {
  const up = byRank(mt, "k3dist_rank_up"), warm = byRank(mt, "k3dist_rank_warm");
  const rss = byRank(mt, "k3dist_rank_resident_bytes"), limit = byRank(mt, "k3dist_rank_memory_limit_bytes");
  const plan = byRank(mt, "k3dist_rank_plan_bytes"), gen = byRank(mt, "k3dist_rank_generated_tokens_total");
  const age = byRank(mt, "k3dist_rank_report_age_seconds");
  const box = document.getElementById("ranks");
  const ranks = Object.keys(up).sort((a, b) => a - b);
  box.innerHTML = "";
  for (const r of ranks) {
    const lim = limit[r] || null, pct = lim ? Math.min(100, (100 * (rss[r] || 0)) / lim) : 0;
    const planPct = lim && plan[r] ? Math.min(100, (100 * plan[r]) / lim) : null;
    const d = document.createElement("div");
    d.className = "card rank";
    d.id = "rank-" + r;
    d.dataset.up = up[r];
    d.dataset.warm = warm[r] ?? "";
    d.dataset.rss = rss[r] ?? "";
    d.dataset.generated = gen[r] ?? "";
    d.innerHTML =
      `<h2><span class="dot ${up[r] ? "up" : ""}"></span>rank ${r} · ${up[r] ? "alive" : "lost"} · ` +
      `${warm[r] ? "warm" : "not warm"}</h2>` +
      `<div class="bar" title="resident memory against the limit; the line: the plan">` +
      `<div class="fill" style="width:${pct}%"></div>` +
      (planPct !== null ? `<div class="plan" style="left:${planPct}%"></div>` : "") +
      `</div><div class="kv num"><span>resident</span><span>${bytes(rss[r])} of ${bytes(lim)}</span>` +
      `<span>plan</span><span>${bytes(plan[r])}</span>` +
      `<span>tokens generated</span><span class="gen">${gen[r] ?? "-"}</span>` +
      `<span>last report</span><span>${age[r] !== undefined ? age[r].toFixed(1) + " s ago" : "-"}</span></div>`;
    box.appendChild(d);
  }
}

function drawTps() {
  const c = document.getElementById("tps"), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  g.strokeStyle = "#dde1e7";
  g.strokeRect(0.5, 0.5, c.width - 1, c.height - 1);
  if (history.length < 2) return;
  const t1 = history[history.length - 1][0], t0 = Math.max(history[0][0], t1 - 3600);
  const top = Math.max(1, ...history.map((h) => h[1])) * 1.1;
  g.fillStyle = "#6b7280";
  g.fillText(top.toFixed(1) + " tok/s", 4, 12);
  g.fillText(((t1 - t0) / 60).toFixed(1) + " min", c.width - 50, c.height - 4);
  g.strokeStyle = "#4c7dd9";
  g.lineWidth = 1.5;
  g.beginPath();
  history.forEach(([t, v], i) => {
    const x = ((t - t0) / Math.max(1, t1 - t0)) * (c.width - 2) + 1, y = c.height - 2 - (v / top) * (c.height - 18);
    i ? g.lineTo(x, y) : g.moveTo(x, y);
  });
  g.stroke();
}

function drawHeat(mt) {
  const cells = mt["k3dist_expert_routes_total"] || [];
  const layers = placement && placement.layers.length ? placement.layers : [...new Set(cells.map((s) => +s.labels.layer))].sort((a, b) => a - b);
  const experts = placement && placement.owners.length ? placement.owners[0].length : 1 + Math.max(0, ...cells.map((s) => +s.labels.expert));
  const grid = layers.map(() => new Array(experts).fill(0));
  const row = new Map(layers.map((l, i) => [l, i]));
  let total = 0;
  for (const s of cells) {
    const i = row.get(+s.labels.layer);
    if (i === undefined) continue;
    grid[i][+s.labels.expert] = s.value;
    total += s.value;
  }
  set("routes", total);
  const c = document.getElementById("heat"), g = c.getContext("2d");
  const cw = Math.max(1, Math.min(40, Math.floor(1180 / Math.max(1, experts)))), rh = 16, band = 4;
  c.width = 40 + cw * experts;
  c.height = 4 + layers.length * (rh + band + 1);
  g.clearRect(0, 0, c.width, c.height);
  g.font = "10px system-ui";
  layers.forEach((l, i) => {
    const y = 2 + i * (rh + band + 1), hot = Math.max(1, ...grid[i]);
    g.fillStyle = "#6b7280";
    g.fillText("L" + l, 2, y + rh - 2);
    for (let e = 0; e < experts; e++) {
      const v = grid[i][e] / hot;
      g.fillStyle = `rgb(${255 - Math.round(v * 40)},${255 - Math.round(v * 190)},${255 - Math.round(v * 230)})`;
      g.fillRect(36 + e * cw, y, cw - (cw > 3 ? 1 : 0), rh);
      if (placement) {
        const owner = placement.owners[i][e];
        g.fillStyle = RANK_COLORS[owner % RANK_COLORS.length];
        g.fillRect(36 + e * cw, y + rh, cw, band);
        if (e > 0 && placement.owners[i][e - 1] !== owner) {
          g.fillStyle = "#1d2330"; // a rank boundary across the row
          g.fillRect(36 + e * cw - 1, y, 1, rh + band);
        }
      }
    }
  });
  const ranks = placement ? [...new Set(placement.owners.flat())].sort((a, b) => a - b) : [];
  document.getElementById("legend").innerHTML = ranks
    .map((r) => `<span><span class="sw" style="background:${RANK_COLORS[r % RANK_COLORS.length]}"></span>rank ${r}'s experts</span>`)
    .join("");
  c.dataset.layers = layers.length;
  c.dataset.experts = experts;
  c.dataset.hot = grid.reduce((a, r) => a + r.filter((v) => v > 0).length, 0);
}

function draw(mt, now) {
  const gen = one(mt, "k3dist_generated_tokens_total") || 0;
  if (prev) {
    const dt = now - prev.t;
    const rate = dt > 0 ? (gen - prev.gen) / dt : 0;
    history.push([now, rate]);
    while (history.length && history[0][0] < now - 3600) history.shift();
    set("tps-now", rate, rate.toFixed(2));
  }
  prev = { t: now, gen };
  set("generated", gen);
  set("prompt", one(mt, "k3dist_prompt_tokens_total") || 0);
  const ttftN = one(mt, "k3dist_time_to_first_token_seconds_count"), itlN = one(mt, "k3dist_inter_token_latency_seconds_count");
  const ttft = ttftN ? one(mt, "k3dist_time_to_first_token_seconds_sum") / ttftN : null;
  const itl = itlN ? one(mt, "k3dist_inter_token_latency_seconds_sum") / itlN : null;
  set("ttft", ttft, ttft === null ? "-" : (1000 * ttft).toFixed(0) + " ms");
  set("itl", itl, itl === null ? "-" : (1000 * itl).toFixed(1) + " ms");
  set("in-flight", one(mt, "k3dist_requests_in_flight"));
  set("queued", one(mt, "k3dist_queue_depth"));
  set("running", one(mt, "k3dist_running_requests"));
  set("limit", one(mt, "k3dist_max_requests_in_flight"));
  set("requests", sum(mt, "k3dist_requests_total"));
  const hits = one(mt, "k3dist_prefix_cache_hits_total") || 0, misses = one(mt, "k3dist_prefix_cache_misses_total") || 0;
  set("cache-hits", hits);
  set("cache-misses", misses);
  set("cache-rate", hits + misses ? hits / (hits + misses) : null, hits + misses ? ((100 * hits) / (hits + misses)).toFixed(0) + " %" : "-");
  set("cached-tokens", one(mt, "k3dist_prefix_cache_cached_tokens_total") || 0);
  const mem = one(mt, "k3dist_prefix_cache_memory_bytes"), disk = one(mt, "k3dist_prefix_cache_disk_bytes");
  set("cache-mem", mem, bytes(mem) + " (" + (one(mt, "k3dist_prefix_cache_memory_entries") || 0) + " entries)");
  set("cache-disk", disk, disk === null ? "off" : bytes(disk) + " (" + one(mt, "k3dist_prefix_cache_disk_entries") + " entries)");
  set("route-samples", one(mt, "k3dist_route_samples_total") || 0);
  set("khi", one(mt, "k3dist_khi_overflow_routes_total") || 0);
  drawRanks(mt);
  drawTps();
  drawHeat(mt);
}

async function poll() {
  try {
    if (!placement) {
      const p = await fetch("status/placement", { headers });
      if (p.ok) placement = await p.json();
    }
    const r = await fetch("metrics", { headers, cache: "no-store" });
    if (r.status === 401) throw new Error("401: open this page with ?key=<the API key>");
    if (!r.ok) throw new Error("/metrics answered " + r.status);
    const text = await r.text();
    draw(parse(text), performance.now() / 1000);
    polls += 1;
    set("polls", polls);
    document.getElementById("updated").textContent = new Date().toLocaleTimeString();
    document.getElementById("err").textContent = "";
    window.k3status = { polls, text };
  } catch (e) {
    document.getElementById("err").textContent = String(e.message || e);
  }
  setTimeout(poll, interval);
}
poll();
