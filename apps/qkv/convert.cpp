// `qkv convert`: one model file to another format, where nothing is lost (see train::convert_model_file).
#include <cstdio>
#include <filesystem>

#include "commands.hpp"
#include "options.hpp"
#include "qkv/io/file.hpp"
#include "qkv/kernels/convert.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/nn/lora.hpp"
#include "qkv/nn/pretrained.hpp"

namespace qkv::cli {

namespace {
// An existing output is kept unless --overwrite says to replace it (an empty folder, or a device such as /dev/null,
// is written into).
void check_output(const ConvertCommand& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(options.output, ec);
  if (options.overwrite || ec || !fs::exists(status)) return;
  if (fs::is_directory(status) ? !fs::is_empty(options.output, ec) : fs::is_regular_file(status))
    throw UsageError(options.output + " already exists (" + io::describe_file(options.output) + "); give --overwrite to "
                     "replace it, or another output");
}

// Folds a PEFT adapter into the model's weights; its fully trained modules replace theirs. A module the model has no
// place for (a classifier head) is a usage error naming it.
void merge_adapter(const std::string& dir, nn::Module& model) {
  const nn::PeftAdapter adapter = nn::read_peft_adapter(dir);
  try {
    const auto rest = nn::apply_peft_adapter(model, adapter);
    if (!rest.empty()) {
      throw ValueError("its " + rest.begin()->first + " " + rest.begin()->second.shape().str() +
                       " has no place in the model (a classifier head: use the model.pth qkv finetune classify wrote)");
    }
  } catch (const ValueError& e) {
    throw UsageError("--merge " + dir + ": " + e.what());
  }
  nn::merge_lora(model);
}

// A book model file with an adapter merged in, written as the book's .pth or safetensors.
int convert_merged(const ConvertCommand& options) {
  train::ModelFile file = train::load_model_file(options.input, options.hint);
  merge_adapter(options.merge, *file.model);
  const train::ModelFormat to = train::output_format(options.to, options.output);
  if (to == train::ModelFormat::Pth) {
    train::save_book_pth(options.output, *file.model);
  } else if (to == train::ModelFormat::BookSafetensors) {
    train::save_book_safetensors(options.output, *file.model);
  } else {
    throw UsageError("--merge writes the book's .pth or safetensors (--to pth or safetensors)");
  }
  std::fprintf(stderr, "qkv convert: %s with the adapter %s merged → %s\n", options.input.c_str(), options.merge.c_str(),
               options.output.c_str());
  return 0;
}

// A Hugging Face folder to another (F32 or BF16), its tokenizer files copied along, read back and checked.
int convert_to_hf_folder(const ConvertCommand& options) {
  namespace fs = std::filesystem;
  if (!nn::is_hf_folder(options.input))
    throw UsageError("--to hf converts a Hugging Face model folder (a directory with config.json): " + options.input +
                     " is not one");
  if (nn::hf_model_type(options.input) == "gpt2")
    throw UsageError(options.input + " is a GPT-2 folder; convert its model.safetensors with --to pth, safetensors or checkpoint");
  if (options.dtype != "f32" && options.dtype != "bf16") throw UsageError("--dtype must be f32 or bf16");
  std::error_code same;
  if (fs::equivalent(options.input, options.output, same))
    throw UsageError("the output folder is the input folder; write to another");
  check_output(options);
  // With --merge: the adapter's pairs folded in; a classifier adapter's head (modules_to_save: score) makes the output
  // a *ForSequenceClassification folder.
  nn::PretrainedOptions o;
  o.adapter = options.merge;
  o.tokenizer = false;  // the weights alone: the tokenizer files are copied below
  std::unique_ptr<nn::Pretrained> loaded;
  try {
    loaded = nn::load_pretrained(options.input, o);
  } catch (const ValueError& e) {
    throw UsageError("--merge " + options.merge + ": " + e.what());
  }
  nn::Decoder* model = loaded->model.get();
  // experts kept as their file's MXFP4 rows are written widened anyway: widened first, the adapter merges into them
  if (!options.merge.empty()) model->store_matrices(kernels::WeightType::F32);
  nn::merge_lora(*model);
  const nn::HfDType dtype = options.dtype == "bf16" ? nn::HfDType::BF16 : nn::HfDType::F32;
  const bool new_classifier = loaded->is_classifier() && !model->is_classifier();
  if (new_classifier) {
    nn::save_hf_classifier(options.output, *model, loaded->classifier.weight, loaded->classifier.labels,
                           loaded->classifier.pad_id, "", dtype);
  } else {
    nn::save_hf_folder(options.output, *model, dtype);
  }
  int copied = 0;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                        "chat_template.jinja", "chat_template.json"}) {
    const fs::path from = fs::path(options.input) / f;
    std::error_code ec;
    if (!fs::exists(from, ec)) continue;
    fs::copy_file(from, fs::path(options.output) / f, fs::copy_options::overwrite_existing, ec);
    if (ec) throw IoError((fs::path(options.output) / f).string() + ": cannot write (" + ec.message() + ")");
    ++copied;
  }
  // Read back: every parameter bit for bit (F32), or as its bf16 rounding.
  auto back = nn::load_hf_decoder(options.output);
  auto a = model->named_parameters(), b = back->named_parameters();
  if (new_classifier) {  // the language-model head gives way to the adapter's classifier head
    if (!model->config.tie_word_embeddings)
      std::erase_if(a, [&](const auto& p) { return p.first == model->head_prefix() + "weight"; });
    a.emplace_back("score.weight", loaded->classifier.weight);
  }
  for (size_t i = 0; i < a.size(); ++i) {
    std::vector<float> want = nn::stacked_experts_as_checkpoint(a[i].second, b[i].second.shape()).to_vector();
    if (dtype == nn::HfDType::BF16)
      for (float& v : want) v = kernels::bf16_to_f32_reference(kernels::f32_to_bf16_reference(v));
    if (b[i].second.to_vector() != want) throw IoError(options.output + ": " + a[i].first + " did not read back as written");
  }
  std::fprintf(stderr, "qkv convert: %s (%s folder) → %s (%s, %d tokenizer file%s); read back, every parameter %s\n",
               options.input.c_str(), model->config.family->name.c_str(), options.output.c_str(), options.dtype.c_str(), copied,
               copied == 1 ? "" : "s", dtype == nn::HfDType::BF16 ? "its bf16 rounding" : "identical");
  return 0;
}
}  // namespace

int run_convert(const ConvertCommand& options) {
  if (options.to == "hf") return convert_to_hf_folder(options);
  if (nn::is_hf_folder(options.input))
    throw UsageError(options.input + " is a Hugging Face folder: convert it with --to hf (to F32 or BF16, --dtype)");
  check_output(options);
  if (!options.merge.empty()) return convert_merged(options);
  const train::ModelFormat to = train::output_format(options.to, options.output);
  train::Conversion c;
  try {
    c = train::convert_model_file(options.input, options.output, to, options.hint, options.weights_only);
  } catch (const ValueError& e) {
    throw UsageError(e.what());  // a conversion that would lose something: the user chooses
  }
  std::fprintf(stderr, "qkv convert: %s (%s) → %s (%s)%s; read back, every parameter identical\n", options.input.c_str(),
               train::model_format_name(c.from), options.output.c_str(), train::model_format_name(c.to),
               c.with_optimizer ? ", with the optimizer state" : "");
  if (!c.note.empty()) std::fprintf(stderr, "  note: %s\n", c.note.c_str());
  return 0;
}

Runner setup_convert(CLI::App& cmd, CommandContext&) {
  auto o = std::make_shared<ConvertCommand>();
  cmd.add_option("input", o->input, "The model file (any format qkv reads)")->required()->transform(folder_path());
  cmd.add_option("output", o->output, "The file to write")->required()->transform(folder_path());
  cmd.add_option("--to", o->to, "pth, safetensors (book names), checkpoint (qkv), gpt2 (Hugging Face) or hf (a Hugging "
                                "Face folder from another); default: .pth/.pt → pth, otherwise safetensors")
      ->check(one_of({"pth", "safetensors", "checkpoint", "gpt2", "hf"}));
  cmd.add_option("--dtype", o->dtype, "With --to hf: f32 or bf16 (half the bytes)")->capture_default_str()
      ->check(one_of({"f32", "bf16"}));
  add_config_options(cmd, o->hint);
  cmd.add_flag("--weights-only", o->weights_only, "Keep only the weights (drop optimizer state)");
  cmd.add_flag("--overwrite", o->overwrite, "Replace the output if it exists");
  cmd.add_option("--merge", o->merge, "A LoRA adapter folder (PEFT's layout, as qkv finetune writes) to merge into the "
                                      "weights: W + (alpha / r)·B·A")
      ->transform(folder_path());
  return [o] { return run_convert(*o); };
}

}  // namespace qkv::cli
