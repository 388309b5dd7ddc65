"""Canonical text form of loop programs; :func:`parse_program` reads it back exactly.

::

    program gemm(NI: i64, NJ: i64, NK: i64, alpha: f64, beta: f64) {
      buffer C: f64[NI, NJ]
      buffer A: f64[NI, NK]
      buffer B: f64[NK, NJ]
      for i in [0, NI) @parallel {
        for j in [0, NJ) {
          S0: C[i, j] = C[i, j] * beta
        }
        for k in [0, NK) {
          j_1: for j in [0, NJ) {
            S1: C[i, j] += alpha * A[i, k] * B[k, j]
          }
        }
      }
    }

* Loops print ``[lower, upper)``, ``step s`` when ``s != 1`` and an annotation (``@parallel``,
  ``@vectorized``, ``@unrolled(4)``, ``@mapped("threadIdx.x")``); a loop whose name differs
  from its iterator is labeled ``name: for ...``.
* Statements are always labeled; reductions print ``+=``, ``*=``, ``max=``, ``min=``.
* Buffers print their scope unless it is ``global``; parameters and typed literals carry
  their dtype (``3:i32``, ``0.5:f32``; ``i64`` and ``f64`` literals are bare).
* ``floordiv``, ``floormod``, ``min``, ``max``, ``select``, casts (``f32(x)``) and math
  functions use call syntax; ``/`` and ``%`` are C division and remainder.

Kernels (``docs/gpu.md``) add: task loops ``for (i, j) in spatial(4, 8) * repeat(2, 2) on t {``,
``barrier`` / ``barrier warp``, ``commit_copies``, ``wait_copies n``, warp shuffles
``S0: r[0] = shfl_xor(value, offset, width)`` and vector copies ``S1: s[i, j] = vec4(x[a, b])``
(``async_vec4`` for ``cp.async``); buffers may be ``shared`` or ``register``.

``str(parse_program(str(p))) == str(p)`` holds for every program.
"""

from __future__ import annotations

from ..printer import format_scalar
from ..types import DType
from .expr import (
    CMP_OPS, FUNC_OPS, INDEX, MATH_FUNCS, Binary, Call, Cast, Const, Expr, Load, Select, Unary, Var,
)
from .mapping import ATOMS, TaskMapping, repeat, spatial
from .program import (
    Annotation, Barrier, Buffer, CopyCommit, CopyWait, If, Loop, Node, Param, Program, Reduce, Shuffle, Store,
    TaskLoop, VectorCopy,
)

_PREC = {"||": 1, "&&": 2, "==": 3, "!=": 3, "<": 4, "<=": 4, ">": 4, ">=": 4,
         "+": 5, "-": 5, "*": 6, "/": 6, "%": 6}
_UNARY_PREC = 7
_ATOM_PREC = 8


# ============================================================================ printing
def format_const(c: Const) -> str:
    text = format_scalar(c.value, c.dtype)
    if c.dtype in (INDEX, DType.float64, DType.bool):
        return text
    return f"{text}:{c.dtype.short}"


def _prec(e: Expr) -> int:
    if isinstance(e, Binary) and e.op in _PREC:
        return _PREC[e.op]
    if isinstance(e, Unary):
        return _UNARY_PREC
    if isinstance(e, Const) and format_const(e).startswith("-"):
        return _UNARY_PREC
    return _ATOM_PREC


def format_expr(e: Expr) -> str:
    """One expression in the text form, with the fewest parentheses that parse back."""
    if isinstance(e, Const):
        return format_const(e)
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Load):
        return f"{e.buffer}[{', '.join(format_expr(i) for i in e.indices)}]"
    if isinstance(e, Unary):
        inner = format_expr(e.operand)
        if _prec(e.operand) <= _UNARY_PREC:
            inner = f"({inner})"
        return e.op + inner
    if isinstance(e, Binary):
        if e.op in FUNC_OPS:
            return f"{e.op}({format_expr(e.lhs)}, {format_expr(e.rhs)})"
        p = _PREC[e.op]
        lhs, rhs = format_expr(e.lhs), format_expr(e.rhs)
        if _prec(e.lhs) < p or (_prec(e.lhs) == p and e.op in CMP_OPS):
            lhs = f"({lhs})"
        if _prec(e.rhs) <= p:
            rhs = f"({rhs})"
        return f"{lhs} {e.op} {rhs}"
    if isinstance(e, Select):
        return f"select({format_expr(e.cond)}, {format_expr(e.if_true)}, {format_expr(e.if_false)})"
    if isinstance(e, Cast):
        return f"{e.dtype.short}({format_expr(e.operand)})"
    if isinstance(e, Call):
        return f"{e.fn}({', '.join(format_expr(a) for a in e.args)})"
    raise TypeError(f"not an expression: {e!r}")


def format_annotation(a: Annotation) -> str:
    if a.mode == "serial":
        return ""
    if a.mode == "unrolled":
        return f" @unrolled({a.factor})"
    if a.mode == "mapped":
        return f' @mapped("{a.axis}")'
    return f" @{a.mode}"


_REDUCE_OPS = {"+": "+=", "*": "*=", "max": "max=", "min": "min="}


def format_node(n: Node, indent: str) -> list[str]:
    inner = indent + "  "
    if isinstance(n, Barrier):
        return [f"{indent}barrier" + ("" if n.scope == "block" else f" {n.scope}")]
    if isinstance(n, CopyCommit):
        return [f"{indent}commit_copies"]
    if isinstance(n, CopyWait):
        return [f"{indent}wait_copies {n.pending}"]
    if isinstance(n, Shuffle):
        return [f"{indent}{n.name}: {format_expr(n.target)} = shfl_{n.mode}({format_expr(n.value)}, "
                f"{format_expr(n.offset)}, {n.width})"]
    if isinstance(n, VectorCopy):
        kind = "async_vec" if n.asynchronous else "vec"
        return [f"{indent}{n.name}: {format_expr(Load(n.dst, n.dst_indices))} = "
                f"{kind}{n.width}({format_expr(Load(n.src, n.src_indices))})"]
    if isinstance(n, TaskLoop):
        lines = [f"{indent}for ({', '.join(n.iterators)}) in {n.mapping} on {format_expr(n.worker)} {{"]
        for c in n.body:
            lines += format_node(c, inner)
        lines.append(indent + "}")
        return lines
    if isinstance(n, Store):
        return [f"{indent}{n.name}: {format_expr(n.target)} = {format_expr(n.value)}"]
    if isinstance(n, Reduce):
        return [f"{indent}{n.name}: {format_expr(n.target)} {_REDUCE_OPS[n.combiner]} {format_expr(n.value)}"]
    if isinstance(n, If):
        lines = [f"{indent}if ({format_expr(n.cond)}) {{"]
        for c in n.then:
            lines += format_node(c, inner)
        if n.orelse:
            lines.append(f"{indent}}} else {{")
            for c in n.orelse:
                lines += format_node(c, inner)
        lines.append(indent + "}")
        return lines
    label = f"{n.name}: " if n.name != n.iterator else ""
    step = f" step {n.step}" if n.step != 1 else ""
    head = (f"{indent}{label}for {n.iterator} in [{format_expr(n.lower)}, {format_expr(n.upper)})"
            f"{step}{format_annotation(n.annotation)} {{")
    lines = [head]
    for c in n.body:
        lines += format_node(c, inner)
    lines.append(indent + "}")
    return lines


def format_buffer(b: Buffer) -> str:
    scope = "" if b.scope == "global" else f" {b.scope}"
    return f"buffer {b.name}: {b.dtype.short}[{', '.join(format_expr(d) for d in b.shape)}]{scope}"


def format_program(p: Program) -> str:
    params = ", ".join(f"{q.name}: {q.dtype.short}" for q in p.params)
    lines = [f"program {p.name}({params}) {{"]
    lines += ["  " + format_buffer(b) for b in p.buffers]
    for n in p.body:
        lines += format_node(n, "  ")
    lines.append("}")
    return "\n".join(lines)


# ============================================================================ parsing
from .lexer import Token, TokenStream  # noqa: E402  (the parser half of this module)

KEYWORDS = {"program", "buffer", "for", "in", "if", "else", "step", "true", "false", "inf", "nan",
            "select"} | set(FUNC_OPS) | set(MATH_FUNCS) | {d.short for d in DType}
_SCOPES = {"global", "local", "shared", "register"}
_SYNC_WORDS = ("barrier", "commit_copies", "wait_copies")
_SHUFFLES = {f"shfl_{m}": m for m in ("xor", "down", "up", "idx")}


def parse_program(text: str) -> Program:
    """Parse the text form; errors are :class:`~kiln.ir.errors.ParseError` with line/column."""
    ts = TokenStream(text, puncts=_PUNCTS)
    prog = _Parser(ts).program()
    ts.expect_end()
    return prog


def parse_expr(text: str) -> Expr:
    ts = TokenStream(text, puncts=_PUNCTS)
    e = _Parser(ts).expr()
    ts.expect_end()
    return e


_PUNCTS = ("+=", "*=", "==", "!=", "<=", ">=", "&&", "||", "(", ")", "[", "]", "{", "}", ",", ":",
           "+", "-", "*", "/", "%", "<", ">", "!", "=", "@")


class _Parser:
    def __init__(self, ts: TokenStream):
        self.ts = ts

    # ------------------------------------------------------------- structure
    def program(self) -> Program:
        ts = self.ts
        ts.expect_word("program")
        name = ts.expect_ident().text
        ts.expect("(")
        params: list[Param] = []
        while not ts.accept(")"):
            if params:
                ts.expect(",")
            pname = self.name_token("parameter")
            ts.expect(":")
            params.append(Param(pname.text, self.dtype()))
        ts.expect("{")
        buffers: list[Buffer] = []
        while ts.peek_word("buffer"):
            buffers.append(self.buffer())
        body = self.nodes()
        ts.expect("}")
        return Program(name, tuple(params), tuple(buffers), body)

    def name_token(self, what: str) -> Token:
        tok = self.ts.expect_ident()
        if tok.text in KEYWORDS:
            self.ts.fail(f"'{tok.text}' is a keyword and cannot name a {what}", tok)
        return tok

    def dtype(self) -> DType:
        tok = self.ts.expect_ident()
        try:
            return DType.parse(tok.text)
        except ValueError as e:
            self.ts.fail(str(e), tok)

    def buffer(self) -> Buffer:
        ts = self.ts
        ts.expect_word("buffer")
        name = self.name_token("buffer").text
        ts.expect(":")
        dtype = self.dtype()
        ts.expect("[")
        shape = self.expr_list("]")
        scope = "global"
        tok = ts.peek()
        if tok.kind == "ident" and tok.text in _SCOPES:
            scope = ts.next().text
        return Buffer(name, tuple(shape), dtype, scope)

    def nodes(self) -> tuple[Node, ...]:
        out: list[Node] = []
        while not self.ts.peek_is("}"):
            out.append(self.node())
        return tuple(out)

    def block(self) -> tuple[Node, ...]:
        self.ts.expect("{")
        body = self.nodes()
        self.ts.expect("}")
        return body

    def node(self) -> Node:
        ts = self.ts
        if ts.peek_word("if"):
            ts.next()
            ts.expect("(")
            cond = self.expr()
            ts.expect(")")
            then = self.block()
            orelse: tuple[Node, ...] = ()
            if ts.peek_word("else"):
                ts.next()
                orelse = self.block()
            return If(cond, then, orelse)
        word = ts.peek()
        if word.kind == "ident" and word.text in _SYNC_WORDS and not ts.peek(1).text == ":":
            ts.next()
            if word.text == "commit_copies":
                return CopyCommit()
            if word.text == "wait_copies":
                return CopyWait(self.int_literal())
            if ts.peek_word("warp"):
                ts.next()
                return Barrier("warp")
            return Barrier()
        if ts.peek_word("for") and ts.peek(1).text == "(":
            return self.task_loop()
        label = ""
        if not ts.peek_word("for"):
            label = self.name_token("loop or statement").text
            ts.expect(":")
        if ts.peek_word("for"):
            return self.loop(label)
        if not label:
            ts.fail("expected a loop, an if or a labeled statement", ts.peek())
        return self.statement(label)

    def loop(self, label: str) -> Loop:
        ts = self.ts
        ts.expect_word("for")
        iterator = self.name_token("loop iterator").text
        ts.expect_word("in")
        ts.expect("[")
        lower = self.expr()
        ts.expect(",")
        upper = self.expr()
        ts.expect(")")
        step = 1
        if ts.peek_word("step"):
            ts.next()
            step = self.int_literal()
        annotation = Annotation()
        if ts.accept("@"):
            annotation = self.annotation()
        body = self.block()
        return Loop(iterator, lower, upper, body, name=label, step=step, annotation=annotation)

    def task_loop(self) -> TaskLoop:
        ts = self.ts
        ts.expect_word("for")
        ts.expect("(")
        iterators = [self.name_token("task iterator").text]
        while ts.accept(","):
            iterators.append(self.name_token("task iterator").text)
        ts.expect(")")
        ts.expect_word("in")
        mapping = self.mapping()
        while ts.accept("*"):
            mapping = mapping * self.mapping()
        ts.expect_word("on")
        worker = self.expr()
        body = self.block()
        try:
            return TaskLoop(mapping, worker, tuple(iterators), body)
        except ValueError as e:
            ts.fail(str(e), ts.peek())

    def mapping(self) -> TaskMapping:
        ts = self.ts
        tok = ts.expect_ident()
        if tok.text not in ATOMS:
            ts.fail(f"expected a task mapping ({' or '.join(ATOMS)}), got '{tok.text}'", tok)
        ts.expect("(")
        shape = [self.int_literal()]
        ranks = None
        while ts.accept(","):
            if ts.peek_word("ranks"):
                ts.next()
                ts.expect("=")
                ts.expect("[")
                ranks = [self.int_literal()]
                while ts.accept(","):
                    ranks.append(self.int_literal())
                ts.expect("]")
                break
            shape.append(self.int_literal())
        ts.expect(")")
        try:
            return (spatial if tok.text == "spatial" else repeat)(*shape, ranks=ranks)
        except ValueError as e:
            ts.fail(str(e), tok)

    def int_literal(self) -> int:
        tok = self.ts.next()
        if tok.kind != "number" or not tok.text.isdigit():
            self.ts.fail("expected a positive integer", tok)
        return int(tok.text)

    def annotation(self) -> Annotation:
        ts = self.ts
        tok = ts.expect_ident()
        kind = tok.text
        try:
            if kind == "unrolled":
                ts.expect("(")
                factor = self.int_literal()
                ts.expect(")")
                return Annotation(kind, factor=factor)
            if kind == "mapped":
                ts.expect("(")
                axis = ts.next()
                if axis.kind != "string":
                    ts.fail('expected the axis as a string, e.g. @mapped("threadIdx.x")', axis)
                ts.expect(")")
                return Annotation(kind, axis=axis.text)
            return Annotation(kind)
        except ValueError as e:
            ts.fail(str(e), tok)

    def statement(self, label: str) -> Node:
        ts = self.ts
        target = self.name_token("buffer")
        ts.expect("[")
        indices = tuple(self.expr_list("]"))
        tok = ts.next()
        op = tok.text
        if op in ("max", "min") and tok.kind == "ident" and ts.peek_is("="):
            ts.next()
            op += "="
        combiner = {"+=": "+", "*=": "*", "max=": "max", "min=": "min"}.get(op)
        if op != "=" and combiner is None:
            ts.fail("expected '=', '+=', '*=', 'max=' or 'min='", tok)
        head = ts.peek()
        if combiner is None and head.kind == "ident" and ts.peek(1).text == "(":
            if head.text in _SHUFFLES:
                ts.next()
                ts.expect("(")
                value = self.expr()
                ts.expect(",")
                offset = self.expr()
                ts.expect(",")
                width = self.int_literal()
                ts.expect(")")
                return Shuffle(target.text, indices, value, _SHUFFLES[head.text], offset, width, name=label)
            for kind in ("async_vec", "vec"):
                if head.text.startswith(kind) and head.text[len(kind):].isdigit():
                    ts.next()
                    ts.expect("(")
                    src = self.name_token("buffer")
                    ts.expect("[")
                    src_indices = tuple(self.expr_list("]"))
                    ts.expect(")")
                    try:
                        return VectorCopy(target.text, indices, src.text, src_indices, int(head.text[len(kind):]),
                                          asynchronous=kind == "async_vec", name=label)
                    except ValueError as e:
                        ts.fail(str(e), head)
        value = self.expr()
        if combiner is None:
            return Store(target.text, indices, value, name=label)
        return Reduce(target.text, indices, combiner, value, name=label)

    # ------------------------------------------------------------- expressions
    def expr_list(self, close: str) -> list[Expr]:
        out: list[Expr] = []
        while not self.ts.accept(close):
            if out:
                self.ts.expect(",")
            out.append(self.expr())
        return out

    def expr(self, min_prec: int = 1) -> Expr:
        lhs = self.unary()
        while True:
            tok = self.ts.peek()
            p = _PREC.get(tok.text) if tok.kind == "punct" else None
            if p is None or p < min_prec:
                return lhs
            self.ts.next()
            rhs = self.expr(p + 1)
            lhs = Binary(tok.text, lhs, rhs)

    def unary(self) -> Expr:
        ts = self.ts
        tok = ts.peek()
        if tok.kind != "punct" or tok.text not in ("-", "!"):
            return self.atom()
        ts.next()
        nxt = ts.peek()
        literal = nxt.kind == "number" or (nxt.kind == "ident" and nxt.text in ("inf", "nan"))
        if tok.text == "-" and literal and nxt.start == tok.end:
            # "-3" is a negative literal; "-(3)" and "- 3" stay negations.
            c = self.typed_literal(ts.next(), nxt.text)
            return Const(-c.value, c.dtype)
        return Unary(tok.text, self.unary())

    def atom(self) -> Expr:
        ts = self.ts
        tok = ts.next()
        if tok.kind == "number":
            return self.typed_literal(tok, tok.text)
        if tok.kind == "punct" and tok.text == "(":
            e = self.expr()
            ts.expect(")")
            return e
        if tok.kind != "ident":
            ts.fail("expected an expression", tok)
        word = tok.text
        if word in ("true", "false"):
            return Const(word == "true", DType.bool)
        if word in ("inf", "nan"):
            return self.typed_literal(tok, word)
        if ts.peek_is("(") and word in KEYWORDS:
            return self.call(tok)
        if word in KEYWORDS:
            ts.fail(f"'{word}' is a keyword, not a value", tok)
        if ts.accept("["):
            return Load(word, tuple(self.expr_list("]")))
        return Var(word)

    def typed_literal(self, tok: Token, text: str) -> Const:
        ts = self.ts
        dtype = None
        nxt = ts.peek()
        if nxt.text == ":" and nxt.start == tok.end:
            ts.next()
            dtype = self.dtype()
        is_float = any(c in text for c in ".eE") or text in ("inf", "nan")
        if dtype is None:
            dtype = DType.float64 if is_float else INDEX
        try:
            value = float(text) if (is_float or dtype.is_floating) else int(text)
            return Const(value, dtype)
        except ValueError as e:
            ts.fail(str(e), tok)

    def call(self, tok: Token) -> Expr:
        ts = self.ts
        ts.expect("(")
        args = self.expr_list(")")
        fn = tok.text
        want = 3 if fn == "select" else 2 if fn in FUNC_OPS else 1 if fn not in MATH_FUNCS else MATH_FUNCS[fn]
        if len(args) != want:
            ts.fail(f"{fn} takes {want} argument(s), got {len(args)}", tok)
        if fn == "select":
            return Select(*args)
        if fn in FUNC_OPS:
            return Binary(fn, args[0], args[1])
        if fn in MATH_FUNCS:
            return Call(fn, tuple(args))
        return Cast(DType.parse(fn), args[0])
