// The shoal status page: polls /api/status, shows the workers and live charts, and streams a playground chat.
// Plain browser JavaScript, no build step, no libraries. Nothing here may throw to the console: every
// expected failure (401, router down, a bad chunk) is shown on the page instead.
"use strict";

(function () {
  const POLL_MS = 1500;
  const POLL_TIMEOUT_MS = 5000;   // a hung router must not stall the polling loop
  const WINDOW_S = 300;           // the charts keep the last 5 minutes
  const KEY_STORE = "shoal.apiKey";
  const $ = (id) => document.getElementById(id);

  // ---- API key: kept per tab in sessionStorage, sent on every request ----------------------------
  function getKey() {
    try { return sessionStorage.getItem(KEY_STORE) || ""; } catch (e) { return ""; }
  }
  function setKey(k) {
    try { sessionStorage.setItem(KEY_STORE, k); } catch (e) { /* storage disabled: nothing to keep it in */ }
  }
  function headers(extra) {
    const h = Object.assign({}, extra);
    if (getKey()) h["Authorization"] = "Bearer " + getKey();
    return h;
  }
  function askForKey() {
    $("key-message").textContent = getKey() ? "The API key was rejected; enter the current one."
                                             : "This cluster needs an API key.";
    if ($("key-form").hidden) { $("key-form").hidden = false; $("key-input").focus(); }
  }

  // ---- rates: per-worker counter deltas between consecutive polls --------------------------------
  // Summed per worker name so the rate stays right whichever router answers. A worker seen for the first
  // time (or gone since) adds nothing; a negative delta (the worker restarted) counts as 0.
  function computeRates(prev, cur) {
    const dt = prev && cur ? elapsed(prev, cur) : 0;
    if (!(dt > 0)) return null;
    const before = new Map((prev.workers || []).map((w) => [w.worker, w]));
    let reqs = 0, toks = 0;
    for (const w of cur.workers || []) {
      const p = before.get(w.worker);
      if (!p) continue;
      reqs += Math.max(0, (w.num_finished_requests || 0) - (p.num_finished_requests || 0));
      toks += Math.max(0, (w.num_generation_tokens || 0) - (p.num_generation_tokens || 0));
    }
    return { rps: reqs / dt, tps: toks / dt };
  }
  // The router's clock is the better measure (closer to when the counters were read), but replicas may
  // disagree: fall back on the page's own clock when theirs is off from it by more than a second.
  function elapsed(prev, cur) {
    const local = (cur.receivedAt - prev.receivedAt) / 1000, remote = cur.time - prev.time;
    return Number.isFinite(remote) && remote > 0 && !(Math.abs(remote - local) > 1) ? remote : local;
  }

  // ---- chart series: [t (page seconds), value or null] over the last WINDOW_S ---------------------
  const series = { rps: [], tps: [], p50: [], p99: [] };
  function push(name, t, v) {
    const s = series[name];
    s.push([t, v]);
    while (s.length && s[0][0] < t - WINDOW_S) s.shift();
  }

  // ---- polling: one request at a time, the next one scheduled when it ends -------------------------
  let prevSample = null, lastStatus = null;
  // Whether the router wants a key (GET /api/auth, open like /health): the page then asks for it before
  // its first poll, so a first visit sends no request that gets a 401 (which the browser logs as an error).
  let keyRequired = false;

  async function poll() {
    if (keyRequired && !getKey()) { askForKey(); setTimeout(poll, POLL_MS); return; }
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), POLL_TIMEOUT_MS);
    try {
      const res = await fetch("/api/status", { headers: headers(), cache: "no-store", signal: ctl.signal });
      if (res.status === 401) { askForKey(); showNotice(""); return; }
      if (!res.ok) { showNotice("Router unreachable (HTTP " + res.status + "), retrying…"); return; }
      const st = await res.json();
      st.receivedAt = performance.now();
      $("key-form").hidden = true;
      showNotice("");
      render(st);
    } catch (e) {
      // A network error, a timeout, or a body that is not JSON: all mean "try again shortly".
      showNotice("Router unreachable, retrying…");
    } finally {
      clearTimeout(timer);
      setTimeout(poll, POLL_MS);
    }
  }
  function showNotice(msg) {
    $("notice").textContent = msg;
    $("notice").hidden = !msg;
    document.body.classList.toggle("stale", !!msg);   // dims the last data shown
  }

  // ---- rendering --------------------------------------------------------------------------------
  function render(st) {
    lastStatus = st;
    const workers = Array.isArray(st.workers) ? st.workers : [], configured = st.num_workers || 0;
    $("model").textContent = st.model || "?";
    document.title = "shoal · " + (st.model || "cluster");
    const shape = { workers: workers.length + "/" + configured, tp: st.tensor_parallel_size,
      routing: st.routing, "max-len": st.max_model_len, block: st.block_size, router: st.router };
    for (const k in shape) $("shape-" + k).textContent = shape[k] === undefined ? "–" : shape[k];
    $("updated").textContent = Number.isFinite(st.time) ? new Date(st.time * 1000).toLocaleTimeString() : "";
    if (st.max_model_len) $("play-max-tokens").max = st.max_model_len;
    $("workers-warning").hidden = workers.length >= configured;
    $("workers-warning").textContent = workers.length + " of " + configured + " workers answering";
    renderWorkers(workers);
    renderTiers(workers, num(st.block_size) || 0);

    const rs = st.router_stats || {};
    const total = (f) => workers.reduce((a, w) => a + (num(w[f]) || 0), 0);
    $("stat-running").textContent = fmt(rs.num_requests_running, 0);
    $("stat-queue").textContent = total("num_running") + " / " + total("num_waiting");
    $("stat-ttft-p50").textContent = fmtSeconds(rs.ttft_p50_s);
    $("stat-ttft-p99").textContent = fmtSeconds(rs.ttft_p99_s);

    const t = st.receivedAt / 1000, rates = computeRates(prevSample, st);
    prevSample = st;
    if (rates) {
      push("rps", t, rates.rps);
      push("tps", t, rates.tps);
      $("stat-rps").textContent = fmt(rates.rps, 2);
      $("stat-tps").textContent = fmt(rates.tps, 1);
    }
    push("p50", t, num(rs.ttft_p50_s));
    push("p99", t, num(rs.ttft_p99_s));
    drawCharts();
  }

  function renderWorkers(workers) {
    const rows = workers.map((w) => {
      const total = num(w.num_total_blocks) || 0, used = Math.max(0, total - (num(w.num_free_blocks) || 0));
      const pct = total ? (100 * used) / total : 0;
      const bar = el("div", { class: "bar" + (pct >= 90 ? " hot" : pct >= 75 ? " warm" : "") });
      const usedBar = el("div", { class: "used" });
      usedBar.style.width = pct.toFixed(1) + "%";  // through the CSSOM: the page's CSP refuses style attributes
      bar.append(usedBar);
      const kv = el("td", { class: "kv", "data-used": used, "data-total": total });
      kv.append(bar, el("span", { class: "kvtext" }, used + " / " + total + " (" + pct.toFixed(0) + "%)"));
      const tr = el("tr", { class: "worker-row", "data-worker": w.worker });
      tr.append(el("td", { class: "name" }, w.worker), kv,
        el("td", { class: "num running" }, fmt(w.num_running, 0)),
        el("td", { class: "num waiting" }, fmt(w.num_waiting, 0)),
        el("td", { class: "num hit" }, fmtPct(w.prefix_cache_hit_rate)),
        el("td", { class: "num preemptions" }, fmt(w.num_preemptions, 0)),
        el("td", { class: "num finished" }, fmt(w.num_finished_requests, 0)),
        el("td", { class: "lora", title: "waiting: " + ((w.waiting_lora_adapters || []).join(", ") || "none") },
          (w.lora_on_device || []).join(", ") || "–"));
      return tr;
    });
    if (!rows.length) {
      rows.push(el("tr", { class: "empty" }));
      rows[0].append(el("td", { colspan: 8 }, "no worker is answering"));
    }
    $("workers").replaceChildren(...rows);
  }

  function renderTiers(workers, blockSize) {
    const rows = [];
    const ms = (x) => (x > 0 ? fmt(x, x < 10 ? 3 : 1) : "–");
    for (const w of workers) {
      const tiers = w.kv_tiers && typeof w.kv_tiers === "object" ? w.kv_tiers : {};
      const prefill = (num(w.prefill_us_per_token) || 0) * blockSize / 1000;  // ms to prefill a block there
      for (const name of Object.keys(tiers).sort()) {
        const t = tiers[name] || {};
        const used = num(t.used_blocks) || 0, total = num(t.total_blocks) || 0, query = num(t.query_tokens) || 0;
        const tr = el("tr", { class: "tier-row", "data-worker": w.worker, "data-tier": name });
        tr.append(el("td", { class: "name" }, w.worker), el("td", { class: "tier" }, name),
          el("td", { class: "num hits" }, fmt(num(t.hit_tokens), 0)),
          el("td", { class: "num share" }, query ? fmtPct((num(t.hit_tokens) || 0) / query) : "–"),
          el("td", { class: "num loaded" }, fmt(num(t.loaded_blocks), 0)),
          el("td", { class: "num saved" }, fmt(num(t.saved_blocks), 0)),
          el("td", { class: "num failed" }, fmt(num(t.failed_blocks), 0)),
          el("td", { class: "num fetch-ms" }, ms(num(t.loaded_blocks) ? (num(t.load_us) || 0) / num(t.loaded_blocks) / 1000 : 0)),
          el("td", { class: "num prefill-ms" }, ms(prefill)),
          el("td", { class: "num used" }, used + " / " + total + (total ? " (" + fmtPct(used / total) + ")" : "")));
        rows.push(tr);
      }
    }
    $("tiers-section").hidden = !rows.length;  // no tier on any worker: no panel
    $("tiers").replaceChildren(...rows);
  }

  // textContent only: names come from the cluster and are never parsed as HTML.
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text) e.textContent = text;
    return e;
  }
  function num(v) { return typeof v === "number" && Number.isFinite(v) ? v : null; }
  function fmt(v, digits) { return num(v) === null ? "–" : v.toFixed(digits); }
  function fmtPct(v) { return num(v) === null ? "–" : (100 * v).toFixed(1) + "%"; }
  function fmtSeconds(v) {
    return num(v) === null ? "–" : v < 1 ? (1000 * v).toFixed(0) + " ms" : v.toFixed(2) + " s";
  }

  // ---- charts, drawn on <canvas>; data-points says how many samples each holds --------------------
  const CHARTS = [
    { id: "chart-rps", lines: [["rps", "#2f81f7"]], label: (v) => String(+v.toPrecision(3)) },
    { id: "chart-tps", lines: [["tps", "#1f9d55"]], label: (v) => String(+v.toPrecision(3)) },
    { id: "chart-ttft", lines: [["p50", "#2f81f7"], ["p99", "#d9480f"]], label: fmtSeconds },
  ];
  function drawCharts() {
    const now = performance.now() / 1000;
    for (const c of CHARTS) {
      const canvas = $(c.id);
      drawChart(canvas, c.lines.map(([name, color]) => [series[name], color]), now, c.label);
      canvas.dataset.points = series[c.lines[0][0]].length;
      const last = c.lines.map(([name]) => (series[name].length ? series[name].at(-1)[1] : null));
      $(c.id + "-last").textContent = last.some((v) => v !== null) ? last.map(c.label).join(" / ") : "";
    }
  }

  function drawChart(canvas, lines, now, label) {
    // Size the backing store to the element and the screen's pixel ratio so lines stay sharp.
    const dpr = window.devicePixelRatio || 1, w = canvas.clientWidth || 300, h = canvas.clientHeight || 140;
    if (canvas.width !== Math.round(w * dpr)) canvas.width = Math.round(w * dpr);
    if (canvas.height !== Math.round(h * dpr)) canvas.height = Math.round(h * dpr);
    const ctx = canvas.getContext("2d");
    if (!ctx) return;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const L = 52, R = 8, T = 8, B = 18, pw = w - L - R, ph = h - T - B;
    let max = 0;
    for (const [s] of lines) for (const [, v] of s) if (v !== null && v > max) max = v;
    max = niceCeil(max);
    const x = (t) => L + pw * (1 - (now - t) / WINDOW_S), y = (v) => T + ph * (1 - v / max);

    // Grid: four horizontal lines with their values, and a label each minute.
    Object.assign(ctx, { font: "10px system-ui, sans-serif", fillStyle: "#6a737d", strokeStyle: "#e3e6ea",
      lineWidth: 1, textAlign: "right", textBaseline: "middle" });
    for (let i = 0; i <= 4; i++) {
      const v = (max * i) / 4, yy = Math.round(y(v)) + 0.5;
      ctx.beginPath(); ctx.moveTo(L, yy); ctx.lineTo(w - R, yy); ctx.stroke();
      ctx.fillText(label(v), L - 4, yy);
    }
    ctx.textBaseline = "top";
    for (let m = 5; m >= 0; m--) {   // the end labels lean inwards so the canvas edge does not cut them
      ctx.textAlign = m === 5 ? "left" : m === 0 ? "right" : "center";
      ctx.fillText(m ? "-" + m + "m" : "now", x(now - 60 * m), h - B + 4);
    }

    // Each series as a line; a null (no TTFT in the router's window) breaks it. Every run starts with a
    // short tick so that a lone point between two gaps still shows.
    Object.assign(ctx, { lineWidth: 1.5, lineJoin: "round" });
    for (const [s, color] of lines) {
      ctx.strokeStyle = color;
      ctx.beginPath();
      let open = false;
      for (const [t, v] of s) {
        if (v === null) { open = false; continue; }
        if (!open) { ctx.moveTo(x(t) - 1.5, y(v)); open = true; }
        ctx.lineTo(x(t), y(v));
      }
      ctx.stroke();
    }
  }
  // 1, 2 or 5 times a power of ten, at or above v; never 0, so an idle chart still has an axis.
  function niceCeil(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    return [1, 2, 5, 10].find((m) => v <= m * p * (1 + 1e-9)) * p;
  }

  // ---- playground: one streamed chat completion at a time -----------------------------------------
  let playCtl = null;

  function readNumber(id, name, lo, hi, integer) {
    const raw = $(id).value, v = Number(raw);
    if (raw === "" || !(v >= lo && v <= hi) || (integer && !Number.isInteger(v)))
      throw new RangeError(`${name} must be ${integer ? "an integer" : "a number"} from ${lo} to ${hi}`);
    return v;
  }
  function playError(msg) {
    $("play-error").textContent = msg;
    $("play-error").hidden = !msg;
  }
  function setPlaying(on, status) {
    $("play-send").disabled = on;
    $("play-stop").disabled = !on;
    $("play-status").textContent = status;
  }

  async function send() {
    if (playCtl) return;
    playError("");
    const body = { messages: [{ role: "user", content: $("play-input").value }],
                   stream: true, stream_options: { include_usage: true } };
    try {
      body.temperature = readNumber("play-temperature", "temperature", 0, 2, false);
      body.top_p = readNumber("play-top-p", "top-p", 0, 1, false);
      const maxLen = Number($("play-max-tokens").max) || 1e9;   // max_model_len, once a status came
      body.max_tokens = readNumber("play-max-tokens", "max tokens", 1, maxLen, true);
    } catch (e) { playError(e.message); return; }
    if (lastStatus && lastStatus.model) body.model = lastStatus.model;

    const out = $("play-output"), tps = $("play-tps");
    out.textContent = "";
    $("play-ttft").textContent = tps.textContent = "–";
    tps.dataset.final = "0";
    $("play-tokens").textContent = "0";
    setPlaying(true, "waiting…");
    playCtl = new AbortController();
    const t0 = performance.now();
    let tFirst = null, chunks = 0, usage = null, finish = null, done = false;
    const onEvent = (msg) => {
      if (msg.error) { playError(msg.error.message || "the stream reported an error"); return; }
      if (msg.usage) usage = msg.usage;
      const choice = msg.choices && msg.choices[0];
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      const text = choice && choice.delta && choice.delta.content;
      if (!text) return;
      const now = performance.now();
      if (tFirst === null) { tFirst = now; $("play-ttft").textContent = fmtSeconds((now - t0) / 1000); }
      out.append(text);
      $("play-tokens").textContent = ++chunks;
      // Running estimate, one token per chunk: the tokens after the first over the time since it came.
      if (chunks > 1) tps.textContent = ((chunks - 1) / ((now - tFirst) / 1000)).toFixed(1);
    };
    try {
      const res = await fetch("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
        signal: playCtl.signal, headers: headers({ "Content-Type": "application/json" }) });
      if (!res.ok) {
        if (res.status === 401) askForKey();
        playError("HTTP " + res.status + ": " + (await errorMessage(res)));
        setPlaying(false, "failed");
        return;
      }
      setPlaying(true, "streaming…");
      done = await readEvents(res.body.getReader(), onEvent);
      if (usage && Number.isFinite(usage.completion_tokens)) {   // the exact count, from the usage chunk
        const n = usage.completion_tokens, secs = (performance.now() - (tFirst === null ? t0 : tFirst)) / 1000;
        $("play-tokens").textContent = n;
        if (n > 1 && secs > 0) tps.textContent = ((n - 1) / secs).toFixed(1);
        tps.dataset.final = "1";
      }
      setPlaying(false, done ? "done" + (finish ? " (" + finish + ")" : "") : "stream ended early");
    } catch (e) {
      if (e && e.name === "AbortError") setPlaying(false, "stopped");
      else { playError("Request failed: " + (e && e.message ? e.message : e)); setPlaying(false, "failed"); }
    } finally {
      playCtl = null;
    }
  }

  // Server-Sent Events: "data: {json}" lines, blank-line separated, ended by "data: [DONE]". Calls
  // onEvent with each parsed object; resolves true on [DONE], false if the body ended without it.
  async function readEvents(reader, onEvent) {
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const r = await reader.read();
      if (r.done) return false;
      buf += decoder.decode(r.value, { stream: true });
      const lines = buf.split(/\r?\n/);
      buf = lines.pop();   // the last piece may be a partial line
      for (const line of lines) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") { reader.cancel().catch(() => {}); return true; }
        let msg;
        try { msg = JSON.parse(data); } catch (e) { continue; }   // a malformed event is skipped
        onEvent(msg);
      }
    }
  }

  // The OpenAI-style error body's message, or the status text when the body is something else.
  async function errorMessage(res) {
    try {
      const j = await res.json();
      return (j && j.error && j.error.message) || JSON.stringify(j);
    } catch (e) { return res.statusText || "request failed"; }
  }

  // ---- wiring -----------------------------------------------------------------------------------
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    setKey($("key-input").value.trim());
    $("key-input").value = "";
    $("key-form").hidden = true;   // the next poll (within POLL_MS) shows whether the key works
  });
  $("play-form").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
  $("play-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); send(); }
  });
  $("play-stop").addEventListener("click", () => { if (playCtl) playCtl.abort(); });
  window.addEventListener("resize", drawCharts);

  // For tests and the curious: the rate arithmetic, the chart data, and the last status shown.
  window.shoalStatus = { computeRates, series, lastStatus: () => lastStatus };
  fetch("/api/auth", { cache: "no-store" })
    .then((res) => (res.ok ? res.json() : {}))
    .then((j) => { keyRequired = !!j.api_key_required; }, () => { /* unknown: a 401 will tell */ })
    .finally(poll);
})();
