"""`stoker serve --config models.yaml`: several models in one server (issue 18 part 4).

    generate:                      # at most one generative model (optional)
      path: /models/llama
      served_model_name: [llama]   # default: the path as written
      max_model_len: 4096          # any engine flag, by its flag name (--max-num-seqs -> max_num_seqs)
    pooling:                       # any number of embedding / reranker models
      - path: /models/bge-small
        served_model_name: bge
        max_batch_size: 64         # the dynamic batcher's flags, by their names

Each entry takes the keys its `stoker serve` flags name (the same types and choices); an unknown
key, a wrong type, a missing folder or a name served twice is refused at start-up, naming the
key and the model. With --config, MODEL_DIR and every per-model flag are refused (they would be
ambiguous): only the server's own flags (--host, --port, --api-key...) apply.

`--config` may also name a model repository folder, as Triton's `--model-repository`: each
subfolder is one model served under the subfolder's name, a Hugging Face checkpoint folder
itself or, Triton's layout, numbered version folders of which the highest is served. Its
architecture puts it under `generate` or `pooling` (`runner` overrides), and an optional
`serve.yaml` in the subfolder holds its settings: the keys of a models.yaml entry but `path`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_COMMON = ("path", "served_model_name", "runner")


class ConfigError(ValueError):
    pass


def _engine_parser() -> argparse.ArgumentParser:
    from stoker.engine.args import add_engine_args

    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p, model_required=False)
    return p


def _pooling_parser() -> argparse.ArgumentParser:
    from stoker.server.pooling.cli import add_pooling_args

    p = argparse.ArgumentParser(add_help=False)
    add_pooling_args(p)
    # what a pooling model takes of the engine flags (PoolingModelSpec)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    return p


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in ("help", "runner")}


@dataclass
class GenerateEntry:
    path: str
    names: tuple[str, ...]
    args: argparse.Namespace  # the engine flags, as `stoker serve` would have parsed them


@dataclass
class ServeConfig:
    generate: GenerateEntry | None = None
    pooling: list[Any] = field(default_factory=list)  # PoolingModelSpec

    @property
    def names(self) -> list[str]:
        return [*(self.generate.names if self.generate else ()), *(n for s in self.pooling for n in s.names)]


def _check_value(where: str, key: str, action: argparse.Action, value: Any) -> Any:
    """`value` as the flag would have parsed it, or ConfigError naming the key."""
    def fail(what: str) -> ConfigError:
        return ConfigError(f"{where}: {key}: {what}, got {value!r}")

    def scalar(v: Any) -> Any:
        if v is None and action.default is None and action.nargs is None:
            return None
        typ = action.type or str
        if typ is int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise fail("must be an integer")
        elif typ is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise fail("must be a number")
            v = float(v)
        elif typ is str:
            if not isinstance(v, str):
                raise fail("must be a string")
        else:
            v = typ(str(v))
        if action.choices is not None and v not in action.choices:
            raise fail(f"must be one of {', '.join(map(str, action.choices))}")
        return v

    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise fail("must be true or false")
        return value
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not items:
            raise fail("must name at least one value")
        return [scalar(v) for v in items]
    return scalar(value)


def _names(where: str, entry: dict[str, Any]) -> tuple[str, ...]:
    value = entry.get("served_model_name", entry["path"])
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(n, str) and n for n in items):
        raise ConfigError(f"{where}: served_model_name: must be a name or a list of names, got {value!r}")
    return tuple(items)


def _entry(where: str, entry: Any, kind: str, actions: dict[str, argparse.Action],
           parser: argparse.ArgumentParser, base: Path,
           in_repository: bool = False) -> tuple[str, tuple[str, ...], argparse.Namespace]:
    from stoker.pooling.config import resolve_runner

    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be a mapping of settings (path, served_model_name, ...), got {entry!r}")
    path_value = entry.get("path")
    label = f"{where} (model {entry.get('served_model_name', path_value)!r})" if path_value else where
    if not isinstance(path_value, str) or not path_value:
        raise ConfigError(f"{label}: path: required, the model's checkpoint folder")
    unknown = sorted(k for k in entry if k not in actions and k not in _COMMON)
    if unknown:
        common = [k for k in _COMMON if k != "path"] if in_repository else list(_COMMON)  # a serve.yaml has no path
        allowed = ", ".join([*common, *sorted(actions)])
        raise ConfigError(f"{label}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(str, unknown))} "
                          f"(a {kind} model takes: {allowed})")
    names = _names(label, entry)
    path = Path(path_value).expanduser()
    if not path.is_absolute():
        path = base / path  # relative to the config file
    if path.suffix.lower() == ".gguf":  # a llama.cpp file (models/gguf_loader.py): a generative model
        if not path.is_file():
            raise ConfigError(f"{label}: path: {path}: no such GGUF file")
    elif not (path / "config.json").is_file():
        raise ConfigError(f"{label}: path: {path}: no config.json; give a Hugging Face checkpoint folder or a .gguf file")
    runner = entry.get("runner", "auto")
    if runner not in ("auto", kind):
        raise ConfigError(f"{label}: runner: must be auto or {kind} in the {where.split('[')[0]} section, got {runner!r}")
    if resolve_runner(path, runner) != kind:
        other = "pooling" if kind == "generate" else "generate"
        raise ConfigError(f"{label}: path: {path} is a {other} model; list it under `{other}`"
                          + (", or set runner: pooling" if kind == "pooling" else ""))
    ns = parser.parse_args([])
    for key, value in entry.items():
        if key in actions:
            setattr(ns, key, _check_value(label, key, actions[key], value))
    return str(path), names, ns


REPOSITORY_SETTINGS = "serve.yaml"  # a model's settings in a model repository folder


def _read_yaml(file: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(file.read_text())
    except OSError as exc:
        raise ConfigError(f"--config {file}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {file}: not valid YAML: {exc}") from exc


def _model_folder(sub: Path) -> Path:
    """The checkpoint a repository entry serves: itself, or its highest numbered version."""
    if (sub / "config.json").is_file():
        return sub
    try:
        versions = [v for v in sub.iterdir() if v.name.isdigit() and (v / "config.json").is_file()]
    except OSError as exc:
        raise ConfigError(f"--config {sub}: {exc.strerror or exc}") from exc
    if not versions:
        raise ConfigError(f"--config {sub.parent}: {sub.name}: no config.json in it nor in a numbered version "
                          "folder (1/, 2/...); each subfolder of a model repository is one Hugging Face checkpoint")
    return max(versions, key=lambda v: int(v.name))


def repository_config(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model repository folder as the mapping a models.yaml holds (see the module docstring),
    and what each entry is called in errors (its serve.yaml, or its folder)."""
    from stoker.pooling.config import resolve_runner

    raw: dict[str, Any] = {"pooling": []}
    labels: dict[str, Any] = {"pooling": []}
    generative: list[str] = []
    try:
        subfolders = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError as exc:
        raise ConfigError(f"--config {folder}: {exc.strerror or exc}") from exc
    for sub in subfolders:
        settings_file = sub / REPOSITORY_SETTINGS
        settings = _read_yaml(settings_file) if settings_file.is_file() else {}
        if settings is None:
            settings = {}  # an empty file
        if not isinstance(settings, dict):
            raise ConfigError(f"--config {settings_file}: must be a mapping of settings (served_model_name, "
                              f"max_batch_size, ...), got {settings!r}")
        if "path" in settings:
            raise ConfigError(f"--config {settings_file}: path: not taken here, the model is its folder {sub}")
        path = _model_folder(sub)
        entry = {"path": str(path), "served_model_name": sub.name, **settings}
        runner = entry.get("runner", "auto")
        try:
            kind = resolve_runner(path, runner if isinstance(runner, str) else repr(runner))
        except ValueError as exc:
            raise ConfigError(f"--config {settings_file}: runner: {exc}") from exc
        label = str(settings_file if settings_file.is_file() else sub)
        if kind == "generate":
            generative.append(sub.name)
            raw["generate"], labels["generate"] = entry, label
        else:
            raw["pooling"].append(entry)
            labels["pooling"].append(label)
    if not generative and not raw["pooling"]:
        raise ConfigError(f"--config {folder}: a model repository with no model folder in it (one subfolder per "
                          "model, named as it is served)")
    if len(generative) > 1:
        raise ConfigError(f"--config {folder}: holds {len(generative)} generative models ({', '.join(generative)}); "
                          "a server serves at most one (set runner: pooling in a serve.yaml if one is an embedder)")
    return raw, labels


def load_serve_config(file: str | Path) -> ServeConfig:
    """Read and check a models.yaml or a model repository folder; ConfigError (a ValueError)
    names the key and the model."""
    file = Path(file)
    labels: dict[str, Any] | None = None  # a repository's: each entry named by its serve.yaml or folder
    if file.is_dir():
        raw, labels = repository_config(file)
        base = file.resolve()
    else:
        raw = _read_yaml(file)
        base = file.resolve().parent
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {file}: must be a mapping with `generate` and/or `pooling`")
    unknown = sorted(str(k) for k in raw if k not in ("generate", "pooling"))
    if unknown:
        raise ConfigError(f"--config {file}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                          "(the file takes: generate (one model), pooling (a list of models))")
    out = ServeConfig()
    gen = raw.get("generate")
    if gen is not None:
        if isinstance(gen, list):
            raise ConfigError(f"--config {file}: generate: at most one generative model (a mapping, not a list)")
        parser = _engine_parser()
        where = labels["generate"] if labels else "generate"
        path, names, ns = _entry(where, gen, "generate", _actions(parser), parser, base, labels is not None)
        out.generate = GenerateEntry(path, names, ns)
    pooling = raw.get("pooling") or []
    if not isinstance(pooling, list):
        raise ConfigError(f"--config {file}: pooling: must be a list of models, got {type(pooling).__name__}")
    from stoker.server.pooling.cli import pooling_spec

    parser = _pooling_parser()
    actions = _actions(parser)
    for i, entry in enumerate(pooling):
        where = labels["pooling"][i] if labels else f"pooling[{i}]"
        path, names, ns = _entry(where, entry, "pooling", actions, parser, base, labels is not None)
        try:
            out.pooling.append(pooling_spec(ns, path, names))
        except ValueError as exc:  # the batcher's own checks, in flag form: say which model
            raise ConfigError(f"{where} (model {names[0]!r}): {exc}") from exc
    if out.generate is None and not out.pooling:
        raise ConfigError(f"--config {file}: names no model (give `generate` and/or `pooling`)")
    seen: set[str] = set()
    for name in out.names:
        if name in seen:
            raise ConfigError(f"--config {file}: served_model_name {name!r} is served by two models; names must be unique")
        seen.add(name)
    return out


# Flags that describe one model: with --config they belong in the file.
def per_model_flags() -> set[str]:
    return set(_actions(_engine_parser())) | set(_actions(_pooling_parser())) | {"runner", "served_model_name"}


def refuse_flags_with_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """MODEL_DIR or a per-model flag next to --config: refused, naming them."""
    if args.model_dir is not None:
        raise ConfigError(f"MODEL_DIR ({args.model_dir}) and --config both name models: give the models in the "
                          "config file alone")
    defaults = vars(parser.parse_args([]))
    given = sorted(k for k in per_model_flags() if k in defaults and getattr(args, k, None) != defaults[k])
    if given:
        names = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ConfigError(f"{names}: with --config each model's settings go in the config file "
                          "(the same names, e.g. max_model_len: 4096 under its model)")
