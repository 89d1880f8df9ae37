"""``registry.Shape``: the release ranges a shape is seen in, and the one shape a target declares per stack."""

from __future__ import annotations

import pytest

from verl_qwen3vl_plugin.registry import Shape, Target, Verdict, in_range


@pytest.mark.parametrize(
    ("version", "spec", "held"),
    [
        ((0, 7, 1), ">=0.7.1,<0.9", True),
        ((0, 9, 0), ">=0.7.1,<0.9", False),
        ((0, 7, 0), ">=0.7.1,<0.9", False),
        ((0, 7, 1), "==0.7.1", True),
        ((0, 7, 0), "==0.7.1", False),
        ((4, 57, 6), "<5", True),
        ((5, 0, 0), "<5", False),
        ((5, 3, 0), "", True),
    ],
)
def test_in_range(version, spec, held):
    assert in_range(version, spec) is held


def test_an_unknown_operator_is_a_clear_error():
    with pytest.raises(ValueError, match="'~=0.7': use >=, < or =="):
        in_range((0, 7, 1), "~=0.7")


def test_narrowed_keeps_the_tighter_bounds():
    shape = Shape(id="s", verdict=Verdict.APPLY, transformers=">=5.9,<5.16")
    assert shape.narrowed(transformers=">=5.2").transformers == ">=5.9,<5.16"
    assert Shape(id="s", verdict=Verdict.APPLY, transformers="<5.9").narrowed(transformers=">=5.2").transformers == (
        ">=5.2,<5.9"
    )


def test_a_shape_of_a_pull_requests_branch_is_seen_on_no_stack():
    assert not Shape(id="s", verdict=Verdict.FIXED_UPSTREAM, elsewhere="verl#1's branch").seen_on((0, 9, 1), (5, 10))


@pytest.mark.parametrize(
    "shapes",
    [
        (Shape(id="old", verdict=Verdict.APPLY, verl="<0.8"),),
        (Shape(id="a", verdict=Verdict.APPLY), Shape(id="b", verdict=Verdict.NOT_USED)),
    ],
    ids=["none", "two"],
)
def test_a_target_has_one_shape_per_stack_or_says_so(shapes):
    target = Target(module="m", probe=lambda tree: None, apply=None, shapes=shapes)
    with pytest.raises(LookupError, match=r"m: [02] declared shapes seen on verl 0.9.1, transformers 5.10.4"):
        target.shape_on((0, 9, 1), (5, 10, 4))


def test_only_a_not_used_shape_stands_for_an_absent_module():
    assert Shape(id="gone", verdict=Verdict.NOT_USED).when_absent("no such module")().shape == "gone"
    with pytest.raises(ValueError, match="not apply: here"):
        Shape(id="here", verdict=Verdict.APPLY).when_absent("no such module")
