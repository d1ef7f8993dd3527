"""Settings in a file (``--config run.yaml``, or JSON): any field by its flag name without dashes, checked like
a flag; a switch-off flag (``--no-chat-template``) is written as its setting (``chat-template: false``). A key given
twice in one mapping (YAML and JSON parsers keep the last silently) is refused naming both lines.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

from auto_research.config import trl
from auto_research.config.fields import flag_of, flagged_fields, json_ready
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
        for item in flagged_fields(cls):
            found.setdefault(key_of(item), item)
    return found


def _expected(annotation: str) -> tuple[set, bool]:
    """The JSON kinds a field takes (str, int, float, bool, list), and whether null is allowed, from its
    annotation as written (``int | None``, ``list[str]``, ``Path``)."""
    names = {"str": str, "Path": str, "int": int, "float": float, "bool": bool}
    parts = [piece.strip() for piece in str(annotation).split("|")]
    return ({list if part.startswith("list") else names[part] for part in parts
             if part.startswith("list") or part in names}, "None" in parts)


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


class _Repeated(Exception):
    """A key given twice in one mapping of a config file: (key, first line, second line; None where unknown)."""


def _text(path: Path) -> str:
    """The file's text: UTF-8 (a byte-order mark allowed), else one line naming the first bad byte's line."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise UserError(f"--config {path}: cannot read ({error.strerror or error})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise UserError(f"--config {path}: not UTF-8 text (byte 0x{data[error.start]:02x} on line {line}); save it "
                        "as UTF-8") from None


def _json_lines(text: str, key: str) -> list[int]:
    """The lines where ``"key":`` is written (a message's pointer, not parsing)."""
    return [text.count("\n", 0, found.start()) + 1
            for found in re.finditer(re.escape(json.dumps(key)) + r"\s*:", text)]


def _parse_json(path: Path, text: str) -> tuple[object, dict]:
    def unique(pairs):
        keys = [key for key, _ in pairs]
        for key in keys:
            if keys.count(key) > 1:
                lines = _json_lines(text, key)
                raise _Repeated(key, *(lines[:2] if len(lines) > 1 else (None, None)))
        return dict(pairs)

    try:
        payload = json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as error:
        raise UserError(f"--config {path}: not valid JSON at line {error.lineno}, column {error.colno} "
                        f"({error.msg})") from None
    keys = payload if isinstance(payload, dict) else ()
    return payload, {key: next(iter(_json_lines(text, key)), None) for key in keys}


def _unique_key_loader():
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""
    import yaml  # here only: a run without --config never needs it

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *defaults": keys written beside it override
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise _Repeated(key, seen[key], key_node.start_mark.line + 1)
                    seen[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: the base constructor says so
                    break
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def _parse_yaml(path: Path, text: str) -> tuple[object, dict]:
    import yaml  # here only: a run without --config never needs it

    loader = _unique_key_loader()(text)
    try:
        node = loader.get_single_node()
        payload = None if node is None else loader.construct_document(node)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise UserError(f"--config {path}: not valid YAML{where} ({problem})") from None
    finally:
        loader.dispose()
    lines = {str(key.value): key.start_mark.line + 1 for key, _ in node.value} \
        if isinstance(node, yaml.MappingNode) else {}
    return payload, lines


def _parse(path: Path) -> tuple[dict, dict]:
    """The file's mapping of settings, and the line of each key (None where unknown)."""
    text = _text(path)
    try:
        payload, lines = _parse_json(path, text) if path.suffix == ".json" else _parse_yaml(path, text)
    except _Repeated as repeated:
        key, first, second = repeated.args
        raise UserError(f"--config {path}: {key!r} is given twice{_lines(first, second)}; keep one") from None
    if payload is None:
        return {}, {}
    if not isinstance(payload, dict):
        raise UserError(f"--config {path}: expected a mapping of settings (key: value), got {type(payload).__name__}")
    return payload, lines


def _lines(first: int | None, second: int | None) -> str:
    if first is None or second is None:
        return ""
    return f" (line {first})" if first == second else f" (lines {first} and {second})"


def read_config_file(path: str | Path, classes, trl_names: bool = False) -> dict:
    """The file's settings as field name → value, for the dataclasses ``classes`` (a command's settings).

    With ``trl_names``, TRL's keys too (``config/trl.py``). A key spelled as both ours and TRL's (``beta``) is
    ours, unless its value only makes sense as TRL's (``warmup_steps: 0.1``, ``report_to: [wandb]``)."""
    path = Path(path)
    where = f"--config {path}"
    known = _flagged(classes)
    payload, lines = _parse(path)
    given_as, trl_keys = {}, {}  # field name → (the key as written, the key, the field); TRL name → key as written
    for raw_key in payload:  # every key known, and each setting given once, before any value is judged
        key = str(raw_key).replace("_", "-")
        item = known.get(key)
        trl_name = key.replace("-", "_")
        if item is None and not (trl_names and trl.is_trl_name(trl_name)):
            names = list(known) + ([name.replace("_", "-") for name in trl.trl_names()] if trl_names else [])
            nearest = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {nearest[0]}?" if nearest else ""
            raise UserError(f"{where}: unknown key {raw_key!r}{hint}")
        first = given_as[item.name][0] if item is not None and item.name in given_as else trl_keys.get(trl_name)
        if first is not None:  # two spellings of one setting (learning_rate, learning-rate)
            raise UserError(f"{where}: {first!r} and {raw_key!r} both set {key}"
                            f"{_lines(lines.get(str(first)), lines.get(str(raw_key)))}; keep one")
        if item is not None:
            given_as[item.name] = (raw_key, key, item)
        trl_keys[trl_name] = raw_key
    settings, trl_settings = {}, {}
    for name, (raw_key, key, item) in given_as.items():
        value = payload[raw_key]
        if trl_names and trl.is_trl_name(key.replace("-", "_")) and not takes(item, value):
            trl_settings[key.replace("-", "_")] = value  # ours by name, TRL's by value (warmup_steps: 0.1)
        else:
            settings[name] = _check_type(where, key, value, item)
    for trl_name, raw_key in trl_keys.items():
        if known.get(trl_name.replace("_", "-")) is None:
            trl_settings[trl_name] = payload[raw_key]
    return {**settings, **_from_trl(where, trl_settings, settings, known)} if trl_settings else settings


def _from_trl(where: str, trl_settings: dict, settings: dict, known: dict) -> dict:
    """A file's TRL keys as our settings, each type-checked as ours; a clash with the file's own keys refused."""
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
    return json_ready({key_of(item): getattr(config, item.name) for item in flagged_fields(type(config))})


def write_config_file(path: str | Path, config) -> Path:
    """The config as JSON (a child run's settings; JSON is YAML too)."""
    return atomic_write_json(path, config_payload(config))


RUN_CONTROL = ("resume", "overwrite")
"""Keys a resolved config leaves out: they say what to do with an existing folder, not what the run is."""


def resolved_settings(config) -> dict:
    """The settings that say what a run is (its config.yaml, and the config the trackers are given)."""
    return {key: value for key, value in config_payload(config).items() if key not in RUN_CONTROL}


def write_resolved_config(path: str | Path, config, python_rewards=()) -> Path:
    """The run's filled settings as YAML: ``--config <run>/config.yaml`` runs the same again. ``python_rewards``:
    (name, the spec that imports it or None); one without a spec is written ``from-python:NAME``, which a rerun
    refuses until it is passed again."""
    import yaml  # noqa: PLC0415

    from auto_research.rewards.loading import FROM_PYTHON  # noqa: PLC0415

    payload = resolved_settings(config)
    header = "# The resolved settings of this run; rerun with: auto-research post-train --config <this file>\n"
    unnamed = [name for name, spec in python_rewards if spec is None]
    if python_rewards:
        payload["reward"] = [*payload["reward"], *(spec or f"{FROM_PYTHON}{name}" for name, spec in python_rewards)]
    if unnamed:
        header += (f"# reward {', '.join(f'{FROM_PYTHON}{name}' for name in unnamed)}: given from Python "
                   "(post_train(reward=...)) and not importable by name, so not rerun from here: pass it again, or "
                   "put it in a module and give --reward module:function\n")
    return atomic_write_text(path, header + yaml.safe_dump(payload, sort_keys=False, allow_unicode=True))
