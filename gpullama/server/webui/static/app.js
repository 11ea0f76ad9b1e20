// The chat page: the conversation list, the composer, and one generation at a time over the server's own
// OpenAI endpoint (api.js); conversations are kept in this browser (store.js).

import { fetchModels, fetchProps, ServerError, streamChat } from "./api.js";
import { copyText } from "./markdown.js";
import { apiKey, currentSettings, requestFields, setupSettings } from "./settings.js";
import {
  deleteConversation, exportObject, listConversations, newConversation, newId, parseImport, saveConversation,
} from "./store.js";
import { createMessage, drawMessage, editMessage } from "./view.js";

const $ = (id) => document.getElementById(id);
const narrow = window.matchMedia("(max-width: 640px)"); // phone width: Enter breaks the line, the list is a drawer
const TITLE_CHARS = 60;
const MODEL_KEY = "gpullama.model"; // the model chosen in the selector (a server of several models)

const state = {
  conversations: [], // every stored conversation, newest first
  current: null, // the open conversation
  props: null, // the server's GET /props (of the chosen model)
  models: [], // the server's GET /v1/models: the selector lists them when there are several
  model: localStorage.getItem(MODEL_KEY), // the chosen model's name (null: the server's default)
  generation: null, // {controller, message} while an answer streams
  attachments: [], // data: URLs of the images to send with the next message
  query: "",
};
const elements = new Map(); // message id -> its <article>

// ---- the server ----------------------------------------------------------------------------------------------

async function loadProps() {
  try {
    state.props = await fetchProps(apiKey(), state.model);
  } catch (error) {
    if (error instanceof ServerError && error.status === 404 && state.model) {
      chooseModel(null); // the chosen model is no longer served: the default one
      return;
    }
    if (error instanceof ServerError && error.status === 401) {
      $("model-name").textContent = "API key needed";
      $("model-meta").textContent = "";
      openSettings("This server needs an API key (its --api-key): enter it below.");
      return;
    }
    if (error instanceof ServerError && error.status === 500 && state.model) {
      $("model-meta").textContent = error.message; // the chosen model cannot load: say why, let another be chosen
      loadModels();
      return;
    }
    $("model-name").textContent = error.status === 503 ? "the model is loading…" : "server unreachable";
    $("model-meta").textContent = error.message;
    setTimeout(loadProps, 2000);
    return;
  }
  const props = state.props;
  const context = props.default_generation_settings?.n_ctx;
  const modalities = Object.entries(props.modalities || {}).filter(([, on]) => on).map(([name]) => name);
  $("model-name").textContent = props.model_alias || "model";
  $("model-meta").textContent = [context ? `context ${context.toLocaleString("en-US")} tokens` : "",
    ["text", ...modalities].join(", ")].filter(Boolean).join(" · ");
  $("model-info").title = `${props.model_path || ""} (${props.build_info || ""})`;
  $("attach").hidden = !props.modalities?.vision;
  loadModels();
}

/** The selector's line for a model: its name, the base model of an adapter, and its state (loaded, ...). */
function modelLabel(model) {
  const status = model.status ? (model.status.failed ? "failed" : model.status.value) : "";
  return `${model.id}${model.parent ? ` · adapter of ${model.parent}` : ""}${status ? ` (${status})` : ""}`;
}

/** Fetch the served models and draw the selector: hidden when the server serves one model. */
async function loadModels() {
  try {
    state.models = await fetchModels(apiKey());
  } catch {
    return; // the selector keeps what it showed; the next answer tries again
  }
  const select = $("model-select");
  select.hidden = state.models.length < 2;
  $("model-name").hidden = !select.hidden;
  if (select.hidden) return;
  const chosen = state.model || state.props?.model_alias;
  const same = select.options.length === state.models.length
    && state.models.every((model, i) => select.options[i].value === model.id);
  if (same) { // only the states changed: relabel in place (an open list stays open)
    state.models.forEach((model, i) => { select.options[i].textContent = modelLabel(model); });
    return;
  }
  select.replaceChildren(...state.models.map((model) => {
    const option = document.createElement("option");
    option.value = model.id;
    option.textContent = modelLabel(model);
    option.selected = model.id === chosen;
    return option;
  }));
}

/** Ask with `name` from now on (null: the server's default): its properties are fetched, which loads it. */
function chooseModel(name) {
  state.model = name;
  if (name) localStorage.setItem(MODEL_KEY, name);
  else localStorage.removeItem(MODEL_KEY);
  $("model-meta").textContent = name ? "loading…" : "";
  loadProps();
}

function contextSize() {
  return state.props?.default_generation_settings?.n_ctx ?? null;
}

/** The chat completion body for the open conversation up to (and, when continuing, with) `upTo`. */
function requestBody(conversation, upTo, continuing) {
  const settings = currentSettings();
  const messages = settings.system.trim() ? [{ role: "system", content: settings.system }] : [];
  const history = conversation.messages.slice(0, conversation.messages.indexOf(upTo) + (continuing ? 1 : 0));
  for (const m of history) {
    if (m.role === "assistant" && !m.content) continue; // an answer that failed before any text
    const content = m.images?.length
      ? [{ type: "text", text: m.content }, ...m.images.map((url) => ({ type: "image_url", image_url: { url } }))]
      : m.content;
    messages.push({ role: m.role, content });
  }
  const body = { messages, ...requestFields(settings) };
  const model = state.model || state.props?.model_alias;
  if (model) body.model = model;
  if (continuing) Object.assign(body, { continue_final_message: true, add_generation_prompt: false });
  return body;
}

/** What to show for a refused or failed request: the server's message, and what to do about it. */
function describeError(error) {
  const body = error.body?.error;
  if (body && Number.isFinite(body.n_ctx)) {
    return `The conversation does not fit the model's context (${body.n_prompt_tokens} tokens, the context holds `
      + `${body.n_ctx}): start a new chat, or edit an earlier message. The server said: ${error.message}`;
  }
  if (error.status === 401) return `${error.message} Set the API key in Settings.`;
  if (error instanceof ServerError) return error.status ? `The server refused the request (${error.status}): ${error.message}` : `The generation failed: ${error.message}`;
  return `No answer from the server: ${error.message}`;
}

// ---- generating ------------------------------------------------------------------------------------------------

/** Stream an answer into `message` (a new assistant message, or the last one when `continuing`). */
async function generate(conversation, message, continuing = false) {
  let body;
  try {
    body = requestBody(conversation, message, continuing);
  } catch (error) {
    message.error = `Settings: ${error.message}`;
    redraw(message);
    return;
  }
  const controller = new AbortController();
  state.generation = { controller, message };
  Object.assign(message, { error: null, finish: null });
  setBusy(true);
  let frame = null;
  const draw = () => {
    frame = null;
    redraw(message, true);
    if (stuckToBottom) scrollToBottom();
  };
  const messages = $("messages");
  let stuckToBottom = true;
  const onScroll = () => {
    stuckToBottom = messages.scrollHeight - messages.scrollTop - messages.clientHeight < 80;
  };
  messages.addEventListener("scroll", onScroll);
  redraw(message, true);
  scrollToBottom();
  try {
    const result = await streamChat(body, {
      apiKey: apiKey(),
      signal: controller.signal,
      onDelta({ content, reasoning }) {
        message.content += content;
        message.reasoning = (message.reasoning || "") + reasoning;
        frame ??= requestAnimationFrame(draw);
      },
    });
    message.timings = result.timings;
    const used = (result.usage?.prompt_tokens ?? 0) + (result.usage?.completion_tokens ?? 0);
    message.finish = result.finishReason === "length" && contextSize() && used >= contextSize() ? "context"
      : result.finishReason;
    announce(message.finish === "length" ? "Answer cut at the token limit." : "Answer complete.");
  } catch (error) {
    if (error.name === "AbortError") {
      message.finish = "stopped";
      announce("Stopped.");
    } else {
      message.error = describeError(error);
      announce(message.error);
    }
  } finally {
    if (frame) cancelAnimationFrame(frame);
    messages.removeEventListener("scroll", onScroll);
    state.generation = null;
    if (!message.reasoning) delete message.reasoning;
    setBusy(false);
    redraw(message);
    if (state.models.length > 1) loadModels(); // the states of the models may have changed
    await persist(conversation);
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("app").classList.toggle("busy", busy);
  for (const id of ["new-chat", "import"]) $(id).disabled = busy;
  if (!busy) $("prompt").focus();
}

function announce(text) {
  $("status").textContent = text;
}

/** A visible note under the conversation list (an import's problem); empty hides it. */
function notice(text) {
  $("notice").hidden = !text;
  $("notice").textContent = text;
}

async function send() {
  const text = $("prompt").value;
  if (state.generation || (!text.trim() && !state.attachments.length)) return;
  const conversation = state.current ?? openConversation(newConversation());
  const user = { id: newId(), role: "user", content: text };
  if (state.attachments.length) user.images = state.attachments;
  if (!conversation.messages.length) conversation.title = text.trim().slice(0, TITLE_CHARS) || "Image";
  const answer = { id: newId(), role: "assistant", content: "" };
  conversation.messages.push(user, answer);
  $("prompt").value = "";
  setAttachments([]);
  growPrompt();
  appendMessage(user);
  appendMessage(answer);
  await persist(conversation);
  await generate(conversation, answer);
}

// ---- drawing -----------------------------------------------------------------------------------------------------

function redraw(message, streaming = false) {
  const element = elements.get(message.id);
  if (!element) return;
  const messages = state.current?.messages || [];
  drawMessage(element, message, { streaming, last: messages[messages.length - 1] === message });
}

function appendMessage(message) {
  const element = createMessage(message);
  elements.set(message.id, element);
  $("empty").hidden = true;
  $("messages").append(element);
  redraw(message);
}

function drawConversation() {
  for (const element of elements.values()) element.remove();
  elements.clear();
  const conversation = state.current;
  $("empty").hidden = Boolean(conversation?.messages.length);
  const fragment = document.createDocumentFragment();
  for (const message of conversation?.messages || []) {
    const element = createMessage(message);
    elements.set(message.id, element);
    fragment.append(element);
  }
  $("messages").append(fragment);
  for (const message of conversation?.messages || []) redraw(message);
  settleAtBottom();
  $("export-chat").disabled = !conversation?.messages.length;
}

function scrollToBottom() {
  const messages = $("messages");
  messages.scrollTop = messages.scrollHeight;
}

/** Scroll to the end once the messages just drawn have their sizes (off-screen ones are laid out lazily, by
 * content-visibility, so the first estimate of the height is short). */
function settleAtBottom(frames = 3) {
  scrollToBottom();
  if (frames > 0) requestAnimationFrame(() => settleAtBottom(frames - 1));
}

function growPrompt() {
  const prompt = $("prompt");
  prompt.style.height = "auto";
  prompt.style.height = `${Math.min(prompt.scrollHeight, 240)}px`;
}

// ---- conversations -----------------------------------------------------------------------------------------------

async function persist(conversation) {
  conversation.updated = Date.now();
  await saveConversation(conversation);
  if (!state.conversations.includes(conversation)) state.conversations.unshift(conversation);
  state.conversations.sort((a, b) => b.updated - a.updated);
  drawList();
  $("export-chat").disabled = !state.current?.messages.length;
}

function openConversation(conversation) {
  state.current = conversation;
  history.replaceState(null, "", `#c=${encodeURIComponent(conversation.id)}`); // a reload reopens it
  drawConversation();
  drawList();
  document.body.classList.remove("sidebar-open");
  return conversation;
}

function matches(conversation, query) {
  if (!query) return true;
  const q = query.toLowerCase();
  return conversation.title.toLowerCase().includes(q)
    || conversation.messages.some((m) => m.content.toLowerCase().includes(q));
}

function drawList() {
  const list = $("conversations");
  const items = state.conversations.filter((c) => matches(c, state.query)).map((conversation) => {
    const item = document.createElement("li");
    item.dataset.id = conversation.id;
    item.className = conversation === state.current ? "current" : "";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conversation-title";
    open.dataset.action = "open";
    open.textContent = conversation.title;
    if (conversation === state.current) open.setAttribute("aria-current", "true");
    const rename = document.createElement("button");
    rename.type = "button";
    rename.className = "icon-button small";
    rename.dataset.action = "rename";
    rename.textContent = "✎";
    rename.setAttribute("aria-label", `Rename “${conversation.title}”`);
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "icon-button small";
    remove.dataset.action = "delete";
    remove.textContent = "✕";
    remove.setAttribute("aria-label", `Delete “${conversation.title}”`);
    item.append(open, rename, remove);
    return item;
  });
  list.replaceChildren(...items);
  if (!items.length && state.query) {
    const none = document.createElement("li");
    none.className = "none";
    none.textContent = "No conversation matches.";
    list.append(none);
  }
}

function startRename(item, conversation) {
  const input = document.createElement("input");
  input.className = "input rename";
  input.value = conversation.title;
  input.setAttribute("aria-label", "New name");
  let done = false;
  const finish = async (save) => {
    if (done) return;
    done = true;
    if (save && input.value.trim()) {
      conversation.title = input.value.trim();
      await saveConversation(conversation);
    }
    drawList();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
  item.replaceChildren(input);
  input.focus();
  input.select();
}

async function removeConversation(button, conversation) {
  if (button.dataset.confirm !== "yes") { // a second press within 4 s deletes
    button.dataset.confirm = "yes";
    button.textContent = "Delete?";
    button.setAttribute("aria-label", `Press again to delete “${conversation.title}”`);
    setTimeout(() => drawList(), 4000);
    return;
  }
  await deleteConversation(conversation.id);
  state.conversations = state.conversations.filter((c) => c !== conversation);
  if (state.current === conversation) {
    state.current = null;
    history.replaceState(null, "", location.pathname + location.search);
    drawConversation();
  }
  drawList();
  announce(`Deleted “${conversation.title}”.`);
}

function download(name, object) {
  const url = URL.createObjectURL(new Blob([JSON.stringify(object, null, 2)], { type: "application/json" }));
  const link = document.createElement("a");
  link.href = url;
  link.download = name;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

async function importFile(file) {
  try {
    const conversations = parseImport(await file.text());
    for (const conversation of conversations) await saveConversation(conversation);
    state.conversations = await listConversations();
    if (conversations.length) openConversation(state.conversations.find((c) => c.id === conversations[0].id));
    announce(`Imported ${conversations.length} conversation${conversations.length === 1 ? "" : "s"}.`);
    notice("");
  } catch (error) {
    notice(`Import failed: ${error.message}`);
  }
}

// ---- attachments (vision models only) ----------------------------------------------------------------------------

function setAttachments(urls) {
  state.attachments = urls;
  const box = $("attachments");
  box.hidden = !urls.length;
  box.replaceChildren(...urls.map((url, i) => {
    const img = document.createElement("img");
    img.src = url;
    img.alt = `attached image ${i + 1}`;
    return img;
  }));
}

function readImage(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// ---- events ------------------------------------------------------------------------------------------------------

const openSettings = setupSettings({ onSaved: () => { if (!state.props) loadProps(); } });

async function onMessageAction(event) {
  const action = event.target.closest("[data-action]")?.dataset.action;
  const element = event.target.closest(".message");
  if (!action || !element || state.generation) return;
  const conversation = state.current;
  const message = conversation.messages.find((m) => m.id === element.dataset.id);
  if (action === "copy-code") {
    const code = event.target.closest(".code-block").querySelector("code").textContent;
    if (await copyText(code)) flash(event.target, "Copied");
  } else if (action === "copy-message") {
    if (await copyText(message.content)) flash(event.target, "Copied");
  } else if (action === "regenerate") {
    truncateAfter(conversation, message, false);
    Object.assign(message, { content: "", reasoning: "", timings: null });
    await generate(conversation, message);
  } else if (action === "continue") {
    await generate(conversation, message, true);
  } else if (action === "edit") {
    editMessage(element, message, async (text) => {
      if (text === null || !text.trim()) {
        redraw(message);
        return;
      }
      message.content = text;
      truncateAfter(conversation, message, false);
      const answer = { id: newId(), role: "assistant", content: "" };
      conversation.messages.push(answer);
      redraw(message);
      appendMessage(answer);
      await generate(conversation, answer);
    });
  }
}

/** Drop the messages after `message` (and it too when `inclusive`), from the conversation and the page. */
function truncateAfter(conversation, message, inclusive) {
  const at = conversation.messages.indexOf(message) + (inclusive ? 0 : 1);
  for (const dropped of conversation.messages.splice(at)) {
    elements.get(dropped.id)?.remove();
    elements.delete(dropped.id);
  }
}

function flash(button, text) {
  const before = button.textContent;
  button.textContent = text;
  setTimeout(() => { button.textContent = before; }, 1200);
}

function wire() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key !== "Enter" || event.isComposing) return;
    if ((event.ctrlKey || event.metaKey) || (!event.shiftKey && !narrow.matches)) {
      event.preventDefault();
      send();
    }
  });
  $("prompt").addEventListener("input", growPrompt);
  $("model-select").addEventListener("change", (event) => chooseModel(event.target.value));
  $("model-select").addEventListener("focus", loadModels);
  $("stop").addEventListener("click", () => state.generation?.controller.abort());
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && state.generation && !$("settings").open) state.generation.controller.abort();
  });
  $("messages").addEventListener("click", onMessageAction);
  $("new-chat").addEventListener("click", () => {
    state.current = null;
    history.replaceState(null, "", location.pathname + location.search);
    drawConversation();
    drawList();
    document.body.classList.remove("sidebar-open");
    $("prompt").focus();
  });
  $("search").addEventListener("input", (event) => {
    state.query = event.target.value.trim();
    drawList();
  });
  $("conversations").addEventListener("click", (event) => {
    const button = event.target.closest("[data-action]");
    const item = event.target.closest("li[data-id]");
    if (!button || !item || state.generation) return;
    const conversation = state.conversations.find((c) => c.id === item.dataset.id);
    if (button.dataset.action === "open") openConversation(conversation);
    if (button.dataset.action === "rename") startRename(item, conversation);
    if (button.dataset.action === "delete") removeConversation(button, conversation);
  });
  $("export-chat").addEventListener("click", () => {
    if (state.current) download(`gpullama-${state.current.title.replace(/[^\w-]+/g, "_").slice(0, 40)}.json`,
      exportObject([state.current]));
  });
  $("export-all").addEventListener("click", () => {
    download(`gpullama-conversations-${new Date().toISOString().slice(0, 10)}.json`,
      exportObject(state.conversations));
  });
  $("import").addEventListener("click", () => $("import-file").click());
  $("import-file").addEventListener("change", async (event) => {
    const [file] = event.target.files;
    event.target.value = "";
    if (file) await importFile(file);
  });
  $("open-settings").addEventListener("click", () => openSettings());
  $("open-sidebar").addEventListener("click", () => {
    document.body.classList.add("sidebar-open");
    $("search").focus();
  });
  $("close-sidebar").addEventListener("click", () => {
    document.body.classList.remove("sidebar-open");
    $("open-sidebar").focus();
  });
  $("attach").addEventListener("click", () => $("attach-file").click());
  $("attach-file").addEventListener("change", async (event) => {
    const files = [...event.target.files].filter((file) => file.type.startsWith("image/"));
    event.target.value = "";
    setAttachments([...state.attachments, ...await Promise.all(files.map(readImage))]);
  });
}

async function start() {
  wire();
  drawConversation();
  state.conversations = await listConversations();
  drawList();
  const wanted = new URLSearchParams(location.hash.slice(1)).get("c");
  const first = state.conversations.find((c) => c.id === wanted);
  if (first) openConversation(first);
  $("prompt").focus();
  document.documentElement.dataset.ready = "true"; // the tests wait for this
  await loadProps();
}

start();
