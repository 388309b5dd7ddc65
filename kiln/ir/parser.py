"""Reads the canonical text form printed by :mod:`kiln.ir.printer` back into a :class:`Graph`.

Guarantee: ``str(parse(str(g))) == str(g)`` for every graph ``g``.  The text is parsed in one
pass and built through the ordinary :class:`Graph` builders, so inference runs on every node
and the result types written in the text must equal the inferred ones.  Value names are kept
exactly as written, constants included (equal constants are not merged).  A value name is
bare (``%x``, ``%12``, ``%fc1.weight``) or, when it is anything else -- names taken from
PyTorch such as ``0.weight`` or a ``ModuleDict`` key -- a JSON string (``%"0.weight"``).

Every malformed input raises :class:`~kiln.ir.errors.ParseError` with the 1-based line and
column of the offending token.  Whitespace and line breaks are insignificant; ``#`` starts a
comment that runs to the end of the line.

Grammar (``[x]`` optional, ``x*`` repeated, ``|`` alternatives)::

    graph     := "graph" @name "(" [decl ("," decl)*] ")" ["params" "(" [decl ("," decl)*] ")"]
                 ["sizes" "(" [name ":" "[" int "," (int | inf) "]" ...] ")"]
                 "{" stmt* "return" [%v ("," %v)*] "}"
    decl      := %name ":" type                        (%"any name": JSON-quoted, see below)
    type      := dtype "[" [dim ("," dim)*] "]"          dim := int | size
    size      := a size expression: names, ints, + - * ( ), floor(a/b), Mod, Max, Min (``2*seq``)
    stmt      := [decl ("," decl)*] "=" (const | op)
    const     := "const" (scalar | "[" [scalar ("," scalar)*] "]" | hex"<little-endian bytes>")
    op        := name "(" [%v ("," %v)*] ")" ["{" [attr ("," attr)*] "}"]
    attr      := name "=" value
    value     := int | float | inf | nan | "json string" | true | false | none | dtype
                 | "[" [value ("," value)*] "]" | graph | "size" "(" size ")"
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import OpTypeError, ParseError
from .graph import Graph, Value
from .printer import PLAIN_GRAPH_NAME
from .registry import OpDef, get_op, has_op
from .types import Dim, DType, SizeRange, TensorType, as_dim, parse_size

__all__ = ["parse"]

_NAME = r"(?:[A-Za-z_][A-Za-z0-9_.]*|[0-9]+)(?![A-Za-z0-9_.])"
_STRING = r'"(?:[^"\\\n]|\\.)*"'
_TOKEN_RE = re.compile(
    rf"""
     (?P<space>[ \t\r\n]+)
    |(?P<comment>\#[^\n]*)
    |(?P<hex>hex"[^"\n]*")
    |(?P<string>{_STRING})
    |(?P<value>%(?:{_NAME}|{_STRING}))
    |(?P<graphname>@(?:{PLAIN_GRAPH_NAME.pattern}|{_STRING}))
    |(?P<number>-?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|(?:inf|nan)(?![A-Za-z0-9_.])))
    |(?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
    |(?P<punct>[()\[\]{{}},:=])
    |(?P<op>[*+/])
    """,
    re.VERBOSE,
)
_KEYWORD_VALUES = {"true": True, "false": False, "none": None}


@dataclass(frozen=True)
class _Token:
    kind: str  # space/comment never reach the parser; "eof" ends the stream
    text: str
    offset: int


class _Lexer:
    """Turns text into tokens lazily, so the first error in reading order is the one reported."""

    def __init__(self, text: str):
        self.text = text
        self._line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
        self._tokens = self._scan()
        self.current = next(self._tokens)

    def advance(self) -> _Token:
        tok = self.current
        if tok.kind != "eof":
            self.current = next(self._tokens)
        return tok

    def position(self, offset: int) -> tuple[int, int, str]:
        """1-based line and column of ``offset`` and the text of its line."""
        line = bisect.bisect_right(self._line_starts, offset) - 1
        start = self._line_starts[line]
        end = self.text.find("\n", start)
        source = self.text[start: end if end >= 0 else len(self.text)]
        return line + 1, offset - start + 1, source.rstrip("\r")

    def error(self, message: str, offset: int) -> ParseError:
        line, col, source = self.position(offset)
        return ParseError(message, line, col, source)

    def _scan(self) -> Iterator[_Token]:
        pos, text = 0, self.text
        while pos < len(text):
            m = _TOKEN_RE.match(text, pos)
            if m is None:
                raise self.error(_bad_character(text, pos), pos)
            kind = m.lastgroup or ""
            if kind not in ("space", "comment"):
                yield _Token(kind, m.group(), pos)
            pos = m.end()
        while True:
            yield _Token("eof", "", len(text))


def _bad_character(text: str, pos: int) -> str:
    ch = text[pos]
    if ch == '"' or text.startswith('hex"', pos):
        return "unterminated string: a closing '\"' is missing on this line"
    if ch == "%":
        return ("invalid value name: bare names are letters, digits, '_' and '.' (e.g. %x, %12, "
                "%fc1.weight); quote any other name as a JSON string (e.g. %\"0.weight\")")
    if ch == "@":
        return "expected a graph name after '@'"
    return f"unexpected character {ch!r}"


def _describe(tok: _Token) -> str:
    return "end of input" if tok.kind == "eof" else repr(tok.text)


def parse(text: str) -> Graph:
    """Parse one graph in the canonical text form; raises ``ParseError`` on malformed text."""
    parser = _Parser(text)
    graph = parser.graph()
    tail = parser.lex.current
    if tail.kind != "eof":
        raise parser.lex.error(f"unexpected {_describe(tail)} after the end of the graph", tail.offset)
    return graph


class _Scope:
    """The values of one graph being parsed, by name, with where each was defined."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.values: dict[str, Value] = {}
        self.defined_at: dict[str, int] = {}


class _Parser:
    def __init__(self, text: str):
        self.lex = _Lexer(text)

    # ------------------------------------------------------------ token helpers
    def _error(self, message: str, tok: _Token) -> ParseError:
        return self.lex.error(message, tok.offset)

    def _at(self, kind: str, text: str | None = None) -> bool:
        tok = self.lex.current
        return tok.kind == kind and (text is None or tok.text == text)

    def _accept(self, kind: str, text: str | None = None) -> _Token | None:
        return self.lex.advance() if self._at(kind, text) else None

    def _expect(self, kind: str, text: str | None = None, what: str | None = None) -> _Token:
        if self._at(kind, text):
            return self.lex.advance()
        wanted = what or (repr(text) if text else kind)
        tok = self.lex.current
        raise self._error(f"expected {wanted}, got {_describe(tok)}", tok)

    def _comma_list(self, close: str, item) -> list[Any]:
        """Items separated by commas up to the punctuation ``close`` (consumed)."""
        items: list[Any] = []
        if self._accept("punct", close):
            return items
        while True:
            items.append(item())
            if self._accept("punct", close):
                return items
            self._expect("punct", ",", what=f"',' or '{close}'")

    # ------------------------------------------------------------------ graphs
    def graph(self) -> Graph:
        self._expect("ident", "graph", what="'graph'")
        name_tok = self._expect("graphname", what="a graph name such as @main")
        name = name_tok.text[1:]
        if name.startswith('"'):
            name = self._string(name_tok, name)
        scope = _Scope(Graph(name))
        self._expect("punct", "(")
        self._comma_list(")", lambda: self._signature_entry(scope, "input"))
        if self._accept("ident", "params"):
            self._expect("punct", "(")
            self._comma_list(")", lambda: self._signature_entry(scope, "param"))
        if self._accept("ident", "sizes"):
            self._expect("punct", "(")
            self._comma_list(")", lambda: self._size_range(scope))
        open_tok = self._expect("punct", "{", what="'{' to open the graph body")
        while not self._at("ident", "return"):
            tok = self.lex.current
            if tok.kind == "eof":
                raise self._unterminated(scope, open_tok, tok)
            if tok.kind == "punct" and tok.text == "}":
                raise self._error(f"graph @{name} ends without a 'return' statement", tok)
            if not (tok.kind == "value" or (tok.kind == "punct" and tok.text == "=")):
                raise self._error(
                    f"expected a definition '%name: type = ...' or 'return', got {_describe(tok)}", tok
                )
            self._statement(scope)
        self.lex.advance()
        outputs = []
        if self._at("value"):
            outputs = [self._use(scope)]
            while self._accept("punct", ","):
                outputs.append(self._use(scope))
        if self._at("eof"):
            raise self._unterminated(scope, open_tok, self.lex.current)
        self._expect("punct", "}", what="'}' after the return statement")
        scope.graph.set_outputs(outputs)
        return scope.graph

    def _unterminated(self, scope: _Scope, open_tok: _Token, at: _Token) -> ParseError:
        line, col, _ = self.lex.position(open_tok.offset)
        return self._error(
            f"unterminated graph @{scope.graph.name}: the '{{' at line {line}, column {col} "
            "is never closed; end the body with 'return ...' and '}'",
            at,
        )

    def _signature_entry(self, scope: _Scope, kind: str) -> None:
        name_tok, ttype, _ = self._declaration(scope)
        add = scope.graph.add_input if kind == "input" else scope.graph.add_param
        self._define(scope, name_tok, add(self._value_name(name_tok), ttype))

    def _declaration(self, scope: _Scope) -> tuple[_Token, TensorType, _Token]:
        """``%name: type``; checks the name is not yet defined. Returns the type's token too."""
        name_tok = self._expect("value", what="a value name such as %x")
        name = self._value_name(name_tok)
        if name in scope.defined_at:
            line, col, _ = self.lex.position(scope.defined_at[name])
            raise self._error(
                f"duplicate definition of %{name} (first defined at line {line}, column {col})",
                name_tok,
            )
        self._expect("punct", ":", what="':' and a type after the value name")
        type_tok = self.lex.current
        return name_tok, self._type(), type_tok

    def _define(self, scope: _Scope, name_tok: _Token, value: Value) -> None:
        scope.values[value.name] = value
        scope.defined_at[value.name] = name_tok.offset

    def _use(self, scope: _Scope) -> Value:
        tok = self._expect("value", what="a value such as %x")
        value = scope.values.get(self._value_name(tok))
        if value is None:
            raise self._error(
                f"use of undefined value {tok.text} in graph @{scope.graph.name} "
                "(a value must be defined before it is used)",
                tok,
            )
        return value

    # ------------------------------------------------------------------- types
    def _type(self) -> TensorType:
        tok = self._expect("ident", what="a type such as f32[2, 3]")
        try:
            dtype = DType.parse(tok.text)
        except ValueError as e:
            raise self._error(f"bad type: {e}", tok) from None
        self._expect("punct", "[", what=f"'[' and the shape after the dtype {tok.text}")
        shape = self._comma_list("]", self._dim)
        return TensorType(tuple(shape), dtype)

    def _dim(self) -> Dim:
        tok = self.lex.current
        if tok.kind in ("ident", "number", "op") or (tok.kind == "punct" and tok.text == "("):
            return self._size_expression(tok, "bad type: dimension")
        self.lex.advance()
        raise self._error(
            f"bad type: dimension {_describe(tok)} is neither a non-negative integer nor a size expression",
            tok,
        )

    def _size_expression(self, start: _Token, what: str) -> Dim:
        """Tokens up to the next ',' / ']' (or an unmatched ')') read as one size."""
        parts: list[str] = []
        depth = 0
        while True:
            tok = self.lex.current
            if tok.kind == "eof":
                break
            if tok.kind == "punct":
                if tok.text in (",", "]") and depth == 0:
                    break
                if tok.text == ")":
                    if depth == 0:
                        break
                    depth -= 1
                elif tok.text == "(":
                    depth += 1
                elif tok.text != ",":
                    break
            elif tok.kind not in ("ident", "number", "op"):
                break
            parts.append(tok.text)
            self.lex.advance()
        text = " ".join(parts)
        try:
            dim = int(text) if text.isdigit() else as_dim(parse_size(text))
        except (ValueError, TypeError) as e:
            raise self._error(f"{what} {text!r}: {e}", start) from None
        if isinstance(dim, int) and dim < 0:
            raise self._error(f"{what} {text!r} is neither a non-negative integer nor a size expression", start)
        return dim

    def _size_range(self, scope: _Scope) -> None:
        name_tok = self._expect("ident", what="a size name")
        self._expect("punct", ":", what=f"':' after the size name {name_tok.text}")
        self._expect("punct", "[", what="'[' and the range of the size")
        lo_tok = self._expect("number", what="the least value of the size")
        self._expect("punct", ",", what="',' in the size range")
        hi_tok = self._expect("number", what="the greatest value of the size, or inf")
        self._expect("punct", "]", what="']' after the size range")
        try:
            hi = None if hi_tok.text == "inf" else int(hi_tok.text)
            scope.graph.sizes[name_tok.text] = SizeRange(int(lo_tok.text), hi)
        except ValueError as e:
            raise self._error(f"bad size range: {e}", lo_tok) from None

    # -------------------------------------------------------------- statements
    def _statement(self, scope: _Scope) -> None:
        results: list[tuple[_Token, TensorType, _Token]] = []
        if self._at("value"):
            results.append(self._result_declaration(scope, results))
            while self._accept("punct", ","):
                results.append(self._result_declaration(scope, results))
        self._expect("punct", "=", what="'=' after the result declarations")
        op_tok = self._expect("ident", what="an op name or 'const'")
        if op_tok.text == "const":
            self._constant(scope, op_tok, results)
        else:
            self._node(scope, op_tok, results)

    def _result_declaration(self, scope: _Scope, earlier: list) -> tuple[_Token, TensorType, _Token]:
        name_tok = self.lex.current
        if name_tok.kind == "value" and any(self._value_name(t) == self._value_name(name_tok)
                                            for t, _, _ in earlier):
            raise self._error(f"duplicate definition of {name_tok.text} in one statement", name_tok)
        return self._declaration(scope)

    def _node(self, scope: _Scope, op_tok: _Token, results: list) -> None:
        if not has_op(op_tok.text):
            raise self._error(
                f"unknown op '{op_tok.text}': it is not declared in kiln.ir.ops "
                "(declare it with kiln.ir.defop)",
                op_tok,
            )
        opdef = get_op(op_tok.text)
        self._expect("punct", "(", what=f"'(' and the operands of {opdef.name}")
        operands = self._comma_list(")", lambda: self._use(scope))
        attrs: dict[str, Any] = {}
        if self._accept("punct", "{"):
            self._comma_list("}", lambda: self._attribute(opdef, attrs))
        types = self._infer(opdef, op_tok, operands, attrs)
        if len(types) != len(results):
            raise self._error(
                f"{opdef.name}: {len(results)} result(s) declared but inference gives "
                f"{len(types)}: {', '.join(map(str, types)) or 'none'}",
                op_tok,
            )
        for (name_tok, declared, type_tok), inferred in zip(results, types):
            if declared != inferred:
                raise self._error(
                    f"{opdef.name}: result {name_tok.text} is declared {declared} "
                    f"but inference gives {inferred}",
                    type_tok,
                )
        names = [self._value_name(t) for t, _, _ in results]
        try:
            node = scope.graph.add_node(opdef, operands, attrs, names=names)
        except (OpTypeError, ValueError) as e:  # already checked above; kept as a safety net
            raise self._error(str(e), op_tok) from None
        for (name_tok, _, _), value in zip(results, node.outputs):
            self._define(scope, name_tok, value)

    def _infer(self, opdef: OpDef, op_tok: _Token, operands: list[Value],
               attrs: dict[str, Any]) -> tuple[TensorType, ...]:
        """Run the op's attribute validation and inference; errors point at the op name."""
        input_types = [v.type for v in operands]
        try:
            norm = opdef.normalize_attrs(attrs)
            return opdef.infer_types(input_types, norm)
        except OpTypeError as e:
            problem = str(e).split(": ", 1)[-1]
            raise self._error(str(OpTypeError(opdef.name, problem, input_types)), op_tok) from None

    def _attribute(self, opdef: OpDef, attrs: dict[str, Any]) -> None:
        name_tok = self._expect("ident", what="an attribute name")
        name = name_tok.text
        if name in attrs:
            raise self._error(f"{opdef.name}: attribute '{name}' is given twice", name_tok)
        spec = opdef.attrs.get(name)
        if spec is None:
            known = ", ".join(sorted(opdef.attrs)) or "none"
            raise self._error(f"{opdef.name}: unknown attribute '{name}'; known: {known}", name_tok)
        self._expect("punct", "=", what=f"'=' after the attribute name '{name}'")
        value_tok = self.lex.current
        value = self._attr_value()
        try:
            attrs[name] = spec.coerce(opdef.name, name, value)
        except OpTypeError as e:
            raise self._error(f"bad attribute: {e}", value_tok) from None

    def _attr_value(self) -> Any:
        tok = self.lex.current
        if tok.kind == "number":
            self.lex.advance()
            return self._number(tok)
        if tok.kind == "string":
            self.lex.advance()
            return self._string(tok, tok.text)
        if tok.kind == "punct" and tok.text == "[":
            self.lex.advance()
            return tuple(self._comma_list("]", self._attr_value))
        if tok.kind == "ident" and tok.text == "graph":
            return self.graph()
        if tok.kind == "ident" and tok.text == "size":
            self.lex.advance()
            self._expect("punct", "(", what="'(' after size")
            value = self._size_expression(tok, "bad size")
            self._expect("punct", ")", what="')' after the size")
            return value
        if tok.kind == "ident" and tok.text in _KEYWORD_VALUES:
            self.lex.advance()
            return _KEYWORD_VALUES[tok.text]
        if tok.kind == "ident":
            try:
                dtype = DType.parse(tok.text)
            except ValueError:
                pass
            else:
                self.lex.advance()
                return dtype
        raise self._error(
            f"expected an attribute value (number, \"string\", true, false, none, a dtype, "
            f"[list] or graph), got {_describe(tok)}",
            tok,
        )

    # --------------------------------------------------------------- constants
    def _constant(self, scope: _Scope, const_tok: _Token, results: list) -> None:
        if len(results) != 1:
            raise self._error(f"a constant defines exactly one value, not {len(results)}", const_tok)
        name_tok, ttype, type_tok = results[0]
        if not ttype.is_static:
            raise self._error(f"bad type: constant {name_tok.text} has symbolic shape {ttype}", type_tok)
        data_tok = self.lex.current
        if data_tok.kind == "hex":
            self.lex.advance()
            data = self._hex_data(data_tok, name_tok.text, ttype)
        else:
            if self._accept("punct", "["):
                items = self._comma_list("]", self._const_scalar)
            else:
                items = [self._const_scalar()]
            data = self._list_data(data_tok, name_tok.text, ttype, items)
        value = scope.graph.add_constant(data, ttype.dtype, self._value_name(name_tok), dedup=False)
        self._define(scope, name_tok, value)

    def _const_scalar(self) -> _Token:
        tok = self.lex.current
        if tok.kind == "number" or (tok.kind == "ident" and tok.text in ("true", "false")):
            return self.lex.advance()
        hint = "; constant lists are flat and reshaped to the declared shape" if tok.text == "[" else ""
        raise self._error(
            f"expected a constant element (number, inf, nan, true or false), got {_describe(tok)}{hint}",
            tok,
        )

    def _list_data(self, at: _Token, name: str, ttype: TensorType, items: list[_Token]) -> np.ndarray:
        if len(items) != ttype.numel:
            raise self._error(
                f"constant {name}: {ttype} needs {ttype.numel} value(s), got {len(items)}", at
            )
        dtype = ttype.dtype
        values = [self._element(tok, name, dtype) for tok in items]
        with np.errstate(over="ignore"):
            if dtype.is_floating:
                return np.array(values, dtype=np.float64).astype(dtype.numpy).reshape(ttype.shape)
            return np.array(values, dtype=dtype.numpy).reshape(ttype.shape)

    def _element(self, tok: _Token, name: str, dtype: DType) -> bool | int | float:
        if dtype == DType.bool:
            if tok.text not in ("true", "false"):
                raise self._error(f"constant {name}: bool elements are true or false, got {tok.text}", tok)
            return tok.text == "true"
        if tok.kind != "number":
            raise self._error(f"constant {name}: {dtype.short} elements are numbers, got {tok.text}", tok)
        number = self._number(tok)
        if dtype.is_floating:
            return float(number)
        if not isinstance(number, int):
            raise self._error(f"constant {name}: {dtype.short} elements are integers, got {tok.text}", tok)
        info = np.iinfo(dtype.numpy)
        if not info.min <= number <= info.max:
            raise self._error(
                f"constant {name}: {number} is out of range for {dtype.short} [{info.min}, {info.max}]", tok
            )
        return number

    def _hex_data(self, tok: _Token, name: str, ttype: TensorType) -> np.ndarray:
        digits = tok.text[4:-1]
        try:
            raw = bytes.fromhex(digits)
        except ValueError:
            raise self._error(
                f"constant {name}: hex\"...\" must hold an even number of hex digits", tok
            ) from None
        if len(raw) != ttype.nbytes:
            raise self._error(
                f"constant {name}: {ttype} needs {ttype.nbytes} bytes, the hex data has {len(raw)}", tok
            )
        little = np.frombuffer(raw, dtype=ttype.dtype.numpy.newbyteorder("<"))
        return little.astype(ttype.dtype.numpy).reshape(ttype.shape)

    def _number(self, tok: _Token) -> int | float:
        try:
            if any(c in tok.text for c in ".eEn"):  # 'n' covers inf and nan
                return float(tok.text)
            return int(tok.text)
        except ValueError as e:  # e.g. an integer longer than Python converts
            raise self._error(f"bad number {tok.text[:20]!r}: {e}", tok) from None

    def _value_name(self, tok: _Token) -> str:
        """The name of a ``%name`` or ``%"quoted name"`` token."""
        text = tok.text[1:]
        return self._string(tok, text) if text.startswith('"') else text

    def _string(self, tok: _Token, quoted: str) -> str:
        try:
            return json.loads(quoted)
        except ValueError as e:
            raise self._error(f"bad string {quoted[:40]}: {e} (strings are JSON-quoted)", tok) from None

