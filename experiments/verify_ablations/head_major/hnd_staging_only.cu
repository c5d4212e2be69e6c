// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=0 layout=hnd
// the stage ring alone over a head-major cache
#define HND 1
#define STAGING_ONLY 1
#include "../ablations/landed_parts.inc"
