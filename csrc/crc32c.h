// CRC32C (Castagnoli, reflected polynomial 0x82F63B78, init and xorout 0xFFFFFFFF): the checksum
// google-crc32c, iSCSI and ext4 compute. Hardware instructions where the CPU has them (SSE4.2 on
// x86-64, the CRC extension on ARMv8), a slicing-by-8 table otherwise; identical answers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gpumem::crc32c {

enum class Impl { Auto, Table, Hardware };

// "sse4.2", "armv8-crc" or "table": what Impl::Auto uses on this CPU.
const char* hardware_name();
// "vpclmulqdq", "pclmulqdq" or "none": how the hardware path folds long buffers on this CPU.
const char* fold_name();
bool has_hardware();

// Extends a finalized running CRC (0 for a fresh one) by n bytes: extend(extend(0, a), b) == crc(a + b).
// Throws std::invalid_argument for Impl::Hardware on a CPU without the instructions.
uint32_t extend(uint32_t crc, const uint8_t* data, size_t n, Impl impl = Impl::Auto);

// Same result, with large buffers split into one part per thread and the parts combined.
uint32_t extend_parallel(uint32_t crc, const uint8_t* data, size_t n, int threads, Impl impl = Impl::Auto);

// CRC of a + b from crc_a = crc(a), crc_b = crc(b) and len_b = len(b), in O(log len_b).
uint32_t combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// out[i] = crc of bytes [i * chunk, min((i + 1) * chunk, n)); ceil(n / chunk) entries.
void chunks(const uint8_t* data, size_t n, size_t chunk, int64_t* out, int threads,
            Impl impl = Impl::Auto);

}  // namespace gpumem::crc32c
