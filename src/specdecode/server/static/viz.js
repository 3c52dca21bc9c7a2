// The draft/verify visualizer: streams a request with step events from this server and draws
// each step's tokens by role, the acceptance per draft position, and the same prompt without
// speculation beside it. No build step, no library, nothing fetched from elsewhere.
"use strict";

const $ = (selector, root = document) => root.querySelector(selector);
let served = null; // GET /viz/config

// This server's routes by their origin: a page opened as http://user:key@host/viz (HTTP Basic,
// when the server has --api-key) would otherwise resolve "/viz/config" to a URL that carries
// the credentials, which fetch() refuses. The browser sends the key it was given itself.
const route = (path) => new URL(path, location.origin);

function showError(message) {
  const box = $("#error");
  box.textContent = message;
  box.hidden = !message;
}

async function loadConfig() {
  const response = await fetch(route("/viz/config"));
  served = await response.json();
  const select = $("#drafter");
  select.replaceChildren();
  for (const drafter of served.drafters) {
    const option = document.createElement("option");
    option.value = drafter.name;
    option.textContent = drafter.name;
    option.dataset.k = drafter.num_speculative_tokens;
    select.append(option);
  }
  select.disabled = served.drafters.length < 2;
  pickDrafter();
  const what = served.drafters.length ? served.drafters.map((d) => d.name).join(", ") : "none";
  $("#served").textContent = `model ${served.model} · drafters: ${what}`;
  $("#chat").checked = served.chat;
  $("#chat").disabled = !served.chat;
  $("#run").disabled = !served.drafters.length;
  if (!served.drafters.length) {
    showError("this server runs without a drafter: start it with --speculative-config to see speculation");
  }
}

function pickDrafter() {
  const option = $("#drafter").selectedOptions[0];
  if (!option) return;
  const k = $("#k");
  k.max = option.dataset.k;
  k.value = option.dataset.k;
}

// One request, streamed: calls onSteps(events) as step events arrive; resolves at [DONE].
async function stream(body, onSteps) {
  const chat = $("#chat").checked;
  const url = chat ? "/v1/chat/completions" : "/v1/completions";
  const prompt = $("#prompt").value;
  const payload = { model: served.model, stream: true, step_events: true, ...body };
  if (chat) payload.messages = [{ role: "user", content: prompt }];
  else payload.prompt = prompt;
  const response = await fetch(route(url), {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(payload),
  });
  if (!response.ok) {
    const error = await response.json().catch(() => ({}));
    throw new Error(error.error ? error.error.message : `HTTP ${response.status}`);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 2);
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.step_events) onSteps(chunk.step_events);
    }
  }
}

function span(cls, text, title, tag = "span") {
  const node = document.createElement(tag);
  node.className = cls;
  node.textContent = text;
  node.title = title;
  return node;
}

// The spans of one step: accepted draft tokens, then (for a chain's correction) the rejected
// draft token struck through, then the target's own token.
function drawStep(box, step) {
  const verify = (1000 * step.verify_s).toFixed(1);
  const title = `step ${step.index}: drafted ${step.drafted.length}, accepted ${step.num_accepted}, ` +
    `${step.final} token; verify ${verify} ms, batch ${step.batch_size}`;
  step.tokens.forEach((token, i) => {
    if (i === step.num_accepted && step.final === "correction" && step.parents === null) {
      const rejected = step.drafted_pieces[step.num_accepted];
      box.append(span("rejected", rejected, `${title}; rejected draft token`, "s"));
    }
    const role = i < step.num_accepted ? "accepted" : step.final;
    const node = span(`tok ${role}`, step.pieces[i], title);
    node.dataset.step = step.index;
    box.append(node);
  });
}

class Run {
  constructor(panel) {
    this.panel = panel;
    this.box = $(".text", panel);
    this.steps = [];
    this.box.replaceChildren();
    for (const field of ["tps", "tau", "acc", "steps"]) {
      const node = $(`.${field}`, panel);
      if (node) node.textContent = field === "steps" ? "0" : "–";
    }
  }

  add(events) {
    for (const step of events) {
      this.steps.push(step);
      drawStep(this.box, step);
    }
    const last = this.steps[this.steps.length - 1];
    const tokens = this.steps.reduce((n, s) => n + s.tokens.length, 0);
    const decoding = this.steps.slice(1); // step 0 is the prefill
    const drafted = decoding.reduce((n, s) => n + s.drafted.length, 0);
    const accepted = decoding.reduce((n, s) => n + s.num_accepted, 0);
    $(".tps", this.panel).textContent = (tokens / last.elapsed_s).toFixed(1);
    $(".steps", this.panel).textContent = this.steps.length;
    const tau = $(".tau", this.panel);
    if (tau && decoding.length) {
      const emitted = decoding.reduce((n, s) => n + s.tokens.length, 0);
      tau.textContent = (emitted / decoding.length).toFixed(2);
    }
    const acc = $(".acc", this.panel);
    if (acc && drafted) acc.textContent = `${((100 * accepted) / drafted).toFixed(0)}%`;
  }

  tokensPerSecond() {
    const last = this.steps[this.steps.length - 1];
    return last ? this.steps.reduce((n, s) => n + s.tokens.length, 0) / last.elapsed_s : 0;
  }
}

// Acceptance per draft position i: accepted at i / drafted at least i (chains: the first
// num_accepted tokens are accepted; trees: the path's depth).
function drawChart(steps, k) {
  const drafted = new Array(k).fill(0);
  const accepted = new Array(k).fill(0);
  for (const step of steps) {
    const depth = step.parents === null ? step.drafted.length : treeDepth(step.parents);
    for (let i = 0; i < Math.min(depth, k); i++) drafted[i] += 1;
    for (let i = 0; i < Math.min(step.num_accepted, k); i++) accepted[i] += 1;
  }
  const svg = $("#chart");
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const width = 640, height = 220, left = 40, bottom = 30, top = 10;
  const slot = (width - left) / k;
  const el = (name, attrs, text) => {
    const node = document.createElementNS(ns, name);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
    return node;
  };
  el("line", { x1: left, y1: top, x2: left, y2: height - bottom, stroke: "#888" });
  el("text", { x: 2, y: top + 10 }, "100%");
  el("text", { x: 10, y: height - bottom }, "0%");
  for (let i = 0; i < k; i++) {
    const rate = drafted[i] ? accepted[i] / drafted[i] : 0;
    const h = rate * (height - bottom - top);
    const bar = el("rect", {
      class: "bar", x: left + i * slot + slot * 0.15, y: height - bottom - h,
      width: slot * 0.7, height: h, "data-position": i + 1, "data-rate": rate.toFixed(3),
    });
    const tip = document.createElementNS(ns, "title");
    tip.textContent = `position ${i + 1}: ${accepted[i]} of ${drafted[i]} accepted`;
    bar.append(tip);
    el("text", { x: left + (i + 0.5) * slot - 4, y: height - 10 }, String(i + 1));
  }
}

function treeDepth(parents) {
  const depth = [];
  parents.forEach((parent, node) => { depth[node] = parent < 0 ? 1 : depth[parent] + 1; });
  return depth.length ? Math.max(...depth) : 0;
}

async function run(event) {
  event.preventDefault();
  showError("");
  document.body.dataset.done = "false";
  $("#run").disabled = true;
  $("#speedup").textContent = "";
  const k = Number($("#k").value);
  const common = {
    max_tokens: Number($("#max-tokens").value),
    temperature: Number($("#temperature").value),
  };
  const drafter = $("#drafter").value;
  $(".what", $("#spec")).textContent = `(${drafter}, K = ${k})`;
  const spec = new Run($("#spec"));
  const plain = new Run($("#plain"));
  drawChart([], k);
  try {
    await stream({ ...common, num_speculative_tokens: k, drafter }, (events) => {
      spec.add(events);
      drawChart(spec.steps.slice(1), k);
    });
    if ($("#baseline").checked) {
      await stream({ ...common, num_speculative_tokens: 0 }, (events) => plain.add(events));
      const ratio = spec.tokensPerSecond() / plain.tokensPerSecond();
      $("#speedup").textContent = `speedup ${ratio.toFixed(2)}x (tokens/s, prefill included, one run each)`;
    }
  } catch (error) {
    showError(error.message);
  } finally {
    $("#run").disabled = false;
    document.body.dataset.done = "true";
  }
}

$("#drafter").addEventListener("change", pickDrafter);
$("#form").addEventListener("submit", run);
loadConfig().catch((error) => showError(`cannot read /viz/config: ${error.message}`));
