#include <qkv/qkv.hpp>
#include <qkv/viz/heatmap.hpp>
#include <qkv/viz/plot.hpp>

#include <iostream>
#include <string>

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : ".";
  // SelfAttention_v1 on the book's sentence, its weights seeded as the book seeds them.
  qkv::Tensor x = qkv::Tensor::from_rows({{0.43f, 0.15f, 0.89f}, {0.55f, 0.87f, 0.66f}, {0.57f, 0.85f, 0.64f},
                                          {0.22f, 0.58f, 0.33f}, {0.77f, 0.25f, 0.10f}, {0.05f, 0.80f, 0.55f}});
  qkv::manual_seed(123);
  qkv::nn::SelfAttentionV1 attention(3, 2);
  const qkv::Tensor weights = attention.trace(x).weights;  // A = softmax(QKᵀ/√2), (6, 6)

  qkv::viz::HeatmapStyle style;
  style.title = "A = softmax(QKᵀ/√2)";
  style.row_labels = style.col_labels = {"Your", "journey", "starts", "with", "one", "step"};
  qkv::viz::save_heatmap(dir + "/weights.svg", weights, style);                   // vectors
  qkv::viz::save_heatmap(dir + "/weights.png", weights, style, {.scale = 2.0});  // a PNG for a HiDPI screen

  // A curve on a log axis; the format is the file name's.
  qkv::viz::Series loss{"loss", {31, 119, 180}, {}};
  for (int step = 1; step <= 100; ++step) loss.points.emplace_back(step, 5.0 / step);
  qkv::viz::save_plot(dir + "/loss.pdf", {loss}, {.title = "a toy loss", .x_label = "step", .y_label = "loss", .log_y = true});
  std::cout << "wrote weights.svg, weights.png and loss.pdf in " << dir << "\n";
}
