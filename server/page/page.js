// The operator page: reads GET /status, /versions and /receivers with the token kept in this tab's
// sessionStorage (sent as a header, never in a URL) and draws them. Everything the daemon sends is put in the
// page as text (textContent), never as markup: a reason or host name cannot inject anything.
"use strict";

const TOKEN_KEY = "ckpt-engine-token";
const REFRESH_MS = 2000;
// A stalled daemon (stopped, swapped out, a hung proxy) must not leave the page showing old data as current.
const FETCH_TIMEOUT_MS = 5000;
// What the daemon accepts as a token (ckpt_engine/control/auth.py Token): it travels in a header, which
// fetch refuses to send with any other character (a word processor's dash or quote in a pasted token).
const TOKEN_RE = /^[\x21-\x7e]{16,4096}$/;
const VERSIONS_SHOWN = 30;
// What each stage is (docs/daemon.md, docs/benchmarks.md): the legend's and the bars' title text.
const STAGE_INFO = {
  header: "the sender announces the version: its layout and every tensor's digest",
  fill: "copying tensors into the send buckets (cached: also waiting for the snapshot to cache each bucket)",
  digest: "computing the tensors' digests (xxh3-64 on host memory, torch integer ops on a device)",
  broadcast: "waiting on the buckets' broadcasts: the bytes on the wire",
  control: "per-bucket header frames and the end-of-version trailer (on gloo a header waits behind the previous " +
    "bucket's data, so wire time lands here too)",
  ack: "the acknowledgement round: waiting until every receiver has verified, loaded and acknowledged",
  other: "the rest of request→commit: the wait for the trainer's step boundary, the sync group's rendezvous, a " +
    "snapshot taken before the send, and the receivers' reports that commit the version",
  snapshot: "cached: the training loop held for the device→host snapshot (before the send on a CPU trainer, " +
    "overlapping it on a GPU/NPU one)",
  held: "bypass_cpu: the training loop held until its buckets were read from the live parameters (overlaps fill, " +
    "broadcast and control)",
  verify: "the slowest receiver recomputing every digest (during ack)",
  load: "the slowest receiver applying the verified version to its model (during ack)",
};
// The sender's stages run one after another on its send thread: stacked in this order, then "other" up to
// request→commit. Every other stage overlaps them (the trainer held meanwhile, the receivers working during
// ack): drawn as a line of its own under the bar, to the same scale, never added to the stack.
const SEQUENTIAL = ["header", "fill", "digest", "broadcast", "control", "ack"];
const OVERLAPPING = ["snapshot", "held", "verify", "load"];
const OTHER = "other";
const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
  "#9c755f", "#bab0ac", "#86bcb6", "#d37295"];
const OTHER_COLOUR = "#d5d5d5";
const AGGREGATES = new Set(["total"]);  // sums of the others: never drawn
const TERMINAL = new Set(["committed", "failed", "cancelled", "interrupted"]);

class AuthError extends Error {}

let timer = null;  // the one pending refresh
let loop = 0;  // bumped when the token changes: a refresh of an older loop drops its result and stops
let shownAt = null;  // when the data on the page was fetched
let failingSince = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  return node;
}

function ms(seconds) {
  if (seconds === null || seconds === undefined) return "";
  return seconds >= 10 ? `${seconds.toFixed(1)} s` : `${(seconds * 1000).toFixed(1)} ms`;
}

function ago(seconds) {
  return seconds < 60 ? `${seconds.toFixed(1)} s ago` : `${Math.round(seconds / 60)} min ago`;
}

function mib(bytes) {
  return (bytes / 1048576).toFixed(2);
}

function validToken(token) {
  return TOKEN_RE.test(token);
}

async function api(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token && !validToken(token)) throw new AuthError(`${path}: the kept token is not a valid token`);
  const headers = token ? {Authorization: `Bearer ${token}`} : {};  // none: a daemon with auth.open needs none
  const signal = AbortSignal.timeout(FETCH_TIMEOUT_MS);  // (also bounds reading the body)
  try {
    const reply = await fetch(path, {headers, cache: "no-store", signal});
    if (reply.status === 401 || reply.status === 403) throw new AuthError(`${path}: ${reply.status}`);
    if (!reply.ok) throw new Error(`${path}: HTTP ${reply.status}`);
    return await reply.json();
  } catch (error) {
    if (error.name === "TimeoutError") throw new Error(`${path}: no answer within ${FETCH_TIMEOUT_MS / 1000} s`);
    if (error instanceof TypeError) throw new Error(`${path}: ${error.message}`);  // (fetch's: which is not said)
    throw error;
  }
}

// A stage's seconds, or undefined: only the record's own keys (a stage named "constructor" must not find
// Object.prototype's), and only finite numbers (anything else would make every bar NaN).
function stageSeconds(record, name) {
  const stages = record.stages || {};
  const seconds = Object.hasOwn(stages, name) ? stages[name] : undefined;
  return typeof seconds === "number" && Number.isFinite(seconds) ? seconds : undefined;
}

function stageInfo(name) {
  return Object.hasOwn(STAGE_INFO, name) ? STAGE_INFO[name]
    : "a stage this page does not know: drawn apart, not added to the stack";
}

// The stages the records have, in drawing order: the sequential ones first (stacked), then the others.
function stageNames(records) {
  const seen = new Set();
  for (const r of records) for (const name of Object.keys(r.stages || {})) if (!AGGREGATES.has(name)) seen.add(name);
  const known = SEQUENTIAL.concat(OVERLAPPING).filter((name) => seen.has(name));
  return known.concat([...seen].filter((name) => !known.includes(name)).sort());
}

// The sum of the stacked (sequential) stages among names.
function stagedSeconds(record, names) {
  return names.filter((name) => SEQUENTIAL.includes(name))
    .reduce((sum, name) => sum + (stageSeconds(record, name) || 0), 0);
}

// request→commit, as the demo's log and `ckpt-engine versions` say: from the request to the version's end (its
// commit; for one that failed, its last update). Undefined while it is in flight.
function requestToCommit(record) {
  const end = typeof record.committed_at === "number" ? record.committed_at
    : TERMINAL.has(record.status) && typeof record.updated_at === "number" ? record.updated_at : undefined;
  const seconds = end !== undefined && typeof record.created_at === "number" ? end - record.created_at : undefined;
  return Number.isFinite(seconds) && seconds >= 0 ? seconds : undefined;
}

// The rest of request→commit that no stacked stage accounts for (0 when unknown).
function otherSeconds(record, names) {
  const total = requestToCommit(record);
  return total === undefined ? 0 : Math.max(0, total - stagedSeconds(record, names));
}

// Marks of one version besides its status: torn (a receiver's failed apply tore its model), repaired by vN
// (a later committed repair brought that receiver back), repair of vS (this version is such a repair).
function marks(record, records) {
  const out = [];
  const torn = (record.receivers || []).filter((e) => e.torn).map((e) => e.agent_id);
  if (torn.length) {
    out.push("torn");
    const repair = records.filter((r) => r.purpose === "repair" && r.status === "committed" && r.id > record.id)
      .reverse().find((r) => (r.receivers || []).some((e) => torn.includes(e.agent_id) && e.ok));
    if (repair) out.push(`repaired by v${repair.id}`);
  }
  if (record.purpose === "repair" && record.source_version !== null) out.push(`repair of v${record.source_version}`);
  if (record.purpose === "push" && record.source_version !== null) out.push(`re-push of v${record.source_version}`);
  return out;
}

function colourOf(name, names) {
  return name === OTHER ? OTHER_COLOUR : PALETTE[names.indexOf(name) % PALETTE.length];
}

function titled(node, text) {
  const title = svg("title", {});
  title.textContent = text;
  node.append(title);
  return node;
}

// One bar: the sequential stages stacked, then "other" up to request→commit; under it one thin line per
// overlapping stage, from the left, to the same scale.
function stageBar(record, names, widest) {
  const width = 320, height = 12, lane = 5;
  const stacked = names.filter((n) => SEQUENTIAL.includes(n) && stageSeconds(record, n));
  const apart = names.filter((n) => !SEQUENTIAL.includes(n) && stageSeconds(record, n));
  const bar = svg("svg", {width, height: height + 2 + lane * apart.length, class: "bar", role: "img"});
  const scale = (seconds) => Math.max(1, (seconds / widest) * width);
  let x = 0;
  for (const name of stacked.concat(otherSeconds(record, names) > 0 ? [OTHER] : [])) {
    const seconds = name === OTHER ? otherSeconds(record, names) : stageSeconds(record, name);
    const w = scale(seconds);
    bar.append(titled(svg("rect", {x, y: 0, width: w, height, fill: colourOf(name, names), "data-stage": name,
      "data-kind": name === OTHER ? "other" : "stacked", "data-seconds": seconds}),
    `${name} ${ms(seconds)}: ${stageInfo(name)}`));
    x += w;
  }
  apart.forEach((name, i) => {
    const seconds = stageSeconds(record, name);
    bar.append(titled(svg("rect", {x: 0, y: height + 2 + lane * i, width: scale(seconds), height: lane - 2,
      fill: colourOf(name, names), "data-stage": name, "data-kind": "overlapping", "data-seconds": seconds}),
    `${name} ${ms(seconds)}, beside or inside the stacked stages (not added to them): ${stageInfo(name)}`));
  });
  return bar;
}

function renderLegend(names, withOther) {
  const legend = document.getElementById("legend");
  const swatch = (name, thin) => {  // an SVG fill, not a style attribute: the page's CSP allows no inline styles
    const box = svg("svg", {width: 10, height: 10});
    box.append(svg("rect", {y: thin ? 4 : 0, width: 10, height: thin ? 3 : 10, fill: colourOf(name, names)}));
    return box;
  };
  const key = (name, thin) => el("span", {class: `key${thin ? " key-overlapping" : ""}`, title: stageInfo(name),
    "data-stage": name}, swatch(name, thin), name);
  const stacked = names.filter((n) => SEQUENTIAL.includes(n)).concat(withOther ? [OTHER] : []);
  const apart = names.filter((n) => !SEQUENTIAL.includes(n));
  legend.replaceChildren(el("span", {class: "legend-part"}, "stacked, one after another: "),
    ...stacked.map((n) => key(n, false)),
    ...(apart.length ? [el("span", {class: "legend-part"},
      "lines under the bar, stages beside or inside those (not added): "), ...apart.map((n) => key(n, true))] : []));
}

function renderVersions(records) {
  const names = stageNames(records);
  const widest = Math.max(1e-6, ...records.map((r) => Math.max(requestToCommit(r) || 0, stagedSeconds(r, names),
    ...names.map((n) => stageSeconds(r, n) || 0))));
  renderLegend(names, records.some((r) => otherSeconds(r, names) > 0));
  const rows = records.map((r) => {
    const extra = marks(r, records);
    const shown = names.filter((n) => stageSeconds(r, n));
    const other = otherSeconds(r, names);
    const stages = shown.filter((n) => SEQUENTIAL.includes(n)).map((n) => `${n} ${ms(stageSeconds(r, n))}`)
      .concat(other > 0 ? [`${OTHER} ${ms(other)}`] : []).join(", ");
    const apart = shown.filter((n) => !SEQUENTIAL.includes(n)).map((n) => `${n} ${ms(stageSeconds(r, n))}`).join(", ");
    const text = stages + (apart ? ` | overlapping: ${apart}` : "");
    const total = requestToCommit(r);
    return el("tr", {"data-version": r.id, "data-status": r.status, class: `status-${r.status}`},
      el("td", {}, `v${r.id}`),
      el("td", {}, el("span", {class: `pill status-${r.status}`}, r.status),
        ...extra.map((m) => el("span", {class: `mark mark-${m.split(" ")[0]}`}, m))),
      el("td", {}, r.purpose), el("td", {}, r.step ?? "-"), el("td", {}, r.owners), el("td", {}, mib(r.bytes)),
      el("td", {class: "stages", title: text}, stageBar(r, names, widest), el("span", {class: "stage-text"}, text)),
      el("td", {class: "total", "data-seconds": total ?? ""}, total === undefined ? "-" : ms(total)),
      el("td", {class: "reason"}, r.reason || ""));
  });
  document.querySelector("#versions tbody").replaceChildren(...rows);
}

// The rule of server/decisions/views.py: each receiver's newest failure. A Map: an agent id is the agent's
// own word, and "constructor" must not find Object.prototype's.
function lastErrors(records) {
  const errors = new Map();
  for (const r of records) for (const e of r.receivers || []) {
    if (e.agent_id && !e.ok && !errors.has(e.agent_id)) errors.set(e.agent_id, `v${r.id}: ${e.reason || "failed"}`);
  }
  return errors;
}

// The daemon's own count (over its window of committed versions, not the few shown here); "-" when it
// serves nothing, or from a daemon too old to send one.
function lag(agent) {
  return Number.isFinite(agent.lag) ? agent.lag : "-";
}

function staging(s) {
  if (!s) return "";
  return [s.mode, s.why ? `(${s.why})` : "", s.pause_s !== null && s.pause_s !== undefined ? `pause ${ms(s.pause_s)}` : ""]
    .filter(Boolean).join(" ");
}

// The rule of server/decisions/views.py quorum_ranks: each receiver's rank in the newest version that had it in its
// quorum, the N of "receiver N" in reasons and in `ckpt-engine version` (a Map, as above).
function quorumRanks(records) {
  const found = new Map();
  for (const r of records) for (const e of r.receivers || []) {
    if (e.agent_id && Number.isInteger(e.rank) && !found.has(e.agent_id)) found.set(e.agent_id, `${e.rank} (v${r.id})`);
  }
  return found;
}

function renderReceivers(agents, records) {
  const errors = lastErrors(records);
  const seats = quorumRanks(records);
  const rows = agents.filter((a) => a.role === "receiver").map((a) => el("tr", {"data-agent": a.agent_id, "data-state": a.state},
    el("td", {}, a.agent_id), el("td", {}, seats.get(a.agent_id) || "-"), el("td", {}, a.engine || "-"),
    el("td", {}, `${a.host}:${a.pid}`),
    el("td", {}, el("span", {class: `pill state-${a.state}`}, a.state)),
    el("td", {}, a.serving === null ? "-" : `v${a.serving}`), el("td", {}, lag(a)),
    el("td", {}, staging(a.last_staging)),
    el("td", {class: "reason"}, a.torn || a.unable || errors.get(a.agent_id) || ""),
    el("td", {}, ago(a.seconds_since_seen))));
  document.querySelector("#receivers tbody").replaceChildren(...rows);
}

function renderTrainers(agents) {
  const rows = agents.filter((a) => a.role === "trainer").sort((a, b) => a.rank - b.rank).map((a) => el("tr", {},
    el("td", {}, a.rank), el("td", {}, a.agent_id), el("td", {}, `${a.host}:${a.pid}`), el("td", {}, a.device),
    el("td", {}, a.versions.map((v) => `v${v}`).join(" ")), el("td", {}, ago(a.seconds_since_seen))));
  document.querySelector("#trainers tbody").replaceChildren(...rows);
}

function renderCache(status, records) {
  const byId = new Map(records.map((r) => [r.id, r]));
  const kept = new Set(status.cache_kept_for_repairs || []);
  const rows = [...status.cache_versions].sort((a, b) => b - a).map((id) => {
    const r = byId.get(id);
    return el("tr", {"data-version": id}, el("td", {}, `v${id}`), el("td", {}, r ? r.status : ""),
      el("td", {}, r ? mib(r.bytes) : ""), el("td", {}, r ? r.owners : ""), el("td", {}, kept.has(id) ? "yes" : ""));
  });
  document.querySelector("#cache tbody").replaceChildren(...rows);
}

function renderDaemon(status) {
  const facts = {
    "ckpt-engine": status.version, history: status.history_id, started: new Date(status.started_at * 1000).toLocaleString(),
    degraded: status.degraded ? `yes: ${status.storage.error || "the history cannot be written"}` : "no",
    "in flight": status.in_flight ?? "-", receivers: status.receivers,
    versions: Object.entries(status.versions).map(([k, v]) => `${k} ${v}`).join(", "),
    torn: status.torn.join(", ") || "-", unable: status.unable.join(", ") || "-",
    ...Object.fromEntries(Object.entries(status.config).map(([k, v]) => [k, String(v)])),
  };
  document.querySelector("#config tbody").replaceChildren(...Object.entries(facts).map(([k, v]) =>
    el("tr", {}, el("th", {}, k), el("td", {"data-fact": k}, v))));
  const health = document.getElementById("health");
  const problem = status.degraded ? "degraded" : status.torn.length ? `${status.torn.length} torn` : "";
  health.textContent = problem || "ok";
  health.className = `pill ${problem ? "bad" : "good"}`;
  document.getElementById("daemon").textContent = `${status.version} · history ${status.history_id.slice(0, 8)}`;
}

function renderProgress(status, records) {
  const line = document.getElementById("progress");
  const r = records.find((v) => v.id === status.in_flight);
  if (status.in_flight === null || !r) {
    line.textContent = status.queued_push !== null && status.queued_push !== undefined
      ? `re-push v${status.queued_push} waits for the framework's next sync` : "no version in flight";
    line.className = "progress idle";
    return;
  }
  const done = Object.keys(r.stages || {}).filter((k) => stageSeconds(r, k) !== undefined)
    .map((k) => `${k} ${ms(stageSeconds(r, k))}`).join(", ");
  line.textContent = `v${r.id} ${r.status}: ${(Date.now() / 1000 - r.created_at).toFixed(1)} s so far` +
    (done ? ` (${done})` : "");
  line.className = "progress busy";
}

// One loop per token: a refresh started for an older one (forgotten, or replaced by a paste while its fetches
// were out) drops what it got and stops, so pasting again never adds a loop.
async function refresh(mine) {
  try {
    const [status, page, agents] = await Promise.all([api("/status"), api(`/versions?limit=${VERSIONS_SHOWN}`),
      api("/receivers")]);
    if (mine !== loop) return;
    const records = page.versions;
    renderDaemon(status);
    renderProgress(status, records);
    renderVersions(records);
    renderReceivers(agents.agents, records);
    renderTrainers(agents.agents);
    renderCache(status, records);
    showFresh();
  } catch (error) {
    if (mine !== loop) return;
    if (error instanceof AuthError) {
      const kept = sessionStorage.getItem(TOKEN_KEY);
      return askForToken(kept ? `That token was refused (${error.message}): paste another.` : "");
    }
    showStale(error);
  }
  timer = setTimeout(refresh, REFRESH_MS, mine);
}

function showFresh() {
  shownAt = new Date();
  failingSince = null;
  document.getElementById("main").classList.remove("stale");
  document.getElementById("health").title = "";
  document.getElementById("refreshed").textContent = `updated ${shownAt.toLocaleTimeString()}`;
  document.body.dataset.loaded = "yes";
}

// The tables stay (the last known state helps), but nothing may look current: the pill leaves green/red for
// its own state and says how old the data is, and the tables are dimmed until a refresh succeeds.
function showStale(error) {
  failingSince = failingSince || new Date();
  const health = document.getElementById("health");
  health.textContent = `stale · ${shownAt ? `data from ${shownAt.toLocaleTimeString()}` : "no data yet"}`;
  health.className = "pill stale";
  health.title = error.message;
  document.getElementById("main").classList.add("stale");
  document.getElementById("refreshed").textContent =
    `no answer since ${failingSince.toLocaleTimeString()}: ${error.message}`;
}

function stopRefreshing() {
  clearTimeout(timer);
  loop += 1;
}

function askForToken(message) {
  stopRefreshing();
  sessionStorage.removeItem(TOKEN_KEY);
  document.getElementById("main").hidden = true;
  document.getElementById("forget").hidden = true;
  document.getElementById("login").hidden = false;
  document.getElementById("login-error").textContent = message || "";
}

function start() {
  document.getElementById("login").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = document.getElementById("token");
    const token = input.value.trim();
    input.value = "";
    if (!validToken(token)) {  // never kept: fetch could not send it, and the daemon would refuse it anyway
      return askForToken("That is not a token: a token is 16 to 4096 printable ASCII characters with no spaces " +
        "(a dash or quote changed by the program it was copied from is a common cause).");
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    show();
  });
  document.getElementById("forget").addEventListener("click", () => askForToken());
  show();  // with no token yet, the first refresh's 401 asks for one
}

function show() {
  stopRefreshing();
  document.getElementById("login").hidden = true;
  document.getElementById("main").hidden = false;
  document.getElementById("forget").hidden = false;
  refresh(loop);
}

start();
