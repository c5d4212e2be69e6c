// AB: smem=70944 box=176 threads=128 heads=1 parts=1 check=0 layout=hnd per_sm=3
#define HND 1
#define STAGING_ONLY 1
#define NO_DECODE 1
#define NO_TABLE 1
#define MIN_BLOCKS 3
#include "../ablations/landed_parts.inc"
