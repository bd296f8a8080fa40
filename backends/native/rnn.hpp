// The SPEC.md network (Elman / LSTM / GRU in both reset forms, stacked, uni- or
// bidirectional, softmax or mse head, full / truncated / tail BPTT, SGD with clipping)
// for float and double, parallelised with OpenMP.
//
// Shapes follow harness/reference.py: time-major, row vectors, row r = t*B + b.
// Per layer and direction the forward keeps h (and c, tanh c, the activated gates,
// the GRU's u_n + b_hn or r * h_{t-1}) for every step; a reverse direction is the same
// cell run over a time-reversed copy of its input, its outputs reversed back into the
// layer's [h_t, h_t_rev] rows; the backward is O(T) (O(T*K) rows for truncated K) with every weight gradient
// one GEMM over all steps. A `Team` is the set of OpenMP threads sharing one worker:
// each phase splits its rows or columns among the team and ends with a barrier.
#pragma once

#include <linux/futex.h>
#include <omp.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "blas.hpp"
#include "bf16.hpp"
#include "gemm_f32.hpp"
#include "vmath.hpp"

namespace rnn {

enum class Kind { Elman, Lstm, Gru };
enum class Act { Tanh, Relu, Sigmoid };
enum class Head { Softmax, Mse };
enum class Bptt { Full, Truncated, Tail };
enum class Variant { Default, Sync, Async };

struct Config {
    Kind kind = Kind::Elman;
    int hidden = 0;
    int layers = 1;
    Act act = Act::Tanh;
    bool bias = true;
    bool peephole = false;
    bool reset_after = true;     // GRU: r multiplies (h W_hn + b_hn), else h before the product
    bool bidirectional = false;  // every layer also runs a reverse direction (full BPTT only)
    Head head = Head::Softmax;
    bool out_tanh = false;
    Bptt bptt = Bptt::Full;
    int k = 0;
    double clip = 0.0;  // <= 0: no clipping
    double split_scale = 1.0;  // scales the work thresholds below; 0 splits everything (tests)
    int recurrence = 0;        // how a split recurrence is shared: 0 by size, 1 batch rows, 2 hidden units
    bool adapt = true;         // time one thread against the team and keep the faster (TeamTuner)
    int input_size = 0;
    int output_size = 0;
    bool tokens = false;
    // bfloat16 mixed precision (float engines only): every product's inputs rounded to
    // bfloat16, the products summed in float32 (gemm_bf16.hpp); all else stays float32
    bool bf16 = false;

    int gates() const { return kind == Kind::Lstm ? 4 * hidden : kind == Kind::Gru ? 3 * hidden : hidden; }
    int dirs() const { return bidirectional ? 2 : 1; }
    // the width of a layer's output: [h_t] or [h_t, h_t_rev]
    int out_width() const { return dirs() * hidden; }
};

// Work below these sizes (multiply-adds, elements for kParRows) is not worth a split
// across threads. kParTeam: a step whose largest product is smaller runs on one thread
// altogether; on a 2-core machine shared with other work each barrier can cost
// 0.1-0.2 ms, which made the WildML step (largest product 16M) 2x slower on two threads.
// kParStep: the per-step recurrent product (B x H x G) split across the team (by batch
// rows with no barrier, or by hidden units with a barrier each step: recurrence_split). At 1 << 18 the LSTM 700/500/80 batch-1 step went from 26.5 to 15 ms
// on two threads (half of W_hh stays in each core's L2); at 1 << 16 an LSTM 128 batch-1
// step took 25x longer in one of three runs while another process held the other core.
constexpr double kParTeam = 1 << 25;
constexpr double kParGemm = 1 << 20;
constexpr double kParStep = 1 << 18;
constexpr double kParRows = 1 << 16;
// Fewest sequences per thread for a recurrence split by batch rows: below it each
// per-step product has too few rows to pay for reading all of W_hh, and splitting W_hh's
// columns (one barrier a step) is faster (automatic choice only). float32 through the
// BLAS, which packs W_hh again at every call, two threads: at batch 16 (8 rows each)
// hidden units beat batch rows 1.09-1.26x (Elman H 256-1760, LSTM H 256-1024, GRU H 256);
// at batch 32 (16 rows each) the two are within 3%, at 64 rows batch leads. bfloat16
// products take half the time, so the barrier weighs more: at batch 16 batch rows lead
// by 6-12% at H 256 and trail by 3-4% at H 512; it keeps 8.
// float32 on the engine's own kernel (own_recurrence), where each thread packs W_hh once
// per pass instead of once per step, batch rows win from 8 rows each while W_hh is at most
// kOwnBatchBytes: two threads at batch 16 (T 25, input H, mse head; AMD EPYC Zen 4 at load
// 5-7, paired rounds; batch rows' time over hidden units') Elman H 256 0.20x, H 1024
// 0.74x, LSTM H 512 0.71x, GRU H 512 0.60x; CPU time per thread per step 3.2 / 6.0,
// 45 / 48, 31 / 33.5 and 24 / 27 ms. Past it each thread streams all of a W_hh that no
// cache holds: LSTM H 1024 (16 MB) 0.96x and 1.16x in two runs, 140 / 128 CPU ms.
constexpr int kMinRows = 16;
constexpr int kMinRowsBf16 = 8;
constexpr int kMinRowsOwn = 8;
constexpr std::size_t kOwnBatchBytes = std::size_t(8) << 20;
// The batch sizes whose per-step float32 products go to the engine's own kernel with
// W_hh packed once per pass (gemm_f32.hpp) instead of the BLAS; see own_recurrence.
constexpr int kOwnMinRows = 2;
constexpr int kOwnMaxRows = 64;
constexpr std::size_t kAlign = 16;  // elements: 64 bytes for float
// Fused SGD adds -lr * (A^T B) into the parameters with beta = 1. BLAS splits a deep
// product into panels of K (OpenBLAS: 256-384) and adds each panel's partial sum to C,
// so each panel rounds at the size of the weight instead of the size of its update. At
// K = 10112 (LSTM 500, T 80, B 128: 27 panels) the float32 update came within 4% of its
// bound, where every other backend stays near 9%. Deeper products than this go through a
// scratch gradient and one update. Up to it (one or two panels) the rounding stays at the
// other backends' level, and there the extra pass over the weight would cost 3-4% of the
// step (vocab 2000, hidden 100, K = 320). At K = 512 (frame differences, T 16, B 32)
// fusing leaves the check at 0.21 of the bound against NumPy's 0.10, at K = 1024 (Sobel,
// T 64, B 16) at 0.26.
constexpr int kFuseDepth = 512;
constexpr std::size_t kResidentBytes = 1 << 20;  // half of a 2 MiB per-core L2

// Buffers of kHugeBytes or more are aligned to 2 MiB and asked for transparent huge pages
// (madvise; the kernel's default on many systems gives them only where asked, as NumPy asks
// for its large arrays): a product's output rows lie ldc floats apart, and a tile or panel
// written 16-32 rows at a time touches as many 4 KiB pages, past what the TLB holds. The
// bfloat16 input projection of the LSTM H 512 B 64 T 50 step on AMX spent 13.8 ms where the
// same product on NumPy's (huge-paged) arrays takes 6.9 ms.
constexpr std::size_t kHugeBytes = std::size_t(4) << 20, kHugePage = std::size_t(2) << 20;

template <class T>
struct AlignedAllocator {
    using value_type = T;
    AlignedAllocator() = default;
    template <class U>
    AlignedAllocator(const AlignedAllocator<U>&) {}
    T* allocate(std::size_t n) {
        std::size_t bytes = ((n * sizeof(T) + 63) / 64) * 64;
        const bool huge = bytes >= kHugeBytes;
        if (huge) bytes = (bytes + kHugePage - 1) / kHugePage * kHugePage;
        void* p = std::aligned_alloc(huge ? kHugePage : 64, bytes ? bytes : 64);
        if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
        if (huge) madvise(p, bytes, MADV_HUGEPAGE);  // advice only: nothing changes where it is refused
#endif
        return static_cast<T*>(p);
    }
    void deallocate(T* p, std::size_t) { std::free(p); }
    template <class U>
    bool operator==(const AlignedAllocator<U>&) const { return true; }
    template <class U>
    bool operator!=(const AlignedAllocator<U>&) const { return false; }
};

template <class T>
using Buf = std::vector<T, AlignedAllocator<T>>;

// Where each parameter lives in one flat, 64-byte aligned buffer, in canonical order.
struct Tensor {
    std::string name;
    std::size_t offset;
    int rows, cols;  // 1-D tensors have rows == 1
    std::size_t size() const { return (std::size_t)rows * cols; }
};

constexpr std::size_t kNone = (std::size_t)-1;

struct LayerSlots {
    int din;
    std::size_t W_in, W_hh, b = kNone, b_hn = kNone, p_i = kNone, p_f = kNone, p_o = kNone;
};

struct Layout {
    std::vector<Tensor> tensors;
    std::vector<LayerSlots> layers;  // layer l, direction d at l * dirs + d
    std::size_t W_hy = 0, b_y = kNone, total = 0;

    explicit Layout(const Config& c) {
        auto add = [&](const std::string& name, int rows, int cols) {
            tensors.push_back({name, total, rows, cols});
            std::size_t at = total;
            total += ((std::size_t)rows * cols + kAlign - 1) / kAlign * kAlign;
            return at;
        };
        const int H = c.hidden, G = c.gates();
        const bool elman = c.kind == Kind::Elman;
        for (int l = 0; l < c.layers; ++l) {
            for (int d = 0; d < c.dirs(); ++d) {  // harness/spec.py's order: per direction, suffix _rev
                std::string s = (l == 0 ? "" : "_" + std::to_string(l)) + (d ? "_rev" : "");
                LayerSlots slot;
                slot.din = l == 0 ? c.input_size : c.out_width();
                slot.W_in = add((elman ? "W_xh" : "W_ih") + s, slot.din, G);
                slot.W_hh = add("W_hh" + s, H, G);
                if (c.bias) {
                    slot.b = add((elman ? "b_h" : "b") + s, 1, G);
                    if (c.kind == Kind::Gru && c.reset_after) slot.b_hn = add("b_hn" + s, 1, H);
                }
                if (c.peephole) {
                    slot.p_i = add("p_i" + s, 1, H);
                    slot.p_f = add("p_f" + s, 1, H);
                    slot.p_o = add("p_o" + s, 1, H);
                }
                layers.push_back(slot);
            }
        }
        W_hy = add("W_hy", c.out_width(), c.output_size);
        if (c.bias) b_y = add("b_y", 1, c.output_size);
    }
};

// A barrier that spins briefly, then yields, then sleeps. libgomp's own spins for
// ~300k iterations, which on a shared machine burns the very core the late thread
// is waiting for; OMP_WAIT_POLICY would fix that only if set before libgomp loads.
class Barrier {
  public:
    explicit Barrier(int n) : n_(n) {}
    void reset(int n) { n_ = n; }

    void wait() {
        const int phase = phase_.load(std::memory_order_acquire);
        if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
            arrived_.store(0, std::memory_order_relaxed);
            phase_.store(phase + 1, std::memory_order_release);
            if (sleepers_.load(std::memory_order_acquire) > 0)
                syscall(SYS_futex, reinterpret_cast<int*>(&phase_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
            return;
        }
        for (int i = 0; phase_.load(std::memory_order_acquire) == phase; ++i) {
            if (i < kSpins) {
                spin_pause();
            } else if (i < kSpins + kYields) {
                sched_yield();
            } else {
                sleepers_.fetch_add(1, std::memory_order_acq_rel);
                if (phase_.load(std::memory_order_acquire) == phase)
                    syscall(SYS_futex, reinterpret_cast<int*>(&phase_), FUTEX_WAIT_PRIVATE, phase, nullptr, nullptr,
                            0);
                sleepers_.fetch_sub(1, std::memory_order_acq_rel);
            }
        }
    }

  private:
    static constexpr int kSpins = 4000, kYields = 200;
    static void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    int n_;
    alignas(64) std::atomic<int> arrived_{0};
    alignas(64) std::atomic<int> phase_{0};
    alignas(64) std::atomic<int> sleepers_{0};
};

// Profiling (off by default: no clock is read unless a Profile is attached). Per
// thread and phase: the wall time spent in the phase and the part of it spent waiting
// at barriers; per thread: the wall and CPU time (CLOCK_THREAD_CPUTIME_ID) of each
// team run, whose difference is time the thread was runnable but off its core.
enum Phase : int { kInputProj, kRecurFwd, kOutput, kHead, kOutGrads, kRecurBwd, kWeightGrads, kUpdate, kPhases };
inline const char* phase_name(int p) {
    static const char* names[kPhases] = {"input_projection", "recurrence_forward", "output_gemm", "head",
                                         "output_grads", "recurrence_backward", "weight_grads", "update"};
    return names[p];
}

inline std::int64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (std::int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
inline std::int64_t cpu_ns() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (std::int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

struct alignas(64) ThreadProfile {  // one cache line apart: no false sharing between threads
    std::int64_t phase_ns[kPhases] = {};
    std::int64_t wait_ns[kPhases] = {};
    std::int64_t phase_cpu_ns[kPhases] = {};
    std::int64_t wall_ns = 0, cpu_ns = 0, barriers = 0, runs = 0;
    int phase = -1;  // the phase this thread is in
};

struct Profile {
    std::vector<ThreadProfile> threads;
    std::int64_t steps = 0;
    std::int64_t team_sizes[8] = {};  // how many runs used 1, 2, 3-4, 5-8, ... threads
    explicit Profile(int n) : threads(std::max(1, n)) {}
};

// The OpenMP threads that share one worker's phases.
struct Team {
    int tid = 0, nth = 1;
    double scale = 1.0;
    Barrier* sync = nullptr;
    Profile* prof = nullptr;  // null: profiling off
    int slot = 0;             // this thread's ThreadProfile (a solo team inside a larger one keeps its thread's)
    bool leader() const { return tid == 0; }
    // Whether `work` multiply-adds are worth splitting (threshold `base`).
    bool split(double work, double base) const { return nth > 1 && work >= base * scale; }
    void barrier() const {
        if (nth <= 1) return;
        if (!prof) {
            sync->wait();
            return;
        }
        ThreadProfile& p = prof->threads[slot];
        const std::int64_t t0 = now_ns();
        sync->wait();
        if (p.phase >= 0) p.wait_ns[p.phase] += now_ns() - t0;
        ++p.barriers;
    }
    // This member's share of [0, n), in chunks that are multiples of `align`.
    void share(int n, int align, int& lo, int& hi) const {
        int per = (n + nth - 1) / nth;
        per = (per + align - 1) / align * align;
        lo = std::min(n, tid * per);
        hi = std::min(n, lo + per);
    }
    // This member's share of [0, n) as share() gives it when `work` is worth a split
    // (threshold `base`); otherwise all of it on the leader and none elsewhere.
    void share_if(double work, double base, int n, int align, int& lo, int& hi) const {
        if (split(work, base)) {
            share(n, align, lo, hi);
        } else {
            lo = 0;
            hi = leader() ? n : 0;
        }
    }
    // This member's share of n rows among the first `parts` members (others get none).
    void share_among(int n, int parts, int& lo, int& hi) const {
        parts = std::max(1, std::min(parts, nth));
        if (tid >= parts) {
            lo = hi = n;
            return;
        }
        lo = (int)((long)n * tid / parts);
        hi = (int)((long)n * (tid + 1) / parts);
    }
};

// Times one phase of one thread while it is in scope.
class PhaseScope {
  public:
    PhaseScope(const Team& tm, Phase ph) : p_(tm.prof ? &tm.prof->threads[tm.slot] : nullptr) {
        if (!p_) return;
        prev_ = p_->phase;
        p_->phase = ph;
        t0_ = now_ns();
        c0_ = cpu_ns();
    }
    ~PhaseScope() {
        if (!p_) return;
        p_->phase_ns[p_->phase] += now_ns() - t0_;
        p_->phase_cpu_ns[p_->phase] += cpu_ns() - c0_;
        p_->phase = prev_;
    }

  private:
    ThreadProfile* p_;
    int prev_ = -1;
    std::int64_t t0_ = 0, c0_ = 0;
};

// Times a whole team run of one thread (wall and CPU).
class RunScope {
  public:
    explicit RunScope(const Team& tm) : p_(tm.prof ? &tm.prof->threads[tm.slot] : nullptr) {
        if (!p_) return;
        w0_ = now_ns();
        c0_ = cpu_ns();
    }
    ~RunScope() {
        if (!p_) return;
        p_->wall_ns += now_ns() - w0_;
        p_->cpu_ns += cpu_ns() - c0_;
        ++p_->runs;
    }

  private:
    ThreadProfile* p_;
    std::int64_t w0_ = 0, c0_ = 0;
};

// Runs f(team) on n threads (inline when n == 1).
template <class F>
void run_team(int n, double scale, Profile* prof, F&& f) {
    if (prof) {
        int bin = 0;
        for (int k = 1; k < n && bin < 7; k *= 2) ++bin;
        ++prof->team_sizes[bin];
    }
    if (n <= 1) {
        Team tm{0, 1, scale, nullptr, prof, 0};
        RunScope rs(tm);
        f(tm);
        return;
    }
    Barrier sync(n), fewer(1);
#pragma omp parallel num_threads(n)
    {
        const int got = omp_get_num_threads();
        if (got != n) {  // libgomp granted fewer threads than asked (nested or limited)
#pragma omp single
            fewer.reset(got);
        }
        const int tid = omp_get_thread_num();
        Team tm{tid, got, scale, got == n ? &sync : &fewer, prof, tid};
        RunScope rs(tm);
        f(tm);
    }
}

// This member's block of an M x N product with K-deep sums shared as panels across the
// team, along the larger output dimension (the whole product on the leader, nothing
// elsewhere, below kParGemm). The same split for every caller, so a later pass over
// the same block (a fused update) needs no barrier.
inline void gemm_block(const Team& tm, int M, int N, double K, int& r0, int& r1, int& c0, int& c1) {
    r0 = c0 = 0, r1 = M, c1 = N;
    if (!tm.split((double)M * N * K, kParGemm)) {
        if (!tm.leader()) r1 = 0;
    } else if (N >= M) {
        tm.share(N, (int)kAlign, c0, c1);
    } else {
        tm.share(M, 1, r0, r1);
    }
}

template <class T>
inline T act_fwd(Act a, T v) {
    switch (a) {
        case Act::Tanh: return vtanh(v);
        case Act::Relu: return v > T(0) ? v : T(0);
        default: return vsigmoid(v);
    }
}

// Where gradients go: into a gradient buffer `G`, or (fused SGD without clipping)
// straight into the parameters as `P -= lr * g`, GEMMs using alpha = -lr, beta = 1.
template <class T>
struct Sink {
    T* P = nullptr;
    T* G = nullptr;
    T lr = 0;
    bool fused() const { return G == nullptr; }
};

// One minibatch (or one worker's share of it): contiguous, time-major.
template <class T>
struct Batch {
    int T_ = 0, B = 0;
    const std::int64_t* tok = nullptr;  // (T, B) token ids, or
    const T* x = nullptr;               // (T, B, D)
    const std::int64_t* lab = nullptr;  // (T, B) class ids, or
    const T* y = nullptr;               // (T, B, O)
};

template <class T>
struct LayerWs {
    Buf<T> A;   // (T*B, G): pre-activations; for the LSTM the activated gates i, f, g, o; GRU r, z, n
    Buf<T> Hs;  // ((T+1)*B, H): block 0 is h_{-1} = 0, block t+1 is h_t
    Buf<T> C;   // ((T+1)*B, H): LSTM cell states, same convention
    Buf<T> TC;  // (T*B, H): LSTM tanh(c_t)
    Buf<T> DH;  // (T*B, H): dL/dh_t arriving from above; the recurrence adds its carry in place
    Buf<T> DA;  // (T*B, G): dL/da_t (truncated: summed over the windows that reach step t)
    Buf<T> DAj, CH, DC0, DC1;  // truncated: one lag's dL/da, dh carry, LSTM dc carry (double-buffered)
    Buf<T> dc;                 // (B, H): LSTM dc carry of the O(T) backward
    Buf<T> WhhT;               // (G, H): W_hh transposed, when W_hh does not stay in cache
    // GRU
    Buf<T> U;    // (B, G): one step's h_{t-1} W_hh (reset before: its r, z part and (r * h_{t-1}) W_hn);
                 // in the backward one step's dL/d(r * h_{t-1})
    Buf<T> UN;   // (T*B, H): u_n + b_hn (reset after) or r * h_{t-1} (reset before)
    Buf<T> DU;   // (T*B, G): reset after, dL/du_t = [da_r, da_z, r * da_n] (truncated: summed)
    Buf<T> DUj;  // truncated: one lag's dL/du (reset after) or dL/d(r * h) (reset before)
    Buf<T> CD;   // truncated: the carry being built for the next lag (swapped with CH)
    // bidirectional: the layer's [h_t, h_t_rev] rows and their gradient (direction 0's
    // buffers), the time-reversed input and its gradient (direction 1's)
    Buf<T> Y, DY, Xr, DXr;
    std::vector<std::int64_t> tokr;
};

template <class T>
class Worker {
  public:
    Worker(const Config& cfg, const Layout& lay)
        : cfg_(cfg), lay_(lay), L_(cfg.layers),
          nd_(cfg.dirs()), resident_((std::size_t)cfg.hidden * cfg.gates() * sizeof(T) <= kResidentBytes) {
        L_.resize((std::size_t)cfg.layers * nd_);
        zeros_.assign((std::size_t)std::max({cfg.gates(), cfg.output_size, cfg.out_width(), cfg.input_size}), T(0));
        mark_.assign(cfg.tokens ? cfg.input_size : 0, 0);
    }

    // Buffers for (T, B); grows only.
    void ensure(int Tn, int Bn) {
        std::size_t rows = (std::size_t)(Tn + 1) * Bn;
        if (rows <= cap_rows_ && Tn <= cap_T_ && Bn <= cap_B_) return;
        cap_rows_ = std::max(rows, cap_rows_);
        cap_T_ = std::max(Tn, cap_T_);
        cap_B_ = std::max(Bn, cap_B_);
        const std::size_t R = cap_rows_, H = cfg_.hidden, G = cfg_.gates(), O = cfg_.output_size;
        const bool lstm = cfg_.kind == Kind::Lstm, gru = cfg_.kind == Kind::Gru,
                   lagged = cfg_.bptt == Bptt::Truncated;
        for (std::size_t i = 0; i < L_.size(); ++i) {
            LayerWs<T>& w = L_[i];
            const int l = (int)i / nd_, d = (int)i % nd_;
            const std::size_t din = l == 0 ? cfg_.input_size : cfg_.out_width();
            if (nd_ == 2 && d == 0) {
                w.Y.assign(R * 2 * H, T(0));
                w.DY.assign(R * 2 * H, T(0));
            }
            if (d == 1) {
                if (l == 0 && cfg_.tokens) w.tokr.assign(R, 0);
                else w.Xr.assign(R * din, T(0));
                if (l > 0) w.DXr.assign(R * din, T(0));
            }
            if (gru) {
                w.U.assign((std::size_t)cap_B_ * G, T(0));
                w.UN.assign(R * H, T(0));
                if (cfg_.reset_after) w.DU.assign(R * G, T(0));
                if (lagged) {
                    w.DUj.assign(R * G, T(0));
                    w.CD.assign(R * H, T(0));
                }
            }
            w.A.assign(R * G, T(0));
            w.Hs.assign(R * H, T(0));
            w.DH.assign(R * H, T(0));
            w.DA.assign(R * G, T(0));
            if (!resident_) w.WhhT.assign(H * G, T(0));
            if (lstm) {
                w.C.assign(R * H, T(0));
                w.TC.assign(R * H, T(0));
                w.dc.assign(R * H, T(0));
            }
            if (lagged) {
                w.DAj.assign(R * G, T(0));
                w.CH.assign(R * H, T(0));
                if (lstm) {
                    w.DC0.assign(R * H, T(0));
                    w.DC1.assign(R * H, T(0));
                }
            }
        }
        Z_.assign(R * O, T(0));
        row_loss_.assign(R, 0.0);
    }

    void ensure_grads() {
        if (grads_.size() != lay_.total) grads_.assign(lay_.total, T(0));
    }

    // The scratch gradients of deep fused products, at the parameters' own offsets: each
    // weight its own block, so no product waits for another's update to free the scratch.
    void ensure_fuse_scratch() {
        if (scratch_.size() < lay_.total) scratch_.assign(lay_.total, T(0));
    }

    T* grads() { return grads_.data(); }
    const std::vector<std::int64_t>& touched() const { return touched_; }
    Buf<T>& local() { return local_; }

    // Forward through every layer and the output projection, then the head:
    // `out` (T*B, O) receives z, and then dL/dz (train) or the outputs (inference).
    double forward_head(const Team& tm, const T* P, const Batch<T>& in, bool train, T inv_b, T* out) {
        for (int l = 0; l < cfg_.layers; ++l) {
            for (int d = 0; d < nd_; ++d) forward_layer(tm, P, in, l, d);
            if (nd_ == 2) {
                PhaseScope ps(tm, kRecurFwd);
                join_directions(tm, in, l);
            }
        }
        const int TB = in.T_ * in.B, HW = cfg_.out_width(), O = cfg_.output_size;
        {
            PhaseScope ps(tm, kOutput);
            pgemm(tm, false, false, TB, O, HW, T(1), out_h(cfg_.layers - 1, in.B), HW, P + lay_.W_hy, O, T(0), out, O);
            tm.barrier();
        }
        {
            PhaseScope ps(tm, kHead);
            head(tm, P, in, train, inv_b, out);
            tm.barrier();
        }
        if (!tm.leader()) return 0.0;
        double total = 0.0;
        for (int r = 0; r < TB; ++r) total += row_loss_[r];
        return total;
    }

    double forward_head(const Team& tm, const T* P, const Batch<T>& in, bool train, T inv_b) {
        return forward_head(tm, P, in, train, inv_b, Z_.data());
    }

    // BPTT from the dL/dz that forward_head(train=true) left in Z.
    void backward(const Team& tm, const T* P, Sink<T> s, const Batch<T>& in) {
        const int Tn = in.T_, Bn = in.B, HW = cfg_.out_width(), O = cfg_.output_size;
        const int t0 = cfg_.bptt == Bptt::Tail ? std::max(0, Tn - cfg_.k) : 0;
        const int R0 = t0 * Bn, nR = (Tn - t0) * Bn;
        if (!s.fused() && cfg_.tokens && tm.leader()) touched_.clear();
        const T* dZ = Z_.data() + (std::size_t)R0 * O;
        {
            PhaseScope ps(tm, kOutGrads);
            // dh of the top layer first: the fused update below overwrites W_hy
            pgemm(tm, false, true, nR, HW, O, T(1), dZ, O, P + lay_.W_hy, O, T(0),
                  out_dh(cfg_.layers - 1) + (std::size_t)R0 * HW, HW);
            tm.barrier();
            grad_gemm(tm, s, lay_.W_hy, true, false, HW, O, nR, out_h(cfg_.layers - 1, Bn) + (std::size_t)R0 * HW, HW,
                      dZ, O);
            if (cfg_.bias) colsum(tm, s, lay_.b_y, dZ, nR, O);
        }
        if (nd_ == 2) {  // full BPTT only: each layer's two directions, top down
            for (int l = cfg_.layers - 1; l >= 0; --l) {
                {
                    PhaseScope ps(tm, kRecurBwd);
                    split_directions(tm, in, l);
                }
                for (int d = 0; d < 2; ++d) {
                    {
                        PhaseScope ps(tm, kRecurBwd);
                        window_backward(tm, P, in, l, d, 0);
                    }
                    PhaseScope ps(tm, kWeightGrads);
                    layer_grads(tm, P, s, in, l, d, 0, l > 0);
                }
                if (l > 0) {
                    PhaseScope ps(tm, kWeightGrads);
                    add_reversed_dx(tm, in, l);
                }
            }
        } else if (cfg_.bptt == Bptt::Truncated && cfg_.k < Tn - 1) {
            {
                PhaseScope ps(tm, kRecurBwd);
                if (cfg_.kind == Kind::Gru) gru_lagged_backward(tm, P, in);
                else lagged_backward(tm, P, in);
            }
            PhaseScope ps(tm, kWeightGrads);
            for (int l = cfg_.layers - 1; l >= 0; --l) layer_grads(tm, P, s, in, l, 0, 0, false);
        } else {
            for (int l = cfg_.layers - 1; l >= 0; --l) {
                {
                    PhaseScope ps(tm, kRecurBwd);
                    window_backward(tm, P, in, l, 0, t0);
                }
                PhaseScope ps(tm, kWeightGrads);
                layer_grads(tm, P, s, in, l, 0, t0, l > 0);
            }
        }
        PhaseScope ps(tm, kWeightGrads);
        tm.barrier();
    }

  private:
    const Config& cfg_;
    const Layout& lay_;
    std::vector<LayerWs<T>> L_;
    Buf<T> Z_;
    std::vector<double> row_loss_;
    Buf<T> grads_, local_;
    Buf<T> scratch_;  // see kFuseDepth
    Buf<T> zeros_;
    std::vector<std::int64_t> touched_;
    std::vector<int> mark_;
    int gen_ = 0;
    std::size_t cap_rows_ = 0;
    int cap_T_ = 0, cap_B_ = 0;
    const int nd_;         // directions per layer
    const bool resident_;  // W_hh small enough to stay in L2 through the per-step products

    LayerWs<T>& ws(int l, int d) { return L_[(std::size_t)l * nd_ + d]; }
    const LayerSlots& slot(int l, int d) const { return lay_.layers[(std::size_t)l * nd_ + d]; }
    // Layer l's output rows (T*B, out_width): h_t, or [h_t, h_t_rev] for a bidirectional layer.
    const T* out_h(int l, int Bn) {
        return nd_ == 2 ? ws(l, 0).Y.data() : ws(l, 0).Hs.data() + (std::size_t)Bn * cfg_.hidden;
    }
    // Where the gradient of layer l's output rows goes (the same layout).
    T* out_dh(int l) { return nd_ == 2 ? ws(l, 0).DY.data() : ws(l, 0).DH.data(); }
    // The rows direction d of layer l reads (time-reversed for d = 1), and their width.
    const T* layer_x(const Batch<T>& in, int l, int d) {
        if (d == 1) return ws(l, 1).Xr.data();
        return l == 0 ? in.x : out_h(l - 1, in.B);
    }
    const std::int64_t* layer_tok(const Batch<T>& in, int d) { return d == 1 ? ws(0, 1).tokr.data() : in.tok; }

    // A bidirectional layer's output rows: [h_t, h_t_rev], h_t_rev being the reverse
    // run's step T-1-t (its state block T-t).
    void join_directions(const Team& tm, const Batch<T>& in, int l) {
        const int Tn = in.T_, Bn = in.B, H = cfg_.hidden, TB = Tn * Bn;
        int lo, hi;
        tm.share_if((double)TB * 2 * H, kParRows, TB, 1, lo, hi);
        LayerWs<T>&f = ws(l, 0), &r = ws(l, 1);
        for (int i = lo; i < hi; ++i) {
            const int t = i / Bn, b = i % Bn;
            T* y = f.Y.data() + (std::size_t)i * 2 * H;
            std::memcpy(y, f.Hs.data() + ((std::size_t)(t + 1) * Bn + b) * H, sizeof(T) * H);
            std::memcpy(y + H, r.Hs.data() + ((std::size_t)(Tn - t) * Bn + b) * H, sizeof(T) * H);
        }
        tm.barrier();
    }

    // The gradient of a bidirectional layer's output rows, handed to each direction in its own time order.
    void split_directions(const Team& tm, const Batch<T>& in, int l) {
        const int Tn = in.T_, Bn = in.B, H = cfg_.hidden, TB = Tn * Bn;
        int lo, hi;
        tm.share_if((double)TB * 2 * H, kParRows, TB, 1, lo, hi);
        LayerWs<T>&f = ws(l, 0), &r = ws(l, 1);
        for (int i = lo; i < hi; ++i) {
            const int t = i / Bn, b = i % Bn;
            const T* dy = f.DY.data() + (std::size_t)i * 2 * H;
            std::memcpy(f.DH.data() + (std::size_t)i * H, dy, sizeof(T) * H);
            std::memcpy(r.DH.data() + ((std::size_t)(Tn - 1 - t) * Bn + b) * H, dy + H, sizeof(T) * H);
        }
        tm.barrier();
    }

    // Layer l-1's output gradient gets the reverse direction's dL/dx, time-reversed back.
    void add_reversed_dx(const Team& tm, const Batch<T>& in, int l) {
        const int Tn = in.T_, Bn = in.B, W = cfg_.out_width(), TB = Tn * Bn;
        int lo, hi;
        tm.share_if((double)TB * W, kParRows, TB, 1, lo, hi);
        T* dy = out_dh(l - 1);
        const T* dx = ws(l, 1).DXr.data();
        for (int i = lo; i < hi; ++i) {
            const int t = i / Bn, b = i % Bn;
            T* o = dy + (std::size_t)i * W;
            const T* g = dx + ((std::size_t)(Tn - 1 - t) * Bn + b) * W;
#pragma omp simd
            for (int k = 0; k < W; ++k) o[k] += g[k];
        }
        tm.barrier();
    }
    const T* opt(const T* P, std::size_t off) const { return off == kNone ? zeros_.data() : P + off; }

    // Every product of the engine goes through these three. gemm: C (M x N, row stride
    // ldc) = alpha op(A) op(B) + beta C by the BLAS (gemm<T>, blas.hpp), or under bfloat16
    // (Config::bf16, float engines) with op(A) and op(B) rounded to bfloat16 and summed in
    // float32 (gemm_bf16.hpp). Both are single-threaded: the team shares the work.
    void gemm(bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb, T beta, T* C,
              int ldc, bool resident = false) const {
        if constexpr (std::is_same_v<T, float>) {
            if (cfg_.bf16) {
                bf16::gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
                return;
            }
        }
        if constexpr (std::is_same_v<T, float>) {
            // a per-step product of a recurrence (a ReuseScope is open: op(B) is W_hh or W_hh^T,
            // packed once per pass), by the engine's own kernel where own_recurrence says so
            if (!ta && f32::reusing() && f32::active()) {
                f32::gemm(tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
                return;
            }
        }
        rnn::gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, resident);
    }

    // Whether the per-step products of a recurrence over Bn rows run on the engine's own
    // float32 kernel (gemm_f32.hpp) with W_hh packed once per pass, rather than the BLAS.
    bool own_recurrence(int Bn) const {
        if constexpr (std::is_same_v<T, float>)
            return !cfg_.bf16 && f32::active() && Bn >= kOwnMinRows && Bn <= kOwnMaxRows;
        return false;
    }

    // The block [r0, r1) x [c0, c1) of C = alpha op(A) op(B) + beta C.
    void block_gemm(bool ta, bool tb, int r0, int r1, int c0, int c1, int K, T alpha, const T* A, int lda, const T* B,
                    int ldb, T beta, T* C, int ldc) const {
        if (r0 >= r1 || c0 >= c1) return;
        gemm(ta, tb, r1 - r0, c1 - c0, K, alpha, ta ? A + r0 : A + (std::size_t)r0 * lda, lda,
             tb ? B + (std::size_t)c0 * ldb : B + c0, ldb, beta, C + (std::size_t)r0 * ldc + c0, ldc);
    }

    // A GEMM split over the team as panels (gemm_block); no barrier.
    void pgemm(const Team& tm, bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb,
               T beta, T* C, int ldc) const {
        int r0, r1, c0, c1;
        gemm_block(tm, M, N, K, r0, r1, c0, c1);
        block_gemm(ta, tb, r0, r1, c0, c1, K, alpha, A, lda, B, ldb, beta, C, ldc);
    }

    // How a per-step recurrence of Bn rows is shared by the team. By batch rows: each
    // thread runs its own sequences through every step with no barrier at all, but reads
    // all of W_hh and needs kMinRows rows (kMinRowsOwn, kMinRowsBf16) to pay for that. By
    // hidden units: each thread keeps its block of W_hh's columns (rows of W_hh^T in the backward) and the
    // team meets at one barrier per step. Batch rows whenever they keep at least half the
    // team busy. On two threads (Elman 512, B 32, T 50) batch rows cut each thread's CPU
    // time per step 1.9-2.0x against one thread, hidden units 1.3x (111 barriers per step,
    // each spinning); for the LSTM 500 (W_hh 4 MB, out of L2; T 80) 1.93x against 1.76x,
    // with 7 barriers per step instead of 165.
    enum class Split { None, Batch, Hidden };
    Split recurrence_split(const Team& tm, int Bn, int& parts) const {
        parts = 1;
        if (!tm.split((double)Bn * cfg_.hidden * cfg_.gates(), kParStep)) return Split::None;
        if (cfg_.recurrence == 2 || Bn < 2) return Split::Hidden;
        if (cfg_.recurrence == 1) {
            parts = std::min(tm.nth, Bn);
            return Split::Batch;
        }
        const bool own_rows =
            own_recurrence(Bn) && (std::size_t)cfg_.hidden * cfg_.gates() * sizeof(T) <= kOwnBatchBytes;
        parts = std::min(tm.nth, Bn / (cfg_.bf16 ? kMinRowsBf16 : own_rows ? kMinRowsOwn : kMinRows));
        if (parts >= 2 && 2 * parts >= tm.nth) return Split::Batch;
        parts = 1;
        return Split::Hidden;
    }

    // One thread's part of a recurrence shared as recurrence_split says: rows [b0, b1) and
    // hidden units [k0, k1) of every step. Split by hidden units (`units`), every thread is
    // in every step and the team meets wherever a product reads the other threads' units
    // (sync); otherwise a part is whole rows, its own sequences, and never waits.
    struct Part {
        const Team* tm;
        int b0, b1, k0, k1, H;
        bool units;
        int rows() const { return b1 - b0; }
        void sync() const {
            if (units) tm->barrier();
        }
        // f(c, n) over this part's columns of `blocks` gate blocks (H columns each) from
        // column `first`: the blocks whole in one go, or each block's units [k0, k1).
        template <class F>
        void columns(int first, int blocks, F&& f) const {
            if (!units) {
                f(first, blocks * H);
                return;
            }
            if (k0 < k1)
                for (int q = 0; q < blocks; ++q) f(first + q * H + k0, k1 - k0);
        }
    };

    // A recurrence over Bn rows, shared by the team: body(part) on every thread that has a
    // part (each its own sequences; each its hidden units; or the leader alone), then one
    // barrier. The cells' forward and backward recurrences all run through it.
    template <class F>
    void recur(const Team& tm, int Bn, F&& body) const {
        int parts;
        const Split how = recurrence_split(tm, Bn, parts);
        const int H = cfg_.hidden;
        Part p{&tm, 0, Bn, 0, H, H, how == Split::Hidden};
        bool mine = tm.leader();
        if (how == Split::Batch) {  // this thread's sequences, start to end, no barrier
            tm.share_among(Bn, parts, p.b0, p.b1);
            mine = p.b0 < p.b1;
        } else if (p.units) {
            tm.share(H, (int)kAlign, p.k0, p.k1);
            mine = true;
        }
        if (mine) {
            if (Bn == 1 && !cfg_.bf16)
                narrow_loops(body, p);
            else
                body(p);
        }
        tm.barrier();
    }

    // body(p) with every loop it inlines vectorised 256 bits wide, as GCC tunes Intel's AVX-512
    // cores by default (the module is built with -mprefer-vector-width=512, CMakeLists.txt). A
    // recurrence of one row is OpenBLAS's 256-bit GEMV step after step, and there the wider loops
    // made the GRU's step 4% slower (Intel Xeon, family 6 model 167: 741 against 713 us).
    // (GCC on x86 only: elsewhere the body runs as it is.)
    template <class F>
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
    __attribute__((target("prefer-vector-width=256"), flatten, noinline))
#endif
    void narrow_loops(F& body, const Part& p) const {
        body(p);
    }

    void forward_layer(const Team& tm, const T* P, const Batch<T>& in, int l, int d) {
        const LayerSlots& sl = slot(l, d);
        LayerWs<T>& w = ws(l, d);
        const int Tn = in.T_, Bn = in.B, TB = Tn * Bn, H = cfg_.hidden, G = cfg_.gates();
        T* A = w.A.data();
        // A W_hh too big for L2 is repacked by every per-step product of the BLAS, and
        // OpenBLAS packs it 1.2-1.8x faster as a transposed operand (measured at 32 x 2048 x
        // 512); a single row goes to GEMV, which streams W_hh as it is. The engine's own
        // kernels (float32, bfloat16) pack W_hh once per pass, fastest as it is: for them the
        // transposed copy would only cost its pass (GRU 512, B 64, T 24 bfloat16: 2 ms a step)
        const bool own = own_recurrence(Bn);
        const bool transposed = !own && !cfg_.bf16 && !resident_ && Tn > 2 && !(Bn == 1 && has_gemv(T(0)));
        {
            PhaseScope ps(tm, kInputProj);
            if (l == 0 && cfg_.tokens) {  // x_t W_xh is the row gather W_xh[x_t]
                int lo, hi;
                tm.share_if((double)TB * G, kParRows, TB, 1, lo, hi);
                const T* W = P + sl.W_in;
                const std::int64_t* tok = in.tok;
                if (d == 1) {  // the reverse run's step s reads x_{T-1-s}
                    for (int r = lo; r < hi; ++r)
                        w.tokr[r] = in.tok[(std::size_t)(Tn - 1 - r / Bn) * Bn + r % Bn];
                    tok = w.tokr.data();
                }
                for (int r = lo; r < hi; ++r)
                    std::memcpy(A + (std::size_t)r * G, W + (std::size_t)tok[r] * G, sizeof(T) * G);
            } else {
                if (d == 1) {  // a time-reversed copy of the input rows
                    const T* X = l == 0 ? in.x : out_h(l - 1, Bn);
                    int lo, hi;
                    tm.share_if((double)TB * sl.din, kParRows, TB, 1, lo, hi);
                    for (int r = lo; r < hi; ++r)
                        std::memcpy(w.Xr.data() + (std::size_t)r * sl.din,
                                    X + ((std::size_t)(Tn - 1 - r / Bn) * Bn + r % Bn) * sl.din, sizeof(T) * sl.din);
                    tm.barrier();
                }
                pgemm(tm, false, false, TB, G, sl.din, T(1), layer_x(in, l, d), sl.din, P + sl.W_in, G, T(0), A, G);
            }
            if (tm.leader()) {  // the initial state (earlier, larger batches may have used this block)
                std::fill(w.Hs.begin(), w.Hs.begin() + (std::size_t)Bn * H, T(0));
                if (cfg_.kind == Kind::Lstm) std::fill(w.C.begin(), w.C.begin() + (std::size_t)Bn * H, T(0));
            }
            if (transposed) transpose(tm, P + sl.W_hh, H, G, w.WhhT);
            tm.barrier();
        }
        PhaseScope ps(tm, kRecurFwd);
        // bfloat16: every step multiplies by the same W_hh; this thread rounds and packs it once
        bf16::ReuseScope reuse(cfg_.bf16);
        f32::ReuseScope reuse32(own);  // float32 on the engine's kernel: W_hh packed once, likewise
        if (cfg_.kind == Kind::Gru) {
            gru_forward(tm, P, sl, w, Tn, Bn, transposed);
            return;
        }
        const T* Whh = P + sl.W_hh;
        const T* WhhT = w.WhhT.data();
        recur(tm, Bn, [&](const Part& p) {
            for (int t = 0; t < Tn; ++t) {
                const std::size_t r = (std::size_t)t * Bn + p.b0;
                if (t > 0) {
                    p.sync();  // the product reads every unit of h_{t-1}
                    const T* hprev = w.Hs.data() + r * H;
                    T* At = A + r * G;
                    p.columns(0, G / H, [&](int c, int n) {
                        if (transposed)
                            gemm(false, true, p.rows(), n, H, T(1), hprev, H, WhhT + (std::size_t)c * H, H, T(1),
                                 At + c, G);
                        else
                            gemm(false, false, p.rows(), n, H, T(1), hprev, H, Whh + c, G, T(1), At + c, G, resident_);
                    });
                }
                step_rows(P, sl, w, t, Bn, p.b0, p.b1, p.k0, p.k1);
            }
        });
    }

    void step_rows(const T* P, const LayerSlots& sl, LayerWs<T>& w, int t, int Bn, int b0, int b1, int k0, int k1) {
        if (cfg_.kind == Kind::Elman)
            elman_step(P, sl, w, t, Bn, b0, b1, k0, k1);
        else
            lstm_step(P, sl, w, t, Bn, b0, b1, k0, k1);
    }

    // out (cols x rows) = in (rows x cols)^T, in 32 x 32 tiles, rows split over the team.
    void transpose(const Team& tm, const T* in, int rows, int cols, Buf<T>& out) {
        int r0, r1;
        tm.share_if((double)rows * cols, kParRows, rows, 32, r0, r1);
        if (r0 >= r1) return;
        constexpr int W = 32;
        for (int i = r0; i < r1; i += W)
            for (int j = 0; j < cols; j += W)
                for (int a = i; a < std::min(i + W, r1); ++a)
                    for (int b = j; b < std::min(j + W, cols); ++b)
                        out[(std::size_t)b * rows + a] = in[(std::size_t)a * cols + b];
    }

    void elman_step(const T* P, const LayerSlots& sl, LayerWs<T>& w, int t, int Bn, int b0, int b1, int k0, int k1) {
        const int H = cfg_.hidden;
        const T* bias = opt(P, sl.b);
        const Act act = cfg_.act;
        for (int b = b0; b < b1; ++b) {
            const T* a = w.A.data() + ((std::size_t)t * Bn + b) * H;
            T* h = w.Hs.data() + ((std::size_t)(t + 1) * Bn + b) * H;
            if (act == Act::Tanh) {
#pragma omp simd
                for (int k = k0; k < k1; ++k) h[k] = vtanh(a[k] + bias[k]);
            } else if (act == Act::Relu) {
#pragma omp simd
                for (int k = k0; k < k1; ++k) {
                    T v = a[k] + bias[k];
                    h[k] = v > T(0) ? v : T(0);
                }
            } else {
#pragma omp simd
                for (int k = k0; k < k1; ++k) h[k] = vsigmoid(a[k] + bias[k]);
            }
        }
    }

    void lstm_step(const T* P, const LayerSlots& sl, LayerWs<T>& w, int t, int Bn, int b0, int b1, int k0, int k1) {
        const int H = cfg_.hidden, G = 4 * H;
        const T* bias = opt(P, sl.b);
        const T *bi = bias, *bf = bias + H, *bg = bias + 2 * H, *bo = bias + 3 * H;
        const T *pi = opt(P, sl.p_i), *pf = opt(P, sl.p_f), *po = opt(P, sl.p_o);
        for (int b = b0; b < b1; ++b) {
            const std::size_t r = (std::size_t)t * Bn + b;
            T* a = w.A.data() + r * G;
            const T* cp = w.C.data() + r * H;
            T* cn = w.C.data() + (r + Bn) * H;
            T* tc = w.TC.data() + r * H;
            T* h = w.Hs.data() + (r + Bn) * H;
#pragma omp simd
            for (int k = k0; k < k1; ++k) {
                T i = vsigmoid(a[k] + bi[k] + pi[k] * cp[k]);
                T f = vsigmoid(a[H + k] + bf[k] + pf[k] * cp[k]);
                T g = vtanh(a[2 * H + k] + bg[k]);
                T c = f * cp[k] + i * g;
                T o = vsigmoid(a[3 * H + k] + bo[k] + po[k] * c);
                T th = vtanh(c);
                a[k] = i;
                a[H + k] = f;
                a[2 * H + k] = g;
                a[3 * H + k] = o;
                cn[k] = c;
                tc[k] = th;
                h[k] = o * th;
            }
        }
    }

    // The GRU over all steps: one recurrent product per step, h_{t-1} W_hh for r, z and n
    // at once into U; reset before takes r, z from it first, then (r * h_{t-1}) W_hn once
    // r is known: a second product. Shared like the other cells (batch rows without a
    // barrier, or hidden units with one barrier per step, two for reset before).
    void gru_forward(const Team& tm, const T* P, const LayerSlots& sl, LayerWs<T>& w, int Tn, int Bn,
                     bool transposed) {
        const int H = cfg_.hidden, G = 3 * H;
        const bool after = cfg_.reset_after;
        const T* Whh = P + sl.W_hh;
        const T* WhhT = w.WhhT.data();
        T* U = w.U.data();
        // Uo[rows, c0 : c0 + n] = X (rows x H) W_hh[:, c0 : c0 + n]
        auto product = [&](int rows, int c0, int n, const T* X, T* Uo) {
            if (transposed)
                gemm(false, true, rows, n, H, T(1), X, H, WhhT + (std::size_t)c0 * H, H, T(0), Uo + c0, G);
            else
                gemm(false, false, rows, n, H, T(1), X, H, Whh + c0, G, T(0), Uo + c0, G, resident_);
        };
        recur(tm, Bn, [&](const Part& p) {
            T* Ub = U + (std::size_t)p.b0 * G;
            for (int t = 0; t < Tn; ++t) {
                const std::size_t r = (std::size_t)t * Bn + p.b0;
                if (t > 0) {
                    p.sync();  // the product reads every unit of h_{t-1}
                    p.columns(0, after ? 3 : 2, [&](int c, int n) { product(p.rows(), c, n, w.Hs.data() + r * H, Ub); });
                }
                gru_gates(P, sl, w, t, Bn, p.b0, p.b1, p.k0, p.k1);
                if (!after) {
                    if (t > 0) {
                        p.sync();  // the product needs every unit's r * h_{t-1}
                        p.columns(2 * H, 1, [&](int c, int n) { product(p.rows(), c, n, w.UN.data() + r * H, Ub); });
                    }
                    gru_finish(P, sl, w, t, Bn, p.b0, p.b1, p.k0, p.k1);
                }
            }
        });
    }

    // r and z of step t (U holds h_{t-1} W_hh; at t = 0 it is zero); reset after also n and
    // h_t, keeping u_n + b_hn; reset before keeps r * h_{t-1} for the second product.
    void gru_gates(const T* P, const LayerSlots& sl, LayerWs<T>& w, int t, int Bn, int b0, int b1, int k0, int k1) {
        const int H = cfg_.hidden, G = 3 * H;
        const T* bias = opt(P, sl.b);
        const T *br = bias, *bz = bias + H, *bn = bias + 2 * H, *bhn = opt(P, sl.b_hn);
        for (int b = b0; b < b1; ++b) {
            const std::size_t r = (std::size_t)t * Bn + b;
            T* a = w.A.data() + r * G;
            const T* u = t > 0 ? w.U.data() + (std::size_t)b * G : zeros_.data();
            const T* hp = w.Hs.data() + r * H;
            T* h = w.Hs.data() + (r + Bn) * H;
            T* x = w.UN.data() + r * H;
            if (cfg_.reset_after) {
#pragma omp simd
                for (int k = k0; k < k1; ++k) {
                    const T rr = vsigmoid(a[k] + br[k] + u[k]);
                    const T zz = vsigmoid(a[H + k] + bz[k] + u[H + k]);
                    const T un = u[2 * H + k] + bhn[k];
                    const T nn = vtanh(a[2 * H + k] + bn[k] + rr * un);
                    a[k] = rr;
                    a[H + k] = zz;
                    a[2 * H + k] = nn;
                    x[k] = un;
                    h[k] = (T(1) - zz) * nn + zz * hp[k];
                }
            } else {
#pragma omp simd
                for (int k = k0; k < k1; ++k) {
                    const T rr = vsigmoid(a[k] + br[k] + u[k]);
                    a[k] = rr;
                    a[H + k] = vsigmoid(a[H + k] + bz[k] + u[H + k]);
                    x[k] = rr * hp[k];
                }
            }
        }
    }

    // Reset before: n and h_t once U holds (r * h_{t-1}) W_hn.
    void gru_finish(const T* P, const LayerSlots& sl, LayerWs<T>& w, int t, int Bn, int b0, int b1, int k0, int k1) {
        const int H = cfg_.hidden, G = 3 * H;
        const T* bn = opt(P, sl.b) + (sl.b == kNone ? 0 : 2 * H);
        for (int b = b0; b < b1; ++b) {
            const std::size_t r = (std::size_t)t * Bn + b;
            T* a = w.A.data() + r * G;
            const T* u = t > 0 ? w.U.data() + (std::size_t)b * G : zeros_.data();
            const T* hp = w.Hs.data() + r * H;
            T* h = w.Hs.data() + (r + Bn) * H;
#pragma omp simd
            for (int k = k0; k < k1; ++k) {
                const T nn = vtanh(a[2 * H + k] + bn[k] + u[2 * H + k]);
                const T zz = a[H + k];
                a[2 * H + k] = nn;
                h[k] = (T(1) - zz) * nn + zz * hp[k];
            }
        }
    }

    // Per row: loss, and dL/dz = (softmax - onehot) / B or (out - y) / B (* (1 - out^2) for tanh);
    // inference writes the outputs instead.
    void head(const Team& tm, const T* P, const Batch<T>& in, bool train, T inv_b, T* Z) {
        const int TB = in.T_ * in.B, O = cfg_.output_size;
        int lo, hi;
        tm.share_if((double)TB * O, kParRows, TB, 1, lo, hi);
        const T* by = opt(P, lay_.b_y);
        for (int r = lo; r < hi; ++r) {
            T* z = Z + (std::size_t)r * O;
            if (cfg_.head == Head::Softmax) {
                if (lay_.b_y != kNone) {
#pragma omp simd
                    for (int k = 0; k < O; ++k) z[k] += by[k];
                }
                const T m = row_max(z, O);
                const std::int64_t y = in.lab ? in.lab[r] : 0;
                const T zy = z[y];
                T sum = 0;
#pragma omp simd reduction(+ : sum)
                for (int k = 0; k < O; ++k) {
                    z[k] = vexp(z[k] - m);
                    sum += z[k];
                }
                if (train) {
                    row_loss_[r] = (double)m + std::log((double)sum) - (double)zy;
                    const T scale = inv_b / sum;
#pragma omp simd
                    for (int k = 0; k < O; ++k) z[k] *= scale;
                    z[y] -= inv_b;
                } else {
                    const T scale = T(1) / sum;
#pragma omp simd
                    for (int k = 0; k < O; ++k) z[k] *= scale;
                }
            } else {
                const T* y = in.y ? in.y + (std::size_t)r * O : zeros_.data();
                const bool th = cfg_.out_tanh;
                T l = 0;
#pragma omp simd reduction(+ : l)
                for (int k = 0; k < O; ++k) {
                    T v = z[k] + by[k];
                    T out = th ? vtanh(v) : v;
                    T diff = out - y[k];
                    l += diff * diff;
                    z[k] = train ? diff * inv_b * (th ? T(1) - out * out : T(1)) : out;
                }
                row_loss_[r] = 0.5 * (double)l;
            }
        }
    }

    // The gradient (M x N, rows `ldc` apart; 0: N) of the parameter block at `off`.
    void grad_gemm(const Team& tm, const Sink<T>& s, std::size_t off, bool ta, bool tb, int M, int N, int K,
                   const T* A, int lda, const T* B, int ldb, int ldc = 0) {
        if (ldc == 0) ldc = N;
        if (!s.fused()) {
            pgemm(tm, ta, tb, M, N, K, T(1), A, lda, B, ldb, T(0), s.G + off, ldc);
        } else if (K <= kFuseDepth) {
            pgemm(tm, ta, tb, M, N, K, -s.lr, A, lda, B, ldb, T(1), s.P + off, ldc);
        } else {  // one rounding at the size of the weight, not one per panel of K
            // each thread updates the very block it computed into the weight's own scratch:
            // no barrier before the update, none after it
            T* g = scratch_.data() + off;
            int r0, r1, c0, c1;
            gemm_block(tm, M, N, K, r0, r1, c0, c1);
            block_gemm(ta, tb, r0, r1, c0, c1, K, T(1), A, lda, B, ldb, T(0), g, ldc);
            T* p = s.P + off;
            const T lr = s.lr;
            for (int r = r0; r < r1; ++r) {
                T* pr = p + (std::size_t)r * ldc;
                const T* gr = g + (std::size_t)r * ldc;
#pragma omp simd
                for (int c = c0; c < c1; ++c) pr[c] -= lr * gr[c];
            }
        }
    }

    void put(const Sink<T>& s, std::size_t off, int k, T v) {
        if (s.fused())
            s.P[off + k] -= s.lr * v;
        else
            s.G[off + k] = v;
    }

    // Column sums of X (n x cols, rows `ld` apart; 0: cols): the bias gradients.
    void colsum(const Team& tm, const Sink<T>& s, std::size_t off, const T* X, int n, int cols, int ld = 0) {
        if (ld == 0) ld = cols;
        int c0, c1;
        tm.share_if((double)n * cols, kParRows, cols, (int)kAlign, c0, c1);
        if (c0 >= c1) return;
        constexpr int W = 256;
        T acc[W];
        for (int c = c0; c < c1; c += W) {
            const int m = std::min(W, c1 - c);
            std::fill(acc, acc + m, T(0));
            for (int r = 0; r < n; ++r) {
                const T* x = X + (std::size_t)r * ld + c;
#pragma omp simd
                for (int k = 0; k < m; ++k) acc[k] += x[k];
            }
            for (int k = 0; k < m; ++k) put(s, off, c + k, acc[k]);
        }
    }

    // Peephole gradients: sum over rows of dai * c_prev, daf * c_prev, dao * c.
    void peephole_sums(const Team& tm, const Sink<T>& s, const LayerSlots& sl, const LayerWs<T>& w, int Bn, int R0,
                       int n) {
        const int H = cfg_.hidden, G = 4 * H;
        int c0, c1;
        tm.share_if((double)n * H, kParRows, H, (int)kAlign, c0, c1);
        if (c0 >= c1) return;
        constexpr int W = 128;
        T ai[W], af[W], ao[W];
        for (int c = c0; c < c1; c += W) {
            const int m = std::min(W, c1 - c);
            std::fill(ai, ai + m, T(0));
            std::fill(af, af + m, T(0));
            std::fill(ao, ao + m, T(0));
            for (int r = R0; r < R0 + n; ++r) {
                const T* da = w.DA.data() + (std::size_t)r * G + c;
                const T* cp = w.C.data() + (std::size_t)r * H + c;
                const T* cn = w.C.data() + (std::size_t)(r + Bn) * H + c;
#pragma omp simd
                for (int k = 0; k < m; ++k) {
                    ai[k] += da[k] * cp[k];
                    af[k] += da[H + k] * cp[k];
                    ao[k] += da[3 * H + k] * cn[k];
                }
            }
            for (int k = 0; k < m; ++k) {
                put(s, sl.p_i, c + k, ai[k]);
                put(s, sl.p_f, c + k, af[k]);
                put(s, sl.p_o, c + k, ao[k]);
            }
        }
    }

    // dW_xh for token input: scatter-add rows of DA into the rows x_t, split by columns.
    // `record`: note the rows (once per step: both directions of a layer read the same tokens).
    void token_scatter(const Team& tm, const Sink<T>& s, std::size_t off, const std::int64_t* tok, const T* DA, int n,
                       int G, bool record) {
        if (!s.fused() && record && tm.leader()) {  // the distinct rows touched, to clip, update and re-zero later
            ++gen_;
            for (int r = 0; r < n; ++r)
                if (mark_[tok[r]] != gen_) {
                    mark_[tok[r]] = gen_;
                    touched_.push_back(tok[r]);
                }
        }
        int c0, c1;
        tm.share_if((double)n * G, kParRows, G, (int)kAlign, c0, c1);
        if (c0 >= c1) return;
        for (int r = 0; r < n; ++r) {
            const T* d = DA + (std::size_t)r * G;
            if (s.fused()) {
                T* p = s.P + off + (std::size_t)tok[r] * G;
                const T lr = s.lr;
#pragma omp simd
                for (int k = c0; k < c1; ++k) p[k] -= lr * d[k];
            } else {
                T* g = s.G + off + (std::size_t)tok[r] * G;
#pragma omp simd
                for (int k = c0; k < c1; ++k) g[k] += d[k];
            }
        }
    }

    // The O(T) backward of one layer over steps t1 = T-1 down to t0 (h_{t0-1} held constant),
    // shared like the forward recurrence.
    void window_backward(const Team& tm, const T* P, const Batch<T>& in, int l, int d, int t0) {
        bf16::ReuseScope reuse(cfg_.bf16);  // W_hh is read, never written, until the layer's update
        f32::ReuseScope reuse32(own_recurrence(in.B));
        if (cfg_.kind == Kind::Gru) {
            gru_window_backward(tm, P, in, l, d, t0);
            return;
        }
        const LayerSlots& sl = slot(l, d);
        LayerWs<T>& w = ws(l, d);
        const int Tn = in.T_, Bn = in.B, H = cfg_.hidden, G = cfg_.gates();
        const bool lstm = cfg_.kind == Kind::Lstm;
        const T* Whh = P + sl.W_hh;
        T *DH = w.DH.data(), *DA = w.DA.data();
        recur(tm, Bn, [&](const Part& p) {
            const int nb = p.rows(), k0 = p.k0, k1 = p.k1;
            T* dc = w.dc.data() + (std::size_t)p.b0 * H;  // this part's rows of the LSTM's dc carry
            if (lstm)
                for (int j = 0; j < nb; ++j) std::fill(dc + (std::size_t)j * H + k0, dc + (std::size_t)j * H + k1, T(0));
            for (int t = Tn - 1; t >= t0; --t) {
                const std::size_t r = (std::size_t)t * Bn + p.b0;
                if (lstm)
                    lstm_back_rows(P, sl, w, r, nb, Bn, DH + r * H, nullptr, dc, dc, 0, DA + r * G, nullptr, false, k0,
                                   k1);
                else
                    elman_back_rows(w, r, nb, Bn, DH + r * H, nullptr, DA + r * G, nullptr, false, k0, k1);
                if (t > t0) {
                    p.sync();  // the product needs every unit's dL/da_t
                    // dL/dh_{t-1} += dL/da_t W_hh^T, this part's rows and units
                    if (k0 < k1)
                        gemm(false, true, nb, k1 - k0, G, T(1), DA + r * G, G, Whh + (std::size_t)k0 * G, G, T(1),
                             DH + (r - Bn) * H + k0, H, resident_);
                }
            }
        });
    }

    // The GRU's O(T) backward of one layer direction over steps T-1 down to t0, shared like
    // its forward. Per step one product dL/du_t W_hh^T (reset after) carries to h_{t-1};
    // reset before first takes dL/d(r * h_{t-1}) = da_n W_hn^T (r's gradient needs it),
    // then carries [da_r, da_z] W_hrz^T.
    void gru_window_backward(const Team& tm, const T* P, const Batch<T>& in, int l, int d, int t0) {
        const LayerSlots& sl = slot(l, d);
        LayerWs<T>& w = ws(l, d);
        const int Tn = in.T_, Bn = in.B, H = cfg_.hidden, G = 3 * H;
        const bool after = cfg_.reset_after;
        const T* Whh = P + sl.W_hh;
        T *DH = w.DH.data(), *DA = w.DA.data(), *DU = after ? w.DU.data() : nullptr, *U = w.U.data();
        // the rows that multiply W_hh^T into the carry: du (reset after), or da's r, z blocks
        const T* RG = after ? DU : DA;
        const int KG = after ? G : 2 * H;
        recur(tm, Bn, [&](const Part& p) {
            const int nb = p.rows(), k0 = p.k0, k1 = p.k1;
            T* drh = U + (std::size_t)p.b0 * G;  // reset before: this part's rows of dL/d(r * h_{t-1})
            for (int t = Tn - 1; t >= t0; --t) {
                const std::size_t r = (std::size_t)t * Bn + p.b0;
                T* co = t > t0 ? DH + r * H : nullptr;  // h_{t-1}'s rows, Bn back
                gru_back_a(w, r, nb, DH + r * H, nullptr, co, Bn, true, DA + r * G, after ? DU + r * G : nullptr, k0,
                           k1);
                if (!after) {
                    p.sync();  // the product needs every unit's da_n
                    if (k0 < k1)
                        gemm(false, true, nb, k1 - k0, H, T(1), DA + r * G + 2 * H, G,
                             Whh + (std::size_t)k0 * G + 2 * H, G, T(0), drh + k0, G);
                    gru_back_b(w, r, nb, drh, G, DA + r * G, co, Bn, k0, k1);
                }
                if (t > t0) {
                    p.sync();  // the product needs every unit's dL/da_t
                    // dL/dh_{t-1} += (du_t or [da_r, da_z]) W_hh^T, this part's rows and units
                    if (k0 < k1)
                        gemm(false, true, nb, k1 - k0, KG, T(1), RG + r * G, G, Whh + (std::size_t)k0 * G, G, T(1),
                             DH + (r - Bn) * H + k0, H, resident_);
                }
            }
        });
    }

    // GRU dL/da for n rows from row r0 of the forward state, units [k0, k1): dh = in + carry.
    // Writes da = [da_r, da_z, da_n] (reset before: da_r comes in gru_back_b) and, reset
    // after, du = [da_r, da_z, r * da_n], the gradient of h_{t-1} W_hh + [0, 0, b_hn]. The
    // direct part of the carry to step s-1, dh * z, goes to row j - shift of co (added to
    // it when `add`); none leaves step 0 or when co is null.
    void gru_back_a(LayerWs<T>& w, std::size_t r0, int n, const T* in, const T* carry, T* co, int shift, bool add,
                    T* da_out, T* du_out, int k0, int k1) {
        const int H = cfg_.hidden, G = 3 * H;
        const bool after = cfg_.reset_after;
        for (int j = 0; j < n; ++j) {
            const std::size_t r = r0 + j;
            const T* a = w.A.data() + r * G;
            const T* hp = w.Hs.data() + r * H;
            const T* un = w.UN.data() + r * H;
            const T* dh = in ? in + (std::size_t)j * H : zeros_.data();
            const T* ch = carry ? carry + (std::size_t)j * H : zeros_.data();
            T* da = da_out + (std::size_t)j * G;
            if (after) {
                T* du = du_out + (std::size_t)j * G;
#pragma omp simd
                for (int k = k0; k < k1; ++k) {
                    const T rr = a[k], zz = a[H + k], nn = a[2 * H + k];
                    const T g = dh[k] + ch[k];
                    const T dan = g * (T(1) - zz) * (T(1) - nn * nn);
                    const T daz = g * (hp[k] - nn) * zz * (T(1) - zz);
                    const T dar = dan * un[k] * rr * (T(1) - rr);
                    da[k] = dar;
                    da[H + k] = daz;
                    da[2 * H + k] = dan;
                    du[k] = dar;
                    du[H + k] = daz;
                    du[2 * H + k] = dan * rr;
                }
            } else {
#pragma omp simd
                for (int k = k0; k < k1; ++k) {
                    const T zz = a[H + k], nn = a[2 * H + k];
                    const T g = dh[k] + ch[k];
                    da[H + k] = g * (hp[k] - nn) * zz * (T(1) - zz);
                    da[2 * H + k] = g * (T(1) - zz) * (T(1) - nn * nn);
                }
            }
            if (co && (std::ptrdiff_t)r - shift >= 0) {
                T* c = co + ((std::ptrdiff_t)j - shift) * H;
                if (add) {
#pragma omp simd
                    for (int k = k0; k < k1; ++k) c[k] += (dh[k] + ch[k]) * a[H + k];
                } else {
#pragma omp simd
                    for (int k = k0; k < k1; ++k) c[k] = (dh[k] + ch[k]) * a[H + k];
                }
            }
        }
    }

    // GRU reset before, once drh = dL/d(r * h_{t-1}) (rows `ldd` apart) is known: da_r, and
    // drh * r added to the carry (as in gru_back_a).
    void gru_back_b(LayerWs<T>& w, std::size_t r0, int n, const T* drh, int ldd, T* da_out, T* co, int shift, int k0,
                    int k1) {
        const int H = cfg_.hidden, G = 3 * H;
        for (int j = 0; j < n; ++j) {
            const std::size_t r = r0 + j;
            const T* a = w.A.data() + r * G;
            const T* hp = w.Hs.data() + r * H;
            const T* dr = drh + (std::size_t)j * ldd;
            T* da = da_out + (std::size_t)j * G;
#pragma omp simd
            for (int k = k0; k < k1; ++k) da[k] = dr[k] * hp[k] * a[k] * (T(1) - a[k]);
            if (co && (std::ptrdiff_t)r - shift >= 0) {
                T* c = co + ((std::ptrdiff_t)j - shift) * H;
#pragma omp simd
                for (int k = k0; k < k1; ++k) c[k] += dr[k] * a[k];
            }
        }
    }

    // GRU truncated K < T-1, laid out as lagged_backward. The carry to the next lag is built
    // in CD (its direct part per row, then the product) and swapped into CH.
    void gru_lagged_backward(const Team& tm, const T* P, const Batch<T>& in) {
        const int Tn = in.T_, Bn = in.B, H = cfg_.hidden, G = 3 * H, K = cfg_.k;
        const bool after = cfg_.reset_after;
        for (int j = 0; j <= K && j < Tn; ++j) {
            const int nS = Tn - j, n = nS * Bn;
            for (int l = cfg_.layers - 1; l >= 0; --l) {
                const LayerSlots& sl = lay_.layers[l];
                LayerWs<T>& w = L_[l];
                const bool top = l == cfg_.layers - 1;
                const T* input = top && j > 0 ? nullptr : w.DH.data();
                const T* carry = j > 0 ? w.CH.data() : nullptr;
                T *DAj = w.DAj.data(), *DUj = w.DUj.data(), *CD = w.CD.data();
                int lo, hi;
                tm.share_if((double)n * G, kParRows, n, 1, lo, hi);
                // this lag's rows into the sums over windows
                auto sum = [&](const T* src, T* dst) {
                    for (int r = lo; r < hi; ++r) {
                        const T* x = src + (std::size_t)r * G;
                        T* y = dst + (std::size_t)r * G;
                        if (j > 0) {
#pragma omp simd
                            for (int k = 0; k < G; ++k) y[k] += x[k];
                        } else {
                            std::memcpy(y, x, sizeof(T) * G);
                        }
                    }
                };
                const std::size_t o = (std::size_t)lo;
                if (lo < hi) {
                    gru_back_a(w, o, hi - lo, input ? input + o * H : nullptr, carry ? carry + o * H : nullptr,
                               CD + o * H, Bn, false, DAj + o * G, after ? DUj + o * G : nullptr, 0, H);
                    if (after) {
                        sum(DAj, w.DA.data());
                        sum(DUj, w.DU.data());
                    }
                }
                if (!after) {
                    tm.barrier();
                    // dL/d(r * h) = da_n W_hn^T for every row of the lag
                    pgemm(tm, false, true, n, H, H, T(1), DAj + 2 * H, G, P + sl.W_hh + 2 * H, G, T(0), DUj, H);
                    tm.barrier();
                    if (lo < hi) {
                        gru_back_b(w, o, hi - lo, DUj + o * H, H, DAj + o * G, CD + o * H, Bn, 0, H);
                        sum(DAj, w.DA.data());
                    }
                }
                tm.barrier();
                if (j < K && nS > 1)  // the carry's product part, to step s-1 of the same windows
                    pgemm(tm, false, true, (nS - 1) * Bn, H, after ? G : 2 * H, T(1),
                          (after ? DUj : DAj) + (std::size_t)Bn * G, G, P + sl.W_hh, G, T(1), CD, H);
                if (l > 0)
                    pgemm(tm, false, true, n, H, G, T(1), DAj, G, P + sl.W_in, G, T(0), L_[l - 1].DH.data(), H);
                tm.barrier();
                if (tm.leader()) std::swap(w.CH, w.CD);
                tm.barrier();
            }
        }
    }

    // dL/da for n rows starting at row r0 of the forward state: dh = in + carry.
    void elman_back_rows(LayerWs<T>& w, std::size_t r0, int n, int Bn, const T* in, const T* carry, T* da_out,
                         T* da_sum, bool accumulate, int k0, int k1) {
        const int H = cfg_.hidden;
        const Act act = cfg_.act;
        for (int j = 0; j < n; ++j) {
            const T* h = w.Hs.data() + (r0 + j + Bn) * H;
            const T* dh = in ? in + (std::size_t)j * H : zeros_.data();
            const T* ch = carry ? carry + (std::size_t)j * H : zeros_.data();
            T* da = da_out + (std::size_t)j * H;
            if (act == Act::Tanh) {
#pragma omp simd
                for (int k = k0; k < k1; ++k) da[k] = (dh[k] + ch[k]) * (T(1) - h[k] * h[k]);
            } else if (act == Act::Relu) {
#pragma omp simd
                for (int k = k0; k < k1; ++k) da[k] = h[k] > T(0) ? dh[k] + ch[k] : T(0);
            } else {
#pragma omp simd
                for (int k = k0; k < k1; ++k) da[k] = (dh[k] + ch[k]) * h[k] * (T(1) - h[k]);
            }
            if (da_sum) {
                T* s = da_sum + (std::size_t)j * H;
                if (accumulate) {
#pragma omp simd
                    for (int k = k0; k < k1; ++k) s[k] += da[k];
                } else {
#pragma omp simd
                    for (int k = k0; k < k1; ++k) s[k] = da[k];
                }
            }
        }
    }

    // LSTM dL/da for n rows from row r0: dh = in + carry, dc = dc_in; writes dc carried to
    // the step before into dc_out, rows shifted back by `shift` (0 for the in-place carry).
    void lstm_back_rows(const T* P, const LayerSlots& sl, LayerWs<T>& w, std::size_t r0, int n, int Bn, const T* in,
                        const T* carry, const T* dc_in, T* dc_out, int shift, T* da_out, T* da_sum, bool accumulate,
                        int k0, int k1) {
        const int H = cfg_.hidden, G = 4 * H;
        const T *pi = opt(P, sl.p_i), *pf = opt(P, sl.p_f), *po = opt(P, sl.p_o);
        for (int j = 0; j < n; ++j) {
            const std::size_t r = r0 + j;
            const T* a = w.A.data() + r * G;
            const T* cp = w.C.data() + r * H;
            const T* tc = w.TC.data() + r * H;
            const T* dh = in ? in + (std::size_t)j * H : zeros_.data();
            const T* ch = carry ? carry + (std::size_t)j * H : zeros_.data();
            const T* dci = dc_in ? dc_in + (std::size_t)j * H : zeros_.data();
            // the dc carried to step s-1; none leaves step 0
            T* dco = (std::ptrdiff_t)r - shift >= 0 ? dc_out + ((std::ptrdiff_t)j - shift) * H : nullptr;
            T* da = da_out + (std::size_t)j * G;
            if (dco) {
#pragma omp simd
                for (int k = k0; k < k1; ++k) {
                    const T i = a[k], f = a[H + k], g = a[2 * H + k], o = a[3 * H + k], th = tc[k];
                    const T d = dh[k] + ch[k];
                    const T dao = d * th * o * (T(1) - o);
                    const T dc = dci[k] + d * o * (T(1) - th * th) + dao * po[k];
                    const T dai = dc * g * i * (T(1) - i);
                    const T daf = dc * cp[k] * f * (T(1) - f);
                    da[k] = dai;
                    da[H + k] = daf;
                    da[2 * H + k] = dc * i * (T(1) - g * g);
                    da[3 * H + k] = dao;
                    dco[k] = dc * f + dai * pi[k] + daf * pf[k];
                }
            } else {
#pragma omp simd
                for (int k = k0; k < k1; ++k) {
                    const T i = a[k], f = a[H + k], g = a[2 * H + k], o = a[3 * H + k], th = tc[k];
                    const T d = dh[k] + ch[k];
                    const T dao = d * th * o * (T(1) - o);
                    const T dc = dci[k] + d * o * (T(1) - th * th) + dao * po[k];
                    da[k] = dc * g * i * (T(1) - i);
                    da[H + k] = dc * cp[k] * f * (T(1) - f);
                    da[2 * H + k] = dc * i * (T(1) - g * g);
                    da[3 * H + k] = dao;
                }
            }
            if (da_sum) {
                T* s = da_sum + (std::size_t)j * G;
                for (int q = 0; q < 4; ++q) {
                    if (accumulate) {
#pragma omp simd
                        for (int k = k0; k < k1; ++k) s[q * H + k] += da[q * H + k];
                    } else {
#pragma omp simd
                        for (int k = k0; k < k1; ++k) s[q * H + k] = da[q * H + k];
                    }
                }
            }
        }
    }

    // Truncated K < T-1: output t's gradient reaches steps t..t-K. All windows advance
    // together, one lag j at a time: at lag j window t sits at step s = t - j, so a
    // lag is (T-j)*B rows laid out like the forward state and its carry is one GEMM.
    // Layer l-1 takes layer l's dL/dx at the same window and lag, hence layers inside lags.
    void lagged_backward(const Team& tm, const T* P, const Batch<T>& in) {
        const int Tn = in.T_, Bn = in.B, H = cfg_.hidden, G = cfg_.gates(), K = cfg_.k;
        const bool lstm = cfg_.kind == Kind::Lstm;
        for (int j = 0; j <= K && j < Tn; ++j) {
            const int nS = Tn - j, n = nS * Bn;
            for (int l = cfg_.layers - 1; l >= 0; --l) {
                const LayerSlots& sl = lay_.layers[l];
                LayerWs<T>& w = L_[l];
                const bool top = l == cfg_.layers - 1;
                const T* input = top && j > 0 ? nullptr : w.DH.data();
                const T* carry = j > 0 ? w.CH.data() : nullptr;
                int lo, hi;
                tm.share_if((double)n * G, kParRows, n, 1, lo, hi);
                if (lo < hi) {
                    const std::size_t o = (std::size_t)lo;
                    if (lstm)
                        lstm_back_rows(P, sl, w, o, hi - lo, Bn, input ? input + o * H : nullptr,
                                       carry ? carry + o * H : nullptr, j > 0 ? w.DC0.data() + o * H : nullptr,
                                       w.DC1.data() + o * H, Bn, w.DAj.data() + o * G, w.DA.data() + o * G, j > 0, 0,
                                       H);
                    else
                        elman_back_rows(w, o, hi - lo, Bn, input ? input + o * H : nullptr,
                                        carry ? carry + o * H : nullptr, w.DAj.data() + o * G, w.DA.data() + o * G,
                                        j > 0, 0, H);
                }
                tm.barrier();
                if (j < K && nS > 1)  // carry to step s-1 of the same windows: rows shift back by B
                    pgemm(tm, false, true, (nS - 1) * Bn, H, G, T(1), w.DAj.data() + (std::size_t)Bn * G, G,
                          P + sl.W_hh, G, T(0), w.CH.data(), H);
                if (l > 0)
                    pgemm(tm, false, true, n, H, G, T(1), w.DAj.data(), G, P + sl.W_in, G, T(0), L_[l - 1].DH.data(),
                          H);
                tm.barrier();
                if (lstm && tm.leader()) std::swap(w.DC0, w.DC1);
                tm.barrier();
            }
        }
    }

    // Weight gradients of layer l from DA over steps t0..T-1 (and dL/dx for the layer below).
    // Weight gradients of layer l, direction d from DA over steps t0..T-1 (and dL/dx for the
    // layer below: its output gradient, or for a reverse direction the time-reversed DXr).
    void layer_grads(const Team& tm, const T* P, const Sink<T>& s, const Batch<T>& in, int l, int d, int t0,
                     bool want_dx) {
        const LayerSlots& sl = slot(l, d);
        LayerWs<T>& w = ws(l, d);
        const int Tn = in.T_, Bn = in.B, H = cfg_.hidden, G = cfg_.gates(), din = sl.din;
        const int R0 = t0 * Bn, n = (Tn - t0) * Bn;
        const T* DA = w.DA.data();
        if (want_dx) {  // before the fused update changes W_in
            T* dx = d == 1 ? w.DXr.data() : out_dh(l - 1);
            pgemm(tm, false, true, n, din, G, T(1), DA + (std::size_t)R0 * G, G, P + sl.W_in, G, T(0),
                  dx + (std::size_t)R0 * din, din);
            tm.barrier();
        }
        // dW_hh = sum_t h_{t-1}^T da_t; with t0 = 0 step 0 is skipped (h_{-1} = 0)
        const int ts = t0 == 0 ? 1 : t0;
        const std::size_t Rs = (std::size_t)ts * Bn;
        const int Ks = (Tn - ts) * Bn;
        if (cfg_.kind != Kind::Gru) {
            grad_gemm(tm, s, sl.W_hh, true, false, H, G, Ks, w.Hs.data() + Rs * H, H, DA + Rs * G, G);
        } else if (cfg_.reset_after) {  // dW_hh = sum_t h_{t-1}^T du_t
            grad_gemm(tm, s, sl.W_hh, true, false, H, G, Ks, w.Hs.data() + Rs * H, H, w.DU.data() + Rs * G, G);
        } else {  // dW_hrz = sum_t h_{t-1}^T [da_r, da_z], dW_hn = sum_t (r * h_{t-1})^T da_n
            grad_gemm(tm, s, sl.W_hh, true, false, H, 2 * H, Ks, w.Hs.data() + Rs * H, H, DA + Rs * G, G, G);
            grad_gemm(tm, s, sl.W_hh + 2 * H, true, false, H, H, Ks, w.UN.data() + Rs * H, H, DA + Rs * G + 2 * H, G,
                      G);
        }
        if (l == 0 && cfg_.tokens) {
            token_scatter(tm, s, sl.W_in, layer_tok(in, d) + R0, DA + (std::size_t)R0 * G, n, G, d == 0);
        } else {
            grad_gemm(tm, s, sl.W_in, true, false, din, G, n, layer_x(in, l, d) + (std::size_t)R0 * din, din,
                      DA + (std::size_t)R0 * G, G);
        }
        if (cfg_.bias) colsum(tm, s, sl.b, DA + (std::size_t)R0 * G, n, G);
        if (cfg_.bias && sl.b_hn != kNone)  // db_hn = sum_t r * da_n
            colsum(tm, s, sl.b_hn, w.DU.data() + (std::size_t)R0 * G + 2 * H, n, H, G);
        if (cfg_.peephole) peephole_sums(tm, s, sl, w, Bn, R0, n);
    }
};

// Chooses, per kind of call and (T, B) shape, between one thread and the whole team by
// timing both. Whether a team repays its barriers depends on whether the other cores
// are free at the moment, which no size threshold can know on a machine shared with
// other work: a thread taken off its core stalls every barrier of the step. It starts
// with kProbe tries of each; after that every call runs the choice with the lower
// running mean (exponentially weighted), and now and then a try of the other one lets
// the choice follow the load as it changes. A try is kBurst calls of which only the last
// counts, and it replaces the old mean of its choice: the first team call after a run
// of solo calls wakes sleeping threads whose caches lost the step's data, and counting
// it kept a tuner that had fallen back to one thread there (Elman 100 on two idle cores:
// 3.9 instead of 2.4 ms for rounds on end).
// While the team leads, its own calls show when load slows it, so one thread is tried
// only every kExploreMax calls (its time hardly depends on the other cores): a try costs
// up to the whole difference, 2x at Elman 512 on two threads, which a try every 10th
// call turned into a 10% slower step. While one thread leads, the team is tried after
// kExplore calls, then after twice as many each time the try confirms the lead.
class TeamTuner {
  public:
    static constexpr int kProbe = 2, kBurst = 2, kExplore = 10, kExploreMax = 160;

    int pick(int full, int Tn, int Bn) {
        if (full <= 1) return full;
        if (Tn != T_ || Bn != B_ || full != full_) {
            T_ = Tn, B_ = Bn, full_ = full;
            calls_ = since_ = 0, gap_ = kExplore, burst_ = 0, mean_[0] = mean_[1] = 0;
        }
        if (calls_ < 2 * kProbe * kBurst) return (calls_ / kBurst) % 2 == 0 ? full : 1;  // team, team, solo, solo, ...
        if (burst_ == 0 && since_ + 1 >= (best_team() ? (long)kExploreMax : gap_)) burst_ = kBurst;
        return best_team() != (burst_ > 0) ? full : 1;
    }

    void record(int used, std::int64_t ns) {
        if (full_ <= 1) return;
        const bool probing = calls_ < 2 * kProbe * kBurst;
        ++calls_;
        if (probing ? calls_ % kBurst != 0 : burst_ > 1) {  // a try's warming call: not counted
            if (!probing) --burst_;
            return;
        }
        const bool before = best_team();
        double& m = mean_[used == 1 ? 0 : 1];
        // a try's call replaces the mean it measures: that mean is as old as the last try
        m = m == 0 || (!probing && burst_ == 1) ? (double)ns : 0.7 * m + 0.3 * (double)ns;
        if (probing) return;
        if (burst_ == 0) {  // an ordinary call; when it overturns the choice, try the old one again soon
            ++since_;
            if (best_team() != before) gap_ = kExplore, since_ = 0;
            return;
        }
        burst_ = 0, since_ = 0;
        gap_ = best_team() == before ? std::min(2 * gap_, (long)kExploreMax) : (long)kExplore;
    }

  private:
    bool best_team() const { return mean_[1] < mean_[0]; }
    int T_ = -1, B_ = -1, full_ = 0, burst_ = 0;
    long calls_ = 0, since_ = 0, gap_ = kExplore;
    double mean_[2] = {0, 0};  // one thread, the team: running mean of a counted call's nanoseconds
};

// The network: shared parameters and one worker per thread (sync, async) or one
// worker for the whole team (default).
template <class T>
class Net {
  public:
    Net(const Config& cfg, Variant variant, int threads, int chunk = 1)
        : cfg_(cfg), lay_(cfg), variant_(variant), threads_(std::max(1, threads)), chunk_(std::max(1, chunk)) {
        P_.assign(lay_.total, T(0));
        int n = variant == Variant::Default ? 1 : threads_;
        for (int i = 0; i < n; ++i) workers_.push_back(std::make_unique<Worker<T>>(cfg_, lay_));
        if (cfg_.tokens) mark_.assign(cfg_.input_size, 0);
    }

    const Config& config() const { return cfg_; }
    const Layout& layout() const { return lay_; }
    T* params() { return P_.data(); }
    int threads() const { return threads_; }

    // Profiling on (counters cleared) or off; see Profile.
    void set_profiling(bool on) { prof_ = on ? std::make_unique<Profile>(threads_) : nullptr; }
    const Profile* profile() const { return prof_.get(); }

    void reserve(int Tn, int Bn) {
        if (variant_ == Variant::Default) {
            workers_[0]->ensure(Tn, Bn);
            return;
        }
        int nw = (int)workers_.size();
        for (int i = 0; i < nw; ++i) {
            int share = variant_ == Variant::Async ? std::min(chunk_, Bn) : (Bn + nw - 1) / nw;
            workers_[i]->ensure(Tn, std::max(1, share));
            workers_[i]->ensure_grads();
            if (variant_ == Variant::Async && workers_[i]->local().size() != P_.size()) workers_[i]->local() = P_;
        }
        workers_[0]->ensure(Tn, Bn);  // forward and loss_and_grads run the whole batch on worker 0
    }

    // Threads worth forking for a (T, B) step: all of them, or one for a small step.
    int team_size(int Tn, int Bn) const {
        if (threads_ == 1) return 1;
        const double TB = (double)Tn * Bn, H = cfg_.hidden, G = cfg_.gates(), O = cfg_.output_size;
        const double D = cfg_.tokens ? 0.0 : cfg_.input_size;
        const double largest = TB * std::max(O * H, G * std::max(H, D));
        const double scale = cfg_.split_scale;
        return largest >= kParTeam * scale || (double)Bn * H * G >= kParStep * scale ? threads_ : 1;
    }

    // Runs f(team) on the team size `tuner` picks out of `full` threads, and tells it the time.
    template <class F>
    void tuned_team(TeamTuner& tuner, int full, const Batch<T>& in, F&& f) {
        const int n = cfg_.adapt ? tuner.pick(full, in.T_, in.B) : full;
        const std::int64_t t0 = now_ns();
        run_team(n, cfg_.split_scale, prof_.get(), f);
        if (cfg_.adapt) tuner.record(n, now_ns() - t0);
    }

    // Inference outputs into out (T*B, O).
    void forward(const Batch<T>& in, T* out) {
        Worker<T>& w = *workers_[0];
        w.ensure(in.T_, in.B);
        tuned_team(tune_fwd_, team_size(in.T_, in.B), in,
                   [&](const Team& tm) { w.forward_head(tm, P_.data(), in, false, T(1), out); });
    }

    // Reported loss; gradients of the objective in `grads` (flat layout).
    double loss_and_grads(const Batch<T>& in, T* grads) {
        Worker<T>& w = *workers_[0];
        w.ensure(in.T_, in.B);
        std::fill(grads, grads + lay_.total, T(0));
        double total = 0;
        const T inv_b = T(1) / in.B;
        tuned_team(tune_grad_, team_size(in.T_, in.B), in, [&](const Team& tm) {
            double l = w.forward_head(tm, P_.data(), in, true, inv_b);
            if (tm.leader()) total = l;
            w.backward(tm, P_.data(), Sink<T>{nullptr, grads, T(0)}, in);
        });
        return total / ((double)in.T_ * in.B);
    }

    double sgd_step(const Batch<T>& in, T lr) {
        if (prof_) ++prof_->steps;
        double total = 0;
        // one sequence cannot be shared out: sync then runs like default (with B >= 2 it
        // keeps its own path even on one thread, so that conformance checks exercise it)
        if (variant_ == Variant::Default || (variant_ == Variant::Sync && in.B == 1)) total = step_default(in, lr);
        else if (variant_ == Variant::Sync) total = step_sync(in, lr);
        else total = step_async(in, lr);
        return total / ((double)in.T_ * in.B);
    }

  private:
    Config cfg_;
    Layout lay_;
    Variant variant_;
    int threads_, chunk_;
    Buf<T> P_;
    std::vector<std::unique_ptr<Worker<T>>> workers_;
    std::vector<int> mark_;
    std::vector<std::int64_t> rows_;
    int gen_ = 0;
    std::unique_ptr<Profile> prof_;
    TeamTuner tune_fwd_, tune_grad_, tune_step_;

    T clipped(T g) const {
        if (cfg_.clip > 0) {
            const T c = (T)cfg_.clip;
            g = g < -c ? -c : (g > c ? c : g);
        }
        return g;
    }

    // The token-input tables (layer 0's input weights, one per direction), in layout order.
    std::vector<std::size_t> token_tables() const {
        std::vector<std::size_t> out;
        if (cfg_.tokens)
            for (int d = 0; d < cfg_.dirs(); ++d) out.push_back(lay_.layers[d].W_in);
        return out;
    }
    std::size_t table_size() const { return (std::size_t)cfg_.input_size * cfg_.gates(); }

    // P -= lr * clip(sum of the workers' gradients) over [b, e), split over the team.
    void update_dense(const Team& tm, T* P, T* const* G, int nw, std::size_t b, std::size_t e, T lr) {
        int lo, hi;
        const std::size_t n = e - b, blocks = (n + kAlign - 1) / kAlign;
        tm.share((int)blocks, 1, lo, hi);
        const std::size_t i0 = b + (std::size_t)lo * kAlign, i1 = std::min(e, b + (std::size_t)hi * kAlign);
        if (i0 >= i1) return;
        const bool clip = cfg_.clip > 0;
        const T c = (T)cfg_.clip;
        if (nw == 1 && !clip) {
            const T* g = G[0];
#pragma omp simd
            for (std::size_t i = i0; i < i1; ++i) P[i] -= lr * g[i];
            return;
        }
#pragma omp simd
        for (std::size_t i = i0; i < i1; ++i) {
            T g = 0;
            for (int w = 0; w < nw; ++w) g += G[w][i];
            if (clip) g = g < -c ? -c : (g > c ? c : g);
            P[i] -= lr * g;
        }
    }

    // The token rows of a table at `off`: update the rows any worker touched, then re-zero them.
    void update_rows(const Team& tm, T* P, T* const* G, int nw, const std::vector<std::int64_t>& rows, T lr,
                     std::size_t off) {
        const int Gc = cfg_.gates();
        int c0, c1;
        tm.share(Gc, (int)kAlign, c0, c1);
        if (c0 >= c1) return;
        const bool clip = cfg_.clip > 0;
        const T c = (T)cfg_.clip;
        for (std::int64_t row : rows) {
            T* p = P + off + (std::size_t)row * Gc;
            for (int k = c0; k < c1; ++k) {
                T g = 0;
                for (int w = 0; w < nw; ++w) g += G[w][off + (std::size_t)row * Gc + k];
                if (clip) g = g < -c ? -c : (g > c ? c : g);
                p[k] -= lr * g;
            }
            for (int w = 0; w < nw; ++w) std::fill(G[w] + off + (std::size_t)row * Gc + c0, G[w] + off + (std::size_t)row * Gc + c1, T(0));
        }
    }

    void apply(const Team& tm, T* P, T* const* G, int nw, const std::vector<std::int64_t>& rows, T lr) {
        std::size_t at = 0;
        for (std::size_t tb : token_tables()) {
            update_dense(tm, P, G, nw, at, tb, lr);
            update_rows(tm, P, G, nw, rows, lr, tb);
            at = tb + table_size();
        }
        update_dense(tm, P, G, nw, at, lay_.total, lr);
    }

    double step_default(const Batch<T>& in, T lr) {
        Worker<T>& w = *workers_[0];
        w.ensure(in.T_, in.B);
        const bool fused = !(cfg_.clip > 0);
        if (fused) w.ensure_fuse_scratch();
        else w.ensure_grads();
        double total = 0;
        const T inv_b = T(1) / in.B;
        tuned_team(tune_step_, team_size(in.T_, in.B), in, [&](const Team& tm) {
            double l = w.forward_head(tm, P_.data(), in, true, inv_b);
            if (tm.leader()) total = l;
            if (fused) {
                w.backward(tm, P_.data(), Sink<T>{P_.data(), nullptr, lr}, in);
            } else {
                w.backward(tm, P_.data(), Sink<T>{nullptr, w.grads(), T(0)}, in);
                PhaseScope ps(tm, kUpdate);
                T* g[1] = {w.grads()};
                apply(tm, P_.data(), g, 1, w.touched(), lr);
                tm.barrier();
            }
        });
        return total;
    }

    // A worker's own contiguous copy of batch columns [b0, b1).
    struct Slice {
        Buf<T> x, y;
        std::vector<std::int64_t> tok, lab;
        Batch<T> batch;
    };
    std::vector<Slice> slices_;

    // Sizes a slice for up to n columns (outside parallel regions: it may allocate).
    void size_slice(const Batch<T>& in, int n, Slice& s) {
        const std::size_t rows = (std::size_t)in.T_ * n;
        if (in.tok) s.tok.resize(rows);
        else s.x.resize(rows * cfg_.input_size);
        if (in.lab) s.lab.resize(rows);
        else s.y.resize(rows * cfg_.output_size);
    }

    void fill_slice(const Batch<T>& in, int b0, int b1, Slice& s) {
        const int Tn = in.T_, Bn = in.B, n = b1 - b0, D = cfg_.input_size, O = cfg_.output_size;
        s.batch = Batch<T>{Tn, n};
        for (int t = 0; t < Tn; ++t) {
            const std::size_t src = (std::size_t)t * Bn + b0, dst = (std::size_t)t * n;
            if (in.tok) std::memcpy(&s.tok[dst], in.tok + src, sizeof(std::int64_t) * n);
            else std::memcpy(&s.x[dst * D], in.x + src * D, sizeof(T) * n * D);
            if (in.lab) std::memcpy(&s.lab[dst], in.lab + src, sizeof(std::int64_t) * n);
            else std::memcpy(&s.y[dst * O], in.y + src * O, sizeof(T) * n * O);
        }
        s.batch.tok = in.tok ? s.tok.data() : nullptr;
        s.batch.x = in.tok ? nullptr : s.x.data();
        s.batch.lab = in.lab ? s.lab.data() : nullptr;
        s.batch.y = in.lab ? nullptr : s.y.data();
    }

    // Synchronous data parallelism: each thread the gradient of its share of the
    // sequences into its own buffers, then one reduced update (the spec's SGD step).
    double step_sync(const Batch<T>& in, T lr) {
        const int nw = std::min((int)workers_.size(), in.B);
        slices_.resize(nw);
        std::vector<double> part(nw, 0.0);
        std::vector<T*> G(nw);
        for (int i = 0; i < nw; ++i) {
            const int b0 = (int)((long)in.B * i / nw), b1 = (int)((long)in.B * (i + 1) / nw);
            workers_[i]->ensure(in.T_, b1 - b0);
            workers_[i]->ensure_grads();
            size_slice(in, b1 - b0, slices_[i]);
            G[i] = workers_[i]->grads();
        }
        const T inv_b = T(1) / in.B;
        // the same nw slices whatever the team size, so the tuner changes no result
        tuned_team(tune_step_, nw, in, [&](const Team& tm) {
            const Team solo{0, 1, cfg_.split_scale, nullptr, tm.prof, tm.slot};
            for (int i = tm.tid; i < nw; i += tm.nth) {
                const int b0 = (int)((long)in.B * i / nw), b1 = (int)((long)in.B * (i + 1) / nw);
                fill_slice(in, b0, b1, slices_[i]);
                Worker<T>& w = *workers_[i];
                part[i] = w.forward_head(solo, P_.data(), slices_[i].batch, true, inv_b);
                w.backward(solo, P_.data(), Sink<T>{nullptr, w.grads(), T(0)}, slices_[i].batch);
            }
            PhaseScope ps(tm, kUpdate);
            tm.barrier();
            if (cfg_.tokens && tm.leader()) union_rows(nw);
            tm.barrier();
            apply(tm, P_.data(), G.data(), nw, rows_, lr);
        });
        double total = 0;
        for (double p : part) total += p;
        return total;
    }

    void union_rows(int nw) {
        rows_.clear();
        ++gen_;
        for (int i = 0; i < nw; ++i)
            for (std::int64_t r : workers_[i]->touched())
                if (mark_[r] != gen_) {
                    mark_[r] = gen_;
                    rows_.push_back(r);
                }
    }

    // Asynchronous parameter server (not the spec's SGD): each thread takes `chunk_`
    // sequences at a time, pulls the shared parameters into its local copy, computes
    // the gradient there and pushes `lr * g / B` back, all under one lock.
    double step_async(const Batch<T>& in, T lr) {
        const int nw = std::min((int)workers_.size(), in.B);
        slices_.resize(nw);
        std::vector<double> part(nw, 0.0);
        for (int i = 0; i < nw; ++i) {
            workers_[i]->ensure(in.T_, std::min(chunk_, in.B));
            workers_[i]->ensure_grads();
            size_slice(in, std::min(chunk_, in.B), slices_[i]);
            if (workers_[i]->local().size() != P_.size()) workers_[i]->local() = P_;
        }
        const T inv_b = T(1) / in.B;
        const std::vector<std::size_t> tables = token_tables();
        const int Gc = cfg_.gates();
        run_team(nw, cfg_.split_scale, prof_.get(), [&](const Team& tm) {
            const Team solo{0, 1, cfg_.split_scale, nullptr, tm.prof, tm.slot};
            for (int i = tm.tid; i < nw; i += tm.nth) {
                Worker<T>& w = *workers_[i];
                T* local = w.local().data();
                T* g = w.grads();
                const int s0 = (int)((long)in.B * i / nw), s1 = (int)((long)in.B * (i + 1) / nw);
                for (int b0 = s0; b0 < s1; b0 += chunk_) {
                    const int b1 = std::min(s1, b0 + chunk_);
                    Slice& sl = slices_[i];
                    fill_slice(in, b0, b1, sl);
#pragma omp critical(rnn_parameter_server)
                    {
                        std::size_t at = 0;
                        for (std::size_t tb : tables) {
                            std::memcpy(local + at, P_.data() + at, sizeof(T) * (tb - at));
                            for (std::int64_t tok : sl.tok)  // only the rows this chunk reads
                                std::memcpy(local + tb + (std::size_t)tok * Gc, P_.data() + tb + (std::size_t)tok * Gc,
                                            sizeof(T) * Gc);
                            at = tb + table_size();
                        }
                        std::memcpy(local + at, P_.data() + at, sizeof(T) * (lay_.total - at));
                    }
                    part[i] += w.forward_head(solo, local, sl.batch, true, inv_b);
                    w.backward(solo, local, Sink<T>{nullptr, g, T(0)}, sl.batch);
                    PhaseScope ps(tm, kUpdate);
#pragma omp critical(rnn_parameter_server)
                    {
                        T* gs[1] = {g};
                        apply(solo, P_.data(), gs, 1, w.touched(), lr);
                    }
                }
            }
        });
        double total = 0;
        for (double p : part) total += p;
        return total;
    }
};

}  // namespace rnn
