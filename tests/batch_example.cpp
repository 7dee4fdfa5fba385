// docs/api.md's second example: several prompts generated as one batch, each stopping on its own.
//   batch_example FOLDER "prompt" ["prompt" …]
#include <qkv/qkv.hpp>

#include <iostream>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: batch_example FOLDER PROMPT [PROMPT …]\n";
    return 2;
  }
  try {
    const auto model = qkv::nn::load_pretrained(argv[1]);
    qkv::nn::Session session(*model->model);

    std::vector<qkv::nn::GenerationRequest> requests;
    for (int i = 2; i < argc; ++i) {
      qkv::nn::GenerationRequest request;
      request.prompt = model->tokenizer->encode(argv[i]);
      request.max_new_tokens = 12;
      request.stop_ids = model->stop_ids;
      request.sampling.greedy = true;  // greedy: each reply is exactly what the prompt gives alone
      requests.push_back(request);
    }
    const auto results = qkv::nn::generate(session, requests);  // one batch: memory is read once per step for all
    for (size_t i = 0; i < results.size(); ++i)
      std::cout << i << "\t" << qkv::nn::finish_reason_name(results[i].finish) << "\t"
                << model->tokenizer->decode(results[i].tokens) << "\n";
  } catch (const qkv::Error& e) {
    std::cerr << "batch_example: " << e.what() << "\n";
    return 1;
  }
}
