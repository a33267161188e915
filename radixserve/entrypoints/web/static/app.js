// radixserve's built-in page: a chat playground over /v1/chat/completions (streamed) and a live dashboard over
// /stats. Plain JavaScript, no dependencies, nothing loaded from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { history: [], controller: null, model: "default", points: [] };

function apiKey() { return localStorage.getItem("radixserve-api-key") || ""; }
function headers(extra) {
  const h = Object.assign({ "Content-Type": "application/json" }, extra || {});
  if (apiKey()) h.Authorization = "Bearer " + apiKey();
  return h;
}
function needKey(message) {
  $("auth").classList.remove("hidden");
  $("auth-msg").textContent = message || "This server needs an API key.";
}
async function api(path, init) {
  const resp = await fetch(path, Object.assign({ headers: headers() }, init || {}));
  if (resp.status === 401) needKey("The API key is missing or wrong.");
  return resp;
}
async function errorText(resp) {
  try { const j = await resp.json(); return (j.error && j.error.message) || JSON.stringify(j); }
  catch (e) { return resp.status + " " + resp.statusText; }
}

// ------------------------------------------------------------------------------------------ tabs and key
for (const b of document.querySelectorAll(".tab")) {
  b.addEventListener("click", () => {
    for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t === b);
    $("view-chat").classList.toggle("hidden", b.dataset.view !== "chat");
    $("view-dash").classList.toggle("hidden", b.dataset.view !== "dash");
    if (b.dataset.view === "dash") drawChart();
  });
}
$("api-key").value = apiKey();
$("save-key").addEventListener("click", () => {
  localStorage.setItem("radixserve-api-key", $("api-key").value.trim());
  $("auth-msg").textContent = "Saved.";
  loadModel();
});
if (window.matchMedia("(max-width: 700px)").matches) $("settings").open = false;

async function loadModel() {
  try {
    const resp = await api("/v1/models");
    if (!resp.ok) return;
    const j = await resp.json();
    if (j.data && j.data.length) { state.model = j.data[0].id; $("model-name").textContent = state.model; }
    $("auth").classList.toggle("hidden", !apiKey());
    if (apiKey()) $("auth-msg").textContent = "Key accepted.";
  } catch (e) { /* the dashboard shows the connection state */ }
}

// ------------------------------------------------------------------------------------------ chat
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.innerHTML = '<div class="role"></div><div class="thinking hidden"></div><div class="text"></div>' +
    '<div class="meta"></div>';
  div.querySelector(".role").textContent = role;
  div.querySelector(".text").textContent = text || "";
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function requestBody(messages) {
  const body = { model: state.model, messages: messages, stream: true, stream_options: { include_usage: true } };
  const num = (id) => { const v = $(id).value.trim(); return v === "" ? undefined : Number(v); };
  body.temperature = num("temperature");
  body.top_p = num("top-p");
  body.max_tokens = num("max-tokens");
  const schema = $("schema").value.trim();
  if (schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "output", schema: JSON.parse(schema) } };
  }
  return body;
}

async function send(text) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content: text });
  let body;
  try { body = requestBody(messages); }
  catch (e) { $("chat-status").textContent = "The JSON schema is not valid JSON: " + e.message; return; }
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  div.classList.add("streaming");
  const out = div.querySelector(".text"), think = div.querySelector(".thinking"), meta = div.querySelector(".meta");
  state.controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  $("chat-status").textContent = "Generating…";
  const started = performance.now();
  let firstAt = null, answer = "", usage = null, finish = null, stopped = false;
  try {
    const resp = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
                                                      signal: state.controller.signal });
    if (!resp.ok) throw new Error(await errorText(resp));
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          for (const c of chunk.choices || []) {
            const d = c.delta || {};
            if (d.reasoning_content) { think.classList.remove("hidden"); think.textContent += d.reasoning_content; }
            if (d.content) { if (firstAt === null) firstAt = performance.now(); answer += d.content;
                             out.textContent = answer; }
            if (c.finish_reason) finish = c.finish_reason;
          }
          $("messages").scrollTop = $("messages").scrollHeight;
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") { stopped = true; }
    else { div.classList.add("error"); out.textContent = answer + (answer ? "\n" : "") + "Error: " + e.message; }
  } finally {
    div.classList.remove("streaming");
    div.dataset.done = stopped ? "stopped" : (finish || "error");
    const secs = (performance.now() - started) / 1000;
    const parts = [];
    if (stopped) parts.push("stopped");
    else if (finish) parts.push("finish: " + finish);
    if (usage) parts.push(usage.completion_tokens + " tokens", (usage.completion_tokens / secs).toFixed(1) + " tok/s");
    if (firstAt !== null) parts.push("first token " + ((firstAt - started) / 1000).toFixed(2) + " s");
    meta.textContent = parts.join(" · ");
    if (answer) state.history.push({ role: "assistant", content: answer });
    state.controller = null;
    $("send").disabled = false; $("stop").disabled = true;
    $("chat-status").textContent = stopped ? "Stopped." : "";
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
$("clear").addEventListener("click", () => { state.history = []; $("messages").innerHTML = ""; });

// ------------------------------------------------------------------------------------------ dashboard
function fmt(v, digits, unit) { return v === null || v === undefined ? "–" : v.toFixed(digits) + (unit || ""); }

function drawChart() {
  const canvas = $("tput-chart");
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (!w) return;
  canvas.width = w * devicePixelRatio; canvas.height = h * devicePixelRatio;
  const ctx = canvas.getContext("2d");
  ctx.scale(devicePixelRatio, devicePixelRatio);
  ctx.clearRect(0, 0, w, h);
  const pts = state.points;
  const max = Math.max(1, ...pts.map((p) => p.tput));
  ctx.fillStyle = getComputedStyle(document.body).getPropertyValue("--muted");
  ctx.font = "12px system-ui";
  ctx.fillText("generation tok/s (max " + max.toFixed(0) + ")", 8, 14);
  if (pts.length < 2) return;
  ctx.strokeStyle = getComputedStyle(document.body).getPropertyValue("--accent");
  ctx.lineWidth = 2;
  ctx.beginPath();
  pts.forEach((p, i) => {
    const x = 8 + (w - 16) * i / (pts.length - 1), y = h - 8 - (h - 28) * p.tput / max;
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

async function poll() {
  try {
    const resp = await api("/stats");
    if (!resp.ok) { $("dash-status").textContent = "stats: " + await errorText(resp); return; }
    const s = await resp.json();
    $("s-running").textContent = s.num_running_reqs;
    $("s-queued").textContent = s.num_queued_reqs;
    $("s-kv").textContent = fmt(100 * s.kv_usage, 1, " %");
    $("s-kv-bar").style.width = (100 * s.kv_usage).toFixed(1) + "%";
    $("s-tput").textContent = fmt(s.gen_throughput, 1, " tok/s");
    $("s-hit").textContent = fmt(s.cache_hit_rate === null ? null : 100 * s.cache_hit_rate, 1, " %");
    $("s-ttft").textContent = fmt(s.ttft_ms_p50, 0, " ms");
    $("s-itl").textContent = fmt(s.itl_ms_p50, 1, " ms");
    $("s-done").textContent = s.num_finished_reqs;
    state.points.push({ t: Date.now(), tput: s.gen_throughput || 0 });
    if (state.points.length > 120) state.points.shift();
    $("dash-status").textContent = "updated " + new Date().toLocaleTimeString() + " · uptime " +
      Math.round(s.uptime_s) + " s · " + s.kv_used_tokens + " / " + s.kv_total_tokens + " KV tokens held";
    $("view-dash").dataset.updates = String(Number($("view-dash").dataset.updates || 0) + 1);
    if (!$("view-dash").classList.contains("hidden")) drawChart();
  } catch (e) {
    $("dash-status").textContent = "the server does not answer: " + e.message;
  }
}

loadModel();
poll();
setInterval(poll, 1000);
