"""llama.cpp's side of `bench_decode.py`: run by a Python that has llama-cpp-python, driven over stdin/stdout.

    python llama_cpp_worker.py MODEL.gguf THREADS N_CTX

Loads the model once, prints ``ready``, then answers each line ``pp N`` (evaluate N prompt tokens in one batch, as
llama-bench's pp) or ``tg N`` (generate N tokens greedily after a one-token prompt through `Llama.generate`,
EOS ignored, as a user of the library would) with the seconds it took. Every run starts from an empty KV cache
(`reset`), so no prefix is reused. Never imported by gpullama or its tests.
"""

from __future__ import annotations

import sys
import time

from llama_cpp import Llama


def main() -> None:
    """Serve pp/tg timing requests on stdin until it closes."""
    path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = Llama(path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    vocab = llm.n_vocab()
    print("ready", llm.model_path, flush=True)
    for line in sys.stdin:
        test, n = line.split()
        n = int(n)
        prompt = [100 + (i * 7919) % (vocab - 100) for i in range(n if test == "pp" else 1)]
        llm.reset()
        start = time.perf_counter()
        if test == "pp":
            llm.eval(prompt)
        else:
            for count, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True), start=1):
                if count == n:
                    break
        print(f"{time.perf_counter() - start:.6f}", flush=True)


if __name__ == "__main__":
    main()
