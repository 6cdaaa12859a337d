"""The learner across ranks: PyTorch's FSDP2 (`fully_shard`) over the student's blocks, one process per rank,
launched by torchrun (`torchrun --nproc-per-node N -m opd.cli train ... --set compute.learner_ranks=N`) or, on one
machine, by `opd train` itself (`launch`: torchrun's rank variables, a rendezvous through a file store and gloo's pairs
on loopback: nothing listens on the machine's network). `compute.sharded` runs the same path on one rank (a group of
one, no launcher): the check of it on a machine with one GPU.

Layout: each rank holds 1/N of every block's parameters, gradients and AdamW moments. The embeddings, the final norm
and the output layer stay whole on every rank: chunked.py reads the output layer's weight outside any module's
forward, where FSDP could not gather it; their gradients are summed over the ranks by an all-reduce (a tied output
layer is the embedding). A step: rank r samples sub-batch r of the step's batch (rollouts.shards(): its prompts and
seed, the rollouts a one-rank run with sampling.shards = N samples), scores it with every token weighted by N over
the whole batch's tokens, and backward; the blocks' gradients are reduce-scattered and averaged (FSDP's
default: gloo has no pre-scaled sum), the others all-reduced and averaged, so every rank holds its part of the whole
batch's gradient. Clipping takes the global norm. The rollouts and the per-token scores are
gathered to rank 0, which logs the step's metrics over the whole batch as a one-rank run would.

Rollouts: the built-in engine on each rank runs a whole copy of the student (the engine samples with whole weights;
each publish gathers them from the shards into it). That copy is also what rank 0 evaluates and checkpoints. In the
async schedule each rank has a rollout worker process of its own, sampling the rank's sub-batch ahead; a checkpoint
keeps every rank's batches in flight, so an async run resumes exactly on its own rank count (refused on another).
Checkpoints are gathered to rank 0 in the one-rank run's format (safetensors + JSON; the AdamW moments gathered from
the shards): a run written by N ranks resumes on M (any M; tested 2 -> 1), and the student folder is a plain Hugging
Face folder. Memory on rank 0 while saving: one whole copy of the AdamW moments (8 bytes a parameter).

Not yet: the Ray backend's rollout actors, served or top-k teachers, canary training (each refused with its reason in
config.run; Ray placing the ranks themselves is ray_ranks.py);
calibrated KV scales (each rank's engine would calibrate on its own sub-batch).
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from opd.io.errors import require
from opd.training.learner import Scores, clip_gradients, collate, sum_of_squares, unpack
from opd.training.losses import loss_metrics

def launched() -> bool:
    """This process is one rank of a job (torchrun's, or launch()'s)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def check_placement(cfg) -> None:
    """The ranks fit this machine: one CPU core each at least, or one CUDA device each."""
    ranks = cfg.compute.learner_ranks
    if cfg.compute.device.startswith("cuda") or (cfg.compute.device == "auto" and torch.cuda.is_available()):
        have = torch.cuda.device_count()
        require(ranks <= have, f"compute.learner_ranks {ranks}: this machine has {have} CUDA device(s), one per "
                "rank is needed", f"use learner_ranks <= {have}, or launch across machines with torchrun")
    else:
        have = os.cpu_count() or 1
        require(ranks <= have, f"compute.learner_ranks {ranks}: this machine has {have} CPU core(s), one per rank "
                "is needed", f"use learner_ranks <= {have}")


def launch(argv: list[str], ranks: int) -> int:
    """Run `opd <argv>` as `ranks` processes on this machine, each with torchrun's environment (RANK, WORLD_SIZE,
    LOCAL_RANK) and a rendezvous through a file store (OPD_RENDEZVOUS: no listening socket; gloo's pairs on loopback),
    and wait. Rank 0's output is passed through to this terminal; the others' stderr is
    kept and shown only where rank 0 said nothing of the failure (one line: the failing rank's error, or its last
    line). When a rank exits with an error the others are stopped (SIGTERM, then SIGKILL after 30 s) and its exit
    status is returned."""
    store = tempfile.mkdtemp(prefix="opd-ranks-")  # the rendezvous: a file store, no listening socket
    procs, logs = [], []
    for rank in range(ranks):
        # c10d's warnings are not the user's business; gloo's pairs on loopback (one machine)
        env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"} | os.environ | {
            "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank), "OPD_RENDEZVOUS": f"file://{store}/s"}
        logs.append(tempfile.TemporaryFile("w+") if rank else None)
        procs.append(subprocess.Popen([sys.executable, "-m", "opd.cli", *argv], env=env,
                                      stdout=None if rank == 0 else subprocess.DEVNULL,
                                      stderr=subprocess.PIPE if rank == 0 else logs[-1]))
    said = _pass_through(procs[0].stderr)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            time.sleep(0.2)
    except KeyboardInterrupt:  # the ranks got the same SIGINT (one process group) and stop at a step boundary
        codes = [p.wait() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c != 0]
    if failed:
        _stop(procs)
    said["thread"].join(timeout=10)
    try:
        if not failed:
            return 0
        rank, code = failed[0]
        if rank > 0 and not said["error"]:
            logs[rank].seek(0)
            print(failure_line(rank, code, logs[rank].read()), file=sys.stderr)
        return code if code > 0 else 1
    finally:
        for log in logs[1:]:
            log.close()
        shutil.rmtree(store, ignore_errors=True)


def failure_line(rank: int, code: int, text: str) -> str:
    """The one line a failed rank other than 0 leaves when rank 0 said nothing of it: its last `opd: error:` line,
    else its exit status and last line (launch, and ray_ranks for Ray-placed ranks)."""
    lines = text.splitlines()
    errors = [x for x in lines if x.startswith("opd: error:")]
    last = next((x.strip() for x in reversed(lines) if x.strip()), "no output")
    return errors[-1] if errors else f"opd: error: learner rank {rank} failed (exit status {code}): {last:.300}"


def _pass_through(stream) -> dict:
    """Copy rank 0's stderr to ours as it comes (progress bars included), noting whether it printed an error line."""
    import threading
    said = {"error": False}

    def copy():
        tail = b""
        for chunk in iter(lambda: os.read(stream.fileno(), 4096), b""):
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
            tail = (tail + chunk)[-65536:]
            said["error"] = said["error"] or b"opd: error:" in tail
    said["thread"] = threading.Thread(target=copy, daemon=True)
    said["thread"].start()
    return said


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Sharding:
    """This process's rank of a sharded learner; made by `start` once the config is read."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        self.full_model = None  # the whole student the engine samples with (and rank 0 evaluates and saves)
        self.blocks: list = []

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # --- the learner's layout ----------------------------------------------------------------------------------

    def shard(self, student, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """fully_shard every block of the student (in place), and an AdamW over the sharded parameters holding
        `opt`'s state, each moment cut the way its parameter is."""
        saved = opt.state_dict()
        for block in student.layers:
            fully_shard(block)  # its gradients averaged over the ranks (each rank's loss carries `world` times its share)
        self.blocks = list(student.layers)
        params = list(student.parameters())
        for index, entry in saved["state"].items():
            p = params[index]
            if isinstance(p, DTensor):
                for key in ("exp_avg", "exp_avg_sq"):
                    entry[key] = distribute_tensor(entry[key].to(p.device), p.device_mesh, p.placements)
        group = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
        sharded = torch.optim.AdamW(params, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                    weight_decay=group["weight_decay"], foreach=False)
        sharded.load_state_dict(saved)
        return sharded

    def replicated(self, student) -> list[torch.nn.Parameter]:
        return [p for p in student.parameters() if not isinstance(p, DTensor)]

    # --- collectives -------------------------------------------------------------------------------------------

    def total(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item()

    def any(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def gather(self, obj) -> list | None:
        """Every rank's obj, in rank order, on rank 0 (None elsewhere)."""
        out = [None] * self.world if self.leader else None
        dist.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def whole_batch(self, rows: list, scores, loss: float, pad_id: int):
        """Every rank's rollouts and per-token scores gathered to rank 0 -> (the whole batch a one-rank run collates,
        its Scores as score_batch returns them), in rank order; (None, None) on the other ranks. Hidden states are not
        sent (the metrics do not read them)."""
        parts = self.gather(([replace(r, hidden=None) for r in rows], scores.terms, scores.teacher_seconds))
        if not self.leader:
            return None, None
        batch = collate([r for rollouts, _, _ in parts for r in rollouts], pad_id)
        terms = {name: torch.cat([t[name] for _, t, _ in parts]) for name in parts[0][1]}
        field = lambda name: unpack(terms[name], batch.mask) if name in terms else None  # noqa: E731
        return batch, Scores(field("s_y"), field("t_y"), field("kl_exact"), field("rkl"), loss,
                             loss_metrics(terms, torch.ones_like(terms["s_y"], dtype=torch.bool)),
                             max(seconds for _, _, seconds in parts), None, terms)

    def sum_replicated_grads(self, student) -> None:
        """The whole parameters' gradients averaged over the ranks, as FSDP does the blocks'."""
        for p in self.replicated(student):
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(self.world)

    def clip(self, student, max_norm: float) -> float:
        """learner.clip_gradients over the whole (sharded) gradient: the global L2 norm."""
        return clip_gradients(student.parameters(), max_norm, squares=self.squares)

    def squares(self, grads: list) -> torch.Tensor:
        """The whole gradient's sum of squares: the shards' summed over the ranks, the whole tensors' once."""
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        whole = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in grads:
            if isinstance(g, DTensor):
                sharded += sum_of_squares(g.to_local())
            else:
                whole += sum_of_squares(g)
        dist.all_reduce(sharded)
        return sharded + whole

    @torch.no_grad()
    def refresh(self, student) -> dict:
        """The whole copy (full_model) brought to the student's newest weights (an all-gather of each sharded tensor,
        on every rank) -> its state dict."""
        self.full_model.load_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v
                                         for k, v in student.state_dict().items()})
        return self.full_model.state_dict()

    def full_optimizer_state(self, opt: torch.optim.Optimizer) -> dict:
        """AdamW's state dict with every moment whole (a collective: every rank calls it; all get the result)."""
        saved = opt.state_dict()
        state = {i: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in entry.items()}
                 for i, entry in saved["state"].items()}
        return {"state": state, "param_groups": saved["param_groups"]}


def start(cfg) -> Sharding:
    """Join the job (the process group over the launch environment: gloo on CPU, NCCL on CUDA) -> this rank. One rank
    outside a launched job (compute.sharded with learner_ranks 1): a group of one over a file store, no socket."""
    alone = not launched() and cfg.compute.learner_ranks == 1
    world, rank = (1, 0) if alone else (int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]))
    require(world == cfg.compute.learner_ranks, f"compute.learner_ranks is {cfg.compute.learner_ranks} but this job "
            f"has {world} processes", f"launch {cfg.compute.learner_ranks} processes (torchrun --nproc-per-node "
            f"{cfg.compute.learner_ranks}), or set compute.learner_ranks={world}")
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = cfg.compute.device.startswith("cuda") or (cfg.compute.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        store = {}  # torchrun's: env:// (MASTER_ADDR, MASTER_PORT)
        if alone:
            _STORES.append(tempfile.mkdtemp(prefix="opd-rank-"))
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            store = {"init_method": f"file://{_STORES[-1]}/store"}
        elif "OPD_RENDEZVOUS" in os.environ:  # launch()'s
            store = {"init_method": os.environ["OPD_RENDEZVOUS"]}
        if store:
            store |= {"rank": rank, "world_size": world}
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None, **store)
    return Sharding(rank, world, device)


def rank_state(saved: dict, rank: int, world: int, run_dir) -> dict:
    """A checkpoint's rollout state for rank `rank` of `world` (a learner that is not sharded: 0 of 1): a sharded
    async run's checkpoint holds every rank's batches in flight (`async_ranks`), each rank takes its own; a run written
    by another number of ranks is refused (its sub-batches differ). A synchronous checkpoint is the same for every
    rank count."""
    ranks = saved.get("async_ranks") if isinstance(saved, dict) else None
    out = {k: v for k, v in (saved or {}).items() if k != "async_ranks"}
    if ranks is None:
        return out
    require(isinstance(ranks, list) and len(ranks) == world, f"{run_dir}: this async run's checkpoint holds "
            f"the batches in flight of {len(ranks) if isinstance(ranks, list) else '?'} learner ranks, not "
            f"{world}", f"resume it with compute.learner_ranks={len(ranks) if isinstance(ranks, list) else 1}")
    return out | {"async": ranks[rank]}


def collective_failure(e: BaseException) -> bool:
    """e is a failed collective (a peer rank gone, the rendezvous unreachable), not a bug of this rank."""
    return isinstance(e, dist.DistError) or any(word in str(e) for word in ("gloo", "Gloo", "NCCL", "Connection closed"))


_STORES: list[str] = []  # the file stores of one-rank groups (start), removed at stop


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    while _STORES:
        shutil.rmtree(_STORES.pop(), ignore_errors=True)

