// Reductions over a row in fuser's row kernels: over its warps by shuffles, then its block's
// warps and its cluster's blocks through shared memory (RowReducer). Built on fuser_rows.cuh.
#pragma once
#include "fuser_rows.cuh"

namespace fm {

// ----- reductions over a row: its warps, its block's warps, its cluster's blocks -----

// One value being reduced, and how.
template <typename T, typename Op>
struct Reduced {
  T& value;
  Op op;
};
template <typename T, typename Op>
__device__ __forceinline__ Reduced<T, Op> reduced(T& value, Op op) {
  return Reduced<T, Op>{value, op};
}

// Reduces the values of one inner-reduction level (up to WIDTH of them) over each row's
// threads: shuffles within warps; across a row's warps, lane 0 of each posts its partial to
// `scratch` and, after one barrier, every thread combines the row's partials in warp order;
// across a cluster, thread 0 of each row sends the block's total to every block of the
// cluster (itself too) with store_to_peer, each block waits on its own mbarrier for all
// CLUSTER totals (the words of the values this level reduces, up to WIDTH of them) and
// combines them in rank order (the same result, in the same order, in each). No cluster
// barrier per level: its release would fence every global store in flight.
// Scratch, the exchange's slots and its two mbarriers have two parities, alternated call by
// call: a block sends level r + 2 only after every block has sent it level r + 1, which each
// does after reading level r, so no slot or phase is written while it is still read. Slots
// are of T, the widest type among the reductions; a partial of another type keeps its own
// type in its slot (the exchange's words are 4 or 8 bytes).
// The word a cluster exchange sends a partial of N bytes in (N <= 8).
template <int N>
struct WordOf {
  using type = unsigned;
};
template <>
struct WordOf<8> {
  using type = unsigned long long;
};

template <typename T, typename Part, int WIDTH>
struct RowReducer {
  static constexpr int WARPS = Part::TPR > 32 ? Part::TPR / 32 : 1;
  using Word = typename WordOf<sizeof(T)>::type;
  static constexpr int SLOTS = WIDTH * Part::RPB;  // a rank's words per level: the most sent
  T* scratch;                // 2 parities x WIDTH x RPB x WARPS (rows of more than one warp)
  unsigned long long* bars;  // 2 parities of mbarriers (clusters)
  Word* words;               // 2 parities x CLUSTER ranks x WIDTH x RPB (clusters)
  int round = 0;

  // Clusters: thread 0 initializes the mbarriers, and one cluster barrier makes them visible
  // to the peers before any sends (every thread of the block constructs the reducer).
  __device__ __forceinline__ RowReducer(unsigned char* scratch, unsigned char* exchange)
      : scratch(reinterpret_cast<T*>(scratch)),
        bars(reinterpret_cast<unsigned long long*>(exchange)),
        words(Part::CLUSTER > 1 ? reinterpret_cast<Word*>(exchange + 2 * sizeof(*bars))
                                : nullptr) {
    if constexpr (Part::CLUSTER > 1) {
      if (threadIdx.x == 0 && threadIdx.y == 0) {
        mbarrier_init(&bars[0], 1);
        mbarrier_init(&bars[1], 1);
        fence_mbarrier_init();
      }
      cluster_sync();
    }
  }

  template <typename... Values>
  __device__ __forceinline__ void operator()(const Part& part, Values... values) {
    ((values.value = warp_reduce<(Part::TPR < 32 ? Part::TPR : 32)>(values.value, values.op)), ...);
    const int parity = round & 1;
    const unsigned phase = (round >> 1) & 1;
    ++round;
    if constexpr (Part::TPR > 32) {
      T* slot = scratch + parity * (WIDTH * Part::RPB * WARPS);
      if ((part.tx & 31) == 0) {
        int n = 0;
        ((ref(slot, (n++ * Part::RPB + part.ty) * WARPS + part.tx / 32, values.value) =
              values.value), ...);
      }
      __syncthreads();
      int n = 0;
      ((values.value = combine<WARPS>(&ref(slot, (n++ * Part::RPB + part.ty) * WARPS,
                                           values.value), values.op)), ...);
    }
    if constexpr (Part::CLUSTER > 1) {
      Word* level = words + parity * (Part::CLUSTER * SLOTS);
      if (part.tx == 0 && part.ty == 0) {
        // the words this level sends: a level may reduce fewer values than WIDTH, and an
        // mbarrier that expects a byte more than arrives never completes its phase
        constexpr int SENT = Part::CLUSTER * static_cast<int>(sizeof...(Values)) * Part::RPB;
        mbarrier_expect_tx(&bars[parity], SENT * static_cast<int>(sizeof(Word)));
      }
      if (part.tx == 0) {
        int n = 0;
        ((send(level + part.rank * SLOTS + n++ * Part::RPB + part.ty, values.value,
               &bars[parity]), ...));
      }
      mbarrier_wait(&bars[parity], phase);
      int n = 0;
      ((values.value = combine_ranks(level + n++ * Part::RPB + part.ty, values.value,
                                     values.op)), ...);
    }
  }

  // Slot `index` of `base`, as a V (slots are sizeof(T) >= sizeof(V) bytes apart).
  static __device__ __forceinline__ T& ref(T* base, int index, const T&) { return base[index]; }
  template <typename V>
  static __device__ __forceinline__ V& ref(T* base, int index, const V&) {
    return *reinterpret_cast<V*>(base + index);
  }
  // N partials of V, sizeof(T) bytes apart, combined in order.
  template <int N, typename V, typename Op>
  static __device__ __forceinline__ V combine(const V* first, Op op) {
    V total = first[0];
#pragma unroll
    for (int w = 1; w < N; ++w) {
      total = op(total, *reinterpret_cast<const V*>(reinterpret_cast<const T*>(first) + w));
    }
    return total;
  }
  // `value` into word `slot` of every block of the cluster (this one's included).
  template <typename V>
  static __device__ __forceinline__ void send(Word* slot, const V& value,
                                              unsigned long long* bar) {
    Word word = 0;
    memcpy(&word, &value, sizeof(V));
#pragma unroll
    for (unsigned q = 0; q < Part::CLUSTER; ++q) store_to_peer(slot, word, bar, q);
  }
  // The CLUSTER ranks' words of one value (SLOTS apart), combined in rank order.
  template <typename V, typename Op>
  static __device__ __forceinline__ V combine_ranks(const Word* first, const V&, Op op) {
    V total;
    memcpy(&total, &first[0], sizeof(V));
#pragma unroll
    for (int q = 1; q < Part::CLUSTER; ++q) {
      V next;
      memcpy(&next, &first[q * SLOTS], sizeof(V));
      total = op(total, next);
    }
    return total;
  }
};

}  // namespace fm
