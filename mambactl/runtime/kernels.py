"""WGSL sources: find every entry point, and reflect what explicit bind group layouts need.

Each `kernels/NAME.wgsl` is one op family. Globals are declared as
`@group(0) @binding(N) var<storage, read> x: array<f32>;` (or `read_write`, or `var<uniform> p: Params`, or
`var x_tex: texture_2d<f32>;`, a tensor the runtime copies into a texture for the dispatch: runtime/gpu.py).
For an entry point we collect the globals it reaches (its body and the functions it calls), so its
bind group layout lists exactly those bindings with their real numbers and access modes — never `auto`.

A file that needs a WGSL extension (`enable f16;`) is its own module, so the others still compile on adapters
without it; it may build on another file with a line `//! extends NAME`: its module is then compiled as its
`enable` directives, NAME.wgsl, then its own code (so it reuses NAME's bindings and helpers without a copy), and
it lists only its own entry points. A line `//! include NAME` (any number of them) puts NAME.wgsl's code (helpers,
no entry points: e.g. texture.wgsl) in front of the module's own the same way. An entry point's `features` name
the adapter features it needs: those of its module's `enable` lines, and `subgroup` where it uses subgroup
operations.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

_GLOBAL = re.compile(
    r"@group\(0\)\s*@binding\((\d+)\)\s*var<\s*(storage|uniform)\s*(?:,\s*(read_write|read))?\s*>\s*(\w+)\s*:\s*([^;]+);"
)
_TEXTURE = re.compile(r"@group\(0\)\s*@binding\((\d+)\)\s*var\s+(\w+)\s*:\s*texture_2d<f32>\s*;")
_FN = re.compile(r"(@compute[^\n]*\n)?\s*fn\s+(\w+)\s*\(")
_STRUCT = re.compile(r"struct\s+(\w+)\s*\{([^}]*)\}")
_IDENT = re.compile(r"(?<![\w.])[A-Za-z_]\w*")  # not a member access like gid.y
_COMMENT = re.compile(r"//[^\n]*")
_PARAM = re.compile(r"(\w+)\s*:")  # a parameter's name in a function's parameter list
_LOCAL = re.compile(r"\b(?:let|var|const)\s+(\w+)")  # a name a function body declares
_SCALAR_SIZE = {"u32": 4, "i32": 4, "f32": 4}
# WGSL that only compiles where the device has the `subgroup` feature (naga validates a whole module against the
# device's features, so a module using it would fail everywhere else).
_SUBGROUP_USE = re.compile(r"\bsubgroup[A-Z]\w*\s*\(|@builtin\(\s*subgroup_")
_ENABLE = re.compile(r"^\s*enable\s+([\w\s,]+);", re.M)
_EXTENDS = re.compile(r"^//! extends (\w+)\s*$", re.M)
_INCLUDE = re.compile(r"^//! include (\w+)\s*$", re.M)
_ENABLE_FEATURES = {"f16": "shader-f16"}  # WGSL extension -> the wgpu feature the device must have


@dataclass(frozen=True)
class Binding:
    number: int
    name: str
    kind: str  # "uniform" | "read" | "read_write" | "texture"


@dataclass(frozen=True)
class EntryPoint:
    module: str  # file stem, e.g. "linear"
    name: str
    bindings: tuple[Binding, ...]  # sorted by number
    params: tuple[tuple[str, str], ...]  # uniform struct fields (name, scalar type), in order; () if none
    features: tuple[str, ...] = ()  # device features it needs ("shader-f16" by its module's enable, "subgroup")


@dataclass(frozen=True)
class Module:
    name: str
    source: str
    entries: dict
    # The source without the functions that use subgroup operations (and the entries that call them), for devices
    # without the feature and for every entry point that uses none; the same text when nothing uses them.
    source_without_subgroup: str = ""

    def source_for(self, features) -> str:
        return self.source if "subgroup" in features else self.source_without_subgroup


def _definitions(src: str):
    """(match of the `fn` header, index just past the body's closing brace) per function, by brace matching."""
    for m in _FN.finditer(src):
        depth, i = 0, src.index("{", m.end())
        while True:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            if depth == 0:
                break
            i += 1
        yield m, i + 1


def _functions(src: str) -> dict[str, tuple[bool, str]]:
    """name -> (is_compute_entry, body text)."""
    return {m.group(2): (m.group(1) is not None, src[m.end() : end]) for m, end in _definitions(src)}


def _referenced(text: str) -> set[str]:
    """The identifiers a function's text (its parameter list and body) refers to outside itself: every identifier
    but the names it declares (parameters, let / var / const), so a local `k` does not count as a use of a
    binding `k` (which would put that binding in the layout and make a dispatch that does not pass it fail)."""
    params = text[: text.index("{")].rsplit(")", 1)[0]
    local = set(_PARAM.findall(params)) | set(_LOCAL.findall(text))
    return set(_IDENT.findall(text)) - local


def _function_spans(src: str) -> dict[str, tuple[int, int]]:
    """name -> (start, end) of the whole definition (attributes included)."""
    return {m.group(2): (m.start(), end) for m, end in _definitions(src)}


def _uses_subgroup(funcs: dict[str, tuple[bool, str]]) -> set[str]:
    """The functions that use subgroup operations themselves or through a function they call."""
    uses = {f for f, (_, body) in funcs.items() if _SUBGROUP_USE.search(body)}
    grew = True
    while grew:
        grew = False
        for f, (_, body) in funcs.items():
            if f not in uses and any(ident in uses for ident in _referenced(body)):
                uses.add(f)
                grew = True
    return uses


def parse_module(name: str, source: str, base: str = "") -> Module:
    """`base`: the (comment-free) source of the module this one extends; it is compiled after this file's
    `enable` directives and before the rest of it, and its entry points are not this module's."""
    source = _COMMENT.sub("", source)
    enables = _ENABLE.findall(source)
    extensions = [x.strip() for e in enables for x in e.split(",")]
    features = tuple(_ENABLE_FEATURES[x] for x in extensions if x in _ENABLE_FEATURES)
    own = set(_functions(source))
    if base:
        body = _ENABLE.sub("", source)
        source = "".join(f"enable {e.strip()};\n" for e in enables) + base + "\n" + body
    globals_ = {m.group(4): (int(m.group(1)), m.group(2), m.group(3), m.group(5).strip()) for m in _GLOBAL.finditer(source)}
    globals_.update({m.group(2): (int(m.group(1)), "texture", None, "") for m in _TEXTURE.finditer(source)})
    structs = {m.group(1): m.group(2) for m in _STRUCT.finditer(source)}
    funcs = _functions(source)
    subgroup_fns = _uses_subgroup(funcs)
    entries = {}
    for fname, (is_entry, _) in funcs.items():
        if not is_entry or fname not in own:
            continue
        used: set[str] = set()
        seen: set[str] = set()
        todo = [fname]
        while todo:
            f = todo.pop()
            if f in seen:
                continue
            seen.add(f)
            for ident in _referenced(funcs[f][1]):
                if ident in globals_:
                    used.add(ident)
                elif ident in funcs and ident not in seen:
                    todo.append(ident)
        bindings, params = [], ()
        for g in used:
            number, space, access, ty = globals_[g]
            kind = space if space in ("uniform", "texture") else (access or "read")
            bindings.append(Binding(number, g, kind))
            if space == "uniform":
                fields = [f.strip() for f in structs[ty].split(",") if f.strip()]
                params = tuple((f.split(":")[0].strip(), f.split(":")[1].strip()) for f in fields)
                for pname, pty in params:
                    if pty not in _SCALAR_SIZE:
                        raise ValueError(f"{name}.wgsl: uniform field {pname} has type {pty}; only u32/i32/f32")
        entries[fname] = EntryPoint(name, fname, tuple(sorted(bindings, key=lambda b: b.number)), params,
                                    features + (("subgroup",) if fname in subgroup_fns else ()))
    stripped = source
    for start, end in sorted((span for f, span in _function_spans(source).items() if f in subgroup_fns), reverse=True):
        stripped = stripped[:start] + stripped[end:]
    return Module(name, source, entries, stripped)  # source without comments is what gets compiled


def kernel_dir():
    """Where the WGSL files are: the kernels/ folder of the checkout this package was imported from (so a checkout
    first on sys.path runs its own kernels, whatever is installed), else the installed `mambactl.kernels` data.
    The folder has no __init__.py: a checkout's root on sys.path (`python -m pytest` puts it there) would otherwise
    shadow the PyPI package `kernels`, which transformers imports; mambactl.kernels is a namespace package."""
    checkout = Path(__file__).resolve().parents[2] / "kernels"
    if any(checkout.glob("*.wgsl")):
        return checkout
    return resources.files("mambactl.kernels")


def _code(texts: dict, name: str) -> str:
    """NAME.wgsl without comments, after the files it includes."""
    return "\n".join([_code(texts, i) for i in _INCLUDE.findall(texts[name])] + [_COMMENT.sub("", texts[name])])


@lru_cache(maxsize=None)
def all_modules() -> dict[str, Module]:
    root = kernel_dir()
    texts = {f.name[:-5]: f.read_text() for f in root.iterdir() if f.name.endswith(".wgsl")}
    mods = {}
    for name in sorted(texts):
        ext = _EXTENDS.search(texts[name])
        bases = _INCLUDE.findall(texts[name]) + ([ext.group(1)] if ext else [])
        base = "\n".join(_code(texts, b) for b in bases)
        mods[name] = parse_module(name, texts[name], base)
    return mods


@lru_cache(maxsize=None)
def entry_point(name: str) -> EntryPoint:
    for mod in all_modules().values():
        if name in mod.entries:
            return mod.entries[name]
    raise KeyError(f"no WGSL entry point named {name!r}")


def module_source(name: str) -> str:
    return all_modules()[name].source
