// Tensor storage, construction, element access and printing. The tape walk lives in autograd.cpp.
#include "qkv/core/tensor.hpp"

#include "qkv/kernels/convert.hpp"
#include "qkv/kernels/memory.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <limits>
#include <mutex>
#include <ostream>
#include <sstream>

namespace qkv {

// ---- Shape ----

Shape::Shape(std::initializer_list<int64_t> dims) : Shape(std::span<const int64_t>(dims.begin(), dims.size())) {}

Shape::Shape(std::span<const int64_t> dims) {
  if (dims.size() > static_cast<size_t>(kMaxRank)) {
    throw ShapeError("a tensor has at most " + std::to_string(kMaxRank) + " dimensions, got " +
                     std::to_string(dims.size()));
  }
  rank_ = static_cast<int>(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] < 0) throw ShapeError("negative dimension " + std::to_string(dims[i]) + " in a shape");
    dims_[i] = dims[i];
  }
  // The element count must fit (and stay addressable in bytes): checked once here, so numel() cannot overflow.
  int64_t n = 1;
  bool zero = false;
  for (int i = 0; i < rank_; ++i) zero = zero || dims_[static_cast<size_t>(i)] == 0;
  for (int i = 0; i < rank_ && !zero; ++i) {
    const int64_t d = dims_[static_cast<size_t>(i)];
    if (n > kMaxElements / d) {
      throw ShapeError("shape " + str() + " has more than " + std::to_string(kMaxElements) +
                       " elements; no tensor can be that large");
    }
    n *= d;
  }
}

int64_t Shape::numel() const {
  // A zero anywhere makes it 0 before the others are multiplied ((2³², 2³¹, 0) must not overflow on the way).
  for (int i = 0; i < rank_; ++i)
    if (dims_[static_cast<size_t>(i)] == 0) return 0;
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[static_cast<size_t>(i)];
  return n;
}

int Shape::normalize(int i, const char* op) const {
  const int d = i < 0 ? i + rank_ : i;
  if (d < 0 || d >= rank_) {
    throw ShapeError(std::string(op) + ": dimension " + std::to_string(i) + " is out of range for a tensor of shape " +
                     str());
  }
  return d;
}

std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < rank_; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims_[static_cast<size_t>(i)]);
  }
  return s + ")";
}

bool operator==(const Shape& a, const Shape& b) {
  if (a.rank_ != b.rank_) return false;
  for (int i = 0; i < a.rank_; ++i)
    if (a.dims_[static_cast<size_t>(i)] != b.dims_[static_cast<size_t>(i)]) return false;
  return true;
}

// ---- Tensor ----

namespace {
// Storage comes from the block allocator (qkv/kernels/memory.hpp), which kernel scratch shares: 64-byte aligned
// (a cache line, what AVX loads like best), cached for reuse in training.
std::shared_ptr<float> allocate(int64_t n) {
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float);
  auto* p = static_cast<float*>(memory::allocate_block(bytes));
  // A size that passed the shape check may still exceed this machine's memory: say so as a user error.
  if (!p) {
    throw ValueError("cannot allocate a tensor of " + std::to_string(bytes / sizeof(float)) + " floats (" +
                     std::to_string(bytes >> 20) + " MiB): not enough memory; use smaller sizes");
  }
  return std::shared_ptr<float>(p, [bytes](float* q) { memory::free_block(q, bytes); });
}

detail::TensorImpl& checked(const std::shared_ptr<detail::TensorImpl>& impl) {
  if (!impl) throw ValueError("use of an undefined tensor (default-constructed Tensor)");
  return *impl;
}
}  // namespace

Tensor Tensor::empty(const Shape& shape) {
  auto impl = std::make_shared<detail::TensorImpl>();
  impl->storage = allocate(shape.numel());
  impl->state = std::make_shared<detail::StorageState>();
  impl->ptr = impl->storage.get();
  impl->shape = shape;
  return Tensor(std::move(impl));
}

Tensor Tensor::zeros(const Shape& shape) { return full(shape, 0.0f); }
Tensor Tensor::ones(const Shape& shape) { return full(shape, 1.0f); }

Tensor Tensor::full(const Shape& shape, float value) {
  Tensor t = empty(shape);
  std::fill_n(t.data(), t.numel(), value);
  return t;
}

Tensor Tensor::scalar(float value) { return full(Shape{}, value); }

Tensor Tensor::from(std::span<const float> values, const Shape& shape) {
  if (static_cast<int64_t>(values.size()) != shape.numel()) {
    throw ShapeError("Tensor::from: " + std::to_string(values.size()) + " values do not fill shape " + shape.str() +
                     " (" + std::to_string(shape.numel()) + " elements)");
  }
  Tensor t = empty(shape);
  std::copy(values.begin(), values.end(), t.data());
  return t;
}

Tensor Tensor::from(std::initializer_list<float> values, const Shape& shape) {
  return from(std::span<const float>(values.begin(), values.size()), shape);
}

Tensor Tensor::from_rows(std::initializer_list<std::initializer_list<float>> rows) {
  const int64_t n_rows = static_cast<int64_t>(rows.size());
  const int64_t n_cols = n_rows ? static_cast<int64_t>(rows.begin()->size()) : 0;
  std::vector<float> values;
  values.reserve(static_cast<size_t>(n_rows * n_cols));
  for (const auto& row : rows) {
    if (static_cast<int64_t>(row.size()) != n_cols) {
      throw ShapeError("Tensor::from_rows: rows have different lengths (" + std::to_string(n_cols) + " and " +
                       std::to_string(row.size()) + ")");
    }
    values.insert(values.end(), row.begin(), row.end());
  }
  return from(values, Shape{n_rows, n_cols});
}

const Shape& Tensor::shape() const { return checked(impl_).shape; }
const char* dtype_name(DType d) { return d == DType::BF16 ? "bfloat16" : d == DType::Stored ? "stored" : "float32"; }

namespace {
[[noreturn]] void no_float32(const detail::TensorImpl& impl) {
  if (impl.dtype == DType::Stored)
    throw ValueError(std::string("a tensor ") + impl.shape.str() + " stored as " + kernels::weight_type_name(impl.stored_type) +
                     " has no float32 values: it is an inference weight (loaded with --weights, or from a GGUF file), "
                     "read by products with stored weights; load the model in float32 to train or save it");
  throw ValueError("a bfloat16 tensor " + impl.shape.str() + " has no float32 values: it is an inference weight (made "
                   "by --precision bf16 or Tensor::to_bf16_); read it with bf16 products, or load the model in float32 "
                   "to train or save it");
}
}  // namespace

DType Tensor::dtype() const { return checked(impl_).dtype; }

float* Tensor::data() {
  detail::TensorImpl& impl = checked(impl_);
  if (impl.dtype != DType::F32) no_float32(impl);
  // A write may follow: copies made from this storage are stale from here on (a relaxed load when there are none).
  if (impl.state && impl.state->copied.load(std::memory_order_relaxed)) impl.state->writes.fetch_add(1, std::memory_order_relaxed);
  return impl.ptr;
}

namespace {
std::mutex g_bf16_mutex;  // Tensor::bf16 may be called on a shared weight from several threads

std::shared_ptr<uint16_t> allocate_bf16(int64_t n) {
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(uint16_t);
  auto* p = static_cast<uint16_t*>(memory::allocate_block(bytes));
  if (!p) throw ValueError("cannot allocate " + std::to_string(n) + " bfloat16 values: not enough memory");
  return std::shared_ptr<uint16_t>(p, [bytes](uint16_t* q) { memory::free_block(q, bytes); });
}
}  // namespace

const uint16_t* Tensor::bf16() const {
  detail::TensorImpl& impl = checked(impl_);
  if (impl.dtype == DType::BF16) return impl.bf16.get();
  if (impl.dtype == DType::Stored) no_float32(impl);
  std::lock_guard<std::mutex> lock(g_bf16_mutex);
  impl.state->copied.store(true, std::memory_order_relaxed);  // before reading the count: later writes bump it
  const uint64_t writes = impl.state->writes.load(std::memory_order_relaxed);
  if (impl.bf16 && impl.bf16_writes == writes) return impl.bf16.get();
  const int64_t n = numel();
  if (!impl.bf16) impl.bf16 = allocate_bf16(n);
  kernels::f32_to_bf16(impl.ptr, impl.bf16.get(), n);
  impl.bf16_writes = writes;
  return impl.bf16.get();
}

void Tensor::to_bf16_(bool keep_values) {
  detail::TensorImpl& impl = checked(impl_);
  if (impl.dtype == DType::BF16) return;
  if (impl.dtype == DType::Stored) return to_weight_type_(kernels::WeightType::BF16);
  if (keep_values) {
    bf16();
  } else {
    std::lock_guard<std::mutex> lock(g_bf16_mutex);
    if (!impl.bf16) impl.bf16 = allocate_bf16(numel());
  }
  impl.dtype = DType::BF16;
  impl.storage.reset();
  impl.ptr = nullptr;
}

namespace {
// rows × cols of a matrix, or ValueError naming what a storage type needs
std::pair<int64_t, int64_t> matrix_of(const detail::TensorImpl& impl, kernels::WeightType type, const char* who) {
  const int64_t block = kernels::weight_type_info(type).block_elements;
  if (impl.shape.rank() != 2 || impl.shape[1] % block != 0)
    throw ValueError(std::string(who) + ": a tensor " + impl.shape.str() + " cannot be stored as " +
                     kernels::weight_type_name(type) + ": only matrices whose rows are a multiple of " +
                     std::to_string(block) + " values can; keep it in float32 or bfloat16");
  return {impl.shape[0], impl.shape[1]};
}
std::shared_ptr<unsigned char> allocate_bytes(int64_t n) {
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1));
  auto* p = static_cast<unsigned char*>(memory::allocate_block(bytes));
  if (!p) throw ValueError("cannot allocate " + std::to_string(n) + " bytes of a stored weight: not enough memory");
  return std::shared_ptr<unsigned char>(p, [bytes](unsigned char* q) { memory::free_block(q, bytes); });
}
}  // namespace

namespace {
// A bf16 matrix read where its file is mapped (a Hugging Face folder's, kept as stored), converted to another type: a
// bf16 folder quantized while loading would otherwise keep the file's pages in this process as well as the
// quantized matrices. A no-op for bf16 values in memory of their own (memory::release_file_pages).
void release_bf16_pages(const detail::TensorImpl& impl) {
  if (impl.bf16) memory::release_file_pages(impl.bf16.get(), static_cast<size_t>(impl.shape.numel()) * 2);
}
}  // namespace

void Tensor::to_weight_type_(kernels::WeightType type) {
  detail::TensorImpl& impl = checked(impl_);
  if (type == weight_type()) return;
  if (impl.dtype == DType::Stored) {  // widened first: conversions between stored types go through float32
    const auto [rows, cols] = matrix_of(impl, impl.stored_type, "to_weight_type_");
    auto values = std::shared_ptr<float>(static_cast<float*>(memory::allocate_block(static_cast<size_t>(std::max<int64_t>(rows * cols, 1)) * 4)),
                                         [n = static_cast<size_t>(std::max<int64_t>(rows * cols, 1)) * 4](float* q) { memory::free_block(q, n); });
    if (!values) throw ValueError("cannot allocate a stored weight's float32 values: not enough memory");
    if (rows * cols > 0) kernels::dequantize_rows(impl.stored_type, impl.stored.get(), values.get(), rows, cols);
    // Rows read where a file is mapped: this process's copy of their pages is no longer needed (a no-op for other
    // memory; see memory::release_file_pages).
    memory::release_file_pages(impl.stored.get(), static_cast<size_t>(rows * kernels::row_bytes(impl.stored_type, cols)));
    impl.storage = values;
    impl.ptr = values.get();
    if (!impl.state) impl.state = std::make_shared<detail::StorageState>();
    impl.stored.reset();
    impl.stored_owned = false;
    impl.dtype = DType::F32;
    if (type == kernels::WeightType::F32) return;
  }
  if (type == kernels::WeightType::F32) {  // from BF16: widened exactly
    Tensor wide = empty(impl.shape);
    wide.copy_(*this);
    auto& w = checked(wide.impl_);
    impl.storage = w.storage;
    impl.state = w.state;
    impl.ptr = w.ptr;
    release_bf16_pages(impl);
    impl.bf16.reset();
    impl.dtype = DType::F32;
    return;
  }
  if (type == kernels::WeightType::BF16) return to_bf16_();
  const auto [rows, cols] = matrix_of(impl, type, "to_weight_type_");
  const float* values = impl.dtype == DType::F32 ? impl.ptr : nullptr;
  std::vector<float> widened;
  if (impl.dtype == DType::BF16) {
    widened.resize(static_cast<size_t>(rows * cols));
    kernels::bf16_to_f32(impl.bf16.get(), widened.data(), rows * cols);
    values = widened.data();
  }
  auto bytes = allocate_bytes(rows * kernels::row_bytes(type, cols));
  if (rows * cols > 0) {
    try {
      kernels::quantize_rows(type, values, bytes.get(), rows, cols);
    } catch (const std::invalid_argument& e) {
      throw ValueError(std::string("to_weight_type_: ") + e.what() + " (a matrix " + impl.shape.str() + " to " +
                       kernels::weight_type_name(type) + ")");
    }
  }
  impl.stored = bytes;
  impl.stored_type = type;
  impl.stored_owned = true;
  impl.dtype = DType::Stored;
  impl.storage.reset();
  impl.ptr = nullptr;
  release_bf16_pages(impl);
  impl.bf16.reset();
}

Tensor Tensor::stored(kernels::WeightType type, const Shape& shape, const void* bytes, std::shared_ptr<const void> owner) {
  auto impl = std::make_shared<detail::TensorImpl>();
  impl->shape = shape;
  (void)matrix_of(*impl, type, "Tensor::stored");
  if (type == kernels::WeightType::F32) {
    impl->storage = std::shared_ptr<float>(owner, const_cast<float*>(static_cast<const float*>(bytes)));
    impl->ptr = impl->storage.get();
    impl->state = std::make_shared<detail::StorageState>();
  } else if (type == kernels::WeightType::BF16) {
    impl->bf16 = std::shared_ptr<uint16_t>(owner, const_cast<uint16_t*>(static_cast<const uint16_t*>(bytes)));
    impl->dtype = DType::BF16;
  } else {
    impl->stored = std::shared_ptr<const unsigned char>(owner, static_cast<const unsigned char*>(bytes));
    impl->stored_type = type;
    impl->dtype = DType::Stored;
  }
  return Tensor(std::move(impl));
}

void Tensor::set_stored_(kernels::WeightType type, const void* bytes, std::shared_ptr<const void> owner) {
  detail::TensorImpl& impl = checked(impl_);
  const Tensor made = stored(type, impl.shape, bytes, std::move(owner));
  const detail::TensorImpl& from = checked(made.impl_);
  impl.storage = from.storage;
  impl.state = from.state ? from.state : std::make_shared<detail::StorageState>();
  impl.ptr = from.ptr;
  impl.bf16 = from.bf16;
  impl.bf16_writes = 0;
  impl.dtype = from.dtype;
  impl.stored = from.stored;
  impl.stored_type = from.stored_type;
  impl.stored_owned = false;
}

void Tensor::set_stored_(kernels::WeightType type, const Shape& rows, const void* bytes, std::shared_ptr<const void> owner) {
  detail::TensorImpl& impl = checked(impl_);
  if (rows.numel() != impl.shape.numel())
    throw ValueError("set_stored_: rows " + rows.str() + " hold " + std::to_string(rows.numel()) + " values, the tensor " +
                     impl.shape.str() + " " + std::to_string(impl.shape.numel()));
  const Shape before = impl.shape;
  impl.shape = rows;
  try {
    set_stored_(type, bytes, std::move(owner));
  } catch (...) {
    impl.shape = before;
    throw;
  }
}

kernels::WeightType Tensor::weight_type() const {
  const detail::TensorImpl& impl = checked(impl_);
  return impl.dtype == DType::Stored ? impl.stored_type : impl.dtype == DType::BF16 ? kernels::WeightType::BF16 : kernels::WeightType::F32;
}

const void* Tensor::stored_bytes() const {
  const detail::TensorImpl& impl = checked(impl_);
  return impl.dtype == DType::Stored ? impl.stored.get() : nullptr;
}

void* Tensor::stored_bytes_mut() {
  detail::TensorImpl& impl = checked(impl_);
  if (impl.dtype != DType::Stored || !impl.stored_owned)
    throw ValueError("stored_bytes_mut: the tensor " + impl.shape.str() + " holds no stored bytes of its own to write");
  return const_cast<unsigned char*>(impl.stored.get());
}

int64_t Tensor::storage_bytes() const {
  const detail::TensorImpl& impl = checked(impl_);
  if (impl.dtype == DType::Stored) return impl.shape[0] * kernels::row_bytes(impl.stored_type, impl.shape[1]);
  return impl.shape.numel() * (impl.dtype == DType::BF16 ? 2 : 4);
}

uint16_t* Tensor::bf16_data() {
  detail::TensorImpl& impl = checked(impl_);
  if (impl.dtype != DType::BF16)
    throw ValueError("bf16_data: the tensor " + impl.shape.str() + " holds float32 values; to_bf16_ makes it bfloat16");
  return impl.bf16.get();
}
const float* Tensor::data() const {
  const detail::TensorImpl& impl = checked(impl_);
  if (impl.dtype != DType::F32) no_float32(impl);
  return impl.ptr;
}

float Tensor::item() const {
  if (numel() != 1) throw ShapeError("item(): the tensor has shape " + shape().str() + ", not one element");
  return data()[0];
}

float Tensor::at(std::initializer_list<int64_t> index) const {
  const Shape& s = shape();
  if (static_cast<int>(index.size()) != s.rank()) {
    throw ShapeError("at(): " + std::to_string(index.size()) + " indices for a tensor of shape " + s.str());
  }
  int64_t offset = 0;
  int d = 0;
  for (int64_t i : index) {
    if (i < 0 || i >= s[d]) {
      throw ShapeError("at(): index " + std::to_string(i) + " is out of range for dimension " + std::to_string(d) +
                       " of shape " + s.str());
    }
    offset = offset * s[d] + i;
    ++d;
  }
  return data()[offset];
}

Tensor& Tensor::requires_grad_(bool on) {
  auto& impl = checked(impl_);
  if (!on && impl.node) {
    throw ValueError("requires_grad_(false) on a non-leaf tensor; use detach() to cut it from the graph");
  }
  impl.requires_grad = on;
  return *this;
}

bool Tensor::requires_grad() const { return impl_ && impl_->requires_grad; }
bool Tensor::is_leaf() const { return !impl_ || !impl_->node; }
Tensor Tensor::grad() const { return checked(impl_).grad; }

void Tensor::set_grad(const Tensor& grad) {
  if (grad.defined() && !(grad.shape() == shape())) {
    throw ShapeError("set_grad: gradient of shape " + grad.shape().str() + " for a tensor of shape " + shape().str());
  }
  checked(impl_).grad = grad;
}

void Tensor::zero_grad() {
  auto& impl = checked(impl_);
  if (impl.grad.defined()) impl.grad.fill_(0.0f);
}

const char* Tensor::grad_fn_name() const { return impl_ && impl_->node ? impl_->node->name : nullptr; }

namespace {
// A tensor of `shape` over src's storage from element `offset` on, without history (a BF16 tensor's view is BF16).
Tensor view_of(const detail::TensorImpl& src, const Shape& shape, int64_t offset) {
  auto impl = std::make_shared<detail::TensorImpl>();
  impl->storage = src.storage;
  impl->state = src.state;
  impl->ptr = src.ptr ? src.ptr + offset : nullptr;
  impl->shape = shape;
  impl->dtype = src.dtype;
  if (src.dtype == DType::BF16) impl->bf16 = std::shared_ptr<uint16_t>(src.bf16, src.bf16.get() + offset);
  if (src.dtype == DType::Stored) {  // whole rows only: a block never straddles two views
    const int64_t cols = src.shape[1];
    if (offset % cols != 0 || shape.rank() != 2 || shape[1] != cols)
      throw ShapeError("view_at: a tensor stored as " + std::string(kernels::weight_type_name(src.stored_type)) +
                       " can be viewed only as whole rows of " + std::to_string(cols) + " values, not " + shape.str() +
                       " at element " + std::to_string(offset));
    impl->stored = std::shared_ptr<const unsigned char>(src.stored, src.stored.get() + offset / cols * kernels::row_bytes(src.stored_type, cols));
    impl->stored_type = src.stored_type;
    impl->stored_owned = src.stored_owned;
  }
  return Tensor(std::move(impl));
}
}  // namespace

Tensor Tensor::detach() const { return view_of(checked(impl_), shape(), 0); }

Tensor Tensor::clone() const {
  Tensor t = empty(shape());
  std::copy_n(data(), numel(), t.data());
  return t;
}

void Tensor::copy_(const Tensor& source) {
  if (!(source.shape() == shape())) {
    throw ShapeError("copy_: source shape " + source.shape().str() + " differs from destination shape " +
                     shape().str());
  }
  if (source.dtype() == DType::Stored) {  // widened as ggml dequantizes, or its bytes copied as they are
    if (dtype() == DType::Stored && weight_type() == source.weight_type())
      return void(std::memcpy(stored_bytes_mut(), source.stored_bytes(), static_cast<size_t>(storage_bytes())));
    Tensor wide = empty(shape());
    if (numel() > 0) kernels::dequantize_rows(source.weight_type(), source.stored_bytes(), wide.data(), shape()[0], shape()[1]);
    return copy_(wide);
  }
  if (dtype() == DType::Stored) {  // quantized row by row
    const Tensor wide = source.dtype() == DType::F32 ? source : [&] { Tensor w = empty(shape()); w.copy_(source); return w; }();
    try {
      if (numel() > 0) kernels::quantize_rows(weight_type(), wide.data(), stored_bytes_mut(), shape()[0], shape()[1]);
    } catch (const std::invalid_argument& e) {
      throw ValueError(std::string("copy_: ") + e.what());
    }
    return;
  }
  if (source.dtype() == DType::BF16) {  // widened exactly, or copied as it is
    if (dtype() == DType::BF16) return void(std::copy_n(source.bf16(), numel(), bf16_data()));
    return kernels::bf16_to_f32(source.bf16(), data(), numel());
  }
  if (dtype() == DType::BF16) return kernels::f32_to_bf16(source.data(), bf16_data(), numel());
  std::copy_n(source.data(), numel(), data());
}

void Tensor::fill_(float value) { std::fill_n(data(), numel(), value); }

Tensor Tensor::view_as_shape(const Shape& new_shape) const {
  auto& src = checked(impl_);
  if (new_shape.numel() != src.shape.numel()) {
    throw ShapeError("view: cannot view a tensor of shape " + src.shape.str() + " as " + new_shape.str() + " (" +
                     std::to_string(src.shape.numel()) + " vs " + std::to_string(new_shape.numel()) + " elements)");
  }
  return view_of(src, new_shape, 0);
}

Tensor Tensor::view_at(int64_t offset, const Shape& new_shape) const {
  auto& src = checked(impl_);
  if (offset < 0 || offset + new_shape.numel() > src.shape.numel()) {
    throw ShapeError("view_at: " + new_shape.str() + " at element " + std::to_string(offset) + " does not fit in " +
                     src.shape.str());
  }
  return view_of(src, new_shape, offset);
}

bool Tensor::shares_storage_with(const Tensor& other) const {
  if (!impl_ || !other.impl_ || impl_->dtype != other.impl_->dtype) return false;
  if (impl_->dtype == DType::Stored)
    return !impl_->stored.owner_before(other.impl_->stored) && !other.impl_->stored.owner_before(impl_->stored);
  if (impl_->dtype == DType::BF16)  // the same bf16 buffer (views alias it)
    return !impl_->bf16.owner_before(other.impl_->bf16) && !other.impl_->bf16.owner_before(impl_->bf16);
  return impl_->storage == other.impl_->storage;
}

// ---- printing ----

std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << s.str(); }

namespace {
void print_level(std::ostream& os, const float* p, const Shape& s, int dim, int indent) {
  if (s.rank() == 0) {
    os << std::fixed << std::setprecision(4) << p[0];
    return;
  }
  os << '[';
  int64_t stride = 1;
  for (int d = dim + 1; d < s.rank(); ++d) stride *= s[d];
  for (int64_t i = 0; i < s[dim]; ++i) {
    if (i) {
      os << ',';
      if (dim + 1 < s.rank()) {
        os << '\n' << std::string(static_cast<size_t>(dim + 1 < s.rank() - 1 ? 2 : 1), '\n').substr(1);
        os << std::string(static_cast<size_t>(indent + dim + 1), ' ');
      } else {
        os << ' ';
      }
    }
    if (dim + 1 == s.rank()) {
      std::ostringstream cell;
      cell << std::fixed << std::setprecision(4) << p[i];
      os << cell.str();
    } else {
      print_level(os, p + i * stride, s, dim + 1, indent);
    }
  }
  os << ']';
}
}  // namespace

std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  if (!t.defined()) return os << "tensor(undefined)";
  const auto flags = os.flags();
  const auto precision = os.precision();
  os << "tensor(";
  print_level(os, t.data(), t.shape(), 0, 7);
  if (t.grad_fn_name()) os << ", grad_fn=<" << t.grad_fn_name() << ">";
  else if (t.requires_grad()) os << ", requires_grad=True";
  os << ')';
  os.flags(flags);
  os.precision(precision);
  return os;
}

}  // namespace qkv
