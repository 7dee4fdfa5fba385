// `qkv apply`: run a module stored in safetensors on an input; write the output and, given dL/d(output),
// every gradient. This is how qkv is checked against PyTorch.
#include <cstdio>
#include <string>

#include "commands.hpp"
#include "options.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/nn/apply.hpp"

namespace qkv::cli {

namespace {
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

Tensor read_tensor_file(const std::string& path, const std::string& name) {
  if (ends_with(path, ".npy")) return io::load_npy(path);
  if (ends_with(path, ".safetensors")) {
    const auto file = io::SafetensorsFile::open(path);
    if (!file.contains(name)) throw IoError(path + ": has no tensor named \"" + name + "\"");
    return file.tensor(name);
  }
  throw IoError(path + ": unknown file type; give a .npy or .safetensors file");
}

int run_apply(const ApplyCommand& options) {
  auto module = nn::load_attention_module(options.module_path);
  const Tensor input = read_tensor_file(options.input_path, "input");
  Tensor grad_output;
  if (!options.grad_output_path.empty()) grad_output = read_tensor_file(options.grad_output_path, "grad_output");
  nn::ApplyOptions apply;
  apply.train = options.train;
  apply.seed = options.seed;
  std::vector<std::pair<std::string, Tensor>> result;
  const bool backward = grad_output.defined();
  try {
    result = nn::apply_module(*module, input, std::move(grad_output), apply);  // freed once the backward has used it
  } catch (const Error& e) {
    const std::string blame = backward && std::string(e.what()).rfind("grad_output", 0) == 0
                                  ? options.grad_output_path
                                  : options.input_path;
    throw IoError(blame + ": " + e.what());
  }
  io::save_safetensors(options.output_path, result,
                       {{"module", module->type_name()}, {"train", options.train ? "true" : "false"}});
  std::fprintf(stderr, "qkv apply: %s on %s → %s (%zu tensors)\n", module->type_name().c_str(),
               options.input_path.c_str(), options.output_path.c_str(), result.size());
  return 0;
}

Runner setup_apply(CLI::App& cmd, CommandContext& context) {
  auto o = std::make_shared<ApplyCommand>();
  cmd.add_option("--module", o->module_path, "Module file (.safetensors)")->required();
  cmd.add_option("--input", o->input_path, "Input: .npy, or .safetensors with a tensor \"input\"")->required();
  cmd.add_option("--output", o->output_path,
                 "Result (.safetensors): \"output\", and with --grad-output \"grad.input\" and \"grad.<parameter>\"")
      ->required();
  cmd.add_option("--grad-output", o->grad_output_path, "dL/d(output): .npy, or .safetensors with a tensor \"grad_output\"");
  auto* train_flag = cmd.add_flag("--train", o->train, "Training mode: dropout on");
  cmd.add_option("--seed", o->seed, "Seed drawn from just before forward (dropout masks)")->needs(train_flag);
  add_precision_option(cmd, context);
  return [o] { return run_apply(*o); };
}

}  // namespace qkv::cli
