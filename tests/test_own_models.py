"""Your own models: Qwen3- and Llama-3-style pairs with real tokenizer files (tests/hf_pairs.py), through the library
and through the CLI commands of the README's "Your own models" section.

Oracles: transformers' tokenizer loaded afresh from the folder (token for token), hand-written expected renderings of
each template (so the test does not only compare transformers with itself), and transformers' own greedy `generate`
with the generation config's stop ids (opd's completions must be the same tokens and stop at the same place)."""
import json
import re
import shlex
from pathlib import Path

import pytest
import torch
import transformers

import hf_pairs
from opd.models.checkpoint import load_checkpoint
from opd.cli import main
from opd.engines.builtin import Engine
from opd.io.errors import OpdError
from opd.data.prompts import held_out_share
from opd.engines.sampling import SamplingParams
from opd.training.setup import check_same_tokenizer

FAMILIES = ("qwen3", "llama3")
README = Path(__file__).resolve().parents[1] / "README.md"
TEXTS = ["Natalia has 12 clips.", " leading space and  two spaces", "Zahlen: 1,234.5 und 42!\n\nnew lines\ttab",
         "unicode: café, 東京, emoji 🙂", "<|im_start|> looks special", ""]
CHATS = [[{"role": "user", "content": "How many clips? "}],
         [{"role": "system", "content": "Answer with #### and the number."}, {"role": "user", "content": "1 + 2?"}],
         [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "#### 4"},
          {"role": "user", "content": "and 3 + 3?"}]]
EXPECTED_RENDERING = {  # the templates' output for CHATS[1], written by hand from the model cards' format
    "qwen3": "<|im_start|>system\nAnswer with #### and the number.<|im_end|>\n<|im_start|>user\n1 + 2?<|im_end|>\n"
             "<|im_start|>assistant\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nAnswer with #### and the number.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\n1 + 2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
              "\n\n"}
STOPS = hf_pairs.STOPS
NEW_TOKENS = 12


def gsm8k_rows(n=48):
    names = ["Natalia", "Weng", "Betty", "Julie", "James", "Mark"]
    return [{"question": f"{names[i % 6]} has {i + 3} clips and buys {2 * i} more. How many clips now?",
             "answer": f"{i + 3} + {2 * i} = <<{i + 3}+{2 * i}={3 * i + 3}>>{3 * i + 3}\n#### {3 * i + 3}"}
            for i in range(n)]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Per family: (student, teacher) folders, the GSM8K-style file, a chat file; the student's head relabelled so
    that greedy decoding of the file's first prompts ends at each stop id in turn (hf_pairs.stopping_prompts)."""
    root = tmp_path_factory.mktemp("own-models")
    gsm8k = write_jsonl(root / "gsm8k.jsonl", gsm8k_rows())
    chat = write_jsonl(root / "chat.jsonl", [{"messages": CHATS[i % 3], "answer": str(i)} for i in range(12)])
    out = {}
    for family in FAMILIES:
        student, teacher = hf_pairs.build_pair(family, root / family)
        hf_pairs.stopping_prompts(family, student, [row["question"] for row in gsm8k_rows()])
        out[family] = student, teacher
    return out, gsm8k, chat


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_parity_with_transformers(built, family):
    """encode_prompt == transformers' tokenizer (text) and apply_chat_template(add_generation_prompt=True) (chat),
    token for token; the renderings are the family's format; text round-trips through decode."""
    student = built[0][family][0]
    _, tok = load_checkpoint(student)
    hf = transformers.AutoTokenizer.from_pretrained(str(student))
    for text in TEXTS:
        assert tok.encode_prompt(text) == hf(text)["input_ids"], text
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text
        if "<|" not in text:  # a special token's text is encoded as the special token (as transformers does)
            assert tok.decode(tok.encode(text)) == text
    for chat in CHATS:
        want = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert tok.encode_prompt(chat) == want
    rendered = hf.decode(tok.encode_prompt(CHATS[1]), skip_special_tokens=False)
    assert rendered == EXPECTED_RENDERING[family]
    bos = hf.convert_tokens_to_ids("<|begin_of_text|>") if family == "llama3" else None
    text_ids, chat_ids = tok.encode_prompt(TEXTS[0]), tok.encode_prompt(CHATS[0])
    if family == "llama3":  # one BOS: the post-processor's for text; the template's (not a second one) for chats
        assert text_ids[0] == bos and text_ids.count(bos) == 1 and chat_ids.count(bos) == 1
    else:  # Qwen adds no BOS (an older opd put <|endoftext|> in front)
        assert text_ids == hf(TEXTS[0], add_special_tokens=False)["input_ids"]
        assert hf.convert_tokens_to_ids("<|endoftext|>") not in text_ids + chat_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_stop_ids_and_generation_defaults_from_the_folder(built, family):
    student = built[0][family][0]
    _, tok = load_checkpoint(student)
    hf = transformers.AutoTokenizer.from_pretrained(str(student))
    assert sorted(tok.stop_ids) == sorted(hf.convert_tokens_to_ids(STOPS[family]))
    generation = json.loads((student / "generation_config.json").read_text())
    assert tok.generation == {k: generation[k] for k in ("temperature", "top_k", "top_p") if k in generation}


def test_same_tokenizer_saved_twice_passes_different_ones_name_the_token(built, tmp_path):
    (q_student, q_teacher), (l_student, _) = built[0]["qwen3"], built[0]["llama3"]
    (s, tok), (t, teacher_tok) = load_checkpoint(q_student), load_checkpoint(q_teacher)
    check_same_tokenizer(s, tok, t, teacher_tok)  # the same tokenizer, saved in two folders
    other, other_tok = load_checkpoint(l_student)
    with pytest.raises(OpdError, match=r"tokenizers differ at id \d+: '.*' vs '.*' \(distill between models"):
        check_same_tokenizer(s, tok, other, other_tok)


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_stops_at_each_stop_id_as_transformers_does(built, family):
    """The built-in engine's greedy completion of each prepared prompt equals transformers' generate with the
    generation config's eos ids: the same tokens, ending at that prompt's stop id."""
    student = built[0][family][0]
    net, tok = load_checkpoint(student)
    prompts = [tok.encode_prompt([{"role": "user", "content": row["question"]}]) for row in gsm8k_rows()[:3]]
    rollouts = Engine(net, tok.stop_ids, tok.pad_id).generate(prompts, SamplingParams(NEW_TOKENS, temperature=0.0),
                                                              torch.Generator())
    hf = transformers.AutoTokenizer.from_pretrained(str(student))
    for i, name in enumerate(STOPS[family]):
        want = hf_pairs.hf_greedy(student, prompts[i], NEW_TOKENS, tok.stop_ids)
        assert rollouts[i].completion_ids == want
        assert want[-1] == hf.convert_tokens_to_ids(name) and rollouts[i].finish_reason == "stop"


# ---- the README's commands, run as written (paths and sizes substituted) ----

def readme_commands(family: str, paths: dict[str, Path]) -> list[str]:
    """The `opd` lines of the "own-models" block for the family (the README's or docs/own-models.md's), with its shell variables expanded
    (the model and prompt folders S, T, P replaced by paths)."""
    text = README.read_text() + (README.parent / "docs" / "own-models.md").read_text()
    block = re.search(rf"<!-- own-models: {family} -->\s*```bash\n(.*?)```", text, re.S)
    assert block, f"neither README.md nor docs/own-models.md has an own-models block for {family}"
    env, commands = {name: str(path) for name, path in paths.items()}, []
    for line in block.group(1).splitlines():
        line = line.split(" # ")[0].strip()
        if not line or line.startswith("#"):
            continue
        expanded = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], line)
        if line.startswith("opd "):
            commands.append(expanded)
        else:
            env.update(word.split("=", 1) for word in shlex.split(expanded) if word.split("=")[0] not in paths)
    return commands


SIZES = {  # the README's commands at test size: appended flags win (argparse and --set both take the last)
    "generate": "--n 3 --max-new-tokens 12 --temperature 0 --json",
    "eval": "--n 6 --max-new-tokens 12",
    "admit": "--set sampling.max_new_tokens=12 --rollouts 4 --json --no-propose",
    "train": "--set steps=3 --set batch_size=4 --set sampling.max_new_tokens=12 --set eval.examples=6 "
             "--set eval.fraction=0.25 --set optim.lr=1e-4 --quiet",
}


def run_cli(argv: list[str], capsys) -> str:
    capsys.readouterr()
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 0, err
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_readme_own_models_commands_end_to_end(built, family, tmp_path, capsys, monkeypatch):
    (student, teacher), gsm8k, _ = built[0][family], built[1], built[2]
    monkeypatch.chdir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(student))
    stop_ids = hf.convert_tokens_to_ids(STOPS[family])
    done = set()
    for command in readme_commands(family, {"S": student, "T": teacher, "P": gsm8k}):
        argv = shlex.split(command)[1:]
        name = argv[0]
        out = run_cli(argv + shlex.split(SIZES[name]), capsys)
        done.add(name)
        if name == "generate":  # the chat template's tokens in each prompt; each first prompt stops at its stop id
            records = [json.loads(line) for line in out.splitlines()]
            for i, record in enumerate(records):
                messages = [{"role": "user", "content": gsm8k_rows()[i]["question"]}]
                assert record["prompt_ids"] == hf.apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=True)["input_ids"]
                assert record["completion_ids"] == hf_pairs.hf_greedy(student, record["prompt_ids"], NEW_TOKENS,
                                                                      stop_ids)
                if i < len(stop_ids):
                    assert record["finish_reason"] == "stop" and record["completion_ids"][-1] == stop_ids[i]
        elif name == "eval":
            result = json.loads(out)
            assert result["eval/scored"] == 6 and 0.0 <= result["eval/accuracy"] <= 1.0
        elif name == "admit":
            result = json.loads(out)
            assert result["decision"] in ("ADMIT", "REJECT") and result["plan"]
        elif name == "train":
            run_dir = Path(argv[argv.index("--run-dir") + 1])
            summary = json.loads((run_dir / "summary.json").read_text())
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            assert [m["step"] for m in metrics if "train/grad_norm" in m] == [0, 1, 2]
            held = [r for r in gsm8k_rows() if held_out_share(
                [{"role": "user", "content": r["question"]}]) < 0.25][:6]
            after = summary["after"]  # evaluated on the user's held-out prompts, not the built-in task's
            assert after["eval/n"] == after["eval/scored"] == len(held) > 0
            assert "eval/accuracy" in summary["after"] and "eval/rkl" in summary["after"]
    assert done == {"generate", "eval", "admit", "train"}


@pytest.mark.slow
def test_chat_file_with_held_out_file_trains(built, tmp_path, capsys):
    """A chat-messages JSONL (the template applied to whole conversations), evaluated on a separate eval_prompts
    file, scoring none (no accuracy; the held-out reverse KL is reported)."""
    (student, teacher), _, chat = built[0]["qwen3"], built[1], built[2]
    held = write_jsonl(tmp_path / "held.jsonl", [{"messages": CHATS[0]}, {"messages": CHATS[2]}])
    run_cli(["train", "--set", f"student={student}", "--set", f"teacher={teacher}", "--set", f"data.prompts={chat}",
             "--set", f"eval.prompts={held}", "--set", "data.scoring=none", "--set", "steps=2", "--set", "batch_size=2",
             "--set", "sampling.max_new_tokens=8", "--run-dir", str(tmp_path / "run"), "--quiet"], capsys)
    after = json.loads((tmp_path / "run" / "summary.json").read_text())["after"]
    assert after["eval/n"] == 2 and "eval/accuracy" not in after and after["eval/rkl"] >= 0


def test_student_with_another_tokenizer_is_one_line(built, capsys):
    (student, _), (_, other_teacher) = built[0]["qwen3"], built[0]["llama3"]
    status = main(["admit", "--set", f"student={student}", "--set", f"teacher={other_teacher}",
                   "--set", f"data.prompts={built[1]}", "--set", "data.prompt_key=question"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert re.match(r"opd: error: student and teacher tokenizers differ at id \d+: ", err)

