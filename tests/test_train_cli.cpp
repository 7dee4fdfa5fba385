// End-to-end runs of `qkv train` and `qkv generate` on small texts: the loss falls, outputs appear, a resumed
// run repeats an uninterrupted one exactly, Ctrl-C saves a checkpoint, and every bad input gets a clear
// message and exit code with nothing lost.
#include <sys/wait.h>

#include <array>
#include <filesystem>
#include <fstream>

#include "helpers.hpp"
#include "qkv/io/safetensors.hpp"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

class TrainCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("qkv_train_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // A few thousand characters of varied English: enough windows for a byte-level model.
    std::ofstream text(dir_ / "text.txt");
    for (int i = 0; i < 40; ++i)
      text << "In the beginning was the word, and the word was with the cat; the fat cat sat on the mat " << i
           << ". Then the dog ran after the cat, and the bird sang in the tree.\n";
  }
  void TearDown() override { fs::remove_all(dir_); }
  // A tiny byte-level model: fast enough for the sanitizer build.
  std::string tiny(const std::string& out, int steps) const {
    return "train --text " + (dir_ / "text.txt").string() + " --tokenizer bytes --vocab-size 256 --context-length 32 "
           "--emb-dim 32 --n-heads 2 --n-layers 1 --batch-size 4 --eval-every 10 --eval-batches 2 --sample-tokens 20 "
           "--lr 3e-3 --warmup 5 --steps " + std::to_string(steps) + " --out " + (dir_ / out).string();
  }
  std::vector<std::string> loss_rows(const std::string& out) const {
    std::vector<std::string> rows;
    std::istringstream csv(read(dir_ / out / "losses.csv"));
    std::string line;
    std::getline(csv, line);
    while (std::getline(csv, line)) {
      // step, train loss, and the eval columns: the parts a resumed run must reproduce exactly
      std::vector<std::string> f;
      std::istringstream fields(line);
      for (std::string x; std::getline(fields, x, ',');) f.push_back(x);
      rows.push_back(f[0] + "," + f[1] + "," + (f.size() > 5 ? f[5] : "") + "," + (f.size() > 6 ? f[6] : ""));
    }
    return rows;
  }
  fs::path dir_;
};

TEST_F(TrainCli, TrainsAndWritesCheckpointCsvPlotAndSample) {
  const CliResult r = run_cli(tiny("run", 60) + " --attention-every 20 --attention-prompt 'the fat cat'");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "untrained validation loss"));
  EXPECT_FALSE(contains(r.out, "note: --warmup")) << "a warmup of 5 in 60 steps reaches the peak";
  // The time the run takes is on the progress line from the start (estimated before the first step), then measured.
  const size_t estimate = r.out.find("step 0/60  ETA ~"), first = r.out.find("step 1/60  loss");
  EXPECT_NE(estimate, std::string::npos) << r.out;
  EXPECT_LT(estimate, first) << r.out;
  EXPECT_TRUE(contains(r.out.substr(first, 120), "ETA ")) << r.out;
  // Attention snapshots of the probe: steps 0, 20, 40, 60 and an animation over them.
  for (const char* f : {"step-000000.png", "step-000020.png", "step-000060.png", "attention.gif"})
    EXPECT_TRUE(fs::exists(dir_ / "run" / "attention" / f)) << f;
  EXPECT_TRUE(contains(r.out, "sample (temperature 0.8, top-k 40):"));
  for (const char* f : {"checkpoint.safetensors", "losses.csv", "loss.png", "sample.txt"}) EXPECT_TRUE(fs::exists(dir_ / "run" / f)) << f;
  EXPECT_EQ(read(dir_ / "run" / "loss.png").substr(0, 4), "\x89PNG");
  const auto rows = loss_rows("run");
  ASSERT_EQ(rows.size(), 61u);  // step 0 (the untrained evaluation) and 60 steps
  const double first_val = std::stod(rows[0].substr(rows[0].rfind(',') + 1));
  const double last_val = std::stod(rows[60].substr(rows[60].rfind(',') + 1));
  EXPECT_LT(last_val, first_val - 0.3) << "validation loss should fall: " << first_val << " → " << last_val;
  const CliResult g = run_cli("generate --checkpoint " + (dir_ / "run" / "checkpoint.safetensors").string() +
                           " --prompt 'the cat' --max-new-tokens 20 --seed 3");
  ASSERT_EQ(g.code, 0) << g.out;
  EXPECT_EQ(g.out.rfind("the cat", 0), 0u) << g.out;
  const CliResult greedy = run_cli("generate --checkpoint " + (dir_ / "run" / "checkpoint.safetensors").string() +
                                " --prompt 'the cat' --max-new-tokens 20 --greedy");
  const CliResult greedy_no_cache = run_cli("generate --checkpoint " + (dir_ / "run" / "checkpoint.safetensors").string() +
                                         " --prompt 'the cat' --max-new-tokens 20 --greedy --no-cache");
  // The KV cache changes the cost, not the tokens (the last line, on stderr, reports the cache).
  auto text = [](const std::string& out) { return out.substr(0, out.rfind("qkv generate: ")); };
  EXPECT_EQ(text(greedy.out), text(greedy_no_cache.out));
  EXPECT_NE(greedy.out.find("KV cache"), std::string::npos) << greedy.out;
  // A prompt on standard input (--prompt -) loses echo's line break: the same text as --prompt 'the cat'. A
  // temperature given with --greedy is not used, and the note says so.
  const CliResult piped = run_cli("generate --checkpoint " + (dir_ / "run" / "checkpoint.safetensors").string() +
                                  " --prompt - --max-new-tokens 20 --greedy --temperature 1.5", "echo 'the cat' | ");
  ASSERT_EQ(piped.code, 0) << piped.out;
  EXPECT_TRUE(contains(piped.out, text(greedy.out))) << piped.out << "\nvs\n" << greedy.out;
  EXPECT_TRUE(contains(piped.out, "qkv generate: note: --greedy always takes the likeliest token; --temperature 1.5 is "
                                  "not used")) << piped.out;
  EXPECT_FALSE(contains(greedy.out, "note:")) << greedy.out;
}

// The training plot in another format with a log axis, and eval's plot of the loss along the text.
TEST_F(TrainCli, PlotsInEveryFormat) {
  const CliResult r = run_cli(tiny("svg", 12) + " --format svg --plot-log --attention-every 6");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* f : {"loss.svg", "attention/step-000006.svg", "attention/attention.gif"})
    EXPECT_TRUE(fs::exists(dir_ / "svg" / f)) << f;
  EXPECT_FALSE(fs::exists(dir_ / "svg" / "loss.png"));
  const std::string svg = read(dir_ / "svg" / "loss.svg");
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  const std::string checkpoint = (dir_ / "svg" / "checkpoint.safetensors").string();
  const std::string text = (dir_ / "text.txt").string();
  const CliResult e = run_cli("eval --checkpoint " + checkpoint + " --text " + text + " --context 32 --plot " + (dir_ / "eval").string());
  ASSERT_EQ(e.code, 0) << e.out;
  EXPECT_TRUE(contains(e.out, "[plot: " + (dir_ / "eval.png").string() + "]")) << e.out;
  EXPECT_EQ(read(dir_ / "eval.png").substr(0, 4), "\x89PNG");
  const CliResult p = run_cli("eval --checkpoint " + checkpoint + " --text " + text + " --context 32 --json --plot " +
                              (dir_ / "eval.pdf").string());
  ASSERT_EQ(p.code, 0) << p.out;
  EXPECT_EQ(read(dir_ / "eval.pdf").substr(0, 5), "%PDF-");
  EXPECT_TRUE(contains(p.out, "\"loss\"")) << "--json stays JSON on standard output";
}

TEST_F(TrainCli, ResumeRepeatsAnUninterruptedRunExactly) {
  ASSERT_EQ(run_cli(tiny("straight", 20)).code, 0);
  const CliResult first = run_cli(tiny("split", 20) + " --stop-at 7");  // mid-schedule, between evaluations
  ASSERT_EQ(first.code, 0) << first.out;
  EXPECT_TRUE(contains(first.out, "stopped at step 7")) << first.out;
  const CliResult resumed = run_cli("train --resume " + (dir_ / "split" / "checkpoint.safetensors").string() + " --text " +
                                 (dir_ / "text.txt").string() + " --out " + (dir_ / "split").string() + " --sample-tokens 5");
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  EXPECT_EQ(loss_rows("split"), loss_rows("straight"));
  // Optimisation settings may change on resume; both together, applied before validation (lr 5e-5 alone would
  // be below the stored min-lr).
  const CliResult lowered = run_cli("train --resume " + (dir_ / "split" / "checkpoint.safetensors").string() + " --text " +
                                 (dir_ / "text.txt").string() + " --out " + (dir_ / "split").string() +
                                 " --steps 22 --lr 5e-5 --min-lr 1e-5 --sample-tokens 5");
  ASSERT_EQ(lowered.code, 0) << lowered.out;
  EXPECT_TRUE(contains(lowered.out, "changed on resume: learning_rate: checkpoint 0.003, this run 5e-05")) << lowered.out;
}

// --attention builds today's decoder of the same widths with each attention (and --experts a mixture of experts in
// every MLP), so a learner compares them on the same text: each learns it, its checkpoint generates, and a run cut
// and resumed repeats the one that was not (the settings carry the architecture).
TEST_F(TrainCli, TodaysAttentionVariantsLearnTheSameTextAndResume) {
  const std::vector<std::pair<std::string, std::string>> variants = {
      {"--attention mha", "Qwen3 blocks"}, {"--attention gqa", "1 K/V head shared by groups of 4"},
      {"--attention mla", "multi-head latent attention (a latent of 16)"},
      {"--attention deltanet-hybrid", "1 Gated DeltaNet layer and 1 gated attention layer"},
      {"--attention gqa --experts 4", "4 experts of 22 in every MLP, 2 a token"}};
  auto wider = [&](const std::string& out, int steps) {  // 4 heads (groups to share) and 2 layers (one full)
    std::string c = tiny(out, steps);
    return c.replace(c.find("--n-heads 2 --n-layers 1"), 24, "--n-heads 4 --n-layers 2");
  };
  for (const auto& [flags, architecture] : variants) {
    const std::string out = "variant";
    fs::remove_all(dir_ / out);
    const CliResult r = run_cli(wider(out, 12) + " " + flags);
    ASSERT_EQ(r.code, 0) << flags << "\n" << r.out;
    EXPECT_TRUE(contains(r.out, architecture)) << flags << "\n" << r.out;
    const std::vector<std::string> rows = loss_rows(out);
    ASSERT_GE(rows.size(), 2u) << flags;
    EXPECT_LT(std::stod(rows.back().substr(rows.back().find(',') + 1)), std::stod(rows[1].substr(rows[1].find(',') + 1)))
        << flags << ": the training loss falls";
    const CliResult g = run_cli("generate --checkpoint " + (dir_ / out / "checkpoint.safetensors").string() +
                                " --prompt 'the cat' --max-new-tokens 5 --temperature 0");
    EXPECT_EQ(g.code, 0) << flags << "\n" << g.out;
  }
  const std::string hybrid = " --attention deltanet-hybrid --experts 4";
  ASSERT_EQ(run_cli(wider("straight", 12) + hybrid).code, 0);
  const CliResult first = run_cli(wider("split", 12) + hybrid + " --stop-at 5");
  ASSERT_EQ(first.code, 0) << first.out;
  const CliResult resumed = run_cli("train --resume " + (dir_ / "split" / "checkpoint.safetensors").string() + " --text " +
                                    (dir_ / "text.txt").string() + " --out " + (dir_ / "split").string() + " --sample-tokens 5");
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  EXPECT_TRUE(contains(resumed.out, "Qwen3-Next blocks")) << resumed.out;
  EXPECT_EQ(loss_rows("split"), loss_rows("straight"));
  // what does not go together is refused, naming the way out
  const CliResult book = run_cli(tiny("bad", 2) + " --experts 4");
  EXPECT_NE(book.code, 0);
  EXPECT_TRUE(contains(book.out, "choose an attention (--attention mha, gqa, mla or deltanet-hybrid)")) << book.out;
  const CliResult unknown = run_cli(tiny("bad", 2) + " --attention linear");
  EXPECT_NE(unknown.code, 0);
  EXPECT_TRUE(contains(unknown.out, "use book, mha, gqa, mla or deltanet-hybrid")) << unknown.out;
}

TEST_F(TrainCli, CtrlCSavesACheckpointAndExits130) {
  const CliResult r = run_cli(tiny("interrupted", 1000000), "timeout --preserve-status -s INT 4 ");
  EXPECT_EQ(r.code, 130) << r.out;
  EXPECT_TRUE(contains(r.out, "interrupted (Ctrl-C) at step")) << r.out;
  EXPECT_TRUE(fs::exists(dir_ / "interrupted" / "checkpoint.safetensors"));
  EXPECT_FALSE(fs::exists(dir_ / "interrupted" / "checkpoint.safetensors.tmp"));
}

TEST_F(TrainCli, BadInputsGetClearMessagesAndNothingIsLost) {
  ASSERT_EQ(run_cli(tiny("kept", 10)).code, 0);
  const std::string checkpoint = (dir_ / "kept" / "checkpoint.safetensors").string();
  const std::string before = read(checkpoint);
  std::ofstream(dir_ / "empty.txt").close();
  std::ofstream(dir_ / "short.txt") << "too short";
  std::ofstream(dir_ / "no-validation.txt") << std::string(300, 'a');  // 270 bytes train, 30 validate: < 33
  std::ofstream(dir_ / "bad.txt") << "valid text, then \xff\xfe invalid bytes and more text";
  struct Case {
    std::string args, expect;
    int code;
  };
  const std::string shape = " --tokenizer bytes --vocab-size 256 --context-length 32 --emb-dim 32 --n-layers 1 --overwrite --out " +
                             (dir_ / "kept").string();
  const std::string base = shape + " --n-heads 2 --steps 2";
  const std::vector<Case> cases = {
      {"train --text " + (dir_ / "empty.txt").string() + base, "is empty", 1},
      {"train --text " + (dir_ / "short.txt").string() + base, "fewer than one window", 1},
      {"train --text " + (dir_ / "no-validation.txt").string() + base,
       "validation split (the last 10% of the text, from --train-fraction 0.9): the text has 30 tokens, fewer than one "
       "window of 33 (the context length 32, plus the last token's target)", 1},
      {"train --text " + (dir_ / "bad.txt").string() + " --overwrite --out " + (dir_ / "kept").string(), "invalid UTF-8 at byte 17", 1},
      {"train --text " + (dir_ / "text.txt").string() + " --out " + (dir_ / "kept").string(), "already holds a run", 2},
      {"train --vocab /nonexistent --overwrite --text " + (dir_ / "text.txt").string(), "scripts/fetch-gpt2-vocab", 1},
      {"train --resume " + checkpoint + " --emb-dim 64 --text " + (dir_ / "text.txt").string() + " --out " + (dir_ / "kept").string(),
       "emb_dim: checkpoint 32, this run 64", 1},
      {"train --text /nonexistent.txt" + base, "/nonexistent.txt: cannot open", 1},
      {"train --steps 0 --n-heads 2 --text " + (dir_ / "text.txt").string() + shape, "steps must be at least 1", 2},
      {"train --n-heads 5 --steps 2 --text " + (dir_ / "text.txt").string() + shape, "not divisible by n_heads", 2},
      {"train --vocab-size 2147483648 --emb-dim 2147483648 --n-heads 2 --tokenizer bytes --overwrite --out " + (dir_ / "kept").string() +
           " --text " + (dir_ / "text.txt").string(), "too large", 2},
      {"train --emb-dim 16384 --n-layers 96 --n-heads 2 --tokenizer bytes --overwrite --out " + (dir_ / "kept").string() +
           " --text " + (dir_ / "text.txt").string(), "GiB", 2},
      {"train --lr inf --text " + (dir_ / "text.txt").string() + shape, "finite", 2},
      {"train --seed -1 --text " + (dir_ / "text.txt").string() + shape, "non-negative", 2},
      {"train --lr abc", "lr", 2},
      {"generate --prompt hi", "give the model: --checkpoint FILE (or the file first, without --checkpoint), or --gpt2 FILE",
       2},
      {"generate hi --checkpoint " + checkpoint, "--checkpoint was given twice", 2},
      {"generate --checkpoint " + (dir_ / "text.txt").string(), "text.txt", 1},
      {"generate --gpt2 " + std::string(QKV_FIXTURES) + "/gpt2_tiny_hf.safetensors --prompt hello", "outside the vocabulary", 1},
      // A text that never ends, integer options, picture options.
      {"eval --checkpoint " + checkpoint + " --text /dev/zero", "/dev/zero: is a device, not a file", 1},
      // What the input lacks (a token to score, a chat template) is the input's problem: exit 1.
      {"eval --checkpoint " + checkpoint + " --text " + (dir_ / "empty.txt").string(), "has 0 tokens; scoring needs at least 2", 1},
      {"generate --checkpoint " + checkpoint + " --chat --prompt hi", "--chat needs a model folder whose "
                                                                       "tokenizer_config.json has a chat template", 1},
      {"chat --checkpoint " + checkpoint, "is no Hugging Face model folder", 1},
      {"eval --checkpoint " + checkpoint + " --text " + (dir_ / "text.txt").string() + " --stride 0", "--stride: must be at least 1", 2},
      {"eval --checkpoint " + checkpoint + " --text " + (dir_ / "text.txt").string() + " --plot loss.bmp", ".png, .svg or .pdf", 2},
      {"train --attention-every -1 --text " + (dir_ / "text.txt").string() + shape, "--attention-every: must be at least 0", 2},
      {"--threads 0 eval --checkpoint " + checkpoint, "--threads: must be a whole number from 1 to 1024", 2},
      {"attention --checkpoint " + checkpoint + " --prompt the --format jpg", "png", 2},
      {"attention --checkpoint " + checkpoint + " --prompt the --scale 0", "--scale: must lie in 0.25", 2},
      {"generate --checkpoint " + checkpoint + " --prompt ''", "has no beginning- or end-of-text token", 2},
  };
  for (const Case& c : cases) {
    const CliResult r = run_cli(c.args);
    EXPECT_EQ(r.code, c.code) << c.args << "\n" << r.out;
    EXPECT_TRUE(contains(r.out, c.expect)) << c.args << "\n" << r.out;
    EXPECT_FALSE(contains(r.out, "0.000000 to")) << "an integer option's range is printed as integers: " << r.out;
    EXPECT_FALSE(contains(r.out, "99999")) << "a number as people write it: " << r.out;
    EXPECT_FALSE(contains(r.out, "max_length")) << "the options' names, not the code's: " << r.out;
  }
  EXPECT_EQ(read(checkpoint), before);  // no failed run touched the saved checkpoint
  // Learning rates are checked before a model folder loads (its config.json here would not load: exit 1), naming the
  // default the given one conflicts with.
  fs::create_directories(dir_ / "folder");
  std::ofstream(dir_ / "folder" / "config.json") << "{}";
  const CliResult lr = run_cli("train --resume " + (dir_ / "folder").string() + " --lr 1e-5 --text " +
                               (dir_ / "text.txt").string() + " --out " + (dir_ / "folder-run").string());
  EXPECT_EQ(lr.code, 2) << lr.out;
  EXPECT_TRUE(contains(lr.out, "--lr 1e-05 is below the default --min-lr 1e-04 (where the cosine ends); give a smaller "
                               "--min-lr too, e.g. --min-lr 1e-06")) << lr.out;
  // A warmup longer than the run: the peak learning rate is never reached, and a note says so.
  const CliResult short_run = run_cli(tiny("short", 3));
  ASSERT_EQ(short_run.code, 0) << short_run.out;
  EXPECT_TRUE(contains(short_run.out, "note: --warmup 5 is longer than --steps 3: the learning rate never reaches its "
                                      "peak --lr 0.003 (it rises to 0.0018 at the last step)")) << short_run.out;
  // A prompt longer than context_length is cut to its last context_length tokens, with a notice.
  const CliResult long_prompt = run_cli("generate --checkpoint " + checkpoint + " --max-new-tokens 3 --prompt '" + std::string(100, 'a') + "'");
  EXPECT_EQ(long_prompt.code, 0) << long_prompt.out;
  EXPECT_TRUE(contains(long_prompt.out, "only its last 32 (context_length) are used")) << long_prompt.out;
}

}  // namespace
}  // namespace qkv::test

namespace qkv::test {
namespace {

// `qkv attention` on a tiny trained model: every file, the weights' rows sum to 1, mistakes exit 2, and the HTML
// page renders in headless Chromium (Debian's chromium, which scripts/run test installs).
TEST_F(TrainCli, AttentionWritesPicturesDataAndAnHtmlPageThatRenders) {
  ASSERT_EQ(run_cli(tiny("model", 30)).code, 0);
  const std::string checkpoint = (dir_ / "model" / "checkpoint.safetensors").string();
  const fs::path out = dir_ / "attention";
  const CliResult r = run_cli("attention --checkpoint " + checkpoint + " --prompt 'the fat cat' --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* f : {"attention-grid.png", "layer01-head01.png", "layer01-head02.png", "attention.safetensors", "attention.html"})
    EXPECT_TRUE(fs::exists(out / f)) << f;
  const CliResult pdf = run_cli("attention --checkpoint " + checkpoint + " --prompt 'the fat cat' --format pdf --out " +
                                (dir_ / "pdf").string());
  ASSERT_EQ(pdf.code, 0) << pdf.out;
  for (const char* f : {"attention-grid.pdf", "layer01-head02.pdf"}) EXPECT_EQ(read(dir_ / "pdf" / f).substr(0, 5), "%PDF-") << f;
  const auto file = io::SafetensorsFile::open((out / "attention.safetensors").string());
  const Tensor maps = file.tensor("attention");
  ASSERT_EQ(maps.shape(), (Shape{1, 2, 11, 11}));  // "the fat cat" is 11 bytes
  for (int64_t row = 0; row < 2 * 11; ++row) {
    double total = 0;
    for (int64_t j = 0; j < 11; ++j) total += maps.data()[row * 11 + j];
    EXPECT_NEAR(total, 1.0, 1e-5);
    for (int64_t j = row % 11 + 1; j < 11; ++j) EXPECT_EQ(maps.data()[row * 11 + j], 0.0f) << "causal: no weight on the future";
  }
  // Chosen heads, in the order given; mistakes are usage errors.
  // An output folder given with a trailing slash: the files are named without a doubled one.
  const CliResult one = run_cli("attention --checkpoint " + checkpoint + " --prompt 'the cat' --heads 2 --out " +
                                (dir_ / "one").string() + "/");
  ASSERT_EQ(one.code, 0) << one.out;
  EXPECT_TRUE(contains(one.out, "7 tokens, 1 layer × 1 head → ")) << one.out;
  EXPECT_TRUE(contains(one.out, (dir_ / "one" / "attention.html").string())) << one.out;
  EXPECT_FALSE(contains(one.out, "//")) << one.out;
  EXPECT_EQ(io::SafetensorsFile::open((dir_ / "one" / "attention.safetensors").string()).metadata().at("heads"), "2");
  for (const auto& [args, expect] : std::vector<std::pair<std::string, std::string>>{
           {"--prompt the --heads 3", "the model has heads 1…2"},
           {"--prompt the --layers 0", "the model has layers 1…1"},
           {"--prompt ''", "the prompt is empty"},
           {"--prompt '" + std::string(40, 'x') + "'", "reads at most 32"}}) {
    const CliResult bad = run_cli("attention --checkpoint " + checkpoint + " --out " + (dir_ / "bad").string() + " " + args);
    EXPECT_EQ(bad.code, 2) << args << "\n" << bad.out;
    EXPECT_NE(bad.out.find(expect), std::string::npos) << args << "\n" << bad.out;
  }
  EXPECT_FALSE(fs::exists(dir_ / "bad" / "attention.html"));
  EXPECT_EQ(run_cli("attention --prompt hi").code, 2);

  // The page in a real browser: pinned on token 9 ('c'; the page and its link count from 1, as for layers and heads)
  // of layer 1, head 2, it draws one line per key that token attends to (weight ≥ 0.01), with the weights of
  // attention.safetensors; a space is '␣' there as in the pictures.
  const std::string profile = (dir_ / "chromium-profile").string();
  const CliResult dom = run_cli("", "timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
                                    "--disable-background-networking --disable-component-update --disable-sync "
                                    "--user-data-dir=" + profile + " --dump-dom 'file://" + (out / "attention.html").string() +
                                    "#layer=1&head=2&token=9' 2>/dev/null; true ");
  ASSERT_NE(dom.out.find("<svg"), std::string::npos)
      << "headless chromium did not render the page (is Debian's chromium installed? scripts/run test installs it):\n"
      << dom.out.substr(0, 500);
  int lines = 0, checked = 0;
  for (size_t at = dom.out.find("<line"); at != std::string::npos; at = dom.out.find("<line", at + 1)) {
    ++lines;
    const std::string tag = dom.out.substr(at, dom.out.find('>', at) - at);
    EXPECT_NE(tag.find("data-query=\"9\""), std::string::npos) << tag;
    EXPECT_NE(tag.find("data-head=\"2\""), std::string::npos) << tag;
    const size_t k = tag.find("data-key=\"") + 10, w = tag.find("data-weight=\"") + 13;
    const int64_t key = std::stoll(tag.substr(k)) - 1;
    EXPECT_NEAR(std::stod(tag.substr(w)), maps.data()[(1 * 11 + 8) * 11 + key], 0.5 / 255 + 1e-3) << tag;
    ++checked;
  }
  int expected_lines = 0;
  for (int64_t j = 0; j < 11; ++j) expected_lines += maps.data()[(1 * 11 + 8) * 11 + j] >= 0.01f;
  EXPECT_GT(lines, 0);
  EXPECT_EQ(lines, expected_lines);
  EXPECT_NE(dom.out.find("Token 9, \u201cc\u201d, in layer 1 attends most to"), std::string::npos);
  EXPECT_NE(dom.out.find(">\u2423<"), std::string::npos) << "a space as in the pictures";
  EXPECT_EQ(dom.out.find("\u00b7"), std::string::npos);
  // The page is as wide as the window (chromium's 800 px here, less the margins), and without a link it starts
  // with one head (every head at once is a tangle of lines).
  const size_t box = dom.out.find("viewBox=\"0 0 ");
  ASSERT_NE(box, std::string::npos);
  EXPECT_GT(std::stoi(dom.out.substr(box + 12)), 700) << "the page uses the window's width";
  EXPECT_NE(read(out / "attention.html").find("heads: new Set([0])"), std::string::npos);
}

}  // namespace
}  // namespace qkv::test
