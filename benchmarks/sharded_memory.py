"""Per-rank memory of the sharded learner's training state (issue 59): parameters, gradients and AdamW moments held
by each rank after one optimizer step, with 1 rank and with N ranks (training/sharded.py's own `Sharding.shard`,
FSDP2 over gloo), side by side in one run.

Measured as the bytes of the tensors each rank holds (a DTensor's local shard; a whole parameter in full), not the
process's RSS, which counts the allocator's slack and the libraries; the rollout engine's whole copy of the student
is reported apart (every rank keeps one: it samples with whole weights). Shapes: SmolLM2-135M's pruned student
(15 layers of 576, vocabulary 49152: ~70M parameters, random weights) or, with --quick, a small model.

    unshare -n sh -c 'python tests/loopback_up.py && python benchmarks/sharded_memory.py --quick'   # ~10 s
    unshare -n sh -c 'python tests/loopback_up.py && python benchmarks/sharded_memory.py'           # ~1 min

The ranks rendezvous over TCP, so it runs in a network namespace with only loopback (it refuses otherwise). The last
line is `RESULT key=value ...`: `blocks_ratio` = a rank's block state with N ranks over the whole model's block state
(1/N expected), `total_ratio` the same over all of the training state (the embeddings, final norm and output layer
stay whole on every rank).
"""
import argparse
import os
import socket
import sys

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's warnings (set before torch loads; the ranks inherit it)
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from opd.models.model import ModelConfig, Transformer  # noqa: E402

SHAPES = {"smollm2-pruned": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=15,
                                 num_heads=9, num_kv_heads=3, head_dim=64),
          "quick": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=8, num_heads=4,
                        num_kv_heads=2, head_dim=64)}


def held(t) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def rank_main(rank: int, world: int, port: int, shape: dict, out) -> None:
    os.environ |= {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    import torch.distributed as dist
    from opd.training.sharded import Sharding
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = Transformer(ModelConfig(**shape)).init_weights(torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    shard = Sharding(rank, world, torch.device("cpu"))
    opt = shard.shard(model, opt) if world > 1 else opt
    ids = torch.randint(0, shape["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(rank))
    model(ids).float().logsumexp(-1).mean().backward()
    if world > 1:
        shard.sum_replicated_grads(model)
    opt.step()
    blocks = {id(p) for p in model.layers.parameters()}
    sizes = {"blocks": 0, "other": 0}
    for p in model.parameters():
        state = opt.state[p]
        n = held(p) + (held(p.grad) if p.grad is not None else 0) + held(state["exp_avg"]) + held(state["exp_avg_sq"])
        sizes["blocks" if id(p) in blocks else "other"] += n
    sizes["engine_copy"] = sum(p.numel() * 4 for p in model.parameters())  # a DTensor's numel is the whole one
    out.put((world, rank, sizes))
    dist.destroy_process_group()


def measure(world: int, shape: dict) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, shape, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return [sizes for _, _, sizes in sorted(results)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model (seconds)")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    if [name for _, name in socket.if_nameindex()] != ["lo"]:
        sys.exit("sharded_memory: run it in a network namespace with only loopback (see the docstring): the ranks' "
                 "rendezvous would listen on the machine's address")
    name = "quick" if args.quick else "smollm2-pruned"
    shape = SHAPES[name]
    params = sum(p.numel() for p in Transformer(ModelConfig(**shape)).parameters())
    one = measure(1, shape)[0]
    many = measure(args.ranks, shape)
    mb = lambda b: f"{b / 2**20:8.1f} MiB"  # noqa: E731
    print(f"shape {name}: {params / 1e6:.1f}M parameters; per rank: weights + gradients + AdamW moments (float32)")
    print(f"  1 rank:        blocks {mb(one['blocks'])}, embeddings/norm/output {mb(one['other'])}")
    for r, sizes in enumerate(many):
        print(f"  rank {r} of {args.ranks}:   blocks {mb(sizes['blocks'])}, embeddings/norm/output {mb(sizes['other'])}")
    print(f"  the rollout engine's whole copy on every rank: {mb(one['engine_copy'])}")
    blocks = max(s["blocks"] for s in many) / one["blocks"]
    total = max(s["blocks"] + s["other"] for s in many) / (one["blocks"] + one["other"])
    print(f"RESULT shape={name} ranks={args.ranks} params_m={params / 1e6:.1f} blocks_ratio={blocks:.3f} "
          f"total_ratio={total:.3f}")


if __name__ == "__main__":
    main()
