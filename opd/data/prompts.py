"""Prompt sets: where a run's training prompts and its held-out evaluation examples come from.

- **The built-in task** (no `prompts` file): an endless seeded stream of generated problems for training, the fixed
  held-out split for evaluation (task.py).
- **A JSONL file** (`prompts`), one object a line. The prompt is the field `prompt_key` (default `prompt`): a
  string, or a list of chat messages (`{"role": ..., "content": ...}`); a line without that field but with
  `messages` is a chat too. Chats go through the student's chat template with the generation prompt appended;
  `chat: true` sends text prompts through it as one user message. The reference answer is the field `answer_key`
  (default `answer`): a string, or an integer (GSM8K-style files write them so; read as its decimal text). A float
  (0.1 + 0.2 is not 0.3 as text), a boolean, a list, an object or null is refused with one line (file:line and the
  key): no silent conversion. A line without the field is trained on but not scored. GSM8K's lines are
  `{"question", "answer"}`: `prompt_key: question` and `scoring: gsm8k` (scoring.py) read them.
- **Held out**: `eval.prompts` (a second file, read the same way), or else the `eval.fraction` of the file whose
  prompts hash below it (SHA-256 of the prompt's text): the same split on every machine, disjoint from the training
  prompts by construction, and stable when lines are added or reordered.
- **Characters**: a prompt with a character the tokenizer cannot encode (it would become the unknown token) is
  refused with its file:line when read with the tokenizer (`read_prompts(..., tok)`, as PromptSet does), or by
  `TextTokenizer.encode_prompt` itself otherwise; text that is not Unicode (a lone surrogate escaped in JSON) too.
- **Length**: a prompt longer than `data.max_prompt_tokens` (0, and at most: what the model's context leaves after
  max_new_tokens) is refused with one line naming it (`data.long_prompts: refuse`), or dropped and counted
  (`drop`: the count goes to stderr and to summary.json).
Training prompts are drawn by step, in epochs of seeded permutations of the training lines: a pure function of
(seed, step), so a resumed run draws what it would have drawn.
"""
import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from opd.io.errors import OpdError, require
from opd.io.schema import parse_json, read_text
from opd.data.task import Example, get_task, held_out_examples, train_examples
from opd.models.tokenizer import TextTokenizer


@dataclass(frozen=True)
class PromptFormat:
    """How a prompt file's lines are read (config keys of the same names)."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    chat: bool = False  # text prompts go through the chat template as one user message


def read_prompts(path, fmt: PromptFormat = PromptFormat(), tok: TextTokenizer | None = None) -> list[Example]:
    """Every line of a JSONL prompt file as an Example (prompt: text or messages; answer or None). With tok, a prompt
    the tokenizer cannot encode fully is refused here, where its line is known."""
    path = Path(path)
    lines = read_text(path, "prompt file").splitlines()
    examples = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            examples.append(_example(line, f"{path}:{n}", fmt))
            if tok is not None:
                tok.check_encodable(examples[-1].prompt, f"{path}:{n}")
    require(bool(examples), f"prompt file {path} has no prompts", "add one JSON object per line")
    return examples


def _example(line: str, where: str, fmt: PromptFormat) -> Example:
    expected = f'each line must be an object with "{fmt.prompt_key}" (text or chat messages) or "messages"'
    row = parse_json(line, where, expected)
    require(isinstance(row, dict), f"{where}: expected a JSON object, got {type(row).__name__}", expected)
    key = fmt.prompt_key if fmt.prompt_key in row or "messages" not in row else "messages"
    require(key in row, f"{where}: no field {fmt.prompt_key!r}" + ("" if fmt.prompt_key == "prompt" else
            f" (prompt_key) and no \"messages\"; it has {sorted(row)[:6]}"), expected)
    prompt = row[key]
    if isinstance(prompt, list):
        prompt = _messages(prompt, where)
    else:
        require(isinstance(prompt, str) and prompt.strip() != "", f"{where}: {key!r} must be a non-empty "
                f"string or a list of messages, got {prompt!r:.60}", expected)
        _unicode(prompt, where, key)
        prompt = [{"role": "user", "content": prompt}] if fmt.chat else prompt
    return Example(prompt, "", _answer(row, where, fmt.answer_key))


def _answer(row: dict, where: str, key: str) -> str | None:
    """The reference answer as text: a string as it is, an integer as its decimal text; None when the line has none."""
    if key not in row:
        return None
    answer = row[key]
    if isinstance(answer, int) and not isinstance(answer, bool):
        return str(answer)
    require(isinstance(answer, str), f"{where}: {key!r} must be a string or an integer, got "
            f"{'null' if answer is None else type(answer).__name__} {answer!r:.40}",
            f"write it as a string (\"{key}\": \"...\"), or drop the field to train without scoring")
    _unicode(answer, where, key)
    return answer


def _unicode(text: str, where: str, key: str) -> None:
    """JSON can escape a lone surrogate (\\ud800), which is no character: tokenizers and hashing cannot take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OpdError(f"{where}: {key!r} holds {text[e.start]!r}, half of a UTF-16 surrogate pair, not a character",
                       "write the character itself, or its full surrogate pair") from None


def _messages(messages: list, where: str) -> list[dict]:
    for m in messages:
        require(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str),
                f"{where}: a chat message must be {{\"role\": str, \"content\": str}}, got {m!r:.60}",
                "fix the messages")
        _unicode(m["role"], where, "role")
        _unicode(m["content"], where, "content")
    require(bool(messages), f"{where}: an empty list of messages", "give at least one message")
    return messages


def prompt_text(prompt: str | list[dict]) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def held_out_share(prompt: str | list[dict]) -> float:
    """A number in [0, 1) fixed by the prompt's text: below eval.fraction means held out."""
    return int.from_bytes(hashlib.sha256(prompt_text(prompt).encode()).digest()[:8], "big") / 2 ** 64


class PromptSet:
    """A run's prompts: `batch(step)` (token ids of the training prompts of a step) and `held_out` (the evaluation
    examples). cfg: the run's TrainConfig (prompts, prompt keys, eval split, length policy, task, seed)."""

    def __init__(self, cfg, tok: TextTokenizer, context: int, new_tokens: int):
        self.cfg, self.tok, self.dropped = cfg, tok, 0
        fmt = PromptFormat(cfg.data.prompt_key, cfg.data.answer_key, cfg.data.chat)
        lines = read_prompts(cfg.data.prompts, fmt, tok) if cfg.data.prompts else None
        held = read_prompts(cfg.eval.prompts, fmt, tok) if cfg.data.prompts and cfg.eval.prompts else None
        self.limit = min(cfg.data.max_prompt_tokens or context, context - new_tokens)
        require(self.limit > 0, f"max_new_tokens ({new_tokens}) leaves no room for a prompt in the model's context "
                f"({context})", "lower sampling.max_new_tokens")
        if not cfg.data.prompts:
            self.train, self.held_out = None, held_out_examples(get_task(cfg.task), cfg.eval.examples)
            return
        if held is not None:
            train = lines
        else:
            train = [ex for ex in lines if held_out_share(ex.prompt) >= cfg.eval.fraction]
            held = [ex for ex in lines if held_out_share(ex.prompt) < cfg.eval.fraction]
        require(bool(train), f"no training prompts left in {cfg.data.prompts} after the held-out split",
                "lower eval.fraction or give eval.prompts")
        self.train = self._fitting(train, cfg.data.prompts)
        self.held_out = [ex for ex in held if len(tok.encode_prompt(ex.prompt)) <= self.limit][:cfg.eval.examples]
        if self.dropped:
            print(f"opd: dropped {self.dropped} training prompts longer than {self.limit} tokens (data.long_prompts=drop)",
                  file=sys.stderr)

    def _fitting(self, examples: list[Example], path) -> list[list[int]]:
        out = []
        for i, ex in enumerate(examples):
            ids = self.tok.encode_prompt(ex.prompt)
            if len(ids) > self.limit:
                require(self.cfg.data.long_prompts == "drop",
                        f"a prompt of {path} ({prompt_text(ex.prompt)[:40]!r}...) has "
                        f"{len(ids)} tokens, over the limit of {self.limit}", "raise data.max_prompt_tokens (up to "
                        "the context minus sampling.max_new_tokens), lower sampling.max_new_tokens, shorten it, or set "
                        "data.long_prompts=drop")
                self.dropped += 1
                continue
            out.append(ids)
        require(bool(out), f"every prompt of {path} is longer than {self.limit} tokens", "raise data.max_prompt_tokens")
        return out

    @property
    def longest(self) -> int:
        """Tokens of the longest training prompt (the built-in task's: at most `limit`)."""
        return max(map(len, self.train)) if self.train is not None else self.limit

    def batch(self, step: int) -> list[list[int]]:
        B = self.cfg.batch_size
        if self.train is None:
            stream = train_examples(get_task(self.cfg.task), seed=self.cfg.seed * 1_000_003 + step)
            return [self.tok.encode_prompt(next(stream).prompt) for _ in range(B)]
        n = len(self.train)
        out = []
        for i in range(step * B, (step + 1) * B):  # epochs of seeded permutations
            epoch, k = divmod(i, n)
            order = list(range(n))
            random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
            out.append(self.train[order[k]])
        return out
