"""Target of ``overlong_prompt_filter``: ``RLHFDataset`` in verl's ``rl_dataset``.

- ``POPS_BEFORE_READING`` (verl 0.7.x): ``_build_messages(self, example)`` pops ``self.image_key`` and
  ``self.video_key`` from ``example``, and ``maybe_filter_out_long_prompts`` measures each row in a nested function
  that calls ``self._build_messages(doc)`` and afterwards tests ``image_key in doc`` (or ``self.image_key in doc``).
- ``KEEPS_COLUMNS`` (verl >= 0.8): ``_build_messages`` pops nothing from ``example`` and reads both columns with
  ``example.get``; the filter measures rows through it.
"""

from __future__ import annotations

import ast
from types import ModuleType

from verl_qwen3vl_plugin import originals, syntax
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import RL_DATASET

DATASET, BUILD, FILTER = "RLHFDataset", "_build_messages", "maybe_filter_out_long_prompts"
COLUMNS = {"self.image_key", "self.video_key"}

POPS_BEFORE_READING = Shape(id="verl0.7-filter-reads-popped-columns", verdict=Verdict.APPLY, verl=">=0.7,<0.8")
KEEPS_COLUMNS = Shape(id="verl0.8-messages-keep-columns", verdict=Verdict.FIXED_UPSTREAM, verl=">=0.8")


def _columns(build: ast.FunctionDef, example: str, method: str) -> set[str]:
    """The ``self.<key>`` columns ``build`` reads from ``example`` through ``example.<method>(...)``."""
    return {
        ast.unparse(c.args[0])
        for c in syntax.call_nodes(build, method)
        if isinstance(c.func, ast.Attribute) and ast.unparse(c.func.value) == example and c.args
    }


def _tests_column_after_building(measure: ast.FunctionDef) -> bool:
    """Whether ``measure(doc)`` builds messages from ``doc`` and later tests ``image_key in doc``."""
    params = syntax.parameters(measure)
    if not params:
        return False
    doc = params[0]
    built = [
        c.lineno
        for c in syntax.call_nodes(measure, BUILD)
        if c.args and isinstance(c.args[0], ast.Name) and c.args[0].id == doc
    ]
    tested = [
        n.lineno
        for n in ast.walk(measure)
        if isinstance(n, ast.Compare)
        and [type(op) for op in n.ops] == [ast.In]
        and ast.unparse(n.left) in {"image_key", "self.image_key"}
        and ast.unparse(n.comparators[0]) == doc
    ]
    return bool(built) and bool(tested) and min(tested) > min(built)


def probe(tree: ast.Module) -> Decision:
    cls = syntax.find_class(tree, DATASET)
    build, filter_long = syntax.find_function(cls, BUILD), syntax.find_function(cls, FILTER)
    if build is None or filter_long is None or len(syntax.parameters(build)) < 2:
        return unrecognized(f"{DATASET} lacks {BUILD}(self, example, ...) or {FILTER}")
    example = syntax.parameters(build)[1]
    measures = [
        f
        for f in ast.walk(filter_long)
        if isinstance(f, ast.FunctionDef) and f is not filter_long and syntax.calls_self(f, BUILD)
    ]
    if not measures:
        return unrecognized(f"{FILTER} does not measure rows through self.{BUILD}")
    popped, read = _columns(build, example, "pop"), _columns(build, example, "get")
    if popped == COLUMNS and not read and all(_tests_column_after_building(m) for m in measures):
        return POPS_BEFORE_READING.decision(
            f"{BUILD} pops the image and video columns from the row, and {FILTER} looks for them only afterwards: "
            "it counts every image as one token"
        )
    if not syntax.call_nodes(build, "pop") and read >= COLUMNS:
        return KEEPS_COLUMNS.decision(f"{BUILD} reads the image and video columns without removing them (verl#5004)")
    return unrecognized(f"{BUILD} and {FILTER} read the vision columns in an unknown way")


def _apply(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.overlong_prompt_filter.replacement import measuring_rows_intact

    originals.wrap(getattr(module, DATASET), FILTER, measuring_rows_intact)


DETAILS = """\
**Seen.** Through verl 0.7.1's own `RLHFDataset` with Qwen3-VL's processor over a byte-level tokenizer
(`tests/patches/overlong_prompt_filter/`): a geo3k-shaped row (the e2e run's) whose prompt is 134 tokens long, 4 of
them its image's, is counted as 131. At `max_prompt_length` 133 verl 0.7.1 keeps it, and the patch drops it, with
one filter worker or two; at 134 both keep it. A prompt kept this way fails later in the rollout or the trainer
("Expected size 2048 but got size 2597", verl#5004), or is truncated.

**Details of the change.** While the filter runs, the dataset's `_build_messages` is given a deep copy of each row,
so the image and video columns are still there when the filter hands them to the processor. A deep copy because
verl also writes a decoded `image` into each image dict beside its `bytes`, and `process_image` refuses a dict with
both. `__getitem__` is untouched: it still builds from the row itself.

**Upstream plan.** A backport of verl 0.8's change (`_build_messages` reads the columns with `example.get`,
`__getitem__` pops them) to the 0.7.x release branch, PR title `[data] fix: count vision tokens in the overlong-prompt
filter`. verl#5004 is the open PR for the same fix on main, where 0.8 already has it. The test goes to
`tests/utils/dataset/test_rl_dataset_on_cpu.py`.
"""

PATCH = Patch(
    name="overlong_prompt_filter",
    title="verl 0.7.x's overlong-prompt filter counts the vision tokens of image and video prompts",
    group=MODEL,
    targets=(
        Target(
            module=RL_DATASET,
            name=DATASET,
            probe=probe,
            apply=_apply,
            shapes=(POPS_BEFORE_READING, KEEPS_COLUMNS),
        ),
    ),
    why=(
        "With data.filter_overlong_prompts, verl 0.7.x measures an image or video prompt after _build_messages has "
        "taken its images and videos out of the row: each image counts as one placeholder token, so overlong "
        "multimodal prompts pass the filter and fail or are truncated later."
    ),
    how=(
        "While the filter runs, _build_messages is given a deep copy of each row, so the filter hands the row's "
        "images and videos to the processor and counts their tokens, as verl 0.8 does."
    ),
    upstream=("verl#5004",),
    remove_when="verl 0.7.x is not among the verl releases you run (0.8 counts vision tokens).",
    details=DETAILS,
)
