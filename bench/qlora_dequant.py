"""What dequantising a quantised base costs beside the matmul it feeds: memory.DEQUANT_FLOPS.

One 2048 x 8192 linear (the 1 B Llama's MLP shape) on 512 tokens, 2 threads, without gradients:
fp32, bitsandbytes' NF4 (double quantisation) and LLM.int8, each the best of 5 calls, 3 rounds
interleaved; the extra time a weight over fp32, and the same in FLOPs of the estimate's rate
(this machine's measured matmul rate x memory.MATMUL_EFFICIENCY), which is what the estimate adds
per quantised weight and pass.

    python bench/qlora_dequant.py      # a few seconds; run it on an idle machine

Result lines: `dequant nf4: +1.43 ns a weight over fp32 = 148 FLOPs at the estimate's rate`.
"""

from __future__ import annotations

import time

import torch


def best(call, n: int = 5) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    import bitsandbytes as bnb

    from lodger.memory.estimate import MATMUL_EFFICIENCY
    from lodger.train.throughput import flops_per_second

    torch.set_num_threads(2)
    n_in, n_out, tokens = 2048, 8192, 512
    torch.manual_seed(0)
    ref = torch.nn.Linear(n_in, n_out, bias=False)
    x = torch.randn(tokens, n_in)
    nf4 = bnb.nn.Linear4bit(n_in, n_out, bias=False, compute_dtype=torch.float32, quant_type="nf4",
                            compress_statistics=True)
    nf4.weight = bnb.nn.Params4bit(ref.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                   compress_statistics=True)
    int8 = bnb.nn.Linear8bitLt(n_in, n_out, bias=False, has_fp16_weights=False, threshold=6.0)
    int8.weight = bnb.nn.Int8Params(ref.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
    layers = {"fp32": ref, "nf4": nf4.to("cpu"), "int8": int8.to("cpu")}
    rows: dict[str, list[float]] = {name: [] for name in layers}
    with torch.no_grad():
        for layer in layers.values():
            layer(x)
        for _ in range(3):
            for name, layer in layers.items():
                rows[name].append(best(lambda: layer(x)))  # noqa: B023 (called at once)
    rate = flops_per_second(threads=2)
    base = min(rows["fp32"])
    print(f"# fp32 linear {base * 1e3:.1f} ms ({2 * tokens * n_in * n_out / base / 1e9:.1f} GFLOP/s); "
          f"matmul rate {rate / 1e9:.1f} GFLOP/s, x {MATMUL_EFFICIENCY} in the estimate")
    for name in ("nf4", "int8"):
        extra = (min(rows[name]) - base) / (n_in * n_out)
        print(f"dequant {name}: +{extra * 1e9:.2f} ns a weight over fp32 = {extra * rate * MATMUL_EFFICIENCY:.0f} "
              f"FLOPs at the estimate's rate ({min(rows[name]) * 1e3:.1f} ms a call)")


if __name__ == "__main__":
    main()
