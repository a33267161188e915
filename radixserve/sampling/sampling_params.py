"""Per-request sampling parameters: construction, validation and normalisation.

Life of a `SamplingParams`: built from the user's request (`SamplingParams(**kw)` or `from_dict`), checked once by
`verify(vocab_size)` (every problem is a `ValueError` whose message starts with the field name), then
`normalize(tokenizer)` makes the shapes uniform for the rest of the engine (stop is a list, logit_bias keys are
ints, `stop_str_max_len` is known). After that the object is treated as read-only.

Greedy: `temperature == 0` (below 1e-6) or `top_k == 1` means greedy decoding. It is normalised to `top_k = 1,
temperature = 1.0` so the batched sampler never divides by zero; `is_greedy` stays true.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

SAMPLING_EPS = 1e-6  # a temperature below this is greedy
MAX_TEMPERATURE = 100.0
MAX_N = 128
MAX_STOPS = 16
MAX_LOGIT_BIAS = 100.0
MAX_SEED = 2**63 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _fail(name: str, requirement: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {requirement}, got {value!r}")


def _interval(lo: float, hi: float, lo_open: bool, hi_open: bool) -> str:
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def _check_real(name: str, value: object, lo: float, hi: float, *, lo_open: bool = False,
                hi_open: bool = False) -> None:
    requirement = f"a number in {_interval(lo, hi, lo_open, hi_open)}"
    if not _is_real(value) or not math.isfinite(float(value)):
        raise _fail(name, requirement, value)
    v = float(value)
    if v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
        raise _fail(name, requirement, value)


def _check_int(name: str, value: object, lo: int, hi: int | None = None, hi_text: str | None = None) -> None:
    requirement = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi_text or hi}]"
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        raise _fail(name, requirement, value)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise _fail(name, "a boolean", value)


def _token_id(name: str, value: object, vocab_size: int | None, allow_str: bool = False) -> int:
    """A token id as an int, checked against the vocabulary; `allow_str` admits JSON object keys like "42"."""
    bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
    requirement = f"token ids that are integers in {bound}"
    if _is_int(value):
        tid = int(value)
    elif allow_str and isinstance(value, str):
        try:
            tid = int(value.strip())
        except ValueError:
            raise _fail(name, requirement, value) from None
    else:
        raise _fail(name, requirement, value)
    if tid < 0 or (vocab_size is not None and tid >= vocab_size):
        raise _fail(name, requirement, value)
    return tid


def _encode_len(tokenizer: Any, text: str) -> int:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # a tokenizer whose encode() takes no add_special_tokens
        ids = tokenizer.encode(text)
    return len(ids)


@dataclass(kw_only=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int | str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Derived by normalize(): the longest stop string in tokens (the detokenizer keeps this many tokens of tail).
    stop_str_max_len: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._normalize_greedy()

    # ------------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The keyword arguments the constructor accepts."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a request's JSON object; unknown keys are a ValueError naming them, a null value is the
        field's default (as SGLang reads `max_new_tokens: null` and the `openai` SDK sends unset fields). Does not
        verify()."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in cls.field_names())
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """The constructor arguments (after greedy normalisation), deep-copied."""
        return {name: copy.deepcopy(getattr(self, name)) for name in self.field_names()}

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    # ------------------------------------------------------------------ properties
    @property
    def is_greedy(self) -> bool:
        if self.top_k == 1:
            return True
        return _is_real(self.temperature) and float(self.temperature) < SAMPLING_EPS

    @property
    def grammar(self) -> tuple[str, str] | None:
        """("json_schema" | "regex" | "ebnf", text) when the request is constrained, else None."""
        for name in ("json_schema", "regex", "ebnf"):
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    def _normalize_greedy(self) -> None:
        # Only when the types are sane: a bad value stays as it is for verify() to report.
        if not (_is_real(self.temperature) and _is_int(self.top_k)):
            return
        if float(self.temperature) < 0:
            return
        if self.is_greedy:
            self.top_k = 1
            self.temperature = 1.0

    # ------------------------------------------------------------------ validation
    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError("<field> must be ...") for the first invalid field; normalises greedy on success."""
        _check_int("max_new_tokens", self.max_new_tokens, 0)
        _check_int("min_new_tokens", self.min_new_tokens, 0, int(self.max_new_tokens),
                   hi_text=f"max_new_tokens={self.max_new_tokens}")
        _check_real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_real("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if not _is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise _fail("top_k", "-1 (disabled) or an integer >= 1", self.top_k)
        _check_real("min_p", self.min_p, 0.0, 1.0)
        _check_real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        _check_int("n", self.n, 1, MAX_N)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED, hi_text="2**63 - 1")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            _check_bool(name, getattr(self, name))
        self._verify_stop()
        self._verify_stop_token_ids(vocab_size)
        self._verify_logit_bias(vocab_size)
        self._verify_grammar()
        self._normalize_greedy()

    def _verify_stop(self) -> None:
        stop = self.stop
        if stop is None:
            return
        requirement = f"a non-empty string or a list of at most {MAX_STOPS} non-empty strings"
        if isinstance(stop, str):
            stops: list[object] = [stop]
        elif isinstance(stop, list | tuple):
            stops = list(stop)
        else:
            raise _fail("stop", requirement, stop)
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop must have at most {MAX_STOPS} entries, got {len(stops)}")
        for s in stops:
            if not isinstance(s, str) or s == "":
                raise _fail("stop", requirement, s)

    def _verify_stop_token_ids(self, vocab_size: int | None) -> None:
        ids = self.stop_token_ids
        if ids is None:
            return
        if not isinstance(ids, list | tuple | set | frozenset):
            raise _fail("stop_token_ids", "a list of token ids", ids)
        for tid in ids:
            _token_id("stop_token_ids", tid, vocab_size)

    def _verify_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise _fail("logit_bias", "an object mapping token ids to numbers", bias)
        for key, value in bias.items():
            _token_id("logit_bias", key, vocab_size, allow_str=True)
            _check_real(f"logit_bias[{key!r}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)

    def _verify_grammar(self) -> None:
        for name in ("json_schema", "regex", "ebnf"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise _fail(name, "a string", value)
        given = [name for name in ("json_schema", "regex", "ebnf") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[0]}: at most one of json_schema, regex, ebnf may be set, got {', '.join(given)}")

    # ------------------------------------------------------------------ normalisation
    def normalize(self, tokenizer: Any | None) -> None:
        """Uniform shapes: stop -> list[str], stop_token_ids -> list[int], logit_bias keys -> int,
        stop_str_max_len = longest stop string in tokens (UTF-8 bytes, an upper bound, without a tokenizer).

        Runs the vocabulary-independent checks of verify() first, so a bad value is a ValueError naming its field
        whichever of the two is called first; verify(vocab_size) still checks token ids against the vocabulary."""
        self.verify(None)
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else [int(t) for t in self.stop_token_ids]
        if self.logit_bias is not None:
            self.logit_bias = {_token_id("logit_bias", k, None, allow_str=True): float(v)
                               for k, v in self.logit_bias.items()}
        if tokenizer is not None:
            self.stop_str_max_len = max((_encode_len(tokenizer, s) for s in self.stop), default=0)
        else:
            self.stop_str_max_len = max((len(s.encode("utf-8")) for s in self.stop), default=0)
        self._normalize_greedy()
