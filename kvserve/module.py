"""InferenceModule: the base of kvserve's model modules."""
from __future__ import annotations

from torch import nn


class InferenceModule(nn.Module):
    """An nn.Module whose call is its forward, without nn.Module.__call__'s hook machinery.

    A single-stream decode step makes ~330 module calls, so that machinery is a visible share of it
    (benchmarks/LOG.md). kvserve registers no hooks on its models; hooks registered on these modules are
    ignored. Tested in tests/test_module.py."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            cls.__call__ = cls.forward

    # Submodules are also kept as plain instance attributes, so `self.child` is a dict lookup and not a call of
    # nn.Module.__getattr__ (~330 per decode step).
    # _modules stays the registry (state_dict, modules(), to()); these two methods keep the copies in step.
    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        modules = self.__dict__.get("_modules")
        if modules is not None and name in modules:
            if modules[name] is None:
                self.__dict__.pop(name, None)
            else:
                object.__setattr__(self, name, modules[name])

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__.get("_modules", {}):
            self.__dict__.pop(name, None)
        super().__delattr__(name)
