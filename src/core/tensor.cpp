// Tensor storage, construction, element access and printing. The tape walk lives in autograd.cpp.
#include "qkv/core/tensor.hpp"

#include "qkv/kernels/memory.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <ostream>
#include <sstream>

#include <sys/mman.h>

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
// Large blocks kept for reuse instead of going back to the system, when memory::set_block_cache_limit allows it
// (training does): a training step allocates the same sizes step after step, and a fresh block of hundreds of MiB
// costs a page fault per 4 KiB page on first touch (the kernel zeroes each one). Blocks of at least kMinBytes are
// cached by exact size, up to the limit in all; beyond that they are freed at once. Off by default: a single
// forward and backward (qkv apply) would only hold more memory (268 → 362 MiB at T = 4096, measured before the
// backward pass learned to write first gradients in place). The cache lives until the process ends (never destroyed, so a tensor freed by
// a static destructor still finds it; what it holds stays reachable, not leaked).
class LargeBlockCache {
 public:
  static constexpr size_t kMinBytes = size_t{4} << 20;
  float* take(size_t bytes) {
    if (bytes < kMinBytes) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.find(bytes);
    if (it == blocks_.end()) return nullptr;
    float* p = it->second;
    blocks_.erase(it);
    held_ -= bytes;
    return p;
  }
  bool give(float* p, size_t bytes) {
    if (bytes < kMinBytes) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_ + bytes > static_cast<size_t>(memory::block_cache_limit())) return false;
    blocks_.emplace(bytes, p);
    held_ += bytes;
    return true;
  }

 private:
  std::mutex mutex_;
  std::multimap<size_t, float*> blocks_;
  size_t held_ = 0;
};
LargeBlockCache& block_cache() {
  static LargeBlockCache* cache = new LargeBlockCache;
  return *cache;
}

// Blocks of at least LargeBlockCache::kMinBytes come straight from the kernel (mmap) and go straight back
// (munmap). Through malloc they would not: glibc raises its mmap threshold each time such a block is freed, so
// later ones land on the heap, and freed heap memory stays in the process — qkv apply's peak RSS at T = 4096
// went from 163 to 207 MiB on some runs and not others. They are asked for transparent huge pages: GPT-2 B8T256
// training measured 275 against 264 tok/s without (medians of 3, interleaved).
// Under AddressSanitizer (GCC's macro, clang's feature test) every block goes through operator new, so its bounds
// stay checked.
#if defined(__SANITIZE_ADDRESS__)
#define QKV_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define QKV_ASAN 1
#endif
#endif
#ifdef QKV_ASAN
constexpr bool kMapLargeBlocks = false;
#else
constexpr bool kMapLargeBlocks = true;
#endif
bool mapped(size_t bytes) { return kMapLargeBlocks && bytes >= LargeBlockCache::kMinBytes; }

float* map_block(size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  ::madvise(p, bytes, MADV_HUGEPAGE);  // fewer faults and TLB misses; a hint, so a refusal changes nothing
  return static_cast<float*>(p);
}
void release_block(float* p, size_t bytes) {
  if (mapped(bytes)) {
    ::munmap(p, bytes);
  } else {
    ::operator delete[](p, std::align_val_t(64));
  }
}

// 64-byte alignment: a cache line, and what AVX2 loads like best (mapped blocks are page-aligned).
std::shared_ptr<float> allocate(int64_t n) {
  const size_t count = static_cast<size_t>(std::max<int64_t>(n, 1));
  const size_t size = count * sizeof(float);
  LargeBlockCache& cache = block_cache();
  float* p = cache.take(size);
  // A size that passed the shape check may still exceed this machine's memory: say so as a user error.
  if (!p) {
    p = mapped(size) ? map_block(size) : static_cast<float*>(::operator new[](size, std::align_val_t(64), std::nothrow));
  }
  if (!p) {
    throw ValueError("cannot allocate a tensor of " + std::to_string(count) + " floats (" +
                     std::to_string(count * sizeof(float) >> 20) + " MiB): not enough memory; use smaller sizes");
  }
  const int64_t bytes = static_cast<int64_t>(size);
  memory::detail::on_allocate(bytes);
  return std::shared_ptr<float>(p, [bytes, &cache](float* q) {
    if (!cache.give(q, static_cast<size_t>(bytes))) release_block(q, static_cast<size_t>(bytes));
    memory::detail::on_free(bytes);
  });
}

detail::TensorImpl& checked(const std::shared_ptr<detail::TensorImpl>& impl) {
  if (!impl) throw ValueError("use of an undefined tensor (default-constructed Tensor)");
  return *impl;
}
}  // namespace

Tensor Tensor::empty(const Shape& shape) {
  auto impl = std::make_shared<detail::TensorImpl>();
  impl->storage = allocate(shape.numel());
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
float* Tensor::data() { return checked(impl_).ptr; }
const float* Tensor::data() const { return checked(impl_).ptr; }

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

Tensor Tensor::detach() const {
  auto& src = checked(impl_);
  auto impl = std::make_shared<detail::TensorImpl>();
  impl->storage = src.storage;
  impl->ptr = src.ptr;
  impl->shape = src.shape;
  return Tensor(std::move(impl));
}

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
  std::copy_n(source.data(), numel(), data());
}

void Tensor::fill_(float value) { std::fill_n(data(), numel(), value); }

Tensor Tensor::view_as_shape(const Shape& new_shape) const {
  auto& src = checked(impl_);
  if (new_shape.numel() != src.shape.numel()) {
    throw ShapeError("view: cannot view a tensor of shape " + src.shape.str() + " as " + new_shape.str() + " (" +
                     std::to_string(src.shape.numel()) + " vs " + std::to_string(new_shape.numel()) + " elements)");
  }
  auto impl = std::make_shared<detail::TensorImpl>();
  impl->storage = src.storage;
  impl->ptr = src.ptr;
  impl->shape = new_shape;
  return Tensor(std::move(impl));
}

Tensor Tensor::view_at(int64_t offset, const Shape& new_shape) const {
  auto& src = checked(impl_);
  if (offset < 0 || offset + new_shape.numel() > src.shape.numel()) {
    throw ShapeError("view_at: " + new_shape.str() + " at element " + std::to_string(offset) + " does not fit in " +
                     src.shape.str());
  }
  auto impl = std::make_shared<detail::TensorImpl>();
  impl->storage = src.storage;
  impl->ptr = src.ptr + offset;
  impl->shape = new_shape;
  return Tensor(std::move(impl));
}

bool Tensor::shares_storage_with(const Tensor& other) const {
  return impl_ && other.impl_ && impl_->storage == other.impl_->storage;
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
