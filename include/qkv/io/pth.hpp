// PyTorch's own files: what torch.save writes (model.pth, model_and_optimizer.pth), read without running them,
// and written so that torch.load reads them back.
//
// Format (PyTorch ≥ 1.6): a zip archive whose entries share one folder, <name>/data.pkl (a pickle of the saved
// object), <name>/data/<key> (the raw little-endian bytes of each storage, stored uncompressed), <name>/version,
// and from PyTorch 2.1 on <name>/byteorder. A tensor in the pickle is a call of torch._utils._rebuild_tensor_v2
// with a persistent id ('storage', torch.FloatStorage, key, location, numel), an offset, a size and a stride.
//
// The reader is a pickle interpreter that only builds data: dicts, OrderedDicts, lists, tuples, strings, numbers,
// booleans, None and tensors. It knows a fixed list of globals (collections.OrderedDict, the tensor and
// parameter rebuild functions, the storage classes) and calls none of them; any other global (os.system,
// builtins.eval, a user's class) is refused with a message naming it, before anything else is read. Storages are
// checked against the archive (present, uncompressed, large enough for every tensor that views them) before
// any tensor data is allocated.
// Not here: what the tensors mean (train/model_file.hpp maps the book's state dicts onto the decoder's gpt2 configuration).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/core/tensor.hpp"
#include "qkv/io/safetensors.hpp"

namespace qkv::io {

// A tensor in a .pth: a view (offset, size, stride, in elements) of a storage.
struct PthTensor {
  DType dtype = DType::F32;  // the storage's element type
  std::string storage;  // the storage's key: the archive entry data/<key>
  int64_t storage_numel = 0;  // elements in the storage
  int64_t offset = 0;  // where the view starts, in elements
  std::vector<int64_t> shape, stride;  // the view's sizes and strides, in elements
  bool parameter = false;  // saved as a torch.nn.Parameter
  int64_t numel() const;  // The elements of the view (the product of shape)
};

enum class PyKind { None, Bool, Int, Float, String, List, Tuple, Dict, Tensor };

class PthFile;

// One object of the unpickled data: a handle into its PthFile (which must outlive it).
class PyRef {
 public:
  PyKind kind() const;  // What kind of Python object this is
  // Whether it is of kind `k`
  bool is(PyKind k) const { return kind() == k; }
  bool as_bool() const;             // IoError naming `what` if the object is something else
  int64_t as_int() const;  // The int (IoError naming `where()` otherwise); likewise as_string and as_tensor
  double as_number() const;         // an int or a float
  const std::string& as_string() const;  // The string
  const PthTensor& as_tensor() const;  // The tensor's view of its storage
  // Lists and tuples: the elements; dicts: the number of entries.
  size_t size() const;
  PyRef operator[](size_t i) const;
  // Dicts in insertion order (as Python's): key, value.
  std::vector<std::pair<PyRef, PyRef>> items() const;
  std::optional<PyRef> get(std::string_view key) const;  // a dict's entry under a string key
  std::optional<PyRef> get(int64_t key) const;           // under an int key
  // A short description for messages: "a dict with 2 keys (model_state_dict, optimizer_state_dict)".
  std::string describe() const;
  // Names this object in messages ("optimizer_state_dict.state.3.exp_avg"); set by the accessors above.
  const std::string& where() const { return where_; }

 private:
  friend class PthFile;
  PyRef(const PthFile* file, int32_t index, std::string where) : file_(file), index_(index), where_(std::move(where)) {}
  [[noreturn]] void wrong(const char* expected) const;
  const PthFile* file_;
  int32_t index_;
  std::string where_;
};

// A torch.save file (the zip format of PyTorch ≥ 1.6), unpickled as data: nothing in it ever runs
class PthFile {
 public:
  // Opens and checks a torch.save file; IoError naming the file and the problem (not a zip, a legacy or
  // TorchScript file, a forbidden global, a malformed pickle, a storage that is missing or too small …).
  static PthFile open(const std::string& path);
  // The same from bytes in memory (kept alive by the returned object).
  static PthFile parse(std::vector<std::byte> bytes, const std::string& label = "<memory>");
  // From the archive's entries by their names inside its folder ("data.pkl", "data/0", …): for tests and fuzzing.
  static PthFile from_records(std::map<std::string, std::vector<std::byte>> records, const std::string& label = "<memory>");

  PthFile(PthFile&&) noexcept;  // Movable, not copyable
  PthFile& operator=(PthFile&&) noexcept;  // Movable, not copyable
  ~PthFile();

  // The file's path (or the label it was parsed under)
  const std::string& path() const { return label_; }
  PyRef root() const;  // The unpickled object (a dict for a state dict)
  // The tensor's values as float32 (from F32, F16, BF16 or F64 storage), contiguous. Weights: IoError for an
  // integer storage or a non-finite value, naming the object. At most kMaxRank dimensions.
  Tensor weights(const PyRef& ref) const;
  // The same straight into `dst` (a tensor of that shape, e.g. a model's parameter), checked the same way: a float32
  // row-major storage is read in chunks with no temporary of the tensor's size, into a BF16 tensor rounded to nearest
  // even. ShapeError for another shape.
  void read_weights(const PyRef& ref, Tensor& dst) const;
  // Every element as int64, from any storage (IoError for a fraction, NaN or a value outside int64).
  std::vector<int64_t> int64s(const PyRef& ref) const;

  struct Impl;

 private:
  explicit PthFile(std::unique_ptr<Impl> impl);
  // A row-major float32 storage read into `dst` in chunks (rounded where dst is BF16); false for any other storage.
  bool read_row_major(const PyRef& ref, Tensor& dst) const;
  friend class PyRef;
  std::unique_ptr<Impl> impl_;
  std::string label_;
};

// ---- writing ----

// A Python value to save: the tree torch.save would pickle. Tensors carry their bytes (TensorData: F32 or I64).
struct PyValue {
  PyKind kind = PyKind::None;  // which member holds the value
  bool ordered = false;  // a dict written as collections.OrderedDict (what state_dict() returns)
  bool boolean = false;  // for Bool
  int64_t integer = 0;  // for Int
  double real = 0;  // for Float
  std::string text;  // for String
  std::vector<PyValue> items;                          // lists, tuples
  std::vector<std::pair<PyValue, PyValue>> entries;    // dicts, in order
  std::shared_ptr<const TensorData> tensor;  // for Tensor

  // Python's None
  static PyValue none() { return {}; }
  static PyValue of(bool v);  // A bool
  static PyValue of(int64_t v);  // An int
  static PyValue of(double v);  // A float
  static PyValue of(std::string v);  // A str
  // A str
  static PyValue of(const char* v) { return of(std::string(v)); }
  static PyValue of(TensorData t);  // t.name is not written
  static PyValue list(std::vector<PyValue> items = {});  // A list of `items`
  static PyValue tuple(std::vector<PyValue> items = {});  // A tuple of `items`
  static PyValue dict(bool ordered = false);  // An empty dict (an OrderedDict when `ordered`); fill it with set()
  PyValue& set(PyValue key, PyValue value);  // appends to a dict; returns the value just stored
};

// Writes `root` as torch.save does (protocol 2 pickle, uncompressed zip entries under `<folder>/`), atomically.
// A state dict of tensors, strings and ints loads with torch.load(path, weights_only=True); floats (an
// optimizer's learning rate) need PyTorch 1.13's full torch.load.
void save_pth(const std::string& path, const PyValue& root, const std::string& folder = "archive");

}  // namespace qkv::io
