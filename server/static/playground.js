// Canvas playground: a chat over /v1/chat/completions that draws each canvas as it denoises.
// Plain JavaScript, no dependencies. With streaming on it asks for `stream_drafts`: every
// unfinished step's argmax canvas arrives as `draft_tokens` (one string per position) and is
// drawn as a grid of cells; committed text arrives in `delta.content`, a canvas at a time.
// In hybrid mode each verify pass also sends `verified`: the draft it checked and how many of
// its positions it accepted, drawn as accepted / rejected / discarded cells.
// Images (attached or pasted) go with the next message as `image_url` parts (data: URLs).
"use strict";

const $ = (id) => document.getElementById(id);

const ui = {
  apiKey: $("api-key"), system: $("system-prompt"), temperature: $("temperature"),
  maxTokens: $("max-tokens"), mode: $("mode"), stream: $("stream"),
  messages: $("messages"), composer: $("composer"), prompt: $("prompt"),
  send: $("send"), stop: $("stop"), clear: $("clear"), status: $("status"),
  model: $("model-name"), view: $("canvas-view"), grid: $("grid"),
  canvasIndex: $("canvas-index"), canvasStep: $("canvas-step"), canvases: $("canvases"),
  statSteps: $("stat-steps"), statTpf: $("stat-tpf"), statPasses: $("stat-passes"),
  statTokens: $("stat-tokens"), image: $("image"), attachments: $("attachments"),
  statCached: $("stat-cached"),
};

const chat = { history: [], model: null, controller: null, images: [] };

function setStatus(text, isError = false) {
  ui.status.textContent = text;
  ui.status.classList.toggle("error", isError);
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = ui.apiKey.value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// The error an OpenAI-style envelope carries, as one line.
async function errorText(response) {
  try {
    const body = await response.json();
    const e = body.error || {};
    return (e.message || response.statusText) + (e.param ? ` (${e.param})` : "");
  } catch (_) {
    return `${response.status} ${response.statusText}`;
  }
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) {
      chat.model = null;
      ui.model.textContent = "unknown (this server needs an API key)";
      setStatus("This server needs an API key: type it under Settings.", true);
      return null;
    }
    if (!r.ok) throw new Error(await errorText(r));
    chat.model = (await r.json()).data[0].id;
    ui.model.textContent = chat.model;
    setStatus("");
    return chat.model;
  } catch (err) {
    setStatus("Could not reach the server: " + err.message, true);
    return null;
  }
}

// ---- the canvas view -------------------------------------------------------------------

// A cell shows its token with whitespace made visible; the full text is in its title.
function shown(token) {
  if (token === "") return "∅";
  const text = token.replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "⇥");
  return text.length > 8 ? text.slice(0, 7) + "…" : text;
}

class CanvasView {
  constructor() { this.reset(); }

  reset() {
    this.index = 0;        // canvases started in this answer
    this.step = 0;         // drafts drawn for the current canvas
    this.previous = null;  // the current canvas' previous draft
    this.open = false;     // a canvas is being denoised
    this.drafts = 0;       // drafts drawn in this answer
    this.rows = [];        // per canvas: [drafts, drafts that changed a cell]
    this.verdicts = [];    // per verified canvas (hybrid): [positions accepted, drafted]
    ui.grid.replaceChildren();
    ui.grid.setAttribute("aria-label", "No canvas yet");
    ui.canvases.replaceChildren();
    ui.canvasIndex.textContent = "–";
    ui.canvasStep.textContent = "–";
    this.publish();
  }

  publish() {
    ui.view.dataset.drafts = String(this.drafts);
    ui.view.dataset.canvases = String(this.index);
    ui.view.dataset.changedDrafts = String(this.rows.reduce((n, r) => n + r[1], 0));
    ui.view.dataset.verified = String(this.verdicts.length);
    ui.view.dataset.accepted = String(this.verdicts.reduce((n, v) => n + v[0], 0));
  }

  cells(length) {
    while (ui.grid.children.length < length) {
      const cell = document.createElement("span");
      cell.className = "cell";
      ui.grid.appendChild(cell);
    }
    while (ui.grid.children.length > length) ui.grid.lastChild.remove();
    return ui.grid.children;
  }

  start() {
    if (this.open) return;
    this.open = true;
    this.index += 1;
    this.step = 0;
    this.previous = null;
    this.rows.push([0, 0]);
    ui.canvases.appendChild(document.createElement("li"));
  }

  draft(tokens) {
    this.start();
    this.step += 1;
    this.drafts += 1;
    const cells = this.cells(tokens.length);
    let changed = 0;
    tokens.forEach((token, i) => {
      const moved = this.previous === null || this.previous[i] !== token;
      if (moved) changed += 1;
      cells[i].className = "cell " + (moved ? "changed" : "settled");
      cells[i].textContent = shown(token);
      cells[i].title = JSON.stringify(token);
    });
    const row = this.rows[this.rows.length - 1];
    row[0] += 1;
    if (this.previous !== null && changed > 0) row[1] += 1;
    this.previous = tokens;
    ui.canvasIndex.textContent = String(this.index);
    ui.canvasStep.textContent = String(this.step);
    ui.grid.setAttribute("aria-label",
      `Canvas ${this.index}, draft ${this.step}: ${changed} of ${tokens.length} positions changed`);
    this.describe();
    this.publish();
  }

  // Hybrid: a verify pass checked this draft (the positions after its pinned first token) and
  // kept the first `accepted`; the next one was replaced by the verifier's token, the rest
  // were dropped. Its committed text follows in the same chunk.
  verify(tokens, accepted) {
    this.start();
    this.open = false;
    const cells = this.cells(tokens.length);
    tokens.forEach((token, i) => {
      const verdict = i < accepted ? "accepted" : i === accepted ? "rejected" : "discarded";
      cells[i].className = "cell " + verdict;
      cells[i].textContent = shown(token);
      cells[i].title = `${JSON.stringify(token)} (${verdict})`;
    });
    this.verdicts.push([accepted, tokens.length]);
    const said = `${accepted} of ${tokens.length} drafted positions accepted`;
    ui.grid.setAttribute("aria-label", `Canvas ${this.index} verified: ${said}`);
    this.describe(`; verified: ${said}`);
    this.publish();
  }

  // The canvas was committed: its text is final.
  commit() {
    if (!this.open) return;
    this.open = false;
    for (const cell of ui.grid.children) cell.className = "cell committed";
    ui.grid.setAttribute("aria-label", `Canvas ${this.index} committed`);
    this.describe(" (committed)");
  }

  describe(suffix = "") {
    const [drafts, changed] = this.rows[this.rows.length - 1];
    ui.canvases.lastChild.textContent =
      `canvas ${this.index}: ${drafts} drafts seen, ${changed} changed a cell${suffix}`;
  }
}

const view = new CanvasView();

function showStats(stats, usage) {
  if (stats) {
    ui.statSteps.textContent = stats.steps_per_canvas.length
      ? stats.steps_per_canvas.join(", ") : "– (AR mode)";
    ui.statTpf.textContent = stats.tokens_per_forward.toFixed(2);
    ui.statPasses.textContent = String(stats.decoder_passes);
  }
  if (usage) {
    ui.statTokens.textContent = `${usage.prompt_tokens} / ${usage.completion_tokens}`;
    const details = usage.prompt_tokens_details;
    ui.statCached.textContent = String(details ? details.cached_tokens : 0);
  }
}

function clearStats() {
  const stats = [ui.statSteps, ui.statTpf, ui.statPasses, ui.statTokens, ui.statCached];
  for (const el of stats) el.textContent = "–";
}

// ---- the conversation ------------------------------------------------------------------

function thumbnail(url, alt) {
  const img = document.createElement("img");
  img.className = "thumb";
  img.src = url;
  img.alt = alt;
  return img;
}

function addMessage(role, text, images = []) {
  const item = document.createElement("li");
  item.className = "message " + role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role === "user" ? "You" : role === "assistant" ? "Model" : "Error";
  const body = document.createElement("span");
  body.className = "body";
  body.textContent = text;
  item.append(label, ...images.map((url, i) => thumbnail(url, `image ${i + 1}`)), body);
  ui.messages.appendChild(item);
  ui.messages.scrollTop = ui.messages.scrollHeight;
  return body;
}

// Committed text, one span per canvas (shaded in turn) so the canvases show in the answer.
function appendChunk(body, text, index) {
  const span = document.createElement("span");
  span.className = "chunk " + (index % 2 ? "odd" : "even");
  span.textContent = text;
  body.appendChild(span);
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function numberOrNull(input, name, integer) {
  const raw = input.value.trim();
  if (raw === "") return null;
  const value = Number(raw);
  if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
    throw new Error(`${name} must be ${integer ? "a whole number" : "a number"}`);
  }
  return value;
}

function requestBody(messages) {
  const body = { model: chat.model, messages, stream: ui.stream.checked };
  const temperature = numberOrNull(ui.temperature, "Temperature", false);
  const maxTokens = numberOrNull(ui.maxTokens, "Max tokens", true);
  if (temperature !== null) body.temperature = temperature;
  if (maxTokens !== null) body.max_tokens = maxTokens;
  if (ui.mode.value) body.mode = ui.mode.value;
  if (body.stream) {
    body.stream_drafts = true;
    body.stream_options = { include_usage: true };
  }
  return body;
}

// The `data:` payloads of an SSE response, as they arrive.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of frame.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function readStream(response, body) {
  let text = "";
  let stats = null;
  let usage = null;
  for await (const data of events(response)) {
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const verified = choice.verified;  // before the text: its canvas is closed by the verdict
      if (verified) view.verify(verified.draft_tokens, verified.accepted);
      const content = choice.delta && choice.delta.content;
      if (content) {  // a committed canvas (its text first: a newer draft is the next canvas)
        view.commit();
        appendChunk(body, content, view.index);
        text += content;
      }
      if (choice.draft_tokens) view.draft(choice.draft_tokens);
      if (choice.finish_reason) {
        view.commit();
        stats = choice.canvas_stats;
      }
    }
  }
  return { text, stats, usage };
}

async function readWhole(response, body) {
  const result = await response.json();
  const choice = result.choices[0];
  body.textContent = choice.message.content;
  return { text: choice.message.content, stats: choice.canvas_stats, usage: result.usage };
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
  ui.view.setAttribute("aria-busy", String(busy));
}

// ---- images to send with the next message -----------------------------------------------

function showAttachments() {
  ui.attachments.replaceChildren(...chat.images.map((url, i) => {
    const item = document.createElement("li");
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "Remove";
    remove.setAttribute("aria-label", `Remove image ${i + 1}`);
    remove.addEventListener("click", () => {
      chat.images.splice(i, 1);
      showAttachments();
    });
    item.append(thumbnail(url, `image ${i + 1} to send`), remove);
    return item;
  }));
}

function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.addEventListener("load", () => {
      chat.images.push(reader.result);
      showAttachments();
    });
    reader.readAsDataURL(file);
  }
}

// The user turn: its text, or its parts (the images, then the text) when it has images.
function userTurn(text, images) {
  if (!images.length) return { role: "user", content: text };
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  if (text) parts.push({ type: "text", text });
  return { role: "user", content: parts };
}

async function send() {
  const text = ui.prompt.value.trim();
  const images = chat.images.slice();
  if ((!text && !images.length) || chat.controller) return;
  if (!chat.model && !(await loadModel())) return;
  const system = ui.system.value.trim();
  const turn = userTurn(text, images);
  const messages = [...(system ? [{ role: "system", content: system }] : []),
    ...chat.history, turn];
  let body;
  try {
    body = requestBody(messages);
  } catch (err) {
    setStatus(err.message, true);
    return;
  }
  ui.prompt.value = "";
  chat.images = [];
  showAttachments();
  addMessage("user", text, images);
  const answer = addMessage("assistant", "");
  view.reset();
  clearStats();
  chat.controller = new AbortController();
  setBusy(true);
  setStatus(body.stream ? "Denoising…" : "Waiting for the answer…");
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body),
      signal: chat.controller.signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    const result = body.stream ? await readStream(r, answer) : await readWhole(r, answer);
    chat.history.push(turn, { role: "assistant", content: result.text });
    showStats(result.stats, result.usage);
    const n = result.stats ? result.stats.steps_per_canvas.length : 0;
    setStatus(`Answer finished: ${n} canvas${n === 1 ? "" : "es"}.`);
  } catch (err) {
    answer.parentElement.remove();
    const aborted = err.name === "AbortError";
    addMessage("error", aborted ? "Stopped." : err.message);
    setStatus(aborted ? "Stopped." : "Error: " + err.message, !aborted);
    ui.prompt.value = ui.prompt.value || text;
    if (!chat.images.length) {  // to send again
      chat.images = images;
      showAttachments();
    }
  } finally {
    chat.controller = null;
    setBusy(false);
  }
}

function stop() {
  if (chat.controller) chat.controller.abort();
}

function clearChat() {
  stop();
  chat.history = [];
  chat.images = [];
  showAttachments();
  ui.messages.replaceChildren();
  view.reset();
  clearStats();
  setStatus("Chat cleared.");
  ui.prompt.focus();
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape") stop();
});
ui.image.addEventListener("change", () => {
  attach(ui.image.files);
  ui.image.value = "";
});
ui.prompt.addEventListener("paste", (event) => {
  const files = [...(event.clipboardData ? event.clipboardData.files : [])];
  if (files.some((f) => f.type.startsWith("image/"))) {
    event.preventDefault();
    attach(files);
  }
});
ui.stop.addEventListener("click", stop);
ui.clear.addEventListener("click", clearChat);
ui.apiKey.addEventListener("change", loadModel);
loadModel();
