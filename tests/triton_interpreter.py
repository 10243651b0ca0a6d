"""Triton's interpreter (TRITON_INTERPRET=1) without two costs that change nothing the tests compute: conftest.py and
tests/gpu_step_ops.py call `lighten()` before a kernel runs.

- Its integer-overflow sanitizer: every int32 add, sub and mul of a kernel is redone in int64 and compared with the
  int32 range. The tests' pools and batches are kilobytes, so no index of theirs comes near 2**31; the sizes where
  an int32 index could overflow are the GPU's, and the kernels compute their pointer offsets in int64 for them.
- Its re-patching of triton.language at every call of a @triton.jit helper (tl.max and tl.sum are such helpers: two
  calls per key block of the attention kernel): the patch is the same each time within one launch, as the
  interpreter applies it and never undoes a helper's. The first call of a helper module's in a launch still patches.

Both reach into triton.runtime.interpreter (its private names, triton==3.7.1 as the Makefile pins): where they are
not there, `lighten` changes nothing and says so in its return value, and the tests run as they would without it."""
from __future__ import annotations

import dataclasses


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
    if hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "_LangPatchScope"):
        if not getattr(interpreter._patch_lang, "patches_once", False):
            interpreter._patch_lang = _once_a_launch(interpreter._patch_lang, interpreter._LangPatchScope)
    else:
        missed.append("_patch_lang")
    return missed


def _once_a_launch(patch_lang, scope_class):
    """patch_lang as the interpreter calls it: first for a launch's kernel (its scope undone after the grid), then at
    each helper call (its scope dropped). A helper whose module already patched in this launch gets an empty
    scope."""
    state = {"launches": 0, "patched": set()}

    class LaunchScope:
        def __init__(self, inner):
            self.inner = inner

        def restore(self):
            state["launches"] -= 1
            state["patched"].clear()
            self.inner.restore()

    def patched_once(fn):
        if state["launches"] == 0:   # a launch: the kernel's own patch, undone when its grid is done
            state["launches"] += 1
            return LaunchScope(patch_lang(fn))
        module = id(fn.__globals__)
        if module in state["patched"]:
            return scope_class()
        state["patched"].add(module)
        return patch_lang(fn)
    patched_once.patches_once = True
    return patched_once
