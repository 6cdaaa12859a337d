"""Structured state as tensors + JSON, never pickle: what checkpoints store and what the rollout worker sends.

`encode(tree)` turns a tree of dicts, lists, tuples, strings, numbers, booleans, None and tensors into the bytes of
one safetensors file: every tensor is stored under a generated name, and the tree itself, with each tensor replaced
by a reference to its name, is JSON in the file's metadata (`__metadata__["opd"]`). `decode(data)` reverses it.
Reading such bytes runs no code whatever they contain (JSON and raw tensor data only), unlike `torch.load` without
`weights_only` or `pickle.loads`, which execute what a crafted file tells them to. Dict keys that are not strings
(the optimizer's parameter indices, the engine's layer numbers) and tuples are tagged, so they come back as they
went in.
"""
import json
import struct
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from safetensors.torch import save_file as save_tensor_file

from opd.io.errors import OpdError

KEY = "opd"


def encode(tree: Any) -> bytes:
    tensors, header = _flatten(tree)
    return save_tensors(tensors, metadata={KEY: header})


def encode_file(tree: Any, path) -> None:
    """encode(tree), written to path as it is serialized: no copy of the tensors' bytes in memory (encode's bytes
    are the serialized buffer plus a copy of it: 8 GB for a 0.5B-parameter student's AdamW state, which is what
    ended a Qwen2.5-Coder run in an out-of-memory kill at its last checkpoint on a 24 GiB machine)."""
    tensors, header = _flatten(tree)
    save_tensor_file(tensors, str(path), metadata={KEY: header})


def _flatten(tree: Any) -> tuple[dict[str, torch.Tensor], str]:
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def walk(node):
        if isinstance(node, torch.Tensor):
            name = f"t{len(tensors)}"
            tensor = node.detach().to("cpu").contiguous()
            storage = tensor.untyped_storage().data_ptr()
            # safetensors refuses two tensors on one storage (tied weights, views): copy only those, not every
            # tensor (the weights go through here at every async publish)
            tensors[name] = tensor.clone() if storage in storages else tensor
            storages.add(storage)
            return {"__tensor__": name}
        if isinstance(node, dict):
            if all(isinstance(k, str) for k in node) and "__tensor__" not in node and "__pairs__" not in node \
                    and "__tuple__" not in node:
                return {k: walk(v) for k, v in node.items()}
            return {"__pairs__": [[walk(k), walk(v)] for k, v in node.items()]}
        if isinstance(node, tuple):
            return {"__tuple__": [walk(v) for v in node]}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"wire.encode: cannot encode a {type(node).__name__}")

    return tensors, json.dumps(walk(tree))


def _metadata(data: bytes) -> dict:
    if len(data) < 8:
        raise ValueError("too short")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise ValueError("its header is cut short")
    header = json.loads(data[8:8 + size])
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict) or \
            not isinstance(header["__metadata__"].get(KEY), str):
        raise ValueError("it has no opd metadata")
    return header["__metadata__"]


def decode(data: bytes, device: str | torch.device = "cpu", what: str = "state") -> Any:
    """The tree `encode` wrote; any other bytes are refused with one line (OpdError), never run."""
    try:
        tree = json.loads(_metadata(data)[KEY])
        tensors = load_tensors(data)
    except Exception as e:  # malformed bytes of any kind: never executed, only refused
        raise _refused(what, e) from None
    return _rebuild(tree, tensors, device, what)


def decode_file(path, device: str | torch.device = "cpu", what: str = "state") -> Any:
    """decode of a file encode_file (or encode) wrote, its tensors read from the file (memory-mapped by safetensors)
    rather than from a copy of its bytes."""
    try:
        with safe_open(str(path), framework="pt") as f:
            tree = json.loads(f.metadata()[KEY])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # malformed bytes of any kind: never executed, only refused
        raise _refused(what, e) from None
    return _rebuild(tree, tensors, device, what)


def _refused(what: str, error: Exception) -> OpdError:
    return OpdError(f"{what} is not an opd tensors + JSON file ({type(error).__name__}: {error})",
                    "it was not written by this version of opd, or it is damaged")


def _rebuild(tree: Any, tensors: dict[str, torch.Tensor], device, what: str) -> Any:
    def walk(node):
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, dict):
            if set(node) == {"__tensor__"}:
                name = node["__tensor__"]
                if name not in tensors:
                    raise OpdError(f"{what} refers to a tensor {name!r} it does not hold", "it is damaged")
                return tensors[name].to(device)
            if set(node) == {"__tuple__"} and isinstance(node["__tuple__"], list):
                return tuple(walk(v) for v in node["__tuple__"])
            if set(node) == {"__pairs__"} and isinstance(node["__pairs__"], list):
                out = {}
                for pair in node["__pairs__"]:
                    if not (isinstance(pair, list) and len(pair) == 2):
                        raise OpdError(f"{what} holds a malformed mapping", "it is damaged")
                    key = walk(pair[0])
                    try:
                        out[key] = walk(pair[1])
                    except TypeError:
                        raise OpdError(f"{what} holds an unusable mapping key", "it is damaged") from None
                return out
            return {k: walk(v) for k, v in node.items()}
        return node

    try:
        return walk(tree)
    except RecursionError:
        raise OpdError(f"{what} is nested too deep", "it is damaged") from None
