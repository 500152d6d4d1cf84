"""User-error formatting for the CLI: parser errors and wrapped ``ValueError``s become the one
line documented in docs/bad_inputs.md."""

from __future__ import annotations

import difflib
import importlib
import os
import pkgutil
import re
import stat
from pathlib import Path

import lightning.pytorch as pl

import datamodules
import heads
import tasks


def check_config_files(argv: list[str]) -> None:
    """Refuse, before anything is built, what the parser would hang on or misread: a ``--config``
    file or a YAML file given as an option's value (``--trainer trainer.yaml``) that
    :func:`read_config_file` refuses, an option's value that is a FIFO, device or socket (reading
    it blocks or never ends), and an option's inline YAML with a recursive or exploding alias or a
    key given twice (``--trainer '&a {x: *a}'``). A missing file is left to the parser, which names it."""
    for position, arg in enumerate(argv):
        if arg.startswith("--") and "=" in arg:
            option, _, value = arg.partition("=")
        elif (arg.startswith("--") or arg == "-c") and position + 1 < len(argv) and not argv[position + 1].startswith("--"):
            option, value = arg, argv[position + 1]
        else:
            continue
        option = "--config" if option == "-c" else option
        if os.path.exists(value):
            mode = os.stat(value).st_mode
            if option == "--config" or Path(value).suffix.lower() in (".yaml", ".yml", ".json"):
                read_config_file(value)
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)) and option != "--ckpt_path":
                kind = next((name for is_kind, name in _FILE_KINDS if is_kind(mode)), "special file")
                raise ValueError(f"{option} {value} is a {kind}, not a regular file or directory: pass the path of a file")
        elif option != "--config" and any(mark in value for mark in "&{["):
            check_yaml_structure(value, option, "option")


#: What a path that is not a regular file is, by the ``stat`` test that recognises it.
_FILE_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)

#: Values a config file's aliases may add when expanded. An alias repeats the whole value it
#: names, so aliases of aliases multiply (the "billion laughs" file) and the parser walks every
#: repetition, while a real config repeats a few sections at most.
MAX_ALIAS_EXPANSION = 100_000


def read_config_file(path: str) -> str:
    """The text of YAML config file ``path``, refused in one line naming the file, the rule and the
    fix when it is not a regular file (a FIFO or a device would block or never end, a directory
    has no text), not UTF-8, or not a plain tree of values (:func:`check_yaml_structure`)."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = next((name for is_kind, name in _FILE_KINDS if is_kind(mode)), "special file")
        raise ValueError(
            f"config file {path} is a {kind}, not a regular file: pass the path of a YAML file such as configs/lm/synthetic.yaml"
        )
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"config file {path} cannot be read ({error.strerror}): check its permissions") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"config file {path} is not UTF-8 (byte 0x{data[error.start]:02x} at offset {error.start}); "
            f"save it as UTF-8 YAML"
        ) from None
    check_yaml_structure(text, path)
    return text


class _Collection:
    """A mapping or sequence being read in :func:`check_yaml_structure`: its anchor, where it
    stands (dotted keys), the values it holds once aliases are expanded, and (a mapping) the line
    of each key read so far."""

    def __init__(self, event: object, where: str) -> None:
        import yaml

        self.anchor, self.where = event.anchor, where
        self.is_mapping = isinstance(event, yaml.MappingStartEvent)
        self.values, self.children = 1, 0
        self.key_lines: dict[tuple, int] = {}
        self.key = ""  # a mapping's key of the value being read


def check_yaml_structure(text: str, path: str, what: str = "config file") -> None:
    """Refuse a config whose YAML would hang the parser or silently lose a setting: a recursive
    alias (``trainer: &a {x: *a}``, a value that contains itself, which the parser expands
    forever), aliases that expand to more than :data:`MAX_ALIAS_EXPANSION` values, and a key
    given twice in one mapping (YAML loaders keep the last one without a word). Read from the
    YAML event stream (no value is built); text that is not YAML is left to the parser's own
    message."""
    import yaml

    stack: list[_Collection] = []
    open_anchors: dict[str, int] = {}  # anchors of the collections being read -> their line
    anchored: dict[str, int] = {}  # anchor -> values its value holds, aliases expanded
    expanded = 0
    try:
        for event in yaml.parse(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            line = event.start_mark.line + 1
            if isinstance(event, yaml.DocumentStartEvent):
                open_anchors.clear()
                anchored.clear()
                continue
            if isinstance(event, yaml.CollectionStartEvent):
                where = ".".join(frame.key if frame.is_mapping else str(frame.children) for frame in stack)
                stack.append(_Collection(event, where))
                if event.anchor is not None:
                    open_anchors[event.anchor] = line
                continue
            if isinstance(event, yaml.CollectionEndEvent):
                done = stack.pop()
                values, anchor = done.values, done.anchor
                open_anchors.pop(anchor, None)
            elif isinstance(event, yaml.ScalarEvent):
                values, anchor = 1, event.anchor
            elif isinstance(event, yaml.AliasEvent):
                if event.anchor in open_anchors:
                    raise ValueError(
                        f"{what} {path} has a recursive alias: *{event.anchor} at line {line} repeats the value "
                        f"&{event.anchor} (line {open_anchors[event.anchor]}) that contains it, so reading it never ends; "
                        f"write the values out instead of *{event.anchor}"
                    )
                values, anchor = anchored.get(event.anchor, 1), None  # an unknown alias: the parser reports it
                expanded += values
                if expanded > MAX_ALIAS_EXPANSION:
                    raise ValueError(
                        f"{what} {path} has aliases that expand to more than {MAX_ALIAS_EXPANSION} values "
                        f"(at *{event.anchor}, line {line}): write the values out instead of repeating aliases of aliases"
                    )
            else:
                continue
            if anchor is not None:
                anchored[anchor] = values
            if stack:
                _add_child(stack, event, values, f"{what} {path}", line)
    except yaml.YAMLError:
        return


def _add_child(stack: list[_Collection], event: object, values: int, subject: str, line: int) -> None:
    """Count a value read into the collection on top of ``stack``; a mapping's scalar key is
    checked against the keys it already has."""
    import yaml

    parent = stack[-1]
    parent.values += values
    is_key = parent.is_mapping and parent.children % 2 == 0
    parent.children += 1
    if not is_key:
        return
    parent.key = str(event.value) if isinstance(event, yaml.ScalarEvent) else "?"
    if not isinstance(event, yaml.ScalarEvent) or (event.value == "<<" and event.implicit[0]):
        return  # a complex key, or a merge key (several are allowed: each merges its mapping)
    key = (event.tag, event.value, event.implicit[0])
    if key in parent.key_lines:
        dotted = ".".join(part for part in (parent.where, event.value) if part)
        first = parent.key_lines[key]
        lines = f"both on line {line}" if first == line else f"lines {first} and {line}"
        raise ValueError(
            f"{subject} sets {dotted!r} twice ({lines}), and YAML would "
            f"silently keep the last: remove one of them"
        )
    parent.key_lines[key] = line


_PROJECT_DIRS = tuple(str(Path(package.__file__).resolve().parent) + os.sep for package in (datamodules, heads, tasks)) + (
    str(Path(__file__).resolve().parent) + os.sep,
)


def raised_by_project(error: BaseException) -> bool:
    """Whether ``error`` was raised in this project's code (its traceback ends in ``app``,
    ``datamodules``, ``heads`` or ``tasks``), not in a library it called."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PROJECT_DIRS)


def error_chain(error: BaseException) -> list[BaseException]:
    """``error`` and what it wraps, outermost first, as Python's own traceback shows them: the
    explicit ``__cause__`` (``raise ... from e``), else the ``__context__`` unless the raise
    suppressed it (``from None``)."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        if current.__cause__ is not None:
            current = current.__cause__
        elif current.__suppress_context__:
            current = None
        else:
            current = current.__context__
    return chain


def root_user_error(error: BaseException) -> BaseException:
    """The one-line message a user should see for ``error``.

    jsonargparse wraps a constructor's ``ValueError`` in a multi-line Union dump (``from`` the
    original), and the project's own messages are often raised while handling a library error
    (a ``UnicodeDecodeError`` or ``JSONDecodeError``, themselves ``ValueError``s). The answer is
    the outermost one-line ``ValueError`` the project raised; the chain stops there, so what it
    replaced never shows. Without one, the outermost one-line ``ValueError`` of any origin."""
    chain = [worker_error(e) or e for e in error_chain(error)]
    one_line = [e for e in chain if isinstance(e, ValueError) and str(e).strip() and "\n" not in str(e).strip()]
    own = [e for e in one_line if raised_by_project(e) or getattr(e, "from_data_loader_worker", False)]
    return (own or one_line or [error])[0]


_WORKER_ERROR = re.compile(r"Caught \w+ in DataLoader worker process \d+\.\s*\nOriginal Traceback")


def worker_error(error: BaseException) -> ValueError | None:
    """The project's ``ValueError`` raised inside a DataLoader worker process (a missing image, a
    damaged file read lazily): torch re-raises it in the main process as a new exception whose
    message is the worker's whole traceback; this is the last line of it, the project's message."""
    text = str(error)
    if not isinstance(error, ValueError) or not _WORKER_ERROR.match(text):
        return None
    frames = re.findall(r'File "([^"]+)"', text)
    last = text.rstrip().splitlines()[-1]
    if not (frames and last.startswith("ValueError: ") and os.path.abspath(frames[-1]).startswith(_PROJECT_DIRS)):
        return None
    found = ValueError(last[len("ValueError: "):])
    found.from_data_loader_worker = True
    return found


_CLASS_PATH_PROBLEM = re.compile(r"Problem with given class_path '([^']*)':\s*\n((?:\s{6,}.*\n?)+)")
_UNKNOWN_CLASS = ("No module named", "has no attribute", "not a subclass", "does not correspond", "Unable to")
_NESTED_KEY = re.compile(r'Parser key "([^"]+)":')
_OPTION = re.compile(r"Option '([^']+)' is not accepted")
_CLASS_NAMED = re.compile(r"Problem with given class_path '([^']*)'|class_path='([^']*)'")
_NON_FINITE = ("nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity")


def _classes_before(text: str) -> list[str]:
    return [a or b for a, b in _CLASS_NAMED.findall(text)]


def _nested_path(key: str, text: str) -> str:
    """The full dotted key of the innermost argument named in ``text`` (a ``Parser key "model"``
    dump mentioning ``Parser key "head"`` then ``Parser key "num_gates"`` gives
    ``model.init_args.head.init_args.num_gates``)."""
    path = key
    for match in _NESTED_KEY.finditer(text):
        if match.start() > 0:  # not the top key itself
            path += f".init_args.{match.group(1)}"
    return path


def _innermost_block(message: str) -> str:
    """The text under the last ``Parser key`` of a dump: the lines after it that are indented
    deeper than the line holding it (the enclosing Union's other branches are not about it)."""
    last = list(_NESTED_KEY.finditer(message))[-1]
    line_start = message.rfind("\n", 0, last.start()) + 1
    indent = len(message[line_start:]) - len(message[line_start:].lstrip(" "))
    first, *rest = message[last.end():].split("\n")
    kept = [first]
    for line in rest:
        if line.strip() and len(line) - len(line.lstrip(" ")) <= indent:
            break
        kept.append(line)
    return "\n".join(kept)


def _expected_types(text: str) -> list[str]:
    names = []
    for name, choices in re.findall(r"Expected a (?:<class '([^']+)'>|typing\.Literal\[([^\]]*)\])", text):
        name = f"one of {choices}" if choices else "None" if name == "NoneType" else name.rsplit(".", 1)[-1]
        if name not in names:
            names.append(name)
    return names


def argument_error_line(message: str) -> str:
    """One line for a jsonargparse parse error (they arrive as multi-line Union dumps).

    An unknown ``model``/``data`` class path lists the classes that exist; an option a class
    does not take names the class (at any depth: a callback, a head, an optimizer); any other
    error names the full key, the value given and the types expected."""
    key_match = re.match(r'Parser key "([^"]+)":', message)
    key = key_match.group(1) if key_match else None
    not_subclass = re.search(r"does not correspond to a subclass of (\w+)", message)
    if not_subclass and key in ("model", "data"):
        given = re.search(r"Given value: (.*)", message)
        value = given.group(1).strip() if given else "?"
        inner = re.search(r"'class_path': '([^']*)'", value)
        return (
            f"{key} class_path {inner.group(1) if inner else value!r} is not a {not_subclass.group(1)}: "
            f"valid are {', '.join(available_classes(key))} (set {key}.class_path in the config or --{key})"
        )
    problem = _CLASS_PATH_PROBLEM.search(message)
    if problem and key in ("model", "data") and not _NESTED_KEY.search(problem.group(2)):
        class_path, detail = problem.group(1), " ".join(problem.group(2).split())
        if any(marker in detail for marker in _UNKNOWN_CLASS):
            valid = ", ".join(available_classes(key))
            return (
                f"unknown {key} class_path {class_path!r} ({detail}): valid are {valid} "
                f"(set {key}.class_path in the config or --{key} on the command line)"
            )
    option = _OPTION.search(message)
    if option and key is not None:
        # The class that refused the option: named just after it (a callable such as a head:
        # "Option 'x' is not accepted. Got value: Namespace(class_path='heads.Mixtape', ...)")
        # or, for a class path given directly (a task, a callback), the problem just before it.
        before = message[: option.start()]
        after = re.match(r"[^\n]*?class_path='([^']*)'", message[option.end():])
        classes = _classes_before(before)
        owner = after.group(1) if after else (classes[-1] if classes else "?")
        path = _nested_path(key, before)
        if key == "model" and owner.rsplit(".", 1)[-1] == "LightningModule":
            return (f"no task chosen before model option '{option.group(1)}': a head config composes after a task config, "
                    f"e.g. --config configs/lm/synthetic.yaml --config configs/heads/mos.yaml")
        where = f"--{path}.help {owner}"
        if path != key and classes:  # a nested class's help needs its parent chosen first
            where = f"--{key} {classes[0]} {where}"
        return f"{path} {owner}: Option '{option.group(1)}' is not accepted (see python -m app fit {where})"
    if problem and key is not None and not _NESTED_KEY.search(problem.group(2)):
        class_path, detail = problem.group(1), " ".join(problem.group(2).split())
        return f"{key} {class_path}: {detail} (see python -m app fit --{key}.help {class_path})"
    missing_file = re.search(r"File does not exist: (.*)", message)
    if key == "config" and missing_file:
        return f"config file {missing_file.group(1).strip()} does not exist (check the --config path)"
    if key is not None:
        path = _nested_path(key, message)
        inner = _innermost_block(message)
        unknown = re.search(r"Expected a dot import path string: ([A-Za-z_][\w.]*)\s*$", inner, re.MULTILINE)
        if unknown and not {"int", "float"} & set(_expected_types(inner)):
            name = unknown.group(1)
            from heads.registry import available_heads, head_class

            if path.rsplit(".", 1)[-1] in ("head", "inner") and name in available_heads():
                cls = head_class(name)
                return (f"{path} {name!r} is a head's short name, which takes no init_args: to set its arguments name its "
                        f"class, --{path} {cls.__module__.split('.')[0]}.{cls.__name__} --{path}.init_args.ARGUMENT VALUE")
            bases = re.findall(r"Subtypes: \[(.*)\]", inner) or [_BASES.get(path.rsplit(".", 1)[-1], "")]
            similar = similar_class_paths(name, bases)
            hint = f"did you mean {' or '.join(similar)}?" if similar else "give its class path, package.module.Class"
            return f"unknown class {name!r} for {path}: no class of that name can be imported; {hint} (fix --{path} or its entry in the config)"
        given = re.search(r"(?:Given|Got) value: (.*?)(?:\. Got value: .*)?$", inner, re.MULTILINE)
        value = given.group(1).strip() if given else None
        types = _expected_types(inner)
        if types:
            finite = "finite " if value is not None and value.lower() in _NON_FINITE and "float" in types else ""
            reason = f"expected {finite}{' or '.join(types)}"
        else:
            reason = " ".join(inner.split())
        shown = f" {value!r}" if value is not None else ""
        return f"invalid value{shown} for {path}: {reason} (fix --{path} or its entry in the config)"
    return " ".join(message.split())


#: The class a key's value must subclass when the parser's message does not list it.
_BASES = {"optimizer": "torch.optim.optimizer.Optimizer", "lr_scheduler": "torch.optim.lr_scheduler.LRScheduler"}


def _locate(dotted: str) -> object | None:
    """The object a dotted path names (``torch.optim.optimizer.Optimizer``), or None."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute, None)
        return found
    return None


def similar_class_paths(name: str, subtypes: list[str]) -> list[str]:
    """Class paths of loaded subclasses of the types listed in a parser dump's ``Subtypes: [...]``
    whose class name is close to ``name`` (``Mitosiss`` -> ``tasks.callbacks.Mitosis``)."""
    stack = []
    for listed in subtypes:
        for dotted in re.findall(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+", listed):
            found = _locate(dotted)
            if isinstance(found, type):
                stack.append(found)
    paths: dict[str, str] = {}
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if not any(part.startswith("_") for part in cls.__module__.split(".")) and not cls.__name__.startswith("_"):
            paths.setdefault(cls.__name__.lower(), f"{cls.__module__}.{cls.__name__}")
    close = difflib.get_close_matches(name.rsplit(".", 1)[-1].lower(), list(paths), n=2, cutoff=0.75)
    return [paths[match] for match in close]


def lightning_error_line(error: BaseException) -> str:
    """One line for Lightning's ``MisconfigurationException`` (a trainer or callback setting it
    refuses, e.g. ``--trainer.max_epochs -5``): its message names the setting and the rule."""
    text = " ".join(str(error).split()).replace("`", "")
    return f"{text} (a Lightning check: fix the trainer or callback setting it names)"


def available_classes(kind: str) -> list[str]:
    """Concrete LightningModules under ``tasks`` (kind ``model``) or LightningDataModules under
    ``datamodules`` (kind ``data``), by the shortest class path the CLI accepts."""
    package, base = (tasks, pl.LightningModule) if kind == "model" else (datamodules, pl.LightningDataModule)
    for module in pkgutil.iter_modules(package.__path__):
        try:
            importlib.import_module(f"{package.__name__}.{module.name}")
        except ImportError:  # an optional dependency missing: its classes are not offered
            continue
    found, stack = [], list(base.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__.startswith(package.__name__ + ".") and not cls.__subclasses__():
            short = f"{package.__name__}.{cls.__name__}"
            found.append(short if getattr(package, cls.__name__, None) is cls else f"{cls.__module__}.{cls.__name__}")
    return sorted(set(found))


