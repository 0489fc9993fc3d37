"""What the step loop hands out and takes in, wherever it runs: a request to add
(`AddRequest`), a request's failure (`EngineFailure`) and the hand-over of outputs
(`Publish`); and what the serving process learns of an engine it does not hold
(`EngineInfo`). All of them cross the engine process's pipe (pickled), so a `ParamError`
is made to pickle with its field, and a `StepOutput` as a tuple (`copyreg` below)."""

from __future__ import annotations

import copyreg
import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.inputs.images import PreparedImage
from engine.params import DecodingDefaults, ParamError, ResolvedParams
from engine.structured import Constraint
from engine.types import EngineLimits, StepOutput
from engine.validation import ContextLengthError


@dataclass(frozen=True, slots=True)
class AddRequest:
    """A validated request for the step loop; `constraint`: its grammar state, built off the
    step loop (it does not cross a pipe: the engine process builds its own)."""

    request_id: str
    prompt_ids: list[int]
    params: ResolvedParams
    want_drafts: bool
    constraint: Constraint | None = None
    images: tuple[PreparedImage, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """Put on a request's queue when the engine could not run it; `error` is re-raised."""

    error: Exception


# Outputs for their requests' queues, in order: one call per step (and per accepted request).
Publish = Callable[[list[tuple[str, StepOutput | EngineFailure]]], None]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the serving process needs of its engine besides the `EngineClient` calls: where
    the checkpoint is and what it is called, its decoding defaults, whether it takes images,
    the engine's limits, and the banner's description of the model and threads."""

    model_dir: Path
    name: str
    defaults: DecodingDefaults
    vision: bool
    limits: EngineLimits
    canvas_length: int
    num_layers: int
    dtype: str
    kernels: str  # the bound backend described (`kernels.KernelSet.describe`)
    adapter: bool
    threads: str  # `engine.cpu_threads.describe_threads`


def rebuilt_param_error(cls: type[ParamError], text: str) -> ParamError:
    """A ParamError (or subclass) unpickled: its message; its fields come back as its state."""
    error = ParamError.__new__(cls)
    error.args = (text,)
    return error


def _reduce_param_error(
    error: ParamError,
) -> tuple[Callable[..., ParamError], tuple[object, ...], dict[str, object]]:
    return rebuilt_param_error, (type(error), str(error)), dict(vars(error))


for _cls in (ParamError, ContextLengthError):  # copyreg matches the exact class
    copyreg.pickle(_cls, _reduce_param_error)

# A step's outputs pickled as their fields' values, in order: a third of the time of the
# dataclass's own state (a dict per output), on the step loop's side and on the reader's.
_OUTPUT_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(StepOutput)))


def _reduce_output(output: StepOutput) -> tuple[type[StepOutput], tuple[object, ...]]:
    return StepOutput, _OUTPUT_FIELDS(output)


copyreg.pickle(StepOutput, _reduce_output)
