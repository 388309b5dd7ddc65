"""The IR text form: print -> parse -> print is the identity, and malformed text fails clearly."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.ir import (
    Attr,
    DType,
    Graph,
    OpTypeError,
    ParseError,
    SymDim,
    TensorType,
    all_ops,
    defop,
    parse,
    verify,
)
from kiln.ir import registry

F32 = DType.float32
EVERY_ATTR = "test_ir_text.every_attr"
SPLIT2 = "test_ir_text.split2"
BODY = "test_ir_text.body"


def _body_infer(types, *, body, tag):
    return tuple(v.type for v in body.outputs)


@pytest.fixture(scope="module", autouse=True)
def test_ops():
    """Ops only these tests use; removed afterwards so other tests never see them."""
    every_kind = {
        "i": Attr("int", 0), "f": Attr("float", 1.0), "b": Attr("bool", False),
        "s": Attr("str", "x"), "ints": Attr("ints", ()), "floats": Attr("floats", ()),
        "dt": Attr("dtype", None, optional=True), "maybe": Attr("int", None, optional=True),
        "sc": Attr("scalar", 0), "anything": Attr("any", None, optional=True),
        "req": Attr("int"),
    }
    defop(EVERY_ATTR, infer=lambda types, **_: types[0], attrs=every_kind)(lambda x, **_: x)
    defop(SPLIT2, infer=lambda types: (types[0], types[0].with_dtype(DType.int64)))(
        lambda x: (x, x.astype(np.int64)))
    defop(BODY, infer=_body_infer, num_inputs=(0, None),
          attrs={"body": Attr("graph"), "tag": Attr("str", "")})(lambda *xs, **_: xs)
    yield
    for name in (EVERY_ATTR, SPLIT2, BODY):
        registry._REGISTRY.pop(name, None)


# ------------------------------------------------------------------ helpers
def _same_attr(a, b) -> bool:
    if isinstance(a, Graph) or isinstance(b, Graph):
        return isinstance(a, Graph) and isinstance(b, Graph) and str(a) == str(b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_attr(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return type(a) is type(b) and a == b


def assert_same_graph(a: Graph, b: Graph) -> None:
    """Structural equality: names, kinds, types, constant bytes, ops, attributes, outputs."""
    assert a.name == b.name
    for va, vb in zip(list(a.values()), list(b.values()), strict=True):
        assert (va.name, va.type, va.origin, va.index) == (vb.name, vb.type, vb.origin, vb.index)
    for ca, cb in zip(a.constants, b.constants, strict=True):
        assert ca.data.dtype == cb.data.dtype and ca.data.shape == cb.data.shape
        if ca.dtype.is_floating:  # every NaN prints as "nan"; compare the rest bit for bit
            nan = np.isnan(ca.data.astype(np.float64))
            assert np.array_equal(nan, np.isnan(cb.data.astype(np.float64)))
            assert ca.data[~nan].tobytes() == cb.data[~nan].tobytes()
        else:
            assert ca.data.tobytes() == cb.data.tobytes()
    for na, nb in zip(a.nodes, b.nodes, strict=True):
        assert na.op is nb.op
        assert [v.name for v in na.inputs] == [v.name for v in nb.inputs]
        assert na.attrs.keys() == nb.attrs.keys()
        for k in na.attrs:
            assert _same_attr(na.attrs[k], nb.attrs[k]), (k, na.attrs[k], nb.attrs[k])
    assert [v.name for v in a.outputs] == [v.name for v in b.outputs]


def roundtrip(g: Graph) -> Graph:
    text = str(g)
    parsed = parse(text)
    assert str(parsed) == text
    assert_same_graph(g, parsed)
    verify(parsed)
    return parsed


# --------------------------------------------------------------- round trips
def test_printer_docstring_shape_of_text():
    g = Graph("mlp")
    x = g.add_input("x", TensorType((2, 64), F32))
    w = g.add_param("fc1.weight", TensorType((2, 64), F32))
    half = g.add_constant(0.5)
    g.set_outputs([g.op("mul", g.op("add", x, w), half)])
    text = str(g)
    assert text.startswith("graph @mlp(%x: f32[2, 64]) params(%fc1.weight: f32[2, 64]) {\n")
    assert "  %c: f32[] = const 0.5\n" in text
    roundtrip(g)


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.short)
def test_every_dtype_with_scalar_list_and_hex_constants(dtype):
    g = Graph(f"consts_{dtype.short}")
    x = g.add_input("x", TensorType((3,), dtype))
    rng = np.random.default_rng(0)
    if dtype == DType.bool:
        small, big = np.array([True, False, True]), rng.integers(0, 2, 40).astype(bool)
        scalar = np.array(True)
    elif dtype.is_integer:
        info = np.iinfo(dtype.numpy)
        small = np.array([info.min, 0, info.max], dtype=dtype.numpy)
        big = rng.integers(info.min, info.max, 40, dtype=dtype.numpy, endpoint=True)
        scalar = np.array(info.max, dtype=dtype.numpy)
    else:
        small = np.array([np.inf, -np.inf, np.nan, -0.0, 1e-3, 3.25], dtype=dtype.numpy)[:3]
        big = rng.standard_normal(40).astype(dtype.numpy)
        scalar = np.array(-0.0, dtype=dtype.numpy)
    cs = [g.add_constant(a, dtype) for a in (scalar, small, big.reshape(5, 8))]
    g.add_constant(np.zeros((0, 3), dtype.numpy), dtype)
    y = g.op("where", g.op("eq", x, cs[1]), x, cs[0])
    g.set_outputs([y, cs[2]])
    text = str(roundtrip(g))
    assert 'hex"' in text and f"{dtype.short}[0, 3] = const []" in text


def test_special_float_values_print_and_parse():
    g = Graph("specials")
    c = g.add_constant(np.array([np.inf, -np.inf, np.nan, -0.0, 1e-45, 3.4e38], np.float32))
    g.set_outputs([c])
    text = str(roundtrip(g))
    assert "const [inf, -inf, nan, -0.0, 1e-45, 3.4e+38]" in text


def test_symbolic_dims_scalars_and_dotted_digit_names():
    g = Graph("sym")
    x = g.add_input("x", TensorType((SymDim("batch"), SymDim("seq"), 4), F32))
    b = g.add_param("layer.0.attn.bias", TensorType((1, SymDim("seq"), 4), F32))
    s = g.add_input("scale", TensorType((), F32))
    y = g.add_node("add", [x, b], names=["12"]).output
    z = g.add_node("mul", [y, s], names=["c_4"]).output
    g.set_outputs([z, y])
    text = str(roundtrip(g))
    assert "%12: f32[batch, seq, 4] = add(%x, %layer.0.attn.bias)" in text
    assert "%scale: f32[]" in text


def test_multi_result_node_and_bare_return():
    g = Graph("multi")
    x = g.add_input("x", TensorType((2,), F32))
    g.add_node(SPLIT2, [x], names=["a", "b"])
    text = str(roundtrip(g))
    assert "%a: f32[2], %b: i64[2] = test_ir_text.split2(%x)" in text
    assert text.endswith("  return\n}")


def test_every_attribute_kind_round_trips():
    g = Graph("attrs")
    x = g.add_input("x", TensorType((2,), F32))
    kw = dict(i=-3, f=1e-05, b=True, s='quote " and\nnewline \u00e9', ints=(1, -2, 3),
              floats=(0.5, -math.inf, math.nan), dt=DType.bfloat16, maybe=None, sc=2.5,
              anything=((1, "a"), (DType.int8, None, False)), req=7)
    y = g.op(EVERY_ATTR, x, **kw)
    y2 = g.op(EVERY_ATTR, y, req=0, sc=True, f=math.inf, maybe=4, anything="text")
    y3 = g.op(EVERY_ATTR, y2, req=1, sc=-4, f=2, dt=DType.bool)
    g.set_outputs([y3])
    parsed = roundtrip(g)
    node = parsed.nodes[0]
    assert node.attrs["ints"] == (1, -2, 3) and node.attrs["dt"] is DType.bfloat16
    assert node.attrs["s"] == kw["s"] and node.attrs["anything"] == kw["anything"]
    assert parsed.nodes[2].attrs["f"] == 2.0 and isinstance(parsed.nodes[2].attrs["f"], float)


def _body_graph(name: str, dtype: DType) -> Graph:
    body = Graph(name)
    a = body.add_input("a", TensorType((2,), dtype))
    one = body.add_constant(np.ones(2, dtype.numpy), dtype)
    body.set_outputs([body.op("add", a, one)])
    return body


def test_nested_graph_attribute_inline_and_twice_nested():
    inner = _body_graph("inner", F32)
    middle = Graph("middle")
    a = middle.add_input("a", TensorType((2,), F32))
    middle.set_outputs([middle.add_node(BODY, [a], {"body": inner}).output])
    g = Graph("outer")
    x = g.add_input("x", TensorType((2,), F32))
    y = g.add_node(BODY, [x], {"body": middle, "tag": "elementwise"}).output
    g.set_outputs([y])
    text = str(roundtrip(g))
    assert "{body=graph @middle(%a: f32[2]) {" in text
    assert "\n    %0: f32[2] = test_ir_text.body(%a) {body=graph @inner(%a: f32[2]) {\n" in text
    assert "\n      %c: f32[2] = const [1.0, 1.0]\n      %0: f32[2] = add(%a, %c)\n" in text
    assert "\n    }}\n    return %0\n  }, tag=\"elementwise\"}\n" in text


def test_equal_constants_stay_distinct_values_with_their_names():
    text = """graph @g(%x: f32[2]) {
      %one: f32[2] = const [1.0, 1.0]
      %also_one: f32[2] = const [1, 1]   # ints are accepted for float constants
      %0: f32[2] = add(%x, %one)
      %1: f32[2] = add(%0, %also_one)
      return %1
    }"""
    g = parse(text)
    assert [c.name for c in g.constants] == ["one", "also_one"]
    assert g.nodes[1].inputs[1] is g.constants[1]
    assert np.array_equal(g.constants[1].data, np.ones(2, np.float32))
    roundtrip(g)


def test_comments_whitespace_and_absent_attributes_get_defaults():
    text = """# a header comment
graph @g(%x: f32[2]) {   # trailing comment
  %0: f32[2] = gelu(%x)
  %1:f32[2]=clamp(%0){max=6}
  %2: f32[2] = gelu(%1) {approximate="tanh"} # "%not a value"
  return %2
}
"""
    g = parse(text)
    assert g.nodes[0].attrs == {"approximate": "none"}
    assert g.nodes[1].attrs == {"min": None, "max": 6.0}
    assert str(parse(str(g))) == str(g)


def test_graph_names_that_need_quoting():
    g = Graph("My model <v1>")
    g.set_outputs([g.add_input("x", TensorType((1,), F32))])
    assert str(g).startswith('graph @"My model <v1>"(')
    roundtrip(g)


# -------------------------------------------------------- random round trip
_DTYPES = [DType.float32, DType.float16, DType.bfloat16, DType.int32, DType.int64, DType.bool]
_SHAPES = [(), (1,), (3,), (2, 3), (1, 3), (2, 1), (SymDim("n"), 3)]


def _elementwise_ops() -> list[str]:
    ops = all_ops()
    return sorted(n for n, o in ops.items() if o.has("elementwise") and o.num_inputs in (1, 2, 3))


def _attr_value(draw, kind: str):
    choices = {
        "int": st.integers(-3, 3), "float": st.floats(-4, 4, width=32), "bool": st.booleans(),
        "str": st.sampled_from(["none", "tanh", "floor", "trunc"]),
        "ints": st.lists(st.integers(-2, 2), max_size=3), "dtype": st.sampled_from(_DTYPES),
        "floats": st.lists(st.floats(-2, 2, width=32), max_size=2),
    }
    return draw(choices.get(kind, st.none()))


@st.composite
def random_graphs(draw) -> Graph:
    g = Graph("rand")
    values = [g.add_input(f"x{i}", TensorType(draw(st.sampled_from(_SHAPES)), draw(st.sampled_from(_DTYPES))))
              for i in range(draw(st.integers(1, 3)))]
    for _ in range(draw(st.integers(0, 2))):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = draw(st.sampled_from([(), (3,), (2, 3), (6, 6)]))
        numel = int(np.prod(shape))
        raw = draw(st.lists(st.floats(allow_nan=True, width=32), min_size=numel, max_size=numel))
        with np.errstate(all="ignore"):
            data = np.array(raw, np.float32).reshape(shape)
            data = data if dtype.is_floating else np.nan_to_num(data).clip(-100, 100)
            data = data.astype(dtype.numpy)
        values.append(g.add_constant(data, dtype, dedup=draw(st.booleans())))
    ops = _elementwise_ops()
    for _ in range(draw(st.integers(1, 6))):
        opdef = all_ops()[draw(st.sampled_from(ops))]
        arity = opdef.num_inputs if isinstance(opdef.num_inputs, int) else opdef.num_inputs[0]
        operands = [draw(st.sampled_from(values)) for _ in range(arity)]
        attrs = {k: _attr_value(draw, a.kind) for k, a in opdef.attrs.items() if draw(st.booleans())}
        try:
            values.extend(g.add_node(opdef, operands, attrs).outputs)
        except OpTypeError:
            continue  # ill-typed combination: the builder refuses it, which is the point
    g.set_outputs(draw(st.lists(st.sampled_from(values), min_size=0, max_size=3)))
    return g


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_random_elementwise_graphs_round_trip(g):
    roundtrip(g)


# ------------------------------------------------------------------- errors
_VALID = """graph @g(%x: f32[2, 3], %y: f32[2, 3]) {
  %0: f32[2, 3] = add(%x, %y)
  return %0
}"""

def _stmt(line: str) -> str:
    """A graph with input %x: f32[2] whose line 2 is ``line``."""
    return f"graph @g(%x: f32[2]) {{\n  {line}\n  return\n}}"


ERRORS = [
    # (text, message regex, line, col)
    ("", r"expected 'graph', got end of input", 1, 1),
    (_stmt("%1: f32[2] = frobnicate(%x)"), r"unknown op 'frobnicate'", 2, 16),
    (_stmt("%1: f32[2] = neg(%y)"), r"use of undefined value %y", 2, 20),
    ("graph @g(%x: f32[2]) {\n  return %nope\n}", r"use of undefined value %nope", 2, 10),
    ("graph @g(%x: f32[2], %x: f32[2]) {\n  return\n}",
     r"duplicate definition of %x \(first defined at line 1, column 10\)", 1, 22),
    (_stmt("%x: f32[2] = neg(%x)"), r"duplicate definition of %x", 2, 3),
    (_stmt("%a: f32[2], %a: i64[2] = test_ir_text.split2(%x)"),
     r"duplicate definition of %a in one statement", 2, 15),
    ("graph @g(%x: f33[2]) {\n  return\n}", r"bad type: unknown dtype 'f33'", 1, 14),
    ("graph @g(%x: f32[-1]) {\n  return\n}", r"dimension '-1' is neither a non-negative integer", 1, 18),
    ("graph @g(%x: f32[2) {\n  return\n}", r"expected ',' or '\]', got '\)'", 1, 19),
    (_stmt("%0: f32[2] = gelu(%x) {foo=1}"), r"gelu: unknown attribute 'foo'; known: approximate", 2, 26),
    (_stmt("%0: f32[2] = gelu(%x) {approximate=1}"),
     r"bad attribute: gelu.*attribute 'approximate' expects str, got 1", 2, 38),
    (_stmt("%0: f32[2] = gelu(%x) {approximate=tanh}"), r"expected an attribute value .* got 'tanh'", 2, 38),
    (_stmt('%0: f32[2] = gelu(%x) {approximate="a", approximate="b"}'),
     r"attribute 'approximate' is given twice", 2, 43),
    (_stmt("%0: f32[2] = cast(%x)"), r"cast\(f32\[2\]\): missing required attribute 'dtype'", 2, 16),
    ("graph @g(%x: f32[2, 3], %y: f32[2, 4]) {\n  %3: f32[2, 3] = add(%x, %y)\n  return %3\n}",
     r"do not broadcast", 2, 19),
    ("graph @g(%x: f32[2, 1], %y: f32[2, 4]) {\n  %3: f32[2, 3] = add(%x, %y)\n  return %3\n}",
     r"add: result %3 is declared f32\[2, 3\] but inference gives f32\[2, 4\]", 2, 7),
    (_stmt("%0: f32[2] = test_ir_text.split2(%x)"), r"1 result\(s\) declared but inference gives 2", 2, 16),
    ("graph @g(%x: f32[2]) {\n  %0: f32[2] = neg(%x)\n  return %0\n",
     r"unterminated graph @g: the '\{' at line 1, column 22 is never closed", 4, 1),
    ("graph @g(%x: f32[2]) {\n  %0: f32[2] = neg(%x)\n", r"unterminated graph @g", 3, 1),
    ("graph @g(%x: f32[2]) {\n  %0: f32[2] = neg(%x)\n}", r"graph @g ends without a 'return'", 3, 1),
    (_VALID + "\n}", r"unexpected '\}' after the end of the graph", 5, 1),
    (_VALID + " junk", r"unexpected 'junk' after the end of the graph", 4, 3),
    (_stmt("%c: f32[2, 3] = const [1.0, 2.0]"), r"constant %c: f32\[2, 3\] needs 6 value\(s\), got 2", 2, 25),
    (_stmt("%c: u8[2] = const [1, 300]"), r"300 is out of range for u8 \[0, 255\]", 2, 25),
    (_stmt("%c: i32[2] = const [1, 2.5]"), r"i32 elements are integers, got 2.5", 2, 26),
    (_stmt("%c: bool[] = const 1"), r"bool elements are true or false, got 1", 2, 22),
    (_stmt("%c: f32[] = const [[1.0]]"), r"constant lists are flat", 2, 22),
    (_stmt('%c: i32[2] = const hex"0100"'), r"i32\[2\] needs 8 bytes, the hex data has 2", 2, 22),
    (_stmt('%c: i8[1] = const hex"0"'), r"even number of hex digits", 2, 21),
    (_stmt("%c: f32[n] = const []"), r"constant %c has symbolic shape f32\[n\]", 2, 7),
    (_stmt("%a: f32[], %b: f32[] = const 1.0"), r"a constant defines exactly one value, not 2", 2, 26),
    (_stmt('%0: f32[2] = gelu(%x) {approximate="tanh)'), r"unterminated string", 2, 38),
    (_stmt('%0: f32[2] = gelu(%x) {approximate="\\q"}'), r"bad string .*JSON-quoted", 2, 38),
    ("graph @g(%1a: f32[2]) {\n  return\n}", r"invalid value name", 1, 10),
    (_stmt("%0: f32[2] = neg(%x) ; "), r"unexpected character ';'", 2, 24),
    ("graph g() {\n  return\n}", r"expected a graph name such as @main, got 'g'", 1, 7),
]


@pytest.mark.parametrize("text, pattern, line, col", ERRORS, ids=[e[1][:40] for e in ERRORS])
def test_parse_errors_name_the_problem_and_position(text, pattern, line, col):
    with pytest.raises(ParseError, match=pattern) as info:
        parse(text)
    assert (info.value.line, info.value.col) == (line, col), str(info.value)
    assert str(info.value).startswith(f"line {line}, column {col}: ")


def test_parse_error_shows_the_source_line_with_a_caret():
    with pytest.raises(ParseError) as info:
        parse("graph @g() {\n  %1: f32[2] = frobnicate()\n  return\n}")
    lines = str(info.value).splitlines()
    assert lines[1] == "    %1: f32[2] = frobnicate()"
    assert lines[2] == "  " + " " * 15 + "^"


def test_valid_reference_text_parses():
    assert str(parse(_VALID)) == _VALID


_MUTATION_SOURCE = """graph @g(%x: f32[2, n], %y: i64[2]) params(%w.0: f32[2, n]) {
  %c: f32[] = const 0.5
  %h: i8[40] = const hex"000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f2021222324252627"
  %0: f32[2, n] = add(%x, %w.0)
  %1: bf16[2, n] = cast(%0) {dtype=bf16}
  %2: f32[2, n] = clamp(%0) {min=-1.0, max=inf}
  %3: i64[2], %4: i64[2] = test_ir_text.split2(%y)
  %5: f32[2, n] = gelu(%2) {approximate="tanh"}
  return %5, %1, %4
}"""


_MUTATIONS = ["", "%", "[", "]", "{", "}", ",", "=", '"', "1", "-", "x", "#", "\n", "inf", 'hex"']


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_corrupted_text_raises_only_parse_errors(data):
    text = _MUTATION_SOURCE
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(text)))
        j = data.draw(st.integers(i, min(len(text), i + 8)))
        insert = data.draw(st.sampled_from(_MUTATIONS))
        text = text[:i] + insert + text[j:]
    try:
        g = parse(text)
    except ParseError as e:
        assert e.line >= 1 and e.col >= 1
        return
    assert str(parse(str(g))) == str(g)


def test_source_of_mutation_test_is_valid():
    roundtrip(parse(_MUTATION_SOURCE))


def test_parse_error_is_not_a_lookup_error():
    with pytest.raises(ParseError) as info:
        parse("graph @g(%x: f32[2]) {\n  return %x, \n}")
    assert not isinstance(info.value, (KeyError, IndexError))
    assert re.search(r"expected a value such as %x, got '\}'", str(info.value))
