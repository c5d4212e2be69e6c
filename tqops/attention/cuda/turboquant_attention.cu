// Split-KV paged attention over a TurboQuant cache at head_dim 128, up to 16 query rows (query tokens x the GQA group)
// per program: the CUDA kernel behind tqops.attention.cuda_paged (compiled at run time with NVRTC). Keys: 4-bit or
// 3-bit Lloyd-Max codes of the rotated key with an fp16 norm (turboquant_4bit_nc, turboquant_k3v4_nc,
// turboquant_3bit_nc), or fp8 e4m3 (turboquant_k8v4); values: 4-bit or 3-bit uniform codes with an fp16 scale and
// zero point.
//
// Why CUDA: cache rows are 134, 118, 102 or 196 bytes, so only 2-byte aligned, and the Triton kernel loads packed
// codes a byte at a time. Here each warp stages whole rows with 16-byte cp.async copies of the aligned 16-byte chunks
// that cover them (64 keys in flight per warp), and reads its fragments from shared memory with a funnel shift. Where
// a slot (every kv head's row of a key) is a multiple of 8 bytes but not of 16 (4 kv heads of 134-byte rows: one
// rank's share of 8 under 2-way tensor parallelism), CP = 8 copies each chunk as two 8-byte pieces from 8-byte
// boundaries, so every staged row still starts at the same offset. On sm_90, per-head programs of the code formats
// with 16-byte aligned slots stage each 16-key tile as one TMA box instead (cuda_paged.tensor_map): no per-thread
// address arithmetic, and the warp waits on an mbarrier. Code keys decode through a 256-entry table of fp16 centroid
// pairs replicated per lane (no bank conflicts), fp8 keys by sm_89's pair conversion, values as fp16 subnormals; both
// products are mma.m16n8k16 with the keys (scores) or the dimensions (output) as M and the query rows as N.
//
// Channel orders are chosen so each lane's fragments are contiguous bytes of a row. 4-bit and fp8 keys: in k-step s,
// the score MMA's K index 2c + e (c = lane % 4) is channel 32c + 4s + e and 2c + 8 + e is channel 32c + 4s + 2 + e,
// so a lane reads bytes 16c .. 16c + 15 (fp8: 32c .. 32c + 31) of its key. 3-bit keys: a lane reads the two 6-byte
// chunks 2c and 2c + 1 (bytes 12c .. 12c + 11); their three code words plus a fourth made of the chunks' high bits are
// looked up like the 4-bit words, in the order `k3_code` gives. 4-bit values: rows g and g + 8 (g = lane / 4) of
// output m-tile t are dimensions 16g + 2t and 16g + 2t + 1, so a lane reads bytes 8g .. 8g + 7 of four keys' value
// codes. 3-bit values: a lane reads chunk g (bytes 6g .. 6g + 5) of four keys, and m-tile t holds two of its codes
// (see the output write).
//
// A program serves one kv head, its warps taking turns at the split's keys (merged at the end), or, with AH (all
// heads), every kv head with a warp each: the program then stages whole slots, so the 8 heads' rows of a block are one
// contiguous range read once, where 8 per-head programs read interleaved 134-byte rows, sharing 32-byte sectors. On
// sm_90 that range arrives as one bulk copy per 16-key tile, issued by thread 0.
//
// Each program writes the unnormalized fp32 partial output and (max, sum) in log2 units of its split, the layout the
// Triton split combiner merges.

#include "common.cuh"

#define KT 16                  // keys per MMA M tile

// A cache row: KB-bit key codes and an fp16 norm (or fp8 e4m3 keys, KB = 8), VB-bit value codes, fp16 scale, fp16
// zero point (134, 118, 102 or 196 bytes); STAGE: the 16-byte chunks that cover it at any 2-byte alignment.
template <int KB, int VB>
struct Row {
  static constexpr int NORM_OFF = HEAD_DIM * KB / 8;
  static constexpr int VALUE_OFF = NORM_OFF + (KB == 8 ? 0 : 2);
  static constexpr int SCALE_OFF = VALUE_OFF + HEAD_DIM * VB / 8;
  static constexpr int ZERO_OFF = SCALE_OFF + 2;
  static constexpr int BYTES = ZERO_OFF + 2;
  static constexpr int CHUNKS = KB == 8 ? 14 : 10;  // (14 + BYTES) / 16 rounded up; 10 for the 3-bit rows too
  static constexpr int STAGE = 16 * CHUNKS;
};

// 3-bit keys: the code (0 .. 31, chunk 2c + code / 16, index code % 16 in it) behind nibble `nib` of byte `vb` of a
// lane's four code words: its chunks' low-bit words A0 A1 | A2 B0 | B1 B2 (halfwords q = 0, 1, 2 of chunks A, B hold
// x_4q .. x_4q+3 in their nibbles' low 3 bits) and the high word (x_12 .. x_15 of A, then of B, one per nibble).
__device__ __forceinline__ constexpr int k3_code(int vb, int nib) {
  return vb < 4 ? 2 * vb + nib                            // A: x_0 .. x_7
       : vb < 6 ? 8 + 2 * (vb - 4) + nib                  // A: x_8 .. x_11
       : vb < 12 ? 16 + 2 * (vb - 6) + nib                // B: x_0 .. x_11
       : vb < 14 ? 12 + 2 * (vb - 12) + nib               // A: x_12 .. x_15
       : 16 + 12 + 2 * (vb - 14) + nib;                   // B: x_12 .. x_15
}

__device__ __forceinline__ void cp_async8(u32 dst, u64 src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
}

// Two fp8 e4m3 values (low byte first) as fp16x2 (sm_89 and later).
__device__ __forceinline__ u32 e4m3x2_to_half2(u16 x) {
  u32 r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(x));
  return r;
}

// d += a @ b: a [16 x 16] row-major fp16 fragment, b [16 x 8] column fragment, d [16 x 8] fp32.
__device__ __forceinline__ void mma16816(float* d, const u32* a, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}



// The dimension of output element e of m-tile t in lane row g (set in `dim`), and the unit its value codes were read
// in (returned). 4-bit: dims 16g + 2t (e < 2) and 16g + 2t + 1, in units 2^-24 and 2^-20. 3-bit: x_j of chunk g,
// nibble j % 4 of its word, in units 2^-24, 2^-20, 2^-16, 2^-16 by nibble.
template <int VB>
__device__ __forceinline__ float output_dim(int t, int e, int g, int& dim) {
  const int nib = 2 * (t & 1) + (e >> 1), x = 4 * (t >> 1) + nib;
  dim = VB == 4 ? 16 * g + 2 * t + (e >> 1) : (x < 8 ? 8 * g + x : 56 + 8 * g + x);
  return (VB == 4 ? (e >> 1) == 0 : nib == 0) ? 16777216.f : (VB == 4 || nib == 1) ? 1048576.f : 65536.f;
}

// Calls fn(n tile, m tile, element, query row, dimension, value unit) for each output element of lane (g, c).
template <int NT, int VB, typename F>
__device__ __forceinline__ void each_output(int g, int c, F&& fn) {
#pragma unroll
  for (int nt = 0; nt < NT; nt++)
#pragma unroll
    for (int t = 0; t < 8; t++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        int dim;
        const float unit = output_dim<VB>(t, e, g, dim);
        fn(nt, t, e, 8 * nt + 2 * c + (e & 1), dim, unit);
      }
}

// KH: MMA M tiles (of KT keys) per warp iteration. With KH > 1 the registers are capped at 128 (16 warps per SM),
// which they would otherwise exceed; KH = 1 keeps the plain bound (its allocation is 128 registers either way, but
// the capped form measured 144 for it).
template <int NW, int KH>
struct Bounds {
  static constexpr int min_blocks = KH > 1 ? 512 / (NW * 32) : 0;
};

template <int NT, int NW, int KH, bool Q_BF16, int KB, int VB, bool AH = false, int CP = 16>
__global__ void __launch_bounds__(NW * 32, Bounds<NW, KH>::min_blocks) turboquant_attention(
    SPLIT_KV_PARAMS, const __grid_constant__ TensorMap cache_map) {
  using R = Row<KB, VB>;
  static_assert((KB == 4 || KB == 3 || KB == 8) && (VB == 4 || VB == 3), "4-bit or 3-bit codes, or fp8 keys");
  static_assert(16 * R::CHUNKS >= 14 + R::BYTES, "a row's chunks cover it at every 2-byte alignment");
  static_assert(CP == 16 || (CP == 8 && !AH), "8-byte copies for per-head programs only");
  constexpr int STAGE_ROW = R::STAGE;
  constexpr int ROWS = 8 * NT;  // query rows (tokens x GQA group): the N side of both MMAs
  constexpr int STAGES = 4 / KH;  // warp tiles (KH x KT keys) in flight per warp: 64 keys
  // Per-head programs of the code formats with 16-byte aligned slots stage each M tile as one TMA box through
  // `cache_map` (R::STAGE bytes from the 16-byte boundary at or before this head's row x KT slots), issued by the
  // warp's lane 0 and counted by the warp's mbarrier for the stage; the others copy 16- or 8-byte pieces with
  // cp.async. fp8 keys' 224-byte boxes measured slower than their cp.async copies (docs/tuning.md). The host passes a
  // map wherever slots are 16-byte pieces on sm_90 (cuda_paged.decode_tensor_map); this choice is the kernel's.
  constexpr bool TMA = TQ_TMA && !AH && CP == 16 && KB != 8;
  // All-heads programs on sm_90 stage each M tile's 16 whole slots, contiguous in the cache, as one bulk copy issued
  // by thread 0 and counted by the stage's mbarrier.
  constexpr bool BULK = TQ_TMA && AH;
  // After the loop the stage buffers hold each warp's partial output, max, sum and zero-point term.
  static_assert(AH || STAGES * KH * KT * STAGE_ROW >= ROWS * (HEAD_DIM + 3) * 4, "stage buffers too small for the merge");
  // Stage buffers [NW][STAGES][KH x KT][STAGE_ROW]; after the loop, the warps' partial results.
  extern __shared__ __align__(128) u8 stage[];  // TMA boxes land on 128-byte boundaries
  // The key decoder's table (fill_pair_table); fp8 keys need none.
  __shared__ u32 pair_table[KB == 8 ? 1 : 256 * 32];
  __shared__ u64 stage_full[(TMA ? NW : 1) * STAGES];  // TMA: [warp][stage] mbarriers; BULK: [stage]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  // AH (all heads): warp w serves kv head w over the program's keys, staged as whole slots of every head; otherwise
  // the program serves kv head blockIdx.y and its warps take turns at the keys.
  const int pid = blockIdx.x, kvh = AH ? warp : blockIdx.y, split = blockIdx.z;

  const int b = tile_sequence(pid, block_q, qsl, num_seqs);
  const int q_start = qsl[b];
  const int q_len = qsl[b + 1] - q_start;
  const int q_tile = block_q == 1 ? pid - q_start : (pid - (q_start / block_q + b)) * block_q;
  if (q_tile >= q_len) return;  // a padding token's program: the combiner writes its zeros
  const int seq_len = seq_lens[b];
  const int ctx = seq_len - q_len;

  // This program's keys: the split's share of the visible ones, in whole KT tiles, dealt to the warps in turn.
  const float qk_scale = (float)qk_scale_d;
  const int bs_mask = (1 << log2_bs) - 1;
  const int tile_last = min(q_tile + block_q, q_len) - 1;
  int kv_end = min(seq_len, max_blocks << log2_bs);
  if (causal) kv_end = min(kv_end, ctx + tile_last + 1);
  kv_end = max(kv_end, 0);
  constexpr int WT = KT * KH;  // keys per warp tile
  const int per_split = ((kv_end + num_splits - 1) / num_splits + WT - 1) / WT * WT;
  const int s_begin = split * per_split;
  const int s_end = min(kv_end, s_begin + per_split);
  const int n_tiles = s_end > s_begin ? (s_end - s_begin + WT - 1) / WT : 0;
  const int my_tiles = AH ? n_tiles : n_tiles > warp ? (n_tiles - warp + NW - 1) / NW : 0;
  auto tile_key = [&](int i) -> int { return s_begin + (AH ? i : warp + i * NW) * WT; };
  // Bytes between staged rows: a staged row of this head, or (AH) a whole slot of every head.
  const int row_stride = AH ? slot_stride : STAGE_ROW;
  const int* bt_row = block_table + (i64)b * stride_bt;
  int pos[NT][2];  // query position of this lane's score columns (rows 8nt + 2c + e)
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    pos[nt][0] = ctx + q_tile + (8 * nt + 2 * c) / group;
    pos[nt][1] = ctx + q_tile + (8 * nt + 2 * c + 1) / group;
  }

  // Block and slot strides are multiples of CP (the host checks), so every row of this kv head starts `a` bytes past
  // a CP-byte boundary: the chunks to copy and every offset into a staged row are the same for all tiles.
  // (AH: `a` is the row's offset in its slot, and the copies start at the slots.)
  const u64 head_addr = reinterpret_cast<u64>(cache) + (u64)kvh * head_stride;
  const int a = AH ? kvh * head_stride : (int)(head_addr & (CP - 1));
  const u64 head_base = AH ? reinterpret_cast<u64>(cache) : head_addr - a;
  u8* my_stage = stage + (AH ? 0 : warp * STAGES * WT * STAGE_ROW);
  const u32 my_stage_s = smem_addr(my_stage);
  constexpr int CH = WT * R::CHUNKS / 32;  // chunks per lane per warp tile
  u32 dst_off[CH], src_off[CH];
  bool take[CH], take_hi[CH], upper[CH];
#pragma unroll
  for (int j = 0; j < CH; j++) {
    const int chunk = j * 32 + lane, r = chunk / R::CHUNKS, ch = chunk - r * R::CHUNKS;
    dst_off[j] = r * STAGE_ROW + ch * 16;
    src_off[j] = (r % KT) * slot_stride + ch * 16;
    upper[j] = r >= KT;
    take[j] = ch * 16 < a + R::BYTES;
    take_hi[j] = ch * 16 + 8 < a + R::BYTES;  // CP = 8: the chunk's second piece (none past the row's last byte)
  }
  // An M tile's KT keys start at a multiple of KT, so they share one block (block_size >= 16): one block id per M
  // tile. Ids outside [0, num_blocks) read block 0 and their keys are dropped.
  struct Blocks {
    int id[KH];
    // Whether M tile h's block id is a block of the cache; the copies read block 0 in its place (masked later).
    __device__ bool ok(int h, int num_blocks) const { return id[h] >= 0 && id[h] < num_blocks; }
    // The block the copies of M tile h read.
    __device__ int copied(int h, int num_blocks) const { return ok(h, num_blocks) ? id[h] : 0; }
  };
  auto tile_block = [&](int i) -> Blocks {
    Blocks blk;
#pragma unroll
    for (int h = 0; h < KH; h++)
      blk.id[h] = i < my_tiles ? bt_row[(tile_key(i) + h * KT) >> log2_bs] : 0;
    return blk;
  };
  const u32 full_s = smem_addr(stage_full) + (TMA ? warp * STAGES * 8 : 0);
  if ((TMA && lane == 0) || (BULK && tid == 0)) {
    for (int s = 0; s < STAGES; s++) mbar_init(full_s + 8 * s, 1);
    mbar_init_fence();
  }
  __syncwarp();  // BULK: the other warps first wait after the table's __syncthreads
  // The first byte M tile h of tile i is copied from: this program's staged range of its slot.
  auto tile_src = [&](int i, const Blocks& blk, int h) -> u64 {
    return head_base + (u64)blk.copied(h, num_blocks) * block_stride +
           (u64)(((tile_key(i) + h * KT) & bs_mask) * slot_stride);
  };
  auto issue = [&](int i, const Blocks& blk) {
    if (TMA && i < my_tiles && lane == 0) {
      const u32 st = my_stage_s + (i % STAGES) * WT * row_stride, full = full_s + 8 * (i % STAGES);
      mbar_expect(full, WT * STAGE_ROW);
#pragma unroll
      for (int h = 0; h < KH; h++)
        tma_load_3d(st + h * KT * STAGE_ROW, &cache_map, kvh * head_stride - a, (tile_key(i) + h * KT) & bs_mask,
                    blk.copied(h, num_blocks), full);
    }
    if (BULK && i < my_tiles && tid == 0) {
      const u32 st = my_stage_s + (i % STAGES) * WT * row_stride, full = full_s + 8 * (i % STAGES);
      const u32 tile_bytes = KT * slot_stride;
      mbar_expect(full, KH * tile_bytes);
#pragma unroll
      for (int h = 0; h < KH; h++) bulk_load(st + h * tile_bytes, tile_src(i, blk, h), tile_bytes, full);
    }
    if (!TMA && !BULK && i < my_tiles) {
      u64 base[KH];
#pragma unroll
      for (int h = 0; h < KH; h++) base[h] = tile_src(i, blk, h);
      const u32 st = my_stage_s + (i % STAGES) * WT * row_stride;
      if constexpr (AH) {
        // The M tiles' slots of every head, contiguous in the cache: 16-byte chunks dealt to all threads.
        const int tile_bytes = KT * slot_stride;
        for (int off = tid * 16; off < KH * tile_bytes; off += NW * 32 * 16)
          cp_async16(st + off, (KH > 1 && off >= tile_bytes ? base[KH - 1] + (off - tile_bytes) : base[0] + off));
      } else {
#pragma unroll
        for (int j = 0; j < CH; j++)
          if (take[j]) {
            const u64 src = (KH > 1 && upper[j] ? base[KH - 1] : base[0]) + src_off[j];
            if constexpr (CP == 16) {
              cp_async16(st + dst_off[j], src);
            } else {
              cp_async8(st + dst_off[j], src);
              if (take_hi[j]) cp_async8(st + dst_off[j] + 8, src + 8);
            }
          }
      }
    }
    cp_commit();  // an empty group past the last tile keeps the group count uniform
  };
  // The first tiles' copies go out before the table and the query are made, which they overlap.
#pragma unroll
  for (int i = 0; i < STAGES - 1; i++) issue(i, tile_block(i));
  Blocks blk_next = tile_block(STAGES - 1);

  if (KB != 8) fill_pair_table(pair_table, pairs, tid, NW * 32);  // fp8 keys need no table

  // The rotated query (q * signs) @ H / sqrt(d), made by every warp for itself: 8 lanes per row, 16 channels each,
  // butterflies of span < 16 in registers and the rest across lanes; then each lane gathers its B fragments. fp8 keys
  // are not rotated: the query as it is.
  float xs[2 * NT][16];
#pragma unroll
  for (int pass = 0; pass < 2 * NT; pass++) {
    const int m = 4 * pass + (lane >> 3), part8 = lane & 7;
    const int qi = m / group, hg = m % group, tok = q_start + q_tile + qi;
    const bool ok = qi < block_q && q_tile + qi < q_len && tok < num_tokens;
    float* x = xs[pass];
#pragma unroll
    for (int i = 0; i < 16; i++) {
      const int d = 16 * part8 + i;
      float v = 0.f;
      if (ok) {
        const u16 bits = q[(i64)tok * stride_qt + (i64)(kvh * group + hg) * stride_qh + d];
        v = Q_BF16 ? __uint_as_float((u32)bits << 16) : half_to_float(bits);
      }
      x[i] = KB == 8 ? v : v * signs[d];
    }
    if (KB != 8) hadamard_8_lanes(xs[pass], part8);
  }
  // B fragment of k-step s, row 8nt + g: channel ch of row 8nt + g is held by lane (g % 4) * 8 + ch / 16 of pass
  // 2nt + g / 4 at element ch % 16. 4-bit and fp8 keys: K indices 2c + e, 2c + 8 + e are channels 32c + 4s .. + 3.
  // 3-bit keys: code k3_code(2s + k / 2, k % 2) of the lane's chunks, index i in chunk 2c + n (n = 0, 1): channel
  // 16c + 8n + i for i < 8, 64 + 16c + 8n + i - 8 above.
  u32 qb[NT][8][2];
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
#pragma unroll
    for (int s = 0; s < 8; s++) {
      float v[4];
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const int code = k3_code(2 * s + (k >> 1), k & 1);
        const int src = (g & 3) * 8 + (KB != 3 ? 2 * c + (s >> 2) : c + 4 * ((code >> 3) & 1));
        const int elem = KB != 3 ? (4 * s + k) & 15 : 8 * (code >> 4) + (code & 7);
        const float lo_pass = __shfl_sync(0xffffffffu, xs[2 * nt][elem], src);
        const float hi_pass = __shfl_sync(0xffffffffu, xs[2 * nt + 1][elem], src);
        v[k] = (g < 4 ? lo_pass : hi_pass) * (KB == 8 ? 1.f : 0.08838834764831845f);
      }
      qb[nt][s][0] = pack_half2(v[0], v[1]);
      qb[nt][s][1] = pack_half2(v[2], v[3]);
    }
  }
  __syncthreads();  // the table is made

  // Offsets (from a stage buffer) of this lane's reads: key codes and norm, scale and zero point of rows g and g + 8,
  // value codes of rows 2c, 2c + 1, 2c + 8, 2c + 9.
  const int key_off = g * row_stride + (a & ~3) + (KB == 8 ? 32 : KB == 4 ? 16 : 12) * c;
  const u32 key_shift = (a & 2) * 8;
  // 4-bit values: bytes 8g .. 8g + 7 of a row's codes; 3-bit: its chunk g (bytes 6g .. 6g + 5).
  const int val_off = 2 * c * row_stride + (VB == 4 ? ((a + R::VALUE_OFF) & ~3) + 8 * g
                                                  : (a + R::VALUE_OFF + 6 * g) & ~3);
  const u32 val_shift = ((a + R::VALUE_OFF + (VB == 4 ? 0 : 6 * g)) & 2) * 8;
  const int aux_off = g * row_stride + a;
  const u32 lane4 = lane * 4;
  const u8* table8 = reinterpret_cast<const u8*>(pair_table);
  // Source lanes of the P^T fragment: keys 2c and 2c + 1 sit in lanes (2c, g / 2) and (2c + 1, g / 2), this lane's
  // row g in half g % 2 of their packed pairs.
  const int src_a = 8 * c + (g >> 1), src_b = src_a + 4;
  const u32 half_sel = (g & 1) ? 0x7632u : 0x5410u;

  float acc[NT][8][4];
#pragma unroll
  for (int nt = 0; nt < NT; nt++)
#pragma unroll
    for (int t = 0; t < 8; t++) acc[nt][t][0] = acc[nt][t][1] = acc[nt][t][2] = acc[nt][t][3] = 0.f;
  float m_run[NT][2], l_run[NT][2], z_run[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; nt++)
#pragma unroll
    for (int e = 0; e < 2; e++) {
      m_run[nt][e] = -1.0e30f;
      l_run[nt][e] = 0.f;
      z_run[nt][e] = 0.f;
    }

  for (int i = 0; i < my_tiles; i++) {
    const Blocks blk = tile_block(i);
    if constexpr (AH) {
      if constexpr (BULK) {
        mbar_wait(full_s + 8 * (i % STAGES), (i / STAGES) & 1);  // tile i is staged
      } else {
        cp_wait<STAGES - 2>();
      }
      __syncthreads();  // tile i is staged by every thread; every warp is done with tile i - 1's buffer
      issue(i + STAGES - 1, blk_next);
    } else {
      issue(i + STAGES - 1, blk_next);
      if constexpr (TMA) {
        mbar_wait(full_s + 8 * (i % STAGES), (i / STAGES) & 1);  // tile i is staged
      } else {
        cp_wait<STAGES - 1>();
      }
      __syncwarp();
    }
    blk_next = tile_block(i + STAGES);
    const u8* st_tile = my_stage + (i % STAGES) * WT * row_stride;
    const int k_tile = tile_key(i);

    float s[KH][NT][4], vsc[KH][2], vzr[KH][2];
#pragma unroll
    for (int h = 0; h < KH; h++) {
      const u8* st = st_tile + h * KT * row_stride;
      const int k0 = k_tile + h * KT;
      const bool blk_ok = blk.ok(h, num_blocks);
      // ---- scores^T [keys, rows]: keys g and g + 8 are this lane's A rows; a byte of codes is one table lookup ----
      u32 ka[8][4];
      if (KB == 8) {
        // fp8 keys: word s of a lane's 32 bytes is channels 32c + 4s .. + 3, two e4m3 pairs converted in one
        // instruction each.
        const u32* p0 = reinterpret_cast<const u32*>(st + key_off);
        const u32* p1 = reinterpret_cast<const u32*>(st + key_off + 8 * row_stride);
        u32 w0[9], w1[9];
#pragma unroll
        for (int k = 0; k < 9; k++) {
          w0[k] = p0[k];
          w1[k] = p1[k];
        }
#pragma unroll
        for (int t = 0; t < 8; t++) {
          const u32 x0 = funnel_right(w0[t], w0[t + 1], key_shift), x1 = funnel_right(w1[t], w1[t + 1], key_shift);
          ka[t][0] = e4m3x2_to_half2((u16)x0);
          ka[t][1] = e4m3x2_to_half2((u16)x1);
          ka[t][2] = e4m3x2_to_half2((u16)(x0 >> 16));
          ka[t][3] = e4m3x2_to_half2((u16)(x1 >> 16));
        }
      } else {
        const u32* p0 = reinterpret_cast<const u32*>(st + key_off);
        const u32* p1 = reinterpret_cast<const u32*>(st + key_off + 8 * row_stride);
        constexpr int KW = KB == 4 ? 4 : 3;  // code words of the row a lane reads
        u32 w0[KW + 1], w1[KW + 1], c0[4], c1[4];
#pragma unroll
        for (int k = 0; k <= KW; k++) {
          w0[k] = p0[k];
          w1[k] = p1[k];
        }
#pragma unroll
        for (int t = 0; t < KW; t++) {
          c0[t] = funnel_right(w0[t], w0[t + 1], key_shift);
          c1[t] = funnel_right(w1[t], w1[t + 1], key_shift);
        }
        if (KB == 3) {
          // The high word: nibble j of halfword h is x_12+j of chunk A (h = 0) or B (h = 1); bit q of it is bit 3 of
          // nibble j of the chunk's halfword q. The table ignores bit 3 of the low-bit words' nibbles.
          auto high = [](u32 a0, u32 a1, u32 a2) {
            return ((a0 >> 3) & 0x1111u) | ((a0 >> 18) & 0x2222u) | ((a1 >> 1) & 0x4444u) |
                   ((a1 >> 3) & 0x11110000u) | ((a2 << 14) & 0x22220000u) | ((a2 >> 1) & 0x44440000u);
          };
          c0[3] = high(c0[0], c0[1], c0[2]);
          c1[3] = high(c1[0], c1[1], c1[2]);
        }
        pair_lookups(ka, c0, c1, table8, lane4);
      }
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
        float even[4] = {0.f, 0.f, 0.f, 0.f}, odd[4] = {0.f, 0.f, 0.f, 0.f};  // two chains of dependent MMAs
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
          mma16816(even, ka[k], qb[nt][k][0], qb[nt][k][1]);
          mma16816(odd, ka[k + 1], qb[nt][k + 1][0], qb[nt][k + 1][1]);
        }
#pragma unroll
        for (int e = 0; e < 4; e++) s[h][nt][e] = even[e] + odd[e];
      }
      // ---- norm, value scale and zero point of keys g (e = 0) and g + 8 (e = 1), and the masks ----
      // (A branch skipping the masks on whole tiles measured slower: it splits the loop body the scheduler
      // interleaves.)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const u8* row = st + aux_off + 8 * e * row_stride;
        const int key = k0 + g + 8 * e;
        const bool ok = blk_ok && key < s_end;
        const float f = KB == 8 ? qk_scale : half_to_float(read_u16(row + R::NORM_OFF)) * qk_scale;
        vsc[h][e] = ok ? half_to_float(read_u16(row + R::SCALE_OFF)) : 0.f;
        vzr[h][e] = ok ? half_to_float(read_u16(row + R::ZERO_OFF)) : 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
          s[h][nt][2 * e] =
              (ok && (!causal || key <= pos[nt][0])) ? s[h][nt][2 * e] * f : __int_as_float(0xff800000);
          s[h][nt][2 * e + 1] =
              (ok && (!causal || key <= pos[nt][1])) ? s[h][nt][2 * e + 1] * f : __int_as_float(0xff800000);
        }
      }
    }

    // ---- online softmax: this lane holds rows 8nt + 2c + r (r = 0, 1) of keys g, g + 8 of each M tile; a row
    // spans 8 lanes ----
    float mx[NT][2];
    bool grew = false;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
      for (int r = 0; r < 2; r++) {
        float v = fmaxf(s[0][nt][r], s[0][nt][2 + r]);
#pragma unroll
        for (int h = 1; h < KH; h++) v = fmaxf(v, fmaxf(s[h][nt][r], s[h][nt][2 + r]));
        v = fmaxf(v, shfl_xor(v, 4));
        v = fmaxf(v, shfl_xor(v, 8));
        v = fmaxf(v, shfl_xor(v, 16));
        mx[nt][r] = fmaxf(m_run[nt][r], v);
        grew |= mx[nt][r] > m_run[nt][r];
      }
    }
    // Rescale only when a running max grew somewhere in the warp: after the first tiles it rarely does.
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
        const float c0 = exp2_approx(m_run[nt][0] - mx[nt][0]), c1 = exp2_approx(m_run[nt][1] - mx[nt][1]);
#pragma unroll
        for (int t = 0; t < 8; t++) {
          acc[nt][t][0] *= c0; acc[nt][t][1] *= c1; acc[nt][t][2] *= c0; acc[nt][t][3] *= c1;
        }
        l_run[nt][0] *= c0; z_run[nt][0] *= c0; l_run[nt][1] *= c1; z_run[nt][1] *= c1;
        m_run[nt][0] = mx[nt][0];
        m_run[nt][1] = mx[nt][1];
      }
    }

#pragma unroll
    for (int h = 0; h < KH; h++) {
      const u8* st = st_tile + h * KT * row_stride;
      // ---- P'^T fragments: v = zero + code * scale, the scale folds into P (fp16), the zero point is the term z ----
      u32 pb[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; e++) p[e] = exp2_approx(s[h][nt][e] - m_run[nt][e & 1]);
        l_run[nt][0] += p[0] + p[2];
        l_run[nt][1] += p[1] + p[3];
        z_run[nt][0] += p[0] * vzr[h][0] + p[2] * vzr[h][1];
        z_run[nt][1] += p[1] * vzr[h][0] + p[3] * vzr[h][1];
        const u32 h0 = pack_half2(p[0] * vsc[h][0], p[1] * vsc[h][0]);  // key g, rows 2c, 2c + 1
        const u32 h1 = pack_half2(p[2] * vsc[h][1], p[3] * vsc[h][1]);  // key g + 8
        const u32 xa0 = __shfl_sync(0xffffffffu, h0, src_a), xb0 = __shfl_sync(0xffffffffu, h0, src_b);
        const u32 xa1 = __shfl_sync(0xffffffffu, h1, src_a), xb1 = __shfl_sync(0xffffffffu, h1, src_b);
        pb[nt][0] = byte_perm(xa0, xb0, half_sel);  // keys 2c, 2c + 1 of row g
        pb[nt][1] = byte_perm(xa1, xb1, half_sel);  // keys 2c + 8, 2c + 9
      }
      // ---- out^T [dims, rows] += V^T P'^T: m-tile t holds dims value_dim(t, 0) (row g) and value_dim(t, 1) ----
      // 4-bit: a byte of two keys, one in each half of a word: its low nibbles as fp16 bits are the subnormals
      // code * 2^-24, its high nibbles (masked in place) code * 2^-20, exact, with no conversion; the output scales
      // them back. 3-bit: a halfword of two keys per word; a nibble's low 3 bits in place are code * 2^-24, 2^-20 or
      // 2^-16 (bits below 0x800 are bits * 2^-24, subnormal or not), the top nibble shifted down one nibble first.
      u32 vw[2][2][2];
#pragma unroll
      for (int j = 0; j < 2; j++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const u32* p32 = reinterpret_cast<const u32*>(st + val_off + (8 * j + e) * row_stride);
          const u32 w0 = p32[0], w1 = p32[1], w2 = p32[2];
          vw[j][e][0] = funnel_right(w0, w1, val_shift);
          vw[j][e][1] = funnel_right(w1, w2, val_shift);
        }
      }
      if (VB == 4) {
#pragma unroll
        for (int t = 0; t < 8; t++) {
          const u32 sel = (t & 3) | ((4 + (t & 3)) << 8);
          const u32 x0 = byte_perm(vw[0][0][t >> 2], vw[0][1][t >> 2], sel);  // keys 2c, 2c + 1
          const u32 x1 = byte_perm(vw[1][0][t >> 2], vw[1][1][t >> 2], sel);  // keys 2c + 8, 2c + 9
          const u32 va[4] = {x0 & 0x000F000Fu, x0 & 0x00F000F0u, x1 & 0x000F000Fu, x1 & 0x00F000F0u};
#pragma unroll
          for (int nt = 0; nt < NT; nt++) mma16816(acc[nt][t], va, pb[nt][0], pb[nt][1]);
        }
      } else {
        // Words of halfword q (x_4q .. x_4q+3) of keys 2c (low half) and 2c + 1, and of keys 2c + 8 and 2c + 9;
        // word 3 holds x_12 .. x_15, gathered from bit 3 of the other three.
        u32 xw[2][4];
#pragma unroll
        for (int j = 0; j < 2; j++) {
          xw[j][0] = byte_perm(vw[j][0][0], vw[j][1][0], 0x5410u);
          xw[j][1] = byte_perm(vw[j][0][0], vw[j][1][0], 0x7632u);
          xw[j][2] = byte_perm(vw[j][0][1], vw[j][1][1], 0x5410u);
          xw[j][3] = ((xw[j][0] >> 3) & 0x11111111u) | ((xw[j][1] >> 2) & 0x22222222u) |
                     ((xw[j][2] >> 1) & 0x44444444u);
        }
#pragma unroll
        for (int t = 0; t < 8; t++) {
          const u32 x0 = xw[0][t >> 1], x1 = xw[1][t >> 1];
          const u32 va[4] = {(t & 1) ? x0 & 0x07000700u : x0 & 0x00070007u,
                             (t & 1) ? (x0 >> 4) & 0x07000700u : x0 & 0x00700070u,
                             (t & 1) ? x1 & 0x07000700u : x1 & 0x00070007u,
                             (t & 1) ? (x1 >> 4) & 0x07000700u : x1 & 0x00700070u};
#pragma unroll
          for (int nt = 0; nt < NT; nt++) mma16816(acc[nt][t], va, pb[nt][0], pb[nt][1]);
        }
      }
    }
    __syncwarp();
  }
  cp_wait<0>();

  // ---- merge the warps' partial softmax states ----
#pragma unroll
  for (int nt = 0; nt < NT; nt++)
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
      for (int x = 4; x < 32; x <<= 1) {
        l_run[nt][r] += shfl_xor(l_run[nt][r], x);
        z_run[nt][r] += shfl_xor(z_run[nt][r], x);
      }
  if constexpr (AH) {
    // Each warp's rows are complete over the split (one kv head per warp): written from registers.
    each_output<NT, VB>(g, c, [&](int nt, int t, int e, int row, int dim, float unit) {
      const int qi = row / group, tok = q_start + q_tile + qi;
      if (!(qi < block_q && q_tile + qi < q_len && tok < num_tokens)) return;
      const i64 out_row = ((i64)split * num_tokens + tok) * num_q_heads + kvh * group + row % group;
      part[out_row * HEAD_DIM + dim] = acc[nt][t][e] * unit + z_run[nt][e & 1];
      if (g == 0 && t == 0 && e < 2) {
        ml[out_row * 2] = m_run[nt][e];
        ml[out_row * 2 + 1] = l_run[nt][e];
      }
    });
    return;
  }
  __syncthreads();  // every warp is done with its stage buffers
  float* wacc = reinterpret_cast<float*>(stage);  // [NW][ROWS][HEAD_DIM]
  float* wm = wacc + NW * ROWS * HEAD_DIM;         // [NW][ROWS]
  float* wl = wm + NW * ROWS;
  float* wz = wl + NW * ROWS;
  each_output<NT, VB>(g, c, [&](int nt, int t, int e, int row, int dim, float unit) {
    wacc[(warp * ROWS + row) * HEAD_DIM + dim] = acc[nt][t][e] * unit;
  });
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    if (g == 0) {
#pragma unroll
      for (int r = 0; r < 2; r++) {
        wm[warp * ROWS + 8 * nt + 2 * c + r] = m_run[nt][r];
        wl[warp * ROWS + 8 * nt + 2 * c + r] = l_run[nt][r];
        wz[warp * ROWS + 8 * nt + 2 * c + r] = z_run[nt][r];
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < ROWS * HEAD_DIM; i += NW * 32) {
    const int row = i / HEAD_DIM, d = i % HEAD_DIM;
    const int qi = row / group, hg = row % group, tok = q_start + q_tile + qi;
    if (!(qi < block_q && q_tile + qi < q_len && tok < num_tokens)) continue;
    float m = -1.0e30f;
#pragma unroll
    for (int w = 0; w < NW; w++) m = fmaxf(m, wm[w * ROWS + row]);
    float l = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < NW; w++) {
      const float f = exp2_approx(wm[w * ROWS + row] - m);
      l += wl[w * ROWS + row] * f;
      o += (wacc[(w * ROWS + row) * HEAD_DIM + d] + wz[w * ROWS + row]) * f;
    }
    const i64 out_row = ((i64)split * num_tokens + tok) * num_q_heads + kvh * group + hg;
    part[out_row * HEAD_DIM + d] = o;
    if (d == 0) {
      ml[out_row * 2] = m;
      ml[out_row * 2 + 1] = l;
    }
  }
}
