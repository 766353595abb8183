// Parallel file I/O: many (file offset, buffer) pieces written with pwrite on the thread pool,
// fdatasync of the file and fsync of its directory, optional O_DIRECT; parallel pread back.
// Every failure becomes a SysError (errno + path) that the bindings turn into OSError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpumem::io {

// errno, the path it concerns, and what we were doing ("pwrite of 8388608 bytes at offset 0").
class SysError : public std::runtime_error {
 public:
  SysError(int err, std::string path, const std::string& what);
  int err;
  std::string path;
};

struct Piece {
  uint64_t offset;
  const uint8_t* data;
  size_t size;
};

struct WriteOptions {
  int64_t size = -1;    // >= 0: ftruncate the file to this size after writing
  int threads = 0;      // <= 0: num_threads()
  bool fsync = true;    // fdatasync before returning
  bool direct = false;  // O_DIRECT for the 4096-aligned parts (see write_file)
};

struct WriteResult {
  uint64_t bytes = 0;         // total bytes written
  uint64_t direct_bytes = 0;  // of which through O_DIRECT
};

// Creates/truncates `path` and writes every piece. With direct, the part of a piece whose file
// offset, buffer address and length are multiples of 4096 goes through an O_DIRECT descriptor and
// the unaligned head/tail through the page cache; if the file system refuses O_DIRECT (EINVAL, as
// tmpfs does) everything is written buffered. Short writes are continued, EINTR retried.
WriteResult write_file(const std::string& path, const std::vector<Piece>& pieces,
                       const WriteOptions& opts);

// fsync a directory, making a rename or file creation inside it durable.
void fsync_dir(const std::string& path);

// Reads exactly `size` bytes at `offset` into `out`; EOF before that is an error (EIO).
uint64_t read_into(const std::string& path, uint64_t offset, uint8_t* out, size_t size, int threads);

struct ReadPiece {
  uint64_t offset;     // in the file
  uint8_t* data;       // destination
  size_t size;
  int64_t crc_index;   // first slot of this piece's chunk CRCs in ReadOptions::crc_out; < 0: none
};

struct ReadOptions {
  int threads = 0;              // <= 0: num_threads(); reads want more than the cores (queue depth)
  bool direct = false;          // O_DIRECT for the 4096-aligned middles (see read_file)
  size_t chunk = 0;             // > 0: CRC32C of every chunk of a piece, relative to the piece start
  int64_t* crc_out = nullptr;   // where the chunk CRCs go (bounds checked by the caller)
};

struct ReadResult {
  uint64_t bytes = 0;
  uint64_t direct_bytes = 0;  // of which through O_DIRECT
};

// Reads every piece of `path` on the thread pool, as write_file writes them: with direct, the part
// whose file offset and buffer address are equally aligned to 4096 goes through an O_DIRECT
// descriptor (no page-cache copy, many requests in flight), the rest through the page cache;
// EINVAL from O_DIRECT (tmpfs) falls back to buffered reads. With a chunk size each piece's chunk
// CRC32Cs are computed right after its bytes land, while they are still in cache. A file shorter
// than a piece is an error (EIO); EINTR is retried and short reads continued.
ReadResult read_file(const std::string& path, const std::vector<ReadPiece>& pieces, const ReadOptions& opts);

}  // namespace gpumem::io
