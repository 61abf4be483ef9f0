// Fencegate dashboard: plain JavaScript, no build step, no third-party code.
//
// Auth: every call goes to the same origin under /admin/. When the token field is filled
// in, the call carries "Authorization: Bearer <token>" (the token is kept in
// sessionStorage for this tab, never in a URL). When it is empty, the call carries no
// Authorization of its own, so whatever added the header to the page request (a proxy,
// a header extension, a test browser) authenticates the calls as well.
//
// Everything that came from the server is put into the page with textContent, never
// as HTML: paths, keys and owners are chosen by workers.
"use strict";

(() => {
  const TOKEN_KEY = "fencegate.adminToken";
  const PAGE_SIZE = 50;
  const REFRESH_SECONDS = 30;
  // "since the first entry" (the default window): chart.js's windowFromData, at most
  // the server's longest window (366 days).
  const HOUR = 3600;
  const MAX_WINDOW_SECONDS = 366 * 86400;

  // One colour per reason, stable across reloads (the legend and the table use them too).
  const COLOURS = {
    "stale-generation": "#d62728",
    "lease-expired": "#ff7f0e",
    "lease-ended": "#bcbd22",
    "invalid-fencing-token": "#9467bd",
    "missing-fencing-token": "#8c564b",
    "missing-idempotency-key": "#e377c2",
    "idempotency-key-reused": "#17becf",
    "idempotent-replay": "#7f7f7f",
    "auto-resolved": "#2ca02c",
    "outcome-unknown": "#1f77b4",
    "request-in-progress": "#aec7e8",
    "ordering-timeout": "#ffbb78",
    "upstream-unavailable": "#98df8a",
    "upstream-timeout": "#2ca02c",
    "body-too-large": "#c5b0d5",
    "unknown-upstream": "#c49c94",
    "invalid-request": "#f7b6d2",
    "store-unavailable": "#393b79",
    "overloaded": "#637939",
  };
  const SPARE_COLOURS = ["#8c6d31", "#843c39", "#7b4173", "#5254a3", "#6b6ecf", "#e7ba52"];

  const state = {
    series: null,
    cursor: null,
    rows: 0,
    timelineJob: null,
    geometry: null,
    refresh: null, // refresh.js's controller
    loading: false,
    edited: false, // a field typed in since the last load: an automatic one waits
    autoWindow: HOUR, // the window "since the first entry" chose last, in seconds
  };

  const $ = (id) => document.getElementById(id);

  function colour(reason) {
    if (Object.prototype.hasOwnProperty.call(COLOURS, reason)) return COLOURS[reason];
    let hash = 0;
    for (const ch of reason) hash = (hash * 31 + ch.codePointAt(0)) >>> 0;
    return SPARE_COLOURS[hash % SPARE_COLOURS.length];
  }

  // el("td", {className: "mono"}, "text", otherNode): strings become text nodes.
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (key === "dataset") Object.assign(node.dataset, value);
      else if (key === "on") for (const [ev, fn] of Object.entries(value)) node.addEventListener(ev, fn);
      else node[key] = value;
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function show(value) {
    return value === null || value === undefined || value === "" ? "—" : String(value);
  }

  function fmtTime(iso) {
    return iso ? iso.replace("T", " ") : "—";
  }

  function setStatus(text, kind) {
    const node = $("status");
    node.textContent = text || "";
    node.className = kind || "";
  }

  // -- calls ---------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, doc) {
      const detail = doc && doc.detail ? doc.detail : `HTTP ${status}`;
      super(detail);
      this.status = status;
      this.doc = doc;
    }
  }

  function token() {
    return $("token").value.trim();
  }

  async function api(path, body) {
    const headers = { Accept: "application/json" };
    const t = token();
    if (t) headers.Authorization = `Bearer ${t}`;
    const init = { method: "GET", headers, cache: "no-store", credentials: "same-origin" };
    if (body !== undefined) {
      init.method = "POST";
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const resp = await fetch(path, init);
    const text = await resp.text();
    let doc = null;
    try {
      doc = text ? JSON.parse(text) : null;
    } catch (_error) {
      doc = null;
    }
    if (!resp.ok) throw new ApiError(resp.status, doc);
    return doc;
  }

  function explain(error) {
    if (error instanceof ApiError) {
      if (error.status === 401) return "The admin API needs a token: type an admin token above.";
      if (error.status === 403) return "This token may not use the admin API: use an admin token.";
      return `${error.status}: ${error.message}`;
    }
    return String(error && error.message ? error.message : error);
  }

  // -- chart ---------------------------------------------------------------------------

  // The drawing is chart.js's (window.FencegateChart), time labels at round times.
  function drawChart() {
    state.geometry = window.FencegateChart.draw($("chart"), state.series, colour);
  }

  function renderLegend() {
    const legend = $("legend");
    legend.replaceChildren();
    const series = state.series;
    if (!series || series.reasons.length === 0) {
      legend.append(el("li", { className: "muted" }, "No refusals in this window."));
      return;
    }
    const selected = $("filter-reason").value;
    for (const reason of series.reasons) {
      const item = el(
        "li",
        {
          dataset: { reason, colour: colour(reason) },
          title: "Show only this reason in the table",
          className: reason === selected ? "active" : "",
          on: { click: () => filterByReason(reason === selected ? "" : reason) },
        },
        swatch(reason),
        `${reason} (${series.totals[reason]})`,
      );
      legend.append(item);
    }
  }

  function swatch(reason) {
    const node = el("span", { className: "swatch" });
    node.style.backgroundColor = colour(reason);
    return node;
  }

  function onChartHover(event) {
    const tip = $("chart-tooltip");
    const g = state.geometry;
    const series = state.series;
    if (!g || !series) return;
    const rect = $("chart").getBoundingClientRect();
    const x = (event.clientX - rect.left) * g.scale;
    const i = Math.floor((x - g.left) / g.slot);
    if (i < 0 || i >= g.n) {
      tip.hidden = true;
      return;
    }
    const bucket = series.buckets[i];
    const lines = [`${fmtTime(bucket.start)} – ${fmtTime(bucket.end)}`];
    for (const reason of series.reasons) {
      if (bucket.counts[reason]) lines.push(`${reason}: ${bucket.counts[reason]}`);
    }
    if (lines.length === 1) lines.push("no refusals");
    if (bucket.replays) lines.push(`(replays, not charted: ${bucket.replays})`);
    tip.textContent = lines.join("\n");
    tip.hidden = false;
    // Beside the pointer, on whichever side keeps it inside the chart.
    const px = event.clientX - rect.left;
    const left = px + 12 + tip.offsetWidth > rect.width ? px - 12 - tip.offsetWidth : px + 12;
    tip.style.left = `${Math.max(0, left)}px`;
    tip.style.top = `${event.clientY - rect.top + 12}px`;
  }

  function windowText(seconds) {
    if (seconds % 86400 === 0) return `${seconds / 86400} day(s)`;
    return `${seconds / HOUR} hour(s)`;
  }

  async function loadChart() {
    // The server's clock ends the window, not this browser's.
    const chosen = $("window").value;
    const auto = chosen === "auto";
    const fetchSeries = (seconds) => {
      const params = new URLSearchParams({ window_seconds: String(seconds) });
      return api(`/admin/ui/api/refusals-over-time?${params}`);
    };
    let series = await fetchSeries(auto ? state.autoWindow : chosen);
    if (auto) {
      // The answer names the first entry: asked again when it needs another window.
      const wanted = window.FencegateChart.windowFromData(
        series.first_at,
        series.until,
        MAX_WINDOW_SECONDS,
      );
      if (wanted !== state.autoWindow) {
        state.autoWindow = wanted;
        series = await fetchSeries(wanted);
      }
    }
    state.series = series;
    $("window").dataset.seconds = String(auto ? state.autoWindow : chosen);
    fillReasons(series.known_reasons);
    // Replays are stored answers of writes forwarded once, not refusals: counted apart.
    const total = Object.values(series.totals).reduce((a, b) => a + b, 0);
    $("chart-summary").textContent =
      (auto ? `the last ${windowText(state.autoWindow)}, since the first entry; ` : "") +
      `${total} refusal(s); ${series.replays} replay(s) of stored answers, not charted; ` +
      `buckets of ${series.bucket_seconds} s (UTC)`;
    drawChart();
    renderLegend();
    renderUpstreams(series);
    fillReplicas(series.replicas);
  }

  // Forwarded (fenced writes admitted, every replica's: read from the idempotency
  // records), replayed and refused (the audit) per upstream, for the chart's window.
  function renderUpstreams(series) {
    const body = $("upstream-table").tBodies[0];
    body.replaceChildren();
    for (const row of series.upstream_counts) {
      const name = row.upstream === null ? "(no configured upstream)" : row.upstream;
      body.append(
        el(
          "tr",
          { dataset: { upstream: row.upstream === null ? "" : row.upstream } },
          el("td", {}, name),
          el("td", { className: "forwarded" }, row.forwarded),
          el("td", { className: "replayed" }, row.replayed),
          el("td", { className: "refused" }, row.refused),
        ),
      );
    }
    if (series.upstream_counts.length === 0) {
      body.append(el("tr", {}, el("td", { colSpan: 4, className: "empty" }, "No upstreams.")));
    }
    // The records of forwarded writes are kept gateway.idempotency_retention_seconds.
    const partial = Date.parse(series.forwarded_since) > Date.parse(series.since);
    $("upstream-note").textContent = partial
      ? `Forwarded: writes admitted since ${fmtTime(series.forwarded_since)} only ` +
        "(their records are kept gateway.idempotency_retention_seconds)."
      : "";
  }

  function fillReplicas(replicas) {
    const list = $("replicas");
    const have = new Set(Array.from(list.options, (o) => o.value));
    for (const name of replicas) if (!have.has(name)) list.append(el("option", { value: name }));
  }

  // -- refusals table ----------------------------------------------------------------------

  function fillReasons(known) {
    const select = $("filter-reason");
    const have = new Set(Array.from(select.options, (o) => o.value));
    for (const reason of known) {
      if (!have.has(reason)) select.append(el("option", { value: reason }, reason));
    }
  }

  function filterByReason(reason) {
    fillReasons([reason].filter(Boolean));
    $("filter-reason").value = reason;
    renderLegend();
    loadRefusals(true).catch(report);
  }

  // A long value (a key, a path, a lease source's job id) is cut to its cell's width
  // (style.css: .clip) and shown whole in its title, so the table fits the screen.
  function clip(value, wide) {
    const text = show(value);
    return el("span", { className: wide ? "clip wide" : "clip", title: text }, text);
  }

  function jobButton(jobId) {
    if (!jobId) return "—";
    return el(
      "button",
      { type: "button", className: "link clip", title: `${jobId}: show this job's timeline`, on: { click: () => openTimeline(jobId) } },
      jobId,
    );
  }

  function generationText(generation, highest) {
    // A lease source's refused token may have lost its generation with its lock (an etcd
    // key, a ZooKeeper node that is gone): the highest known still shows.
    if (generation === null || generation === undefined) {
      return highest === null || highest === undefined ? "—" : `— (highest ${highest})`;
    }
    if (highest === null || highest === undefined || highest === generation) return String(generation);
    return `${generation} (highest ${highest})`;
  }

  // The replica that answered: a click keeps only its entries.
  function replicaButton(replica) {
    if (!replica) return "—";
    const filter = () => {
      $("filter-replica").value = replica;
      loadRefusals(true).catch(report);
    };
    return el(
      "button",
      { type: "button", className: "link clip", title: `${replica}: show only this replica's entries`, on: { click: filter } },
      replica,
    );
  }

  async function loadRefusals(reset) {
    if (reset) {
      state.cursor = null;
      state.rows = 0;
    }
    const params = new URLSearchParams({ limit: String(PAGE_SIZE) });
    const reason = $("filter-reason").value;
    const upstream = $("filter-upstream").value.trim();
    const job = $("filter-job").value.trim();
    const replica = $("filter-replica").value.trim();
    if (reason) params.set("reason", reason);
    if (replica) params.set("replica", replica);
    if (upstream) params.set("upstream", upstream);
    if (job) params.set("job_id", job);
    if (state.cursor) params.set("cursor", state.cursor);
    const page = await api(`/admin/rejections?${params}`);
    const body = $("refusals-table").tBodies[0];
    if (reset) body.replaceChildren();
    for (const item of page.items) {
      body.append(
        el(
          "tr",
          { dataset: { reason: item.reason, id: String(item.id) } },
          el("td", { className: "time" }, fmtTime(item.at)),
          el("td", { className: "reason" }, swatch(item.reason), " ", item.reason),
          // Requests without a lease are counted in one row per group and minute.
          el(
            "td",
            { title: item.count > 1 ? `${item.count} requests until ${fmtTime(item.last_at)}` : "" },
            String(item.count),
          ),
          el("td", {}, item.status),
          // A lease source's job ids are "<source>/<job>"; the source is named here too.
          el(
            "td",
            { className: "mono", title: item.source ? `lease source: ${item.source}` : "" },
            jobButton(item.job_id),
          ),
          el("td", {}, generationText(item.generation, item.highest_generation)),
          // The lease's owner (a label the worker chose), when a lease was behind it.
          el("td", { className: "owner" }, clip(item.owner)),
          el("td", {}, clip(item.upstream)),
          el("td", { className: "mono" }, clip(`${item.method} ${item.path}`, true)),
          el("td", { className: "mono" }, clip(item.idempotency_key)),
          el("td", { className: "mono client" }, clip(item.client)),
          el("td", { className: "replica mono" }, replicaButton(item.replica)),
        ),
      );
    }
    state.rows += page.items.length;
    state.cursor = page.next_cursor;
    if (state.rows === 0) {
      body.append(el("tr", {}, el("td", { colSpan: 12, className: "empty" }, "No entries match.")));
    }
    $("refusals-count").textContent = `${state.rows} shown, newest first`;
    $("refusals-more").hidden = !state.cursor;
  }

  // -- job timeline ------------------------------------------------------------------------

  function describe(event) {
    const key = event.idempotency_key ? ` · key ${event.idempotency_key}` : "";
    switch (event.kind) {
      case "grant":
        return [`granted to ${event.owner}, expires ${fmtTime(event.expires_at)}`, ""];
      case "forward": {
        let outcome = event.state;
        if (event.state === "completed") outcome = `completed ${show(event.status)}`;
        else if (event.state === "unknown") outcome = `unknown outcome${event.note ? ` (${event.note})` : ""}`;
        else if (event.state === "in_flight") outcome = "in flight";
        return [`${event.method} /${event.upstream}/${event.path}${key}`, outcome];
      }
      case "replay":
        return [`${event.method} ${event.path}${key}`, `replayed ${event.status}`];
      case "resolution":
        return [`${event.method} ${event.path}${key}`, `resolved by the gateway: ${event.status}`];
      default:
        return [`${event.reason}: ${event.method} ${event.path}${key}`, `refused ${event.status}`];
    }
  }

  async function openTimeline(jobId) {
    $("timeline-job").value = jobId;
    state.timelineJob = jobId;
    $("timeline-section").scrollIntoView({ block: "start" });
    await loadTimeline().catch(report);
  }

  async function loadTimeline() {
    const jobId = state.timelineJob;
    if (!jobId) return;
    const doc = await api(`/admin/ui/api/jobs/${encodeURIComponent(jobId)}/timeline`);
    const job = doc.job;
    $("timeline-job-summary").textContent = job
      ? `${job.job_id} · queue ${job.queue} · ${job.state} · generation ${job.generation}` +
        (job.owner ? ` · owner ${job.owner}` : "") +
        ` · attempts ${job.attempts}/${job.max_attempts}` +
        (doc.truncated ? " · older events not shown" : "")
      : `${doc.job_id}: no such job now (events kept from before may still show)`;
    const body = $("timeline-table").tBodies[0];
    body.replaceChildren();
    for (const event of doc.events) {
      const [detail, outcome] = describe(event);
      body.append(
        el(
          "tr",
          { dataset: { kind: event.kind } },
          el("td", { className: "time" }, fmtTime(event.at)),
          el("td", {}, event.kind === "refusal" ? `refusal: ${event.reason}` : event.kind),
          el("td", {}, generationText(event.generation, event.highest_generation)),
          el("td", { className: "mono" }, detail),
          el("td", {}, outcome),
        ),
      );
    }
    if (doc.events.length === 0) {
      body.append(el("tr", {}, el("td", { colSpan: 5, className: "empty" }, "No events for this job.")));
    }
  }

  // -- unknown outcomes --------------------------------------------------------------------

  async function resolve(item, applied, statusInput, buttons) {
    const body = { job_id: item.job_id, key: item.key, applied };
    if (applied) {
      const status = Number(statusInput.value);
      if (!Number.isInteger(status) || status < 100 || status > 599) {
        setStatus("Enter the status (100–599) that retries of this key should get.", "error");
        statusInput.focus();
        return;
      }
      body.status = status;
    }
    buttons.forEach((b) => (b.disabled = true));
    try {
      const doc = await api("/admin/unknown-outcomes/resolve", body);
      setStatus(`Resolved key ${doc.key} of job ${doc.job_id}: ${doc.resolved}.`, "ok");
    } catch (error) {
      report(error);
    } finally {
      buttons.forEach((b) => (b.disabled = false));
    }
    await loadUnknown().catch(report);
    if (state.timelineJob === item.job_id) await loadTimeline().catch(report);
  }

  async function loadUnknown() {
    const doc = await api("/admin/unknown-outcomes?limit=200");
    const body = $("unknown-table").tBodies[0];
    body.replaceChildren();
    for (const item of doc.items) {
      const statusInput = el("input", {
        type: "number",
        min: 100,
        max: 599,
        placeholder: "status",
        className: "resolve-status",
        title: "The status retries get when you mark it applied",
      });
      const applied = el("button", { type: "button", className: "resolve-applied" }, "Applied");
      const notApplied = el("button", { type: "button", className: "resolve-not-applied" }, "Not applied");
      const buttons = [applied, notApplied];
      applied.addEventListener("click", () => resolve(item, true, statusInput, buttons));
      notApplied.addEventListener("click", () => resolve(item, false, statusInput, buttons));
      body.append(
        el(
          "tr",
          { dataset: { job: item.job_id, key: item.key } },
          el("td", { className: "mono" }, jobButton(item.job_id)),
          el("td", { className: "mono" }, item.key),
          el("td", {}, item.upstream),
          el("td", { className: "mono" }, `${item.method} /${item.upstream}/${item.path}`),
          el("td", {}, item.generation),
          el("td", { className: "time" }, fmtTime(item.updated_at)),
          el("td", {}, show(item.note)),
          el("td", {}, el("div", { className: "resolve" }, statusInput, applied, notApplied)),
        ),
      );
    }
    if (doc.items.length === 0) {
      body.append(el("tr", {}, el("td", { colSpan: 8, className: "empty" }, "Nothing held.")));
    }
  }

  // -- wiring ----------------------------------------------------------------------------

  function report(error) {
    setStatus(explain(error), "error");
  }

  // `auto`: an automatic refresh, which keeps the pages of the table loaded beyond the
  // first (it would throw them away) instead of reloading it.
  async function loadAll(auto) {
    state.loading = true;
    state.edited = false;
    setStatus("Loading…");
    const keepTable = auto === true && state.rows > PAGE_SIZE;
    const results = await Promise.allSettled([
      loadChart(),
      keepTable ? Promise.resolve() : loadRefusals(true),
      loadUnknown(),
      loadTimeline(),
    ]);
    const failed = results.find((r) => r.status === "rejected");
    if (failed) report(failed.reason);
    else setStatus(`Updated ${new Date().toISOString().replace("T", " ").slice(0, 19)} UTC`, "ok");
    document.body.dataset.loaded = String(Number(document.body.dataset.loaded || 0) + 1);
    state.loading = false;
    if (state.refresh) state.refresh.loaded();
  }

  // An automatic refresh waits while a load runs, and while the operator has typed into
  // a field (a filter, the token, a status for an unknown outcome) without using it yet.
  function busy() {
    if (state.loading || state.edited) return true;
    return Array.from(document.querySelectorAll(".resolve-status")).some((i) => i.value !== "");
  }

  function start() {
    const saved = sessionStorage.getItem(TOKEN_KEY);
    if (saved) $("token").value = saved;

    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const t = token();
      if (t) sessionStorage.setItem(TOKEN_KEY, t);
      else sessionStorage.removeItem(TOKEN_KEY);
      loadAll();
    });
    $("token-forget").addEventListener("click", () => {
      $("token").value = "";
      sessionStorage.removeItem(TOKEN_KEY);
      loadAll();
    });
    $("refresh").addEventListener("click", () => loadAll());
    document.addEventListener("input", (event) => {
      // (A status typed for an unknown outcome counts while it is there: busy().)
      const field = event.target;
      if (field instanceof HTMLInputElement && !field.classList.contains("resolve-status")) {
        state.edited = true;
      }
    });
    state.refresh = window.FencegateRefresh.create({
      seconds: REFRESH_SECONDS,
      load: () => loadAll(true),
      busy,
      button: $("auto-refresh"),
      label: $("auto-refresh-state"),
    });
    $("window").addEventListener("change", () => loadChart().catch(report));
    $("filters").addEventListener("submit", (event) => {
      event.preventDefault();
      state.edited = false;
      renderLegend();
      loadRefusals(true).catch(report);
    });
    $("filter-reason").addEventListener("change", () => {
      renderLegend();
      loadRefusals(true).catch(report);
    });
    $("filter-clear").addEventListener("click", () => {
      state.edited = false;
      $("filter-reason").value = "";
      $("filter-upstream").value = "";
      $("filter-job").value = "";
      $("filter-replica").value = "";
      renderLegend();
      loadRefusals(true).catch(report);
    });
    $("refusals-more").addEventListener("click", () => loadRefusals(false).catch(report));
    $("timeline-form").addEventListener("submit", (event) => {
      event.preventDefault();
      state.edited = false;
      const jobId = $("timeline-job").value.trim();
      if (jobId) openTimeline(jobId);
    });
    const canvas = $("chart");
    canvas.addEventListener("mousemove", onChartHover);
    canvas.addEventListener("mouseleave", () => ($("chart-tooltip").hidden = true));
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(drawChart, 100);
    });
    loadAll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
