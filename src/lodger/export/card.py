"""The model card (README.md) of an export: what the weights are, exactly what they were trained
against and on, and code that loads them in transformers, llama.cpp and Ollama as written."""

from __future__ import annotations


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


def llama_cpp_snippet(path: str) -> list[str]:
    return ["from llama_cpp import Llama",
            "",
            f"llm = Llama(model_path={path!r}, n_ctx=2048, verbose=False)  # run from the export's folder",
            'messages = [{"role": "user", "content": "What is 2 + 3?"}]',
            "out = llm.create_chat_completion(messages, max_tokens=32, temperature=0)  # the GGUF's chat template",
            'print(out["choices"][0]["message"]["content"])',
            "llm.close()"]


def merged_snippet(folder: str) -> list[str]:
    return ["from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f"folder = {folder!r}  # this export's merged folder; run from the export's folder",
            "model = AutoModelForCausalLM.from_pretrained(folder)",
            "tokenizer = AutoTokenizer.from_pretrained(folder)",
            *_generate_lines()]


def model_card(*, run: dict, first: dict, evals: list[dict], compute: dict, checkpoint: str, base,
               parts: dict[str, str], gguf_info: dict | None, formats_done: list[str], files: dict[str, dict],
               chat_template_sha256: str | None) -> str:
    """``parts``: format -> folder inside the export ("." when it is the export itself); ``files``:
    every other file of the export -> {"bytes", "sha256"}."""
    data = first.get("data", {})
    train = data.get("train", {})
    ev = f"{evals[0]['eval_loss']:.4f} -> {evals[-1]['eval_loss']:.4f}" if evals else "n/a"
    code = first.get("code") or {}
    code_line = (f"- Code: git `{code['commit']}`" + (" (uncommitted changes)" if code.get("dirty") else "") + "\n"
                 if code.get("commit") else "")
    init = first.get("model", {}).get("init_adapter")
    init_line = f"- Continued from the adapter `{init['path']}` (sha256 `{init['sha256']}`)\n" if init else ""
    template = (f"- Chat template sha256 `{chat_template_sha256}` (of its UTF-8 text, as the tokenizer files hold it"
                + (" and the GGUF's `tokenizer.chat_template`" if gguf_info else "") + ")"
                if chat_template_sha256 else "- No chat template")
    out = [f"# {run['name']}\n",
           f"Fine-tuned with lodger {first.get('lodger_version', '?')} ({run['method']}) from run `{run['id']}`, "
           f"status **{run['status']}**, {run['step']}/{run['total_steps']} optimizer steps (weights from "
           f"`{checkpoint}`).\n",
           "## Base model\n",
           *[f"- {fact}" for fact in base.facts],
           *([f"- {base.where(parts['peft'])}"] if "peft" in parts else []),
           f"- Tokenizer sha256 `{first.get('model', {}).get('tokenizer_sha256')}`",
           template + "\n",
           "## Training\n",
           f"- Data: `{train.get('path')}` (sha256 `{train.get('sha256')}`, {train.get('lines')} lines); "
           f"eval set sha256 `{data.get('eval_set_sha256')}`",
           f"- Eval loss (first -> last): {ev}",
           f"- Compute: {compute['wall_seconds']:.0f} s wall, {compute['cpu_seconds']:.0f} s CPU",
           code_line + init_line,
           "The full record is in `job.toml`, `provenance.json`, `metrics.jsonl` and `events.json`; "
           "`MANIFEST.json` holds every file's sha256 (this card's too) and the lodger ledger's chain head at "
           "export time.\n"]
    out += _load_sections(run, base, parts, gguf_info, formats_done)
    out += _files_section(files)
    return "\n".join(out)


def _files_section(files: dict[str, dict]) -> list[str]:
    rows = [f"| `{rel}` | {info['bytes']} | `{info['sha256']}` |" for rel, info in sorted(files.items())]
    return ["## Files\n",
            "Every file of this export but this card and `MANIFEST.json` (which lists this card's hash too):\n",
            "| file | bytes | sha256 |", "|---|---:|---|", *rows, ""]


def _load_sections(run: dict, base, parts: dict[str, str], gguf_info: dict | None, done: list[str]) -> list[str]:
    out = ["## Load it\n"]
    if "peft" in parts:
        out += ["### transformers + peft (the adapter)\n",
                f"`adapter_config.json` names the base as `{base.adapter_base}`"
                + (f" at revision `{base.adapter_revision}`" if base.adapter_revision else "") + ".\n",
                _python(peft_snippet(base, parts["peft"]))]
        if base.gguf and base.name_or_path != base.source.spec:
            out += [f"`AutoModelForCausalLM.from_pretrained({base.name_or_path!r})` would load the unquantised "
                    "original instead: close to, not identical with, what was trained.\n"]
    if "merged" in parts:
        out += ["### transformers (merged weights, no peft needed)\n", _python(merged_snippet(parts["merged"]))]
    if gguf_info:
        out += _gguf_sections(run, parts["gguf"], gguf_info)
    missing = [f for f in ("peft", "merged", "gguf") if f not in done and (f != "peft" or run["method"] == "lora")]
    if missing:
        out += ["### Other formats\n",
                "Not in this export: " + ", ".join(f"`{f}`" for f in missing) + f". Make them with "
                f"`lodger export {run['id']} NEW_DIR --format {','.join(missing)}`.\n"]
    return out


def _gguf_sections(run: dict, folder: str, gguf_info: dict) -> list[str]:
    path = f"{folder}/{gguf_info['file']}".removeprefix("./")
    ollama = gguf_info.get("modelfile") or {}
    template = ("`TEMPLATE` is the chat template as Ollama's Go template (checked to render the same prompts)"
                + (", `SYSTEM` its default system prompt" if ollama.get("system") else "")
                if ollama.get("template") else "no `TEMPLATE`: Ollama uses the chat template stored in the GGUF")
    stops = ", ".join(f"`{t}`" for t in ollama.get("stop", []))
    return ["### llama.cpp\n",
            f"`{gguf_info['file']}`: {gguf_info['architecture']}, {gguf_info['outtype']}, "
            f"{gguf_info['tensors']} tensors.\n",
            f"```\nllama-cli -m {path} -cnv\nllama-server -m {path} --port 8080\n```\n",
            "### llama-cpp-python\n",
            _python(llama_cpp_snippet(path)),
            "### Ollama\n",
            f"```\ncd {folder} && ollama create {run['name']} -f Modelfile && ollama run {run['name']}\n```\n",
            f"The Modelfile: `FROM ./{gguf_info['file']}`; {template}; `PARAMETER stop` {stops}.\n",
            "LM Studio: import the `.gguf` file.\n"]
