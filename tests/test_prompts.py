"""Prompt files (text, chat messages, mapped keys), the held-out split, the length policy; and answer scoring."""
import json
from dataclasses import replace

import pytest

from opd.config.files import build_config
from opd.io.errors import OpdError
from opd.data.prompts import PromptFormat, PromptSet, held_out_share, read_prompts
from opd.training.evaluate import get_scorer
from opd.data.scoring import boxed, gsm8k, number
from opd.data.task import Example
from opd.models.tokenizer import TextTokenizer


def write(tmp_path, rows, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r) + "\n" for r in rows))
    return path


def test_text_chat_and_mapped_keys(tmp_path):
    path = write(tmp_path, [{"prompt": "1+2=", "answer": "3"}, "", {"prompt": "why?"}, {"prompt": "2+2=", "answer": 4},
                            {"messages": [{"role": "user", "content": "hi"}], "answer": "x"}])
    assert read_prompts(path) == [Example("1+2=", "", "3"), Example("why?", "", None), Example("2+2=", "", "4"),
                                  Example([{"role": "user", "content": "hi"}], "", "x")]
    gsm = write(tmp_path, [{"question": "How many?", "answer": "2 + 3 = 5\n#### 5"}], "gsm.jsonl")
    got = read_prompts(gsm, PromptFormat("question", "answer", chat=True))
    assert got == [Example([{"role": "user", "content": "How many?"}], "", "2 + 3 = 5\n#### 5")]


@pytest.mark.parametrize("content, where", [
    ('{"prompt": "1+2="}\n{"prompt": \n', ":2:"),
    ('{"prompt": "1+2="}\n["1+2="]\n', ":2:"),
    ('{"answer": "3"}\n', ":1: no field 'prompt'"),
    ('{"prompt": "1", "answer": [3]}\n', ":1:"),
    ('{"messages": [{"role": "user"}]}\n', ":1: a chat message must be"),
    ('{"prompt": ""}\n', ":1:"),
    ("\n\n", "no prompts"),
])
def test_malformed_prompt_files_name_file_and_line(tmp_path, content, where):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(OpdError, match=f"bad.jsonl{where}" if where.startswith(":") else where):
        read_prompts(path)


def test_a_line_without_the_mapped_key_names_it(tmp_path):
    path = write(tmp_path, [{"question": "q1"}, {"text": "q2"}])
    with pytest.raises(OpdError, match=r"p.jsonl:2: no field 'question' \(prompt_key\)"):
        read_prompts(path, PromptFormat("question"))


def test_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(OpdError, match="not UTF-8"):
        read_prompts(path)


def test_held_out_split_is_by_hash_and_disjoint(tmp_path):
    rows = [{"prompt": f"question {i}", "answer": str(i)} for i in range(400)]
    path = write(tmp_path, rows)
    cfg = build_config({"data": {"prompts": str(path)}, "eval": {"fraction": 0.25, "examples": 1000}, "batch_size": 8})
    prompts = PromptSet(cfg, TextTokenizer.builtin(), 512, 32)
    held = {ex.prompt for ex in prompts.held_out}
    train = {TextTokenizer.builtin().decode(ids) for ids in prompts.train}
    assert 70 < len(held) < 130 and not held & train and len(held) + len(train) == 400
    assert held == {r["prompt"] for r in rows if held_out_share(r["prompt"]) < 0.25}  # the same split anywhere
    shuffled = write(tmp_path, rows[::-1], "shuffled.jsonl")
    again = PromptSet(replace(cfg, data=replace(cfg.data, prompts=str(shuffled))), TextTokenizer.builtin(), 512, 32)
    assert {ex.prompt for ex in again.held_out} == held
    other = write(tmp_path, [{"prompt": "x", "answer": "1"}], "eval.jsonl")
    assert [ex.prompt for ex in PromptSet(replace(cfg, eval=replace(cfg.eval, prompts=str(other))), TextTokenizer.builtin(), 512,
                                          32).held_out] == ["x"]


def test_long_prompts_are_refused_or_dropped(tmp_path, capsys):
    path = write(tmp_path, [{"prompt": "short"}, {"prompt": "a much longer prompt than the limit"}, {"prompt": "ok"}])
    cfg = build_config({"data": {"prompts": str(path), "max_prompt_tokens": 10}, "eval": {"fraction": 0.01}})
    with pytest.raises(OpdError, match="has 36 tokens, over the limit of 10"):
        PromptSet(cfg, TextTokenizer.builtin(), 512, 32)
    kept = PromptSet(replace(cfg, data=replace(cfg.data, long_prompts="drop")), TextTokenizer.builtin(), 512, 32)
    assert kept.dropped == 1 and len(kept.train) == 2
    assert "dropped 1 training prompts longer than 10 tokens" in capsys.readouterr().err
    with pytest.raises(OpdError, match="leaves no room for a prompt"):
        PromptSet(replace(cfg, data=replace(cfg.data, max_prompt_tokens=0)), TextTokenizer.builtin(), 32, 32)


# ---- scoring -----------------------------------------------------------------------------------------------------

def test_extractors():
    assert gsm8k("so 5 + 3 = 8\n#### 8") == "8" and gsm8k("#### 1,234.50 dollars") == "1,234.50" and gsm8k("8") is None
    assert gsm8k("#### 3\n#### -4") == "-4"
    assert boxed(r"so \boxed{\frac{1}{2}} or \boxed{x^{2}}") == "x^{2}" and boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert boxed("no box") is None and boxed(r"\boxed{open") is None
    assert number("1,234") == number("1234.0") == number("+1234") == number("$1234.") and number("12a") is None


@pytest.mark.parametrize("scoring, completion, answer, credit", [
    ("last_hash", "12+3=15\n#15", "15", 1.0), ("last_hash", "#0579", "579", 1.0), ("last_hash", "#4x6", "4x6", 1.0),
    ("gsm8k", "She sells 48 + 24 = 72.\n#### 72", "48/2 = 24\n#### 72", 1.0),
    ("gsm8k", "#### 1,000", "1000", 1.0), ("gsm8k", "#### 72.0", "#### 72", 1.0), ("gsm8k", "72", "72", 0.0),
    ("gsm8k", "#### -5", "5", 0.0),
    ("boxed", r"thus \boxed{\frac{3}{4}}", r"\boxed{\frac{3}{4}}", 1.0), ("boxed", r"\boxed{0.5}", "1/2", 0.0),
    ("boxed", r"\boxed{ 42 }", "42.0", 1.0),
    ("exact", " Paris \n", "Paris", 1.0), ("exact", "Paris.", "Paris", 0.0),
])
def test_scorers(scoring, completion, answer, credit):
    assert get_scorer(scoring)(completion, answer) == credit


def test_user_scoring_function_and_its_failures(tmp_path, monkeypatch):
    (tmp_path / "myscore.py").write_text("def contains(c, a):\n    return a in c\n\ndef broken(c, a):\n"
                                         "    raise ValueError('no')\n\ndef half(c, a):\n    return 0.5\n\n"
                                         "def wrong(c, a):\n    return 'yes'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert get_scorer("myscore:contains")("the answer is 42", "42") == 1.0
    assert get_scorer("myscore:half")("x", "y") == 0.5
    assert get_scorer("none") is None
    with pytest.raises(OpdError, match="raised ValueError: no"):
        get_scorer("myscore:broken")("x", "y")
    with pytest.raises(OpdError, match="returned 'yes'"):
        get_scorer("myscore:wrong")("x", "y")
    with pytest.raises(OpdError, match="cannot be imported: ModuleNotFoundError"):
        get_scorer("nosuchmodule:f")
    with pytest.raises(OpdError, match="cannot be imported: AttributeError"):
        get_scorer("myscore:missing")
    with pytest.raises(OpdError, match="unknown scoring 'bogus'"):
        build_config({"data": {"scoring": "bogus"}})
