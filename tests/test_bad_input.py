"""The bad-input suite: every way a user can hand `opd` something wrong, through the CLI as a user would.

Each case builds its bad input in a fresh folder and runs one `opd` command. Every case must end with exit code 2
and one line `opd: error: <problem> (<fix>)` as the last line on stderr (a run may print its directory and opd's own
one-line notes first), no traceback, the fragments that name the problem in that line, and no corrupt output:
nothing new in the folder except what the case declares (`leaves`, e.g. a run directory that `--resume` continues),
and never a temporary file (`.name.tmp-*`) or a half-written checkpoint. Most cases run in-process (`opd.cli.main`);
the ones that need a process of their own (a file-size limit, a shadowed package) run `python -m opd.cli`.
"""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from opd.models.checkpoint import MANIFEST, load_checkpoint, save_checkpoint
from opd.cli import main
from opd.config.files import build_config, dump_config

from helpers import make_checkpoint

pytestmark = pytest.mark.reliability


@dataclass
class Ctx:
    dir: Path  # the case's own folder: its bad inputs and its outputs
    student: Path
    teacher: Path

    def train(self, *sets: str, run: str = "run") -> list:
        """`opd train` on the tiny pair, a 4-step run, plus the case's --set overrides."""
        base = {"student": self.student, "teacher": self.teacher, "task": "add", "steps": 4, "batch_size": 4,
                "eval.every": 0, "eval.examples": 8, "save_every": 2, "threads": 1}
        args = [a for k, v in base.items() for a in ("--set", f"{k}={v}")]
        return ["train", *args, *[a for s in sets for a in ("--set", s)], "--run-dir", self.dir / run, "--quiet"]

    def copy(self, name: str = "student", src: Path | None = None) -> Path:
        """A copy of a checkpoint to damage (a saved folder keeps its manifest)."""
        return Path(shutil.copytree(src or self.student, self.dir / name))

    def write(self, name: str, text: str) -> Path:
        (path := self.dir / name).write_text(text)
        return path


@dataclass(frozen=True)
class Case:
    build: Callable[[Ctx], list]  # makes the bad input in ctx.dir, returns the `opd` arguments
    fragments: tuple[str, ...]  # what the error line must name
    leaves: tuple[str, ...]  # glob patterns (relative to ctx.dir) of what the failed command may create or change
    env: dict | None  # extra environment: the case runs in a process of its own
    file_limit: int  # if set, the most bytes any file it writes may hold (a full disk); also its own process

    @property
    def own_process(self) -> bool:
        return self.env is not None or self.file_limit > 0


CASES: dict[str, Case] = {}


def case(*fragments: str, leaves: tuple[str, ...] = (), env: dict | None = None, file_limit: int = 0):
    """Register a case. The inputs it builds before the command runs must stay as they were."""
    def register(fn):
        CASES[fn.__name__] = Case(fn, fragments, leaves, env, file_limit)
        return fn
    return register


# --- the command line and the config -------------------------------------------------------------------------------

@case("invalid choice: 'fly'")
def unknown_command(ctx):
    return ["fly"]


@case("unrecognized arguments: --no-such-flag")
def unknown_option(ctx):
    return ["pretrain", "--no-such-flag"]


@case("pretrain: argument --family: invalid choice: 'gpt2'", "see `opd pretrain --help`")
def bad_choice(ctx):
    return ["pretrain", "--family", "gpt2"]


@case("steps must be positive, got -5")
def negative_size(ctx):
    return ["pretrain", "--steps", "-5", "--cache-dir", ctx.dir / "cache"]


@case("batch_size must be positive")
def zero_batch_size(ctx):
    return ctx.train("batch_size=0")


@case("unknown config key 'lrr'", "did you mean optim.lr")
def unknown_config_key(ctx):
    return ctx.train("lrr=0.1")


@case("config key 'max_staleness' is now 'async.max_staleness'", "--set async.max_staleness=2")
def flat_key_from_before_the_sections(ctx):
    return ctx.train("schedule=async", "threads=2", "max_staleness=2")


@case("bad.yaml: config key 'guard_every' is now 'guard.every'", "write guard: {every: 5}")
def flat_key_in_a_config_file(ctx):
    return ["train", "--config", ctx.write("bad.yaml", "steps: 4\nguard_every: 5\n"), "--run-dir", ctx.dir / "run"]


@case("config: eval must be a mapping (a section)", "--set eval.every=...")
def section_given_a_value(ctx):
    return ctx.train("eval=5")


@case("unknown config key 'guard.evry'", "did you mean guard.every")
def unknown_key_in_a_section(ctx):
    return ctx.train("guard.evry=5")


@case("steps must be an integer, got 'ten'", "e.g. --set steps=150")
def wrong_value_type(ctx):
    return ctx.train("steps=ten")


@case("not valid YAML")
def malformed_yaml_config(ctx):
    return ["train", "--config", ctx.write("bad.yaml", "steps: [\n"), "--run-dir", ctx.dir / "run"]


@case("config file not found")
def missing_config_file(ctx):
    return ["train", "--config", ctx.dir / "missing.yaml", "--run-dir", ctx.dir / "run"]


@case("the runtime guard reads the rollouts' numerics mismatch", "set async.recompute_fraction")
def guard_without_numerics(ctx):
    return ctx.train("schedule=async", "threads=2", "async.recompute_fraction=0", "guard.every=5")


@case("unknown loss 'rkl'")
def unknown_loss(ctx):
    return ctx.train("loss.name=rkl")


@case("--resume and --overwrite contradict each other")
def conflicting_options(ctx):
    return ctx.train() + ["--resume", "--overwrite"]


@case("give both student and teacher")
def student_without_teacher(ctx):
    return ["train", "--set", f"student={ctx.student}", "--run-dir", ctx.dir / "run"]


@case("already holds a run", "--resume")
def run_dir_holds_a_run(ctx):
    (ctx.dir / "run").mkdir()
    ctx.write("run/config.yaml", dump_config(build_config({"student": str(ctx.student), "teacher": str(ctx.teacher),
                                                             "task": "add", "optim": {"lr": 0.5}})))
    return ctx.train()


@case("is not empty and holds no opd run", "refusing to delete it")
def overwrite_a_folder_that_is_not_a_run(ctx):
    ctx.write("notes.txt", "mine")
    (ctx.dir / "run").mkdir()
    shutil.move(ctx.dir / "notes.txt", ctx.dir / "run" / "notes.txt")
    return ctx.train() + ["--overwrite"]


@case("nothing to resume")
def resume_nothing(ctx):
    return ctx.train() + ["--resume"]


@case("Not a directory", "check that the path exists and is writable")
def unwritable_run_dir(ctx):
    ctx.write("file", "a file, not a folder")
    return ctx.train(run="file/run")


@case("cannot write", "File too large", "free some disk space", leaves=("run", "run/*", "run/tb/*"), file_limit=2000)
def full_disk(ctx):
    return ctx.train()


@case("cannot write the checkpoint", "File too large", "the previous checkpoint is unchanged",
      leaves=("run", "run/*", "run/tb/*"), file_limit=20_000)
def full_disk_while_saving_a_checkpoint(ctx):
    return ctx.train()


# --- devices, dtypes and batch splitting ----------------------------------------------------------------------------

@case("unknown compute.device 'tpu'", "use auto, cpu, cuda or cuda:N")
def unknown_device(ctx):
    return ctx.train("compute.device=tpu")


@case("device cuda:99")  # no GPU here: PyTorch sees none; with GPUs: there is no 100th
def missing_cuda_device(ctx):
    return ctx.train("compute.device=cuda:99")


@case("teacher_device cuda:99")
def missing_teacher_device(ctx):
    return ctx.train("compute.teacher_device=cuda:99")


if not torch.cuda.is_available():
    @case("device cuda was asked for, but PyTorch sees no CUDA GPU here", "set device to cpu or auto")
    def cuda_without_a_gpu(ctx):
        return ctx.train("compute.device=cuda")

    @case("device cuda was asked for, but PyTorch sees no CUDA GPU here")
    def admit_cuda_without_a_gpu(ctx):
        return ["admit", *ctx.train("compute.device=cuda")[1:-3]]


@case("unknown compute.dtype 'float16'", "use one of float32, bf16")
def unknown_dtype(ctx):
    return ctx.train("compute.dtype=float16")


@case("unknown compute.teacher_dtype 'fp8'")
def unknown_teacher_dtype(ctx):
    return ctx.train("compute.teacher_dtype=fp8")


@case("micro_batch_size 3 does not divide batch_size 4", "use a divisor of batch_size")
def micro_batch_not_a_divisor(ctx):
    return ctx.train("compute.micro_batch_size=3")


@case("chunk_tokens must be >= 0, got -1")
def negative_chunk(ctx):
    return ctx.train("compute.chunk_tokens=-1")


# --- checkpoints ---------------------------------------------------------------------------------------------------

@case("checkpoint folder not found", "nope")
def missing_checkpoint_folder(ctx):
    return ["eval", "--model", ctx.dir / "nope", "--task", "add"]


@case("has no model.safetensors")
def missing_weights_file(ctx):
    folder = ctx.copy()
    (folder / "model.safetensors").unlink()
    (folder / MANIFEST).unlink()  # as a folder from elsewhere would be
    return ["eval", "--model", folder, "--task", "add"]


@case("model.safetensors", "truncated or corrupt")
def truncated_weights_without_manifest(ctx):
    folder = ctx.copy()
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:500])
    (folder / MANIFEST).unlink()
    return ["eval", "--model", folder, "--task", "add"]


@case("model.safetensors: tensor", "is torch.int8, not a floating-point weight")
def weights_that_are_integers(ctx):
    from safetensors.torch import load_file, save_file
    folder = ctx.copy()
    state = load_file(folder / "model.safetensors")
    name = sorted(state)[0]
    save_file(state | {name: state[name].to(torch.int8)}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / MANIFEST).unlink()
    return ["eval", "--model", folder, "--task", "add"]


@case("is damaged or incomplete", "model.safetensors has")
def weights_cut_short_by_a_copy(ctx):
    folder = ctx.copy()
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    return ["generate", "--model", folder, "--prompt", "1+2=", "--max-new-tokens", 4]


@case("model_type 'gpt2' is not supported")
def unsupported_architecture(ctx):
    (ctx.dir / "gpt2").mkdir()
    ctx.write("gpt2/config.json", json.dumps({"model_type": "gpt2", "vocab_size": 100}))
    return ["eval", "--model", ctx.dir / "gpt2", "--task", "add"]


@case("config.json is not valid JSON")
def config_json_not_json(ctx):
    folder = ctx.copy()
    (folder / "config.json").write_text("{not json")
    (folder / MANIFEST).unlink()
    return ["eval", "--model", folder, "--task", "add"]


@case("config.json implies")
def weights_do_not_match_config(ctx):
    folder = ctx.copy()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    (folder / MANIFEST).unlink()
    return ["eval", "--model", folder, "--task", "add"]


@case("output layers differ in size")
def vocabulary_mismatch(ctx):
    return ctx.train(f"teacher={make_checkpoint(ctx.dir / 'big', 2, vocab_size=120)}")


@case("student and teacher tokenizers differ at id ", "'a' vs 'b'")
def tokenizer_mismatch(ctx):
    folder = ctx.copy("teacher", ctx.teacher)
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / MANIFEST).unlink()
    return ctx.train(f"teacher={folder}")


@case("has no tokenizer.json", "save the tokenizer next to the weights")
def folder_without_a_tokenizer(ctx):
    folder = ctx.copy()
    (folder / "tokenizer.json").unlink()
    (folder / MANIFEST).unlink()
    return ["eval", "--model", folder, "--task", "add"]


@case("the chat template failed to render", "Unknown role: tool", "check the messages' roles")
def chat_template_that_fails_to_render(ctx):
    import hf_pairs
    student, _ = hf_pairs.build_pair("qwen3", ctx.dir / "qwen3")
    chat = [{"role": "tool", "content": "42"}, {"role": "user", "content": "and now?"}]
    return ["generate", "--model", student, "--prompts", ctx.write("chat.jsonl", json.dumps({"messages": chat}) + "\n"),
            "--max-new-tokens", 4]


@case("the built-in tokenizer has no chat template", "give text prompts")
def chat_without_a_template(ctx):
    return ["eval", "--model", ctx.student, "--prompts", ctx.write("p.jsonl", '{"prompt": "1+2=", "answer": "3"}\n'),
            "--chat", "--max-new-tokens", 4]


@case("checkpoint", "is damaged or incomplete", "trainer_state.safetensors")
def resume_from_a_damaged_checkpoint(ctx):
    assert main([str(a) for a in ctx.train()]) == 0
    state = ctx.dir / "run" / "checkpoint" / "trainer_state.safetensors"
    state.write_bytes(state.read_bytes()[:100])
    return ctx.train("steps=6") + ["--resume"]


# --- data ----------------------------------------------------------------------------------------------------------

@case("prompts.jsonl:2:")
def malformed_jsonl(ctx):
    prompts = ctx.write("prompts.jsonl", '{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+2=", "answer": \n')
    return ["eval", "--model", ctx.student, "--prompts", prompts, "--max-new-tokens", 4]


@case("prompts.jsonl", "no prompts")
def empty_jsonl(ctx):
    return ctx.train(f"data.prompts={ctx.write('prompts.jsonl', '')}")


@case("prompt file not found")
def missing_prompt_file(ctx):
    return ctx.train(f"data.prompts={ctx.dir / 'missing.jsonl'}")


@case("prompts.jsonl:1:", "prompt")
def jsonl_line_without_a_prompt(ctx):
    return ["eval", "--model", ctx.student, "--prompts", ctx.write("prompts.jsonl", '{"question": "1+2="}\n')]


@case("gsm8k.jsonl:2: no field 'question' (prompt_key)")
def line_without_the_mapped_key(ctx):
    lines = json.dumps({"question": "1+2=", "answer": "#### 3"}) + "\n" + json.dumps({"prompt": "2+2="}) + "\n"
    return ctx.train(f"data.prompts={ctx.write('gsm8k.jsonl', lines)}", "data.prompt_key=question", "data.scoring=gsm8k")


@case("scoring 'no_such_module:score' cannot be imported", "ModuleNotFoundError")
def scoring_function_that_cannot_be_imported(ctx):
    return ["eval", "--model", ctx.student, "--task", "add", "--scoring", "no_such_module:score"]


@case("scoring function json:loads raised TypeError", "fix the function")
def scoring_function_that_raises(ctx):
    return ["eval", "--model", ctx.student, "--task", "add", "--n", 4, "--scoring", "json:loads"]


@case("scoring function operator:add returned", "a number in [0, 1]")
def scoring_function_that_returns_a_string(ctx):
    return ctx.train("data.scoring=operator:add")


@case("a prompt of", "p.jsonl", "has 61 tokens, over the limit of 56", "data.long_prompts=drop")
def prompt_longer_than_the_context(ctx):
    prompts = ctx.write("p.jsonl", json.dumps({"prompt": "1+1="}) + "\n" + json.dumps({"prompt": "9" * 60}) + "\n")
    return ctx.train(f"data.prompts={prompts}", "sampling.max_new_tokens=8", "eval.fraction=0.5")


# --- the engine and precision plans --------------------------------------------------------------------------------

@case("unknown KV cache dtype 'fp7'")
def unknown_precision_name(ctx):
    return ["eval", "--model", ctx.student, "--task", "add", "--plan", "kv=fp7"]


@case("out of range")
def layer_index_out_of_range(ctx):
    return ["generate", "--model", ctx.student, "--prompt", "1+2=", "--plan", "3: kv=bf16"]


@case("does not divide")
def group_size_does_not_divide_the_head_dim(ctx):
    return ["generate", "--model", ctx.student, "--prompt", "1+2=", "--plan", "kv=int4 kv_group=6"]


@case("top_p must be in (0, 1]")
def top_p_out_of_range(ctx):
    return ["generate", "--model", ctx.student, "--prompt", "1+2=", "--top-p", "1.5", "--max-new-tokens", 4]


@case("exceeds the model's context")
def max_tokens_beyond_the_context(ctx):
    return ["generate", "--model", ctx.student, "--prompt", "1+2=", "--max-new-tokens", 1000]


# --- at run time ---------------------------------------------------------------------------------------------------

def nan_copy(ctx, src: Path, name: str) -> Path:
    model, tok = load_checkpoint(src)
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    return save_checkpoint(ctx.dir / name, model, tok)


@case("NaN/Inf logits", "check the student checkpoint")
def nan_logits_from_the_engine(ctx):
    return ["generate", "--model", nan_copy(ctx, ctx.student, "nan"), "--prompt", "1+2=", "--max-new-tokens", 4]


@case("the teacher checkpoint", "has NaN/Inf weights (layers.0.mlp.up_proj.weight)", "use an undamaged checkpoint")
def nan_teacher_weights(ctx):
    return ctx.train(f"teacher={nan_copy(ctx, ctx.teacher, 'nan')}")


@case("not finite for 2 steps in a row", leaves=("run", "run/*", "run/*/*"))
def nan_teacher_scores(ctx):
    model, tok = load_checkpoint(ctx.teacher)
    with torch.no_grad():
        model.norm.weight[:] = 3e38  # finite weights, logits that overflow
    return ctx.train(f"teacher={save_checkpoint(ctx.dir / 'overflow', model, tok)}", "max_bad_steps=2")


@case("torch.compile of the rollout engine failed", "No working C++ compiler", "engine.compile=false",
      leaves=("run", "run/*", "run/*/*", "inductor", "inductor/**"),
      env={"CXX": "/nonexistent/g++", "TORCHINDUCTOR_CACHE_DIR": "inductor"})
def engine_compile_without_a_compiler(ctx):
    return ctx.train("engine.compile=true")


@case("engine vllm was requested but vllm is not installed", "pip install -e '.[vllm]'", env={"PYTHONPATH": "shadow"})
def vllm_requested_but_not_installed(ctx):
    (ctx.dir / "shadow" / "vllm").mkdir(parents=True)  # a stand-in `vllm` that fails to import, first on the path
    ctx.write("shadow/vllm/__init__.py", "raise ImportError('No module named vllm')\n")
    return ctx.train("engine.name=vllm")


@case("engine vllm was requested but vllm is not installed", env={"PYTHONPATH": "shadow"})
def vllm_generate_but_not_installed(ctx):
    vllm_requested_but_not_installed(ctx)
    return ["generate", "--model", ctx.student, "--engine", "vllm"]


@case("thresholds", "is not valid JSON")
def malformed_thresholds_file(ctx):
    return ["admit", "--set", f"student={ctx.student}", "--set", f"teacher={ctx.teacher}", "--set", "task=add",
            "--thresholds", ctx.write("t.json", "{not json")]


@case("is not an opd run directory")
def report_on_a_folder_that_is_not_a_run(ctx):
    (ctx.dir / "empty").mkdir()
    return ["report", ctx.dir / "empty", "--out", ctx.dir / "report"]


@case("grid.yaml")
def malformed_sweep_grid(ctx):
    return ["sweep", "--grid", ctx.write("grid.yaml", "families: llama\npoints: 3\n"), "--out", ctx.dir / "sweep"]


@case("no synchronous sweep results")
def calibrate_from_empty_results(ctx):
    return ["calibrate", ctx.write("results.jsonl", ""), "-o", ctx.dir / "thresholds.json"]


# --- issue 23: values out of range and malformed text, refused before any work ------------------------------------

@case("seed must be in [0, 2**32), got 18446744073709551616")
def seed_beyond_64_bits(ctx):
    return ctx.train("seed=18446744073709551616")


@case("lr must be a finite number, got nan")
def non_finite_learning_rate(ctx):
    return ctx.train("optim.lr=.nan")


@case("weight_decay must be >= 0, got -0.1")
def negative_weight_decay(ctx):
    return ctx.train("optim.weight_decay=-0.1")


@case("loss.cap must be a finite number, got inf")
def infinite_correction_cap(ctx):
    return ctx.train("loss.correction=tis", "loss.cap=.inf")


@case("bad.yaml", "the key 'lr' is given twice at line 3")
def duplicate_key_in_a_config(ctx):
    return ["train", "--config", ctx.write("bad.yaml", "optim:\n  lr: 0.1\n  lr: 0.2\n"), "--run-dir", ctx.dir / "run"]


@case("bad.yaml is not UTF-8 text (byte 6)", "save it as UTF-8")
def config_that_is_not_utf8(ctx):
    (ctx.dir / "bad.yaml").write_bytes(b"plan: \xff\xfe\n")
    return ["train", "--config", ctx.dir / "bad.yaml", "--run-dir", ctx.dir / "run"]


@case("bad.yaml: optim.lr must be a number, got [0.1]")
def config_value_of_the_wrong_shape(ctx):
    return ["train", "--config", ctx.write("bad.yaml", "optim: {lr: [0.1]}\n"), "--run-dir", ctx.dir / "run"]


@case("run/config.yaml: expected a mapping of keys to values, got list")
def resume_a_run_whose_config_is_a_list(ctx):
    assert main([str(a) for a in ctx.train()]) == 0
    (ctx.dir / "run" / "config.yaml").write_text("- 1\n- 2\n")
    return ctx.train("steps=6") + ["--resume"]


@case("trainer_state.json: step: expected a valid integer, got '4'")
def resume_a_state_whose_step_is_a_string(ctx):
    assert main([str(a) for a in ctx.train()]) == 0
    folder = ctx.dir / "run" / "checkpoint"
    state = json.loads((folder / "trainer_state.json").read_text()) | {"step": "4"}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"]["trainer_state.json"]["bytes"] = (folder / "trainer_state.json").stat().st_size
    from opd.io.registry import sha256_of as _sha256
    manifest["files"]["trainer_state.json"]["sha256"] = _sha256(folder / "trainer_state.json")
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return ctx.train("steps=6") + ["--resume"]


@case("metrics.jsonl:2: loss/value: expected a valid number or a valid integer, got 'low'")
def resume_a_log_with_a_string_value(ctx):
    assert main([str(a) for a in ctx.train()]) == 0
    path = ctx.dir / "run" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = json.dumps(json.loads(lines[1]) | {"loss/value": "low"})
    path.write_text("\n".join(lines) + "\n")
    return ctx.train("steps=6") + ["--resume"]


@case("run\\udcff' is not valid UTF-8 text")
def run_dir_name_that_is_not_utf8(ctx):
    return ctx.train(run="run\udcff")  # what Python makes of the byte 0xff in a path on the command line


@case("generation_config.json is not a file")
def generation_config_that_is_a_folder(ctx):
    folder = ctx.copy()
    (folder / "generation_config.json").unlink(missing_ok=True)
    (folder / "generation_config.json").mkdir()
    (folder / MANIFEST).unlink()
    return ["generate", "--model", folder, "--max-new-tokens", 4]


@case("config.json: both rope_parameters and rope_scaling are given")
def config_with_two_rope_settings(ctx):
    folder = ctx.copy()
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / MANIFEST).unlink()
    return ["generate", "--model", folder, "--max-new-tokens", 4]


# --- the harness ---------------------------------------------------------------------------------------------------

def snapshot(folder: Path) -> dict[str, tuple]:
    return {str(p.relative_to(folder)): (p.is_dir(), p.stat().st_size if p.is_file() else 0, p.stat().st_mtime_ns)
            for p in folder.rglob("*")}


def run(argv: list, ctx: Ctx, capsys, spec: Case) -> tuple[int, str]:
    argv = [str(a) for a in argv]
    if not spec.own_process:
        return main(argv), capsys.readouterr().err

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec.file_limit, spec.file_limit))
    extra = {k: str(ctx.dir / v) for k, v in (spec.env or {}).items()}
    result = subprocess.run([sys.executable, "-m", "opd.cli", *argv], capture_output=True, text=True, timeout=300,
                            env=os.environ | extra, preexec_fn=limit_file_size if spec.file_limit else None)
    return result.returncode, result.stderr


def test_the_suite_covers_at_least_25_cases():
    assert len(CASES) >= 25


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if spec.own_process else name
                                  for name, spec in CASES.items()])
def test_bad_input_is_one_clear_line_and_leaves_nothing_corrupt(name, pair, tmp_path, capsys):
    spec = CASES[name]
    ctx = Ctx(tmp_path / "case", *pair)
    ctx.dir.mkdir()
    argv = spec.build(ctx)
    capsys.readouterr()
    before = snapshot(ctx.dir)
    status, err = run(argv, ctx, capsys, spec)
    assert status == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("opd: error: "), err
    assert [line for line in lines if line.startswith("opd: error: ")] == lines[-1:], err
    assert all(line.startswith("opd: ") for line in lines[:-1]), err  # opd's own notes (warnings) only
    for fragment in spec.fragments:
        assert fragment in lines[-1], lines[-1]
    after = snapshot(ctx.dir)
    changed = {p for p in after if before.get(p) != after[p]}
    unexpected = {p for p in changed if not any(Path(p).match(pattern) for pattern in spec.leaves)}
    assert not unexpected, f"{name} left {sorted(unexpected)}"
    temporary = [p for p in after if Path(p).name.startswith(".")]
    assert not temporary, f"{name} left temporary files {temporary}"
