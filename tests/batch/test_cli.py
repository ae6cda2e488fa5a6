"""`splitserve batch`: a whole run, and a rerun after a crash that left a torn last line; each result one
line whatever its text holds."""
from __future__ import annotations

import json

import pytest

from splitserve.batch.results import ResultLog
from splitserve.cli import main
from tests.batch.batch_helpers import as_jsonl, batch_lines, expected_texts


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_batch_command_runs_resumes_and_reports(tmp_path, capsys):
    lines = batch_lines(12)
    source, out, stats = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "stats.json"
    source.write_bytes(as_jsonl(lines))
    assert main(["batch", str(source), str(out), "--stats", str(stats)]) == 0
    first = read(out)
    assert {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in first} == expected_texts(lines)
    assert json.loads(stats.read_text())["requests"] == 12
    # a crash: the last four results lost, the one before torn mid-line
    kept = out.read_text().splitlines(keepends=True)[:7]
    out.write_text("".join(kept) + kept[0][:25])
    assert main(["batch", str(source), str(out), "--order", "dfs"]) == 0
    assert "resuming: 7 of 12" in capsys.readouterr().out
    again = read(out)
    assert sorted(r["custom_id"] for r in again) == sorted(line["custom_id"] for line in lines)
    assert [r["id"] for r in again[:7]] == [r["id"] for r in first[:7]]


def test_lines_naming_an_adapter_run_under_it(tmp_path):
    """`--lora-modules`: a line whose body.model is an adapter's name runs under that adapter, the
    others on the base model, as the offline engine answers them; an unknown model fails its line."""
    from splitserve import LLM, SamplingParams
    from splitserve.engine.demo import demo_model_config
    from splitserve.engine.dummy_adapter import write_adapter

    adapter = write_adapter(tmp_path / "sql", demo_model_config(), ["q_proj", "v_proj", "down_proj"], 8, 3, std=0.1)
    lines = batch_lines(6)
    for i, line in enumerate(lines):
        line["body"]["model"] = ("demo", "sql", "nope")[i % 3]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(as_jsonl(lines))
    assert main(["batch", str(source), str(out), "--lora-modules", f"sql={adapter}"]) == 0
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in read(out)}
    llm = LLM("demo", lora_modules={"sql": adapter})
    served = [line for line in lines if line["body"]["model"] != "nope"]
    want = llm.generate([line["body"]["prompt"] for line in served],
                        [SamplingParams(max_tokens=line["body"]["max_tokens"], temperature=0, ignore_eos=True,
                                        lora=None if line["body"]["model"] == "demo" else "sql") for line in served])
    assert texts == {line["custom_id"]: o.text for line, o in zip(served, want)}
    assert texts["req-1"] != expected_texts(lines[1:2])["req-1"]  # the adapter changed the answer
    errors = read(tmp_path / "out.errors.jsonl")
    assert sorted(e["custom_id"] for e in errors) == ["req-2", "req-5"]
    assert main(["batch", str(source), str(tmp_path / "again.jsonl"), "--lora-modules", f"demo={adapter}"]) == 2


def test_result_log_refuses_a_second_result_for_a_line(tmp_path):
    with ResultLog(tmp_path / "log.jsonl") as log:
        log.append({"custom_id": "a"})
        try:
            log.append({"custom_id": "a"})
        except ValueError as error:
            assert "already has a result" in str(error)
        else:
            raise AssertionError("a duplicate result was written")


@pytest.mark.parametrize("line, problem", [
    (b"[1]", "not a JSON object with a string custom_id: [1]"),
    (b'"x"', 'not a JSON object with a string custom_id: "x"'),
    (b"{}", "not a JSON object with a string custom_id: {}"),
    (b'{"custom_id": 5}', 'not a JSON object with a string custom_id: {"custom_id": 5}'),
    (b"", "not valid JSON (Expecting value at column 1)"),
    (b'{"custom_id": "b"', "not valid JSON (Expecting ',' delimiter at column 18)"),
    (b"\xff", "not UTF-8"),
])
def test_a_whole_line_that_is_not_a_result_is_a_value_error_naming_the_file_and_line(tmp_path, line, problem):
    """It raised TypeError, KeyError or JSONDecodeError; the log is left as it was."""
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"custom_id": "a"}\n' + line + b'\n{"custom_id": "c"}\n{"custom_id": "torn')
    with pytest.raises(ValueError) as error:
        ResultLog(path)
    assert str(error.value) == f"{path} line 2: {problem}; the file is damaged or is not a result log"
    assert path.read_bytes().endswith(b'"torn')  # nothing cut


def test_a_result_is_one_line_for_any_line_splitter(tmp_path):
    """A model's text may hold U+0085, U+2028 or U+2029, which str.splitlines takes for line ends."""
    text = "a\x85b\u2028c\u2029d é"
    with ResultLog(tmp_path / "log.jsonl") as log:
        log.append({"custom_id": "a", "text": text})
        log.append({"custom_id": "b", "text": text})
    assert [line["text"] for line in read(tmp_path / "log.jsonl")] == [text, text]
    assert "é" in (tmp_path / "log.jsonl").read_text()  # other characters stay raw UTF-8
    assert list(ResultLog(tmp_path / "log.jsonl").done) == ["a", "b"]


def test_bad_input_is_a_one_line_error(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text('{"custom_id": "a"}\n')
    assert main(["batch", str(source), str(tmp_path / "out.jsonl")]) == 2
    assert "line 1: method must be POST" in capsys.readouterr().err


def test_an_output_that_is_not_a_result_log_is_a_one_line_error(tmp_path, capsys):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(as_jsonl(batch_lines(1)))
    out.write_text("[1]\n")
    assert main(["batch", str(source), str(out)]) == 2
    assert capsys.readouterr().err == (f"splitserve batch: {out} line 1: not a JSON object with a string custom_id: "
                                       "[1]; the file is damaged or is not a result log\n")
    assert out.read_text() == "[1]\n"


def test_an_absurd_kv_cache_size_is_a_usage_error(tmp_path, capsys):
    """--num-kv-blocks 100000000000 reached the engine, whose allocator raised a traceback."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(as_jsonl(batch_lines(1)))
    with pytest.raises(SystemExit) as exit:
        main(["batch", str(source), str(tmp_path / "out.jsonl"), "--num-kv-blocks", "100000000000"])
    assert exit.value.code == 2
    assert "argument --num-kv-blocks: must be in [1, 2147483647], got 100000000000" in capsys.readouterr().err


def test_the_input_output_and_errors_must_be_three_files(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_bytes(as_jsonl(batch_lines(3)))
    for out, errors, named in ((source, None, "OUTPUT"), (tmp_path / "out.jsonl", source, "the errors file"),
                               (tmp_path / "x.jsonl", tmp_path / "x.jsonl", "the errors file")):
        assert main(["batch", str(source), str(out), *(["--errors", str(errors)] if errors else [])]) == 2
        assert f"{named} ({tmp_path}" in capsys.readouterr().err
    assert source.read_bytes() == as_jsonl(batch_lines(3))  # untouched


def test_blend_ends_when_nothing_is_left_to_run(tmp_path, capsys):
    """A batch of one line (the sample is all of it), its rerun (every line done) and a batch whose
    lines all fail validation end with exit 0 (they raised: a stall, a division by zero)."""
    one, invalid, out = tmp_path / "one.jsonl", tmp_path / "invalid.jsonl", tmp_path / "out.jsonl"
    one.write_bytes(as_jsonl(batch_lines(1)))
    assert main(["batch", str(one), str(out)]) == 0 and len(read(out)) == 1
    assert main(["batch", str(one), str(out)]) == 0 and "resuming: 1 of 1" in capsys.readouterr().out
    lines = batch_lines(3)
    for line in lines:
        line["body"]["model"] = "another"
    invalid.write_bytes(as_jsonl(lines))
    assert main(["batch", str(invalid), str(tmp_path / "none.jsonl")]) == 0
    assert "0 lines succeeded, 3 failed" in capsys.readouterr().out


def test_score_label_tokens_make_a_rerank_line_a_reranker_s_verdict(tmp_path, capsys):
    """`--score-label-tokens n y`: a rerank line's scores are probabilities (the demo's byte tokens
    as labels); without it, cosines of embeddings; a label of several tokens is a one-line error."""
    line = {"custom_id": "r", "method": "POST", "url": "/v1/rerank",
            "body": {"model": "demo", "query": "Which is yellow?", "documents": ["Bananas.", "The sky."]}}
    source = tmp_path / "in.jsonl"
    source.write_bytes(as_jsonl([line]))
    assert main(["batch", str(source), str(tmp_path / "cos.jsonl")]) == 0
    assert main(["batch", str(source), str(tmp_path / "verdict.jsonl"), "--score-label-tokens", "n", "y"]) == 0
    [cosines], [verdicts] = read(tmp_path / "cos.jsonl"), read(tmp_path / "verdict.jsonl")
    by_cosine = [r["relevance_score"] for r in cosines["response"]["body"]["results"]]
    by_verdict = [r["relevance_score"] for r in verdicts["response"]["body"]["results"]]
    assert all(0 < p < 1 for p in by_verdict) and by_verdict != pytest.approx(by_cosine)
    capsys.readouterr()
    assert main(["batch", str(source), str(tmp_path / "bad.jsonl"), "--score-label-tokens", "no"]) == 2
    assert "score_label_tokens: 'no' is 2 tokens" in capsys.readouterr().err
