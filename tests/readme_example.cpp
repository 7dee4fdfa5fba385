#include <qkv/qkv.hpp>

#include <iostream>

int main() {
  // The book's embeddings of "Your journey starts with one step" (6 tokens × 3 dimensions).
  qkv::Tensor x = qkv::Tensor::from_rows({{0.43f, 0.15f, 0.89f}, {0.55f, 0.87f, 0.66f}, {0.57f, 0.85f, 0.64f},
                                          {0.22f, 0.58f, 0.33f}, {0.77f, 0.25f, 0.10f}, {0.05f, 0.80f, 0.55f}});

  qkv::manual_seed(789);                     // torch.manual_seed(789)
  qkv::nn::SelfAttentionV2 attention(3, 2);  // SelfAttention_v2(d_in=3, d_out=2)
  qkv::Tensor context = attention(x);        // C = softmax(QKᵀ/√2)·V, shape (6, 2)
  std::cout << context << "\n";              // first row: [-0.0739, 0.0713], as in the book

  // Trainable: one AdamW step on a toy loss moves Wq, Wk and Wv.
  qkv::optim::AdamW optimizer(attention.named_parameters(), {.lr = 0.01});
  qkv::Tensor loss = qkv::sum(qkv::mul(context, context));
  loss.backward();
  optimizer.step();
  std::cout << "loss " << loss.item() << ", after one step " << qkv::sum(qkv::mul(attention(x), attention(x))).item()
            << "\n";
}
