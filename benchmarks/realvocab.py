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
With `--shape qwen2.5-coder`: the Qwen2.5-Coder pair's own shapes (a 0.5B student: 24 layers of 896; a 1.5B
teacher: 28 layers of 1536; Qwen2 with q/k/v biases, tied embeddings), random weights, for speed at the real pair's
size where its weights cannot be carried (benchmarks/gpu.sh).

    python benchmarks/realvocab.py [DIR]     # build (or reuse) the pair; default $OPD_CACHE/bench-realvocab
    python benchmarks/realvocab.py --shape qwen2.5-coder [DIR]     # the 0.5B / 1.5B shapes (~4 GB of folders)
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
QWEN25_CODER = {"student": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                num_key_value_heads=2),
                "teacher": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                                num_key_value_heads=2)}  # Qwen2.5-Coder-0.5B/1.5B-Instruct's config.json
VERSION = 1  # part of the folder name: a changed recipe builds a new pair


def default_dir(shape: str = "qwen3-small") -> Path:
    from opd.io.registry import default_cache_dir
    return default_cache_dir() / (f"bench-realvocab-v{VERSION}" if shape == "qwen3-small" else
                                  f"bench-realvocab-{shape}-v{VERSION}")


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


def build_model(folder: Path, role: str, seed: int, shape: str = "qwen3-small") -> None:
    import torch
    torch.manual_seed(seed)
    if shape == "qwen2.5-coder":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        cfg = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=32768, rope_theta=1_000_000.0,
                          tie_word_embeddings=True, bos_token_id=REGULAR, eos_token_id=REGULAR + 2, **QWEN25_CODER[role])
        with torch.device("cpu"):
            Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
        return
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=VOCAB, max_position_embeddings=2048, rope_theta=1_000_000.0, tie_word_embeddings=True,
                      bos_token_id=REGULAR, eos_token_id=REGULAR + 2, **SHAPES[role])
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)


def build(root: Path | None = None, shape: str = "qwen3-small") -> tuple[Path, Path]:
    """(student, teacher) checkpoint folders, built on first use."""
    root = Path(root or default_dir(shape))
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
        build_model(folder, role, seed, shape)
        (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "bos_token": None, "add_bos_token": False, "model_max_length": 2048}, indent=2))
        (folder / "done").write_text("")
    return folders


if __name__ == "__main__":
    args = sys.argv[1:]
    shape = "qwen3-small"
    if args[:1] == ["--shape"]:
        shape, args = args[1], args[2:]
        if shape not in ("qwen3-small", "qwen2.5-coder"):
            sys.exit(f"realvocab: unknown shape {shape!r} (qwen3-small or qwen2.5-coder)")
    for folder in build(Path(args[0]) if args else None, shape):
        print(folder)
