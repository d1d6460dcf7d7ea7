from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NumBlocks(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class WireSamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias_token_ids", "logit_bias_values", "min_tokens", "prompt_logprobs", "repetition_penalty", "min_p")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias_token_ids: bytes
    logit_bias_values: bytes
    min_tokens: int
    prompt_logprobs: int
    repetition_penalty: float
    min_p: float
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias_token_ids: _Optional[bytes] = ..., logit_bias_values: _Optional[bytes] = ..., min_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ...) -> None: ...

class NewRequests(_message.Message):
    __slots__ = ("req_ids", "num_prompt_tokens", "sampling_params_index", "sampling_params", "num_output_token_ids", "output_token_ids", "num_stop_token_ids", "stop_token_ids", "num_prompt_token_ids", "prompt_token_ids")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_prompt_tokens: bytes
    sampling_params_index: bytes
    sampling_params: _containers.RepeatedCompositeFieldContainer[WireSamplingParams]
    num_output_token_ids: bytes
    output_token_ids: bytes
    num_stop_token_ids: bytes
    stop_token_ids: bytes
    num_prompt_token_ids: bytes
    prompt_token_ids: bytes
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., num_prompt_tokens: _Optional[bytes] = ..., sampling_params_index: _Optional[bytes] = ..., sampling_params: _Optional[_Iterable[_Union[WireSamplingParams, _Mapping]]] = ..., num_output_token_ids: _Optional[bytes] = ..., output_token_ids: _Optional[bytes] = ..., num_stop_token_ids: _Optional[bytes] = ..., stop_token_ids: _Optional[bytes] = ..., num_prompt_token_ids: _Optional[bytes] = ..., prompt_token_ids: _Optional[bytes] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "req_ids", "num_scheduled_tokens", "num_computed_tokens", "token_ids", "num_new_block_ids", "new_block_ids", "sample", "new_requests", "finished_req_ids", "preempted_req_ids", "placeholder_rows", "prompt_logprobs_rows", "next_prompt_token_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_ROWS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_ROWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_scheduled_tokens: bytes
    num_computed_tokens: bytes
    token_ids: bytes
    num_new_block_ids: bytes
    new_block_ids: bytes
    sample: bytes
    new_requests: NewRequests
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    preempted_req_ids: _containers.RepeatedScalarFieldContainer[str]
    placeholder_rows: bytes
    prompt_logprobs_rows: bytes
    next_prompt_token_ids: bytes
    def __init__(self, step_id: _Optional[int] = ..., req_ids: _Optional[_Iterable[str]] = ..., num_scheduled_tokens: _Optional[bytes] = ..., num_computed_tokens: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., num_new_block_ids: _Optional[bytes] = ..., new_block_ids: _Optional[bytes] = ..., sample: _Optional[bytes] = ..., new_requests: _Optional[_Union[NewRequests, _Mapping]] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., preempted_req_ids: _Optional[_Iterable[str]] = ..., placeholder_rows: _Optional[bytes] = ..., prompt_logprobs_rows: _Optional[bytes] = ..., next_prompt_token_ids: _Optional[bytes] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("rows", "num_positions", "num_top", "token_logprobs", "top_token_ids", "top_logprobs")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    rows: bytes
    num_positions: bytes
    num_top: bytes
    token_logprobs: bytes
    top_token_ids: bytes
    top_logprobs: bytes
    def __init__(self, rows: _Optional[bytes] = ..., num_positions: _Optional[bytes] = ..., num_top: _Optional[bytes] = ..., token_logprobs: _Optional[bytes] = ..., top_token_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled_token_ids", "has_samples", "logprob_rows", "token_logprobs", "num_top_logprobs", "top_token_ids", "top_logprobs", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_token_ids: bytes
    has_samples: bool
    logprob_rows: bytes
    token_logprobs: bytes
    num_top_logprobs: bytes
    top_token_ids: bytes
    top_logprobs: bytes
    prompt_logprobs: PromptLogprobs
    def __init__(self, step_id: _Optional[int] = ..., sampled_token_ids: _Optional[bytes] = ..., has_samples: _Optional[bool] = ..., logprob_rows: _Optional[bytes] = ..., token_logprobs: _Optional[bytes] = ..., num_top_logprobs: _Optional[bytes] = ..., top_token_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...
