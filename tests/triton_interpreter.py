"""Triton's interpreter (TRITON_INTERPRET=1) without two costs that change nothing the tests compute: conftest.py and
tests/gpu_step_ops.py call `lighten()` before a kernel runs.

- Its integer-overflow sanitizer: every int32 add, sub and mul of a kernel is redone in int64 and compared with the
  int32 range, and the comparison goes to a device_assert that does nothing unless the options' `debug` is set,
  which the interpreter never sets: work whose result is thrown away.
- Its re-patching of triton.language at every call of a @triton.jit helper (tl.max and tl.sum are such helpers: two
  calls per key block of the attention kernel): the patch is the same each time within one launch, as the
  interpreter applies it and never undoes a helper's. Within a launch, a helper whose module the launch has patched
  already is not patched again; outside a launch everything runs as before.

Both reach into triton.runtime.interpreter (its private names, triton==3.7.1 as the Makefile pins): where they are
not there, `lighten` changes nothing and says so in its return value, and the tests run as they would without it
(tests/test_triton_attention.py's test_the_interpreter_runs_lightened fails then, so that it is seen)."""
from __future__ import annotations

import dataclasses
import functools


def lighten() -> list[str]:
    """Drop the two costs where this triton has them; the names of those it could not drop."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return ["triton"]
    missed = []
    builder = getattr(interpreter, "interpreter_builder", None)
    if builder is not None and hasattr(builder.options, "sanitize_overflow"):
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    else:
        missed.append("sanitize_overflow")
    names = ("_patch_lang", "_LangPatchScope", "GridExecutor")
    if all(hasattr(interpreter, name) for name in names):
        if not getattr(interpreter._patch_lang, "patches_once", False):
            _patch_once_a_launch(interpreter)
    else:
        missed.append("_patch_lang")
    return missed


def _patch_once_a_launch(interpreter) -> None:
    """A launch (GridExecutor's call) marks its start and end; inside it, _patch_lang patches each module's
    globals once: the kernel's first (GridExecutor's own call, its scope undone when the grid is done), then those of
    any helper from another module (a helper's scope is dropped, as the interpreter drops it)."""
    state = {"in_launch": False, "patched": set()}
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__

    @functools.wraps(launch)
    def launch_once(self, *args, **kwargs):
        state["in_launch"], state["patched"] = True, set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["in_launch"], state["patched"] = False, set()

    def patched_once(fn):
        if not state["in_launch"]:
            return patch_lang(fn)
        module = id(fn.__globals__)
        if module in state["patched"]:
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        state["patched"].add(module)
        return scope
    patched_once.patches_once = True
    interpreter.GridExecutor.__call__ = launch_once
    interpreter._patch_lang = patched_once
