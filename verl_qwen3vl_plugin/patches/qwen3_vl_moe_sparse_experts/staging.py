"""``qwen3_vl_moe_sparse_experts`` as a transformers pull request: read by ``scripts/upstream.py``.

**This pull request** edits the modular file (`modular_qwen3_vl_moe.py`) and the modeling file generated from it
(`modeling_qwen3_vl_moe.py`) alike: the grouped helpers sit at module level before `Qwen3VLMoeTextExperts`, whose
`forward` the plugin's takes the place of, with its optional `use_grouped_mm` keyword (None picks by support; False
forces the per-expert loop). `utils/modular_model_converter.py` (not in the sdist) was not run on it: the modeling
file gets the standard library's `logging.getLogger(__name__)` (the same logger object as transformers'
`logging.get_logger(__name__)`), where `make fix-copies` would write the modular file's transformers form. The moved
code runs on Python 3.9, which transformers 4.57 supports: `zip(..., strict=True)` loses `strict` (its parts have
equal lengths) and `X | None` becomes `Optional[X]`.
"""

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts import replacement
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts.spec import EXPERTS
from verl_qwen3vl_plugin.staging import Benchmark, MoveFunctions, ReplaceMethod, StagedTest, Staging

MODULAR = "src/transformers/models/qwen3_vl_moe/modular_qwen3_vl_moe.py"
MODELING = "src/transformers/models/qwen3_vl_moe/modeling_qwen3_vl_moe.py"
HELPERS = ("grouped_mm_is_right", "_runs_right", "_ContiguousGrad", "grouped_experts")
# Python 3.9, which transformers 4.57 supports, evaluates annotations and has no zip(strict=...).
PY39 = ((", strict=True", ""), ("bool | None", "Optional[bool]"))
# The plugin's prefix on its log message goes; where its logger moves too (the modeling file binds none), it is the
# module's.
PREFIX = ("verl-qwen3vl-plugin: ", "")
LOGGER = ('"verl_qwen3vl_plugin"', "__name__")
# The replacement's docstring says what it replaces; the method's says what it does.
DOCSTRING = (
    "``Qwen3VLMoeTextExperts.forward`` (transformers 4.57): the same arguments and result, in every mode.",
    "Each token's routed experts, one grouped GEMM per projection: the same kernels in training and eval.",
)


def _edits(file: str, wording: tuple) -> tuple:
    return (
        MoveFunctions(file=file, source=replacement, names=HELPERS, before=EXPERTS, replace=(*PY39, *wording)),
        ReplaceMethod(
            file=file,
            source=replacement,
            function="sparse_experts_forward",
            method=f"{EXPERTS}.forward",
            replace=(("bool | None", "Optional[bool]"), DOCSTRING),
        ),
    )


STAGING = Staging(
    base="transformers==4.57.6",
    modules=(),
    type="",
    description=(
        "[Qwen3-VL-MoE] Grouped experts in training and eval: only the routed experts run, same outputs in both modes"
    ),
    edits=(*_edits(MODULAR, (PREFIX,)), *_edits(MODELING, (PREFIX, LOGGER))),
    tests=(
        StagedTest(
            path="tests/models/qwen3_vl_moe/test_modeling_qwen3_vl_moe_experts.py",
            source="tests/patches/qwen3_vl_moe_sparse_experts/staged_modeling_qwen3_vl_moe_experts.py",
        ),
    ),
    order=92,
    backport_of="v4.57-release",
    fixed_on_main_by=("transformers#42697",),
    stack="verl0.7.1-tf4.57.6",
    benchmark=Benchmark(
        section=(
            "Performance of the sparse MoE experts (`qwen3_vl_moe_sparse_experts`, `npu_qwen3_vl_moe_sparse_eval`)"
        ),
        command="nox -s bench_moe",
    ),
)
