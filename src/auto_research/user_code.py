"""The user's own code, named on the command line (``--reward``, ``--environment``, ``--tools``,
``--rollout-function``, ``--judge``, ``AUTO_RESEARCH_ENGINES``), by one loader, in two forms:

- ``module:name``: a module found from the working folder (as ``python -c`` finds it) or elsewhere on the path;
- ``path/file.py:name``: a file, whose folder goes on the import path (as ``python path/file.py`` puts it); a file
  inside a package (a folder with ``__init__.py``) is imported as that package's module, so relative imports work.

A run records each spec resolved (``resolved_spec``: a module of the working folder as its absolute file), so
``--config <run>/config.yaml`` and ``--resume`` find the same code from any folder. Light: no torch.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import sysconfig
import traceback
from pathlib import Path

from auto_research.errors import UserError, one_line

FORMS = "module:name (found from the working folder) or path/file.py:name"
_OURS_AND_LIBRARIES = tuple(os.path.join(os.path.realpath(path), "") for path in {
    str(Path(__file__).resolve().parent),
    *(sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib"))} if path)
"""Folders of code that is not the user's: this package's, the standard library's, installed packages'."""


def split_spec(spec, flag: str, forms: str = FORMS) -> tuple[str, str]:
    """``(module or file, name)`` of a spec; one line when it has not the shape of either form."""
    where, colon, name = str(spec).rpartition(":")
    if not colon or not where.strip() or not all(part.isidentifier() for part in name.split(".")):
        raise UserError(f"{flag} {spec!r}: expected {forms}, e.g. my_code:my_function")
    return where, name


def resolved_spec(spec):
    """The spec in the form that finds the same code from any working folder: a file's, or a working folder's
    module's, absolute path; any other spec (a built-in reward, an installed package's, a malformed one) as it was."""
    if not isinstance(spec, str):
        return spec
    where, colon, name = spec.rpartition(":")
    if not colon or not where.strip():
        return spec
    if where.endswith(".py"):
        return f"{os.path.abspath(os.path.expanduser(where))}:{name}"
    found = _module_file(Path.cwd(), where)
    return f"{found}:{name}" if found is not None else spec


USER_CODE_SETTINGS = ("reward", "judge", "environment", "tools", "rollout_function")
"""The run settings that name user code: a list of specs (reward), a comma-separated list (tools), or one spec."""


def resolved_settings(settings: dict) -> dict:
    """Those of ``settings`` (a config's, or a checkpoint's saved one) that name user code, each resolved: what a
    run records, and what a resumed run is compared with."""
    return {key: _resolved(key, settings[key]) for key in USER_CODE_SETTINGS if key in settings}


def _resolved(key: str, value):
    if key == "tools":  # a comma-separated list
        return value and ",".join(resolved_spec(item.strip()) for item in value.split(",") if item.strip())
    return [resolved_spec(item) for item in value] if isinstance(value, list) else resolved_spec(value)


def spec_of(function) -> str | None:
    """The spec that finds ``function`` again from any working folder: its file's absolute path (the user's code)
    or ``module:name`` (an installed package's); None where it is not importable by name (a lambda, a nested
    function, a script's or a notebook's, a callable object)."""
    module, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", None)
    if not module or not qualname or module in ("__main__", "__mp_main__", "builtins") or "<" in qualname:
        return None
    found = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not function:
        return None
    file = getattr(sys.modules[module], "__file__", None)
    if file and file.endswith(".py") and not os.path.realpath(file).startswith(_OURS_AND_LIBRARIES):
        return f"{os.path.abspath(file)}:{qualname}"  # the user's own file, from whichever folder it was imported
    return f"{module}:{qualname}"  # an installed package's


def _module_file(folder: Path, module: str) -> Path | None:
    """The source file of dotted ``module`` inside ``folder`` (``a/b.py`` or ``a/b/__init__.py``), if there is one."""
    parts = module.split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    base = folder.joinpath(*parts)
    for candidate in (base.parent / f"{parts[-1]}.py", base / "__init__.py"):
        if candidate.is_file():
            return candidate.absolute()
    return None


def _package_of(path: Path) -> tuple[Path, str]:
    """(the folder to import from, the dotted name) of a source file: inside folders with ``__init__.py`` it is
    their package's module (``pkg/sub.py`` → ``pkg.sub`` from pkg's parent)."""
    parts = [] if path.name == "__init__.py" else [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file() and folder.name.isidentifier() and folder.parent != folder:
        parts.insert(0, folder.name)
        folder = folder.parent
    return folder, ".".join(parts)


def _on_path(folder: str) -> None:
    if folder not in sys.path and not (folder == os.getcwd() and "" in sys.path):
        sys.path.insert(0, folder)


def _import_file(path: Path):
    """The module of a source file, imported once (a second flag naming the same file gets the same module). By
    its package's dotted name when nothing else holds that name; else under a name of its own."""
    folder, dotted = _package_of(path)
    _on_path(str(folder))
    if dotted and all(part.isidentifier() for part in dotted.split(".")):
        held = sys.modules.get(dotted)
        if held is None or _same_file(held, path):
            try:
                module = importlib.import_module(dotted)
            except ModuleNotFoundError as error:
                if error.name is None or not (dotted == error.name or dotted.startswith(f"{error.name}.")):
                    raise
            else:
                if _same_file(module, path):
                    return module
    # A module of the same name (the standard library's, another folder's) already answers to it.
    private = f"_user_code_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}_{path.stem}"
    if private in sys.modules:
        return sys.modules[private]
    found = importlib.util.spec_from_file_location(private, path)
    module = importlib.util.module_from_spec(found)
    sys.modules[private] = module  # dataclasses and pickle look a module up by its name
    try:
        found.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(private, None)
        raise
    return module


def _same_file(module, path: Path) -> bool:
    file = getattr(module, "__file__", None)
    return file is not None and os.path.realpath(file) == os.path.realpath(path)


def _import(flag: str, spec, where: str):
    """The module a spec names; one line for a module or file not found, a syntax error, or an exception raised
    while it is imported."""
    importlib.invalidate_caches()  # a file written since the last import (a test's, a notebook's) is seen
    try:
        if where.endswith(".py"):
            path = Path(os.path.abspath(os.path.expanduser(where)))
            if not path.is_file():
                raise UserError(f"{flag} {spec!r}: no such file {path}")
            return _import_file(path)
        _on_path(os.getcwd())
        return importlib.import_module(where)
    except UserError:
        raise
    except SyntaxError as error:
        place = f"{os.path.abspath(error.filename)}:{error.lineno}" if error.filename else where
        raise UserError(f"{flag} {spec!r}: syntax error in {place} ({error.msg})") from None
    except (Exception, SystemExit) as error:  # noqa: BLE001 - the user's module raised while it was imported
        name = error.name if isinstance(error, ModuleNotFoundError) else None  # the module itself, not one it imports
        if name is not None and (where == name or where.startswith(f"{name}.")) and not where.endswith(".py"):
            raise UserError(f"{flag} {spec!r}: cannot import module {where!r} (no {where.replace('.', '/')}.py in "
                            f"the working folder {os.getcwd()} or on the import path)") from None
        raise UserError(f"{flag} {spec!r}: importing {where} failed ({one_line(error)})") from None


def load_user_object(spec, flag: str, expected: str = "a function", forms: str = FORMS):
    """The callable a spec names, in either form; every failure (a malformed spec, an import that fails, a missing
    name, an object not callable: ``expected`` says what it should be) one line naming ``flag``."""
    where, name = split_spec(spec, flag, forms)
    found = _import(flag, spec, where)
    for part in name.split("."):
        if not hasattr(found, part):
            raise UserError(f"{flag} {spec!r}: {where} has no {name!r}")
        found = getattr(found, part)
    if not callable(found):
        raise UserError(f"{flag} {spec!r}: {name} is {type(found).__name__}, not callable ({expected})")
    return found


REGISTRATIONS = "AUTO_RESEARCH_ENGINES"
"""The environment variable naming the user's functions that register pieces of their own (rollout engines,
``engine/samplers.register``): ``module:function`` or ``path/file.py:function``, comma-separated. A child process
(a torchrun rank, a rollout server) inherits it, so it knows the same pieces."""


def call_registrations(variable: str = REGISTRATIONS) -> None:
    """Call each function ``variable`` names, with no arguments (the command line does, before it reads a
    setting); every failure one line naming the variable."""
    for spec in filter(None, map(str.strip, os.environ.get(variable, "").split(","))):
        function = load_user_object(spec, variable, "a function that registers")
        try:
            function()
        except Exception as error:  # noqa: BLE001 - the user's code: one line, where it raised
            raise UserError(f"{variable} {spec!r}: {one_line(error)}{where_raised(error)}") from None


last_traceback: str | None = None
"""The whole traceback of the last exception ``where_raised`` described (``--verbose`` prints it before the one line
that ends the run; recipes/post_train.py)."""


def where_raised(error: BaseException) -> str:
    """`` (at file.py:12, in name)``: the innermost frame of ``error``'s traceback in the user's own code, for the
    one line that reports it; empty when there is none. Keeps the whole traceback for ``--verbose``."""
    global last_traceback
    frames = traceback.extract_tb(error.__traceback__)
    last_traceback = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
    own = [frame for frame in frames if not frame.filename.startswith("<")
           and not os.path.realpath(frame.filename).startswith(_OURS_AND_LIBRARIES)]
    if not own:
        return ""
    path = os.path.abspath(own[-1].filename)
    shown = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    return f" (at {shown}:{own[-1].lineno}, in {own[-1].name})"

