"""Helpers shared by the torchvision stand-in modules (test-only)."""

from __future__ import annotations

_MSG = (
    "torchvision.{name} is not available: this is the sgl-sparse CPU test "
    "stand-in for torchvision (tests/cpu_stand_ins), which only exists so that "
    "SGLang's multimodal modules can be imported. Text-only serving never calls it."
)


def make_stub(qualname: str):
    """A class usable as a function, a class or a base class; using it raises."""

    def _raise(*_args, **_kwargs):
        raise NotImplementedError(_MSG.format(name=qualname))

    return type(
        qualname.rsplit(".", 1)[-1],
        (),
        {
            "__init__": _raise,
            "__call__": _raise,
            "__module__": "torchvision." + qualname.rsplit(".", 1)[0]
            if "." in qualname
            else "torchvision",
            "__qualname__": qualname.rsplit(".", 1)[-1],
            "__doc__": f"Stand-in for torchvision.{qualname} (raises NotImplementedError).",
        },
    )


def module_getattr(module_name: str, cache: dict):
    """PEP 562 ``__getattr__``: any public attribute becomes a raising stub."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in cache:
            cache[name] = make_stub(f"{module_name}.{name}" if module_name else name)
        return cache[name]

    return __getattr__
