"""Workloads by name, for the experiment command line.

``make_workload("shared_prefix", 1000, qps=10, seed=0, num_groups=32)``;
``make_workload("mooncake", 1000, qps=None, trace="trace.jsonl")`` replays a
trace at its own rate.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from kvserve.experiments.workloads.agent_tools import agent_tools
from kvserve.experiments.workloads.document_qa import document_qa
from kvserve.experiments.workloads.mooncake import mooncake_trace
from kvserve.experiments.workloads.multi_turn import customer_contexts, multi_turn
from kvserve.experiments.workloads.request import WorkloadRequest
from kvserve.experiments.workloads.shared_prefix import shared_prefix

WORKLOADS: dict[str, Callable[..., list[WorkloadRequest]]] = {
    "shared_prefix": shared_prefix,
    "multi_turn": multi_turn,
    "customer_contexts": customer_contexts,
    "agent_tools": agent_tools,
    "document_qa": document_qa,
}

TRACE_WORKLOAD = "mooncake"

# Arguments of every generator that are not workload parameters: the experiment sets them from options of its own.
_NOT_PARAMETERS = frozenset({"path", "num_requests", "qps", "seed", "burstiness"})


def workload_parameters(name: str) -> dict[str, Any]:
    """The parameters workload ``name`` takes (``--workload-arg``), with their defaults.

    The trace workload's ``trace`` (the path) has no default; it is left out, as are the
    arguments every workload takes from options of their own (seed, burstiness, rate, length).
    """
    generator = mooncake_trace if name == TRACE_WORKLOAD else WORKLOADS.get(name)
    if generator is None:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted([*WORKLOADS, TRACE_WORKLOAD])}")
    return {
        parameter.name: parameter.default
        for parameter in inspect.signature(generator).parameters.values()
        if parameter.name not in _NOT_PARAMETERS
    }


def check_workload_parameters(name: str, params: dict[str, Any]) -> None:
    """``ValueError`` naming a parameter ``name`` does not take, and listing those it does with their defaults
    (``params``: a trace's ``trace`` left out); or naming one whose default is a number but which was given
    text (``--workload-arg prefix_len=abc``), before a workload of one's own fails on it somewhere inside."""
    accepted = workload_parameters(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        listed = ", ".join(f"{key}={value}" for key, value in accepted.items())
        raise ValueError(
            f"the {name} workload has no parameter {', '.join(unknown)}; its parameters (with their defaults): {listed}"
        )
    for key, value in params.items():
        default = accepted[key]
        if isinstance(default, (int, float)) and not isinstance(default, bool) and isinstance(value, str):
            raise ValueError(f"{key} must be a number (its default is {default}), got {value!r}")


def make_workload(
    name: str,
    num_requests: int,
    qps: float | None,
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    **params: Any,
) -> list[WorkloadRequest]:
    """``num_requests`` measured requests of workload ``name`` at mean rate ``qps``, after the
    workload's own warm-up (requests marked ``measured=False``; a trace counts all of its records).

    ``params`` override the generator's defaults (e.g. ``num_groups``); the
    trace workload takes ``trace=PATH`` (and ``vocab_size``, ``block_tokens``, ``warmup_fraction``)
    and replays at its own rate when ``qps`` is ``None``.  Raises ``ValueError`` for unknown names or parameters.
    """
    if name == TRACE_WORKLOAD:
        trace = params.pop("trace", None)
        if trace is None:
            raise ValueError("the mooncake workload needs trace=PATH")
        check_workload_parameters(name, params)
        return mooncake_trace(trace, num_requests=num_requests, qps=qps, seed=seed, **params)
    generator = WORKLOADS.get(name)
    if generator is None:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted([*WORKLOADS, TRACE_WORKLOAD])}")
    if qps is None:
        raise ValueError(f"workload {name!r} needs a rate (qps)")
    check_workload_parameters(name, params)
    try:
        return generator(num_requests, qps, seed=seed, burstiness=burstiness, **params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for workload {name!r}: {exc}") from None
