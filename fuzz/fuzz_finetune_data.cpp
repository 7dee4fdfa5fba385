// Fine-tuning data (the input): as CSV and as TSV rows, and as the book's instruction JSON. Each parses or fails with a
// qkv::Error; every parsed row has its fields, and every parsed entry gives an Alpaca prompt.
#include "fuzz_common.hpp"
#include "qkv/text/records.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (char delimiter : {',', '\t'}) {
    qkv::fuzz::expect_only_qkv_errors([&] {
      std::vector<int64_t> lines;
      const auto rows = qkv::text::parse_delimited(text, delimiter, "fuzz.csv", &lines);
      if (rows.size() != lines.size()) __builtin_trap();
      for (size_t i = 1; i < lines.size(); ++i)
        if (lines[i] < lines[i - 1]) __builtin_trap();  // rows start on increasing lines
    });
  }
  qkv::fuzz::expect_only_qkv_errors([&] {
    for (const auto& e : qkv::text::parse_instructions(text, "fuzz.json"))
      if (qkv::text::alpaca_prompt(e).find(e.instruction) == std::string::npos) __builtin_trap();
  });
  return 0;
}
