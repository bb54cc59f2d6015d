// runlm's chat page: a model from /v1/models, a streamed multi-turn chat over /v1/chat/completions, a stop
// button, and time to first token and tokens/s under each answer. Same origin only; no outside requests.
import { render } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const store = window.localStorage;
const ui = {
  model: $("model"), temperature: $("temperature"), system: $("system"), apiKey: $("api-key"),
  messages: $("messages"), prompt: $("prompt"), send: $("send"), stop: $("stop"), status: $("status"),
  settings: $("settings"), settingsToggle: $("settings-toggle"), newChat: $("new-chat"), form: $("composer"),
};
let history = [];
let controller = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  if (ui.apiKey.value) h.Authorization = `Bearer ${ui.apiKey.value}`;
  return h;
}

function showSettings(open) {
  ui.settings.hidden = !open;
  ui.settingsToggle.setAttribute("aria-expanded", String(open));
}

async function errorMessage(resp) {
  try { const body = await resp.json(); return body.error?.message ?? JSON.stringify(body); }
  catch { return `${resp.status} ${resp.statusText}`; }
}

async function loadModels() {
  ui.status.textContent = "";
  const resp = await fetch("/v1/models", { headers: headers() });
  if (resp.status === 401) {
    showSettings(true);
    ui.status.textContent = "This server needs an API key: enter it under Settings.";
    return;
  }
  if (!resp.ok) { ui.status.textContent = `Could not list models: ${await errorMessage(resp)}`; return; }
  const { data } = await resp.json();
  ui.model.replaceChildren(...data.map((m) => new Option(m.id, m.id)));
  const saved = store.getItem("runlm.model");
  if (saved && data.some((m) => m.id === saved)) ui.model.value = saved;
  if (!data.length) ui.status.textContent = "No models yet: pull one with `runlm pull NAME`.";
}

function addMessage(role, text) {
  const msg = document.createElement("div");
  msg.className = `msg ${role}`;
  const body = document.createElement("div");
  body.className = "body";
  if (role === "user") body.textContent = text; else body.append(render(text));
  const stats = document.createElement("div");
  stats.className = "stats";
  msg.append(body, stats);
  ui.messages.append(msg);
  ui.messages.scrollTop = ui.messages.scrollHeight;
  return { msg, body, stats };
}

// Server-sent events from a fetch body: yields each "data:" payload (the stream's "[DONE]" ends it).
async function* sseData(resp) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
}

async function ask(question) {
  history.push({ role: "user", content: question });
  addMessage("user", question);
  const answer = addMessage("assistant", "");
  const messages = ui.system.value.trim() ? [{ role: "system", content: ui.system.value.trim() }, ...history] : history;
  const body = { model: ui.model.value, messages, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat(ui.temperature.value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  controller = new AbortController();
  setBusy(true);
  let text = "", thinking = "", tokens = 0, usage = null, first = null, pending = false, stopped = false;
  const start = performance.now();
  // a reasoning model's thinking, folded above the answer (open while it is all there is)
  const thought = document.createElement("details");
  thought.className = "thinking";
  thought.open = true;
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const thoughtBody = document.createElement("div");
  thought.append(summary, thoughtBody);
  const paint = () => {
    pending = false;
    if (thinking) {
      if (!thought.isConnected) answer.msg.insertBefore(thought, answer.body);
      thoughtBody.textContent = thinking;
      if (text && summary.textContent === "Thinking") { thought.open = false; summary.textContent = "Thought"; }
    }
    answer.body.replaceChildren(render(text));
    ui.messages.scrollTop = ui.messages.scrollHeight;
  };
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!resp.ok) throw new Error(await errorMessage(resp));
    for await (const chunk of sseData(resp)) {
      if (chunk.error) throw new Error(chunk.error.message ?? String(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      const d = chunk.choices?.[0]?.delta;
      const delta = d?.content, reasoning = d?.reasoning_content ?? d?.reasoning;
      if (!delta && !reasoning) continue;
      first ??= performance.now();
      tokens += 1;
      text += delta ?? "";
      thinking += reasoning ?? "";
      if (!pending) { pending = true; requestAnimationFrame(paint); }
    }
  } catch (err) {
    if (err.name === "AbortError") stopped = true;
    else { answer.msg.classList.add("error"); text += (text ? "\n\n" : "") + `Error: ${err.message}`; }
  } finally {
    controller = null;
    setBusy(false);
  }
  paint();
  history.push({ role: "assistant", content: text });
  const end = performance.now();
  const count = usage?.completion_tokens ?? tokens;
  const parts = [`${count} tokens`];
  if (first !== null) {
    parts.push(`TTFT ${((first - start) / 1000).toFixed(2)} s`);
    // tokens after the first over the time they took; an answer that arrived in one burst: over the whole wait
    const rate = end - first > 50 ? (count - 1) / (end - first) : count / (end - start);
    if (count > 1) parts.push(`${(rate * 1000).toFixed(1)} tok/s`);
  }
  if (stopped) parts.push("stopped");
  answer.stats.textContent = parts.join(" · ");
  answer.msg.dataset.done = stopped ? "stopped" : "complete";
}

ui.form.addEventListener("submit", (e) => {
  e.preventDefault();
  const question = ui.prompt.value.trim();
  if (!question || controller) return;
  if (!ui.model.value) { ui.status.textContent = "Pick a model first."; return; }
  ui.prompt.value = "";
  ask(question);
});
ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); ui.form.requestSubmit(); }
});
ui.stop.addEventListener("click", () => controller?.abort());
ui.newChat.addEventListener("click", () => { controller?.abort(); history = []; ui.messages.replaceChildren(); });
ui.settingsToggle.addEventListener("click", () => showSettings(ui.settings.hidden));
ui.model.addEventListener("change", () => store.setItem("runlm.model", ui.model.value));
for (const [el, key] of [[ui.system, "runlm.system"], [ui.temperature, "runlm.temperature"], [ui.apiKey, "runlm.key"]]) {
  const saved = store.getItem(key);
  if (saved !== null) el.value = saved;
  el.addEventListener("change", () => { store.setItem(key, el.value); if (el === ui.apiKey) loadModels(); });
}
loadModels();
