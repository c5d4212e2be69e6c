// AB: smem=103712 box=176 threads=128 heads=1 parts=1 check=0
// The value fragments as 4 aligned 16-byte loads (no halfword loads, no byte permutes), as a layout storing values in the output MMA's operand order would read them
#define ALIGNED_VALUES 1
#include "../ablations/landed_parts.inc"
