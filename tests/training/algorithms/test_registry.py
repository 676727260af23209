import pytest

from training.algorithms.registry import Registry


def test_registry_errors():
    reg: Registry = Registry("widget")

    @reg.register("a")
    def a():
        return 1

    reg.register("a")(a)  # same function again is fine
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(lambda: 2)
    with pytest.raises(KeyError, match="valid names: a"):
        reg.get("b")
    assert reg.names() == ["a"] and "a" in reg and len(reg) == 1
