// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=1
// The landed kernel with the XOR sink of its A fragments (the control of the SS variants)
#define XOR_SINK 1
#include "../ablations/landed_parts.inc"
