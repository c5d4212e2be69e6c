"""Copy floor of staging a turboquant_4bit_nc cache (32 x 8K, 8 kv heads) into shared memory with 16-byte cp.async,
as a function of how many adjacent heads' rows a program reads as one contiguous range per key."""
import torch
from tqops.bench.attention import _fill_cache
from tqops.bench.timing import time_graph, copy_bandwidth

SRC = r'''
typedef unsigned int u32; typedef unsigned long long u64; typedef unsigned char u8;
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r; asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p)); return r; }
template <int HEADS, int KT, int STAGES, int NT>
__global__ void __launch_bounds__(NT) stage_probe(const u8* cache, int block_stride, int slot_stride, int head_bytes,
    const int* bt, int stride_bt, int log2_bs, int keys_per_split, int* sink) {
  extern __shared__ __align__(16) u8 sm[];
  const int b = blockIdx.x, hg = blockIdx.y, split = blockIdx.z;
  const u64 start = (u64)cache + (u64)hg * HEADS * head_bytes;
  const int a = start & 15;
  const u64 base = start - a;
  const int chunks = (a + HEADS * head_bytes + 15) / 16, row = chunks * 16;
  const int k_begin = split * keys_per_split, ntiles = keys_per_split / KT;
  const u32 sbase = smem_addr(sm);
  auto issue = [&](int t) {
    if (t < ntiles) {
      for (int idx = threadIdx.x; idx < KT * chunks; idx += NT) {
        const int r = idx / chunks, ch = idx - r * chunks, key = k_begin + t * KT + r;
        const int id = bt[b * stride_bt + (key >> log2_bs)];
        const u64 src = base + (u64)id * block_stride + (u64)(key & ((1 << log2_bs) - 1)) * slot_stride + ch * 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sbase + (t % STAGES) * KT * row + r * row + ch * 16), "l"(src) : "memory");
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  for (int t = 0; t < STAGES - 1; t++) issue(t);
  int acc = 0;
  for (int t = 0; t < ntiles; t++) {
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
    __syncthreads();
    issue(t + STAGES - 1);
    acc += sm[(t % STAGES) * KT * row + threadIdx.x];
  }
  if (acc == 123456789) sink[0] = acc;
}
'''

if __name__ == "__main__":
    batch, context, kvh = 32, 8192, 8
    cache, bt = _fill_cache("turboquant_4bit_nc", batch, context, kvh, 128, 16)
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    bw = copy_bandwidth()
    nbytes = cache.numel()
    print(f"{torch.cuda.get_device_name()}: {nbytes / 1e6:.0f} MB, copy {bw / 1e12:.2f} TB/s", flush=True)
    lib = torch.cuda._utils._get_gpu_runtime_library()
    for heads, kt in ((1, 64), (2, 64), (4, 32), (8, 16)):
        for stages, nt in ((4, 128), (4, 256), (8, 256)):
            k = torch.cuda._compile_kernel(SRC, f"stage_probe<{heads}, {kt}, {stages}, {nt}>", compute_capability="90a",
                                           nvcc_options=["-std=c++17"])
            row = ((15 + heads * 134 + 15) // 16) * 16
            smem = stages * kt * row
            torch.cuda._utils._check_cuda(lib.cuFuncSetAttribute(k.func, 8, smem))
            k.set_shared_memory_config(smem)
            for splits in (1, 2, 4, 8):
                groups = kvh // heads
                if batch * groups * splits > 2048:
                    continue
                fn = lambda: k(grid=(batch, groups, splits), block=(nt, 1, 1), shared_mem=smem,
                               args=[cache, cache.stride(0), cache.stride(1), 134, bt, bt.stride(0), 4,
                                     context // splits, sink])
                us = time_graph(fn)
                print(f"heads {heads} keys/tile {kt} stages {stages} threads {nt} splits {splits} "
                      f"({batch * groups * splits} programs, {smem // 1024} KB): {us:6.1f} us "
                      f"({nbytes / us / 1e6 / (bw / 1e12) * 100:.0f}%)", flush=True)
