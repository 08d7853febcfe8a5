"""A tiny Qwen3-MoE checkpoint whose greedy output is a tool call, for the server's tool tests.

A random model never writes a tool call, so this one is built to follow a chain: every layer
adds nothing to the residual stream (each attention ``o_proj`` and every MLP and expert
``down_proj`` is zero), so the last hidden state is RMSNorm(the current token's embedding) and
the next token depends on the current token alone. The chain's tokens have one-hot embeddings
(a dimension each) and ``lm_head`` maps the dimension of token a to its successor s(a) with a
large weight, so greedy decoding goes

    "\\n" (the generation prompt's last token) -> <tool_call> -> the call's JSON pieces
    -> </tool_call> -> <|im_end|> (EOS)

whatever came before. The tokenizer (``serve_model.train_tokenizer``) gets each piece as an
added token (matched whole, not special: its text is kept), and a chat template that renders
``tools`` (their names in a system turn) and an assistant's ``tool_calls`` (arguments with
``tojson``, as Qwen's templates do).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from tests.support.serve_model import EOS, train_tokenizer

__all__ = ["CALL_TEXT", "PIECES", "TOOL_TEMPLATE", "write_tool_checkpoint"]

VOCAB = 384
PIECES = (
    "<tool_call>",
    '\n{"name": "get_weather", "arguments": ',
    '{"city": "Paris"}',
    "}\n",
    "</tool_call>",
)
CALL_TEXT = "".join(PIECES)
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tool_tokenizer():
    """The trained tokenizer of ``VOCAB`` ids: the pieces are its last ids."""
    from tokenizers import AddedToken

    tok = train_tokenizer(VOCAB - len(PIECES))
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in PIECES])
    tok.chat_template = TOOL_TEMPLATE
    assert len(tok) == VOCAB
    return tok


def write_tool_checkpoint(path: Path) -> Path:
    """The chained checkpoint and its tokenizer in ``path``; returns ``path``."""
    import torch
    import transformers

    from tests.hf_reference import TINY

    path = Path(path)
    tok = tool_tokenizer()
    eos = tok.convert_tokens_to_ids(EOS)
    start = tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids[-1]
    chain = [start, *tok.convert_tokens_to_ids(list(PIECES)), eos]
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        **{**TINY, "vocab_size": VOCAB}, eos_token_id=eos, pad_token_id=tok.pad_token_id
    )
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.zero_()  # the layer adds nothing to the residual stream
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for dim, (token, successor) in enumerate(itertools.pairwise(chain)):
            emb[:, dim] = 0.0  # only the chain's tokens read this dimension
            emb[token] = 0.0
            emb[token, dim] = 1.0
            head[:, dim] = 0.0
            head[successor, dim] = 10.0
    model.save_pretrained(str(path), safe_serialization=True)
    tok.save_pretrained(str(path), save_jinja_files=False)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return path
