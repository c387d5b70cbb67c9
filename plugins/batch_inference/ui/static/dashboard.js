// The batch-inference dashboard: plain JavaScript, no libraries, no network
// beyond this app's own JSON endpoints (it has to work on an offline cluster).
// Every value on the page comes from /api/...; text from the ledger (dead-letter
// reasons, model output) is only ever set as textContent, never as HTML.
"use strict";

(function () {
  const body = document.body;
  const BASE = body.dataset.base || "";
  const VIEW = body.dataset.view;
  const SVGNS = "http://www.w3.org/2000/svg";
  const REFRESH_MS = 30000;
  let rollbackOpen = false;

  // -- small helpers -----------------------------------------------------------

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k === "text") el.textContent = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      el.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
    }
    return el;
  }

  function s(tag, attrs, ...children) {
    const el = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "text") el.textContent = v;
      else el.setAttribute(k, String(v));
    }
    for (const c of children.flat()) if (c) el.appendChild(c);
    return el;
  }

  const fmtInt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
  const fmtUsd = (n) => "$" + Number(n).toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 });
  const fmtPct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
  const toDate = (v) => (v ? new Date(v) : null);
  const pad = (n) => String(n).padStart(2, "0");
  const clock = (d) => (d ? pad(d.getHours()) + ":" + pad(d.getMinutes()) : "–");
  function stamp(v) {
    const d = toDate(v);
    if (!d) return "–";
    return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " + clock(d);
  }
  const tzName = () => {
    try { return Intl.DateTimeFormat().resolvedOptions().timeZone || "local"; } catch (e) { return "local"; }
  };

  async function api(path, options) {
    const resp = await fetch(BASE + "/api" + path, Object.assign({ credentials: "same-origin" }, options || {}));
    let payload = null;
    try { payload = await resp.json(); } catch (e) { payload = null; }
    if (!resp.ok) {
      const detail = payload && payload.detail ? payload.detail : resp.statusText;
      const err = new Error(typeof detail === "string" ? detail : JSON.stringify(detail));
      err.status = resp.status;
      throw err;
    }
    return payload;
  }

  function jobLink(jv) {
    return h("a", { class: "mono", href: BASE + "/jobs/" + encodeURIComponent(jv), target: "_self" }, jv);
  }

  function badge(text) {
    return h("span", { class: "badge " + text }, text);
  }

  function showError(where, err) {
    const msg = err.status === 401 ? "Not signed in to Airflow: open Airflow, log in, and reload this page."
      : err.status === 403 ? "Airflow refused: " + err.message : String(err.message || err);
    where.replaceChildren(h("p", { class: "error", role: "alert" }, msg));
  }

  function refreshed() {
    const el = document.getElementById("refreshed");
    if (el) el.textContent = "updated " + new Date().toLocaleTimeString();
  }

  // -- the jobs list ---------------------------------------------------------------

  async function renderJobs() {
    const main = document.getElementById("main");
    const params = new URLSearchParams(location.search);
    const dataset = params.get("dataset");
    const companions = params.get("companions") === "true";   // golden runs and judges: else on their version's page
    const query = new URLSearchParams();
    if (dataset) query.set("dataset", dataset);
    if (companions) query.set("companions", "true");
    let payload;
    try {
      payload = await api("/jobs" + (query.toString() ? "?" + query.toString() : ""));
    } catch (err) { return showError(main, err); }
    const toggle = new URLSearchParams(query);
    if (companions) toggle.delete("companions"); else toggle.set("companions", "true");
    const rows = payload.jobs.map((j) => h("tr", { "data-job": j.job_version, class: j.published ? "current" : null },
      h("td", {}, jobLink(j.job_version)),
      h("td", {}, h("a", { href: "?dataset=" + encodeURIComponent(j.dataset) }, j.dataset)),
      h("td", {}, badge(j.status), j.mode === "fallback" ? [" ", badge("fallback")] : null),
      h("td", { class: "num" }, fmtInt(j.records)),
      h("td", { class: "num" }, fmtInt(j.stored)),
      h("td", { class: "num" }, fmtInt(j.dead_letters)),
      h("td", { class: "num" }, fmtInt(j.outstanding)),
      h("td", { class: "num" }, fmtInt(j.shards_done) + " / " + fmtInt(j.shards)),
      h("td", {}, clock(toDate(j.latest_safe_start))),
      h("td", {}, clock(toDate(j.deadline))),
      h("td", {}, stamp(j.created_at))));
    main.replaceChildren(
      h("h2", {}, dataset ? ["Job versions of ", h("span", { class: "mono" }, dataset), " ", h("a", { href: "?" }, "(all)")] : "Job versions"),
      rows.length ? h("table", { id: "jobs-table" },
        h("thead", {}, h("tr", {}, ["job version", "dataset", "status", "records", "stored", "dead letters",
          "outstanding", "shards done", "cutoff", "deadline", "submitted"].map((t) => h("th", {}, t)))),
        h("tbody", {}, rows))
        : h("p", { class: "muted" }, "No job versions in the ledger yet."),
      h("p", { class: "muted" }, "Times in " + tzName() + ". The bold row of a dataset is the version its readers see. ",
        h("a", { id: "companions-toggle", href: "?" + toggle.toString() },
          companions ? "Hide companion versions" : "Show companion versions (golden runs, judges)")));
    refreshed();
  }

  // -- the job page -----------------------------------------------------------------

  function countCards(c) {
    const card = (cls, id, label, value) => h("div", { class: "card " + cls },
      h("div", { class: "value", id: id }, fmtInt(value)), h("div", { class: "label" }, label));
    return h("div", { class: "cards", id: "counts" },
      card("", "count-records", "records", c.records),
      card("stored", "count-stored", "stored", c.stored),
      card("dead", "count-dead", "dead letters", c.dead_letters),
      card("outstanding", "count-outstanding", "outstanding", c.outstanding),
      card("", "count-reused", "reused", c.reused),
      card("", "count-fallback", "by fallback", c.stored_fallback));
  }

  function header(job) {
    const c = job.counts;
    return h("section", { id: "job-header" },
      h("h1", { id: "job-version" }, job.job_version),
      h("div", { class: "meta" },
        h("span", {}, "dataset ", h("a", { href: BASE + "/?dataset=" + encodeURIComponent(job.dataset) }, job.dataset)),
        h("span", {}, badge(job.status), " ", job.mode === "fallback" ? badge("fallback") : badge("batch")),
        h("span", { class: "muted" }, "model ", h("span", { class: "mono" }, job.model_name), " · prompt ", job.prompt_version),
        h("span", { class: "muted" }, "submitted " + stamp(job.created_at) + " by " + job.submitted_by),
        job.published_version
          ? h("span", {}, job.is_published ? "published now" : ["published: ", jobLink(job.published_version)])
          : h("span", { class: "muted" }, "nothing published for this dataset")),
      countCards(c));
  }

  // The golden runs and judges that serve this version, and the versions this one serves.
  function companionsPanel(job) {
    if (!job.companions.length && !job.serves.length) return "";
    return h("section", { id: "companions" },
      job.companions.length ? [h("h2", {}, "Companion versions"),
        h("table", { id: "companions-table" },
          h("thead", {}, h("tr", {}, ["kind", "job version", "dataset", "status", "records", "stored", "dead letters",
            "outstanding", "submitted"].map((t) => h("th", {}, t)))),
          h("tbody", {}, job.companions.map((c) => h("tr", { "data-job": c.job_version },
            h("td", {}, c.kind),
            h("td", {}, jobLink(c.job_version)),
            h("td", { class: "mono" }, c.dataset),
            h("td", {}, badge(c.status)),
            h("td", { class: "num" }, fmtInt(c.records)),
            h("td", { class: "num" }, fmtInt(c.stored)),
            h("td", { class: "num" }, fmtInt(c.dead_letters)),
            h("td", { class: "num" }, fmtInt(c.outstanding)),
            h("td", {}, stamp(c.created_at))))))] : null,
      job.serves.length ? h("p", { id: "serves" }, "Companion version: ",
        job.serves.flatMap((sv, i) => [i ? ", " : "", "the " + sv.kind + " run of ", jobLink(sv.job_version)])) : null);
  }

  // Nice tick steps for a time axis, in minutes.
  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 180, 360, 720, 1440];

  function timeTicks(t0, t1) {
    const span = (t1 - t0) / 60000;
    const step = TIME_STEPS.find((m) => span / m <= 10) || 1440;
    const ms = step * 60000;
    // Align ticks to the local clock (a tick at 04:30, not at 04:27).
    const offset = new Date(t0).getTimezoneOffset() * 60000;
    const first = Math.ceil((t0 - offset) / ms) * ms + offset;
    const out = [];
    for (let t = first; t <= t1; t += ms) out.push(t);
    return out;
  }

  function countTicks(max) {
    if (max <= 0) return [0];
    const raw = max / 5;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((v) => raw <= v);
    const out = [];
    for (let v = 0; v <= max + 1e-9; v += step) out.push(v);
    return out;
  }

  // The night on one time axis: the burn-down above, the seed's lanes below
  // (batch, fallback re-drive, fixed overhead), and vertical lines for now, the
  // projected finish, the moving cutoff and the deadline.
  function timelineChart(p) {
    const W = 960, H = 440, L = 84, R = 24, T = 58;
    const laneNames = ["batch", "fallback", "overhead"];
    const laneH = 18, laneGap = 8, lanesTop = H - laneNames.length * (laneH + laneGap) - 22;
    const plotB = lanesTop - 34;
    const samples = p.samples.map((x) => Object.assign({}, x, { t: toDate(x.at).getTime() }));
    const times = samples.map((x) => x.t);
    const add = (v) => { const d = toDate(v); if (d) times.push(d.getTime()); };
    [p.now, p.deadline, p.cutoff, p.projected_finish, p.fallback_at, p.started_at].forEach(add);
    p.lanes.forEach((ln) => { add(ln.start); add(ln.end); });
    p.cutoff_history.forEach((c) => add(c.latest_safe_start));
    if (!times.length) return h("p", { class: "muted" }, "No shard has been claimed yet: nothing to draw.");
    let t0 = Math.min(...times), t1 = Math.max(...times);
    if (t1 - t0 < 10 * 60000) { t1 = t0 + 10 * 60000; }
    const padT = (t1 - t0) * 0.03;
    t0 -= padT; t1 += padT;
    const yMax = Math.max(p.records, 1);
    const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
    const y = (v) => plotB - (v / yMax) * (plotB - T);

    const svg = s("svg", { class: "chart", id: "timeline", viewBox: `0 0 ${W} ${H}`, role: "img",
      "aria-label": "stored, dead-lettered and outstanding rows over time, with the cutoff and the deadline" });

    const grid = s("g", { class: "grid" });
    const axis = s("g", { class: "axis" });
    for (const v of countTicks(yMax)) {
      grid.appendChild(s("line", { x1: L, x2: W - R, y1: y(v), y2: y(v) }));
      axis.appendChild(s("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end", text: fmtInt(Math.round(v)) }));
    }
    for (const t of timeTicks(t0, t1)) {
      grid.appendChild(s("line", { x1: x(t), x2: x(t), y1: T, y2: H - 22 }));
      axis.appendChild(s("text", { x: x(t), y: H - 6, "text-anchor": "middle", text: clock(new Date(t)) }));
    }
    axis.appendChild(s("line", { x1: L, x2: W - R, y1: plotB, y2: plotB }));
    axis.appendChild(s("text", { x: 6, y: T - 14, text: "rows" }));
    svg.appendChild(grid);
    svg.appendChild(axis);

    for (const [key, cls] of [["stored", "stored"], ["dead_letters", "dead"], ["outstanding", "outstanding"]]) {
      const pts = samples.map((d) => x(d.t).toFixed(1) + "," + y(d[key]).toFixed(1)).join(" ");
      svg.appendChild(s("polyline", { class: "series " + cls, id: "series-" + cls, points: pts }));
    }

    // The batch at the pace it has shown: outstanding reaches zero at the
    // projected finish (dashed), which the chart sets against the cutoff.
    const last = samples[samples.length - 1];
    const pf = toDate(p.projected_finish);
    if (pf && last && last.outstanding > 0) {
      svg.appendChild(s("line", { class: "series projection", id: "series-projection", x1: x(last.t), y1: y(last.outstanding),
        x2: x(pf.getTime()), y2: y(0) }));
    }

    // Lanes: where the batch ran, where the fallback re-drive would run (or
    // ran), and the fixed overhead that must end at the deadline.
    laneNames.forEach((name, i) => {
      const top = lanesTop + i * (laneH + laneGap);
      const g = s("g", { class: "lane " + name, id: "lane-" + name });
      g.appendChild(s("text", { x: L - 6, y: top + laneH - 5, "text-anchor": "end",
        text: name === "overhead" ? "drain+load" : name }));
      for (const ln of p.lanes.filter((l) => l.lane === name)) {
        const a = x(toDate(ln.start).getTime()), b = x(toDate(ln.end).getTime());
        const r = s("rect", { class: ln.kind, x: Math.min(a, b), y: top, width: Math.max(Math.abs(b - a), 1.5), height: laneH, rx: 2 });
        r.appendChild(s("title", { text: `${name} (${ln.kind}): ${stamp(ln.start)} – ${stamp(ln.end)}` }));
        g.appendChild(r);
      }
      svg.appendChild(g);
    });

    // The moving cutoff: each sample's latest safe start, joined in sample
    // order, drawn in a rail just above the lanes so its drift is visible.
    const railY = lanesTop - 16;
    if (p.cutoff_history.length) {
      const g = s("g", { class: "cutoff-history", id: "cutoff-history" });
      g.appendChild(s("text", { x: L - 6, y: railY + 4, "text-anchor": "end", text: "cutoff" }));
      const pts = p.cutoff_history.map((c, i) => [x(toDate(c.latest_safe_start).getTime()),
        railY - 10 + (20 * i) / Math.max(p.cutoff_history.length - 1, 1)]);
      g.appendChild(s("polyline", { class: "cutoff-path", points: pts.map((q) => q[0].toFixed(1) + "," + q[1].toFixed(1)).join(" ") }));
      p.cutoff_history.forEach((c, i) => {
        const dot = s("circle", { class: "cutoff-sample", cx: pts[i][0], cy: pts[i][1], r: 3 });
        dot.appendChild(s("title", { text: `at ${clock(toDate(c.at))}: ${fmtInt(c.outstanding)} outstanding → cutoff ${clock(toDate(c.latest_safe_start))}` }));
        g.appendChild(dot);
      });
      svg.appendChild(g);
    }

    // The autopilot's decisions: a mark per change of the batch fleet's size (or page),
    // on a rail above the cutoff's, each with its reason.
    if (p.fleet && p.fleet.length) {
      const g = s("g", { class: "fleet-changes", id: "fleet-changes" });
      const fy = railY - 26;
      g.appendChild(s("text", { x: L - 6, y: fy + 4, "text-anchor": "end", text: "fleet" }));
      p.fleet.forEach((f) => {
        const cx = x(toDate(f.at).getTime());
        const mark = s("text", { class: "fleet-" + f.action, x: cx, y: fy + 4, "text-anchor": "middle",
          text: f.page ? "!" : String(f.desired) });
        mark.appendChild(s("title", { text: `at ${clock(toDate(f.at))}: ${f.action} ${f.current} → ${f.desired} workers: ${f.reason}` + (f.page ? ` PAGE: ${f.page}` : "") }));
        g.appendChild(mark);
      });
      svg.appendChild(g);
    }

    // Vertical lines for the moments that matter, labelled at the top. Labels
    // are stacked into rows so that close moments (now and the cutoff, say)
    // stay readable, and flipped to the left of their line at the right edge.
    const marks = [
      ["now-line", p.finished_at ? null : p.now, "now"],
      ["projected-line", p.projected_finish, "projected finish"],
      ["fallback-line", p.fallback_at, "fallback fired"],
      ["cutoff-line", p.cutoff, "cutoff"],
      ["deadline-line", p.deadline, "deadline"],
    ].filter((m) => toDate(m[1])).map((m) => ({ id: m[0], d: toDate(m[1]), label: m[2] + " " + clock(toDate(m[1])) }))
      .sort((a, b) => a.d - b.d);
    const rowEnds = [];
    for (const m of marks) {
      const xx = x(m.d.getTime());
      const w = m.label.length * 6.3;
      const flip = xx + 3 + w > W - 2;
      const from = flip ? xx - 3 - w : xx + 3, to = flip ? xx - 3 : xx + 3 + w;
      let row = rowEnds.findIndex((end) => end < from - 4);
      if (row < 0) { row = rowEnds.length; rowEnds.push(0); }
      rowEnds[row] = to;
      const g = s("g", { class: "marker" + (m.id === "cutoff-line" ? " cutoff" : ""), id: m.id, "data-at": m.d.toISOString() });
      g.appendChild(s("line", { x1: xx, x2: xx, y1: T - 4 - row * 13, y2: H - 22 }));
      g.appendChild(s("text", { x: flip ? xx - 3 : xx + 3, y: T - 8 - row * 13, "text-anchor": flip ? "end" : "start", text: m.label }));
      svg.appendChild(g);
    }
    return svg;
  }

  function timelinePanel(p) {
    const facts = [];
    if (p.deadline) facts.push(h("span", {}, "deadline ", h("b", { id: "deadline-clock" }, clock(toDate(p.deadline)))));
    if (p.cutoff) facts.push(h("span", {}, "cutoff now ", h("b", { id: "cutoff-clock" }, clock(toDate(p.cutoff))),
      p.fires ? h("span", { class: "error" }, " — past it: the fallback must start") : null));
    if (p.projected_finish) facts.push(h("span", {}, "batch projected to finish ", h("b", { id: "projected-clock" }, clock(toDate(p.projected_finish)))));
    if (p.finished_at) facts.push(h("span", {}, "finished ", h("b", {}, stamp(p.finished_at))));
    if (p.fallback_at) facts.push(h("span", { class: "error" }, "fallback fired " + clock(toDate(p.fallback_at))));
    facts.push(h("span", { class: "muted" }, `fallback: ${fmtInt(p.rate)} rows/s after ${Math.round(p.overhead_s / 60)} min fixed overhead`));
    // Which constants the cutoff uses and why (configured, or history and how much of it).
    if (p.constants && p.constants.source) facts.push(h("span", { class: "muted", id: "constants-source" }, "constants: " + p.constants.source));
    if (!p.deadline) facts.push(h("span", { class: "muted" }, "no deadline recorded (no progress sample carries one)"));
    const legend = h("div", { class: "legend" },
      h("span", {}, h("i", { class: "sw-stored" }), "stored"),
      h("span", {}, h("i", { class: "sw-dead" }), "dead-lettered"),
      h("span", {}, h("i", { class: "sw-outstanding" }), "outstanding"),
      h("span", {}, h("i", { class: "sw-cutoff" }), "cutoff (dots: how it moved)"),
      h("span", {}, h("i", { class: "sw-deadline" }), "deadline"),
      h("span", {}, "times in " + tzName() + (p.source === "shards" ? "; curve from shard completion times (no progress samples)" : "")));
    return h("section", { class: "panel", id: "panel-timeline" },
      h("h2", {}, "Burn-down, cutoff and deadline"), h("div", { class: "meta" }, facts), timelineChart(p), legend);
  }

  function costPanel(c) {
    const so = c.so_far, fired = c.if_fallback_now;
    const row = (label, rows, usd, id) => h("tr", { id: id }, h("td", {}, label), h("td", { class: "num" }, fmtInt(rows)), h("td", { class: "num" }, fmtUsd(usd)));
    return h("section", { class: "panel", id: "panel-cost" },
      h("h2", {}, "Cost so far by transport"),
      h("table", {},
        h("thead", {}, h("tr", {}, h("th", {}, "transport"), h("th", { class: "num" }, "rows"), h("th", { class: "num" }, "cost"))),
        h("tbody", {},
          row(so.rungs ? "batch (model ladder, rung by rung)" : "batch", so.batch_rows, so.batch_cost, "cost-batch"),
          (so.rungs || []).map((r) => h("tr", { id: "cost-rung-" + r.rung, class: "muted" },
            h("td", {}, `rung ${r.rung} ${r.model}: ${fmtInt(r.answers)} answers \u00d7 $${r.cost_per_row}`),
            h("td", { class: "num" }, ""), h("td", { class: "num" }, fmtUsd(r.cost)))),
          row("hosted batch", so.hosted_rows, so.hosted_cost, "cost-hosted"),
          row("fallback (synchronous)", so.fallback_rows, so.fallback_cost, "cost-fallback"),
          h("tr", { id: "cost-total" }, h("td", {}, h("b", {}, "total so far")), h("td", { class: "num" }, fmtInt(so.batch_rows + so.hosted_rows + so.fallback_rows)), h("td", { class: "num" }, h("b", {}, fmtUsd(so.total)))))),
      h("p", { class: "muted" },
        `Tonight's ${fmtInt(so.total_rows)} billable rows: ${fmtUsd(so.clean_batch_floor)} if all on batch, ${fmtUsd(so.all_synchronous_ceiling)} if all synchronous (the ceiling). `,
        c.outstanding > 0 ? `If the fallback fired now: ${fmtUsd(fired.total)} (${fired.overage_text}).` : "",
        c.reused ? ` ${fmtInt(c.reused)} reused rows were paid for by an earlier version.` : ""));
  }

  // A model ladder (batch_inference.ladder.report): each rung's share of the records, its golden
  // accuracy (from calibrate) and its cost, beside the bill of the top rung alone.
  function ladderPanel(l) {
    const panel = h("section", { class: "panel", id: "panel-ladder" }, h("h2", {}, "Model ladder"));
    panel.appendChild(h("table", { id: "ladder-table" },
      h("thead", {}, h("tr", {}, h("th", {}, "rung"), h("th", {}, "model"), h("th", { class: "num" }, "threshold"),
        h("th", { class: "num" }, "answered"), h("th", { class: "num" }, "kept"), h("th", { class: "num" }, "share"),
        h("th", { class: "num" }, "golden accuracy"), h("th", { class: "num" }, "cost"))),
      h("tbody", {}, l.rungs.map((r) => h("tr", { id: "ladder-rung-" + r.rung },
        h("td", {}, String(r.rung)), h("td", {}, r.model),
        h("td", { class: "num" }, r.threshold === null ? "none" : r.threshold.toFixed(3)),
        h("td", { class: "num" }, fmtInt(r.answered)), h("td", { class: "num" }, fmtInt(r.kept)),
        h("td", { class: "num" }, fmtPct(r.share)), h("td", { class: "num" }, fmtPct(r.golden_accuracy)),
        h("td", { class: "num" }, fmtUsd(r.cost)))))));
    const cal = l.calibration;
    panel.appendChild(h("p", { class: "muted", id: "ladder-bill" },
      `Bill ${fmtUsd(l.bill)} against ${fmtUsd(l.top_alone_bill)} for the top rung alone` +
      (l.bill_share_of_top === null ? "." : ` (${fmtPct(l.bill_share_of_top)}).`) +
      (cal ? ` Calibrated ${stamp(cal.calibrated_at)}: golden accuracy ${fmtPct(cal.golden_accuracy)} against ` +
             `${fmtPct(cal.top_alone_golden_accuracy)} for the top rung alone (target ${fmtPct(cal.target)} of it).`
           : " Not calibrated (`batch-inference calibrate SPEC`).")));
    return panel;
  }

  function shardsPanel(sh) {
    const W = 460, H = 22;
    const total = Math.max(sh.total, 1);
    const svg = s("svg", { class: "chart", id: "shards-bar", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "shards by state" });
    let at = 0;
    for (const st of ["done", "leased", "pending"]) {
      const n = sh.by_state[st].shards;
      const w = (n / total) * W;
      if (n) {
        const r = s("rect", { class: "bar " + st, x: at, y: 2, width: w, height: H - 4 });
        r.appendChild(s("title", { text: `${st}: ${n} shards` }));
        svg.appendChild(r);
      }
      at += w;
    }
    const counts = h("div", { class: "meta" }, ["pending", "leased", "done"].map((st) =>
      h("span", {}, st + " ", h("b", { id: "shards-" + st }, fmtInt(sh.by_state[st].shards)),
        h("span", { class: "muted" }, ` (${fmtInt(sh.by_state[st].records)} records)`))));
    const rows = sh.shards.map((r) => h("tr", {},
      h("td", { class: "num" }, r.shard_no), h("td", {}, r.state), h("td", { class: "num" }, r.epoch),
      h("td", { class: "mono" }, r.lease_owner || ""), h("td", { class: "num" }, r.records),
      h("td", { class: "num" }, r.stored), h("td", { class: "num" }, r.stored_fallback), h("td", { class: "num" }, r.dead),
      h("td", {}, stamp(r.first_claim_at)), h("td", {}, stamp(r.done_at))));
    return h("section", { class: "panel", id: "panel-shards" },
      h("h2", {}, "Shards by state"), counts, svg,
      h("details", {}, h("summary", {}, `the shard table (${sh.shards.length < sh.total ? "first " + sh.shards.length + " of " : ""}${fmtInt(sh.total)})`),
        h("table", {}, h("thead", {}, h("tr", {}, ["shard", "state", "epoch", "lease owner", "records", "stored", "by fallback", "dead", "first claim", "done"].map((t) => h("th", {}, t)))),
          h("tbody", {}, rows))));
  }

  function driftPanel(d) {
    const panel = h("section", { class: "panel", id: "panel-drift" }, h("h2", {}, "Drift against the published version"));
    if (!d.categories.length) {
      panel.appendChild(h("p", { class: "muted" }, "No results with a category yet."));
      return panel;
    }
    panel.appendChild(h("div", { class: "meta" },
      d.baseline_version ? h("span", {}, "baseline ", jobLink(d.baseline_version)) : h("span", { class: "muted" }, "no published version to compare with"),
      d.tv_distance !== null ? h("span", { class: d.over_gate ? "error" : "ok" }, "total variation ",
        h("b", { id: "drift-tv" }, d.tv_distance.toFixed(3)), ` (gate ${d.max_drift})`) : null,
      h("span", { class: "muted" }, d.source.current === "validation" ? "counts from the validation reports" : "counted from results")));
    const rowH = 26, L = 90, W = 460, H = d.categories.length * rowH + 8;
    const svg = s("svg", { class: "chart", id: "drift-chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "category shares" });
    const maxShare = Math.max(...d.categories.map((c) => Math.max(c.current, c.baseline || 0)), 0.01);
    const x = (v) => (v / maxShare) * (W - L - 120);
    d.categories.forEach((c, i) => {
      const top = 4 + i * rowH;
      const g = s("g", { class: "drift-row", "data-category": c.category });
      g.appendChild(s("text", { x: L - 8, y: top + 15, "text-anchor": "end", text: c.category }));
      g.appendChild(s("rect", { class: "bar current", x: L, y: top + 2, width: Math.max(x(c.current), 1), height: 10 }));
      if (c.baseline !== null) g.appendChild(s("rect", { class: "bar baseline", x: L, y: top + 13, width: Math.max(x(c.baseline), 1), height: 8 }));
      const delta = c.baseline !== null ? ` (${c.current >= c.baseline ? "+" : ""}${(100 * (c.current - c.baseline)).toFixed(1)} pts)` : "";
      g.appendChild(s("text", { x: L + x(Math.max(c.current, c.baseline || 0)) + 6, y: top + 15, text: fmtPct(c.current) + delta }));
      svg.appendChild(g);
    });
    panel.appendChild(svg);
    panel.appendChild(h("div", { class: "legend" },
      h("span", {}, h("i", { class: "sw-current" }), "this version"),
      h("span", {}, h("i", { class: "sw-baseline" }), "published baseline")));
    return panel;
  }

  function deadLettersPanel(dl) {
    const panel = h("section", { class: "panel", id: "panel-dead-letters" },
      h("h2", {}, "Dead letters ", h("span", { class: "muted", id: "dead-total" }, fmtInt(dl.total))));
    // An operator's re-drives (batch-inference redrive): dead letters put back to pending on purpose.
    if ((dl.redrives || []).length) {
      panel.appendChild(h("table", { id: "redrives" },
        h("thead", {}, h("tr", {}, ["re-driven", "by", "why", "filter", "records", "shards"].map((t) => h("th", {}, t)))),
        h("tbody", {}, dl.redrives.map((r) => h("tr", {},
          h("td", { class: "nowrap" }, stamp(r.at)), h("td", {}, r.actor), h("td", {}, r.reason),
          h("td", {}, [r.stage ? "stage " + r.stage : "", r.reason_like ? `reason ~ "${r.reason_like}"` : ""].filter(Boolean).join(", ") || "all"),
          h("td", { class: "num" }, fmtInt(r.records)), h("td", { class: "num" }, fmtInt(r.shards)))))));
    }
    if (!dl.total) {
      panel.appendChild(h("p", { class: "muted" }, "None: every settled record produced a result."));
      return panel;
    }
    if (dl.hidden) {
      // Row-level security: the signed-in user's reader role may not read these records.
      panel.appendChild(h("p", { class: "muted", id: "dead-hidden" },
        dl.visible ? `${fmtInt(dl.hidden)} of ${fmtInt(dl.total)} are not shown: your reader role may not read them.`
                   : "Their text is not shown: your Airflow user has no reader role that may read these records."));
    }
    if (!dl.visible) return panel;
    panel.appendChild(h("table", { id: "dead-reasons" },
      h("thead", {}, h("tr", {}, h("th", {}, "reason"), h("th", {}, "stage"), h("th", { class: "num" }, "records"))),
      h("tbody", {}, dl.reasons.map((r) => h("tr", {}, h("td", {}, r.reason), h("td", {}, r.stage), h("td", { class: "num" }, fmtInt(r.n)))))));
    panel.appendChild(h("details", {}, h("summary", {}, `the records (${dl.dead_letters.length < dl.visible ? "first " + dl.dead_letters.length + " of " : ""}${fmtInt(dl.visible)})`),
      h("table", { id: "dead-letters" },
        h("thead", {}, h("tr", {}, ["record", "reason", "stage", "attempts", "last error", "raw output"].map((t) => h("th", {}, t)))),
        h("tbody", {}, dl.dead_letters.map((r) => h("tr", {},
          h("td", { class: "mono" }, r.record_id), h("td", {}, r.reason), h("td", {}, r.stage), h("td", { class: "num" }, r.attempts),
          h("td", { class: "clip", title: r.error || "" }, r.error || ""), h("td", { class: "clip mono", title: r.raw_output || "" }, r.raw_output || "")))))));
    return panel;
  }

  function historyPanel(hist, jobVersion, reload) {
    const cur = hist.pointer ? hist.pointer.job_version : null;
    const panel = h("section", { class: "panel", id: "panel-history" },
      h("h2", {}, "Publish history of ", h("span", { class: "mono" }, hist.dataset)),
      h("div", { class: "meta" }, cur ? h("span", {}, "readers see ", h("b", { id: "pointer-version" }, jobLink(cur)),
        h("span", { class: "muted" }, ` since ${stamp(hist.pointer.switched_at)} (${hist.pointer.switched_by})`))
        : h("span", { class: "muted", id: "pointer-version" }, "never published")));
    if (hist.history.length) {
      panel.appendChild(h("div", { class: "scroll" }, h("table", { id: "history-table" },
        h("thead", {}, h("tr", {}, ["#", "when", "action", "from", "to", "by", "reason", "destinations"].map((t) => h("th", {}, t)))),
        h("tbody", {}, hist.history.map((r) => h("tr", { "data-action": r.action, class: r.to_version === jobVersion ? "current" : null },
          h("td", { class: "num" }, r.id), h("td", { class: "nowrap" }, stamp(r.at)), h("td", {}, r.action + (r.forced ? " (forced)" : "")),
          h("td", {}, r.from_version ? jobLink(r.from_version) : "–"), h("td", {}, r.to_version ? jobLink(r.to_version) : "–"),
          h("td", {}, r.actor), h("td", {}, r.reason || ""),
          // Where each destination besides the view pointed after this switch: an Iceberg table's snapshot.
          h("td", { class: "destinations" }, (r.destinations || []).map((d) => h("div", { class: "mono", title: d.location || "" },
            `${d.destination} @ snapshot ${d.snapshot_id}`)))))))));
    }
    if ((hist.rejections || []).length) {
      panel.appendChild(h("h3", {}, "Reviewers' rejections"));
      panel.appendChild(rejectionsTable(hist.rejections, "history-rejections"));
    }
    // Rollback goes one publish back (bi.rollback_v2): to the version the
    // current one replaced. The request names the version the user saw, and the
    // database refuses (409) if a publish landed in between.
    // As in bi.rollback_v1: the latest *publish* that made the current version live.
    const last = hist.history.find((r) => r.action === "publish" && r.to_version === cur);
    const target = last ? last.from_version : null;
    if (cur && target) {
      const status = h("span", { id: "rollback-status", role: "status" });
      const reason = h("input", { type: "text", id: "rollback-reason", placeholder: "reason (recorded in the history)" });
      const form = h("div", { class: "rollback-form", hidden: true, id: "rollback-form" },
        h("span", {}, "Switch readers of ", h("b", {}, hist.dataset), " from ", h("span", { class: "mono" }, cur), " back to ", h("span", { class: "mono" }, target), "?"),
        reason,
        h("button", { class: "danger confirm", id: "rollback-confirm", onclick: async () => {
          status.textContent = "rolling back…";
          try {
            await api("/datasets/" + encodeURIComponent(hist.dataset) + "/rollback", {
              method: "POST", headers: { "Content-Type": "application/json" },
              body: JSON.stringify({ expected_current: cur, reason: reason.value || null }) });
            rollbackOpen = false;
            await reload();
            const st = document.getElementById("rollback-status");
            if (st) st.textContent = "rolled back to " + target;
          } catch (err) {
            status.className = "error";
            status.textContent = (err.status === 401 ? "not signed in: " : err.status === 403 ? "not allowed: " : "") + err.message;
          }
        } }, "Roll back"),
        h("button", { onclick: () => { form.hidden = true; rollbackOpen = false; } }, "Cancel"));
      panel.appendChild(h("div", { class: "rollback-form" },
        h("button", { class: "danger", id: "rollback-button", onclick: () => { form.hidden = false; rollbackOpen = true; reason.focus(); } },
          "Roll back to " + target), status));
      panel.appendChild(form);
    }
    return panel;
  }

  // The preview a DAG run made before its submit, and the pilots that measured its rate
  // (batch_inference.estimate): what the night was expected to cost and when it would finish.
  function estimatePanel(est) {
    const panel = h("section", { class: "panel", id: "panel-estimate" }, h("h2", {}, "Preview before the run"));
    const p = est.previews[0];
    if (!p) {
      panel.appendChild(h("p", { class: "muted" }, "No preview recorded for this dataset (`batch-inference estimate SPEC` prints one)."));
    } else {
      const f = p.figures, t = f.input_tokens, b = f.bill.planned;
      const row = (label, value, id) => h("tr", { id: id }, h("td", {}, label), h("td", { class: "num" }, value));
      panel.appendChild(h("table", { id: "estimate-table" }, h("tbody", {},
        row("verdict", h("span", { class: "badge", id: "estimate-verdict" }, p.verdict), "estimate-verdict-row"),
        row("records to run", fmtInt(f.eligible) + (f.rejected ? ` (+${fmtInt(f.rejected)} dead at planning)` : ""), "estimate-records"),
        row("input tokens" + (f.exact ? "" : " (estimated)"), `${fmtInt(t.total)} (p50 ${fmtInt(t.p50)}, p90 ${fmtInt(t.p90)}, p99 ${fmtInt(t.p99)})`, "estimate-tokens"),
        row("shared prefix", `${fmtInt(f.shared_prefix_tokens)} tokens a prompt`, "estimate-prefix"),
        row("output tokens", `${fmtInt(f.output_tokens.total)} (${f.output_tokens.source})`, "estimate-output"),
        row("GPU-hours", f.gpu_hours === null ? "no measured rate" : f.gpu_hours.toFixed(3), "estimate-gpu-hours"),
        row("planned bill", fmtUsd(b.total) + (f.budget !== null ? ` of ${fmtUsd(f.budget)} budget` : ""), "estimate-bill"),
        row("projected finish", f.finish ? stamp(f.finish) : "unknown", "estimate-finish"),
        row("deadline", f.deadline ? stamp(f.deadline) : "none", "estimate-deadline"))));
      panel.appendChild(h("p", { class: "muted" }, `${f.why}. Run ${p.run_id}, ${stamp(p.at)}.`));
    }
    if (est.pilots.length) {
      const q = est.pilots[0];
      panel.appendChild(h("p", { class: "muted", id: "estimate-pilot" },
        `Pilot of ${fmtInt(q.records)} records on ${q.engine}: ${q.records_per_s.toPrecision(3)} records/s a worker, ` +
        `${Math.round(q.valid_rate * 100)}% valid answers (${stamp(q.measured_at)}).`));
    }
    return panel;
  }

  async function renderJob(jobVersion, note) {
    const main = document.getElementById("main");
    document.getElementById("where").textContent = jobVersion;
    const enc = encodeURIComponent(jobVersion);
    let job, prog, cost, shards, drift, dead;
    try {
      [job, prog, cost, shards, drift, dead] = await Promise.all([
        api("/jobs/" + enc), api("/jobs/" + enc + "/progress"), api("/jobs/" + enc + "/cost"),
        api("/jobs/" + enc + "/shards"), api("/jobs/" + enc + "/drift"), api("/jobs/" + enc + "/dead-letters")]);
    } catch (err) { return showError(main, err); }
    let hist;
    try { hist = await api("/datasets/" + encodeURIComponent(job.dataset) + "/history"); } catch (err) { return showError(main, err); }
    let est;
    try { est = await api("/datasets/" + encodeURIComponent(job.dataset) + "/estimates"); } catch (err) { return showError(main, err); }
    let lad;
    try { lad = await api("/jobs/" + enc + "/ladder"); } catch (err) { return showError(main, err); }
    const reload = () => renderJob(jobVersion, note);
    main.replaceChildren(
      note ? h("p", { class: "muted", id: "run-note" }, note) : "",
      header(job),
      companionsPanel(job),
      h("p", {}, h("a", { id: "review-link", href: BASE + "/jobs/" + enc + "/review" }, "Review the sample")),
      timelinePanel(prog),
      h("div", { class: "grid" }, costPanel(cost), shardsPanel(shards)),
      lad.ladder ? ladderPanel(lad.ladder) : "",
      h("div", { class: "grid" }, driftPanel(drift), historyPanel(hist, jobVersion, reload)),
      estimatePanel(est),
      deadLettersPanel(dead));
    body.dataset.loaded = "true";  // for tests and screenshots: every panel is drawn
    refreshed();
    return job;
  }

  // -- the review sample: input and output side by side, a verdict per row ---------

  // A reviewer's rejections of the whole version (bi.review_rejections): a standing one
  // makes publish refuse the version, forced or not.
  function rejectionsTable(rows, id) {
    return h("div", { class: "scroll" }, h("table", { id: id },
      h("thead", {}, h("tr", {}, ["when", "version", "by", "reason", "state"].map((t) => h("th", {}, t)))),
      h("tbody", {}, rows.map((r) => h("tr", { "data-standing": String(r.standing) },
        h("td", { class: "nowrap" }, stamp(r.rejected_at)), h("td", {}, jobLink(r.job_version)), h("td", {}, r.reviewer),
        h("td", {}, r.reason), h("td", {}, r.standing ? "standing"
          : `withdrawn by ${r.withdrawn_by}, ${stamp(r.withdrawn_at)}: ${r.withdraw_reason}`))))));
  }

  function rejectForm(rv, reload) {
    const reason = h("input", { type: "text", id: "reject-reason", placeholder: "reason (required)" });
    const status = h("span", { id: "reject-status", role: "status" });
    return h("div", { class: "rollback-form" }, reason,
      h("button", { class: "danger", id: "reject-button", disabled: !rv.may_review, onclick: async () => {
        status.textContent = "rejecting…";
        try {
          await api("/jobs/" + encodeURIComponent(rv.job_version) + "/reject", {
            method: "POST", headers: { "Content-Type": "application/json" },
            body: JSON.stringify({ reason: reason.value }) });
          await reload();
        } catch (err) {
          status.className = "error";
          status.textContent = (err.status === 403 ? "not allowed: " : "") + err.message;
        }
      } }, "Reject this version"), status);
  }

  function reviewGate(rv, reload) {
    const g = rv.review;
    const parts = [`${fmtInt(g.reviewed)} of ${fmtInt(g.sampled)} sample rows reviewed`,
      `${fmtInt(g.right)} right, ${fmtInt(g.wrong)} wrong, ${fmtInt(g.unsure)} unsure`];
    if (g.required || g.min_right) parts.push(`gate: at least ${fmtInt(g.required)} reviewed, ${fmtPct(g.min_right)} right`);
    return h("section", { class: "panel", id: "panel-review-gate" },
      h("h2", {}, "Review gate ", badge(g.passed ? "met" : "open")),
      h("p", { id: "review-progress" }, parts.join("; ")),
      h("p", { id: "review-problem", class: g.problem ? "error" : "muted" }, g.problem || "The review gate is met."),
      h("p", { id: "review-publish" }, rv.publishable ? "Publish: allowed."
        : g.rejection ? "Publish: refused, even forced, while the rejection stands."
        : "Publish: refused without --force and a reason (" + (rv.status !== "validated" && rv.status !== "published"
          ? "the version is " + rv.status : g.problem) + ")."),
      Object.keys(rv.accuracy || {}).length ? h("p", { id: "review-accuracy" }, `golden set (${fmtInt(rv.graded)} graded): ` +
        Object.entries(rv.accuracy).map(([k, v]) => `${k} ${fmtPct(v)}`).join(", ")) : "",
      rv.judge ? h("p", { id: "review-judge" }, `judge: ${fmtInt(rv.judge.judged)} rows, ${fmtPct(rv.judge.agreement)} right`) : "",
      (rv.rejections || []).length ? rejectionsTable(rv.rejections, "review-rejections") : "",
      rejectForm(rv, reload));
  }

  function reviewRow(rv, r, reload) {
    const comment = h("input", { type: "text", class: "review-comment", placeholder: "comment", value: r.comment || "" });
    const status = h("span", { class: "review-status", role: "status" });
    const send = async (verdict) => {
      status.textContent = "saving…";
      try {
        await api("/jobs/" + encodeURIComponent(rv.job_version) + "/review", {
          method: "POST", headers: { "Content-Type": "application/json" },
          body: JSON.stringify({ record_id: r.record_id, verdict: verdict, comment: comment.value || null }) });
        await reload();
      } catch (err) {
        status.className = "review-status error";
        status.textContent = (err.status === 403 ? "not allowed: " : "") + err.message;
      }
    };
    const buttons = ["right", "wrong", "unsure"].map((v) => h("button", {
      class: "verdict verdict-" + v + (r.verdict === v ? " chosen" : ""), "data-verdict": v,
      disabled: !rv.may_review, onclick: () => send(v) }, v));
    return h("tr", { "data-record": r.record_id, "data-verdict": r.verdict || "" },
      h("td", { class: "mono" }, r.record_id),
      h("td", { class: "review-text" }, r.text),
      h("td", { class: "review-output mono" }, JSON.stringify(r.output, null, 1)),
      h("td", { class: "nowrap" }, buttons, h("div", {}, comment), status,
        r.reviewer ? h("div", { class: "muted" }, `${r.verdict} by ${r.reviewer}, ${stamp(r.reviewed_at)}`) : ""));
  }

  async function renderReview(jobVersion) {
    const main = document.getElementById("main");
    document.getElementById("where").textContent = "review of " + jobVersion;
    let rv;
    try { rv = await api("/jobs/" + encodeURIComponent(jobVersion) + "/review"); } catch (err) { return showError(main, err); }
    const reload = () => renderReview(jobVersion);
    const notes = [];
    if (!rv.may_review) notes.push("Your Airflow user may not record reviews: that needs the edit right on the DAG that ran this version.");
    if (!rv.reads_text) notes.push("Your Airflow user has no reader role, so no customer text is shown.");
    else if (rv.hidden) notes.push(`${fmtInt(rv.hidden)} of ${fmtInt(rv.review.sampled)} sample rows are not shown: your reader role may not read them.`);
    main.replaceChildren(
      h("p", {}, h("a", { href: BASE + "/jobs/" + encodeURIComponent(jobVersion), id: "review-back" }, "← the job page")),
      reviewGate(rv, reload),
      notes.length ? h("p", { class: "muted", id: "review-notes" }, notes.join(" ")) : "",
      rv.rows.length ? h("section", { class: "panel" }, h("div", { class: "scroll" }, h("table", { id: "review-rows" },
        h("thead", {}, h("tr", {}, ["record", "input", "output", "verdict"].map((t) => h("th", {}, t)))),
        h("tbody", {}, rv.rows.map((r) => reviewRow(rv, r, reload))))))
        : h("p", { class: "muted", id: "review-empty" }, rv.review.sampled ? "" : "No review sample yet: validate the version first."));
    body.dataset.loaded = "true";
    refreshed();
    return rv;
  }

  async function renderRun() {
    const main = document.getElementById("main");
    const dagId = body.dataset.dagId, runId = body.dataset.runId;
    document.getElementById("where").textContent = dagId + " / " + runId;
    let found;
    try {
      found = await api("/runs/job?dag_id=" + encodeURIComponent(dagId) + "&run_id=" + encodeURIComponent(runId));
    } catch (err) { return showError(main, err); }
    if (!found.job_version) {
      main.replaceChildren(h("p", { class: "muted", id: "run-note" },
        "This DAG run has no batch-inference job version yet (none in its conf, none in its XComs)."));
      return null;
    }
    return renderJob(found.job_version, `DAG run ${dagId} / ${runId} worked on this job version.`);
  }

  // -- start, then keep the page current while a job runs --------------------------

  async function tick() {
    if (rollbackOpen) return;
    if (VIEW === "jobs") return renderJobs();
    if (VIEW === "job") return renderJob(body.dataset.jobVersion);
    if (VIEW === "run") return renderRun();
    if (VIEW === "review" && body.dataset.loaded !== "true") return renderReview(body.dataset.jobVersion);
  }

  tick().finally(() => {
    setInterval(() => {
      const open = document.querySelector("details[open]");
      if (document.hidden || open) return;  // do not redraw under someone reading a table
      tick();
    }, REFRESH_MS);
  });
})();
