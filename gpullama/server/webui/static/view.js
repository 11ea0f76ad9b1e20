// Drawing messages: one <article> per message from the template in index.html, its Markdown, reasoning block,
// error, timings and action buttons. The buttons carry data-action; app.js handles them by delegation.

import { addCopyButtons, renderMarkdown } from "./markdown.js";

const template = document.getElementById("message-template");

function button(action, label, ariaLabel) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "link-button";
  b.dataset.action = action;
  b.textContent = label;
  if (ariaLabel) b.setAttribute("aria-label", ariaLabel);
  return b;
}

/** "12 tokens · 25.3 tokens/s · first token 0.21 s" */
export function timingsText(timings) {
  if (!timings) return "";
  const parts = [`${timings.tokens} token${timings.tokens === 1 ? "" : "s"}`];
  if (timings.tokensPerSecond) parts.push(`${timings.tokensPerSecond.toFixed(1)} tokens/s`);
  if (timings.ttftMs !== null && timings.ttftMs !== undefined) {
    parts.push(`first token ${(timings.ttftMs / 1000).toFixed(2)} s`);
  }
  return parts.join(" · ");
}

function finishNote(message) {
  if (message.finish === "stopped") return "Stopped.";
  if (message.finish === "context") return "The context is full: start a new chat, or edit an earlier message.";
  if (message.finish === "length") return "Cut at the token limit.";
  return "";
}

/** A new element for `message`. */
export function createMessage(message) {
  const element = template.content.firstElementChild.cloneNode(true);
  element.dataset.id = message.id;
  element.classList.add(message.role);
  element.querySelector(".message-role").textContent = message.role === "user" ? "You" : "Model";
  return element;
}

/**
 * Draw `message` into `element`. `streaming`: text is still arriving (no actions; aria-busy); `last`: the
 * conversation's last message (Continue is offered there).
 */
export function drawMessage(element, message, { streaming = false, last = false } = {}) {
  element.setAttribute("aria-busy", String(streaming));
  element.classList.toggle("streaming", streaming);
  const body = element.querySelector(".message-body");
  if (message.role === "user") {
    body.replaceChildren();
    for (const url of message.images || []) {
      const img = document.createElement("img");
      img.src = url;
      img.alt = "attached image";
      img.className = "attached";
      body.append(img);
    }
    const text = document.createElement("p");
    text.className = "user-text";
    text.textContent = message.content;
    body.append(text);
  } else {
    body.innerHTML = message.content ? renderMarkdown(message.content) : streaming && !message.reasoning
      ? '<p class="waiting">…</p>' : "";
    addCopyButtons(body);
  }
  const reasoning = element.querySelector(".reasoning");
  reasoning.hidden = !message.reasoning;
  if (message.reasoning) {
    reasoning.querySelector("summary").textContent = streaming && !message.content ? "Reasoning…" : "Reasoning";
    reasoning.querySelector(".reasoning-body").innerHTML = renderMarkdown(message.reasoning);
  }
  const error = element.querySelector(".message-error");
  error.hidden = !message.error;
  error.textContent = message.error || "";
  const note = finishNote(message);
  element.querySelector(".timings").textContent = [timingsText(message.timings), note].filter(Boolean).join(" · ");

  const actions = element.querySelector(".message-actions");
  actions.replaceChildren();
  if (streaming) return;
  if (message.role === "user") {
    actions.append(button("edit", "Edit", "Edit this message and send it again"),
      button("copy-message", "Copy", "Copy this message"));
  } else {
    actions.append(button("copy-message", "Copy", "Copy this answer"),
      button("regenerate", "Regenerate", "Generate this answer again"));
    if (last && message.finish === "length") actions.append(button("continue", "Continue", "Continue this answer"));
  }
}

/** Turn a user message's element into an editor; `onDone(text | null)` gets the new text, or null on cancel. */
export function editMessage(element, message, onDone) {
  const body = element.querySelector(".message-body");
  const area = document.createElement("textarea");
  area.className = "edit-area";
  area.value = message.content;
  area.setAttribute("aria-label", "Edit the message");
  const save = button("edit-save", "Save and send");
  const cancel = button("edit-cancel", "Cancel");
  save.classList.add("button", "primary");
  cancel.classList.add("button");
  const row = document.createElement("div");
  row.className = "edit-buttons";
  row.append(cancel, save);
  body.replaceChildren(area, row);
  element.querySelector(".message-actions").replaceChildren();
  save.addEventListener("click", () => onDone(area.value));
  cancel.addEventListener("click", () => onDone(null));
  area.addEventListener("keydown", (event) => {
    if (event.key === "Escape") onDone(null);
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) onDone(area.value);
  });
  area.focus();
}
