"""Prompt sets: where a run's training prompts and its held-out evaluation examples come from.

- **The built-in task** (no `prompts` file): an endless seeded stream of generated problems for training, the fixed
  held-out split for evaluation (task.py).
- **A JSONL file** (`prompts`), one object a line. The prompt is the field `prompt_key` (default `prompt`): a
  string, or a list of chat messages (`{"role": ..., "content": ...}`); a line without that field but with
  `messages` is a chat too. Chats go through the student's chat template with the generation prompt appended;
  `chat: true` sends text prompts through it as one user message. The reference answer is the field `answer_key`
  (default `answer`; a string or a number). A line without it is trained on but not scored. GSM8K's lines are
  `{"question", "answer"}`: `prompt_key: question` and `scoring: gsm8k` (scoring.py) read them.
- **Held out**: `eval_prompts` (a second file, read the same way), or else the `eval_fraction` of the file whose
  prompts hash below it (SHA-256 of the prompt's text): the same split on every machine, disjoint from the training
  prompts by construction, and stable when lines are added or reordered.
- **Length**: a prompt longer than `max_prompt_tokens` (0, and at most: what the model's context leaves after
  max_new_tokens) is refused with one line naming it (`long_prompts: refuse`), or dropped and counted
  (`long_prompts: drop`: the count goes to stderr and to summary.json).
Training prompts are drawn by step, in epochs of seeded permutations of the training lines: a pure function of
(seed, step), so a resumed run draws what it would have drawn.
"""
import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from opd.errors import OpdError, require
from opd.task import Example, get_task, held_out_examples, train_examples
from opd.tokenizer import TextTokenizer


@dataclass(frozen=True)
class PromptFormat:
    """How a prompt file's lines are read (config keys of the same names)."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    chat: bool = False  # text prompts go through the chat template as one user message


def read_prompts(path, fmt: PromptFormat = PromptFormat()) -> list[Example]:
    """Every line of a JSONL prompt file as an Example (prompt: text or messages; answer or None)."""
    path = Path(path)
    if not path.is_file():
        raise OpdError(f"prompt file not found: {path}", "check the path")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise OpdError(f"{path} is not UTF-8 text (byte {e.start})", "save it as UTF-8") from None
    examples = [_example(line, f"{path}:{n}", fmt) for n, line in enumerate(lines, 1) if line.strip()]
    require(bool(examples), f"prompt file {path} has no prompts", "add one JSON object per line")
    return examples


def _example(line: str, where: str, fmt: PromptFormat) -> Example:
    expected = f'each line must be an object with "{fmt.prompt_key}" (text or chat messages) or "messages"'
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise OpdError(f"{where}: not valid JSON ({e.msg})", expected) from None
    require(isinstance(row, dict), f"{where}: expected a JSON object, got {type(row).__name__}", expected)
    prompt = row.get(fmt.prompt_key, row.get("messages"))
    require(prompt is not None, f"{where}: no field {fmt.prompt_key!r}" + ("" if fmt.prompt_key == "prompt" else
            f" (prompt_key) and no \"messages\"; it has {sorted(row)[:6]}"), expected)
    if isinstance(prompt, list):
        prompt = _messages(prompt, where)
    else:
        require(isinstance(prompt, str) and prompt.strip() != "", f"{where}: {fmt.prompt_key!r} must be a non-empty "
                f"string or a list of messages, got {prompt!r:.60}", expected)
        prompt = [{"role": "user", "content": prompt}] if fmt.chat else prompt
    answer = row.get(fmt.answer_key)
    require(answer is None or (isinstance(answer, (str, int, float)) and not isinstance(answer, bool)),
            f"{where}: {fmt.answer_key!r} must be a string or a number, got {type(answer).__name__}",
            "fix or drop the field")
    return Example(prompt, "", None if answer is None else str(answer))


def _messages(messages: list, where: str) -> list[dict]:
    for m in messages:
        require(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str),
                f"{where}: a chat message must be {{\"role\": str, \"content\": str}}, got {m!r:.60}",
                "fix the messages")
    require(bool(messages), f"{where}: an empty list of messages", "give at least one message")
    return messages


def prompt_text(prompt: str | list[dict]) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def held_out_share(prompt: str | list[dict]) -> float:
    """A number in [0, 1) fixed by the prompt's text: below eval_fraction means held out."""
    return int.from_bytes(hashlib.sha256(prompt_text(prompt).encode()).digest()[:8], "big") / 2 ** 64


class PromptSet:
    """A run's prompts: `batch(step)` (token ids of the training prompts of a step) and `held_out` (the evaluation
    examples). cfg: the run's TrainConfig (prompts, prompt keys, eval split, length policy, task, seed)."""

    def __init__(self, cfg, tok: TextTokenizer, context: int, new_tokens: int):
        self.cfg, self.tok, self.dropped = cfg, tok, 0
        fmt = PromptFormat(cfg.prompt_key, cfg.answer_key, cfg.chat)
        lines = read_prompts(cfg.prompts, fmt) if cfg.prompts else None
        held = read_prompts(cfg.eval_prompts, fmt) if cfg.prompts and cfg.eval_prompts else None
        self.limit = min(cfg.max_prompt_tokens or context, context - new_tokens)
        require(self.limit > 0, f"max_new_tokens ({new_tokens}) leaves no room for a prompt in the model's context "
                f"({context})", "lower max_new_tokens")
        if not cfg.prompts:
            self.train, self.held_out = None, held_out_examples(get_task(cfg.task), cfg.eval_examples)
            return
        if held is not None:
            train = lines
        else:
            train = [ex for ex in lines if held_out_share(ex.prompt) >= cfg.eval_fraction]
            held = [ex for ex in lines if held_out_share(ex.prompt) < cfg.eval_fraction]
        require(bool(train), f"no training prompts left in {cfg.prompts} after the held-out split",
                "lower eval_fraction or give eval_prompts")
        self.train = self._fitting(train, cfg.prompts)
        self.held_out = [ex for ex in held if len(tok.encode_prompt(ex.prompt)) <= self.limit][:cfg.eval_examples]
        if self.dropped:
            print(f"opd: dropped {self.dropped} training prompts longer than {self.limit} tokens (long_prompts=drop)",
                  file=sys.stderr)

    def _fitting(self, examples: list[Example], path) -> list[list[int]]:
        out = []
        for i, ex in enumerate(examples):
            ids = self.tok.encode_prompt(ex.prompt)
            if len(ids) > self.limit:
                require(self.cfg.long_prompts == "drop", f"a prompt of {path} ({prompt_text(ex.prompt)[:40]!r}...) has "
                        f"{len(ids)} tokens, over the limit of {self.limit}", "raise max_prompt_tokens (up to the "
                        "context minus max_new_tokens), lower max_new_tokens, shorten it, or set long_prompts=drop")
                self.dropped += 1
                continue
            out.append(ids)
        require(bool(out), f"every prompt of {path} is longer than {self.limit} tokens", "raise max_prompt_tokens")
        return out

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
