// docs/api.md's first example: load a Hugging Face folder (or any checkpoint qkv reads) and stream a chat reply.
//   chat_example FOLDER "your message"
#include <qkv/qkv.hpp>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: chat_example FOLDER MESSAGE\n";
    return 2;
  }
  try {
    // The decoder, its tokenizer, chat template, stop tokens and generation_config.json's defaults, in one call
    const auto model = qkv::nn::load_pretrained(argv[1]);
    qkv::nn::Session session(*model->model);  // a KV cache of fixed-size blocks

    std::vector<qkv::text::ChatMessage> chat = {{"user", argv[2]}};
    qkv::nn::GenerationRequest request;
    request.prompt = model->encode_chat(chat);  // rendered by the model's own template
    request.max_new_tokens = 24;
    request.stop_ids = model->stop_ids;
    request.sampling.greedy = true;

    qkv::text::StreamDecoder stream(*model->tokenizer);  // whole UTF-8 characters only
    qkv::nn::generate(session, {request}, [&](size_t, int64_t token) {
      std::cout << stream.push(token) << std::flush;
      return true;  // false stops the reply here
    });
    std::cout << stream.finish() << "\n";
  } catch (const qkv::Error& e) {  // a missing file, a bad folder, …: the message names it and the fix
    std::cerr << "chat_example: " << e.what() << "\n";
    return 1;
  }
}
