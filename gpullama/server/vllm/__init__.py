"""vLLM's extra endpoints, which llama.cpp's server shares: ``/tokenize``, ``/detokenize``, ``/version``, and the
operational ``/health`` and ``/metrics``."""
