// The tensor table of a shard manifest, decoded without Python's json (issue #25): a hundred
// thousand entries cost a dozen Python objects each through json.loads before any check runs.
//
// Accept-only, like format._fast_tensor: find_tensors locates the top-level "tensors" value, and
// build_tensors parses it in a strict subset of JSON (ASCII strings without escapes, non-negative
// integers without fraction or exponent, each entry's keys once and all known) while checking
// every rule of format._parse_tensor and parse_shard's over the table. Anything outside the subset, or any rule broken, returns
// None and the caller decodes the manifest with the Python path, whose messages name the fault.
#include "tensor_table.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace nb = nanobind;

namespace gpumem::table {
namespace {

constexpr int64_t kMaxFileBytes = int64_t(1) << 50;  // format.MAX_FILE_BYTES
constexpr size_t kMaxNdim = 64;                      // format.MAX_NDIM
constexpr size_t kMaxName = 1024;                    // format.MAX_NAME
constexpr int kMaxDepth = 400;                       // deeper: left to the Python path

struct Fail {};  // outside the subset or against a rule: the caller falls back

struct Cursor {
  const char* p;
  const char* end;

  void ws() {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) ++p;
  }
  char peek() const { return p < end ? *p : '\0'; }
  void expect(char c) {
    ws();
    if (p >= end || *p != c) throw Fail{};
    ++p;
  }
  bool take(char c) {
    ws();
    if (p < end && *p == c) {
      ++p;
      return true;
    }
    return false;
  }
  // A string of printable ASCII without escapes (what every name the writer makes is).
  std::string_view str() {
    expect('"');
    const char* s = p;
    while (p < end && *p != '"') {
      const unsigned char c = static_cast<unsigned char>(*p);
      if (c < 0x20 || c > 0x7e || c == '\\') throw Fail{};
      ++p;
    }
    if (p >= end) throw Fail{};
    return {s, static_cast<size_t>(p++ - s)};
  }
  // A non-negative JSON integer of at most 16 digits (no sign, fraction or exponent).
  int64_t num() {
    ws();
    const char* s = p;
    while (p < end && *p >= '0' && *p <= '9') ++p;
    const size_t n = static_cast<size_t>(p - s);
    if (n == 0 || n > 16 || (n > 1 && *s == '0')) throw Fail{};
    if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) throw Fail{};
    int64_t v = 0;
    for (const char* q = s; q < p; ++q) v = v * 10 + (*q - '0');
    return v;
  }
  template <typename F>
  void array(F&& item) {
    expect('[');
    if (take(']')) return;
    do item();
    while (take(','));
    expect(']');
  }
  // Skip any value, tracking strings and nesting only: its validity is checked by whoever parses
  // it (build_tensors the tensors array, strict_json the rest with that array cut out), so a
  // bracketed value is one scan for its closing bracket, strings jumped over with memchr.
  void skip(int /*depth*/) {
    ws();
    const char c = peek();
    if (c == '"') {
      ++p;
      string_end();
      return;
    }
    if (c != '[' && c != '{') {
      const char* s = p;
      while (p < end && !std::strchr(",]}: \t\n\r\"[{", *p)) ++p;
      if (p == s) throw Fail{};
      return;
    }
    int depth = 0;
    for (; p < end; ++p) {
      const char ch = *p;
      if (ch == '"') {
        ++p;
        string_end();
        --p;
      } else if (ch == '[' || ch == '{') {
        if (++depth > kMaxDepth) throw Fail{};
      } else if ((ch == ']' || ch == '}') && --depth == 0) {
        ++p;
        return;
      }
    }
    throw Fail{};
  }
  // From inside a string to just past its closing quote (a backslash escapes the next byte).
  void string_end() {
    for (;;) {
      const void* q = std::memchr(p, '"', static_cast<size_t>(end - p));
      if (!q) throw Fail{};
      const char* quote = static_cast<const char*>(q);
      size_t slashes = 0;  // an odd run of backslashes before it escapes the quote
      for (const char* b = quote; b > p && b[-1] == '\\'; --b) ++slashes;
      p = quote + 1;
      if (slashes % 2 == 0) return;
    }
  }
};

bool plain_name(std::string_view s) {  // format._check_name
  return !s.empty() && s.size() <= kMaxName && s.find('/') == std::string_view::npos;
}

bool placement(std::string_view s) {  // format._PLACEMENT: R | S(d{1,2}) | SS(d{1,2},d{1,9})
  auto digits = [&](size_t& i, size_t lo, size_t hi) {
    size_t n = 0;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i, ++n;
    return n >= lo && n <= hi;
  };
  if (s == "R") return true;
  size_t i = 0;
  if (s.rfind("SS(", 0) == 0) {
    i = 3;
    if (!digits(i, 1, 2) || i >= s.size() || s[i++] != ',' || !digits(i, 1, 9)) return false;
  } else if (s.rfind("S(", 0) == 0) {
    i = 2;
    if (!digits(i, 1, 2)) return false;
  } else {
    return false;
  }
  return i + 1 == s.size() && s[i] == ')';
}

struct Extent {
  PyObject* file;  // borrowed: the key of the files dict
  int64_t file_index, file_size, off, len;
};

struct Entry {
  std::string_view name, dtype, tensor;
  std::vector<int64_t> shape, crcs, gshape, offsets;
  std::vector<Extent> extents;
  std::vector<std::string_view> placements;
  int64_t nbytes = -1, mesh = -1;
  bool has_global = false, has_tensor = false, has_mesh = false, has_placements = false;
};

struct Rules {
  int64_t chunk, align;
  struct File {
    PyObject* key;
    int64_t index, size;
  };
  std::unordered_map<std::string_view, File> files;  // name -> key, place in the dict, size
  std::unordered_map<std::string_view, std::pair<PyObject*, int64_t>> dtypes;  // -> key, itemsize
  std::vector<int64_t> mesh_ndims;
  bool sharded;
};

// The entry's "global" record (format._parse_global's rules are checked in check()).
void parse_global(Cursor& c, Entry& e) {
  unsigned seen = 0;
  auto once = [&](unsigned bit) {
    if (seen & bit) throw Fail{};
    seen |= bit;
  };
  c.expect('{');
  if (c.take('}')) return;
  do {
    const std::string_view key = c.str();
    c.expect(':');
    if (key == "shape") {
      once(1);
      c.array([&] { e.gshape.push_back(c.num()); });
    } else if (key == "offsets") {
      once(2);
      c.array([&] { e.offsets.push_back(c.num()); });
    } else if (key == "tensor") {
      once(4);
      e.tensor = c.str(), e.has_tensor = true;
    } else if (key == "mesh") {
      once(8);
      e.mesh = c.num(), e.has_mesh = true;
    } else if (key == "placements") {
      once(16);
      e.has_placements = true;
      c.array([&] { e.placements.push_back(c.str()); });
    } else {
      throw Fail{};
    }
  } while (c.take(','));
  c.expect('}');
  if ((seen & 3) != 3) throw Fail{};
}

void parse_entry(Cursor& c, Entry& e, const Rules& r) {
  unsigned seen = 0;
  auto once = [&](unsigned bit) {
    if (seen & bit) throw Fail{};
    seen |= bit;
  };
  c.expect('{');
  if (c.take('}')) throw Fail{};
  do {
    const std::string_view key = c.str();
    c.expect(':');
    if (key == "name") {
      once(1), e.name = c.str();
    } else if (key == "dtype") {
      once(2), e.dtype = c.str();
    } else if (key == "shape") {
      once(4);
      c.array([&] { e.shape.push_back(c.num()); });
    } else if (key == "nbytes") {
      once(8), e.nbytes = c.num();
    } else if (key == "crc32c") {
      once(16);
      c.array([&] { e.crcs.push_back(c.num()); });
    } else if (key == "extents") {
      once(32);
      c.array([&] {
        c.expect('[');
        const auto f = r.files.find(c.str());
        if (f == r.files.end()) throw Fail{};
        c.expect(',');
        const int64_t off = c.num();
        c.expect(',');
        const int64_t len = c.num();
        c.expect(']');
        e.extents.push_back({f->second.key, f->second.index, f->second.size, off, len});
      });
    } else if (key == "global") {
      once(64), e.has_global = true;
      parse_global(c, e);
    } else {
      throw Fail{};
    }
  } while (c.take(','));
  c.expect('}');
  if ((seen & 63) != 63) throw Fail{};
}

// format._parse_tensor's rules, on a parsed entry.
void check(const Entry& e, const Rules& r) {
  if (!plain_name(e.name) || e.shape.size() > kMaxNdim) throw Fail{};
  const auto dt = r.dtypes.find(e.dtype);
  if (dt == r.dtypes.end()) throw Fail{};
  const int64_t itemsize = dt->second.second;
  // exact products, saturated far above 2^63 (each factor is at most 2^50)
  constexpr unsigned __int128 kCap = static_cast<unsigned __int128>(1) << 70;
  unsigned __int128 size = 1, nonzero = 1;
  for (const int64_t d : e.shape) {
    if (d > kMaxFileBytes) throw Fail{};
    size = size * static_cast<unsigned __int128>(d);
    nonzero = nonzero * static_cast<unsigned __int128>(d ? d : 1);
    if (size > kCap) size = kCap;
    if (nonzero > kCap) nonzero = kCap;
  }
  if (nonzero * itemsize >= (static_cast<unsigned __int128>(1) << 63)) throw Fail{};
  if (e.nbytes > kMaxFileBytes || size * itemsize != static_cast<unsigned __int128>(e.nbytes))
    throw Fail{};
  if (static_cast<int64_t>(e.crcs.size()) != (e.nbytes + r.chunk - 1) / r.chunk) throw Fail{};
  for (const int64_t x : e.crcs)
    if (x >= (int64_t(1) << 32)) throw Fail{};
  int64_t total = 0;
  for (size_t j = 0; j < e.extents.size(); ++j) {
    const Extent& x = e.extents[j];
    if (x.len <= 0 || x.off % r.align || x.off + x.len > x.file_size) throw Fail{};
    if (j + 1 < e.extents.size() && x.len % r.chunk) throw Fail{};
    total += x.len;
  }
  if (total != e.nbytes) throw Fail{};
  if (!e.has_global) return;
  if (!r.sharded || e.gshape.size() != e.shape.size() || e.offsets.size() != e.shape.size())
    throw Fail{};
  for (size_t k = 0; k < e.shape.size(); ++k)
    if (e.gshape[k] > kMaxFileBytes || e.offsets[k] + e.shape[k] > e.gshape[k]) throw Fail{};
  if (e.has_tensor && !plain_name(e.tensor)) throw Fail{};
  if (!e.has_mesh && !e.has_placements) return;
  if (!e.has_mesh || !e.has_placements || e.mesh >= static_cast<int64_t>(r.mesh_ndims.size()))
    throw Fail{};
  if (static_cast<int64_t>(e.placements.size()) != r.mesh_ndims[e.mesh]) throw Fail{};
  for (const auto& p : e.placements)
    if (!placement(p)) throw Fail{};
}

// format.parse_shard's checks over the whole table: no name twice, and each data file's
// extents laid out canonically (each at the aligned end of the previous, the file ending with
// the last).
bool unique_and_canonical(const std::vector<Entry>& entries, const Rules& r) {
  std::unordered_map<std::string_view, int> names;
  names.reserve(entries.size() * 2);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> per_file(r.files.size());
  for (const Entry& e : entries) {
    if (!names.emplace(e.name, 0).second) return false;
    for (const Extent& x : e.extents) per_file[x.file_index].emplace_back(x.off, x.len);
  }
  for (const auto& [name, f] : r.files) {
    auto& spans = per_file[f.index];
    std::sort(spans.begin(), spans.end());
    int64_t expected = 0;
    for (const auto& [off, len] : spans) {
      if (off != (expected + r.align - 1) / r.align * r.align) return false;
      expected = off + len;
    }
    if (expected != f.size) return false;
  }
  return true;
}

nb::object owned(PyObject* o) {
  if (!o) throw nb::python_error();
  return nb::steal(o);
}

nb::object ints(const std::vector<int64_t>& v) {
  nb::object t = owned(PyTuple_New(static_cast<Py_ssize_t>(v.size())));
  for (size_t i = 0; i < v.size(); ++i)
    PyTuple_SET_ITEM(t.ptr(), i, owned(PyLong_FromLongLong(v[i])).release().ptr());
  return t;
}

nb::object text(std::string_view s) {
  return owned(PyUnicode_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size())));
}

// An instance of the frozen dataclass `type` with these fields, as format._fast_tensor makes
// one: every field was checked, so __init__ is not rerun.
nb::object instance(nb::handle type, nb::handle fields) {
  PyTypeObject* tp = reinterpret_cast<PyTypeObject*>(type.ptr());
  nb::object obj = owned(tp->tp_alloc(tp, 0));
  if (PyObject_GenericSetDict(obj.ptr(), fields.ptr(), nullptr) < 0) throw nb::python_error();
  return obj;
}

struct Keys {
  nb::object name = text("name"), dtype = text("dtype"), shape = text("shape"),
             nbytes = text("nbytes"), crc32c = text("crc32c"), extents = text("extents"),
             box = text("box"), mesh = text("mesh"), placements = text("placements"),
             tensor = text("tensor"), global_shape = text("global_shape"),
             offsets = text("offsets");
};

// The last tuple made of each kind: consecutive blocks of one tensor share their shape and
// global shape (immutable, so one object serves them all).
struct Shared {
  std::vector<int64_t> values;
  nb::object tuple;
  const nb::object& get(const std::vector<int64_t>& v) {
    if (!tuple.is_valid() || v != values) values = v, tuple = ints(v);
    return tuple;
  }
};

struct Cache {
  Shared shape, gshape;
  std::string_view tensor;
  nb::object tensor_text;
  const nb::object& tensor_name(std::string_view s) {
    if (!tensor_text.is_valid() || s != tensor) tensor = s, tensor_text = text(s);
    return tensor_text;
  }
};

void set(nb::handle d, const nb::object& k, const nb::object& v) {
  if (PyDict_SetItem(d.ptr(), k.ptr(), v.ptr()) < 0) throw nb::python_error();
}

nb::object make(const Entry& e, const Rules& r, const Keys& k, Cache& cache,
                nb::handle entry_type, nb::handle box_type, const nb::object& empty) {
  nb::object d = owned(PyDict_New());
  nb::object name = text(e.name);
  nb::object shape = cache.shape.get(e.shape);
  set(d, k.name, name);
  set(d, k.dtype, nb::borrow(r.dtypes.at(e.dtype).first));
  set(d, k.shape, shape);
  set(d, k.nbytes, owned(PyLong_FromLongLong(e.nbytes)));
  set(d, k.crc32c, ints(e.crcs));
  nb::object ext = owned(PyTuple_New(static_cast<Py_ssize_t>(e.extents.size())));
  for (size_t j = 0; j < e.extents.size(); ++j) {
    nb::object x = owned(PyTuple_New(3));
    PyTuple_SET_ITEM(x.ptr(), 0, nb::borrow(e.extents[j].file).release().ptr());
    PyTuple_SET_ITEM(x.ptr(), 1, owned(PyLong_FromLongLong(e.extents[j].off)).release().ptr());
    PyTuple_SET_ITEM(x.ptr(), 2, owned(PyLong_FromLongLong(e.extents[j].len)).release().ptr());
    PyTuple_SET_ITEM(ext.ptr(), j, x.release().ptr());
  }
  set(d, k.extents, ext);
  if (!e.has_global) {
    set(d, k.box, nb::none());
    set(d, k.mesh, owned(PyLong_FromLong(-1)));
    set(d, k.placements, empty);
    set(d, k.tensor, owned(PyUnicode_FromString("")));
    return instance(entry_type, d);
  }
  nb::object b = owned(PyDict_New());
  set(b, k.global_shape, cache.gshape.get(e.gshape));
  set(b, k.offsets, ints(e.offsets));
  set(b, k.shape, shape);
  set(d, k.box, instance(box_type, b));
  set(d, k.mesh, owned(PyLong_FromLongLong(e.has_mesh ? e.mesh : -1)));
  nb::object pl = owned(PyTuple_New(static_cast<Py_ssize_t>(e.placements.size())));
  for (size_t j = 0; j < e.placements.size(); ++j)
    PyTuple_SET_ITEM(pl.ptr(), j, text(e.placements[j]).release().ptr());
  set(d, k.placements, pl);
  set(d, k.tensor, e.has_tensor ? cache.tensor_name(e.tensor) : name);
  return instance(entry_type, d);
}

std::string_view as_view(nb::handle s) {
  Py_ssize_t n = 0;
  const char* p = PyUnicode_AsUTF8AndSize(s.ptr(), &n);
  if (!p) throw nb::python_error();
  return {p, static_cast<size_t>(n)};
}

}  // namespace

nb::object find_tensors(const char* data, size_t size) {
  Cursor c{data, data + size};
  try {
    c.expect('{');
    if (c.take('}')) return nb::none();
    int64_t start = -1, stop = -1;
    do {
      c.ws();
      const char* k = c.p;
      c.skip(1);
      const bool hit = std::string_view(k, static_cast<size_t>(c.p - k)) == "\"tensors\"";
      c.expect(':');
      c.ws();
      const char* v = c.p;
      c.skip(1);
      if (hit && start < 0) start = v - data, stop = c.p - data;
    } while (c.take(','));
    c.expect('}');
    c.ws();
    if (c.p != c.end || start < 0) return nb::none();
    return nb::make_tuple(start, stop);
  } catch (const Fail&) {
    return nb::none();
  }
}

nb::object build_tensors(const char* data, size_t size, int64_t chunk, int64_t align,
                         nb::dict files, nb::dict itemsize, std::vector<int64_t> mesh_ndims,
                         bool sharded, nb::handle entry_type, nb::handle box_type) {
  if (chunk <= 0 || align <= 0) return nb::none();
  Rules r{chunk, align, {}, {}, std::move(mesh_ndims), sharded};
  int64_t index = 0;
  for (auto [k, v] : files) r.files[as_view(k)] = {k.ptr(), index++, nb::cast<int64_t>(v)};
  for (auto [k, v] : itemsize) r.dtypes[as_view(k)] = {k.ptr(), nb::cast<int64_t>(v)};
  Cursor c{data, data + size};
  std::vector<Entry> entries;
  try {
    c.array([&] {
      entries.emplace_back();
      parse_entry(c, entries.back(), r);
      check(entries.back(), r);
    });
    c.ws();
    if (c.p != c.end) return nb::none();
  } catch (const Fail&) {
    return nb::none();
  }
  if (!unique_and_canonical(entries, r)) return nb::none();
  const Keys keys;
  Cache cache;
  nb::object empty = owned(PyTuple_New(0));
  nb::object out = owned(PyList_New(static_cast<Py_ssize_t>(entries.size())));
  // the same table as columns, for readers that need no object per entry: every extent as
  // (tensor, position in the tensor, file index, offset, length), every chunk CRC in order, and
  // each tensor's number of chunk CRCs
  std::vector<int64_t> extents, crcs, counts;
  counts.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    counts.push_back(static_cast<int64_t>(e.crcs.size()));
    int64_t pos = 0;
    for (const Extent& x : e.extents) {
      extents.insert(extents.end(), {static_cast<int64_t>(i), pos, x.file_index, x.off, x.len});
      pos += x.len;
    }
    crcs.insert(crcs.end(), e.crcs.begin(), e.crcs.end());
    PyList_SET_ITEM(out.ptr(), i,
                    make(e, r, keys, cache, entry_type, box_type, empty).release().ptr());
  }
  auto raw = [](const std::vector<int64_t>& v) {
    return owned(PyBytes_FromStringAndSize(reinterpret_cast<const char*>(v.data()),
                                           static_cast<Py_ssize_t>(v.size() * sizeof(int64_t))));
  };
  return nb::make_tuple(out, raw(extents), raw(crcs), raw(counts));
}

}  // namespace gpumem::table
