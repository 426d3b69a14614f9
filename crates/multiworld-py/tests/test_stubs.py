"""The type stubs match the native module: every public class, method,
attribute and function of ``multiworld_rs._native`` is in ``_native.pyi``,
and the stub names nothing the module lacks (so editors and type checkers
see the API as it is)."""

from __future__ import annotations

import ast
from pathlib import Path

from multiworld_rs import _native

STUB = Path(_native.__file__).with_name("_native.pyi")
#: What only the nccl build has.
NCCL_ONLY = {"Nccl", "nccl_world"}


def _public(names):
    return {n for n in names if not n.startswith("_")}


def test_the_native_stub_names_exactly_what_the_module_has():
    tree = ast.parse(STUB.read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            top.add(node.name)
            cls = getattr(_native, node.name, None)
            if cls is None and node.name in NCCL_ONLY and not _native.nccl_built():
                continue
            assert cls is not None, f"the stub's class {node.name} is not in the module"
            stub = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            stub |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            assert _public(stub) == _public(dir(cls)), (
                node.name, sorted(_public(stub) - _public(dir(cls))), sorted(_public(dir(cls)) - _public(stub)))
        elif isinstance(node, ast.FunctionDef):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
    module = _public(dir(_native))
    assert module <= top, f"not in the stub: {sorted(module - top)}"
    # Names of the nccl build are in the stub whichever build this is.
    missing = {n for n in _public(top) if not hasattr(_native, n)}
    allowed = set() if _native.nccl_built() else NCCL_ONLY
    assert missing <= allowed, f"in the stub, not in the module: {sorted(missing)}"
