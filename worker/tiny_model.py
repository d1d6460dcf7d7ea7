"""Tiny Hugging Face models created locally: seeded random weights, local tokenizer.

No model hub can be reached from the machines kvserve is tested on, so tests and
the embedded default model use directories written here.  They have exactly the
layout of a real checkpoint (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``) and
load with ``AutoModelForCausalLM`` / ``AutoTokenizer``, so the rest of kvserve
cannot tell them from a downloaded model.

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on
``data/tiny_corpus.txt`` (shipped with the package).  Its pre-tokenizer is the
Qwen2 one (NFC, a split regex that isolates single digits, then byte-level):
``AutoTokenizer`` rebuilds the pre-tokenizer itself for ``model_type == "qwen2"``,
and using the same one for every family keeps ``tokenizer.json`` and every
loader in agreement.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

logger = logging.getLogger(__name__)

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
TOKENIZER_VOCAB_SIZE = 1000
DEFAULT_FAMILY = "llama"
DEFAULT_MODEL_NAME = "tiny-llama"
# What the default model's directory is written as: raised whenever create_tiny_model
# writes it differently (2: the chat template), so that a copy cached by an older kvserve
# is written anew rather than served stale.  Kept in the directory's FORMAT_FILE.
DEFAULT_MODEL_FORMAT = 2
FORMAT_FILE = "kvserve-format"
CACHE_DIR_ENV = "KVSERVE_CACHE_DIR"

# NOTE: the same regex as transformers' Qwen2Tokenizer (see module docstring).
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Standard deviations of the random weights.  Chosen so that a random model's
# greedy continuations are varied (not one token repeated) and the gap between
# the two best logits is usually large enough for greedy outputs to be stable
# across attention implementations.
_EMBEDDING_STD = 1.0
# Tied embeddings also produce the logits: std 1 would make them so peaked that
# greedy decoding often repeats one token.
_TIED_EMBEDDING_STD = 0.3
_LINEAR_STD = 0.2
_BIAS_STD = 0.1
_NORM_WEIGHT_RANGE = (0.5, 1.5)


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """The transformers classes that define one model family."""

    config_class_name: str
    model_class_name: str
    default_overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def config_class(self) -> type[transformers.PretrainedConfig]:
        return getattr(transformers, self.config_class_name)

    @property
    def model_class(self) -> type[transformers.PreTrainedModel]:
        return getattr(transformers, self.model_class_name)


FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily("LlamaConfig", "LlamaForCausalLM"),
    # NOTE: Mistral defaults to a 4096-token sliding window; the tiny model has
    # full attention like Mistral 7B v0.2 and later.
    "mistral": ModelFamily("MistralConfig", "MistralForCausalLM", (("sliding_window", None),)),
    "qwen2": ModelFamily("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ModelFamily("Qwen3Config", "Qwen3ForCausalLM"),
}

_TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
}

# Accepted by every family although not a field of every config class:
# transformers converts the legacy rope keys to ``rope_parameters``, and the
# Qwen2 model reads ``head_dim`` when present.
_EXTRA_CONFIG_KEYS = frozenset({"rope_scaling", "rope_theta", "head_dim"})


def create_tiny_model(
    path: str | os.PathLike[str],
    family: str = DEFAULT_FAMILY,
    *,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a complete Hugging Face model directory with random weights to ``path``.

    The directory holds ``config.json``, ``model.safetensors`` (float32),
    ``generation_config.json`` (greedy by default), ``tokenizer.json`` and
    ``tokenizer_config.json``.  The default shape is 2 layers, hidden size 64,
    4 attention heads and 2 KV heads of dimension 16, and a vocabulary equal to
    the tokenizer's (1000 tokens, ``<s>`` = 0 is BOS, ``</s>`` = 1 is EOS).

    ``config_overrides`` replace any field of the family's config class, e.g.
    ``tie_word_embeddings=True``, ``num_hidden_layers=4`` or
    ``rope_parameters={"rope_type": "linear", "factor": 2.0}``.  The same
    arguments always produce byte-identical files.

    Raises ``ValueError`` for an unknown family, an override that is not a
    config field, or a ``vocab_size`` smaller than the tokenizer's, and
    ``FileExistsError`` if ``path`` exists and is not an empty directory.
    Returns ``path`` as a ``Path``.
    """
    model_family = _family(family)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file, not a directory")
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} already exists and is not an empty directory")

    config = tiny_config(family, **config_overrides)
    model = _build_model(model_family, config, seed)

    path.mkdir(parents=True, exist_ok=True)
    with _progress_bars_disabled():
        model.save_pretrained(path)
    write_tokenizer(path, config.max_position_embeddings)
    logger.info("created tiny %s model (seed %d) in %s", family, seed, path)
    return path


def tiny_config(family: str = DEFAULT_FAMILY, **config_overrides: Any) -> transformers.PretrainedConfig:
    """The config ``create_tiny_model(path, family, **config_overrides)`` writes.

    Raises ``ValueError`` as ``create_tiny_model`` does for its arguments.
    """
    vocab_size = Tokenizer.from_str(_trained_tokenizer_json()).get_vocab_size()
    return _build_config(_family(family), vocab_size, config_overrides)


def write_tokenizer(path: Path, model_max_length: int) -> None:
    """Write the tiny models' ``tokenizer.json`` and ``tokenizer_config.json`` into ``path``."""
    Tokenizer.from_str(_trained_tokenizer_json()).save(str(path / "tokenizer.json"))
    _write_tokenizer_config(path, model_max_length)


def default_tiny_model_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the embedded default model lives: ``<cache>/models/tiny-llama``.

    ``<cache>`` is ``cache_dir`` if given, else ``$KVSERVE_CACHE_DIR`` if set,
    else ``~/.cache/kvserve``.  Nothing is created.
    """
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "kvserve"
    return Path(cache_dir).expanduser() / "models" / DEFAULT_MODEL_NAME


def ensure_default_tiny_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the default tiny Llama model's directory, creating it on first use.

    Creation is atomic: the model is written to a temporary sibling directory
    and renamed into place, so concurrent callers never see a partial model.
    When two processes race, one rename wins and the other's copy (identical,
    since creation is deterministic) is discarded.  A copy written by an older
    kvserve (``DEFAULT_MODEL_FORMAT``) is replaced the same way.
    """
    final_path = default_tiny_model_path(cache_dir)
    if _is_current_default_model(final_path):
        return final_path
    if (final_path / "config.json").is_file():
        logger.info("%s was written by an older kvserve; writing it anew", final_path)
    with staged_model_directory(final_path, is_complete=_is_current_default_model) as staging:
        create_tiny_model(staging, DEFAULT_FAMILY, seed=0)
        (staging / FORMAT_FILE).write_text(f"{DEFAULT_MODEL_FORMAT}\n", encoding="utf-8")
    return final_path


def ensure_default_tiny_model_in_a_child(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """:func:`ensure_default_tiny_model`, its creation (when one is needed) run in a child process.

    For processes that serve a model and never run one (``kvserve serve``'s front end, a live
    experiment's driver): building the model imports transformers' modeling code, which brings
    in torch.compile's and Triton's modules, and Triton's bindings then print a
    report of "leaked" objects when the interpreter exits, after ``kvserve serve: stopped``.
    ``RuntimeError`` with the child's last line if it fails.
    """
    final_path = default_tiny_model_path(cache_dir)
    if _is_current_default_model(final_path):
        return final_path
    script = "import sys; from kvserve.worker.tiny_model import ensure_default_tiny_model as e; e(sys.argv[1])"
    result = subprocess.run(
        [sys.executable, "-c", script, str(final_path.parent.parent)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        raise RuntimeError(f"cannot create the default tiny model in {final_path}: {last}")
    return final_path


def _is_current_default_model(path: Path) -> bool:
    try:
        return (path / FORMAT_FILE).read_text(encoding="utf-8").strip() == str(DEFAULT_MODEL_FORMAT)
    except OSError:
        return False


def _has_config(path: Path) -> bool:
    return (path / "config.json").is_file()


@contextmanager
def staged_model_directory(final_path: Path, is_complete: Callable[[Path], bool] = _has_config) -> Iterator[Path]:
    """A temporary sibling of ``final_path`` to write a model into, renamed to ``final_path`` after the block.

    Nothing is left behind when the block fails, so no directory looks like a
    model without being one.  A ``final_path`` that is empty, or holds a model
    that ``is_complete`` refuses (a stale copy), is replaced; one that holds a
    complete model by then (another process renamed its copy first) is kept,
    and the staged copy discarded.
    """
    final_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final_path.name}.tmp-", dir=final_path.parent))
    try:
        yield staging
        with suppress(OSError):  # only an empty directory is removed
            final_path.rmdir()
        try:
            os.rename(staging, final_path)
        except OSError:
            if is_complete(final_path):
                return
            if not final_path.is_dir():
                raise
            _replace_directory(final_path, staging, is_complete)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _replace_directory(final_path: Path, staging: Path, is_complete: Callable[[Path], bool]) -> None:
    """Put ``staging`` in the place of the stale directory ``final_path``.

    The stale copy is first renamed aside (a process reading it keeps its open
    files), then removed.  When another process put a complete copy there in
    between, that one is kept.
    """
    aside = Path(tempfile.mkdtemp(prefix=f".{final_path.name}.stale-", dir=final_path.parent))
    try:
        with suppress(FileNotFoundError):  # another process moved it first
            os.rename(final_path, aside / final_path.name)
        try:
            os.rename(staging, final_path)
        except OSError:
            if not is_complete(final_path):
                raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def ensure_default_tiny_model_at(model_dir: str | os.PathLike[str]) -> None:
    """Create the default tiny model if ``model_dir`` is this machine's default path and
    holds none (or a copy written by an older kvserve).

    NOTE: ``kvserve serve`` without ``--model`` creates it on its own node and
    passes its path on; a worker on another node (the KubeRay laptop demo's
    worker pods) found nothing there.  The cluster's worker actor calls this on
    its node before it builds the Worker (which never writes a model): creation
    is deterministic, so the copies are identical.
    """
    path = Path(model_dir).expanduser()
    if path == default_tiny_model_path() and not _is_current_default_model(path):
        ensure_default_tiny_model()


@contextmanager
def _progress_bars_disabled() -> Iterator[None]:
    was_enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers.utils.logging.enable_progress_bar()


def _family(family: str) -> ModelFamily:
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}") from None


def _build_config(
    family: ModelFamily, tokenizer_vocab_size: int, overrides: dict[str, Any]
) -> transformers.PretrainedConfig:
    config_class = family.config_class
    known_keys = _config_keys(config_class) | _EXTRA_CONFIG_KEYS
    unknown = sorted(set(overrides) - known_keys)
    if unknown:
        raise ValueError(f"{config_class.__name__} has no field(s) {unknown}")
    kwargs: dict[str, Any] = {
        **_TINY_SHAPE,
        **dict(family.default_overrides),
        "vocab_size": tokenizer_vocab_size,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        **overrides,
    }
    if kwargs["vocab_size"] < tokenizer_vocab_size:
        raise ValueError(
            f"vocab_size must be at least the tokenizer's {tokenizer_vocab_size}, got {kwargs['vocab_size']}"
        )
    return config_class(**kwargs)


def _config_keys(config_class: type) -> frozenset[str]:
    parameters = inspect.signature(config_class.__init__).parameters.values()
    return frozenset(
        p.name for p in parameters if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    )


def _build_model(
    family: ModelFamily, config: transformers.PretrainedConfig, seed: int
) -> transformers.PreTrainedModel:
    # NOTE: transformers initialises weights from torch's global RNG; fork it so
    # that creating a model leaves the caller's random state untouched.
    with torch.random.fork_rng(devices=[]):
        model = family.model_class(config).to(torch.float32)
    embedding_std = _TIED_EMBEDDING_STD if config.tie_word_embeddings else _EMBEDDING_STD
    with torch.no_grad():
        # NOTE: named_parameters() lists a tied lm_head once, as the embedding.
        for name, param in model.named_parameters():
            param.copy_(_random_tensor(name, tuple(param.shape), seed, embedding_std))
    model.generation_config = greedy_generation_config(config)
    model.eval()
    return model


def greedy_generation_config(config: transformers.PretrainedConfig) -> transformers.GenerationConfig:
    """The ``generation_config.json`` of the models created here: greedy, padded with the (first) EOS."""
    eos = config.eos_token_id
    return transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos,
        # NOTE: a model may stop at several EOS tokens; it pads with one.
        pad_token_id=eos[0] if isinstance(eos, list) else eos,
        do_sample=False,
    )


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, embedding_std: float) -> torch.Tensor:
    """Seeded random values for the parameter ``name``.

    Each parameter draws from its own generator seeded by ``(seed, name)``, so
    its values do not depend on which other parameters exist (adding a layer
    leaves the others unchanged) nor on the order transformers defines them in.
    """
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    if name.endswith("norm.weight"):
        low, high = _NORM_WEIGHT_RANGE
        return low + (high - low) * torch.rand(shape, generator=generator)
    if name.endswith(".bias"):
        std = _BIAS_STD
    elif "embed_tokens" in name:
        std = embedding_std
    else:
        std = _LINEAR_STD
    return std * torch.randn(shape, generator=generator)


def parameter_seed(seed: int, name: str) -> int:
    """The seed of parameter ``name``'s own generator in a model created with ``seed``."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63


@lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """Train the byte-level BPE tokenizer on the shipped corpus (deterministic)."""
    corpus = resources.files(__package__).joinpath("data", "tiny_corpus.txt").read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([corpus], trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Like Llama: BOS is prepended to every sequence, EOS is never appended.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer.to_str()


# A chat template of role markers, so that the OpenAI chat API works on the tiny models as on real ones.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _write_tokenizer_config(path: Path, model_max_length: int) -> None:
    # NOTE: written by hand rather than by save_pretrained so that the file is
    # the same under transformers 4 and 5.  "PreTrainedTokenizerFast" loads
    # tokenizer.json as is in both; unk_token is null so that Qwen2Tokenizer
    # does not add its own "<|endoftext|>" beyond the model's vocabulary.
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    text = json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n"
    (path / "tokenizer_config.json").write_text(text, encoding="utf-8")
