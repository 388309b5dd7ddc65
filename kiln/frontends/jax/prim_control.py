"""Primitives holding sub-jaxprs: calls, custom derivatives, ``cond``, ``scan``.

* ``jit`` (a nested ``jax.jit``), ``closed_call`` and ``remat2`` (``jax.checkpoint``) are
  inlined: their jaxpr is lowered in place on the operands.
* ``custom_jvp_call`` and ``custom_vjp_call`` (most ``jax.nn`` activations) inline their
  primal function, ``call_jaxpr``.  kiln differentiates that primal with its own gradient
  rules (``kiln.jax.grad``); the user's custom JVP/VJP rule is not used.
* ``cond``: a constant branch index inlines that branch only; otherwise every branch is
  lowered and the results are chosen elementwise by the index (``where``), which is exact
  because jaxprs have no side effects.
* ``scan`` is unrolled: its trip count ``length`` is static by construction.  Each step
  takes ``xs[i]`` (a ``select``), and the per-step outputs are stacked (``cat``).
  ``lax.fori_loop`` with static bounds is a ``scan`` in the jaxpr, so it lowers too.
* ``while`` (``lax.while_loop``, ``fori_loop`` with traced bounds) has a trip count that
  depends on values, and is refused.
* ``sharding_constraint`` is the identity on one device.
"""

from __future__ import annotations

from kiln.ir import Value

from .rules import JaxContext, lowers, static_int


@lowers("jit", control=True)
def _jit(ctx: JaxContext, *args: Value, jaxpr, **_) -> list[Value]:
    return ctx.inline(jaxpr, args)


@lowers("closed_call", control=True)
def _closed_call(ctx: JaxContext, *args: Value, call_jaxpr, **_) -> list[Value]:
    return ctx.inline(call_jaxpr, args)


@lowers("remat2", control=True)
def _checkpoint(ctx: JaxContext, *args: Value, jaxpr, **_) -> list[Value]:
    return ctx.inline(jaxpr, args)


@lowers("custom_jvp_call", "custom_vjp_call", control=True)
def _custom_derivative_call(ctx: JaxContext, *args: Value, call_jaxpr, **_) -> list[Value]:
    return ctx.inline(call_jaxpr, args)


@lowers("sharding_constraint")
def _sharding_constraint(ctx: JaxContext, x: Value, **_) -> Value:
    return x


@lowers("cond", control=True)
def _cond(ctx: JaxContext, index: Value, *operands: Value, branches, **_) -> list[Value]:
    fixed = static_int(index, "the cond branch index")
    if fixed is not None:
        return ctx.inline(branches[min(max(fixed, 0), len(branches) - 1)], operands)
    results = [ctx.inline(branch, operands) for branch in branches]
    top = ctx.const(len(branches) - 1, index)
    clamped = index if index.dtype.name == "bool" else ctx.op("minimum", ctx.op("maximum", index, ctx.const(0, index)), top)
    return [ctx.where_index(clamped, [ctx.broadcast_to(r[i], ctx.outs[i].shape) for r in results])
            for i in range(len(results[0]))]


@lowers("scan", control=True)
def _scan(ctx: JaxContext, *operands: Value, jaxpr, length, reverse, num_consts, num_carry,
          **_) -> list[Value]:
    consts = list(operands[:num_consts])
    carry = list(operands[num_consts:num_consts + num_carry])
    xs = list(operands[num_consts + num_carry:])
    length = int(length)
    steps: dict[int, list[Value]] = {}
    for i in (range(length - 1, -1, -1) if reverse else range(length)):
        sliced = [ctx.op("select", x, dim=0, index=i) for x in xs]
        out = ctx.inline(jaxpr, [*consts, *carry, *sliced])
        carry, steps[i] = list(out[:num_carry]), list(out[num_carry:])
    stacked = []
    for j, out_type in enumerate(ctx.outs[num_carry:]):
        if length == 0:
            stacked.append(ctx.zeros(out_type))
            continue
        rows = [ctx.reshape(steps[i][j], (1, *steps[i][j].shape)) for i in range(length)]
        stacked.append(rows[0] if length == 1 else ctx.op("cat", *rows, dim=0))
    return [*carry, *stacked]


def _while_check(eqn) -> str:
    return ("lax.while_loop (or fori_loop with traced bounds) has a trip count that depends on "
            "values; kiln compiles loops of static length: use lax.fori_loop with Python int "
            "bounds or lax.scan, which kiln unrolls")


@lowers("while", check=_while_check, control=True)
def _while(ctx: JaxContext, *args: Value, **_) -> list[Value]:
    raise AssertionError("unreachable: the check refuses every while")
