"""Format showcase: store and read back random K/V in every cache format; bytes, error and capacity per format."""
from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

import tqops


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tqops.demo", description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    parser.add_argument("--layers", type=int, default=28, help="for the capacity column")
    parser.add_argument("--budget-gib", type=float, default=16.0, help="KV memory budget for the capacity column")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    gen = torch.Generator(device=args.device).manual_seed(0)
    shape = (args.tokens, args.kv_heads, args.head_dim)
    key = torch.randn(shape, generator=gen, device=args.device)
    key[..., :4] *= 8.0  # outlier channels, as real keys have
    value = torch.randn(shape, generator=gen, device=args.device)
    slots = torch.randperm(args.tokens, device=args.device)

    rows = []
    for name in tqdm(tqops.FORMATS, desc=f"round trips on {args.device}"):
        fmt = tqops.get_format(name)
        cache = tqops.allocate_kv_cache(fmt, args.tokens // 16, 16, args.kv_heads, args.head_dim, device=args.device)
        tqops.kv_store(key.to(torch.bfloat16), value.to(torch.bfloat16), cache, slots, fmt)
        key_hat, value_hat = tqops.kv_load(cache, slots, fmt, args.head_dim)
        kb = key.to(torch.bfloat16).float()
        key_err = ((key_hat - kb).pow(2).sum(-1) / kb.pow(2).sum(-1)).mean().item()
        value_err = (value_hat - value.to(torch.bfloat16).float()).abs().mean().item()
        bytes_per_token = fmt.slot_bytes(args.head_dim) * args.kv_heads * args.layers
        capacity = int(args.budget_gib * 2**30 // bytes_per_token)
        rows.append((name, fmt.slot_bytes(args.head_dim), bytes_per_token, capacity, key_err, value_err))

    bf16_bytes = rows[0][1]
    print(f"\n{args.tokens} tokens x {args.kv_heads} kv heads x head_dim {args.head_dim} (bf16 input, {args.device})")
    print(f"capacity: tokens that fit in {args.budget_gib:g} GiB for a {args.layers}-layer model\n")
    print(f"{'format':<20} {'slot B':>7} {'vs bf16':>8} {'KV B/token':>11} {'capacity':>11} "
          f"{'key rel MSE':>12} {'value MAE':>10}")
    for name, slot, per_token, capacity, key_err, value_err in rows:
        print(f"{name:<20} {slot:>7} {bf16_bytes / slot:>7.2f}x {per_token:>11,} {capacity:>11,} "
              f"{key_err:>12.2e} {value_err:>10.2e}")


if __name__ == "__main__":
    main()
