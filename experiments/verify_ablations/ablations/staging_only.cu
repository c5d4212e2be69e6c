// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=0
// The stage ring alone: top barrier, refill, staging wait, one read per lane
#define STAGING_ONLY 1
#include "landed_parts.inc"
