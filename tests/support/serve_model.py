"""A tiny Qwen3-MoE checkpoint with a tokenizer trained by the test, for the server's tests.

``write_serve_checkpoint(path)`` trains a byte-level BPE tokenizer (``tokenizers``) on a small
corpus with multi-byte characters (so some tokens hold part of a UTF-8 sequence), with an EOS
token and chat tokens, saves it with a chat template so transformers' AutoTokenizer loads it,
and writes the tiny checkpoint of ``tests/hf_reference.py`` with the tokenizer's vocabulary
size. ``eos_ids`` of generation_config.json are the tokenizer's EOS plus ``extra_eos`` (a
plain token the random model does sample, so a test sees a request end on EOS); ``generation``
adds keys to that file (sampling defaults: ``{"top_k": 1}``). Write those after loading a
transformers reference from the directory: its ``generate`` would apply them too.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "EOS", "train_tokenizer", "write_serve_checkpoint"]

EOS = "<|im_end|>"
SPECIALS = ("<|endoftext|>", "<|im_start|>", EOS)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Data parallel attention with expert parallel mixture of experts.",
    "Héllo wörld, façade, naïve café, smörgåsbord, crème brûlée.",
    "日本語のテキスト、中文文本，한국어 텍스트.",
    "Emoji: 🙂 🚀 🎉 ✨ — and math: ∑ ∫ √ ≈ ≠ ∞.",
    "user: hello there! assistant: hi, how can I help you today?",
]


def train_tokenizer(vocab_size: int = 384):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` ids (specials
    first), its EOS ``<|im_end|>`` and the chat template set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"trained {tok.get_vocab_size()} ids, wanted {vocab_size}: grow the corpus"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=SPECIALS[0],
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
    )


def write_serve_checkpoint(
    path: Path,
    *,
    seed: int = 0,
    extra_eos: tuple[int, ...] = (),
    vocab_size: int = 384,
    generation: dict | None = None,
) -> Path:
    """The tiny checkpoint with the trained tokenizer in ``path``; generation_config.json's
    ``eos_token_id`` is ``[<|im_end|>, *extra_eos]``, and it holds ``generation``'s keys.
    Returns ``path``."""
    from tests.hf_reference import write_tiny_checkpoint

    path = Path(path)
    tokenizer = train_tokenizer(vocab_size)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    write_tiny_checkpoint(
        path,
        seed=seed,
        vocab_size=vocab_size,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    tokenizer.save_pretrained(
        str(path), save_jinja_files=False
    )  # the template in tokenizer_config.json
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen["eos_token_id"] = [eos, *extra_eos]
    gen.update(generation or {})
    gen_path.write_text(json.dumps(gen, indent=2))
    return path
