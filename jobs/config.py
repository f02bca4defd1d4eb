"""One configuration system for every job: presets by name, typed `--set`, strict building, one echo.

A job's settings are one frozen dataclass tree, resolved in layers: the defaults; `--config NAME_OR_FILE`
(a preset `presets/NAME.yaml` shipped in the job's package, found through importlib.resources so a name
works from anywhere, or a YAML file); then `--set section.key=value`, each value read as YAML. Unknown or
removed keys and wrong types are refused naming the key and the source. Relative paths in a preset are
read against the current directory. This module imports nothing of the project.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

SETTINGS_FILE = "config.yaml"  # the resolved settings, saved beside every job's outputs
PRESET_SUFFIXES = (".yaml", ".yml")


class ConfigError(ValueError):
    """A user-fixable configuration problem (unknown key or preset, wrong type, impossible value)."""


@dataclasses.dataclass(frozen=True)
class RemovedKey:
    """A key an earlier version had: the value whose behaviour remains, and why the key went. A config
    dataclass lists its own as `REMOVED_KEYS: ClassVar[dict[str, RemovedKey]]`."""

    kept: Any
    why: str


@dataclasses.dataclass(frozen=True)
class Preset:
    """One shipped preset: its name, what it is for (its file's first comment line) and its settings."""

    name: str
    purpose: str
    text: str


@dataclasses.dataclass(frozen=True)
class Presets:
    """The presets of one job: the `*.yaml` files of `package`'s `folder`, shipped as package data."""

    job: str  # the command, for messages: "relicv2 pretrain"
    package: str  # importable package holding the folder: "pretrain"
    folder: str = "presets"

    def _files(self) -> dict[str, Any]:
        root = resources.files(self.package).joinpath(self.folder)
        if not root.is_dir():
            return {}
        return {Path(entry.name).stem: entry for entry in root.iterdir()
                if entry.name.endswith(PRESET_SUFFIXES) and entry.is_file()}

    def names(self) -> list[str]:
        return sorted(self._files())

    def get(self, name: str) -> Preset:
        """The preset called `name`, or a ConfigError that lists the presets."""
        entry = self._files().get(name)
        if entry is None:
            raise ConfigError(f"{self.job}: unknown preset {name!r}; {self.listing()}")
        text = entry.read_text(encoding="utf-8")
        return Preset(name, _first_comment(text), text)

    def all(self) -> list[Preset]:
        return [self.get(name) for name in self.names()]

    def listing(self) -> str:
        """One line naming every preset and what it is for."""
        items = [f"{p.name} ({p.purpose})" if p.purpose else p.name for p in self.all()]
        return ("presets: " + "; ".join(items) if items else "this job ships no presets") + \
            " (or pass a YAML file path ending in .yaml)"


def _first_comment(text: str) -> str:
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first.lstrip("#").strip().rstrip(".") if first.startswith("#") else ""


def is_file_reference(value: str | Path) -> bool:
    """Whether `--config VALUE` names a file (a path or a .yaml name) rather than a preset."""
    text = str(value)
    return isinstance(value, Path) or "/" in text or os.sep in text or text.endswith(PRESET_SUFFIXES)


def read_tree(config: str | Path | None, presets: Presets) -> tuple[dict[str, Any], str]:
    """(settings tree, where it came from) of `--config NAME_OR_FILE`; ({}, "defaults") for None."""
    if config is None:
        return {}, "defaults"
    if is_file_reference(config):
        path = Path(config)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist; pass an existing file or a preset name, "
                              f"{presets.listing()}") from None
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
            raise ConfigError(f"config file {path} cannot be read ({reason}); pass a YAML file") from None
        source, what = str(path), f"config file {path}"
    else:
        preset = presets.get(str(config))
        text, source = preset.text, f"preset {preset.name}"
        what = source
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{what} is not valid YAML: {error}") from None
    if tree is not None and not isinstance(tree, dict):
        raise ConfigError(f"{what} must hold a mapping of settings (section: or key: value lines)")
    return tree or {}, source


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`section.key=value` strings as a nested tree; each value read as YAML (empty: the empty string)."""
    tree: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form section.key=value (or key=value)")
        keys = [part.strip() for part in key.strip().split(".")]
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text  # not YAML (e.g. an unbalanced bracket): the text itself, type-checked later
        node = tree
        for section in keys[:-1]:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                raise ConfigError(f"cannot set {'.'.join(keys)}: {section} is a value, not a section")
        node[keys[-1]] = value
    return tree


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` laid on `base`, section by section (a value replaces, a mapping merges)."""
    merged = dict(base)
    for key, value in over.items():
        nested = isinstance(value, Mapping) and isinstance(merged.get(key), Mapping)
        merged[key] = merge(merged[key], value) if nested else value
    return merged


def resolve(cls: type, config: str | Path | None, overrides: Sequence[str], presets: Presets,
            *, defaults: Mapping[str, Any] | None = None, given: Mapping[str, Any] | None = None) -> Any:
    """The config of type `cls`: `defaults`, then the preset or file, then `given` (a command's own options),
    then the overrides; errors name where the value came from."""
    tree, source = read_tree(config, presets)
    if overrides:
        source = f"{source} with --set overrides" if config is not None else "--set overrides"
    tree = merge(merge(merge(defaults or {}, tree), given or {}), parse_overrides(overrides))
    return build(cls, tree, source=source)


def build(cls: type, tree: Mapping[str, Any], *, source: str = "config", prefix: str = "", saved: bool = False) -> Any:
    """An instance of the frozen dataclass `cls` from a nested mapping, strict on keys and types: missing keys
    keep their defaults, ints pass for floats, a comma-separated string for a tuple (`methods=rbd,mc`); a
    `dict` field takes a partial mapping over its default's keys. A removed key is refused with the fix, except
    in a job's own `saved` settings (a checkpoint's), where it records how that job ran and is left out."""
    if not isinstance(tree, Mapping):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'the config'} must be a mapping of keys")
    removed: Mapping[str, RemovedKey] = getattr(cls, "REMOVED_KEYS", {})
    gone = sorted(set(tree) & set(removed))
    if gone and not saved:
        raise ConfigError(f"{source}: {prefix}{gone[0]} was removed: {removed[gone[0]].why}; delete the key")
    tree = {key: value for key, value in tree.items() if key not in removed}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := sorted(set(tree) - set(fields)):
        raise ConfigError(f"{source}: unknown key {prefix}{unknown[0]}; valid keys here are: "
                          f"{', '.join(sorted(fields))}")
    values: dict[str, Any] = {}
    for name, value in tree.items():
        hint, key = hints[name], f"{prefix}{name}"
        if dataclasses.is_dataclass(hint):
            values[name] = build(hint, value or {}, source=source, prefix=f"{key}.", saved=saved)
        elif typing.get_origin(hint) is dict:
            values[name] = _mapping(value, hint, fields[name].default_factory(), key=key, source=source)
        else:
            values[name] = coerce(value, hint, key=key, source=source)
    try:
        return cls(**values)
    except ValueError as error:  # a job's own checks (ConfigError is a ValueError), named by their section
        text = str(error)
        raise ConfigError(text if text.startswith(f"{source}:") else f"{source}: {prefix}{text}") from None


def removed_settings(cls: type, tree: Mapping[str, Any], prefix: str = "") -> dict[str, tuple[Any, RemovedKey]]:
    """{dotted key: (value, its RemovedKey)} of the removed keys that saved settings of `cls` hold with
    another value than the one that remains: behaviour this version no longer has."""
    removed, hints, found = getattr(cls, "REMOVED_KEYS", {}), typing.get_type_hints(cls), {}
    for name, value in tree.items():
        if name in removed and value != removed[name].kept:
            found[f"{prefix}{name}"] = (value, removed[name])
        elif dataclasses.is_dataclass(hints.get(name)) and isinstance(value, Mapping):
            found.update(removed_settings(hints[name], value, f"{prefix}{name}."))
    return found


def _mapping(value: Any, hint: Any, allowed: dict[str, Any], *, key: str, source: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: {key} must be a mapping, got {value!r}")
    _, value_type = typing.get_args(hint)
    if allowed and (unknown := sorted(set(value) - set(allowed))):
        raise ConfigError(f"{source}: unknown key {key}.{unknown[0]}; valid keys here are: "
                          f"{', '.join(sorted(allowed))}")
    return {**allowed, **{str(k): coerce(v, value_type, key=f"{key}.{k}", source=source) for k, v in value.items()}}


def coerce(value: Any, hint: Any, *, key: str, source: str) -> Any:
    """`value` checked against a field's type hint; a ConfigError naming `key` when it does not fit."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            choices = ", ".join(repr(c) for c in typing.get_args(hint))
            raise ConfigError(f"{source}: {key} must be one of {choices}, got {value!r}")
        return value
    if origin is tuple:
        return _tuple(value, typing.get_args(hint), key=key, source=source)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (hint,) = [option for option in options if option is not type(None)]
    if hint is Path and isinstance(value, str | Path):
        return Path(value)
    if hint is float and isinstance(value, str):
        # YAML 1.1 reads "1e-3" (no dot) as a string; a number written that way is still a number.
        with contextlib.suppress(ValueError):
            value = float(value)
    # An int passes for a float; a bool, an int to Python, passes for nothing but a bool.
    ok = hint in (bool, int, float, str) and isinstance(value, int | float if hint is float else hint)
    if not ok or (isinstance(value, bool) and hint is not bool):
        name = getattr(hint, "__name__", str(hint))
        raise ConfigError(f"{source}: {key} must be of type {name}, got {value!r} ({type(value).__name__})")
    return float(value) if hint is float else value


def _tuple(value: Any, element_types: tuple[Any, ...], *, key: str, source: str) -> tuple[Any, ...]:
    if isinstance(value, str) and "," in value:  # --set methods=rbd,mc or crop_scale=0.2,1
        value = [yaml.safe_load(part) for part in value.split(",") if part.strip()]
    if len(element_types) == 2 and element_types[1] is Ellipsis:  # variadic
        value = [value] if isinstance(value, str | int | float) else value  # --set methods=rbd, severities=3
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{source}: {key} must be a list, got {value!r}")
        element_types = (element_types[0],) * len(value)
    elif not isinstance(value, list | tuple) or len(value) != len(element_types):
        raise ConfigError(f"{source}: {key} must be a list of {len(element_types)} values, got {value!r}")
    return tuple(coerce(v, t, key=f"{key}[{i}]", source=source)
                 for i, (v, t) in enumerate(zip(value, element_types, strict=True)))


def to_dict(config: Any) -> Any:
    """A dataclass (or mapping, list) as plain nested builtins, tuples as lists, paths as text (safe for YAML,
    JSON and `weights_only` loading)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, Mapping):
        return {str(k): to_dict(v) for k, v in config.items()}
    if isinstance(config, list | tuple):
        return [to_dict(v) for v in config]
    return str(config) if isinstance(config, Path) else config


def settings_text(config: Any, *, extra: Mapping[str, Any] | None = None, version: str = "") -> str:
    """The resolved settings as every job prints them at start and saves them (`SETTINGS_FILE`): YAML,
    `version` first (when given), then the config's keys, then `extra` sections (inputs, derived values)."""
    tree: dict[str, Any] = {"version": version} if version else {}
    tree.update(to_dict(config))
    tree.update(to_dict(extra or {}))
    return yaml.safe_dump(tree, sort_keys=False)

