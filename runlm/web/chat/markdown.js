// Markdown to DOM nodes, built with createElement/textContent only: a model's answer is never parsed as HTML,
// so nothing it writes can run script (the page's CSP forbids inline script as a second line of defence).
import { highlight } from "./highlight.js";

const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*([^*]+)\*\*|__([^_]+)__|\*([^*\s][^*]*)\*|_([^_\s][^_]*)_|\[([^\]]+)\]\(([^)\s]+)\)/g;

function inline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    let node;
    if (m[2] !== undefined) { node = document.createElement("code"); node.textContent = m[2]; }
    else if (m[3] !== undefined || m[4] !== undefined) { node = document.createElement("strong"); inline(node, m[3] ?? m[4]); }
    else if (m[5] !== undefined || m[6] !== undefined) { node = document.createElement("em"); inline(node, m[5] ?? m[6]); }
    else if (/^https?:\/\//i.test(m[8])) {
      node = document.createElement("a"); node.href = m[8]; node.rel = "noopener noreferrer"; node.target = "_blank";
      inline(node, m[7]);
    } else { node = document.createTextNode(m[0]); }
    parent.append(node);
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function codeBlock(lang, lines) {
  const pre = document.createElement("pre");
  const code = document.createElement("code");
  if (lang) code.dataset.lang = lang;
  highlight(code, lines.join("\n"), lang);
  pre.append(code);
  return pre;
}

// One pass over the lines: fenced code (an unclosed fence, mid-stream, runs to the end), headings, lists,
// quotes and paragraphs.
export function render(text) {
  const out = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let para = [];
  let list = null;
  const flush = () => {
    if (para.length) { const p = document.createElement("p"); inline(p, para.join("\n")); out.append(p); para = []; }
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*(```|~~~)\s*([\w+#.-]*)/);
    if (fence) {
      flush(); list = null;
      const body = [];
      for (i++; i < lines.length && !lines[i].trimStart().startsWith(fence[1]); i++) body.push(lines[i]);
      out.append(codeBlock(fence[2], body));
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
    if (heading) {
      flush(); list = null;
      const h = document.createElement(`h${Math.min(6, heading[1].length + 2)}`);
      inline(h, heading[2]); out.append(h);
    } else if (item) {
      flush();
      const kind = /\d/.test(item[1]) ? "OL" : "UL";
      if (!list || list.tagName !== kind) { list = document.createElement(kind.toLowerCase()); out.append(list); }
      const li = document.createElement("li"); inline(li, item[2]); list.append(li);
    } else if (line.startsWith(">")) {
      flush(); list = null;
      const q = document.createElement("blockquote"); inline(q, line.replace(/^>\s?/, "")); out.append(q);
    } else if (!line.trim()) {
      flush(); list = null;
    } else {
      list = null; para.push(line);
    }
  }
  flush();
  return out;
}
