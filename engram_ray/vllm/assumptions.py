"""What the DeepSeek-V4.1 patch (`engram_ray.vllm.deepseek_engram`) and an engine's restart in
place (`engram_ray.vllm.held_memory`) assume about vLLM, as named checks on vLLM's source text.

A check reads files of a vLLM tree (`SourceTree`: the folder holding an installed `vllm/`
package, an unzipped wheel, or the wheel file itself) with `ast` and never imports vLLM, so the
same checks run at engine start against the installed vLLM (`engram_ray.vllm.compat`) and
against each release's wheel (`benchmarks/check_vllm_releases.py`). Each check function returns
None when the assumption holds, else what it found instead; `check_tree(tree)` runs them all.
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ENGRAM = "vllm/models/deepseek_v41/common/engram.py"
NVIDIA_MODEL = "vllm/models/deepseek_v41/nvidia/model.py"
LOADER_UTILS = "vllm/model_executor/model_loader/utils.py"
WORKER_UTILS = "vllm/v1/worker/utils.py"
GPU_WORKER = "vllm/v1/worker/gpu_worker.py"
LOADERS = "vllm/model_executor/model_loader/__init__.py"
TABLE = "ParallelEngramEmbedding"
_REQUIRED = object()  # a parameter without a default
CONSTRUCTOR = (("self", _REQUIRED), ("num_embeddings", _REQUIRED), ("dim", _REQUIRED),
               ("head_sizes", _REQUIRED), ("block_size", 32), ("cpu_offload", False),
               ("dp_shared_memory", False), ("use_thp", False))
LOOKUP = (("self", _REQUIRED), ("indices", _REQUIRED), ("out", _REQUIRED),
          ("background", False))


class Broken(Exception):
    """An assumption does not hold; the message says what the source has instead."""


class SourceTree:
    """Source files of one vLLM tree by path relative to the folder holding `vllm/`: a
    directory (site-packages, an unzipped wheel) or a wheel (zip) read in place."""

    def __init__(self, root: Path | str, label: str = ""):
        self.root, self.label = Path(root), label or str(root)
        self._parsed: dict[str, ast.Module] = {}

    def text(self, path: str) -> str:
        try:
            if self.root.is_file():
                with zipfile.ZipFile(self.root) as wheel:
                    return wheel.read(path).decode()
            return (self.root / path).read_text()
        except (KeyError, OSError) as exc:
            raise Broken(f"{path} is missing from {self.label}") from exc
        except UnicodeDecodeError as exc:
            raise Broken(f"{path} in {self.label} is not UTF-8 text ({exc.reason} at byte "
                         f"{exc.start})") from exc

    def parsed(self, path: str) -> ast.Module:
        if path not in self._parsed:
            self._parsed[path] = ast.parse(self.text(path), filename=path)
        return self._parsed[path]


def _class(module: ast.Module, name: str, path: str) -> ast.ClassDef:
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise Broken(f"{path} defines no module-level class {name}")


def _method(tree: SourceTree, path: str, qualname: str) -> ast.FunctionDef:
    """`Class.method` (or a module-level function) of `path`."""
    module = tree.parsed(path)
    *owner, name = qualname.split(".")
    body = _class(module, owner[0], path).body if owner else module.body
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise Broken(f"{path} has no function {qualname}")


def _parameters(fn: ast.FunctionDef) -> tuple:
    args = fn.args
    if args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs:
        return ("*args/**kwargs/keyword-only/positional-only parameters",)
    defaults = [_REQUIRED] * (len(args.args) - len(args.defaults))
    for node in args.defaults:
        try:
            defaults.append(ast.literal_eval(node))
        except ValueError:
            defaults.append(ast.unparse(node))
    return tuple(zip([a.arg for a in args.args], defaults))


def _show(params: tuple) -> str:
    return "(" + ", ".join(p if isinstance(p, str) else p[0] if p[1] is _REQUIRED
                           else f"{p[0]}={p[1]!r}" for p in params) + ")"


def _calls(node: ast.AST, attr: str, owner: str | None = None) -> list[ast.Call]:
    """Calls of `<...>.attr(...)` (of `<...>.owner.attr(...)` with `owner`) or of bare `attr`."""
    found = []
    for call in ast.walk(node):
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        if isinstance(func, ast.Name) and func.id == attr and owner is None:
            found.append(call)
        elif isinstance(func, ast.Attribute) and func.attr == attr and (
                owner is None or isinstance(func.value, ast.Attribute)
                and func.value.attr == owner):
            found.append(call)
    return found


def _compares_to_one(node: ast.AST, attr: str) -> bool:
    """Whether `node` holds a comparison `<...>.attr == 1`."""
    return any(isinstance(c, ast.Compare) and isinstance(c.left, ast.Attribute)
               and c.left.attr == attr and isinstance(c.ops[0], ast.Eq)
               and isinstance(c.comparators[0], ast.Constant) and c.comparators[0].value == 1
               for c in ast.walk(node))


# --- the assumptions --------------------------------------------------------------------

def substitution_point(tree: SourceTree) -> str | None:
    fn = _method(tree, ENGRAM, "Engram._create_embedding")
    _class(tree.parsed(ENGRAM), TABLE, ENGRAM)
    calls = [c for c in _calls(fn, TABLE) if isinstance(c.func, ast.Name)]
    if not calls:
        return f"Engram._create_embedding does not call the module-level name {TABLE}"
    return None


def _signature_problem(tree: SourceTree, method: str, expected) -> str | None:
    """`TABLE.<method>(...)` as found, when its parameters are not `expected`."""
    found = _parameters(_method(tree, ENGRAM, f"{TABLE}.{method}"))
    return None if found == expected else f"{TABLE}.{method}{_show(found)}, not {_show(expected)}"


def constructor_signature(tree: SourceTree) -> str | None:
    problem = _signature_problem(tree, "__init__", CONSTRUCTOR)
    if problem:
        return problem
    allowed = {name for name, _ in CONSTRUCTOR[4:]}
    for call in _calls(_method(tree, ENGRAM, "Engram._create_embedding"), TABLE):
        extra = {k.arg for k in call.keywords} - allowed
        if len(call.args) > 3 or extra:
            return f"Engram._create_embedding passes {ast.unparse(call)[:120]}"
    return None


def lookup_signature(tree: SourceTree) -> str | None:
    problem = _signature_problem(tree, "lookup", LOOKUP)
    if problem:
        return problem
    calls = _calls(tree.parsed(ENGRAM), "lookup", owner="embed_tokens")
    if not calls:
        return "no embed_tokens.lookup(...) call in engram.py (the model calls the table how?)"
    for call in calls:
        if len(call.args) != 2 or {k.arg for k in call.keywords} - {"background"}:
            return f"engram.py calls {ast.unparse(call)}, not lookup(hash_ids, rows[, background])"
    return None


def allocation_hook(tree: SourceTree) -> str | None:
    init = _method(tree, ENGRAM, f"{TABLE}.__init__")
    if not _calls(init, "_allocate_weights"):
        return f"{TABLE}.__init__ does not call self._allocate_weights()"
    _method(tree, ENGRAM, f"{TABLE}._allocate_weights")
    loader = next((node.value for node in _class(tree.parsed(ENGRAM), TABLE, ENGRAM).body
                   if isinstance(node, ast.Assign) and any(
                       getattr(t, "id", None) == "_weight_loader" for t in node.targets)), None)
    if loader is None:
        return f"{TABLE} has no class attribute _weight_loader"
    name = ast.unparse(loader).removeprefix("staticmethod(").removesuffix(")")
    if not any(isinstance(n, ast.Attribute) and n.attr == "engram_vocab_start"
               for n in ast.walk(_method(tree, ENGRAM, name))):
        return f"{TABLE}._weight_loader ({name}) does not narrow rows by engram_vocab_start"
    return None


def join_after_loading(tree: SourceTree) -> str | None:
    fn = _method(tree, LOADER_UTILS, "process_weights_after_loading")
    if not any(isinstance(c.func, ast.Attribute) and ast.unparse(c.func.value) == "quant_method"
               for c in _calls(fn, "process_weights_after_loading")):
        return ("process_weights_after_loading no longer calls "
                "quant_method.process_weights_after_loading(module)")
    return None


def dp_staging_rule(tree: SourceTree) -> str | None:
    for node in ast.walk(tree.parsed(NVIDIA_MODEL)):
        if (isinstance(node, ast.Assign) and any(getattr(t, "attr", None) ==
                                                 "engram_dp_shared_memory" for t in node.targets)
                and _compares_to_one(node.value, "dp_size")
                and "embed_tokens" in ast.unparse(node.value)):
            return None
    return ("nvidia/model.py has no `engram_dp_shared_memory = engram.embed_tokens.dp_size == 1`"
            ": a table with dp_size 1 would get the DP group's gathered tokens")


def batch_skips_local_tables(tree: SourceTree) -> str | None:
    try:
        create = _method(tree, ENGRAM, "EngramBatch.create")
    except Broken:
        return None  # no batched staging: nothing can take the table past its lookup
    if not _compares_to_one(create, "dp_size"):
        return "EngramBatch.create no longer returns None for tables with dp_size == 1"
    return None


def prefetch_stream(tree: SourceTree) -> str | None:
    fn = _method(tree, ENGRAM, "Engram._init_staging")
    for node in ast.walk(fn):
        if (isinstance(node, ast.If) and ast.unparse(node.test) ==
                "not self.embed_tokens.cpu_offload" and any(
                    isinstance(s, ast.Assign) and ast.unparse(s) == "self._prefetch_stream = None"
                    for s in node.body)):
            return None
    return ("Engram._init_staging no longer drops the prefetch stream for tables in HBM "
            "(`if not self.embed_tokens.cpu_offload: self._prefetch_stream = None`)")


def background_grid(tree: SourceTree) -> str | None:
    lookup = _method(tree, ENGRAM, f"{TABLE}.lookup")
    uses = [n for n in ast.walk(lookup) if isinstance(n, ast.Name) and n.id == "background"]
    grids = [n for n in ast.walk(lookup) if isinstance(n, ast.IfExp)
             and ast.unparse(n.test) == "background" and "_num_sms" in ast.unparse(n)]
    if len(uses) != 1 or len(grids) != 1:
        return (f"{TABLE}.lookup uses `background` for more than its grid size "
                f"({len(uses)} uses, {len(grids)} `_num_sms ... if background` grids)")
    prefetch = _method(tree, ENGRAM, "Engram._start_prefetch")
    if not any(k.arg == "background" for c in _calls(prefetch, "lookup") for k in c.keywords):
        return "Engram._start_prefetch no longer passes background= to the table's lookup"
    return None


def external_memory_hook(tree: SourceTree) -> str | None:
    fn = _method(tree, WORKER_UTILS, "request_memory")
    if "external_weight_memory" not in [a.arg for a in fn.args.args]:
        return "request_memory takes no external_weight_memory"
    if not _calls(tree.parsed(GPU_WORKER), "get_external_weight_memory"):
        return "gpu_worker.py no longer asks the model loader for get_external_weight_memory"
    _method(tree, LOADERS, "register_model_loader")
    return None


@dataclass(frozen=True)
class Assumption:
    name: str
    assumes: str
    check: Callable[[SourceTree], str | None]


ASSUMPTIONS = (
    Assumption("substitution_point", "Engram._create_embedding builds the table through the "
               f"module-level name {TABLE} (looked up at call time)", substitution_point),
    Assumption("constructor_signature", f"{TABLE}.__init__{_show(CONSTRUCTOR)}, called with "
               "those arguments only", constructor_signature),
    Assumption("lookup_signature", f"{TABLE}.lookup{_show(LOOKUP)}; the model calls "
               "embed_tokens.lookup(hash_ids, rows[, background=...])", lookup_signature),
    Assumption("allocation_hook", f"{TABLE}.__init__ allocates through _allocate_weights(); "
               "_weight_loader narrows rows by engram_vocab_start", allocation_hook),
    Assumption("join_after_loading", "vLLM's process_weights_after_loading calls each "
               "module's quant_method.process_weights_after_loading", join_after_loading),
    Assumption("dp_staging_rule", "nvidia/model.py: engram_dp_shared_memory = "
               "engram.embed_tokens.dp_size == 1 (local tokens only)", dp_staging_rule),
    Assumption("batch_skips_local_tables", "EngramBatch.create returns None for dp_size == 1 "
               "tables", batch_skips_local_tables),
    Assumption("prefetch_stream", "tables in HBM (cpu_offload false) are looked up inline: "
               "Engram._init_staging drops the prefetch stream", prefetch_stream),
    Assumption("background_grid", "lookup's `background` only halves vLLM's own grid (the "
               "patch ignores it)", background_grid),
    Assumption("external_memory_hook", "the GPU worker subtracts the model loader's "
               "get_external_weight_memory from request_memory's budget; loaders register "
               "through register_model_loader (an engine restarted in place declares its held "
               "slice: engram_ray.vllm.held_memory)", external_memory_hook),
)


@dataclass(frozen=True)
class Finding:
    name: str
    holds: bool
    detail: str   # what is assumed when it holds, else what the source has instead


def check_tree(tree: SourceTree) -> list[Finding]:
    """Every assumption against one vLLM tree."""
    findings = []
    for assumption in ASSUMPTIONS:
        try:
            problem = assumption.check(tree)
        except (Broken, SyntaxError) as exc:
            problem = str(exc)
        findings.append(Finding(assumption.name, problem is None, problem or assumption.assumes))
    return findings
