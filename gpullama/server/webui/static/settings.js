// The settings dialog: system message, sampling fields, extra request fields as JSON, presets, the API key.
// Values are sent as typed; the server checks them and its refusal is shown under the answer.

import { loadSetting, saveSetting } from "./store.js";

export const SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
  "max_tokens", "seed"];
const DEFAULTS = { system: "", custom: "", ...Object.fromEntries(SAMPLING_FIELDS.map((name) => [name, ""])) };

const $ = (id) => document.getElementById(id);

/** The stored settings (system message, sampling fields as typed, custom JSON text). */
export function currentSettings() {
  return { ...DEFAULTS, ...loadSetting("settings", {}) };
}

export function apiKey() {
  return loadSetting("apiKey", "");
}

/** The request fields the settings add to a chat completion body (empty fields are left to the server). */
export function requestFields(settings) {
  const fields = {};
  for (const name of SAMPLING_FIELDS) {
    const text = String(settings[name] ?? "").trim();
    if (text !== "") fields[name] = Number(text);
  }
  return { ...fields, ...(settings.custom.trim() ? JSON.parse(settings.custom) : {}) };
}

function customError(text) {
  if (!text.trim()) return "";
  try {
    const value = JSON.parse(text);
    return value && typeof value === "object" && !Array.isArray(value) ? "" : "must be a JSON object";
  } catch (error) {
    return `is not valid JSON: ${error.message}`;
  }
}

function fillForm(settings) {
  $("system").value = settings.system;
  $("custom").value = settings.custom;
  for (const name of SAMPLING_FIELDS) $(name).value = settings[name];
}

function readForm() {
  const settings = { system: $("system").value, custom: $("custom").value };
  for (const name of SAMPLING_FIELDS) settings[name] = $(name).value;
  return settings;
}

function fillPresets(selected = "") {
  const presets = loadSetting("presets", {});
  const select = $("preset");
  select.replaceChildren(new Option("Choose a preset…", ""),
    ...Object.keys(presets).sort().map((name) => new Option(name, name)));
  select.value = selected;
}

/** Wire the dialog; `onOpen(reason)` opens it, `onSaved()` runs after Save. */
export function setupSettings({ onSaved }) {
  const dialog = $("settings");
  const error = $("settings-error");

  $("preset-save").addEventListener("click", () => {
    const name = $("preset-name").value.trim();
    if (!name) {
      error.textContent = "Give the preset a name.";
      $("preset-name").focus();
      return;
    }
    const presets = loadSetting("presets", {});
    presets[name] = readForm();
    saveSetting("presets", presets);
    $("preset-name").value = "";
    error.textContent = "";
    fillPresets(name);
  });
  $("preset-load").addEventListener("click", () => {
    const preset = loadSetting("presets", {})[$("preset").value];
    if (preset) fillForm({ ...DEFAULTS, ...preset });
  });
  $("preset-delete").addEventListener("click", () => {
    const presets = loadSetting("presets", {});
    delete presets[$("preset").value];
    saveSetting("presets", presets);
    fillPresets();
  });
  $("settings-reset").addEventListener("click", () => fillForm(DEFAULTS));
  $("settings-cancel").addEventListener("click", () => dialog.close());
  $("settings-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const settings = readForm();
    const problem = customError(settings.custom);
    if (problem) {
      error.textContent = `More request fields ${problem}.`;
      $("custom").focus();
      return;
    }
    saveSetting("settings", settings);
    saveSetting("apiKey", $("api-key").value.trim());
    dialog.close();
    onSaved();
  });

  return function open(message = "") {
    fillForm(currentSettings());
    fillPresets();
    $("api-key").value = apiKey();
    error.textContent = message;
    dialog.showModal();
    (message ? $("api-key") : $("system")).focus();
  };
}
