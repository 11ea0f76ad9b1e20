// What the page keeps in the browser: conversations in IndexedDB (database "gpullama", store "conversations"),
// settings, presets and the API key in localStorage; and the JSON file format of export and import.

const DB_NAME = "gpullama";
const STORE = "conversations";
export const EXPORT_FORMAT = "gpullama.conversations";

let opened = null;

function database() {
  opened ??= new Promise((resolve, reject) => {
    const request = indexedDB.open(DB_NAME, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(STORE, { keyPath: "id" });
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
  return opened;
}

async function transaction(mode, work) {
  const db = await database();
  return new Promise((resolve, reject) => {
    const tx = db.transaction(STORE, mode);
    const result = work(tx.objectStore(STORE));
    tx.oncomplete = () => resolve(result?.result);
    tx.onerror = () => reject(tx.error);
    tx.onabort = () => reject(tx.error);
  });
}

/** Every stored conversation, the most recently updated first. */
export async function listConversations() {
  const all = await transaction("readonly", (store) => store.getAll());
  return all.sort((a, b) => b.updated - a.updated);
}

/** Store (add or replace) a conversation. */
export function saveConversation(conversation) {
  return transaction("readwrite", (store) => store.put(conversation));
}

export function deleteConversation(id) {
  return transaction("readwrite", (store) => store.delete(id));
}

export function newId() {
  return crypto.randomUUID ? crypto.randomUUID() : `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
}

export function newConversation() {
  const now = Date.now();
  return { id: newId(), title: "New chat", created: now, updated: now, messages: [] };
}

export function loadSetting(key, fallback) {
  try {
    const text = localStorage.getItem(`gpullama.${key}`);
    return text === null ? fallback : JSON.parse(text);
  } catch {
    return fallback;
  }
}

export function saveSetting(key, value) {
  localStorage.setItem(`gpullama.${key}`, JSON.stringify(value));
}

/** The export file's object for `conversations`. */
export function exportObject(conversations) {
  return { format: EXPORT_FORMAT, version: 1, exported: new Date().toISOString(), conversations };
}

const ROLES = new Set(["user", "assistant"]);

function checkedMessage(message, where) {
  if (typeof message !== "object" || message === null) throw new Error(`${where} is not an object`);
  if (!ROLES.has(message.role)) throw new Error(`${where}.role must be "user" or "assistant"`);
  if (typeof message.content !== "string") throw new Error(`${where}.content must be a string`);
  const images = Array.isArray(message.images) ? message.images.filter((url) => typeof url === "string"
    && url.startsWith("data:image/")) : undefined;
  return {
    id: typeof message.id === "string" ? message.id : newId(),
    role: message.role,
    content: message.content,
    ...(typeof message.reasoning === "string" && message.reasoning ? { reasoning: message.reasoning } : {}),
    ...(images?.length ? { images } : {}),
    ...(message.timings && typeof message.timings === "object" ? { timings: message.timings } : {}),
    ...(typeof message.finish === "string" ? { finish: message.finish } : {}),
  };
}

/**
 * The conversations of an imported file: this page's export (one conversation or all), a bare conversation or a
 * list of them. Each is checked (roles, text) and gets a fresh id, so an import never replaces a stored one.
 */
export function parseImport(text) {
  let data;
  try {
    data = JSON.parse(text);
  } catch (error) {
    throw new Error(`not a JSON file (${error.message})`);
  }
  const list = Array.isArray(data) ? data : Array.isArray(data?.conversations) ? data.conversations : [data];
  return list.map((conversation, i) => {
    const where = `conversation ${i + 1}`;
    if (typeof conversation !== "object" || conversation === null || !Array.isArray(conversation.messages)) {
      throw new Error(`${where} has no "messages" list`);
    }
    const now = Date.now();
    return {
      id: newId(),
      title: typeof conversation.title === "string" && conversation.title ? conversation.title : "Imported chat",
      created: Number.isFinite(conversation.created) ? conversation.created : now,
      updated: Number.isFinite(conversation.updated) ? conversation.updated : now,
      messages: conversation.messages.map((m, j) => checkedMessage(m, `${where}, message ${j + 1}`)),
    };
  });
}
