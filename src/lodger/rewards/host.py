"""The reward host: a child process that loads the run's reward functions and calls them when the
training process asks (rewards/__init__.py). Run as ``python -m lodger.rewards.host``.

Apart because a reward is code the owner wrote (or a regular expression they chose), and such
code can hang where no signal reaches it (a catastrophic regex backtracks inside C), crash the
interpreter, or print: the training process waits for an answer with a time limit and kills this
process when it runs over, naming the function; the training state is untouched. Messages are
JSON lines: requests on stdin, answers on the file descriptor that was stdout (stdout itself goes
to stderr, so a reward's print cannot break the protocol). It exits when stdin closes, and dies
with its parent (PR_SET_PDEATHSIG), so a SIGKILLed run leaves no host behind.
"""

from __future__ import annotations

import ctypes
import importlib.util
import inspect
import json
import math
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: stdin's end still stops it
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(0)


def load_function(path: Path, name: str) -> Callable:
    """The function ``name`` of the Python file ``path``, or ValueError saying why not."""
    spec = importlib.util.spec_from_file_location(f"lodger_reward_{abs(hash(str(path)))}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # helpers beside the reward file import as they would there
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ValueError(f"{path} raised while being imported: {type(exc).__name__}: {exc}") from None
    function = getattr(module, name, None)
    if function is None:
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise ValueError(f"{path} defines no `{name}` (its functions: {', '.join(defined) or 'none'})")
    if not callable(function):
        raise ValueError(f"`{name}` in {path} is not a function")
    signature_problem(function, name)
    return function


def signature_problem(function: Callable, name: str) -> None:
    """TRL's reward signature: called with keywords prompts, completions, completion_ids and every
    field of the line, so it must take **kwargs (or name every one)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return  # a builtin or C function: its call will tell
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind == p.VAR_KEYWORD for p in parameters):
        raise ValueError(f"`{name}` must accept **kwargs: it is called as TRL calls reward functions, "
                         f"`{name}(prompts=..., completions=..., completion_ids=..., **fields)`; write "
                         f"`def {name}(prompts, completions, **kwargs):`")
    missing = [k for k in ("prompts", "completions") if k not in names]
    if missing and not any(p.kind == p.VAR_POSITIONAL for p in parameters):
        raise ValueError(f"`{name}` has no parameter `{missing[0]}`: write `def {name}(prompts, completions, **kwargs):`")


def check_values(values: Any, n: int) -> tuple[str, int | None] | None:
    """Why ``values`` is not one number (or None) per completion, with the completion it is about
    (None: all of them); None when it is."""
    if not isinstance(values, (list, tuple)):
        return f"returned {type(values).__name__}, not a list of {n} numbers", None
    if len(values) != n:
        return f"returned {len(values)} values for {n} completions", None
    for i, value in enumerate(values):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"returned {value!r} ({type(value).__name__}), not a number or None", i
        if not math.isfinite(value):
            return f"returned {value!r}: rewards must be finite numbers (None: the reward does not apply)", i
    return None


class Host:
    def __init__(self):
        self.functions: dict[str, Callable] = {}

    def load(self, specs: list[dict]) -> dict:
        from .builtin import make

        problems = []
        for spec in specs:
            try:
                if spec["kind"] == "python":
                    self.functions[spec["label"]] = load_function(Path(spec["file"]), spec["function"])
                else:
                    self.functions[spec["label"]] = make(spec)
            except Exception as exc:  # every problem is the owner's to fix: named, not a traceback
                problems.append(f"[[rewards]] {spec['label']}: {exc}")
        return {"problems": problems}

    def score(self, request: dict) -> dict:
        function = self.functions[request["label"]]
        fields = request["fields"]
        n = len(request["completions"])
        try:
            values = function(prompts=request["prompts"], completions=request["completions"],
                              completion_ids=request["completion_ids"], step=request["step"], **fields)
        except Exception as exc:
            return {"error": _describe(exc), "at": self._first_failing(function, request)}
        problem = check_values(values, n)
        if problem:
            return {"error": problem[0], "at": problem[1]}
        return {"values": [None if v is None else float(v) for v in values]}

    @staticmethod
    def _first_failing(function: Callable, request: dict) -> int | None:
        """The first completion whose call alone raises (so the error names its prompt line)."""
        for i in range(len(request["completions"])):
            one = {k: [v[i]] for k, v in request["fields"].items()}
            try:
                function(prompts=[request["prompts"][i]], completions=[request["completions"][i]],
                         completion_ids=[request["completion_ids"][i]], step=request["step"], **one)
            except Exception:
                return i
        return None


def _describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def main() -> None:
    _die_with_parent()
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # a reward's print goes to stderr, never into the answers
    sys.stdout = sys.stderr
    host = Host()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "load":
            answer = host.load(request["rewards"])
        else:
            answer = host.score(request)
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
