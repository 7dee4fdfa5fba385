// llama.cpp's own code on a GGUF file, through the prebuilt libllama that npm's node-llama-cpp ships: quantize a
// file (llama_model_quantize, llama-quantize's code), or load one and generate greedily (token ids and text), with a
// chosen CPU back-end. For cross-checks against qkv; not part of qkv. Build (tools/llamacpp.sh does it):
//   cc -O2 -I SRC/include -I SRC/ggml/include tools/llamacpp.c -L BINS -l:libllama.v0.5.0.so -l:libggml.v0.5.0.so
//      -l:libggml-base.so -Wl,-rpath,BINS -o llamacpp
// where SRC is llama.cpp's source at the same commit (node-llama-cpp/llama/gitRelease.bundle) and BINS the folder
// @node-llama-cpp/linux-x64/bins/linux-x64.
// Usage: llamacpp [--cpu VARIANT] quantize IN OUT TYPE [THREADS]       TYPE: f16 bf16 q8_0 q4_0 q4_k_m q5_k_m q6_k …
//        llamacpp [--cpu VARIANT] generate MODEL PROMPT N [THREADS]    prints "ids: …" and "text: …"
//        llamacpp [--cpu VARIANT] [--kv-cache TYPE] bench MODEL PROMPT_TOKENS GEN_TOKENS THREADS [SHORT_PROMPT]
//            load seconds, then GEN_TOKENS greedy tokens after a SHORT_PROMPT-token prompt (default 16) and a fresh
//            PROMPT_TOKENS-token prompt in one llama_decode, timed around llama_decode here; prints "ids: …" and
//            "result load_s=… pp_tok_s=… gen_tok_s=… rss=…" (peak RSS after generating; qkv_gguf_bench reads it). Prompt token i is (i·7919 + 11) mod
//            the vocabulary, as qkv_gguf_bench feeds qkv.
//        llamacpp tokenize MODEL [--no-special] FILE…                 prints "ids: [a, b, …]" per file (vocab only)
//        llamacpp [--cpu VARIANT] [--kv-cache TYPE] kl BASE QUANTIZED N_TOKENS CONTEXT [THREADS]
//            the KL divergence of QUANTIZED's next-token distributions from BASE's over N_TOKENS prompt tokens in
//            windows of CONTEXT, as qkv's nn::next_token_divergence defines it (KV cache f32 unless TYPE); prints
//            "result positions=… mean_kl=… median_kl=… p99_kl=… max_kl=… top1=… perplexity=… reference_perplexity=…"
// TYPE (f32, f16, bf16, q8_0; llama.cpp's --cache-type-k and -v) stores the bench's keys and values; without it,
// llama.cpp's default (f16). The type used is printed ("kv cache: f16").
// VARIANT is a libggml-cpu-VARIANT.so in BINS (haswell = AVX2, zen4 / icelake / sapphirerapids = AVX-512, …); without
// it, ggml loads the one that scores best on this CPU. The back-end loaded is printed first, and the CPU library
// mapped ("cpu library: libggml-cpu-zen4.so").
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-backend.h"
#include "llama.h"

// The bench's KV cache type: llama.cpp's default unless --kv-cache names one
static enum ggml_type g_kv_type = GGML_TYPE_F16;
static int g_kv_type_set = 0;

static int kv_type_of(const char* name, enum ggml_type* out) {
  static const struct { const char* name; enum ggml_type type; } table[] = {
      {"f32", GGML_TYPE_F32}, {"f16", GGML_TYPE_F16}, {"bf16", GGML_TYPE_BF16}, {"q8_0", GGML_TYPE_Q8_0}};
  for (size_t i = 0; i < sizeof table / sizeof table[0]; ++i)
    if (strcmp(table[i].name, name) == 0) {
      *out = table[i].type;
      return 1;
    }
  return 0;
}

// Keys and values stored as `type` (a quantized V needs llama.cpp's flash attention)
static void set_kv_type(struct llama_context_params* params, enum ggml_type type) {
  params->type_k = params->type_v = type;
  if (type == GGML_TYPE_Q8_0) params->flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
}

static int ftype_of(const char* name) {
  static const struct { const char* name; int ftype; } table[] = {
      {"f32", LLAMA_FTYPE_ALL_F32},        {"f16", LLAMA_FTYPE_MOSTLY_F16},       {"bf16", LLAMA_FTYPE_MOSTLY_BF16},
      {"q8_0", LLAMA_FTYPE_MOSTLY_Q8_0},   {"q4_0", LLAMA_FTYPE_MOSTLY_Q4_0},     {"q4_1", LLAMA_FTYPE_MOSTLY_Q4_1},
      {"q5_0", LLAMA_FTYPE_MOSTLY_Q5_0},   {"q5_1", LLAMA_FTYPE_MOSTLY_Q5_1},     {"q2_k", LLAMA_FTYPE_MOSTLY_Q2_K},
      {"q3_k_m", LLAMA_FTYPE_MOSTLY_Q3_K_M}, {"q4_k_s", LLAMA_FTYPE_MOSTLY_Q4_K_S}, {"q4_k_m", LLAMA_FTYPE_MOSTLY_Q4_K_M},
      {"q5_k_s", LLAMA_FTYPE_MOSTLY_Q5_K_S}, {"q5_k_m", LLAMA_FTYPE_MOSTLY_Q5_K_M}, {"q6_k", LLAMA_FTYPE_MOSTLY_Q6_K},
      {"mxfp4_moe", LLAMA_FTYPE_MOSTLY_MXFP4_MOE},
  };
  for (size_t i = 0; i < sizeof table / sizeof table[0]; ++i)
    if (strcmp(table[i].name, name) == 0) return table[i].ftype;
  return -1;
}

// The folder holding libllama (the CPU back-ends sit beside it): from the path the dynamic loader resolved.
static void load_backends(const char* variant) {
  const char* bins = getenv("LLAMACPP_BINS");
  if (variant) {
    char path[4096];
    snprintf(path, sizeof path, "%s/libggml-cpu-%s.so", bins ? bins : ".", variant);
    if (!ggml_backend_load(path)) {
      fprintf(stderr, "cannot load %s (set LLAMACPP_BINS to the folder of libllama)\n", path);
      exit(1);
    }
  } else {
    ggml_backend_load_all_from_path(bins);
  }
  for (size_t i = 0; i < ggml_backend_reg_count(); ++i) {
    ggml_backend_reg_t reg = ggml_backend_reg_get(i);
    printf("backend: %s\n", ggml_backend_reg_name(reg));
  }
  for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
    ggml_backend_dev_t dev = ggml_backend_dev_get(i);
    printf("device: %s (%s)\n", ggml_backend_dev_name(dev), ggml_backend_dev_description(dev));
  }
  printf("system: %s\n", llama_print_system_info());
  // Which libggml-cpu-*.so ggml chose: the one this process has mapped
  FILE* maps = fopen("/proc/self/maps", "r");
  char line[4096], seen[4096] = "";
  while (maps && fgets(line, sizeof line, maps)) {
    const char* at = strstr(line, "libggml-cpu-");
    if (!at) continue;
    char name[256];
    snprintf(name, sizeof name, "%.*s", (int)strcspn(at, "\n"), at);
    if (strstr(seen, name)) continue;
    printf("cpu library: %s\n", name);
    strncat(seen, name, sizeof seen - strlen(seen) - 1);
  }
  if (maps) fclose(maps);
}

static int quantize(const char* in, const char* out, const char* type, int threads) {
  const int ftype = ftype_of(type);
  if (ftype < 0) {
    fprintf(stderr, "unknown type %s\n", type);
    return 1;
  }
  struct llama_model_quantize_params params = llama_model_quantize_default_params();
  params.nthread = threads;
  params.ftype = (enum llama_ftype)ftype;
  const uint32_t status = llama_model_quantize(in, out, &params);
  printf("quantize %s -> %s as %s: %s\n", in, out, type, status == 0 ? "ok" : "failed");
  return status == 0 ? 0 : 1;
}

static int generate(const char* model_path, const char* prompt, int n, int threads) {
  struct llama_model_params model_params = llama_model_default_params();
  struct llama_model* model = llama_model_load_from_file(model_path, model_params);
  if (!model) {
    fprintf(stderr, "llama.cpp could not load %s\n", model_path);
    return 1;
  }
  char desc[256];
  llama_model_desc(model, desc, sizeof desc);
  printf("model: %s\n", desc);
  const struct llama_vocab* vocab = llama_model_get_vocab(model);
  llama_token tokens[4096];
  const int n_prompt = llama_tokenize(vocab, prompt, (int32_t)strlen(prompt), tokens, 4096 - n, true, true);
  if (n_prompt < 0) {
    fprintf(stderr, "prompt too long\n");
    return 1;
  }
  struct llama_context_params ctx_params = llama_context_default_params();
  ctx_params.n_ctx = (uint32_t)(n_prompt + n + 8);
  ctx_params.n_batch = (uint32_t)(n_prompt + 8);
  ctx_params.n_threads = threads;
  ctx_params.n_threads_batch = threads;
  struct llama_context* ctx = llama_init_from_model(model, ctx_params);
  struct llama_sampler* sampler = llama_sampler_chain_init(llama_sampler_chain_default_params());
  llama_sampler_chain_add(sampler, llama_sampler_init_greedy());
  printf("prompt ids:");
  for (int i = 0; i < n_prompt; ++i) printf(" %d", tokens[i]);
  printf("\n");
  struct llama_batch batch = llama_batch_get_one(tokens, n_prompt);
  llama_token generated[4096];
  int count = 0;
  for (; count < n; ++count) {
    if (llama_decode(ctx, batch) != 0) {
      fprintf(stderr, "llama_decode failed\n");
      return 1;
    }
    llama_token next = llama_sampler_sample(sampler, ctx, -1);
    generated[count] = next;
    if (llama_vocab_is_eog(vocab, next)) {
      ++count;
      break;
    }
    batch = llama_batch_get_one(&generated[count], 1);
  }
  printf("ids:");
  for (int i = 0; i < count; ++i) printf(" %d", generated[i]);
  printf("\ntext: ");
  for (int i = 0; i < count; ++i) {
    char piece[256];
    const int len = llama_token_to_piece(vocab, generated[i], piece, sizeof piece, 0, true);
    if (len > 0) fwrite(piece, 1, (size_t)len, stdout);
  }
  printf("\n");
  llama_sampler_free(sampler);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}

// Warnings and errors only: bench's load time is not llama.cpp writing a thousand debug lines to stderr
static void quiet_log(enum ggml_log_level level, const char* text, void* user_data) {
  (void)user_data;
  if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static double now_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// This process's peak resident memory so far (VmHWM, bytes): of its own image, unlike getrusage's ru_maxrss, which
// after a posix_spawn also holds the parent's resident memory at the time
static long long peak_rss_bytes(void) {
  FILE* status = fopen("/proc/self/status", "r");
  char line[256];
  long long kib = -1;
  while (status && fgets(line, sizeof line, status))
    if (strncmp(line, "VmHWM:", 6) == 0) kib = atoll(line + 6);
  if (status) fclose(status);
  return kib < 0 ? -1 : kib * 1024;
}

// Prompt token i of qkv_gguf_bench's prompts
static llama_token prompt_token(int i, int vocab_size) { return (llama_token)(((long long)i * 7919 + 11) % vocab_size); }

// What llama-bench measures, on prompts of token ids (no tokenizer): load, generation after a short prompt (from the
// first new token to the last: decode steps only), and a long prompt decoded as one batch. Generation does not stop
// at an end-of-text token (random weights may pick one).
static int bench(const char* model_path, int n_prompt, int n_gen, int threads, int n_short) {
  if (n_prompt < 1 || n_gen < 2 || threads < 1 || n_short < 1 || n_prompt > 65536 || n_gen > 65536 || n_short > 65536) {
    fprintf(stderr, "bench: PROMPT_TOKENS, SHORT_PROMPT ≥ 1, GEN_TOKENS ≥ 2, THREADS ≥ 1 (all ≤ 65536)\n");
    return 2;
  }
  llama_log_set(quiet_log, NULL);
  const double load_began = now_seconds();
  struct llama_model_params model_params = llama_model_default_params();
  struct llama_model* model = llama_model_load_from_file(model_path, model_params);
  if (!model) {
    fprintf(stderr, "llama.cpp could not load %s\n", model_path);
    return 1;
  }
  const int vocab_size = llama_vocab_n_tokens(llama_model_get_vocab(model));
  const int longest = n_prompt > n_short ? n_prompt : n_short;
  struct llama_context_params ctx_params = llama_context_default_params();
  ctx_params.n_ctx = (uint32_t)((n_prompt > n_short + n_gen ? n_prompt : n_short + n_gen) + 16);
  ctx_params.n_batch = (uint32_t)longest;
  ctx_params.n_ubatch = (uint32_t)longest;
  ctx_params.n_threads = threads;
  ctx_params.n_threads_batch = threads;
  if (g_kv_type_set) set_kv_type(&ctx_params, g_kv_type);
  printf("kv cache: %s\n", ggml_type_name(ctx_params.type_k));
  struct llama_context* ctx = llama_init_from_model(model, ctx_params);
  if (!ctx) {
    fprintf(stderr, "llama.cpp could not make a context\n");
    return 1;
  }
  const double load_seconds = now_seconds() - load_began;
  char desc[256];
  llama_model_desc(model, desc, sizeof desc);
  printf("model: %s\n", desc);
  struct llama_sampler* sampler = llama_sampler_chain_init(llama_sampler_chain_default_params());
  llama_sampler_chain_add(sampler, llama_sampler_init_greedy());
  llama_token* tokens = malloc(sizeof(llama_token) * (size_t)(longest + n_gen));
  for (int i = 0; i < longest; ++i) tokens[i] = prompt_token(i, vocab_size);

  // Generation: the short prompt, then one token per llama_decode
  llama_token* generated = tokens + longest;
  if (llama_decode(ctx, llama_batch_get_one(tokens, n_short)) != 0) goto failed;
  generated[0] = llama_sampler_sample(sampler, ctx, -1);
  const double first = now_seconds();
  for (int i = 1; i < n_gen; ++i) {
    if (llama_decode(ctx, llama_batch_get_one(&generated[i - 1], 1)) != 0) goto failed;
    generated[i] = llama_sampler_sample(sampler, ctx, -1);
  }
  const double gen_seconds = now_seconds() - first;
  const long long rss = peak_rss_bytes();  // after loading and generating, as qkv_gguf_bench reads qkv's

  // Prompt processing: a fresh cache, the long prompt in one batch
  llama_memory_clear(llama_get_memory(ctx), true);
  const double pp_began = now_seconds();
  if (llama_decode(ctx, llama_batch_get_one(tokens, n_prompt)) != 0) goto failed;
  llama_synchronize(ctx);
  const double pp_seconds = now_seconds() - pp_began;

  printf("ids:");
  for (int i = 0; i < n_gen; ++i) printf(" %d", generated[i]);
  printf("\nresult load_s=%.4f pp_tok_s=%.3f gen_tok_s=%.3f rss=%lld\n", load_seconds, n_prompt / pp_seconds,
         (n_gen - 1) / gen_seconds, rss);
  free(tokens);
  llama_sampler_free(sampler);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
failed:
  fprintf(stderr, "llama_decode failed\n");
  return 1;
}

// Each FILE's bytes through llama_tokenize (add_special and parse_special both true, or both false with
// --no-special), the model loaded vocab-only: one "ids: [a, b, …]" line per file, in order.
static int tokenize(const char* model_path, int special, char** files, int n_files) {
  struct llama_model_params model_params = llama_model_default_params();
  model_params.vocab_only = true;
  struct llama_model* model = llama_model_load_from_file(model_path, model_params);
  if (!model) {
    fprintf(stderr, "llama.cpp could not load %s\n", model_path);
    return 1;
  }
  const struct llama_vocab* vocab = llama_model_get_vocab(model);
  for (int f = 0; f < n_files; ++f) {
    FILE* in = fopen(files[f], "rb");
    if (!in) {
      fprintf(stderr, "cannot read %s\n", files[f]);
      return 1;
    }
    fseek(in, 0, SEEK_END);
    const long size = ftell(in);
    fseek(in, 0, SEEK_SET);
    char* text = malloc((size_t)size + 1);
    const size_t got = fread(text, 1, (size_t)size, in);
    fclose(in);
    const int capacity = (int)got + 16;
    llama_token* tokens = malloc(sizeof(llama_token) * (size_t)capacity);
    const int n = llama_tokenize(vocab, text, (int32_t)got, tokens, capacity, special, special);
    if (n < 0) {
      fprintf(stderr, "llama_tokenize failed on %s\n", files[f]);
      return 1;
    }
    printf("ids: [");
    for (int i = 0; i < n; ++i) printf(i ? ", %d" : "%d", tokens[i]);
    printf("]\n");
    free(tokens);
    free(text);
  }
  llama_model_free(model);
  return 0;
}

// Loads a model for `kl` with a context of `context` tokens whose every position returns logits; NULL on failure.
static struct llama_context* kl_context(const char* path, struct llama_model** model, int context, int threads) {
  struct llama_model_params model_params = llama_model_default_params();
  *model = llama_model_load_from_file(path, model_params);
  if (!*model) {
    fprintf(stderr, "llama.cpp could not load %s\n", path);
    return NULL;
  }
  struct llama_context_params ctx_params = llama_context_default_params();
  ctx_params.n_ctx = ctx_params.n_batch = ctx_params.n_ubatch = (uint32_t)context;
  ctx_params.n_threads = ctx_params.n_threads_batch = threads;
  set_kv_type(&ctx_params, g_kv_type_set ? g_kv_type : GGML_TYPE_F32);
  struct llama_context* ctx = llama_init_from_model(*model, ctx_params);
  if (!ctx) fprintf(stderr, "llama.cpp could not make a context for %s\n", path);
  return ctx;
}

// log Σ exp(x), in double
static double log_sum_exp(const float* x, int n) {
  double top = x[0], sum = 0;
  for (int i = 1; i < n; ++i) top = x[i] > top ? x[i] : top;
  for (int i = 0; i < n; ++i) sum += exp((double)x[i] - top);
  return top + log(sum);
}

static int argmax(const float* x, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

static int compare_doubles(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

// What quantizing loses, measured by llama.cpp's own forward passes: both models over N_TOKENS prompt tokens (i·7919 +
// 11 mod the vocabulary, as bench feeds them) in windows of CONTEXT tokens that do not overlap, each from an empty
// cache, every position's next-token distribution compared, as qkv's nn::next_token_divergence defines it (KL(base ‖
// quantized) in double, its mean, median, 99th percentile and largest; top-1 agreement; both perplexities over the
// positions whose next token is in the same window). llama-perplexity --kl-divergence scores only the second half of
// each window; this scores every position, so that both programs' figures are of one definition.
static int kl(const char* base_path, const char* quant_path, int n_tokens, int context, int threads) {
  if (n_tokens < 2 || context < 1 || threads < 1 || n_tokens > 1 << 20 || context > 65536) {
    fprintf(stderr, "kl: N_TOKENS ≥ 2 (≤ 2^20), CONTEXT 1 … 65536, THREADS ≥ 1\n");
    return 2;
  }
  llama_log_set(quiet_log, NULL);
  struct llama_model *base = NULL, *quant = NULL;
  struct llama_context* base_ctx = kl_context(base_path, &base, context, threads);
  struct llama_context* quant_ctx = base_ctx ? kl_context(quant_path, &quant, context, threads) : NULL;
  if (!quant_ctx) return 1;
  const int V = llama_vocab_n_tokens(llama_model_get_vocab(base));
  if (llama_vocab_n_tokens(llama_model_get_vocab(quant)) != V) {
    fprintf(stderr, "the models' vocabularies differ in size\n");
    return 1;
  }
  printf("kv cache: %s\n", ggml_type_name(g_kv_type_set ? g_kv_type : GGML_TYPE_F32));
  double* kls = malloc(sizeof(double) * (size_t)n_tokens);
  struct llama_batch batch = llama_batch_init(context, 0, 1);
  long long agree = 0, scored = 0, positions = 0;
  double nll = 0, base_nll = 0;
  for (int start = 0; start < n_tokens; start += context) {
    const int T = n_tokens - start < context ? n_tokens - start : context;
    batch.n_tokens = T;
    for (int t = 0; t < T; ++t) {
      batch.token[t] = prompt_token(start + t, V);
      batch.pos[t] = t;
      batch.n_seq_id[t] = 1;
      batch.seq_id[t][0] = 0;
      batch.logits[t] = 1;
    }
    llama_memory_clear(llama_get_memory(base_ctx), true);
    llama_memory_clear(llama_get_memory(quant_ctx), true);
    if (llama_decode(base_ctx, batch) != 0 || llama_decode(quant_ctx, batch) != 0) {
      fprintf(stderr, "llama_decode failed\n");
      return 1;
    }
    for (int t = 0; t < T; ++t) {
      const float* r = llama_get_logits_ith(base_ctx, t);
      const float* q = llama_get_logits_ith(quant_ctx, t);
      const double lr = log_sum_exp(r, V), lq = log_sum_exp(q, V);
      double sum = 0;
      for (int i = 0; i < V; ++i) {
        const double log_p = r[i] - lr;
        sum += exp(log_p) * (log_p - (q[i] - lq));
      }
      kls[positions++] = sum > 0 ? sum : 0;
      agree += argmax(r, V) == argmax(q, V);
      if (t + 1 < T) {
        const int next = batch.token[t + 1];
        nll += lq - q[next];
        base_nll += lr - r[next];
        ++scored;
      }
    }
    fprintf(stderr, "kl: %d of %d tokens\n", start + T, n_tokens);
  }
  double mean = 0;
  for (long long i = 0; i < positions; ++i) mean += kls[i];
  mean /= (double)positions;
  qsort(kls, (size_t)positions, sizeof(double), compare_doubles);
  long long p99 = (long long)(0.99 * (double)positions);
  if (p99 > positions - 1) p99 = positions - 1;
  printf("result positions=%lld mean_kl=%.6e median_kl=%.6e p99_kl=%.6e max_kl=%.6e top1=%.6f perplexity=%.3f "
         "reference_perplexity=%.3f\n", positions, mean, kls[positions / 2], kls[p99], kls[positions - 1],
         (double)agree / (double)positions, scored ? exp(nll / (double)scored) : 0.0,
         scored ? exp(base_nll / (double)scored) : 0.0);
  free(kls);
  llama_batch_free(batch);
  llama_free(base_ctx);
  llama_free(quant_ctx);
  llama_model_free(base);
  llama_model_free(quant);
  return 0;
}

int main(int argc, char** argv) {
  const char* variant = NULL;
  int a = 1;
  if (a + 1 < argc && strcmp(argv[a], "--cpu") == 0) {
    variant = argv[a + 1];
    a += 2;
  }
  if (a + 1 < argc && strcmp(argv[a], "--kv-cache") == 0) {
    if (!kv_type_of(argv[a + 1], &g_kv_type)) {
      fprintf(stderr, "--kv-cache %s: not f32, f16, bf16 or q8_0\n", argv[a + 1]);
      return 2;
    }
    g_kv_type_set = 1;
    a += 2;
  }
  if (a >= argc) {
    fprintf(stderr, "usage: llamacpp [--cpu VARIANT] [--kv-cache TYPE] quantize IN OUT TYPE [THREADS] | generate MODEL PROMPT N [THREADS] | "
                    "tokenize MODEL [--no-special] FILE... | bench MODEL PROMPT_TOKENS GEN_TOKENS THREADS [SHORT_PROMPT] | "
                    "kl BASE QUANTIZED N_TOKENS CONTEXT [THREADS]\n");
    return 2;
  }
  load_backends(variant);  // before llama_backend_init, which would search only the program's folder and the cwd
  llama_backend_init();
  int status = 2;
  if (strcmp(argv[a], "quantize") == 0 && argc - a >= 4) {
    status = quantize(argv[a + 1], argv[a + 2], argv[a + 3], argc - a > 4 ? atoi(argv[a + 4]) : 1);
  } else if (strcmp(argv[a], "tokenize") == 0 && argc - a >= 3) {
    const int special = strcmp(argv[a + 2], "--no-special") != 0;
    const int first = a + (special ? 2 : 3);
    status = tokenize(argv[a + 1], special, argv + first, argc - first);
  } else if (strcmp(argv[a], "generate") == 0 && argc - a >= 4) {
    status = generate(argv[a + 1], argv[a + 2], atoi(argv[a + 3]), argc - a > 4 ? atoi(argv[a + 4]) : 1);
  } else if (strcmp(argv[a], "bench") == 0 && argc - a >= 5) {
    status = bench(argv[a + 1], atoi(argv[a + 2]), atoi(argv[a + 3]), atoi(argv[a + 4]), argc - a > 5 ? atoi(argv[a + 5]) : 16);
  } else if (strcmp(argv[a], "kl") == 0 && argc - a >= 5) {
    status = kl(argv[a + 1], argv[a + 2], atoi(argv[a + 3]), atoi(argv[a + 4]), argc - a > 5 ? atoi(argv[a + 5]) : 1);
  } else {
    fprintf(stderr, "unknown command or missing arguments\n");
  }
  llama_backend_free();
  return status;
}
