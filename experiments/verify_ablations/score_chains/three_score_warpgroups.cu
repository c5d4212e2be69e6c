// AB: smem=200640 box=176 threads=512 heads=1 parts=4 check=0
// Three score warpgroups and a refill-only warpgroup, without zero-point sums
#define NS 3
#define S_REGS 128
#define NO_PV 1
#define NO_Z 1
#include "score_chains.inc"
