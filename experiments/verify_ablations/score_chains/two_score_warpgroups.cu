// AB: smem=180416 box=176 threads=384 heads=1 parts=2 check=0
// Two score warpgroups and a refill-only warpgroup, without zero-point sums
#define NS 2
#define S_REGS 152
#define NO_PV 1
#define NO_Z 1
#include "score_chains.inc"
