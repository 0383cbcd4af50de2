"""Plain English prompts of chosen token lengths, for end-to-end tests.

Natural text (not random words) keeps greedy decoding away from near-ties,
so token-for-token comparisons with the transformers oracle are meaningful.
"""

from __future__ import annotations

PARAGRAPHS = [
    "The old lighthouse stood at the end of a narrow spit of rock, and for most of the year the only "
    "visitors were gulls. Its keeper, a quiet man named Tomas, kept a logbook in which he wrote the "
    "weather every morning, the ships he saw every afternoon, and a single sentence about his day "
    "every night before he climbed the stairs to trim the wick.",
    "In the spring the town below would wake up. Fishing boats were painted in bright colours, the "
    "bakery opened its shutters before dawn, and children ran along the harbour wall collecting "
    "shells. Tomas liked to watch them through his brass telescope, although he never told anyone "
    "that he did.",
    "A computer keeps its working data in memory, and a program that serves many users at once must "
    "decide how to share that memory fairly. One common approach is to cut the memory into small "
    "pages of equal size, hand out pages as they are needed, and take them back as soon as a task "
    "finishes, so that no space is wasted on reservations that are never used.",
    "Cooking rice well is mostly a matter of patience. Rinse the grains until the water runs clear, "
    "use a little less water than the packet suggests, bring it to a boil, and then leave the lid on "
    "while it simmers gently. When the pot is taken off the heat, let it rest for ten minutes before "
    "fluffing the rice with a fork.",
    "The history of the bicycle is longer than most people expect. Early machines had no pedals at "
    "all: riders pushed themselves along with their feet. Later designs added cranks to the front "
    "wheel, which grew larger and larger until the chain drive made a safer shape possible, with two "
    "wheels of the same size.",
    "Every autumn the migrating geese passed over the valley in long uneven lines, calling to one "
    "another as they flew. Farmers would stop their work and look up, and some of the older ones said "
    "they could tell how hard the winter would be from how early the birds arrived.",
]


def corpus_token_ids(tokenizer) -> list[int]:
    return tokenizer.encode(" ".join(PARAGRAPHS * 3))


def prompt_of_length(tokenizer, length: int, offset: int = 0) -> list[int]:
    """``length`` tokens of the corpus starting ``offset`` tokens in."""
    ids = corpus_token_ids(tokenizer)
    assert offset + length <= len(ids), "corpus too short for this prompt"
    return ids[offset : offset + length]
