"""What `lodger chat` talks to: the model loaded in this process, or a running `lodger serve`.

Both answer ``reply(messages)`` with text pieces and ``switch(what)`` for ``/adapter``; the terminal
side (prompt, echo, Ctrl-C) is in ``cli/serve.py``.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Iterator

from ..errors import LodgerError


class LocalChat:
    """The base model and a run's adapters in this process; ``/adapter STEP`` loads that checkpoint."""

    def __init__(self, engine, run_id: str, max_tokens: int, temperature: float):
        self.engine, self.run_id = engine, run_id
        self.max_tokens, self.temperature = max_tokens, temperature
        self.name = run_id  # the slot answering: the run (following its newest checkpoint), a step, or base

    @property
    def label(self) -> str:
        return self.engine.slots[self.name].version

    def switch(self, what: str) -> str:
        """`latest` (the run's newest checkpoint, followed), `base`, or a step number."""
        if what in ("latest", self.run_id):
            self.name = self.run_id
            with contextlib.suppress(Exception):  # as in reply(): the current adapter goes on answering
                self.engine.refresh(self.engine.slots[self.run_id])
        elif what == "base":
            self.name = "base"
        elif what.isdigit():
            try:
                self.name = self.engine.add_checkpoint(self.run_id, int(what)).name
            except LodgerError:
                raise
            except Exception as exc:  # verified by its manifest, yet peft cannot load it
                raise LodgerError(f"checkpoint step {what} of {self.run_id} does not load as an adapter: "
                                  f"{exc}") from None
        else:
            raise LodgerError(f"/adapter {what}: give a step number (e.g. /adapter 20), `latest` or `base`")
        return self.label

    def reply(self, messages: list[dict]) -> Iterator[str]:
        if self.name == self.run_id:
            # A checkpoint committed since the last turn; one that does not load leaves the current
            # adapter answering, as the server's reload does.
            with contextlib.suppress(Exception):
                self.engine.refresh(self.engine.slots[self.run_id])
        ids = self.engine.encode_chat(messages)
        room = self.engine.context_length - len(ids)
        if room <= 0:
            raise LodgerError(f"the conversation has {len(ids)} tokens, the model's context is "
                              f"{self.engine.context_length}: /reset to start again")
        generator = self.engine.generate(self.name, ids, max_tokens=min(self.max_tokens, room),
                                         temperature=self.temperature, top_p=1.0, seed=None, stop=[])
        try:
            for piece, _, _ in generator:
                yield piece
        finally:
            generator.close()  # on Ctrl-C too: gives the engine lock back


class RemoteChat:
    """A running `lodger serve`, through its OpenAI API, with the token of $LODGER_HOME/serve-token."""

    def __init__(self, url: str, model: str, token: str | None, max_tokens: int, temperature: float):
        self.url, self.name, self.first, self.token = url.rstrip("/"), model, model, token
        self.max_tokens, self.temperature = max_tokens, temperature
        self.label = self.switch(model)

    def _request(self, path: str, body: dict | None = None, timeout: float = 30):
        headers = {"content-type": "application/json"}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = exc.reason
            raise LodgerError(f"{self.url} answered {exc.code}: {message}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise LodgerError(f"cannot reach `lodger serve` at {self.url} ({getattr(exc, 'reason', exc)}): "
                              "is it running, and on that port?") from None

    def switch(self, what: str) -> str:
        """Another served model name (`base`, a run id, an adapter folder's name)."""
        if what.isdigit():
            raise LodgerError("a running server serves each run's newest checkpoint only: to compare steps, "
                              "chat without --url (the model is then loaded here)")
        name = self.first if what == "latest" else what
        with self._request(f"/v1/models/{urllib.parse.quote(name, safe='')}") as response:
            model = json.loads(response.read())
        self.name = name
        return (model.get("lodger") or {}).get("version") or name

    def reply(self, messages: list[dict]) -> Iterator[str]:
        body = {"model": self.name, "messages": messages, "stream": True, "max_tokens": self.max_tokens,
                "temperature": self.temperature}
        with self._request("/v1/chat/completions", body, timeout=300) as response:
            for raw in response:  # closing the response (Ctrl-C) makes the server stop generating
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise LodgerError(f"{self.url}: {chunk['error'].get('message')}")
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        yield choice["delta"]["content"]


__all__ = ["LocalChat", "RemoteChat"]
