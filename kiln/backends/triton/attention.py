"""The fused attention template: ``softmax(q k^T * scale + mask) v`` with an online softmax.

For a ``scaled_dot_product_attention`` node (or a fused node of view ops followed by one:
strided operands absorbed into the kernel), each program computes ``BLOCK_M`` query rows of
one batch entry.  It walks the keys in ``BLOCK_N`` blocks, keeping per row the running
maximum ``m``, the running sum ``l`` of ``exp(score - m)`` and the unnormalized output, all
rescaled by ``exp(m_old - m_new)`` when the maximum grows (Milakov & Gimelshein's online
softmax, as in FlashAttention), so the ``Lq x Lk`` scores never exist in memory.

Semantics are the op's (:func:`kiln.ir.ops.attention.scaled_dot_product_attention`): a
boolean mask keeps scores where true, a floating mask is added, ``is_causal`` keeps key
``n <= query m`` (and skips key blocks past the diagonal); a row whose every key is masked
out gives zeros (its maximum stays ``-inf``, the shift uses 0, its sum is 0), never NaN.
Scores and the softmax run in float32 (float64 for float64 operands); float16/bfloat16
``q``, ``k``, ``v`` go into ``tl.dot`` as they are.

The operands are read through their element expressions (the compute rules of the body's
view ops, :class:`kiln.ir.ops.compute.KernelBuilder`), so a permuted or sliced operand costs
no copy.  A body whose operands are not pure views, or a batch of broadcast masks the rule
cannot express, is refused (the kernel falls back).
"""

from __future__ import annotations

import math

from kiln.ir import Graph, Node
from kiln.ir.loops import Var
from kiln.ir.ops.compute import KernelBuilder, apply_rule, broadcast_index, compute_dtype
from kiln.ir.types import DType

from .analysis import UnsupportedProgram, product
from .configs import INTERPRET, space
from .printer import TL_DTYPES, ExprPrinter, Scope, conj
from .source import PLACEHOLDER, TORCH_DTYPES, KernelSource, launch_function

OP = "scaled_dot_product_attention"


def _parts(node: Node) -> tuple[Graph | None, Node]:
    if node.op_name == OP:
        return None, node
    body: Graph = node.attrs["body"]
    return body, body.nodes[-1]


def is_attention(node: Node) -> bool:
    """Whether ``node`` is an attention node, alone or after view ops (module docstring)."""
    if node.op_name == OP:
        return True
    if node.op_name != "fused":
        return False
    body: Graph = node.attrs["body"]
    if not body.nodes or body.nodes[-1].op_name != OP or list(body.outputs) != list(body.nodes[-1].outputs):
        return False
    return all(n.op.has("view") for n in body.nodes[:-1])


def attention_source(node: Node, printer: ExprPrinter, *, tf32: bool = False) -> KernelSource:
    """The kernel of an attention node (module docstring)."""
    body, sdpa = _parts(node)
    builder = KernelBuilder()
    buffer_of: dict = {}
    for v in node.inputs:
        if v not in buffer_of:
            buffer_of[v] = builder.declare(v.name, tuple(int(d) for d in v.shape), v.dtype, "global")
    out = node.outputs[0]
    out_name = builder.declare(out.name, tuple(int(d) for d in out.shape), out.dtype, "global")
    env = {}
    if body is None:
        env = {v: builder.tensor_of(buffer_of[v]) for v in node.inputs}
    else:
        for inner, outer in zip(body.inputs, node.inputs):
            env[inner] = builder.tensor_of(buffer_of[outer])
        for n in body.nodes[:-1]:
            results = apply_rule(builder, n.op, [env[v] for v in n.inputs], n.attrs, [v.type for v in n.outputs],
                                 n.outputs[0].name)
            env.update(zip(n.outputs, results))
    if builder.nests or builder.constants:
        raise UnsupportedProgram("attention operands are not plain views of the kernel's buffers")
    q, k, v = (env[x] for x in sdpa.inputs[:3])
    mask = env[sdpa.inputs[3]] if len(sdpa.inputs) == 4 else None
    is_causal = bool(sdpa.attrs.get("is_causal"))
    scale = sdpa.attrs.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out_shape = tuple(int(d) for d in out.shape)
    batch_shape = out_shape[:-2]
    lq, lk, e, ev = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    nb = len(batch_shape)
    t = compute_dtype(q.dtype)
    tt = TL_DTYPES[t]
    dot_dtype = q.dtype if q.dtype == k.dtype == v.dtype else t
    buffers = builder.buffers
    names = [*dict.fromkeys(buffer_of[x] for x in node.inputs), out_name]
    pointers = {name: f"{name}_ptr" for name in names}

    batch = tuple(Var(f"b{i}") for i in range(nb))
    bvars = {f"b{i}": (f"b{i}", 0) for i in range(nb)}
    q_e = q[(*broadcast_index(batch, q.shape[:-2]), Var("m"), Var("d"))]
    k_e = k[(*broadcast_index(batch, k.shape[:-2]), Var("n"), Var("d"))]
    v_e = v[(*broadcast_index(batch, v.shape[:-2]), Var("n"), Var("e"))]

    def tile(rows: str, cols: str) -> str:
        return f"tl.full([{rows}, {cols}], 0, tl.int32)"

    def scope(vars_: dict[str, str], rows: str, cols: str, mask: str) -> Scope:
        pad = tile(rows, cols)
        return Scope({**bvars, **{name: (x, 2) for name, x in vars_.items()}}, buffers, pointers, lane_mask=mask,
                     mask=mask, pads={1: pad, 2: pad})

    lines = [
        "@triton.jit",
        f"def {PLACEHOLDER}_attn({', '.join(pointers.values())}, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, "
        "BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):",
        f"    # out[{', '.join(map(str, out_shape))}] = softmax(q k^T * {scale:.6g}"
        f"{' + mask' if mask is not None else ''}{', causal' if is_causal else ''}) v",
        "    pid = tl.program_id(0)",
        f"    num_m = ({lq} + BLOCK_M - 1) // BLOCK_M",
        "    pid_m = pid % num_m",
        "    bidx = pid // num_m",
    ]
    inner = 1
    for i in reversed(range(nb)):
        part = "bidx" if inner == 1 else f"(bidx // {inner})"
        lines.append(f"    b{i} = {part if i == 0 else f'{part} % {batch_shape[i]}'}")
        inner *= batch_shape[i]
    lines += [
        "    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
        "    offs_d = tl.arange(0, BLOCK_D)",
        "    offs_e = tl.arange(0, BLOCK_E)",
        f"    qm = offs_m[:, None] + {tile('BLOCK_M', 'BLOCK_D')}",
        f"    qd = offs_d[None, :] + {tile('BLOCK_M', 'BLOCK_D')}",
    ]
    q_mask = f"(qm < {lq}) & (qd < {e})"
    qt = printer.expr(q_e, scope({"m": "qm", "d": "qd"}, "BLOCK_M", "BLOCK_D", q_mask))
    lines.append(f"    q = tl.where({q_mask}, {printer.cast(qt, dot_dtype).text}, 0)")
    lines += [
        f"    m_i = tl.full([BLOCK_M], float(\"-inf\"), {tt})",
        f"    l_i = tl.full([BLOCK_M], 0, {tt})",
        f"    acc = tl.full([BLOCK_M, BLOCK_E], 0, {tt})",
    ]
    hi = f"tl.minimum({lk}, (pid_m + 1) * BLOCK_M)" if is_causal else str(lk)
    lines.append(f"    for start_n in range(0, {hi}, BLOCK_N):")
    ind = "        "
    lines += [
        f"{ind}offs_n = start_n + tl.arange(0, BLOCK_N)",
        f"{ind}kd = offs_d[:, None] + {tile('BLOCK_D', 'BLOCK_N')}",
        f"{ind}kn = offs_n[None, :] + {tile('BLOCK_D', 'BLOCK_N')}",
    ]
    k_mask = f"(kd < {e}) & (kn < {lk})"
    kt = printer.expr(k_e, scope({"n": "kn", "d": "kd"}, "BLOCK_D", "BLOCK_N", k_mask))
    precision = ", input_precision=\"ieee\"" if dot_dtype == DType.float32 and not tf32 else ""
    lines += [
        f"{ind}kt = tl.where({k_mask}, {printer.cast(kt, dot_dtype).text}, 0)",
        f"{ind}s = tl.dot(q, kt{precision}, out_dtype={tt}) * {scale!r}",
        f"{ind}sm = offs_m[:, None] + {tile('BLOCK_M', 'BLOCK_N')}",
        f"{ind}sn = offs_n[None, :] + {tile('BLOCK_M', 'BLOCK_N')}",
    ]
    keep = f"sn < {lk}"
    if is_causal:
        keep = conj(keep, "sn <= sm")
    if mask is not None:
        s_mask = f"(sm < {lq}) & (sn < {lk})"
        index = broadcast_index((*batch, Var("m"), Var("n")), mask.shape)
        mt = printer.expr(mask[index], scope({"m": "sm", "n": "sn"}, "BLOCK_M", "BLOCK_N", s_mask))
        if mask.dtype == DType.bool:
            keep = conj(keep, printer.truth(mt))
        else:
            lines.append(f"{ind}s = s + {printer.cast(mt, t).text}")
    lines += [
        f"{ind}s = tl.where({keep}, s, float(\"-inf\"))",
        f"{ind}m_new = tl.maximum(m_i, tl.max(s, 1))",
        f"{ind}shift = tl.where(m_new == float(\"-inf\"), 0.0, m_new)",
        f"{ind}alpha = tl.exp(m_i - shift)",
        f"{ind}p = tl.exp(s - shift[:, None])",
        f"{ind}l_i = l_i * alpha + tl.sum(p, 1)",
        f"{ind}vn = offs_n[:, None] + {tile('BLOCK_N', 'BLOCK_E')}",
        f"{ind}ve = offs_e[None, :] + {tile('BLOCK_N', 'BLOCK_E')}",
    ]
    v_mask = f"(vn < {lk}) & (ve < {ev})"
    vt = printer.expr(v_e, scope({"n": "vn", "e": "ve"}, "BLOCK_N", "BLOCK_E", v_mask))
    lines += [
        f"{ind}vt = tl.where({v_mask}, {printer.cast(vt, dot_dtype).text}, 0)",
        f"{ind}acc = acc * alpha[:, None] + tl.dot(p.to({TL_DTYPES[dot_dtype]}), vt{precision}, out_dtype={tt})",
        f"{ind}m_i = m_new",
        "    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)",
        f"    om = offs_m[:, None] + {tile('BLOCK_M', 'BLOCK_E')}",
        f"    oe = offs_e[None, :] + {tile('BLOCK_M', 'BLOCK_E')}",
    ]
    o_mask = f"(om < {lq}) & (oe < {ev})"
    o_scope = scope({"m": "om", "e": "oe"}, "BLOCK_M", "BLOCK_E", o_mask)
    ptr, store_mask, _ = printer.access(out_name, (*batch, Var("m"), Var("e")), o_scope, None)
    lines.append(f"    tl.store({ptr}, out.to({TL_DTYPES[out.dtype]}), mask={store_mask})")
    nbatch = product(batch_shape)
    launch = [
        f"BLOCK_M = _dot_block(cfg['BLOCK_M'], {lq})",
        f"BLOCK_N = _dot_block(cfg['BLOCK_N'], {lk})",
        f"{PLACEHOLDER}_attn[(triton.cdiv({lq}, BLOCK_M) * {nbatch},)](*ptrs, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, "
        f"BLOCK_D=_dot_block({e}, {e}), BLOCK_E=_dot_block({ev}, {ev}), num_warps=cfg['num_warps'], "
        "num_stages=cfg['num_stages'])",
    ]
    text = "\n".join(lines) + "\n\n\n" + launch_function(launch)
    args = [(tuple(int(d.value) for d in buffers[n].shape), TORCH_DTYPES[buffers[n].dtype]) for n in names]
    info = {"lq": lq, "lk": lk, "d": e, "batch": nbatch}
    return KernelSource("", "attention", text, args, configs=space("attention", info),
                        interpret_config=dict(INTERPRET["attention"]), info=info)


__all__ = ["attention_source", "is_attention"]
