// The chat view: a conversation kept in localStorage, streamed from
// /v1/chat/completions (SSE), with a Stop button (AbortController: the server aborts
// the request when the connection closes and frees its KV blocks), and per reply its
// time to first token and decode speed.

import { apiFetch, errorMessage } from "./api.js";
import { renderMarkdownSafe } from "./markdown.js";
import { sseEvents } from "./sse.js";

const MESSAGES_KEY = "roseinfer.chat.messages";
const SETTINGS_KEY = "roseinfer.chat.settings";
const SETTING_IDS = ["system", "temperature", "top-p", "max-tokens", "seed", "schema"];

export class ChatView {
  constructor(root) {
    this.el = (id) => root.querySelector(`#${id}`);
    this.messagesEl = this.el("messages");
    this.promptEl = this.el("prompt");
    const saved = load(MESSAGES_KEY, []);
    this.messages = Array.isArray(saved) ? saved : [];
    this.controller = null;
    this.model = null;
    this.renderPending = false;
    this.restoreSettings();
    this.bind();
    this.renderAll();
  }

  setModel(name) {
    this.model = name;
  }

  bind() {
    this.el("chat-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    this.el("settings").addEventListener("submit", (e) => e.preventDefault());
    this.promptEl.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.ctrlKey && !e.altKey && !e.metaKey &&
          !e.isComposing) {
        e.preventDefault();
        this.send();
      } else if (e.key === "Escape" && this.controller) {
        e.preventDefault();
        this.stop();
      }
    });
    this.el("stop").addEventListener("click", () => this.stop());
    this.el("new-chat").addEventListener("click", () => this.newChat());
    for (const id of SETTING_IDS) {
      this.el(id).addEventListener("input", () => this.saveSettings());
    }
    this.el("schema").addEventListener("input", () => this.schemaFormat(true));
  }

  // ------------------------------------------------------------- settings
  restoreSettings() {
    const saved = load(SETTINGS_KEY, {});
    for (const id of SETTING_IDS) {
      if (typeof saved[id] === "string") this.el(id).value = saved[id];
    }
  }

  saveSettings() {
    const values = {};
    for (const id of SETTING_IDS) values[id] = this.el(id).value;
    store(SETTINGS_KEY, values);
  }

  // The response_format for the schema field, or undefined; throws on bad JSON.
  schemaFormat(quiet = false) {
    const text = this.el("schema").value.trim();
    const errorEl = this.el("schema-error");
    errorEl.textContent = "";
    if (!text) return undefined;
    try {
      const schema = JSON.parse(text);
      if (typeof schema !== "object" || schema === null || Array.isArray(schema)) {
        throw new Error("the schema must be a JSON object");
      }
      return { type: "json_schema", json_schema: { name: "ui_schema", schema } };
    } catch (err) {
      errorEl.textContent = `JSON schema: ${err.message}`;
      if (quiet) return undefined;
      throw err;
    }
  }

  requestBody() {
    const history = [];
    const system = this.el("system").value.trim();
    if (system) history.push({ role: "system", content: system });
    for (const m of this.messages) {
      if (m.role === "assistant" && !m.content) continue; // failed or stopped before a token
      history.push({ role: m.role, content: m.content });
    }
    const body = { messages: history, stream: true, stream_options: { include_usage: true } };
    if (this.model) body.model = this.model;
    const number = (id, key, parse) => {
      const raw = this.el(id).value.trim();
      if (raw !== "") body[key] = parse(raw);
    };
    number("temperature", "temperature", Number);
    number("top-p", "top_p", Number);
    number("max-tokens", "max_tokens", (v) => parseInt(v, 10));
    number("seed", "seed", (v) => parseInt(v, 10));
    const format = this.schemaFormat();
    if (format) body.response_format = format;
    return body;
  }

  // ----------------------------------------------------------------- send
  async send() {
    const text = this.promptEl.value.trim();
    if (this.controller || !text) return;
    let body;
    this.messages.push({ role: "user", content: text });
    try {
      body = this.requestBody();
    } catch {
      this.messages.pop();
      this.el("schema").focus();
      return;
    }
    this.promptEl.value = "";
    this.appendMessage(this.messages[this.messages.length - 1]);
    const reply = { role: "assistant", content: "", meta: null };
    this.messages.push(reply);
    const node = this.appendMessage(reply);
    node.classList.add("streaming");
    this.save();

    const controller = new AbortController();
    this.controller = controller;
    this.setBusy(true);
    const t0 = performance.now();
    const run = { first: null, last: null, chunks: 0, usage: null, finish: null };
    let outcome = "done";
    let error = null;
    try {
      const response = await apiFetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) throw new Error(await errorMessage(response));
      for await (const event of sseEvents(response)) {
        if (event.error) throw new Error(event.error.message || "the request failed");
        if (event.usage) run.usage = event.usage;
        const choice = event.choices && event.choices[0];
        if (!choice) continue;
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          const now = performance.now();
          if (run.first === null) run.first = now;
          run.last = now;
          run.chunks += 1;
          reply.content += delta;
          this.scheduleRender(node, reply);
        }
        if (choice.finish_reason) run.finish = choice.finish_reason;
      }
    } catch (err) {
      if (err.name === "AbortError") outcome = "stopped";
      else {
        outcome = "error";
        error = err.message || String(err);
      }
    } finally {
      this.controller = null;
      reply.meta = replyMeta(run, t0, outcome, error);
      node.classList.remove("streaming");
      this.renderMessage(node, reply);
      this.save();
      this.setBusy(false);
    }
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  newChat() {
    this.stop();
    this.messages = [];
    this.save();
    this.renderAll();
    this.promptEl.focus();
  }

  setBusy(busy) {
    this.el("send").disabled = busy;
    this.el("stop").disabled = !busy;
    this.el("chat-status").textContent = busy ? "generating…" : "";
    this.messagesEl.setAttribute("aria-busy", busy ? "true" : "false");
  }

  save() {
    store(MESSAGES_KEY, this.messages);
  }

  // --------------------------------------------------------------- render
  renderAll() {
    this.messagesEl.replaceChildren();
    for (const m of this.messages) this.appendMessage(m);
  }

  appendMessage(message) {
    const node = document.createElement("div");
    node.className = `msg ${message.role === "user" ? "user" : "assistant"}`;
    const role = document.createElement("span");
    role.className = "role";
    role.textContent = message.role === "user" ? "You" : "Assistant";
    const body = document.createElement("div");
    body.className = "body";
    const meta = document.createElement("span");
    meta.className = "meta";
    node.append(role, body, meta);
    this.renderMessage(node, message);
    const stick = nearBottom();
    this.messagesEl.append(node);
    this.el("empty-hint").hidden = this.messages.length > 0;
    if (stick) node.scrollIntoView({ block: "end" });
    return node;
  }

  renderMessage(node, message) {
    const body = node.querySelector(".body");
    if (message.role === "user") body.textContent = message.content;
    else body.innerHTML = renderMarkdownSafe(message.content); // escaped; never throws
    const meta = node.querySelector(".meta");
    const info = message.meta;
    meta.textContent = info ? info.text : "";
    meta.classList.toggle("error", Boolean(info && info.error));
  }

  scheduleRender(node, message) {
    if (this.renderPending) return;
    this.renderPending = true;
    requestAnimationFrame(() => {
      this.renderPending = false;
      const stick = nearBottom();
      this.renderMessage(node, message);
      if (stick) node.scrollIntoView({ block: "end" });
    });
  }
}

// "stop · 42 tokens · TTFT 0.21 s · 38.5 tok/s": decode speed after the first token.
function replyMeta(run, t0, outcome, error) {
  const parts = [];
  if (outcome === "stopped") parts.push("stopped");
  else if (outcome === "error") parts.push(`error: ${error}`);
  else if (run.finish) parts.push(run.finish);
  const exact = run.usage && outcome === "done";
  const tokens = exact ? run.usage.completion_tokens : run.chunks;
  if (tokens) parts.push(`${exact ? "" : "≈"}${tokens} tokens`);
  let ttft = null;
  let rate = null;
  if (run.first !== null) {
    ttft = (run.first - t0) / 1000;
    parts.push(`TTFT ${ttft.toFixed(2)} s`);
    const span = (run.last - run.first) / 1000;
    if (tokens > 1 && span > 0) {
      rate = (tokens - 1) / span;
      parts.push(`${rate.toFixed(1)} tok/s`);
    }
  }
  return { text: parts.join(" · "), error: outcome === "error", ttft, rate, tokens, outcome };
}

function nearBottom() {
  const doc = document.documentElement;
  return doc.scrollHeight - (window.scrollY + window.innerHeight) < 120;
}

function load(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw ? JSON.parse(raw) : fallback;
  } catch {
    return fallback;
  }
}

function store(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch {
    /* storage full or disabled: the conversation lasts until the page is closed */
  }
}
