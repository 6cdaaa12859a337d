"""Tokenizers: a checkpoint's own, as transformers defines it, and the built-in character-level one.

**A checkpoint's tokenizer** is loaded with `transformers.AutoTokenizer` from the folder (`tokenizer.json`,
`tokenizer_config.json`, a chat template in either file or in `chat_template.jinja`), so that special tokens,
`add_bos_token`/`add_eos_token`, the post-processor and the chat template behave exactly as they do for a user of
transformers: a text prompt is encoded as `tokenizer(text)` does (with the special tokens it adds), a chat prompt
(a list of `{"role", "content"}` messages) as `apply_chat_template(messages, add_generation_prompt=True)` does.
We use transformers rather than render Jinja ourselves: its templates rely on transformers' own environment
(`raise_exception`, `strftime_now`, its `tojson`, trimming rules) and the tokenizer classes' special-token rules;
a re-implementation would drift from what the model was trained with.

**Stop ids** are every `eos_token_id` of `config.json` and of `generation_config.json` (an id or a list: Llama 3
stops at `<|eot_id|>` and `<|end_of_text|>`); the first is the pad fallback. **Generation defaults**
(`generation_config.json`'s temperature, top_k, top_p, max_new_tokens) are kept with the tokenizer and saved with it,
and apply where the user sets none (config.py).

**The built-in tokenizer**: 4 special tokens (<pad>=0, <bos>=1, <eos>=2, <unk>=3), newline and the 95 printable ASCII
characters, one token per character, so the arithmetic task's digits are never merged. It is saved as a real
`tokenizer.json` (a `tokenizers` WordLevel model, split every character) with a post-processor that adds <bos>, so
transformers' tokenizer encodes a prompt as the built-in models were trained: `<bos>` + characters. A folder whose
vocabulary is the built-in one is read with the same rule without transformers (it loads in milliseconds; folders
saved before the post-processor existed keep working).
"""
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from opd.errors import OpdError, require

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
GENERATION_KEYS = ("temperature", "top_k", "top_p", "max_new_tokens")  # the defaults opd takes from a checkpoint


def char_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", 1)])
    return tok


class TextTokenizer:
    """Text <-> token ids for one model: encode (no special tokens), encode_prompt (what the model is prompted with),
    decode; with its stop ids, pad id and generation defaults."""

    def __init__(self, tok: Tokenizer, bos_id: int | None, stop_ids: list[int], pad_id: int, hf=None,
                 generation: dict | None = None):
        require(bool(stop_ids), "a tokenizer needs at least one stop (eos) id")
        self.tok, self.bos_id, self.stop_ids, self.pad_id = tok, bos_id, list(stop_ids), pad_id
        self.hf, self.generation = hf, dict(generation or {})

    @classmethod
    def builtin(cls) -> "TextTokenizer":
        return cls(char_tokenizer(), bos_id=1, stop_ids=[2], pad_id=0)

    @classmethod
    def load(cls, folder: Path, bos_id: int | None, stop_ids: list[int], pad_id: int | None,
             generation: dict | None = None) -> "TextTokenizer":
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise OpdError(f"checkpoint {folder} has no tokenizer.json", "save the tokenizer next to the weights")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise OpdError(f"cannot read {path}: {str(e).splitlines()[0]}", "re-save the tokenizer") from None
        if tok.get_vocab(with_added_tokens=True) == char_tokenizer().get_vocab(with_added_tokens=True):
            return cls(char_tokenizer(), bos_id, stop_ids, 0 if pad_id is None else pad_id, None, generation)
        hf = _hf_tokenizer(Path(folder))
        if pad_id is None:
            pad_id = hf.pad_token_id if hf.pad_token_id is not None else stop_ids[0]
        return cls(tok, bos_id, stop_ids, pad_id, hf, generation)

    @property
    def eos_id(self) -> int:
        return self.stop_ids[0]

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.hf is not None and bool(getattr(self.hf, "chat_template", None))

    def vocab(self) -> dict[str, int]:
        return self.tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """The text's tokens alone, no special tokens added."""
        if self.hf is not None:  # its class may normalise or split otherwise than tokenizer.json alone
            return list(self.hf(text, add_special_tokens=False)["input_ids"])
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, prompt: str | list[dict]) -> list[int]:
        """What the model is prompted with: a text as the tokenizer encodes it (special tokens included), messages
        through the chat template with the generation prompt appended."""
        if self.hf is None:
            require(isinstance(prompt, str), "the built-in tokenizer has no chat template",
                    "give text prompts, or a checkpoint whose tokenizer has a chat template")
            return ([self.bos_id] if self.bos_id is not None else []) + self.encode(prompt)
        if isinstance(prompt, str):
            return list(self.hf(prompt, add_special_tokens=True)["input_ids"])
        require(self.has_chat_template, "chat messages were given but the tokenizer has no chat template",
                "give text prompts, or add a chat_template to tokenizer_config.json")
        try:
            out = self.hf.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # a template that fails to render (TemplateError, a raise_exception in it, ...)
            raise OpdError(f"the chat template failed to render: {type(e).__name__}: {str(e).splitlines()[0]}",
                           "check the messages' roles and fields against the template") from None
        return list(out["input_ids"] if not isinstance(out, list) else out)

    def decode(self, ids: list[int]) -> str:
        if self.hf is not None:
            return self.hf.decode(list(ids), skip_special_tokens=True)
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        if self.hf is not None:
            self.hf.save_pretrained(str(folder))
        else:
            self.tok.save(str(folder / "tokenizer.json"))
            name = lambda i: None if i is None else self.tok.id_to_token(i)  # noqa: E731
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(self.bos_id),
                      "eos_token": name(self.eos_id), "pad_token": name(self.pad_id), "unk_token": "<unk>",
                      "model_max_length": 1 << 20, "add_bos_token": True, "clean_up_tokenization_spaces": False}
            (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        if self.generation or len(self.stop_ids) > 1:
            (folder / "generation_config.json").write_text(json.dumps(
                {**self.generation, "eos_token_id": self.stop_ids}, indent=2))


def _hf_tokenizer(folder: Path):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise OpdError(f"the tokenizer of {folder} needs transformers", "pip install transformers") from None
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise OpdError(f"transformers cannot load the tokenizer of {folder}: {type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}", "check tokenizer.json and tokenizer_config.json") \
            from None


def first_difference(a: dict[str, int], b: dict[str, int]) -> str | None:
    """Where two vocabularies (token -> id) first differ, in id order: "id 5: 'x' vs 'y'", or None if they are equal."""
    if a == b:
        return None
    by_id_a, by_id_b = {i: t for t, i in a.items()}, {i: t for t, i in b.items()}
    for i in sorted(set(by_id_a) | set(by_id_b)):
        if by_id_a.get(i) != by_id_b.get(i):
            return f"id {i}: {by_id_a.get(i, '(none)')!r} vs {by_id_b.get(i, '(none)')!r}"
    return "the same ids, other tokens"
