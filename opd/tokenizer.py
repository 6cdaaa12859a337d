"""Tokenizers: the built-in character-level one, and any Hugging Face `tokenizer.json`.

The built-in vocabulary is 4 special tokens (<pad>=0, <bos>=1, <eos>=2, <unk>=3), newline and the 95 printable
ASCII characters: one token per character, so the arithmetic task's digits are never merged and every prompt of
plain ASCII text can be encoded. It is saved as a real `tokenizer.json` (a `tokenizers` WordLevel model with a
split-every-character pre-tokenizer) plus `tokenizer_config.json`, so `transformers.AutoTokenizer` and vLLM load it.
"""
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from opd.errors import OpdError

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


def char_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    return tok


class TextTokenizer:
    """Text <-> token ids, with the special ids the model config names."""

    def __init__(self, tok: Tokenizer, bos_id: int | None, eos_id: int, pad_id: int):
        self.tok, self.bos_id, self.eos_id, self.pad_id = tok, bos_id, eos_id, pad_id

    @classmethod
    def builtin(cls) -> "TextTokenizer":
        return cls(char_tokenizer(), bos_id=1, eos_id=2, pad_id=0)

    @classmethod
    def load(cls, folder: Path, bos_id: int | None, eos_id: int, pad_id: int) -> "TextTokenizer":
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise OpdError(f"checkpoint {folder} has no tokenizer.json", "save the tokenizer next to the weights")
        try:
            return cls(Tokenizer.from_file(str(path)), bos_id, eos_id, pad_id)
        except Exception as e:
            raise OpdError(f"cannot read {path}: {str(e).splitlines()[0]}", "re-save the tokenizer") from None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        self.tok.save(str(folder / "tokenizer.json"))
        name = lambda i: None if i is None else self.tok.id_to_token(i)  # noqa: E731
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(self.bos_id),
                  "eos_token": name(self.eos_id), "pad_token": name(self.pad_id), "unk_token": "<unk>",
                  "model_max_length": 1 << 20, "add_bos_token": False, "clean_up_tokenization_spaces": False}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
