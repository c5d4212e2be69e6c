// AB: smem=70944 box=176 threads=128 heads=1 parts=1 check=0
// The skeleton without the pair table's 32 KB, at up to 2 programs per SM
#define NO_DECODE 1
#define NO_SOFTMAX 1
#define NO_PV 1
#define NO_TABLE 1
#define MIN_BLOCKS 2
#include "landed_parts.inc"
