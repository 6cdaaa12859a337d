"""Fuzzing the files of a checkpoint folder and of a prompt file: each mutation is loaded through the CLI, as a user
would, and must end in success or in one line `opd: error: ...` (tests/fuzzlib.py's `outcome`), never a traceback.

File kinds: config.json, generation_config.json, opd_manifest.json, model.safetensors.index.json (a sharded copy),
tokenizer_config.json and tokenizer.json (the built-in tokenizer and a Llama-3-style BPE one from hf_pairs), a JSONL
prompt file. Folders other than the manifest's are mutated without their manifest, as transformers saves them (with
it, every change is refused as damage before the file is read). Then the rules the fuzzing does not reach by chance,
one case each: relations between config keys, unknown characters, integer answers, the pretrain cache folder.
"""
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from opd import cli
from opd.models.checkpoint import MANIFEST, load_checkpoint, save_checkpoint
from opd.config.files import build_config
from opd.io.errors import OpdError
from opd.models.model import ModelConfig, Transformer
from opd.training.pretrain import PretrainConfig, pretrain
from opd.io.registry import check_cache_dir, default_cache_dir
from opd.data.prompts import PromptSet, read_prompts
from opd.models.tokenizer import TextTokenizer

from fuzzlib import FUZZ, mutated_file, outcome

pytestmark = [pytest.mark.fuzz, pytest.mark.reliability]

TINY = dict(arch="llama", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
            head_dim=16, tie_word_embeddings=False, max_position_embeddings=128)
GENERATION = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 8, "do_sample": True,
              "eos_token_id": [2], "pad_token_id": 0, "bos_token_id": 1}
PROMPTS = [{"prompt": "12+34=", "answer": "46"}, {"prompt": "1+2=", "answer": 3}, {"prompt": "5+5="}]


def tiny_checkpoint(folder: Path, vocab_size: int = 100) -> Path:
    model = Transformer(ModelConfig(vocab_size=vocab_size, **TINY)).init_weights(torch.Generator().manual_seed(0))
    return save_checkpoint(folder, model, TextTokenizer.builtin())


def without_manifest(folder: Path) -> Path:
    (folder / MANIFEST).unlink()
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    """The module's valid folders, built once: each example copies one."""
    import hf_pairs
    root = tmp_path_factory.mktemp("base")
    out = {"builtin": tiny_checkpoint(root / "builtin")}
    out["plain"] = without_manifest(Path(shutil.copytree(out["builtin"], root / "plain")))
    (out["plain"] / "generation_config.json").write_text(json.dumps(GENERATION, indent=2))
    sharded = Path(shutil.copytree(out["plain"], root / "sharded"))
    weights = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(sharded / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    out["sharded"] = sharded
    bpe = without_manifest(tiny_checkpoint(root / "bpe", vocab_size=hf_pairs.ROWS))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bpe / name).unlink()
    tok = hf_pairs.save_tokenizer("llama3", bpe)
    config = json.loads((bpe / "config.json").read_text())
    config |= {"bos_token_id": tok.convert_tokens_to_ids("<|begin_of_text|>"),
               "eos_token_id": tok.convert_tokens_to_ids("<|eot_id|>"), "pad_token_id": None}
    (bpe / "config.json").write_text(json.dumps(config, indent=2))
    out["bpe"] = bpe
    prompts = root / "prompts"
    prompts.mkdir()
    (prompts / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    out["prompts"] = prompts
    return out


def generate(folder: Path) -> int:
    return cli.main(["generate", "--model", str(folder), "--n", "1", "--max-new-tokens", "2", "--device", "cpu"])


def mutate(src: Path, name: str, data: bytes, run) -> str:
    """A copy of src with `name` replaced by data, run through `run(copy)`: the outcome line."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(shutil.copytree(src, Path(tmp) / "ckpt"))
        (folder / name).write_bytes(data)
        return outcome(lambda: run(folder), folder)


def fuzz_file(kind: str, name: str, mode: str):
    """One property test: mutations of base[kind]/name, loaded with `opd generate`."""
    @FUZZ
    @given(data=st.data())
    def test(base, data):
        original = (base[kind] / name).read_bytes()
        mutate(base[kind], name, data.draw(mutated_file(original, mode)), generate)
    return test


test_config_json = fuzz_file("plain", "config.json", "json")
test_generation_config_json = fuzz_file("plain", "generation_config.json", "json")
test_manifest = fuzz_file("builtin", MANIFEST, "json")
test_index_json = fuzz_file("sharded", "model.safetensors.index.json", "json")
test_tokenizer_config_json = fuzz_file("bpe", "tokenizer_config.json", "json")
test_builtin_tokenizer_config_json = fuzz_file("plain", "tokenizer_config.json", "json")
test_tokenizer_json = fuzz_file("bpe", "tokenizer.json", "bytes")
test_builtin_tokenizer_json = fuzz_file("plain", "tokenizer.json", "bytes")


@FUZZ
@given(data=st.data())
def test_prompt_file(base, data):
    original = (base["prompts"] / "p.jsonl").read_bytes()
    model = base["builtin"]
    mutate(base["prompts"], "p.jsonl", data.draw(mutated_file(original, "jsonl")), lambda folder: cli.main(
        ["eval", "--model", str(model), "--prompts", str(folder / "p.jsonl"), "--n", "3", "--max-new-tokens", "2",
         "--device", "cpu"]))


# --- the rules, one case each ---------------------------------------------------------------------------------------

def edited(base, kind: str, name: str, change, tmp_path) -> Path:
    folder = Path(shutil.copytree(base[kind], tmp_path / "ckpt"))
    data = json.loads((folder / name).read_text())
    change(data)
    (folder / name).write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("key, value, message", [
    ("vocab_size", 120, "config.json implies vocab_size 120, the weights have 100"),
    ("vocab_size", -3, "vocab_size: expected greater than 0, got -3"),
    ("vocab_size", 2 ** 70, "vocab_size: expected less than or equal to 2147483647"),
    ("hidden_size", "32", "hidden_size: expected a valid integer, got '32'"),
    ("num_key_value_heads", 3, "num_key_value_heads 3 does not divide num_attention_heads 2"),
    ("num_hidden_layers", 3, "config.json implies num_hidden_layers 3, the weights have 2 layers"),
    ("rms_norm_eps", None, "rms_norm_eps: expected a valid number, got None"),
    ("rope_theta", 1, "rope_theta: expected greater than 1"),
    ("eos_token_id", 100, "eos_token_id 100 is outside the vocabulary (vocab_size 100)"),
    ("tie_word_embeddings", True, "tie_word_embeddings is true but the weights' lm_head.weight differs"),
    ("tie_word_embeddings", "false", "tie_word_embeddings: expected a valid boolean"),
])
def test_config_values_are_named_by_key(base, tmp_path, key, value, message):
    folder = edited(base, "plain", "config.json", lambda c: c.update({key: value}), tmp_path)
    with pytest.raises(OpdError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_checkpoint(folder)


def test_heads_that_do_not_divide_hidden_size_without_head_dim(base, tmp_path):
    folder = edited(base, "plain", "config.json", lambda c: c.update(num_attention_heads=3, head_dim=None), tmp_path)
    with pytest.raises(OpdError, match="hidden_size 32 is not a multiple of num_attention_heads 3"):
        load_checkpoint(folder)


@pytest.mark.parametrize("key, value, message", [
    ("temperature", -1, "temperature: expected greater than or equal to 0"),
    ("top_p", 1.5, "top_p: expected less than or equal to 1"),
    ("top_k", 2.5, "top_k: expected a valid integer"),
    ("max_new_tokens", 0, "max_new_tokens: expected greater than 0"),
    ("pad_token_id", 500, "pad_token_id 500 is outside the vocabulary"),
])
def test_generation_values_are_named_by_key(base, tmp_path, key, value, message):
    folder = edited(base, "plain", "generation_config.json", lambda c: c.update({key: value}), tmp_path)
    with pytest.raises(OpdError, match=message):
        load_checkpoint(folder)


@pytest.mark.parametrize("change, message", [
    (lambda m: m["files"]["config.json"].update(sha256="XYZ"), "its opd_manifest.json is unreadable .*sha256"),
    (lambda m: m["files"].update({"../x": m["files"]["config.json"]}), "must name a file inside the checkpoint"),
    (lambda m: m.pop("files"), "missing key 'files'"),
])
def test_a_malformed_manifest_is_damage(base, tmp_path, change, message):
    folder = edited(base, "builtin", MANIFEST, change, tmp_path)
    with pytest.raises(OpdError, match=f"is damaged or incomplete: .*{message}"):
        load_checkpoint(folder)


def test_an_index_cannot_point_outside_its_folder(base, tmp_path):
    folder = edited(base, "sharded", "model.safetensors.index.json",
                    lambda i: i["weight_map"].update({"lm_head.weight": "../model.safetensors"}), tmp_path)
    with pytest.raises(OpdError, match="'../model.safetensors' must name a file inside the checkpoint folder"):
        load_checkpoint(folder)


def test_a_tokenizer_config_of_the_wrong_type_is_named(base, tmp_path):
    folder = edited(base, "bpe", "tokenizer_config.json", lambda c: c.update(add_bos_token="false"), tmp_path)
    with pytest.raises(OpdError, match="tokenizer_config.json: add_bos_token: expected a valid boolean"):
        load_checkpoint(folder)


def test_a_builtin_vocabulary_with_a_chat_template_goes_through_transformers(base, tmp_path):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    folder = edited(base, "plain", "tokenizer_config.json", lambda c: c.update(chat_template=template), tmp_path)
    _, tok = load_checkpoint(folder)
    assert tok.has_chat_template and tok.encode_prompt([{"role": "user", "content": "1+2="}])[-4:] == \
        TextTokenizer.builtin().encode("1+2=")


def test_characters_the_tokenizer_cannot_encode_are_refused_with_file_and_line(base, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+2="}\n\n{"prompt": "caf\\u00e9 1+2="}\n')
    _, tok = load_checkpoint(base["builtin"])
    with pytest.raises(OpdError, match=r"p.jsonl:3: the tokenizer cannot encode the character 'é' \(U\+00E9\)"):
        read_prompts(path, tok=tok)
    with pytest.raises(OpdError, match=r"the prompt 'tab\\there': the tokenizer cannot encode the character '\\t'"):
        tok.encode_prompt("tab\there")
    assert tok.encode_prompt("a<unk>b") == [1, 70, 3, 71]  # the unknown token written literally is not refused
    cfg = build_config({"data": {"prompts": str(path)}, "eval": {"fraction": 0.5}})
    with pytest.raises(OpdError, match="p.jsonl:3: the tokenizer cannot encode"):
        PromptSet(cfg, tok, 128, 8)


def test_an_unknown_character_through_the_cli_is_one_line(base, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+2=\\u00e9", "answer": "3"}\n')
    line = outcome(lambda: cli.main(["eval", "--model", str(base["builtin"]), "--prompts", str(path),
                                      "--max-new-tokens", "2", "--device", "cpu"]), tmp_path)
    assert "cannot encode the character 'é'" in line


@pytest.mark.parametrize("answer, result", [('"3"', "3"), ("3", "3"), ("-12", "-12"), ("3.0", "float"),
                                            ("true", "bool"), ("null", "null"), ("[3]", "list"), ('{"a": 3}', "dict")])
def test_answers_are_strings_or_integers(tmp_path, answer, result):
    path = tmp_path / "p.jsonl"
    path.write_text(f'{{"prompt": "1+2=", "answer": {answer}}}\n')
    if result.lstrip("-").isdigit():
        assert read_prompts(path)[0].answer == result
        return
    with pytest.raises(OpdError, match=f"p.jsonl:1: 'answer' must be a string or an integer, got {result}.*"
                                       "write it as a string"):
        read_prompts(path)


def test_a_lone_surrogate_in_a_prompt_is_one_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+2=\\ud800"}\n')
    with pytest.raises(OpdError, match="p.jsonl:1: 'prompt' holds .* not a character"):
        read_prompts(path)


def test_an_unusable_cache_is_found_before_training(tmp_path, monkeypatch):
    import opd.training.pretrain as pretrain_mod
    monkeypatch.setattr(pretrain_mod, "train", lambda *a, **k: pytest.fail("trained with an unusable cache"))
    cfg = PretrainConfig(family="llama", role="student", task="add", steps=1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OpdError, match="the pretrain cache .*file is not a folder"):
        pretrain(cfg, tmp_path / "file")
    with pytest.raises(OpdError, match="the pretrain cache .*file/sub cannot be created"):
        check_cache_dir(tmp_path / "file" / "sub")
    monkeypatch.setenv("OPD_CACHE", "")
    with pytest.raises(OpdError, match="OPD_CACHE is set but empty"):
        pretrain(cfg)
    monkeypatch.setenv("OPD_CACHE", str(tmp_path / "new"))
    assert check_cache_dir() == default_cache_dir() == tmp_path / "new" and (tmp_path / "new").is_dir()
    if os.geteuid() != 0:  # root writes into read-only folders
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(OpdError, match="cannot be written"):
            pretrain(cfg, tmp_path / "ro")


def test_a_damaged_cached_eval_json_is_trained_again(tmp_path, monkeypatch, capsys):
    import opd.training.pretrain as pretrain_mod
    cfg = PretrainConfig(family="llama", role="student", task="add", steps=1)
    folder = tmp_path / cfg.cache_name()
    model = Transformer(cfg.model_config(TextTokenizer.builtin().vocab_size))
    stats = {"train/seconds": 1.0, "train/final_loss": 1.0, "train/params": model.num_params()}
    save_checkpoint(folder, model, TextTokenizer.builtin(),
                    {"pretrain.json": cfg.resolved(), "eval.json": {"eval/accuracy": "high", **stats}})
    monkeypatch.setattr(pretrain_mod, "train", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("retrained")))
    with pytest.raises(RuntimeError, match="retrained"):
        pretrain(cfg, tmp_path)
    assert "is damaged (eval.json: eval/accuracy: expected a valid number" in capsys.readouterr().err
