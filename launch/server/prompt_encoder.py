"""Prompts to token ids off the server's event loop.

A long prompt, or a chat template with much to render, takes the tokenizer milliseconds to
seconds; on the event loop that time would stall every stream the server is delivering. So the
routes await ``PromptEncoder``, which runs ``text.encode_text`` / ``text.encode_chat`` on one
worker thread of its own:

- one thread, not the loop's shared pool: a transformers fast tokenizer sets its truncation and
  padding state on each call, and two calls at once on one tokenizer can fail ("Already
  borrowed"); one thread also keeps prompts encoded in the order they arrived (vLLM also
  encodes on a single-thread executor);
- the Rust tokenizer releases the GIL while it encodes, so the loop keeps running beside it;
  template rendering (Jinja, Python) shares the GIL but is preempted like any thread.

The app owns its encoder and closes it when its lifespan ends (``app.create_app``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from launch.server.text import encode_chat, encode_text

__all__ = ["PromptEncoder"]


class PromptEncoder:
    """Encodes prompts for ``model_name`` with ``tokenizer`` (None: token-id prompts only; a
    text prompt raises ``text.TokenizerMissing``, as ``encode_text`` does) on one thread."""

    def __init__(self, tokenizer: Any | None, model_name: str) -> None:
        self._tokenizer, self._model_name = tokenizer, model_name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dp-runtime-encode")

    async def text(self, text: str) -> list[int]:
        """``encode_text`` of ``text``, on the encoder's thread."""
        return await self._run(encode_text, text)

    async def chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None
                   ) -> list[int]:
        """``encode_chat`` of ``messages`` and ``tools``, on the encoder's thread."""
        return await self._run(encode_chat, messages, tools)

    async def _run(self, fn, *args) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, fn, self._tokenizer, self._model_name, *args
        )

    def close(self) -> None:
        """Stop the thread; prompts still queued are cancelled (their requests are ending with
        the server). Idempotent."""
        self._pool.shutdown(wait=False, cancel_futures=True)
