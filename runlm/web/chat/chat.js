// runlm's chat page: a model from /v1/models, a streamed multi-turn chat over /v1/chat/completions, a stop
// button, and time to first token and tokens/s under each answer. Images (attached, pasted or dropped) go with a
// question as image_url parts holding data: URLs, and show in the conversation. Same origin only; no outside
// requests.
import { render } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const store = window.localStorage;
const ui = {
  model: $("model"), temperature: $("temperature"), system: $("system"), apiKey: $("api-key"),
  messages: $("messages"), prompt: $("prompt"), send: $("send"), stop: $("stop"), status: $("status"),
  settings: $("settings"), settingsToggle: $("settings-toggle"), newChat: $("new-chat"), form: $("composer"),
  attach: $("attach"), imageFile: $("image-file"), attachments: $("attachments"),
};
let history = [];
let controller = null;
let images = [];  // the next question's images, as data: URLs
const MAX_IMAGE_BYTES = 20 * 1024 * 1024;  // the server's limit for one image

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attachFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) { ui.status.textContent = `${file.name || "That file"} is not an image.`; continue; }
    if (file.size > MAX_IMAGE_BYTES) { ui.status.textContent = `${file.name} is larger than 20 MiB.`; continue; }
    images.push(await readAsDataURL(file));
  }
  showAttachments();
}

function showAttachments() {
  ui.attachments.replaceChildren(...images.map((url, i) => {
    const figure = document.createElement("figure");
    const img = new Image();
    img.src = url;
    img.alt = `attached image ${i + 1}`;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.title = "Remove this image";
    remove.addEventListener("click", () => { images.splice(i, 1); showAttachments(); });
    figure.append(img, remove);
    return figure;
  }));
}

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

function addMessage(role, text, pictures = []) {
  const msg = document.createElement("div");
  msg.className = `msg ${role}`;
  if (pictures.length) {
    const row = document.createElement("div");
    row.className = "images";
    row.append(...pictures.map((url, i) => { const img = new Image(); img.src = url; img.alt = `image ${i + 1}`; return img; }));
    msg.append(row);
  }
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

async function ask(question, pictures) {
  const content = pictures.length
    ? [...pictures.map((url) => ({ type: "image_url", image_url: { url } })), ...(question ? [{ type: "text", text: question }] : [])]
    : question;
  history.push({ role: "user", content });
  addMessage("user", question, pictures);
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
  if ((!question && !images.length) || controller) return;
  if (!ui.model.value) { ui.status.textContent = "Pick a model first."; return; }
  ui.prompt.value = "";
  ui.status.textContent = "";
  const pictures = images;
  images = [];
  showAttachments();
  ask(question, pictures);
});
ui.attach.addEventListener("click", () => ui.imageFile.click());
ui.imageFile.addEventListener("change", async () => { await attachFiles([...ui.imageFile.files]); ui.imageFile.value = ""; });
ui.prompt.addEventListener("paste", (e) => {
  const files = [...(e.clipboardData?.files ?? [])].filter((f) => f.type.startsWith("image/"));
  if (files.length) { e.preventDefault(); attachFiles(files); }
});
ui.form.addEventListener("dragover", (e) => { e.preventDefault(); ui.form.classList.add("dropping"); });
ui.form.addEventListener("dragleave", () => ui.form.classList.remove("dropping"));
ui.form.addEventListener("drop", (e) => {
  e.preventDefault();
  ui.form.classList.remove("dropping");
  attachFiles([...(e.dataTransfer?.files ?? [])]);
});
ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); ui.form.requestSubmit(); }
});
ui.stop.addEventListener("click", () => controller?.abort());
ui.newChat.addEventListener("click", () => {
  controller?.abort(); history = []; images = []; showAttachments(); ui.messages.replaceChildren();
});
ui.settingsToggle.addEventListener("click", () => showSettings(ui.settings.hidden));
ui.model.addEventListener("change", () => store.setItem("runlm.model", ui.model.value));
for (const [el, key] of [[ui.system, "runlm.system"], [ui.temperature, "runlm.temperature"], [ui.apiKey, "runlm.key"]]) {
  const saved = store.getItem(key);
  if (saved !== null) el.value = saved;
  el.addEventListener("change", () => { store.setItem(key, el.value); if (el === ui.apiKey) loadModels(); });
}
loadModels();
