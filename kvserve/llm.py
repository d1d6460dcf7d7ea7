"""The in-process engine for one replica: ``LLM(model).generate(prompts, params)``, ``LLM(model).chat(messages)``."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.generate_progress import GenerateProgress
from kvserve.scheduler.engine_core import EngineCore
from kvserve.scheduler.engine_config import EngineConfig
from kvserve.scheduler.logprobs import TokenLogprobs
from kvserve.scheduler.prompt_logprobs import first_output_prompt_logprobs
from kvserve.stop_watch import StopWatch
from kvserve.scheduler.request import FinishReason, Request
from kvserve.scheduler.sampling_params import SamplingParams, check_token_ids_in_vocabulary, first_outside_vocabulary
from kvserve.scheduler.scheduler import Scheduler
from kvserve.worker.chat_template import conversation_of, render_conversation, template_of
from kvserve.worker.model_config import ModelConfig
from kvserve.worker.tokenizer import load_tokenizer
from kvserve.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

# Text, token ids, or vLLM's prompt dicts: {"prompt": text} (TextPrompt), {"prompt_token_ids": ids} (TokensPrompt).
Prompt = str | Sequence[int] | Mapping[str, Any]
# The prompt dict keys this engine serves; vLLM's others (multi_modal_data, ...) ask for what it does not do.
_PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One of a prompt's ``n`` completions (vLLM's ``CompletionOutput``): ``index`` in ``0..n-1``,
    and the fields :class:`GenerationOutput` describes.

    ``cumulative_logprob`` is the sum of the sampled tokens' logprobs (those of ``logprobs``)
    when the request asked for logprobs, else ``None``, as vLLM's.
    """

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    """The result of one prompt.

    ``prompt`` is the prompt's text (a string or ``{"prompt": text}``), ``None`` for one given
    as token ids (as vLLM's ``RequestOutput.prompt``), ``chat``'s too (rendered to token ids).
    ``num_cached_tokens`` counts the prompt tokens served from the prefix cache; ``text`` is
    ``None`` when the model directory has no tokenizer.
    ``logprobs`` has one entry per token of ``token_ids`` when the request
    asked for them (``SamplingParams.logprobs``), else it is ``None``; so has
    ``prompt_logprobs`` per token of ``prompt_token_ids``
    (``SamplingParams.prompt_logprobs``), the first ``None``: nothing predicts it.
    ``finish_reason`` is ``"stop"`` (a stop or EOS token, included in ``token_ids``; or a
    stop string, whose last token ends ``token_ids`` and which ``text`` stops before)
    or ``"length"`` (``max_tokens`` or ``max_model_len``).

    ``outputs`` holds the prompt's ``SamplingParams.n`` completions, as vLLM's
    ``RequestOutput.outputs`` (``output.outputs[0].text``); ``token_ids``, ``text``,
    ``finish_reason`` and ``logprobs`` are the first one's, and ``num_cached_tokens``
    is its request's (the other completions' requests find the prompt in the cache).
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt: str | None = None


class LLM:
    """One model replica in this process (or, with tensor parallelism, in child processes).

    ``settings`` are the engine's, by name (``kvserve.scheduler.engine_config``):
    ``block_size``, ``num_blocks``, ``enable_prefix_caching``, ``gpu_memory_utilization``,
    ``cpu_kv_cache_bytes``, ``tenant_cache_share`` (requests here have no tenant: no effect);
    ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``,
    ``enable_chunked_prefill``, ``long_prefill_token_threshold``; ``device``, ``dtype``,
    ``seed``, ``enforce_eager``, ``async_scheduling`` (plan each step while the device, or
    the tensor-parallel ranks, run the one before; by default on CUDA or with tensor
    parallelism, off for one CPU rank), ``attention_backend``, ``cpu_threads``;
    ``tensor_parallel_size``.

    ``generate`` may be called from several threads: the calls run one after another.
    An exception raised while it runs (Ctrl-C, a signal handler's timeout) aborts that
    call's requests; the LLM stays usable.

    With ``tensor_parallel_size > 1`` the ranks are processes started with the spawn
    method, which imports the main module in each of them: a script must create the
    LLM under ``if __name__ == "__main__":``.  A rank that dies makes every later call
    raise ``WorkerProcessError``.

    ``cpu_threads`` (CPU only) sets each rank's torch threads.  With
    ``tensor_parallel_size=1`` the rank is the calling process: its torch thread count
    (``torch.set_num_threads``) is ``cpu_threads`` until ``shutdown``, which restores it.
    """

    def __init__(self, model: str | Path, **settings: Any) -> None:
        config = EngineConfig.from_kwargs(str(model), **settings)
        if config.parallel.num_replicas != 1:
            raise ValueError("LLM runs one replica; num_replicas is kvserve serve's")
        self.config = config
        tensor_parallel_size = config.parallel.tensor_parallel_size
        self.model_config = ModelConfig.from_pretrained(model, config.scheduler.max_model_len)
        self.tokenizer = load_tokenizer(model)
        worker_config = WorkerConfig.for_engine(config, self.model_config.max_model_len)
        self.model_config.check_tensor_parallel_size(tensor_parallel_size)
        # Checked before any worker starts (they load the weights): settings that need max_model_len.
        scheduler_config = config.scheduler_config(self.model_config.max_model_len)
        if tensor_parallel_size == 1:
            from kvserve.worker.uniproc_executor import UniprocExecutor

            executor = UniprocExecutor(worker_config)
        else:
            from kvserve.worker.multiproc_executor import MultiprocExecutor

            executor = MultiprocExecutor(worker_config)
        scheduler = Scheduler(
            scheduler_config, config.cache_config(executor.num_kv_blocks, self.model_config.model_id)
        )
        self.engine = EngineCore(scheduler, executor, async_scheduling=config.runtime.async_scheduling)
        self._request_counter = itertools.count()
        self._shut_down = False
        # One generate (or shutdown) at a time: the engine's requests and steps are shared.
        self._lock = threading.Lock()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        progress: bool | None = None,
        use_tqdm: bool | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text or token ids); results in prompt order.

        A prompt may also be vLLM's ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``;
        ``ValueError`` for a dict with both keys or any other (``multi_modal_data``, ...).

        ``progress``: requests finished and tokens per second on stderr; by default only on a
        terminal and once the call has run 2 s (``kvserve.generate_progress``); ``True``
        always, ``False`` never.  ``use_tqdm`` is vLLM's name for it.  Calls from other threads
        wait for this one to end.
        """
        progress = _progress_setting(progress, use_tqdm)
        with self._lock:
            return self._generate(prompts, sampling_params, cache_salt, progress)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        cache_salt: str | None = None,
        progress: bool | None = None,
        use_tqdm: bool | None = None,
    ) -> list[GenerationOutput]:
        """Answer conversations as vLLM's ``LLM.chat``: ``generate`` on each rendered with the chat template.

        ``messages``: one conversation (a list of ``{"role", "content"}`` dicts, ``"name"``
        optional) or a list of them; results in the same order.  ``chat_template``: a Jinja
        template to use instead of the tokenizer's own.  The rendering is the server's
        ``/v1/chat/completions`` one (``kvserve.worker.chat_template``): the generation prompt
        appended, no special tokens added beyond the template's.  ``ValueError`` for a
        malformed message, a model without a tokenizer or a template, or a template that
        refuses the conversation.
        """
        if isinstance(messages, Sequence) and messages and isinstance(messages[0], Mapping):
            conversations = [messages]  # one conversation
        elif isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)) and messages:
            conversations = list(messages)
        else:
            raise ValueError(f"messages must be a conversation (a list of message dicts) or a list of them, "
                             f"got {messages!r}")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: chat needs one to render the messages")
        template = template_of(self.tokenizer, chat_template)
        if not template:
            raise ValueError("this model's tokenizer has no chat template: pass chat_template=")
        prompts = []
        for i, conversation in enumerate(conversations):
            where = f"conversation {i}: " if len(conversations) > 1 else ""
            try:
                prompts.append(render_conversation(self.tokenizer, template, conversation_of(conversation)))
            except ValueError as exc:
                raise ValueError(f"{where}{exc}") from None
        return self.generate(prompts, sampling_params, cache_salt=cache_salt, progress=progress, use_tqdm=use_tqdm)

    def get_tokenizer(self) -> Any | None:
        """The model's tokenizer (``None`` without one), as vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    def _generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        cache_salt: str | None,
        progress: bool | None,
    ) -> list[GenerationOutput]:
        if self._shut_down:
            raise RuntimeError("this LLM was shut down")
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            not_a_list = TypeError(
                f"sampling_params must be SamplingParams or a list of them, got {type(sampling_params).__name__}"
            )
            if isinstance(sampling_params, (Mapping, str)):
                raise not_a_list
            try:
                params_list = list(sampling_params)
            except TypeError:
                raise not_a_list from None
            wrong = next((p for p in params_list if not isinstance(p, SamplingParams)), None)
            if wrong is not None:
                raise TypeError(f"sampling_params must be SamplingParams or a list of them, got {wrong!r}")
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts"
                )
        vocab_size = self.model_config.vocab_size
        for params in params_list:
            check_token_ids_in_vocabulary(params, vocab_size)  # as the cluster checks them
        requests: dict[str, Request] = {}
        # Each prompt's requests, one per completion (SamplingParams.n).
        choices: list[list[Request]] = []
        stops = StopWatch(self.tokenizer)
        try:
            for prompt, params in zip(prompt_list, params_list):
                token_ids = self._tokenize(prompt)
                cap = self.model_config.max_model_len_cap
                if cap is not None and len(token_ids) > self.model_config.max_model_len:
                    raise ValueError(
                        f"prompt has {len(token_ids)} tokens, more than max_model_len="
                        f"{self.model_config.max_model_len} ({cap})"
                    )
                choices.append([])
                for choice_params in _choices(params):
                    request = Request(
                        f"llm-{next(self._request_counter)}",
                        token_ids,
                        choice_params,
                        eos_token_ids=self.model_config.eos_token_ids,
                        cache_salt=cache_salt,
                    )
                    stops.watch(request)
                    self.engine.add_request(request)
                    requests[request.req_id] = request
                    choices[-1].append(request)
            logprobs: dict[str, list[TokenLogprobs]] = {
                req_id: [] for req_id, request in requests.items() if request.sampling_params.logprobs is not None
            }
            shown = GenerateProgress(len(requests), progress)
            num_finished = num_tokens = 0
            try:
                while self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    for output in outputs:
                        stopped = stops.stops(output)  # its text completed a stop string: it ends with this token
                        if stopped and not output.finished:
                            self.engine.abort_requests([output.req_id])
                        num_finished += output.finished or stopped
                        if output.logprobs is not None and output.req_id in logprobs:
                            logprobs[output.req_id].append(output.logprobs)
                    num_tokens += len(outputs)
                    shown.update(num_finished, num_tokens)
            finally:
                shown.close()  # an interrupted call's too: what it did before, and the line ended
        except BaseException:
            self.engine.abort_requests(requests)
            raise
        return [
            self._result(prompt if isinstance(prompt, str) else None, prompt_requests, logprobs, stops)
            for prompt, prompt_requests in zip(prompt_list, choices)
        ]

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            token_ids = self.tokenizer(prompt)["input_ids"]
        else:
            token_ids = _token_ids(prompt)
        vocab_size = self.model_config.vocab_size
        if (bad := first_outside_vocabulary(token_ids, vocab_size)) is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
        return token_ids

    def _result(
        self,
        prompt: str | None,
        requests: list[Request],
        logprobs: dict[str, list[TokenLogprobs]],
        stops: StopWatch,
    ) -> GenerationOutput:
        """One prompt's result, from its completions' ``requests``; ``prompt`` its text, if it had one."""
        completions = [self._completion(i, request, logprobs.get(request.req_id), stops)
                       for i, request in enumerate(requests)]
        first, request = completions[0], requests[0]
        return GenerationOutput(
            prompt_token_ids=request.prompt_token_ids,
            token_ids=first.token_ids,
            text=first.text,
            finish_reason=first.finish_reason,
            num_cached_tokens=request.num_cached_tokens or 0,
            logprobs=first.logprobs,
            prompt_logprobs=first_output_prompt_logprobs(request),
            outputs=completions,
            prompt=prompt,
        )

    def _completion(
        self, index: int, request: Request, logprobs: list[TokenLogprobs] | None, stops: StopWatch
    ) -> CompletionOutput:
        token_ids = list(request.output_token_ids)
        # A stop string's request was aborted at the token that completed it (or ended there anyway).
        finish_reason = FinishReason.STOP if stops.stopped(request.req_id) else request.finish_reason
        if finish_reason is None or finish_reason is FinishReason.ABORT:
            # NOTE: cannot happen while generate calls are serialised; never hand back an empty result.
            raise RuntimeError(f"request {request.req_id} was aborted while generate ran")
        text = stops.text(request.req_id)
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cumulative_logprob = None if logprobs is None else sum(t.logprob for t in logprobs)
        return CompletionOutput(index, token_ids, text, finish_reason.value, logprobs, cumulative_logprob)

    def shutdown(self) -> None:
        """Stop the workers and give back their memory: the weights, the KV cache, the CUDA graphs.

        Afterwards a new ``LLM`` in this process can use the whole device again.
        Calling it twice is harmless; ``generate`` afterwards raises ``RuntimeError``.
        A ``generate`` running in another thread ends first.
        """
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _choices(params: SamplingParams) -> list[SamplingParams]:
    """The sampling parameters of each of ``params.n`` completions: ``n`` 1, and completion ``i``'s
    seed ``seed + i`` when there is a seed (as the servers' OpenAI API seeds its choices)."""
    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]


# Iterables of integers that are no prompt: unordered, or text in bytes.
_NOT_TOKEN_SEQUENCES = (set, frozenset, dict, bytes, bytearray)


def _progress_setting(progress: bool | None, use_tqdm: bool | None) -> bool | None:
    """``progress``, or vLLM's ``use_tqdm`` in its place; ``ValueError`` when both are given."""
    if use_tqdm is None:
        return progress
    if progress is not None:
        raise ValueError("progress and use_tqdm are one setting (use_tqdm is vLLM's name for it): give one")
    if not isinstance(use_tqdm, bool):  # vLLM's may be a tqdm factory, which this progress line is not
        raise ValueError(f"use_tqdm must be True or False, got {use_tqdm!r}")
    return use_tqdm


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | Sequence[int]]:
    """Each prompt as text or token ids: vLLM's prompt dicts unwrapped, one prompt made a list of one."""
    if isinstance(prompts, Mapping):
        return [_unwrap_prompt_dict(prompts)]
    if isinstance(prompts, str) or getattr(prompts, "ndim", None) == 1:
        return [prompts]  # one text, or one prompt as a 1-D array or tensor of token ids
    if isinstance(prompts, _NOT_TOKEN_SEQUENCES) or getattr(prompts, "ndim", None) == 0:
        raise ValueError(f"prompts must be a string, token ids or a list of them, got {type(prompts).__name__}")
    try:
        prompt_list = list(prompts)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"prompts must be a string, token ids or a list of them, got {prompts!r}") from None
    if prompt_list and all(_is_scalar(t) for t in prompt_list):
        return [prompt_list]  # a single prompt given as token ids (checked one by one later)
    return [_unwrap_prompt_dict(p) if isinstance(p, Mapping) else p for p in prompt_list]


def _unwrap_prompt_dict(prompt: Mapping[Any, Any]) -> str | list[int]:
    """The text of vLLM's ``{"prompt": text}`` or the token ids of ``{"prompt_token_ids": ids}``.

    ``ValueError`` for any other key: ignoring ``multi_modal_data`` (or a ``prompt`` beside
    ``prompt_token_ids``) would generate for another prompt than the caller meant.
    """
    other = next((key for key in prompt if key not in _PROMPT_DICT_KEYS), None)
    if other is not None:
        raise ValueError(
            f"prompt dict key {other!r} is not supported: a prompt dict is {{'prompt': text}} "
            f"or {{'prompt_token_ids': token ids}}"
        )
    if len(prompt) != 1:
        given = "not both" if prompt else "got neither"
        raise ValueError(f"a prompt dict must have the key 'prompt' or 'prompt_token_ids', {given}")
    if "prompt" in prompt:
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"prompt dict key 'prompt' must be a string, got {text!r}")
        return text
    token_ids = prompt["prompt_token_ids"]
    if isinstance(token_ids, str):  # else read as token ids one character each
        raise ValueError(f"prompt dict key 'prompt_token_ids' must be token ids, got the string {token_ids!r}")
    return _token_ids(token_ids)


def _is_scalar(value: object) -> bool:
    """A number, or a 0-d array or tensor: an element of a prompt given as token ids."""
    return isinstance(value, numbers.Number) or getattr(value, "ndim", None) == 0


def _token_ids(prompt: object) -> list[int]:
    """A prompt given as token ids (a sequence, array or tensor of integers) as a list of ints.

    ``ValueError`` for anything else: a float (it was truncated), a bool, a nested list.
    """
    if isinstance(prompt, _NOT_TOKEN_SEQUENCES):
        raise ValueError(f"a prompt must be a string or a sequence of token ids, got {type(prompt).__name__}")
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()  # numpy arrays and torch tensors, as Python numbers
    try:
        values = list(prompt)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"a prompt must be a string or a sequence of token ids, got {prompt!r}") from None
    token_ids = []
    for value in values:
        if getattr(value, "ndim", None) == 0:
            value = value.item()  # a 0-d array or tensor, what iterating one gives
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise ValueError(f"prompt token ids must be integers, got {value!r}")
        token_ids.append(int(value))
    return token_ids
