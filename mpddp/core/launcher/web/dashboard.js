// mpddp --dashboard: reads the launcher's snapshot (the JSON of `mpddp top --json`) and every rank's recent arrival
// lags, every node's, once a second, and draws them: the header, a row a rank (the straggler marked, as `mpddp top`
// marks it), and the lags over time (the live form of --timeline's picture). It only reads: no request it makes acts
// on the job.
// Every text from the job (a rank's last line) goes in as text, never as HTML.
"use strict";

const EVERY = 1000; // ms between two reads
const QUERY = window.location.search; // the token, where the launcher asks for one
const COLUMNS = ["RANK", "NODE", "LOCAL", "STATE", "COLL/S", "LAST COLLECTIVE", "LAG", "CPU", "RSS", "GPU", "LAST LINE"];
const NUMERIC = new Set(["RANK", "NODE", "LOCAL", "COLL/S", "LAG", "CPU", "RSS"]);
// matplotlib's tab10, the colours of --timeline's picture: a rank has the same colour in both
const COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
  "#17becf"];

function clock(seconds) {
  const s = Math.floor(seconds);
  const two = (n) => String(n).padStart(2, "0");
  return `${Math.floor(s / 3600)}:${two(Math.floor(s / 60) % 60)}:${two(s % 60)}`;
}

function size(bytes) {
  return bytes >= 2 ** 30 ? `${(bytes / 2 ** 30).toFixed(1)} GiB` : `${(bytes / 2 ** 20).toFixed(0)} MiB`;
}

function signed(ms) {
  return `${ms >= 0 ? "+" : ""}${ms.toFixed(1)} ms`;
}

// A row's cells, in COLUMNS' order: the same words as core/launcher/live_table.py's
function cells(r) {
  const gpu = r.gpu === null ? "" : `${r.gpu}: ` + [r.gpu_util === null ? "" : `${r.gpu_util}%`,
    r.gpu_mib === null ? "" : `${r.gpu_mib} MiB`].filter((x) => x).join(" ");
  return [String(r.rank), String(r.node), String(r.local_rank), r.state,
    r.per_second === null ? "" : r.per_second.toFixed(1), r.last || "",
    r.lag_ms === null ? "" : signed(r.lag_ms) + (r.straggler ? " *" : ""),
    r.cpu === null ? "" : `${r.cpu.toFixed(0)}%`, r.rss === null ? "" : size(r.rss), gpu, r.line.trim()];
}

function header(snapshot) {
  const h = snapshot.header;
  const nodes = `${h.nnodes} node(s)` + (h.max_nnodes !== h.nnodes ? ` of ${h.max_nnodes}` : "") +
    (h.spares ? ` + ${h.spares} waiting` : "");
  const where = h.node === null ? h.host : `node ${h.node} (${h.host})`;
  document.getElementById("job").textContent = `job ${h.job}`;
  document.title = `mpddp ${h.job}`;
  document.getElementById("summary").textContent = `round ${h.round}  ·  ${h.world_size} rank(s) on ${nodes}  ·  ` +
    `restarts ${h.restarts}  ·  up ${clock(h.elapsed)}  ·  seen from ${where}`;
  const failure = document.getElementById("failure");
  failure.hidden = !h.failure;
  failure.textContent = h.failure ? `first failure: ${h.failure}` : "";
}

function table(snapshot) {
  const gpu = snapshot.ranks.some((r) => r.gpu !== null);
  const keep = COLUMNS.map((name, i) => i).filter((i) => gpu || COLUMNS[i] !== "GPU");
  const head = document.getElementById("columns");
  head.replaceChildren(...keep.map((i) => Object.assign(document.createElement("th"), {textContent: COLUMNS[i]})));
  const body = document.querySelector("#ranks tbody");
  body.replaceChildren(...snapshot.ranks.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.rank = r.rank;
    tr.className = r.straggler ? "straggler" : "";
    const row = cells(r);
    for (const i of keep) {
      const td = document.createElement("td");
      td.textContent = row[i];
      td.className = [NUMERIC.has(COLUMNS[i]) ? "num" : "", COLUMNS[i] === "LAG" ? "lag" : "",
        COLUMNS[i] === "LAST LINE" ? "line" : "", COLUMNS[i] === "STATE" ? `state-${r.state.split(" ")[0]}` : ""]
        .filter((x) => x).join(" ");
      if (COLUMNS[i] === "LAST LINE") td.title = row[i];
      tr.appendChild(td);
    }
    return tr;
  }));
  const notes = [];
  if (!snapshot.ranks.length) notes.push("No rank running: the launcher waits for its round, or its ranks have not started.");
  const ages = new Map(snapshot.ranks.map((r) => [r.node, r.age]));
  if (ages.size > 1) notes.push(`Rows' age: ${[...ages].sort((a, b) => a[0] - b[0]).map(([n, a]) => `node ${n} ${a.toFixed(1)} s`).join(", ")}.`);
  if (snapshot.missing.length) notes.push(`Not heard from yet: node(s) ${snapshot.missing.join(", ")} (their rows come with their next beat).`);
  if (snapshot.ranks.some((r) => r.straggler)) notes.push("* the straggler: the rank the others wait for at collectives.");
  document.getElementById("notes").textContent = notes.join(" ");
}

// The tick at or above ``step`` of 1, 2 or 5 times a power of ten: the lag axis reads 0, 10, 20, 30, 40 ms
function nice(step) {
  const ten = 10 ** Math.floor(Math.log10(step));
  return [1, 2, 5, 10].map((m) => m * ten).find((t) => t >= step);
}

// Each rank's lags as dots, x: seconds before now, y: ms; the straggler's naming as a dashed line
function timeline(data) {
  const canvas = document.getElementById("timeline");
  const g = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, left = 60, right = 110, top = 12, bottom = 34;
  g.clearRect(0, 0, W, H);
  const all = data.ranks.flatMap((r) => r.points.map((p) => p[1]));
  const tick = nice(Math.max(1, ...all) * 1.1 / 4), most = 4 * tick;
  // a young job fills the width: the span shown grows by 10 s up to the launcher's
  const oldest = Math.min(0, ...data.ranks.flatMap((r) => r.points.map((p) => p[0])));
  const span = Math.min(data.span, Math.max(10, Math.ceil(-oldest / 10) * 10));
  document.getElementById("span").textContent = span >= 120 ? `${span / 60} minutes` : `${span} s`;
  const x = (ago) => left + (W - left - right) * (1 + ago / span);
  const y = (ms) => H - bottom - (H - top - bottom) * (ms / most);
  g.strokeStyle = "#ccc"; g.fillStyle = "#555"; g.font = "11px sans-serif"; g.lineWidth = 1;
  for (let k = 0; k <= 4; k++) {
    const ms = tick * k;
    g.beginPath(); g.moveTo(left, y(ms)); g.lineTo(W - right, y(ms)); g.stroke();
    g.fillText(`${+ms.toFixed(1)} ms`, 4, y(ms) + 4);
  }
  for (let s = 0; s <= span; s += span / 4) {
    g.fillText(s === 0 ? "now" : `-${s.toFixed(s < 10 ? 1 : 0)} s`, x(-s) - 12, H - bottom + 16);
  }
  data.ranks.forEach((r, i) => {
    g.fillStyle = COLOURS[r.rank % COLOURS.length];
    for (const [ago, ms] of r.points) g.fillRect(x(ago) - 1.5, y(ms) - 1.5, 3, 3);
    g.fillRect(W - right + 12, top + 6 + i * 16, 8, 8);
    g.fillStyle = "#333";
    g.fillText(`rank ${r.rank}`, W - right + 24, top + 14 + i * 16);
  });
  if (data.named && -data.named.ago <= span) {
    const at = x(data.named.ago), label = `rank ${data.named.rank} named`;
    g.strokeStyle = "#000"; g.setLineDash([5, 4]);
    g.beginPath(); g.moveTo(at, top); g.lineTo(at, H - bottom); g.stroke();
    g.setLineDash([]); g.fillStyle = "#000";
    const wide = g.measureText(label).width;  // left of the line near the right edge: clear of the legend
    g.fillText(label, at + 4 + wide > W - right ? at - 4 - wide : at + 4, top + 10);
  }
  canvas.dataset.points = String(all.length); // for a reader (and the browser test): what was drawn
  canvas.dataset.named = data.named ? String(data.named.rank) : "";
  canvas.dataset.ranks = data.ranks.map((r) => r.rank).join(",");
}

async function read(path) {
  const answer = await fetch(path + QUERY, {cache: "no-store"});
  if (!answer.ok) throw new Error(`${path}: ${answer.status}`);
  return answer.json();
}

const FIRST_WAIT = 8000; // ms the first look waits for every node's rows, as `mpddp top --once` does
const opened = Date.now();
let whole = false; // every node's rows were in once: from then on, a look is drawn as it comes

// The snapshot and the whole job's timeline of one moment (/look.json); until every node's rows are in (or
// FIRST_WAIT has passed), the page says how many nodes it still waits for instead of drawing half the job
async function look() {
  const status = document.getElementById("status");
  try {
    const {snapshot, timeline: lags} = await read("look.json");
    const nodes = snapshot.header.nnodes, waiting = snapshot.missing.length;
    whole = whole || !waiting || Date.now() - opened > FIRST_WAIT;
    if (!whole) {
      status.textContent = `waiting for ${waiting} of ${nodes} nodes' rows (they come with their next beat)`;
      status.className = "stale";
    } else {
      header(snapshot);
      table(snapshot);
      timeline(lags);
      status.textContent = `updated ${new Date(snapshot.taken * 1000).toLocaleTimeString()}`;
      status.className = "";
    }
  } catch (e) {
    status.textContent = `the launcher does not answer (the job may have ended): ${e.message}`;
    status.className = "stale";
  }
  setTimeout(look, EVERY); // after the answer: a slow launcher is never asked twice at once
}

document.addEventListener("DOMContentLoaded", look);
