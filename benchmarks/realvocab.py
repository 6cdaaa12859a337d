"""A real-vocabulary pair built on this machine (no downloads): what a user's Qwen3 pair looks like to opd's memory.

- A byte-level BPE `tokenizer.json` with Qwen's layout: 151,643 regular tokens (BPE merges trained by `tokenizers` on
  a synthetic corpus of syllable words and GSM8K-style sentences, ~15 s) and 22 special tokens after them
  (`<|endoftext|>` = 151643, `<|im_start|>`, `<|im_end|>` = 151645, reserved ones): 151,665 tokens in an embedding
  of 151,936 rows, as Qwen3's.
- A Qwen3-shaped student (~40M parameters: hidden 256, 2 layers) and teacher (~90M: hidden 512, 4 layers), both
  with tied embeddings of 151,936 x hidden (which is most of their parameters), random weights, saved by
  transformers' Qwen3ForCausalLM in bf16 safetensors.
Random weights give near-uniform distributions, so sampled completions never stop early: every rollout has exactly
max_new_tokens tokens, and memory depends on the sizes alone.

    python benchmarks/realvocab.py [DIR]     # build (or reuse) the pair; default $OPD_CACHE/bench-realvocab
"""
import json
import os
import random
import sys
from pathlib import Path

VOCAB, TOKENIZER_SIZE, REGULAR = 151_936, 151_665, 151_643
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|reserved_{i}|>" for i in range(19)]
SHAPES = {"student": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64),
          "teacher": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=64)}
VERSION = 1  # part of the folder name: a changed recipe builds a new pair


def default_dir() -> Path:
    from opd.io.registry import default_cache_dir
    return default_cache_dir() / f"bench-realvocab-v{VERSION}"


def build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "st", "ng", "er", "an", "in", "on"]
    words = set()
    while len(words) < 160_000:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(2, 5))))
    words = sorted(words)

    def corpus():
        for i in range(0, len(words), 1000):
            yield " ".join(words[i:i + 1000])
        for i in range(2000):
            yield (f"Natalia sold clips to {i} of her friends in April, and then she sold half as many clips in May. "
                   f"How many clips did Natalia sell altogether in April and May? {3 * i} + {2 * i} = {5 * i}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=REGULAR, show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size() == TOKENIZER_SIZE, tok.get_vocab_size()
    tok.save(str(path))


def build_model(folder: Path, role: str, seed: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, max_position_embeddings=2048, rope_theta=1_000_000.0, tie_word_embeddings=True,
                      bos_token_id=REGULAR, eos_token_id=REGULAR + 2, **SHAPES[role])
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)


def build(root: Path | None = None) -> tuple[Path, Path]:
    """(student, teacher) checkpoint folders, built on first use."""
    root = Path(root or default_dir())
    folders = root / "student", root / "teacher"
    if all((f / "done").is_file() for f in folders):
        return folders
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = root / "tokenizer.json"
    if not tokenizer.is_file():
        print(f"realvocab: training a {TOKENIZER_SIZE}-token BPE tokenizer (~15 s)", file=sys.stderr)
        build_tokenizer(root / "tokenizer.tmp.json")
        os.replace(root / "tokenizer.tmp.json", tokenizer)
    for seed, (folder, role) in enumerate(zip(folders, ("student", "teacher"))):
        print(f"realvocab: building the {role} in {folder}", file=sys.stderr)
        build_model(folder, role, seed)
        (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "bos_token": None, "add_bos_token": False, "model_max_length": 2048}, indent=2))
        (folder / "done").write_text("")
    return folders


if __name__ == "__main__":
    for folder in build(Path(sys.argv[1]) if len(sys.argv) > 1 else None):
        print(folder)
