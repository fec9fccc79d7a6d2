// Server-sent events from a fetch() response body: yields the parsed JSON of each
// "data:" event and stops at "data: [DONE]". Works with an AbortController signal:
// aborting the fetch makes the read throw an AbortError.

export async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = eventEnd(buffer)) >= 0) {
        const raw = buffer.slice(0, end);
        buffer = buffer.slice(end).replace(/^(\r?\n){2}/, "");
        const data = eventData(raw);
        if (data === null) continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  } finally {
    reader.releaseLock();
  }
}

function eventEnd(buffer) {
  const lf = buffer.indexOf("\n\n");
  const crlf = buffer.indexOf("\r\n\r\n");
  if (lf < 0) return crlf;
  if (crlf < 0) return lf;
  return Math.min(lf, crlf);
}

function eventData(raw) {
  const lines = raw.split(/\r?\n/).filter((l) => l.startsWith("data:"));
  if (!lines.length) return null;
  return lines.map((l) => l.slice(5).replace(/^ /, "")).join("\n");
}
