// Boots the page: the two views (#chat, #dashboard) switched by the URL hash, the
// served model's name, and the API-key panel (shown when a call answers 401, or from
// the header's "API key" button).

import { apiFetch, getKey, setKey } from "./api.js";
import { ChatView } from "./chat.js";
import { DashboardView } from "./dashboard.js";

const VIEWS = ["chat", "dashboard"];

function main() {
  const chat = new ChatView(document);
  const dashboard = new DashboardView(document);
  const keys = new KeyPanel(document);

  const showView = () => {
    const name = VIEWS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "chat";
    for (const view of VIEWS) {
      document.getElementById(`view-${view}`).hidden = view !== name;
      const link = document.getElementById(`nav-${view}`);
      if (view === name) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    document.title = name === "chat" ? "roseinfer · chat" : "roseinfer · dashboard";
    dashboard.setActive(name === "dashboard");
  };
  window.addEventListener("hashchange", showView);
  showView();

  const loadModel = async () => {
    try {
      const response = await apiFetch("/v1/models");
      if (!response.ok) return;
      const body = await response.json();
      const name = body.data && body.data[0] && body.data[0].id;
      if (name) {
        chat.setModel(name);
        document.getElementById("model-name").textContent = name;
      }
    } catch {
      /* the dashboard reports an unreachable server */
    }
  };
  document.addEventListener("roseinfer:auth-required", () => keys.open(true));
  document.addEventListener("roseinfer:auth-changed", loadModel);
  loadModel();
}

class KeyPanel {
  constructor(root) {
    this.panel = root.getElementById("key-panel");
    this.input = root.getElementById("key-input");
    this.why = root.getElementById("key-why");
    this.error = root.getElementById("key-error");
    this.askedBecause = this.why.textContent;
    root.getElementById("key-button").addEventListener("click", () => this.open(false));
    root.getElementById("key-close").addEventListener("click", () => this.close());
    root.getElementById("key-forget").addEventListener("click", () => {
      setKey("");
      this.input.value = "";
      this.error.textContent = "The key was removed from this browser.";
    });
    root.getElementById("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const key = this.input.value.trim();
      if (!key) {
        this.error.textContent = "Enter the key, or close this panel.";
        return;
      }
      this.close();
      setKey(key);
    });
    this.panel.addEventListener("keydown", (e) => {
      if (e.key === "Escape") this.close();
    });
  }

  open(required) {
    const wasOpen = !this.panel.hidden;
    this.why.textContent = required
      ? (getKey() ? "The server refused the saved API key. " : "") + this.askedBecause.trim()
      : "The key this browser sends (kept in localStorage, sent as Authorization: Bearer).";
    this.error.textContent = "";
    this.panel.hidden = false;
    if (!wasOpen) {
      this.input.value = getKey();
      this.input.focus();
    }
  }

  close() {
    this.panel.hidden = true;
  }
}

main();
