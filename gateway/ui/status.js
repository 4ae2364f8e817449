// Pulse status page: polls /pulse/status once a second, draws the fleet and three charts, and streams a chat
// through /v1/chat/completions. Plain DOM, no library; every server string goes in as text, never as HTML.
(() => {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const KEY = "pulse.key";
  const POLL_MS = 1000;
  const WINDOW_S = 900;
  const SVG = "http://www.w3.org/2000/svg";

  let key = sessionStorage.getItem(KEY) || "";
  let series = [];          // [time, tokens/s, TTFT p50 ms | null, waiting], oldest first
  let lastPoint = null;     // time of the newest point held: the next poll asks only for newer ones
  let lastOk = 0;
  let modelsLoaded = false;

  // ---- small helpers ------------------------------------------------------------------------------
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function authHeaders(extra) {
    const h = Object.assign({}, extra || {});
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }
  function num(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    const d = digits === undefined ? (Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2) : digits;
    return Number(v).toLocaleString(undefined, { maximumFractionDigits: d, minimumFractionDigits: 0 });
  }
  function ms(v) {
    if (v === null || v === undefined) return "–";
    return v >= 1000 ? num(v / 1000, 2) + " s" : num(v) + " ms";
  }
  function pct(v) { return v === null || v === undefined ? "–" : num(v * 100, 1) + " %"; }
  function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

  function setConn(text, cls) {
    const c = $("conn");
    c.textContent = text;
    c.className = "pill " + (cls || "");
  }
  function tick() {
    $("updated").textContent = lastOk ? "updated " + Math.max(0, Math.round((Date.now() - lastOk) / 1000)) + " s ago" : "";
  }

  // ---- access -------------------------------------------------------------------------------------
  function showKeyPrompt(message) {
    $("key-prompt").hidden = false;
    $("key-error").textContent = message || "";
    $("try").hidden = true;
    $("scope-notice").hidden = true;
    hideFleet();
    setConn("key needed", "bad");
    $("access").textContent = "keys required";
    $("forget-key").hidden = !key;
  }
  function hideFleet() {
    $("fleet").hidden = true;
    series = [];
    lastPoint = null;
    for (const id of ["gateway-tiles", "workers", "index-tiles"]) $(id).replaceChildren();
    $("errors").tBodies[0].replaceChildren();
  }
  function useKey(value) {
    key = value;
    if (key) sessionStorage.setItem(KEY, key); else sessionStorage.removeItem(KEY);
    modelsLoaded = false;
    hideFleet();
    poll();
  }

  // ---- polling ------------------------------------------------------------------------------------
  async function poll() {
    let r;
    try {
      const url = "/pulse/status" + (lastPoint !== null ? "?since=" + lastPoint : "");
      r = await fetch(url, { headers: authHeaders(), cache: "no-store" });
    } catch (e) {
      setConn("gateway unreachable", "bad");
      return;
    }
    if (r.status === 401) {
      showKeyPrompt(key ? "That key was refused." : "");
      return;
    }
    $("key-prompt").hidden = true;
    $("forget-key").hidden = !key;
    $("try").hidden = false;
    if (r.status === 403) {
      hideFleet();
      $("scope-notice").hidden = false;
      $("access").textContent = "key without admin scope";
      setConn("limited", "");
      loadModels();
      return;
    }
    if (!r.ok) {
      setConn("error " + r.status, "bad");
      return;
    }
    const s = await r.json();
    $("scope-notice").hidden = true;
    render(s);
  }
  function loop() { poll().finally(() => setTimeout(loop, POLL_MS)); }

  async function loadModels() {
    if (modelsLoaded) return;
    let ids;
    try {
      const r = await fetch("/v1/models", { headers: authHeaders() });
      if (!r.ok) return;
      ids = (await r.json()).data.map((m) => m.id);
    } catch (e) { return; }
    const sel = $("try-model");
    const keep = sel.value;
    sel.replaceChildren(...ids.map((id) => { const o = el("option", "", id); o.value = id; return o; }));
    if (ids.includes(keep)) sel.value = keep;
    modelsLoaded = ids.length > 0;
  }

  // ---- rendering ----------------------------------------------------------------------------------
  function render(s) {
    lastOk = Date.now();
    tick();
    $("fleet").hidden = false;
    $("access").textContent = s.access === "open" ? "open: loopback, no keys" : "admin key";
    const healthy = s.workers.filter((w) => w.healthy).length;
    setConn(healthy + "/" + s.workers.length + " workers healthy", healthy === s.workers.length && healthy ? "ok" : "bad");
    loadModels();
    addPoints(s.series.points);
    renderGateway(s.gateway, s.workers);
    renderWorkers(s.workers);
    renderIndex(s.index);
    renderErrors(s.errors);
    drawCharts();
  }

  function tile(label, value, unit, sub, bad) {
    const t = el("div", "card tile");
    t.append(el("div", "label", label));
    const v = el("div", "value" + (bad ? " bad" : ""), value);
    if (unit) v.append(el("span", "unit", unit));
    t.append(v);
    if (sub) t.append(el("div", "sub", sub));
    t.setAttribute("aria-label", label + ": " + value + (unit ? " " + unit : "") + (sub ? ", " + sub : ""));
    return t;
  }

  function renderGateway(g, workers) {
    const tps = workers.reduce((a, w) => a + (w.healthy ? w.tokens_per_s : 0), 0);
    const m = g.last_minute;
    const errors = m.client_error + m.rate_limited + m.server_error + m.stream_errors;
    $("gateway-tiles").replaceChildren(
      tile("Requests/s", num(g.requests_per_s), "", m.requests + " in " + Math.round(g.window_s) + " s"),
      tile("Tokens/s", num(tps), "", "all workers, now"),
      tile("TTFT p50", ms(g.ttft_ms.p50), "", "p99 " + ms(g.ttft_ms.p99)),
      tile("Inter-token p50", ms(g.itl_ms.p50), "", "p99 " + ms(g.itl_ms.p99)),
      tile("In flight", num(g.in_flight, 0), "", "queue " + g.queue_depth),
      tile("Errors", num(errors, 0), "", "4xx " + m.client_error + " · 429 " + m.rate_limited + " · 5xx " +
        m.server_error + (m.stream_errors ? " · in-stream " + m.stream_errors : ""), m.server_error > 0),
    );
  }

  function meter(used, total) {
    const bar = el("div", "meter");
    const frac = total > 0 ? Math.min(used / total, 1) : 0;
    if (frac > 0.9) bar.classList.add("hot");
    const fill = el("span");
    fill.style.width = (frac * 100).toFixed(1) + "%";
    bar.append(fill);
    bar.setAttribute("role", "presentation");
    return bar;
  }

  function stat(dl, label, value, extra) {
    const d = el("div");
    d.append(el("dt", "", label));
    const dd = el("dd", "", value);
    d.append(dd);
    if (extra) dd.append(extra);
    dl.append(d);
  }

  function workerCard(w) {
    const card = el("article", "card worker");
    card.dataset.worker = w.id;
    const head = el("header");
    head.append(el("span", "wid", w.id), el("span", "pill " + (w.healthy ? "ok" : "bad"), w.healthy ? "healthy" : "unhealthy"));
    card.append(head);
    const device = w.device_id && w.device_id !== w.device ? w.device + " " + w.device_id.slice(0, 16) : w.device;
    const where = [w.node ? "node " + w.node.slice(0, 12) : "", device,
      w.backend, (w.models || []).join(", ")].filter(Boolean).join(" · ");
    card.append(el("p", "meta", where));
    if (w.why) card.append(el("p", "why", w.why));
    const dl = el("dl");
    stat(dl, "Tokens/s", num(w.tokens_per_s));
    stat(dl, "Prefill tokens/s", num(w.prefill_tokens_per_s));
    stat(dl, "Running / waiting", w.running + " / " + w.waiting, meter(w.running, w.slots));
    stat(dl, "Places + its queue", num(w.slots, 0) + " + " + num(w.queue, 0));
    stat(dl, "KV blocks", num(w.kv_blocks_used, 0) + " / " + num(w.kv_blocks_total, 0), meter(w.kv_blocks_used, w.kv_blocks_total));
    stat(dl, "Speculation K", w.speculation_k === null ? "off" : String(w.speculation_k));
    stat(dl, "Draft acceptance", pct(w.acceptance));
    stat(dl, "Blocks indexed", w.blocks_indexed === null ? "–" : num(w.blocks_indexed, 0));
    stat(dl, "Preemptions", num(w.preemptions, 0));
    card.append(dl);
    return card;
  }

  function renderWorkers(workers) {
    $("workers-count").textContent = workers.length + (workers.length === 1 ? " worker" : " workers");
    $("workers").replaceChildren(...workers.map(workerCard));
  }

  function renderIndex(ix) {
    $("index-tiles").replaceChildren(
      tile("Blocks indexed", ix.blocks === null ? "–" : num(ix.blocks, 0), "", ix.kind || "no index"),
      tile("Prefix found in index", pct(ix.match_ratio), "", ix.lookups + " lookups, last minute"),
      tile("Prompt tokens cached", pct(ix.cached_ratio), "", "served from KV cache, last minute"),
    );
  }

  function renderErrors(errors) {
    const body = $("errors").tBodies[0];
    if (!errors.length) {
      const td = el("td", "none", "No errors recorded.");
      td.colSpan = 5;
      const tr = el("tr");
      tr.append(td);
      body.replaceChildren(tr);
      return;
    }
    body.replaceChildren(...errors.slice(0, 20).map((e) => {
      const tr = el("tr");
      tr.append(el("td", "", clock(e.time)), el("td", "", e.status), el("td", "mono", e.code),
        el("td", "mono", e.path), el("td", e.message ? "" : "muted", e.message || "–"));
      return tr;
    }));
  }

  // ---- charts -------------------------------------------------------------------------------------
  function addPoints(points) {
    if (!points.length) return;
    series.push(...points);
    lastPoint = points[points.length - 1][0];
    const cutoff = lastPoint - WINDOW_S;
    let drop = 0;
    while (drop < series.length && series[drop][0] < cutoff) drop++;
    if (drop) series.splice(0, drop);
  }

  function niceMax(v) {
    if (v <= 0) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function svgEl(tag, attrs, text) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function drawChart(svg, field, format, fill, name, floor) {
    const w = svg.clientWidth || 300, h = svg.clientHeight || 130;
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    const rem = parseFloat(getComputedStyle(document.documentElement).fontSize) || 16;  // axis text is in rem
    const left = Math.round(rem * 3), right = 6, top = 8, bottom = Math.round(rem * 1.15);
    const now = series.length ? series[series.length - 1][0] : Date.now() / 1000;
    const t0 = now - WINDOW_S;
    const values = series.map((p) => p[field]).filter((v) => v !== null);
    const max = niceMax(Math.max(...values, floor) * 1.05);
    const x = (t) => left + ((t - t0) / WINDOW_S) * (w - left - right);
    const y = (v) => top + (1 - v / max) * (h - top - bottom);
    const kids = [];
    for (const f of [0, 0.5, 1]) {
      kids.push(svgEl("line", { class: "grid", x1: left, x2: w - right, y1: y(max * f), y2: y(max * f) }));
      kids.push(svgEl("text", { class: "axis", x: left - 6, y: y(max * f) + rem * 0.25, "text-anchor": "end" }, format(max * f)));
    }
    for (const [m, label] of [[15, "−15 min"], [10, "−10"], [5, "−5"], [0, "now"]]) {
      const anchor = m === 15 ? "start" : m === 0 ? "end" : "middle";
      kids.push(svgEl("text", { class: "axis", x: x(now - m * 60), y: h - 3, "text-anchor": anchor }, label));
    }
    const base = y(0).toFixed(1);
    let d = "", area = "", prevX = null, prevT = null, segment = [];
    const closeSegment = () => {
      if (fill && prevX !== null) area += "L" + prevX + "," + base + "Z";
      if (segment.length === 1) kids.push(svgEl("circle", { class: "dot", cx: segment[0][0], cy: segment[0][1], r: 2.5 }));
      segment = [];
    };
    for (const p of series) {
      const v = p[field];
      if (v === null) { closeSegment(); prevX = null; continue; }
      const px = x(p[0]).toFixed(1), py = y(v).toFixed(1);
      if (prevX === null || p[0] - prevT > 5) {  // a gap (no data, or the page was away): start a new run
        closeSegment();
        d += "M" + px + "," + py;
        area += "M" + px + "," + base + "L" + px + "," + py;
      } else {
        d += "L" + px + "," + py;
        area += "L" + px + "," + py;
      }
      segment.push([px, py]);
      prevX = px;
      prevT = p[0];
    }
    closeSegment();
    if (fill && area) kids.push(svgEl("path", { class: "area", d: area }));
    if (d) kids.push(svgEl("path", { class: "line", d: d }));
    if (!values.length) kids.push(svgEl("text", { class: "empty", x: (left + w) / 2, y: h / 2, "text-anchor": "middle" }, "no data yet"));
    svg.replaceChildren(...kids);
    const latest = series.length ? series[series.length - 1][field] : null;
    svg.setAttribute("aria-label", name + " over the last 15 minutes: now " + (latest === null ? "no data" : format(latest)) +
      ", peak " + (values.length ? format(Math.max(...values)) : "none"));
    return latest;
  }
  function drawCharts() {
    if ($("fleet").hidden) return;
    // floors keep an idle chart's axis readable (0 to 10 tokens/s, not 0 to 1)
    const tps = drawChart($("chart-tps"), 1, (v) => num(v), true, "Tokens per second", 10);
    const ttft = drawChart($("chart-ttft"), 2, ms, false, "Time to first token, median", 100);
    const waiting = drawChart($("chart-waiting"), 3, (v) => num(v), true, "Waiting requests", 4);
    $("now-tps").textContent = tps === null ? "" : num(tps);
    $("now-ttft").textContent = ttft === null ? "" : ms(ttft);
    $("now-waiting").textContent = waiting === null ? "" : num(waiting, 0);
  }

  // ---- try it -------------------------------------------------------------------------------------
  let running = null;

  function* sseData(buffer) {
    // complete events in `buffer.text`; the unfinished tail stays there for the next read
    let i;
    while ((i = buffer.text.indexOf("\n\n")) >= 0) {
      const event = buffer.text.slice(0, i);
      buffer.text = buffer.text.slice(i + 2);
      for (const line of event.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }

  function showRate(stats, n, t0, tFirst, tEnd, worker, final) {
    const parts = [n + (n === 1 ? " token" : " tokens")];
    if (tFirst !== null) {
      const decode = (tEnd - tFirst) / 1000;
      const rate = n > 1 && decode > 0 ? (n - 1) / decode : n / ((tEnd - t0) / 1000);
      parts.push(num(rate, 1) + " tokens/s", "first token " + ms(tFirst - t0));
    }
    if (worker) parts.push("worker " + worker);
    stats.textContent = parts.join(" · ") + (final ? "" : " …");
    stats.dataset.state = final ? "done" : "streaming";
  }

  async function send(ev) {
    ev.preventDefault();
    const out = $("try-output"), stats = $("try-stats");
    const prompt = $("try-prompt").value.trim();
    if (!prompt || running) return;
    const body = {
      model: $("try-model").value, messages: [{ role: "user", content: prompt }],
      max_tokens: Math.max(1, parseInt($("try-max").value, 10) || 64), stream: true,
      stream_options: { include_usage: true },
    };
    running = new AbortController();
    $("try-send").disabled = true;
    $("try-stop").disabled = false;
    out.replaceChildren();
    out.setAttribute("aria-busy", "true");
    stats.setAttribute("aria-busy", "true");  // announced once, when the answer is complete
    stats.textContent = "waiting for the first token…";
    stats.dataset.state = "waiting";
    const t0 = performance.now();
    let tFirst = null, chunks = 0, usage = null, worker = "";
    try {
      const r = await fetch("/v1/chat/completions", {
        method: "POST", headers: authHeaders({ "Content-Type": "application/json" }),
        body: JSON.stringify(body), signal: running.signal,
      });
      worker = r.headers.get("x-pulse-worker") || "";
      if (!r.ok) {
        const err = await r.json().catch(() => null);
        throw new Error((err && err.error && err.error.message) || "HTTP " + r.status);
      }
      const reader = r.body.getReader(), decoder = new TextDecoder(), buffer = { text: "" };
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer.text += decoder.decode(value, { stream: true });
        for (const data of sseData(buffer)) {
          if (data === "[DONE]") continue;
          const obj = JSON.parse(data);
          if (obj.error) throw new Error(obj.error.message);
          if (obj.usage) usage = obj.usage;
          const delta = obj.choices && obj.choices[0] && obj.choices[0].delta;
          if (delta && delta.content) {
            if (tFirst === null) tFirst = performance.now();
            chunks += 1;
            out.append(delta.content);
            out.scrollTop = out.scrollHeight;
            showRate(stats, chunks, t0, tFirst, performance.now(), worker, false);
          }
        }
      }
      showRate(stats, usage ? usage.completion_tokens : chunks, t0, tFirst, performance.now(), worker, true);
    } catch (e) {
      stats.textContent = e.name === "AbortError" ? "stopped" : "error: " + e.message;
      stats.dataset.state = "failed";
    } finally {
      running = null;
      out.setAttribute("aria-busy", "false");
      stats.setAttribute("aria-busy", "false");
      $("try-send").disabled = false;
      $("try-stop").disabled = true;
    }
  }

  // ---- wiring -------------------------------------------------------------------------------------
  document.addEventListener("DOMContentLoaded", () => {
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      useKey($("key-input").value.trim());
      $("key-input").value = "";
    });
    $("forget-key").addEventListener("click", () => useKey(""));
    $("try-form").addEventListener("submit", send);
    $("try-stop").addEventListener("click", () => running && running.abort());
    window.addEventListener("resize", drawCharts);
    setInterval(tick, 1000);
    loop();
  });
})();
