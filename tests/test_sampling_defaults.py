"""A checkpoint's sampling defaults (dp_runtime/model/sampling_defaults.py) from the
generation_config.json each test writes: present, missing, partial, out of a field's limits, and
repetition_penalty (a default like the others); then as the engine exposes them
(``Engine.sampling_defaults``, ``EngineOptions.sampling_defaults``) on an engine built but never
started, which is when it reads the file. The served path: test_serve_gang.py (``model``, the
default) and test_serve_openai.py (``none``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dp_runtime.model.model_config import ModelConfigError
from dp_runtime.model.sampling_defaults import SamplingDefaults, checkpoint_sampling_defaults
from dp_runtime.rank_spec import RankSpec
from launch.engine import Engine, EngineOptions

transformers = pytest.importorskip("transformers")

QWEN3 = {  # Qwen3-30B-A3B's generation_config.json
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def _dir(path: Path, generation: dict | None) -> Path:
    """A checkpoint directory's config.json (the tiny model's, no weights: an engine that never
    starts reads nothing else) and, unless None, this generation_config.json."""
    from tests.hf_reference import TINY

    path.mkdir(parents=True, exist_ok=True)
    transformers.Qwen3MoeConfig(**TINY).save_pretrained(str(path))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_a_checkpoint_s_recommendations_are_read(tmp_path):
    got = checkpoint_sampling_defaults(_dir(tmp_path, QWEN3))
    assert got == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert got.items() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    some = checkpoint_sampling_defaults(_dir(tmp_path / "some", {"temperature": 1, "top_k": -1, "min_p": 0.05,
                                                                 "top_p": None}))
    assert some == SamplingDefaults(temperature=1.0, top_k=0, min_p=0.05)  # -1: off; null: unset
    assert isinstance(some.temperature, float)


def test_no_file_or_no_sampling_keys_is_no_defaults(tmp_path):
    assert checkpoint_sampling_defaults(_dir(tmp_path / "none", None)) == SamplingDefaults()
    eos_only = _dir(tmp_path / "eos", {"eos_token_id": 2, "do_sample": False, "max_new_tokens": 9})
    assert checkpoint_sampling_defaults(eos_only) == SamplingDefaults()
    assert SamplingDefaults().items() == {}


@pytest.mark.parametrize("key,value,rule", [
    ("temperature", -0.1, "temperature must be a finite number >= 0, got -0.1"),
    ("temperature", True, "temperature must be a finite number >= 0, got True"),
    ("top_p", 1.5, "top_p must be a finite number in (0, 1], got 1.5"),
    ("top_p", 0, "top_p must be a finite number in (0, 1], got 0"),
    ("top_k", 2.5, "top_k must be an int >= 0 (0: off), got 2.5"),
    ("top_k", -2, "top_k must be an int >= 0 (0: off), got -2"),
    ("min_p", 1.2, "min_p must be a finite number in [0, 1] (0: off), got 1.2"),
    ("min_p", "0.1", "min_p must be a finite number in [0, 1] (0: off), got '0.1'"),
    ("repetition_penalty", 0, "repetition_penalty must be a finite number > 0 (1: off), got 0"),
    ("repetition_penalty", -1.1, "repetition_penalty must be a finite number > 0 (1: off), got -1.1"),
])
def test_a_value_outside_its_field_s_limits_names_the_file_the_key_the_limit_and_the_value(
        tmp_path, key, value, rule):
    path = _dir(tmp_path, {**QWEN3, key: value})
    with pytest.raises(ModelConfigError) as info:
        checkpoint_sampling_defaults(path)
    assert str(info.value) == f"{path / 'generation_config.json'}: {rule}"


def test_a_file_that_is_not_a_json_object_is_named(tmp_path):
    path = _dir(tmp_path, None)
    (path / "generation_config.json").write_text("[0.6]")
    with pytest.raises(ModelConfigError, match=r"generation_config.json must hold a JSON object, got list"):
        checkpoint_sampling_defaults(path)


def test_repetition_penalty_is_a_default_like_the_others(tmp_path):
    got = checkpoint_sampling_defaults(_dir(tmp_path, {**QWEN3, "repetition_penalty": 1.05}))
    assert got.repetition_penalty == 1.05 and got.items()["repetition_penalty"] == 1.05
    assert got.pick("repetition_penalty", None, 1.0) == 1.05 and got.pick("repetition_penalty", 1.0, 1.0) == 1.0
    one = checkpoint_sampling_defaults(_dir(tmp_path / "one", {"repetition_penalty": 1}))
    assert one == SamplingDefaults(repetition_penalty=1.0) and isinstance(one.repetition_penalty, float)


def _engine(path: Path, **options) -> Engine:
    spec = RankSpec.create(str(path), device="cpu", dtype="float32", max_context_len=64)
    return Engine(spec, EngineOptions(**options))


def test_the_engine_reads_them_when_built(tmp_path, caplog):
    path = _dir(tmp_path, {**QWEN3, "min_p": 0.1, "repetition_penalty": 1.1})
    with caplog.at_level(logging.WARNING, logger="launch"):
        engine = _engine(path)
    assert engine.sampling_defaults == SamplingDefaults(0.6, 0.95, 20, 0.1, repetition_penalty=1.1)
    assert not caplog.records  # repetition_penalty is applied: nothing to warn about
    off = _engine(path, sampling_defaults="none")  # the file is not read
    assert off.sampling_defaults == SamplingDefaults()
    assert Engine(RankSpec.create("tiny", device="cpu", max_context_len=64)).sampling_defaults == SamplingDefaults()


def test_the_engine_refuses_a_bad_file_when_built_and_a_bad_option(tmp_path):
    path = _dir(tmp_path, {"top_p": 2})
    with pytest.raises(ModelConfigError, match=r"generation_config.json: top_p must be .* got 2$"):
        _engine(path)
    assert _engine(path, sampling_defaults="none").sampling_defaults == SamplingDefaults()
    with pytest.raises(ValueError, match=r"EngineOptions.sampling_defaults must be one of \('model', 'none'\), "
                                         r"got 'openai'"):
        EngineOptions(sampling_defaults="openai")
