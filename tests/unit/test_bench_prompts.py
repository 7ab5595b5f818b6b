"""Prompts as long in tokens as asked: the fitting against a stand-in tokenizer."""

from __future__ import annotations

import pytest

from r3090d.measure import prompts
from r3090d.measure.prompts import FittedPrompt, PromptSet, PromptStats, PromptUnit

# Long words and, less expected, a few short ones: the short words that fill a gap can overshoot too.
TWO_TOKEN_WORDS = {"model", "server", "process", "kernel", "tomorrow", "question", "python", "and", "was"}
CHAT_TEMPLATE_TOKENS = 11


class StandInTokenizer:
    """Most words one token, a few two, a number one token per digit (as Qwen's tokenizer splits digits)."""

    def __init__(self, template: int = 0):
        self.template = template
        self.calls: list[str] = []

    def __call__(self, text: str) -> int:
        self.calls.append(text)
        total = self.template
        for word in text.split():
            total += len(word) if word.isdigit() else 2 if word in TWO_TOKEN_WORDS else 1
        return total


def test_the_stand_in_tokenizer_does_make_the_word_count_wrong():
    # Without this the fitting below would be tested against a tokenizer it need not fit.
    count = StandInTokenizer()
    assert any(count(prompts.word_prompt(i, 64, seed=1)) != 64 for i in range(20))


@pytest.mark.parametrize("template", [0, CHAT_TEMPLATE_TOKENS])
@pytest.mark.parametrize("wanted", [16, 37, 128, 1000])
def test_fitted_prompts_are_exactly_as_long_as_asked(wanted, template):
    for index in (0, 7, 123, 4567):
        count = StandInTokenizer(template)
        fitted = prompts.fit_prompt(index, wanted, seed=3090, count=count)
        assert fitted.exact and fitted.tokens == wanted == StandInTokenizer(template)(fitted.text)
        assert fitted.text.split()[0] == str(index)  # its own number first: no shared prefix
        assert len(count.calls) <= prompts.FIT_ROUNDS


def test_fitted_prompts_are_distinct_and_repeatable():
    count = StandInTokenizer()
    a = [prompts.fit_prompt(i, 40, seed=5, count=count).text for i in range(200)]
    assert len(set(a)) == 200
    assert a == [prompts.fit_prompt(i, 40, seed=5, count=count).text for i in range(200)]
    assert a != [prompts.fit_prompt(i, 40, seed=6, count=count).text for i in range(200)]


def test_a_two_token_word_at_the_edge_is_replaced_not_looped_over():
    # Where one word more overshoots and one word less falls short, that word is swapped for
    # another, not added and removed again; every prompt comes out exact within the rounds.
    for template in (0, CHAT_TEMPLATE_TOKENS):
        for wanted in (20, 50, 301):
            fits = [
                prompts.fit_prompt(i, wanted, seed=11, count=StandInTokenizer(template)) for i in range(300)
            ]
            assert all(f.exact for f in fits), [f for f in fits if not f.exact][:3]


def test_a_prompt_that_cannot_be_met_keeps_the_closest():
    # The chat template alone is longer than the prompt asked for: the shortest prompt is the closest.
    count = StandInTokenizer(template=CHAT_TEMPLATE_TOKENS)
    fitted = prompts.fit_prompt(42, 5, seed=1, count=count)
    assert not fitted.exact
    assert fitted.text == "42" and fitted.tokens == CHAT_TEMPLATE_TOKENS + 2 and fitted.off == 8

    # A tokenizer that only ever answers even counts cannot give 37; the best is one off, found within the rounds.
    def even(text: str) -> int:
        even.calls += 1
        return 2 * len(text.split())

    even.calls = 0
    fitted = prompts.fit_prompt(3, 37, seed=1, count=even)
    assert not fitted.exact and fitted.off == 1 and even(fitted.text) == fitted.tokens
    assert even.calls <= prompts.FIT_ROUNDS + 1


def test_word_prompts_are_the_fallback():
    a = [prompts.word_prompt(i, 20, seed=3090) for i in range(50)]
    assert len(set(a)) == 50
    assert all(len(p.split()) == 20 for p in a)
    assert a == [prompts.word_prompt(i, 20, seed=3090) for i in range(50)]
    assert a != [prompts.word_prompt(i, 20, seed=1) for i in range(50)]


def test_a_word_count_that_is_already_exact_is_kept_as_it_is():
    # A tokenizer of one token per word: the first guess is the word prompt and is answered at once.
    calls = []
    fitted = prompts.fit_prompt(9, 30, seed=2, count=lambda text: calls.append(text) or len(text.split()))
    assert fitted == FittedPrompt(prompts.word_prompt(9, 30, seed=2), 30, 30)
    assert len(calls) == 1


def test_prompt_stats_and_the_split_into_rounds():
    fits = [FittedPrompt("a", 10, 10), FittedPrompt("b", 12, 10), FittedPrompt("c", 10, 10)]
    stats = PromptStats.of_fitted(10, fits)
    assert (stats.unit, stats.prompts, stats.exact, stats.shortest, stats.longest) == (
        PromptUnit.TOKENS,
        3,
        2,
        10,
        12,
    )
    words = PromptStats.of_words(10, 4)
    assert (words.unit, words.prompts, words.exact, words.shortest) == (PromptUnit.WORDS, 4, 0, None)
    split = PromptSet.split(["w0", "a", "b", "c", "d", "e"], warmup=1, rounds=[2, 3], stats=words)
    assert split.warmup == ("w0",) and split.rounds == (("a", "b"), ("c", "d", "e"))
    with pytest.raises(ValueError):
        PromptSet.split(["a"], warmup=1, rounds=[1], stats=words)


def test_the_table_says_how_long_the_prompts_are():
    from r3090d.cli.bench_cmd import prompt_note

    exact = PromptStats.of_fitted(37, [FittedPrompt("a", 37, 37)] * 4)
    assert prompt_note(exact.to_dict()) == "prompt 37 tokens (exact, via /tokenize)"
    some_off = PromptStats.of_fitted(
        5, [FittedPrompt("a", 5, 5), FittedPrompt("b", 9, 5), FittedPrompt("c", 8, 5)]
    )
    assert prompt_note(some_off.to_dict()) == "prompt 5 tokens via /tokenize, 2 of 3 not exact (5..9)"
    assert (
        prompt_note(PromptStats.of_words(37, 8).to_dict()) == "prompt ~37 words (the server has no /tokenize)"
    )
