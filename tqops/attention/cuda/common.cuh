// Device helpers shared by the TurboQuant CUDA kernels (turboquant_attention.cu, turboquant_verify.cu): PTX
// wrappers, the per-lane centroid-pair table, its lookups, and the in-register Hadamard rotation of the query.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;
typedef unsigned long long u64;

#define HEAD_DIM 128

// The launch arguments of both kernels, in the order cuda_paged.launch_split_kv passes them.
#define SPLIT_KV_PARAMS                                                                                    \
  const u16 *__restrict__ q, int stride_qt, int stride_qh, const u8 *__restrict__ cache, int block_stride,  \
      int slot_stride, int head_stride, const int *__restrict__ block_table, int stride_bt,                \
      const int *__restrict__ seq_lens, const int *__restrict__ qsl, const float *__restrict__ signs,       \
      const u32 *__restrict__ pairs, float *__restrict__ part, float *__restrict__ ml, double qk_scale_d,   \
      int num_seqs, int num_tokens, int num_blocks, int max_blocks, int log2_bs, int block_q, int group,    \
      int num_splits, int causal, int num_q_heads

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ void cp_async16(u32 dst, u64 src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// TMA copies and mbarrier transactions are sm_90's: kernels built for older GPUs keep cp.async (TQ_TMA 0), and these
// helpers compile to nothing there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TQ_TMA 1
#else
#define TQ_TMA 0
#endif

// The driver's CUtensorMap: an opaque 128-byte object, passed by value (cuda_paged.tensor_map encodes it).
struct alignas(64) TensorMap {
  u64 opaque[16];
};

__device__ __forceinline__ void mbar_init(u32 addr, u32 count) {
#if TQ_TMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(addr), "r"(count) : "memory");
#endif
}
// Makes the initialized mbarriers visible to the TMA unit.
__device__ __forceinline__ void mbar_init_fence() {
#if TQ_TMA
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// Arrives on the mbarrier and adds `bytes` to the transactions it waits for.
__device__ __forceinline__ void mbar_expect(u32 addr, u32 bytes) {
#if TQ_TMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(addr), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ bool mbar_try_wait(u32 addr, u32 parity) {
#if TQ_TMA
  u32 done;
  asm volatile("{ .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p; }"
               : "=r"(done) : "r"(addr), "r"(parity) : "memory");
  return done != 0;
#else
  return true;
#endif
}
// Spins until the mbarrier at `addr` completes its phase of `parity`.
__device__ __forceinline__ void mbar_wait(u32 addr, u32 parity) {
  while (!mbar_try_wait(addr, parity)) {
  }
}
// `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte aligned), completing on the mbarrier at
// `mbar`.
__device__ __forceinline__ void bulk_load(u32 dst, u64 src, u32 bytes, u32 mbar) {
#if TQ_TMA
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(mbar) : "memory");
#endif
}
// The box of `map` at (x, y, z) into shared memory at `dst`, completing `bytes` on the mbarrier at `mbar`.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap* map, int x, int y, int z, u32 mbar) {
#if TQ_TMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(z), "r"(mbar) : "memory");
#endif
}

__device__ __forceinline__ float half_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ u32 byte_perm(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

__device__ __forceinline__ u32 funnel_right(u32 lo, u32 hi, u32 shift) {
  u32 r;
  asm("shf.r.wrap.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(shift));
  return r;
}

__device__ __forceinline__ float exp2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float shfl_xor(float x, int m) { return __shfl_xor_sync(0xffffffffu, x, m); }

__device__ __forceinline__ u16 read_u16(const u8* p) { return *reinterpret_cast<const u16*>(p); }

// The key decoder's table: entry e (a byte of two codes) holds the fp16 centroids of its low and high nibble's code,
// replicated once per lane (word 32e + lane), so the 32 lanes' lookups never share a bank. Made by `nthreads`
// threads from the 256 pairs in global memory.
__device__ __forceinline__ void fill_pair_table(u32* table, const u32* __restrict__ pairs, int tid, int nthreads) {
  for (int e = tid; e < 256; e += nthreads) {
    const u32 v = pairs[e];
    uint4* dst = reinterpret_cast<uint4*>(table + 32 * e);
#pragma unroll
    for (int k = 0; k < 8; k++) dst[k] = make_uint4(v, v, v, v);
  }
}

// A fragments of two keys' 16 code bytes (words c0 of the key in A row g, c1 of the key in row g + 8): k-step s is
// bytes 2s (fragment registers 0, 1) and 2s + 1 (registers 2, 3), one table lookup each.
__device__ __forceinline__ void pair_lookups(u32 (&ka)[8][4], const u32 (&c0)[4], const u32 (&c1)[4],
                                             const u8* table8, u32 lane4) {
#pragma unroll
  for (int t = 0; t < 4; t++) {
    const u32 x0 = c0[t], x1 = c1[t];
    // byte k of a word times 128 (the table's entry stride in bytes), plus this lane's column
    const u32 lookup0[4] = {((x0 << 7) & 0x7F80u) | lane4, ((x0 >> 1) & 0x7F80u) | lane4,
                            ((x0 >> 9) & 0x7F80u) | lane4, ((x0 >> 17) & 0x7F80u) | lane4};
    const u32 lookup1[4] = {((x1 << 7) & 0x7F80u) | lane4, ((x1 >> 1) & 0x7F80u) | lane4,
                            ((x1 >> 9) & 0x7F80u) | lane4, ((x1 >> 17) & 0x7F80u) | lane4};
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
      ka[2 * t + hh][0] = *reinterpret_cast<const u32*>(table8 + lookup0[2 * hh]);
      ka[2 * t + hh][1] = *reinterpret_cast<const u32*>(table8 + lookup1[2 * hh]);
      ka[2 * t + hh][2] = *reinterpret_cast<const u32*>(table8 + lookup0[2 * hh + 1]);
      ka[2 * t + hh][3] = *reinterpret_cast<const u32*>(table8 + lookup1[2 * hh + 1]);
    }
  }
}

// The unnormalized Hadamard transform of a 128-channel row held by 8 lanes (lane part8 holds channels
// 16 part8 .. + 15 in x): butterflies of span < 16 in registers, the rest across the 8 lanes.
__device__ __forceinline__ void hadamard_8_lanes(float (&x)[16], int part8) {
#pragma unroll
  for (int h = 1; h < 16; h <<= 1) {
#pragma unroll
    for (int i = 0; i < 16; i++) {
      if (!(i & h)) {
        const float u = x[i], v = x[i + h];
        x[i] = u + v;
        x[i + h] = u - v;
      }
    }
  }
#pragma unroll
  for (int h = 1; h < 8; h <<= 1) {
    const bool upper = part8 & h;
#pragma unroll
    for (int i = 0; i < 16; i++) {
      const float other = shfl_xor(x[i], h);
      x[i] = upper ? other - x[i] : x[i] + other;
    }
  }
}

// The sequence of query tile `pid` (as launch.query_tiles lays the grid out): sequence b owns tiles
// [start(b), start(b + 1)), start(b) = qsl[b] / block_q + b, or qsl[b] with one token per tile (no padding tiles), so
// b is the last sequence with start(b) <= pid. One token per sequence (decode) is checked first.
__device__ __forceinline__ int tile_sequence(int pid, int block_q, const int* __restrict__ qsl, int num_seqs) {
  if (block_q == 1) {
    const int guess = min(pid, num_seqs - 1);
    if (qsl[guess] <= pid && (guess == num_seqs - 1 || qsl[guess + 1] > pid)) return guess;
  }
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    const int mid_start = block_q == 1 ? qsl[mid] : qsl[mid] / block_q + mid;
    if (mid_start <= pid) lo = mid; else hi = mid - 1;
  }
  return lo;
}
