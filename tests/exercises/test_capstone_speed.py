"""The capstone's speed: each component's own time (nested components counted once), both engines
timed on the same workload, the ratio and the slowest component named."""
from __future__ import annotations

import time

from minipaged.core.block_manager import FreeListAllocator
from minipaged.exercises import capstone_speed as speed
from minipaged.exercises import workbench


def test_a_components_own_time_leaves_out_the_components_it_calls():
    clock = speed.ComponentClock()
    inner = clock.timed("inner", lambda: time.sleep(0.05))

    def outer_work():
        time.sleep(0.02)
        inner()

    clock.counting = True
    clock.timed("outer", outer_work)()
    assert 0.045 <= clock.own["inner"] < 0.2
    assert 0.015 <= clock.own["outer"] < 0.045  # its own 0.02 s, not the inner 0.05 s


class SlowAllocator(FreeListAllocator):
    """The package's free list with a slow allocate of its own."""

    def allocate(self):
        time.sleep(0.001)
        return super().allocate()

    def helper_of_mine(self):
        return 1


def test_a_class_is_timed_on_the_methods_it_defines_and_its_twin_on_the_same_names():
    clock = speed.ComponentClock()
    timed = clock.wrap("allocator", SlowAllocator)
    assert issubclass(timed, SlowAllocator) and timed.__name__ == "SlowAllocator"
    assert speed.own_methods(SlowAllocator) == ("allocate", "helper_of_mine")
    from minipaged.block import Device

    clock.counting = True
    allocator = timed(Device.CPU, 4, 4)
    allocator.allocate()
    assert allocator.helper_of_mine() == 1 and clock.own["allocator"] >= 0.001
    twin = clock.wrap("package", FreeListAllocator, speed.own_methods(SlowAllocator))
    assert "allocate" in vars(twin) and "helper_of_mine" not in vars(twin)
    assert clock.wrap("phase 3", "  // C++\n") == "  // C++\n"


def test_the_line_gives_the_ratio_and_names_the_component_that_grew_most():
    timing = speed.Speed(tokens=100, yours_s=2.0, package_s=1.0,
                         yours_own={"Scheduler": 0.9, "Sampler": 0.3},
                         package_own={"Scheduler": 0.1, "Sampler": 0.25})
    line = timing.line()
    assert "your engine 50 tokens/s, LLM()'s 100 tokens/s" in line and "0.50x" in line
    assert "slowest component against the package's: Scheduler (0.900 s" in line
    assert "9.0x" in line
    assert "not measured" in speed.Speed(0, 0.0, 0.0).line()
    timing.yours_own[speed.MODEL], timing.package_own[speed.MODEL] = 3.0, 1.0
    line = timing.line()
    assert "slowest component against the package's: Scheduler" in line  # never the model
    assert "the model itself, the same code in both, took 3.00x its time in LLM()" in line


def test_the_package_twin_of_a_component_is_the_object_at_its_first_slot():
    twins = speed.package_twins({"FreeListAllocator": SlowAllocator})
    assert twins == {"FreeListAllocator": workbench.component("FreeListAllocator")
                     .package_object()}


def test_the_first_step_is_left_out():
    class Engine:
        def step(self):
            time.sleep(0.03)
            work()
            return []

    clock = speed.ComponentClock()
    work = clock.timed("work", lambda: time.sleep(0.01))
    engine = Engine()
    clock.step(engine)
    assert clock.steps == 0.0 and not clock.own
    clock.step(engine)
    assert 0.035 <= clock.steps < 0.2 and 0.008 <= clock.own["work"] < 0.05
