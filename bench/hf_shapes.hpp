// The published config.json of the decoders the benchmarks run at their real shapes (Qwen3-0.6B, Llama-3.2-1B,
// Gemma-3-270M), for random-weight models of those shapes, and the child process the benchmarks make them in (so the
// measuring process's peak RSS is the model's alone). Shared by decoder_bench and gguf_bench; not a model zoo.
#pragma once

#include <spawn.h>
#include <sys/wait.h>

#include <string>
#include <vector>

extern char** environ;

namespace qkv::bench {

// The shapes config_json knows, for messages
inline const char* kShapeNames = "qwen3-0.6b, llama-3.2-1b, gemma-3-270m or gpt-oss-4l";

// The config.json of `shape` (sizes and settings; tokenizer ids kept; max_position_embeddings as shipped), or "" for
// a shape not listed. smoke: a tiny qwen3 stand-in with every feature, for CI.
inline std::string config_json(const std::string& shape, bool smoke) {
  if (smoke)
    return R"({"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
      "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": true})";
  if (shape == "qwen3-0.6b")
    return R"({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
      "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
      "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
      "tie_word_embeddings": true, "hidden_act": "silu", "attention_bias": false, "bos_token_id": 151643,
      "eos_token_id": 151645})";
  if (shape == "llama-3.2-1b")
    return R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
      "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
      "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
      "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "tie_word_embeddings": true, "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]})";
  if (shape == "gemma-3-270m")
    return R"({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144,
      "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
      "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
      "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256, "sliding_window": 512,
      "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                      "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                      "sliding_attention", "sliding_attention", "sliding_attention", "full_attention",
                      "sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                      "sliding_attention", "full_attention"],
      "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true, "final_logit_softcapping": null,
      "attn_logit_softcapping": null, "bos_token_id": 2, "eos_token_id": [1, 106]})";
  if (shape == "gpt-oss-4l")  // gpt-oss-20b's layers (attention, experts of 2880, a sliding then a full layer, YaRN),
                              // 4 of them with 16 experts (2 a token: 20b's active share of 1/8) and a 32k vocabulary
    return R"({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 32000,
      "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 4, "num_attention_heads": 64,
      "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
      "rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
      "original_max_position_embeddings": 4096, "truncate": false}, "sliding_window": 128,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
      "num_local_experts": 16, "num_experts_per_tok": 2, "swiglu_limit": 7.0, "attention_bias": true,
      "tie_word_embeddings": false, "hidden_act": "silu", "eos_token_id": 31999})";
  return "";
}

// Runs `args` (args[0] the program) as a child process with this environment and waits for it; its exit status, or
// -1 when it could not be started or did not exit normally.
inline int run_child(std::vector<std::string> args) {
  std::vector<char*> cargs;
  for (auto& s : args) cargs.push_back(s.data());
  cargs.push_back(nullptr);
  pid_t pid;
  if (posix_spawn(&pid, cargs[0], nullptr, nullptr, cargs.data(), environ) != 0) return -1;
  int status = 0;
  if (waitpid(pid, &status, 0) < 0) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace qkv::bench
