// The sm_90 verify kernel (tqops/attention/cuda/turboquant_verify.cu) split across warpgroups, an experiment: two
// score warpgroups take alternate 64-key tiles (key fragments, the score MMA, the softmax with their own reference
// maxima and sums, P'^T into one of two buffers each); an output warpgroup takes every tile in order (value
// fragments, the output MMA into the accumulator of the tile's score warpgroup, the stage ring's TMA refills). They
// hand off through named barriers (a full and an empty barrier per P'^T buffer) and a per-buffer rescale flag with
// its factors. Each score warpgroup's partial goes to the combiner as a split of its own (launch with num_splits
// twice the grid's z). Measured against the landed kernel in docs/tuning.md ("Score and output warpgroups").
#include "../../tqops/attention/cuda/common.cuh"

#define ROWS 64           // query rows per program: the N of both MMAs
#define TILE 64           // keys per warpgroup tile: the M of the score MMA
#define ROW_BYTES 134     // a turboquant_4bit_nc row: 64 code bytes, fp16 norm, 64 value bytes, fp16 scale, zero
#define NORM_OFF 64
#define VALUE_OFF 66
#define SCALE_OFF 130
#define ZERO_OFF 132
#define STAGE_ROW 176     // staged row stride, the TMA box's width (44 words: a warp's value reads fall on distinct
                          // banks)
#define RESCALE_LOG2 8.f
#ifndef STAGES
#define STAGES 8
#endif
#define THREADS 384       // two score warpgroups and one output warpgroup
#ifndef S_REGS
#define S_REGS 152
#endif
#define O_REGS (504 - 2 * S_REGS)  // the 168 x 3 registers per thread the launch allocates

__device__ __forceinline__ void bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
// Whether `pred` holds in any of the barrier's n threads (which all wait for each other).
__device__ __forceinline__ bool bar_any(int id, int n, bool pred) {
  u32 r;
  asm volatile(
      "{ .reg .pred pi, po;\n setp.ne.u32 pi, %1, 0;\n bar.red.or.pred po, %2, %3, pi;\n selp.u32 %0, 1, 0, po; }"
      : "=r"(r) : "r"((u32)pred), "r"(id), "r"(n) : "memory");
  return r != 0;
}

__device__ __forceinline__ u16 float_to_half(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// A no-swizzle shared-memory matrix descriptor: core matrices of 8 rows x 16 bytes, `lbo` bytes apart along K and
// `sbo` bytes apart along N.
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of accumulator registers across a wgmma wait, and the definitions of A
// fragments past the wgmma fence (non-wgmma instructions defining a wgmma's input registers inside its pipeline
// stage serialize the wgmmas, C7513).
__device__ __forceinline__ void fence_regs(float* d) {
#pragma unroll
  for (int i = 0; i < 32; i++) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(u32* r) {
#pragma unroll
  for (int i = 0; i < N; i++) asm volatile("" : "+r"(r[i])::"memory");
}
// The descriptors of N k-steps `step` bytes apart, made (and fenced) ahead of the wgmma fence, as fence_regs.
template <int N>
__device__ __forceinline__ void k_step_descs(u64 (&d)[N], u32 addr, u32 step, u32 lbo, u32 sbo) {
#pragma unroll
  for (int s = 0; s < N; s++) {
    d[s] = smem_desc(addr + s * step, lbo, sbo);
    asm volatile("" : "+l"(d[s])::"memory");
  }
}

// d [64 x 64, fp32] (+)= a [64 x 16 fp16, registers] @ b [16 x 64 fp16, shared memory]; TB: b is N-major.
template <int TB>
__device__ __forceinline__ void wgmma_rs(float* d, const u32* a, u64 desc, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate), "n"(TB));
}


__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
template <int N>
__device__ __forceinline__ void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }

// Shared memory, in bytes from the start of the dynamic buffer.
struct Smem {
  static constexpr int TABLE = 0;                        // [256][32] u32: centroid pairs, replicated per lane
  static constexpr int QS = TABLE + 256 * 32 * 4;        // Q^T
  static constexpr int PT = QS + ROWS * HEAD_DIM * 2;    // [2 score wgs][2 buffers] P'^T, 8 KB each
  static constexpr int XMAX = PT + 4 * TILE * ROWS * 2;  // [2 score wgs][4 warps][64 rows] fp32
  static constexpr int ALPHA = XMAX + 2 * 4 * ROWS * 4;  // [2][2 buffers][64 rows] fp32 rescale factors
  static constexpr int RFLAG = ALPHA + 4 * ROWS * 4;     // [2][2] u32: whether the buffer's tile rescaled
  static constexpr int LZ = RFLAG + 16;                  // [2][4 warps][64 rows][2] fp32 row sums at the end
  static constexpr int MREF = LZ + 2 * 4 * ROWS * 2 * 4; // [2][64] fp32 reference maxima at the end
  static constexpr int STAGE = (MREF + 2 * ROWS * 4 + 127) / 128 * 128;  // [STAGES][64 rows][STAGE_ROW]
  static constexpr int MBAR = STAGE + STAGES * TILE * STAGE_ROW;
  static constexpr int FLAGS = MBAR + STAGES * 8;
  static constexpr int TOTAL = FLAGS + STAGES * TILE;
};

#define BAR_S(s) (1 + (s))
#define BAR_FULL(s, b) (3 + 2 * (s) + (b))
#define BAR_EMPTY(s, b) (7 + 2 * (s) + (b))

template <bool Q_BF16>
__global__ void __launch_bounds__(THREADS, 1) turboquant_verify(
    SPLIT_KV_PARAMS, const __grid_constant__ TensorMap cache_map) {
  using S = Smem;
  constexpr int NT = THREADS;
  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int wg = tid >> 7, w = (tid >> 5) & 3;  // warpgroup 0, 1: scores of even / odd tiles; 2: output
  const int pid = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, real_splits = num_splits >> 1;

  const int b = tile_sequence(pid, block_q, qsl, num_seqs);
  const int q_start = qsl[b], q_len = qsl[b + 1] - q_start;
  const int q_tile = block_q == 1 ? pid - q_start : (pid - (q_start / block_q + b)) * block_q;
  if (q_tile >= q_len) return;
  const int seq_len = seq_lens[b], ctx = seq_len - q_len;
  const int tile_last = min(q_tile + block_q, q_len) - 1;
  int kv_end = min(seq_len, max_blocks << log2_bs);
  if (causal) kv_end = min(kv_end, ctx + tile_last + 1);
  kv_end = max(kv_end, 0);
  const int per_split = ((kv_end + real_splits - 1) / real_splits + TILE - 1) / TILE * TILE;
  const int s_begin = split * per_split, s_end = min(kv_end, s_begin + per_split);
  const int n_tiles = s_end > s_begin ? (s_end - s_begin + TILE - 1) / TILE : 0;
  const int bs_mask = (1 << log2_bs) - 1;
  const int* bt_row = block_table + (i64)b * stride_bt;

  // ---- the stage ring, refilled by the output warpgroup: segment j of a tile by lane j / 4 of its warp j % 4 ----
  const int a = (int)((reinterpret_cast<u64>(cache) + (u64)kvh * head_stride) & 15);
  const int box_x = kvh * head_stride - a;
  u8* stage = smem + S::STAGE;
  const u32 stage_s = smem_addr(stage);
  u8* flags = smem + S::FLAGS;
  const u32 mbar_s = smem_addr(smem + S::MBAR);
  const int log2_seg = min(6, log2_bs), nseg = TILE >> log2_seg, seg = (lane << 2) | w;
  const bool issuer = wg == 2 && seg < nseg;
  if (tid == 0) {
    for (int s = 0; s < STAGES; s++) mbar_init(mbar_s + 8 * s, nseg);
    mbar_init_fence();
  }
  __syncthreads();
  auto tile_key = [&](int i) { return s_begin + i * TILE; };
  auto load_id = [&](int i) {
    return issuer && i < n_tiles ? bt_row[min((tile_key(i) + (seg << log2_seg)) >> log2_bs, max_blocks - 1)] : 0;
  };
  auto issue = [&](int i, int id) {
    if (issuer && i < n_tiles) {
      const int k0 = tile_key(i) + (seg << log2_seg), slot = i % STAGES;
      const bool ok = id >= 0 && id < num_blocks;
      flags[slot * TILE + seg] = ok;
      mbar_expect(mbar_s + 8 * slot, STAGE_ROW << log2_seg);
      tma_load_3d(stage_s + (slot * TILE + (seg << log2_seg)) * STAGE_ROW, &cache_map, box_x, k0 & bs_mask,
                  ok ? id : 0, mbar_s + 8 * slot);
    }
  };
  int id_next = 0;
  if (wg == 2) {
#pragma unroll 1
    for (int i = 0; i < STAGES; i++) issue(i, load_id(i));
    id_next = load_id(STAGES);
  }

  // ---- the rotated query as Q^T, by every thread: 8 lanes per row ----
  u32* table = reinterpret_cast<u32*>(smem + S::TABLE);
  fill_pair_table(table, pairs, tid, NT);
  u16* qs = reinterpret_cast<u16*>(smem + S::QS);
  {
    const int part8 = tid & 7;
    float sg[16];
#pragma unroll
    for (int i = 0; i < 16; i++) sg[i] = signs[16 * part8 + i];
#pragma unroll 1
    for (int idx = tid; idx < ROWS * 8; idx += NT) {
      const int n = idx >> 3, qi = n / group, tok = q_start + q_tile + qi;
      u32 raw[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (qi < block_q && q_tile + qi < q_len && tok < num_tokens) {
        const uint4* src = reinterpret_cast<const uint4*>(
            q + (i64)tok * stride_qt + (i64)(kvh * group + n % group) * stride_qh + 16 * part8);
        const uint4 v0 = src[0], v1 = src[1];
        raw[0] = v0.x; raw[1] = v0.y; raw[2] = v0.z; raw[3] = v0.w;
        raw[4] = v1.x; raw[5] = v1.y; raw[6] = v1.z; raw[7] = v1.w;
      }
      float x[16];
#pragma unroll
      for (int i = 0; i < 16; i++) {
        const u16 bits = (u16)(raw[i >> 1] >> (16 * (i & 1)));
        x[i] = (Q_BF16 ? __uint_as_float((u32)bits << 16) : half_to_float(bits)) * sg[i];
      }
      hadamard_8_lanes(x, part8);
#pragma unroll
      for (int i = 0; i < 16; i++) {
        const int ch = 16 * part8 + i, cc = ch >> 5, s = (ch & 31) >> 2, t = ch & 3;
        const int kk = 16 * s + (t < 2 ? 2 * cc + t : 8 + 2 * cc + t - 2);
        qs[((n >> 3) * 2048 + (kk >> 3) * 128 + (n & 7) * 16 + (kk & 7) * 2) / 2] =
            float_to_half(x[i] * 0.08838834764831845f);
      }
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();

  const u32 lane4 = lane * 4;
  const u8* table8 = reinterpret_cast<const u8*>(table);
  float* lzs = reinterpret_cast<float*>(smem + S::LZ);
  float* mrefs = reinterpret_cast<float*>(smem + S::MREF);
  float* alphas = reinterpret_cast<float*>(smem + S::ALPHA);
  volatile u32* rflags = reinterpret_cast<volatile u32*>(smem + S::RFLAG);

  if (wg < 2) {
    // ======== score warpgroup s: tiles s, s + 2, s + 4, ... ========
    regs_dec<S_REGS>();
    const int s = wg, bar_id = BAR_S(s);
    const int key_off = (a & ~3) + 16 * c;
    const u32 key_shift = (a & 2) * 8;
    const u32 qs_s = smem_addr(smem + S::QS);
    float* xmax = reinterpret_cast<float*>(smem + S::XMAX) + s * 4 * ROWS;
    const float qk_scale = (float)qk_scale_d;
    float sacc[32];
    float m_ref[16], l_part[16], z_part[16];
#pragma unroll
    for (int r = 0; r < 16; r++) {
      m_ref[r] = -1.0e30f;
      l_part[r] = 0.f;
      z_part[r] = 0.f;
    }
#pragma unroll 1
    for (int n = 0;; n++) {
      const int t = 2 * n + s;
      if (t >= n_tiles) break;
      const int slot = t % STAGES, k0 = tile_key(t), buf = n & 1;
      while (!mbar_try_wait(mbar_s + 8 * slot, (t / STAGES) & 1)) {
      }
      const u8* st = stage + slot * TILE * STAGE_ROW;
      u32 ka[8][4];
      {
        const u32* p0 = reinterpret_cast<const u32*>(st + (16 * w + g) * STAGE_ROW + key_off);
        const u32* p1 = reinterpret_cast<const u32*>(st + (16 * w + g + 8) * STAGE_ROW + key_off);
        u32 w0[5], w1[5];
#pragma unroll
        for (int k = 0; k < 5; k++) {
          w0[k] = p0[k];
          w1[k] = p1[k];
        }
        u32 c0[4], c1[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
          c0[q] = funnel_right(w0[q], w0[q + 1], key_shift);
          c1[q] = funnel_right(w1[q], w1[q + 1], key_shift);
        }
        pair_lookups(ka, c0, c1, table8, lane4);
      }
      fence_regs<32>(&ka[0][0]);
      u64 qdesc[8];
      k_step_descs(qdesc, qs_s, 256, 128, 2048);
      wgmma_fence();
#pragma unroll
      for (int q = 0; q < 8; q++) wgmma_rs<0>(sacc, ka[q], qdesc[q], q > 0);
      wgmma_commit();

      float f[2], vsc[2], vzr[2];
      bool ok[2];
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int r = 16 * w + g + 8 * e;
        const u8* row = st + r * STAGE_ROW + a;
        ok[e] = flags[slot * TILE + (r >> log2_seg)] && k0 + r < s_end;
        f[e] = half_to_float(read_u16(row + NORM_OFF)) * qk_scale;
        vsc[e] = ok[e] ? half_to_float(read_u16(row + SCALE_OFF)) : 0.f;
        vzr[e] = ok[e] ? half_to_float(read_u16(row + ZERO_OFF)) : 0.f;
      }
      wgmma_wait<0>();
      fence_regs(sacc);

#pragma unroll
      for (int j = 0; j < 8; j++)
#pragma unroll
        for (int qq = 0; qq < 4; qq++) sacc[4 * j + qq] *= f[qq >> 1];
      const bool edge = k0 + TILE > s_end || !(ok[0] && ok[1]) || (causal && k0 + TILE - 1 > ctx + q_tile);
      if (__any_sync(0xffffffffu, edge)) {
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
          for (int qq = 0; qq < 4; qq++) {
            const int e = qq >> 1, key = k0 + 16 * w + g + 8 * e, row = 8 * j + 2 * c + (qq & 1);
            if (!ok[e] || (causal && key > ctx + q_tile + row / group)) sacc[4 * j + qq] = __int_as_float(0xff800000);
          }
      }
      bool grow = false;
#pragma unroll
      for (int j = 0; j < 8; j++)
#pragma unroll
        for (int qq = 0; qq < 4; qq++) grow |= sacc[4 * j + qq] > m_ref[2 * j + (qq & 1)] + RESCALE_LOG2;
      const bool rescale = bar_any(bar_id, 128, grow);
      bar_sync(BAR_EMPTY(s, buf), 256);  // the output warpgroup is done with this buffer's last tile
      float* alpha_buf = alphas + (2 * s + buf) * ROWS;
      if (rescale) {
        float mx[16];
#pragma unroll
        for (int r = 0; r < 16; r++) {
          const int j = r >> 1, e = r & 1;
          float v = fmaxf(sacc[4 * j + e], sacc[4 * j + 2 + e]);
          v = fmaxf(v, shfl_xor(v, 4));
          v = fmaxf(v, shfl_xor(v, 8));
          mx[r] = fmaxf(v, shfl_xor(v, 16));
        }
        if (g == 0) {
#pragma unroll
          for (int r = 0; r < 16; r++) xmax[w * ROWS + 8 * (r >> 1) + 2 * c + (r & 1)] = mx[r];
        }
        bar_sync(bar_id, 128);
#pragma unroll
        for (int r = 0; r < 16; r++) {
          const int row = 8 * (r >> 1) + 2 * c + (r & 1);
          float m = m_ref[r];
#pragma unroll
          for (int ww = 0; ww < 4; ww++) m = fmaxf(m, xmax[ww * ROWS + row]);
          const float al = exp2_approx(m_ref[r] - m);
          m_ref[r] = m;
          l_part[r] *= al;
          z_part[r] *= al;
          if (w == 0 && g == 0) alpha_buf[row] = al;
        }
      }
      if (tid == 0 || tid == 128) rflags[2 * s + buf] = rescale;

      u8* pt = smem + S::PT + (2 * s + buf) * (TILE * ROWS * 2);
#pragma unroll
      for (int j = 0; j < 8; j++) {
        float p[4];
#pragma unroll
        for (int qq = 0; qq < 4; qq++) p[qq] = exp2_approx(sacc[4 * j + qq] - m_ref[2 * j + (qq & 1)]);
#pragma unroll
        for (int e = 0; e < 2; e++) {
          l_part[2 * j + e] += p[e] + p[2 + e];
          z_part[2 * j + e] += p[e] * vzr[0] + p[2 + e] * vzr[1];
        }
        *reinterpret_cast<u32*>(pt + (2 * w) * 1024 + j * 128 + g * 16 + 4 * c) =
            pack_half2(p[0] * vsc[0], p[1] * vsc[0]);
        *reinterpret_cast<u32*>(pt + (2 * w + 1) * 1024 + j * 128 + g * 16 + 4 * c) =
            pack_half2(p[2] * vsc[1], p[3] * vsc[1]);
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      bar_arrive(BAR_FULL(s, buf), 256);
    }
    // ---- row sums over lanes and warps, and the reference maxima, for the output warpgroup ----
#pragma unroll
    for (int r = 0; r < 16; r++)
#pragma unroll
      for (int x = 4; x < 32; x <<= 1) {
        l_part[r] += shfl_xor(l_part[r], x);
        z_part[r] += shfl_xor(z_part[r], x);
      }
    if (g == 0) {
#pragma unroll
      for (int r = 0; r < 16; r++) {
        const int row = 8 * (r >> 1) + 2 * c + (r & 1);
        lzs[((s * 4 + w) * ROWS + row) * 2] = l_part[r];
        lzs[((s * 4 + w) * ROWS + row) * 2 + 1] = z_part[r];
        if (w == 0) mrefs[s * ROWS + row] = m_ref[r];
      }
    }
    __syncthreads();
  } else {
    // ======== the output warpgroup: every tile in order, out^T += V^T P'^T into the tile's score warpgroup's sums,
    // and the stage ring's refills ========
    regs_inc<O_REGS>();
    const int val_off = a + VALUE_OFF + 2 * (8 * w + g);
    const u32 pt_s = smem_addr(smem + S::PT);
    float oacc[2][2][32];
#pragma unroll
    for (int i = 0; i < 32; i++) oacc[0][0][i] = oacc[0][1][i] = oacc[1][0][i] = oacc[1][1][i] = 0.f;
    // every buffer a score warpgroup will fill starts empty
#pragma unroll
    for (int q = 0; q < 4; q++)
      if (q < n_tiles) bar_arrive(BAR_EMPTY(q & 1, q >> 1), 256);
#pragma unroll 1
    for (int t0 = 0; t0 < n_tiles; t0 += 2) {
#pragma unroll
    for (int s = 0; s < 2; s++) {
      const int t = t0 + s;
      if (t >= n_tiles) break;
      const int n = t >> 1, buf = n & 1, slot = t % STAGES;
      while (!mbar_try_wait(mbar_s + 8 * slot, (t / STAGES) & 1)) {
      }
      const u8* st = stage + slot * TILE * STAGE_ROW;
      u32 va[2][4][4];
      {
        u32 x[4][4];
#pragma unroll
        for (int q = 0; q < 4; q++)
#pragma unroll
          for (int k = 0; k < 4; k++)
            x[q][k] = read_u16(st + (16 * q + 2 * c + (k & 1) + 8 * (k >> 1)) * STAGE_ROW + val_off);
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const u32 sel = h | ((4 + h) << 8);
#pragma unroll
          for (int q = 0; q < 4; q++) {
            const u32 y01 = byte_perm(x[q][0], x[q][1], sel), y89 = byte_perm(x[q][2], x[q][3], sel);
            va[h][q][0] = y01 & 0x000F000Fu;
            va[h][q][1] = y01 & 0x00F000F0u;
            va[h][q][2] = y89 & 0x000F000Fu;
            va[h][q][3] = y89 & 0x00F000F0u;
          }
        }
      }
      bar_sync(BAR_FULL(s, buf), 256);  // P'^T of tile t is written; every warp is done with tile t's stage
      issue(t + STAGES, id_next);
      id_next = load_id(t + STAGES + 1);
      if (rflags[2 * s + buf]) {
        const float* alpha_buf = alphas + (2 * s + buf) * ROWS;
        float al[16];
#pragma unroll
        for (int r = 0; r < 16; r++) al[r] = alpha_buf[8 * (r >> 1) + 2 * c + (r & 1)];
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
          for (int j = 0; j < 8; j++)
#pragma unroll
            for (int qq = 0; qq < 4; qq++) oacc[s][h][4 * j + qq] *= al[2 * j + (qq & 1)];
      }
      fence_regs<32>(&va[0][0][0]);
      fence_regs(oacc[s][0]);
      fence_regs(oacc[s][1]);
      u64 pdesc[4];
      k_step_descs(pdesc, pt_s + (2 * s + buf) * (TILE * ROWS * 2), 2048, 1024, 128);
      wgmma_fence();
#pragma unroll
      for (int h = 0; h < 2; h++)
#pragma unroll
        for (int q = 0; q < 4; q++) wgmma_rs<1>(oacc[s][h], va[h][q], pdesc[q], 1);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(oacc[s][0]);
      fence_regs(oacc[s][1]);
      if (t + 4 < n_tiles) bar_arrive(BAR_EMPTY(s, buf), 256);
    }
    }
    __syncthreads();  // the score warpgroups' row sums and maxima are in shared memory
#pragma unroll
    for (int s = 0; s < 2; s++) {
#pragma unroll
      for (int r = 0; r < 16; r++) {
        const int j = r >> 1, e = r & 1, row = 8 * j + 2 * c + e, qi = row / group, tok = q_start + q_tile + qi;
        if (!(qi < block_q && q_tile + qi < q_len && tok < num_tokens)) continue;
        float l = 0.f, z = 0.f;
#pragma unroll
        for (int ww = 0; ww < 4; ww++) {
          l += lzs[((s * 4 + ww) * ROWS + row) * 2];
          z += lzs[((s * 4 + ww) * ROWS + row) * 2 + 1];
        }
        const i64 out_row = ((i64)(2 * split + s) * num_tokens + tok) * num_q_heads + kvh * group + row % group;
        *reinterpret_cast<float4*>(part + out_row * HEAD_DIM + 4 * (8 * w + g)) =
            make_float4(oacc[s][0][4 * j + e] * 16777216.f + z, oacc[s][0][4 * j + 2 + e] * 1048576.f + z,
                        oacc[s][1][4 * j + e] * 16777216.f + z, oacc[s][1][4 * j + 2 + e] * 1048576.f + z);
        if (w == 0 && g == 0) {
          ml[out_row * 2] = mrefs[s * ROWS + row];
          ml[out_row * 2 + 1] = l;
        }
      }
    }
  }
}
