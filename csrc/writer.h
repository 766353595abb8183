// Parallel file writes: many (file offset, buffer) pieces written with pwrite on the thread pool,
// fdatasync of the file and fsync of its directory, optional O_DIRECT. Every failure becomes a
// SysError (errno + path) that the bindings turn into OSError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fileio.h"

namespace gpumem::io {

struct Piece {
  uint64_t offset;
  const uint8_t* data;
  size_t size;
};

struct WriteOptions {
  int64_t size = -1;       // >= 0: ftruncate the file to this size after writing
  int threads = 0;         // <= 0: num_threads()
  bool fsync = true;       // fdatasync before returning
  bool direct = false;     // O_DIRECT for the 4096-aligned parts (see write_file)
  int dir_fd = kCwd;       // the path is relative to this directory
  bool exclusive = false;  // create a new file: never an existing one, never through a symlink
};

struct WriteResult {
  uint64_t bytes = 0;         // total bytes written
  uint64_t direct_bytes = 0;  // of which through O_DIRECT
};

// Creates/truncates `path` (with exclusive: creates it, O_EXCL | O_NOFOLLOW) and writes every
// piece. With direct, the part of a piece whose file offset, buffer address and length are
// multiples of 4096 goes through an O_DIRECT descriptor and the unaligned head/tail through the
// page cache; if the file system refuses O_DIRECT (EINVAL, as tmpfs does) everything is written
// buffered. Short writes are continued, EINTR retried.
WriteResult write_file(const std::string& path, const std::vector<Piece>& pieces,
                       const WriteOptions& opts);

// fsync a directory, making a rename or file creation inside it durable.
void fsync_dir(const std::string& path);

}  // namespace gpumem::io
