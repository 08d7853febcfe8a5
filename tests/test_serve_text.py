"""The server's text: a tokenizer trained here, incremental detokenization, stop strings."""

from __future__ import annotations

import asyncio
import random

import pytest

from launch.server.prompt_encoder import PromptEncoder
from launch.server.text import (
    TextStream,
    TokenizerMissing,
    encode_chat,
    encode_text,
    load_tokenizer,
)
from tests.support.serve_model import EOS, train_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer().save_pretrained(str(path), save_jinja_files=False)
    return load_tokenizer(path)  # as the server loads it: AutoTokenizer of the directory


def _full(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _stream(tok, ids, step=1, **kw):
    ts = TextStream(tok, **kw)
    deltas = []
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        deltas.append(ts.add(ids[i : i + step], finished=last).text)
    return ts, deltas


def test_trained_tokenizer_loads_with_eos_and_chat_template(tok):
    assert len(tok) == 384 and tok.eos_token == EOS
    ids = encode_chat(tok, "m", [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_text_is_whole_utf8_and_equals_full_decode(tok, step):
    text = "Héllo wörld 日本語のテキスト 🙂🚀 crème brûlée ∑∫"
    ids = encode_text(tok, "m", text)
    # Some of these tokens hold part of a character: decoding them alone gives U+FFFD.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    ts, deltas = _stream(tok, ids, step)
    assert "".join(deltas) == text == ts.text
    assert all("\ufffd" not in d for d in deltas)


def test_random_ids_stream_equals_full_decode(tok):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        _, deltas = _stream(tok, ids, rng.randrange(1, 4))
        assert "".join(deltas) == _full(tok, ids)


def test_special_tokens_are_not_text(tok):
    ids = [
        *encode_text(tok, "m", "ab"),
        tok.convert_tokens_to_ids("<|im_start|>"),
        *encode_text(tok, "m", "cd"),
    ]
    _, deltas = _stream(tok, ids)
    assert "".join(deltas) == "abcd"


def test_final_stop_token_is_not_text_but_earlier_ones_are(tok):
    ids = encode_text(tok, "m", "hello there")
    stop_id = encode_text(tok, "m", "!")[0]
    ts = TextStream(tok, hidden_ids=(stop_id,))
    out = ts.add([*ids, stop_id], finished=True, stop_by_token=True).text
    assert out == "hello there"
    ts = TextStream(tok, hidden_ids=(stop_id,))  # finished by length: the id is text
    assert ts.add([stop_id, *ids, stop_id], finished=True).text == "!hello there!"


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_string_cuts_the_text_and_is_never_half_sent(tok, step):
    ids = encode_text(tok, "m", "The quick brown fox jumps over the lazy dog.")
    ts = TextStream(tok, stop=("fox jumps", "zzz"))
    deltas = []
    for i in range(0, len(ids), step):
        d = ts.add(ids[i : i + step])
        deltas.append(d.text)
        if d.stopped:
            break
    assert ts.stopped and "".join(deltas) == "The quick brown " == ts.text
    assert not any("fox" in d for d in deltas)


def test_stop_string_absent_releases_everything_at_the_end(tok):
    text = "over the lazy dog"
    ts, deltas = _stream(tok, encode_text(tok, "m", text), stop=("lazy cat",))
    assert "".join(deltas) == text and not ts.stopped


def test_no_tokenizer_means_token_ids_only():
    with pytest.raises(TokenizerMissing, match="no tokenizer"):
        encode_text(None, "tiny", "hello")
    with pytest.raises(TokenizerMissing, match="token ids"):
        encode_chat(None, "tiny", [{"role": "user", "content": "hi"}])
    ts = TextStream(None, stop=("x",))
    assert ts.add([1, 2, 3], finished=True).text == ""


def test_no_chat_template_is_a_value_error(tmp_path):
    t = train_tokenizer()
    t.chat_template = None
    t.save_pretrained(str(tmp_path), save_jinja_files=False)
    with pytest.raises(ValueError, match="no chat template"):
        encode_chat(load_tokenizer(tmp_path), "m", [{"role": "user", "content": "hi"}])


def test_preset_or_tokenizerless_dir_has_no_tokenizer(tmp_path):
    assert load_tokenizer(None) is None
    assert load_tokenizer(tmp_path) is None


def test_prompt_encoder_gives_the_same_ids_and_errors_off_the_loop(tok):
    import copy

    slow = copy.deepcopy(tok)
    # Rendering this template takes the tokenizer's thread a while (Jinja, in Python): a loop
    # that waited for it would not run the ticker below in between.
    slow.chat_template = ("{% for i in range(1000) %}{% for j in range(400) %}{% endfor %}{% endfor %}"
                          + tok.chat_template)
    messages = [{"role": "user", "content": "hi there"}]

    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        enc, bare = PromptEncoder(slow, "m"), PromptEncoder(None, "m")
        t = asyncio.create_task(ticker())
        try:
            chat = await enc.chat(messages)
            during = ticks
            text = await enc.text("Héllo wörld")
            with pytest.raises(TokenizerMissing):
                await bare.text("x")
        finally:
            t.cancel()
            enc.close()
            bare.close()
            enc.close()  # idempotent
        return chat, text, during

    chat, text, during = asyncio.run(run())
    assert chat == encode_chat(tok, "m", messages)
    assert text == encode_text(tok, "m", "Héllo wörld")
    # The loop ran while the template rendered on the encoder's thread: encoded on the loop, the
    # ticker could not run before the ids came back (0). How often it ran depends on the GIL's
    # switches (each turn's poll lets the rendering thread take the GIL for up to 5 ms).
    assert during > 0
