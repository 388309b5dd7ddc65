"""kiln's intermediate representations. This package imports nothing else from kiln."""

from .errors import KilnError, OpTypeError, ParseError, UnknownOpError, VerificationError
from .graph import Graph, Node, Value
from .parser import parse
from .registry import Attr, OpDef, all_ops, builtin_ops, defop, get_op, has_op
from .types import DType, Dim, SymDim, TensorType
from .verifier import verify

__all__ = [
    "Attr", "DType", "Dim", "Graph", "KilnError", "Node", "OpDef", "OpTypeError", "ParseError",
    "SymDim", "TensorType", "UnknownOpError", "Value", "VerificationError", "all_ops", "builtin_ops", "defop",
    "get_op", "has_op", "parse", "verify",
]
