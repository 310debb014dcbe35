"""No memoised function of the package takes a tensor argument.

``functools.cache`` keys a tensor by its identity: a second call with the same tensor objects
returns the first call's result without launching anything (stale after an in-place change,
nothing recorded under CUDA-graph capture), and every argument stays alive in the cache.
"""

import importlib
import inspect
import pkgutil

import batchinv


def _package_modules():
    for info in pkgutil.walk_packages(batchinv.__path__, "batchinv."):
        if info.name.endswith("__main__"):
            continue
        try:
            yield importlib.import_module(info.name)
        except ImportError:
            continue  # optional dependencies (transformers...) are tested where they are installed


def _memoised(module):
    for owner in (module, *(c for _, c in inspect.getmembers(module, inspect.isclass))):
        for name, value in vars(owner).items():
            target = value.fget if isinstance(value, property) else value
            memoised = hasattr(target, "cache_info") and hasattr(target, "__wrapped__")
            if callable(target) and memoised:
                yield f"{module.__name__}.{getattr(owner, '__name__', '')}.{name}", target


def test_no_memoised_function_takes_a_tensor():
    found, offenders = 0, []
    for module in _package_modules():
        for name, fn in _memoised(module):
            found += 1
            for parameter in inspect.signature(fn.__wrapped__).parameters.values():
                if "Tensor" in str(parameter.annotation):
                    offenders.append(f"{name}({parameter.name})")
    assert found > 10  # the walk reaches the GPU modules' caches
    assert not offenders, f"memoised on tensor arguments: {offenders}"
