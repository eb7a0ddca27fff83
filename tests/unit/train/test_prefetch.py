"""StepPrefetch: step s + 1 is built in a background thread while step s runs, the results are what a
plain build gives, in order, and an error in the thread surfaces in the loop."""

import threading
import time

import pytest
import torch

from dflash_train.train.prefetch import StepPrefetch, worth_prefetching


def test_the_next_step_is_built_in_the_background_and_results_equal_plain_builds():
    built = []

    def build(step):
        built.append((step, threading.current_thread().name))
        time.sleep(0.05)
        return [step * 10 + micro for micro in range(2)]

    with StepPrefetch(build, total=4) as prefetch:
        got = []
        for step in range(4):
            got.append(prefetch.get(step))
            time.sleep(0.1)  # "the device runs the step": the next build finishes meanwhile
            if step < 3:
                assert built[-1][0] == step + 1  # already started before the loop asks for it
    assert got == [build(s) for s in range(4)]
    steps = [s for s, _ in built[:4]]
    assert steps == [0, 1, 2, 3]  # each step built once, none past the end
    assert built[0][1] == "MainThread" and all(name.startswith("step-prefetch") for _, name in built[1:4])


def test_a_resumed_loop_starts_anywhere_and_an_unexpected_step_is_built_afresh():
    with StepPrefetch(lambda s: s, total=10) as prefetch:
        assert [prefetch.get(s) for s in (6, 7, 8)] == [6, 7, 8]
        assert prefetch.get(3) == 3  # not the prefetched 9: built for the step asked
        assert prefetch.get(4) == 4


def test_an_error_in_the_background_build_is_raised_by_get():
    def build(step):
        if step == 2:
            raise RuntimeError("row 7 is broken")
        return step

    prefetch = StepPrefetch(build, total=5)
    assert prefetch.get(0) == 0 and prefetch.get(1) == 1
    with pytest.raises(RuntimeError, match="row 7 is broken"):
        prefetch.get(2)
    prefetch.close()


def test_disabled_builds_in_the_loops_thread():
    names = []
    prefetch = StepPrefetch(lambda s: names.append(threading.current_thread().name) or s, total=3, enabled=False)
    assert [prefetch.get(s) for s in range(3)] == [0, 1, 2] and set(names) == {"MainThread"}
    prefetch.close()


def test_prefetching_is_on_for_a_gpu_only_unless_the_recipe_says():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not worth_prefetching(cpu) and worth_prefetching(cuda)  # auto
    assert worth_prefetching(cpu, True) and not worth_prefetching(cuda, False)


def test_the_recipe_takes_true_false_or_auto():
    from dflash_train.errors import ConfigError
    from dflash_train.train.recipe import load_recipe

    for value, want in (("true", True), ("false", False), ("auto", "auto")):
        assert load_recipe("recipes/smollm2-135m-demo.yaml", [f"engine.prefetch={value}"]).recipe.engine.prefetch == want
    with pytest.raises(ConfigError, match="engine.prefetch"):
        load_recipe("recipes/smollm2-135m-demo.yaml", ["engine.prefetch=sometimes"])
