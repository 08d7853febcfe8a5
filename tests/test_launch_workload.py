"""Workloads: the synthetic generator, JSONL files (errors name the line), the rank split."""

from __future__ import annotations

import pytest

from dp_runtime.serving.request import SamplingParams
from launch.workload import SyntheticWorkload, WorkloadError, load_jsonl, split_round_robin


def test_synthetic_is_a_pure_function_of_its_options():
    w = SyntheticWorkload(num_requests=5, prompt_len=8, prompt_len_min=3, max_new_tokens=4, vocab_size=50, seed=7)
    a, b = w.requests(), w.requests()
    assert a == b
    assert [r.rid for r in a] == ["r0000", "r0001", "r0002", "r0003", "r0004"]
    assert all(3 <= len(r.prompt_ids) <= 8 and max(r.prompt_ids) < 50 for r in a)
    assert all(r.sampling.max_new_tokens == 4 and r.sampling.greedy for r in a)
    assert SyntheticWorkload(num_requests=5, seed=8).requests() != SyntheticWorkload(num_requests=5, seed=7).requests()


def test_synthetic_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_requests must be >= 1, got 0"):
        SyntheticWorkload(num_requests=0)
    with pytest.raises(ValueError, match="prompt_len_min"):
        SyntheticWorkload(prompt_len=4, prompt_len_min=5)


def test_jsonl_reads_requests_with_defaults(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text(
        '# a comment\n'
        '{"rid": "a", "prompt_ids": [1, 2, 3], "max_new_tokens": 3}\n'
        '\n'
        '{"prompt_ids": [4], "temperature": 0.5, "stop_token_ids": [9]}\n'
    )
    reqs = load_jsonl(f, SamplingParams(max_new_tokens=7), vocab_size=10)
    assert [r.rid for r in reqs] == ["a", "line4"]
    assert reqs[0].prompt_ids == (1, 2, 3) and reqs[0].sampling.max_new_tokens == 3
    assert reqs[1].sampling.max_new_tokens == 7 and reqs[1].sampling.temperature == 0.5
    assert reqs[1].sampling.stop_token_ids == (9,)


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"prompt_ids": []}', "non-empty list"),
    ('{"prompt_ids": [1, -2]}', r"prompt_ids\[1\] must be an int >= 0, got -2"),
    ('{"prompt_ids": [1, 2.5]}', r"prompt_ids\[1\] must be an int >= 0, got 2.5"),
    ('{"prompt_ids": [1], "colour": 3}', "unknown keys \\['colour'\\]"),
    ('{"prompt_ids": [99]}', r"prompt_ids\[0\]=99 is not a token id in \[0, vocab_size=10\)"),
    ('{"prompt_ids": [1], "max_new_tokens": 0}', "max_new_tokens must be an int >= 1, got 0"),
    ('{"prompt_ids": [1], "max_new_tokens": 2.5}', "max_new_tokens must be an int >= 1, got 2.5"),
    # json.loads reads these literals; the sampling rules refuse them.
    ('{"prompt_ids": [1], "temperature": NaN}', "temperature must be a finite number >= 0, got nan"),
    ('{"prompt_ids": [1], "temperature": Infinity}', "temperature must be a finite number >= 0, got inf"),
    ('{"prompt_ids": [1], "top_p": NaN}', r"top_p must be a finite number in \(0, 1\], got nan"),
    ('{"prompt_ids": [1], "seed": -1}', r"seed must be an int in \[0, 2\*\*64\), got -1"),
])
def test_jsonl_errors_name_the_file_and_line(tmp_path, line, message):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt_ids": [1]}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=f"bad.jsonl:2: .*{message}"):
        load_jsonl(f, vocab_size=10)


def test_jsonl_missing_empty_and_duplicate(tmp_path):
    with pytest.raises(WorkloadError, match="does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n# nothing\n")
    with pytest.raises(WorkloadError, match="holds no requests"):
        load_jsonl(empty)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"rid": "x", "prompt_ids": [1]}\n{"rid": "x", "prompt_ids": [2]}\n')
    with pytest.raises(WorkloadError, match=r"dup\.jsonl:2: rid 'x' already used on line 1"):
        load_jsonl(dup)


def test_split_round_robin():
    reqs = SyntheticWorkload(num_requests=5).requests()
    shares = split_round_robin(reqs, 3)
    assert [[r.rid for r in s] for s in shares] == [["r0000", "r0003"], ["r0001", "r0004"], ["r0002"]]
    assert split_round_robin(reqs[:1], 2)[1] == []
    with pytest.raises(ValueError):
        split_round_robin(reqs, 0)


def test_a_line_that_is_not_utf8_or_json_is_named_by_file_and_line_on_the_cli(tmp_path):
    from tests.support.cli_probe import probe_cli

    bad_bytes = tmp_path / "latin1.jsonl"
    bad_bytes.write_bytes(b'{"prompt_ids": [1]}\n# caf\xe9\n{"rid": "caf\xe9", "prompt_ids": [2]}\n')
    with pytest.raises(WorkloadError, match=r"latin1.jsonl:2: not UTF-8 \(byte 0xe9 at column 6\)"):
        load_jsonl(bad_bytes)
    bad_json = tmp_path / "broken.jsonl"
    bad_json.write_text('{"prompt_ids": [1]}\n\n{"prompt_ids": [2],}\n')
    out = probe_cli([["run", "--launcher", "local", "--workload", str(f)]
                     for f in (bad_bytes, bad_json)])
    (code1, err1), (code2, err2) = out["cases"]
    assert code1 == code2 == 2 and len(err1.splitlines()) == len(err2.splitlines()) == 1
    assert err1.strip() == f"error: {bad_bytes}:2: not UTF-8 (byte 0xe9 at column 6)"
    assert err2.startswith(f"error: {bad_json}:3: invalid JSON ("), err2
