// A model as a user of it needs it, from any checkpoint qkv reads, in one call: the decoder and everything that came
// with it — its tokenizer, chat template and special tokens, the ids that end generation, generation_config.json's
// defaults, and a fine-tuned classifier's head, labels and how it reads a text. What the CLI's generate, chat, eval,
// classify and attention use, and what a C++ program embeds:
//   auto m = qkv::nn::load_pretrained("Qwen3-0.6B");
//   auto ids = m->tokenizer->encode("The capital of France is");
// Not here: generation (generate.hpp), training state (train/model_file.hpp).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "qkv/nn/checkpoint.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/text/chat_template.hpp"
#include "qkv/text/tokenizer.hpp"

namespace qkv::nn {

// How load_pretrained reads a checkpoint
struct PretrainedOptions {
  ConfigHint hint;         // a book state dict's configuration, heads and tokenizer (checkpoint.hpp)
  std::string vocab_dir;   // GPT-2's encoder.json and vocab.bpe (empty: the default places)
  std::string adapter;     // a PEFT LoRA adapter folder to apply (empty: none)
  // Matrices held as bfloat16 only (half the memory; inference only): read as such from the file, or — with an
  // adapter — rounded after its update is added in float32.
  DType matrices = DType::F32;
  bool tokenizer = true;   // false: the weights alone (a conversion needs no tokenizer; Pretrained::tokenizer stays null)
};

// generation_config.json's defaults (transformers' GenerationConfig), where the folder has one
struct GenerationDefaults {
  bool do_sample = false;          // sampling (true) or greedy
  double temperature = 1.0, top_p = 1.0, min_p = 0.0, repetition_penalty = 1.0;  // sampling settings
  int64_t top_k = 0;               // 0: no top-k
  int64_t max_new_tokens = 0;      // 0: the caller's choice
};

// How a fine-tuned classifier reads a text and names its classes
struct ClassifierHead {
  Tensor weight, bias;                // (classes, C) and (classes) or undefined (Hugging Face's score has none)
  std::vector<std::string> labels;    // class names in id order ("0", "1", … when the files name none)
  bool last_real = false;             // pool at the last real token (before padding), else at the last position
  int64_t pad_id = 0;                 // what texts are padded with
  int64_t max_length = 0;             // texts are cut (and padded) to this many tokens; 0: the model's context
  int64_t classes() const { return weight.defined() ? weight.size(0) : 0; }  // how many classes (0: none)
};

// The model and what came with it
struct Pretrained {
  std::unique_ptr<Decoder> model;            // in eval mode
  std::unique_ptr<text::Tokenizer> tokenizer;  // the model's own (tokenizer.json, the GPT-2 files, …)
  std::string chat_template;                 // the template's Jinja source; empty: none
  text::ChatOptions chat;                    // its bos_token and eos_token
  std::vector<int64_t> stop_ids;             // generation ends at these (the model's EOS ids, end of text)
  int64_t bos_id = -1;                       // the beginning-of-text token (−1: none)
  GenerationDefaults generation;             // generation_config.json's, else transformers' defaults
  ClassifierHead classifier;                 // a fine-tuned classifier's (weight undefined for a language model)
  CheckpointFormat format = CheckpointFormat::QkvCheckpoint;  // what kind of file it was
  std::string path;                          // what it was loaded from
  std::string description;                   // for titles: "qwen3 folder Qwen3-0.6B + adapter lora/"
  int64_t default_context = 0;               // what eval reads per window unless told (≤ the model's context)

  bool is_classifier() const { return classifier.weight.defined(); }  // a fine-tuned classifier, not a language model
  // Token ids of a chat rendered by the model's template, as apply_chat_template(tokenize=True) gives them.
  // ValueError when the model has no chat template.
  std::vector<int64_t> encode_chat(const std::vector<text::ChatMessage>& messages, bool add_generation_prompt = true,
                                   bool enable_thinking = true) const;
};

// Loads any checkpoint qkv reads (checkpoint.hpp: a Hugging Face folder, a qkv checkpoint, a .pth, book or GPT-2
// safetensors) with its tokenizer (the folder's tokenizer.json, else GPT-2's BPE or bytes as the file says), applies
// options.adapter, and reads a classifier's labels (config.json's id2label, or the metrics.json qkv finetune wrote
// beside a model.pth or an adapter). IoError naming the file and the fix for anything wrong with it; ValueError for an
// adapter made for another model.
std::unique_ptr<Pretrained> load_pretrained(const std::string& path, const PretrainedOptions& options = {});

}  // namespace qkv::nn
