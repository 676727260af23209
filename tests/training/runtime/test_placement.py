"""A run's placement group (training.runtime.placement) on a real local Ray: its bundles from the
recipe, a run that waits for room and gives up after its timeout with one line, a run beside
another run of this process that waits on until that one ends, a stop that interrupts the wait,
and the lock that places a multi-group run's groups together."""

from __future__ import annotations

import threading
import time

import pytest

from training.recipe import recipe_from_dict
from training.runtime.placement import PlacementError, RunPlacement, _fits, placing_alone


def _recipe(**placement):
    return recipe_from_dict({"name": "t", "engines": {"num_rollout_engines": 2,
                                                      "rollout_threads": 2,
                                                      "placement": placement}})


def test_bundles_follow_the_recipe():
    assert RunPlacement(_recipe()).plan() == [{"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}]
    custom = RunPlacement(_recipe(trainer={"train_node": 1}, rollout={"CPU": 0.5, "r": 2}))
    assert custom.plan() == [{"CPU": 1.0, "train_node": 1.0}, {"CPU": 0.5, "r": 2.0},
                             {"CPU": 0.5, "r": 2.0}]
    sglang = recipe_from_dict({"name": "t", "engines": {"rollout": "sglang"}})
    assert RunPlacement(sglang).plan() == [{"CPU": 1.0}]  # its engines: the fleet's own group
    with pytest.raises(PlacementError, match="asks for no resources at all"):
        RunPlacement(_recipe(trainer={"CPU": 0})).plan()


def test_fits_sums_every_bundle():
    assert _fits([{"CPU": 2}, {"CPU": 2, "x": 1}], {"CPU": 4, "x": 1})
    assert not _fits([{"CPU": 2}, {"CPU": 3}], {"CPU": 4})
    assert not _fits([{"gpu_node": 1}], {"CPU": 64})


def test_a_run_that_does_not_fit_gives_up_with_one_line(ray_session):
    ray = ray_session
    total = ray.cluster_resources()["CPU"]
    p = RunPlacement(_recipe(trainer={"CPU": total + 1}, timeout_s=1))  # never fits
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as err:
        p.reserve(ray)
    assert 1 <= time.monotonic() - t0 < 10
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and "no room for this run's bundles" in msg
    assert p.group is None


@pytest.mark.slow  # ≈5 s of waiting past a timeout
def test_beside_a_run_that_holds_the_cluster_a_run_waits_for_it(ray_session):
    """Past its timeout a run still waits while another run of this process holds a group and
    the cluster could hold both one after the other; it is placed once that run ends."""
    ray = ray_session
    total = ray.cluster_resources()["CPU"]
    half = {"CPU": 0.5}  # the two engines: 1 CPU; the trainer: all the rest but 1
    first = RunPlacement(_recipe(trainer={"CPU": total - 2}, rollout=half, timeout_s=5))
    first.reserve(ray)
    second = RunPlacement(_recipe(trainer={"CPU": total - 2}, rollout=half, timeout_s=1))
    placed = threading.Event()
    errors: list[BaseException] = []

    def place():
        try:
            second.reserve(ray)
            placed.set()
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=place)
    t.start()
    time.sleep(4)  # well past the second run's 1 s timeout
    assert not placed.is_set() and not errors
    first.release(ray)
    t.join(30)
    assert placed.is_set() and not errors
    second.release(ray)


def test_a_stop_interrupts_the_wait(ray_session):
    ray = ray_session
    total = ray.cluster_resources()["CPU"]
    half = {"CPU": 0.5}
    first = RunPlacement(_recipe(trainer={"CPU": total - 2}, rollout=half, timeout_s=5))
    first.reserve(ray)
    stop = threading.Event()
    second = RunPlacement(_recipe(trainer={"CPU": total - 2}, rollout=half))
    threading.Timer(1.5, stop.set).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            second.reserve(ray, stop)
        assert time.monotonic() - t0 < 5 and second.group is None
    finally:
        first.release(ray)


def test_multi_group_runs_place_one_at_a_time():
    order: list[str] = []
    inside = threading.Event()

    def run(name: str, hold: float):
        with placing_alone(True):
            order.append(f"{name} in")
            inside.set()
            time.sleep(hold)
            order.append(f"{name} out")

    a = threading.Thread(target=run, args=("a", 0.5))
    a.start()
    inside.wait(5)
    b = threading.Thread(target=run, args=("b", 0))
    b.start()
    a.join(5)
    b.join(5)
    assert order == ["a in", "a out", "b in", "b out"]
    with placing_alone(False):  # a single-group run takes no lock
        pass
    stop = threading.Event()
    stop.set()
    # the lock held: a stopped waiter gives up
    with placing_alone(True), pytest.raises(KeyboardInterrupt), placing_alone(True, stop):
        pass
