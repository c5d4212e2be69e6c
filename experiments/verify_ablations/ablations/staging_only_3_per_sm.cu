// AB: smem=70944 box=176 threads=128 heads=1 parts=1 check=0
// The stage ring alone without the pair table, at up to 3 programs per SM
#define STAGING_ONLY 1
#define NO_DECODE 1
#define NO_TABLE 1
#define MIN_BLOCKS 3
#include "landed_parts.inc"
