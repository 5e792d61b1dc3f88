"""Random states: the one type for "the random state at one moment" (:class:`RngState`), and what it
is made of.

An :class:`RngState` holds the process RNGs' states (torch, CUDA, Python, NumPy: every one a training
step or a loader's workers draw from), or only some of them, and the states of generator objects
(a loader's ``torch.Generator`` objects, and the generators its dataset, samplers and collate_fn keep of
their own, found by :func:`private_rngs`). A snapshot of the training state holds the process RNGs
only; a batch source's state holds its generators only; choosing loader settings holds both.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import types
from collections.abc import Iterable
from typing import Any

import torch

from speedkit.data.batch import same_batch

#: the process RNGs an :class:`RngState` may hold
PROCESS_RNGS = ("torch", "cuda", "python", "numpy")


def process_rng_state(kinds: Iterable[str] = PROCESS_RNGS) -> dict[str, Any]:
    """The states of the process RNGs named in ``kinds`` (all: every RNG state a training step or a data
    loader may draw from); CUDA's and NumPy's are None where there is none."""
    kinds = tuple(kinds)
    state: dict[str, Any] = {}
    if "torch" in kinds:
        state["torch"] = torch.get_rng_state()
    if "cuda" in kinds:
        state["cuda"] = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    if "python" in kinds:
        state["python"] = random.getstate()
    if "numpy" in kinds:
        state["numpy"] = None
        try:
            import numpy as np

            state["numpy"] = np.random.get_state()
        except ImportError:
            pass
    return state


def set_process_rng_state(state: dict[str, Any]) -> None:
    """Put the process RNGs named in ``state`` (from :func:`process_rng_state`) back."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "python" in state:
        random.setstate(state["python"])
    if state.get("numpy") is not None:
        import numpy as np

        np.random.set_state(state["numpy"])


def seeded_process_state(seed: int) -> dict[str, Any]:
    """The states the torch (CPU), Python and NumPy RNGs have when seeded with ``seed``, as a worker seeds them."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {"torch": gen.get_state(), "python": random.Random(seed).getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.RandomState(seed).get_state()
    except ImportError:
        pass
    return state


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The generators that iterating ``loader`` advances: its own, its sampler's, its batch sampler's;
    for several loaders (a list, tuple or dict, as Lightning combines them), each one's."""
    if isinstance(loader, dict):
        loader = list(loader.values())
    owners: list[Any] = []
    for one in loader if isinstance(loader, (list, tuple)) else [loader]:
        owners += [
            one,
            getattr(one, "sampler", None),
            getattr(one, "batch_sampler", None),
            getattr(getattr(one, "batch_sampler", None), "sampler", None),
        ]
    found: list[torch.Generator] = []
    for owner in owners:
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def rng_object_state(obj: Any) -> Any:
    """The state of a random generator object (a ``torch.Generator``, NumPy ``Generator`` or
    ``RandomState``, Python ``random.Random``); None when ``obj`` is none of those."""
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, random.Random):
        return obj.getstate()
    kind = type(obj).__module__ or ""
    if kind.startswith("numpy.random"):
        if hasattr(obj, "bit_generator"):  # numpy.random.Generator
            return obj.bit_generator.state
        if hasattr(obj, "get_state"):  # numpy.random.RandomState
            return obj.get_state()
    return None


def set_rng_object_state(obj: Any, state: Any) -> None:
    """Put a generator found by :func:`private_rngs` back to ``state`` (from :func:`rng_object_state`)."""
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    elif isinstance(obj, random.Random):
        obj.setstate(state)
    elif hasattr(obj, "bit_generator"):
        obj.bit_generator.state = state
    else:
        obj.set_state(state)


def private_rngs(*roots: Any, depth: int = 4, visit_limit: int = 512, width: int = 64) -> list[Any]:
    """The random generator objects a dataset, sampler or collate_fn keeps of its own (in attributes,
    small lists, tuples and dicts, ``functools.partial`` arguments, closures and bound methods, up to
    ``depth`` levels down): reading samples draws from them, and the process RNGs' states
    (:func:`process_rng_state`) do not hold them. Large containers (over ``width`` items)
    and modules are not searched."""
    found: list[Any] = []
    seen: set[int] = set()

    def visit(obj: Any, level: int) -> None:
        if id(obj) in seen or len(seen) >= visit_limit:
            return
        seen.add(id(obj))
        if rng_object_state(obj) is not None:
            found.append(obj)
            return
        if (
            level >= depth
            or obj is None
            or isinstance(obj, (str, bytes, int, float, complex, torch.Tensor, type, types.ModuleType, types.BuiltinFunctionType))
        ):
            return
        children: Iterable[Any]
        if isinstance(obj, dict):
            children = obj.values() if len(obj) <= width else ()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = obj if len(obj) <= width else ()
        elif isinstance(obj, functools.partial):
            children = [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, types.MethodType):
            children = [obj.__self__, obj.__func__]
        elif isinstance(obj, types.FunctionType):
            children = [cell.cell_contents for cell in obj.__closure__ or () if _cell_filled(cell)]
        else:
            try:
                attributes = vars(obj)
            except Exception:  # no __dict__ (slots, builtins), or a proxy that refuses it
                attributes = None
            children = attributes.values() if isinstance(attributes, dict) and len(attributes) <= width else ()
        for child in list(children):
            visit(child, level + 1)

    for root in roots:
        visit(root, 0)
    return found


def _cell_filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def loader_rng_owners(loader: Any) -> list[Any]:
    """What iterating ``loader`` may draw from besides the process RNGs and the generators of
    :func:`loader_generators`: its dataset, sampler, batch sampler and collate_fn (each one's for
    several loaders), where :func:`private_rngs` looks."""
    if isinstance(loader, dict):
        loader = list(loader.values())
    owners: list[Any] = []
    for one in loader if isinstance(loader, (list, tuple)) else [loader]:
        owners += [getattr(one, name, None) for name in ("dataset", "sampler", "batch_sampler", "collate_fn")]
    return [o for o in owners if o is not None]


@dataclasses.dataclass
class RngState:
    """The random state at one moment: the process RNGs' (``process``: those captured, None: none) and
    those of generator objects (``generators``: each object with its state, see :func:`rng_object_state`)."""

    process: dict[str, Any] | None
    generators: list[tuple[Any, Any]]

    @classmethod
    def capture(
        cls, generators: Iterable[Any] = (), *, owners: Iterable[Any] = (), process: bool | Iterable[str] = True
    ) -> RngState:
        """The states now of ``generators``, of those :func:`private_rngs` finds in ``owners`` (each
        object once), and of the process RNGs (``process``: all, none, or those named)."""
        found = list(generators)
        found += [g for g in private_rngs(*owners) if all(g is not f for f in found)]
        kinds = PROCESS_RNGS if process is True else () if process is False else tuple(process)
        return cls(process_rng_state(kinds) if kinds else None, [(g, rng_object_state(g)) for g in found])

    def restore(self) -> None:
        """Put the process RNGs back, then each generator."""
        if self.process is not None:
            set_process_rng_state(self.process)
        for g, state in self.generators:
            set_rng_object_state(g, state)

    def same_as(self, other: RngState) -> bool:
        """Whether both hold the same generators in the same states, and the same process RNG states."""
        if [id(g) for g, _ in self.generators] != [id(g) for g, _ in other.generators]:
            return False
        if not all(same_batch(a, b) for (_, a), (_, b) in zip(self.generators, other.generators)):
            return False
        mine, theirs = self.process or {}, other.process or {}
        return all(same_batch(mine.get(k), theirs.get(k)) for k in PROCESS_RNGS)
