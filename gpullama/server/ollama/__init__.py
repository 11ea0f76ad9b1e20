"""Ollama's native API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/embeddings``, ``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/version``), for the desktop apps and editor plug-ins that speak only it: the
request fields (`request`), chat and generate answered whole or as newline-delimited JSON (`chat`), embeddings
(`embed`), the model listings (`models`)."""
