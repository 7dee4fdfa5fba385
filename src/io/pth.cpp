// torch.save files: a restricted unpickler over a zip archive read with libzip, and the writer (see qkv/io/pth.hpp).
#include "qkv/io/pth.hpp"

#include <zip.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <unordered_map>

#include "qkv/io/file.hpp"
#include "qkv/kernels/convert.hpp"

namespace qkv::io {

namespace {

constexpr size_t kMaxPickle = 16u << 20;   // a GPT-2 XL state dict's pickle is about 60 KB
constexpr size_t kMaxObjects = 1u << 20;   // objects one pickle may build
constexpr size_t kMaxDepth = 200;          // containers inside containers (marks included)
constexpr size_t kMaxRankPth = 16;

[[noreturn]] void fail(const std::string& label, const std::string& problem) { throw IoError(label + ": " + problem); }

std::string dims_text(const std::vector<int64_t>& dims) {  // "[3, 4]"
  std::string s = "[";
  for (size_t d = 0; d < dims.size(); ++d) s += (d ? ", " : "") + std::to_string(dims[d]);
  return s + "]";
}

// ---- the archive: named records ----

struct Record {
  bool compressed = false;
  uint64_t size = 0;
};

class Archive {
 public:
  virtual ~Archive() = default;
  virtual std::optional<Record> find(const std::string& name) const = 0;  // name inside the folder
  // `bytes` bytes of the record from `offset`, into `out` (which has room for them)
  virtual void read_into(const std::string& name, uint64_t offset, uint64_t bytes, std::byte* out) const = 0;
  std::vector<std::byte> read(const std::string& name, uint64_t offset, uint64_t bytes) const {
    std::vector<std::byte> out(bytes);
    read_into(name, offset, bytes, out.data());
    return out;
  }
};

class MemoryArchive final : public Archive {
 public:
  explicit MemoryArchive(std::map<std::string, std::vector<std::byte>> records) : records_(std::move(records)) {}
  std::optional<Record> find(const std::string& name) const override {
    auto it = records_.find(name);
    if (it == records_.end()) return std::nullopt;
    return Record{false, it->second.size()};
  }
  void read_into(const std::string& name, uint64_t offset, uint64_t bytes, std::byte* out) const override {
    const auto& r = records_.at(name);
    std::copy_n(r.begin() + static_cast<ptrdiff_t>(offset), bytes, out);
  }

 private:
  std::map<std::string, std::vector<std::byte>> records_;
};

class ZipArchive final : public Archive {
 public:
  // Takes ownership of `bytes` when the archive is in memory (zip_source_buffer reads from them).
  ZipArchive(const std::string& label, zip_t* zip, std::vector<std::byte> bytes)
      : label_(label), bytes_(std::move(bytes)), zip_(zip, zip_discard) {
    const zip_int64_t n = zip_get_num_entries(zip_.get(), 0);
    std::string folder;
    for (zip_int64_t i = 0; i < n; ++i) {
      const char* raw = zip_get_name(zip_.get(), static_cast<zip_uint64_t>(i), ZIP_FL_ENC_RAW);
      if (!raw) fail(label_, "the zip archive's entry " + std::to_string(i) + " has no readable name");
      const std::string name = raw;
      // Nothing is ever extracted to disk, but a name like this is never written by torch.save: refuse the file.
      if (name.empty() || name[0] == '/' || name.find('\\') != std::string::npos || name == ".." ||
          name.rfind("../", 0) == 0 || name.find("/../") != std::string::npos ||
          (name.size() >= 3 && name.compare(name.size() - 3, 3, "/..") == 0)) {
        fail(label_, "the zip archive holds an entry named \"" + printable(name) +
                         "\" (absolute, or with '..' or '\\'), which torch.save never writes; refusing the file");
      }
      const size_t slash = name.find('/');
      if (slash == std::string::npos) continue;  // torch.save puts every entry in one folder
      const std::string top = name.substr(0, slash);
      if (folder.empty()) folder = top;
      if (top != folder) continue;
      index_[name.substr(slash + 1)] = static_cast<zip_uint64_t>(i);
    }
    folder_ = folder;
  }
  const std::string& folder() const { return folder_; }
  bool has_entries() const { return !index_.empty(); }

  std::optional<Record> find(const std::string& name) const override {
    auto it = index_.find(name);
    if (it == index_.end()) return std::nullopt;
    zip_stat_t st;
    zip_stat_init(&st);
    if (zip_stat_index(zip_.get(), it->second, 0, &st) != 0 || !(st.valid & ZIP_STAT_SIZE) || !(st.valid & ZIP_STAT_COMP_METHOD)) {
      fail(label_, "cannot read the zip entry " + folder_ + "/" + printable(name) + ": " + zip_strerror(zip_.get()));
    }
    return Record{st.comp_method != ZIP_CM_STORE, st.size};
  }

  void read_into(const std::string& name, uint64_t offset, uint64_t bytes, std::byte* out) const override {
    const std::string entry = folder_ + "/" + printable(name);
    zip_file_t* f = zip_fopen_index(zip_.get(), index_.at(name), 0);
    if (!f) fail(label_, "cannot open the zip entry " + entry + ": " + zip_strerror(zip_.get()));
    bool ok = offset == 0 || zip_fseek(f, static_cast<zip_int64_t>(offset), SEEK_SET) == 0;
    uint64_t got = 0;
    while (ok && got < bytes) {
      const zip_int64_t n = zip_fread(f, out + got, bytes - got);
      if (n <= 0) ok = false;
      else got += static_cast<uint64_t>(n);
    }
    const std::string why = ok ? "" : zip_file_strerror(f);
    zip_fclose(f);
    if (!ok) fail(label_, "cannot read the zip entry " + entry + " (" + why + "); the file is truncated or corrupt");
  }

 private:
  std::string label_, folder_;
  std::vector<std::byte> bytes_;  // an archive in memory: zip_ reads them, so they outlive it
  std::unique_ptr<zip_t, void (*)(zip_t*)> zip_;  // discarded even when the constructor throws
  std::map<std::string, zip_uint64_t> index_;
};

// ---- unpickled objects ----

enum class Node : uint8_t { None, Bool, Int, Float, String, List, Tuple, Dict, Tensor, Global, Storage, Mark };

struct Object {
  Node kind = Node::None;
  bool ordered = false;
  int64_t i = 0;  // Bool/Int value; Tensor/Storage: index into tensors/storages; Global: which
  double f = 0;
  std::string s;               // String; Global: "module.name"
  std::vector<int32_t> items;  // List/Tuple elements; Dict: key, value, key, value …
  std::unordered_map<std::string, size_t> keys;  // Dict: key → position of the key in items
  size_t depth = 0;
};

struct Storage {
  DType dtype;
  std::string key;
  int64_t numel;
};

enum class Callable { OrderedDict, RebuildTensorV2, RebuildTensor, RebuildParameter, RebuildParameterWithState, Storage };

struct Known {
  const char* name;
  Callable what;
  DType dtype;
};
constexpr Known kGlobals[] = {
    {"collections.OrderedDict", Callable::OrderedDict, DType::F32},
    {"torch._utils._rebuild_tensor_v2", Callable::RebuildTensorV2, DType::F32},
    {"torch._utils._rebuild_tensor", Callable::RebuildTensor, DType::F32},
    {"torch._utils._rebuild_parameter", Callable::RebuildParameter, DType::F32},
    {"torch._utils._rebuild_parameter_with_state", Callable::RebuildParameterWithState, DType::F32},
    {"torch.FloatStorage", Callable::Storage, DType::F32},
    {"torch.HalfStorage", Callable::Storage, DType::F16},
    {"torch.BFloat16Storage", Callable::Storage, DType::BF16},
    {"torch.DoubleStorage", Callable::Storage, DType::F64},
    {"torch.LongStorage", Callable::Storage, DType::I64},
    {"torch.IntStorage", Callable::Storage, DType::I32},
    {"torch.ShortStorage", Callable::Storage, DType::I16},
    {"torch.CharStorage", Callable::Storage, DType::I8},
    {"torch.ByteStorage", Callable::Storage, DType::U8},
    {"torch.BoolStorage", Callable::Storage, DType::BOOL},
};

// A dict key as text, for lookups: only the hashable kinds state dicts use.
std::optional<std::string> key_of(const Object& o) {
  switch (o.kind) {
    case Node::String: return "s" + o.s;
    case Node::Int: return "i" + std::to_string(o.i);
    case Node::Bool: return "i" + std::to_string(o.i);  // Python: True == 1
    case Node::None: return std::string("n");
    default: return std::nullopt;
  }
}

}  // namespace

struct PthFile::Impl {
  std::string label;
  std::unique_ptr<Archive> archive;
  std::vector<Object> objects;
  std::vector<Storage> storages;
  std::vector<PthTensor> tensors;
  int32_t root = -1;
};

namespace {

const char* kind_word(Node k) {
  switch (k) {
    case Node::None: return "None";
    case Node::Bool: return "a bool";
    case Node::Int: return "an int";
    case Node::Float: return "a float";
    case Node::String: return "a string";
    case Node::List: return "a list";
    case Node::Tuple: return "a tuple";
    case Node::Dict: return "a dict";
    case Node::Tensor: return "a tensor";
    case Node::Global: return "a class or function";
    case Node::Storage: return "a storage";
    case Node::Mark: return "a mark";
  }
  return "?";
}

// The pickle virtual machine, restricted to building data (see the header).
class Unpickler {
 public:
  Unpickler(PthFile::Impl& out, std::span<const std::byte> code) : out_(out), code_(code) {
    // Shared singletons: None, False, True (every other object is created by an opcode).
    make(Node::None);
    make(Node::Bool).i = 0;
    make(Node::Bool).i = 1;
  }

  int32_t run() {
    while (true) {
      if (pos_ >= code_.size()) bad("the pickle ends before its STOP opcode; the file is truncated");
      at_ = pos_;
      const uint8_t op = byte();
      switch (op) {
        case 0x80: byte(); break;                 // PROTO
        case 0x95: take(8); break;                // FRAME (protocol 4): a length hint
        case '.': {                               // STOP
          if (stack_.empty()) bad("STOP with nothing on the stack");
          return stack_.back();
        }
        case '(': {                               // MARK
          if (marks_.size() >= kMaxDepth) bad("nested deeper than " + std::to_string(kMaxDepth) + " levels");
          marks_.push_back(stack_.size());
          break;
        }
        case '0': pop(); break;                   // POP
        case '1': pop_mark(); break;              // POP_MARK
        case '2': push(top()); break;             // DUP
        case 'N': push(0); break;
        case 0x89: push(1); break;                // NEWFALSE
        case 0x88: push(2); break;                // NEWTRUE
        case '}': push(new_object(Node::Dict)); break;
        case ']': push(new_object(Node::List)); break;
        case ')': push(new_object(Node::Tuple)); break;
        case 't': {                               // TUPLE
          std::vector<int32_t> items = pop_mark();
          const int32_t t = new_object(Node::Tuple);
          for (int32_t v : items) add_item(t, v);
          push(t);
          break;
        }
        case 0x85: case 0x86: case 0x87: {       // TUPLE1..3
          const size_t n = op - 0x84u;
          std::vector<int32_t> items(n);
          for (size_t k = n; k-- > 0;) items[k] = pop();
          const int32_t t = new_object(Node::Tuple);
          for (int32_t v : items) add_item(t, v);
          push(t);
          break;
        }
        case 'J': push_int(static_cast<int32_t>(le<uint32_t>(4))); break;   // BININT
        case 'K': push_int(byte()); break;                                   // BININT1
        case 'M': push_int(le<uint16_t>(2)); break;                          // BININT2
        case 0x8a: {                                                         // LONG1
          const size_t n = byte();
          if (n > 8) bad("an integer of " + std::to_string(n) + " bytes; qkv reads integers up to 64 bits");
          const auto b = take(n);
          uint64_t v = 0;
          for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(b[k]) << (8 * k);
          if (n > 0 && n < 8 && (static_cast<uint8_t>(b[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);  // sign-extend
          push_int(static_cast<int64_t>(v));
          break;
        }
        case 'G': {                                                          // BINFLOAT (big-endian)
          const auto b = take(8);
          uint64_t bits = 0;
          for (size_t k = 0; k < 8; ++k) bits = (bits << 8) | static_cast<uint8_t>(b[k]);
          const int32_t o = new_object(Node::Float);
          out_.objects[o].f = std::bit_cast<double>(bits);
          push(o);
          break;
        }
        case 'X': push_string(le<uint32_t>(4)); break;              // BINUNICODE
        case 0x8c: push_string(byte()); break;                      // SHORT_BINUNICODE
        case 0x8d: push_string(le<uint64_t>(8)); break;             // BINUNICODE8
        case 'U': case 'C': push_string(byte()); break;             // SHORT_BINSTRING, SHORT_BINBYTES
        case 'T': case 'B': push_string(le<uint32_t>(4)); break;    // BINSTRING, BINBYTES
        case 'c': {                                                  // GLOBAL "module\nname\n"
          const std::string module = line(), name = line();
          push(global(module, name));
          break;
        }
        case 0x93: {                                                 // STACK_GLOBAL
          const int32_t name = pop(), module = pop();
          if (obj(name).kind != Node::String || obj(module).kind != Node::String) bad("STACK_GLOBAL needs two strings");
          push(global(obj(module).s, obj(name).s));
          break;
        }
        case 'q': memo(byte()); break;                               // BINPUT
        case 'r': memo(le<uint32_t>(4)); break;                      // LONG_BINPUT
        case 0x94: memo(memo_.size()); break;                        // MEMOIZE
        case 'h': push(recall(byte())); break;                       // BINGET
        case 'j': push(recall(le<uint32_t>(4))); break;              // LONG_BINGET
        case 'a': {                                                  // APPEND
          const int32_t v = pop();
          append(top(), v);
          break;
        }
        case 'e': {                                                  // APPENDS
          const std::vector<int32_t> items = pop_mark();
          for (int32_t v : items) append(top(), v);
          break;
        }
        case 's': {                                                  // SETITEM
          const int32_t v = pop(), k = pop();
          set_item(top(), k, v);
          break;
        }
        case 'u': {                                                  // SETITEMS
          const std::vector<int32_t> items = pop_mark();
          if (items.size() % 2) bad("SETITEMS with an odd number of keys and values");
          for (size_t k = 0; k < items.size(); k += 2) set_item(top(), items[k], items[k + 1]);
          break;
        }
        case 'R': {                                                  // REDUCE: a call of a known global
          const int32_t args = pop(), fn = pop();
          push(reduce(fn, args));
          break;
        }
        case 'b': {                                                  // BUILD: only a state dict's _metadata
          const int32_t state = pop();
          const Node k = obj(top()).kind;
          if (k != Node::Dict && k != Node::Tensor) bad(std::string("BUILD on ") + kind_word(k) + ", which a state dict never does");
          (void)state;  // OrderedDict._metadata (module versions) and tensor state are not needed
          break;
        }
        case 'Q': {                                                  // BINPERSID: a storage
          push(persistent(pop()));
          break;
        }
        case 'P': bad("a text persistent id (protocol 0), which torch.save never writes");
        case 0x81: case 0x92: case 'i': case 'o': case 0x82: case 0x83: case 0x84:
          bad("opcode " + opcode_name(op) + ", which creates an object of a class; a state dict never needs one, "
              "and qkv never creates objects from a file");
        default:
          bad("opcode " + opcode_name(op) + ", which qkv's reader of state dicts does not accept");
      }
    }
  }

 private:
  PthFile::Impl& out_;
  std::span<const std::byte> code_;
  size_t pos_ = 0, at_ = 0;
  std::vector<int32_t> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, int32_t> memo_;

  static std::string opcode_name(uint8_t op) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "0x%02x", op);
    std::string s = buf;
    if (op >= 0x21 && op < 0x7f) s += std::string(" ('") + static_cast<char>(op) + "')";
    return s;
  }
  [[noreturn]] void bad(const std::string& problem) const {
    fail(out_.label, "data.pkl at byte " + std::to_string(at_) + ": " + problem);
  }
  Object& obj(int32_t i) { return out_.objects[static_cast<size_t>(i)]; }
  Object& make(Node kind) {
    out_.objects.emplace_back();
    out_.objects.back().kind = kind;
    return out_.objects.back();
  }
  int32_t new_object(Node kind) {
    if (out_.objects.size() >= kMaxObjects) bad("more than " + std::to_string(kMaxObjects) + " objects; not a state dict");
    make(kind);
    return static_cast<int32_t>(out_.objects.size() - 1);
  }
  uint8_t byte() { return static_cast<uint8_t>(take(1)[0]); }
  std::span<const std::byte> take(uint64_t n) {
    if (n > code_.size() - pos_) bad("an opcode's argument runs past the end of the pickle; the file is truncated");
    const auto s = code_.subspan(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }
  template <typename T>
  T le(size_t n) {
    const auto b = take(n);
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[k])) << (8 * k);
    return static_cast<T>(v);
  }
  std::string line() {
    const auto rest = code_.subspan(pos_);
    const auto nl = std::find(rest.begin(), rest.end(), std::byte{'\n'});
    if (nl == rest.end()) bad("GLOBAL without a newline");
    const auto s = take(static_cast<size_t>(nl - rest.begin()) + 1);
    return std::string(reinterpret_cast<const char*>(s.data()), s.size() - 1);
  }
  void push(int32_t v) {
    if (stack_.size() >= kMaxObjects) bad("the stack grows beyond " + std::to_string(kMaxObjects) + " entries");
    stack_.push_back(v);
  }
  int32_t top() {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) bad("an opcode needs an object, but the stack is empty");
    return stack_.back();
  }
  int32_t pop() {
    const int32_t v = top();
    stack_.pop_back();
    return v;
  }
  std::vector<int32_t> pop_mark() {
    if (marks_.empty()) bad("an opcode needs a MARK, but there is none");
    const size_t from = marks_.back();
    marks_.pop_back();
    std::vector<int32_t> items(stack_.begin() + static_cast<ptrdiff_t>(from), stack_.end());
    stack_.resize(from);
    return items;
  }
  void push_int(int64_t v) {
    const int32_t o = new_object(Node::Int);
    obj(o).i = v;
    push(o);
  }
  void push_string(uint64_t n) {
    const auto b = take(n);
    const int32_t o = new_object(Node::String);
    obj(o).s.assign(reinterpret_cast<const char*>(b.data()), b.size());
    push(o);
  }
  void memo(uint64_t key) {
    if (memo_.size() >= kMaxObjects && !memo_.count(key)) bad("too many memo entries");
    memo_[key] = top();
  }
  int32_t recall(uint64_t key) {
    auto it = memo_.find(key);
    if (it == memo_.end()) bad("memo entry " + std::to_string(key) + " is read before it is written");
    return it->second;
  }
  void add_item(int32_t container, int32_t v) {
    Object& c = obj(container);
    const size_t depth = obj(v).depth + 1;
    if (depth > kMaxDepth) bad("nested deeper than " + std::to_string(kMaxDepth) + " levels");
    c.depth = std::max(c.depth, depth);
    c.items.push_back(v);
  }
  void append(int32_t list, int32_t v) {
    if (obj(list).kind != Node::List) bad(std::string("APPEND to ") + kind_word(obj(list).kind) + ", not a list");
    add_item(list, v);
  }
  void set_item(int32_t dict, int32_t k, int32_t v) {
    if (obj(dict).kind != Node::Dict) bad(std::string("SETITEM on ") + kind_word(obj(dict).kind) + ", not a dict");
    const std::optional<std::string> key = key_of(obj(k));
    if (!key) bad(std::string("a dict key that is ") + kind_word(obj(k).kind) + "; state dicts use strings and ints");
    auto it = obj(dict).keys.find(*key);
    if (it != obj(dict).keys.end()) {  // Python replaces the value
      obj(dict).items[it->second + 1] = v;
      return;
    }
    obj(dict).keys.emplace(*key, obj(dict).items.size());
    add_item(dict, k);
    add_item(dict, v);
  }
  int32_t global(const std::string& module, const std::string& name) {
    const std::string full = module + "." + name;
    for (size_t k = 0; k < std::size(kGlobals); ++k) {
      if (full == kGlobals[k].name) {
        const int32_t o = new_object(Node::Global);
        obj(o).i = static_cast<int64_t>(k);
        obj(o).s = full;
        return o;
      }
    }
    fail(out_.label, "refusing to load: its pickle asks for the global " + printable(full) +
                         ", which a PyTorch state dict never uses (it could run code). qkv reads only tensors, dicts, "
                         "lists, numbers and strings, and never runs anything from a file. If the file holds a whole "
                         "model object (torch.save(model)), save model.state_dict() instead");
  }
  const Known& callable(int32_t fn) {
    if (obj(fn).kind != Node::Global) bad(std::string("REDUCE calls ") + kind_word(obj(fn).kind));
    return kGlobals[static_cast<size_t>(obj(fn).i)];
  }
  std::vector<int64_t> ints(int32_t tuple, const char* what) {
    const Object& t = obj(tuple);
    if (t.kind != Node::Tuple && t.kind != Node::List) bad(std::string(what) + " is " + kind_word(t.kind) + ", not a tuple");
    if (t.items.size() > kMaxRankPth) bad(std::string(what) + " has " + std::to_string(t.items.size()) + " dimensions");
    std::vector<int64_t> out;
    for (int32_t v : t.items) {
      if (obj(v).kind != Node::Int) bad(std::string(what) + " holds " + kind_word(obj(v).kind));
      out.push_back(obj(v).i);
    }
    return out;
  }
  int32_t reduce(int32_t fn, int32_t args_index) {
    const Known& k = callable(fn);
    const Object& args = obj(args_index);
    if (args.kind != Node::Tuple) bad(std::string("the arguments of ") + k.name + " are " + kind_word(args.kind));
    const std::vector<int32_t> a = args.items;
    switch (k.what) {
      case Callable::OrderedDict: {
        if (!a.empty()) bad("collections.OrderedDict with arguments; torch.save writes an empty one and fills it");
        const int32_t d = new_object(Node::Dict);
        obj(d).ordered = true;
        return d;
      }
      case Callable::RebuildTensorV2:
      case Callable::RebuildTensor: {
        if (a.size() < 4) bad(std::string(k.name) + " with " + std::to_string(a.size()) + " arguments");
        if (obj(a[0]).kind != Node::Storage) bad(std::string(k.name) + "'s first argument is " + kind_word(obj(a[0]).kind));
        if (obj(a[1]).kind != Node::Int) bad("a tensor's storage offset is not an int");
        const Storage& s = out_.storages[static_cast<size_t>(obj(a[0]).i)];
        PthTensor t;
        t.dtype = s.dtype;
        t.storage = s.key;
        t.storage_numel = s.numel;
        t.offset = obj(a[1]).i;
        t.shape = ints(a[2], "a tensor's size");
        t.stride = ints(a[3], "a tensor's stride");
        check_view(t);
        const int32_t o = new_object(Node::Tensor);
        obj(o).i = static_cast<int64_t>(out_.tensors.size());
        out_.tensors.push_back(std::move(t));
        return o;
      }
      case Callable::RebuildParameter:
      case Callable::RebuildParameterWithState: {
        if (a.empty() || obj(a[0]).kind != Node::Tensor) bad(std::string(k.name) + " without a tensor");
        out_.tensors[static_cast<size_t>(obj(a[0]).i)].parameter = true;
        return a[0];
      }
      case Callable::Storage: bad(std::string("a call of ") + k.name + "; torch.save refers to storages by persistent id");
    }
    bad("unreachable");
  }
  void check_view(const PthTensor& t) {
    if (t.shape.size() != t.stride.size()) bad("a tensor's size and stride differ in length");
    if (t.offset < 0) bad("a tensor's storage offset is negative");
    int64_t last = t.offset;  // the last element's index, overflow-checked
    bool empty = false;
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (t.shape[d] < 0 || t.stride[d] < 0) bad("a tensor has a negative size or stride");
      if (t.shape[d] == 0) empty = true;
    }
    if (!empty) {
      for (size_t d = 0; d < t.shape.size(); ++d) {
        int64_t step = 0;
        if (__builtin_mul_overflow(t.shape[d] - 1, t.stride[d], &step) || __builtin_add_overflow(last, step, &last)) {
          bad("a tensor's size and stride overflow");
        }
      }
      if (last >= t.storage_numel) {
        bad("a tensor of size " + dims_text(t.shape) + " at offset " + std::to_string(t.offset) +
            " reaches element " + std::to_string(last) + " of a storage of " + std::to_string(t.storage_numel));
      }
    }
  }
  int32_t persistent(int32_t pid) {
    const Object& p = obj(pid);
    if (p.kind != Node::Tuple || p.items.size() != 5 || obj(p.items[0]).kind != Node::String || obj(p.items[0]).s != "storage") {
      bad("a persistent id that is not ('storage', type, key, location, numel)");
    }
    const Object& type = obj(p.items[1]);
    if (type.kind != Node::Global || kGlobals[static_cast<size_t>(type.i)].what != Callable::Storage) {
      bad("a storage whose type is not one of torch's storage classes");
    }
    if (obj(p.items[2]).kind != Node::String || obj(p.items[4]).kind != Node::Int) bad("a storage's key or size has the wrong type");
    Storage s{kGlobals[static_cast<size_t>(type.i)].dtype, obj(p.items[2]).s, obj(p.items[4]).i};
    if (s.numel < 0) bad("a storage of negative size");
    if (s.key.empty() || s.key.find('/') != std::string::npos || s.key.find("..") != std::string::npos) {
      bad("a storage key \"" + printable(s.key) + "\" that is not a plain name");
    }
    for (size_t k = 0; k < out_.storages.size(); ++k) {
      const Storage& o = out_.storages[k];
      if (o.key == s.key) {
        if (o.dtype != s.dtype || o.numel != s.numel) bad("storage " + printable(s.key) + " is declared twice, differently");
      }
    }
    const int32_t o = new_object(Node::Storage);
    obj(o).i = static_cast<int64_t>(out_.storages.size());
    out_.storages.push_back(std::move(s));
    return o;
  }
};

PyKind public_kind(Node k) {
  switch (k) {
    case Node::None: return PyKind::None;
    case Node::Bool: return PyKind::Bool;
    case Node::Int: return PyKind::Int;
    case Node::Float: return PyKind::Float;
    case Node::String: return PyKind::String;
    case Node::List: return PyKind::List;
    case Node::Tuple: return PyKind::Tuple;
    case Node::Dict: return PyKind::Dict;
    case Node::Tensor: return PyKind::Tensor;
    default: return PyKind::None;  // globals and storages are never handed out: they only build tensors
  }
}

std::unique_ptr<PthFile::Impl> load(std::unique_ptr<Archive> archive, const std::string& label) {
  auto impl = std::make_unique<PthFile::Impl>();
  impl->label = label;
  impl->archive = std::move(archive);
  if (impl->archive->find("constants.pkl")) {
    fail(label, "is a TorchScript module (torch.jit.save), not a state dict; in PyTorch, save "
                "model.state_dict() with torch.save and load that");
  }
  const auto pkl = impl->archive->find("data.pkl");
  if (!pkl) fail(label, "is a zip archive without data.pkl; not a file written by torch.save");
  if (const auto order = impl->archive->find("byteorder"); order && order->size <= 16 && !order->compressed) {
    const std::vector<std::byte> b = impl->archive->read("byteorder", 0, order->size);
    if (std::string(reinterpret_cast<const char*>(b.data()), b.size()) == "big") {
      fail(label, "was saved on a big-endian machine; load it there and save it again on a little-endian one");
    }
  }
  if (pkl->size > kMaxPickle) {
    fail(label, "data.pkl is " + std::to_string(pkl->size) + " bytes; a state dict's pickle is far smaller (limit " +
                    std::to_string(kMaxPickle) + ")");
  }
  const std::vector<std::byte> code = impl->archive->read("data.pkl", 0, pkl->size);
  Unpickler vm(*impl, code);
  impl->root = vm.run();
  // Every storage a tensor views is in the archive, stored as torch.save stores it, and holds its elements.
  for (const Storage& s : impl->storages) {
    const std::string name = "data/" + s.key;
    const auto r = impl->archive->find(name);
    if (!r) fail(label, "the pickle names storage " + printable(s.key) + ", but the archive has no entry " + printable(name));
    if (r->compressed) {
      fail(label, "storage " + printable(s.key) + " is compressed in the zip; torch.save stores storages uncompressed "
                  "(was the file re-zipped? Save it again with torch.save)");
    }
    const uint64_t need = static_cast<uint64_t>(s.numel) * dtype_size(s.dtype);
    if (static_cast<uint64_t>(s.numel) > std::numeric_limits<uint64_t>::max() / 8 || r->size < need) {
      fail(label, "storage " + printable(s.key) + " should hold " + std::to_string(s.numel) + " elements (" +
                      std::to_string(need) + " bytes), but its entry has " + std::to_string(r->size) +
                      " bytes; the file is truncated or corrupt");
    }
  }
  return impl;
}

}  // namespace

int64_t PthTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---- PyRef ----

namespace {
const Object& object_of(const PthFile::Impl& impl, int32_t index) { return impl.objects[static_cast<size_t>(index)]; }
}  // namespace

PyKind PyRef::kind() const { return public_kind(object_of(*file_->impl_, index_).kind); }

void PyRef::wrong(const char* expected) const {
  fail(file_->path(), (where_.empty() ? std::string("the saved object") : where_) + " is " + describe() + ", not " + expected);
}

bool PyRef::as_bool() const {
  if (!is(PyKind::Bool)) wrong("a bool");
  return object_of(*file_->impl_, index_).i != 0;
}
int64_t PyRef::as_int() const {
  if (!is(PyKind::Int)) wrong("an int");
  return object_of(*file_->impl_, index_).i;
}
double PyRef::as_number() const {
  if (is(PyKind::Int)) return static_cast<double>(object_of(*file_->impl_, index_).i);
  if (!is(PyKind::Float)) wrong("a number");
  return object_of(*file_->impl_, index_).f;
}
const std::string& PyRef::as_string() const {
  if (!is(PyKind::String)) wrong("a string");
  return object_of(*file_->impl_, index_).s;
}
const PthTensor& PyRef::as_tensor() const {
  if (!is(PyKind::Tensor)) wrong("a tensor");
  return file_->impl_->tensors[static_cast<size_t>(object_of(*file_->impl_, index_).i)];
}
size_t PyRef::size() const {
  const Object& o = object_of(*file_->impl_, index_);
  if (o.kind == Node::Dict) return o.items.size() / 2;
  if (o.kind != Node::List && o.kind != Node::Tuple) wrong("a list, tuple or dict");
  return o.items.size();
}
PyRef PyRef::operator[](size_t i) const {
  const Object& o = object_of(*file_->impl_, index_);
  if (o.kind != Node::List && o.kind != Node::Tuple) wrong("a list or tuple");
  if (i >= o.items.size()) wrong(("a sequence of more than " + std::to_string(i) + " items").c_str());
  return PyRef(file_, o.items[i], where_ + "[" + std::to_string(i) + "]");
}
std::vector<std::pair<PyRef, PyRef>> PyRef::items() const {
  const Object& o = object_of(*file_->impl_, index_);
  if (o.kind != Node::Dict) wrong("a dict");
  std::vector<std::pair<PyRef, PyRef>> out;
  for (size_t k = 0; k + 1 < o.items.size(); k += 2) {
    const Object& key = object_of(*file_->impl_, o.items[k]);
    const std::string name = key.kind == Node::String ? key.s : std::to_string(key.i);
    const std::string where = where_.empty() ? name : where_ + "." + name;
    out.emplace_back(PyRef(file_, o.items[k], where + " (key)"), PyRef(file_, o.items[k + 1], where));
  }
  return out;
}
std::optional<PyRef> PyRef::get(std::string_view key) const {
  const Object& o = object_of(*file_->impl_, index_);
  if (o.kind != Node::Dict) wrong("a dict");
  auto it = o.keys.find("s" + std::string(key));
  if (it == o.keys.end()) return std::nullopt;
  return PyRef(file_, o.items[it->second + 1], where_.empty() ? std::string(key) : where_ + "." + std::string(key));
}
std::optional<PyRef> PyRef::get(int64_t key) const {
  const Object& o = object_of(*file_->impl_, index_);
  if (o.kind != Node::Dict) wrong("a dict");
  auto it = o.keys.find("i" + std::to_string(key));
  if (it == o.keys.end()) return std::nullopt;
  return PyRef(file_, o.items[it->second + 1], (where_.empty() ? "" : where_ + ".") + std::to_string(key));
}
std::string PyRef::describe() const {
  const Object& o = object_of(*file_->impl_, index_);
  switch (o.kind) {
    case Node::Dict: {
      std::string keys;
      size_t shown = 0;
      for (size_t k = 0; k + 1 < o.items.size() && shown < 4; k += 2, ++shown) {
        const Object& key = object_of(*file_->impl_, o.items[k]);
        keys += (keys.empty() ? "" : ", ") + (key.kind == Node::String ? printable(key.s, 40) : std::to_string(key.i));
      }
      if (o.items.size() / 2 > shown) keys += ", …";
      return std::string(o.ordered ? "an OrderedDict" : "a dict") + " with " + std::to_string(o.items.size() / 2) +
             " keys" + (keys.empty() ? "" : " (" + keys + ")");
    }
    case Node::List: case Node::Tuple:
      return std::string(kind_word(o.kind)) + " of " + std::to_string(o.items.size());
    case Node::Tensor: {
      const PthTensor& t = file_->impl_->tensors[static_cast<size_t>(o.i)];
      return std::string("a ") + dtype_name(t.dtype) + " tensor of size " + dims_text(t.shape);
    }
    case Node::String: return "the string \"" + printable(o.s, 40) + "\"";
    case Node::Int: return "the int " + std::to_string(o.i);
    case Node::Float: return "the float " + std::to_string(o.f);
    default: return kind_word(o.kind);
  }
}

// ---- PthFile ----

PthFile::PthFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)), label_(impl_->label) {}
PthFile::PthFile(PthFile&&) noexcept = default;
PthFile& PthFile::operator=(PthFile&&) noexcept = default;
PthFile::~PthFile() = default;

PyRef PthFile::root() const { return PyRef(this, impl_->root, ""); }

namespace {
std::unique_ptr<ZipArchive> open_zip(const std::string& label, std::vector<std::byte> bytes, const std::string& path) {
  zip_error_t error;
  zip_error_init(&error);
  zip_t* zip = nullptr;
  if (path.empty()) {
    zip_source_t* src = zip_source_buffer_create(bytes.data(), bytes.size(), 0, &error);
    if (src) {
      zip = zip_open_from_source(src, ZIP_RDONLY | ZIP_CHECKCONS, &error);
      if (!zip) zip_source_free(src);
    }
  } else {
    int code = 0;
    zip = zip_open(path.c_str(), ZIP_RDONLY | ZIP_CHECKCONS, &code);
    if (!zip) zip_error_init_with_code(&error, code);
  }
  if (!zip) {
    const std::string why = zip_error_strerror(&error);
    zip_error_fini(&error);
    fail(label, "not a readable zip archive (" + why + "); a .pth from torch.save is one (PyTorch 1.6 or newer)");
  }
  zip_error_fini(&error);
  auto archive = std::make_unique<ZipArchive>(label, zip, std::move(bytes));
  if (!archive->has_entries()) fail(label, "is a zip archive, but not one written by torch.save (no folder with data.pkl)");
  return archive;
}

// What a file that is not a zip is, for the message.
void check_magic(const std::string& label, std::span<const std::byte> head) {
  auto at = [&](size_t i) { return i < head.size() ? static_cast<uint8_t>(head[i]) : 0; };
  if (at(0) == 'P' && at(1) == 'K') return;
  if (at(0) == 0x80 && at(1) >= 2 && at(1) <= 5) {
    fail(label, "is a PyTorch file in the legacy format (before PyTorch 1.6, or _use_new_zipfile_serialization=False); "
                "load it in PyTorch and save it again with torch.save(obj, path) to get the zip format qkv reads");
  }
  if (head.size() >= 9 && at(8) == '{') {
    fail(label, "is a safetensors file, not a .pth; give it as a safetensors file (qkv reads both)");
  }
  fail(label, "is not a PyTorch .pth file (torch.save writes a zip archive, which starts with \"PK\")");
}
}  // namespace

PthFile PthFile::open(const std::string& path) {
  {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) fail(path, std::string("cannot open: ") + std::strerror(errno));
    std::byte head[16] = {};
    const size_t n = std::fread(head, 1, sizeof head, f);
    std::fclose(f);
    check_magic(path, std::span<const std::byte>(head, n));
  }
  return PthFile(load(open_zip(path, {}, path), path));
}

PthFile PthFile::parse(std::vector<std::byte> bytes, const std::string& label) {
  check_magic(label, std::span<const std::byte>(bytes.data(), std::min<size_t>(bytes.size(), 16)));
  return PthFile(load(open_zip(label, std::move(bytes), ""), label));
}

PthFile PthFile::from_records(std::map<std::string, std::vector<std::byte>> records, const std::string& label) {
  return PthFile(load(std::make_unique<MemoryArchive>(std::move(records)), label));
}

namespace {
// The elements of a view, in row-major order, converted by `put(index, element pointer)`.
template <typename Put>
void gather(const Archive& archive, const PthTensor& t, Put put) {
  const int64_t n = t.numel();
  if (n == 0) return;
  const size_t es = dtype_size(t.dtype);
  int64_t last = t.offset;
  for (size_t d = 0; d < t.shape.size(); ++d) last += (t.shape[d] - 1) * t.stride[d];
  const std::vector<std::byte> span = archive.read("data/" + t.storage, static_cast<uint64_t>(t.offset) * es,
                                                   static_cast<uint64_t>(last - t.offset + 1) * es);
  std::vector<int64_t> index(t.shape.size(), 0);
  int64_t at = 0;  // element offset from t.offset
  for (int64_t i = 0; i < n; ++i) {
    put(i, span.data() + static_cast<size_t>(at) * es);
    for (size_t d = t.shape.size(); d-- > 0;) {  // next index, odometer style
      at += t.stride[d];
      if (++index[d] < t.shape[d]) break;
      at -= t.stride[d] * t.shape[d];
      index[d] = 0;
    }
  }
}
}  // namespace

bool PthFile::read_row_major(const PyRef& ref, Tensor& dst) const {
  const PthTensor& t = ref.as_tensor();
  bool row_major = t.dtype == DType::F32;
  for (int64_t d = static_cast<int64_t>(t.shape.size()) - 1, step = 1; d >= 0 && row_major; step *= t.shape[static_cast<size_t>(d)], --d)
    row_major = t.shape[static_cast<size_t>(d)] == 1 || t.stride[static_cast<size_t>(d)] == step;
  if (!row_major || dst.numel() == 0) return false;
  const std::string name = ref.where().empty() ? "the tensor" : ref.where();
  // Chunks of 1 Mi values: into the tensor itself, or through one buffer into a bf16 tensor.
  constexpr int64_t kChunk = int64_t{1} << 20;
  const bool bf16 = dst.dtype() == qkv::DType::BF16;
  std::vector<float> buffer(bf16 ? static_cast<size_t>(std::min(kChunk, dst.numel())) : 0);
  for (int64_t first = 0; first < dst.numel(); first += kChunk) {
    const int64_t n = std::min(kChunk, dst.numel() - first);
    float* into = bf16 ? buffer.data() : dst.data() + first;
    impl_->archive->read_into("data/" + t.storage, static_cast<uint64_t>(t.offset + first) * sizeof(float),
                              static_cast<uint64_t>(n) * sizeof(float), reinterpret_cast<std::byte*>(into));
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(into[i])) {
        fail(label_, name + " holds a non-finite value at element " + std::to_string(first + i) + "; the weights are corrupt");
      }
    if (bf16) kernels::f32_to_bf16(into, dst.bf16_data() + first, n);
  }
  return true;
}

void PthFile::read_weights(const PyRef& ref, Tensor& dst) const {
  const PthTensor& t = ref.as_tensor();
  if (!(Shape(std::span<const int64_t>(t.shape)) == dst.shape())) {
    throw ShapeError(label_ + ": " + ref.where() + " is " + Shape(std::span<const int64_t>(t.shape)).str() + ", not " +
                     dst.shape().str());
  }
  if (t.dtype != DType::F32 || !read_row_major(ref, dst)) dst.copy_(weights(ref));
}

Tensor PthFile::weights(const PyRef& ref) const {
  const PthTensor& t = ref.as_tensor();
  const std::string name = ref.where().empty() ? "the tensor" : ref.where();
  if (t.dtype != DType::F32 && t.dtype != DType::F16 && t.dtype != DType::BF16 && t.dtype != DType::F64) {
    fail(label_, name + " is " + dtype_name(t.dtype) + "; weights must be float32, float16, bfloat16 or float64");
  }
  if (t.shape.size() > static_cast<size_t>(kMaxRank)) {
    fail(label_, name + " has " + std::to_string(t.shape.size()) + " dimensions; qkv supports up to " + std::to_string(kMaxRank));
  }
  Tensor out = Tensor::empty(Shape(std::span<const int64_t>(t.shape)));
  if (read_row_major(ref, out)) return out;
  float* dst = out.data();
  gather(*impl_->archive, t, [&](int64_t i, const std::byte* p) {
    float v;
    if (t.dtype == DType::F32) std::memcpy(&v, p, sizeof v);
    else v = static_cast<float>(element_value(p, t.dtype));
    if (!std::isfinite(v)) {
      fail(label_, name + " holds a non-finite value at element " + std::to_string(i) + "; the weights are corrupt");
    }
    dst[i] = v;
  });
  return out;
}

std::vector<int64_t> PthFile::int64s(const PyRef& ref) const {
  const PthTensor& t = ref.as_tensor();
  std::vector<int64_t> out(static_cast<size_t>(t.numel()));
  gather(*impl_->archive, t, [&](int64_t i, const std::byte* p) {
    if (t.dtype == DType::I64) {
      std::memcpy(&out[static_cast<size_t>(i)], p, sizeof(int64_t));
      return;
    }
    const double v = element_value(p, t.dtype);
    if (!(v >= -9.2233720368547758e18 && v < 9.2233720368547758e18) || v != std::trunc(v)) {
      fail(label_, ref.where() + " element " + std::to_string(i) + " = " + std::to_string(v) + " is not a whole number");
    }
    out[static_cast<size_t>(i)] = static_cast<int64_t>(v);
  });
  return out;
}

// ---- writing ----

namespace {
PyValue value_of(PyKind kind) {
  PyValue v;
  v.kind = kind;
  return v;
}
}  // namespace

PyValue PyValue::of(bool b) { PyValue v = value_of(PyKind::Bool); v.boolean = b; return v; }
PyValue PyValue::of(int64_t i) { PyValue v = value_of(PyKind::Int); v.integer = i; return v; }
PyValue PyValue::of(double d) { PyValue v = value_of(PyKind::Float); v.real = d; return v; }
PyValue PyValue::of(std::string s) { PyValue v = value_of(PyKind::String); v.text = std::move(s); return v; }
PyValue PyValue::of(TensorData t) {
  PyValue v = value_of(PyKind::Tensor);
  v.tensor = std::make_shared<const TensorData>(std::move(t));
  return v;
}
PyValue PyValue::list(std::vector<PyValue> items) { PyValue v = value_of(PyKind::List); v.items = std::move(items); return v; }
PyValue PyValue::tuple(std::vector<PyValue> items) { PyValue v = value_of(PyKind::Tuple); v.items = std::move(items); return v; }
PyValue PyValue::dict(bool ordered) { PyValue v = value_of(PyKind::Dict); v.ordered = ordered; return v; }
PyValue& PyValue::set(PyValue key, PyValue value) {
  QKV_CHECK(kind == PyKind::Dict, "PyValue::set on a value that is not a dict");
  entries.emplace_back(std::move(key), std::move(value));
  return entries.back().second;
}

namespace {

class Pickler {
 public:
  std::vector<std::byte> code;
  std::vector<std::shared_ptr<const TensorData>> storages;

  void run(const PyValue& root) {
    op(0x80);
    op(2);
    value(root);
    op('.');
  }

 private:
  void op(uint8_t b) { code.push_back(static_cast<std::byte>(b)); }
  void le(uint64_t v, size_t n) {
    for (size_t k = 0; k < n; ++k) op(static_cast<uint8_t>(v >> (8 * k)));
  }
  void text(const std::string& s) {
    op('X');
    le(s.size(), 4);
    for (char c : s) op(static_cast<uint8_t>(c));
  }
  void global(const char* module, const char* name) {
    op('c');
    for (const char* p = module; *p; ++p) op(static_cast<uint8_t>(*p));
    op('\n');
    for (const char* p = name; *p; ++p) op(static_cast<uint8_t>(*p));
    op('\n');
  }
  void integer(int64_t v) {
    if (v >= 0 && v < 256) {
      op('K');
      op(static_cast<uint8_t>(v));
    } else if (v >= 0 && v < 65536) {
      op('M');
      le(static_cast<uint64_t>(v), 2);
    } else if (v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max()) {
      op('J');
      le(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
    } else {
      op(0x8a);
      op(8);
      le(static_cast<uint64_t>(v), 8);
    }
  }
  void tuple_of(const std::vector<int64_t>& v) {
    op('(');
    for (int64_t x : v) integer(x);
    op('t');
  }
  void tensor(const std::shared_ptr<const TensorData>& t) {
    const char* storage = t->dtype == DType::I64 ? "LongStorage" : t->dtype == DType::F32 ? "FloatStorage" : nullptr;
    QKV_CHECK(storage, "save_pth writes float32 and int64 tensors only");
    const std::string key = std::to_string(storages.size());
    storages.push_back(t);
    std::vector<int64_t> stride(t->shape.size(), 1);
    for (size_t d = t->shape.size(); d-- > 1;) stride[d - 1] = stride[d] * std::max<int64_t>(t->shape[d], 1);
    global("torch._utils", "_rebuild_tensor_v2");
    op('(');
    op('(');
    text("storage");
    global("torch", storage);
    text(key);
    text("cpu");
    integer(static_cast<int64_t>(t->bytes.size() / dtype_size(t->dtype)));
    op('t');
    op('Q');
    integer(0);
    tuple_of(t->shape);
    tuple_of(stride);
    op(0x89);  // requires_grad = False
    global("collections", "OrderedDict");
    op(')');
    op('R');   // backward hooks: OrderedDict()
    op('t');
    op('R');
  }
  void value(const PyValue& v) {
    switch (v.kind) {
      case PyKind::None: op('N'); break;
      case PyKind::Bool: op(v.boolean ? 0x88 : 0x89); break;
      case PyKind::Int: integer(v.integer); break;
      case PyKind::Float: {
        op('G');
        const uint64_t bits = std::bit_cast<uint64_t>(v.real);
        for (int k = 7; k >= 0; --k) op(static_cast<uint8_t>(bits >> (8 * k)));
        break;
      }
      case PyKind::String: text(v.text); break;
      case PyKind::Tensor: tensor(v.tensor); break;
      case PyKind::List:
        op(']');
        if (!v.items.empty()) {
          op('(');
          for (const auto& x : v.items) value(x);
          op('e');
        }
        break;
      case PyKind::Tuple:
        op('(');
        for (const auto& x : v.items) value(x);
        op('t');
        break;
      case PyKind::Dict:
        if (v.ordered) {
          global("collections", "OrderedDict");
          op(')');
          op('R');
        } else {
          op('}');
        }
        for (size_t k = 0; k < v.entries.size(); k += 1000) {  // SETITEMS in batches, as pickle does
          op('(');
          for (size_t j = k; j < std::min(v.entries.size(), k + 1000); ++j) {
            value(v.entries[j].first);
            value(v.entries[j].second);
          }
          op('u');
        }
        break;
    }
  }
};

}  // namespace

void save_pth(const std::string& path, const PyValue& root, const std::string& folder) {
  Pickler pickler;
  pickler.run(root);
  zip_error_t error;
  zip_error_init(&error);
  zip_source_t* target = zip_source_buffer_create(nullptr, 0, 0, &error);
  if (!target) fail(path, std::string("cannot create a zip archive in memory: ") + zip_error_strerror(&error));
  zip_source_keep(target);
  zip_t* zip = zip_open_from_source(target, ZIP_TRUNCATE, &error);
  if (!zip) {
    zip_source_free(target);
    fail(path, std::string("cannot create a zip archive in memory: ") + zip_error_strerror(&error));
  }
  static const char kVersion[] = "3\n", kByteOrder[] = "little";
  auto add = [&](const std::string& name, const void* data, size_t size) {
    zip_source_t* src = zip_source_buffer(zip, data, size, 0);
    const zip_int64_t index = src ? zip_file_add(zip, (folder + "/" + name).c_str(), src, ZIP_FL_ENC_UTF_8) : -1;
    if (index < 0) {
      if (src) zip_source_free(src);
      const std::string why = zip_strerror(zip);
      zip_discard(zip);
      zip_source_free(target);
      fail(path, "cannot add " + name + " to the zip archive: " + why);
    }
    zip_set_file_compression(zip, static_cast<zip_uint64_t>(index), ZIP_CM_STORE, 0);  // as torch.save: uncompressed
  };
  add("data.pkl", pickler.code.data(), pickler.code.size());
  add("byteorder", kByteOrder, sizeof kByteOrder - 1);
  for (size_t k = 0; k < pickler.storages.size(); ++k) {
    add("data/" + std::to_string(k), pickler.storages[k]->bytes.data(), pickler.storages[k]->bytes.size());
  }
  add("version", kVersion, sizeof kVersion - 1);
  if (zip_close(zip) != 0) {
    const std::string why = zip_strerror(zip);
    zip_discard(zip);
    zip_source_free(target);
    fail(path, "cannot write the zip archive: " + why);
  }
  std::vector<std::byte> bytes;
  zip_stat_t st;
  zip_stat_init(&st);
  bool ok = zip_source_stat(target, &st) == 0 && zip_source_open(target) == 0;
  if (ok) {
    bytes.resize(st.size);
    ok = zip_source_read(target, bytes.data(), st.size) == static_cast<zip_int64_t>(st.size);
    zip_source_close(target);
  }
  zip_source_free(target);
  if (!ok) fail(path, "cannot read back the zip archive built in memory");
  write_file_atomically(path, bytes);
}

}  // namespace qkv::io
