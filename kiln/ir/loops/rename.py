"""Generated names for printers: no user text reaches generated source.

:func:`generated_names` renames a program's buffers ``b0, b1, ...`` in declaration order
and its parameters, then its loop and task-loop iterators in pre-order, ``v0, v1, ...``;
the program is named ``kernel``.  Every C-family printer of a backend prints the renamed
program, so names taken from a model (``%fc1.bias``, a C keyword, a macro) never appear in
its source.
"""

from __future__ import annotations

from dataclasses import replace

from .expr import Expr, Load, Var, map_expr
from .program import Buffer, If, Loop, Node, Param, Program, TaskLoop, map_nodes


def generated_names(program: Program, *, keep_loop_names: bool = True) -> tuple[Program, dict[str, str]]:
    """``program`` renamed (module docstring) and the buffer renaming (old -> new).  Loop
    names (the labels schedules refer to) are kept unless ``keep_loop_names`` is False."""
    buffers = {b.name: f"b{i}" for i, b in enumerate(program.buffers)}
    names: dict[str, str] = {}
    for p in program.params:
        names.setdefault(p.name, f"v{len(names)}")
    for n, _ in program.walk():
        for it in (n.iterator,) if isinstance(n, Loop) else n.iterators if isinstance(n, TaskLoop) else ():
            names.setdefault(it, f"v{len(names)}")

    def one(x: Expr) -> Expr | None:
        if isinstance(x, Var):
            return Var(names.get(x.name, x.name))
        if isinstance(x, Load):
            return Load(buffers[x.buffer], x.indices)
        return None

    def expr(e: Expr) -> Expr:
        return map_expr(e, one)

    def nodes(body: tuple[Node, ...]) -> tuple[Node, ...]:
        out: list[Node] = []
        for n in body:
            if isinstance(n, Loop):
                n = replace(n, iterator=names[n.iterator], lower=expr(n.lower), upper=expr(n.upper),
                            body=nodes(n.body), name=n.name if keep_loop_names else "")
            elif isinstance(n, If):
                n = replace(n, cond=expr(n.cond), then=nodes(n.then), orelse=nodes(n.orelse))
            elif isinstance(n, TaskLoop):
                n = replace(n, worker=expr(n.worker), iterators=tuple(names[i] for i in n.iterators),
                            body=nodes(n.body))
            else:
                n = map_nodes((n,), expr)[0]
            out.append(n)
        return tuple(out)

    renamed = Program(
        name="kernel",
        params=tuple(Param(names[p.name], p.dtype) for p in program.params),
        buffers=tuple(Buffer(buffers[b.name], tuple(expr(d) for d in b.shape), b.dtype, b.scope)
                      for b in program.buffers),
        body=nodes(program.body),
    )
    return renamed, buffers


__all__ = ["generated_names"]
