"""llama.cpp's native server API (``POST /completion`` and ``/completions``, ``POST /infill``, ``POST /embeddings``
and ``/embedding``, ``POST /apply-template``, ``GET /props``), for the clients written for llama.cpp's server
(llama.vscode, its web UI, scripts): the request fields under its names and defaults (`request`), completion and
infill answered whole or as SSE events (`completion`), its embeddings' shape (`embeddings`), the server properties
and the template rendering (`props`)."""
