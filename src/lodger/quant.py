"""A frozen base held in 4 or 8 bits ([method] base_bits): loaded through transformers'
bitsandbytes integration, so peft wraps its layers as it wraps any QLoRA model and a stranger's
transformers reads the same configuration; named by the sha256 of its quantised tensors, which a
checkpoint records instead of storing them.

Why bitsandbytes (docs/qlora.md has the measurements): its CPU backend trains here (a 4-bit
linear's forward and backward are a dequantisation and an fp32 matmul, bitwise repeatable), and
it is the quantisation peft's LoRA and DoRA layers and transformers' ``BitsAndBytesConfig`` know;
torchao's NF4 tensor was 3x slower in bf16 (30x in fp32) here, needs shapes divisible by its
block sizes, and peft has no LoRA layer for it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from typing import Any


LIBRARY = "bitsandbytes"
NF4_BLOCK = 64            # values per absmax of the 4-bit weights (bitsandbytes' default)
NESTED_BLOCK = 256        # absmaxes per fp32 scale of the double quantisation


def describe(bits: int | None) -> str:
    """The base's precision in words, as compare, show and the export card say it."""
    if bits == 4:
        return "4-bit NF4 (double quantisation, bitsandbytes)"
    if bits == 8:
        return "8-bit LLM.int8 (bitsandbytes)"
    return "fp32"


def library_version() -> str | None:
    """The installed bitsandbytes version, without importing it (None when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(LIBRARY)
    except PackageNotFoundError:
        return None


def device_problem(bits: int, device: str) -> str | None:
    """Why bitsandbytes cannot hold a ``bits``-bit base on ``device`` ("cpu" or "cuda"), or None:
    not installed, its native library not loaded for this machine, or no kernel of its for the
    device (a CPU-only torch has no CUDA kernels)."""
    if importlib.util.find_spec(LIBRARY) is None:
        return (f"[method] base_bits = {bits} needs the `{LIBRARY}` package, which is not installed; "
                f"install it with `pip install {LIBRARY}` (make demo installs it)")
    import torch

    bnb = import_library()
    from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib

    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device)
    op = "bitsandbytes::dequantize_4bit" if bits == 4 else "bitsandbytes::int8_vectorwise_quant"
    served = key is not None and (torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
                                  or torch._C._dispatch_has_kernel_for_dispatch_key(op, "CompositeExplicitAutograd"))
    if device == "cpu" and isinstance(lib, ErrorHandlerMockBNBNativeLibrary):
        served = False
    if device == "cuda" and not torch.cuda.is_available():
        served = False
    if served:
        return None
    return (f"[method] base_bits = {bits} on {device}: {LIBRARY} {bnb.__version__} cannot serve this device here "
            f"(no {op.split('::')[1]} kernel of its for {device}); train on a device it serves (the CPU), or "
            "remove base_bits")


def import_library():
    """bitsandbytes, imported quietly. Its CPU backend asks the `kernels` package for a hub kernel
    (offline here, so that fails and logs a warning) and its 8-bit matmul logs the same cast at
    every call: both are said once in docs/qlora.md, not in the run's log."""
    import logging

    for name in ("bitsandbytes", "bitsandbytes.backends.cpu.ops", "bitsandbytes.autograd._functions"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import bitsandbytes

    return bitsandbytes


def config(bits: int, compute_dtype) -> Any:
    """transformers' BitsAndBytesConfig for a ``bits``-bit base computing in ``compute_dtype``."""
    from transformers import BitsAndBytesConfig

    if bits == 4:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage="uint8")
    return BitsAndBytesConfig(load_in_8bit=True)


def load_quantised(folder, bits: int, device: str, compute_dtype):
    """The base causal LM with its decoder layers' linear weights quantised as they load (one
    tensor in fp32 at a time), the rest fp32, on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    import_library()
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32,
                                                 quantization_config=config(bits, compute_dtype),
                                                 device_map={"": 0} if device == "cuda" else "cpu")
    keep_training_numerics(model)
    release_file(model)
    model.config.use_cache = False
    return model


def release_file(model) -> None:
    """Copy the weights left unquantised (embeddings, norms, head) out of the safetensors file's
    mapping, so the mapping closes and the file's pages, all read while quantising, leave the
    resident set; then hand the loader's freed scratch back to the system (glibc's malloc_trim).
    Measured on SmolLM2 4-bit: 1,094 MiB resident after loading, 603 after this (docs/qlora.md)."""
    import ctypes
    import ctypes.util
    import gc

    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.dtype.is_floating_point and tensor.device.type == "cpu":
            tensor.data = tensor.data.clone()
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def keep_training_numerics(model) -> None:
    """One way of computing for training and evaluation alike. On a CPU with AVX512-BF16,
    bitsandbytes repacks a 4-bit weight in place the first time it runs without gradients (an
    eval) and from then on computes that layer in bf16 without a backward pass: an eval would
    change the training that follows (measured: the LoRA gradients below it vanish)."""
    bnb = import_library()
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def quantised_modules(model) -> dict[str, Any]:
    """The base's quantised linear layers by name (peft's wrappers looked through)."""
    bnb = import_library()
    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return {name.removeprefix("base_model.model.").removesuffix(".base_layer"): module
            for name, module in model.named_modules() if isinstance(module, kinds)}


def base_digest(model) -> str:
    """sha256 over every quantised tensor of the base (packed weights, block scales, the second
    level's scales and code books, and the quantisation state's description), by name: what the
    checkpoint checks instead of storing the base."""
    import torch

    digest = hashlib.sha256()
    for name, module in sorted(quantised_modules(model).items()):
        state: dict[str, Any] = {}
        module._save_to_state_dict(state, "", keep_vars=False)
        for key in sorted(state):
            tensor = state[key]
            if tensor is None:
                continue
            data = tensor.detach().contiguous().cpu()
            header = f"{name}.{key}|{data.dtype}|{tuple(data.shape)}\n".encode()
            digest.update(header)
            digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def facts(bits: int, model) -> dict[str, Any]:
    """What provenance and the checkpoint record of a quantised base."""
    layers = quantised_modules(model)
    params = sum(m.in_features * m.out_features for m in layers.values())
    found: dict[str, Any] = {"bits": bits, "format": "nf4" if bits == 4 else "int8",
                             "library": LIBRARY, "version": library_version(), "layers": len(layers),
                             "quantised_params": params, "sha256": base_digest(model)}
    if bits == 4:
        found.update(double_quant=True, block=NF4_BLOCK, nested_block=NESTED_BLOCK)
    return found


def quantisation_config_json(bits: int) -> dict[str, Any]:
    """The `quantization_config` a quantised base's config.json carries, as transformers writes it,
    for the export card and adapter_config's base description."""
    import torch

    return json.loads(config(bits, torch.float32).to_json_string())
