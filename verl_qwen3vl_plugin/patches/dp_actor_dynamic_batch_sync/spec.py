"""Targets of ``dp_actor_dynamic_batch_sync``: verl's legacy ``dp_actor`` and ``dp_critic`` modules. Each binds
``prepare_dynamic_batch`` at import, so the name is replaced there, by one that passes the default group when the
caller passes none; verl's own split then syncs the count.

Every shape but ``ENGINE_PASSES_DP_GROUP`` needs ``prepare_dynamic_batch(data, max_token_len, dp_group, ...)``
handing ``dp_group=dp_group`` to ``rearrange_micro_batches``, which all-reduces ``num_micro_batches`` once over
``group=dp_group``. Every clause of the conditions over that all-reduce must be in ``KNOWN_CLAUSES``, written inline or
through a name the function assigns once, and ``dp_group`` read nowhere else.

- ``SYNCS_ONLY_WITH_DP_GROUP``: a condition over the all-reduce has the clause ``dp_group is not None``.
- ``SYNCS_OVER_DEFAULT_GROUP``: no condition over it reads ``dp_group``, so None means the default group.
- ``PASSES_NO_DP_GROUP``: ``DataParallelPPOActor.compute_log_prob`` and ``update_policy``
  (``DataParallelPPOCritic.compute_values`` and ``update_critic``) each call ``prepare_dynamic_batch`` once, none
  with a ``dp_group``, over a ``SYNCS_ONLY_WITH_DP_GROUP`` split. Over the other split the caller reads as that split.
- ``PASSES_DP_GROUP``: the same calls, each passing a ``dp_group`` that is not a literal None, over either split.
- ``ENGINE_PASSES_DP_GROUP``, where the legacy modules are missing: ``FSDPEngine.forward_backward_batch`` calls
  ``prepare_micro_batches``, every call of it in ``FSDPEngine`` passes a DP group, the engine calls neither
  ``prepare_dynamic_batch`` nor ``rearrange_micro_batches`` itself, and ``prepare_micro_batches(data, dp_group, ...)``
  hands ``dp_group=dp_group`` to a ``rearrange_micro_batches`` that syncs the count once.
"""

from __future__ import annotations

import ast
from types import ModuleType

from verl_qwen3vl_plugin import environment, originals, syntax
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import DP_ACTOR, DP_CRITIC, ENGINE_UTILS, FSDP_ENGINE, SEQLEN_BALANCING

GUARD = "dp_group is not None"
KNOWN_CLAUSES = {"dist.is_initialized()", "same_micro_num_in_dp", GUARD}  # in the known splits' conditions
FUNCTION = "prepare_dynamic_batch"
SPLITTER = "rearrange_micro_batches"
CALLERS = {  # the legacy module -> its class and the methods that split a batch
    DP_ACTOR: ("DataParallelPPOActor", ("compute_log_prob", "update_policy")),
    DP_CRITIC: ("DataParallelPPOCritic", ("compute_values", "update_critic")),
}


PASSES_NO_DP_GROUP = Shape(id="verl0.7.1-passes-no-dp-group", verdict=Verdict.APPLY, verl="==0.7.1")
PASSES_DP_GROUP = Shape(
    id="passes-dp-group", verdict=Verdict.FIXED_UPSTREAM, elsewhere="no release yet: callers that pass their dp_group"
)
ENGINE_PASSES_DP_GROUP = Shape(id="verl0.8-engine-passes-dp-group", verdict=Verdict.NOT_USED, verl=">=0.8")
SYNCS_ONLY_WITH_DP_GROUP = Shape(id="verl0.7.1-syncs-only-with-dp-group", verdict=Verdict.APPLY, verl="==0.7.1")
SYNCS_OVER_DEFAULT_GROUP = Shape(
    id="verl0.7.0-syncs-over-default-group", verdict=Verdict.FIXED_UPSTREAM, verl="==0.7.0"
)


def _keyword(call: ast.Call, name: str, value: str | None = None) -> bool:
    """Whether ``call`` passes ``name=`` (as the source text ``value``, when given)."""
    return any(k.arg == name and (value is None or ast.unparse(k.value) == value) for k in call.keywords)


def _passes_group(call: ast.Call, position: int) -> bool:
    """A DP group other than a literal None, by position or by keyword."""
    given = [k.value for k in call.keywords if k.arg == "dp_group"] + call.args[position : position + 1]
    return any(not (isinstance(v, ast.Constant) and v.value is None) for v in given)


def _conditions_over(func: ast.FunctionDef, call: ast.Call) -> list[ast.expr]:
    """The tests of the ``if`` statements that enclose ``call`` in ``func``."""
    found: list[ast.expr] = []

    def visit(node: ast.AST, tests: list[ast.expr]) -> None:
        if node is call:
            found.extend(tests)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, tests + [node.test] if isinstance(node, ast.If) and child is not node.test else tests)

    visit(func, [])
    return found


def _count_syncs(split: ast.FunctionDef) -> list[ast.Call]:
    """The all-reduces of the micro-batch count (``num_micro_batches``) over ``group=dp_group``."""
    return [
        c
        for c in syntax.call_nodes(split, "all_reduce")
        if _keyword(c, "group", "dp_group") and [ast.unparse(a) for a in c.args[:1]] == ["num_micro_batches"]
    ]


def _balancing() -> tuple[ast.FunctionDef, ast.FunctionDef] | Decision:
    """verl's ``prepare_dynamic_batch`` and ``rearrange_micro_batches``, where the first hands its group on."""
    tree = environment.tree(SEQLEN_BALANCING)
    prepare, split = syntax.find_function(tree, FUNCTION), syntax.find_function(tree, SPLITTER)
    if prepare is None or split is None:
        return unrecognized(f"{SEQLEN_BALANCING} lacks {FUNCTION} or {SPLITTER}")
    if syntax.parameters(prepare)[:3] != ["data", "max_token_len", "dp_group"]:
        return unrecognized(f"{FUNCTION} is not (data, max_token_len, dp_group, ...)")
    if not any(_keyword(c, "dp_group", "dp_group") for c in syntax.call_nodes(prepare, SPLITTER)):
        return unrecognized(f"{FUNCTION} does not hand dp_group to {SPLITTER}")
    return prepare, split


def probe_balancing() -> Decision:
    """What verl 0.7's split does with ``dp_group=None``: the guarded shape (0.7.1) is the affected one. Every clause
    of every condition over the count's all-reduce must be a known one, and ``dp_group`` read nowhere else."""
    found = _balancing()
    if isinstance(found, Decision):
        return found
    _, split = found
    reduces = _count_syncs(split)
    if len(reduces) != 1:
        return unrecognized(f"{SPLITTER} does not all-reduce the count over dp_group once")
    clauses = [c for t in _conditions_over(split, reduces[0]) for c in _clauses(_expanded(split, t))]
    texts = [ast.unparse(c) for c in clauses]
    reads = sum(isinstance(n, ast.Name) and n.id == "dp_group" for n in ast.walk(split))
    if not set(texts) <= KNOWN_CLAUSES or reads != 1 + texts.count(GUARD):
        return unrecognized(f"{SPLITTER} conditions its count sync in an unknown way")
    if GUARD in texts:
        return SYNCS_ONLY_WITH_DP_GROUP.decision(f"{SPLITTER} syncs the micro-batch count only when given a dp_group")
    return SYNCS_OVER_DEFAULT_GROUP.decision(
        f"{SPLITTER} syncs the count over the default group without a dp_group (0.7.0)"
    )


def _expanded(func: ast.FunctionDef, test: ast.expr) -> ast.expr:
    """``test`` with a bare name replaced by the one value ``func`` assigns it (a name verl assigns elsewhere, or
    more than once, stays a name: an unknown clause)."""
    if isinstance(test, ast.Name):
        values = [
            n.value
            for n in ast.walk(func)
            if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == [test.id]
        ]
        if len(values) == 1:
            return values[0]
    return test


def _clauses(test: ast.expr) -> list[ast.expr]:
    """The operands of a top-level ``and`` (or the test itself)."""
    return test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]


def probe_caller(module: str, tree: ast.Module) -> Decision:
    cls_name, methods = CALLERS[module]
    cls = syntax.find_class(tree, cls_name)
    imported = any(
        isinstance(n, ast.ImportFrom)
        and n.module == SEQLEN_BALANCING
        and any(a.name == FUNCTION and not a.asname for a in n.names)
        for n in tree.body
    )
    per_method = [syntax.call_nodes(syntax.find_function(cls, m) or ast.Pass(), FUNCTION) for m in methods]
    calls = [c for found in per_method for c in found]
    if cls is None or not imported or any(len(found) != 1 for found in per_method):
        return unrecognized(f"{cls_name} does not split batches as verl 0.7 does ({', '.join(methods)})")
    balancing = probe_balancing()
    if balancing.verdict is Verdict.UNRECOGNIZED:
        return balancing
    if all(_passes_group(c, 2) for c in calls):
        return PASSES_DP_GROUP.decision(f"{cls_name} passes its dp_group to {FUNCTION}")
    if any(_passes_group(c, 2) for c in calls):
        return unrecognized(f"{cls_name} passes dp_group to {FUNCTION} in some calls only")
    if balancing.verdict is Verdict.APPLY:
        return PASSES_NO_DP_GROUP.decision(f"{cls_name}.{'/'.join(methods)} pass no dp_group and {balancing.reason}")
    return balancing


def probe_engine() -> Decision:
    """verl >= 0.8, where the legacy modules are gone: every split of the FSDP engine must be given its DP group."""
    engine, utils = syntax.find_class(environment.tree(FSDP_ENGINE), "FSDPEngine"), environment.tree(ENGINE_UTILS)
    prepare = syntax.find_function(utils, "prepare_micro_batches")
    hands_on = (
        prepare is not None
        and syntax.parameters(prepare)[:2] == ["data", "dp_group"]
        and any(_keyword(c, "dp_group", "dp_group") for c in syntax.call_nodes(prepare, SPLITTER))
    )
    found = _balancing()
    syncs = not isinstance(found, Decision) and len(_count_syncs(found[1])) == 1
    method = syntax.find_function(engine, "forward_backward_batch")
    calls = syntax.call_nodes(engine, "prepare_micro_batches") if engine else []
    direct = [f for f in (FUNCTION, SPLITTER) if engine and syntax.calls(engine, f)]
    if (
        hands_on
        and not direct
        and method is not None
        and syntax.calls(method, "prepare_micro_batches")
        and all(_passes_group(c, 1) for c in calls)
        and syncs
    ):
        return ENGINE_PASSES_DP_GROUP.decision(
            "no legacy FSDP actor/critic; every split of the FSDP engine gets its DP group (verl#5591)"
        )
    return unrecognized("no legacy FSDP actor/critic, and the FSDP engine's split is not verl 0.8's")


def _apply(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.dp_actor_dynamic_batch_sync.replacement import with_default_group

    originals.wrap(module, FUNCTION, with_default_group)


DETAILS = """\
**Seen.** The guard sits in `rearrange_micro_batches` (`verl/utils/seqlen_balancing.py`); verl 0.7.0 has none.
`tests/patches/dp_actor_dynamic_batch_sync/test_probes.py` runs verl 0.7.1's real `DataParallelPPOActor` on two
FSDP2 ranks on the CPU, large images on rank 0 and small ones on rank 1. With the patch disabled both ranks fail
within the test's time bounds. verl's own `prepare_dynamic_batch` on two gloo ranks of different lengths makes
`[2, 1]` micro-batches, the wrapper `[2, 2]`. Through the real actor both ranks make 2 in `compute_log_prob` and in
`update_policy`, and the log-probs are within 1e-5 of fixed micro-batches.

**Details of the change.** The wrapper passes `dist.group.WORLD` only when a process group is initialised and the
caller passes no group. A caller that passes a group is left alone.

**Upstream plan.** A backport of verl#5591's idea (the FSDP engine passes its DP group) to the 0.7.x release branch:
`compute_log_prob` and `update_policy` in `verl/workers/actor/dp_actor.py`, and `compute_values` and `update_critic`
in `verl/workers/critic/dp_critic.py`, pass `dp_group` to `prepare_dynamic_batch`. verl >= 0.8 needs nothing. PR
title: `[fsdp] fix: agree on the dynamic micro-batch count across ranks in dp_actor and dp_critic`. The two-rank
test would go to a `*_on_cpu.py` file beside verl's actor tests.
"""

PATCH = Patch(
    name="dp_actor_dynamic_batch_sync",
    title="one micro-batch count across ranks in verl 0.7.1's FSDP actor and critic",
    group=MODEL,
    targets=tuple(
        Target(
            module=module,
            probe=lambda tree, module=module: probe_caller(module, tree),
            apply=_apply,
            absent=probe_engine,
            reads=(SEQLEN_BALANCING, FSDP_ENGINE, ENGINE_UTILS),
            shapes=(PASSES_NO_DP_GROUP, SYNCS_OVER_DEFAULT_GROUP, PASSES_DP_GROUP, ENGINE_PASSES_DP_GROUP),
        )
        for module in CALLERS
    ),
    why=(
        "With use_dynamic_bsz, verl 0.7.1's FSDP actor and critic split each rank's batch by its own token count "
        "and never agree on the number of micro-batches: a rank with large images makes more forward passes than "
        "its peers, and FSDP hangs on the first pass the others never make."
    ),
    how=(
        "prepare_dynamic_batch, as dp_actor and dp_critic call it, is given the default process group when the "
        "caller passes none, so verl's own split all-reduces the count (MAX) as verl 0.7.0 did."
    ),
    upstream=("verl#6176", "verl#6178", "verl#5591"),
    remove_when="verl 0.7.1 is not among the verl releases you run (0.7.0 and 0.8+ agree on the count).",
    details=DETAILS,
)
