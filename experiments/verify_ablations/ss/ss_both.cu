// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=0
// The landed kernel with the MMAs' A tiles read from shared memory (any bytes): SS_SCORE SS_OUT
#define SS_SCORE 1
#define SS_OUT 1
#define XOR_SINK 1
#include "../ablations/landed_parts.inc"
