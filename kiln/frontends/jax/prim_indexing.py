"""Indexed reads and writes: ``gather``, ``scatter``, ``scatter-add`` and
``dynamic_update_slice``.

``gather`` and the scatters are lowered in the forms ``jnp`` indexing, ``jnp.take``,
``jnp.take_along_axis``, ``x.at[i].set/add`` and JAX's gradients of them produce: every
indexed axis reads or writes windows of size 1, and every other axis is taken whole.  They
become kiln's advanced-indexing ops, ``index`` and ``index_put``, on the operand with its
indexed axes moved first (the last axis of ``indices`` lists the index per indexed axis;
batching axes get ``arange`` indices).  Out-of-bounds indices follow XLA: a gather clamps
them (``mode=fill`` puts ``fill_value`` there instead), a scatter drops their updates
(``mode=clip`` clamps them); a dropped update goes to one extra, discarded slot per axis.

``dynamic_update_slice`` clamps its starts into ``[0, size - update]`` as XLA does: with
constant starts it is a ``pad`` of the update and a ``where``; with computed ones an
``index_put`` at ``arange`` indices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kiln.ir import DType, Value

from .prim_layout import iota_along
from .rules import JaxContext, lowers, static_int


def _window_reason(what: str, operand: Sequence[int], windows: Mapping[int, int],
                   indexed: set[int]) -> str | None:
    """Why windows of ``windows[axis]`` elements (per operand axis) are not a supported form."""
    for axis, size in sorted(windows.items()):
        if axis in indexed and size != 1:
            return (f"{what} windows of size {size} along indexed axis {axis} are not supported; "
                    f"kiln lowers a {what} whose indexed axes take one element (jnp indexing, "
                    "jnp.take, jnp.take_along_axis, x.at[i])")
        if axis not in indexed and size != operand[axis]:
            return (f"{what} takes {size} of the {operand[axis]} elements of axis {axis}, which is "
                    f"not indexed; kiln lowers a {what} that takes non-indexed axes whole")
    return None


def _index_columns(ctx: JaxContext, indices: Value, index_map: Sequence[int],
                   operand_batching: Sequence[int], index_batching: Sequence[int]
                   ) -> tuple[tuple[int, ...], list[int], list[Value]]:
    """The batch shape of ``indices``, the operand axes indexed, and one index array (of the
    batch shape) per indexed axis."""
    batch = tuple(indices.shape[:-1])
    nb = len(batch)
    columns = [ctx.reshape(ctx.op("slice", indices, dim=nb, start=j, end=j + 1), batch)
               for j in range(indices.shape[-1])]
    axes = [int(a) for a in index_map]
    for op_axis, idx_axis in zip(operand_batching, index_batching):
        axes.append(int(op_axis))
        columns.append(iota_along(ctx, batch, int(idx_axis), indices.dtype))
    return batch, axes, columns


def _in_bounds(ctx: JaxContext, column: Value, size: int) -> Value:
    return ctx.op("logical_and", ctx.op("ge", column, ctx.const(0, column)),
                  ctx.op("lt", column, ctx.const(size, column)))


def _all(ctx: JaxContext, masks: Sequence[Value]) -> Value:
    result = masks[0]
    for mask in masks[1:]:
        result = ctx.op("logical_and", result, mask)
    return result


def _clamped(ctx: JaxContext, column: Value, size: int) -> Value:
    return ctx.op("clamp", column, min=0.0, max=float(size - 1))


def _inverse(perm: Sequence[int]) -> list[int]:
    return sorted(range(len(perm)), key=lambda i: perm[i])


# ------------------------------------------------------------------------------ gather
def _gather_check(eqn) -> str | None:
    dn = eqn.params["dimension_numbers"]
    if set(dn.collapsed_slice_dims) - set(dn.start_index_map):
        return "gather collapses an axis it does not index"
    indexed = set(dn.start_index_map) | set(dn.operand_batching_dims)
    windows = {a: int(s) for a, s in enumerate(eqn.params["slice_sizes"])}
    return _window_reason("gather", eqn.invars[0].aval.shape, windows, indexed)


@lowers("gather", check=_gather_check)
def _gather(ctx: JaxContext, x: Value, indices: Value, *, dimension_numbers, slice_sizes, mode,
            fill_value=None, **_) -> Value:
    dn = dimension_numbers
    batch, axes, columns = _index_columns(ctx, indices, dn.start_index_map, dn.operand_batching_dims,
                                          dn.start_indices_batching_dims)
    nb = len(batch)
    rest = [a for a in range(x.type.rank) if a not in axes]
    clipped = [_clamped(ctx, c, x.shape[a]) for a, c in zip(axes, columns)]
    picked = ctx.op("index", ctx.permute(x, axes + rest), *clipped, dims=tuple(range(len(axes))))
    dropped = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
    offset_shape = [int(slice_sizes[a]) for a in range(x.type.rank) if a not in dropped]
    picked = ctx.reshape(picked, (*batch, *offset_shape))  # [*batch, *offset]
    offset_dims = [int(d) for d in dn.offset_dims]
    order, next_batch = [], 0
    for position in range(nb + len(offset_shape)):
        if position in offset_dims:
            order.append(nb + offset_dims.index(position))
        else:
            order.append(next_batch)
            next_batch += 1
    result = ctx.permute(picked, order)
    if "FILL" not in str(mode) or not axes:
        return result
    valid = _all(ctx, [_in_bounds(ctx, c, x.shape[a]) for a, c in zip(axes, columns)])
    keep = [1 if p in offset_dims else batch[order[p]] for p in range(len(order))]
    fill = float("nan") if fill_value is None and x.dtype.is_floating else (fill_value or 0)
    return ctx.where(ctx.reshape(valid, keep), result, ctx.const(fill, x))


# ------------------------------------------------------------------------------ scatter
def _scatter_check(eqn) -> str | None:
    dn = eqn.params["dimension_numbers"]
    if set(dn.inserted_window_dims) - set(dn.scatter_dims_to_operand_dims):
        return "scatter inserts a window axis it does not index"
    operand, updates = eqn.invars[0].aval.shape, eqn.invars[2].aval.shape
    dropped = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
    window_axes = [a for a in range(len(operand)) if a not in dropped]
    windows = {a: int(updates[d]) for a, d in zip(window_axes, dn.update_window_dims)}
    indexed = set(dn.scatter_dims_to_operand_dims) | set(dn.operand_batching_dims)
    return _window_reason("scatter", operand, windows, indexed)


def _scatter(accumulate: bool):
    def lower(ctx: JaxContext, x: Value, indices: Value, updates: Value, *, dimension_numbers,
              mode, **_) -> Value:
        dn = dimension_numbers
        batch, axes, columns = _index_columns(ctx, indices, dn.scatter_dims_to_operand_dims,
                                              dn.operand_batching_dims, dn.scatter_indices_batching_dims)
        rest = [a for a in range(x.type.rank) if a not in axes]
        window = [int(d) for d in dn.update_window_dims]
        scattered = [d for d in range(updates.type.rank) if d not in window]
        values = ctx.reshape(ctx.permute(updates, scattered + window), (*batch, *(x.shape[a] for a in rest)))
        moved = ctx.permute(x, axes + rest)
        drop = "CLIP" not in str(mode)
        if drop:  # out-of-bounds updates go to one extra slot per indexed axis, cut off after
            pads = [0, 0] * len(rest) + [0, 1] * len(axes)
            moved = ctx.op("pad", moved, pads=tuple(pads))
            targets = [ctx.where(_in_bounds(ctx, c, x.shape[a]), c, ctx.const(x.shape[a], c))
                       for a, c in zip(axes, columns)]
        else:
            targets = [_clamped(ctx, c, x.shape[a]) for a, c in zip(axes, columns)]
        out = ctx.op("index_put", moved, values, *targets, dims=tuple(range(len(axes))),
                     accumulate=accumulate)
        if drop:
            for i, a in enumerate(axes):
                out = ctx.op("slice", out, dim=i, start=0, end=x.shape[a])
        return ctx.permute(out, _inverse(axes + rest))
    return lower


lowers("scatter-add", check=_scatter_check)(_scatter(True))
lowers("scatter", check=_scatter_check)(_scatter(False))


# ----------------------------------------------------------------- dynamic_update_slice
@lowers("dynamic_update_slice")
def _dynamic_update_slice(ctx: JaxContext, x: Value, update: Value, *starts: Value, **_) -> Value:
    fixed = [static_int(s, "a dynamic_update_slice start") for s in starts]
    limits = [d - u for d, u in zip(x.shape, update.shape)]
    if all(f is not None for f in fixed):
        begins = [min(max(f, 0), top) for f, top in zip(fixed, limits)]
        pads: list[int] = []
        for begin, d, u in reversed(list(zip(begins, x.shape, update.shape))):  # last axis first
            pads += [begin, d - begin - u]
        mask = ctx.op("pad", ctx.op("full", shape=tuple(update.shape), value=True, dtype=DType.bool),
                      pads=tuple(pads))
        return ctx.where(mask, ctx.op("pad", update, pads=tuple(pads)), x)
    rank = x.type.rank
    grids = []
    for axis, (start, top) in enumerate(zip(starts, limits)):
        begin = ctx.op("clamp", ctx.cast(start, DType.int64), min=0.0, max=float(top))
        line = ctx.add(ctx.op("arange", start=0, end=update.shape[axis], dtype=DType.int64), begin)
        grids.append(ctx.reshape(line, [update.shape[axis] if a == axis else 1 for a in range(rank)]))
    return ctx.op("index_put", x, update, *grids, dims=tuple(range(rank)))
