"""The model card (README.md) of an export: what the weights are, exactly what they were trained
against and on, and code that loads them in transformers, llama.cpp and Ollama as written."""

from __future__ import annotations

import re

IM_SYSTEM = re.compile(r"<\|im_start\|>system(?:\\n|\n)(.*?)<\|im_end\|>", re.S)


def _python(lines: list[str]) -> str:
    return "```python\n" + "\n".join(lines) + "\n```\n"


def _generate_lines(model_var: str = "model") -> list[str]:
    return ['messages = [{"role": "user", "content": "What is 2 + 3?"}]',
            "text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)",
            'ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]',
            f"out = {model_var}.generate(ids, max_new_tokens=32, do_sample=False)",
            "print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))"]


def peft_snippet(base, folder: str) -> list[str]:
    return ["from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f"folder = {folder!r}  # this export's adapter folder; run from the export's folder",
            *base.load_lines(),
            "model = PeftModel.from_pretrained(base, folder)",
            "tokenizer = AutoTokenizer.from_pretrained(folder)",
            *_generate_lines()]


def merged_snippet(folder: str) -> list[str]:
    return ["from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f"folder = {folder!r}  # this export's merged folder; run from the export's folder",
            "model = AutoModelForCausalLM.from_pretrained(folder)",
            "tokenizer = AutoTokenizer.from_pretrained(folder)",
            *_generate_lines()]


def modelfile(gguf_name: str, run_name: str, chat_template: str | None) -> str:
    """An Ollama Modelfile: ChatML templates are written as Ollama's Go template; for others Ollama
    falls back to the template in the GGUF's metadata (tokenizer.chat_template)."""
    lines = [f"# Ollama: ollama create {run_name} -f Modelfile && ollama run {run_name}",
             f"FROM ./{gguf_name}"]
    if chat_template and "<|im_start|>" in chat_template:
        lines += ['TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}',
                  '{{ .Content }}<|im_end|>',
                  '{{ end }}<|im_start|>assistant',
                  '"""',
                  'PARAMETER stop "<|im_end|>"',
                  'PARAMETER stop "<|im_start|>"']
        system = IM_SYSTEM.search(chat_template)
        if system:
            lines.append(f'SYSTEM """{system.group(1)}"""')
    elif chat_template:
        lines.append("# Not ChatML: Ollama uses the chat template stored in the GGUF (tokenizer.chat_template).")
    if chat_template:
        lines += ["", "# The model's chat template (Jinja, as trained):"]
        lines += ["# " + line for line in chat_template.splitlines()]
    return "\n".join(lines) + "\n"


def model_card(*, run: dict, first: dict, evals: list[dict], compute: dict, checkpoint: str, base,
               parts: dict[str, str], gguf_info: dict | None, formats_done: list[str]) -> str:
    """``parts``: format -> folder inside the export ("." when it is the export itself)."""
    data = first.get("data", {})
    train = data.get("train", {})
    ev = f"{evals[0]['eval_loss']:.4f} -> {evals[-1]['eval_loss']:.4f}" if evals else "n/a"
    code = first.get("code") or {}
    code_line = (f"- Code: git `{code['commit']}`" + (" (uncommitted changes)" if code.get("dirty") else "") + "\n"
                 if code.get("commit") else "")
    init = first.get("model", {}).get("init_adapter")
    init_line = f"- Continued from the adapter `{init['path']}` (sha256 `{init['sha256']}`)\n" if init else ""
    out = [f"# {run['name']}\n",
           f"Fine-tuned with lodger {first.get('lodger_version', '?')} ({run['method']}) from run `{run['id']}`, "
           f"status **{run['status']}**, {run['step']}/{run['total_steps']} optimizer steps (weights from "
           f"`{checkpoint}`).\n",
           "## Base model\n",
           *[f"- {fact}" for fact in base.facts],
           f"- Tokenizer sha256 `{first.get('model', {}).get('tokenizer_sha256')}`\n",
           "## Training\n",
           f"- Data: `{train.get('path')}` (sha256 `{train.get('sha256')}`, {train.get('lines')} lines); "
           f"eval set sha256 `{data.get('eval_set_sha256')}`",
           f"- Eval loss (first -> last): {ev}",
           f"- Compute: {compute['wall_seconds']:.0f} s wall, {compute['cpu_seconds']:.0f} s CPU",
           code_line + init_line,
           "The full record is in `job.toml`, `provenance.json`, `metrics.jsonl` and `events.json`; "
           "`MANIFEST.json` holds every file's sha256 and the lodger ledger's chain head at export time.\n"]
    out += _load_sections(run, base, parts, gguf_info, formats_done)
    return "\n".join(out)


def _load_sections(run: dict, base, parts: dict[str, str], gguf_info: dict | None, done: list[str]) -> list[str]:
    out = ["## Load it\n"]
    if "peft" in parts:
        out += ["### transformers + peft (the adapter)\n",
                f"`adapter_config.json` names the base as `{base.name_or_path}`"
                + (f" at revision `{base.revision}`" if base.revision else "") + ".\n",
                _python(peft_snippet(base, parts["peft"]))]
        if base.gguf and base.name_or_path != base.source.spec:
            out += [f"On a machine without that file, `AutoModelForCausalLM.from_pretrained({base.name_or_path!r})` "
                    "loads the unquantised original instead (close, not identical, to what was trained).\n"]
    if "merged" in parts:
        out += ["### transformers (merged weights, no peft needed)\n", _python(merged_snippet(parts["merged"]))]
    if gguf_info:
        path = f"{parts['gguf']}/{gguf_info['file']}".removeprefix("./")
        out += ["### llama.cpp\n",
                f"`{gguf_info['file']}`: {gguf_info['architecture']}, {gguf_info['outtype']}, "
                f"{gguf_info['tensors']} tensors.\n",
                f"```\nllama-cli -m {path} -cnv\nllama-server -m {path} --port 8080\n```\n",
                "### Ollama\n",
                f"```\ncd {parts['gguf']} && ollama create {run['name']} -f Modelfile && ollama run {run['name']}\n```\n",
                "LM Studio: import the `.gguf` file.\n"]
    missing = [f for f in ("peft", "merged", "gguf") if f not in done and (f != "peft" or run["method"] == "lora")]
    if missing:
        out += ["### Other formats\n",
                "Not in this export: " + ", ".join(f"`{f}`" for f in missing) + f". Make them with "
                f"`lodger export {run['id']} NEW_DIR --format {','.join(missing)}`.\n"]
    return out
