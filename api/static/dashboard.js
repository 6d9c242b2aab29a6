// The operator's dashboard (served by api/routes/dashboard.py). Plain JavaScript, no build step
// and nothing from outside the API: the page's Content-Security-Policy lets it run this file and
// talk to its own origin, nothing else.
//
// Every string from the API reaches the page as a text node or an attribute value (`el`, `svg`),
// never as markup: model names, reasons and actors are data, not HTML. The admin key lives in
// sessionStorage (this tab only) and goes out only as the Authorization header of the API calls.
// It is typed into the form, or handed over in the address as `#key=sk_…` (an automated browser's
// way in): a fragment never reaches the server or its logs, and the page drops it from the address
// bar and the history once read.
"use strict";

(() => {
  const POLL_MS = 3000;
  const KEY_STORE = "sluice.dashboard.key";
  // Each window's step keeps its charts at about 60 buckets.
  const WINDOWS = [
    { label: "5 min", window: 300, step: 5 },
    { label: "15 min", window: 900, step: 15 },
    { label: "1 h", window: 3600, step: 60 },
    { label: "6 h", window: 21600, step: 360 },
  ];
  const SPARK_POINTS = 100;
  const AUDIT_ROWS = 8;
  const DECISION_ROWS = 8;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const W = 520, H = 200, M = { l: 50, r: 14, t: 12, b: 26 };
  const PERCENTILES = [
    { key: "p50", label: "p50", cls: "s-p50" },
    { key: "p95", label: "p95", cls: "s-p95" },
    { key: "p99", label: "p99", cls: "s-p99" },
  ];

  class AuthError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  const state = {
    key: sessionStorage.getItem(KEY_STORE),
    timer: null,
    generation: 0, // a poll whose generation is stale (key or model changed meanwhile) draws nothing
    hold: false, // the pointer is on a chart: keep its tooltip, draw the next answer once it leaves
    pending: null,
    history: new Map(), // "model/version" -> the numbers seen while the page is open, for sparklines
  };

  const $ = (id) => document.getElementById(id);

  function fill(node, attrs, children) {
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  const el = (tag, attrs, ...children) => fill(document.createElement(tag), attrs, children);
  const svg = (tag, attrs, ...children) => fill(document.createElementNS(SVG_NS, tag), attrs, children);

  // --- formatting ------------------------------------------------------------------------------

  const pad = (n) => String(n).padStart(2, "0");
  function clock(t, seconds) {
    const d = new Date(t * 1000);
    return `${pad(d.getHours())}:${pad(d.getMinutes())}${seconds ? `:${pad(d.getSeconds())}` : ""}`;
  }
  function when(iso) {
    const d = new Date(iso);
    const today = d.toDateString() === new Date().toDateString();
    const day = `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} `;
    return `${today ? "" : day}${clock(d.getTime() / 1000, true)}`;
  }
  function num(v) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "—";
    if (Math.abs(v) >= 10000) return `${+(v / 1000).toFixed(1)}k`;
    if (Math.abs(v) >= 100) return String(Math.round(v));
    if (Math.abs(v) >= 10) return String(+v.toFixed(1));
    return String(+v.toFixed(2));
  }
  function ms(v) {
    if (v === null || v === undefined) return "—";
    return v >= 1000 ? `${num(v / 1000)} s` : `${num(v)} ms`;
  }
  function pct(ratio) {
    if (ratio === null || ratio === undefined) return "—";
    const p = ratio * 100;
    return `${p > 0 && p < 1 ? p.toFixed(2) : num(p)} %`;
  }
  const orDash = (v) => (v === null || v === undefined ? "—" : String(v));
  // A price: small figures keep two significant digits (0.0042), never rounded to 0.
  function money(v) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "—";
    return v > 0 && Math.abs(v) < 0.01 ? String(+v.toPrecision(2)) : num(v);
  }
  function bytes(v) {
    if (v === null || v === undefined) return "—";
    return v >= 2 ** 30 ? `${num(v / 2 ** 30)} GiB` : `${num(v / 2 ** 20)} MiB`;
  }
  // When a version's batching was last tuned: an ISO date or Unix seconds; absent, never.
  function tunedAt(batching) {
    const t = batching ? batching.tuned_at : null;
    if (t === null || t === undefined || t === "") return "never";
    return when(typeof t === "number" ? t * 1000 : t);
  }

  // The nightly job's proposal for a version's batching, for a person to apply (`sluice tune status`,
  // PATCH {"apply_proposal": true}); none: nothing.
  function proposal(batching) {
    const p = batching ? batching.proposal : null;
    if (!p) return "";
    const same = p.max_batch_size === batching.max_batch_size && p.max_wait_ms === batching.max_wait_ms;
    if (same) return "proposal: keep";
    const gain = p.gain === null || p.gain === undefined ? "" : `, ${p.gain >= 0 ? "+" : ""}${pct(p.gain)} predicted`;
    return `proposal: up to ${p.max_batch_size}, ${num(p.max_wait_ms)} ms${gain}`;
  }

  // --- the API ---------------------------------------------------------------------------------

  async function reason(response) {
    try {
      const body = await response.json();
      return (body.error && body.error.message) || response.statusText;
    } catch {
      return response.statusText;
    }
  }

  // 401 and 403 end the session (AuthError); 404 is an answer (null): a model with no rollout.
  async function api(path) {
    const response = await fetch(path, {
      headers: { Authorization: `Bearer ${state.key}`, Accept: "application/json" },
      cache: "no-store",
      credentials: "omit",
    });
    if (response.status === 401 || response.status === 403) {
      throw new AuthError(response.status, await reason(response));
    }
    if (response.status === 404) return null;
    if (!response.ok) throw new Error(`${path.split("?")[0]} answered ${response.status}: ${await reason(response)}`);
    return response.json();
  }

  const params = () => new URLSearchParams(location.hash.slice(1));
  function hashWith(name, value) {
    const p = params();
    p.set(name, value);
    return `#${p.toString()}`;
  }
  function currentWindow() {
    const wanted = Number(params().get("window"));
    return WINDOWS.find((w) => w.window === wanted) || WINDOWS[0];
  }

  async function load() {
    const listed = await api("/v1/models");
    const models = (listed ? listed.models : []).sort((a, b) => a.name.localeCompare(b.name));
    const model = models.find((m) => m.name === params().get("model")) || models[0];
    if (!model) return { models, model: null };
    const win = currentWindow();
    const m = encodeURIComponent(model.name);
    const versions = model.versions.filter((v) => v.state !== "retired");
    const [queue, audit, rollout, ...perVersion] = await Promise.all([
      api(`/v1/models/${m}/queue`),
      api(`/v1/models/${m}/audit?limit=${AUDIT_ROWS}`),
      rolloutOf(model),
      ...versions.map((v) => versionData(m, v, win)),
    ]);
    const entries = audit ? audit.entries : [];
    return {
      models, model, queue, audit: entries, rollout, win,
      versions: versions.map((v, i) => ({ ...v, ...perVersion[i] })),
    };
  }

  async function versionData(m, version, win) {
    const base = `/v1/models/${m}/versions/${encodeURIComponent(version.version)}/stats`;
    const [stats, series] = await Promise.all([
      api(`${base}?window_s=${win.window}`),
      api(`${base}/series?window_s=${win.window}&step_s=${win.step}`),
    ]);
    return { stats, series };
  }

  // The latest rollout, running or finished; null when the model never had one.
  async function rolloutOf(model) {
    const listed = await api(`/v1/models/${encodeURIComponent(model.name)}/rollouts?limit=1&decisions=${DECISION_ROWS}`);
    return listed && listed.items.length ? listed.items[0] : null;
  }

  // --- polling and the key ---------------------------------------------------------------------

  async function poll() {
    clearTimeout(state.timer);
    const generation = ++state.generation;
    if (!state.key) {
      showLogin(null);
      return;
    }
    if (!document.hidden) {
      try {
        const data = await load();
        if (generation !== state.generation) return;
        draw(data);
        showBanner(null);
        $("updated").textContent = `updated ${clock(Date.now() / 1000, true)}`;
      } catch (error) {
        if (generation !== state.generation) return;
        if (error instanceof AuthError) {
          refuse(error);
          return;
        }
        showBanner(`The last update failed (${error.message}); trying again every ${POLL_MS / 1000} s.`);
      }
    }
    state.timer = setTimeout(poll, POLL_MS);
  }

  function refuse(error) {
    sessionStorage.removeItem(KEY_STORE);
    state.key = null;
    showLogin(error.status === 403
      ? "This key is not an admin key (403 forbidden). The dashboard reads the admin API: paste an admin "
        + "key, such as the contents of .sluice/admin.key."
      : `The API refused this key (401 unauthenticated: ${error.message}). Paste an admin key.`);
  }

  function showLogin(message) {
    clearTimeout(state.timer);
    state.generation++;
    state.hold = false;
    state.pending = null;
    $("login").hidden = false;
    $("forget").hidden = true;
    $("models").replaceChildren();
    $("content").replaceChildren();
    $("updated").textContent = "";
    showBanner(null);
    const box = $("key-message");
    box.hidden = !message;
    box.textContent = message || "";
    $("key-input").value = "";
    $("key-input").focus();
  }

  function showBanner(message) {
    $("banner").hidden = !message;
    $("banner").textContent = message || "";
  }

  // --- drawing ---------------------------------------------------------------------------------

  function draw(data) {
    if (state.hold) {
      state.pending = data;
      return;
    }
    state.pending = null;
    $("login").hidden = true;
    $("forget").hidden = false;
    $("models").replaceChildren(...data.models.map((m) => el("a", {
      href: hashWith("model", m.name),
      class: data.model && m.name === data.model.name ? "tab active" : "tab",
      "aria-current": data.model && m.name === data.model.name ? "page" : null,
    }, m.name)));
    if (!data.model) {
      $("content").replaceChildren(el("p", { class: "empty" }, "No model is registered yet."));
      return;
    }
    remember(data);
    $("content").replaceChildren(modelView(data));
  }

  function remember({ model, queue, versions }) {
    const queues = new Map((queue ? queue.versions : []).map((q) => [q.version, q]));
    for (const version of versions) {
      const key = `${model.name}/${version.version}`;
      const seen = state.history.get(key) || { online: [], bulk: [], live: [], desired: [] };
      const q = queues.get(version.version);
      const push = (list, value) => {
        list.push(value === undefined ? null : value);
        if (list.length > SPARK_POINTS) list.shift();
      };
      push(seen.online, q ? q.lanes.online.lag : null);
      push(seen.bulk, q ? q.lanes.bulk.lag : null);
      push(seen.live, q ? q.live_workers : null);
      push(seen.desired, version.replicas ? version.replicas.desired : null);
      state.history.set(key, seen);
    }
  }

  function panel(title, ...body) {
    return el("section", { class: "panel" }, el("h3", {}, title), ...body);
  }

  function table(head, rows, cls, empty) {
    if (!rows.length) return el("p", { class: "muted" }, empty);
    return el("table", { class: cls },
      el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))),
      el("tbody", {}, rows));
  }

  function modelView(data) {
    const { model, queue, audit, versions, rollout, win } = data;
    const queues = new Map((queue ? queue.versions : []).map((q) => [q.version, q]));
    const total = Object.values(model.routing).reduce((a, b) => a + b, 0);
    return el("div", { class: "model", "data-model": model.name },
      el("div", { class: "model-head" },
        el("h1", {}, model.name),
        el("span", { class: "pill" }, model.kind),
        el("span", { class: "pill" }, `tier ${model.tier}`),
        el("span", { class: "muted" }, `charts: the last ${win.label} in steps of ${win.step} s, one panel per version`)),
      el("div", { class: "row" },
        panel("Versions and routing weights", weightsTable(model, queues, total)),
        panel("Rollout", rolloutView(rollout))),
      versions.map((v) => versionView(model, v, queues.get(v.version), total, win)),
      panel(`Audit log (latest ${AUDIT_ROWS})`, auditTable(audit)));
  }

  function weightsTable(model, queues, total) {
    const rows = model.versions.map((v) => {
      const weight = model.routing[v.version] || 0;
      const q = queues.get(v.version);
      const replicas = v.replicas;
      return el("tr", { "data-version": v.version },
        el("td", {}, el("strong", {}, v.version)),
        el("td", {}, el("span", { class: `state state-${v.state}` }, v.state)),
        el("td", { class: "weight num" }, num(weight)),
        el("td", { class: "num" }, total ? pct(weight / total) : "—"),
        el("td", { class: "num" }, q ? String(q.live_workers) : "—"),
        el("td", { class: "num" }, replicas ? String(replicas.desired) : "—"),
        el("td", { class: "small placement" }, placement(replicas)),
        el("td", { class: "muted small" }, replicas ? replicas.reason : "no scheduler decision in the last minute"));
    });
    return table(["Version", "State", "Weight", "Share", "Live", "Desired", "Processes", "Scheduler"], rows, "weights", "");
  }

  // Which worker processes serve the version and what each shares with it: a process that fails
  // takes every version it holds.
  function placement(replicas) {
    if (!replicas) return "—";
    if (replicas.not_served) return `not served: ${replicas.not_served}`;
    const processes = replicas.processes || [];
    if (!processes.length) return "none";
    return processes.map((p) => `${p.group} (${p.tier})` +
      (p.shares_with.length ? ` with ${p.shares_with.join(", ")}` : " alone")).join("; ");
  }

  function rolloutView(rollout) {
    if (!rollout) return el("p", { class: "muted" }, "No rollout yet for this model.");
    const steps = rollout.policy && Array.isArray(rollout.policy.steps) ? rollout.policy.steps.length : "?";
    const step = rollout.step_index < 0 ? "shadow phase" : `step ${rollout.step_index + 1} of ${steps}`;
    const decisions = rollout.decisions.slice().reverse().map((d) => el("tr", { "data-action": d.action },
      el("td", { class: "nowrap" }, when(d.at)),
      el("td", { class: "num" }, d.step_index < 0 ? "shadow" : String(d.step_index + 1)),
      el("td", {}, el("span", { class: `action action-${d.action}` }, d.action)),
      el("td", { class: "small" }, d.reason)));
    return el("div", { class: "rollout", "data-rollout": rollout.id },
      el("p", {},
        el("strong", {}, `#${rollout.id} `),
        `canary ${rollout.canary} against stable ${rollout.stable} · `,
        el("span", { class: `rstate rstate-${rollout.state}` }, rollout.state),
        ` · ${step}, canary at ${num(rollout.weight)} %`),
      rollout.reason ? el("p", { class: "muted small" }, rollout.reason) : null,
      table(["When", "Step", "Decision", "Why"], decisions, "decisions", "No decision yet."));
  }

  function change(before, after) {
    const show = (v) => (v === null || v === undefined ? "—" : typeof v === "object" ? JSON.stringify(v) : String(v));
    if (before && after && typeof before === "object" && typeof after === "object") {
      const keys = [...new Set([...Object.keys(before), ...Object.keys(after)])]
        .filter((k) => JSON.stringify(before[k]) !== JSON.stringify(after[k]));
      if (keys.length) return keys.map((k) => `${k}: ${show(before[k])} → ${show(after[k])}`).join(", ");
    }
    return before === null || before === undefined ? show(after) : `${show(before)} → ${show(after)}`;
  }

  function auditTable(entries) {
    const rows = entries.map((e) => {
      const text = change(e.before, e.after);
      return el("tr", { "data-audit": e.id },
        el("td", { class: "nowrap" }, when(e.at)),
        el("td", {}, e.actor),
        el("td", {}, el("code", {}, e.action)),
        el("td", { class: "small change", title: text }, text.length > 100 ? `${text.slice(0, 99)}…` : text),
        el("td", { class: "small why" }, orDash(e.reason)));
    });
    return table(["When", "Who", "Action", "Change", "Why"], rows, "audit", "No change recorded yet.");
  }

  function versionView(model, version, queue, total, win) {
    const { stats, series } = version;
    const weight = model.routing[version.version] || 0;
    const seen = state.history.get(`${model.name}/${version.version}`);
    const lanes = queue ? queue.lanes : null;
    const oldest = lanes ? Math.max(lanes.online.oldest_age_s, lanes.bulk.oldest_age_s) : null;
    const replicas = version.replicas;
    const buckets = series ? series.buckets : [];
    const frame = series ? { t0: series.since, t1: series.until, step: series.step_s } : { t0: 0, t1: 1, step: 1 };
    return el("section", { class: "version", "data-version": version.version },
      el("header", { class: "version-head" },
        el("h2", {}, version.version),
        el("span", { class: `state state-${version.state}` }, version.state),
        el("span", { class: "muted" }, `weight ${num(weight)}${total ? ` (${pct(weight / total)} of traffic)` : ""}`),
        el("span", { class: "muted" },
          `batches of up to ${version.batching.max_batch_size}, closed after ${num(version.batching.max_wait_ms)} ms`),
        el("span", { class: "muted", "data-field": "tuned_at" }, `last tuned ${tunedAt(version.batching)}`),
        el("span", { class: "muted", "data-field": "proposal" }, proposal(version.batching))),
      el("div", { class: "tiles" },
        tile("Lag online", lanes ? lanes.online.lag : null, seen.online, "lag-online"),
        tile("Lag bulk", lanes ? lanes.bulk.lag : null, seen.bulk, "lag-bulk"),
        tile("Oldest queued", oldest === null ? "—" : `${num(oldest)} s`),
        tile("Workers live", queue ? queue.live_workers : null, seen.live, "live"),
        tile("Workers desired", replicas ? replicas.desired : null, seen.desired, "desired",
          replicas ? replicas.reason : "no scheduler decision in the last minute"),
        tile(`Jobs, ${win.label}`, stats ? stats.count : null),
        tile("Throughput", stats ? `${num(stats.throughput_per_s)}/s` : null),
        tile("Error rate", stats ? pct(stats.error_rate) : null),
        tile("Queue wait p99", stats ? ms(stats.queue_wait_ms.p99) : null, null, null,
          stats && stats.queue_wait_ms.p99 === null ? `needs ${stats.p99_min_samples} jobs in the window` : null),
        tile("Cost / 1,000 jobs", stats ? money(stats.cost.per_1k_jobs) : null, null, "cost",
          stats && stats.cost.per_1k_jobs === null
            ? "needs a price per core-hour (and per GPU-hour on a GPU) and jobs in the window"
            : "model time plus idle slot time, times cores and GPUs, at the configured prices"),
        tile("Padding", stats && stats.cost.padding_ratio !== null ? `${num(stats.cost.padding_ratio)}×` : null,
          null, "padding", "tokens computed (each pass padded to its longest input) / real tokens"),
        tile("Time to fill p50", stats ? ms(stats.fill_ms.p50) : null, null, "fill",
          "a batch's oldest arrival at the worker to its close"),
        tile("Idle slot", stats ? `${num(stats.cost.idle_slot_s)} s` : null, null, "idle",
          `model-slot seconds with no batch, ${win.label}`),
        tile("Weights resident", stats ? bytes(stats.resident_bytes) : null, null, "resident")),
      el("div", { class: "charts" },
        lineChart({ id: "queue_wait", title: "Queue wait", unit: "ms", buckets, frame, format: ms,
          lines: PERCENTILES.map((p) => ({ ...p, get: (b) => b.queue_wait_ms[p.key] })) }),
        lineChart({ id: "model_time", title: "Model time", unit: "ms", buckets, frame, format: ms,
          lines: PERCENTILES.map((p) => ({ ...p, get: (b) => b.model_ms[p.key] })) }),
        lineChart({ id: "throughput", title: "Throughput", unit: "jobs/s", buckets, frame, format: (v) => `${num(v)}/s`,
          lines: [{ key: "rate", label: "finished", cls: "s-rate", get: (b) => b.throughput_per_s }] }),
        lineChart({ id: "error_rate", title: "Error rate", unit: "%", buckets, frame, format: (v) => `${num(v)} %`,
          lines: [{ key: "errors", label: "failed", cls: "s-error",
            get: (b) => (b.error_rate === null ? null : b.error_rate * 100) }] }),
        barChart({ id: "batch_sizes", title: "Batch sizes", unit: `batches per size, ${win.label}`,
          bars: sizeBars(stats), cls: () => "bar" }),
        barChart({ id: "close_reasons", title: "Close reasons", unit: `batches, ${win.label}`,
          bars: stats ? Object.entries(stats.close_reasons).map(([label, value]) => ({ label, value })) : [],
          cls: (bar) => `bar reason-${bar.label}` })));
  }

  function sizeBars(stats) {
    if (!stats) return [];
    const counts = new Map(Object.entries(stats.batch_size.histogram).map(([size, n]) => [Number(size), n]));
    const largest = Math.max(0, ...counts.keys());
    // Every size up to the largest seen, zeros included, shows the histogram's shape; past 64
    // sizes the bars would be slivers, so only the sizes seen.
    const sizes = largest <= 64 ? Array.from({ length: largest }, (_, i) => i + 1) : [...counts.keys()].sort((a, b) => a - b);
    return sizes.map((size) => ({ label: String(size), value: counts.get(size) || 0 }));
  }

  function tile(label, value, history, id, title) {
    return el("div", { class: "tile", "data-tile": id, title },
      el("div", { class: "tile-label" }, label),
      el("div", { class: "tile-value" }, orDash(value)),
      history ? sparkline(history) : null);
  }

  function sparkline(values) {
    const w = 120, h = 26;
    const known = values.filter((v) => v !== null);
    const top = Math.max(1, ...known);
    // Spread over the width from the second poll on: the page's history starts when it opens.
    const points = values.map((v, i) => [values.length < 2 ? w : (i / (values.length - 1)) * w,
      v === null ? null : h - 2 - (v / top) * (h - 4)]);
    const d = pathOf(points, (t) => t, (v) => v);
    return svg("svg", { class: "spark", viewBox: `0 0 ${w} ${h}`, preserveAspectRatio: "none", "aria-hidden": "true",
      "data-points": known.length }, d ? svg("path", { d }) : null);
  }

  function pathOf(points, x, y) {
    let d = "";
    let pen = false;
    for (const [t, v] of points) {
      if (v === null || !Number.isFinite(v)) {
        pen = false;
        continue;
      }
      d += `${pen ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
      pen = true;
    }
    return d;
  }

  function scale(max, integer) {
    if (!(max > 0)) return { top: integer ? 4 : 1, step: integer ? 1 : 0.25 };
    const raw = max / 4;
    const mag = 10 ** Math.floor(Math.log10(raw));
    const n = raw / mag;
    let step = (n <= 1 ? 1 : n <= 2 ? 2 : n <= 2.5 ? 2.5 : n <= 5 ? 5 : 10) * mag;
    if (integer) step = Math.max(1, Math.round(step));
    return { top: Math.ceil(max / step - 1e-9) * step, step };
  }

  function yAxis(plot, sc, y, format) {
    for (let v = 0; v <= sc.top + sc.step / 2; v += sc.step) {
      plot.append(
        svg("line", { class: v === 0 ? "axis" : "grid", x1: M.l, x2: W - M.r, y1: y(v), y2: y(v) }),
        svg("text", { class: "tick", x: M.l - 6, y: y(v) + 4, "text-anchor": "end" }, format(v)));
    }
  }

  const TIME_STEPS = [5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600];
  function timeTicks(t0, t1) {
    const every = TIME_STEPS.find((s) => (t1 - t0) / s <= 6) || 43200;
    const ticks = [];
    for (let t = Math.ceil(t0 / every) * every; t <= t1; t += every) ticks.push(t);
    return { ticks, seconds: every < 60 };
  }

  function figure(id, title, unit, legend, plot) {
    return el("figure", { class: "chart", "data-figure": id },
      el("figcaption", {}, el("span", { class: "chart-title" }, title),
        unit ? el("span", { class: "muted" }, ` ${unit}`) : null,
        legend ? el("span", { class: "legend" }, legend) : null),
      plot);
  }

  function lineChart({ id, title, unit, buckets, frame, lines, format }) {
    const { t0, t1, step } = frame;
    const points = lines.map((line) => buckets.map((b) => [b.t + step / 2, line.get(b)]));
    const values = points.flat().map((p) => p[1]).filter((v) => v !== null && Number.isFinite(v));
    const sc = scale(Math.max(0, ...values), false);
    const x = (t) => M.l + ((t - t0) / Math.max(1e-9, t1 - t0)) * (W - M.l - M.r);
    const y = (v) => H - M.b - (v / sc.top) * (H - M.t - M.b);
    const plot = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "plot", "data-chart": id, role: "img",
      "aria-label": `${title} (${unit})` });
    const time = timeTicks(t0, t1);
    for (const t of time.ticks) {
      plot.append(svg("line", { class: "grid", x1: x(t), x2: x(t), y1: M.t, y2: H - M.b }),
        svg("text", { class: "tick", x: x(t), y: H - 8, "text-anchor": "middle" }, clock(t, time.seconds)));
    }
    yAxis(plot, sc, y, (v) => num(v));
    lines.forEach((line, i) => {
      const d = pathOf(points[i], x, y);
      const drawn = points[i].filter(([, v]) => v !== null && Number.isFinite(v)).length;
      plot.append(svg("path", { class: `line ${line.cls}`, "data-series": line.key, "data-points": drawn, d: d || null }));
      // A point with a gap on each side has no segment to show it: a dot does.
      points[i].forEach(([t, v], k) => {
        const gap = (p) => !p || p[1] === null;
        if (v !== null && gap(points[i][k - 1]) && gap(points[i][k + 1])) {
          plot.append(svg("circle", { class: `dot ${line.cls}`, cx: x(t), cy: y(v), r: 2.5 }));
        }
      });
    });
    if (!values.length) {
      plot.append(svg("text", { class: "nodata", x: (W + M.l) / 2, y: H / 2, "text-anchor": "middle" },
        "no finished jobs in this window"));
    }
    const legend = lines.length > 1 ? lines.map((l) => el("span", { class: "key" },
      el("span", { class: `swatch ${l.cls}` }), l.label)) : null;
    const fig = figure(id, title, `(${unit})`, legend, plot);
    if (buckets.length) hover(fig, plot, buckets, lines, x, format, frame);
    return fig;
  }

  function hover(fig, plot, buckets, lines, x, format, { t0, t1, step }) {
    const rule = svg("line", { class: "rule", y1: M.t, y2: H - M.b, visibility: "hidden" });
    const zone = svg("rect", { class: "zone", x: M.l, y: M.t, width: W - M.l - M.r, height: H - M.t - M.b });
    plot.append(rule, zone);
    const tip = el("div", { class: "tip", hidden: true });
    fig.append(tip);
    zone.addEventListener("pointerenter", () => { state.hold = true; });
    zone.addEventListener("pointermove", (event) => {
      const box = plot.getBoundingClientRect();
      const vx = ((event.clientX - box.left) / box.width) * W;
      const t = t0 + ((vx - M.l) / (W - M.l - M.r)) * (t1 - t0);
      const b = buckets[Math.min(buckets.length - 1, Math.max(0, Math.floor((t - t0) / step)))];
      const cx = x(b.t + step / 2);
      rule.setAttribute("x1", cx);
      rule.setAttribute("x2", cx);
      rule.setAttribute("visibility", "visible");
      tip.replaceChildren(
        el("div", { class: "tip-head" }, `${clock(b.t, true)}–${clock(b.t + step, true)} · ${b.count} jobs`),
        ...lines.map((l) => el("div", {}, el("span", { class: `swatch ${l.cls}` }),
          `${l.label} ${l.get(b) === null ? "—" : format(l.get(b))}`)));
      tip.hidden = false;
      const px = (cx / W) * box.width;
      // Element.style is the CSSOM, which the page's CSP allows (a style attribute it would not).
      tip.style.left = `${px > box.width / 2 ? px - tip.offsetWidth - 10 : px + 10}px`;
      tip.style.top = `${(M.t / H) * box.height + 18}px`;
    });
    zone.addEventListener("pointerleave", () => {
      tip.hidden = true;
      rule.setAttribute("visibility", "hidden");
      state.hold = false;
      if (state.pending) draw(state.pending);
    });
  }

  function barChart({ id, title, unit, bars, cls }) {
    const sc = scale(Math.max(0, ...bars.map((b) => b.value)), true);
    const y = (v) => H - M.b - (v / sc.top) * (H - M.t - M.b);
    const plot = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "plot", "data-chart": id, role: "img",
      "aria-label": `${title} (${unit})` });
    yAxis(plot, sc, y, (v) => num(v));
    const band = (W - M.l - M.r) / Math.max(1, bars.length);
    const width = Math.max(1, Math.min(56, band * 0.72));
    const labelEvery = Math.ceil(bars.length / 24);
    bars.forEach((bar, i) => {
      const cx = M.l + band * (i + 0.5);
      const top = y(bar.value);
      plot.append(svg("rect", { class: cls(bar), x: cx - width / 2, y: top, width, height: Math.max(0, H - M.b - top),
        "data-label": bar.label, "data-value": bar.value }, svg("title", {}, `${bar.label}: ${bar.value}`)));
      if (i % labelEvery === 0) {
        plot.append(svg("text", { class: "tick", x: cx, y: H - 8, "text-anchor": "middle" }, bar.label));
      }
      if (bars.length <= 12 && bar.value > 0) {
        plot.append(svg("text", { class: "value", x: cx, y: top - 4, "text-anchor": "middle" }, num(bar.value)));
      }
    });
    if (!bars.some((b) => b.value > 0)) {
      plot.append(svg("text", { class: "nodata", x: (W + M.l) / 2, y: H / 2, "text-anchor": "middle" },
        "no batches in this window"));
    }
    return figure(id, title, `(${unit})`, null, plot);
  }

  // --- start -----------------------------------------------------------------------------------

  function takeKeyFromAddress() {
    const p = params();
    const key = (p.get("key") || "").trim();
    if (!p.has("key")) return;
    p.delete("key");
    const rest = p.toString();
    history.replaceState(history.state, "", `${location.pathname}${location.search}${rest ? `#${rest}` : ""}`);
    if (!key) return;
    sessionStorage.setItem(KEY_STORE, key);
    state.key = key;
  }

  function start() {
    takeKeyFromAddress();
    const select = $("window");
    select.replaceChildren(...WINDOWS.map((w) => el("option", { value: w.window }, w.label)));
    select.value = String(currentWindow().window);
    select.addEventListener("change", () => { location.hash = hashWith("window", select.value); });
    window.addEventListener("hashchange", () => {
      select.value = String(currentWindow().window);
      poll();
    });
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) poll();
    });
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_STORE, key);
      state.key = key;
      $("key-input").value = "";
      $("login").hidden = true;
      poll();
    });
    $("forget").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_STORE);
      state.key = null;
      state.history.clear();
      showLogin(null);
    });
    poll();
  }

  start();
})();
