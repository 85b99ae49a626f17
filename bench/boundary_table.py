"""The table of larger jobs in docs/boundary.md: lodger's estimator on model shapes not on disk.

Only the model's config enters the estimate (no weights are loaded), so the shapes are written
out here: SmolLM2-135M and SmolLM2-1.7B (their published config.json values) and the Llama-2-7B
shape. Batch 8, LoRA r=8 on q/v or full fine-tuning, fp32, the runtime measured on this machine.

    python bench/boundary_table.py
"""

from __future__ import annotations

from lodger.config import JobConfig
from lodger.memory.estimate import estimate, step_flops

SHAPES = {
    "SmolLM2-135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "SmolLM2-1.7B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=49152, tie_word_embeddings=True),
    "Llama-2-7B shape": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                             tie_word_embeddings=False),
}
ROWS = [("SmolLM2-135M", "lora", 128), ("SmolLM2-135M", "full", 128), ("SmolLM2-1.7B", "lora", 128),
        ("SmolLM2-1.7B", "full", 128), ("Llama-2-7B shape", "lora", 128), ("Llama-2-7B shape", "full", 128),
        ("SmolLM2-1.7B", "lora", 2048), ("Llama-2-7B shape", "full", 2048)]
GIB = 2**30


def job(kind: str, seq: int) -> JobConfig:
    return JobConfig.model_validate({
        "model": {"source": "unused"}, "method": {"kind": kind, "rank": 8, "target_modules": ["q_proj", "v_proj"]},
        "data": {"train": "unused.jsonl", "max_length": seq},
        "training": {"steps": 100, "batch_size": 8, "threads": 2}})


def main() -> None:
    print("| model | method | sequence | peak on CPU | peak on one GPU | FLOP per step "
          "| trainable state (weights + 2 moments, fp32) |")
    print("|---|---|---|---|---|---|---|")
    for name, kind, seq in ROWS:
        config = {**SHAPES[name], "model_type": "llama"}
        j = job(kind, seq)
        cpu, gpu = estimate(j, config, device="cpu"), estimate(j, config, device="cuda")
        flops = step_flops(j, config)
        state = 12 * cpu.trainable_params / GIB
        print(f"| {name} | {'LoRA' if kind == 'lora' else 'full'} | {seq} | {cpu.total_bytes / GIB:.1f} GiB "
              f"| {gpu.total_bytes / GIB:.1f} GiB | {flops / 1e12:.3g} TFLOP | {state:.2f} GiB |")


if __name__ == "__main__":
    main()
