// An experiment, not part of the package (docs/tuning.md, "A transposed wgmma verify kernel"); built and run by
// verify_dev.py beside it.
//
// Split-KV paged attention for up to 64 query rows (query tokens x the GQA group: a 16-token verify at group 4) over
// a turboquant_4bit_nc cache at head_dim 128, on sm_90 warpgroup MMAs (compiled at run time with NVRTC for sm_90a).
//
// The products run transposed, keys as M: scores^T [64 keys, 64 rows] = K [keys, dims] Q^T and
// out^T [128 dims, 64 rows] += V^T [dims, keys] P'^T, both wgmma m64n64k16 with the A operand in registers. So each
// warp decodes only its own 16 keys (scores) or 16 + 16 dimensions (output) of a tile, straight from the staged
// codes into A fragments, with no decoded tile written to shared memory; Q^T (made once) and P'^T (written per tile)
// are the shared-memory B operands. Every warpgroup takes every NWG-th 64-key tile of the split with its own online
// softmax state; the states are merged at the end. While one warpgroup decodes and runs its softmax, the other's
// MMAs keep the tensor cores busy.
//
// Channel orders as in turboquant_attention.cu: in k-step s the score MMA's K index 2c + e (c = lane % 4) is channel
// 32c + 4s + e and 2c + 8 + e is channel 32c + 4s + 2 + e, so a lane's key bytes are 16c .. 16c + 15 of its key,
// one centroid-pair table lookup per byte. Values: row g (g = lane / 4) of warp w's M tile in output MMA h is
// dimension 4(8w + g) + 2h, row g + 8 the next one: the low and high nibble of value byte 2(8w + g) + h, which as
// fp16 bits are the exact subnormals code * 2^-24 and code * 2^-20; the value scale folds into P', the zero point
// is the per-row term z.
//
// The softmax rescales lazily: P' = exp2(s - m_ref) with a per-row reference max that moves only when a score
// passes it by more than RESCALE_LOG2 (warpgroup-wide vote), so most tiles need no row maxima at all.
//
// Output: the unnormalized fp32 partial output and (max, sum) in log2 units of each split, the layout the Triton
// split combiner merges (as turboquant_attention.cu).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;
typedef unsigned long long u64;

#define HEAD_DIM 128
#define ROWS 64           // query rows per program: the N of both MMAs
#define TILE 64           // keys per warpgroup tile: the M of the score MMA
#define ROW_BYTES 134     // a turboquant_4bit_nc row: 64 code bytes, fp16 norm, 64 value bytes, fp16 scale, zero
#define NORM_OFF 64
#define VALUE_OFF 66
#define SCALE_OFF 130
#define ZERO_OFF 132
#define STAGE_ROW 176     // staged row stride (44 words: a warp's value reads fall on distinct banks)
#define RESCALE_LOG2 8.f

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

__device__ __forceinline__ float half_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 float_to_half(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
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
__device__ __forceinline__ void fence_desc(u64& d) { asm volatile("" : "+l"(d)::"memory"); }

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

// Shared memory, in bytes from the start of the dynamic buffer.
template <int NWG, int STAGES>
struct Smem {
  static constexpr int TABLE = 0;                        // [256][32] u32: centroid pairs, replicated per lane
  static constexpr int QS = TABLE + 256 * 32 * 4;        // Q^T: [8 row groups][16 K groups][8 rows][16 bytes]
  static constexpr int PT = QS + ROWS * HEAD_DIM * 2;    // per warpgroup P'^T: [8 key groups][8 row groups][8][16]
  static constexpr int XMAX = PT + NWG * TILE * ROWS * 2;  // per warpgroup [4 warps][64 rows] fp32 row maxima
  static constexpr int FLAGS = XMAX + NWG * 4 * ROWS * 4;  // per warpgroup [STAGES][64] key-block validity
  static constexpr int STAGE = (FLAGS + NWG * STAGES * TILE + 127) / 128 * 128;
  static constexpr int STAGE_BYTES = NWG * STAGES * TILE * STAGE_ROW;
  // After the loop the stage buffers hold the warpgroups' results: [NWG][64][128] output, [NWG][64] max,
  // [NWG][4][64] sum and zero-point term. Before it, the fp32 query being rotated, [64][128].
  static constexpr int MERGE_BYTES = NWG * ROWS * HEAD_DIM * 4 + NWG * ROWS * 4 + 2 * NWG * 4 * ROWS * 4;
  static constexpr int TOTAL = STAGE + (STAGE_BYTES > MERGE_BYTES ? STAGE_BYTES : MERGE_BYTES);
  static_assert(STAGE_BYTES >= ROWS * HEAD_DIM * 4, "the stage buffers hold the query while it is rotated");
};

// MODE (timing ablations only): bit 0 no key decode, 1 no value decode, 2 no MMAs, 3 no softmax, 4 no masks, 5 no
// tiles at all (the query prologue and the merge), 6 the output MMA retired at the next tile's start, 7 no copies
// (the tiles decode whatever the stage buffers hold: compute only).
template <int NWG, int STAGES, bool Q_BF16, int DBG = 0, int MODE = 0>
__global__ void __launch_bounds__(NWG * 128, 1) turboquant_verify(
    const u16* __restrict__ q, int stride_qt, int stride_qh,
    const u8* __restrict__ cache, int block_stride, int slot_stride, int head_stride,
    const int* __restrict__ block_table, int stride_bt,
    const int* __restrict__ seq_lens, const int* __restrict__ qsl,
    const float* __restrict__ signs, const u32* __restrict__ pairs,
    float* __restrict__ part, float* __restrict__ ml,
    double qk_scale_d, int num_seqs, int num_tokens, int num_blocks, int max_blocks, int log2_bs,
    int block_q, int group, int num_splits, int causal, int num_q_heads) {
  using S = Smem<NWG, STAGES>;
  constexpr int NT = NWG * 128;
  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, c = lane & 3;
  // The warpgroup index through a shuffle, so ptxas knows it is warp-uniform: its loop then holds the wgmmas on a
  // path it does not treat as divergent (which serializes them, C7520).
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0), wtid = tid & 127, w = (tid >> 5) & 3;
  const int pid = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;

  // The sequence of this query tile (as turboquant_attention.cu): sequence b owns tiles
  // [qsl[b] / block_q + b, qsl[b + 1] / block_q + b + 1).
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (qsl[mid] / block_q + mid <= pid) lo = mid; else hi = mid - 1;
  }
  const int b = lo;
  const int q_start = qsl[b], q_len = qsl[b + 1] - q_start;
  const int q_tile = (pid - (q_start / block_q + b)) * block_q;
  if (q_tile >= q_len) return;  // a padding token's program: the combiner writes its zeros
  const int seq_len = seq_lens[b], ctx = seq_len - q_len;
  const int tile_last = min(q_tile + block_q, q_len) - 1;
  int kv_end = min(seq_len, max_blocks << log2_bs);
  if (causal) kv_end = min(kv_end, ctx + tile_last + 1);
  kv_end = max(kv_end, 0);
  const int per_split = ((kv_end + num_splits - 1) / num_splits + TILE - 1) / TILE * TILE;
  const int s_begin = split * per_split, s_end = min(kv_end, s_begin + per_split);
  const int n_tiles = s_end > s_begin ? (s_end - s_begin + TILE - 1) / TILE : 0;
  const int my_tiles = (MODE & 32) ? 0 : n_tiles > wg ? (n_tiles - wg + NWG - 1) / NWG : 0;
  const int bs_mask = (1 << log2_bs) - 1;
  const int* bt_row = block_table + (i64)b * stride_bt;

  // ---- the rotated query (q * signs) H / sqrt(128) as Q^T, once per program: 8 lanes per row, 16 channels each
  // (two 16-byte loads), butterflies of span < 16 in registers and the rest across the 8 lanes ----
  u32* table = reinterpret_cast<u32*>(smem + S::TABLE);
  for (int e = tid; e < 256; e += NT) {
    const u32 v = pairs[e];
    uint4* dst = reinterpret_cast<uint4*>(table + 32 * e);
#pragma unroll
    for (int k = 0; k < 8; k++) dst[k] = make_uint4(v, v, v, v);
  }
  u16* qs = reinterpret_cast<u16*>(smem + S::QS);
  {
    const int part8 = tid & 7;
    float sg[16];
#pragma unroll
    for (int i = 0; i < 16; i++) sg[i] = signs[16 * part8 + i];
#pragma unroll
    for (int pass = 0; pass < ROWS * 8 / NT; pass++) {
      const int n = pass * (NT / 8) + (tid >> 3), qi = n / group, tok = q_start + q_tile + qi;
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
#pragma unroll
      for (int h = 1; h < 16; h <<= 1)
#pragma unroll
        for (int i = 0; i < 16; i++)
          if (!(i & h)) {
            const float u = x[i], v = x[i + h];
            x[i] = u + v;
            x[i + h] = u - v;
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
      // channel ch = 32c + 4s + t is K index 16s + 2c + t (t < 2) or 16s + 8 + 2c + t - 2
#pragma unroll
      for (int i = 0; i < 16; i++) {
        const int ch = 16 * part8 + i, cc = ch >> 5, s = (ch & 31) >> 2, t = ch & 3;
        const int kk = 16 * s + (t < 2 ? 2 * cc + t : 8 + 2 * cc + t - 2);
        qs[((n >> 3) * 2048 + (kk >> 3) * 128 + (n & 7) * 16 + (kk & 7) * 2) / 2] =
            float_to_half(x[i] * 0.08838834764831845f);
      }
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // Q^T is read by the MMAs' async proxy
  __syncthreads();

  // ---- this warpgroup's stage ring: each thread copies 5 of a tile's 64 x 10 16-byte chunks ----
  const u64 head_addr = reinterpret_cast<u64>(cache) + (u64)kvh * head_stride;
  const int a = (int)(head_addr & 15);  // every row of this head starts `a` bytes past a 16-byte boundary
  const u64 head_base = head_addr - a;
  u8* stage = smem + S::STAGE + wg * STAGES * TILE * STAGE_ROW;
  const u32 stage_s = smem_addr(stage);
  u8* flags = smem + S::FLAGS + wg * STAGES * TILE;
  int row_of[5];
  u32 dst_of[5];
  bool take[5], first[5];
#pragma unroll
  for (int j = 0; j < 5; j++) {
    const int chunk = j * 128 + wtid, r = chunk / 10, ch = chunk - r * 10;
    row_of[j] = r;
    dst_of[j] = r * STAGE_ROW + ch * 16;
    take[j] = ch * 16 < a + ROW_BYTES;  // never past the row's last byte
    first[j] = ch == 0;
  }
  auto tile_key = [&](int i) { return s_begin + (wg + i * NWG) * TILE; };
  auto load_ids = [&](int i, int* ids) {
#pragma unroll
    for (int j = 0; j < 5; j++)
      ids[j] = i < my_tiles ? bt_row[min((tile_key(i) + row_of[j]) >> log2_bs, max_blocks - 1)] : 0;
  };
  auto issue = [&](int i, const int* ids) {
    if (i < my_tiles) {
      const int k0 = tile_key(i), slot = i % STAGES;
#pragma unroll
      for (int j = 0; j < 5; j++) {
        const bool ok = ids[j] >= 0 && ids[j] < num_blocks;
        const u64 src = head_base + (u64)(ok ? ids[j] : 0) * block_stride +
                        (u64)(((k0 + row_of[j]) & bs_mask) * slot_stride) + (dst_of[j] % STAGE_ROW);
        if (take[j] && !(MODE & 128)) cp_async16(stage_s + slot * TILE * STAGE_ROW + dst_of[j], src);
        if (first[j]) flags[slot * TILE + row_of[j]] = ok;
      }
    }
    cp_commit();  // an empty group past the last tile keeps the group count uniform
  };
  int ids_next[5];
#pragma unroll
  for (int i = 0; i < STAGES - 1; i++) {
    int ids[5];
    load_ids(i, ids);
    issue(i, ids);
  }
  load_ids(STAGES - 1, ids_next);

  // Offsets into a staged row: this lane's key bytes 16c .. 16c + 15 (read as 5 words from a 4-byte boundary), and
  // its value bytes 2(8w + g), 2(8w + g) + 1.
  const int key_off = (a & ~3) + 16 * c;
  const u32 key_shift = (a & 2) * 8;
  const int val_off = a + VALUE_OFF + 2 * (8 * w + g);
  const u32 lane4 = lane * 4;
  const u8* table8 = reinterpret_cast<const u8*>(table);
  const u32 qs_s = smem_addr(smem + S::QS);
  u8* pt = smem + S::PT + wg * TILE * ROWS * 2;
  const u32 pt_s = smem_addr(pt);
  float* xmax = reinterpret_cast<float*>(smem + S::XMAX) + wg * 4 * ROWS;
  const float qk_scale = (float)qk_scale_d;
  const int bar_id = 1 + wg;

  float oacc[2][32], sacc[32];
#pragma unroll
  for (int i = 0; i < 32; i++) oacc[0][i] = oacc[1][i] = 0.f;
  // Per row this lane holds (rows 8j + 2c + e, index 2j + e): reference max, and partial sums over its keys.
  float m_ref[16], l_part[16], z_part[16];
#pragma unroll
  for (int r = 0; r < 16; r++) {
    m_ref[r] = -1.0e30f;
    l_part[r] = 0.f;
    z_part[r] = 0.f;
  }
  u32 va[2][4][4];

  for (int i = 0; i < my_tiles; i++) {
    cp_wait<STAGES - 2>();
    bar_sync(bar_id, 128);  // tile i is staged; every warp is done with tile i - 1's buffer, which is refilled next
    issue(i + STAGES - 1, ids_next);
    load_ids(i + STAGES, ids_next);
    if (MODE & 64) {
      wgmma_wait<0>();  // the previous tile's output MMA, left running under this tile's copies
      fence_regs(oacc[0]);
      fence_regs(oacc[1]);
    }
    const int slot = i % STAGES, k0 = tile_key(i);
    const u8* st = stage + slot * TILE * STAGE_ROW;

    // ---- scores^T: this warp's keys 16w + g and 16w + g + 8 as A fragments, one table lookup per code byte ----
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
#pragma unroll
      for (int t = 0; t < 4; t++) {
        const u32 x0 = funnel_right(w0[t], w0[t + 1], key_shift), x1 = funnel_right(w1[t], w1[t + 1], key_shift);
        const u32 lookup0[4] = {((x0 << 7) & 0x7F80u) | lane4, ((x0 >> 1) & 0x7F80u) | lane4,
                                ((x0 >> 9) & 0x7F80u) | lane4, ((x0 >> 17) & 0x7F80u) | lane4};
        const u32 lookup1[4] = {((x1 << 7) & 0x7F80u) | lane4, ((x1 >> 1) & 0x7F80u) | lane4,
                                ((x1 >> 9) & 0x7F80u) | lane4, ((x1 >> 17) & 0x7F80u) | lane4};
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
          if (MODE & 1) {
            ka[2 * t + hh][0] = x0 & 0x3C003C00u; ka[2 * t + hh][1] = x1 & 0x3C003C00u;
            ka[2 * t + hh][2] = x0 & 0x38003800u; ka[2 * t + hh][3] = x1 & 0x38003800u;
            continue;
          }
          ka[2 * t + hh][0] = *reinterpret_cast<const u32*>(table8 + lookup0[2 * hh]);
          ka[2 * t + hh][1] = *reinterpret_cast<const u32*>(table8 + lookup1[2 * hh]);
          ka[2 * t + hh][2] = *reinterpret_cast<const u32*>(table8 + lookup0[2 * hh + 1]);
          ka[2 * t + hh][3] = *reinterpret_cast<const u32*>(table8 + lookup1[2 * hh + 1]);
        }
      }
    }
    fence_regs<32>(&ka[0][0]);
    u64 qdesc[8];  // k-step s: Q^T's K groups 2s, 2s + 1
#pragma unroll
    for (int s = 0; s < 8; s++) {
      qdesc[s] = smem_desc(qs_s + s * 256, 128, 2048);
      fence_desc(qdesc[s]);
    }
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 8; s++)
      if (MODE & 4) {
#pragma unroll
        for (int k = 0; k < 32; k++) sacc[k] = __uint_as_float(ka[s][k & 3] ^ k);
      } else {
        wgmma_rs<0>(sacc, ka[s], qdesc[s], s > 0);
      }
    wgmma_commit();

    // ---- norm, value scale and zero point of keys g (e = 0) and g + 8 (e = 1) of this warp ----
    float f[2], vsc[2], vzr[2];
    bool ok[2];
#pragma unroll
    for (int e = 0; e < 2; e++) {
      const int r = 16 * w + g + 8 * e;
      const u8* row = st + r * STAGE_ROW + a;
      ok[e] = flags[slot * TILE + r] && k0 + r < s_end;
      f[e] = half_to_float(read_u16(row + NORM_OFF)) * qk_scale;
      vsc[e] = ok[e] ? half_to_float(read_u16(row + SCALE_OFF)) : 0.f;
      vzr[e] = ok[e] ? half_to_float(read_u16(row + ZERO_OFF)) : 0.f;
    }

    // ---- V^T A fragments, made under the score MMA ----
    {
      u32 x[4][4];
#pragma unroll
      for (int s = 0; s < 4; s++)
#pragma unroll
        for (int k = 0; k < 4; k++)
          x[s][k] = (MODE & 2) ? k0 + s + k : read_u16(st + (16 * s + 2 * c + (k & 1) + 8 * (k >> 1)) * STAGE_ROW + val_off);
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const u32 sel = h | ((4 + h) << 8);  // byte h of key 2c (+8) in byte 0, of key 2c + 1 (+9) in byte 2
#pragma unroll
        for (int s = 0; s < 4; s++) {
          const u32 y01 = byte_perm(x[s][0], x[s][1], sel), y89 = byte_perm(x[s][2], x[s][3], sel);
          va[h][s][0] = y01 & 0x000F000Fu;
          va[h][s][1] = y01 & 0x00F000F0u;
          va[h][s][2] = y89 & 0x000F000Fu;
          va[h][s][3] = y89 & 0x00F000F0u;
        }
      }
    }
    wgmma_wait<0>();
    fence_regs(sacc);
    fence_regs(oacc[0]);
    fence_regs(oacc[1]);

    // ---- scores, masks, and whether any row's reference max must move ----
    // sacc[4j + q]: key g + 8 (q >> 1), row 8j + 2c + (q & 1)
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
      for (int qq = 0; qq < 4; qq++) sacc[4 * j + qq] *= f[qq >> 1];
    // Masks only on tiles that need them (a split's last keys, invalid blocks, the causal corner), as a branch.
    const bool edge = k0 + TILE > s_end || !(ok[0] && ok[1]) || (causal && k0 + TILE - 1 > ctx + q_tile);
    if ((MODE & 16) == 0 && __any_sync(0xffffffffu, edge)) {
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
    if (DBG == 1 && i == 0) {
#pragma unroll
      for (int j = 0; j < 8; j++)
#pragma unroll
        for (int qq = 0; qq < 4; qq++)
          part[wg * 4096 + (16 * w + g + 8 * (qq >> 1)) * 64 + 8 * j + 2 * c + (qq & 1)] = sacc[4 * j + qq];
      return;
    }
    if ((MODE & 8) == 0 && bar_any(bar_id, 128, grow)) {
      // Row maxima over the warpgroup's 64 keys: this lane's two keys, the warp's 16 by shuffles, then 4 warps.
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
      float alpha[16];
#pragma unroll
      for (int r = 0; r < 16; r++) {
        const int row = 8 * (r >> 1) + 2 * c + (r & 1);
        float m = m_ref[r];
#pragma unroll
        for (int ww = 0; ww < 4; ww++) m = fmaxf(m, xmax[ww * ROWS + row]);
        alpha[r] = exp2_approx(m_ref[r] - m);
        m_ref[r] = m;
        l_part[r] *= alpha[r];
        z_part[r] *= alpha[r];
      }
#pragma unroll
      for (int h = 0; h < 2; h++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
          for (int qq = 0; qq < 4; qq++) oacc[h][4 * j + qq] *= alpha[2 * j + (qq & 1)];
    }

    // ---- P'^T = exp2(s - m_ref) * value scale, N-major: key k of row group j at k / 8 * 1024 + j * 128 + ... ----
#pragma unroll
    for (int j = 0; j < 8; j++) {
      float p[4];
#pragma unroll
      for (int qq = 0; qq < 4; qq++)
        p[qq] = (MODE & 8) ? sacc[4 * j + qq] : exp2_approx(sacc[4 * j + qq] - m_ref[2 * j + (qq & 1)]);
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
    bar_sync(bar_id, 128);  // every warp's keys of P'^T are written

    // ---- out^T += V^T P'^T ----
    fence_regs<32>(&va[0][0][0]);
    fence_regs(oacc[0]);
    fence_regs(oacc[1]);
    u64 pdesc[4];  // k-step s: P'^T's key groups 2s, 2s + 1
#pragma unroll
    for (int s = 0; s < 4; s++) {
      pdesc[s] = smem_desc(pt_s + s * 2048, 1024, 128);
      fence_desc(pdesc[s]);
    }
    wgmma_fence();
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
      for (int s = 0; s < 4; s++)
        if (MODE & 4) {
          oacc[h][s] += __uint_as_float(va[h][s][0] ^ va[h][s][3]);
        } else {
          wgmma_rs<1>(oacc[h], va[h][s], pdesc[s], 1);
        }
    wgmma_commit();
    if (DBG == 2 && i == 0) {
      wgmma_wait<0>();
      fence_regs(oacc[0]);
      fence_regs(oacc[1]);
#pragma unroll
      for (int h = 0; h < 2; h++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
          for (int qq = 0; qq < 4; qq++)
            part[wg * 8192 + (8 * j + 2 * c + (qq & 1)) * 128 + 4 * (8 * w + g) + 2 * h + (qq >> 1)] =
                oacc[h][4 * j + qq] * ((qq >> 1) ? 1048576.f : 16777216.f);
      for (int k = wtid; k < 64 * 64; k += 128) {
        const int key = k >> 6, row = k & 63;
        const u16 hv = *reinterpret_cast<const u16*>(pt + (key >> 3) * 1024 + (row >> 3) * 128 + (key & 7) * 16 +
                                                     (row & 7) * 2);
        part[16384 + wg * 4096 + k] = half_to_float(hv);
      }
      return;
    }
    // Retired before the next tile: a wgmma still in flight while the next tile's A fragments are made would be
    // serialized by ptxas (C7513); the other warpgroup's work fills the tensor cores meanwhile.
    if (!(MODE & 64)) wgmma_wait<0>();
  }
  wgmma_wait<0>();
  fence_regs(oacc[0]);
  fence_regs(oacc[1]);
  cp_wait<0>();
  __syncthreads();  // every warpgroup is done with its stage buffers

  // ---- merge the warpgroups' softmax states ----
#pragma unroll
  for (int r = 0; r < 16; r++)
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) {
      l_part[r] += shfl_xor(l_part[r], x);
      z_part[r] += shfl_xor(z_part[r], x);
    }
  if constexpr (NWG == 1) {
    // One warpgroup: each lane's 4 consecutive dimensions of a row are one 16-byte store; the sums over warps
    // through shared memory.
    float* lz = reinterpret_cast<float*>(smem + S::STAGE);  // [4 warps][64 rows][2]
    if (g == 0) {
#pragma unroll
      for (int r = 0; r < 16; r++) {
        const int row = 8 * (r >> 1) + 2 * c + (r & 1);
        lz[(w * ROWS + row) * 2] = l_part[r];
        lz[(w * ROWS + row) * 2 + 1] = z_part[r];
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 16; r++) {
      const int j = r >> 1, e = r & 1, row = 8 * j + 2 * c + e, qi = row / group, tok = q_start + q_tile + qi;
      if (!(qi < block_q && q_tile + qi < q_len && tok < num_tokens)) continue;
      float l = 0.f, z = 0.f;
#pragma unroll
      for (int ww = 0; ww < 4; ww++) {
        l += lz[(ww * ROWS + row) * 2];
        z += lz[(ww * ROWS + row) * 2 + 1];
      }
      const i64 out_row = ((i64)split * num_tokens + tok) * num_q_heads + kvh * group + row % group;
      *reinterpret_cast<float4*>(part + out_row * HEAD_DIM + 4 * (8 * w + g)) =
          make_float4(oacc[0][4 * j + e] * 16777216.f + z, oacc[0][4 * j + 2 + e] * 1048576.f + z,
                      oacc[1][4 * j + e] * 16777216.f + z, oacc[1][4 * j + 2 + e] * 1048576.f + z);
      if (w == 0 && g == 0) {
        ml[out_row * 2] = m_ref[r];
        ml[out_row * 2 + 1] = l;
      }
    }
    return;
  }
  float* mo = reinterpret_cast<float*>(smem + S::STAGE);  // [NWG][64][128]
  float* mm = mo + NWG * ROWS * HEAD_DIM;                 // [NWG][64]
  float* ml_ = mm + NWG * ROWS;                           // [NWG][4][64]
  float* mz = ml_ + NWG * 4 * ROWS;                       // [NWG][4][64]
#pragma unroll
  for (int h = 0; h < 2; h++)
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
      for (int qq = 0; qq < 4; qq++) {
        const int dim = 4 * (8 * w + g) + 2 * h + (qq >> 1), row = 8 * j + 2 * c + (qq & 1);
        mo[(wg * ROWS + row) * HEAD_DIM + dim] = oacc[h][4 * j + qq] * ((qq >> 1) ? 1048576.f : 16777216.f);
      }
  if (g == 0) {
#pragma unroll
    for (int r = 0; r < 16; r++) {
      const int row = 8 * (r >> 1) + 2 * c + (r & 1);
      ml_[(wg * 4 + w) * ROWS + row] = l_part[r];
      mz[(wg * 4 + w) * ROWS + row] = z_part[r];
      if (w == 0) mm[wg * ROWS + row] = m_ref[r];
    }
  }
  __syncthreads();
  for (int i = tid; i < ROWS * HEAD_DIM; i += NT) {
    const int row = i >> 7, d = i & 127, qi = row / group, tok = q_start + q_tile + qi;
    if (!(qi < block_q && q_tile + qi < q_len && tok < num_tokens)) continue;
    float m = -1.0e30f;
#pragma unroll
    for (int k = 0; k < NWG; k++) m = fmaxf(m, mm[k * ROWS + row]);
    float l = 0.f, o = 0.f;
#pragma unroll
    for (int k = 0; k < NWG; k++) {
      const float fk = exp2_approx(mm[k * ROWS + row] - m);
      float lk = 0.f, zk = 0.f;
#pragma unroll
      for (int ww = 0; ww < 4; ww++) {
        lk += ml_[(k * 4 + ww) * ROWS + row];
        zk += mz[(k * 4 + ww) * ROWS + row];
      }
      l += lk * fk;
      o += (mo[(k * ROWS + row) * HEAD_DIM + d] + zk) * fk;
    }
    const i64 out_row = ((i64)split * num_tokens + tok) * num_q_heads + kvh * group + row % group;
    part[out_row * HEAD_DIM + d] = o;
    if (d == 0) {
      ml[out_row * 2] = m;
      ml[out_row * 2 + 1] = l;
    }
  }
}
