// llama.cpp's logits at every position of a token list, for benchmarks/bench_accuracy.py.
//
//   llama_logits MODEL.gguf TOKENS.i32 OUT.f32 [THREADS [FLASH_ATTN]]
//
// TOKENS.i32 holds int32 token ids; all of them are evaluated in one batch (n_ctx = n_batch = n_ubatch = n,
// one sequence, positions 0..n-1, every position an output), on the CPU, with the context's default KV cache
// type (f16). FLASH_ATTN: -1 auto (llama.cpp's default), 0 off, 1 on. OUT.f32 gets float32 logits [n, n_vocab];
// stdout gets one line, "n_vocab <V> flash_attn <asked> -> <used>". Build (bench_accuracy.py does):
//   cc -O2 llama_logits.c -I LLAMA/include -I LLAMA/ggml/include -L BIN -Wl,-rpath,BIN -lllama -lggml -o llama_logits
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static const char *flash_attn_used = NULL;  // what "auto" resolved to, from llama.cpp's log

static void quiet(enum ggml_log_level level, const char *text, void *user_data) {
    (void)user_data;
    if (strstr(text, "Flash Attention enabled")) flash_attn_used = "enabled";
    if (strstr(text, "Flash Attention disabled")) flash_attn_used = "disabled";
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf TOKENS.i32 OUT.f32 [THREADS [FLASH_ATTN]]\n", argv[0]);
        return 2;
    }
    int threads = argc > 4 ? atoi(argv[4]) : 2;
    int flash_attn = argc > 5 ? atoi(argv[5]) : LLAMA_FLASH_ATTN_TYPE_AUTO;

    FILE *f = fopen(argv[2], "rb");
    if (!f) { perror(argv[2]); return 1; }
    fseek(f, 0, SEEK_END);
    int n = (int)(ftell(f) / sizeof(llama_token));
    fseek(f, 0, SEEK_SET);
    llama_token *tokens = malloc(n * sizeof(llama_token));
    if (n < 1 || fread(tokens, sizeof(llama_token), n, f) != (size_t)n) { fprintf(stderr, "no tokens\n"); return 1; }
    fclose(f);

    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(argv[1], mparams);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int n_vocab = llama_vocab_n_tokens(vocab);

    struct llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = (uint32_t)n;
    cparams.n_seq_max = 1;
    cparams.n_threads = cparams.n_threads_batch = threads;
    cparams.flash_attn_type = (enum llama_flash_attn_type)flash_attn;
    cparams.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cparams);
    if (!ctx) { fprintf(stderr, "cannot create the context\n"); return 1; }

    struct llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    int rc = llama_decode(ctx, batch);
    if (rc != 0) { fprintf(stderr, "llama_decode failed: %d\n", rc); return 1; }

    FILE *out = fopen(argv[3], "wb");
    if (!out) { perror(argv[3]); return 1; }
    for (int i = 0; i < n; i++) {
        const float *logits = llama_get_logits_ith(ctx, i);
        if (!logits || fwrite(logits, sizeof(float), n_vocab, out) != (size_t)n_vocab) {
            fprintf(stderr, "no logits at position %d\n", i);
            return 1;
        }
    }
    fclose(out);
    printf("n_vocab %d flash_attn %s -> %s\n", n_vocab, llama_flash_attn_type_name(cparams.flash_attn_type),
           flash_attn_used ? flash_attn_used : llama_flash_attn_type_name(cparams.flash_attn_type));

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(tokens);
    return 0;
}
