"""Command-line flags made from the config dataclasses' ``setting(...)`` fields, and back into settings.

Every flag defaults to None here: given or not is what matters (an unset one takes the preset, the level's
default or ``--config``'s value). Flags given on the command line win over the file's.
"""

from __future__ import annotations

import argparse
import copy
import difflib
from dataclasses import MISSING
from pathlib import Path

from auto_research.config.fields import SECTIONS, flag_of, flagged_fields, help_group, setting_fields
from auto_research.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit status 2; a mistyped flag gets the nearest one
    (as a config file's mistyped key does)."""

    def error(self, message: str):  # type: ignore[override]
        raise UserError(message + self._nearest(message))

    def _nearest(self, message: str) -> str:
        """``; did you mean --num-generations?`` for argparse's "unrecognized arguments: --num-generaions 4"."""
        prefix = "unrecognized arguments: "
        typed = next((word.split("=", 1)[0] for word in message[len(prefix):].split() if word.startswith("--")),
                     None) if message.startswith(prefix) else None
        if typed is None:
            return ""
        options = {option for parser in [self, *_subparsers(self)] for option in parser._option_string_actions
                   if option.startswith("--") and ("_" in typed or "_" not in option)}
        nearest = difflib.get_close_matches(typed, sorted(options), n=1)
        return f"; did you mean {nearest[0]}?" if nearest else ""


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [subparser for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for subparser in action.choices.values()]


def _describe(item) -> str | None:
    """What --help says of a field's default: its ``default_text``, else the default (none: None, a switch's, [])."""
    if item.metadata.get("default_text"):
        return item.metadata["default_text"]
    default = item.default_factory() if item.default_factory is not MISSING else item.default
    return None if default is MISSING or default is None or default == [] or isinstance(default, bool) else str(default)


def add_flags(parser: argparse.ArgumentParser, cls, exclude=(), grouped: bool = False, levels: dict | None = None,
              defaults: dict | None = None) -> None:
    """One flag per field of ``cls`` made by ``setting``, in its section's group when ``grouped``. ``levels``
    ({"candidate level": CandidateConfig}) lets the help say each level's default where they differ; ``defaults``:
    the command's own default of a field (post-train's dataset)."""
    groups = {key: parser.add_argument_group(title) for key, title in SECTIONS.items()} if grouped else {}
    for item in flagged_fields(cls, exclude):
        meta = item.metadata
        options = dict(meta["options"])
        if options.pop("positional", False):
            parser.add_argument(item.name, help=meta["help"])
            continue
        options.pop("required", None)  # checked by the config's validate(): the value may come from --config
        names = [flag_of(item), *options.pop("aliases", ())]
        switch = options.get("action") in ("store_true", "store_false")
        help_text = meta["help"]
        if "(default:" not in help_text and not switch:
            shared = [(level, f) for level, other in (levels or {}).items() for f in setting_fields(other)
                      if f.name == item.name]
            if defaults and item.name in defaults:
                help_text += f" (default: {defaults[item.name]})"
            elif shared and any(_describe(f) != _describe(item) for _, f in shared):
                parts = [f"{_describe(f) or 'none'} {level}" for level, f in shared]
                help_text += f" (default: {', '.join(parts)}, {_describe(item) or 'none'} generation level)"
            elif _describe(item) is not None:
                help_text += f" (default: {_describe(item)})"
        if meta["options"].get("required"):
            help_text += " (required)"
        if not switch:
            options.setdefault("metavar", names[0].lstrip("-").upper().replace("-", "_"))
        target = groups.get(help_group(cls, item), parser) if grouped else parser
        target.add_argument(*names, dest=item.name, default=None, help=help_text, **options)


METAVARS = {"int": "N", "float": "X", "number": "X", "bool": "BOOL", "floats": "X", "texts": "NAME", "text": "TEXT"}
TRL_DEST = "trl:"
"""argparse's destination prefix of a flag under TRL's name (``config/trl.py``)."""


def add_trl_flags(parser: argparse.ArgumentParser) -> None:
    """TRL's names as flags, ``--num-generations`` and ``--num_generations`` alike (transformers' parser takes
    both), less the spellings already ours (``--beta``); the neutral ones are left out of --help."""
    from auto_research.config import trl

    taken = set(parser._option_string_actions)
    ours = [action for action in parser._actions if action.option_strings and action.dest.isidentifier()]
    group = parser.add_argument_group("TRL's names (docs/trl.md; config files take them too)")
    for name in trl.trl_names():
        spellings = [spelling for spelling in dict.fromkeys((f"--{name.replace('_', '-')}", f"--{name}"))
                     if spelling not in taken]
        if not spellings:
            continue
        kind = trl.kind_of(name)
        nargs = "+" if kind in ("floats", "texts") else "?" if kind == "bool" else None
        shown = f"TRL's {name}: {trl.MAPPED[name].ours}" if name in trl.MAPPED else argparse.SUPPRESS
        options = {"nargs": nargs, "const": "true"} if nargs == "?" else {"nargs": nargs} if nargs else {}
        group.add_argument(*spellings, dest=TRL_DEST + name, default=None, metavar=METAVARS.get(kind, "VALUE"), help=shown,
                           **options)
    for action in ours:  # ours underscored too, as transformers' parser takes them (--entropy_coef), unlisted
        spelling = action.option_strings[0].replace("-", "_").replace("__", "--", 1)
        if action.option_strings[0].startswith("--") and spelling not in parser._option_string_actions:
            alias = copy.copy(action)
            alias.option_strings, alias.help = [spelling], argparse.SUPPRESS
            parser._add_action(alias)


def trl_given(args: argparse.Namespace, cls) -> tuple[dict, dict]:
    """The TRL-named flags given: (ours, TRL's). A name that is also ours is ours when its text reads as ours
    (``--log_completions 4``), else TRL's (``--log_completions false``), as a config file's key is."""
    from auto_research.config import trl

    found = {key[len(TRL_DEST):]: value if isinstance(value, list) else [value] for key, value in vars(args).items()
             if key.startswith(TRL_DEST) and value is not None}  # name → its words
    fields_by_name = {item.name: item for item in flagged_fields(cls)}
    ours = {name: parsed for name, words in found.items()
            if (parsed := _as_ours(fields_by_name.get(name), words)) is not None}
    return ours, {name: trl.parse_flag(name, words) for name, words in found.items() if name not in ours}


def _as_ours(item, words: list[str]):
    """``words`` as our setting ``item``'s flag reads them, or None (no such setting, or not its kind of value)."""
    options = item.metadata["options"] if item is not None else {}
    if item is None or len(words) != 1 or "action" in options:
        return None
    try:
        return options.get("type", str)(words[0])
    except (ValueError, UserError):
        return None


def refuse_flag(parser: argparse.ArgumentParser, flag: str, message: str) -> None:
    """``flag`` refused in one line, ``message``, and out of --help (argparse would otherwise read it as an
    abbreviation of a longer flag, ``--api-key`` of ``--api-key-file``)."""

    class Refuse(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            raise UserError(message)

    parser.add_argument(flag, nargs="?", action=Refuse, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="settings in a YAML (or JSON) file, keys named as the flags; flags given here win")


def given(args: argparse.Namespace, cls, exclude=(), trl_names: bool = False) -> dict:
    """The settings of ``cls`` given on the command line (or in ``--config``): field name → value. With
    ``trl_names``, TRL's names too; a TRL name and ours that set one setting differently are refused."""
    from_file = getattr(args, "_from_file", {})
    settings = {item.name: from_file[item.name] for item in flagged_fields(cls, exclude) if item.name in from_file}
    from_flags = {item.name: getattr(args, item.name) for item in flagged_fields(cls, exclude)
                  if getattr(args, item.name, None) is not None}
    if not trl_names:
        return {**settings, **from_flags}
    from auto_research.config import trl

    settings.update({key: value for key, value in from_file.items() if key.startswith("_")})
    ours, theirs = trl_given(args, cls)
    from_flags = {**ours, **from_flags}
    translated = trl.translate(theirs)
    for key, value in translated.items():
        if key in from_flags and from_flags[key] != value:
            raise UserError(f"{flag_names(cls).get(key, key)} {from_flags[key]} and a TRL flag that sets it to {value} were "
                            "both given: give one")
    return {**settings, **translated, **from_flags}


def load_config_file(args: argparse.Namespace, classes, trl_names: bool = False) -> None:
    """Read ``--config`` (if given) into ``args`` for ``given`` to merge under the command line's flags."""
    args._from_file = {}
    if getattr(args, "config", None):
        from auto_research.config.files import read_config_file  # a run without --config never needs it

        args._from_file = read_config_file(args.config, classes, trl_names)


def flag_names(cls) -> dict[str, str]:
    """field name → its flag."""
    return {item.name: flag_of(item) for item in flagged_fields(cls)}
