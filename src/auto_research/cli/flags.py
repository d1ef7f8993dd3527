"""Command-line flags made from the config dataclasses: a field's name, default and help are written once, in
its ``setting(...)``; this turns them into argparse flags and back into settings.

Every flag defaults to None here: given or not is what matters (an unset one takes the dataset's preset,
the level's default, or the value from ``--config``; a candidate-level run refuses a generation-only flag
that was given). Flags given on the command line win over the file's.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from pathlib import Path

from auto_research.config.fields import SECTIONS, flag_of
from auto_research.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        raise UserError(message)


def _default_of(item):
    if item.default is not MISSING:
        return item.default
    if item.default_factory is not MISSING:
        value = item.default_factory()
        return value if not isinstance(value, list) or value else None
    return None


def _describe(item) -> str | None:
    text = item.metadata.get("default_text")
    if text:
        return text
    default = _default_of(item)
    return None if default is None or isinstance(default, bool) else str(default)


def flagged_fields(cls, exclude=()) -> list:
    return [item for item in fields(cls) if item.metadata.get("section") is not None and item.name not in exclude]


def add_flags(parser: argparse.ArgumentParser, cls, exclude=(), grouped: bool = False, levels: dict | None = None,
              defaults: dict | None = None) -> None:
    """One flag per field of ``cls`` made by ``setting``, in its section's group when ``grouped``.

    ``levels`` ({"candidate level": CandidateConfig, …}) names the other dataclasses a shared field's
    default comes from, so that the help says each level's default where they differ; ``defaults`` names
    the command's own default of a field (post-train's dataset).
    """
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
            shared = [(level, f) for level, other in (levels or {}).items() for f in fields(other) if f.name == item.name]
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
        target = groups.get(meta["section"], parser) if grouped else parser
        target.add_argument(*names, dest=item.name, default=None, help=help_text, **options)


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="settings in a YAML (or JSON) file, keys named as the flags; flags given here win")


def given(args: argparse.Namespace, cls, exclude=()) -> dict:
    """The settings of ``cls`` given on the command line (or in ``--config``): field name → value."""
    from_file = getattr(args, "_from_file", {})
    settings = {item.name: from_file[item.name] for item in flagged_fields(cls, exclude) if item.name in from_file}
    for item in flagged_fields(cls, exclude):
        value = getattr(args, item.name, None)
        if value is not None:
            settings[item.name] = value
    return settings


def load_config_file(args: argparse.Namespace, classes) -> None:
    """Read ``--config`` (if given) into ``args`` for ``given`` to merge under the command line's flags."""
    args._from_file = {}
    if getattr(args, "config", None):
        from auto_research.config.files import read_config_file  # a run without --config never needs it

        args._from_file = read_config_file(args.config, classes)


def flag_names(cls) -> dict[str, str]:
    """field name → its flag."""
    return {item.name: flag_of(item) for item in flagged_fields(cls)}
