"""Strict YAML: PyYAML's safe loader refusing what a config never needs and a hostile file uses."""

from __future__ import annotations

import stat
from pathlib import Path

import yaml

from harness.spec.errors import HarnessError
from harness.spec.model import MAX_INT, short_repr

MAX_DEPTH = 40  # nesting levels; real configs use 4
MAX_CONFIG_BYTES = 1 << 20  # real configs are a few KB
MAX_EXPANDED_NODES = 100_000  # nodes once every alias is expanded; real configs have a few hundred


class _YamlRefused(Exception):
    def __init__(self, mark, message: str):
        super().__init__(message)
        self.mark = mark


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that also refuses what a config never needs and a hostile file uses:
    duplicate keys (silently, the last would win), deep nesting (the composer recurses), aliases
    that refer to their own node, alias bombs (a few hundred bytes expanding to gigabytes), and
    integers no consumer can hold."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._open_anchors: set[str] = set()
        self._size: dict[int, int] = {}  # id(node) -> node count once expanded
        self._total = 0  # over the documents so far

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open_anchors:
                raise _YamlRefused(event.start_mark, f"alias *{event.anchor} refers to the node that contains it")
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _YamlRefused(event.start_mark, f"nested more than {MAX_DEPTH} levels deep")
        anchor = getattr(event, "anchor", None)
        if anchor:
            self._open_anchors.add(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open_anchors.discard(anchor)
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
            self._no_duplicate_keys(node)
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        size = 1 + sum(self._size.get(id(c), 1) for c in children)
        if parent is None:  # a document's root: count every document of the file together
            self._total += size
            size = self._total
        if size > MAX_EXPANDED_NODES:
            raise _YamlRefused(node.start_mark, f"expands to more than {MAX_EXPANDED_NODES} values "
                                                f"once its aliases are expanded (an alias bomb?)")
        self._size[id(node)] = size
        return node

    @staticmethod
    def _no_duplicate_keys(node) -> None:
        seen = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            ident = (key.tag, key.value)
            if ident in seen:
                raise _YamlRefused(key.start_mark, f"duplicate key {short_repr(key.value)} "
                                                   f"(first at line {seen[ident].line + 1})")
            seen[ident] = key.start_mark

    def construct_yaml_int(self, node):
        self._no_yaml11_number(node)
        value = super().construct_yaml_int(node)
        if abs(value) > MAX_INT:
            raise _YamlRefused(node.start_mark, f"expected an integer below 2**63, got {short_repr(node.value)}")
        return value


    @staticmethod
    def _no_yaml11_number(node, octal: bool = True) -> None:
        """YAML 1.1 reads ``010`` as octal 8 and ``1:30`` as sexagesimal 90, where a reader means ten and
        a time or a ratio: refused, with the spellings that say what is meant."""
        text = node.value.replace("_", "").lstrip("+-")
        if ":" in text:
            raise _YamlRefused(node.start_mark, f"{short_repr(node.value)} is a base-60 number in YAML 1.1 "
                                                f"(1:30 reads as 90); write the number itself, or quote it for text")
        if octal and len(text) > 1 and text[0] == "0" and text[1].isdigit():
            raise _YamlRefused(node.start_mark, f"{short_repr(node.value)} is an octal number in YAML 1.1 "
                                                f"(010 reads as 8); write it without leading zeros, or quote it for text")

    def construct_yaml_float(self, node):
        self._no_yaml11_number(node, octal=False)
        return super().construct_yaml_float(node)


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)


def _where(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"


def parse_yaml(path: str) -> list:
    """The documents of a YAML file, through :class:`StrictLoader`; HarnessError naming the file and
    the place on anything it cannot read."""
    try:
        st = Path(path).stat()
        if not stat.S_ISREG(st.st_mode):
            raise HarnessError(f"{path}: expected a regular file holding a config, got "
                               f"{'a folder' if stat.S_ISDIR(st.st_mode) else 'a device, pipe or socket'}")
        if st.st_size > MAX_CONFIG_BYTES:
            raise HarnessError(f"{path}: expected a config of at most {MAX_CONFIG_BYTES >> 20} MB, "
                               f"got {st.st_size / 2**20:.1f} MB")
        with open(path, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:  # it grew since
            raise HarnessError(f"{path}: expected a config of at most {MAX_CONFIG_BYTES >> 20} MB")
    except OSError as exc:
        raise HarnessError(f"{path}: cannot read config: {exc.strerror}") from None
    except ValueError as exc:  # a NUL in the path
        raise HarnessError(f"{short_repr(path)}: cannot read config: {exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise HarnessError(f"{path}: line {line}: expected UTF-8 text, got byte 0x{data[exc.start]:02x}") from None
    try:
        return list(yaml.load_all(text, Loader=StrictLoader))
    except _YamlRefused as exc:
        raise HarnessError(f"{path}: {_where(exc.mark)}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        what = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise HarnessError(f"{path}: {_where(exc.problem_mark or exc.context_mark)}: not valid YAML: {what}") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow, anywhere in the file
        line = text[: exc.position].count("\n") + 1
        raise HarnessError(f"{path}: line {line}: not valid YAML: {exc.reason} character "
                           f"{chr(exc.character)!r} is not allowed") from None
    except (yaml.YAMLError, RecursionError, ValueError, OverflowError) as exc:
        raise HarnessError(f"{path}: not valid YAML: {short_repr(str(exc), 120)}") from None
