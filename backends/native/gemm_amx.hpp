// The bfloat16 GEMM on Intel's AMX tiles (AMX-TILE + AMX-BF16: Sapphire Rapids and later):
//
//     C (float32) = alpha * op(A) op(B) + beta * C
//
// with the same meaning as gemm_bf16.hpp's product: A, B and C float32 in memory, every
// element of op(A) and op(B) rounded to bfloat16 (nearest even, bit for bit as round())
// while it is packed, the products summed in float32. Single-threaded, called from the
// engine's thread teams on the same panels as the other kernels.
//
// The instruction. TDPBF16PS multiplies a 16 x 32 bfloat16 tile of A (16 rows of 16 pairs
// of K, 64 bytes a row) by a 16 x 16 tile of B pairs (16 rows, one per pair of K, of 16
// columns: B in the same pair-interleaved layout as VDPBF16PS reads, so B's panels are
// gemm_bf16.hpp's [panel][pair][NR] words, with the pairs of each panel padded to a
// multiple of 16) into a 16 x 16 float32 tile: 16 x 16 x 32 multiply-adds, 1024 FLOPs a
// cycle on one core where VDPBF16PS does 64. A is packed row-major by pairs ([row][pair]
// words, rows padded to 16, pairs to 16). A C block of 32 x 32 holds four accumulator
// tiles against two A and two B tiles (eight tiles in all, the architecture's number),
// so each tile loaded feeds two products.
//
// Blocking: KQ pairs of K per pass (a B panel's block of KQ x NR words, 32 KiB, in L1),
// every row of A against each panel (A's block of M x KQ words in L2). A C tile is
// written once per pass: straight from the accumulator where it is whole and alpha is 1
// (and, after the first pass or where beta is 1, the accumulator starts from C), else
// through a 16 x 16 buffer with alpha and beta applied and the rows and columns past C's
// edge left alone.
//
// Who may run it. The CPU must list AMX-BF16 and AMX-TILE (CPUID leaf 7), the OS must
// enable the tile state (XCR0 bits 17 and 18), and Linux (5.16 and later) must grant this
// process the tile data (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once
// per process). The tiles are configured (LDTILECFG) at the start of every call, since
// another library on the same thread may have configured them otherwise, and released
// (TILERELEASE) at its end, which leaves no tile state for the OS to save between calls.
// The instructions are written as inline assembly with a "memory" clobber (GCC's own
// tile macros declare none, so the compiler could move the packing's stores past a tile
// load); the build defines RNN_AMX_ASM where its assembler knows them (CMakeLists.txt),
// and without it this file compiles to "not available".
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gemm_bf16.hpp"

#if defined(RNN_BF16_X86) && defined(__linux__) && defined(__x86_64__) && defined(RNN_AMX_ASM)
#define RNN_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace rnn {
namespace amx {

constexpr int TR = 16;   // rows of a tile (of A and of C)
constexpr int TP = 16;   // pairs of K in a tile of A (64 bytes a row) and rows of a tile of B
constexpr int KQ = 256;  // pairs of K per pass (a B panel block of KQ x NR words: 32 KiB)
constexpr int MQ = 512;  // rows of A per block (MQ x KQ words: 512 KiB, in L2)
// The panel width of a packed B: gemm_bf16.hpp's NR, tagged so that the thread's pack cache
// (packs.hpp) never hands this layout (pairs padded to TP) to the other kernels, or theirs here.
constexpr int kPanelTag = -bf16::NR;
static_assert(bf16::NR == 2 * TR, "a B panel holds two tiles' columns");

inline std::size_t pairs_padded(int K) { return bf16::round_up((std::size_t)(K + 1) / 2, TP); }

// ---- who may run it --------------------------------------------------------------------

#ifdef RNN_AMX
constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureTileData = 18;

// The CPU lists AMX-BF16 and AMX-TILE and the OS has switched the tile state on.
inline bool cpu_has_amx_bf16() {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;  // AMX-BF16, AMX-TILE
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return false;  // OSXSAVE
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((lo >> 17) & 3u) == 3u;  // XTILECFG and XTILEDATA
}

// Ask Linux once for the tile data (it refuses a process that has not asked: SIGILL at the
// first tile instruction); true where it is granted.
inline bool permission() {
    static const bool granted = [] {
        if (!cpu_has_amx_bf16()) return false;
        unsigned long long bits = 0;
        if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) != 0) return false;
        if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bits) != 0) return false;
        return ((bits >> kXfeatureTileData) & 1ull) != 0;
    }();
    return granted;
}
#else
inline bool cpu_has_amx_bf16() { return false; }
inline bool permission() { return false; }
#endif

// Whether this process can run the AMX kernel.
inline bool available() { return permission(); }

// Why not, in words ("" where it can).
inline const char* why_not() {
#ifdef RNN_AMX
    if (!cpu_has_amx_bf16()) return "this CPU has no AMX-BF16 (or the OS has not enabled the tile state)";
    if (!permission()) return "the kernel did not grant the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+)";
    return "";
#else
    return "this build has no AMX kernel (x86-64 Linux with an assembler that knows the AMX instructions)";
#endif
}

#ifdef RNN_AMX
// ---- the instructions ---------------------------------------------------------------------

struct alignas(64) TileConfig {
    std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
    std::uint16_t colsb[16] = {};
    std::uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes: tmm0-3 the accumulators, tmm4-5 A, tmm6-7 B.
inline const TileConfig& tile_config() {
    static const TileConfig cfg = [] {
        TileConfig c;
        for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = TR;
        return c;
    }();
    return cfg;
}

#define RNN_AMX_LOAD(t, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void*)(base)), "r"((long)(stride)) : "memory")
#define RNN_AMX_STORE(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void*)(base)), "r"((long)(stride)) : "memory")
#define RNN_AMX_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define RNN_AMX_DP(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

// The tiles configured on this thread for one call, and released at its end.
struct Tiles {
    Tiles() { __asm__ volatile("ldtilecfg %0" ::"m"(tile_config()) : "memory"); }
    ~Tiles() { __asm__ volatile("tilerelease" ::: "memory"); }
    Tiles(const Tiles&) = delete;
    Tiles& operator=(const Tiles&) = delete;
};

// ---- packing ----------------------------------------------------------------------------

// 32 bfloat16 bits (16-bit lanes, ascending) of x[0:n] (n <= 32; past n zero), as round() gives them.
RNN_BF16_TARGET inline __m512i bf16x32(const float* x, int n) {
    const __m512i lo = bf16::round16(_mm512_maskz_loadu_ps(bf16::first(n), x));
    const __m512i hi = bf16::round16(_mm512_maskz_loadu_ps(bf16::first(n - 16), x + 16));
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)), _mm512_cvtepi32_epi16(hi), 1);
}

// r[0:16] transposed as a 16 x 16 matrix of 32-bit words, in place.
RNN_BF16_TARGET inline void transpose16(__m512i* r) {
    __m512i t[16], u[16];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
        t[2 * j] = _mm512_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
        t[2 * j + 1] = _mm512_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {  // u[4j + c], lane L: column 4L + c of rows 4j..4j+3
        u[4 * j + 0] = _mm512_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
        u[4 * j + 1] = _mm512_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
        u[4 * j + 2] = _mm512_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
        u[4 * j + 3] = _mm512_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
        r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
        r[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
    }
}

// op(A) (M x K; ta: A stored K x M) as tiles of pairs, each tile's 16 x 16 words contiguous
// (1 KiB, one load of 16 rows 64 bytes apart): word [i / TR][p / TP][i % TR][p % TP] (kq / TP
// tiles a row block) = pair(op(A)[i][2p], [2p + 1]); rows from M to the next multiple of TR
// and pairs past K (to kq) zero. A tile's rows side by side, not A's rows kq pairs apart: each
// tile is then one stream for the prefetchers, not 16.
RNN_BF16_TARGET __attribute__((flatten)) inline void pack_a(bool ta, int M, int K, const float* A, int lda, int kq,
                                                           std::uint32_t* out) {
    const int mp = (int)bf16::round_up((std::size_t)M, TR);
    const std::size_t tile = (std::size_t)TR * TP, row_block = (std::size_t)kq * TR;
    if (!ta) {
        for (int i = 0; i < M; ++i) {
            const float* x = A + (std::size_t)i * lda;
            std::uint32_t* o = out + (std::size_t)(i / TR) * row_block + (std::size_t)(i % TR) * TP;
            for (int k = 0; k < 2 * kq; k += 2 * TP)
                _mm512_storeu_si512((void*)(o + (std::size_t)(k / (2 * TP)) * tile), bf16x32(x + k, K - k));
        }
    } else {  // A is K x M: 16 pairs of 16 columns of A, paired as 16 words each, then transposed
        for (int i0 = 0; i0 < M; i0 += TR) {
            const __mmask16 m = bf16::first(M - i0);
            for (int p0 = 0; p0 < kq; p0 += TP) {
                __m512i r[16];
#pragma GCC unroll 16
                for (int p = 0; p < TP; ++p) {
                    const int k = 2 * (p0 + p);
                    const float* e = A + (std::size_t)k * lda + i0;
                    const __m512 ev = k < K ? _mm512_maskz_loadu_ps(m, e) : _mm512_setzero_ps();
                    const __m512 od = k + 1 < K ? _mm512_maskz_loadu_ps(m, e + lda) : _mm512_setzero_ps();
                    r[p] = bf16::pairs16(ev, od);
                }
                transpose16(r);  // rows past M: zero words (masked loads)
                std::uint32_t* o = out + (std::size_t)(i0 / TR) * row_block + (std::size_t)(p0 / TP) * tile;
#pragma GCC unroll 16
                for (int i = 0; i < TR; ++i) _mm512_storeu_si512((void*)(o + (std::size_t)i * TP), r[i]);
            }
        }
        return;
    }
    for (int i = M; i < mp; ++i) {  // the last row block's rows past M
        std::uint32_t* o = out + (std::size_t)(i / TR) * row_block + (std::size_t)(i % TR) * TP;
        for (int t = 0; t < kq / TP; ++t) std::memset(o + (std::size_t)t * tile, 0, sizeof(std::uint32_t) * TP);
    }
}

// op(B) (K x N) as gemm_bf16.hpp's NR-column panels of pairs, each panel kq pairs long (pairs
// past K zero): the pair kernel's packing, one panel at a time.
inline void pack_b(bool tb, int K, int N, const float* B, int ldb, int kq, std::uint32_t* out) {
    const int kp = (K + 1) / 2;
    const bf16::PackBFn pack = bf16::pack_b_avx512;
    if (kp == kq) {  // no padding: the whole operand at once (a tall B read in order)
        pack(tb, K, N, B, ldb, out);
        return;
    }
    for (int j0 = 0; j0 < N; j0 += bf16::NR) {
        std::uint32_t* panel = out + (std::size_t)(j0 / bf16::NR) * kq * bf16::NR;
        const int cols = N - j0 < bf16::NR ? N - j0 : bf16::NR;
        pack(tb, K, cols, tb ? B + (std::size_t)j0 * ldb : B + j0, ldb, panel);
        std::memset(panel + (std::size_t)kp * bf16::NR, 0, sizeof(std::uint32_t) * (kq - kp) * bf16::NR);
    }
}

// ---- the kernel --------------------------------------------------------------------------

// A C tile's writing (see the top): `acc` the tile's sums stored 16 x 16, the tile at c.
RNN_BF16_TARGET inline void put(float* c, int ldc, const float* acc, int rows, int cols, float alpha, float beta) {
    const __mmask16 m = bf16::first(cols);
    const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
    for (int i = 0; i < rows; ++i) {
        float* ci = c + (std::size_t)i * ldc;
        const __m512 r = _mm512_mul_ps(va, _mm512_load_ps(acc + i * TR));
        _mm512_mask_storeu_ps(ci, m, beta == 0.0f ? r : _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m, ci), r));
    }
}

// One C block of (RT x 16) rows and (CT x 16) columns over kq pairs: a (the first row block's
// tiles from this pass's first pair on; the second row block's sa words further), b (a panel's
// block, 128-byte rows). `direct`: every tile of the block is whole,
// alpha is 1 and beta 0 or 1, so the tiles load and store C themselves.
template <int RT, int CT>
inline void block(int kq, const std::uint32_t* a, std::size_t sa, const std::uint32_t* b, float* C, int ldc, int rows,
                  int cols, float alpha, float beta, bool direct) {
    constexpr long sb = bf16::NR * 4;
    const long sc = (long)ldc * 4;
    float* c10 = C + (std::size_t)TR * ldc;
    if (direct && beta != 0.0f) {
        RNN_AMX_LOAD(0, C, sc);
        if (CT > 1) RNN_AMX_LOAD(1, C + TR, sc);
        if (RT > 1) RNN_AMX_LOAD(2, c10, sc);
        if (RT > 1 && CT > 1) RNN_AMX_LOAD(3, c10 + TR, sc);
    } else {
        RNN_AMX_ZERO(0);
        if (CT > 1) RNN_AMX_ZERO(1);
        if (RT > 1) RNN_AMX_ZERO(2);
        if (RT > 1 && CT > 1) RNN_AMX_ZERO(3);
    }
    const std::uint32_t* a1 = a + sa;
    constexpr long st = TP * 4;  // a tile of A: 16 rows of 64 bytes, side by side
    for (int p = 0; p < kq; p += TP) {
        // the next step's tiles of A (1 KiB each, from L2) fetched while these multiply: 1.03-1.06x
        // on the products of measure_native.py --bf16 (past the block's end, a prefetch is harmless)
        const std::uint32_t* na = a + (std::size_t)(p + TP) * TR;
        const std::uint32_t* na1 = a1 + (std::size_t)(p + TP) * TR;
#pragma GCC unroll 16
        for (int l = 0; l < TR; ++l) {
            __builtin_prefetch(na + l * TP, 0, 3);
            if (RT > 1) __builtin_prefetch(na1 + l * TP, 0, 3);
        }
        RNN_AMX_LOAD(4, a + (std::size_t)p * TR, st);
        RNN_AMX_LOAD(6, b + (std::size_t)p * bf16::NR, sb);
        RNN_AMX_DP(0, 4, 6);
        if (CT > 1) {
            RNN_AMX_LOAD(7, b + (std::size_t)p * bf16::NR + TR, sb);
            RNN_AMX_DP(1, 4, 7);
        }
        if (RT > 1) {
            RNN_AMX_LOAD(5, a1 + (std::size_t)p * TR, st);
            RNN_AMX_DP(2, 5, 6);
            if (CT > 1) RNN_AMX_DP(3, 5, 7);
        }
    }
    if (direct) {
        RNN_AMX_STORE(0, C, sc);
        if (CT > 1) RNN_AMX_STORE(1, C + TR, sc);
        if (RT > 1) RNN_AMX_STORE(2, c10, sc);
        if (RT > 1 && CT > 1) RNN_AMX_STORE(3, c10 + TR, sc);
        return;
    }
    alignas(64) float acc[TR * TR];
    const int r0 = rows < TR ? rows : TR, r1 = rows - TR, k0 = cols < TR ? cols : TR, k1 = cols - TR;
    RNN_AMX_STORE(0, acc, TR * 4);
    put(C, ldc, acc, r0, k0, alpha, beta);
    if (CT > 1 && k1 > 0) {
        RNN_AMX_STORE(1, acc, TR * 4);
        put(C + TR, ldc, acc, r0, k1, alpha, beta);
    }
    if (RT > 1 && r1 > 0) {
        RNN_AMX_STORE(2, acc, TR * 4);
        put(c10, ldc, acc, r1, k0, alpha, beta);
        if (CT > 1 && k1 > 0) {
            RNN_AMX_STORE(3, acc, TR * 4);
            put(c10 + TR, ldc, acc, r1, k1, alpha, beta);
        }
    }
}

// C (M x N, row stride ldc) = alpha * bf16(op(A)) bf16(op(B)) + beta * C in float32 (op as in
// gemm<T>). Only where available() says so.
inline void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                 float beta, float* C, int ldc) {
    const int kq = (int)pairs_padded(K), mp = (int)bf16::round_up((std::size_t)M, TR);
    const std::size_t bwords = bf16::round_up((std::size_t)N, bf16::NR) * kq;
    const std::uint32_t* Bp = thread_packs<std::uint32_t>().get(
        tb, K, N, B, ldb, kPanelTag, bwords, [&](std::uint32_t* out) { pack_b(tb, K, N, B, ldb, kq, out); });
    std::vector<std::uint32_t>& ap = bf16::packed_a_scratch();
    if (ap.size() < (std::size_t)mp * kq) ap.resize((std::size_t)mp * kq);
    pack_a(ta, M, K, A, lda, kq, ap.data());
    const std::size_t sa = (std::size_t)kq * TR;  // words per row block of A
    Tiles tiles;
    for (int p0 = 0; p0 < kq; p0 += KQ) {
        const int kc = kq - p0 < KQ ? kq - p0 : KQ;
        const float b = p0 == 0 ? beta : 1.0f;
        const bool plain = alpha == 1.0f && (b == 0.0f || b == 1.0f);
        for (int i0 = 0; i0 < mp; i0 += MQ) {
            const int i1 = mp - i0 < MQ ? mp : i0 + MQ;
            for (int j = 0; j < N; j += bf16::NR) {
                const std::uint32_t* bp = Bp + (std::size_t)(j / bf16::NR) * kq * bf16::NR + (std::size_t)p0 * bf16::NR;
                const int cols = N - j < bf16::NR ? N - j : bf16::NR;
                for (int i = i0; i < i1; i += 2 * TR) {
                    const int rows = M - i < 2 * TR ? M - i : 2 * TR;
                    const std::uint32_t* a = ap.data() + (std::size_t)(i / TR) * sa + (std::size_t)p0 * TR;
                    float* c = C + (std::size_t)i * ldc + j;
                    const bool two_r = i1 - i > TR, two_c = cols > TR;
                    const bool direct = plain && rows == (two_r ? 2 * TR : TR) && cols == (two_c ? 2 * TR : TR);
                    if (two_r && two_c) block<2, 2>(kc, a, sa, bp, c, ldc, rows, cols, alpha, b, direct);
                    else if (two_r) block<2, 1>(kc, a, sa, bp, c, ldc, rows, cols, alpha, b, direct);
                    else if (two_c) block<1, 2>(kc, a, sa, bp, c, ldc, rows, cols, alpha, b, direct);
                    else block<1, 1>(kc, a, sa, bp, c, ldc, rows, cols, alpha, b, direct);
                }
            }
        }
    }
}

// The peak: `iters` rounds of four TDPBF16PS on four accumulators from tiles that stay in
// place (no memory traffic); 16 x 16 x 32 x 2 FLOPs each. Returns a value read from the
// accumulators, so that nothing is optimised away.
__attribute__((noinline)) inline float peak_loop(std::int64_t iters) {
    alignas(64) std::uint32_t src[TR * TR];
    for (std::uint32_t& w : src) w = bf16::pair(1e-3f, -1e-3f);  // small, non-zero: no shortcut, no overflow
    alignas(64) float out[TR * TR];
    Tiles tiles;
    RNN_AMX_LOAD(4, src, 64);
    RNN_AMX_LOAD(5, src, 64);
    RNN_AMX_LOAD(6, src, 64);
    RNN_AMX_LOAD(7, src, 64);
    RNN_AMX_ZERO(0);
    RNN_AMX_ZERO(1);
    RNN_AMX_ZERO(2);
    RNN_AMX_ZERO(3);
    for (std::int64_t i = 0; i < iters; ++i) {
        RNN_AMX_DP(0, 4, 6);
        RNN_AMX_DP(1, 4, 7);
        RNN_AMX_DP(2, 5, 6);
        RNN_AMX_DP(3, 5, 7);
    }
    RNN_AMX_STORE(0, out, 64);
    return out[0] + out[TR * TR - 1];
}
constexpr double kPeakFlopsPerIter = 4.0 * TR * TR * 2 * TP * 2;

#undef RNN_AMX_LOAD
#undef RNN_AMX_STORE
#undef RNN_AMX_ZERO
#undef RNN_AMX_DP
#else
// Without the kernel available() is false and nothing routes here.
[[noreturn]] inline void gemm(bool, bool, int, int, int, float, const float*, int, const float*, int, float, float*,
                              int) {
    std::abort();
}
[[noreturn]] inline float peak_loop(std::int64_t) { std::abort(); }
constexpr double kPeakFlopsPerIter = 0.0;
#endif

}  // namespace amx
}  // namespace rnn

#pragma GCC diagnostic pop
