// A chat template (the input) rendered for a short conversation: it parses and renders, or fails with a qkv::Error —
// never a crash, a hang (rendering is bounded in steps) or an unbounded output.
#include "fuzz_common.hpp"
#include "qkv/text/chat_template.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  qkv::fuzz::expect_only_qkv_errors([&] {
    const auto chat = qkv::text::ChatTemplate::parse(source);
    qkv::text::ChatOptions options;
    options.bos_token = "<s>";
    options.eos_token = "</s>";
    (void)chat.render({{"system", "Be brief."}, {"user", "Hi <think>x</think>"}, {"assistant", "Hello."}, {"user", "Bye"}},
                      options);
  });
  return 0;
}
