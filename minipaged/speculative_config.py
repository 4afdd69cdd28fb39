"""``SpeculativeConfig``: how the engine guesses tokens ahead and verifies them, from vLLM's
``speculative_config`` dict, checked field by field (lesson 12; ``config.py``'s
``EngineConfig.speculative_config`` holds one)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from minipaged.validation import as_int, shown


@dataclass
class SpeculativeConfig:
    """How the engine guesses tokens ahead and verifies them in one pass (lesson 12).

    Built from vLLM's ``speculative_config`` dict by ``SpeculativeConfig.of``, which checks every
    field (a ValueError names it).

    Fields:
        method: "ngram" (prompt lookup: propose what followed the latest earlier occurrence of
            the sequence's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens) or
            "draft" (a smaller model with the same vocabulary proposes, token by token); given
            a ``model``, the method is "draft".
        num_speculative_tokens: k, the most tokens proposed per sequence and step.
        prompt_lookup_max, prompt_lookup_min: the n-gram lengths tried, longest first.
        model: the draft model (a path or Hugging Face id), for "draft".
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None

    @classmethod
    def of(cls, spec) -> SpeculativeConfig | None:
        """``spec``: None, a ``SpeculativeConfig``, or vLLM's dict (``method``,
        ``num_speculative_tokens``, ``prompt_lookup_max``, ``prompt_lookup_min``, ``model``)."""
        if spec is None or isinstance(spec, cls):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {shown(spec)}")
        unknown = sorted(set(spec) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; allowed: "
                             f"{sorted(f.name for f in fields(cls))}")
        model = spec.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"speculative_config.model must be a path or a model id, "
                             f"got {shown(model)}")
        method = spec.get("method") or ("draft" if model is not None else None)
        if method in ("draft_model", "draft"):
            method = "draft"
        if method not in ("ngram", "draft"):
            raise ValueError(f"speculative_config.method must be 'ngram' or 'draft' (or give "
                             f"a 'model'), got {shown(spec.get('method'))}")
        if method == "draft" and model is None:
            raise ValueError("speculative_config.model: the draft method needs a draft model")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config.model: the ngram method takes no model")
        out = {"method": method, "model": model}
        for name, default, low in (("num_speculative_tokens", None, 1),
                                   ("prompt_lookup_max", 4, 1), ("prompt_lookup_min", 1, 1)):
            value = spec.get(name, default)
            converted = as_int(value) if value is not None else None
            if converted is None or converted < low:
                raise ValueError(f"speculative_config.{name} must be an integer >= {low}, "
                                 f"got {shown(value)}")
            out[name] = converted
        if out["prompt_lookup_min"] > out["prompt_lookup_max"]:
            raise ValueError(f"speculative_config.prompt_lookup_min ({out['prompt_lookup_min']}) "
                             f"must be <= prompt_lookup_max ({out['prompt_lookup_max']})")
        return cls(**out)
