// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=1 layout=hnd
// the library kernel over a head-major cache: one bulk copy per segment, packed rows
#define HND 1
#include "../ablations/landed_parts.inc"
