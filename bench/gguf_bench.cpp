// qkv against llama.cpp on the same GGUF file, in one run (issue 41's targets): random-weight models of Qwen3-0.6B's or
// Llama-3.2-1B's shape, written as GGUF by qkv's own quantizer (nn::quantize_to_gguf, what `qkv quantize` does), then
// per type and thread count, qkv and llama.cpp (node-llama-cpp's prebuilt libllama, through tools/llamacpp.sh bench)
// alternating, each run a fresh child process, medians of --repeats:
//   - generation: 128 greedy tokens after a 16-token prompt, tokens/s from the first new token to the last, against
//     the memory-bound limit (bytes read per token ÷ the read bandwidth measured here, on the same threads);
//   - prompt processing: 512 tokens in one call, tokens/s;
//   - load (qkv: load_pretrained of the .gguf, tokenizer included) against reading the file from a warm page cache;
//   - peak RSS of the child after loading and generating (its VmHWM), against the file + the KV cache (qkv's);
//   - how many of the greedy tokens the two agree on.
//   qkv_gguf_bench [--shape qwen3-0.6b|llama-3.2-1b|gpt-oss-4l] [--types q8_0,q4_0,q4_k_m,mxfp4_moe] [--threads 1,2]
//                  [--repeats 3] [--dir DIR] [--llamacpp PATH] [--cpu VARIANT] [--prompt 512] [--tokens 128] [--smoke]
//                  [--kv-cache f32|f16|bf16|q8_0]  (both programs' KV cache; without it each runs its default: qkv f32,
//                  llama.cpp f16)
//   qkv_gguf_bench --kl [--types …] [--threads 2] [--kl-tokens 512] [--kl-context 256]   instead of speed: what each type
//                  loses, KL(F32 file ‖ type's file) measured by qkv and by llama.cpp on the same tokens (kl_table)
//   --logit-scale S: the random model's token embedding (and head) × S, in a folder of its own (make_folder)
// mxfp4_moe: the experts as MXFP4, the other matrices Q8_0 (how gpt-oss is published; qkv's file has llama.cpp's bytes);
// gpt-oss-4l is gpt-oss-20b's layers, 4 of them with 16 experts.
// Prompts are token ids, (i·7919 + 11) mod the vocabulary, in both programs: no tokenizer is involved. Not a test: it
// prints figures; tests/test_gguf_export.cpp checks that llama.cpp loads qkv's files and agrees with them.
#include <fcntl.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "hf_shapes.hpp"
#include "peak.hpp"
#include "qkv/core/error.hpp"
#include "qkv/io/gguf.hpp"
#include "qkv/kernels/threads.hpp"
#include "qkv/nn/divergence.hpp"
#include "qkv/nn/gguf_export.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/nn/pretrained.hpp"
#include "qkv/nn/session.hpp"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

// Prompt token i, as tools/llamacpp.c bench makes it
int64_t prompt_token(int64_t i, int64_t vocab) { return (i * 7919 + 11) % vocab; }

// GPT-2's byte-to-character table (bytes_to_unicode): printable bytes stand for themselves, the rest from U+0100 on.
std::string byte_char(int b) {
  auto printable = [](int x) { return (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255); };
  int code = b;
  if (!printable(b)) {
    code = 256;
    for (int x = 0; x < b; ++x) code += !printable(x);
  }
  std::string s;
  if (code < 0x80) s += static_cast<char>(code);
  else s += static_cast<char>(0xC0 | (code >> 6)), s += static_cast<char>(0x80 | (code & 0x3F));
  return s;
}

// A byte-level BPE tokenizer.json as Qwen's is built (its Split regex, ByteLevel) whose ids reach the model's vocabulary:
// the 256 bytes, one merge, special tokens at config.json's bos and eos ids and at the last id, and words "w<id>" that
// no merge makes at every other id, so a GGUF of it holds vocab_size tokens. Enough for llama.cpp to load the file;
// the benchmark feeds token ids, so how it tokenizes text does not matter.
void write_tokenizer(const fs::path& dir, const json& config) {
  const int64_t vocab_size = config["vocab_size"];
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  vocab["\xC4\xA0t"] = 256;  // "Ġt"
  std::map<int64_t, std::string> specials;
  auto ids = [](const json& v) {
    std::vector<int64_t> out;
    if (v.is_number_integer()) out.push_back(v.get<int64_t>());
    if (v.is_array())
      for (const json& x : v) out.push_back(x.get<int64_t>());
    return out;
  };
  for (int64_t id : ids(config.value("bos_token_id", json()))) specials[id] = "<|begin_of_text|>";
  for (int64_t id : ids(config.value("eos_token_id", json()))) specials[id] = "<|end_" + std::to_string(id) + "|>";
  specials.try_emplace(vocab_size - 1, "<|reserved_last|>");
  // Every other id a word no merge makes (qkv's reader refuses large gaps in the ids)
  for (int64_t id = 257; id < vocab_size; ++id)
    if (!specials.count(id)) vocab["w" + std::to_string(id)] = id;
  json added = json::array();
  for (const auto& [id, content] : specials)
    added.push_back({{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", true}});
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  const json tokenizer = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array({{{"type", "Split"},
                       {"pattern", {{"Regex", R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
                       {"behavior", "Isolated"}, {"invert", false}},
                      byte_level})}}},
      {"post_processor", byte_level},
      {"decoder", byte_level},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"byte_fallback", false},
                 {"vocab", vocab}, {"merges", json::array({"\xC4\xA0 t"})}}}};
  std::ofstream(dir / "tokenizer.json") << tokenizer.dump();
  const auto eos = ids(config.value("eos_token_id", json()));
  const json tokenizer_config = {{"eos_token", eos.empty() ? json() : json(specials[eos[0]])}, {"bos_token", nullptr},
                                 {"add_bos_token", false}};
  std::ofstream(dir / "tokenizer_config.json") << tokenizer_config.dump();
}

// Child: the Hugging Face folder of random weights (as decoder_bench makes it) with its tokenizer. With `logit_scale`
// ≠ 1, the token embedding (the head too, when tied) is multiplied by it: random weights give logits of standard
// deviation ~0.6 and nearly uniform distributions, which make a weak test of what quantizing loses; ×8 gives peaked
// ones, closer to a trained model's.
int make_folder(const std::string& shape, const fs::path& dir, bool smoke, double logit_scale) {
  const auto t = Clock::now();
  const std::string text = qkv::bench::config_json(shape, smoke);
  if (!fs::exists(dir / "model.safetensors")) {  // (a folder whose tokenizer is being rewritten keeps its weights)
    qkv::Generator gen(7);
    qkv::nn::Decoder model(qkv::nn::decoder_config_from_hf(text, shape + " config"), gen);
    if (logit_scale != 1.0) {
      float* table = model.tok_emb.data();
      for (int64_t i = 0; i < model.tok_emb.numel(); ++i) table[i] *= static_cast<float>(logit_scale);
      if (!model.config.tie_word_embeddings) {
        float* head = model.head.data();
        for (int64_t i = 0; i < model.head.numel(); ++i) head[i] *= static_cast<float>(logit_scale);
      }
    }
    qkv::nn::save_hf_folder(dir.string(), model);
    std::printf("made %s: %lld parameters, random weights, in %.1f s\n", dir.c_str(),
                static_cast<long long>(model.parameter_count()), since(t));
  }
  write_tokenizer(dir, json::parse(text));
  return 0;
}

// Child: the folder written as a GGUF file of `type` by qkv's quantizer
int quantize(const fs::path& dir, const std::string& type, const fs::path& out) {
  const auto t = Clock::now();
  qkv::nn::GgufExportOptions options;
  options.type = *qkv::nn::gguf_file_type_from_name(type);
  const auto report = qkv::nn::quantize_to_gguf(dir.string(), out.string(), options);
  std::string types;
  for (const auto& [name, count] : report.tensors_by_type) types += " " + std::to_string(count) + " " + name;
  std::printf("wrote %s: %.1f MiB (tensors:%s) in %.1f s\n", out.c_str(), static_cast<double>(report.file_bytes) / (1 << 20),
              types.c_str(), since(t));
  return 0;
}

// This process's peak resident memory so far (VmHWM, bytes; see proc_status_kb), or −1.
int64_t peak_rss_bytes() {
  const double kb = qkv::bench::proc_status_kb("VmHWM");
  return kb < 0 ? -1 : static_cast<int64_t>(kb) * 1024;
}

// Child: qkv on the file, as `qkv generate` runs it (load_pretrained, a Session, greedy): load, generate `gen` tokens
// after a `short_prompt`-token prompt, peak RSS so far, then a fresh `prompt`-token prompt. Prints "ids: …" and a
// "result …" line the parent reads.
int run_qkv(const std::string& file, int threads, int64_t prompt, int64_t gen, int64_t short_prompt,
            const std::string& kv_cache) {
  qkv::set_num_threads(threads);
  auto t = Clock::now();
  const auto pretrained = qkv::nn::load_pretrained(file);
  const double load_seconds = since(t);
  const int64_t vocab = pretrained->model->config.vocab_size;
  qkv::nn::SessionOptions options;
  if (!kv_cache.empty()) options.kv_type = *qkv::kernels::weight_type_from_name(kv_cache);
  qkv::nn::Session session(*pretrained->model, options);
  qkv::nn::GenerationRequest request;
  for (int64_t i = 0; i < short_prompt; ++i) request.prompt.push_back(prompt_token(i, vocab));
  request.max_new_tokens = gen;
  request.sampling.greedy = true;  // no stop ids: always `gen` tokens
  std::vector<Clock::time_point> stamps;
  const auto results = qkv::nn::generate(session, {request}, [&](size_t, int64_t) {
    stamps.push_back(Clock::now());
    return true;
  });
  const double gen_seconds = std::chrono::duration<double>(stamps.back() - stamps.front()).count();
  const int64_t kv_bytes = session.cache().bytes_allocated();
  const int64_t rss = peak_rss_bytes();

  request.prompt.clear();
  for (int64_t i = 0; i < prompt; ++i) request.prompt.push_back(prompt_token(i, vocab));
  request.max_new_tokens = 1;
  t = Clock::now();
  qkv::nn::generate(session, {request});
  const double pp_seconds = since(t);

  std::printf("ids:");
  for (int64_t id : results[0].tokens) std::printf(" %lld", static_cast<long long>(id));
  std::printf("\nresult load_s=%.4f pp_tok_s=%.3f gen_tok_s=%.3f rss=%lld kv_bytes=%lld\n", load_seconds,
              static_cast<double>(prompt) / pp_seconds, static_cast<double>(stamps.size() - 1) / gen_seconds,
              static_cast<long long>(rss), static_cast<long long>(kv_bytes));
  return 0;
}

// Child: qkv's nn::next_token_divergence (what `qkv eval --kl-reference` runs) of `file` against `reference` over
// `tokens` prompt tokens in windows of `context`; prints a "result …" line with tools/llamacpp.c kl's keys.
int run_kl(const std::string& reference, const std::string& file, int threads, int64_t tokens, int64_t context) {
  qkv::set_num_threads(threads);
  const auto base = qkv::nn::load_pretrained(reference);
  const auto model = qkv::nn::load_pretrained(file);
  const int64_t vocab = model->model->config.vocab_size;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < tokens; ++i) ids.push_back(prompt_token(i, vocab));
  const qkv::nn::Divergence d = qkv::nn::next_token_divergence(*base->model, *model->model, ids, context);
  std::printf("result positions=%lld mean_kl=%.6e median_kl=%.6e p99_kl=%.6e max_kl=%.6e top1=%.6f perplexity=%.3f "
              "reference_perplexity=%.3f\n", static_cast<long long>(d.positions), d.mean_kl, d.median_kl, d.p99_kl,
              d.max_kl, d.top1_agreement, d.perplexity, d.reference_perplexity);
  return 0;
}

// A child's exit status and output
struct ChildRun {
  int status = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Runs `args` with stdout and stderr into files (llama.cpp logs much to stderr), waits, and reads them back.
ChildRun run_captured(std::vector<std::string> args, const fs::path& scratch) {
  ChildRun run;
  const std::string out = (scratch / "child.out").string(), err = (scratch / "child.err").string();
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> cargs;
  for (auto& s : args) cargs.push_back(s.data());
  cargs.push_back(nullptr);
  pid_t pid;
  // posix_spawnp: the llama.cpp command may be a script found through its #! line
  if (posix_spawnp(&pid, cargs[0], &actions, nullptr, cargs.data(), environ) == 0) {
    int status = 0;
    if (waitpid(pid, &status, 0) >= 0 && WIFEXITED(status)) run.status = WEXITSTATUS(status);
  }
  posix_spawn_file_actions_destroy(&actions);
  run.out = slurp(out);
  run.err = slurp(err);
  return run;
}

// "key=value" from the output's "result …" line (NaN when absent)
double result_value(const std::string& out, const std::string& key) {
  const std::string text = "\n" + out;  // (the line may be the first)
  const size_t line = text.rfind("\nresult ");
  const size_t at = line == std::string::npos ? line : text.find(" " + key + "=", line);
  return at == std::string::npos ? std::nan("") : std::strtod(text.c_str() + at + key.size() + 2, nullptr);
}

std::vector<int64_t> result_ids(const std::string& out) {
  std::vector<int64_t> ids;
  const size_t at = out.find("ids:");
  if (at == std::string::npos) return ids;
  std::stringstream in(out.substr(at + 4, out.find('\n', at) - at - 4));
  for (long long id; in >> id;) ids.push_back(id);
  return ids;
}

std::string line_with(const std::string& out, const std::string& prefix) {
  const size_t at = out.find(prefix);
  return at == std::string::npos ? "" : out.substr(at + prefix.size(), out.find('\n', at) - at - prefix.size());
}

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Reads the file once to warm the page cache, then again, timed.
double read_file_seconds(const fs::path& path) {
  std::vector<char> chunk(1 << 24);
  double seconds = 0.0;
  for (int pass = 0; pass < 2; ++pass) {
    const auto t = Clock::now();
    std::ifstream in(path, std::ios::binary);
    while (in.read(chunk.data(), static_cast<std::streamsize>(chunk.size())) || in.gcount() > 0) {
    }
    seconds = since(t);
  }
  return seconds;
}

const char* mark(bool ok) { return ok ? "✔" : "✘"; }

// Makes dir/TYPE.gguf with qkv's quantizer unless it is there; false (and a message) when that fails.
bool ensure_file(const fs::path& dir, const std::string& type, const std::function<std::vector<std::string>(std::vector<std::string>)>& self) {
  const fs::path file = dir / (type + ".gguf");
  if (fs::exists(file)) return true;
  const ChildRun q = run_captured(self({"--quantize", type, file.string()}), dir);
  std::fputs(q.out.c_str(), stdout);
  if (q.status != 0) std::fprintf(stderr, "quantizing to %s failed:\n%s", type.c_str(), q.err.c_str());
  return q.status == 0;
}

// --kl: issue 41's quality target. Per type, the KL divergence of its next-token distributions from the F32 file's,
// measured by qkv (nn::next_token_divergence) and by llama.cpp (tools/llamacpp.c kl: llama.cpp's own forward passes
// of both files), over the same prompt tokens and windows, with one definition; the target is qkv's mean KL ≤ 1.05×
// llama.cpp's. Both are deterministic: one run each.
int kl_table(const fs::path& dir, const std::vector<std::string>& types, int threads, int64_t tokens, int64_t context,
             const std::string& llamacpp, const std::string& cpu, const std::string& kv_cache,
             const std::function<std::vector<std::string>(std::vector<std::string>)>& self) {
  if (!ensure_file(dir, "f32", self)) return 1;
  const std::string reference = (dir / "f32.gguf").string();
  const std::string kv = kv_cache.empty() ? "f32" : kv_cache;
  std::printf("\nWhat quantizing loses, qkv against llama.cpp: KL(F32 ‖ type) over %lld prompt tokens in windows of %lld, "
              "%d thread%s, llama.cpp's KV cache %s (qkv's forward pass keeps none)\n", static_cast<long long>(tokens),
              static_cast<long long>(context), threads, threads > 1 ? "s" : "", kv.c_str());
  const std::vector<std::string> keys = {"mean_kl", "median_kl", "p99_kl", "max_kl", "top1", "perplexity", "reference_perplexity"};
  struct Row {
    std::string type;
    std::map<std::string, double> qkv, ll;
  };
  std::vector<Row> rows;
  std::string cpu_library;
  for (const std::string& type : types) {
    if (!ensure_file(dir, type, self)) return 1;
    const std::string file = (dir / (type + ".gguf")).string();
    Row row{type, {}, {}};
    const ChildRun q = run_captured(self({"--run-kl", reference, file, std::to_string(threads)}), dir);
    if (q.status != 0) {
      std::fprintf(stderr, "qkv's KL on %s failed:\n%s", file.c_str(), q.err.c_str());
      return 1;
    }
    std::vector<std::string> args = {llamacpp};
    if (!cpu.empty()) args.insert(args.end(), {"--cpu", cpu});
    args.insert(args.end(), {"--kv-cache", kv, "kl", reference, file, std::to_string(tokens), std::to_string(context),
                             std::to_string(threads)});
    const ChildRun l = run_captured(args, dir);
    if (l.status != 0) {
      const std::string tail = l.err.size() > 2000 ? l.err.substr(l.err.size() - 2000) : l.err;
      std::printf("llama.cpp (%s) did not run (exit %d): its figures are left out\n%s\n", llamacpp.c_str(), l.status, tail.c_str());
    }
    if (cpu_library.empty()) cpu_library = line_with(l.out, "cpu library: ");
    for (const std::string& key : keys) row.qkv[key] = result_value(q.out, key), row.ll[key] = result_value(l.out, key);
    std::printf("  %s: mean KL qkv %.3e, llama.cpp %.3e\n", type.c_str(), row.qkv["mean_kl"], row.ll["mean_kl"]);
    std::fflush(stdout);
    rows.push_back(row);
  }
  std::printf("\nllama.cpp: %s, CPU library %s\n", llamacpp.c_str(), cpu_library.empty() ? "(not run)" : cpu_library.c_str());
  std::printf("\n%-7s | %-42s | %-42s | %s\n", "type", "qkv: mean KL, median, 99%, top-1", "llama.cpp: mean KL, median, 99%, top-1",
              "mean KL qkv / llama.cpp");
  for (Row& r : rows) {
    const double ratio = r.qkv["mean_kl"] / r.ll["mean_kl"];
    std::printf("%-7s | %9.3e %9.3e %9.3e %6.1f%% | %9.3e %9.3e %9.3e %6.1f%% | %.3f %s\n", r.type.c_str(), r.qkv["mean_kl"],
                r.qkv["median_kl"], r.qkv["p99_kl"], 100 * r.qkv["top1"], r.ll["mean_kl"], r.ll["median_kl"],
                r.ll["p99_kl"], 100 * r.ll["top1"], ratio, mark(ratio <= 1.05));
  }
  std::printf("\n%-7s | %-36s | %s\n", "type", "perplexity: qkv, llama.cpp", "F32's perplexity: qkv, llama.cpp");
  for (Row& r : rows)
    std::printf("%-7s | %12.1f %12.1f           | %12.1f %12.1f\n", r.type.c_str(), r.qkv["perplexity"], r.ll["perplexity"],
                r.qkv["reference_perplexity"], r.ll["reference_perplexity"]);
  std::printf("target: qkv's mean KL <= 1.05x llama.cpp's on the same file\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape = "qwen3-0.6b", dir_arg, types_arg = "q8_0,q4_0,q4_k_m", threads_arg = "1,2", llamacpp, cpu, kv_cache;
  int repeats = 3;
  int64_t prompt = 512, tokens = 128, short_prompt = 16;
  int64_t kl_tokens = 512, kl_context = 256;
  double logit_scale = 1.0;
  bool smoke = false, kl = false;
  std::string mode, child_file, child_type, child_reference;
  int child_threads = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--shape") shape = next();
    else if (a == "--dir") dir_arg = next();
    else if (a == "--types") types_arg = next();
    else if (a == "--threads") threads_arg = next();
    else if (a == "--repeats") repeats = std::stoi(next());
    else if (a == "--llamacpp") llamacpp = next();
    else if (a == "--cpu") cpu = next();
    else if (a == "--kv-cache") kv_cache = next();
    else if (a == "--prompt") prompt = std::stoll(next());
    else if (a == "--tokens") tokens = std::stoll(next());
    else if (a == "--smoke") smoke = true;
    else if (a == "--kl") kl = true;
    else if (a == "--kl-tokens") kl_tokens = std::stoll(next());
    else if (a == "--kl-context") kl_context = std::stoll(next());
    else if (a == "--logit-scale") logit_scale = std::stod(next());
    else if (a == "--make") mode = "make";
    else if (a == "--quantize") mode = "quantize", child_type = next(), child_file = next();
    else if (a == "--run-qkv") mode = "run-qkv", child_file = next(), child_threads = std::stoi(next());
    else if (a == "--run-kl") mode = "run-kl", child_reference = next(), child_file = next(), child_threads = std::stoi(next());
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (qkv::bench::config_json(shape, smoke).empty() || shape == "gemma-3-270m") {
    std::fprintf(stderr, "unknown --shape %s: qwen3-0.6b, llama-3.2-1b or gpt-oss-4l\n", shape.c_str());
    return 2;
  }
  if (smoke) {  // every step once, on a tiny model
    repeats = 1, prompt = 32, tokens = 8, short_prompt = 4;
    threads_arg = "1";
  }
  if (!kv_cache.empty() && kv_cache != "f32" && kv_cache != "f16" && kv_cache != "bf16" && kv_cache != "q8_0") {
    std::fprintf(stderr, "--kv-cache %s: not f32, f16, bf16 or q8_0\n", kv_cache.c_str());
    return 2;
  }
  if (smoke) kl_tokens = 48, kl_context = 32;
  if (repeats < 1 || prompt < 1 || tokens < 2 || kl_tokens < 2 || kl_context < 1) {
    std::fprintf(stderr, "--repeats, --prompt and --kl-context must be >= 1, --tokens and --kl-tokens >= 2\n");
    return 2;
  }
  const std::vector<std::string> types = split(types_arg, ',');
  for (const std::string& type : types)
    if (!qkv::nn::gguf_file_type_from_name(type)) {
      std::fprintf(stderr, "--types: %s is not one of %s\n", type.c_str(), qkv::nn::gguf_file_type_names().c_str());
      return 2;
    }
  std::vector<int> thread_counts;
  for (const std::string& t : split(threads_arg, ',')) thread_counts.push_back(std::max(1, std::stoi(t)));
  if (thread_counts.empty()) thread_counts.push_back(1);
  if (llamacpp.empty()) llamacpp = std::string(QKV_SOURCE_DIR) + "/tools/llamacpp.sh";
  if (!(logit_scale > 0) || logit_scale > 1000) {
    std::fprintf(stderr, "--logit-scale %g: give a factor in (0, 1000]\n", logit_scale);
    return 2;
  }
  char scale_name[32];
  std::snprintf(scale_name, sizeof scale_name, "_logits%g", logit_scale);
  const fs::path dir = dir_arg.empty() ? fs::temp_directory_path() / ("qkv_gguf_bench_" + (smoke ? "smoke" : shape) +
                                                                     (logit_scale != 1.0 ? scale_name : ""))
                                       : fs::path(dir_arg);

  try {
    if (mode == "make") return make_folder(shape, dir, smoke, logit_scale);
    if (mode == "quantize") return quantize(dir, child_type, child_file);
    if (mode == "run-qkv") return run_qkv(child_file, child_threads, prompt, tokens, short_prompt, kv_cache);
    if (mode == "run-kl") return run_kl(child_reference, child_file, child_threads, kl_tokens, kl_context);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkv_gguf_bench: %s\n", e.what());
    return 1;
  }

  fs::create_directories(dir);
  auto self = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {argv[0], "--shape", shape, "--dir", dir.string(), "--prompt", std::to_string(prompt),
                                     "--tokens", std::to_string(tokens), "--kl-tokens", std::to_string(kl_tokens),
                                     "--kl-context", std::to_string(kl_context), "--logit-scale", std::to_string(logit_scale)};
    if (smoke) args.push_back("--smoke");
    if (!kv_cache.empty()) args.insert(args.end(), {"--kv-cache", kv_cache});
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  if (!fs::exists(dir / "tokenizer.json") && qkv::bench::run_child(self({"--make"})) != 0) return 1;
  if (kl)
    return kl_table(dir, types, *std::max_element(thread_counts.begin(), thread_counts.end()), kl_tokens, kl_context,
                    llamacpp, cpu, kv_cache, self);

  std::printf("\nqkv against llama.cpp on the same GGUF files: %s shape, random weights, %d repeats (medians), "
              "generation of %lld tokens after %lld, prompt of %lld\n", smoke ? "smoke" : shape.c_str(), repeats,
              static_cast<long long>(tokens), static_cast<long long>(short_prompt), static_cast<long long>(prompt));
  double load_average[3] = {0, 0, 0};
  if (getloadavg(load_average, 3) == 3) std::printf("load average at the start: %.2f %.2f %.2f\n", load_average[0], load_average[1], load_average[2]);

  struct Row {
    std::string type;
    int threads;
    double qkv_gen, ll_gen, qkv_pp, ll_pp, limit, bandwidth, bytes_per_token, qkv_load, ll_load, read_s, qkv_rss, ll_rss;
    double file_bytes, kv_bytes;
    int64_t agree_prefix = 0, agree_total = 0, compared = 0;
  };
  std::vector<Row> rows;
  bool llama_ok = true;
  std::string cpu_library, llama_kv;
  for (const std::string& type : types) {
    const fs::path file = dir / (type + ".gguf");
    if (!ensure_file(dir, type, self)) return 1;
    const qkv::io::GgufFile gguf = qkv::io::GgufFile::open(file.string());
    // The bytes of the matrices one token reads: every rank-2 tensor, but the token embedding only when it is also the
    // head (one row of it is looked up otherwise); of a layer's experts (rank 3), the share a token chooses, k of E.
    double matrices = 0;
    const bool untied = gguf.find("output.weight") != nullptr;
    const std::string arch = gguf.string("general.architecture");
    const double chosen = gguf.contains(arch + ".expert_count")
                              ? static_cast<double>(gguf.integer(arch + ".expert_used_count")) / static_cast<double>(gguf.integer(arch + ".expert_count"))
                              : 1.0;
    for (const auto& t : gguf.tensors()) {
      if (t.dims.size() == 2 && !(untied && t.name == "token_embd.weight")) matrices += static_cast<double>(t.bytes);
      if (t.dims.size() == 3) matrices += chosen * static_cast<double>(t.bytes);
    }
    const double file_bytes = static_cast<double>(fs::file_size(file));
    const double read_seconds = read_file_seconds(file);
    for (int threads : thread_counts) {
      qkv::set_num_threads(threads);
      const double bandwidth = qkv::bench::read_bandwidth(smoke ? (int64_t{64} << 20) : (int64_t{512} << 20));
      std::vector<double> qg, lg, qp, lp, ql, ll, qr, lr, kv;
      std::vector<int64_t> qkv_ids, llama_ids;
      for (int rep = 0; rep < repeats; ++rep) {
        // alternate which program goes first, so a drift in the machine's load falls on both
        for (int turn = 0; turn < 2; ++turn) {
          if ((turn == 0) == (rep % 2 == 0)) {
            const ChildRun r = run_captured(self({"--run-qkv", file.string(), std::to_string(threads)}), dir);
            if (r.status != 0) {
              std::fprintf(stderr, "qkv on %s failed:\n%s", file.c_str(), r.err.c_str());
              return 1;
            }
            qg.push_back(result_value(r.out, "gen_tok_s")), qp.push_back(result_value(r.out, "pp_tok_s"));
            ql.push_back(result_value(r.out, "load_s")), qr.push_back(result_value(r.out, "rss"));
            kv.push_back(result_value(r.out, "kv_bytes"));
            if (qkv_ids.empty()) qkv_ids = result_ids(r.out);
          } else if (llama_ok) {
            std::vector<std::string> args = {llamacpp};
            if (!cpu.empty()) args.insert(args.end(), {"--cpu", cpu});
            if (!kv_cache.empty()) args.insert(args.end(), {"--kv-cache", kv_cache});
            args.insert(args.end(), {"bench", file.string(), std::to_string(prompt), std::to_string(tokens),
                                     std::to_string(threads), std::to_string(short_prompt)});
            const ChildRun r = run_captured(args, dir);
            if (r.status != 0) {
              std::string tail = r.err.size() > 2000 ? r.err.substr(r.err.size() - 2000) : r.err;
              std::printf("llama.cpp (%s) did not run (exit %d): its figures are left out\n%s\n", llamacpp.c_str(),
                          r.status, tail.c_str());
              llama_ok = false;
              continue;
            }
            if (cpu_library.empty()) cpu_library = line_with(r.out, "cpu library: ");
            if (llama_kv.empty()) llama_kv = line_with(r.out, "kv cache: ");
            lg.push_back(result_value(r.out, "gen_tok_s")), lp.push_back(result_value(r.out, "pp_tok_s"));
            ll.push_back(result_value(r.out, "load_s"));
            lr.push_back(result_value(r.out, "rss"));
            if (llama_ids.empty()) llama_ids = result_ids(r.out);
          }
        }
      }
      Row row{type, threads, median(qg), median(lg), median(qp), median(lp), 0, bandwidth, 0, median(ql), median(ll),
              read_seconds, median(qr), median(lr), file_bytes, median(kv)};
      // Per token: the matrices, and on average half of the final KV cache (qkv's, of its --kv-cache type) read
      row.bytes_per_token = matrices + 0.5 * row.kv_bytes;
      row.limit = bandwidth / row.bytes_per_token;
      row.compared = static_cast<int64_t>(std::min(qkv_ids.size(), llama_ids.size()));
      for (int64_t i = 0; i < row.compared; ++i) {
        const bool same = qkv_ids[static_cast<size_t>(i)] == llama_ids[static_cast<size_t>(i)];
        row.agree_total += same;
        if (same && row.agree_prefix == i) ++row.agree_prefix;
      }
      rows.push_back(row);
      std::printf("  %s, %d thread%s: qkv %.2f tok/s generating, %.1f prompt; llama.cpp %.2f, %.1f\n", type.c_str(),
                  threads, threads > 1 ? "s" : "", row.qkv_gen, row.qkv_pp, row.ll_gen, row.ll_pp);
      std::fflush(stdout);
    }
  }

  std::printf("\nllama.cpp: %s, CPU library %s\n", llamacpp.c_str(), cpu_library.empty() ? "(not run)" : cpu_library.c_str());
  std::printf("KV cache: qkv %s, llama.cpp %s%s\n", kv_cache.empty() ? "f32" : kv_cache.c_str(),
              llama_kv.empty() ? "(not run)" : llama_kv.c_str(),
              kv_cache.empty() ? " (each program's default; --kv-cache sets both)" : "");
  std::printf("\n%-7s %2s | %-44s | %-29s\n", "type", "t", "generation tok/s: qkv, llama.cpp, ratio, % of limit",
              "prompt tok/s: qkv, llama.cpp, ratio");
  for (const Row& r : rows) {
    const double gen_ratio = r.qkv_gen / r.ll_gen, pp_ratio = r.qkv_pp / r.ll_pp, of_limit = 100.0 * r.qkv_gen / r.limit;
    std::printf("%-7s %2d | %6.2f %6.2f %5.2fx %s  %4.0f%% (llama.cpp %3.0f%%) %s | %6.1f %6.1f %5.2fx %s\n",
                r.type.c_str(), r.threads, r.qkv_gen, r.ll_gen, gen_ratio, mark(gen_ratio >= 1.1), of_limit,
                100.0 * r.ll_gen / r.limit, mark(of_limit >= 85.0), r.qkv_pp, r.ll_pp, pp_ratio, mark(pp_ratio >= 1.0));
  }
  std::printf("\n%-7s %2s | %-58s | %-40s | %s\n", "type", "t", "memory-bound limit: bytes/token, bandwidth, tok/s",
              "peak RSS MiB: qkv (÷ file+KV), llama.cpp", "load s: qkv (÷ read), llama.cpp, read");
  for (const Row& r : rows) {
    const double rss_ratio = r.qkv_rss / (r.file_bytes + r.kv_bytes), load_ratio = r.qkv_load / r.read_s;
    std::printf("%-7s %2d | %7.1f MB/token, %5.1f GB/s read -> %6.1f tok/s            | %6.0f (%.2fx %s) %6.0f     "
                "         | %.3f (%.2fx %s) %.3f %.3f\n", r.type.c_str(), r.threads, r.bytes_per_token / 1e6,
                r.bandwidth / 1e9, r.limit, r.qkv_rss / (1 << 20), rss_ratio, mark(rss_ratio <= 1.1),
                r.ll_rss / (1 << 20), r.qkv_load, load_ratio, mark(load_ratio <= 1.2), r.ll_load, r.read_s);
  }
  std::printf("\ngreedy tokens, qkv against llama.cpp (first run of each):\n");
  for (const Row& r : rows)
    std::printf("  %-7s %d thread%s: the first %lld of %lld agree, %lld in all\n", r.type.c_str(), r.threads,
                r.threads > 1 ? "s" : "", static_cast<long long>(r.agree_prefix), static_cast<long long>(r.compared),
                static_cast<long long>(r.agree_total));
  std::printf("targets: generation >= 1.1x llama.cpp and >= 85%% of the memory-bound limit; prompt >= 1.0x; "
              "peak RSS <= 1.1x (file + KV cache); load <= 1.2x reading the file\n");
  return 0;
}
