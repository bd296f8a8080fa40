// Packed B operands kept per thread across the per-step products of a recurrence, for the
// engine's own kernels: float32 panels (gemm_f32.hpp, Word = float) and bfloat16 pairs
// (gemm_bf16.hpp, Word = std::uint32_t), one cache per word type and thread.
//
// Every step of a recurrence multiplies by the same W_hh (forward) or W_hh^T (the
// backward's carry), or by the same column blocks of it when the team splits the hidden
// units. While a ReuseScope is open on a thread, the B operands that the thread's products
// pack (pointer, stride, shape, transpose, panel width) are taken to be unchanged, and each
// is packed once: the engine opens one around each pass of a recurrence over time, where
// W_hh is read and never written. Outside a scope an operand is packed into scratch for
// the one call and nothing is kept.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace rnn {

template <class Word>
struct PackedB {
    const float* B = nullptr;  // null: the entry holds nothing reusable
    int ldb = 0, K = 0, N = 0, nr = 0;
    bool tb = false;
    std::uint64_t use = 0;
    std::vector<Word> words;
};

template <class Word>
struct ThreadPacks {
    int scopes = 0;  // open ReuseScopes on this thread
    std::uint64_t clock = 0;
    PackedB<Word> cache[4];     // a gate block each (the LSTM's split by hidden units uses four)
    std::vector<Word> scratch;  // outside a scope: the operand of one call

    // op(B) packed (`words` words, `nr`-wide panels): a kept copy where one matches, else
    // written by pack(out) into the least recently used entry (into scratch outside a scope).
    template <class Pack>
    const Word* get(bool tb, int K, int N, const float* B, int ldb, int nr, std::size_t words, Pack&& pack) {
        if (scopes == 0) {
            if (scratch.size() < words) scratch.resize(words);
            pack(scratch.data());
            return scratch.data();
        }
        PackedB<Word>* slot = &cache[0];
        for (PackedB<Word>& e : cache) {
            if (e.B == B && e.ldb == ldb && e.K == K && e.N == N && e.tb == tb && e.nr == nr) {
                e.use = ++clock;
                return e.words.data();
            }
            if (e.use < slot->use) slot = &e;
        }
        if (slot->words.size() < words) slot->words.resize(words);
        pack(slot->words.data());
        slot->B = B, slot->ldb = ldb, slot->K = K, slot->N = N, slot->tb = tb, slot->nr = nr, slot->use = ++clock;
        return slot->words.data();
    }
};

template <class Word>
inline ThreadPacks<Word>& thread_packs() {
    thread_local ThreadPacks<Word> t;
    return t;
}

// Keeps this thread's packed operands of word type Word while it is open (see above); the
// last one to close forgets them.
template <class Word>
class ReuseScope {
  public:
    explicit ReuseScope(bool on = true) : on_(on) {
        if (on_) ++thread_packs<Word>().scopes;
    }
    ~ReuseScope() {
        if (!on_) return;
        ThreadPacks<Word>& t = thread_packs<Word>();
        if (--t.scopes == 0)
            for (PackedB<Word>& e : t.cache) e.B = nullptr;
    }
    ReuseScope(const ReuseScope&) = delete;
    ReuseScope& operator=(const ReuseScope&) = delete;

  private:
    bool on_;
};

}  // namespace rnn
