"""Optimization profiles: from the manifest's per-stage `profile` ranges to
the [min, opt, max] shape of every input, and back from concrete shapes to
the profile that covers them. Pure logic, no TensorRT: the engine builder and
the TensorRT backend both use it, and it is tested on the CPU.

A stage's `profile` is either one mapping `{"T": [min, opt, max], ...}` or a
list of such mappings (several TensorRT optimization profiles, e.g. a small
and a large sequence range). Input dimensions in the manifest are ints,
symbol names (`"T"`) or small expressions of them (`"P + 1"`, `"2*T"`)."""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cosyedge_models.errors import BundleError, SynthesisError

Dim = int | str
Shape = tuple[int, ...]


@dataclass(frozen=True)
class ShapeRange:
    min: Shape
    opt: Shape
    max: Shape

    def contains(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.min) and all(
            lo <= s <= hi for lo, s, hi in zip(self.min, shape, self.max, strict=True))


# One TensorRT optimization profile: input name -> its shape range.
ProfileShapes = dict[str, ShapeRange]


def eval_dim(dim: Dim, values: Mapping[str, int]) -> int:
    """An int, a symbol, or + - * // over ints and symbols (nothing else is
    evaluated: the manifest is data, not code)."""
    if isinstance(dim, int):
        return dim
    try:
        tree = ast.parse(str(dim).strip(), mode="eval")
    except SyntaxError as exc:
        raise BundleError(f"manifest: cannot read dimension {dim!r}") from exc

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in values:
                raise BundleError(f"manifest: dimension {dim!r} uses {node.id!r}, which the stage's profile "
                                  f"does not give (profile has: {sorted(values)})")
            return values[node.id]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.FloorDiv):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            return a // b
        raise BundleError(f"manifest: dimension {dim!r} is not an int, a symbol or +, -, *, // of them")

    return ev(tree)


def stage_profiles(entry: Mapping[str, Any], stage: str) -> list[dict[str, tuple[int, int, int]]]:
    """The stage's profile(s) as a list of {symbol: (min, opt, max)}, checked."""
    raw = entry.get("profile")
    if raw is None:
        return [{}]
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        raise BundleError(f"manifest: stages.{stage}.profile is an empty list")
    out: list[dict[str, tuple[int, int, int]]] = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise BundleError(f"manifest: stages.{stage}.profile[{i}] must map dimension names to [min, opt, max]")
        prof: dict[str, tuple[int, int, int]] = {}
        for sym, rng in item.items():
            if (not isinstance(rng, list | tuple) or len(rng) != 3
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in rng)):
                raise BundleError(f"manifest: stages.{stage}.profile {sym!r} must be [min, opt, max] ints, got {rng!r}")
            lo, opt, hi = rng
            if not 0 <= lo <= opt <= hi:
                raise BundleError(f"manifest: stages.{stage}.profile {sym!r} = {list(rng)} "
                                  "needs 0 <= min <= opt <= max")
            prof[str(sym)] = (lo, opt, hi)
        out.append(prof)
    return out


def input_ranges(inputs: Sequence[Mapping[str, Any]], profile: Mapping[str, tuple[int, int, int]],
                 stage: str) -> ProfileShapes:
    """Shape range of every input for one profile. `inputs` are the manifest's
    `{"name", "shape"}` entries."""
    at = [{k: v[i] for k, v in profile.items()} for i in range(3)]
    ranges: ProfileShapes = {}
    for spec in inputs:
        name = str(spec["name"])
        dims = spec.get("shape")
        if not isinstance(dims, list):
            raise BundleError(f"manifest: stages.{stage} input {name!r} has no shape list")
        lo, opt, hi = (tuple(eval_dim(d, values) for d in dims) for values in at)
        if any(d < 0 for d in lo + opt + hi):
            raise BundleError(f"manifest: stages.{stage} input {name!r} evaluates to a negative dimension")
        ranges[name] = ShapeRange(lo, opt, hi)
    return ranges


def all_input_ranges(entry: Mapping[str, Any], stage: str) -> list[ProfileShapes]:
    inputs = entry.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BundleError(f"manifest: stages.{stage} lists no inputs; re-export the bundle")
    return [input_ranges(inputs, prof, stage) for prof in stage_profiles(entry, stage)]


def choose_profile(profiles: Sequence[ProfileShapes], shapes: Mapping[str, Sequence[int]], stage: str) -> int:
    """Index of the profile that covers all `shapes`; among several, the one
    with the smallest max volume (its buffers are the smallest)."""
    fits = [i for i, prof in enumerate(profiles)
            if all(name in prof and prof[name].contains(shape) for name, shape in shapes.items())]
    if not fits:
        have = "; ".join(", ".join(f"{n} {list(r.min)}..{list(r.max)}" for n, r in p.items()) for p in profiles)
        got = ", ".join(f"{n} {list(s)}" for n, s in shapes.items())
        raise SynthesisError(f"{stage}: input shapes {got} are outside the engine's optimization profiles ({have}); "
                          "rebuild the engines with a larger profile in the manifest")
    return min(fits, key=lambda i: sum(math.prod(r.max) for r in profiles[i].values()))


Range = tuple[int, int, int]


def cap_profile(profile: Mapping[str, Range], caps: Mapping[str, int]) -> dict[str, Range]:
    """Clamp the max (and opt, min) of the symbols named in `caps`."""
    out = {}
    for sym, (lo, opt, hi) in profile.items():
        if sym in caps:
            hi = min(hi, caps[sym])
            opt, lo = min(opt, hi), min(lo, hi)
        out[sym] = (lo, opt, hi)
    return out
