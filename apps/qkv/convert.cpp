// `qkv convert`: one model file to another format, where nothing is lost (see train::convert_model_file).
#include <cstdio>

#include "commands.hpp"

namespace qkv::cli {

int run_convert(const ConvertCommand& options) {
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

}  // namespace qkv::cli
