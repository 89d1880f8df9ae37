"""Targets of ``qwen3_vl_nested_position_ids``: the modules that call ``maybe_fix_3d_position_ids`` on every batch
before they split or read it, ``verl.workers.engine_workers`` (``TrainingWorker``), ``verl.workers.engine.base``
(``BaseEngine``) and ``verl.workers.engine_workers_tinker`` (``TinkerTrainingWorker``, whose ``forward_backward``
calls it and then the engine's ``forward_backward_batch``, past ``BaseEngine``). Each binds the name at import, so the
name is replaced there. ``tensordict_utils`` itself is left alone: ``import verl`` imports it, and patches apply when
their target is imported, not at ``import verl``. The fourth target is the FSDP engine's split into micro-batches,
``prepare_micro_batches`` as ``verl.workers.engine.fsdp.transformer_impl`` binds it: a split that rebuilds each nested
field with ``as_nested_tensor`` rope-packs an equal-length micro-batch again after the callers' fix, so the wrapper
fixes each micro-batch once more.

- ``RELABELS_RAGGED_INDEX``: the caller imports ``maybe_fix_3d_position_ids`` from ``verl.utils.tensordict_utils``,
  where it is ``(data)`` and its whole body is ``if KNOWN_TEST: KNOWN_BODY``, which sets ``_ragged_idx = 2`` on a
  3-d nested ``data["position_ids"]``.
- ``NO_3D_POSITION_FIX``: the caller's class is there and its module never names the function. On the engine target
  it is a repacking split where ``tensordict_utils`` has no such function.
- ``NO_TINKER_WORKER``: no ``engine_workers_tinker`` module.
- ``SPLITS_REPACK``: ``transformer_impl`` imports ``prepare_micro_batches`` from verl's engine utils and calls it,
  ``index_select_tensor_dict`` or ``chunk_tensordict`` calls ``as_nested_tensor``, and the function has
  ``RELABELS_RAGGED_INDEX``'s body.
- ``SPLITS_KEEP_RAGGED_INDEX``: the same call, and both splits rebuild with ``nested_tensor_from_tensor_list(...,
  ragged_idx=...)``, neither with ``as_nested_tensor``.

Any other body is unrecognized, verl#7901's fix among them: no code of it could be read, only its description.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from types import ModuleType

from verl_qwen3vl_plugin import environment, originals, syntax
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import (
    ENGINE_BASE,
    ENGINE_UTILS,
    ENGINE_WORKERS,
    ENGINE_WORKERS_TINKER,
    FSDP_ENGINE,
    TENSORDICT_UTILS,
)

FUNCTION = "maybe_fix_3d_position_ids"
CALLERS = {ENGINE_WORKERS: "TrainingWorker", ENGINE_BASE: "BaseEngine", ENGINE_WORKERS_TINKER: "TinkerTrainingWorker"}
NO_TINKER_WORKER = Shape(id="no-tinker-worker", verdict=Verdict.NOT_USED, verl="<0.9")
# Where a caller's module is missing: verl before its Tinker worker (every supported verl has the FSDP engine).
ABSENT = {ENGINE_WORKERS_TINKER: (NO_TINKER_WORKER, "this verl has no Tinker training worker")}


KNOWN_TEST = "'position_ids' in data.keys() and data['position_ids'].dim() == 3 and data['position_ids'].is_nested"
KNOWN_BODY = "data['position_ids']._ragged_idx = 2"
MICRO_BATCHES = "prepare_micro_batches"  # the FSDP engine's split of a batch, bound from verl.workers.engine.utils
SPLITS = ("index_select_tensor_dict", "chunk_tensordict")  # what it splits with: dynamic and fixed micro-batch sizes


RELABELS_RAGGED_INDEX = Shape(id="verl0.7.1-relabels-ragged-index", verdict=Verdict.APPLY, verl=">=0.7.1")
NO_3D_POSITION_FIX = Shape(id="verl0.7.0-no-3d-position-fix", verdict=Verdict.NOT_USED, verl="==0.7.0")
SPLITS_KEEP_RAGGED_INDEX = Shape(id="verl0.8-splits-keep-ragged-index", verdict=Verdict.FIXED_UPSTREAM, verl=">=0.8")
SPLITS_REPACK = Shape(id="verl0.7-splits-repack", verdict=Verdict.APPLY, verl=">=0.7.1,<0.8")


def _sets_index_only(func: ast.FunctionDef) -> bool:
    """verl's whole body, statement for statement (its comment aside): ``if KNOWN_TEST: KNOWN_BODY``."""
    body = [n for n in func.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.If) or body[0].orelse:
        return False
    return ast.unparse(body[0].test) == KNOWN_TEST and [ast.unparse(n) for n in body[0].body] == [KNOWN_BODY]


def _imports_function(tree: ast.Module) -> bool:
    return any(
        isinstance(n, ast.ImportFrom) and n.module == TENSORDICT_UTILS and any(a.name == FUNCTION for a in n.names)
        for n in tree.body
    )


def probe_function(tree: ast.Module | None) -> Decision:
    """verl's function itself, in ``tensordict_utils``' parsed source."""
    func = syntax.find_function(tree, FUNCTION)
    if func is None:
        return unrecognized(f"verl's tensordict_utils has no {FUNCTION}")
    if syntax.parameters(func) != ["data"]:
        return unrecognized(f"{FUNCTION} is not ({FUNCTION}(data))")
    if _sets_index_only(func):
        return RELABELS_RAGGED_INDEX.decision(
            f"{FUNCTION} only sets _ragged_idx = 2: equal-length samples arrive rope-packed and stay wrong"
        )
    return unrecognized(f"{FUNCTION} matches no known verl release's body")


def caller_probe(caller: str) -> Callable[[ast.Module], Decision]:
    def probe(tree: ast.Module) -> Decision:
        if _imports_function(tree):
            return probe_function(environment.tree(TENSORDICT_UTILS))
        if syntax.find_class(tree, CALLERS[caller]) is not None and not syntax.mentions(tree, FUNCTION):
            return NO_3D_POSITION_FIX.decision(f"{CALLERS[caller]} never calls {FUNCTION} (verl 0.7.0)")
        return unrecognized(f"{caller} neither imports {FUNCTION} nor has verl 0.7.0's shape")

    return probe


def _split_rebuild(tree: ast.Module | None) -> str | None:
    """How verl's micro-batch splits rebuild a nested field: ``"repack"`` with ``as_nested_tensor`` (verl 0.7: an
    equal-length subset comes out rope-packed again), ``"keep"`` with ``nested_tensor_from_tensor_list(...,
    ragged_idx=...)`` (verl >= 0.8: the input's layout kept); None for neither."""
    splits = [syntax.find_function(tree, name) for name in SPLITS]
    if tree is None or any(split is None for split in splits):
        return None
    if any(syntax.calls(split, "as_nested_tensor") for split in splits):
        return "repack"
    keeps = [
        any(
            k.arg == "ragged_idx"
            for call in syntax.call_nodes(split, "nested_tensor_from_tensor_list")
            for k in call.keywords
        )
        for split in splits
    ]
    return "keep" if all(keeps) else None


def _binds_micro_batches(tree: ast.Module) -> bool:
    return any(
        isinstance(n, ast.ImportFrom)
        and (n.module == ENGINE_UTILS or (n.level == 2 and n.module == "utils"))  # absolute, or ..utils
        and any(a.name == MICRO_BATCHES for a in n.names)
        for n in tree.body
    ) and syntax.calls(tree, MICRO_BATCHES)


def probe_engine(tree: ast.Module) -> Decision:
    """The FSDP engine's micro-batches: the callers' fix runs before the split, so the split must keep the layout."""
    if not _binds_micro_batches(tree):
        return unrecognized(f"{FSDP_ENGINE} does not import and call {MICRO_BATCHES} from verl's engine utils")
    utils = environment.tree(TENSORDICT_UTILS)
    rebuild = _split_rebuild(utils)
    if rebuild == "keep":
        return SPLITS_KEEP_RAGGED_INDEX.decision(
            f"verl's {' and '.join(SPLITS)} rebuild nested fields with the input's ragged index"
        )
    if rebuild is None:
        return unrecognized(f"verl's {' and '.join(SPLITS)} rebuild nested fields in no known way")
    if syntax.find_function(utils, FUNCTION) is None:
        return NO_3D_POSITION_FIX.decision(
            f"verl 0.7.0 fixes no 3-d position ids before the split either ({FUNCTION} is absent)"
        )
    if probe_function(utils).verdict is Verdict.UNRECOGNIZED:
        return unrecognized(f"verl's {FUNCTION} matches no known verl release's body")
    return SPLITS_REPACK.decision(
        f"verl's {' and '.join(SPLITS)} rebuild nested fields with as_nested_tensor: an equal-length micro-batch "
        "comes out rope-packed after the callers' fix, and the engine reads its values as (8, seq), not (4, 2 * seq)"
    )


def _apply_engine(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids.replacement import canonical_micro_batches

    originals.wrap(module, MICRO_BATCHES, canonical_micro_batches)


def _apply(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids.replacement import maybe_fix_3d_position_ids

    originals.replace(module, FUNCTION, maybe_fix_3d_position_ids)


DETAILS = """\
**The failure, as users see it.** The engine fails with `split_with_sizes expects split_sizes to sum exactly to ...
got [4, 4, 4, 4]`, or, with padding removal, a rotary shape mismatch such as `The size of tensor a (300) must match
the size of tensor b (8)`. The end-to-end run (`nox -s e2e`) found it, crashing on its first update step without the
patch. Where verl 0.7.1's split rope-packs a micro-batch again, the engine reads its values as `(8, seq)` instead of
`(4, 2 * seq)`.

**Details of the change.** A rope-packed tensor is rebuilt and written back, even into a locked, consolidated
TensorDict. A sequence-packed one whose index a pickle round trip reset gets its index set to 2 in place, as verl
does. `tests/patches/qwen3_vl_nested_position_ids/test_in_effect.py` runs verl's own function and verl's own split
against the plugin's on every stack, on samples packed as TransferQueue packs them.

**Upstream plan.** verl#7899 reports that an equal-length batch crashes the V1 trainer. verl#7901 (open) proposes the
same validating rebuild in place of the blind relabel in `maybe_fix_3d_position_ids`
(`verl/utils/tensordict_utils.py`), and write sites that build the right layout. Review verl#7901, or send
`sequence_ragged` as `[trainer] fix: rebuild rope-packed 3D position_ids in maybe_fix_3d_position_ids`. Its tests
would go to a `*_on_cpu.py` file beside verl's tests of `tensordict_utils`.
"""

PATCH = Patch(
    name="qwen3_vl_nested_position_ids",
    title="multimodal position ids ragged along the sequence, whatever the lengths",
    group=MODEL,
    targets=(
        *(
            Target(
                module=caller,
                probe=caller_probe(caller),
                apply=_apply,
                absent=ABSENT[caller][0].when_absent(ABSENT[caller][1]) if caller in ABSENT else None,
                reads=(TENSORDICT_UTILS,),
                shapes=(NO_TINKER_WORKER, RELABELS_RAGGED_INDEX.narrowed(verl=">=0.9"))
                if caller in ABSENT
                else (NO_3D_POSITION_FIX, RELABELS_RAGGED_INDEX),
            )
            for caller in CALLERS
        ),
        Target(
            module=FSDP_ENGINE,
            probe=probe_engine,
            apply=_apply_engine,
            reads=(TENSORDICT_UTILS,),
            shapes=(NO_3D_POSITION_FIX, SPLITS_REPACK, SPLITS_KEEP_RAGGED_INDEX),
        ),
    ),
    why=(
        "verl 0.9.1's trainer crashes on Qwen3-VL and Qwen3.5 as soon as every sequence of a batch has one length "
        "(GRPO's n responses cut at the same maximum): TransferQueue packs their (4, seq) position_ids ragged along "
        "the rope rows, verl's maybe_fix_3d_position_ids relabels them as ragged along the sequence without moving "
        "the values, and the engine fails (a split_with_sizes error, or a rotary shape mismatch with padding "
        "removal)."
    ),
    how=(
        "verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids.replacement.maybe_fix_3d_position_ids: "
        "the batch's 3-d nested position_ids rebuilt from their values and offsets as sequence-ragged, from either "
        "layout that reaches it (rope-packed, or sequence-packed with its index reset); a canonical tensor passes "
        "through untouched, and one in no known layout raises a ValueError that names its shapes. On verl 0.7's FSDP "
        "engine, canonical_micro_batches wraps prepare_micro_batches to fix each micro-batch after the split."
    ),
    upstream=("verl#7899", "verl#7901"),
    remove_when="verl's maybe_fix_3d_position_ids rebuilds the layout (verl#7901) in every supported release.",
    details=DETAILS,
)
