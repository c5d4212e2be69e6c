// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=0
// Each lane's key bytes as one aligned 16-byte load (no funnel shifts), as a layout with aligned code runs would read them
#define ALIGNED_KEYS 1
#include "../ablations/landed_parts.inc"
