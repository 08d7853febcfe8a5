"""vLLM's request extras: the fields ``dp-runtime serve`` takes beside OpenAI's, as pydantic
declares them (``VllmExtras``, a base of both request models; checks and effects are in
``vllm_fields.py``).

Implemented: ``return_token_ids`` (the prompt's ids beside the output's),
``return_tokens_as_token_ids`` (logprob tokens read ``token_id:N``), ``truncate_prompt_tokens``
(keep the prompt's last k tokens; -1: as many as the context leaves room for). Declared only to be
refused by name when a request sets them (they change what a response must be, and a server that
ignored them would answer something else): guided decoding (``guided_*``, ``structured_outputs``,
``structural_tag``), ``include_stop_str_in_output``, ``prompt_logprobs``, beam search
(``use_beam_search``, ``length_penalty``, ``early_stopping``), ``bad_words``, ``allowed_token_ids``,
``skip_special_tokens: false``, ``spaces_between_special_tokens: false``, and chat's ``echo``,
``add_generation_prompt: false``, ``continue_final_message``, ``chat_template``,
``chat_template_kwargs``, ``documents``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

__all__ = ["VllmExtras"]


class VllmExtras(BaseModel):
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None
    # refused when set (vllm_fields.REFUSED says which values are "not set")
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    structured_outputs: Any = None
    include_stop_str_in_output: Any = None
    prompt_logprobs: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    early_stopping: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    echo: Any = None  # chat's (completions declare their own: protocol.py)
