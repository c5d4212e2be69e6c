// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=0
// The landed kernel without its output MMA (and so without value fragments)
#define NO_PV 1
#include "../ablations/landed_parts.inc"
