"""Chat above the engine: messages, the models' chat formats (one module per tool-call format), and the output
read back into reasoning, content and tool calls. No HTTP here (the server builds its APIs on it) and no model
code (the engine below sees token ids and sampling parameters only)."""
