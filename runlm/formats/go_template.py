"""Go's text/template, the language of Ollama's TEMPLATE: a parser and an interpreter for what chat templates use.

Supported: text and actions with ``{{-``/``-}}`` trimming and ``{{/* comments */}}``; pipelines with ``|``;
``.Field`` chains on the dot, on ``$`` variables and on parenthesised pipelines; ``$x :=`` and ``$x =``;
``if``/``else if``/``else``, ``range`` (over lists, maps in key order and integers, with ``$i, $v :=``,
``{{break}}``/``{{continue}}``, ``else``) and ``with``/``else with``; string, raw-string, character, number,
``true``/``false``/``nil`` literals; Go's functions (``and or not len index slice eq ne lt le gt ge print printf
println html js urlquery``) and Ollama's (``json``, ``currentDate``, ``yesterdayDate``, ``toTypeScriptType``).
``define``/``template``/``block`` are refused at parse time (no Ollama chat template uses them).

Values are Python's: dicts are Go maps (``.key`` reads a key; a missing one is ``<no value>``), ``GoStruct``
is a Go struct with a JSON form (Ollama's Tool, Message, ToolCall: ``{{ . }}`` prints that JSON, as their
``String()`` methods do), lists are slices. A render is bounded by runlm/formats/template_limits.py's
deadline and output size; the caller runs it in a template worker process like any chat template.
"""
from __future__ import annotations

import datetime as dt
import json
import re
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from runlm.formats.template_limits import _BIG_PERCENT, MAX_CHARS, RenderLimitError, check_deadline

MAX_NESTING = 64           # parentheses and blocks within blocks
MAX_RANGE_STEPS = 1 << 20  # iterations of all range loops in one render


class GoTemplateError(ValueError):
    """The template does not parse, or failed while running (Go's exec errors)."""


@dataclass(frozen=True, slots=True)
class GoStruct:
    """A Go struct value: ``fields`` by their Go names, ``json`` its encoding/json form (what it prints as)."""
    fields: Mapping[str, Any]
    json: Any = None


# --- lexing ------------------------------------------------------------------------------------------------------
_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<declare>:=)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<char>'(?:[^'\\\n]|\\.)+')
  | (?P<number>[-+]?(?:0[xX][0-9a-fA-F_]+|(?:\d[\d_]*)?\.?\d[\d_]*(?:[eE][-+]?\d+)?))
  | (?P<field>(?:\.[A-Za-z_]\w*)+)
  | (?P<dot>\.)
  | (?P<var>\$\w*)
  | (?P<ident>[A-Za-z_]\w*)
  | (?P<punct>[()|,=])
""", re.VERBOSE)


@dataclass(slots=True)
class _Tok:
    kind: str
    text: str
    glued: bool = False  # no space before it: a field chain that belongs to the operand before, as in $v.A, (x).A


def _lex_action(body: str, line: int) -> list[_Tok]:
    out, pos, glued = [], 0, False
    while pos < len(body):
        m = _TOKEN.match(body, pos)
        if m is None:
            raise GoTemplateError(f"template line {line}: unexpected {body[pos:pos + 10]!r} in an action")
        kind = m.lastgroup or ""
        if kind != "space":
            out.append(_Tok(kind, m.group(), glued))
        glued, pos = kind != "space", m.end()
    return out


_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.DOTALL)
_COMMENT = re.compile(r"\s*/\*.*?\*/\s*", re.DOTALL)


def _pieces(source: str) -> Iterator[tuple[str, str, int]]:
    """("text", text, line) and ("action", body, line) in order, with Go's trim markers applied to the text."""
    pos, trim_next = 0, False
    for m in _ACTION.finditer(source):
        text = source[pos:m.start()]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        if m.group(1):
            text = text.rstrip(" \t\r\n")
        if text:
            yield "text", text, source.count("\n", 0, pos) + 1
        line = source.count("\n", 0, m.start()) + 1
        body = m.group(2)
        if not _COMMENT.fullmatch(body):
            yield "action", body, line
        trim_next, pos = bool(m.group(3)), m.end()
    text = source[pos:]
    if trim_next:
        text = text.lstrip(" \t\r\n")
    if "{{" in text:
        raise GoTemplateError(f"template line {source.count(chr(10), 0, pos) + 1}: unclosed action")
    if text:
        yield "text", text, source.count("\n", 0, pos) + 1


# --- the tree ----------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Operand:
    kind: str                 # field, dot, var, literal, ident, pipe
    value: Any = None         # var name, literal, ident name, or a _Pipe
    chain: tuple[str, ...] = ()


@dataclass(slots=True)
class _Pipe:
    commands: list[list[_Operand]]
    decl: list[str] = field(default_factory=list)
    assign: bool = False       # $x = ... (not :=)
    line: int = 0


@dataclass(slots=True)
class _Node:
    kind: str                  # text, action, if, range, with, break, continue
    text: str = ""
    pipe: _Pipe | None = None
    body: list[_Node] = field(default_factory=list)
    orelse: list[_Node] = field(default_factory=list)


class _Parser:
    def __init__(self, source: str) -> None:
        self.items = list(_pieces(source))
        self.pos = 0
        self.depth = 0

    def parse(self) -> list[_Node]:
        nodes, end = self.list_until(())
        if end is not None:
            raise GoTemplateError(f"template line {end[1]}: unexpected {{{{{end[0]}}}}}")
        return nodes

    def list_until(self, stops: tuple[str, ...]) -> tuple[list[_Node], tuple[str, int, list[_Tok]] | None]:
        """Nodes up to one of ``stops`` (end, else): that keyword, its line and the rest of its tokens."""
        nodes: list[_Node] = []
        while self.pos < len(self.items):
            kind, text, line = self.items[self.pos]
            self.pos += 1
            if kind == "text":
                nodes.append(_Node("text", text))
                continue
            toks = _lex_action(text, line)
            if not toks:
                raise GoTemplateError(f"template line {line}: missing value for command")
            head = toks[0].text if toks[0].kind == "ident" else ""
            if head in ("end", "else"):
                if head not in stops:
                    raise GoTemplateError(f"template line {line}: unexpected {{{{{head}}}}}")
                return nodes, (head, line, toks[1:])
            if head in ("if", "range", "with"):
                nodes.append(self.block(head, toks[1:], line))
            elif head in ("break", "continue"):
                if len(toks) > 1:
                    raise GoTemplateError(f"template line {line}: unexpected tokens after {head}")
                nodes.append(_Node(head))
            elif head in ("define", "template", "block"):
                raise GoTemplateError(f"template line {line}: {{{{{head}}}}} is not supported in chat templates")
            else:
                nodes.append(_Node("action", pipe=self.pipeline(toks, line)))
        if stops:
            raise GoTemplateError("template ends before the {{end}} of a block")
        return nodes, None

    def block(self, kind: str, toks: list[_Tok], line: int) -> _Node:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise GoTemplateError(f"template line {line}: blocks nested more than {MAX_NESTING} deep")
        node = _Node(kind, pipe=self.pipeline(toks, line, allow_two=kind == "range"))
        node.body, end = self.list_until(("end", "else"))
        assert end is not None
        if end[0] == "else":
            rest = end[2]
            if rest and rest[0].kind == "ident" and rest[0].text in ("if", "with") and kind != "range":
                # {{else if x}} is {{else}}{{if x}}...{{end}} sharing this block's {{end}}
                self.depth -= 1
                node.orelse = [self.block(rest[0].text, rest[1:], end[1])]
                return node
            if rest:
                raise GoTemplateError(f"template line {end[1]}: unexpected tokens after else")
            node.orelse, end = self.list_until(("end",))
            assert end is not None
        if end[2]:
            raise GoTemplateError(f"template line {end[1]}: unexpected tokens after end")
        self.depth -= 1
        return node

    def pipeline(self, toks: list[_Tok], line: int, allow_two: bool = False) -> _Pipe:
        pipe = _Pipe([], line=line)
        # declarations: $x := / $x = / $i, $v :=
        names, i = [], 0
        while i < len(toks) and toks[i].kind == "var":
            names.append(toks[i].text)
            if i + 1 < len(toks) and toks[i + 1].text == "," and allow_two and len(names) < 2:
                i += 2
                continue
            break
        if names and i + 1 < len(toks) and toks[i + 1].kind in ("declare", "punct") and toks[i + 1].text in (":=", "="):
            pipe.decl, pipe.assign = names, toks[i + 1].text == "="
            toks = toks[i + 2:]
        if not toks:
            raise GoTemplateError(f"template line {line}: missing value for command")
        command: list[_Operand] = []
        pos = 0
        while pos < len(toks):
            tok = toks[pos]
            if tok.text == "|" and tok.kind == "punct":
                if not command:
                    raise GoTemplateError(f"template line {line}: missing command before |")
                pipe.commands.append(command)
                command = []
                pos += 1
                continue
            operand, pos = self.operand(toks, pos, line)
            command.append(operand)
        if not command:
            raise GoTemplateError(f"template line {line}: missing command after |")
        pipe.commands.append(command)
        return pipe

    def operand(self, toks: list[_Tok], pos: int, line: int) -> tuple[_Operand, int]:
        tok = toks[pos]
        pos += 1
        if tok.kind == "punct" and tok.text == "(":
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise GoTemplateError(f"template line {line}: parentheses nested more than {MAX_NESTING} deep")
            close, level = pos, 1
            while close < len(toks) and level:
                level += {"(": 1, ")": -1}.get(toks[close].text if toks[close].kind == "punct" else "", 0)
                close += 1
            if level:
                raise GoTemplateError(f"template line {line}: unclosed left paren")
            op = _Operand("pipe", self.pipeline(toks[pos:close - 1], line))
            self.depth -= 1
            pos = close
        elif tok.kind == "field":
            op = _Operand("field", chain=tuple(tok.text[1:].split(".")))
            return op, pos
        elif tok.kind == "dot":
            op = _Operand("dot")
        elif tok.kind == "var":
            op = _Operand("var", tok.text)
        elif tok.kind == "ident":
            literal = {"true": True, "false": False, "nil": None}
            op = _Operand("literal", literal[tok.text]) if tok.text in literal else _Operand("ident", tok.text)
            if tok.text not in literal and tok.text not in FUNCTIONS:
                raise GoTemplateError(f'template line {line}: function "{tok.text}" not defined')
            return op, pos
        elif tok.kind in ("string", "raw", "char", "number"):
            return _Operand("literal", _literal(tok, line)), pos
        else:
            raise GoTemplateError(f"template line {line}: unexpected {tok.text!r} in an operand")
        if pos < len(toks) and toks[pos].kind == "field" and toks[pos].glued:  # (pipe).A.B, $v.A.B
            op.chain = tuple(toks[pos].text[1:].split("."))
            pos += 1
        return op, pos


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "a": "\a", "b": "\b", "f": "\f",
            "v": "\v", "0": "\0"}


def _unquote(body: str, line: int) -> str:
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = body[i + 1:i + 2]
        if e in ("x", "u", "U"):
            n = {"x": 2, "u": 4, "U": 8}[e]
            try:
                out.append(chr(int(body[i + 2:i + 2 + n], 16)))
            except ValueError:
                raise GoTemplateError(f"template line {line}: bad escape in a string") from None
            i += 2 + n
        elif e in _ESCAPES:
            out.append(_ESCAPES[e])
            i += 2
        else:
            raise GoTemplateError(f"template line {line}: unknown escape \\{e} in a string")
    return "".join(out)


def _literal(tok: _Tok, line: int) -> Any:
    if tok.kind == "string":
        return _unquote(tok.text[1:-1], line)
    if tok.kind == "raw":
        return tok.text[1:-1]
    if tok.kind == "char":
        text = _unquote(tok.text[1:-1], line)
        if len(text) != 1:
            raise GoTemplateError(f"template line {line}: malformed character constant {tok.text}")
        return ord(text)
    text = tok.text.replace("_", "")
    try:
        if re.fullmatch(r"[-+]?(0[xX][0-9a-fA-F]+|\d+)", text):
            return int(text, 0) if not re.fullmatch(r"[-+]?0\d+", text) else int(text, 8)
        return float(text)
    except ValueError:
        raise GoTemplateError(f"template line {line}: bad number syntax: {tok.text}") from None


# --- values ------------------------------------------------------------------------------------------------------
def truth(value: Any) -> bool:
    """Go's truth: false, 0, nil and empty strings, slices and maps are false; a struct is true."""
    if isinstance(value, GoStruct):
        return True
    return bool(value)


def _encode(value: Any, ordered: bool = False) -> str:
    """encoding/json's form of a value: a plain dict is a Go map (keys sorted); a GoStruct's JSON is written in the
    order it was built in, all the way down (its builder sorts the maps inside it)."""
    if isinstance(value, GoStruct):
        return _encode(value.json, ordered=True)
    if isinstance(value, Mapping):
        keys = list(value) if ordered else sorted(value, key=str)
        return "{" + ",".join(f"{_encode(str(k))}:{_encode(value[k], ordered)}" for k in keys) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_encode(v, ordered) for v in value) + "]"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    return json.dumps(value, ensure_ascii=False)


def go_json(value: Any) -> str:
    """encoding/json's Marshal: compact, map keys sorted, <, > and & escaped as Go escapes them."""
    return _encode(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026") \
        .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _float_text(x: float) -> str:
    """fmt's %v of a float64: the shortest digits that read back, as %e when the exponent is below -4 or 6 and
    more (Go prints 1e+06 and 0.0001), else as %f without trailing zeros."""
    if x != x:
        return "NaN"
    if x in (float("inf"), float("-inf")):
        return "+Inf" if x > 0 else "-Inf"
    if x == 0:
        return "0"
    sign, digits, exponent = Decimal(repr(x)).normalize().as_tuple()
    text = "".join(map(str, digits))
    exp = len(digits) + int(exponent) - 1
    if exp < -4 or exp >= 6:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{'-' if sign else ''}{mantissa}e{'+' if exp >= 0 else '-'}{abs(exp):02d}"
    return format(Decimal(repr(x)).normalize(), "f")


def go_text(value: Any) -> str:
    """What ``{{ value }}`` prints (fmt's %v, with Ollama's types printing their JSON)."""
    if value is None:
        return "<no value>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float_text(value)
    return go_json(value)


def _sprint(args: tuple) -> str:
    """fmt.Sprint: a space between operands when neither side is a string."""
    out = []
    for i, a in enumerate(args):
        if i and not isinstance(a, str) and not isinstance(args[i - 1], str):
            out.append(" ")
        out.append("<nil>" if a is None else go_text(a))
    return "".join(out)


_VERB = re.compile(r"%([-+# 0]*)(\d*)(?:\.(\d+))?([vsdqtfgexXcboU%])")


def _sprintf(fmt: str, *args: Any) -> str:
    if _BIG_PERCENT.search(fmt):
        raise RenderLimitError("the chat template formats with a width of a million characters or more")
    it = iter(args)

    def one(m: re.Match) -> str:
        flags, width, prec, verb = m.groups()
        if verb == "%":
            return "%"
        try:
            a = next(it)
        except StopIteration:
            return f"%!{verb}(MISSING)"
        if verb in "vs":
            text = go_text(a) if a is not None else "<nil>"
        elif verb == "q":
            text = json.dumps(a if isinstance(a, str) else go_text(a), ensure_ascii=False)
        elif verb == "t":
            text = go_text(a)
        elif verb in "dxXobc" and isinstance(a, int):
            text = {"d": str(a), "x": f"{a:x}", "X": f"{a:X}", "o": f"{a:o}", "b": f"{a:b}", "c": chr(a)}[verb]
        elif verb in "fgeU" and isinstance(a, (int, float)):
            text = f"{a:.{prec or 6}{verb}}" if verb in "fe" else _float_text(float(a))
        else:
            text = f"%!{verb}({go_text(a)})"
        return text.rjust(int(width)) if width and "-" not in flags else text.ljust(int(width or 0))

    return _VERB.sub(one, fmt)


def _index(item: Any, *keys: Any) -> Any:
    for key in keys:
        if isinstance(item, Mapping):
            item = item.get(key)
        elif isinstance(item, (list, tuple, str)) and isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < len(item):
                raise GoTemplateError(f"error calling index: index out of range: {key}")
            item = item[key] if not isinstance(item, str) else ord(item[key])
        elif item is None:
            raise GoTemplateError("error calling index: index of untyped nil")
        else:
            raise GoTemplateError(f"error calling index: cannot index {type(item).__name__} with {key!r}")
    return item


def _slice(item: Any, *bounds: Any) -> Any:
    if not isinstance(item, (list, tuple, str)):
        raise GoTemplateError(f"error calling slice: can't slice item of type {type(item).__name__}")
    if len(bounds) > 3 or (len(bounds) == 3 and isinstance(item, str)):
        raise GoTemplateError("error calling slice: too many slice indexes")
    idx = [int(b) for b in bounds]
    lo = idx[0] if idx else 0
    hi = idx[1] if len(idx) > 1 else len(item)
    if not 0 <= lo <= hi <= len(item):
        raise GoTemplateError(f"error calling slice: index out of range: {lo}:{hi}")
    return item[lo:hi]


def _len(item: Any) -> int:
    if isinstance(item, (str, list, tuple, Mapping)):
        return len(item.encode() if isinstance(item, str) else item)
    raise GoTemplateError(f"error calling len: len of type {type(item).__name__}")


def _basic(a: Any) -> Any:
    if isinstance(a, GoStruct):
        raise GoTemplateError("error calling eq: non-comparable type")
    return a


def _eq(a: Any, *others: Any) -> bool:
    if not others:
        raise GoTemplateError("wrong number of args for eq: want at least 2 got 1")
    a = _basic(a)
    for b in others:
        b = _basic(b)
        if isinstance(a, (int, float)) != isinstance(b, (int, float)) and a is not None and b is not None:
            raise GoTemplateError("error calling eq: incompatible types for comparison")
        if a == b:
            return True
    return False


def _order(name: str, test: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    def compare(a: Any, b: Any) -> bool:
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) or isinstance(a, str) and isinstance(b, str):
            return test(a, b)
        raise GoTemplateError(f"error calling {name}: incompatible types for comparison")
    return compare


def _html(*args: Any) -> str:
    return (_sprint(args).replace("&", "&amp;").replace("'", "&#39;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&#34;").replace("\0", "\uFFFD"))


def _js(*args: Any) -> str:
    text = _sprint(args)
    table = {"\\": "\\\\", "'": "\\'", '"': "\\\"", "<": "\\u003C", ">": "\\u003E", "&": "\\u0026", "=": "\\u003D",
             "\n": "\\u000A", "\r": "\\u000D", "\t": "\\u0009"}
    return "".join(table.get(c, c) for c in text)


def _date(days: int) -> Callable[[], str]:
    return lambda: (dt.date.today() - dt.timedelta(days=days)).isoformat()


def _typescript(schema: Any) -> str:
    """Ollama's toTypeScriptType for a JSON-schema property: string | number | boolean | T[] | any."""
    props = schema.fields if isinstance(schema, GoStruct) else schema if isinstance(schema, Mapping) else {}
    kind = props.get("Type", props.get("type"))
    kinds = kind if isinstance(kind, list) else [kind] if kind else []
    names = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null",
             "object": "Record<string, any>"}
    out = []
    for k in kinds:
        if k == "array":
            out.append(f"{_typescript(props.get('Items', props.get('items')) or {})}[]")
        else:
            out.append(names.get(str(k), "any"))
    enum = props.get("Enum", props.get("enum"))
    if isinstance(enum, list) and enum:
        return " | ".join(json.dumps(e) for e in enum)
    return " | ".join(out) or "any"


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "len": _len, "index": _index, "slice": _slice, "not": lambda a: not truth(a),
    "eq": _eq, "ne": lambda a, b: not _eq(a, b),
    "lt": _order("lt", lambda a, b: a < b), "le": _order("le", lambda a, b: a <= b),
    "gt": _order("gt", lambda a, b: a > b), "ge": _order("ge", lambda a, b: a >= b),
    "print": lambda *a: _sprint(a), "println": lambda *a: " ".join(go_text(x) for x in a) + "\n",
    "printf": _sprintf, "html": _html, "js": _js,
    "urlquery": lambda *a: urllib.parse.quote_plus(_sprint(a)),
    "json": go_json, "currentDate": _date(0), "yesterdayDate": _date(1), "toTypeScriptType": _typescript,
    "and": lambda *a: a, "or": lambda *a: a,  # evaluated lazily by the interpreter
}


# --- running -----------------------------------------------------------------------------------------------------
class _Loop(Exception):
    def __init__(self, kind: str) -> None:
        self.kind = kind


class _Run:
    def __init__(self, root: Any) -> None:
        self.vars: list[tuple[str, Any]] = [("$", root)]
        self.steps = 0

    def lookup(self, name: str, line: int) -> Any:
        for n, v in reversed(self.vars):
            if n == name:
                return v
        raise GoTemplateError(f"template line {line}: undefined variable: {name}")

    def set(self, name: str, value: Any, line: int) -> None:
        for i in range(len(self.vars) - 1, -1, -1):
            if self.vars[i][0] == name:
                self.vars[i] = (name, value)
                return
        raise GoTemplateError(f"template line {line}: undefined variable: {name}")

    def nodes(self, nodes: list[_Node], dot: Any) -> Iterator[str]:
        mark = len(self.vars)
        try:
            for node in nodes:
                yield from self.node(node, dot)
        finally:
            del self.vars[mark:]

    def node(self, node: _Node, dot: Any) -> Iterator[str]:
        if node.kind == "text":
            yield node.text
            return
        if node.kind in ("break", "continue"):
            raise _Loop(node.kind)
        assert node.pipe is not None
        if node.kind == "action":
            value = self.pipe(node.pipe, dot)
            if not node.pipe.decl:
                yield go_text(value)
            return
        if node.kind == "range":
            yield from self.range(node, dot)
            return
        mark = len(self.vars)
        try:
            value = self.pipe(node.pipe, dot)
            if truth(value):
                yield from self.nodes(node.body, value if node.kind == "with" else dot)
            else:
                del self.vars[mark:]  # a declaration in the condition is not seen by else
                yield from self.nodes(node.orelse, dot)
        finally:
            del self.vars[mark:]

    def range(self, node: _Node, dot: Any) -> Iterator[str]:
        assert node.pipe is not None
        decl = node.pipe.decl
        value = self.pipe(node.pipe, dot, declare=False)
        if isinstance(value, Mapping):
            items = [(k, value[k]) for k in sorted(value)]
        elif isinstance(value, (list, tuple)):
            items = list(enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool):
            items = [(i, i) for i in range(max(0, min(value, MAX_RANGE_STEPS)))]
        elif value is None:
            items = []
        else:
            raise GoTemplateError(f"template line {node.pipe.line}: range can't iterate over {go_text(value)[:40]}")
        if not items:
            yield from self.nodes(node.orelse, dot)
            return
        for key, item in items:
            self.steps += 1
            if self.steps > MAX_RANGE_STEPS:
                raise RenderLimitError(f"the chat template loops more than {MAX_RANGE_STEPS} times")
            check_deadline()
            mark = len(self.vars)
            if len(decl) == 1:
                self.vars.append((decl[0], item))
            elif len(decl) == 2:
                self.vars += [(decl[0], key), (decl[1], item)]
            try:
                yield from self.nodes(node.body, item)
            except _Loop as loop:
                if loop.kind == "break":
                    break
            finally:
                del self.vars[mark:]

    def pipe(self, pipe: _Pipe, dot: Any, declare: bool = True) -> Any:
        value: Any = None
        for i, command in enumerate(pipe.commands):
            value = self.command(command, dot, pipe.line, (value,) if i else ())
        for name in pipe.decl if declare else ():
            if pipe.assign:
                self.set(name, value, pipe.line)
            else:
                self.vars.append((name, value))
        return value

    def command(self, command: list[_Operand], dot: Any, line: int, piped: tuple) -> Any:
        head = command[0]
        if head.kind == "ident":
            name = head.value
            if name in ("and", "or"):
                args = [*command[1:]]
                if not args and not piped:
                    raise GoTemplateError(f"template line {line}: wrong number of args for {name}")
                value: Any = None
                for operand in args:
                    value = self.operand(operand, dot, line)
                    if truth(value) != (name == "and"):
                        return value
                return piped[0] if piped else value
            args = [self.operand(o, dot, line) for o in command[1:]] + list(piped)
            try:
                return FUNCTIONS[name](*args)
            except GoTemplateError as exc:
                raise GoTemplateError(f"template line {line}: {exc}") from None
            except TypeError:
                raise GoTemplateError(f"template line {line}: wrong number of args for {name}") from None
        if len(command) > 1 or piped:
            raise GoTemplateError(f"template line {line}: can't give argument to non-function")
        return self.operand(head, dot, line)

    def operand(self, op: _Operand, dot: Any, line: int) -> Any:
        if op.kind == "dot":
            base = dot
        elif op.kind == "field":
            base = dot
        elif op.kind == "var":
            base = self.lookup(op.value, line)
        elif op.kind == "literal":
            base = op.value
        elif op.kind == "pipe":
            base = self.pipe(op.value, dot)
        else:  # a function named as an argument is called with no arguments
            return self.command([op], dot, line, ())
        for name in op.chain:
            base = _field(base, name, line)
        if isinstance(base, str) and len(base) > MAX_CHARS:
            raise RenderLimitError("the chat template builds too long a string")
        return base


def _field(base: Any, name: str, line: int) -> Any:
    if isinstance(base, GoStruct):
        if name not in base.fields:
            raise GoTemplateError(f"template line {line}: can't evaluate field {name}")
        return base.fields[name]
    if isinstance(base, Mapping):
        return base.get(name)
    if base is None:
        raise GoTemplateError(f"template line {line}: nil pointer evaluating .{name}")
    raise GoTemplateError(f"template line {line}: can't evaluate field {name} in type {type(base).__name__}")


@dataclass(slots=True)
class GoTemplate:
    nodes: list[_Node]

    def generate(self, data: Any) -> Iterator[str]:
        run = _Run(data)
        try:
            yield from run.nodes(self.nodes, data)
        except _Loop as loop:
            raise GoTemplateError(f"{{{{{loop.kind}}}}} outside {{{{range}}}}") from None

    def fields(self) -> set[str]:
        """Every field name the template reads (Ollama asks whether a template uses ``.Messages``)."""
        out: set[str] = set()

        def pipe(p: _Pipe) -> None:
            for command in p.commands:
                for op in command:
                    out.update(op.chain)
                    if op.kind == "pipe":
                        pipe(op.value)

        def walk(nodes: list[_Node]) -> None:
            for n in nodes:
                if n.pipe is not None:
                    pipe(n.pipe)
                walk(n.body)
                walk(n.orelse)

        walk(self.nodes)
        return out

    def cut_after_response(self) -> GoTemplate:
        """The template up to the first action that prints ``.Response``, that action included: what Ollama
        renders for the last turn of a template without ``.Messages``, so the prompt ends where the answer
        begins."""
        cut = False

        def keep(nodes: list[_Node]) -> list[_Node]:
            nonlocal cut
            out = []
            for n in nodes:
                if cut:
                    break
                if n.kind in ("if", "range", "with"):  # (a condition that reads .Response does not cut)
                    body = keep(n.body)
                    out.append(_Node(n.kind, pipe=n.pipe, body=body, orelse=[] if cut else keep(n.orelse)))
                else:
                    out.append(n)
                    if n.pipe is not None and "Response" in GoTemplate([n]).fields():
                        cut = True
            return out

        return GoTemplate(keep(self.nodes))


def parse(source: str) -> GoTemplate:
    """A parsed template; GoTemplateError names the line where it does not parse."""
    return GoTemplate(_Parser(source).parse())


# an action that opens with a field, a variable, a comment or a keyword followed by a space or the action's end
# (Jinja's ``{{ range(3) }}`` calls a function)
_GO_ACTION = re.compile(r"\{\{-?\s*(?:\.|\$|/\*|(?:range|if|with|end|else|block|define|template)(?=\s|-?\}\}))")


def looks_like_go(source: str) -> bool:
    """A Go template (Ollama's TEMPLATE) rather than a Jinja one: it has Go's actions (``{{ .X }}``, ``{{ end }}``,
    ``{{ range``...) and none of Jinja's statements (``{%``), which Go has no use for."""
    return "{%" not in source and _GO_ACTION.search(source) is not None
