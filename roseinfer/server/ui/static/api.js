// API access: the stored key, authorised fetch, and the "key needed" signal.
// The key lives in localStorage and goes out as "Authorization: Bearer <key>".
// A 401 from any call fires the "roseinfer:auth-required" event on document.

const KEY_STORAGE = "roseinfer.apiKey";

export function getKey() {
  try {
    return localStorage.getItem(KEY_STORAGE) || "";
  } catch {
    return "";
  }
}

export function setKey(key) {
  try {
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  } catch {
    /* storage disabled: the key lasts until the page is closed */
  }
  document.dispatchEvent(new CustomEvent("roseinfer:auth-changed"));
}

export function authHeaders(extra = {}) {
  const headers = { ...extra };
  const key = getKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

// fetch() with the key; a 401 also tells the page to ask for a key.
export async function apiFetch(path, options = {}) {
  const response = await fetch(path, { ...options, headers: authHeaders(options.headers) });
  if (response.status === 401) {
    document.dispatchEvent(new CustomEvent("roseinfer:auth-required"));
  }
  return response;
}

// The message of an OpenAI-shaped error body, or the status line.
export async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch {
    /* not JSON */
  }
  return `HTTP ${response.status} ${response.statusText}`.trim();
}
