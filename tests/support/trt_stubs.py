"""tensorrt-stubs 10.13.0.35.1 as mypy can read them.

The package ships `tensorrt/` and `tensorrt_bindings/` as stub-only packages
without a py.typed marker (so mypy ignores them and every TensorRT name
becomes Any), and five signatures in `tensorrt_bindings/tensorrt.pyi` are not
valid Python (a parameter named `in`; a parameter without a default after
defaulted ones). `patched_stubs(dst)` copies the installed stubs into `dst`
with those signatures repaired mechanically, for use as MYPYPATH; the stub
content is otherwise unchanged."""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
from pathlib import Path

_PARAM_IN = re.compile(r"\bin: ")


def installed_stub_root() -> Path | None:
    spec = importlib.util.find_spec("tensorrt_stubs")
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).resolve().parent.parent
    return root if (root / "tensorrt_bindings" / "tensorrt.pyi").exists() else None


def _fix_defaults(line: str) -> str:
    """def f(a, b: X = None, c: int) -> ...  ->  ..., c: int = ...) (one-line defs)."""
    m = re.match(r"^(\s*def \w+\()(.*)(\)\s*->.*)$", line)
    if not m:
        return line
    params, seen_default, out = m.group(2).split(", "), False, []
    for p in params:
        if "=" in p:
            seen_default = True
        elif seen_default and ":" in p and not p.strip().startswith("*"):
            p = p + " = ..."
        out.append(p)
    return m.group(1) + ", ".join(out) + m.group(3)


def _repair(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if line.lstrip().startswith("def "):
            line = _fix_defaults(_PARAM_IN.sub("in_: ", line))
        lines.append(line)
    return "\n".join(lines) + "\n"


def patched_stubs(dst: Path) -> Path:
    root = installed_stub_root()
    if root is None:
        raise FileNotFoundError("tensorrt-stubs is not installed (pip install --no-deps tensorrt-stubs==10.13.0.35.1)")
    for pkg in ("tensorrt", "tensorrt_bindings"):
        shutil.copytree(root / pkg, dst / pkg, dirs_exist_ok=True)
        for pyi in (dst / pkg).rglob("*.pyi"):
            fixed = _repair(pyi.read_text())
            ast.parse(fixed, filename=str(pyi))  # raises if a new stub release breaks differently
            pyi.write_text(fixed)
    return dst
