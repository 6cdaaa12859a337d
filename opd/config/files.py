"""The config as a file: YAML and `--set` read into a checked TrainConfig (config.py's sections), keys from before
the sections (refused in a user's file with their new name, moved in what opd itself stored: a run's config.yaml, a
results line), and the config written back.

Every error names the key and, for a file, the file: unknown keys (with the closest known one), wrong types (checked
against the default's type: ints are accepted for floats; a plan may be a string or a mapping of layers to settings),
a section given as a scalar. `teacher: DIR` is short for `teacher: {path: DIR}` everywhere a config is read.
"""
import difflib
import json
from dataclasses import asdict, fields
from pathlib import Path

import yaml

from opd.config.run import OPTIONAL, SECTIONS, TeacherConfig, TrainConfig, attribute
from opd.io.errors import OpdError, require


# Each setting that was a top-level key before the config had sections -> its name now.
MOVED = {old: f"{section}.{new}" for section, names in {
    "data": "prompts prompt_key answer_key chat max_prompt_tokens long_prompts scoring",
    "sampling": "max_new_tokens temperature top_k top_p",
    "optim": "lr warmup_steps lr_schedule:schedule weight_decay grad_clip",
    "eval": "eval_every:every eval_examples:examples eval_prompts:prompts eval_fraction:fraction "
            "eval_batch_size:batch_size",
    "engine": "engine:name engine_compile:compile",
    "async": "max_staleness prefetch stale_policy recompute_fraction worker_threads worker_timeout max_worker_restarts",
    "guard": "guard_every:every guard_action:action guard_thresholds:thresholds guard_limit:limit",
    "compute": "device teacher_device dtype teacher_dtype micro_batch_size chunk_tokens",
    "teacher": "teacher_engine:engine teacher_plan:plan teacher_topk:topk teacher_check:check",
}.items() for old, _, new in (name.partition(":") for name in names.split()) for new in [new or old]}


def moved(key: str, value) -> OpdError:
    """The error for a key from before the sections, naming its new place."""
    section, name = MOVED[key].split(".")
    text = f"{json.dumps(value)!s:.40}" if isinstance(value, (str, int, float, bool)) else "..."
    return OpdError(f"config key {key!r} is now {MOVED[key]!r}",
                    f"write {section}: {{{name}: {text}}}, or --set {MOVED[key]}={text}")


def _checked_keys(values: dict, cls, prefix: str = "") -> dict:
    names = [f.name.removesuffix("_") for f in fields(cls)]
    for key, value in values.items():
        if key in names:
            continue
        if not prefix and key in MOVED:
            raise moved(key, value)
        known = {name: prefix + name for name in names} | ({} if prefix else MOVED)  # a typo of a moved key too
        close = difflib.get_close_matches(str(key), list(known), n=1)
        raise OpdError(f"unknown config key {prefix + str(key)!r}",
                       f"did you mean {known[close[0]]}?" if close else f"valid keys: {', '.join(names)}")
    return values


PLAN_KEYS = ("plan", "teacher.plan")  # precision plans: a string, or a mapping of layers to settings strings


def _typed(key: str, value, default):
    """Check a YAML value against the type of the field's default (ints are accepted for floats)."""
    leaf = key.rpartition(".")[2]
    if default is None and leaf in OPTIONAL:
        return None if value is None else _typed(key, value, OPTIONAL[leaf])
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
            (isinstance(value, float) or abs(value) < 1e308)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, str) and key in PLAN_KEYS:
        ok = isinstance(value, str) or (isinstance(value, dict) and all(
            isinstance(k, (str, int)) and not isinstance(k, bool) and isinstance(v, str) for k, v in value.items()))
    elif isinstance(default, str):
        ok = isinstance(value, str)
    else:
        ok = True
    names = {bool: "true or false", float: "a number", int: "an integer", str: "a string"}
    expected = "a string or a mapping of layers to settings strings" if key in PLAN_KEYS else names[type(default)]
    require(ok, f"config: {key} must be {expected}, got {value!r:.60}",
            f"e.g. {key}: \"kv=fp8_e4m3\"" if key in PLAN_KEYS else f"e.g. --set {key}={json.dumps(default)}")
    return value


def _checked_values(values, where: str = "config") -> dict:
    """values with their keys and types checked (no range checks yet: each section's own); errors name `where`."""
    try:
        require(isinstance(values, dict), f"config: expected a mapping of keys to values, got {type(values).__name__}",
                "write key: value lines")
        values = expand_shorthand(values)
        _checked_keys(values, TrainConfig)
        defaults = TrainConfig()
        out = {}
        for key, value in values.items():
            if key in SECTIONS:
                if key in MOVED and not isinstance(value, dict):  # engine: vllm, from before the sections
                    raise moved(key, value)
                require(isinstance(value, dict), f"config: {key} must be a mapping (a section)",
                        f"e.g. {key}: {{{fields(SECTIONS[key])[0].name}: ...}}, or --set {key}."
                        f"{fields(SECTIONS[key])[0].name}=...")
                _checked_keys(value, SECTIONS[key], f"{key}.")
                section = asdict(getattr(defaults, attribute(key)))
                out[key] = {k: _typed(f"{key}.{k}", v, section[k]) for k, v in value.items()}
            else:
                out[key] = _typed(key, value, getattr(defaults, key))
        return out
    except OpdError as e:
        if where == "config":
            raise
        raise OpdError(f"{where}: {e.problem.removeprefix('config: ')}", e.fix) from None


def expand_shorthand(values):
    """`teacher: DIR` -> `teacher: {path: DIR}` (the teacher's checkpoint, as `student: DIR` names the student's)."""
    if isinstance(values, dict) and isinstance(values.get("teacher"), str):
        return {**values, "teacher": {"path": values["teacher"]}}
    return values


def build_config(values: dict, where: str = "config") -> TrainConfig:
    """A TrainConfig from a mapping as a config file holds it (sections as nested mappings), with key, type and
    range checks."""
    out = _checked_values(values, where)
    try:
        for key, cls in SECTIONS.items():
            if key in out:
                out[attribute(key)] = cls(**out.pop(key))
        return TrainConfig(**out)
    except OpdError as e:
        problem = e.problem if where == "config" else f"{where}: {e.problem.removeprefix('config: ')}"
        raise OpdError(problem, e.fix or "each key's meaning and range: opd/config/run.py") from None


def migrate(values: dict) -> dict:
    """A config that opd itself saved before the config had sections (a run's config.yaml, a results line) in today's
    layout; a config a user writes with an old key is refused instead (_checked_keys names the new key)."""
    out = {}
    for key, value in expand_shorthand(values).items():
        if key in MOVED and not (key in SECTIONS and isinstance(value, dict)):
            section, name = MOVED[key].split(".")
            out.setdefault(section, {})[name] = value
        else:
            out[key] = merge(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


def stored_teacher(values: dict) -> TeacherConfig:
    """The teacher section of a config opd stored (a results line's or a run's, of any release)."""
    section = migrate(values).get("teacher", {})
    names = {f.name for f in fields(TeacherConfig)}
    return TeacherConfig(**{k: v for k, v in section.items() if k in names})


def known_settings(values: dict) -> dict:
    """values without the keys this release does not have (top-level and in sections): a stored config from a
    release with more settings."""
    defaults = TrainConfig().to_dict()
    return {key: ({k: v for k, v in value.items() if k in defaults[key]} if key in SECTIONS and
                  isinstance(value, dict) else value) for key, value in values.items() if key in defaults}


def flatten(values: dict, prefix: str = "") -> dict:
    """{"async": {"max_staleness": 2}} -> {"async.max_staleness": 2}."""
    out = {}
    for key, value in values.items():
        if key in SECTIONS and not prefix and isinstance(value, dict):
            out.update(flatten(value, f"{key}."))
        else:
            out[prefix + key] = value
    return out


def parse_overrides(pairs: list[str]) -> dict:
    """["lr=3e-4", "loss.name=fkl"] -> {"lr": 0.0003, "loss": {"name": "fkl"}}."""
    out: dict = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        require(eq == "=" and key.strip(), f"--set {pair!r}: expected key=value", "e.g. --set lr=3e-4")
        try:
            value = yaml.load(text, Loader=_unique_key_loader()) if text.strip() else ""  # noqa: S506 (safe)
        except yaml.constructor.ConstructorError as e:  # a key given twice
            raise OpdError(f"--set {pair!r}: {e.problem}", "give each key once") from None
        except yaml.YAMLError:
            value = text
        *parents, leaf = key.strip().split(".")
        if not parents and leaf == "teacher" and isinstance(value, str) and isinstance(out.get(leaf), dict):
            parents, leaf, value = [leaf], "path", value  # teacher=DIR after teacher.*: its path
        out = expand_shorthand(out)  # teacher=DIR, then teacher.engine=...
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
            require(isinstance(node, dict), f"--set {pair!r}: {parent} is not a section")
        node[leaf] = value
    return out


def _unique_key_loader():
    from opd.io.schema import UniqueKeyLoader  # pydantic comes with schema.py: not imported for a config alone
    return UniqueKeyLoader


def merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(path: Path | None, overrides: list[str] = ()) -> TrainConfig:
    """The config file (checked: UTF-8, YAML without duplicate keys, known keys of the right types, each error
    naming the file) with the --set overrides applied, then range-checked as a whole."""
    from opd.io.schema import read_yaml
    values = {}
    if path is not None:
        values = read_yaml(path, "config file", "fix the file") or {}
        require(isinstance(values, dict), f"{path}: expected a mapping of config keys, got {type(values).__name__}",
                "write key: value lines")
        _checked_values(values, str(path))
    return build_config(merge(expand_shorthand(values), expand_shorthand(parse_overrides(list(overrides)))))


def dump_config(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
