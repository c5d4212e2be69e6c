// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=0
// Both
#define ALIGNED_KEYS 1
#define ALIGNED_VALUES 1
#include "../ablations/landed_parts.inc"
