"""A stranger's session with a lodger export: only peft, transformers and llama.cpp, never lodger.

The export tests run this file in a subprocess with a fresh HF_HOME, HF_HUB_OFFLINE=1 and lodger's
cache out of reach (``strangers_env`` in test_export_stranger.py); it prints one JSON object:

- ``peft``: the adapter loaded by ``PeftModel.from_pretrained`` on the base its adapter_config names
  (relative to the adapter folder, as a shipped ``./base`` is), logits of ``--ids``;
- ``merged``: ``AutoModelForCausalLM``/``AutoTokenizer`` on merged/: logits of ``--ids``, the chat
  prompt of ``--messages`` by the tokenizer's chat template, its ids (and with ``--prompt-logits`` the
  logits at each), and the greedy continuation (``--new-tokens``, one full forward per token, EOS not
  special) with the logits along it;
- ``llama``: llama.cpp on the GGUF (``stranger_llama.mjs``: node-llama-cpp's prebuilt llama.cpp, run
  by Node in a process of its own): its tokens for the same prompt text, its own greedy sampler's
  continuation of the merged tokenizer's ids, and its logits along that path (and with
  ``--prompt-logits`` at every position of the prompt), each as ``{token id: logit}`` for every token
  or the ``--top`` best; its KV cache is f32, so that they compare with transformers' at f32
  precision.
"""

from __future__ import annotations

import sys

sys.modules["lodger"] = None  # `import lodger` fails here, editable install or not

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402


def _logits(model, ids: list[int]) -> list[list[float]]:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].tolist()


def load_peft(folder: str, ids: list[int]) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.load(open(os.path.join(folder, "adapter_config.json")))
    named = config["base_model_name_or_path"]
    base_path = named if os.path.isabs(named) else os.path.join(folder, named)
    base = AutoModelForCausalLM.from_pretrained(base_path, revision=config.get("revision"))
    model = PeftModel.from_pretrained(base, folder).eval()
    return {"base": named, "base_path": os.path.abspath(base_path), "logits": _logits(model, ids)}


def greedy(model, ids: list[int], n: int) -> tuple[list[int], list[list[float]]]:
    """Greedy tokens and, for each, the logits it was chosen from (no KV cache: every step recomputed)."""
    import torch

    tokens, path = [], []
    for _ in range(n):
        with torch.no_grad():
            last = model(input_ids=torch.tensor([ids + tokens]), use_cache=False).logits[0, -1]
        path.append(last.tolist())
        tokens.append(int(last.argmax()))
    return tokens, path


def load_merged(folder: str, ids: list[int], messages: list[dict], n: int, prompt_logits: bool) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    tokens, path = greedy(model, prompt_ids, n)
    return {"logits": _logits(model, ids), "chat_template": tokenizer.chat_template, "prompt": prompt,
            "prompt_ids": prompt_ids, "prompt_logits": _logits(model, prompt_ids) if prompt_logits else None,
            "greedy": tokens, "greedy_logits": path, "eos": tokenizer.eos_token_id}


def load_gguf(runtime: str, path: str, prompt: str, prompt_ids: list[int], n: int, threads: int,
              prompt_logits: bool, top: int) -> dict:
    """llama.cpp in a process of its own (stranger_llama.mjs under Node), not in this interpreter."""
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stranger_llama.mjs")
    request = {"runtime": runtime, "gguf": os.path.abspath(path), "prompt": prompt, "prompt_ids": prompt_ids,
               "new_tokens": n, "threads": threads, "prompt_logits": prompt_logits, "top": top}
    done = subprocess.run(["node", script], input=json.dumps(request), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp (node-llama-cpp) failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peft")
    parser.add_argument("--merged")
    parser.add_argument("--gguf")
    parser.add_argument("--llama-cpp", help="the folder node-llama-cpp is installed in (tests/node-llama-cpp)")
    parser.add_argument("--ids", type=json.loads, required=True)
    parser.add_argument("--messages", type=json.loads, required=True)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--prompt-logits", action="store_true", help="logits at every position of the chat prompt")
    parser.add_argument("--top", type=int, default=0, help="llama.cpp's logits of the best N tokens only (0: all)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.gguf and not args.merged:
        parser.error("--gguf needs --merged: llama.cpp is given the merged tokenizer's prompt")
    import torch

    torch.set_num_threads(args.threads)
    out: dict = {}
    if args.peft:
        out["peft"] = load_peft(args.peft, args.ids)
    if args.merged:
        out["merged"] = load_merged(args.merged, args.ids, args.messages, args.new_tokens, args.prompt_logits)
    if args.gguf:
        merged = out["merged"]
        out["llama"] = load_gguf(args.llama_cpp, args.gguf, merged["prompt"], merged["prompt_ids"], args.new_tokens,
                                 args.threads, args.prompt_logits, args.top)
    out["lodger_imported"] = sorted(m for m in sys.modules if m.startswith("lodger") and sys.modules[m] is not None)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
