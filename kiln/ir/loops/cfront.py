"""``from_c``: read a PolyBench-style C subset into a loop program.

Accepted input is either a sequence of declarations and statements (a "SCoP") or one
function definition ``void kernel(int n, double alpha, double A[n][n]) { ... }``, optionally
after global declarations.  Inside:

* ``for (int i = lb; i < ub; i++)``: ``<`` or ``<=``, increments ``i++``, ``++i``,
  ``i += c``, ``i = i + c`` (``c`` a positive constant), ``int`` optional; bounds may use
  ``min``/``max``/``MIN``/``MAX``/``floord``;
* ``{ ... }`` blocks, ``if (...) ... else ...``, labels ``L1: for ...`` / ``S1: A[i] = ...;``;
* assignments ``=``, ``+=`` (a ``+`` reduction), ``*=`` (a ``*`` reduction), ``-=``, ``/=``,
  ``%=`` to array elements ``A[i][j+1]`` or scalars;
* expressions: literals (``1``, ``2.5``, ``1e-3``, ``0.5f``), ``+ - * / %``, unary ``-``/``!``,
  comparisons, ``&& ||``, ``?:``, casts ``(double)x``, math calls (``sqrt``, ``exp``, ``pow``,
  ``fabs``, ... and their ``f`` variants);
* declarations ``double A[N][M];``, ``float s = 0;`` (``double``, ``float``, ``int``, ``long``,
  ``DATA_TYPE`` = ``double``).  Declarations inside a function body are ``local`` buffers.

Declared arrays (``double A[M][M]``, a parameter ``double A[n][n]``, or a shape given in
the call, ``from_c(src, shapes={"A": ("M", "M")})``) keep their declared extents; an
unconditional affine access that can leave them for some sizes is a ``ParseError`` at the
access, naming the cell, the instance and the sizes (checked with isl).  Names nobody
declared are classified by their uses: subscripted or assigned names are ``f64`` arrays
(rank from the subscripts, extents the bounding box of every access over the whole
iteration domain, computed with isl), names used in bounds or subscripts are ``i64`` size
parameters, and the other names (``alpha``) are ``f64`` scalar parameters.  Anything outside
the subset is a :class:`~kiln.ir.errors.ParseError` with line and column.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ParseError
from ..types import DType
from .expr import (
    INDEX, MATH_FUNCS, add_const, Binary, Call, Cast, Const, Expr, Load, Select, Unary, Var, free_vars, map_expr,
)
from .lexer import Token, TokenStream
from .program import Buffer, If, Loop, Node, Param, Program, Reduce, Store

_TYPES = {"double": DType.float64, "DATA_TYPE": DType.float64, "float": DType.float32,
          "int": DType.int32, "long": DType.int64, "char": DType.int8, "bool": DType.bool}
_QUALIFIERS = {"const", "static", "restrict", "__restrict", "__restrict__", "volatile", "register",
               "unsigned", "signed", "inline", "extern"}
_MINMAX = {"min": "min", "max": "max", "MIN": "min", "MAX": "max", "fmin": "min", "fmax": "max",
           "fminf": "min", "fmaxf": "max", "floord": "floordiv"}
_MATH_ALIASES = {"fabs": "abs", "fabsf": "abs", "abs": "abs", "powf": "pow"}
_PUNCTS = ("<<=", ">>=", "++", "--", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "==", "!=", "<=",
           ">=", "&&", "||", "<<", ">>", "->", "(", ")", "[", "]", "{", "}", ",", ";", ":", "?", "+", "-",
           "*", "/", "%", "<", ">", "!", "=", "&", "|", "^", "~", ".")
_BIN_PREC = {"||": 1, "&&": 2, "==": 3, "!=": 3, "<": 4, "<=": 4, ">": 4, ">=": 4, "+": 5, "-": 5,
             "*": 6, "/": 6, "%": 6}
_UNSUPPORTED_OPS = {"&", "|", "^", "<<", ">>", "~", "->", ".", "++", "--"}


@dataclass
class _Name:
    """What the source says about one identifier, to classify it at the end."""

    first: Token
    ranks: set[int] = field(default_factory=set)
    assigned: bool = False
    index_use: bool = False
    value_use: bool = False


def from_c(source: str, name: str | None = None,
           shapes: dict[str, tuple[int | str | Expr, ...]] | None = None) -> Program:
    """Parse C ``source`` (see the module docstring for the subset) into a :class:`Program`.

    ``shapes`` declares global ``f64`` arrays the source leaves undeclared, extents given as
    integers or loop-IR expressions of size parameters (``("M", "N + 1")``)."""
    parser = _CParser(source, shapes or {})
    return parser.parse(name)


class _CParser:
    def __init__(self, source: str, shapes: dict[str, tuple[int | str | Expr, ...]]):
        self.ts = TokenStream(source, puncts=_PUNCTS, hash_lines=True)
        self.given = {k: _shape(k, v) for k, v in shapes.items()}
        self.stmt_tokens: list[Token] = []
        self.accesses: list[dict[tuple[str, tuple[Expr, ...]], Token]] = []
        self.current: dict[tuple[str, tuple[Expr, ...]], Token] | None = None
        self.buffers: dict[str, Buffer] = {}
        self.params: dict[str, Param] = {}
        self.scalar_decls: dict[str, tuple[DType, Token, str]] = {}
        self.names: dict[str, _Name] = {}
        self.iterators: list[str] = []
        self.iterator_names: set[str] = set()
        self.func_name: str | None = None
        self.in_function = False

    # ============================================================ top level
    def parse(self, name: str | None) -> Program:
        ts = self.ts
        body: list[Node] = []
        while ts.peek().kind != "eof":
            if self.at_function():
                if self.func_name is not None:
                    ts.fail("only one function definition is supported", ts.peek())
                body += self.function()
            else:
                body += self.statement()
        return self.finish(name or self.func_name or "kernel", tuple(body))

    def at_function(self) -> bool:
        k = 0
        while self.ts.peek(k).text in _QUALIFIERS:
            k += 1
        t0, t1, t2 = self.ts.peek(k), self.ts.peek(k + 1), self.ts.peek(k + 2)
        return (t0.text in _TYPES or t0.text == "void") and t1.kind == "ident" and t2.text == "("

    def skip_qualifiers(self) -> None:
        while self.ts.peek().text in _QUALIFIERS:
            self.ts.next()

    def function(self) -> list[Node]:
        ts = self.ts
        self.skip_qualifiers()
        ts.next()  # return type
        self.func_name = ts.expect_ident().text
        ts.expect("(")
        if ts.peek_word("void") and ts.peek(1).text == ")":
            ts.next()
        count = 0
        while not ts.accept(")"):
            if count:
                ts.expect(",")
            self.function_param()
            count += 1
        self.in_function = True
        ts.expect("{")
        body: list[Node] = []
        while not ts.accept("}"):
            body += self.statement()
        self.in_function = False
        return body

    def function_param(self) -> None:
        ts = self.ts
        self.skip_qualifiers()
        dtype = self.type_name()
        self.skip_qualifiers()
        tok = ts.expect_ident()
        dims = self.array_dims()
        if dims:
            self.declare_buffer(tok, dims, dtype, "global")
        elif tok.text in self.params:
            ts.fail(f"parameter '{tok.text}' is declared twice", tok)
        else:
            self.params[tok.text] = Param(tok.text, INDEX if dtype.is_integer else dtype)

    def type_name(self) -> DType:
        tok = self.ts.next()
        if tok.text not in _TYPES:
            self.ts.fail(f"expected a type ({', '.join(_TYPES)})", tok)
        if tok.text == "long" and self.ts.peek_word("long"):
            self.ts.next()
        return _TYPES[tok.text]

    def array_dims(self) -> list[Expr]:
        dims = []
        while self.ts.accept("["):
            self.skip_qualifiers()
            dims.append(self.expr(index=True))
            self.ts.expect("]")
        return dims

    def declare_buffer(self, tok: Token, dims: list[Expr], dtype: DType, scope: str) -> None:
        if tok.text in self.given:
            self.ts.fail(f"array '{tok.text}' is declared here and given a shape in the call "
                         f"(from_c(shapes=...)); declare it once", tok)
        if tok.text in self.buffers or tok.text in self.params:
            self.ts.fail(f"'{tok.text}' is declared twice", tok)
        self.buffers[tok.text] = Buffer(tok.text, tuple(dims), dtype, scope)

    # ============================================================ statements
    def statement(self) -> list[Node]:
        ts = self.ts
        tok = ts.peek()
        label = ""
        if tok.kind == "ident" and ts.peek(1).text == ":" and tok.text not in _TYPES:
            label = ts.next().text
            ts.next()
            tok = ts.peek()
        if tok.text == ";":
            ts.next()
            return []
        if tok.text == "{":
            if label:
                ts.fail("a label must precede a for loop or an assignment", tok)
            ts.next()
            out: list[Node] = []
            while not ts.accept("}"):
                out += self.statement()
            return out
        if tok.text == "for":
            return [self.for_loop(label)]
        if tok.text == "if":
            return [self.if_stmt()]
        if tok.text in _TYPES or tok.text in _QUALIFIERS:
            if label:
                ts.fail("a label must precede a for loop or an assignment", tok)
            return self.declaration()
        if tok.text in ("while", "do", "switch", "goto", "return", "break", "continue"):
            ts.fail(f"'{tok.text}' is outside the supported C subset (for, if, blocks, declarations and "
                    f"assignments)", tok)
        if tok.kind == "ident":
            return [self.assignment(label)]
        ts.fail("expected a statement (for, if, {...}, a declaration or an assignment)", tok)

    def declaration(self) -> list[Node]:
        ts = self.ts
        self.skip_qualifiers()
        dtype = self.type_name()
        out: list[Node] = []
        while True:
            self.skip_qualifiers()
            tok = ts.expect_ident()
            dims = self.array_dims()
            scope = "local" if self.in_function else "global"
            if dims:
                self.declare_buffer(tok, dims, dtype, scope)
                if ts.peek_is("="):
                    ts.fail("array initializers are not supported; assign the elements in a loop", ts.peek())
            else:
                if tok.text in self.scalar_decls or tok.text in self.buffers or tok.text in self.params:
                    ts.fail(f"'{tok.text}' is declared twice", tok)
                self.scalar_decls[tok.text] = (dtype, tok, scope)
                if ts.accept("="):
                    self.begin_statement(tok)
                    value = self.expr()
                    self.current = None
                    self.note(tok, assigned=True)
                    out.append(Store(tok.text, (), value))
            if not ts.accept(","):
                break
        ts.expect(";")
        return out

    def for_loop(self, label: str) -> Loop:
        ts = self.ts
        ts.expect_word("for")
        ts.expect("(")
        if ts.peek().text in _TYPES:
            self.type_name()
        var = ts.expect_ident()
        ts.expect("=")
        lower = self.expr(index=True)
        ts.expect(";")
        cvar = ts.expect_ident()
        if cvar.text != var.text:
            ts.fail(f"the loop condition must test the iterator '{var.text}'", cvar)
        op = ts.next()
        if op.text not in ("<", "<="):
            ts.fail(f"the loop condition must be '{var.text} < bound' or '{var.text} <= bound'", op)
        upper = self.expr(index=True)
        if op.text == "<=":
            upper = add_const(upper, 1)
        ts.expect(";")
        step = self.increment(var)
        ts.expect(")")
        if var.text in self.iterators:
            ts.fail(f"loop iterator '{var.text}' shadows an enclosing loop's iterator", var)
        self.iterators.append(var.text)
        self.iterator_names.add(var.text)
        body = self.statement()
        self.iterators.pop()
        return Loop(var.text, lower, upper, tuple(body), name=label, step=step)

    def increment(self, var: Token) -> int:
        ts = self.ts
        if ts.accept("++"):
            self.expect_same(var)
            return 1
        self.expect_same(var)
        if ts.accept("++"):
            return 1
        if ts.accept("+="):
            return self.positive_int()
        if ts.accept("="):
            self.expect_same(var)
            ts.expect("+")
            return self.positive_int()
        ts.fail(f"the loop increment must be {var.text}++, ++{var.text} or {var.text} += c", ts.peek())

    def expect_same(self, var: Token) -> None:
        tok = self.ts.expect_ident()
        if tok.text != var.text:
            self.ts.fail(f"the loop increment must update the iterator '{var.text}'", tok)

    def positive_int(self) -> int:
        tok = self.ts.next()
        if tok.kind != "number" or not tok.text.isdigit() or int(tok.text) < 1:
            self.ts.fail("expected a positive integer step", tok)
        return int(tok.text)

    def if_stmt(self) -> If:
        ts = self.ts
        ts.expect_word("if")
        ts.expect("(")
        cond = self.expr()
        ts.expect(")")
        then = self.statement()
        orelse: list[Node] = []
        if ts.peek_word("else"):
            ts.next()
            orelse = self.statement()
        return If(cond, tuple(then), tuple(orelse))

    def begin_statement(self, tok: Token) -> None:
        """Start recording the accesses of a new statement (for extent errors)."""
        self.current = {}
        self.stmt_tokens.append(tok)
        self.accesses.append(self.current)

    def assignment(self, label: str) -> Node:
        ts = self.ts
        tok = ts.expect_ident()
        if tok.text in self.iterators:
            ts.fail(f"cannot assign to loop iterator '{tok.text}'", tok)
        self.begin_statement(tok)
        indices = tuple(self.subscripts())
        self.current.setdefault((tok.text, indices), tok)
        self.note(tok, rank=len(indices), assigned=True)
        op = ts.next()
        if op.text not in ("=", "+=", "-=", "*=", "/=", "%="):
            ts.fail("expected an assignment operator (=, +=, -=, *=, /=, %=)", op)
        value = self.expr()
        self.current = None
        ts.expect(";")
        target = Load(tok.text, indices)
        if op.text == "+=":
            return Reduce(tok.text, indices, "+", value, name=label)
        if op.text == "*=":
            return Reduce(tok.text, indices, "*", value, name=label)
        if op.text != "=":
            value = Binary(op.text[0], target, value)
        return Store(tok.text, indices, value, name=label)

    def subscripts(self) -> list[Expr]:
        out = []
        while self.ts.accept("["):
            out.append(self.expr(index=True))
            self.ts.expect("]")
        return out

    # ============================================================ expressions
    def expr(self, index: bool = False) -> Expr:
        cond = self.binary(1, index)
        if not self.ts.accept("?"):
            return cond
        a = self.expr(index)
        self.ts.expect(":")
        b = self.expr(index)
        return Select(cond, a, b)

    def binary(self, min_prec: int, index: bool) -> Expr:
        lhs = self.unary(index)
        while True:
            tok = self.ts.peek()
            if tok.kind == "punct" and tok.text in _UNSUPPORTED_OPS:
                self.ts.fail(f"operator '{tok.text}' is outside the supported C subset", tok)
            p = _BIN_PREC.get(tok.text) if tok.kind == "punct" else None
            if p is None or p < min_prec:
                return lhs
            self.ts.next()
            rhs = self.binary(p + 1, index)
            lhs = Binary(tok.text, lhs, rhs)

    def unary(self, index: bool) -> Expr:
        ts = self.ts
        tok = ts.peek()
        if tok.text in ("-", "+", "!") and tok.kind == "punct":
            ts.next()
            operand = self.unary(index)
            if tok.text == "+":
                return operand
            if tok.text == "-" and isinstance(operand, Const) and operand.dtype != DType.bool:
                return Const(-operand.value, operand.dtype)
            return Unary(tok.text, operand)
        if tok.text == "(" and ts.peek(1).text in _TYPES and ts.peek(2).text == ")":
            ts.next()
            dtype = self.type_name()
            ts.expect(")")
            return Cast(dtype, self.unary(index))
        if tok.kind == "punct" and tok.text in _UNSUPPORTED_OPS:
            ts.fail(f"operator '{tok.text}' is outside the supported C subset", tok)
        return self.primary(index)

    def primary(self, index: bool) -> Expr:
        ts = self.ts
        tok = ts.next()
        if tok.kind == "number":
            return self.literal(tok)
        if tok.text == "(":
            e = self.expr(index)
            ts.expect(")")
            return e
        if tok.kind != "ident":
            ts.fail("expected an expression", tok)
        if ts.peek_is("("):
            return self.call(tok, index)
        if tok.text in _TYPES or tok.text in ("for", "if", "else", "while", "do", "return"):
            ts.fail(f"'{tok.text}' cannot appear in an expression", tok)
        if ts.peek_is("["):
            current = self.current
            indices = tuple(self.subscripts())
            if current is not None:
                current.setdefault((tok.text, indices), tok)
            self.note(tok, rank=len(indices))
            return Load(tok.text, indices)
        if tok.text in self.iterators:
            return Var(tok.text)
        self.note(tok, index_use=index, value_use=not index)
        return Var(tok.text)

    def literal(self, tok: Token) -> Const:
        text, suffix = tok.text, tok.suffix.lower()
        if text.lower().startswith("0x"):
            return Const(int(text, 16), INDEX)
        if any(c in text for c in ".eE") or "f" in suffix:
            return Const(float(text), DType.float32 if "f" in suffix else DType.float64)
        return Const(int(text), INDEX)

    def call(self, tok: Token, index: bool) -> Expr:
        ts = self.ts
        ts.expect("(")
        args: list[Expr] = []
        while not ts.accept(")"):
            if args:
                ts.expect(",")
            args.append(self.expr(index))
        fn = tok.text
        if fn in _MINMAX:
            if len(args) != 2:
                ts.fail(f"{fn} takes 2 arguments, got {len(args)}", tok)
            return Binary(_MINMAX[fn], args[0], args[1])
        canonical = _MATH_ALIASES.get(fn, fn)
        if canonical not in MATH_FUNCS and canonical.endswith("f") and canonical[:-1] in MATH_FUNCS:
            canonical = canonical[:-1]
        if canonical not in MATH_FUNCS:
            ts.fail(f"unknown function '{fn}'; supported: min, max, floord, {', '.join(MATH_FUNCS)}", tok)
        if len(args) != MATH_FUNCS[canonical]:
            ts.fail(f"{fn} takes {MATH_FUNCS[canonical]} argument(s), got {len(args)}", tok)
        return Call(canonical, tuple(args))

    # ============================================================ classification
    def note(self, tok: Token, rank: int | None = None, assigned: bool = False,
             index_use: bool = False, value_use: bool = False) -> None:
        name = tok.text
        if name in self.params and (rank is not None or assigned):
            self.ts.fail(f"'{name}' is a scalar parameter and cannot be subscripted or assigned", tok)
        if name in self.scalar_decls and rank:
            self.ts.fail(f"'{name}' is declared as a scalar and cannot be subscripted", tok)
        buf = self.buffers.get(name)
        if buf is not None and rank is not None and rank != buf.rank:
            self.ts.fail(f"array '{name}' has rank {buf.rank} but is used with {rank} subscript(s)", tok)
        info = self.names.setdefault(name, _Name(tok))
        if rank is not None:
            if info.ranks and rank not in info.ranks:
                self.ts.fail(f"'{name}' is used with {rank} subscript(s) here but {min(info.ranks)} "
                             f"at line {info.first.line}", tok)
            info.ranks.add(rank)
        info.assigned |= assigned
        info.index_use |= index_use
        info.value_use |= value_use

    def finish(self, name: str, body: tuple[Node, ...]) -> Program:
        scalar_buffers: set[str] = set()
        inferred: list[str] = []
        params = dict(self.params)
        buffers = dict(self.buffers)
        for ident, shape in self.given.items():
            info = self.names.get(ident)
            if info is None:
                raise ParseError(f"from_c(shapes=...) gives a shape for '{ident}', which the source never uses", 1, 1)
            if ident in params or ident in self.scalar_decls or ident in self.iterator_names:
                self._fail(f"'{ident}' is not an array, but from_c(shapes=...) gives it a shape", info.first)
            if info.ranks and max(info.ranks) != len(shape):
                self._fail(f"'{ident}' is used with {max(info.ranks)} subscript(s) but from_c(shapes=...) gives "
                           f"it {len(shape)} extent(s)", info.first)
            buffers[ident] = Buffer(ident, shape, DType.float64, "global")
            for var in sorted({v for e in shape for v in free_vars(e)}):
                if var not in params and var not in self.names:
                    params[var] = Param(var, INDEX)
                elif var in self.names:
                    self.names[var].index_use = True
        for ident, info in self.names.items():
            if ident in params:
                continue
            if ident in buffers:
                continue
            if ident in self.iterator_names:
                self._fail(f"'{ident}' is a loop iterator and is used outside its loop", info.first)
            if ident in self.scalar_decls:
                dtype, _, scope = self.scalar_decls[ident]
                buffers[ident] = Buffer(ident, (), dtype, scope)
                scalar_buffers.add(ident)
            elif info.ranks or info.assigned:
                rank = max(info.ranks, default=0)
                if rank == 0:
                    scalar_buffers.add(ident)
                buffers[ident] = Buffer(ident, (Const(0),) * rank, DType.float64)
                inferred.append(ident)
            else:
                params[ident] = Param(ident, INDEX if info.index_use else DType.float64)
        if scalar_buffers:
            body = _scalars_to_loads(body, scalar_buffers)
        program = Program(name, tuple(params.values()), tuple(buffers.values()), body)
        inferred = [b for b in inferred if buffers[b].rank]
        if inferred:
            from ..poly.extents import infer_extents

            try:
                shapes = infer_extents(program, inferred)
            except ValueError as e:
                bad = next((n for n in inferred if f"'{n}'" in str(e)), inferred[0])
                self._fail(str(e), self.names[bad].first)
            program = program.replace(buffers=tuple(
                Buffer(b.name, shapes[b.name], b.dtype, b.scope) if b.name in shapes else b
                for b in program.buffers))
        declared = [b.name for b in program.buffers if b.rank and b.name not in inferred]
        if declared:
            self._check_extents(program, declared)
        return program

    def _check_extents(self, program: Program, names: list[str]) -> None:
        from ..poly.extents import check_extents

        problems = check_extents(program, names)
        if not problems:
            return
        first = problems[0]
        order = [st.name for st in program.statements()]
        tok = self.names[first.array].first
        if len(order) == len(self.stmt_tokens) and first.statement in order:
            k = order.index(first.statement)
            tok = self.accesses[k].get((first.ref.buffer, first.ref.indices), self.stmt_tokens[k])
        self._fail(first.explain(), tok)

    def _fail(self, message: str, tok: Token) -> None:
        source = self.ts.lines[tok.line - 1] if 0 < tok.line <= len(self.ts.lines) else ""
        raise ParseError(message, tok.line, tok.col, source)


def _shape(name: str, extents) -> tuple[Expr, ...]:
    """A shape given to ``from_c``: integers, loop-IR expression text or expressions."""
    from .text import parse_expr

    if isinstance(extents, (int, str, Expr)):
        extents = (extents,)
    out = []
    for e in extents:
        if isinstance(e, bool) or not isinstance(e, (int, str, Expr)):
            raise ParseError(f"from_c(shapes=...): the extents of '{name}' must be integers or expressions, "
                             f"got {e!r}", 1, 1)
        out.append(Const(e, INDEX) if isinstance(e, int) else parse_expr(e) if isinstance(e, str) else e)
    return tuple(out)


def _scalars_to_loads(body: tuple[Node, ...], names: set[str]) -> tuple[Node, ...]:
    """Turn references to 0-d buffers, parsed as variables, into loads ``s[]``."""

    def fix(e: Expr) -> Expr:
        return map_expr(e, lambda x: Load(x.name, ()) if isinstance(x, Var) and x.name in names else None)

    out: list[Node] = []
    for n in body:
        if isinstance(n, Loop):
            out.append(Loop(n.iterator, fix(n.lower), fix(n.upper), _scalars_to_loads(n.body, names),
                            name=n.name, step=n.step, annotation=n.annotation))
        elif isinstance(n, If):
            out.append(If(fix(n.cond), _scalars_to_loads(n.then, names), _scalars_to_loads(n.orelse, names)))
        elif isinstance(n, Store):
            out.append(Store(n.buffer, tuple(fix(i) for i in n.indices), fix(n.value), name=n.name))
        else:
            out.append(Reduce(n.buffer, tuple(fix(i) for i in n.indices), n.combiner, fix(n.value), name=n.name))
    return tuple(out)
