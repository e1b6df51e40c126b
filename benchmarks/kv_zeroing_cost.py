"""What zeroing a poisoned request's KV blocks costs, next to one read of the same blocks.

`vllm.end_poisoned_requests` has vLLM zero the blocks a poisoned request's end freed, once,
before the next step (clean requests' blocks are never zeroed: the clean path costs
nothing). vLLM's CPU runner zeroes a block as `kv[block_id].zero_()` on each attention layer's
cache (layout LBHNC: blocks first); this times exactly that, on a cache shaped like an 8B
Llama's (32 layers, 8 KV heads, head size 128, bfloat16, 128-token blocks), for poisoned
requests of several lengths. The baseline, timed in the same run and interleaved call by
call, is one read of the same blocks (`kv[block_id].sum()`, the same loop): what one decode step's
attention over that request's context reads anyway. On a GPU vLLM zeroes with its Triton
kernel (`KVBlockZeroer`), a memset at HBM bandwidth (no GPU here).

    python -m benchmarks.kv_zeroing_cost [--layers 32] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--tokens", default="512,2048,8192")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    lengths = [int(n) for n in args.tokens.split(",")]
    num_blocks = max(lengths) // args.block_size * 2
    # One tensor per layer, [blocks, 2 (K, V), heads, block_size, head_size].
    shape = (num_blocks, 2, args.kv_heads, args.block_size, args.head_size)
    caches = [torch.randn(shape, dtype=torch.bfloat16) for _ in range(args.layers)]
    block_bytes = caches[0][0].numel() * caches[0].element_size() * args.layers
    print(
        f"KV cache: {args.layers} layers x {args.kv_heads} KV heads x head size "
        f"{args.head_size}, bfloat16, {args.block_size}-token blocks: "
        f"{block_bytes / 2**20:.1f} MiB per block; {torch.get_num_threads()} threads"
    )
    print(f"{'tokens':>7} {'blocks':>6} {'MiB':>7} {'zero ms':>9} {'read ms':>9} {'zero/read':>9}")
    for tokens in lengths:
        count = -(-tokens // args.block_size)
        # Spread over the cache, as freed blocks are.
        block_ids = list(range(0, 2 * count, 2))
        zero, read = [], []
        for repeat in range(args.repeats + 1):
            start = time.perf_counter()
            for kv in caches:
                for block_id in block_ids:
                    kv[block_id].zero_()
            middle = time.perf_counter()
            for kv in caches:
                for block_id in block_ids:
                    kv[block_id].sum()
            end = time.perf_counter()
            if repeat:  # the first round warms up
                zero.append(middle - start)
                read.append(end - middle)
        z, r = statistics.median(zero) * 1e3, statistics.median(read) * 1e3
        mib = count * block_bytes / 2**20
        print(f"{tokens:>7} {count:>6} {mib:>7.0f} {z:>9.2f} {r:>9.2f} {z / r:>9.2f}")


if __name__ == "__main__":
    main()
