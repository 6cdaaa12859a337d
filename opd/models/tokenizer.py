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
saved before the post-processor existed keep working) when nothing else in its files differs: any other
`tokenizer.json`, a chat template, or `add_bos_token: false` goes through transformers, which reads them as written.

**Files are checked as data**: `tokenizer.json` is UTF-8 JSON without duplicate keys before `tokenizers` reads it,
`tokenizer_config.json` has the types transformers expects for the keys that change encoding (`TokenizerConfigSchema`).
**No silent unknown tokens**: a prompt with a character the tokenizer cannot encode (it would become the unknown
token: the built-in tokenizer's `<unk>`, or an HF tokenizer's unk token when it has no byte fallback) is refused with
one line naming the prompt and the character, unless the text holds the unknown token literally.
"""
import json
from pathlib import Path

from pydantic import Field
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from opd.io.errors import OpdError, require
from opd.io.schema import Schema, parse_json, read_object, read_text

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
GENERATION_KEYS = ("temperature", "top_k", "top_p", "max_new_tokens")  # the defaults opd takes from a checkpoint


class AddedTokenSchema(Schema):
    content: str


Special = str | AddedTokenSchema | None


class TokenizerConfigSchema(Schema):
    """tokenizer_config.json: the keys that change how text is encoded, with the types transformers writes."""
    tokenizer_class: str | None = None
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    bos_token: Special = None
    eos_token: Special = None
    pad_token: Special = None
    unk_token: Special = None
    chat_template: str | list[dict] | None = None
    model_max_length: int | float | None = Field(default=None, ge=0)
    clean_up_tokenization_spaces: bool | None = None


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
        text = read_text(path, "tokenizer.json")
        data = parse_json(text, str(path), "re-save the tokenizer")  # UTF-8, valid JSON, no key given twice
        _check_templates(data.get("post_processor") if isinstance(data, dict) else None, path)
        try:
            tok = Tokenizer.from_str(text)
        except Exception as e:
            raise OpdError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                           "re-save the tokenizer") from None
        _probe(lambda: tok.encode("a", add_special_tokens=True), path)
        if _is_builtin(tok, tokenizer_config(folder), Path(folder)):
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
    def unk(self) -> tuple[int | None, str | None]:
        """(id, text) of the unknown token; (None, None) when the tokenizer has none (byte-level BPE)."""
        if self.hf is None:
            return self.tok.token_to_id("<unk>"), "<unk>"
        return self.hf.unk_token_id, self.hf.unk_token

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

    def encode_prompt(self, prompt: str | list[dict], where: str | None = None) -> list[int]:
        """What the model is prompted with: a text as the tokenizer encodes it (special tokens included), messages
        through the chat template with the generation prompt appended. A prompt with a character the tokenizer
        cannot encode is refused (check_encodable; where: its file:line, when known)."""
        ids = self._encode_prompt(prompt)
        if self.unk[0] is not None and self.unk[0] in ids:  # the common case costs one membership test
            self.check_encodable(prompt, where)
        return ids

    def check_encodable(self, prompt: str | list[dict], where: str | None = None) -> None:
        """One line naming the prompt (where, else its first characters) and its first character that would become
        the unknown token; nothing when there is none."""
        for text in [prompt] if isinstance(prompt, str) else [m.get("content", "") for m in prompt]:
            char = self.unknown_char(text) if isinstance(text, str) else None
            if char is not None:
                name = where or f"the prompt {text[:30]!r}" + ("..." if len(text) > 30 else "")
                raise OpdError(f"{name}: the tokenizer cannot encode the character {char!r} (U+{ord(char[0]):04X}); it "
                               f"would silently become the unknown token {self.unk[1]!r}",
                               "remove or replace the character, or use a model whose tokenizer covers it")

    def unknown_char(self, text: str) -> str | None:
        """The first character of text that encodes to the unknown token (a literal unknown token in the text does
        not count), or None."""
        unk_id, unk_text = self.unk
        if unk_id is None:
            return None
        if self.hf is None:
            enc = self.tok.encode(text, add_special_tokens=False)
            ids, offsets = enc.ids, enc.offsets
        else:
            enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = enc["input_ids"], enc["offset_mapping"]
        for i, (start, end) in zip(ids, offsets):
            if i == unk_id and text[start:end] != unk_text:
                span = text[start:end] or "?"
                return next((c for c in span if unk_id in self.encode(c)), span)
        return None

    def _encode_prompt(self, prompt: str | list[dict]) -> list[int]:
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


def tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json checked against TokenizerConfigSchema ({} when the folder has none)."""
    return read_object(Path(folder) / "tokenizer_config.json", TokenizerConfigSchema,
                       "fix tokenizer_config.json, or re-save the tokenizer", optional=True)


def _is_builtin(tok: Tokenizer, config: dict, folder: Path) -> bool:
    """Whether the folder's tokenizer is the built-in one in every respect that changes encoding: tokenizer.json as
    char_tokenizer() serialises (a folder saved before the post-processor existed may lack it), no chat template,
    BOS added, no EOS added. Anything else is read by transformers, exactly as written."""
    mine, ref = json.loads(tok.to_str()), json.loads(char_tokenizer().to_str())
    if mine.get("post_processor") is None:
        mine["post_processor"] = ref["post_processor"]
    return mine == ref and not config.get("chat_template") and config.get("add_bos_token") is not False \
        and not config.get("add_eos_token") and not (folder / "chat_template.jinja").exists()


def _check_templates(processor, path: Path) -> None:
    """Every special token a TemplateProcessing post-processor places must be one it defines: `tokenizers` would
    otherwise panic at the first encode, printing a Rust backtrace (_probe catches what this does not foresee)."""
    if isinstance(processor, dict) and processor.get("type") == "Sequence":
        for inner in processor.get("processors") or []:
            _check_templates(inner, path)
    if not (isinstance(processor, dict) and processor.get("type") == "TemplateProcessing"):
        return
    defined = processor.get("special_tokens")
    for piece in [*(processor.get("single") or []), *(processor.get("pair") or [])]:
        special = piece.get("SpecialToken") if isinstance(piece, dict) else None
        name = special.get("id") if isinstance(special, dict) else None
        require(name is None or (isinstance(defined, dict) and name in defined), f"{path}: the post-processor's "
                f"template places {name!r:.40}, which its special_tokens do not define", "re-save the tokenizer")


def _probe(encode, path: Path) -> None:
    """Encode once at load. `tokenizers` checks a post-processor only when it runs: a template that names a special
    token it does not define panics then (pyo3's PanicException, a BaseException), in the middle of a run."""
    try:
        encode()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: B036 (the panic is not an Exception)
        detail = str(e).splitlines()[0] if str(e) else ""
        raise OpdError(f"cannot use {path}: encoding fails ({type(e).__name__}: {detail})", "re-save the tokenizer") \
            from None


def _hf_tokenizer(folder: Path):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise OpdError(f"the tokenizer of {folder} needs transformers", "pip install transformers") from None
    try:
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        _probe(lambda: hf("a", add_special_tokens=True), folder / "tokenizer.json")
        return hf
    except OpdError:
        raise
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
