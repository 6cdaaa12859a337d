"""transformers' `generate` as a rollout engine (engine kind `hf`, engines.py): the reference implementation of
sampling that most OPD code starts from, behind opd's engine interface. It is an oracle (its log-probs of its own
tokens against the built-in engine's, teacher-forced: tests/test_engines.py) and a baseline for speed, and it is the
smallest engine there is: it shows what a new kind needs (a class with the `RolloutEngine` methods and one row in
engines.KINDS) and nothing else.

It loads the checkpoint folder with `AutoModelForCausalLM` on the CPU and is sent the learner's weights by
`update_weights`. Plans: full precision (`""`) or the whole model in bfloat16 (`forward=bf16 kv=bf16`, `w=bf16` too);
anything else (FP8 KV, quantized weights, per-layer plans) has no switch in transformers and is refused. Sampling is
transformers' own (its temperature, top-k and top-p processors, the global generator seeded from the batch's seed in a
forked RNG state, so nothing outside changes); `mu` is the log-prob under the scores it sampled from, the raw log-prob
the one under logits / temperature. No hidden states (the exact KL is off with it), no KV scales.
"""
import torch

from opd.models.checkpoint import hf_state_dict
from opd.io.errors import require
from opd.engines.naive import left_pad
from opd.numerics.plan import Plan
from opd.engines.sampling import Rollout
from opd.engines.sampling import SamplingParams, seeded


def hf_dtype(plan: Plan) -> torch.dtype:
    """The torch dtype transformers runs the plan at; an error for a plan it has no switch for."""
    first = plan.layers[0]
    fix = "use plan \"\" (float32) or \"forward=bf16 kv=bf16\" with engine hf, or engine builtin"
    require(all(layer == first for layer in plan.layers), f"the hf engine runs one precision for the whole model, not "
            f"the per-layer plan {plan}", fix)
    dtype = "bf16" if plan.forward == "bf16" or first.weights == "bf16" else "fp32"
    require(first.weights in ("none", "bf16") and first.noise == 0 and first.key_outlier == 1 and
            first.kv.dtype == dtype and first.kv.scale_mode == "fixed",
            f"the hf engine has no switch for the plan {plan} (transformers keeps the KV cache and weights in the "
            f"model's dtype, {dtype})", fix)
    return torch.bfloat16 if dtype == "bf16" else torch.float32


class HfEngine:
    hidden_states = False  # transformers' generate is not asked for hidden states: no exact KL, no KV statistics

    def __init__(self, model_dir: str, stop_ids: int | list[int], pad_id: int, plan: Plan, tied: bool,
                 version: int = 0):
        import transformers
        self.plan, self.pad_id, self.version, self.tied = plan, pad_id, version, tied
        self.stop_ids = [stop_ids] if isinstance(stop_ids, int) else list(stop_ids)
        self.scales: dict = {}
        bar = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # its loading bar on stderr, restored after
        try:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=hf_dtype(plan)).eval()
        finally:
            if bar:
                transformers.utils.logging.enable_progress_bar()

    @classmethod
    def for_model(cls, model, model_dir: str, stop_ids: int | list[int], pad_id: int, plan: Plan, *, version: int = 0,
                  **unused) -> "HfEngine":
        """engines.make_engine's constructor (transformers sizes its cache per call and seeds from each batch's
        seed: the sizes and the engine seed are unused)."""
        require(bool(model_dir), "the hf engine needs the checkpoint folder", "pass model_dir")
        return cls(model_dir, stop_ids, pad_id, plan, model.cfg.tie_word_embeddings, version)

    @torch.no_grad()
    def update_weights(self, state_dict: dict, version: int) -> None:
        weights = hf_state_dict(state_dict, self.tied)
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        require(not unexpected and set(missing) <= {"lm_head.weight"}, "the hf engine was sent weights that do not "
                f"match its checkpoint (missing {missing[:3]}, unexpected {unexpected[:3]})",
                "this is a bug: report it")
        if self.tied:
            self.model.tie_weights()
        self.version = version

    def logprobs(self, hidden: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        require(False, "the hf engine returns the sampled tokens' log-probs, not hidden states", "turn exact_kl off")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | int,
                 return_hidden: bool = False, stats: dict | None = None) -> list[Rollout]:
        """As engine.Engine.generate (stats gets nothing)."""
        import transformers
        require(not return_hidden, "the hf engine returns no hidden states", "turn exact_kl off")
        require(all(len(p) > 0 for p in prompts), "every prompt needs at least one token")
        seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=seeded(generator)))
        ids, valid = left_pad(prompts, self.pad_id)
        stops = [*self.stop_ids, *params.stop_token_ids]
        greedy = params.temperature == 0
        config = transformers.GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else params.temperature,
            top_k=None if greedy else params.top_k, top_p=None if greedy else params.top_p,
            max_new_tokens=params.max_new_tokens, min_new_tokens=0, eos_token_id=[s for s in stops if s >= 0] or None,
            pad_token_id=self.pad_id, output_scores=True, output_logits=True, return_dict_in_generate=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids, attention_mask=valid.long(), generation_config=config)
        tokens = out.sequences[:, ids.shape[1]:]  # [B, steps]
        processed = torch.stack(out.scores, 1).float().log_softmax(-1)  # what it sampled from: mu
        raw = (torch.stack(out.logits, 1).float() / (params.temperature or 1.0)).log_softmax(-1)
        mu = processed.gather(-1, tokens[..., None])[..., 0]
        raw = raw.gather(-1, tokens[..., None])[..., 0]
        rollouts = []
        for b, prompt in enumerate(prompts):
            row = tokens[b].tolist()
            end = next((t + 1 for t, token in enumerate(row) if token in stops), None)
            n = end or min(len(row), params.max_new_tokens)
            rollouts.append(Rollout(list(prompt), row[:n], mu[b, :n].tolist(), raw[b, :n].tolist(),
                                    "stop" if end else "length", self.version))
        return rollouts

    def close(self) -> None:
        """Nothing to release: the model is tensors in this process."""
