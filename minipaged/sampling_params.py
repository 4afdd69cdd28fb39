"""How to pick the next token: the user-facing knobs of one request (lessons 03 and 08)."""
from __future__ import annotations

from dataclasses import dataclass, field

from minipaged.validation import as_int, as_number, shown

_GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy
# The seeds a torch.Generator takes (manual_seed accepts signed and unsigned 64-bit values).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


@dataclass
class SamplingParams:
    """Sampling settings of one request, with vLLM v0.1's names and rules.

    Args:
        n: number of outputs returned.
        best_of: number of sequences generated, of which the ``n`` with the highest cumulative
            logprob are returned (default ``n``). With beam search it is the beam width.
        presence_penalty: subtracted once from the logit of every token already generated.
        frequency_penalty: subtracted from a token's logit once per time it was generated.
        temperature: 0 (or anything below 1e-5) means greedy; higher is more random.
        top_p: keep the smallest set of tokens whose probability sum reaches ``top_p``.
        top_k: keep the ``top_k`` most likely tokens (-1 keeps all).
        use_beam_search: beam search of width ``best_of`` instead of sampling.
        stop: strings that end generation; they are not included in the returned text.
        ignore_eos: keep generating after the end-of-sequence token.
        max_tokens: the most tokens generated per output.
        logprobs: return the log probabilities of this many most likely tokens at each step
            (plus the chosen token's).
        seed: a per-request random seed, so the request samples the same tokens in any batch.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    use_beam_search: bool = False
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    logprobs: int | None = None
    seed: int | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        self.verify()

    @property
    def greedy(self) -> bool:
        # NOTE: as in vLLM, a temperature this small would only overflow the softmax; it means
        # "always the most likely token".
        return self.temperature < _GREEDY_TEMPERATURE and not self.use_beam_search

    def verify(self) -> None:
        """Check every field (ValueError naming the field, its value and the allowed range).

        Run at construction and again by the engine for each request, so that a field changed
        after construction (``p.temperature = float("nan")``) is caught too. numpy scalars are
        turned into Python numbers; booleans are refused where numbers are expected.
        """
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {shown(getattr(self, name))}")

        def integer(name: str):  # the field as a Python int, or None
            value = as_int(getattr(self, name))
            if value is not None:
                setattr(self, name, value)
            return value

        def number(name: str):  # the field as a finite Python int or float, or None
            value = as_number(getattr(self, name))
            if value is not None:
                setattr(self, name, value)
            return value

        if (n := integer("n")) is None or n < 1:
            raise bad("n", "an integer >= 1")
        if (best_of := integer("best_of")) is None or best_of < n:
            raise ValueError(f"best_of must be an integer >= n ({self.n!r}), got "
                             f"{shown(self.best_of)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if (v := number(name)) is None or not -2.0 <= v <= 2.0:
                raise bad(name, "a number in [-2, 2]")
        if (v := number("temperature")) is None or v < 0.0:
            raise bad("temperature", "a finite number >= 0")
        if (v := number("top_p")) is None or not 0.0 < v <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if (v := integer("top_k")) is None or (v < 1 and v != -1):
            raise bad("top_k", "-1 (disabled) or an integer >= 1")
        if (v := integer("max_tokens")) is None or v < 1:
            raise bad("max_tokens", "an integer >= 1")
        if self.logprobs is not None and ((v := integer("logprobs")) is None or v < 0):
            raise bad("logprobs", "None or an integer >= 0")
        if self.seed is not None and ((v := integer("seed")) is None
                                      or not SEED_MIN <= v <= SEED_MAX):
            raise bad("seed", f"None or an integer in [{SEED_MIN}, {SEED_MAX}]")
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop_strings = list(self.stop)
        else:
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        for name in ("use_beam_search", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")
        if any(not isinstance(s, str) or s == "" for s in self.stop_strings):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if self.use_beam_search:
            if self.best_of == 1:
                raise ValueError(f"best_of must be > 1 with beam search, got {self.best_of}")
            if self.temperature >= _GREEDY_TEMPERATURE:
                raise ValueError(
                    f"temperature must be 0 with beam search, got {self.temperature}"
                )
            if self.top_p != 1.0:
                raise ValueError(f"top_p must be 1 with beam search, got {self.top_p}")
            if self.top_k != -1:
                raise ValueError(f"top_k must be -1 with beam search, got {self.top_k}")
