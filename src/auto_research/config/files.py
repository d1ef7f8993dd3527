"""Settings in a file (``--config run.yaml``, or JSON): any field by its flag name, checked like a flag.

A key is a flag without its dashes (``learning-rate``, ``ppo-epochs``); a flag that switches something
off (``--no-chat-template``) is written as its setting (``chat-template: false``); underscores may stand for
dashes. A key no command takes is refused with the nearest one it does take, a value of the wrong type
with what was expected, and a file that is not YAML with the line and column of the mistake.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import fields
from pathlib import Path

from auto_research.config.fields import flag_of
from auto_research.errors import UserError
from auto_research.files import atomic_write_json, atomic_write_text


def key_of(item) -> str:
    """A field's key in a config file."""
    flag = flag_of(item)[2:]
    action = item.metadata.get("options", {}).get("action")
    return item.name.replace("_", "-") if action == "store_false" else flag


def _flagged(classes) -> dict[str, object]:
    """key → field, for every field with a flag in ``classes`` (the first class that has a name wins)."""
    found = {}
    for cls in classes:
        for item in fields(cls):
            if item.metadata.get("section") is not None:
                found.setdefault(key_of(item), item)
    return found


def _expected(annotation: str) -> tuple[set, bool]:
    """The JSON kinds a field takes (str, int, float, bool, list), and whether null is allowed, from its
    annotation as written (``int | None``, ``list[str]``, ``Path``)."""
    kinds, nullable = set(), False
    names = {"str": str, "Path": str, "int": int, "float": float, "bool": bool}
    for part in (piece.strip() for piece in str(annotation).split("|")):
        if part == "None":
            nullable = True
        elif part.startswith("list"):
            kinds.add(list)
        elif part in names:
            kinds.add(names[part])
    return kinds, nullable


def _check_type(where: str, key: str, value, item):
    kinds, nullable = _expected(item.type)
    if value is None:
        if nullable:
            return None
        raise UserError(f"{where}: {key} cannot be null")
    if bool in kinds and isinstance(value, bool):
        return value
    if float in kinds and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if int in kinds and isinstance(value, int) and not isinstance(value, bool):
        return value
    if str in kinds and isinstance(value, str):
        return Path(value) if "Path" in str(item.type) else value
    if list in kinds and isinstance(value, list):
        return value
    if list in kinds and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        parse = item.metadata.get("options", {}).get("type")  # a comma-separated flag's own parser, else one item
        return parse(str(value)) if parse else [value]
    names = {bool: "true or false", int: "an integer", float: "a number", str: "text", list: "a list"}
    wanted = " or ".join(names[kind] for kind in (bool, int, float, str, list) if kind in kinds)
    raise UserError(f"{where}: {key} must be {wanted}, got {json.dumps(value)}")


def takes(item, value) -> bool:
    """Whether the field ``item`` (made by ``setting``) takes ``value`` as it is (a list for a list field, a number
    for a number...)."""
    try:
        _check_type("", item.name, value, item)
    except UserError:
        return False
    return True


def _parse(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as error:
        raise UserError(f"--config {path}: cannot read ({error.strerror or error})") from None
    if path.suffix == ".json":
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as error:
            raise UserError(f"--config {path}: not valid JSON at line {error.lineno}, column {error.colno} "
                            f"({error.msg})") from None
    else:
        import yaml  # here only: a run without --config never needs it

        try:
            payload = yaml.safe_load(text)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise UserError(f"--config {path}: not valid YAML{where} ({problem})") from None
    if payload is None:
        return {}
    if not isinstance(payload, dict):
        raise UserError(f"--config {path}: expected a mapping of settings (key: value), got {type(payload).__name__}")
    return payload


def read_config_file(path: str | Path, classes, trl_names: bool = False) -> dict:
    """The file's settings as field name → value, for the dataclasses ``classes`` (a command's settings).

    With ``trl_names``, a key that is TRL's name for one of ours (``num_generations``, ``config/trl.py``) sets
    ours, exactly; a TRL field we have no equivalent for is refused in one line, and so is a TRL key that sets a
    setting the file also sets differently under our name. A key spelled as both ours and TRL's (``beta``) is
    ours, unless its value only makes sense as TRL's (``warmup_steps: 0.1``, ``report_to: [wandb]``)."""
    path = Path(path)
    where = f"--config {path}"
    known = _flagged(classes)
    settings, trl_settings = {}, {}
    for raw_key, value in _parse(path).items():
        key = str(raw_key).replace("_", "-")
        item = known.get(key)
        trl_name = key.replace("-", "_")
        if item is not None:
            try:
                settings[item.name] = _check_type(where, key, value, item)
                continue
            except UserError:
                if not (trl_names and _is_trl(trl_name)):
                    raise
        if trl_names and _is_trl(trl_name):
            trl_settings[trl_name] = value
            continue
        names = list(known) + ([name.replace("_", "-") for name in _trl_names()] if trl_names else [])
        nearest = difflib.get_close_matches(key, names, n=1)
        hint = f"; did you mean {nearest[0]}?" if nearest else ""
        raise UserError(f"{where}: unknown key {raw_key!r}{hint}")
    return {**settings, **_from_trl(where, trl_settings, settings, known)} if trl_settings else settings


def _is_trl(name: str) -> bool:
    from auto_research.config import trl

    return trl.is_trl_name(name)


def _trl_names() -> list[str]:
    from auto_research.config import trl

    return trl.trl_names()


def _from_trl(where: str, trl_settings: dict, settings: dict, known: dict) -> dict:
    """A file's TRL keys as our settings, each type-checked as ours; a clash with the file's own keys refused."""
    from auto_research.config import trl

    try:
        translated = trl.translate(trl_settings)
    except UserError as error:
        raise UserError(f"{where}: {error}") from None
    by_name = {item.name: (key, item) for key, item in known.items()}
    for name, value in list(translated.items()):
        if name in by_name:
            key, item = by_name[name]
            translated[name] = _check_type(where, key, value, item)
            if name in settings and settings[name] != translated[name]:
                raise UserError(f"{where}: {key} is {settings[name]!r}, and a TRL key sets it to {value!r}: give one")
    return translated


def config_payload(config) -> dict:
    """A config dataclass as a config file's mapping (every field with a flag, by its key)."""
    payload = {}
    for item in fields(config):
        if item.metadata.get("section") is None:
            continue
        value = getattr(config, item.name)
        payload[key_of(item)] = str(value) if isinstance(value, Path) else value
    return payload


def write_config_file(path: str | Path, config) -> Path:
    """The config as JSON (a child run's settings; JSON is YAML too)."""
    return atomic_write_json(path, config_payload(config))


RUN_CONTROL = ("resume", "overwrite")
"""Keys a resolved config leaves out: they say what to do with an existing folder, not what the run is."""


def resolved_settings(config) -> dict:
    """The settings that say what a run is (its config.yaml, and the config the trackers are given)."""
    return {key: value for key, value in config_payload(config).items() if key not in RUN_CONTROL}


def write_resolved_config(path: str | Path, config) -> Path:
    """The run's settings after the dataset's presets filled the unset ones, as YAML: ``--config <run>/config.yaml``
    runs the same again (flags given beside it win)."""
    import yaml  # noqa: PLC0415

    payload = resolved_settings(config)
    header = "# The resolved settings of this run; rerun with: auto-research post-train --config <this file>\n"
    return atomic_write_text(path, header + yaml.safe_dump(payload, sort_keys=False, allow_unicode=True))
