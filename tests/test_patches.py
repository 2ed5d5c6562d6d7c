"""`streamsync.vllm.patches`: the one way streamsync wraps a method of a vLLM class."""

from __future__ import annotations

from streamsync.vllm.patches import MARK, wrap_method, wrapped


def test_a_method_is_wrapped_once_marked_and_keeps_its_name_and_the_original():
    class Pool:
        def reset(self, n: int) -> int:
            """vLLM's."""
            return n

    made: list[object] = []

    def make(orig):  # type: ignore[no-untyped-def]
        made.append(orig)

        def reset(self, n):  # type: ignore[no-untyped-def]
            return orig(self, n) + 1
        return reset

    assert wrap_method(Pool, "reset", make) and wrap_method(Pool, "reset", make)
    assert len(made) == 1 and Pool().reset(1) == 2  # the second call found it wrapped and left it
    assert wrapped(Pool.reset) and getattr(Pool.reset, MARK) and not wrapped(Pool.reset.__wrapped__)
    assert Pool.reset.__name__ == "reset" and Pool.reset.__doc__ == "vLLM's."


def test_a_method_that_is_missing_refused_or_on_a_class_that_takes_no_attributes_is_left_alone():
    class Pool:
        def reset(self) -> int:
            return 0

    assert not wrap_method(Pool, "absent", lambda orig: orig)
    assert not wrap_method(Pool, "reset", lambda orig: orig, when=lambda orig: False)
    assert not wrapped(Pool.reset)
    assert not wrap_method(int, "bit_length", lambda orig: lambda self: 0)  # a builtin type refuses new attributes
    assert (5).bit_length() == 3
