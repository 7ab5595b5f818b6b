"""The prompts `bench` sends: distinct, and as long in tokens as asked.

Each prompt starts with its own number, so no two share a cached prefix, and
goes on with common words drawn from a stream seeded by (seed, number). The
server's tokenizer decides the length: `fit_steps` proposes a text, is told its
token count, and changes the number of words until the count is the one asked
for: it cuts what overshot and fills the gap with short words, one token each
in the tokenizers of English-trained models, so two or three counts do. The
counting is passed in, so everything here is pure; the /tokenize client is in
`tokenize_client`.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

WORDS = (
    "the a of and to in is that for it on with as was be by at this from or are "
    "model server token cache memory card process engine request stream health "
    "restart alert metric block queue python kernel driver signal hello world "
    "please answer question quickly slowly today tomorrow yes no river stone "
    "light green small house water paper table"
).split()

# The short common words are one token in any tokenizer trained on English (a small
# byte-level BPE too, where "stone" or "table" are several): words added to a prompt
# after the first count are short ones, so that n missing tokens are n words.
SHORT_WORDS = tuple(w for w in WORDS if len(w) <= 3)
FIT_ROUNDS = 8  # counts asked per prompt at most; the closest text is kept if none was exact


class _Words:
    """The words of prompt `index` after its number; the same (seed, index) draws the same words."""

    def __init__(self, index: int, seed: int):
        self.rng = random.Random(f"{seed}:{index}")
        self.words: list[str] = []
        self.costly: set[str] = set()  # words seen to cost more than the gap they had to fill

    def add(self, n: int, pool: Sequence[str] = WORDS) -> None:
        choices = [w for w in pool if w not in self.costly] or pool
        self.words += [self.rng.choice(choices) for _ in range(n)]

    def cut(self, n: int) -> None:
        del self.words[n:]

    def swap(self, position: int) -> None:
        """Another short word at `position`: the one there cost more tokens than the gap it had to fill."""
        self.costly.add(self.words[position])
        choices = [w for w in SHORT_WORDS if w not in self.costly] or [
            w for w in SHORT_WORDS if w != self.words[position]
        ]
        self.words[position] = self.rng.choice(choices)


def _compose(index: int, words: Sequence[str]) -> str:
    return " ".join([str(index), *words])


def word_prompt(index: int, words: int, seed: int) -> str:
    """Prompt `index` as `words` words (its number and words - 1 more): the fallback without a tokenizer."""
    drawn = _Words(index, seed)
    drawn.add(max(words - 1, 0))
    return _compose(index, drawn.words)


@dataclass(frozen=True)
class FittedPrompt:
    text: str
    tokens: int  # the server's count for `text`
    wanted: int

    @property
    def exact(self) -> bool:
        return self.tokens == self.wanted

    @property
    def off(self) -> int:
        return abs(self.tokens - self.wanted)


def fit_steps(
    index: int, wanted: int, seed: int, max_rounds: int = FIT_ROUNDS
) -> Generator[str, int, FittedPrompt]:
    """Yields candidate texts for prompt `index`, is sent each one's token count; returns the closest.

    The first candidate is the word prompt (one token a word). Then the number
    of words k steps from the last count by the tokens per word seen between
    two counts (one at first), inside the bracket of known counts below and
    above `wanted`: words are cut from the end, or short ones added. When the
    bracket is one word wide, that word costs more than the gap: another short
    word takes its place.
    """
    drawn = _Words(index, seed)
    drawn.add(max(wanted - 1, 0))
    known: dict[int, int] = {}  # k -> count, for the first k of the words as they are now
    best: FittedPrompt | None = None
    for _ in range(max_rounds):
        k = len(drawn.words)
        text = _compose(index, drawn.words)
        count = yield text
        candidate = FittedPrompt(text, count, wanted)
        if best is None or candidate.off < best.off:
            best = candidate
        if candidate.exact or (k == 0 and count > wanted):
            break  # done, or the number alone is already too long
        known[k] = count
        lo = max((j for j, c in known.items() if c < wanted), default=None)
        hi = min((j for j, c in known.items() if c > wanted), default=None)
        if lo is not None and hi is not None and hi <= lo:
            known, lo, hi = {k: count}, None, None  # counts that do not grow with k: trust only the last
        if lo is not None and hi is not None and hi == lo + 1:
            drawn.cut(lo + 1)
            drawn.swap(lo)
            known = {j: c for j, c in known.items() if j <= lo}
            continue
        others = [j for j in known if j != k]
        rate = 1.0
        if others:
            j = min(others, key=lambda j: abs(j - k))
            if (known[k] - known[j]) * (k - j) > 0:
                rate = (known[k] - known[j]) / (k - j)
        step = round((wanted - count) / rate) or (1 if count < wanted else -1)
        target = k + step
        if lo is not None:
            target = max(target, lo + 1)
        if hi is not None:
            target = min(target, hi - 1)
        target = max(target, 0)
        if target < k:
            drawn.cut(target)
            known = {j: c for j, c in known.items() if j <= target}
        else:
            drawn.add(target - k, SHORT_WORDS)
    assert best is not None  # max_rounds >= 1
    return best


def fit_prompt(
    index: int, wanted: int, seed: int, count: Callable[[str], int], max_rounds: int = FIT_ROUNDS
) -> FittedPrompt:
    """Prompt `index` of `wanted` tokens by `count`, or the closest found in `max_rounds` counts."""
    if max_rounds < 1:
        raise ValueError("fitting a prompt needs at least one count")
    steps = fit_steps(index, wanted, seed, max_rounds)
    text = next(steps)
    while True:
        try:
            text = steps.send(count(text))
        except StopIteration as done:
            return done.value


class PromptUnit(enum.Enum):
    TOKENS = "tokens"  # fitted by the server's /tokenize
    WORDS = "words"  # the server has no /tokenize: about one token a word


@dataclass(frozen=True)
class PromptStats:
    """How the prompts came out: `wanted` long in `unit`; shortest/longest by the server's count (tokens only)."""

    wanted: int
    unit: PromptUnit
    prompts: int
    exact: int  # prompts of exactly `wanted` tokens
    shortest: int | None = None
    longest: int | None = None

    @classmethod
    def of_fitted(cls, wanted: int, fitted: Sequence[FittedPrompt]) -> PromptStats:
        counts = [f.tokens for f in fitted]
        return cls(
            wanted=wanted,
            unit=PromptUnit.TOKENS,
            prompts=len(fitted),
            exact=sum(f.exact for f in fitted),
            shortest=min(counts, default=None),
            longest=max(counts, default=None),
        )

    @classmethod
    def of_words(cls, wanted: int, prompts: int) -> PromptStats:
        return cls(wanted=wanted, unit=PromptUnit.WORDS, prompts=prompts, exact=0)

    def to_dict(self) -> dict:
        return {
            "wanted": self.wanted,
            "unit": self.unit.value,
            "prompts": self.prompts,
            "exact": self.exact,
            "shortest": self.shortest,
            "longest": self.longest,
        }


@dataclass(frozen=True)
class PromptSet:
    """Every prompt of a run, made before it: the warmup's, then each round's in the order they run."""

    warmup: tuple[str, ...]
    rounds: tuple[tuple[str, ...], ...]
    stats: PromptStats

    @classmethod
    def split(cls, texts: Sequence[str], warmup: int, rounds: Sequence[int], stats: PromptStats) -> PromptSet:
        if len(texts) != warmup + sum(rounds):
            raise ValueError(f"{len(texts)} prompts for {warmup} warmup and {sum(rounds)} measured requests")
        cut, out = warmup, []
        for size in rounds:
            out.append(tuple(texts[cut : cut + size]))
            cut += size
        return cls(warmup=tuple(texts[:warmup]), rounds=tuple(out), stats=stats)
