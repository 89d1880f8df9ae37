"""This patch is retired by deleting its two folders and its ``NAMES`` line: nothing else names it."""

from tests.test_new_patch import names_left_after_retiring
from verl_qwen3vl_plugin.patches.dp_actor_dynamic_batch_sync.spec import PATCH


def test_retiring_it_leaves_no_file_naming_it(tmp_path):
    assert names_left_after_retiring(PATCH.name, tmp_path) == []
