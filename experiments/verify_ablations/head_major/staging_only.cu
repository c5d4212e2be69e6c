// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=0
// the stage ring alone, landed boxes
#define STAGING_ONLY 1
#include "../ablations/landed_parts.inc"
