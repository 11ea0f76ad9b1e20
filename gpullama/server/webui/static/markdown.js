// Markdown (GFM) to safe HTML: marked renders, highlight.js colours code blocks, DOMPurify sanitizes the result;
// images from other origins become links (the page loads nothing from elsewhere), links open in a new tab.

import { Marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.js";
import hljs from "./vendor/highlight.min.js";

const AUTO_HIGHLIGHT_CHARS = 4000; // longer code without a language is left plain (guessing costs time per render)

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function highlighted(code, lang) {
  try {
    if (lang && hljs.getLanguage(lang)) return hljs.highlight(code, { language: lang, ignoreIllegals: true }).value;
    if (code.length <= AUTO_HIGHLIGHT_CHARS) return hljs.highlightAuto(code).value;
  } catch {
    // fall through to plain text
  }
  return escapeHtml(code);
}

const marked = new Marked({
  gfm: true,
  renderer: {
    image({ href, text }) {
      if (sameOriginImage(href || "")) return false; // the default rendering
      return `<a href="${escapeHtml(href || "#")}">${escapeHtml(text || "image")}</a>`;
    },
    code({ text, lang }) {
      const language = (lang || "").trim().split(/\s+/)[0];
      const label = language ? `<span class="code-lang">${escapeHtml(language)}</span>` : "<span></span>";
      return `<div class="code-block"><div class="code-head">${label}</div>`
        + `<pre><code class="hljs">${highlighted(text.replace(/\n$/, ""), language)}</code></pre></div>`;
    },
  },
});

function sameOriginImage(src) {
  try {
    return src.startsWith("data:image/") || new URL(src, document.baseURI).origin === location.origin;
  } catch {
    return false;
  }
}

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
  if (node.tagName === "IMG" && !sameOriginImage(node.getAttribute("src") || "")) {
    node.removeAttribute("src"); // raw HTML in an answer: no request leaves the page (the CSP would block it too)
    node.removeAttribute("srcset");
  }
});

/** `text` as sanitized HTML. */
export function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text), { USE_PROFILES: { html: true } });
}

/** Add a copy button to each code block under `root` that has none. */
export function addCopyButtons(root) {
  for (const head of root.querySelectorAll(".code-head")) {
    if (head.querySelector("button")) continue;
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy-code";
    button.dataset.action = "copy-code";
    button.textContent = "Copy";
    button.setAttribute("aria-label", "Copy the code");
    head.append(button);
  }
}

/** Put `text` on the clipboard (the Clipboard API, else a selection and the copy command). */
export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    const area = document.createElement("textarea");
    area.value = text;
    area.className = "visually-hidden";
    document.body.append(area);
    area.select();
    const copied = document.execCommand("copy");
    area.remove();
    return copied;
  }
}
