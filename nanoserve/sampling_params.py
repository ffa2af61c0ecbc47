"""Per-request sampling settings, checked when they are made so bad values fail before any work."""
from dataclasses import dataclass


@dataclass
class SamplingParams:
    temperature: float = 1.0    # 0 means greedy: exact argmax
    top_p: float = 1.0          # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1             # keep the k most likely tokens; -1 keeps all (vLLM's convention)
    min_p: float = 0.0          # drop tokens less likely than min_p x the top token's probability
    max_tokens: int = 64
    min_tokens: int = 0         # EOS and stop ids are ignored until this many tokens exist
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None     # makes this request's samples reproducible, whatever else is batched
    logprobs: int | None = None  # return the chosen token's logprob and the top-N logprobs

    def __post_init__(self):
        checks = {
            "temperature": self.temperature >= 0,
            "top_p": 0 < self.top_p <= 1,
            "top_k": self.top_k == -1 or self.top_k >= 1,
            "min_p": 0 <= self.min_p <= 1,
            "max_tokens": self.max_tokens >= 1,
            "min_tokens": 0 <= self.min_tokens <= self.max_tokens,
            "logprobs": self.logprobs is None or self.logprobs >= 0,
            "seed": self.seed is None or isinstance(self.seed, int),
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"SamplingParams.{field}={getattr(self, field)!r} is out of range")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop or [] if s]
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Top-k, top-p or min-p trims the distribution before the draw."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0
