// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=1 layout=soa
// the library kernel over a head-major structure-of-arrays cache
#define SOA 1
#include "../ablations/landed_parts.inc"
