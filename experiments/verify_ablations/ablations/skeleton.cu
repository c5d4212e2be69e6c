// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=0
// The skeleton: TMA staging, the score MMA, barriers and P'^T stores
#define NO_DECODE 1
#define NO_SOFTMAX 1
#define NO_PV 1
#include "landed_parts.inc"
