"""SpecDecodeStats: running counters of speculative decoding (drafts, draft tokens, accepted tokens,
accepted tokens per draft position).  Plain Python: the scheduler keeps one."""

from __future__ import annotations

import msgspec


class SpecDecodeStats(msgspec.Struct):
    """A msgspec Struct, so that it travels with EngineStats across a process boundary."""

    max_k: int
    num_drafts: int = 0  # request-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = msgspec.field(default_factory=list)  # [max_k]: drafts accepted at position i

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.max_k

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step yields on average: 1 (the target's own) + accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def copy(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.max_k, self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos))

    def minus(self, before: "SpecDecodeStats") -> "SpecDecodeStats":
        """The counts since `before` (an earlier copy)."""
        return SpecDecodeStats(self.max_k, self.num_drafts - before.num_drafts,
                               self.num_draft_tokens - before.num_draft_tokens,
                               self.num_accepted_tokens - before.num_accepted_tokens,
                               [a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos)])
