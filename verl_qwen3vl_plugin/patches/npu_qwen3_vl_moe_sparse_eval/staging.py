"""``npu_qwen3_vl_moe_sparse_eval`` as a verl pull request: read by ``scripts/upstream.py``."""

from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_sparse_eval import replacement
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_sparse_eval.spec import EXPERTS, GMM
from verl_qwen3vl_plugin.staging import Benchmark, Decorate, MoveFunctions, StagedTest, Staging

NPU_PATCH = "verl/models/transformers/npu_patch.py"

STAGING = Staging(
    base="verl==0.9.1",
    modules=("model", "hardware", "perf"),
    type="feat",
    description="grouped eval path for NPU Qwen3-VL-MoE experts",
    edits=(
        # The eval path moves in whole (its torch_npu import is the module's already) ...
        MoveFunctions(
            file=NPU_PATCH,
            source=replacement,
            names=("grouped_eval_forward",),
            before=EXPERTS,
            # The plugin's word on the verl releases it covers (the block scatters in eval on each of them).
            replace=((" in eval on every verl", ""),),
        ),
        # ... and decorates the experts' forward where it is defined, as the plugin wraps it at import.
        Decorate(
            file=NPU_PATCH,
            functions=(f"{EXPERTS}.forward",),
            decorator=f"functools.partial(grouped_eval_forward, gmm={GMM})",
            imports=("import functools",),
            note=(
                f"The plugin passes the module's `{GMM}`, which is defined above the class. The decorated forward's "
                "own eval branch (the dense `bmm`) no longer runs."
            ),
        ),
    ),
    tests=(
        StagedTest(
            path="tests/models/test_npu_qwen3_vl_moe_grouped_eval_on_cpu.py",
            source="tests/patches/npu_qwen3_vl_moe_sparse_eval/staged_npu_qwen3_vl_moe_grouped_eval.py",
        ),
    ),
    order=55,
    benchmark=Benchmark(
        section=(
            "Performance of the sparse MoE experts (`qwen3_vl_moe_sparse_experts`, `npu_qwen3_vl_moe_sparse_eval`)"
        ),
        command="nox -s bench_moe",
    ),
)
