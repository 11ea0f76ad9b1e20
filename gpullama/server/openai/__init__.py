"""OpenAI's API: chat completions, completions, responses, models (and embeddings), one module each."""
