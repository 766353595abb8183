// CRC32C: hardware paths with three interleaved streams, carry-less-multiply folding on x86-64,
// slicing-by-8 fallback, GF(2) combine.
//
// One crc32 instruction has a latency of ~3 cycles but a throughput of 1 per cycle, so a single
// dependency chain runs at a third of the possible speed. The hardware path therefore runs three
// independent streams over adjacent blocks and merges them by "shifting" a CRC over the length of
// a block with 4 table lookups (zero-operator tables, as in Mark Adler's crc32c.c). That still
// caps it at 8 bytes a cycle; where the CPU has PCLMULQDQ, long buffers are folded instead (Intel,
// "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", 2009): eight 128-bit
// accumulators, each multiplied forward by x^1024 mod P as the next 128 bytes arrive, ~2x the
// crc32 instruction's rate, so a checksum of bytes just copied costs a fraction of the copy.
#include "crc32c.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "parallel.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <nmmintrin.h>
#include <wmmintrin.h>
#define GPUMEM_CRC_HW 1
#if defined(__clang__) && __clang_major__ >= 14
#define GPUMEM_CRC_TARGET __attribute__((target("sse4.2,crc32")))  // clang split crc32 out
#define GPUMEM_CLMUL_TARGET __attribute__((target("sse4.2,crc32,pclmul")))
#define GPUMEM_VCLMUL_TARGET __attribute__((target("sse4.2,crc32,pclmul,avx2,vpclmulqdq")))
#else
#define GPUMEM_CRC_TARGET __attribute__((target("sse4.2")))
#define GPUMEM_CLMUL_TARGET __attribute__((target("sse4.2,pclmul")))
#define GPUMEM_VCLMUL_TARGET __attribute__((target("sse4.2,pclmul,avx2,vpclmulqdq")))
#endif
#elif defined(__aarch64__)
#include <arm_acle.h>
#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#endif
#define GPUMEM_CRC_HW 1
#if defined(__clang__)
#define GPUMEM_CRC_TARGET __attribute__((target("crc")))
#else
#define GPUMEM_CRC_TARGET __attribute__((target("+crc")))
#endif
#else
#define GPUMEM_CRC_HW 0
#endif

namespace gpumem::crc32c {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

// ---- GF(2) arithmetic modulo the CRC polynomial (reflected bit order, as zlib's crc32_combine) ----

// a * b mod P, where bit 31 is x^0.
uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(2^k) mod P for k < 72: enough for any 64-bit byte count (bit index + 3).
struct PowerTable {
  uint32_t x2n[72];
  PowerTable() {
    uint32_t p = 1u << 30;  // x^1
    x2n[0] = p;
    for (int k = 1; k < 72; ++k) x2n[k] = p = multmodp(p, p);
  }
};
const PowerTable kPowers;

// x^(n * 2^k) mod P.
uint32_t x2nmodp(uint64_t n, unsigned k) {
  uint32_t p = 1u << 31;  // x^0
  while (n) {
    if (n & 1) p = multmodp(kPowers.x2n[k], p);
    n >>= 1;
    ++k;
  }
  return p;
}

// ---- slicing-by-8 table path ----

struct SliceTables {
  uint32_t t[8][256];
  SliceTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
  }
};
const SliceTables kSlice;

// Updates the raw (non-inverted) CRC register.
uint32_t table_update(uint32_t crc, const uint8_t* p, size_t n) {
  const auto& t = kSlice.t;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    --n;
  }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= crc;
    crc = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^
          t[4][(w >> 24) & 0xff] ^ t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^
          t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
#endif
  while (n--) crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return crc;
}

// ---- hardware path ----

#if GPUMEM_CRC_HW
constexpr size_t kLong = 8192;  // bytes per stream in the main loop (3 streams: 24 KiB, in L1)
constexpr size_t kShort = 256;  // bytes per stream for the remainder
constexpr size_t kPrefetch = 1024;  // read ahead in each stream: DRAM latency on a streaming read

// zeros[k][b] = the register after shifting byte b at position k over `len` zero bytes, so that a
// shift of a whole register is 4 lookups (the operator is linear over GF(2)).
struct ZeroTables {
  uint32_t z[4][256];
  explicit ZeroTables(size_t len) {
    const uint32_t op = x2nmodp(len, 3);
    for (uint32_t k = 0; k < 4; ++k)
      for (uint32_t b = 0; b < 256; ++b) z[k][b] = multmodp(op, b << (8 * k));
  }
  uint32_t shift(uint32_t crc) const {
    return z[0][crc & 0xff] ^ z[1][(crc >> 8) & 0xff] ^ z[2][(crc >> 16) & 0xff] ^ z[3][crc >> 24];
  }
};
const ZeroTables kLongZeros(kLong);
const ZeroTables kShortZeros(kShort);

#if defined(__x86_64__) || defined(_M_X64)
GPUMEM_CRC_TARGET inline uint32_t hw_u8(uint32_t crc, uint8_t v) { return _mm_crc32_u8(crc, v); }
GPUMEM_CRC_TARGET inline uint32_t hw_u64(uint32_t crc, const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return static_cast<uint32_t>(_mm_crc32_u64(crc, v));
}
bool detect_hardware() {
  __builtin_cpu_init();  // we run during static initialization, maybe before libgcc's own
  return __builtin_cpu_supports("sse4.2");
}
constexpr const char* kHardwareName = "sse4.2";
#else
GPUMEM_CRC_TARGET inline uint32_t hw_u8(uint32_t crc, uint8_t v) { return __crc32cb(crc, v); }
GPUMEM_CRC_TARGET inline uint32_t hw_u64(uint32_t crc, const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return __crc32cd(crc, v);
}
#if defined(__linux__)
bool detect_hardware() { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
#else
bool detect_hardware() { return false; }  // no portable query: stay on the table path
#endif
constexpr const char* kHardwareName = "armv8-crc";
#endif

// Three streams over blocks of `block` bytes while at least 3 blocks remain; advances *pp / *pn.
// Locals only inside the loop: through the pointers the compiler would store p every iteration.
GPUMEM_CRC_TARGET inline uint32_t hw_three_way(uint32_t crc0, const uint8_t** pp, size_t* pn,
                                               size_t block, const ZeroTables& zeros) {
  const uint8_t* p = *pp;
  size_t n = *pn;
  while (n >= 3 * block) {
    uint32_t crc1 = 0, crc2 = 0;
    const uint8_t* end = p + block;
    do {  // block is a multiple of 64: one cache line per stream per iteration
      __builtin_prefetch(p + kPrefetch);
      __builtin_prefetch(p + block + kPrefetch);
      __builtin_prefetch(p + 2 * block + kPrefetch);
      for (int k = 0; k < 64; k += 8) {
        crc0 = hw_u64(crc0, p + k);
        crc1 = hw_u64(crc1, p + block + k);
        crc2 = hw_u64(crc2, p + 2 * block + k);
      }
      p += 64;
    } while (p < end);
    crc0 = zeros.shift(crc0) ^ crc1;
    crc0 = zeros.shift(crc0) ^ crc2;
    p += 2 * block;
    n -= 3 * block;
  }
  *pp = p;
  *pn = n;
  return crc0;
}

#if defined(__x86_64__) || defined(_M_X64)
// ---- carry-less-multiply folding (x86-64 with PCLMULQDQ) ----
//
// Conventions: a 16-byte block loaded little-endian is a polynomial whose bit t is the
// coefficient of x^(127-t) (reflected order: the first byte's lowest bit is the highest term).
// Its low lane L0 holds the high half, so block = L0 * x^64 + L1. Folding a block forward by D
// bits replaces it by L0 * (x^(64+D) mod P) + L1 * (x^D mod P), congruent mod P and at most 96
// bits long, XORed into the block D bits later; the CRC of the message is then the CRC of the
// last 16-byte state, which the crc32 instruction computes. PCLMULQDQ on reflected operands
// yields the product times x, so each constant is x^(n-1) mod P, its reflected 32 bits placed
// in the top half of a 64-bit lane (bit 63 - j holds x^j).
constexpr size_t kFoldMin = 512;  // below this the three-way crc32 path is as fast
constexpr int kFoldLanes = 8;     // accumulators: enough to cover PCLMULQDQ's latency

struct FoldKey {
  uint64_t lo, hi;  // multiplier of lane 0 (x^(64+D-1)) and of lane 1 (x^(D-1))
  explicit FoldKey(uint64_t d)
      : lo(uint64_t(x2nmodp(64 + d - 1, 0)) << 32), hi(uint64_t(x2nmodp(d - 1, 0)) << 32) {}
};
const FoldKey kFold1024(1024);  // one accumulator to itself, 8 blocks on
const FoldKey kFold128(128);    // one block to the next
const FoldKey kFold2048(2048);  // the 256-bit path: one accumulator to itself, 16 blocks on

// GPUMEM_CRC32C_FOLD=none|pclmulqdq caps the folding path below what the CPU has (tests run
// every path on one machine; a user can rule out a suspected miscompile).
bool fold_allowed(const char* level) {
  const char* cap = std::getenv("GPUMEM_CRC32C_FOLD");
  if (cap == nullptr) return true;
  if (std::strcmp(cap, "none") == 0) return false;
  return !(std::strcmp(cap, "pclmulqdq") == 0 && std::strcmp(level, "vpclmulqdq") == 0);
}
bool detect_clmul() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.2") && fold_allowed("pclmulqdq");
}
const bool kHasClmul = detect_clmul();
// VPCLMULQDQ on 256-bit registers (Ice Lake, Zen 3 and later): two blocks per instruction. Not
// the 512-bit form, whose frequency licence on some Xeons would slow the training threads beside.
bool detect_vclmul() {
  __builtin_cpu_init();
  return kHasClmul && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq") &&
         fold_allowed("vpclmulqdq");
}
const bool kHasVclmul = detect_vclmul();

GPUMEM_CLMUL_TARGET inline __m128i fold(__m128i x, __m128i key) {
  return _mm_xor_si128(_mm_clmulepi64_si128(x, key, 0x00), _mm_clmulepi64_si128(x, key, 0x11));
}

GPUMEM_VCLMUL_TARGET inline __m256i fold256(__m256i x, __m256i key) {
  return _mm256_xor_si256(_mm256_clmulepi64_epi128(x, key, 0x00), _mm256_clmulepi64_epi128(x, key, 0x11));
}

// clmul_update's first part on 256-bit registers: folds 256-byte groups while at least two
// remain, then hands the state (as 16 blocks folded into one) back with *pp / *pn advanced.
GPUMEM_VCLMUL_TARGET __m128i vclmul_groups(uint32_t crc, const uint8_t** pp, size_t* pn) {
  const uint8_t* p = *pp;
  size_t n = *pn;
  __m256i y[kFoldLanes];
  for (int i = 0; i < kFoldLanes; ++i) y[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * i));
  y[0] = _mm256_xor_si256(y[0], _mm256_zextsi128_si256(_mm_cvtsi32_si128(static_cast<int>(crc))));
  p += 32 * kFoldLanes;
  n -= 32 * kFoldLanes;
  const __m256i k2048 = _mm256_broadcastsi128_si256(
      _mm_set_epi64x(static_cast<long long>(kFold2048.hi), static_cast<long long>(kFold2048.lo)));
  while (n >= 32 * kFoldLanes) {
    __builtin_prefetch(p + kPrefetch);
    __builtin_prefetch(p + kPrefetch + 64);
    for (int i = 0; i < kFoldLanes; ++i)
      y[i] = _mm256_xor_si256(fold256(y[i], k2048), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * i)));
    p += 32 * kFoldLanes;
    n -= 32 * kFoldLanes;
  }
  const __m128i k128 = _mm_set_epi64x(static_cast<long long>(kFold128.hi), static_cast<long long>(kFold128.lo));
  __m128i acc = _mm256_castsi256_si128(y[0]);
  acc = _mm_xor_si128(fold(acc, k128), _mm256_extracti128_si256(y[0], 1));
  for (int i = 1; i < kFoldLanes; ++i) {
    acc = _mm_xor_si128(fold(acc, k128), _mm256_castsi256_si128(y[i]));
    acc = _mm_xor_si128(fold(acc, k128), _mm256_extracti128_si256(y[i], 1));
  }
  *pp = p;
  *pn = n;
  return acc;
}

// The raw register after [*pp, *pp + *pn), folding whole 16-byte blocks (n >= kFoldMin); leaves
// the last n % 16 bytes in *pp / *pn for the crc32 instruction.
GPUMEM_CLMUL_TARGET uint32_t clmul_update(uint32_t crc, const uint8_t** pp, size_t* pn) {
  const __m128i k128 = _mm_set_epi64x(static_cast<long long>(kFold128.hi), static_cast<long long>(kFold128.lo));
  __m128i acc;
  if (kHasVclmul && *pn >= 2 * 32 * kFoldLanes) {
    acc = vclmul_groups(crc, pp, pn);
  } else {
    const uint8_t* p = *pp;
    size_t n = *pn;
    __m128i x[kFoldLanes];
    for (int i = 0; i < kFoldLanes; ++i) x[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i));
    x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128(static_cast<int>(crc)));  // the register enters the first bytes
    p += 16 * kFoldLanes;
    n -= 16 * kFoldLanes;
    const __m128i k1024 = _mm_set_epi64x(static_cast<long long>(kFold1024.hi), static_cast<long long>(kFold1024.lo));
    while (n >= 16 * kFoldLanes) {
      __builtin_prefetch(p + kPrefetch);
      for (int i = 0; i < kFoldLanes; ++i)
        x[i] = _mm_xor_si128(fold(x[i], k1024), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i)));
      p += 16 * kFoldLanes;
      n -= 16 * kFoldLanes;
    }
    acc = x[0];
    for (int i = 1; i < kFoldLanes; ++i) acc = _mm_xor_si128(fold(acc, k128), x[i]);
    *pp = p;
    *pn = n;
  }
  const uint8_t* p = *pp;
  size_t n = *pn;
  while (n >= 16) {
    acc = _mm_xor_si128(fold(acc, k128), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    p += 16;
    n -= 16;
  }
  alignas(16) uint8_t last[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(last), acc);
  *pp = p;
  *pn = n;
  return hw_u64(hw_u64(0, last), last + 8);  // the CRC of the 16-byte state, from a zero register
}
#endif

GPUMEM_CRC_TARGET uint32_t hw_update(uint32_t crc, const uint8_t* p, size_t n) {
#if defined(__x86_64__) || defined(_M_X64)
  if (n >= kFoldMin && kHasClmul) crc = clmul_update(crc, &p, &n);
#endif
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = hw_u8(crc, *p++);
    --n;
  }
  crc = hw_three_way(crc, &p, &n, kLong, kLongZeros);
  crc = hw_three_way(crc, &p, &n, kShort, kShortZeros);
  while (n >= 8) {
    crc = hw_u64(crc, p);
    p += 8;
    n -= 8;
  }
  while (n--) crc = hw_u8(crc, *p++);
  return crc;
}

const bool kHasHardware = detect_hardware();
#else
const bool kHasHardware = false;
constexpr const char* kHardwareName = "table";
#endif

uint32_t update(uint32_t raw, const uint8_t* p, size_t n, Impl impl) {
  if (impl == Impl::Hardware && !kHasHardware)
    throw std::invalid_argument(
        "impl='hardware' requested but this CPU has no CRC32C instructions; use impl='auto'");
#if GPUMEM_CRC_HW
  if (impl != Impl::Table && kHasHardware) return hw_update(raw, p, n);
#endif
  return table_update(raw, p, n);
}

constexpr size_t kMinPerThread = size_t(1) << 20;  // below ~1 MiB a thread costs more than it saves
constexpr size_t kPartAlign = 4096;

}  // namespace

const char* hardware_name() { return kHasHardware ? kHardwareName : "table"; }

const char* fold_name() {
#if defined(__x86_64__) || defined(_M_X64)
  if (kHasHardware && kHasVclmul) return "vpclmulqdq";
  if (kHasHardware && kHasClmul) return "pclmulqdq";
#endif
  return "none";
}
bool has_hardware() { return kHasHardware; }

uint32_t extend(uint32_t crc, const uint8_t* data, size_t n, Impl impl) {
  return ~update(~crc, data, n, impl);
}

uint32_t combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return multmodp(x2nmodp(len_b, 3), crc_a) ^ crc_b;
}

uint32_t extend_parallel(uint32_t crc, const uint8_t* data, size_t n, int threads, Impl impl) {
  if (threads <= 0) threads = num_threads();
  size_t parts = n / kMinPerThread;
  if (parts > static_cast<size_t>(threads)) parts = static_cast<size_t>(threads);
  if (parts <= 1) return extend(crc, data, n, impl);
  // Equal parts rounded to pages; the last part takes the remainder.
  const size_t step = (n / parts + kPartAlign - 1) / kPartAlign * kPartAlign;
  parts = (n + step - 1) / step;
  std::vector<uint32_t> crcs(parts);
  parallel_for(
      parts,
      [&](size_t i) {
        const size_t begin = i * step;
        const size_t len = (i + 1 == parts) ? n - begin : step;
        crcs[i] = extend(i == 0 ? crc : 0, data + begin, len, impl);
      },
      threads);
  uint32_t out = crcs[0];
  for (size_t i = 1; i < parts; ++i) {
    const size_t len = (i + 1 == parts) ? n - i * step : step;
    out = combine(out, crcs[i], len);
  }
  return out;
}

void chunks(const uint8_t* data, size_t n, size_t chunk, int64_t* out, int threads, Impl impl) {
  if (chunk == 0) throw std::invalid_argument("chunk_bytes must be positive");
  if (threads <= 0) threads = num_threads();
  const size_t count = (n + chunk - 1) / chunk;
  if (count == 0) return;
  auto one = [&](size_t i, int inner_threads) {
    const size_t begin = i * chunk;
    const size_t len = (n - begin < chunk) ? n - begin : chunk;
    out[i] = static_cast<int64_t>(extend_parallel(0, data + begin, len, inner_threads, impl));
  };
  if (count < static_cast<size_t>(threads) && chunk >= 2 * kMinPerThread) {
    // Few big chunks: parallelism inside each chunk keeps every thread busy.
    for (size_t i = 0; i < count; ++i) one(i, threads);
    return;
  }
  // Many chunks: each task takes a run of chunks worth about kMinPerThread bytes.
  const size_t per_task = chunk >= kMinPerThread ? 1 : kMinPerThread / chunk;
  const size_t tasks = (count + per_task - 1) / per_task;
  parallel_for(
      tasks,
      [&](size_t t) {
        const size_t end = (t + 1) * per_task < count ? (t + 1) * per_task : count;
        for (size_t i = t * per_task; i < end; ++i) one(i, 1);
      },
      threads);
}

}  // namespace gpumem::crc32c
