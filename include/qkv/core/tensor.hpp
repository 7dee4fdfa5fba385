// Tensor: float32, contiguous, row-major, rank 0..4, with an optional gradient and a place on the autograd tape.
// A Tensor is a handle: copies share the same storage (as in PyTorch). Views (reshape, detach) share
// storage too; every op that changes layout returns a new contiguous tensor.
// Not here: the differentiable operations (ops.hpp) and the tape walk (autograd.hpp).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/kernels/quant.hpp"

namespace qkv {

inline constexpr int kMaxRank = 4;
// The most elements one tensor may have (2⁴⁰ floats = 4 TiB): a shape beyond it is a ShapeError, never an overflow.
inline constexpr int64_t kMaxElements = int64_t{1} << 40;

// The sizes of a tensor's dimensions, outermost first. Rank 0 is a scalar.
class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);  // A shape from its sizes, e.g. Shape{2, 6, 3}
  explicit Shape(std::span<const int64_t> dims);  // A shape from a span of sizes

  // Dimensions (0 for a scalar)
  int rank() const { return rank_; }
  int64_t numel() const;  // Elements: the product of the sizes (1 for a scalar)
  // i may be negative, counting from the back (-1 is the last dimension).
  int64_t operator[](int i) const { return dims_[static_cast<size_t>(normalize(i))]; }
  int64_t& operator[](int i) { return dims_[static_cast<size_t>(normalize(i))]; }
  // Turns a possibly negative dimension index into 0..rank-1, or throws ShapeError naming `op`.
  int normalize(int i, const char* op = "index") const;
  std::span<const int64_t> dims() const { return {dims_.data(), static_cast<size_t>(rank_)}; }
  std::string str() const;  // "(2, 6, 3)"

  friend bool operator==(const Shape& a, const Shape& b);  // same rank and sizes

 private:
  int rank_ = 0;
  std::array<int64_t, kMaxRank> dims_{};
};

// How a tensor stores its values: float32 (every tensor unless made otherwise), bfloat16 only — inference weights at
// half the memory (Tensor::to_bf16_), read as they are by bf16 products (kernels::gemm_bf16), by products that widen
// them (kernels::gemm_weight) and lookups — or Stored: a weight matrix kept in another of kernels/quant.hpp's storage
// types (float16 or one of ggml's block formats; Tensor::weight_type says which), read only by kernels::gemm_weight's
// products (x·Wᵀ, and dX = dY·W through a frozen weight) and by lookups of its rows.
enum class DType { F32, BF16, Stored };
const char* dtype_name(DType d);  // "float32", "bfloat16" or "stored"

namespace detail {
struct TensorImpl;
struct Node;
}  // namespace detail

// A dense float32 tensor: owns its values or views another's, and records the ops that made it for backward()
class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false

  static Tensor empty(const Shape& shape);  // uninitialised values
  static Tensor zeros(const Shape& shape);  // All zeros
  static Tensor ones(const Shape& shape);  // All ones
  static Tensor full(const Shape& shape, float value);  // Every element `value`
  static Tensor scalar(float value);  // A rank-0 tensor holding `value`
  // Copies `values` (row-major) into a new tensor; throws ShapeError if the count does not match.
  static Tensor from(std::span<const float> values, const Shape& shape);
  static Tensor from(std::initializer_list<float> values, const Shape& shape);
  // A 2-D tensor from nested rows, e.g. {{0.43f, 0.15f, 0.89f}, {...}}; all rows must have one length.
  static Tensor from_rows(std::initializer_list<std::initializer_list<float>> rows);

  // Whether it holds a tensor (a default-constructed Tensor does not)
  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const;  // Its shape
  // Dimensions
  int rank() const { return shape().rank(); }
  // The size of dimension `dim`
  int64_t size(int dim) const { return shape()[dim]; }
  // Elements
  int64_t numel() const { return shape().numel(); }

  // The values, row-major (contiguous). A BF16 tensor has no float32 values: ValueError naming it.
  float* data();
  const float* data() const;  // The values, row-major (contiguous); ValueError for a BF16 tensor
  DType dtype() const;  // F32 unless to_bf16_ made it BF16
  // The values as a span
  std::span<float> values() { return {data(), static_cast<size_t>(numel())}; }
  // The values as a span
  std::span<const float> values() const { return {data(), static_cast<size_t>(numel())}; }
  // The values rounded to bfloat16 (nearest even, NaN kept; kernels/convert.hpp's bit patterns), row-major: made on
  // first use and kept with the tensor until its storage is next written through data() (by this handle or any view
  // of the same storage), then made afresh. So a weight's bf16 copy is rounded once per optimiser step however
  // often the step reads it, and an activation's once however many products read it. Writes through a pointer
  // taken from data() before this call are not seen: take the pointer again to write.
  // A BF16 tensor's own values are returned as they are.
  const uint16_t* bf16() const;
  // In place, for every handle of this tensor: its values become bfloat16 (rounded to nearest even) and its float32
  // storage is let go (views made before keep their float32 values), so a weight takes half the memory and bf16
  // products read it as it is. With keep_values false the values are left unset for a loader to write through
  // bf16_data() (the float32 ones are never read: pages never touched stay unallocated). A no-op on a BF16 tensor.
  void to_bf16_(bool keep_values = true);
  uint16_t* bf16_data();  // a BF16 tensor's writable values (ValueError for F32)
  // In place, for every handle of this tensor: a matrix (rank 2, its columns a multiple of the type's block) becomes
  // `type` — F32 a no-op, BF16 to_bf16_, F16 and the block types rounded or quantized row by row as ggml does
  // (kernels::quantize_rows) — and its float32 storage is let go (views made before keep it). A stored tensor is
  // widened first when it is converted again. ValueError for other shapes, or non-finite values in a block type.
  void to_weight_type_(kernels::WeightType type);
  // A matrix over `bytes` (rows of row_bytes(type, cols)) that `owner` keeps alive, e.g. a mapped file's tensor: no
  // copy. F32 and BF16 bytes give F32 and BF16 tensors (read-only: data() would write them); ValueError when the
  // shape is not (rows, cols) or the columns are not a multiple of the block.
  static Tensor stored(kernels::WeightType type, const Shape& shape, const void* bytes, std::shared_ptr<const void> owner);
  // In place, for every handle of this tensor: its values become the rows at `bytes` (as Tensor::stored: F32, BF16
  // or Stored), which `owner` keeps alive — a mapped file's tensor, not copied — and its own storage is let go (views
  // made before keep it). ValueError when the tensor is not a matrix the type can hold.
  void set_stored_(kernels::WeightType type, const void* bytes, std::shared_ptr<const void> owner);
  // The same for a weight its file keeps as rows of another shape: the tensor's shape becomes `rows` (rows, cols),
  // the same number of values — gpt-oss's stacked experts, (E, C, 2F) as used, stored as (E·2F, C) rows of MXFP4
  // (ops.hpp's mixture_of_experts reads either). ValueError when the counts differ or the type cannot hold the rows.
  void set_stored_(kernels::WeightType type, const Shape& rows, const void* bytes, std::shared_ptr<const void> owner);
  // How the values are stored: F32, BF16, or a Stored tensor's type
  kernels::WeightType weight_type() const;
  // A Stored tensor's bytes (rows of row_bytes(weight_type(), cols)); nullptr for F32 and BF16 tensors
  const void* stored_bytes() const;
  // A Stored tensor's bytes to write (a loader filling a tensor made by to_weight_type_ or Tensor::stored); ValueError
  // when the tensor is not Stored or its bytes are not its own
  void* stored_bytes_mut();
  // Bytes the values take in memory: 4 per value, 2 for BF16, the rows' bytes for a Stored tensor
  int64_t storage_bytes() const;
  // A copy of the values
  std::vector<float> to_vector() const { return {data(), data() + numel()}; }
  float item() const;                                 // the value of a one-element tensor
  float at(std::initializer_list<int64_t> index) const;  // bounds-checked element read

  // Autograd. A leaf that requires grad collects dL/dself in grad() when backward() runs.
  Tensor& requires_grad_(bool on = true);
  bool requires_grad() const;
  bool is_leaf() const;
  Tensor grad() const;  // undefined until a backward pass reached this tensor
  void set_grad(const Tensor& grad);
  void zero_grad();     // sets an existing grad to zeros (PyTorch 1.13's default)
  // Runs reverse-mode differentiation from this tensor. Without an argument the tensor must hold one
  // element (a loss); otherwise grad_output has this tensor's shape. The graph is freed afterwards.
  void backward() const;
  void backward(const Tensor& grad_output) const;
  // The same, handing grad_output over: its memory goes as soon as the last op has used it.
  void backward(Tensor&& grad_output) const;
  const char* grad_fn_name() const;  // the op that made this tensor, or nullptr for a leaf

  Tensor detach() const;               // same storage, no history, requires_grad false
  Tensor clone() const;                // a copy of the values, no history
  // Copies values in place; the shapes must be equal. Into a BF16 tensor: rounded to nearest even (NaN kept); from
  // a BF16 tensor into a float32 one: widened exactly.
  void copy_(const Tensor& source);
  void fill_(float value);  // Sets every element to `value`, in place (no gradient is recorded)
  // A tensor of another shape over the same storage (numel must match). No history: ops.hpp's reshape
  // is the differentiable form.
  Tensor view_as_shape(const Shape& shape) const;
  // A tensor of `shape` over this one's storage from element `offset` on (ShapeError unless it fits inside):
  // one allocation carved into many tensors, such as every gradient of a model in one buffer.
  Tensor view_at(int64_t offset, const Shape& shape) const;
  bool shares_storage_with(const Tensor& other) const;

  // For ops and the tape (detail).
  detail::TensorImpl* impl() const { return impl_.get(); }
  explicit Tensor(std::shared_ptr<detail::TensorImpl> impl) : impl_(std::move(impl)) {}

 private:
  std::shared_ptr<detail::TensorImpl> impl_;
};

namespace detail {

// One recorded operation: the tensors it read and how to send a gradient back to them.
struct Node {
  const char* name = "";
  std::vector<Tensor> inputs;
  // Called with dL/d(output); adds each input's share into that input's gradient (see accumulate_grad).
  std::function<void(const Tensor& grad_output)> backward;
};

// What every view of one storage shares: whether any of them has a bf16 copy, and a count of writes since.
struct StorageState {
  std::atomic<bool> copied{false};
  std::atomic<uint64_t> writes{0};
};

struct TensorImpl {
  std::shared_ptr<float> storage;  // aligned allocation shared by views
  std::shared_ptr<StorageState> state;  // shared by views, as storage
  std::shared_ptr<uint16_t> bf16;       // Tensor::bf16()'s copy, or null
  uint64_t bf16_writes = 0;             // state->writes when that copy was made
  DType dtype = DType::F32;             // BF16: storage and ptr are null, bf16 holds the values
  // Stored: storage, ptr and bf16 are null; `stored` holds the rows in `stored_type` (owned, or kept alive for a
  // mapped file: then `stored_owned` is false and the bytes are never written)
  std::shared_ptr<const unsigned char> stored;
  kernels::WeightType stored_type = kernels::WeightType::F32;
  bool stored_owned = false;
  float* ptr = nullptr;
  Shape shape;
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<Node> node;  // set for results of recorded ops
  bool graph_released = false; // backward() has run through this tensor's node and freed it
};

}  // namespace detail

// Prints like PyTorch: tensor([[0.2996, 0.8053], ...]).
std::ostream& operator<<(std::ostream& os, const Tensor& t);
std::ostream& operator<<(std::ostream& os, const Shape& s);

}  // namespace qkv
