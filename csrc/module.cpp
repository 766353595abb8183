// nanobind bindings for gpumem._C. Each concern lives in its own file; this one only binds.
// Buffers arrive as 1-D uint8 arrays (buffer protocol / DLPack, no torch C++ ABI); the Python
// modules (gpumem/checksum.py, writer.py, reader.py, arena.py) turn user objects into those views.
// Paths arrive as bytes (os.fsencode), so any name the OS accepts works, UTF-8 or not.
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "alloc_sim.h"
#include "arena.h"
#include "crc32c.h"
#include "cuda_api.h"
#include "fileio.h"
#include "parallel.h"
#include "reader.h"
#include "tensor_table.h"
#include "writer.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using Bytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::device::cpu>;
using MutBytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::device::cpu>;
using MutInt64 = nb::ndarray<int64_t, nb::ndim<1>, nb::device::cpu>;
using DeviceCopies = nb::ndarray<const uint64_t, nb::shape<-1, 3>, nb::c_contig, nb::device::cpu>;

template <typename Array>
void require_dense(const Array& a, const char* what) {
  if (a.shape(0) > 1 && a.stride(0) != 1)
    throw std::invalid_argument(std::string(what) + " must be contiguous (stride " +
                                std::to_string(a.stride(0)) + "); pass a contiguous copy");
}

// One (buffer, file offset) piece of write_file/read_file: dense, at a non-negative offset.
template <typename Array>
void check_piece(const Array& buffer, int64_t offset, size_t i) {
  require_dense(buffer, "each buffer");
  if (offset < 0)
    throw std::invalid_argument("piece " + std::to_string(i) + " has a negative file offset " + std::to_string(offset));
}

gpumem::crc32c::Impl parse_impl(const std::string& impl) {
  if (impl == "auto") return gpumem::crc32c::Impl::Auto;
  if (impl == "table") return gpumem::crc32c::Impl::Table;
  if (impl == "hardware") return gpumem::crc32c::Impl::Hardware;
  throw std::invalid_argument("impl must be 'auto', 'table' or 'hardware', got '" + impl + "'");
}

uint32_t crc_value(int64_t value) {
  if (value < 0 || value > 0xFFFFFFFFll)
    throw std::invalid_argument("value must be a CRC32C in [0, 2**32), got " + std::to_string(value));
  return static_cast<uint32_t>(value);
}

std::string path_of(const nb::bytes& path) { return std::string(path.c_str(), path.size()); }

using Int64s = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

size_t check_chunk(int64_t chunk_bytes, const MutInt64& crc_out) {
  if (chunk_bytes < 0) throw std::invalid_argument("chunk_bytes must be >= 0, got " + std::to_string(chunk_bytes));
  require_dense(crc_out, "crc_out");
  return static_cast<size_t>(chunk_bytes);
}

// A piece's CRC slots must lie inside crc_out; -1 (none) and -2 (must be zero) take none.
void check_slots(int64_t index, size_t size, size_t chunk, const MutInt64& crc_out, size_t i) {
  if (index < gpumem::io::kMustBeZero)
    throw std::invalid_argument("piece " + std::to_string(i) + " has CRC index " + std::to_string(index) +
                                " (>= 0, -1: none, -2: must be zero)");
  if (chunk > 0 && index >= 0) {
    const size_t need = static_cast<size_t>(index) + (size + chunk - 1) / chunk;
    if (need > crc_out.shape(0))
      throw std::invalid_argument("piece " + std::to_string(i) + " needs CRC slots up to " + std::to_string(need) +
                                  " but crc_out has " + std::to_string(crc_out.shape(0)));
  }
}

std::tuple<uint64_t, uint64_t, int64_t, uint64_t> run_read(const nb::bytes& path, const std::vector<gpumem::io::ReadPiece>& pieces,
                                                  size_t chunk, MutInt64& crc_out, int threads, bool direct,
                                                  int dir_fd, int64_t expect_size) {
  gpumem::io::ReadOptions opts;
  opts.threads = threads;
  opts.direct = direct;
  opts.chunk = chunk;
  opts.crc_out = crc_out.data();
  opts.dir_fd = dir_fd < 0 ? gpumem::io::kCwd : dir_fd;
  opts.expect_size = expect_size;
  gpumem::io::ReadResult r;
  const std::string p = path_of(path);
  {
    nb::gil_scoped_release release;
    r = gpumem::io::read_file(p, pieces, opts);
  }
  return std::make_tuple(r.bytes, r.direct_bytes, r.nonzero_at, r.cached_bytes);
}

// gpumem._C.UnexpectedFileError (an OSError): the file is not the regular file of the expected
// size the caller asked for (io::UnexpectedFile). Created once, when the module loads.
PyObject* unexpected_file_error = nullptr;

void set_os_error(PyObject* type, const gpumem::io::SysError& e) {
  // OSError(errno, text, filename) picks the subclass (PermissionError, ...) and sets .filename;
  // the filename is decoded as os.fsdecode would, so undecodable bytes survive.
  // An unexpected file's message says what it is; a system error leads with strerror.
  const std::string text = type == unexpected_file_error
                               ? std::string(e.what())
                               : std::string(std::strerror(e.err)) + " (" + e.what() + ")";
  PyObject* filename = PyUnicode_DecodeFSDefaultAndSize(e.path.data(), static_cast<Py_ssize_t>(e.path.size()));
  if (!filename) return;
  PyObject* args = Py_BuildValue("(isN)", e.err, text.c_str(), filename);
  if (args) {
    PyErr_SetObject(type, args);
    Py_DECREF(args);
  }
}

nb::dict status_dict(const gpumem::cuda::Status& s) {
  nb::dict d;
  d["attempted"] = s.attempted;
  d["available"] = s.available;
  d["library"] = s.library;
  d["device_count"] = s.device_count;
  d["reason"] = s.reason;
  return d;
}

// HostBuffer as Python owns it. The last reference may die anywhere (a torch tensor made from
// array() can outlive its HostArena), and nanobind destroys the object with the GIL held: joining
// the pinning thread (up to a chunk's registration) and unregistering and unmapping tens of GiB
// there would stall every Python thread, so the teardown runs with the GIL released.
struct PyHostBuffer : gpumem::arena::HostBuffer {
  using HostBuffer::HostBuffer;
  ~PyHostBuffer() {
    // Only a thread that holds the GIL may release it; without it, the teardown simply runs.
    if (PyGILState_Check()) {
      nb::gil_scoped_release release;
      close();
    }
  }
};

}  // namespace

NB_MODULE(_C, m) {
  using namespace gpumem;
  m.doc() = "gpumem native core (private; use the gpumem Python modules)";
  m.attr("__version__") = "0.1.0";
  // Arena memory is owned by torch tensors made from it, which the interpreter may still hold at
  // exit (module globals are not collected in order); that is not a reference leak.
  nb::set_leak_warnings(false);

  unexpected_file_error = PyErr_NewExceptionWithDoc(
      "gpumem._C.UnexpectedFileError",
      "The file is not what the caller asked for (a symbolic link, not a regular file, another "
      "size); it was not read.",
      PyExc_OSError, nullptr);
  if (!unexpected_file_error) throw nb::python_error();
  m.attr("UnexpectedFileError") = nb::handle(unexpected_file_error);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const io::UnexpectedFile& e) {
      set_os_error(unexpected_file_error, e);
    } catch (const io::SysError& e) {
      set_os_error(PyExc_OSError, e);
    }
  });

  // ---- threads ----
  m.def("num_threads", &num_threads, "Threads the native core uses by default.");
  m.def("set_num_threads", &set_num_threads, "n"_a,
        "Set the default thread count (<= 0: hardware concurrency).");

  // ---- CRC32C ----
  m.def(
      "crc32c",
      [](Bytes data, int64_t value, const std::string& impl, int threads) {
        require_dense(data, "data");
        const auto kind = parse_impl(impl);
        const uint32_t start = crc_value(value);
        nb::gil_scoped_release release;
        return crc32c::extend_parallel(start, data.data(), data.shape(0), threads, kind);
      },
      "data"_a.noconvert(), "value"_a = 0, "impl"_a = "auto", "threads"_a = 0,
      "CRC32C of a 1-D uint8 buffer, extending the running CRC `value`.");
  m.def(
      "crc32c_combine",
      [](int64_t a, int64_t b, int64_t len_b) {
        if (len_b < 0) throw std::invalid_argument("len_b must be >= 0, got " + std::to_string(len_b));
        return crc32c::combine(crc_value(a), crc_value(b), static_cast<uint64_t>(len_b));
      },
      "crc_a"_a, "crc_b"_a, "len_b"_a, "CRC32C of a + b from crc(a), crc(b) and len(b).");
  m.def(
      "chunk_crc32c",
      [](Bytes data, int64_t chunk_bytes, MutInt64 out, const std::string& impl, int threads) {
        require_dense(data, "data");
        require_dense(out, "out");
        if (chunk_bytes <= 0)
          throw std::invalid_argument("chunk_bytes must be positive, got " + std::to_string(chunk_bytes));
        const size_t n = data.shape(0);
        const size_t chunk = static_cast<size_t>(chunk_bytes);
        const size_t count = (n + chunk - 1) / chunk;
        if (out.shape(0) != count)
          throw std::invalid_argument("out has " + std::to_string(out.shape(0)) + " entries, need " +
                                      std::to_string(count));
        const auto kind = parse_impl(impl);
        nb::gil_scoped_release release;
        crc32c::chunks(data.data(), n, chunk, out.data(), threads, kind);
      },
      "data"_a.noconvert(), "chunk_bytes"_a, "out"_a.noconvert(), "impl"_a = "auto", "threads"_a = 0,
      "Write one CRC32C per chunk_bytes-sized chunk of data into out (int64).");
  m.def("crc32c_hardware", &crc32c::hardware_name,
        "'sse4.2', 'armv8-crc' or 'table': the CRC32C path this CPU uses.");
  m.def("crc32c_fold", &crc32c::fold_name,
        "'vpclmulqdq', 'pclmulqdq' or 'none': how the hardware CRC32C path folds long buffers.");

  // ---- file I/O ----
  m.def(
      "write_file",
      [](const nb::bytes& path, const std::vector<int64_t>& offsets, const std::vector<Bytes>& buffers,
         int64_t size, int threads, bool fsync, bool direct, int dir_fd, bool exclusive) {
        if (offsets.size() != buffers.size())
          throw std::invalid_argument("got " + std::to_string(offsets.size()) + " offsets but " +
                                      std::to_string(buffers.size()) + " buffers");
        std::vector<io::Piece> pieces;
        pieces.reserve(buffers.size());
        for (size_t i = 0; i < buffers.size(); ++i) {
          check_piece(buffers[i], offsets[i], i);
          pieces.push_back({static_cast<uint64_t>(offsets[i]), buffers[i].data(), buffers[i].shape(0)});
        }
        io::WriteOptions opts;
        opts.size = size;
        opts.threads = threads;
        opts.fsync = fsync;
        opts.direct = direct;
        opts.dir_fd = dir_fd < 0 ? io::kCwd : dir_fd;
        opts.exclusive = exclusive;
        io::WriteResult r;
        {
          nb::gil_scoped_release release;
          r = io::write_file(path_of(path), pieces, opts);
        }
        return std::make_tuple(r.bytes, r.direct_bytes);
      },
      "path"_a, "offsets"_a, "buffers"_a.noconvert(), "size"_a = -1, "threads"_a = 0, "fsync"_a = true,
      "direct"_a = false, "dir_fd"_a = -1, "exclusive"_a = false,
      "Write pieces in parallel (path relative to dir_fd when >= 0; exclusive: create a new file, "
      "never through a symlink); returns (bytes written, bytes via O_DIRECT).");
  m.def(
      "fsync_dir",
      [](const nb::bytes& path) {
        const std::string p = path_of(path);
        nb::gil_scoped_release release;
        io::fsync_dir(p);
      },
      "path"_a, "fsync a directory.");
  m.def(
      "read_into",
      [](const nb::bytes& path, int64_t offset, MutBytes out, int threads) {
        require_dense(out, "out");
        if (offset < 0) throw std::invalid_argument("offset must be >= 0, got " + std::to_string(offset));
        const std::string p = path_of(path);
        nb::gil_scoped_release release;
        return io::read_into(p, static_cast<uint64_t>(offset), out.data(), out.shape(0), threads);
      },
      "path"_a, "offset"_a, "out"_a.noconvert(), "threads"_a = 0,
      "Read exactly len(out) bytes at offset into out.");

  m.def(
      "copy_many",
      [](const std::vector<Bytes>& srcs, const std::vector<MutBytes>& dsts, int threads) {
        if (srcs.size() != dsts.size())
          throw std::invalid_argument("copy_many got " + std::to_string(srcs.size()) + " sources and " +
                                      std::to_string(dsts.size()) + " destinations");
        struct Task {
          const uint8_t* src;
          uint8_t* dst;
          size_t size;
        };
        std::vector<Task> tasks;
        for (size_t i = 0; i < srcs.size(); ++i) {
          require_dense(srcs[i], "each source");
          require_dense(dsts[i], "each destination");
          const size_t n = srcs[i].shape(0);
          if (dsts[i].shape(0) != n)
            throw std::invalid_argument("copy_many: source " + std::to_string(i) + " has " + std::to_string(n) +
                                        " bytes, its destination " + std::to_string(dsts[i].shape(0)));
          for (size_t b = 0; b < n; b += io::kSplit)
            tasks.push_back({srcs[i].data() + b, dsts[i].data() + b, b + io::kSplit < n ? io::kSplit : n - b});
        }
        nb::gil_scoped_release release;
        parallel_for(tasks.size(), [&](size_t i) { std::memcpy(tasks[i].dst, tasks[i].src, tasks[i].size); }, threads);
      },
      "srcs"_a, "dsts"_a.noconvert(), "threads"_a = 0,
      "Copy each source's bytes into its destination of the same size, 8 MiB pieces on the pool.");
  // Both read bindings fill io::read_file's pieces: one buffer per piece (tensors), or spans of
  // one buffer given as arrays (a hundred thousand extents without a Python object each).
  m.def(
      "read_file",
      [](const nb::bytes& path, const std::vector<int64_t>& offsets, const std::vector<MutBytes>& buffers,
         const std::vector<int64_t>& crc_index, int64_t chunk_bytes, MutInt64 crc_out, int threads, bool direct,
         int dir_fd, int64_t expect_size) {
        if (offsets.size() != buffers.size() || crc_index.size() != buffers.size())
          throw std::invalid_argument("got " + std::to_string(offsets.size()) + " offsets, " +
                                      std::to_string(buffers.size()) + " buffers and " +
                                      std::to_string(crc_index.size()) + " CRC indices; they must match");
        const size_t chunk = check_chunk(chunk_bytes, crc_out);
        std::vector<io::ReadPiece> pieces;
        pieces.reserve(buffers.size());
        for (size_t i = 0; i < buffers.size(); ++i) {
          check_piece(buffers[i], offsets[i], i);
          const size_t size = buffers[i].shape(0);
          check_slots(crc_index[i], size, chunk, crc_out, i);
          pieces.push_back({static_cast<uint64_t>(offsets[i]), buffers[i].data(), size, crc_index[i]});
        }
        return run_read(path, pieces, chunk, crc_out, threads, direct, dir_fd, expect_size);
      },
      "path"_a, "offsets"_a, "buffers"_a.noconvert(), "crc_index"_a, "chunk_bytes"_a, "crc_out"_a.noconvert(),
      "threads"_a = 0, "direct"_a = false, "dir_fd"_a = -1, "expect_size"_a = -1,
      "Read pieces in parallel (O_DIRECT for aligned middles), optionally CRC32C each chunk (CRC "
      "index -2: the piece must be all zero); path relative to dir_fd when >= 0; expect_size >= 0: "
      "only a regular file of that size, never through a symlink. Returns (bytes read, bytes via "
      "O_DIRECT, lowest file offset of a nonzero byte in a must-be-zero piece or -1, bytes O_DIRECT "
      "would have read but the page cache held and gave).");
  m.def(
      "read_spans",
      [](const nb::bytes& path, MutBytes buffer, Int64s file_offsets, Int64s buffer_offsets, Int64s lengths,
         Int64s crc_index, int64_t chunk_bytes, MutInt64 crc_out, int threads, bool direct, int dir_fd,
         int64_t expect_size) {
        require_dense(buffer, "buffer");
        const size_t n = file_offsets.shape(0);
        if (buffer_offsets.shape(0) != n || lengths.shape(0) != n || crc_index.shape(0) != n)
          throw std::invalid_argument("file_offsets, buffer_offsets, lengths and crc_index must have one entry per span");
        const size_t chunk = check_chunk(chunk_bytes, crc_out);
        const uint64_t cap = buffer.shape(0);
        std::vector<io::ReadPiece> pieces;
        pieces.reserve(n);
        for (size_t i = 0; i < n; ++i) {
          const int64_t off = file_offsets(i), at = buffer_offsets(i), len = lengths(i);
          if (off < 0 || at < 0 || len < 0 || static_cast<uint64_t>(at) + static_cast<uint64_t>(len) > cap)
            throw std::invalid_argument("span " + std::to_string(i) + " (file offset " + std::to_string(off) +
                                        ", buffer offset " + std::to_string(at) + ", length " +
                                        std::to_string(len) + ") lies outside the buffer of " +
                                        std::to_string(cap) + " bytes or is negative");
          check_slots(crc_index(i), static_cast<size_t>(len), chunk, crc_out, i);
          pieces.push_back({static_cast<uint64_t>(off), buffer.data() + at, static_cast<size_t>(len), crc_index(i)});
        }
        return run_read(path, pieces, chunk, crc_out, threads, direct, dir_fd, expect_size);
      },
      "path"_a, "buffer"_a.noconvert(), "file_offsets"_a, "buffer_offsets"_a, "lengths"_a, "crc_index"_a,
      "chunk_bytes"_a, "crc_out"_a.noconvert(), "threads"_a = 0, "direct"_a = false, "dir_fd"_a = -1,
      "expect_size"_a = -1,
      "read_file for spans of one buffer given as int64 arrays (file offset, buffer offset, length, "
      "CRC index); spans adjacent in the file and the buffer are read by one pread. Same returns.");

  // ---- CUDA runtime ----
  m.def(
      "cuda_load",
      [](bool disabled, const std::string& library) {
        const cuda::Status* s;
        {
          nb::gil_scoped_release release;  // cudaGetDeviceCount may take a while (driver init)
          s = &cuda::load(disabled, library);
        }
        return status_dict(*s);
      },
      "disabled"_a, "library"_a, "Load the CUDA runtime once; returns its status dict.");
  m.def("cuda_status", [] { return status_dict(cuda::status()); }, "Status of the CUDA runtime.");
  m.def(
      "cuda_get_device",
      [] {
        int device = -1;
        std::string err;
        return cuda::get_device(&device, &err) == 0 ? device : -1;
      },
      "The calling thread's current CUDA device (cudaGetDevice); -1 without a usable runtime.");

  // ---- host arena ----
  m.attr("PIN_CHUNK_BYTES") = arena::kPinChunk;
  nb::class_<PyHostBuffer>(m, "HostBuffer", "Page-aligned host memory, optionally pinned.")
      .def(nb::init<size_t, size_t>(), "nbytes"_a, "alignment"_a = 4096)
      .def_prop_ro("nbytes", &arena::HostBuffer::size)
      .def_prop_ro("data_ptr", [](const PyHostBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_prop_ro("pinning", &arena::HostBuffer::pinning)
      .def_prop_ro("pinned_bytes", &arena::HostBuffer::pinned_bytes)
      .def(
          "array",
          [](nb::object self) {
            auto& b = nb::cast<PyHostBuffer&>(self);
            // The array (and any torch tensor made from it) keeps this HostBuffer alive.
            return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(b.data(), {b.size()}, self);
          },
          "The whole buffer as a writable 1-D uint8 numpy array (no copy).")
      .def("start_pinning", &arena::HostBuffer::start_pinning, "device"_a = -1,
           "Register with cudaHostRegister in PIN_CHUNK_BYTES chunks, in a background thread, on "
           "`device` (< 0: the calling thread's current device).")
      .def("wait_pinned", &arena::HostBuffer::wait_pinned, "timeout_s"_a = -1.0,
           nb::call_guard<nb::gil_scoped_release>(), "Wait for pinning; True when done.")
      .def("start_faulting", &arena::HostBuffer::start_faulting, "lock"_a, "chunk"_a,
           "populate"_a = true,
           "Fault in (and with `lock`, mlock) the buffer in `chunk`-byte chunks from the end, in a "
           "background thread, without the GIL; contents are kept.")
      .def("wait_faulted", &arena::HostBuffer::wait_faulted, "timeout_s"_a = -1.0,
           nb::call_guard<nb::gil_scoped_release>(), "Wait for faulting; True when done.")
      .def("unlock", &arena::HostBuffer::unlock, nb::call_guard<nb::gil_scoped_release>(),
           "Stop faulting and munlock what was locked.")
      .def_prop_ro("faulting", &arena::HostBuffer::faulting)
      .def_prop_ro("ready_from", &arena::HostBuffer::ready_from)
      .def_prop_ro("locked", &arena::HostBuffer::locked)
      .def(
          "copy_in",
          [](PyHostBuffer& b, const std::vector<Bytes>& sources, const std::vector<int64_t>& offsets,
             int threads, int64_t chunk_bytes, std::optional<std::vector<int64_t>> crc_index,
             std::optional<MutInt64> crc_out) {
            std::vector<const uint8_t*> ptrs;
            std::vector<size_t> sizes;
            std::vector<uint64_t> offs;
            for (size_t i = 0; i < sources.size(); ++i) {
              require_dense(sources[i], "each source");
              ptrs.push_back(sources[i].data());
              sizes.push_back(sources[i].shape(0));
            }
            for (int64_t o : offsets) {
              if (o < 0) throw std::invalid_argument("copy_in: negative offset " + std::to_string(o));
              offs.push_back(static_cast<uint64_t>(o));
            }
            if (crc_index.has_value() != crc_out.has_value() || (crc_out && chunk_bytes <= 0))
              throw std::invalid_argument("copy_in: crc_index, crc_out and chunk_bytes > 0 go together");
            if (crc_out) {
              const size_t chunk = check_chunk(chunk_bytes, *crc_out);
              if (crc_index->size() != sources.size())
                throw std::invalid_argument("copy_in: got " + std::to_string(sources.size()) + " sources but " +
                                            std::to_string(crc_index->size()) + " CRC indices");
              for (size_t i = 0; i < sources.size(); ++i) {
                if ((*crc_index)[i] == io::kMustBeZero)
                  throw std::invalid_argument("copy_in: CRC index -2 (must be zero) is for reads only");
                check_slots((*crc_index)[i], sizes[i], chunk, *crc_out, i);
              }
              nb::gil_scoped_release release;
              b.copy_in(ptrs, sizes, offs, threads, chunk, &*crc_index, crc_out->data());
              return;
            }
            nb::gil_scoped_release release;
            b.copy_in(ptrs, sizes, offs, threads);
          },
          "sources"_a.noconvert(), "offsets"_a, "threads"_a = 0, "chunk_bytes"_a = 0,
          "crc_index"_a = nb::none(), "crc_out"_a.noconvert() = nb::none(),
          "Copy each 1-D uint8 source into the buffer at its offset, in parallel.\n\nWith crc_index "
          "and crc_out, also each chunk's CRC32C of the copied bytes:\nsource i's chunk k goes to "
          "crc_out[crc_index[i] + k] (index -1: none).")
      .def(
          "enqueue_d2h",
          [](PyHostBuffer& b, const DeviceCopies& copies, uintptr_t stream) {
            static_assert(sizeof(arena::HostBuffer::DeviceCopy) == 3 * sizeof(uint64_t));
            const auto* rows = reinterpret_cast<const arena::HostBuffer::DeviceCopy*>(copies.data());
            nb::gil_scoped_release release;
            return b.enqueue_d2h(rows, copies.shape(0), stream);
          },
          "copies"_a.noconvert(), "stream"_a,
          "Enqueue cudaMemcpyAsync device-to-host of every row (device address, bytes, buffer "
          "offset) of a C-contiguous (n, 3) uint64 array on `stream`, cut at PIN_CHUNK_BYTES; "
          "returns the number of cudaMemcpyAsync calls.");

  // ---- the caching allocator simulator's plain case (gpumem/allocator/native.py) ----
  using alloc::PlainSim;
  m.def(
      "alloc_sim",
      [](int64_t max_split, int64_t max_non_split_rounding, int64_t large_segment,
         const std::vector<int64_t>& divisions) {
        if (divisions.size() != 16) throw std::invalid_argument("alloc_sim: 16 divisions");
        alloc::Conf c;
        c.max_split = max_split;
        c.max_non_split_rounding = max_non_split_rounding;
        c.large_segment = large_segment;
        std::copy(divisions.begin(), divisions.end(), c.divisions.begin());
        return PlainSim(c);
      },
      "max_split"_a, "max_non_split_rounding"_a, "large_segment"_a, "divisions"_a,
      "A caching allocator simulator without expandable segments, capacity or record_stream.");
  nb::class_<PlainSim>(m, "PlainSim", "CachingAllocatorSim's plain case, compiled.")
      .def("malloc", &PlainSim::malloc, "handle"_a, "size"_a, "stream"_a = 0)
      .def(
          "free",
          [](PlainSim& s, int64_t h) {
            try {
              s.free(h);
            } catch (const std::out_of_range& e) {
              throw nb::key_error(e.what());
            }
          },
          "handle"_a)
      .def(
          "take",
          [](PlainSim& s, int64_t size, std::optional<int64_t> handle, int64_t stream) {
            return s.take(size, handle ? *handle : s.next_handle++, stream);
          },
          "size"_a, "handle"_a = nb::none(), "stream"_a = 0,
          "malloc, keeping the requested bytes alive, their peak and the unreleasable peak; "
          "returns the handle (the next of a counter when none is given).")
      .def(
          "give",
          [](PlainSim& s, int64_t h) {
            try {
              s.give(h);
            } catch (const std::out_of_range& e) {
              throw nb::key_error(e.what());
            }
          },
          "handle"_a)
      .def("fork", [](const PlainSim& s) { return PlainSim(s); })
      .def("empty_cache", &PlainSim::empty_cache)
      .def("would_reserve", &PlainSim::would_reserve, "size"_a, "stream"_a = 0)
      .def("largest_free_block", &PlainSim::largest_free_block)
      .def("releasable", &PlainSim::releasable)
      .def("round_size", &PlainSim::round_size, "size"_a)
      .def(
          "segments",
          [](const PlainSim& s) {
            nb::list out;
            for (const auto& r : s.segments())
              out.append(nb::make_tuple(r.address, r.size, r.stream, r.small, r.blocks));
            return out;
          },
          "The segment map by address: (address, size, stream, small, [(size, allocated, "
          "requested)]).")
      .def_ro("reserved", &PlainSim::reserved)
      .def_ro("reserved_peak", &PlainSim::reserved_peak)
      .def_ro("allocated", &PlainSim::allocated)
      .def_ro("allocated_peak", &PlainSim::allocated_peak)
      .def_ro("requested", &PlainSim::requested)
      .def_ro("requested_peak", &PlainSim::requested_peak)
      .def_ro("segments_count", &PlainSim::segments_count)
      .def_ro("num_device_alloc", &PlainSim::num_device_alloc)
      .def_ro("num_device_free", &PlainSim::num_device_free)
      .def_ro("mallocs", &PlainSim::mallocs)
      .def_ro("live", &PlainSim::live)
      .def_ro("peak", &PlainSim::peak)
      .def_ro("pinned", &PlainSim::pinned);

  // ---- manifests ----
  m.def(
      "find_tensors",
      [](nb::bytes data) { return table::find_tensors(data.c_str(), data.size()); },
      "data"_a, "(start, stop) of the top-level \"tensors\" value of a JSON object, or None.");
  m.def(
      "build_tensors",
      [](nb::bytes data, size_t start, size_t stop, int64_t chunk, int64_t align, nb::dict files,
         nb::dict itemsize, std::vector<int64_t> mesh_ndims, bool sharded, nb::handle entry_type,
         nb::handle box_type) {
        if (start > stop || stop > data.size()) throw std::invalid_argument("bad byte range");
        return table::build_tensors(data.c_str() + start, stop - start, chunk, align, files,
                                    itemsize, std::move(mesh_ndims), sharded, entry_type,
                                    box_type);
      },
      "data"_a, "start"_a, "stop"_a, "chunk"_a, "align"_a, "files"_a, "itemsize"_a,
      "mesh_ndims"_a, "sharded"_a, "entry_type"_a, "box_type"_a,
      "(format.TensorEntry list, extent rows, chunk CRCs as int64 bytes) of the JSON tensor "
      "table data[start:stop], each rule of "
      "format._parse_tensor checked; None where the Python decoder must decide.");
}
