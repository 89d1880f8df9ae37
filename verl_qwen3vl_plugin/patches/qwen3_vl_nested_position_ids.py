"""Patch ``qwen3_vl_nested_position_ids``: verl's FSDP engine gets multimodal ``position_ids`` ragged along the
sequence, whatever the samples' lengths.

Target: ``verl.utils.tensordict_utils``, whose ``maybe_fix_3d_position_ids(data)`` verl's engine worker and engine
call on every batch before they split or read it. ``engine_workers`` and ``engine.base`` import the name; the hook
runs when ``tensordict_utils`` is imported, normally before them, and rebinds it in any verl module that was first.
verl's function only sets ``_ragged_idx = 2``: right for a sequence-packed tensor whose index a pickle round trip
reset, wrong for the rope-packed layout TransferQueue (verl 0.9's data path) builds when
every sample has one length, which it turns into an inconsistent tensor. verl 0.9.1 then crashes on Qwen3-VL and
Qwen3.5 as soon as a batch's sequences share a length (GRPO's n responses cut at the same maximum).

Known shapes (the probe's whole knowledge):
- affected, verl 0.7.0 to 0.9.1: ``maybe_fix_3d_position_ids(data)`` whose whole body is verl's one ``if`` on a
  3-d nested ``data["position_ids"]`` that sets its ``_ragged_idx = 2``;
- fixed: none released; verl#7901 (open) would rebuild the layout there. Until its final shape ships, any other body is
  ``unrecognized``.
"""

from __future__ import annotations

import ast
import functools
import sys
from types import ModuleType

from verl_qwen3vl_plugin import compat
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Target, Verdict, not_used_when_absent

TARGET = "verl.utils.tensordict_utils"
FUNCTION = "maybe_fix_3d_position_ids"


KNOWN_TEST = "'position_ids' in data.keys() and data['position_ids'].dim() == 3 and data['position_ids'].is_nested"
KNOWN_BODY = "data['position_ids']._ragged_idx = 2"


def _sets_index_only(func: ast.FunctionDef) -> bool:
    """verl's whole body, statement for statement (its comment aside): ``if KNOWN_TEST: KNOWN_BODY``."""
    body = [n for n in func.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.If) or body[0].orelse:
        return False
    return ast.unparse(body[0].test) == KNOWN_TEST and [ast.unparse(n) for n in body[0].body] == [KNOWN_BODY]


def decide(tree: ast.Module) -> Decision:
    func = compat.find_function(tree, FUNCTION)
    if func is None:
        return Decision(Verdict.UNRECOGNIZED, f"verl's tensordict_utils has no {FUNCTION}")
    if compat.parameters(func) != ["data"]:
        return Decision(Verdict.UNRECOGNIZED, f"{FUNCTION} is not ({FUNCTION}(data))")
    if _sets_index_only(func):
        return Decision(
            Verdict.APPLY,
            f"{FUNCTION} only sets _ragged_idx = 2: equal-length samples arrive rope-packed and stay wrong",
        )
    return Decision(Verdict.UNRECOGNIZED, f"{FUNCTION} matches no known verl release's body")


def _apply(module: ModuleType) -> None:
    from verl_qwen3vl_plugin.replacements.qwen3_vl_nested_position_ids import maybe_fix_3d_position_ids

    original = getattr(module, FUNCTION)

    @functools.wraps(original)  # __wrapped__: verl's, for the self-test
    def fixed(data) -> None:
        maybe_fix_3d_position_ids(data)

    for name, importer in list(sys.modules.items()):  # verl modules that bound the name before this hook ran
        if name.startswith("verl.") and importer is not None and vars(importer).get(FUNCTION) is original:
            setattr(importer, FUNCTION, fixed)


PATCH = Patch(
    name="qwen3_vl_nested_position_ids",
    group=MODEL,
    targets=(Target(TARGET, decide, _apply, not_used_when_absent("this verl has no tensordict_utils")),),
    devices=None,
    why=(
        "verl 0.9.1's trainer crashes on Qwen3-VL and Qwen3.5 as soon as every sequence of a batch has one length "
        "(GRPO's n responses cut at the same maximum): TransferQueue packs their (4, seq) position_ids ragged along "
        "the rope rows, verl's maybe_fix_3d_position_ids relabels them as ragged along the sequence without moving "
        "the values, and the engine fails (a split_with_sizes error, or a rotary shape mismatch with padding "
        "removal)."
    ),
    how=(
        "verl_qwen3vl_plugin.replacements.qwen3_vl_nested_position_ids.maybe_fix_3d_position_ids: "
        "the batch's 3-d nested position_ids rebuilt from their values and offsets as sequence-ragged, from either "
        "layout that reaches it (rope-packed, or sequence-packed with its index reset); a canonical tensor passes "
        "through untouched, and one in no known layout raises a ValueError that names its shapes."
    ),
    upstream=("verl#7899", "verl#7901"),
    remove_when="verl's maybe_fix_3d_position_ids rebuilds the layout (verl#7901) in every supported release.",
    selftest="verl_qwen3vl_plugin.selftest.qwen3_vl_nested_position_ids",
)
