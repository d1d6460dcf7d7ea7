"""How long one step of one replica takes: a linear model of the plan's shape.

    step time = a + b * prefill tokens + c * decode requests + d * context tokens

* ``a``: fixed cost of a forward pass (weights read once, launches, sampling);
* ``b``: per prompt token computed (the compute-bound part of prefill);
* ``c``: per request decoding one token;
* ``d``: per token of KV context read by attention (the memory-bound part of decode).

A plan row scheduling one token is a decode; a row scheduling more is a
prefill chunk.  The context of a row is its length after the step
(``num_computed_tokens + num_scheduled_tokens``).

The coefficients come from ``fit`` over measured steps (``calibration.calibrate``
measures a real replica through its ``Executor``; ``python -m
kvserve.bench.calibrate_cost_model`` runs it on a model) and are saved as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.scheduler.step_plan import StepPlan


@dataclass(frozen=True, slots=True)
class StepShape:
    """The features of one step the cost model prices."""

    num_prefill_tokens: int
    num_decode_requests: int
    num_context_tokens: int

    @classmethod
    def of(cls, plan: StepPlan) -> StepShape:
        num_decodes = plan.num_scheduled_tokens.count(1)
        return cls(
            num_prefill_tokens=len(plan.token_ids) - num_decodes,
            num_decode_requests=num_decodes,
            num_context_tokens=sum(plan.num_computed_tokens) + len(plan.token_ids),
        )


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step: its shape and how long it took, in seconds."""

    shape: StepShape
    seconds: float


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Seconds per step: ``a + b * prefill tokens + c * decode requests + d * context tokens``."""

    a: float
    b: float
    c: float
    d: float

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise ValueError(f"cost model coefficient {name} must be finite and >= 0, got {value!r}")
        if self.a == 0 and self.b == 0 and self.c == 0 and self.d == 0:
            raise ValueError("cost model coefficients must not all be zero: steps would take no time")

    @classmethod
    def default(cls) -> StepCostModel:
        """An 8B-parameter model on one H100, from first principles (not measured).

        a: 16 GB of bf16 weights read at ~3 TB/s plus launches, ~7 ms;
        b: ~16 GFLOP per token at ~300 TFLOP/s effective, 50 us;
        c: a decode token's compute and sampling, 60 us;
        d: 128 KiB of KV per token read at ~3 TB/s, 40 ns.
        """
        return cls(a=7e-3, b=5e-5, c=6e-5, d=4e-8)

    def step_time(self, plan: StepPlan) -> float:
        """Modelled seconds for ``plan``; 0 for a plan that schedules nothing."""
        num_tokens = len(plan.token_ids)
        if not num_tokens:
            return 0.0
        num_decodes = plan.num_scheduled_tokens.count(1)
        return (
            self.a
            + self.b * (num_tokens - num_decodes)
            + self.c * num_decodes
            + self.d * (sum(plan.num_computed_tokens) + num_tokens)
        )

    def shape_time(self, shape: StepShape) -> float:
        return (
            self.a
            + self.b * shape.num_prefill_tokens
            + self.c * shape.num_decode_requests
            + self.d * shape.num_context_tokens
        )

    # -- fitting and persistence ---------------------------------------------------

    @classmethod
    def fit(cls, samples: Sequence[StepSample]) -> StepCostModel:
        """Least-squares coefficients over ``samples``, none negative.

        Coefficients that come out negative (noise on a term too small to
        measure) are fixed at zero and the rest refitted.
        """
        if len(samples) < 4:
            raise ValueError(f"need at least 4 measured steps to fit 4 coefficients, got {len(samples)}")
        features = np.array(
            [
                [1.0, s.shape.num_prefill_tokens, s.shape.num_decode_requests, s.shape.num_context_tokens]
                for s in samples
            ]
        )
        seconds = np.array([s.seconds for s in samples])
        active = [0, 1, 2, 3]
        coefficients = np.zeros(4)
        while active:
            solution, *_ = np.linalg.lstsq(features[:, active], seconds, rcond=None)
            if (solution >= 0).all():
                coefficients[active] = solution
                break
            # Drop the most negative coefficient and refit the others.
            active.pop(int(np.argmin(solution)))
        return cls(*(float(x) for x in coefficients))

    def to_json(self, about: Mapping[str, Any] | None = None) -> str:
        """The coefficients as JSON, with ``about`` (what was calibrated, where, how well) under
        ``"calibration"`` when given: for the reader, ``from_json`` ignores it."""
        data: dict[str, Any] = asdict(self)
        if about is not None:
            data["calibration"] = dict(about)
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> StepCostModel:
        """The model ``to_json`` wrote (other keys, such as ``"calibration"``, are ignored); ``ValueError``
        for anything else."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"cost model is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"cost model JSON must be an object with keys a, b, c, d, got {type(data).__name__}")
        missing = {"a", "b", "c", "d"} - set(data)
        if missing:
            raise ValueError(f"cost model JSON lacks {sorted(missing)}")
        for key in ("a", "b", "c", "d"):
            if isinstance(data[key], bool) or not isinstance(data[key], (int, float)):
                raise ValueError(f"cost model coefficient {key} must be a number, got {data[key]!r}")
        return cls(**{key: float(data[key]) for key in ("a", "b", "c", "d")})

    def save(self, path: str | Path, about: Mapping[str, Any] | None = None) -> None:
        Path(path).write_text(self.to_json(about) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        """The model in the JSON file ``path``, or, where no such file exists, the measured model of
        that name shipped with kvserve (``measured_cost_models()``).

        ``OSError`` when neither exists (or the file cannot be read); ``ValueError`` for bad contents.
        """
        return cls.from_json(cost_model_text(path))


def cost_model_text(path: str | Path) -> str:
    """The JSON text ``StepCostModel.load(path)`` reads (its errors as ``load``'s)."""
    file = Path(path)
    if not file.exists() and str(path) in measured_cost_models():
        return _MEASURED.joinpath(f"{path}.json").read_text(encoding="utf-8")
    try:
        return file.read_text()
    except FileNotFoundError:
        names = ", ".join(measured_cost_models())
        raise FileNotFoundError(f"no such file, nor a measured cost model of that name ({names})") from None


def cost_model_calibration(path: str | Path) -> dict[str, Any]:
    """What the model ``StepCostModel.load(path)`` reads was timed on (its ``"calibration"``:
    model, device, torch threads, ...), empty where it says nothing."""
    block = json.loads(cost_model_text(path)).get("calibration")
    return block if isinstance(block, dict) else {}


# The calibrated models that ship with kvserve (cost_models/*.json, package data).
_MEASURED = resources.files(__package__).joinpath("cost_models")


def measured_cost_models() -> list[str]:
    """The names ``StepCostModel.load`` takes besides paths: the models measured on real replicas."""
    return sorted(entry.name.removesuffix(".json") for entry in _MEASURED.iterdir() if entry.name.endswith(".json"))
