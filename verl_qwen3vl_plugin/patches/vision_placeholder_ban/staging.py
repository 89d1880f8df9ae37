"""``vision_placeholder_ban`` as a verl pull request: read by ``scripts/upstream.py``.

**This pull request** carries the agent loop's part only: verl 0.9's vLLM rollout already bans the placeholders
(``banned_token_ids``), so the logits patch stays in the plugin for verl 0.7 / 0.8. Another engine, or a rollout
without the ban, can still sample one: the agent loop now refuses such a sample by name before it pairs it.
"""

from verl_qwen3vl_plugin.patches.vision_placeholder_ban import replacement
from verl_qwen3vl_plugin.patches.vision_placeholder_ban.spec import POSITIONS
from verl_qwen3vl_plugin.staging import Decorate, MoveFunctions, StagedTest, Staging

FILE = "verl/experimental/agent_loop/agent_loop.py"
OWNER = "AgentLoopWorker"  # the class whose _compute_position_ids calls get_rope_index in verl 0.9.1

STAGING = Staging(
    base="verl==0.9.1",
    modules=("rollout",),
    type="fix",
    description="refuse a sampled vision placeholder by name in the agent loop",
    edits=(
        # The replacement's check moves in whole ...
        MoveFunctions(
            file=FILE,
            source=replacement,
            names=("first_stray", "refuse_strays", "processor_ids", "refuse_strays_in_positions"),
            before=OWNER,
            # The fix the error names, without the plugin's part in it.
            replace=(
                (
                    "verl >= 0.9's vLLM rollout does, and this plugin does ",
                    "verl's vLLM rollout does (banned_token_ids); ",
                ),
                ("for verl 0.7 / 0.8's; for another engine", "for another engine"),
            ),
        ),
        # ... and guards the agent loop's first pairing of a sample, as the plugin wraps it at import.
        Decorate(file=FILE, functions=(f"{OWNER}.{POSITIONS}",), decorator="refuse_strays_in_positions"),
    ),
    tests=(
        StagedTest(
            path="tests/experimental/agent_loop/test_vision_placeholder_refused_on_cpu.py",
            source="tests/patches/vision_placeholder_ban/staged_vision_placeholder_refused.py",
        ),
    ),
    order=60,
)
