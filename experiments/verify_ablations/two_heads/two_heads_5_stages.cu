// AB: smem=181616 box=304 threads=256 heads=2 parts=1 check=1
// The library's verify kernel for two kv heads per program (an experiment): one warpgroup per head, both
// heads' adjacent rows staged as one 304-byte box through a 16-bit tensor map (a box dimension holds at most
// 256 elements), both warpgroups meeting at the top of each tile. docs/tuning.md, "Two kv heads per program".
//
// Split-KV paged attention for up to 64 query rows per kv head (query tokens x the GQA group: a 16-token verify at
// group 4) over a turboquant_4bit_nc cache at head_dim 128, on sm_90 warpgroup MMAs: the kernel behind
// tqops.attention.cuda_verify (compiled at run time with NVRTC for sm_90a).
//
// The products run transposed, keys as M: scores^T [64 keys, 64 rows] = K [keys, dims] Q^T and
// out^T [128 dims, 64 rows] += V^T [dims, keys] P'^T, both wgmma m64n64k16 with the A operand in registers. So each
// warp decodes only its own 16 keys (scores) or its own 32 dimensions (output) of a 64-key tile, straight from the
// staged codes into A fragments, and no decoded tile goes through shared memory; Q^T (made once per program) and
// P'^T (written per tile) are the shared-memory B operands. One warpgroup per program, two programs per SM.
//
// Tiles are staged by TMA: one box per block segment of a tile (the tile's keys in one cache block: 64 slots, or
// the block's slots where blocks are smaller) of this head's rows, STAGE_ROW bytes wide from the 16-byte boundary at
// or before the row, through a tensor map of the cache as [blocks][slots][slot bytes] (cuda_paged.tensor_map). The
// boxes are issued by one lane per segment, spread over the warps, and counted by the stage's mbarrier; no thread
// spends instructions on the copies' addresses.
//
// Channel orders as in turboquant_attention.cu: in k-step s the score MMA's K index 2c + e (c = lane % 4) is channel
// 32c + 4s + e and 2c + 8 + e is channel 32c + 4s + 2 + e, so a lane's key bytes are 16c .. 16c + 15 of its key,
// one centroid-pair table lookup per byte. Values: row g (g = lane / 4) of warp w's M tile in output MMA h is
// dimension 4(8w + g) + 2h, row g + 8 the next one: the low and high nibble of value byte 2(8w + g) + h, which as
// fp16 bits are the exact subnormals code * 2^-24 and code * 2^-20; the value scale folds into P', the zero point
// is the per-row term z.
//
// The softmax rescales lazily: P' = exp2(s - m_ref) with a per-row reference max that moves only when a score
// passes it by more than RESCALE_LOG2 (a warpgroup-wide vote), so most tiles compute no row maxima at all.
//
// Each program writes the unnormalized fp32 partial output and (max, sum) in log2 units of its split, the layout the
// Triton split combiner merges (as turboquant_attention.cu). Its measurements and the designs
// measured against it: docs/tuning.md ("The sm_90 verify kernel").

#include "../../../tqops/attention/cuda/common.cuh"

#define ROWS 64           // query rows per program: the N of both MMAs
#define TILE 64           // keys per warpgroup tile: the M of the score MMA
#define ROW_BYTES 134     // a turboquant_4bit_nc row: 64 code bytes, fp16 norm, 64 value bytes, fp16 scale, zero
#define NORM_OFF 64
#define VALUE_OFF 66
#define SCALE_OFF 130
#define ZERO_OFF 132
#define STAGE_ROW 304     // staged row stride, the TMA box's width (44 words: a warp's value reads fall on distinct
                          // banks)
#define RESCALE_LOG2 8.f
#define STAGES 5
#define THREADS 256       // two warpgroups: kv heads 2y and 2y + 1

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

// Shared memory, in bytes from the start of the dynamic buffer (cuda_verify.SMEM_BYTES mirrors TOTAL).
struct Smem {
  static constexpr int TABLE = 0;                        // [256][32] u32: centroid pairs, replicated per lane
  static constexpr int QS = TABLE + 256 * 32 * 4;        // Q^T: [8 row groups][16 K groups][8 rows][16 bytes]
  static constexpr int PT = QS + 2 * ROWS * HEAD_DIM * 2;    // P'^T: [8 key groups][8 row groups][8 keys][16 bytes]
  static constexpr int XMAX = PT + 2 * TILE * ROWS * 2;      // [4 warps][64 rows] fp32 row maxima
  static constexpr int STAGE = XMAX + 2 * 4 * ROWS * 4;      // [STAGES][64 rows][STAGE_ROW], 128-byte aligned boxes
  static constexpr int MBAR = STAGE + STAGES * TILE * STAGE_ROW;  // [STAGES] u64 mbarriers: the stage is full
  static constexpr int FLAGS = MBAR + STAGES * 8;        // [STAGES][64] whether a segment's block id is valid
  static constexpr int TOTAL = FLAGS + STAGES * TILE;
  static_assert(STAGE % 128 == 0 && (16 * STAGE_ROW) % 128 == 0, "TMA boxes land on 128-byte boundaries");
  static_assert(STAGE_ROW >= 15 + 2 * ROW_BYTES, "a box holds its two rows from the 16-byte boundary before them");
  static_assert(STAGES * TILE * STAGE_ROW >= 4 * ROWS * 2 * 4, "the stage buffers hold the warps' row sums at the end");
};

template <bool Q_BF16>
__global__ void __launch_bounds__(THREADS, 1) turboquant_verify(
    SPLIT_KV_PARAMS, const __grid_constant__ TensorMap cache_map) {
  using S = Smem;
  constexpr int NT = THREADS;
  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int wg = tid >> 7, w = (tid >> 5) & 3, tid_w = tid & 127;
  const int pid = blockIdx.x, kvh = 2 * blockIdx.y + wg, split = blockIdx.z;

  const int b = tile_sequence(pid, block_q, qsl, num_seqs);
  const int q_start = qsl[b], q_len = qsl[b + 1] - q_start;
  const int q_tile = block_q == 1 ? pid - q_start : (pid - (q_start / block_q + b)) * block_q;
  if (q_tile >= q_len) return;  // a padding token's program: the combiner writes its zeros
  const int seq_len = seq_lens[b], ctx = seq_len - q_len;
  const int tile_last = min(q_tile + block_q, q_len) - 1;
  int kv_end = min(seq_len, max_blocks << log2_bs);
  if (causal) kv_end = min(kv_end, ctx + tile_last + 1);
  kv_end = max(kv_end, 0);
  const int per_split = ((kv_end + num_splits - 1) / num_splits + TILE - 1) / TILE * TILE;
  const int s_begin = split * per_split, s_end = min(kv_end, s_begin + per_split);
  const int n_tiles = s_end > s_begin ? (s_end - s_begin + TILE - 1) / TILE : 0;
  const int bs_mask = (1 << log2_bs) - 1;
  const int* bt_row = block_table + (i64)b * stride_bt;

  // ---- the stage ring: segment j of a tile (2^log2_seg slots of one block) is staged by lane j / 4 of warp j % 4;
  // the first tiles' boxes go out before the query and the table are made, which they overlap ----
  const int pair_x = 2 * blockIdx.y * head_stride;
  const int a0 = (int)((reinterpret_cast<u64>(cache) + (u64)pair_x) & 15);
  const int box_x = pair_x - a0;
  const int a = a0 + wg * head_stride;  // this warpgroup's row in the box
  u8* stage = smem + S::STAGE;
  const u32 stage_s = smem_addr(stage);
  u8* flags = smem + S::FLAGS;
  const u32 mbar_s = smem_addr(smem + S::MBAR);
  const int log2_seg = min(6, log2_bs), nseg = TILE >> log2_seg, seg = (lane << 2) | w;
  const bool issuer = wg == 0 && seg < nseg;
  if (tid == 0) {
    for (int s = 0; s < STAGES; s++) mbar_init(mbar_s + 8 * s, nseg);
    mbar_init_fence();
  }
  __syncthreads();  // every issuer sees the initialized mbarriers
  auto tile_key = [&](int i) { return s_begin + i * TILE; };
  auto load_id = [&](int i) {
    return issuer && i < n_tiles ? bt_row[min((tile_key(i) + (seg << log2_seg)) >> log2_bs, max_blocks - 1)] : 0;
  };
  auto issue = [&](int i, int id) {
    if (issuer && i < n_tiles) {
      const int k0 = tile_key(i) + (seg << log2_seg), slot = i % STAGES;
      const bool ok = id >= 0 && id < num_blocks;
      mbar_expect(mbar_s + 8 * slot, STAGE_ROW << log2_seg);
      // blocks of more than 64 keys: the segment starts at the tile's offset in its block
      tma_load_3d(stage_s + (slot * TILE + (seg << log2_seg)) * STAGE_ROW, &cache_map, box_x >> 1, k0 & bs_mask,
                  ok ? id : 0, mbar_s + 8 * slot);
      flags[slot * TILE + seg] = ok;
    }
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; i++) issue(i, load_id(i));
  int id_next = load_id(STAGES - 1);

  // ---- the rotated query (q * signs) H / sqrt(128) as Q^T, once per program: 8 lanes per row, 16 channels each
  // (two 16-byte loads), butterflies of span < 16 in registers and the rest across the 8 lanes ----
  u32* table = reinterpret_cast<u32*>(smem + S::TABLE);
  fill_pair_table(table, pairs, tid, NT);
  u16* qs = reinterpret_cast<u16*>(smem + S::QS + wg * ROWS * HEAD_DIM * 2);
  {
    const int part8 = tid_w & 7;
    float sg[16];
#pragma unroll
    for (int i = 0; i < 16; i++) sg[i] = signs[16 * part8 + i];
#pragma unroll
    for (int pass = 0; pass < ROWS * 8 / 128; pass++) {
      const int n = pass * 16 + (tid_w >> 3), qi = n / group, tok = q_start + q_tile + qi;
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

  // Offsets into a staged row: this lane's key bytes 16c .. 16c + 15 (read as 5 words from a 4-byte boundary), and
  // its value bytes 2(8w + g), 2(8w + g) + 1.
  const int key_off = (a & ~3) + 16 * c;
  const u32 key_shift = (a & 2) * 8;
  const int val_off = a + VALUE_OFF + 2 * (8 * w + g);
  const u32 lane4 = lane * 4;
  const u8* table8 = reinterpret_cast<const u8*>(table);
  const u32 qs_s = smem_addr(smem + S::QS + wg * ROWS * HEAD_DIM * 2);
  u8* pt = smem + S::PT + wg * TILE * ROWS * 2;
  const u32 pt_s = smem_addr(pt);
  float* xmax = reinterpret_cast<float*>(smem + S::XMAX) + wg * 4 * ROWS;
  const float qk_scale = (float)qk_scale_d;
  const int bar_id = 2 + wg;  // the warpgroup's named barrier (1: both warpgroups)

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

  for (int i = 0; i < n_tiles; i++) {
    bar_sync(1, THREADS);  // every warp of both warpgroups is done with tile i - 1's buffer, refilled next
    issue(i + STAGES - 1, id_next);
    id_next = load_id(i + STAGES);
    const int slot = i % STAGES, k0 = tile_key(i);
    while (!mbar_try_wait(mbar_s + 8 * slot, (i / STAGES) & 1)) {  // tile i is staged
    }
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
      u32 c0[4], c1[4];
#pragma unroll
      for (int t = 0; t < 4; t++) {
        c0[t] = funnel_right(w0[t], w0[t + 1], key_shift);
        c1[t] = funnel_right(w1[t], w1[t + 1], key_shift);
      }
      pair_lookups(ka, c0, c1, table8, lane4);
    }
    fence_regs<32>(&ka[0][0]);
    u64 qdesc[8];  // k-step s: Q^T's K groups 2s, 2s + 1
    k_step_descs(qdesc, qs_s, 256, 128, 2048);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 8; s++) wgmma_rs<0>(sacc, ka[s], qdesc[s], s > 0);
    wgmma_commit();

    // ---- norm, value scale and zero point of keys g (e = 0) and g + 8 (e = 1) of this warp ----
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

    // ---- V^T A fragments, made under the score MMA ----
    {
      u32 x[4][4];
#pragma unroll
      for (int s = 0; s < 4; s++)
#pragma unroll
        for (int k = 0; k < 4; k++)
          x[s][k] = read_u16(st + (16 * s + 2 * c + (k & 1) + 8 * (k >> 1)) * STAGE_ROW + val_off);
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
    if (bar_any(bar_id, 128, grow)) {
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
        p[qq] = exp2_approx(sacc[4 * j + qq] - m_ref[2 * j + (qq & 1)]);
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
    k_step_descs(pdesc, pt_s, 2048, 1024, 128);
    wgmma_fence();
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
      for (int s = 0; s < 4; s++) wgmma_rs<1>(oacc[h], va[h][s], pdesc[s], 1);
    wgmma_commit();
    // Retired before the next tile: a wgmma still in flight while the next tile's A fragments are made would be
    // serialized by ptxas (C7513); the other warpgroup's work fills the tensor cores meanwhile.
    wgmma_wait<0>();
  }
  wgmma_wait<0>();
  fence_regs(oacc[0]);
  fence_regs(oacc[1]);
  __syncthreads();  // every warp is done with the stage buffers

  // ---- the row sums over lanes (shuffles) and warps (shared memory), and the partial output ----
#pragma unroll
  for (int r = 0; r < 16; r++)
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) {
      l_part[r] += shfl_xor(l_part[r], x);
      z_part[r] += shfl_xor(z_part[r], x);
    }
  // Each lane's 4 consecutive dimensions of a row are one 16-byte store; the sums over warps go through shared
  // memory.
  float* lz = reinterpret_cast<float*>(smem + S::STAGE) + wg * 4 * ROWS * 2;  // [4 warps][64 rows][2]
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
}
