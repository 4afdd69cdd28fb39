// The live page: a chat streamed from /v1/chat/completions beside the engine's steps, pushed by
// /live/events (minipaged/entrypoints/live_routes.py). Nothing is loaded from elsewhere.
"use strict";

const MODEL = document.body.dataset.model;
const NEEDS_KEY = document.body.dataset.needsKey === "true";
const $ = (id) => document.getElementById(id);
let apiKey = sessionStorage.getItem("minipaged-key") || "";
let history = [];
const seenEvents = new Set();

function askKey(again) {
  // With an API key the page asks once per tab (kept in sessionStorage, sent with each call).
  if (!NEEDS_KEY || (apiKey && !again)) return;
  apiKey = window.prompt(again ? "That API key was refused; the server's API key:"
                               : "This server needs its API key:") || "";
  sessionStorage.setItem("minipaged-key", apiKey);
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (apiKey) h["Authorization"] = "Bearer " + apiKey;
  return h;
}

// Server-sent events read through fetch (EventSource cannot send the key): "event:"/"data:"
// lines, a blank line ends an event.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data += line.slice(5).trim();
      }
      if (data) onEvent(name, data);
    }
  }
}

// -- the engine view --------------------------------------------------------------------------
async function follow() {
  for (;;) {
    try {
      const response = await fetch("/live/events", { headers: headers() });
      if (response.status === 401) { askKey(true); continue; }
      if (!response.ok) {
        const body = await response.json().catch(() => ({}));
        $("status").textContent = (body.error && body.error.message) || response.statusText;
        await new Promise((r) => setTimeout(r, 5000));
        continue;
      }
      $("status").textContent = "live";
      await readEvents(response, (name, data) => {
        if (name === "frame") draw(JSON.parse(data));
        if (name === "error") $("status").textContent = "the engine stopped: " + JSON.parse(data);
      });
    } catch (e) {
      $("status").textContent = "disconnected: " + e;
    }
    await new Promise((r) => setTimeout(r, 5000));
  }
}

function draw(frame) {
  document.body.dataset.step = frame.step;
  $("step-number").textContent = frame.step;
  $("tokens-per-s").textContent = frame.tokens_per_s;
  $("batched").textContent = frame.num_batched_tokens;
  const p = frame.pool;
  const blocks = $("blocks");
  Object.assign(blocks.dataset, { free: p.free, held: p.held, shared: p.shared, total: p.total });
  $("pool-numbers").textContent =
    `KV pool: ${p.free}/${p.total} free · ${p.held} held · ${p.shared} shared · ` +
    `${p.cached} cached (${p.evictable} evictable) · swap ${p.cpu_total - p.cpu_free}/` +
    `${p.cpu_total} used · preemptions ${frame.stats.num_preemptions_recompute} recompute, ` +
    `${frame.stats.num_preemptions_swap} swap · copy-on-write copies ` +
    `${frame.stats.num_blocks_copied}`;
  if (frame.svg) {
    $("queues").innerHTML = frame.svg.queues;  // drawn by the server (the lessons' visualizer)
    blocks.innerHTML = frame.svg.blocks;
  } else {
    drawAsText(frame);
  }
  for (const e of frame.events) {
    const key = e.step + ":" + JSON.stringify(e);
    if (seenEvents.has(key)) continue;
    seenEvents.add(key);
    const li = document.createElement("li");
    li.className = "event";
    // counted since the frame before (steps e.since + 1 .. e.step); the ids are this step's
    const parts = e.preempted.map(([rid, mode]) => `req ${rid} preempted (${mode})`);
    const counts = [["num_preemptions_recompute", "preempted (recompute)"],
                    ["num_preemptions_swap", "preempted (swap)"],
                    ["num_blocks_copied", "block(s) copied on write"],
                    ["num_blocks_swapped_out", "block(s) swapped out"]];
    const named = (mode) => e.preempted.filter(([, m]) => m === mode).length;
    const shown = { num_preemptions_recompute: named("recompute"),
                    num_preemptions_swap: named("swap") };
    for (const [key, label] of counts) {
      const more = (e[key] || 0) - (shown[key] || 0);  // those of steps no frame showed
      if (more > 0) parts.push(`${more} ${shown[key] ? "more " : ""}${label}`);
    }
    const steps = e.step - e.since > 1 ? `steps ${e.since + 1}-${e.step}` : `step ${e.step}`;
    li.textContent = `${steps}: ` + parts.join(", ");
    $("event-log").prepend(li);
  }
  $("pause").textContent = frame.paused ? "Resume" : "Pause";
  $("step").disabled = !frame.paused;
}

function drawAsText(frame) {
  // Without the visualizer package: the queues and block tables as a table.
  const table = document.createElement("table");
  table.className = "fallback";
  for (const q of ["waiting", "running", "swapped"]) {
    const row = table.insertRow();
    row.insertCell().textContent = q;
    row.insertCell().textContent = frame.queues[q].map((b) => b.request_id).join(", ");
  }
  for (const s of frame.tables) {
    const row = table.insertRow();
    row.insertCell().textContent = `seq ${s.seq_id} (req ${s.request_id})`;
    row.insertCell().textContent = s.block_table.join(" ");
  }
  $("queues").replaceChildren();
  $("blocks").replaceChildren(table);
}

async function control(action) {
  const response = await fetch("/live/control", {
    method: "POST", headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify({ action }) });
  if (response.status === 401) askKey(true);
}

// -- the chat ---------------------------------------------------------------------------------
async function send(event) {
  event.preventDefault();
  const text = $("message").value.trim();
  if (!text) return;
  $("message").value = "";
  history.push({ role: "user", content: text });
  const turn = document.createElement("div");
  turn.className = "turn user";
  turn.textContent = text;
  const answer = document.createElement("div");
  answer.className = "turn assistant";
  $("conversation").append(turn, answer);
  const body = { model: MODEL, messages: history, stream: true,
                 temperature: Number($("temperature").value),
                 max_tokens: Number($("max-tokens").value), n: Number($("n").value) };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const choices = [];
  const choice = (i) => {
    while (choices.length <= i) {
      const div = document.createElement("div");
      div.className = "choice";
      div.dataset.index = choices.length;
      answer.append(div);
      choices.push(div);
    }
    return choices[i];
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(body) });
    if (response.status === 401) askKey(true);
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error((error.error && error.error.message) || response.statusText);
    }
    await readEvents(response, (name, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const c of chunk.choices) {
        const div = choice(c.index);
        div.textContent += (c.delta && c.delta.content) || "";
        if (c.finish_reason) div.dataset.done = "1";
      }
    });
    history.push({ role: "assistant", content: choices.length ? choices[0].textContent : "" });
  } catch (e) {
    const div = document.createElement("div");
    div.className = "error";
    div.textContent = String(e.message || e);
    answer.append(div);
    history.pop();
  }
  answer.dataset.done = "1";
  $("conversation").scrollTop = $("conversation").scrollHeight;
}

$("chat-form").addEventListener("submit", send);
$("message").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("send").click(); }
});
$("clear").addEventListener("click", () => { history = []; $("conversation").replaceChildren(); });
$("pause").addEventListener("click", () =>
  control($("pause").textContent === "Pause" ? "pause" : "resume"));
$("step").addEventListener("click", () => control("step"));
askKey(false);
follow();
