import pytest

from opd.data import IGNORE, load_prompts, sft_batch
from opd.errors import OpdError
from opd.task import Example
from opd.tokenizer import TextTokenizer


def test_load_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+2=", "answer": "3"}\n\n{"prompt": "why?"}\n{"prompt": "2+2=", "answer": 4}\n')
    assert load_prompts(path) == [Example("1+2=", "", "3"), Example("why?", "", None), Example("2+2=", "", "4")]


@pytest.mark.parametrize("content, where", [
    ('{"prompt": "1+2="}\n{"prompt": \n', ":2:"),
    ('{"prompt": "1+2="}\n["1+2="]\n', ":2:"),
    ('{"answer": "3"}\n', ":1:"),
    ('{"prompt": "1", "answer": [3]}\n', ":1:"),
    ("\n\n", "no prompts"),
])
def test_malformed_prompt_files_name_file_and_line(tmp_path, content, where):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(OpdError, match=f"bad.jsonl{where}" if where.startswith(":") else where):
        load_prompts(path)


def test_sft_batch_masks_prompt_and_padding():
    tok = TextTokenizer.builtin()
    inputs, targets = sft_batch(tok, [Example("1+2=", "#3", "3"), Example("10+20=", "#30", "30")])
    # sequence 0: <bos> 1 + 2 = # 3 <eos>  (8 tokens -> 7 inputs), sequence 1 is 2 tokens longer
    assert inputs.shape == targets.shape == (2, 10)
    assert inputs[0, :7].tolist() == [tok.bos_id] + tok.encode("1+2=#3")
    assert (inputs[0, 7:] == tok.pad_id).all()
    assert targets[0].tolist() == [IGNORE] * 4 + tok.encode("#3") + [tok.eos_id] + [IGNORE] * 3
    assert targets[1].tolist() == [IGNORE] * 6 + tok.encode("#30") + [tok.eos_id]
