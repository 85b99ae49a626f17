// lodger's page. Every string from the ledger, a job or a run goes into the page as text
// (textContent, never innerHTML): a run or an event named <img src=x onerror=...> shows as text.
"use strict";

const CSRF = document.querySelector('meta[name="csrf"]').content;
const state = { table: null, open: null, selected: new Set(), charts: {}, compared: [], chat: [], busy: false };
const PANELS = [  // the curves every run has; each other numeric field gets a chart of its own
  ["loss", ["loss", "eval:eval_loss"]], ["learning rate", ["lr"]], ["tokens/s", ["tokens_per_s"]], ["MFU", ["mfu"]],
];
const NOT_CURVES = new Set(["seconds", "tokens", "computed", "padded", "held_seconds", "skipped"]);
const COLORS = ["#2458d3", "#d3432b", "#1f9e57", "#9b36c4", "#c98b00", "#128a9a", "#555"];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

async function api(path, body) {
  const options = body === undefined ? {} : {
    method: "POST", body: JSON.stringify(body),
    headers: { "Content-Type": "application/json", "X-Lodger-CSRF": CSRF },
  };
  const answer = await fetch(path, { credentials: "same-origin", ...options });
  const text = await answer.text();
  let data;
  try { data = JSON.parse(text); } catch (e) { data = { error: text }; }
  if (!answer.ok) throw new Error(data.error || `HTTP ${answer.status}`);
  return data;
}

function say(text, bad) {
  const node = document.getElementById("message");
  node.textContent = text;
  node.className = bad ? "bad" : "";
}

const fmt = {
  num(v) { return v === null || v === undefined ? "-" : Math.abs(v) >= 1e4 ? v.toFixed(0) : Number(v.toPrecision(5)).toString(); },
  secs(s) {
    if (s === null || s === undefined) return "-";
    s = Math.round(s);
    return s >= 3600 ? `${Math.floor(s / 3600)}h${String(Math.floor(s % 3600 / 60)).padStart(2, "0")}m`
      : s >= 60 ? `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s` : `${s}s`;
  },
  when(t) { return t ? new Date(t * 1000).toLocaleString() : "-"; },
};

function checkpointCell(c) {
  if (!c) return el("td", {}, "-");
  if (c.verified === null) return el("td", {}, `${c.name} checking ...`);
  return el("td", { class: c.verified ? "good" : "bad", title: c.problem || "every file matches its manifest" },
    `${c.name} ${c.verified ? "verified" : "DAMAGED"}`);
}

function renderTable(table) {
  state.table = table;
  const body = document.querySelector("#runs tbody");
  body.replaceChildren(...table.runs.map((r) => {
    const box = el("input", { type: "checkbox", "aria-label": `select ${r.id}` });
    box.checked = state.selected.has(r.id);
    box.addEventListener("click", (e) => { e.stopPropagation(); toggle(r.id, box.checked); });
    const row = el("tr", { "data-run": r.id, class: r.id === state.open ? "selected" : "" },
      el("td", {}, box), el("td", { class: "id" }, r.id), el("td", { class: `status status-${r.status}` }, r.status),
      el("td", {}, r.model), el("td", {}, r.method), el("td", {}, r.objective),
      el("td", { class: "step" }, `${r.step}/${r.total_steps}` + (r.checkpoint_step !== r.step ? ` (ckpt ${r.checkpoint_step})` : "")),
      el("td", {}, fmt.num(r.loss)), el("td", {}, fmt.secs(r.eta_seconds)), el("td", {}, fmt.secs(r.held_seconds)),
      checkpointCell(r.checkpoint));
    row.addEventListener("click", () => openRun(r.id));
    return row;
  }));
  if (!table.runs.length) body.append(el("tr", {}, el("td", { colspan: 11 }, "no runs yet: `lodger run JOB` starts one")));
  document.getElementById("agent").textContent = table.agent_pid ? `agent: running (pid ${table.agent_pid})` : "agent: not running";
  renderQueue(table.queue);
}

function renderQueue(queue) {
  const box = document.getElementById("queue");
  if (!queue.length) { box.replaceChildren(); return; }
  const move = async (entry, priority) => {
    try { say((await api(`/api/queue/${entry.id}/priority`, { priority })).message); } catch (e) { say(e.message, true); }
  };
  box.replaceChildren(el("h3", {}, "Queue (the next to start first)"), el("ol", {}, ...queue.map((q, i) => el("li", {},
    `#${q.id} ${q.name} (priority ${q.priority}) `,
    el("button", { onclick: () => move(q, (queue[i - 1] || q).priority + 1), ...(i ? {} : { disabled: "" }) }, "up"),
    el("button", { onclick: () => move(q, (queue[i + 1] || q).priority - 1), ...(i < queue.length - 1 ? {} : { disabled: "" }) }, "down")))));
}

function toggle(id, on) {
  if (on) state.selected.add(id); else state.selected.delete(id);
  document.getElementById("compare-button").disabled = state.selected.size < 2;
}

async function openRun(id) {
  if (state.open !== id) { state.open = id; state.chat = []; renderChat(); clearCharts("charts"); }
  document.querySelectorAll("#runs tbody tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.run === id));
  document.getElementById("detail").hidden = false;
  await refreshRun();
}

async function refreshRun() {
  const id = state.open;
  if (!id) return;
  const [detail, series] = await Promise.all([api(`/api/runs/${encodeURIComponent(id)}`),
    api(`/api/runs/${encodeURIComponent(id)}/series?width=${chartWidth()}`)]);
  if (state.open !== id) return;
  const r = detail.run;
  document.getElementById("detail-title").textContent = r.id;
  const c = r.checkpoint;
  const ckpt = c ? `${c.name} (${c.verified === null ? "checking" : c.verified ? "verified" : "DAMAGED: " + c.problem})` : "none";
  document.getElementById("detail-summary").replaceChildren(
    el("span", { class: `status status-${r.status}`, id: "detail-status" }, r.status), ` · step ${r.step}/${r.total_steps}`,
    ` · ETA ${fmt.secs(r.eta_seconds)} · held ${fmt.secs(r.held_seconds)} · last good checkpoint ${ckpt}`,
    ` · ${r.model} · ${r.method} · ${r.objective}`);
  renderTimeline(detail);
  renderProvenance(detail.provenance);
  drawRun(series);
}

function renderTimeline(detail) {
  const audit = detail.audit;
  document.getElementById("audit").replaceChildren(audit.verified
    ? el("span", { class: "good" }, "ledger: every row of this run agrees with the hash chain" + (audit.against ? ` and ${audit.against}` : ""))
    : el("span", { class: "bad" }, "UNVERIFIED: " + audit.problems.join("; ") + " (run `lodger audit`)"));
  const items = detail.events.slice().reverse().map((e) => el("li", { class: e.verified ? "" : "unverified", value: e.seq },
    e.verified ? "" : "UNVERIFIED ", el("span", { class: "kind" }, e.kind), fmt.when(e.time), " ",
    Object.entries(e.data).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(", ")));
  document.getElementById("timeline").replaceChildren(...items);
}

function renderProvenance(segments) {
  const p = segments[segments.length - 1];
  const rows = [];
  if (p) {
    const code = p.code || {};
    rows.push(["segments", segments.length], ["lodger", p.lodger_version], ["python", (p.python || {}).version],
      ["torch", (p.packages || {}).torch], ["threads", (p.numerics || {}).threads], ["host", p.host],
      ["git", (code.commit || "-") + (code.dirty ? " (dirty)" : "")], ["model sha256", ((p.model || {}).sha256 || "")],
      ["train", `${((p.data || {}).train || {}).path || "-"} sha256 ${((p.data || {}).train || {}).sha256 || "-"}`]);
  }
  document.getElementById("provenance").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v ?? "-")]));
}

function chartWidth() { return Math.max(320, Math.min(560, (document.getElementById("charts").clientWidth - 40) / 2)); }

function clearCharts(where) {
  for (const [key, chart] of Object.entries(state.charts)) if (key.startsWith(where + "/")) { chart.plot.destroy(); delete state.charts[key]; }
  document.getElementById(where).replaceChildren();
}

function panelsOf(series) {
  const used = new Set(PANELS.flatMap(([, f]) => f));
  const panels = PANELS.filter(([, fields]) => fields.some((f) => hasField(series, f)));
  for (const name of Object.keys(series.train.fields)) if (!used.has(name) && !NOT_CURVES.has(name)) panels.push([name, [name]]);
  for (const name of Object.keys(series.eval.fields)) if (!used.has("eval:" + name)) panels.push([name, ["eval:" + name]]);
  return panels;
}

function hasField(series, f) {
  const [kind, name] = f.startsWith("eval:") ? ["eval", f.slice(5)] : ["train", f];
  return (series[kind].fields[name] || []).some((v) => v !== null);
}

function column(series, f) {
  const [kind, name] = f.startsWith("eval:") ? ["eval", f.slice(5)] : ["train", f];
  return [series[kind].steps, series[kind].fields[name] || series[kind].steps.map(() => null)];
}

function drawRun(series) {
  for (const [title, fields] of panelsOf(series)) {
    const present = fields.filter((f) => hasField(series, f));
    const data = uPlot.join(present.map((f) => column(series, f)));
    plot("charts", title, present.map((f) => f.replace("eval:", "eval ")), data, series.train.total);
  }
}

function plot(where, title, labels, data, total) {
  const key = `${where}/${title}`;
  let chart = state.charts[key];
  if (chart && chart.labels.join() !== labels.join()) { chart.plot.destroy(); chart.box.remove(); chart = null; }
  if (!chart) {
    const box = el("div", { class: "chart", "data-chart": title }, el("h4", {}, title));
    document.getElementById(where).append(box);
    const opts = {
      width: chartWidth(), height: 180, scales: { x: { time: false } }, legend: { live: true },
      // uPlot's default ticks round to a few decimals: a learning rate of 2e-4 read 0.000 (three significant digits here)
      axes: [{}, { values: (u, ticks) => ticks.map((v) => (v === 0 || (Math.abs(v) >= 0.01 && Math.abs(v) < 1e5)
        ? String(+v.toPrecision(3)) : v.toExponential(1))), size: 56 }],
      series: [{ label: "step" }, ...labels.map((label, i) => ({ label, stroke: COLORS[i % COLORS.length], width: 1.4, spanGaps: true,
        points: { show: label.includes("eval") } }))],
    };
    chart = state.charts[key] = { plot: new uPlot(opts, data, box), box, labels };
  } else chart.plot.setData(data);
  chart.box.dataset.points = String(data[0].length);
  chart.box.dataset.steps = String(total ?? data[0].length);
}

async function compareSelected() {
  const ids = [...state.selected];
  state.compared = ids;
  document.getElementById("compare").hidden = false;
  say("comparing ...");
  const [result, ...series] = await Promise.all([api(`/api/compare?runs=${ids.map(encodeURIComponent).join(",")}`),
    ...ids.map((id) => api(`/api/runs/${encodeURIComponent(id)}/series?width=${chartWidth()}`))]);
  document.getElementById("verdicts").replaceChildren(...result.pairs.map((p) => el("li", { class: p.equal ? "good" : "" },
    el("b", {}, `${p.a} vs ${p.b}: `), p.verdict,
    p.first_difference !== null ? ` (the losses part at step ${p.first_difference})` : "")));
  clearCharts("compare-charts");
  for (const [title, field] of [["training loss", "loss"], ["eval loss", "eval:eval_loss"]]) {
    const present = series.map((s, i) => [ids[i], s]).filter(([, s]) => hasField(s, field));
    if (present.length) plot("compare-charts", title, present.map(([id]) => id), uPlot.join(present.map(([, s]) => column(s, field))));
  }
  say("");
}

async function act(path, body, doing) {
  if (!state.open) return;
  say(doing);
  try { say((await api(`/api/runs/${encodeURIComponent(state.open)}/${path}`, body || {})).message); }
  catch (e) { say(e.message, true); }
}

function renderChat() {
  document.getElementById("chat-log").replaceChildren(...state.chat.map((m) => el("p", {},
    el("span", { class: "who" }, m.role === "user" ? "you" : m.role), m.content)));
}

async function sendChat(event) {
  event.preventDefault();
  const input = document.getElementById("chat-input");
  if (!state.open || !input.value.trim()) return;
  state.chat.push({ role: "user", content: input.value });
  input.value = "";
  renderChat();
  try {
    const answer = await api("/api/chat", { run: state.open, messages: state.chat.filter((m) => m.role !== "error") });
    state.chat.push({ role: "assistant", content: answer.content });
  } catch (e) { state.chat.push({ role: "error", content: e.message }); }
  renderChat();
}

async function refreshMachine() {
  if (document.hidden) return;
  try {
    const m = await api("/api/machine");
    const pct = (v) => v === null || v === undefined ? "-" : `${Math.round(v * 100)}%`;
    const gib = (b) => b ? `${(b / 2 ** 30).toFixed(1)} GiB` : "-";
    const sensors = [...m.temperatures.map((t) => `${t.name}: ${t.celsius.toFixed(0)} °C`),
      ...m.power.map((p) => `${p.name}: ${p.watts} W`), ...m.gpus.map((g) => `${g.name}: ${g.watts ?? "-"} W, ${g.celsius ?? "-"} °C`)];
    document.getElementById("machine").replaceChildren(
      el("div", {}, el("h3", {}, "CPU and memory"), el("p", {}, `${m.cpu.cores} cores, load ${m.cpu.load.map((v) => v.toFixed(2)).join(" ")}; `,
        `other processes ${pct(m.cpu.others)}, lodger ${pct(m.cpu.ours)}`),
        el("p", {}, `memory ${gib(m.memory.available)} free of ${gib(m.memory.total)}; other processes use ${pct(m.memory.others)}`),
        el("p", {}, m.on_battery ? "on battery" : "on mains power (or no battery)")),
      el("div", {}, el("h3", {}, "Temperature and power"), ...(sensors.length ? sensors.map((s) => el("p", {}, s))
        : [el("p", {}, "no readable sensors on this machine")])),
      el("div", {}, el("h3", {}, "Policies of live runs"), ...(m.policies.length ? m.policies.map((p) => el("p", {}, el("b", {}, p.run), " ",
        JSON.stringify(p.policy), p.would_yield.length ? ` — would yield now: ${p.would_yield.join("; ")}` : " — clear"))
        : [el("p", {}, "no run is training")])),
      el("div", {}, el("h3", {}, "Decisions"), el("ol", {}, ...m.decisions.slice(0, 12).map((d) => el("li", {},
        `${fmt.when(d.time)} ${d.kind} ${d.run || ""} ${d.data.reason || (d.data.reasons || []).join("; ") || d.data.decision || d.data.mode || ""}`)))));
  } catch (e) { say(e.message, true); }
}

let pending = null;
function onTable(table) {
  renderTable(table);
  if (pending) return;  // at most one refresh of the open run in flight; the next table brings the rest
  pending = Promise.all([refreshRun(), state.compared.length ? Promise.resolve() : null])
    .catch((e) => say(e.message, true)).finally(() => { pending = null; });
}

function connect() {
  const live = document.getElementById("live");
  const source = new EventSource("/events");
  source.addEventListener("runs", (e) => onTable(JSON.parse(e.data)));
  source.onopen = () => { live.textContent = "live"; live.className = "dot on"; };
  source.onerror = () => { live.textContent = "reconnecting"; live.className = "dot off"; };
}

document.getElementById("compare-button").addEventListener("click", () => compareSelected().catch((e) => say(e.message, true)));
document.getElementById("pause-release").addEventListener("click", () => act("pause", { mode: "release" }, "asking the run to release ..."));
document.getElementById("pause-hold").addEventListener("click", () => act("pause", { mode: "hold" }, "asking the run to hold ..."));
document.getElementById("continue").addEventListener("click", () => act("continue", {}, "asking the run to continue ..."));
document.getElementById("resume").addEventListener("click", () => act("resume", {}, "resuming (loading the model) ..."));
document.getElementById("chat-form").addEventListener("submit", sendChat);
connect();
refreshMachine();
setInterval(refreshMachine, 5000);
