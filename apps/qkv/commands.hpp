// The subcommands of the qkv tool: each has a setup_* function that registers its options on its CLI11 command and
// returns what runs it, and a run_* function that does the work on parsed options. main.cpp holds the table of
// commands and maps errors to exit codes.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qkv/core/precision.hpp"
#include "qkv/nn/footprint.hpp"
#include "qkv/nn/pretrained.hpp"
#include "qkv/nn/sampler.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/text/tokenizer.hpp"
#include "qkv/train/finetune.hpp"
#include "qkv/train/model_file.hpp"
#include "qkv/train/trainer.hpp"
#include "qkv/viz/picture.hpp"

namespace CLI {
class App;
}

namespace qkv::nn {
struct SessionOptions;
class Session;
}  // namespace qkv::nn

namespace qkv::cli {

// What main.cpp shares with the commands: the command line (MPI's start takes it) and --precision.
struct CommandContext {
  int* argc = nullptr;
  char*** argv = nullptr;
  std::string precision_text = "fp32";    // --precision, for the commands that take it
  Precision precision = Precision::FP32;  // resolved once the line is parsed
};
// A command's setup registers its options on `command` (they live in the runner it returns) and returns the function
// that runs the command once the line is parsed: its exit code, or an exception main.cpp maps to one.
using Runner = std::function<int()>;
using Setup = Runner (*)(CLI::App& command, CommandContext& context);
Runner setup_demo(CLI::App& command, CommandContext& context);
Runner setup_apply(CLI::App& command, CommandContext& context);
Runner setup_tokenize(CLI::App& command, CommandContext& context);
Runner setup_detokenize(CLI::App& command, CommandContext& context);
Runner setup_train(CLI::App& command, CommandContext& context);
Runner setup_generate(CLI::App& command, CommandContext& context);
Runner setup_chat(CLI::App& command, CommandContext& context);
Runner setup_attention(CLI::App& command, CommandContext& context);
Runner setup_eval(CLI::App& command, CommandContext& context);
Runner setup_finetune(CLI::App& command, CommandContext& context);
Runner setup_classify(CLI::App& command, CommandContext& context);
Runner setup_convert(CLI::App& command, CommandContext& context);
Runner setup_quantize(CLI::App& command, CommandContext& context);
Runner setup_memory(CLI::App& command, CommandContext& context);
Runner setup_serve(CLI::App& command, CommandContext& context);

// A mistake on the command line found after parsing (a bad combination, an input that does not fit): exit 2.
class UsageError : public Error {
 public:
  using Error::Error;
};

// "1 layer", "2 layers": a count with its noun, for messages.
inline std::string count_of(int64_t n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

// "12.34 MiB" (or "48.0 KiB" below one MiB): a size, for messages.
inline std::string mib(int64_t bytes) {
  char text[32];
  if (bytes < (1 << 20)) std::snprintf(text, sizeof text, "%.1f KiB", static_cast<double>(bytes) / (1 << 10));
  else std::snprintf(text, sizeof text, "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  return text;
}

// The most a command reads of a text (--text, --messages, standard input): 1 GiB, stated in the error past it.
inline constexpr uint64_t kMaxTextBytes = uint64_t{1} << 30;

struct DemoOptions {
  std::vector<std::string> sections;  // empty: all
  bool color = false;
  std::string pictures_dir;           // draw every weight matrix there and the training (GIF)
  viz::PictureOptions pictures;       // --format, --scale
  std::string color_scale;            // --color-scale: fixed, auto, or empty (auto except where pictures compare)
  std::string sentence;               // the learner's own words, one random embedding per distinct word
  bool sentence_given = false;
  std::string embeddings, tokens;     // or embeddings from a .npy (T × d_in), one token per row
  std::optional<int64_t> d_in, d_out;  // unset: the defaults (3 and 2)
  std::optional<uint64_t> seed;       // for the learner's input (default 123)
  // Section 3's pair: which word learns to attend to which, as "QUERY,KEY" (words or 1-based positions); empty:
  // "cat,fat" when the sentence has both, else its last word to its first.
  std::string attend;
};
const std::vector<std::string>& demo_sections();
int run_demo(const DemoOptions& options, std::ostream& out);

struct ApplyCommand {
  std::string module_path, input_path, output_path, grad_output_path;
  bool train = false;
  uint64_t seed = 0;
};
int run_apply(const ApplyCommand& options);

struct TokenizeCommand {
  std::string tokenizer = "gpt2", vocab_dir;
  bool no_special = false, replace_invalid = false;
};
int run_tokenize(const TokenizeCommand& options);
int run_detokenize(const TokenizeCommand& options);

struct TrainCommand {
  train::TrainSettings settings;
  std::map<std::string, std::string> overrides;  // settings given on the command line (they win over --resume's)
  std::string text_path, out_dir = "runs/gpt", vocab_dir, resume;
  std::string resume_config;  // --config for a .pth or book safetensors given to --resume
  bool replace_invalid = false;
  int64_t stop_at = 0;  // checkpoint and stop after this step (0: run to the end)
  int64_t attention_every = 0;  // snapshot the probe's attention maps every N steps (0: never)
  std::string attention_prompt;  // the probe (default: the first 24 tokens of the text)
  bool overwrite = false;     // replace a run already in out_dir
  viz::PictureOptions pictures;  // loss plot and attention snapshots (the animation stays a GIF)
  bool plot_log = false;         // the loss plot's y axis logarithmic
  std::string sample_prompt;  // empty: the first words of the text
  int64_t sample_tokens = 60;
};
int run_train(const TrainCommand& options, train::Communicator& comm);
// qkv train --resume DIR with a Hugging Face folder: continued pretraining, the result written as a folder.
int run_train_folder(const TrainCommand& options, train::Communicator& comm);
// Runs `setup` on every process; under mpirun a problem on any process stops them all with an Error naming it
// ("rank N: …"), so none waits for the others.
void set_up_everywhere(train::Communicator& comm, const std::function<void()>& setup);
std::string read_corpus(const std::string& path);  // --text FILE, or the default corpus
// The settings `strings` hold (the defaults or a checkpoint's, with the command line's over them), parsed and
// validated; a bad value is a UsageError that names where a value not given came from (`origin`: "default",
// "checkpoint's").
train::TrainSettings parse_train_settings(const std::map<std::string, std::string>& strings, const TrainCommand& options,
                                          const std::string& origin);
// A note on stderr when the schedule cannot do what its settings say (a warmup longer than the run).
void note_schedule(const train::TrainSettings& settings, int64_t start_step);

// Where a model comes from: --checkpoint FILE (a qkv checkpoint, a .pth, a book-named or Hugging Face safetensors
// file; told apart by content), --checkpoint DIR (a Hugging Face model folder: config.json, the safetensors and
// tokenizer.json) or --gpt2 FILE, and for a book state dict its configuration (--config, --n-heads)
// and the tokenizer (--tokenizer).
struct ModelOptions {
  std::string checkpoint, gpt2_path, vocab_dir;
  std::string adapter;  // a PEFT LoRA adapter folder applied to the model (qkv finetune … --lora-rank writes one)
  nn::ConfigHint hint;
  // Inference under --precision bf16: matrices kept in bfloat16 only (half the memory; a folder's are read as such).
  bool bf16_weights = false;
  // --weights: how matrices are kept in memory — "stored" (as the file stores them: a bfloat16 folder stays bfloat16),
  // or a storage type the matrices are converted to while loading: f32, bf16, f16, q8_0, q4_0, q4_k, q5_k, q6_k
  std::string weights = "stored";
  std::string path() const { return checkpoint.empty() ? gpt2_path : checkpoint; }
};

// The model (in eval mode) and what came with it: the library's loader (nn/pretrained.hpp) on the options above.
using LoadedModel = nn::Pretrained;
LoadedModel load_model(const ModelOptions& options);

struct AttentionCommand {
  ModelOptions model;
  std::string prompt, out_dir = "attention";
  std::vector<int64_t> layers, heads;  // 1-based; empty: all
  bool per_head = true;
  viz::PictureOptions pictures;
};
int run_attention(const AttentionCommand& options);

// `qkv memory`: KV-cache bytes and MoE parameters from settings (the book's four figures when none are given), or a
// Hugging Face folder's parameters and KV cache.
struct MemoryCommand {
  std::string folder;                   // a Hugging Face folder (config.json), or empty
  nn::MemorySettings settings;          // from --emb, --heads, …
  bool custom = false;                  // some setting was given
  std::string dtype = "bf16", swa_ratio = "1:0", ffn = "swiglu";
};
int run_memory(const MemoryCommand& options, std::ostream& out);

struct GenerateCommand {
  ModelOptions model;
  std::string prompt;
  std::string prompts_path;  // --prompts FILE: one JSON string per line, run as one batch, one JSON result per line
  int64_t max_new_tokens = 100, top_k = 40;
  double temperature = 0.8, top_p = 1.0;
  double min_p = 0.0, repetition_penalty = 1.0, presence_penalty = 0.0, frequency_penalty = 0.0;
  uint64_t seed = 0;
  bool greedy = false, no_cache = false, replace_invalid = false;
  std::string kv_cache = "f32";  // --kv-cache: how the session's KV cache stores keys and values
  std::vector<std::string> sampling_given;  // "--temperature 1.5", … as given (with --greedy they are not used: say so)
  bool chat = false;  // the prompt as one user message in the model's chat template
};
int run_generate(const GenerateCommand& options);
// The sampler chain the generation options describe (greedy, temperature, top-k, top-p, min-p, penalties, seed)
nn::SamplerOptions sampler_options(const GenerateCommand& options, const LoadedModel& loaded);
// The session the generation options describe (--kv-cache), holding at most max_tokens positions (0: the context)
nn::SessionOptions session_options(const GenerateCommand& options, int64_t max_tokens = 0);
// "KV cache 12.5 MiB of bf16 …": how much memory the cache of a session holds now, and its type
std::string kv_cache_summary(const nn::Session& session);

// `qkv chat`: the generation options, plus the conversation's source and the template's switches.
struct ChatCommand {
  GenerateCommand generation;
  std::string system;          // a system message first
  std::string messages_path;   // a JSON list of {role, content} to start from
  std::string template_path;   // with --print-prompt: a tokenizer_config.json, no model needed
  bool print_prompt = false, no_thinking = false;
  int64_t max_context = 8192;  // tokens the KV cache holds (at most the model's context length)
};
int run_chat(const ChatCommand& options);

struct EvalCommand {
  ModelOptions model;
  std::string text_path;        // "-": standard input
  int64_t context = 0;          // 0: the model's context_length
  int64_t stride = 0;           // 0: the context (windows that do not overlap)
  int64_t batch_size = 0;       // 0: as many windows as keep the logits under 256 MiB
  bool json = false, replace_invalid = false;
  std::string plot_path;        // --plot FILE: the loss of each window (FILE.png, .svg or .pdf; else --format's)
  viz::PictureOptions pictures;
  std::string kl_reference;     // --kl-reference MODEL: KL divergence and top-1 agreement against it instead of the loss
};
int run_eval(const EvalCommand& options);

// qkv finetune classify: the book's chapter 6 (and appendix E with --lora-rank).
struct FinetuneClassifyCommand {
  ModelOptions model;
  std::string train_path, val_path, test_path, out_dir;
  text::TableColumns columns;
  train::ClassifierOptions options;
  // pooling: last, last-real, or empty: last-real for a Hugging Face folder (as transformers reads), else last
  std::string trainable = "last-block", pooling, lora_targets = "all";
  int64_t prefix_cache_mib = 2048;
  bool overwrite = false;
  viz::PictureOptions pictures;
};
int run_finetune_classify(const FinetuneClassifyCommand& options);

// qkv finetune instruct: the book's chapter 7.
struct FinetuneInstructCommand {
  ModelOptions model;
  std::string data_path, out_dir, format = "alpaca", lora_targets = "all";
  train::InstructOptions options;
  uint64_t split_seed = 0;        // 0: the file's order, as the book
  int64_t max_new_tokens = 256;   // for the test responses
  bool overwrite = false;
  viz::PictureOptions pictures;
};
int run_finetune_instruct(const FinetuneInstructCommand& options);

// qkv classify: a fine-tuned classifier's label for each text (the book's classify_review).
struct ClassifyCommand {
  ModelOptions model;
  std::vector<std::string> texts;
  bool json = false;
};
int run_classify(const ClassifyCommand& options);

struct ConvertCommand {
  std::string input, output, to;  // to: pth, safetensors, checkpoint, gpt2, hf (empty: from the output's extension)
  std::string dtype = "f32";      // hf: f32 or bf16
  std::string merge;              // a PEFT LoRA adapter folder to fold into the weights first
  nn::ConfigHint hint;
  bool weights_only = false;
  bool overwrite = false;  // replace an existing output (as train's --overwrite)
};
int run_convert(const ConvertCommand& options);

}  // namespace qkv::cli

namespace CLI {
class App;
}
namespace qkv::cli {
// `qkv serve` (serve.cpp), once the line is parsed
int run_serve();
}  // namespace qkv::cli
