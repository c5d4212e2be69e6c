// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=0
// The skeleton without the score MMA
#define NO_DECODE 1
#define NO_SOFTMAX 1
#define NO_PV 1
#define NO_SMMA 1
#include "landed_parts.inc"
