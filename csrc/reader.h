// Parallel file reads: many (file offset, buffer) pieces read with pread on the thread pool, each
// chunk's CRC32C computed by the thread that read it, optional O_DIRECT. Every failure becomes a
// SysError (errno + path) that the bindings turn into OSError; a file that is not what the caller
// expects (a symlink, a FIFO, a device, another size) is an UnexpectedFile, never read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fileio.h"

namespace gpumem::io {

// Reads exactly `size` bytes at `offset` into `out`; EOF before that is an error (EIO).
uint64_t read_into(const std::string& path, uint64_t offset, uint8_t* out, size_t size, int threads);

constexpr int64_t kNoCheck = -1;   // ReadPiece::crc_index: the bytes are only read
constexpr int64_t kMustBeZero = -2;  // ReadPiece::crc_index: every byte must be 0 (padding)

struct ReadPiece {
  uint64_t offset;     // in the file
  uint8_t* data;       // destination
  size_t size;
  int64_t crc_index;   // first slot of this piece's chunk CRCs in ReadOptions::crc_out, or
                       // kNoCheck, or kMustBeZero
};

struct ReadOptions {
  int threads = 0;              // <= 0: num_threads(); reads want more than the cores (queue depth)
  bool direct = false;          // O_DIRECT for the 4096-aligned middles (see read_file)
  size_t chunk = 0;             // > 0: CRC32C of every chunk of a piece, relative to the piece start
  int64_t* crc_out = nullptr;   // where the chunk CRCs go (bounds checked by the caller)
  int dir_fd = kCwd;            // the path is relative to this directory
  int64_t expect_size = -1;     // >= 0: a regular file of exactly this size (see open_regular)
};

struct ReadResult {
  uint64_t bytes = 0;
  uint64_t direct_bytes = 0;  // of which through O_DIRECT
  uint64_t cached_bytes = 0;  // of which O_DIRECT would have read but the page cache held
  int64_t nonzero_at = -1;    // lowest file offset of a nonzero byte in a kMustBeZero piece
};

// Reads every piece of `path` on the thread pool, as write_file writes them: with direct, the part
// whose file offset and buffer address are equally aligned to 4096 goes through an O_DIRECT
// descriptor (no page-cache copy, many requests in flight), the rest through the page cache;
// EINVAL from O_DIRECT (tmpfs) falls back to buffered reads. A middle the page cache holds whole
// (cachestat, Linux 6.5+) is copied from it instead (cached_bytes). Fresh destinations of the
// O_DIRECT middles are mapped in (MADV_POPULATE_WRITE) by a thread ahead of the readers once they
// total kPrefaultAhead bytes, so zeroing fresh pages overlaps the reads. With a chunk size each piece's chunk
// CRC32Cs are computed right after its bytes land, while they are still in cache. A file shorter
// than a piece is an error (EIO); EINTR is retried and short reads continued. With expect_size
// the file is opened only if it is a regular file of that size (open_regular): no symlink is
// followed and no FIFO or device is opened, so the call cannot block or read outside.
// Pieces that follow each other in the file and in memory (sorted by offset) are read by one
// pread per task, up to kSplit bytes: a hundred thousand tiny extents cost a few dozen calls,
// each piece still checked on its own (its chunk CRCs, or that it is all zero).
ReadResult read_file(const std::string& path, const std::vector<ReadPiece>& pieces, const ReadOptions& opts);

}  // namespace gpumem::io
