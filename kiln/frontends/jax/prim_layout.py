"""Layout primitives: broadcasts, reshapes, transposes, concatenation, ``split``, slices,
``dynamic_slice``, ``iota``, ``pad`` (interior padding included) and ``rev``.

``broadcast_in_dim`` (how JAX spells rank promotion and ``jnp.expand_dims``) is a
``reshape`` that puts the operand's axes at ``broadcast_dimensions``, then an ``expand``.
``dynamic_slice`` with constant starts (the usual case once a ``scan`` is unrolled) is a
static ``slice``; with computed starts it is an ``index_select`` per axis.  ``gather`` and
the scatters are in :mod:`.prim_indexing`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.ir import DType, Value

from .rules import JaxContext, lowers, static_int


@lowers("broadcast_in_dim")
def _broadcast_in_dim(ctx: JaxContext, x: Value, *dyn: Value, shape, broadcast_dimensions, **_) -> Value:
    shape = tuple(int(d) for d in shape)
    placed = [1] * len(shape)
    for axis, size in zip(broadcast_dimensions, x.shape):
        placed[axis] = size
    x = ctx.reshape(x, placed)
    return x if tuple(placed) == shape else ctx.op("expand", x, shape=shape)


def _static_reshape(eqn) -> str | None:
    if eqn.params.get("dimensions") is not None:
        return "reshape with dimensions= (a transpose first) is not supported; transpose explicitly"
    return None


@lowers("reshape", check=_static_reshape)
def _reshape(ctx: JaxContext, x: Value, *dyn: Value, new_sizes, **_) -> Value:
    return ctx.reshape(x, tuple(int(d) for d in new_sizes))


@lowers("squeeze")
def _squeeze(ctx: JaxContext, x: Value, *, dimensions, **_) -> Value:
    return ctx.reshape(x, ctx.out.shape)


@lowers("transpose")
def _transpose(ctx: JaxContext, x: Value, *, permutation, **_) -> Value:
    return ctx.permute(x, tuple(permutation))


@lowers("concatenate")
def _concatenate(ctx: JaxContext, *xs: Value, dimension, **_) -> Value:
    return xs[0] if len(xs) == 1 else ctx.op("cat", *xs, dim=int(dimension))


@lowers("split")
def _split(ctx: JaxContext, x: Value, *, sizes, axis, **_) -> list[Value]:
    parts, start = [], 0
    for size in sizes:
        parts.append(ctx.op("slice", x, dim=int(axis), start=start, end=start + int(size)))
        start += int(size)
    return parts


@lowers("rev")
def _rev(ctx: JaxContext, x: Value, *, dimensions, **_) -> Value:
    return ctx.op("flip", x, dims=tuple(dimensions)) if dimensions else x


def slice_axes(ctx: JaxContext, x: Value, starts: Sequence[int], limits: Sequence[int],
               strides: Sequence[int] | None = None) -> Value:
    """``x[start:limit:stride, ...]``: one kiln ``slice`` per axis that is not taken whole."""
    for axis, (start, limit) in enumerate(zip(starts, limits)):
        step = 1 if strides is None else int(strides[axis])
        if (start, limit, step) != (0, x.shape[axis], 1):
            x = ctx.op("slice", x, dim=axis, start=int(start), end=int(limit), step=step)
    return x


@lowers("slice")
def _slice(ctx: JaxContext, x: Value, *, start_indices, limit_indices, strides=None, **_) -> Value:
    return slice_axes(ctx, x, start_indices, limit_indices, strides)


@lowers("dynamic_slice")
def _dynamic_slice(ctx: JaxContext, x: Value, *starts: Value, slice_sizes, **_) -> Value:
    """Starts are clamped into ``[0, size - slice]``, as in XLA."""
    sizes = [int(s) for s in slice_sizes]
    for axis, (start, size) in enumerate(zip(starts, sizes)):
        dim = x.shape[axis]
        fixed = static_int(start, "a dynamic_slice start")
        if fixed is not None:
            begin = min(max(fixed, 0), dim - size)
            x = slice_axes(ctx, x, [0] * axis + [begin], [*x.shape[:axis], begin + size])
            continue
        begin = ctx.op("clamp", ctx.cast(start, DType.int64), min=0.0, max=float(dim - size))
        index = ctx.add(ctx.op("arange", start=0, end=size, dtype=DType.int64), begin)
        x = ctx.op("index_select", x, index, dim=axis)
    return x


@lowers("iota")
def _iota(ctx: JaxContext, *, dtype, shape, dimension, **_) -> Value:
    return iota_along(ctx, ctx.out.shape, int(dimension), ctx.out.dtype)


def dilate(ctx: JaxContext, x: Value, axis: int, gap: int, fill: float = 0.0) -> Value:
    """``gap`` fill elements between neighbours along ``axis`` (XLA's interior padding): a
    new axis after ``axis`` padded to ``gap + 1``, merged into ``axis``, the tail cut."""
    if gap <= 0 or x.shape[axis] == 0:
        return x
    shape = list(x.shape)
    n = shape[axis]
    x = ctx.reshape(x, (*shape[:axis + 1], 1, *shape[axis + 1:]))
    pads = [0, 0] * (len(shape) - axis - 1) + [0, gap]  # kiln's pad lists the last axis first
    x = ctx.op("pad", x, pads=tuple(pads), value=fill)
    x = ctx.reshape(x, (*shape[:axis], n * (gap + 1), *shape[axis + 1:]))
    return ctx.op("slice", x, dim=axis, start=0, end=(n - 1) * (gap + 1) + 1)


def pad_axes(ctx: JaxContext, x: Value, config, fill: float = 0.0) -> Value:
    """``lax.pad`` by ``config`` = ``(low, high, interior)`` per axis (negative amounts crop)."""
    for axis, (_, _, interior) in enumerate(config):
        x = dilate(ctx, x, axis, int(interior), fill)
    pads: list[int] = []
    for low, high, _ in reversed(config):  # kiln's pad lists the last axis first
        pads += [int(low), int(high)]
    return ctx.op("pad", x, pads=tuple(pads), value=fill) if any(pads) else x


@lowers("pad")
def _pad(ctx: JaxContext, x: Value, value: Value, *, padding_config, **_) -> Value:
    """A constant fill value is the ``pad``'s own; a computed one is put where a padded
    mask of ones is zero."""
    if value.is_const:
        return pad_axes(ctx, x, padding_config, float(value.data.reshape(())))
    inside = pad_axes(ctx, ctx.op("full", shape=tuple(x.shape), value=1.0, dtype=DType.float32),
                      padding_config)
    mask = ctx.op("gt", inside, ctx.const(0.5, DType.float32))
    return ctx.where(mask, pad_axes(ctx, x, padding_config), value)


def iota_along(ctx: JaxContext, shape: Sequence[int], axis: int, dtype: DType) -> Value:
    line = ctx.op("arange", start=0, end=int(shape[axis]), dtype=dtype)
    placed = [1] * len(shape)
    placed[axis] = int(shape[axis])
    return ctx.broadcast_to(ctx.reshape(line, placed), shape)
