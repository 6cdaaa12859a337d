import random

from opd.data.task import (TASKS, AdditionTask, ChainTask, extract_answer, held_out_examples, is_correct, is_held_out,
                      train_examples)
from opd.models.tokenizer import TextTokenizer


def test_extract_answer():
    assert extract_answer("12+34=46\n46+5=51\n#51") == "51"
    assert extract_answer("#-7 ") == "-7"
    assert extract_answer("579") == "579"
    assert extract_answer("12+34=46\n#4x6") == "4x6"
    assert extract_answer("") is None and extract_answer("# ") is None
    assert extract_answer("1#2#3") == "3"


def test_is_correct_compares_integers():
    assert is_correct("#0579", "579")
    assert not is_correct("#578", "579")
    assert not is_correct("no answer", "579")
    assert not is_correct("#4x6", "46")
    assert is_correct("The capital is #Paris ", "Paris") and not is_correct("#paris", "Paris")


def test_chain_worked_solution_is_arithmetically_right():
    ex = ChainTask().sample(random.Random(0))
    terms = [int(x) for x in ex.prompt.rstrip("=").split("+")]
    lines = ex.completion.split("\n")
    total = terms[0]
    for line, x in zip(lines, terms[1:]):
        assert line == f"{total:03d}+{x:03d}={total + x:03d}"
        total += x
    assert lines[-1] == f"#{total}" and ex.answer == str(total) == str(sum(terms))


def test_chain_is_long_form():
    """The default task's completions are a scratchpad of at least ~64 generated tokens."""
    tok = TextTokenizer.builtin()
    lengths = [len(tok.encode(ex.completion)) + 1 for ex in held_out_examples(TASKS["chain"], 200)]
    assert min(lengths) >= 64
    assert max(lengths) <= TASKS["chain"].max_new_tokens


def test_addition_is_short():
    ex = AdditionTask().sample(random.Random(1))
    assert ex.completion == f"#{ex.answer}" and len(ex.completion) <= 5


def test_held_out_split_is_fixed_and_disjoint():
    task = TASKS["add"]
    a, b = held_out_examples(task, 300), held_out_examples(task, 300)
    assert a == b and len({ex.prompt for ex in a}) == 300
    assert all(is_held_out(ex.prompt) for ex in a)
    stream = train_examples(task, seed=3)
    train_prompts = {next(stream).prompt for _ in range(5000)}
    assert not train_prompts & {ex.prompt for ex in a}
    assert 0.05 < sum(is_held_out(str(i)) for i in range(10000)) / 10000 < 0.15


def test_tokenizer_roundtrip_is_one_token_per_character(tmp_path):
    tok = TextTokenizer.builtin()
    text = "37+85=122\n#122 Q: what?"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    tok.save(tmp_path)
    again = TextTokenizer.load(tmp_path, 1, [2], 0)
    assert again.encode(text) == ids and again.vocab_size == tok.vocab_size == 100
