// The option groups the qkv commands share, and their checks (see options.hpp).
#include "options.hpp"

#include <cstdio>

#include "qkv/core/precision.hpp"
#include "qkv/core/settings.hpp"
#include "qkv/kernels/quant.hpp"

namespace qkv::cli {

CLI::Validator checked(std::function<std::string(const std::string&)> check) {
  return CLI::Validator(
      [check = std::move(check)](std::string& text) -> std::string {
        try {
          return check(text);
        } catch (const Error& e) {
          return e.what();
        }
      },
      "");
}

std::string parse_problem(const Error& error, const std::string& what) {
  const std::string message = error.what(), prefix = what + " = ";
  return message.rfind(prefix, 0) == 0 ? message.substr(prefix.size()) : message;
}

namespace {
// The text as an integer, or an Error whose message is only the problem ("\"abc\" is not an integer").
int64_t whole_number(const std::string& text) {
  try {
    return parse_int(text, "value");
  } catch (const ValueError& e) {
    throw ValueError(parse_problem(e, "value"));
  }
}
double real_number(const std::string& text) {
  try {
    return parse_real(text, "value");
  } catch (const ValueError& e) {
    throw ValueError(parse_problem(e, "value"));
  }
}
}  // namespace

CLI::Validator folder_path() {
  return CLI::Validator(
      [](std::string& path) {
        while (path.size() > 1 && path.back() == '/') path.pop_back();
        return std::string();
      },
      "");
}

CLI::Validator int_at_least(int64_t least) {
  return checked([least](const std::string& text) {
    return whole_number(text) >= least ? std::string() : "must be at least " + std::to_string(least) + ", not " + text;
  });
}

CLI::Validator int_in_range(int64_t least, int64_t most) {
  return checked([least, most](const std::string& text) {
    const int64_t v = whole_number(text);
    return v >= least && v <= most ? std::string()
                                   : "must be a whole number from " + std::to_string(least) + " to " +
                                         std::to_string(most) + ", not " + text;
  });
}

CLI::Validator positive_real() {
  return checked([](const std::string& text) {
    return real_number(text) > 0 ? std::string() : "must be a positive number, not " + text;
  });
}

CLI::Validator non_negative_real() {
  return checked([](const std::string& text) {
    return real_number(text) >= 0 ? std::string() : "must not be negative, not " + text;
  });
}

CLI::Validator one_of(std::vector<std::string> names) {
  return checked([names = std::move(names)](const std::string& text) {
    std::string list;
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] == text) return std::string();
      list += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
    }
    return "must be " + list + ", not \"" + printable(text) + "\"";
  });
}

void add_config_options(CLI::App& command, nn::ConfigHint& hint) {
  command.add_option("--config", hint.config,
                     "For a book state dict: the book's configuration dict as a JSON file (GPT_CONFIG_124M; Python's "
                     "True/False accepted) or a preset: gpt2-small, gpt2-medium, gpt2-large, gpt2-xl");
  command.add_option("--n-heads", hint.n_heads, "For a book state dict: its attention heads (the one setting its "
                                                "tensors do not show)")
      ->check(int_at_least(1));
  command.add_option("--tokenizer", hint.tokenizer, "gpt2 or bytes (default: the checkpoint's; for a .pth, bytes "
                                                    "when the vocabulary is 256, else gpt2)")
      ->check(one_of({"gpt2", "bytes"}));
}

void add_model_options(CLI::App& command, ModelOptions& m) {
  // (also the first argument without a name: `qkv generate model.gguf --prompt …`, as llama.cpp and ollama users type)
  auto* ckpt = command.add_option("--checkpoint,MODEL", m.checkpoint,
                                  "The model: a qkv checkpoint, a PyTorch .pth (the book's model.pth or "
                                  "model_and_optimizer.pth), a safetensors state dict (book or Hugging Face names), "
                                  "a Hugging Face model folder (config.json, safetensors, tokenizer.json), or a GGUF "
                                  "file (llama.cpp's; quantized blocks kept as they are); --checkpoint may be left out")
      ->transform(folder_path());
  auto* gpt2 = command.add_option("--gpt2", m.gpt2_path, "GPT-2 weights: Hugging Face model.safetensors");
  ckpt->excludes(gpt2);
  add_config_options(command, m.hint);
  command.add_option("--vocab", m.vocab_dir, "Directory with GPT-2's encoder.json and vocab.bpe")->transform(folder_path());
  command.add_option("--adapter", m.adapter, "A LoRA adapter folder (PEFT's adapter_config.json and "
                                             "adapter_model.safetensors, as qkv finetune --lora-rank writes) to apply")
      ->transform(folder_path());
}

void add_weights_option(CLI::App& command, ModelOptions& m) {
  command.add_option("--weights", m.weights,
                     "How matrices are kept in memory: stored (as the file stores them: a bf16 folder stays bf16), or "
                     "converted while loading to f32, bf16, f16, q8_0, q4_0, q4_k, q5_k, q6_k or mxfp4 (ggml's block formats)")
      ->capture_default_str()
      ->type_name("TYPE")
      ->check(checked([](const std::string& text) {
        return text == "stored" || kernels::weight_type_from_name(text)
                   ? std::string()
                   : "must be stored, f32, bf16, f16, q8_0, q4_0, q4_k, q5_k, q6_k or mxfp4, not \"" + printable(text) + "\"";
      }));
}

void add_picture_options(CLI::App& command, viz::PictureOptions& p, const std::string& names) {
  // The name becomes the enum's number here (CLI11 reads that into p.format), so a wrong one is refused in our words.
  command.add_option(names, p.format, "Pictures as png, svg or pdf (vectors, for papers and slides)")
      ->transform(CLI::Validator(
          [](std::string& text) -> std::string {
            const std::string lower = CLI::detail::to_lower(text);
            for (const auto& [name, format] : {std::pair{"png", viz::PictureFormat::png},
                                               std::pair{"svg", viz::PictureFormat::svg},
                                               std::pair{"pdf", viz::PictureFormat::pdf}}) {
              if (lower != name) continue;
              text = std::to_string(static_cast<int>(format));
              return "";
            }
            return "must be png, svg or pdf, not \"" + printable(text) + "\"";
          },
          ""))
      ->type_name("FORMAT")
      ->default_str("png");
  command.add_option("--scale", p.scale, "PNG pixels per point: 2 for HiDPI screens (0.25 to 8)")->capture_default_str()
      ->check(checked([](const std::string& text) {
        const double v = real_number(text);
        return v >= 0.25 && v <= 8.0 ? std::string() : "must lie in 0.25 … 8, not " + text;
      }));
}

void add_sampling_options(CLI::App& cmd, GenerateCommand& g) {
  cmd.add_option("--max-new-tokens", g.max_new_tokens, "Tokens to generate")->capture_default_str()->check(int_at_least(0));
  cmd.add_option("--temperature", g.temperature, "Sampling temperature (0: greedy)")->capture_default_str()
      ->check(non_negative_real())
      ->each([&g](const std::string& v) { g.sampling_given.push_back("--temperature " + v); });
  cmd.add_option("--top-k", g.top_k, "Sample from the k likeliest tokens (0: all)")->capture_default_str()
      ->check(int_at_least(0))
      ->each([&g](const std::string& v) { g.sampling_given.push_back("--top-k " + v); });
  cmd.add_option("--top-p", g.top_p, "Nucleus sampling threshold, in (0, 1]")->capture_default_str()
      ->check(checked([](const std::string& text) {
        const double v = real_number(text);
        return v > 0.0 && v <= 1.0 ? std::string() : "must lie in (0, 1], not " + text;
      }))
      ->each([&g](const std::string& v) { g.sampling_given.push_back("--top-p " + v); });
  cmd.add_option("--seed", g.seed, "Sampling seed")->capture_default_str()->check(checked([](const std::string& text) {
    try {
      parse_uint(text, "value");
    } catch (const ValueError& e) {
      return parse_problem(e, "value");
    }
    return std::string();
  }));
  const auto real_in = [](double low, double high) {
    return checked([=](const std::string& text) {
      const double v = real_number(text);
      if (v >= low && v <= high) return std::string();
      char range[64];
      std::snprintf(range, sizeof range, "must lie in [%g, %g], not ", low, high);
      return range + text;
    });
  };
  cmd.add_option("--min-p", g.min_p, "Keep tokens at least this fraction of the likeliest one's probability (0: off)")
      ->capture_default_str()->check(real_in(0.0, 1.0))
      ->each([&g](const std::string& v) { g.sampling_given.push_back("--min-p " + v); });
  cmd.add_option("--repetition-penalty", g.repetition_penalty,
                 "Divide the positive logits (multiply the negative) of tokens already seen (1: off)")
      ->capture_default_str()->check(real_in(1e-3, 1e3));
  cmd.add_option("--presence-penalty", g.presence_penalty, "Subtract from the logit of every token seen (0: off)")
      ->capture_default_str()->check(real_in(-100.0, 100.0));
  cmd.add_option("--frequency-penalty", g.frequency_penalty, "Subtract per time a token was seen (0: off)")
      ->capture_default_str()->check(real_in(-100.0, 100.0));
  cmd.add_flag("--replace-invalid", g.replace_invalid, "Replace invalid UTF-8 in the prompt with U+FFFD");
  cmd.add_flag("--greedy", g.greedy, "Always take the likeliest token (--temperature is then not used)");
  auto* no_cache = cmd.add_flag("--no-cache", g.no_cache, "Recompute the whole context for every token (slow; for comparison)");
  add_kv_cache_option(cmd, g.kv_cache)->excludes(no_cache);
}

CLI::Option* add_kv_cache_option(CLI::App& command, std::string& type) {
  return command.add_option("--kv-cache", type,
                            "How the KV cache stores keys and values: f32, f16, bf16 (half the memory) or q8_0 (ggml's "
                            "8-bit blocks, 0.27×; needs kv heads × head size a multiple of 32)")
      ->capture_default_str()->type_name("TYPE")
      ->check(checked([](const std::string& text) {
        return text == "f32" || text == "f16" || text == "bf16" || text == "q8_0"
                   ? std::string()
                   : "must be f32, f16, bf16 or q8_0, not \"" + printable(text) + "\"";
      }));
}

void note_unused_sampling(const GenerateCommand& g, const char* command) {
  if (!g.greedy || g.sampling_given.empty()) return;
  std::string given;
  for (size_t i = 0; i < g.sampling_given.size(); ++i)
    given += (i == 0 ? "" : i + 1 == g.sampling_given.size() ? " and " : ", ") + g.sampling_given[i];
  std::fprintf(stderr, "qkv %s: note: --greedy always takes the likeliest token; %s %s not used\n", command,
               printable(given).c_str(), g.sampling_given.size() == 1 ? "is" : "are");
}

void add_precision_option(CLI::App& command, CommandContext& context) {
  command.add_option("--precision", context.precision_text,
                     "Matrix products in fp32, bf16 (bf16 operands, float32 sums; CPUs with AVX512_BF16 or AMX) or auto")
      ->capture_default_str()
      ->check(checked([](const std::string& text) {
        resolve_precision(text, "--precision");
        return std::string();
      }));
}

}  // namespace qkv::cli
