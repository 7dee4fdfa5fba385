// `qkv train`: train a small GPT on a text (default: the King James Bible from Debian's bible-kjv), with a
// progress bar, a CSV of losses, a PNG loss plot, atomic checkpoints, exact --resume and Ctrl-C handling.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cmath>
#include <csignal>
#include <signal.h>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "commands.hpp"
#include "options.hpp"
#include "qkv/nn/hf.hpp"
#include "progress.hpp"
#include "qkv/core/settings.hpp"
#include "qkv/io/file.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/nn/generate.hpp"
#include "qkv/text/tokenizer.hpp"
#include "qkv/viz/heatmap.hpp"
#include "qkv/viz/plot.hpp"
#include "qkv/viz/report.hpp"
#include "qkv/train/communicator.hpp"
#include "qkv/train/trainer.hpp"

namespace qkv::cli {

namespace {

std::atomic<bool> g_interrupted{false};
std::atomic<int> g_signal{0};
// SIGINT (Ctrl-C), SIGTERM (kill, schedulers) and SIGHUP (a closed terminal) all end the run the same way: the
// current step finishes, a checkpoint is written, and the exit code says which signal it was (128 + number).
extern "C" void on_interrupt(int signal) {
  g_signal.store(signal);
  g_interrupted.store(true);
}

// The model, its gradients and AdamW's two moments take 16 bytes per parameter; refuse what cannot fit.
void check_memory(const train::TrainSettings& settings) {
  const double bytes = 16.0 * static_cast<double>(settings.model.parameter_count());
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  if (physical > 0 && bytes > physical) {
    char message[256];
    std::snprintf(message, sizeof message,
                  "the model has %lld parameters; training needs at least %.1f GiB (weights, gradients and AdamW's "
                  "moments) but this machine has %.1f GiB; choose smaller sizes",
                  static_cast<long long>(settings.model.parameter_count()), bytes / (1 << 30), physical / (1 << 30));
    throw UsageError(message);
  }
}

// The output directory, checked before any training: it can be created and written, no other run writes to it
// (a lock held for the run), and an existing run in it is kept unless --resume or --overwrite says otherwise.
// Temporary files of killed runs are cleaned up.
int g_lock_fd = -1;
void prepare_output_directory(const TrainCommand& options, const std::string& checkpoint, bool resuming_qkv_checkpoint) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(options.out_dir, ec);
  if (ec) throw IoError(options.out_dir + ": cannot create the output directory: " + ec.message());
  const std::string lock_path = options.out_dir + "/.qkv-train.lock";
  g_lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (g_lock_fd < 0) {
    throw IoError(options.out_dir + ": cannot write there (" + std::strerror(errno) + "); choose another --out");
  }
  if (::flock(g_lock_fd, LOCK_EX | LOCK_NB) != 0) {
    char pid[32] = {0};
    (void)!::pread(g_lock_fd, pid, sizeof pid - 1, 0);
    throw IoError(options.out_dir + ": another qkv train (pid " + std::string(pid) + ") is writing there; wait for it "
                  "or choose another --out");
  }
  const std::string me = std::to_string(getpid());
  if (::ftruncate(g_lock_fd, 0) != 0 || ::pwrite(g_lock_fd, me.data(), me.size(), 0) < 0) {
    throw IoError(options.out_dir + ": cannot write there (" + std::string(std::strerror(errno)) + "); choose another --out");
  }
  if (!resuming_qkv_checkpoint && !options.overwrite && fs::exists(checkpoint)) {
    throw UsageError(options.out_dir + " already holds a run (" + checkpoint + "); continue it with --resume " +
                     checkpoint + ", start over with --overwrite, or choose another --out");
  }
  if (const int stale = io::remove_stale_temporaries(checkpoint); stale > 0)
    std::fprintf(stderr, "qkv train: removed %d temporary file(s) left by an interrupted run\n", stale);
  io::remove_stale_temporaries(options.out_dir + "/losses.csv");
  io::remove_stale_temporaries(viz::picture_path(options.out_dir + "/loss", options.pictures));
}

// The training's progress line: step, loss, learning rate, tokens/s and the time left.
struct CsvRow {
  int64_t step;
  double loss, lr, grad_norm, tokens_per_second;
  double eval_train = NAN, eval_validation = NAN;
  double communication = 0;  // seconds summing gradients across processes
};

// Keeps the rows of an earlier run up to `step` (when resuming), so the file stays one consistent history.
std::vector<CsvRow> read_csv(const std::string& path, int64_t up_to_step) {
  std::vector<CsvRow> rows;
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    CsvRow r{};
    std::string eval_train, eval_validation;
    std::istringstream fields(line);
    std::string f;
    std::vector<std::string> v;
    while (std::getline(fields, f, ',')) v.push_back(f);
    if (v.size() < 5 || v[0].empty()) continue;
    // A row that does not parse (the file was edited or cut by a kill) is skipped, not fatal: the checkpoint is
    // what resumes the run; the CSV is its history.
    auto number = [](const std::string& x) {
      try {
        return x.empty() ? NAN : parse_real(x, "losses.csv");
      } catch (const Error&) {
        return static_cast<double>(NAN);
      }
    };
    try {
      r.step = parse_int(v[0], "losses.csv step");
    } catch (const Error&) {
      continue;
    }
    r.loss = number(v[1]), r.lr = number(v[2]), r.grad_norm = number(v[3]), r.tokens_per_second = number(v[4]);
    r.eval_train = v.size() > 5 ? number(v[5]) : NAN;
    r.eval_validation = v.size() > 6 ? number(v[6]) : NAN;
    r.communication = v.size() > 7 && !v[7].empty() ? number(v[7]) : 0.0;
    if (r.step <= up_to_step) rows.push_back(r);
  }
  return rows;
}

void write_outputs(const std::string& out_dir, const std::vector<CsvRow>& rows, const TrainCommand& options) {
  std::ostringstream csv;
  csv << "step,train_loss,learning_rate,grad_norm,tokens_per_second,eval_train_loss,validation_loss,communication_seconds\n";
  // The evaluations with a dot where each was measured (every --eval-every steps), the batches' loss as a line.
  viz::Series train_series{"train (batch)", {31, 119, 180}, {}}, eval_series{"train (eval)", {44, 160, 44}, {}, false, false, true},
      validation{"validation", {214, 39, 40}, {}, false, false, true},
      learning_rate{"learning rate (right)", {150, 150, 150}, {}, true, true};
  for (const auto& r : rows) {
    char line[256];
    if (std::isnan(r.loss)) std::snprintf(line, sizeof line, "%lld,,,,,", static_cast<long long>(r.step));  // before training
    else std::snprintf(line, sizeof line, "%lld,%.6f,%.6e,%.6f,%.1f,", static_cast<long long>(r.step), r.loss, r.lr,
                       r.grad_norm, r.tokens_per_second);
    csv << line;
    if (!std::isnan(r.eval_train)) csv << r.eval_train << ',' << r.eval_validation;
    else csv << ',';
    char communication[32];
    std::snprintf(communication, sizeof communication, ",%.4f", r.communication);
    csv << (std::isnan(r.loss) ? "," : communication) << '\n';
    if (!std::isnan(r.loss)) train_series.points.emplace_back(static_cast<double>(r.step), r.loss);
    if (!std::isnan(r.lr)) learning_rate.points.emplace_back(static_cast<double>(r.step), r.lr);
    if (!std::isnan(r.eval_train)) {
      eval_series.points.emplace_back(static_cast<double>(r.step), r.eval_train);
      validation.points.emplace_back(static_cast<double>(r.step), r.eval_validation);
    }
  }
  const std::string text = csv.str();
  io::write_file_atomically(out_dir + "/losses.csv",
                            std::span<const std::byte>(reinterpret_cast<const std::byte*>(text.data()), text.size()));
  if (!rows.empty()) {
    std::vector<viz::Series> series = {train_series};
    if (!eval_series.points.empty()) series.push_back(eval_series), series.push_back(validation);
    if (!learning_rate.points.empty()) series.push_back(learning_rate);
    viz::save_plot(viz::picture_path(out_dir + "/loss", options.pictures), series,
                   {.title = "qkv train: cross-entropy loss", .x_label = "step", .y_label = "loss (nats)",
                    .y2_label = "learning rate", .log_y = options.plot_log},
                   options.pictures);
  }
}

}  // namespace

// The text to train on: --text FILE, or the default corpus (also qkv train --resume DIR's, train_folder.cpp).
std::string read_corpus(const std::string& path) {
  if (!path.empty()) {
    const std::vector<std::byte> bytes = io::read_file(path, kMaxTextBytes);
    return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  // The default corpus: the King James Bible, as Debian's bible-kjv prints it.
  FILE* pipe = popen("bible -l80 gen1:1-rev22:21 2>/dev/null", "r");
  std::string text;
  if (pipe) {
    char buffer[65536];
    while (size_t n = fread(buffer, 1, sizeof buffer, pipe)) text.append(buffer, n);
    const int status = pclose(pipe);
    if (status != 0) text.clear();
  }
  if (text.empty()) {
    throw IoError("the default corpus is the King James Bible from Debian's bible-kjv package, and `bible` did not "
                  "run; install it (apt-get install bible-kjv) or pass --text FILE");
  }
  return text;
}

train::TrainSettings parse_train_settings(const std::map<std::string, std::string>& strings, const TrainCommand& options,
                                          const std::string& origin) {
  try {
    return train::TrainSettings::from_strings(strings);
  } catch (const ValueError& e) {
    // The learning rates are checked together (0 ≤ min-lr ≤ lr): when one was given and the other was not, say
    // which value the other had and where it came from.
    const bool lr = options.overrides.count("learning_rate"), min_lr = options.overrides.count("min_learning_rate");
    train::TrainSettings values;
    try {
      values.learning_rate = parse_real(strings.at("learning_rate"), "--lr");
      values.min_learning_rate = parse_real(strings.at("min_learning_rate"), "--min-lr");
    } catch (const std::exception&) {
      throw UsageError(e.what());
    }
    if (values.learning_rate > 0 && values.min_learning_rate > values.learning_rate && lr != min_lr) {
      const std::string lr_text = format_real(values.learning_rate), min_text = format_real(values.min_learning_rate);
      char tenth[32];
      std::snprintf(tenth, sizeof tenth, "%.3g", values.learning_rate / 10);
      throw UsageError(lr ? "--lr " + lr_text + " is below the " + origin + " --min-lr " + min_text +
                                " (where the cosine ends); give a smaller --min-lr too, e.g. --min-lr " + tenth
                          : "--min-lr " + min_text + " is above the " + origin + " --lr " + lr_text +
                                " (the peak); give a larger --lr too, or a smaller --min-lr");
    }
    throw UsageError(e.what());  // the values came from the command line (the defaults and a checkpoint's are valid)
  }
}

void note_schedule(const train::TrainSettings& s, int64_t start_step) {
  if (s.warmup_steps <= s.max_steps || start_step >= s.max_steps) return;
  const double last = train::learning_rate_at(s, s.max_steps - 1);
  std::fprintf(stderr, "qkv train: note: --warmup %lld is longer than --steps %lld: the learning rate never reaches its "
                       "peak --lr %s (it rises to %.3g at the last step); give --warmup %lld (a tenth of the steps), say\n",
               static_cast<long long>(s.warmup_steps), static_cast<long long>(s.max_steps),
               format_real(s.learning_rate).c_str(), last, static_cast<long long>(std::max<int64_t>(1, s.max_steps / 10)));
}

void set_up_everywhere(train::Communicator& comm, const std::function<void()>& setup) {
  if (comm.size() == 1) return setup();
  std::string problem;
  try {
    setup();
  } catch (const Error& e) {
    problem = e.what();
  }
  comm.agree(problem);  // every process stops if any could not start, naming it
}

int run_train(const TrainCommand& options, train::Communicator& comm) {
  if (!options.resume.empty() && nn::is_hf_folder(options.resume)) {
    return run_train_folder(options, comm);
  }
  namespace fs = std::filesystem;
  const std::string checkpoint = options.out_dir + "/checkpoint.safetensors";
  // Under mpirun every process runs this; process 0 alone writes files and talks. A problem while setting up
  // (a missing text on one machine, say) stops every process with a message naming the process.
  const bool lead = comm.rank() == 0;
  train::TrainSettings settings;
  std::unique_ptr<text::Tokenizer> tokenizer;
  std::vector<int64_t> tokens;
  std::unique_ptr<train::Trainer> trainer_owner;
  bool qkv_checkpoint = false;  // --resume of qkv's own checkpoint (else a new run, perhaps from a model file)
  auto setup = [&] {
    // The defaults, or with --resume the checkpoint's settings; what the command line gives overrides them as
    // text, and the whole is parsed and validated once.
    std::map<std::string, std::string> strings = options.settings.to_strings();
    train::TrainSettings stored;
    // --resume of a qkv checkpoint resumes exactly; of another model file (the book's model_and_optimizer.pth, a
    // state dict) it continues from its weights and optimizer, with the settings derived from the file.
    qkv_checkpoint = !options.resume.empty() && nn::detect_checkpoint_format(options.resume) == train::ModelFormat::QkvCheckpoint;
    std::optional<train::ModelFile> model_file;
    if (qkv_checkpoint) {
      strings = (stored = train::read_checkpoint_settings(options.resume)).to_strings();
    } else if (!options.resume.empty()) {
      nn::ConfigHint hint{options.resume_config, 0, ""};
      if (auto it = options.overrides.find("n_heads"); it != options.overrides.end()) hint.n_heads = parse_int(it->second, "--n-heads");
      if (auto it = options.overrides.find("tokenizer"); it != options.overrides.end()) hint.tokenizer = it->second;
      model_file = train::load_model_file(options.resume, hint);
      train::TrainSettings base = train::TrainSettings::from_strings(strings);
      strings = (stored = train::settings_for(*model_file, base)).to_strings();
      if (lead) {
        std::fprintf(stderr, "qkv train: continuing %s%s\n", model_file->description.c_str(),
                     model_file->optimizer
                         ? (" at step " + std::to_string(model_file->optimizer->step) + " with its AdamW (lr " +
                            format_real(stored.learning_rate) + ", constant as the book's train_model_simple, weight decay " +
                            format_real(stored.weight_decay) + "; --lr, --warmup, --grad-clip change that)").c_str()
                         : " (weights only: AdamW starts afresh)");
      }
    } else if (!options.resume_config.empty()) {
      throw UsageError("--config goes with --resume of a .pth or book safetensors file; for a new run give the sizes "
                       "(--emb-dim, --n-heads, …)");
    }
    for (const auto& [key, value] : options.overrides) strings[key] = value;
    // The model's vocabulary follows the tokenizer unless given: bytes → 256, gpt2 → 50,257.
    if (options.resume.empty() && !options.overrides.count("vocab_size") && strings["tokenizer"] == "bytes") {
      strings["vocab_size"] = "256";
    }
    settings = parse_train_settings(strings, options, options.resume.empty() ? "default" : "checkpoint's");
    if (!options.resume.empty() && lead) {
      for (const std::string& change : train::settings_differences(stored, settings, /*must_match=*/false))
        std::fprintf(stderr, "qkv train: changed on resume: %s\n", change.c_str());
    }
    check_memory(settings);
    if (lead) prepare_output_directory(options, checkpoint, qkv_checkpoint);

    tokenizer = text::make_tokenizer(settings.tokenizer, options.vocab_dir);
    if (settings.model.vocab_size < tokenizer->vocab_size()) {
      throw UsageError("vocab_size " + std::to_string(settings.model.vocab_size) + " is smaller than the " +
                       tokenizer->name() + " tokenizer's " + std::to_string(tokenizer->vocab_size()) +
                       "; give --vocab-size " + std::to_string(tokenizer->vocab_size()) + " or leave it out");
    }
    std::string corpus = read_corpus(options.text_path);
    if (corpus.empty()) {
      throw ValueError((options.text_path.empty() ? std::string("the corpus") : options.text_path) +
                       " is empty; give a text to train on");
    }
    if (options.replace_invalid) corpus = text::replace_invalid_utf8(corpus);
    try {
      tokens = tokenizer->encode(corpus);
    } catch (const ValueError& e) {
      throw ValueError((options.text_path.empty() ? std::string("corpus") : options.text_path) + ": " + e.what());
    }
    if (lead) {
      std::fprintf(stderr, "qkv train: %zu bytes of text → %zu %s tokens\n", corpus.size(), tokens.size(),
                   tokenizer->name().c_str());
    }
    if (qkv_checkpoint) train::check_checkpoint(options.resume, stored);  // before anything is allocated
    trainer_owner = std::make_unique<train::Trainer>(settings, tokens, &comm);
    if (qkv_checkpoint) trainer_owner->resume(options.resume);
    if (model_file) trainer_owner->resume_from(*model_file);
  };
  set_up_everywhere(comm, setup);
  train::Trainer& trainer = *trainer_owner;
  if (lead) std::fprintf(stderr,
               "model: %lld parameters (emb %lld, %s, %s, context %lld, vocab %lld); "
               "batch %lld; steps %lld → %lld; outputs in %s\n",
               static_cast<long long>(trainer.model().parameter_count()), static_cast<long long>(settings.model.emb_dim),
               count_of(settings.model.n_layers, "layer").c_str(), count_of(settings.model.n_heads, "head").c_str(),
               static_cast<long long>(settings.model.context_length), static_cast<long long>(settings.model.vocab_size),
               static_cast<long long>(trainer.global_batch()), static_cast<long long>(trainer.step()),
               static_cast<long long>(settings.max_steps), options.out_dir.c_str());
  if (lead && settings.model.attention != "book") {  // today's decoder: which one, and what a token uses of it
    const nn::DecoderConfig& c = trainer.model().config;
    std::string what = c.family->description + " blocks (RMSNorm, RoPE, SwiGLU) with " +
                       (settings.model.attention == "mla" ? "multi-head latent attention (a latent of " + std::to_string(c.kv_lora_rank) + ")"
                        : settings.model.attention == "deltanet-hybrid"
                            ? count_of(c.num_layers - trainer.model().block_cache_layers(), "Gated DeltaNet layer") + " and " +
                                  count_of(trainer.model().block_cache_layers(), "gated attention layer")
                        : settings.model.attention == "gqa" ? count_of(c.num_kv_heads, "K/V head") + " shared by groups of " +
                                                                  std::to_string(c.num_heads / c.num_kv_heads)
                                                            : "multi-head attention");
    if (c.num_experts > 0)
      what += "; " + count_of(c.num_experts, "expert") + " of " + std::to_string(c.expert_intermediate_size) + " in every MLP, " +
              std::to_string(c.experts_per_token) + " a token";
    std::fprintf(stderr, "architecture: %s\n", what.c_str());
  }
  if (lead) std::fprintf(stderr, "precision: %s\n", describe_precision(trainer.precision(), settings.precision).c_str());
  if (lead) note_schedule(settings, trainer.step());
  if (lead && comm.size() > 1) {
    std::fprintf(stderr, "data parallel: %d processes × batch %lld × grad-accum %lld = %lld windows per step\n", comm.size(),
                 static_cast<long long>(settings.batch_size), static_cast<long long>(settings.grad_accum),
                 static_cast<long long>(trainer.global_batch()));
  }

  if (lead && trainer.step() >= settings.max_steps) {
    std::fprintf(stderr, "qkv train: note: the run is already at step %lld and --steps (the total) is %lld: nothing to "
                 "train; give --steps %lld for 100 more\n", static_cast<long long>(trainer.step()),
                 static_cast<long long>(settings.max_steps), static_cast<long long>(trainer.step() + 100));
  }
  std::vector<CsvRow> rows = !qkv_checkpoint ? std::vector<CsvRow>{} : read_csv(options.out_dir + "/losses.csv", trainer.step());
  // A step's seconds, estimated before the first from the untrained evaluation's forward passes (a step is about three:
  // forward, backward twice its cost; plus its share of the evaluations every --eval-every steps), so the bar shows
  // the time the run will take from the start.
  double seconds_per_step = 0;
  if (trainer.step() == 0) {
    const auto began = std::chrono::steady_clock::now();
    const double untrained = trainer.evaluate(true, settings.eval_batches);
    const double forwards = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    if (lead)
      std::fprintf(stderr, "untrained validation loss %.4f (ln vocab = %.4f)\n", untrained,
                   std::log(static_cast<double>(settings.model.vocab_size)));
    rows.push_back({0, NAN, NAN, NAN, NAN, trainer.evaluate(false, settings.eval_batches), untrained});
    const double forward = forwards / static_cast<double>(std::max<int64_t>(settings.eval_batches, 1)) *
                           static_cast<double>(trainer.global_batch()) / static_cast<double>(std::max<int64_t>(settings.batch_size, 1)) /
                           static_cast<double>(std::max(comm.size(), 1));
    seconds_per_step = 3.0 * forward;
    if (settings.eval_every > 0)
      seconds_per_step += 2.0 * forwards / static_cast<double>(settings.eval_every);
  }
  // Attention snapshots of a fixed probe while training: watch the heads form.
  std::vector<int64_t> probe;
  std::vector<std::string> probe_labels;
  std::vector<std::pair<std::vector<viz::HeatmapPanel>, std::string>> snapshots;
  const std::string attention_dir = options.out_dir + "/attention";
  if (options.attention_every > 0) {
    probe = options.attention_prompt.empty()
                ? std::vector<int64_t>(tokens.begin(), tokens.begin() + std::min<size_t>(tokens.size(), 24))
                : tokenizer->encode(options.attention_prompt);
    if (probe.empty()) throw UsageError("--attention-prompt is empty; give a few words to watch");
    const int64_t ctx = settings.model.context_length;
    if (static_cast<int64_t>(probe.size()) > ctx) {
      throw UsageError("--attention-prompt has " + std::to_string(probe.size()) + " tokens; the model reads at most " +
                       std::to_string(ctx) + " (--context-length)");
    }
    for (int64_t id : probe) probe_labels.push_back(viz::token_label(tokenizer->token_bytes(id)));
  }
  auto snapshot = [&](int64_t step) {
    nn::Decoder& model = trainer.model();
    const bool was_training = model.is_training();
    model.eval();
    std::vector<int64_t> layers;  // every layer's heads; Gated DeltaNet layers weigh no positions and are left out
    for (int64_t l = 0; l < model.num_layers(); ++l)
      if (!model.config.layers[static_cast<size_t>(l)].linear) layers.push_back(l);
    const Tensor maps = model.attention_maps(probe, layers, {});
    model.train(was_training);
    const int64_t L = maps.size(0), H = maps.size(1), T = maps.size(2);
    std::vector<viz::HeatmapPanel> panels;
    for (int64_t l = 0; l < L; ++l)
      for (int64_t h = 0; h < H; ++h)
        panels.push_back({"L" + std::to_string(layers[static_cast<size_t>(l)] + 1) + " H" + std::to_string(h + 1),
                          Tensor::from(std::span<const float>(maps.data() + (l * H + h) * T * T, static_cast<size_t>(T * T)), {T, T}),
                          viz::causal_cells()});
    char name[64];
    std::snprintf(name, sizeof name, "/step-%06lld", static_cast<long long>(step));
    std::filesystem::create_directories(attention_dir);
    viz::save_heatmap_grid(viz::picture_path(attention_dir + name, options.pictures),
                           "Attention at step " + std::to_string(step) + " (layers \u00d7 heads)", panels,
                           static_cast<int>(H), probe_labels, 1.0, options.pictures);
    snapshots.emplace_back(std::move(panels), "step " + std::to_string(step));
  };
  auto save_animation = [&] {
    if (snapshots.size() < 2) return;
    viz::save_heatmap_grid_gif(attention_dir + "/attention.gif", "Attention while training (layers \u00d7 heads)", snapshots,
                          static_cast<int>(settings.model.n_heads), probe_labels, 1.0, 40);
  };
  if (options.attention_every > 0 && trainer.step() == 0 && lead) snapshot(0);

  Progress progress(settings.max_steps, trainer.step(), lead);
  progress.begin(seconds_per_step);
  g_interrupted.store(false);
  g_signal.store(0);
  struct sigaction action {}, previous[3];
  action.sa_handler = on_interrupt;
  sigemptyset(&action.sa_mask);
  const int signals[3] = {SIGINT, SIGTERM, SIGHUP};
  for (int i = 0; i < 3; ++i) sigaction(signals[i], &action, &previous[i]);
  // losses.csv and loss.png first, then the checkpoint: a kill between the two leaves rows past the checkpoint's
  // step, which a resume drops (read_csv keeps rows up to the checkpoint's step), never a gap.
  auto save = [&](int64_t /*step*/) {
    if (!lead) return;  // one writer
    write_outputs(options.out_dir, rows, options);
    trainer.save_checkpoint(checkpoint);
  };
  // The command that continues this run, as typed: the same text, vocabulary and output folder.
  std::string continue_with = "qkv train --resume " + checkpoint + " --out " + options.out_dir;
  if (!options.text_path.empty()) continue_with += " --text " + options.text_path;
  if (!options.vocab_dir.empty()) continue_with += " --vocab " + options.vocab_dir;
  if (options.replace_invalid) continue_with += " --replace-invalid";
  std::atomic<bool> reached_stop{false};
  try {
    trainer.run([&](const train::StepReport& r) {
                  rows.push_back({r.step, r.loss, r.learning_rate, r.grad_norm, r.tokens_per_second});
                  rows.back().communication = r.communication_seconds;
                  progress.step(r);
                  if (options.stop_at > 0 && r.step >= options.stop_at) reached_stop.store(true), g_interrupted.store(true);
                  if (lead && options.attention_every > 0 &&
                      (r.step % options.attention_every == 0 || r.step == settings.max_steps))
                    snapshot(r.step);
                },
                [&](const train::EvalReport& e) {
                  if (!rows.empty() && rows.back().step == e.step) {
                    rows.back().eval_train = e.train_loss;
                    rows.back().eval_validation = e.validation_loss;
                  }
                  char line[160];
                  std::snprintf(line, sizeof line, "step %lld: train loss %.4f, validation loss %.4f",
                                static_cast<long long>(e.step), e.train_loss, e.validation_loss);
                  progress.message(line);
                },
                save, &g_interrupted);
  } catch (const train::TrainingDiverged& e) {
    for (int i = 0; i < 3; ++i) sigaction(signals[i], &previous[i], nullptr);
    // The weights did not take the bad step; the last checkpoint on disk is untouched.
    throw ValueError(std::string(e.what()) + (std::filesystem::exists(checkpoint) ? "; the last checkpoint, " + checkpoint +
                                                                                         ", is intact"
                                                                                   : "; no checkpoint was written") +
                     ". Lower --lr (or raise --warmup) and train again");
  }
  // The handlers stay while the checkpoint is written: a second signal meanwhile (GNU timeout sends its signal to the
  // process and then to its group; an impatient second Ctrl-C) must not end the run before it is saved.
  save(trainer.step());
  if (lead) save_animation();
  for (int i = 0; i < 3; ++i) sigaction(signals[i], &previous[i], nullptr);
  if (reached_stop.load()) {
    progress.message("stopped at step " + std::to_string(trainer.step()) + " as asked (--stop-at); checkpoint saved to " +
                     checkpoint + "; continue with: " + continue_with);
    return 0;
  }
  if (g_interrupted.load()) {  // the handlers are gone: nothing sets these any more
    const int signal = g_signal.load();
    progress.message("interrupted (" + std::string(signal == SIGTERM ? "SIGTERM" : signal == SIGHUP ? "SIGHUP" : "Ctrl-C") +
                     ") at step " + std::to_string(trainer.step()) + "; checkpoint saved to " + checkpoint +
                     "; continue with: " + continue_with);
    return 128 + (signal ? signal : SIGINT);
  }
  progress.message("done: " + checkpoint + ", " + options.out_dir + "/losses.csv, " +
                   viz::picture_path(options.out_dir + "/loss", options.pictures));
  if (const auto [summed, skipped] = trainer.expert_sums(); summed + skipped > 0) {
    progress.message("experts' gradients: " + std::to_string(summed) + " summed across processes, " +
                     std::to_string(skipped) + " not (no process's tokens chose the expert that step)");
  }
  if (!lead) return 0;

  // A sample, so you can see what it learned.
  nn::SamplingOptions sampling;
  sampling.max_new_tokens = options.sample_tokens;
  sampling.temperature = 0.8;
  sampling.top_k = 40;
  sampling.seed = settings.seed;
  sampling.stop_token = tokenizer->end_of_text();
  sampling.vocab_limit = tokenizer->vocab_size();
  // The prompt: --sample-prompt, else the first words of the text (a Bible verse means nothing to other texts).
  std::string sample_prompt = options.sample_prompt;
  if (sample_prompt.empty()) {
    sample_prompt = tokenizer->decode(std::vector<int64_t>(tokens.begin(), tokens.begin() + std::min<size_t>(tokens.size(), 4)));
  }
  const std::vector<int64_t> prompt = tokenizer->encode(sample_prompt);
  trainer.model().eval();
  const std::vector<int64_t> produced = nn::generate(trainer.model(), prompt, sampling);
  const std::string sample = sample_prompt + tokenizer->decode(produced);
  std::cout << "sample (temperature 0.8, top-k 40):\n" << sample << "\n";
  std::ofstream(options.out_dir + "/sample.txt") << sample << "\n";
  return 0;
}

namespace {
// What a setting's values are, found by asking its parser (the schema keeps only how to read and print it): INT,
// NUMBER or TEXT, for --help.
const char* setting_type(const Setting<train::TrainSettings>& setting) {
  train::TrainSettings scratch;
  auto parses = [&](const char* text) {
    try {
      setting.set(scratch, text);
      return true;
    } catch (const Error&) {
      return false;
    }
  };
  return parses("not a number") ? "TEXT" : parses("1") && !parses("0.5") ? "INT" : "NUMBER";
}

// Runs the parsed command: alone, or under mpirun as one of several processes that train one model together.
int run_train_command(TrainCommand& train, CommandContext& context) {
  if (train::launched_world_size() <= 1) {
    train::SingleProcess single;
    return run_train(train, single);
  }
  if (!train::built_with_mpi()) {
    std::fprintf(stderr, "qkv train: started by mpirun with %d processes, but this qkv was built without MPI; install "
                         "Open MPI (apt-get install libopenmpi-dev openmpi-bin), rebuild, or run without mpirun\n",
                 train::launched_world_size());
    return 2;
  }
  auto comm = train::make_mpi_communicator(context.argc, context.argv);
  try {
    return run_train(train, *comm);
  } catch (const train::CollectiveError& e) {  // every process knows: one message, no abort
    if (comm->rank() == 0) std::fprintf(stderr, "qkv train: error: %s\n", e.what());
    return 1;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "qkv (process %d of %d): usage error: %s\n", comm->rank(), comm->size(), e.what());
    if (comm->size() > 1) comm->abort_all(2);
    return 2;
  } catch (const std::exception& e) {
    // One process failed on its own (a write, a read): stop every process, naming this one.
    std::fprintf(stderr, "qkv (process %d of %d): error: %s\n", comm->rank(), comm->size(), e.what());
    if (comm->size() > 1) comm->abort_all(1);
    return 1;
  }
}
}  // namespace

Runner setup_train(CLI::App& cmd, CommandContext& context) {
  auto o = std::make_shared<TrainCommand>();
  auto& ts = o->settings;
  ts.model.vocab_size = 50257;
  ts.model.context_length = 128;
  ts.model.emb_dim = 192;
  ts.model.n_heads = 6;
  ts.model.n_layers = 4;
  ts.model.drop_rate = 0.1;
  cmd.add_option("--text", o->text_path, "UTF-8 text file to train on (default: bible -l80 gen1:1-rev22:21)");
  cmd.add_option("--out", o->out_dir, "Output directory: checkpoint.safetensors, losses.csv, loss.png, sample.txt")
      ->capture_default_str()->transform(folder_path());
  cmd.add_option("--resume", o->resume,
                 "Continue from a checkpoint: qkv's (exactly, with its settings unless overridden), or the book's "
                 "model_and_optimizer.pth (its weights, AdamW state and learning rate), or a state dict (.pth or "
                 "safetensors: fine-tune from its weights), or a Hugging Face model folder")
      ->transform(folder_path());
  cmd.add_option("--config", o->resume_config,
                 "With --resume of a book state dict: the book's configuration (JSON file or gpt2-small|medium|large|xl)");
  cmd.add_option("--vocab", o->vocab_dir, "Directory with GPT-2's encoder.json and vocab.bpe")->transform(folder_path());
  cmd.add_flag("--replace-invalid", o->replace_invalid, "Replace invalid UTF-8 with U+FFFD instead of failing");
  // Every model and training setting comes from one table (train_settings_schema): its flag, help, default and
  // parser. What the command line gives is kept as text and applied to the defaults or, with --resume, to the
  // checkpoint's settings; then everything is parsed and validated once.
  auto given = std::make_shared<std::map<std::string, std::string>>();
  auto settings_options = std::make_shared<std::vector<std::pair<CLI::Option*, std::string>>>();
  for (const auto& setting : train::train_settings_schema()) {
    if (!setting.flag) continue;
    CLI::Option* option;
    if (setting.is_flag) {
      option = cmd.add_flag(setting.flag, setting.help);
    } else {
      option = cmd.add_option(setting.flag, (*given)[setting.key], setting.help)
                   ->type_name(setting_type(setting))
                   ->default_str(setting.get(ts))
                   ->check(checked([&setting](const std::string& text) {
                     train::TrainSettings scratch;
                     try {
                       setting.set(scratch, text);
                     } catch (const ValueError& e) {
                       return parse_problem(e, setting.key);  // "\"abc\" is not an integer": CLI11 names --steps
                     }
                     return std::string();
                   }));
    }
    settings_options->emplace_back(option, setting.key);
  }
  cmd.add_option("--stop-at", o->stop_at,
                 "Checkpoint and stop after this step, to continue later with --resume (a run in chunks)")
      ->check(int_at_least(0));
  cmd.add_option("--attention-every", o->attention_every,
                 "Every N steps, save the attention maps of a probe prompt (OUT/attention/step-N.png, and an animation "
                 "over the run, OUT/attention/attention.gif)")
      ->check(int_at_least(0));
  cmd.add_option("--attention-prompt", o->attention_prompt,
                 "The probe for --attention-every (default: the first 24 tokens of the text)");
  cmd.add_option("--sample-prompt", o->sample_prompt,
                 "Prompt for the sample printed at the end (default: the first words of the text)");
  cmd.add_flag("--overwrite", o->overwrite, "Start over in an --out that already holds a run");
  add_picture_options(cmd, o->pictures);
  cmd.add_flag("--plot-log", o->plot_log, "Draw the loss plot's y axis on a log scale");
  cmd.add_option("--sample-tokens", o->sample_tokens, "Length of that sample")->capture_default_str()
      ->check(int_at_least(0));
  return [o, given, settings_options, &context] {
    for (const auto& [option, key] : *settings_options)
      if (option->count()) o->overrides[key] = option->get_expected_min() == 0 ? "true" : given->at(key);
    return run_train_command(*o, context);
  };
}

}  // namespace qkv::cli
