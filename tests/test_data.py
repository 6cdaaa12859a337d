from opd.data.supervised import IGNORE, sft_batch
from opd.data.task import Example
from opd.models.tokenizer import TextTokenizer


def test_sft_batch_masks_prompt_and_padding():
    tok = TextTokenizer.builtin()
    inputs, targets = sft_batch(tok, [Example("1+2=", "#3", "3"), Example("10+20=", "#30", "30")])
    # sequence 0: <bos> 1 + 2 = # 3 <eos>  (8 tokens -> 7 inputs), sequence 1 is 2 tokens longer
    assert inputs.shape == targets.shape == (2, 10)
    assert inputs[0, :7].tolist() == [tok.bos_id] + tok.encode("1+2=#3")
    assert (inputs[0, 7:] == tok.pad_id).all()
    assert targets[0].tolist() == [IGNORE] * 4 + tok.encode("#3") + [tok.eos_id] + [IGNORE] * 3
    assert targets[1].tolist() == [IGNORE] * 6 + tok.encode("#30") + [tok.eos_id]
