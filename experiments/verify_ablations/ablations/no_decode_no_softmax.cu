// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=0
// Without the key decode (the staged words as A fragments) and the softmax (P'^T = the raw scores)
#define NO_DECODE 1
#define NO_SOFTMAX 1
#include "landed_parts.inc"
