// A small, safe Markdown renderer for the assistant's replies.
//
// Safety: every piece of source text is HTML-escaped BEFORE any markup is added, and
// the only markup added is a fixed set of tags without attributes (except a
// sanitised language class on code blocks). No link, image or raw HTML is ever
// produced, so model output cannot inject HTML or script.
//
// Supported: fenced code blocks (``` or ~~~, optional language; an unclosed fence
// runs to the end, as while streaming), inline `code`, **bold** / __bold__,
// *italic* / _italic_, ~~strike~~, # headings, - / * / + and 1. lists, > quotes,
// --- rules, paragraphs (single newlines become <br>).
//
// Bounded: > quotes nest at most MAX_DEPTH deep (the only recursion; lists are flat);
// what is quoted deeper is shown as plain text, so ~3,000 nested > cannot overflow the
// stack. renderMarkdownSafe never throws: on any error it returns the escaped text.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const LIST_ITEM = /^( {0,6})([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
export const MAX_DEPTH = 32; // nested > quotes rendered as quotes

export function renderMarkdownSafe(source) {
  try {
    return renderMarkdown(source);
  } catch {
    return plainText(source);
  }
}

// Escaped text, newlines as <br>, in one paragraph.
export function plainText(source) {
  return `<p>${escapeHtml(source).replace(/\r\n?|\n/g, "<br>")}</p>`;
}

export function renderMarkdown(source, depth = 0) {
  const lines = String(source).replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let paragraph = [];
  let list = null; // {tag: "ul" | "ol", items: [string]}
  let quote = [];

  const flushParagraph = () => {
    if (paragraph.length) out.push(`<p>${paragraph.map(inline).join("<br>")}</p>`);
    paragraph = [];
  };
  const flushList = () => {
    if (list) {
      const items = list.items.map((item) => `<li>${item}</li>`).join("");
      out.push(`<${list.tag}>${items}</${list.tag}>`);
    }
    list = null;
  };
  const flushQuote = () => {
    if (quote.length) {
      const text = quote.join("\n");
      const inner = depth + 1 < MAX_DEPTH ? renderMarkdown(text, depth + 1) : plainText(text);
      out.push(`<blockquote>${inner}</blockquote>`);
    }
    quote = [];
  };
  const flushAll = () => {
    flushParagraph();
    flushList();
    flushQuote();
  };

  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      flushAll();
      const marker = fence[1];
      const code = [];
      i++;
      while (i < lines.length && !isClosingFence(lines[i], marker)) code.push(lines[i++]);
      const lang = fence[2].replace(/[^\w+#.-]/g, "").slice(0, 32);
      const cls = lang ? ` class="language-${escapeHtml(lang)}"` : "";
      out.push(`<pre><code${cls}>${escapeHtml(code.join("\n"))}</code></pre>`);
      continue;
    }
    const quoted = QUOTE.exec(line);
    if (quoted) {
      flushParagraph();
      flushList();
      quote.push(quoted[1]);
      continue;
    }
    flushQuote();
    if (!line.trim()) {
      flushParagraph();
      flushList();
      continue;
    }
    if (RULE.test(line)) {
      flushAll();
      out.push("<hr>");
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      flushAll();
      const level = Math.min(6, heading[1].length + 2); // inside a page section: h3..h6
      out.push(`<h${level}>${inline(heading[2])}</h${level}>`);
      continue;
    }
    const item = LIST_ITEM.exec(line);
    if (item) {
      flushParagraph();
      const tag = /^\d/.test(item[2]) ? "ol" : "ul";
      if (list && list.tag !== tag) flushList();
      if (!list) list = { tag, items: [] };
      list.items.push(inline(item[3]));
      continue;
    }
    if (list && /^\s+\S/.test(line)) {
      // an indented line continues the last item
      list.items[list.items.length - 1] += `<br>${inline(line.trim())}`;
      continue;
    }
    flushList();
    paragraph.push(line);
  }
  flushAll();
  return out.join("\n");
}

function isClosingFence(line, marker) {
  const trimmed = line.trim();
  return trimmed.length >= marker.length && trimmed[0] === marker[0] &&
    /^(`+|~+)$/.test(trimmed);
}

// Inline markup of one line: code spans first (their text is only escaped), then
// emphasis on the escaped rest.
export function inline(text) {
  return String(text)
    .split(/(`[^`]+`)/)
    .map((part, i) => (i % 2 ? `<code>${escapeHtml(part.slice(1, -1))}</code>` : emphasis(part)))
    .join("");
}

function emphasis(text) {
  return escapeHtml(text)
    .replace(/\*\*(?=\S)([^*]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([^_]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^*\w])\*(?=\S)([^*]*?\S)\*(?![*\w])/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=\S)([^_]*?\S)_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([^~]*?\S)~~/g, "<del>$1</del>");
}
