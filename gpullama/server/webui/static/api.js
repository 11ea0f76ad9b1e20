// The server's own API, by relative URL (so the page works below a proxy's path prefix): the served models
// (GET v1/models), a model's properties (GET props) and a streamed chat completion (POST v1/chat/completions),
// with the timings measured here.

/** An answer other than 2xx, or an error event in the stream: the server's own message, its status and body. */
export class ServerError extends Error {
  constructor(message, status = 0, body = null) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

function authHeaders(apiKey) {
  return apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
}

async function errorOf(response) {
  let body = null;
  let message = `${response.status} ${response.statusText}`;
  try {
    body = await response.json();
    message = body?.error?.message || body?.message || message;
  } catch {
    // not JSON: the status line says it
  }
  return new ServerError(message, response.status, body);
}

/**
 * llama.cpp's GET /props: model_alias, default_generation_settings.n_ctx, modalities, build_info; of `model` (its
 * `?model=`, which loads it on a server of several models) or of the default model.
 */
export async function fetchProps(apiKey, model = null) {
  const url = model ? `props?model=${encodeURIComponent(model)}` : "props";
  const response = await fetch(url, { headers: authHeaders(apiKey), cache: "no-store" });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

/**
 * GET /v1/models: the served models, each {id, status?: {value, failed?}, parent?} (a server of several models
 * gives each one's status, llama.cpp's router mode; a LoRA adapter names its base model as `parent`, as vLLM's).
 */
export async function fetchModels(apiKey) {
  const response = await fetch("v1/models", { headers: authHeaders(apiKey), cache: "no-store" });
  if (!response.ok) throw await errorOf(response);
  return (await response.json()).data || [];
}

/** The server-sent events of `response`, each parsed from its JSON `data:` line(s), until `[DONE]`. */
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

/**
 * Stream one chat completion. `onDelta({content, reasoning})` is called for each piece of text; the promise
 * resolves to {finishReason, usage, timings} where timings = {ttftMs, tokens, tokensPerSecond, promptTokens}:
 * the time from sending the request to the first piece of text, and the decode speed after it (the tokens after
 * the first, over the time from the first piece to the last), from the stream's usage chunk.
 * Rejects with ServerError (the server's message), or the AbortError of `signal`.
 */
export async function streamChat(body, { apiKey, signal, onDelta }) {
  const sent = performance.now();
  const response = await fetch("v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders(apiKey) },
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  let first = null;
  let last = null;
  let finishReason = null;
  let usage = null;
  for await (const event of events(response)) {
    if (event.error) throw new ServerError(event.error.message || "the generation failed", 0, event);
    if (event.usage) usage = event.usage;
    const choice = event.choices?.[0];
    if (!choice) continue;
    const content = choice.delta?.content || "";
    const reasoning = choice.delta?.reasoning_content || "";
    if (content || reasoning) {
      last = performance.now();
      first ??= last;
      onDelta({ content, reasoning });
    }
    if (choice.finish_reason) finishReason = choice.finish_reason;
  }
  const tokens = usage?.completion_tokens ?? 0;
  const decodeMs = first !== null && last > first ? last - first : 0;
  return {
    finishReason,
    usage,
    timings: {
      ttftMs: first === null ? null : first - sent,
      tokens,
      tokensPerSecond: tokens > 1 && decodeMs > 0 ? ((tokens - 1) * 1000) / decodeMs : null,
      promptTokens: usage?.prompt_tokens ?? null,
    },
  };
}
