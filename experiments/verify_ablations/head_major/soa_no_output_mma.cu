// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=0 layout=soa
// no output MMA, soa
#define SOA 1
#define NO_PV 1
#include "../ablations/landed_parts.inc"
